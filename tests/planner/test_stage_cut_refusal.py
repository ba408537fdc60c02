"""A pipeline whose stages fit no cut is refused with a PlanError that names the memory model's peak
(the figure a plan's summary shows, the backward's transient included), not the stage DP's bound."""
from __future__ import annotations

import re

import pytest

import autopar
from autopar.examples.gpt import build, example_inputs
from autopar.planner.stage_cut import NoCutFits


def test_no_cut_is_a_plan_error_naming_the_ranks_peak():
    model = build("gpt2", device="meta", n_layer=4)
    inputs = example_inputs(model.config, 8, 512, device="meta")
    knobs = dict(schedule="Interleaved1F1B", virtual_stages=2, microbatches=4)
    lifted = autopar.plan(model, (1, 2, 1), inputs, memory_budget="10TB", recompute="full", **knobs)
    fastest = max(m.peak for m in lifted.memory)
    budget = 0.9 * fastest
    with pytest.raises(autopar.PlanError) as e:   # recompute="auto" tries none, then every block recomputed
        autopar.plan(model, (1, 2, 1), inputs, memory_budget=budget, recompute="auto", **knobs)
    assert isinstance(e.value, NoCutFits)
    needs = float(re.search(r"needs ([\d.]+) GiB per rank", str(e.value))[1]) * 2**30
    # the peak of the least-memory cut: above the budget, at most the fastest cut's peak, and the memory
    # model's (the DP's bound leaves out the backward's transient, which this model's peak holds)
    assert budget < needs <= fastest * (1 + 1e-3)
    assert "its backward's transient included" in str(e.value)
