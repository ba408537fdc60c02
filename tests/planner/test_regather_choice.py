"""Under sequence parallelism a plan that misses its memory budget makes room in two ways: Megatron's
storage rule (each sequence-parallel linear keeps its input's shard and gathers it again in the
backward) and recompute. Neither is always the cheaper: here (8 blocks of 2048 at 8,192 tokens, tp 8 on
H100s) recomputing blocks costs less than re-gathering every linear's input, so a budget 10% under the
plain peak is met by recompute alone, faster than the hand layout that re-gathers; a budget no recompute
alone meets takes both. The device's memory is a budget like a given one."""
from __future__ import annotations

import dataclasses

import pytest

import autopar
from autopar.cost_model.devices import DEVICES
from autopar.examples.gpt import build, example_inputs

MESH = (1, 1, 8)
KNOBS = dict(device="h100", precision="bf16", sequence_parallel=True)


@pytest.fixture(scope="module")
def case():
    model = build("gpt2", device="meta", n_layer=8, n_embd=2048, n_head=16, block_size=8192, vocab_size=32000)
    x = example_inputs(model.config, 4, 8192, device="meta")
    plain = autopar.plan(model, MESH, x, recompute="none", **KNOBS)
    return model, x, plain, max(m.peak for m in plain.memory)


@pytest.fixture(scope="module")
def tight(case):
    """The plan for a budget below what recomputing every block reaches."""
    model, x, _, _ = case
    full = autopar.plan(model, MESH, x, recompute="full", **KNOBS)
    budget = 0.98 * max(m.peak for m in full.memory)
    return autopar.plan(model, MESH, x, recompute="auto", memory_budget=budget, **KNOBS), budget


def test_a_budget_recompute_alone_cannot_meet_takes_both(case, tight):
    model, _, _, peak = case
    plan, budget = tight
    assert max(m.peak for m in plan.memory) <= budget < peak
    # every column-parallel linear on a sequence shard re-gathers: two per block and the head
    assert plan.recompute_regions and sum(n.regather for n in plan.nodes) == 2 * model.config.n_layer + 1


def test_recompute_makes_room_where_it_is_cheaper_than_regathering(case, tight):
    model, x, plain, peak = case
    budget = 0.9 * peak
    auto = autopar.plan(model, MESH, x, recompute="auto", memory_budget=budget, **KNOBS)
    assert max(m.peak for m in auto.memory) <= budget
    assert auto.recompute_regions and not any(n.regather for n in auto.nodes)
    # the layout the planner chose before: those linears re-gathering, nothing recomputed, given by hand
    regathered = {n.name for n in tight[0].nodes if n.regather}
    by_hand = autopar.plan(model, MESH, x, plan=dataclasses.replace(plain, nodes=tuple(
        dataclasses.replace(n, regather=n.name in regathered) for n in plain.nodes)), **KNOBS)
    assert max(m.peak for m in by_hand.memory) <= budget and not by_hand.recompute_regions
    assert auto.predicted_step_time < by_hand.predicted_step_time


def test_the_devices_memory_is_a_budget_like_a_given_one(case):
    model, x, _, peak = case
    small = dataclasses.replace(DEVICES["h100"], name="h100 (small)", memory_bytes=int(0.9 * peak))
    knobs = {**KNOBS, "device": small}
    implied = autopar.plan(model, MESH, x, recompute="auto", **knobs)
    given = autopar.plan(model, MESH, x, recompute="auto", memory_budget=small.memory_bytes, **knobs)
    assert implied.diff(given) == "no differences"
    assert max(m.peak for m in implied.memory) <= small.memory_bytes
