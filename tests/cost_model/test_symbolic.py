"""Symbolic costs: a plan's step time and peak memory as sympy expressions in (B, S), checked
against the numeric cost model at the traced size and at fresh plans of other sizes."""
from __future__ import annotations

import dataclasses

import pytest
import sympy
import torch

import autopar
from autopar.cost_model.compute import compute_time
from autopar.cost_model.devices import DEVICES
from autopar.cost_model.devices import CollectiveFit, MatmulSample
from autopar.examples.gpt import build, example_inputs

# A profile with everything the cost model can be given: a matmul curve, a launch floor and fits.
PROFILE = dataclasses.replace(
    DEVICES["cpu"], name="cpu (test profile)", launch_overhead=2e-6,
    matmul_table=tuple(MatmulSample(d, s, s, s, r) for d, scale in (("fp32", 1.0), ("bf16", 1.5))
                       for s, r in ((64, 2e9 * scale), (256, 2e10 * scale), (1024, 6e10 * scale))),
    collective_fits=(CollectiveFit("intra", "all_reduce", 4e-5, 1.5e9),
                     CollectiveFit("intra", "all_gather", 3e-5, 2.5e9)))


def _peak(plan) -> float:
    return max(m.peak for m in plan.memory)


def _at_size(model, plan, batch: int, seq: int, device):
    """A fresh numeric plan at (batch, seq) making the same decisions as ``plan``."""
    local = tuple((batch // (plan.mesh[0] * plan.microbatches), seq, *s[2:]) for s in plan.input_shapes)
    return autopar.plan(model, plan.mesh, example_inputs(model.config, batch, seq, device="meta"), device=device,
                        plan=dataclasses.replace(plan, input_shapes=local))


@pytest.mark.parametrize("mesh, attention, device, knobs", [
    ((1, 1, 2), "sdpa", "cpu", {}),
    ((2, 2, 1), "explicit", PROFILE, dict(recompute="selective", precision="bf16", microbatches=2, zero=1)),
], ids=["tp2-preset", "dp2-pp2-profile-bf16"])
def test_cost_expr_equals_numeric_model(mesh, attention, device, knobs):
    model = build("tiny", device="meta", n_layer=4, block_size=64, attention=attention)
    plan = autopar.plan(model, mesh, example_inputs(model.config, 8, 16, device="meta"), device=device, **knobs)
    expr = autopar.cost_expr(plan, model, device=device)

    assert expr.traced == (8, 16)
    assert expr.step_time.free_symbols == {expr.B, expr.S}
    assert expr.peak_memory.free_symbols <= {expr.B, expr.S}
    # attention's FLOPs grow as S^2; only explicit attention keeps (B, heads, S, S) scores for backward
    assert expr.step_time.has(expr.S**2) and not expr.step_time.has(expr.S**3)
    assert expr.peak_memory.has(expr.S**2) == (attention == "explicit")
    step, peak = expr.at(8, 16)
    assert step == pytest.approx(plan.predicted_step_time, rel=1e-9)
    assert peak == pytest.approx(_peak(plan), rel=1e-9)
    env = {expr.B: 8, expr.S: 16}
    assert float(expr.compute.subs(env)) == pytest.approx(plan.predicted_compute_s, rel=1e-9)

    for batch, seq in ((16, 24), (32, 40)):   # no re-tracing for these: substitution only
        fresh = _at_size(model, plan, batch, seq, device)
        step, peak = expr.at(batch, seq)
        assert step == pytest.approx(fresh.predicted_step_time, rel=1e-6)
        assert peak == pytest.approx(_peak(fresh), rel=1e-6)
        assert step != pytest.approx(plan.predicted_step_time, rel=1e-3)   # the sizes do matter


def test_compute_time_takes_sympy_like_numbers():
    x = sympy.Symbol("x", positive=True)
    for dev in (DEVICES["h100"], PROFILE):
        for dtype in (torch.float32, torch.bfloat16):
            expr = compute_time(3 * x, 5 * x, dev, dtype)
            for v in (1e3, 5e5, 2e7, 1e9, 1e12):
                assert float(expr.subs(x, v)) == pytest.approx(compute_time(3 * v, 5 * v, dev, dtype), rel=1e-12)
    assert compute_time(sympy.Integer(0), 4 * x, PROFILE, None) == sympy.Max(4 * x / PROFILE.mem_bandwidth, 2e-6)


def test_cost_expr_needs_the_profile_it_was_priced_on():
    model = build("tiny", device="meta", n_layer=2)
    plan = autopar.plan(model, (1, 1, 1), example_inputs(model.config, 2, 8, device="meta"), device=PROFILE)
    with pytest.raises(ValueError, match="not a preset: pass device="):
        autopar.cost_expr(plan, model)
