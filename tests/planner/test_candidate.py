"""The planner's candidates: one Request checked once, candidates priced by the one memory sum and the one
step sum, and the Plan built from the kept one with its step's terms."""
from __future__ import annotations

import json

import pytest

import autopar
from autopar.examples.gpt import build, example_inputs
from autopar.planner.request import Request


def _gpt2():
    model = build("gpt2", device="meta")
    return model, example_inputs(model.config, 8, 1024, device="meta")


def test_the_stage_cut_fits_the_peak_not_only_the_stage_dps_bound():
    """The DP's figure leaves out the backward's transient; under a budget between the two, the cut the DP
    takes first misses by the peak, so the planner takes a cut whose peak fits."""
    model, inputs = _gpt2()
    roomy = autopar.plan(model, (1, 2, 4), inputs, microbatches=4)
    fullest = max(roomy.memory, key=lambda m: m.peak)
    budget = fullest.peak - fullest.transient / 2   # above the DP's figure of that cut, below its peak
    tight = autopar.plan(model, (1, 2, 4), inputs, microbatches=4, memory_budget=budget)
    assert [s.modules for s in tight.stages] != [s.modules for s in roomy.stages]
    assert max(m.peak for m in tight.memory) <= budget and not tight.warnings
    assert all(s.memory_bytes == m.peak for s, m in zip(tight.stages, tight.memory))


def test_recompute_at_cp_weighs_the_memory_cp_leaves():
    """recompute="auto" on a cp mesh chooses against the cp plan's own peak (1/cp of the activations
    and the gathered keys and values), not the whole sequence's."""
    model = build("gpt2", device="meta", n_layer=4)
    inputs = example_inputs(model.config, 2, 1024, device="meta")
    plain = autopar.plan(model, {"cp": 2}, inputs, recompute="none")
    whole = autopar.plan(model, {"dp": 1}, inputs, recompute="none")   # what the old choice weighed
    peak = max(m.peak for m in plain.memory)
    assert peak < max(m.peak for m in whole.memory)
    budget = peak * 1.001
    chosen = autopar.plan(model, {"cp": 2}, inputs, recompute="auto", memory_budget=budget)
    assert chosen.recompute_regions == () and max(m.peak for m in chosen.memory) <= budget


def test_the_plan_carries_its_step_terms():
    """The Plan's three predicted figures are its StepTerms' sums, and the terms survive JSON; a file
    without them (an older plan) still loads."""
    model, inputs = _gpt2()
    for mesh in ((1, 1, 4), (1, 2, 4)):
        plan = autopar.plan(model, mesh, inputs, microbatches=4 if mesh[1] > 1 else None)
        t = plan.step_terms
        assert (plan.predicted_compute_s, plan.predicted_comm_s, plan.predicted_update_s) == \
               (t.compute_s, t.comm_s, t.update_s)
        assert plan.predicted_step_time == pytest.approx(sum(t.as_dict().values()), rel=1e-12)
        assert t.pipelined == (mesh[1] > 1) and (t.bubble > 0) == (mesh[1] > 1)
        assert autopar.Plan.from_json(plan.to_json()) == plan
        assert "terms (ms): compute" in plan.summary()
        older = json.loads(plan.to_json())
        del older["step_terms"]
        assert autopar.Plan.from_json(json.dumps(older)).step_terms is None


def test_the_knobs_are_checked_once_before_anything_is_captured():
    with pytest.raises(ValueError, match="zero=5"):
        Request.of((1, 1, 2), zero=5)
    with pytest.raises(ValueError, match="keep_gathered"):
        Request.of((2, 1, 1), zero=1, keep_gathered=["transformer.h.0"])
    with pytest.raises(ValueError, match="cp_attention='ring' chooses how attention runs over cp"):
        Request.of((1, 1, 2), cp_attention="ring")
    with pytest.raises(ValueError, match="expected a size"):
        Request.of((1, 1, 2), memory_budget="lots")
    with pytest.raises(TypeError):
        Request.of((1, 1, 2), zeros=1)
    req = Request.of("auto", memory_budget="1GiB", offload=None, device="h100")
    assert (req.memory_budget, req.limit, req.offload, req.device.name) == (2**30, 2**30, "none", "h100")
