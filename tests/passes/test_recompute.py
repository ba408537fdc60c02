"""Recompute: same numbers as without it, and the saved activations really shrink as predicted."""
from __future__ import annotations

import functools
from dataclasses import replace

import pytest
import torch

import autopar
from autopar.examples.gpt import example_inputs
import pool
from parity import BATCH, SEQ, TINY, make_model, parallel_run, reference

EXPLICIT = replace(TINY, attention="explicit")
MODES = ("none", "selective", "full")
CASES = [((1, 1, 2), m) for m in MODES] + [((1, 2, 2), m) for m in MODES]


def _parity(rank, world, cases):
    return [parallel_run(rank, world, mesh, dict(plan="megatron", sequence_parallel=True, recompute=mode,
                                                 compile=False), cfg=EXPLICIT, steps=3)
            for mesh, mode in cases]


GROUPS = {world: [c for c in CASES if c[0][0] * c[0][1] * c[0][2] == world] for world in (2, 4)}
JOBS = {world: pool.job(world, _parity, group) for world, group in GROUPS.items()}


@pytest.fixture(scope="module")
def results():
    out = {}
    for world, group in GROUPS.items():
        for case, res in zip(group, zip(*JOBS[world].result())):
            out[case] = res
    return out


REFERENCE = functools.partial(reference, EXPLICIT, steps=3)


@pytest.mark.parametrize("mesh,mode", CASES)
def test_recompute_parity(results, ref, mesh, mode):
    ref_loss, ref_grads, ref_curve = ref
    for loss, grads, curve, plan in results[(mesh, mode)]:
        assert loss == pytest.approx(ref_loss, rel=1e-5)
        for name, g in ref_grads.items():
            torch.testing.assert_close(grads[name], g, rtol=1e-5, atol=1e-6, msg=name)
        assert curve == pytest.approx(ref_curve, rel=1e-4)
        assert ('"recompute": "%s"' % mode) in plan


def _saved_bytes(rank, world, mode):
    """Bytes autograd keeps during one forward (eager, by storage), and the eager rules' prediction
    for the plan's graph and recompute regions (the plan itself reports the compiled step's)."""
    from autopar.planner.decide import decide
    from autopar.cost_model.activations import activation_bytes

    idx, tgt = example_inputs(EXPLICIT, BATCH, SEQ)
    pm = autopar.parallelize(make_model(EXPLICIT), (1, 1, world), (idx, tgt), plan="megatron",
                             sequence_parallel=False, recompute=mode, compile=False)
    params = {p.untyped_storage().data_ptr() for p in pm.parameters()}
    kept = {}

    def pack(t):
        kept[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):   # packed by the step's forward
        pm.train_step(idx, tgt)
    cap, strategies, _ = decide(make_model(EXPLICIT), (1, 1, world), (idx, tgt), plan=pm.plan)
    by_name = {n.name: n for n in cap.gm.graph.nodes}
    regions = [[by_name[n] for n in r] for r in pm.plan.recompute_regions]
    calls = [n for n in cap.gm.graph.nodes if n.op == "call_function"]
    return sum(v for k, v in kept.items() if k not in params), activation_bytes(calls, strategies, world, regions)


SAVED_BYTES = {mode: pool.job(2, _saved_bytes, mode, timeout=300) for mode in MODES}


@pytest.mark.parametrize("mode", MODES)
def test_saved_activations_match_the_model(mode):
    for measured, predicted in SAVED_BYTES[mode].result():
        assert measured == pytest.approx(predicted, rel=0.05), f"{mode}: measured {measured}, predicted {predicted}"


def _compiled_saved(rank, world, mode):
    """Bytes the compiled forward graph hands to the backward (AOTAutograd's partition)."""
    from functorch.compile import make_boxed_func
    from torch._dynamo.backends.common import aot_autograd

    saved = {}

    def fw(gm, example):
        out = next(n for n in gm.graph.nodes if n.op == "output").args[0]
        vals = [a.meta.get("val") for a in out[1:] if isinstance(a, torch.fx.Node)]
        saved["bytes"] = sum(v.numel() * v.element_size() for v in vals if isinstance(v, torch.Tensor)
                             and v.is_floating_point() and v.dim() > 1 and v.numel() > 1024)
        return make_boxed_func(gm.forward)

    idx, tgt = example_inputs(EXPLICIT, BATCH, SEQ)
    pm = autopar.parallelize(make_model(EXPLICIT), (1, 1, world), (idx, tgt), plan="megatron",
                             sequence_parallel=False, recompute=mode,
                             compile=aot_autograd(fw_compiler=fw, bw_compiler=lambda g, e: make_boxed_func(g.forward)))
    pm.train_step(idx, tgt)
    return saved["bytes"]


COMPILED_SAVED = [pool.job(2, _compiled_saved, m, timeout=300, lane=pool.compiled(2)) for m in MODES]


def test_compiled_backward_recomputes():
    """Under torch.compile the checkpoint regions survive: the forward graph saves less."""
    none, sel, full = (j.result()[0] for j in COMPILED_SAVED)
    assert full < sel < none, (none, sel, full)


def test_recompute_auto_and_bad_input():
    from autopar.examples.gpt import build
    model = build("gpt3-1.3b", device="meta", n_layer=4, attention="explicit", dropout=0.1)
    x = example_inputs(model.config, 8, 2048, device="meta")
    peaks = {m: autopar.plan(model, (1, 1, 8), x, sequence_parallel=True, recompute=m).memory[0].peak
             for m in MODES}
    assert peaks["full"] < peaks["selective"] < peaks["none"]
    budget = (peaks["none"] + peaks["selective"]) / 2
    auto = autopar.plan(model, (1, 1, 8), x, sequence_parallel=True, recompute="auto", memory_budget=budget)
    assert auto.memory[0].peak <= budget and 0 < len(auto.recompute_regions) < 4
    with pytest.raises(autopar.PlanError, match="smallest peak"):
        autopar.plan(model, (1, 1, 8), x, sequence_parallel=True, recompute="auto", memory_budget="100MiB")
    # without memory_budget it fits the device's memory (one H100's 79.18 GiB here: nothing to recompute)
    assert autopar.plan(model, (1, 1, 8), x, recompute="auto").recompute_regions == ()
    with pytest.raises(ValueError, match="recompute='some'"):
        autopar.plan(model, (1, 1, 8), x, recompute="some")
