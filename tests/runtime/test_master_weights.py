"""MasterAdamW: torch.optim.AdamW's update on fp32 master weights, one fused kernel per tensor.

Its steps must be bit-identical to torch.optim.AdamW's wherever ``pm.optimizer`` builds it (on CPU
the kernel's reference path runs AdamW's single-tensor ops): at 16 bits over the distributed
optimizer's fp32 master slice on one rank, on dp x tp and on a pipeline with ZeRO-1, and at fp32
over the shards. An edit of a 16-bit parameter under ``torch.no_grad`` reaches the master, and a
checkpoint carries it."""
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
    pm = autopar.parallelize(make_model(), mesh, (idx, tgt), **knobs)
    opt = pm.optimizer(autopar.MasterAdamW if master else torch.optim.AdamW, lr=1e-2, weight_decay=0.1)
    curve, grads = [], None
    for step in range(steps):
        opt.zero_grad()
        curve.append(pm.train_step(idx, tgt).item())
        if step == 0:
            grads = pm.full_grads()
        if clip:   # a second, looser clip measures the clipped gradients and must leave them clipped
            curve += [float(pm.clip_grad_norm_(clip)), float(pm.clip_grad_norm_(2 * clip))]
        opt.step()
    return dict(curve=curve, grads=grads, weights=pm.full_state_dict())


def _same(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def _parity(rank, world, mesh, knobs, clips):
    out = []
    for clip in clips:
        plain, master = _train(mesh, knobs, False, clip), _train(mesh, knobs, True, clip)
        out.append(dict(curve=(plain["curve"], master["curve"]), grads=_same(plain["grads"], master["grads"]),
                        weights=_same(plain["weights"], master["weights"]),
                        changed=any(not torch.equal(master["weights"][n], p.detach())
                                    for n, p in make_model().named_parameters())))
    return out


PARITY = {
    # compiled, clipped
    "one-rank": pool.job(1, _parity, (1, 1, 1), dict(precision="bf16", compile="aot_eager"), (0.5,)),
    # dp sums the fp32 gradient buffers; tp (sequence parallel) sums the norm weights' inside the graph
    "dp2-tp2-sp": pool.job(4, _parity, (2, 1, 2), dict(plan="megatron", sequence_parallel=True, precision="bf16",
                                                       compile=False), (0.5,)),
    # the master slice split over dp by ZeRO-1, under a pipeline of two microbatches
    "pp2-dp2-zero1": pool.job(4, _parity, (2, 2, 1), dict(precision="bf16", zero=1, microbatches=2,
                                                          compile=False), (None,)),
    # fp32: over the shards themselves
    "fp32": pool.job(1, _parity, (1, 1, 1), dict(compile=False), (None,)),
}


@pytest.mark.parametrize("case", list(PARITY))
def test_bit_identical_to_torch_adamw(case):
    for per_rank in PARITY[case].result():
        for r in per_rank:
            assert r["curve"][0] == r["curve"][1]
            assert r["grads"] and r["weights"] and r["changed"]


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
    # an edit of a 16-bit parameter outside the optimizer reaches the graph, and its fp32 master
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
    master = pm.full_state_dict()["transformer.wte.weight"]
    halved = master.equal(dict(pm.named_parameters())["transformer.wte.weight"].float())
    # a checkpoint taken here and loaded into a new model continues the same run
    save_checkpoint(pm, opt, path)
    continued = [step(pm, opt) for _ in range(2)]
    loaded, loaded_opt = build()
    load_checkpoint(loaded, loaded_opt, path)
    resumed = [step(loaded, loaded_opt) for _ in range(2)]
    return before, edited, expected, halved, continued, resumed


def _edits_in(rank, world, workdir):
    return _edits_and_checkpoints(rank, world, os.path.join(workdir, "ckpt"))


EDITS = pool.job(1, _edits_in, workdir=True)


def test_master_edits_and_checkpoints_reach_the_masters():
    before, edited, expected, halved, continued, resumed = EDITS.result()[0]
    assert edited != before and edited == expected
    assert halved, "the fp32 master did not take the edit of its 16-bit parameter"
    assert continued == resumed


def _refused(rank, world):
    idx, tgt = example_inputs(TINY, BATCH, SEQ)
    pm = autopar.parallelize(make_model(), (1, 1, 1), (idx, tgt), compile=False, precision="bf16",
                             offload="optimizer")
    try:
        pm.optimizer(autopar.MasterAdamW, lr=1e-3)
        return None
    except ValueError as e:
        return str(e)


REFUSED = pool.job(1, _refused)


def test_offload_is_refused():
    """With offload='optimizer' torch's CPU optimizer steps the host masters: MasterAdamW is refused."""
    message = REFUSED.result()[0]
    assert message is not None and "offload='optimizer'" in message and "torch.optim.AdamW" in message


def test_steps_fp32_tensors_as_torch_adamw_and_refuses_16_bit_ones():
    torch.manual_seed(0)
    a = torch.nn.Parameter(torch.randn(5, 3))
    b = torch.nn.Parameter(a.detach().clone())
    mine = autopar.MasterAdamW([a], lr=1e-2, weight_decay=0.1)
    theirs = torch.optim.AdamW([b], lr=1e-2, weight_decay=0.1)
    for _ in range(3):
        g = torch.randn(5, 3)
        a.grad, b.grad = g.clone(), g.clone()
        mine.step()
        theirs.step()
    assert torch.equal(a, b)
    assert mine.state_dict()["state"][0].keys() == theirs.state_dict()["state"][0].keys()
    with pytest.raises(ValueError, match="pm.optimizer"):
        autopar.MasterAdamW([torch.nn.Parameter(torch.zeros(3, dtype=torch.bfloat16))])
