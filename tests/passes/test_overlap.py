"""Inductor's compute/communication overlap on autopar's per-rank graphs (autopar.overlap).

The tp=2 test compiles the same rank graph (Megatron's plan with sequence parallelism) twice on
two gloo ranks, overlap off and on, and reads the generated code: off, every collective's wait
follows its launch with no compute in between; on, independent compute (weight-gradient matmuls
in the backward) runs between them, and the loss and every gradient are unchanged. The run with
overlap off is also the Inductor parity run against the unsharded model."""
from __future__ import annotations

import pytest
import torch

import pool
from autopar.examples.gpt import example_inputs
from autopar.overlap import MODES, collective_gaps, overlap, overlap_backend, overlap_config


def test_every_knob_exists_in_this_torch():
    import torch._inductor.config as config
    known = set(config.get_config_copy())
    for mode in MODES:
        for bucket in (False, True):
            patches = overlap_config(mode, bucket)
            assert set(patches) <= known, mode
            assert any(v is True for v in patches.values()), mode
    with overlap():
        assert config.reorder_for_compute_comm_overlap is True
    assert config.reorder_for_compute_comm_overlap is False


def test_unknown_mode_names_the_modes():
    with pytest.raises(ValueError, match="scheduler, peak-memory, fx"):
        overlap_config("eager")


WRAPPER = """
    def call(self, args):
        extern_kernels.mm(arg0_1, arg1_1, out=buf0)
        # Topologically Sorted Source Nodes: [all_reduce]
        torch.ops._c10d_functional.all_reduce_.default(buf0, 'sum', '0')
        buf3 = torch.ops._c10d_functional.all_gather_into_tensor.default(reinterpret_tensor(buf1, (1, 64), (64, 1), 0), 2, '0')
        extern_kernels.mm(arg0_1, arg2_1, out=buf5)
        triton_poi_fused_relu_0.run(buf5, 64, stream=stream0)
        torch.ops._c10d_functional.wait_tensor.default(buf0)
        cpp_fused_add_1(buf0, buf5)
        torch.ops._c10d_functional.wait_tensor.default(buf3)
"""


def test_collective_gaps_reads_launch_to_wait():
    gaps = collective_gaps(WRAPPER)
    assert [(g.op, g.buffer) for g in gaps] == [("all_reduce_", "buf0"), ("all_gather_into_tensor", "buf3")]
    assert gaps[0].compute == ("extern_kernels.mm", "triton_poi_fused_relu_0.run")
    assert gaps[1].compute == ("extern_kernels.mm", "triton_poi_fused_relu_0.run", "cpp_fused_add_1")


def _compiled_step(rank, world, compile_):
    import autopar
    from torch._inductor.utils import run_and_get_code

    from parity import BATCH, SEQ, TINY, make_model

    idx, tgt = example_inputs(TINY, BATCH, SEQ)
    pm = autopar.parallelize(make_model(TINY), (1, 1, 2), (idx, tgt), plan="megatron", sequence_parallel=True,
                             compile=compile_)
    loss, codes = run_and_get_code(pm.train_step, idx, tgt)
    return float(loss), pm.full_grads(), codes


def _both(rank, world):
    return _compiled_step(rank, world, True), _compiled_step(rank, world, overlap_backend("scheduler"))


# Inductor's cache directory of the session, shared by both ranks: a kernel both need is built once
# (Inductor locks it while one builds it, and the other loads it), and warm runs take seconds
BOTH = pool.job(2, _both, timeout=900, lane="inductor")


@pytest.fixture(scope="module")
def runs():
    return BOTH.result()


def test_inductor_two_ranks(runs):
    """compile=True lowers each rank's graph through Inductor (C++ on CPU) and keeps parity."""
    from parity import reference
    ref_loss, ref_grads, _ = reference()
    for (loss, grads, _), _ in runs:
        assert loss == pytest.approx(ref_loss, rel=1e-5)
        for name, g in ref_grads.items():
            torch.testing.assert_close(grads[name], g, rtol=1e-4, atol=1e-5)


def _matmuls(gap):
    return [c for c in gap.compute if c.startswith("extern_kernels.") and "mm" in c]


def test_overlap_moves_waits_after_independent_matmuls(runs):
    for rank, ((loss_off, grads_off, codes_off), (loss_on, grads_on, codes_on)) in enumerate(runs):
        assert len(codes_off) == len(codes_on) == 2, "expected one forward and one backward graph"
        off = [g for code in codes_off for g in collective_gaps(code)]
        on = [g for code in codes_on for g in collective_gaps(code)]
        assert len(off) == len(on) >= 4, f"rank {rank}: the tp=2 graphs lost or gained collectives"
        assert not any(g.overlapped for g in off), f"rank {rank}: overlap off already hides {off}"
        backward = collective_gaps(codes_on[1])
        assert any(_matmuls(g) for g in backward), f"rank {rank}: no matmul between launch and wait: {backward}"
        assert sum(len(g.compute) for g in on) > sum(len(g.compute) for g in off)
        assert loss_on == pytest.approx(loss_off, rel=1e-6)
        for name, g in grads_off.items():
            torch.testing.assert_close(grads_on[name], g, rtol=1e-5, atol=1e-7, msg=f"rank {rank} grad {name}")
