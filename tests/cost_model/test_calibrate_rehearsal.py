"""A rehearsal teaches a device profile what its rank's ops took (``calibrate.with_rehearsals``): each
matmul shape the rank ran becomes a sample at its measured rate, the floor under a small op's time
the mean of its other ops, and a plan priced with the profile predicts the rank's compute closer to
what the rehearsal measured. The profile round-trips through its JSON; rehearsals without op times
are refused with a sentence."""
from __future__ import annotations

import dataclasses
import functools
import math

import pytest
import torch

import autopar
from autopar.cost_model.calibrate import with_rehearsals, write_profile
from autopar.cost_model.compute import curve_rate
from autopar.cost_model.devices import get_device
from autopar.examples.gpt import GPT, example_inputs
from autopar.rehearsal import OpTime
from parity import SEQ, TINY

BATCH = 8
MESH = (1, 1, 2)


def _meta_model():
    with torch.device("meta"):
        return GPT(TINY)


def _inputs():
    return example_inputs(TINY, BATCH, SEQ, device="meta")


@functools.cache
def _rehearsed():
    return autopar.rehearse(_meta_model(), MESH, _inputs(), rank=1, plan="megatron", device="cpu",
                            compile="aot_eager", steps=3, warmup=1)


def test_the_rank_s_ops_are_timed():
    (r,) = _rehearsed().rehearsals
    matmuls = [op for op in r.ops if op.op == "matmul"]
    (other,) = [op for op in r.ops if op.op == "other"]
    # tp=2 halves the attention's and MLP's widths: c_fc's forward (tokens, 4h / 2, h) is among them
    assert ("fp32", BATCH * SEQ, 4 * TINY.n_embd // 2, TINY.n_embd) in {(op.dtype, *op.dims) for op in matmuls}
    assert all(op.calls > 0 and op.seconds > 0 for op in r.ops)
    assert other.calls > 50 and other.seconds > 0


def test_a_profile_taught_by_the_rehearsal_predicts_its_compute_closer(tmp_path):
    plan = _rehearsed()
    (r,) = plan.rehearsals
    base = get_device("cpu")
    spec, record = with_rehearsals(base, plan.rehearsals)
    rates = {(s.dtype, s.m, s.n, s.k): s.flops_per_s for s in spec.matmul_table}
    for op in r.ops:
        if op.op == "matmul":
            assert rates[(op.dtype, *op.dims)] == pytest.approx(2 * math.prod(op.dims) / op.seconds)
    assert spec.launch_overhead == next(op.seconds for op in r.ops if op.op == "other")
    assert record["rehearsals"][0]["rank"] == 1
    path = tmp_path / "taught.json"
    write_profile(spec, record, path)
    assert get_device(str(path)) == spec
    again = autopar.plan(_meta_model(), MESH, _inputs(), plan="megatron", device=str(path))
    before, after, measured = r.predicted_compute_s, again.step_terms.compute, r.compute_s
    print(f"compute: rehearsed {measured * 1e3:.2f} ms, predicted {before * 1e3:.2f} ms with the cpu preset, "
          f"{after * 1e3:.2f} ms taught by the rehearsal")
    assert abs(math.log(after / measured)) < abs(math.log(before / measured))


def test_rehearsals_without_op_times_are_refused():
    (r,) = _rehearsed().rehearsals
    with pytest.raises(ValueError, match="recorded no op times.*rehearse again"):
        with_rehearsals(get_device("cpu"), [dataclasses.replace(r, ops=())])


def test_a_gpu_rank_s_attention_and_matmuls_become_samples():
    """A GPU rank's rows (``cuda_op_times``: matmuls and fused attention, no "other") replace the
    profile's samples of the same dtype and FLOPs; the launch overhead stays the profile's."""
    (r,) = _rehearsed().rehearsals
    base = get_device("h100")
    shape = (1, 32, 8192, 128)
    fwd_bwd = 0.004
    kernels = {"matmul": 0.03, "attention": 0.13, "triton pointwise": 0.02, "triton reduction": 0.01, "other": 0.005}
    ops = (OpTime("matmul", "bf16", (8192, 4096, 4096), 64, 0.0004), OpTime("attention", "bf16", shape, 32, fwd_bwd),
           *(OpTime("kernels", family, (), 1, t) for family, t in kernels.items()))
    gpu = dataclasses.replace(r, ops=ops, memory_bound_bytes=7e10, compute_s=0.25)
    spec, record = with_rehearsals(base, [gpu])
    taught = [a for a in spec.attention_table if (a.batch, a.heads, a.seq, a.head_dim) == shape and a.dtype == "bf16"]
    assert len(taught) == 1 and taught[0].causal == 1
    assert taught[0].flops_per_s == pytest.approx(taught[0].flops / fwd_bwd)
    assert (2 * 8192 * 4096 * 4096 / 0.0004) in [s.flops_per_s for s in spec.matmul_table]
    assert spec.launch_overhead == base.launch_overhead
    assert record["rehearsals"][0]["attention_shapes"] == 1
    # memory-bound ops are priced at what the rank's Triton and other kernels reached: 70 GB in 35 ms
    assert spec.fused_bandwidth == pytest.approx(7e10 / 0.035) and base.fused_bandwidth != spec.fused_bandwidth
    assert record["fused_bandwidth"] == {"before": base.fused_bandwidth, "rehearsed": spec.fused_bandwidth}
    line = next(x for x in gpu.lines() if "GPU kernels" in x)
    assert "attention 130.000 ms" in line and "memory-bound 35.000 ms (2000 GB/s" in line and "idle) " not in line
    assert "the timed compute less all kernels 55.000 ms" in line
    # attention of that size is priced at the rehearsed rate now
    flops = taught[0].flops
    assert flops / curve_rate(flops, spec.attention_curve("bf16", True)) == pytest.approx(fwd_bwd, rel=1e-6)
