"""A ZeRO-3 plan whose kept-gathered units the planner chose (``Plan.keep_gathered``) against the
unsharded model on 2 gloo ranks, eager: loss, every gathered gradient and AdamW steps, with a plain
torch optimizer over ``pm.parameters()`` and with ``pm.optimizer``. The memory budget lets the
planner keep one of the two blocks gathered, so the rank's graph reshards one block and not the other."""
from __future__ import annotations

import functools
import dataclasses

import pytest
import torch

import autopar
import pool
from autopar.examples.gpt import example_inputs
from parity import SEQ, TINY, adamw_for, counted_gathers_step, make_model, pm_curve, reference

STEPS, LR, BATCH, MESH = 5, 1e-3, 8, (2, 1, 1)
CASES = ["plain", "own"]


def _peak(plan) -> float:
    return max(m.peak for m in plan.memory)


def _budget(inputs) -> float:
    """A memory budget between the peaks with the first block kept gathered and with both kept,
    from the planner's own plans for the mesh (each rank plans them alike, on the model it runs)."""
    both = autopar.plan(make_model(), MESH, inputs, device="cpu", zero=3)
    assert both.keep_gathered == ("transformer.h.0", "transformer.h.1")
    one = autopar.plan(make_model(), MESH, inputs, device="cpu",
                       plan=dataclasses.replace(both, keep_gathered=("transformer.h.0",)))
    assert _peak(one) < _peak(both)
    return (_peak(one) + _peak(both)) / 2


def _run(rank, world):
    out = []
    idx, tgt = example_inputs(TINY, BATCH, SEQ)
    budget = _budget((idx, tgt))
    for optimizer in CASES:
        pm = autopar.parallelize(make_model(), MESH, (idx, tgt), zero=3, memory_budget=budget, device="cpu",
                                 compile=False)
        loss, gathers = counted_gathers_step(pm, (idx, tgt))
        grads = pm.full_grads()
        curve = pm_curve(pm, adamw_for(pm, optimizer, LR), (idx, tgt), STEPS)
        out.append((loss, grads, curve, gathers, pm.plan.keep_gathered))
    return out


JOB = pool.job(2, _run, timeout=600)


REFERENCE = functools.partial(reference, TINY, steps=STEPS, lr=LR, batch=BATCH)


@pytest.mark.parametrize("optimizer", CASES)
def test_planner_kept_units_train_like_one_device(optimizer, ref):
    ref_loss, ref_grads, ref_curve = ref
    linears_per_block = 4   # attention qkv and projection, the MLP's two
    for per_rank in JOB.result():
        loss, grads, curve, (plain, linears, ran), kept = per_rank[CASES.index(optimizer)]
        assert kept == ("transformer.h.0",)   # the planner's choice: one block kept, the other resharded
        assert linears == linears_per_block and ran == plain + 2 * linears   # only h.1 gathers again in backward
        assert loss == pytest.approx(ref_loss, rel=1e-5)
        for name, g in ref_grads.items():
            torch.testing.assert_close(grads[name], g, rtol=1e-4, atol=1e-6, msg=name)
        assert curve == pytest.approx(ref_curve, rel=1e-4)
