"""Mixed precision: bf16/fp16 runs against the fp32 unsharded model, 16-bit parameters beside fp32
master weights and optimizer state, fp32 reductions in the compiled per-rank graph, fp16 loss
scaling, and the plan's precision field."""
from __future__ import annotations

import functools
import json
import math
from collections import defaultdict

import pytest
import torch

import autopar
from autopar.examples.gpt import example_inputs
from autopar.graph.precision import compute_dtype
from autopar.plans import Plan, PlanFormatError
from autopar.runtime.precision import LossScaler
import pool
from parity import BATCH, SEQ, TINY, make_model, reference

STEPS = 10
RUNS = {
    2: {"tp": ((1, 1, 2), dict(plan="megatron", sequence_parallel=False, precision="bf16")),
        "tp-fp16": ((1, 1, 2), dict(plan="megatron", sequence_parallel=True, precision="fp16")),
        "pp-zero-bubble": ((1, 2, 1), dict(schedule="InterleavedZeroBubble", virtual_stages=2, precision="bf16"))},
    4: {"dp-tp-zero1": ((2, 1, 2), dict(plan="megatron", sequence_parallel=True, zero=1, precision="bf16")),
        "pp-tp": ((1, 2, 2), dict(plan="megatron", sequence_parallel=False, precision="bf16"))},
}
_c10d = torch.ops._c10d_functional
SUMS = {_c10d.all_reduce.default: "all_reduce", _c10d.reduce_scatter_tensor.default: "reduce_scatter"}
MATMULS = {torch.ops.aten.mm.default, torch.ops.aten.addmm.default, torch.ops.aten.bmm.default}


def _train(mesh, knobs):
    """Ten AdamW steps: the loss curve, and the dtypes of the parameters and the optimizer state."""
    idx, tgt = example_inputs(TINY, BATCH, SEQ)
    pm = autopar.parallelize(make_model(), mesh, (idx, tgt), compile=False, **knobs)
    opt = pm.optimizer(torch.optim.AdamW, lr=1e-3)
    curve = []
    for _ in range(STEPS):
        opt.zero_grad()
        curve.append(pm.train_step(idx, tgt).item())
        assert not pm.step_skipped
        opt.step()
    state = [v.dtype for s in opt.state_dict()["state"].values() for v in s.values()
             if isinstance(v, torch.Tensor) and v.dim() > 0]
    return curve, sorted({str(p.dtype) for p in pm.parameters()}), sorted(map(str, set(state))), pm.plan.precision


def _compiled_graphs(sequence_parallel: bool):
    """(graph, collective, input dtype) of every sum in the compiled forward and backward, and
    the dtypes of their matmuls, for one bf16 step on tp=2."""
    from functorch.compile import make_boxed_func
    from torch._dynamo.backends.common import aot_autograd

    graphs = []

    def keep(kind):
        def compiler(gm, example_inputs):
            graphs.append((kind, gm))
            return make_boxed_func(gm.forward)
        return compiler

    backend = aot_autograd(fw_compiler=keep("fwd"), bw_compiler=keep("bwd"))
    idx, tgt = example_inputs(TINY, BATCH, SEQ)
    pm = autopar.parallelize(make_model(), (1, 1, 2), (idx, tgt), plan="megatron",
                             sequence_parallel=sequence_parallel, precision="bf16", compile=backend)
    pm.train_step(idx, tgt)
    sums, matmuls = [], set()
    for kind, gm in graphs:
        for n in gm.graph.nodes:
            if n.target in SUMS:
                sums.append((kind, SUMS[n.target], str(n.args[0].meta["val"].dtype)))
            elif n.target in MATMULS:
                matmuls.add((kind, str(n.meta["val"].dtype)))
    return sums, sorted(matmuls)


def _overflow(rank):
    """fp16 on tp=2 with an inf put into one weight's gradient on tp rank 1 only."""
    idx, tgt = example_inputs(TINY, BATCH, SEQ)
    pm = autopar.parallelize(make_model(), (1, 1, 2), (idx, tgt), plan="megatron", sequence_parallel=False,
                             precision="fp16", compile=False)
    opt = pm.optimizer(torch.optim.AdamW, lr=1e-3)
    params = dict(pm.named_parameters())
    finite = []   # what this rank's own gradients looked like before the overflow check
    hooks = []
    if rank == 1:   # a tp-sharded weight: its gradient is never summed over tp, so rank 0 stays clean
        hooks.append(params["transformer.h.0.mlp.c_fc.weight"].register_hook(lambda g: torch.full_like(g, math.inf)))
    # after the inf (a tensor's hooks run in order), before the gradient reaches its fp32 buffer
    hooks += [p.register_hook(lambda g: finite.append(bool(g.isfinite().all()))) for p in params.values()]
    before = {n: p.detach().clone() for n, p in params.items()}
    scales = [pm.loss_scale]
    pm.train_step(idx, tgt)
    opt.step()
    opt.zero_grad()
    first = dict(skipped=pm.step_skipped, locally_finite=all(finite), unchanged=all(
        torch.equal(before[n], p) for n, p in params.items()), optimizer_state=len(opt.state_dict()["state"]))
    scales.append(pm.loss_scale)
    for h in hooks:
        h.remove()
    pm.train_step(idx, tgt)
    opt.step()
    second = dict(skipped=pm.step_skipped, unchanged=all(torch.equal(before[n], p) for n, p in params.items()),
                  optimizer_state=len(opt.state_dict()["state"]))
    scales.append(pm.loss_scale)
    return first, second, scales


_VIEWS = {"TBackward0", "ViewBackward0", "TransposeBackward0", "PermuteBackward0", "UnsafeViewBackward0",
          "AliasBackward0", "ExpandBackward0"}


def _saved_weights():
    """Over a step of two microbatches: for each parameter whose bf16 copy backward keeps, how many
    distinct copies (storages) were kept; and the parameters backward keeps as they are."""
    idx, tgt = example_inputs(TINY, BATCH, SEQ)
    pm = autopar.parallelize(make_model(), (1, 1, 2), (idx, tgt), plan="megatron", sequence_parallel=False,
                             precision="bf16", microbatches=2, compile=False)
    names = {id(p): n for n, p in pm.named_parameters()}
    kept, direct = defaultdict(set), set()
    storages = {p.untyped_storage().data_ptr(): n for n, p in pm.named_parameters()}

    def pack(x):
        if x.untyped_storage().data_ptr() in storages:   # the parameter, or a view of it
            direct.add(storages[x.untyped_storage().data_ptr()])
        fn = x.grad_fn
        while fn is not None and type(fn).__name__ in _VIEWS:
            fn = fn.next_functions[0][0]
        if x.dtype == torch.bfloat16 and fn is not None and type(fn).__name__ == "ToCopyBackward0":
            source = getattr(fn.next_functions[0][0], "variable", None)   # the AccumulateGrad's leaf
            if id(source) in names:
                kept[names[id(source)]].add(x.untyped_storage().data_ptr())
        return x

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda x: x):
        pm.train_step(idx, tgt)
    return {n: len(ptrs) for n, ptrs in kept.items()}, direct


def _rank_all(rank, world):
    out = {name: _train(mesh, knobs) for name, (mesh, knobs) in RUNS[world].items()}
    if world == 2:
        out["graphs-sp"] = _compiled_graphs(True)
        out["graphs"] = _compiled_graphs(False)
        out["overflow"] = _overflow(rank)
        out["copies"] = _saved_weights()
    return out


REFERENCE = functools.partial(reference, steps=STEPS)


JOBS = {w: pool.job(w, _rank_all, timeout=900, lane=pool.compiled(w)) for w in RUNS}


@pytest.fixture(scope="module")
def results():
    return {w: j.result() for w, j in JOBS.items()}


@pytest.mark.parametrize("world,name", [(w, n) for w, runs in RUNS.items() for n in runs])
def test_tracks_fp32_loss_with_fp32_master_weights(results, ref, world, name):
    precision = RUNS[world][name][1]["precision"]
    for rank, per_rank in enumerate(results[world]):
        curve, param_dtypes, state_dtypes, planned = per_rank[name]
        assert planned == precision
        assert curve == pytest.approx(ref[2], rel=1e-2), f"rank {rank} loss curve"
        assert param_dtypes == [str(compute_dtype(precision))], f"rank {rank}: parameters are not 16-bit"
        assert state_dtypes == ["torch.float32"], f"rank {rank}: optimizer state is not fp32"
    assert curve[-1] < curve[0] - 0.3


@pytest.mark.parametrize("graphs,expected", [("graphs", {"all_reduce"}), ("graphs-sp", {"reduce_scatter"})])
def test_tp_sums_run_in_fp32_in_the_compiled_graph(results, graphs, expected):
    for rank, per_rank in enumerate(results[2]):
        sums, matmuls = per_rank[graphs]
        for phase in ("fwd", "bwd"):
            kinds = {kind for where, kind, _ in sums if where == phase}
            assert expected <= kinds, f"rank {rank}: no {expected} in the {phase} graph ({sums})"
            assert (phase, "torch.bfloat16") in matmuls, f"rank {rank}: the {phase} matmuls are not bf16: {matmuls}"
        assert {dtype for _, _, dtype in sums} == {"torch.float32"}, f"rank {rank}: a sum ran in 16 bits: {sums}"


def test_microbatches_keep_the_16_bit_weights_themselves(results):
    """The parameters are 16-bit: backward keeps them as they are, no copy of a weight per step or
    per microbatch."""
    for rank, per_rank in enumerate(results[2]):
        copies, direct = per_rank["copies"]
        matmul_weights = {f"transformer.h.{i}.{m}.weight" for i in range(TINY.n_layer)
                          for m in ("attn.c_attn", "attn.c_proj", "mlp.c_fc", "mlp.c_proj")}
        assert matmul_weights <= direct, f"rank {rank}: {direct}"
        assert copies == {}, f"rank {rank}: backward kept copies of weights: {copies}"


def test_fp16_overflow_skips_the_step_on_every_rank(results):
    (first0, _, _), (first1, _, _) = [r["overflow"] for r in results[2]]
    assert first0["locally_finite"] and not first1["locally_finite"], "only rank 1 should have seen the inf"
    for rank, per_rank in enumerate(results[2]):
        first, second, scales = per_rank["overflow"]
        assert first["skipped"] and first["unchanged"] and first["optimizer_state"] == 0, f"rank {rank}: {first}"
        assert not second["skipped"] and not second["unchanged"] and second["optimizer_state"] > 0, f"rank {rank}"
        assert scales == [2.0**16, 2.0**15, 2.0**15], f"rank {rank}"


def test_loss_scaler_grows_after_clean_steps_and_halves_on_overflow():
    s = LossScaler()
    for _ in range(999):
        s.update(False)
    assert s.scale == 2.0**16
    s.update(True)
    assert (s.scale, s.clean_steps) == (2.0**15, 0)
    for _ in range(1000):
        s.update(False)
    assert s.scale == 2.0**16
    saved = s.state_dict()
    s.update(True)
    s.load_state_dict(saved)
    assert (s.scale, s.clean_steps) == (2.0**16, 0)


@pytest.fixture(scope="module")
def plans():
    model = make_model()
    inputs = example_inputs(TINY, BATCH, SEQ)
    return {p: autopar.plan(model, (1, 1, 2), inputs, plan="megatron", sequence_parallel=True, device="h100",
                            precision=p) for p in ("fp32", "bf16")}


def test_plan_records_precision_and_round_trips(plans):
    bf16 = plans["bf16"]
    assert bf16.precision == "bf16" and plans["fp32"].precision == "fp32"
    assert Plan.from_json(bf16.to_json()) == bf16
    assert "precision bf16 compute, fp32 master weights and reductions" in bf16.summary()
    assert "precision: fp32 -> bf16" in plans["fp32"].diff(bf16)
    old = json.loads(plans["fp32"].to_json())
    del old["precision"]   # a plan written before the field existed
    assert Plan.from_json(json.dumps(old)) == plans["fp32"]
    with pytest.raises(PlanFormatError, match="plan.precision 'fp8'"):
        Plan.from_json(json.dumps(dict(old, precision="fp8")))
    with pytest.raises(ValueError, match="precision='fp8': expected 'fp32', 'bf16'"):
        autopar.plan(make_model(), (1, 1, 2), example_inputs(TINY, BATCH, SEQ), precision="fp8")


def test_cost_model_prices_the_compute_dtype(plans):
    fp32, bf16 = plans["fp32"], plans["bf16"]
    assert (fp32.peak_flops, bf16.peak_flops) == (67e12, 989e12)
    assert bf16.predicted_compute_s < fp32.predicted_compute_s
    a, b = fp32.memory[0], bf16.memory[0]
    # 2 + 4 + 12 bytes per parameter against 4 + 8 (and fp32 gradients only across microbatches)
    assert (b.params, b.grads, b.optimizer) == (0.5 * a.params, a.params, 1.5 * a.optimizer) and a.grads == 0
    assert 0.45 < b.activations / a.activations < 0.65   # 16-bit activations; fp32 norm statistics

    def total(plan, kind):
        return sum(c.bytes for c in plan.collectives if c.kind == kind and c.axis == "tp")

    assert total(bf16, "all_gather") < 0.75 * total(fp32, "all_gather")   # gathers move 16-bit tensors
    assert total(bf16, "reduce_scatter") == total(fp32, "reduce_scatter") > 0   # sums move fp32


def _weight_casts(rank, world):
    """Casts of parameters inside the rank's graph, the eager working copies' dtype and the parameters'
    dtypes, for one and two microbatches."""
    from autopar.runtime.precision import cast

    idx, tgt = example_inputs(TINY, BATCH, SEQ)
    out = []
    for m in (1, 2):
        pm = autopar.parallelize(make_model(), (1, 1, 1), (idx, tgt), precision="bf16", microbatches=m, compile=False)
        casts = [n for n in pm.graph_module.graph.nodes if n.op == "call_function" and n.target is cast
                 and n.args[0].op == "placeholder" and n.args[0].meta.get("kind") == "param"]
        out.append((len(casts), len({n.args[0] for n in casts}), pm._casts.dtype,
                    {p.dtype for p in pm.parameters()}))
    return out, sum(1 for _ in make_model().parameters())


WEIGHT_CASTS = pool.job(1, _weight_casts)


def test_the_weights_need_no_working_copy():
    """The parameters are bf16 themselves: no working copies with any microbatch count (with one
    on one stage the graph's casts of the weights, kept for fp32 weights, do nothing)."""
    (one, two), n_params = WEIGHT_CASTS.result()[0]
    assert one == (n_params, n_params, None, {torch.bfloat16})
    assert two == (0, 0, None, {torch.bfloat16})
