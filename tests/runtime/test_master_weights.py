"""MasterAdamW: fp32 master weights in the optimizer, persistent bf16 copies in the graph.

Its steps must be bit-identical to the default bf16 path with torch.optim.AdamW (a bf16 gradient
cast to fp32 is exact, and the copy is the master rounded once), on one rank and on dp x tp."""
from __future__ import annotations

import os

import pytest
import torch

import autopar
from autopar.checkpoint import load_checkpoint, save_checkpoint
from autopar.examples.gpt import example_inputs

import pool
from parity import BATCH, SEQ, TINY, make_model

STEPS = 4


def _train(mesh, knobs, master: bool, clip=None, steps=STEPS):
    """Losses (and clip norms), the gradients after the first step, the weights at the end."""
    idx, tgt = example_inputs(TINY, BATCH, SEQ)
    pm = autopar.parallelize(make_model(), mesh, (idx, tgt), precision="bf16", **knobs)
    opt = pm.optimizer(autopar.MasterAdamW if master else torch.optim.AdamW, lr=1e-2, weight_decay=0.1)
    curve, grads, no_grad = [], None, True
    for step in range(steps):
        opt.zero_grad()
        curve.append(pm.train_step(idx, tgt).item())
        no_grad &= all(p.grad is None for p in pm.parameters())
        if step == 0:
            grads = pm.full_grads()
        if clip:   # a second, looser clip measures the clipped gradients and must leave them clipped
            curve += [float(pm.clip_grad_norm_(clip)), float(pm.clip_grad_norm_(2 * clip))]
        opt.step()
    return dict(curve=curve, grads=grads, weights=pm.full_state_dict(), no_grad=no_grad)


def _same(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def _parity(rank, world, mesh, knobs, clips):
    out = []
    for clip in clips:
        plain, master = _train(mesh, knobs, False, clip), _train(mesh, knobs, True, clip)
        out.append(dict(curve=(plain["curve"], master["curve"]), grads=_same(plain["grads"], master["grads"]),
                        weights=_same(plain["weights"], master["weights"]),
                        changed=any(not torch.equal(master["weights"][n], p.detach())
                                    for n, p in make_model().named_parameters()),
                        no_grad=(plain["no_grad"], master["no_grad"])))
    return out


PARITY = {
    # compiled, the clip scale applied inside the update
    "one-rank": pool.job(1, _parity, (1, 1, 1), dict(compile="aot_eager"), (0.5,)),
    # dp sums the bf16 gradients in fp32; tp (sequence parallel) sums the norm weights' inside the graph
    "dp2-tp2-sp": pool.job(4, _parity, (2, 1, 2), dict(plan="megatron", sequence_parallel=True, compile=False), (0.5,)),
}


@pytest.mark.parametrize("case", list(PARITY))
def test_bit_identical_to_torch_adamw(case):
    for per_rank in PARITY[case].result():
        for r in per_rank:
            assert r["curve"][0] == r["curve"][1]
            assert r["grads"] and r["weights"] and r["changed"]
            # the default path leaves gradients on the parameters; MasterAdamW on the working copies
            assert r["no_grad"] == (False, True)


def _edits_and_checkpoints(rank, world, path):
    idx, tgt = example_inputs(TINY, BATCH, SEQ)

    def build():
        pm = autopar.parallelize(make_model(), (1, 1, 1), (idx, tgt), precision="bf16", compile="aot_eager")
        return pm, pm.optimizer(autopar.MasterAdamW, lr=1e-2)

    def step(pm, opt):
        opt.zero_grad()
        loss = pm.train_step(idx, tgt).item()
        opt.step()
        return loss

    pm, opt = build()
    step(pm, opt)
    try:   # without zero_grad the bf16 gradients would add up: refused
        pm.train_step(idx, tgt)
        unzeroed = None
    except RuntimeError as e:
        unzeroed = str(e)
    # an edit of a master weight outside the optimizer reaches the graph's bf16 copy
    before = pm(idx, tgt).item()
    with torch.no_grad():
        dict(pm.named_parameters())["transformer.wte.weight"].mul_(0.5)
    edited = pm(idx, tgt).item()
    fresh, _ = build()
    fresh_state = dict(fresh.named_parameters())
    with torch.no_grad():
        for name, p in pm.named_parameters():
            fresh_state[name].copy_(p)
    expected = fresh(idx, tgt).item()
    # a checkpoint taken here and loaded into a new model continues the same run
    save_checkpoint(pm, opt, path)
    continued = [step(pm, opt) for _ in range(2)]
    loaded, loaded_opt = build()
    load_checkpoint(loaded, loaded_opt, path)
    resumed = [step(loaded, loaded_opt) for _ in range(2)]
    return before, edited, expected, continued, resumed, unzeroed


def _edits_in(rank, world, workdir):
    return _edits_and_checkpoints(rank, world, os.path.join(workdir, "ckpt"))


EDITS = pool.job(1, _edits_in, workdir=True)


def test_master_edits_and_checkpoints_reach_the_copies():
    before, edited, expected, continued, resumed, unzeroed = EDITS.result()[0]
    assert "call opt.zero_grad() before each train_step" in unzeroed
    assert edited != before and edited == expected
    assert continued == resumed


def _refused(rank, world, cases):
    idx, tgt = example_inputs(TINY, BATCH, SEQ)
    messages = []
    for knobs in cases:
        pm = autopar.parallelize(make_model(), (world, 1, 1), (idx, tgt), compile=False, **knobs)
        try:
            pm.optimizer(autopar.MasterAdamW, lr=1e-3)
            messages.append(None)
        except ValueError as e:
            messages.append(str(e))
    return messages


REFUSED = [
    (pool.job(1, _refused, [dict(precision="fp32"), dict(precision="fp16"), dict(precision="bf16", microbatches=2)]),
     ["precision='fp32'", "precision='fp16'", "2 microbatches"]),
    (pool.job(2, _refused, [dict(precision="bf16", zero=1)]), ["zero=1"]),
]


@pytest.mark.parametrize("world,k", [(1, 0), (2, 1)])
def test_unsupported_plans_are_refused(world, k):
    refused, says = REFUSED[k]
    assert refused.world == world
    for messages in refused.result():
        for message, said in zip(messages, says, strict=True):
            assert message is not None and said in message and "torch.optim.AdamW" in message


def test_foreign_parameters_are_refused():
    pm_free = [torch.nn.Parameter(torch.zeros(3))]
    with pytest.raises(TypeError):
        autopar.MasterAdamW(pm_free)   # it needs a ParallelModel's working weights
    from autopar.runtime.master_weights import WorkingWeights
    working = WorkingWeights({"w": torch.nn.Parameter(torch.zeros(3))}, torch.bfloat16)
    with pytest.raises(ValueError, match="pm.optimizer"):
        autopar.MasterAdamW(pm_free, working)
