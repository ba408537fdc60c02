"""Torch optimizers the user builds over a ParallelModel's or the model's own parameters: each
either trains the parallel model exactly as the unsharded one, or raises at its step() naming
pm.optimizer(...); none runs silently without effect.

All cases of one world size share one spawn, the session's pool (process start-up dominates)."""
from __future__ import annotations

import gc

import pytest
import torch
import torch.optim.optimizer as optimizer_module

import autopar
from autopar.examples.gpt import example_inputs
import pool
from parity import BATCH, SEQ, TINY, make_model, train_curve

STEPS = 3
LR = {torch.optim.SGD: 0.2, torch.optim.AdamW: 1e-2}
# an optimizer over this ParallelModel's parameters, or over the model's own (shared) ones
OPTIMIZERS = {
    "SGD(pm.parameters())": lambda pm, model: torch.optim.SGD(pm.parameters(), lr=LR[torch.optim.SGD]),
    "AdamW(model.parameters())": lambda pm, model: torch.optim.AdamW(model.parameters(), lr=LR[torch.optim.AdamW]),
    "pm.optimizer(AdamW)": lambda pm, model: pm.optimizer(torch.optim.AdamW, lr=LR[torch.optim.AdamW]),
}
REFERENCE = {"SGD(pm.parameters())": torch.optim.SGD, "AdamW(model.parameters())": torch.optim.AdamW,
             "pm.optimizer(AdamW)": torch.optim.AdamW}
MEGATRON_SP = dict(plan="megatron", sequence_parallel=True)
# (mesh, knobs, optimizers, whether they must raise: None for "all but pm.optimizer's")
CASES = {
    2: [((2, 1, 1), dict(zero=0), ["SGD(pm.parameters())", "AdamW(model.parameters())"], False),
        ((2, 1, 1), dict(zero=1), ["SGD(pm.parameters())", "AdamW(model.parameters())"], True),
        ((2, 1, 1), dict(zero=1), ["pm.optimizer(AdamW)"], False),
        ((1, 1, 2), dict(MEGATRON_SP, zero=0), ["SGD(pm.parameters())", "AdamW(model.parameters())"], False),
        ((1, 2, 1), dict(schedule="1F1B"), ["AdamW(model.parameters())"], False)],
    4: [((2, 1, 2), dict(MEGATRON_SP, zero=0), ["AdamW(model.parameters())"], False),
        ((2, 1, 2), dict(MEGATRON_SP, zero=1), ["SGD(pm.parameters())", "pm.optimizer(AdamW)"], None)],
}
FLAT = [(mesh, which, raises if raises is not None else which != "pm.optimizer(AdamW)")
        for cases in CASES.values() for mesh, knobs, opts, raises in cases for which in opts]
IDS = [f"{mesh}-zero{knobs.get('zero', 0)}-{which}"
       for cases in CASES.values() for mesh, knobs, opts, _ in cases for which in opts]


def _train(pm, opt, idx, tgt) -> list[float]:
    curve = []
    for _ in range(STEPS):
        opt.zero_grad()
        curve.append(pm.train_step(idx, tgt).item())
        opt.step()
    return curve


def _attempt(fn):
    """("ok", fn()) or ("raised", the RuntimeError's message)."""
    try:
        return "ok", fn()
    except RuntimeError as e:
        return "raised", str(e)


def _layout(pm, model) -> dict:
    """How the model's parameters relate to the ParallelModel's after parallelize."""
    mine = {id(p) for p in pm.parameters()}
    theirs = list(model.parameters())
    full = {q.fqn: tuple(q.shape) for q in pm.plan.parameters}
    return dict(
        same=mine <= {id(p) for p in theirs} and all(id(p) in mine or p.numel() == 0 for p in theirs),
        empty=sum(p.numel() == 0 for p in theirs),
        sharded=any(tuple(p.shape) != full[n] for n, p in pm.named_parameters()),
        tied=model.lm_head.weight is model.transformer.wte.weight)


def _rank_all(rank, world, cases):
    idx, tgt = example_inputs(TINY, BATCH, SEQ)
    out = []
    for mesh, knobs, opts, _ in cases:
        for which in opts:
            model = make_model()
            pm = autopar.parallelize(model, mesh, (idx, tgt), compile=False, **knobs)
            layout = _layout(pm, model)
            call = _attempt(lambda: model(idx, tgt).item())
            opt = OPTIMIZERS[which](pm, model)
            out.append(dict(result=_attempt(lambda: _train(pm, opt, idx, tgt)), layout=layout, call=call))
    return out


def _extras(rank, world):
    """At 16 bits: torch optimizers over the 16-bit parameters beside pm.optimizer's (AdamW and
    MasterAdamW over the fp32 masters); an optimizer built before parallelize."""
    idx, tgt = example_inputs(TINY, BATCH, SEQ)
    out = {}
    hooks = optimizer_module._global_optimizer_pre_hooks
    gc.collect()   # models of earlier work in this process (the test pool's) are gone before counting
    out["hooks before"] = len(hooks)
    model = make_model()
    pm = autopar.parallelize(model, (2, 1, 1), (idx, tgt), precision="bf16", compile=False)
    master = pm.optimizer(autopar.MasterAdamW, lr=1e-2)
    for which in ("SGD(pm.parameters())", "AdamW(model.parameters())"):
        other = OPTIMIZERS[which](pm, model)
        out[which] = _attempt(lambda: _train(pm, other, idx, tgt))
        master.zero_grad()
    out["plain AdamW from pm.optimizer"] = _attempt(
        lambda: _train(pm, pm.optimizer(torch.optim.AdamW, lr=1e-2), idx, tgt))
    master.zero_grad()
    out["MasterAdamW"] = _attempt(lambda: _train(pm, master, idx, tgt))

    model = make_model()
    early = torch.optim.AdamW(model.parameters(), lr=1e-2)
    second = autopar.parallelize(model, (2, 1, 1), (idx, tgt), compile=False)
    out["built before parallelize"] = _attempt(lambda: _train(second, early, idx, tgt))

    out["hooks while alive"] = len(hooks)
    del pm, second
    gc.collect()
    out["hooks when gone"] = len(hooks)
    return out


def _reference_curve(cls) -> list[float]:
    return train_curve(make_model(), *example_inputs(TINY, BATCH, SEQ), STEPS, LR[cls], optimizer=cls)


@pytest.fixture(scope="module")
def refs():
    curves = {cls: _reference_curve(cls) for cls in LR}
    for curve in curves.values():   # a weight that never moved would show: the curves must move
        assert curve[-1] < curve[0] * (1 - 1e-2)
    return curves


JOBS = {world: pool.job(world, _rank_all, cases, timeout=900) for world, cases in CASES.items()}


@pytest.fixture(scope="module")
def results():
    """Per case (in FLAT's order), every rank's result."""
    out = []
    for world in CASES:
        out += [list(per_case) for per_case in zip(*JOBS[world].result())]
    return out


@pytest.mark.parametrize("k", range(len(IDS)), ids=IDS)
def test_trains_like_the_unsharded_model_or_raises(results, refs, k):
    """zero=0: any optimizer over the shards is exact; zero=1: only the one pm.optimizer builds
    (over ZeRO's sharded gradients), any other raises at step()."""
    _, which, raises = FLAT[k]
    for rank, r in enumerate(results[k]):
        status, value = r["result"]
        if raises:
            assert status == "raised", f"rank {rank}: {which} ran under zero=1 (losses {value})"
            assert f"pm.optimizer({which.split('(')[0]}" in value
        else:
            assert status == "ok", f"rank {rank}: {value}"
            assert value == pytest.approx(refs[REFERENCE[which]], rel=1e-4), f"rank {rank} {which}"


@pytest.mark.parametrize("k", range(len(IDS)), ids=IDS)
def test_the_model_holds_the_shards(results, k):
    """model.parameters() are pm.parameters() (plus, under pp, empty tensors for other stages'
    weights); tied weights stay tied; a model whose weights are not whole refuses to run."""
    mesh = FLAT[k][0]
    for r in results[k]:
        layout, (status, message) = r["layout"], r["call"]
        assert layout["same"] and layout["tied"]
        assert (layout["empty"] > 0) == (mesh[1] > 1)
        assert layout["sharded"] == (mesh[2] > 1)
        whole = mesh[1] == 1 and mesh[2] == 1
        assert status == ("ok" if whole else "raised")
        if not whole:
            assert "pm.train_step" in message and "full_state_dict" in message


EXTRAS = pool.job(2, _extras)


@pytest.fixture(scope="module")
def extras():
    return EXTRAS.result()


def test_16_bit_parameters_refuse_other_optimizers(extras):
    """The gradients of 16-bit parameters go to fp32 buffers for the masters pm.optimizer's
    optimizers step: any other optimizer over the parameters raises; pm.optimizer's train."""
    for out in extras:
        for which in ("SGD(pm.parameters())", "AdamW(model.parameters())"):
            status, message = out[which]
            assert status == "raised" and "fp32 buffers" in message and "pm.optimizer(" in message, (which, message)
        for which in ("plain AdamW from pm.optimizer", "MasterAdamW"):
            status, curve = out[which]
            assert status == "ok" and curve[-1] < curve[0], which


def test_an_optimizer_over_the_replaced_parameters_raises(extras):
    for out in extras:
        status, message = out["built before parallelize"]
        assert status == "raised" and "pm.parameters()" in message


def test_the_step_guard_goes_with_its_model(extras):
    """One global optimizer hook per live ParallelModel, none left once they are collected."""
    for out in extras:
        before = out["hooks before"]
        assert (out["hooks while alive"], out["hooks when gone"]) == (before + 2, before)
