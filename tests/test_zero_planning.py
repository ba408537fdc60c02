"""The ZeRO stage as a planner choice, priced by the cost model (offline, on the meta device)."""
from __future__ import annotations

import pytest

import autopar
from autopar.examples.gpt import build, example_inputs
from autopar.plans import PlanFormatError

MESH = (8, 1, 1)


@pytest.fixture(scope="module")
def gpt():
    model = build("gpt3-1.3b", device="meta")
    return model, example_inputs(model.config, 8, 2048, device="meta")


@pytest.fixture(scope="module")
def stages(gpt):
    model, x = gpt
    return {z: autopar.plan(model, MESH, x, device="h100", zero=z) for z in (0, 1, 2, 3)}


def _peak(plan):
    return max(m.peak for m in plan.memory)


def test_each_stage_shards_more_state(stages):
    peaks = {z: _peak(stages[z]) for z in stages}
    # ZeRO-2 keeps every gathered weight through the step: with one microbatch its sharded
    # gradients do not lower the peak (at the forward's end) below ZeRO-1's, only ZeRO-0's
    assert peaks[3] < peaks[1] < peaks[0] and peaks[2] < peaks[0]
    mem = {z: stages[z].memory[0] for z in stages}
    assert mem[1].optimizer == mem[2].optimizer == mem[3].optimizer == pytest.approx(mem[0].optimizer / 8)
    assert mem[3].params < mem[0].params < mem[2].params
    kinds = {z: {(c.phase, c.kind) for c in stages[z].collectives if c.axis == "dp"} for z in stages}
    assert kinds[0] == {("step", "all_reduce")}
    assert kinds[2] == {("fwd", "all_gather"), ("bwd", "reduce_scatter")}
    assert kinds[3] == {("fwd", "all_gather"), ("bwd", "all_gather"), ("bwd", "reduce_scatter")}


def test_auto_takes_the_fastest_stage_that_fits(gpt, stages):
    model, x = gpt
    # a budget between ZeRO-1's peak and ZeRO-0's: stage 0 does not fit
    budget = (_peak(stages[0]) + _peak(stages[1])) / 2
    chosen = autopar.plan(model, MESH, x, device="h100", zero="auto", memory_budget=budget)
    fitting = [z for z in stages if _peak(stages[z]) <= budget]
    best = min(fitting, key=lambda z: stages[z].predicted_step_time)
    assert chosen.zero == best and 0 not in fitting
    assert chosen.predicted_step_time == pytest.approx(stages[best].predicted_step_time)
    assert any("zero chosen automatically" in n for n in chosen.notes)
    # with room for everything, the fastest of all
    roomy = autopar.plan(model, MESH, x, device="h100", zero="auto", memory_budget=10 * _peak(stages[0]))
    assert roomy.zero == min(stages, key=lambda z: stages[z].predicted_step_time)


def test_no_dp_no_sharding(gpt):
    model, x = gpt
    plan = autopar.plan(model, (1, 1, 8), x, device="h100", zero=3)
    assert plan.zero == 0 and any("dp=1" in n for n in plan.notes)
    assert autopar.plan(model, (1, 1, 8), x, device="h100", zero="auto").zero == 0


def test_bad_zero_and_bad_kept_units(gpt, stages):
    model, x = gpt
    with pytest.raises(ValueError, match="zero=4"):
        autopar.plan(model, MESH, x, device="h100", zero=4)
    import dataclasses
    edited = dataclasses.replace(stages[3], keep_gathered=("transformer.h.99",))
    with pytest.raises(PlanFormatError, match="no unit transformer.h.99"):
        autopar.plan(model, MESH, x, device="h100", plan=edited)
    kept = dataclasses.replace(stages[3], keep_gathered=("transformer.h.0",))
    assert autopar.plan(model, MESH, x, device="h100", plan=kept).keep_gathered == ("transformer.h.0",)
    with pytest.raises(PlanFormatError, match="only zero=3"):
        autopar.plan(model, MESH, x, device="h100", plan=dataclasses.replace(stages[2], keep_gathered=("transformer.h.0",)))
