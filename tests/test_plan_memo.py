"""Strategies the planner derives from others are made once per strategy they come from, so the prices
kept per strategy object (``cost_model.memo``) are shared by the candidates that derive them alike."""
from __future__ import annotations

import dataclasses

import autopar
from autopar.examples.gpt import build, example_inputs
from autopar.planner.decide import rebuild
from autopar.planner.sharding import with_regather


def test_regathered_strategies_are_made_once_per_strategy_they_replace():
    model = build("gpt2", device="meta", n_layer=2)
    x = example_inputs(model.config, 4, 256, device="meta")
    plan = autopar.plan(model, (1, 1, 2), x, device="h100", sequence_parallel=True)
    _, strategies = rebuild(model, plan, x, sequence_parallel=True)
    once, again = with_regather(strategies), with_regather(strategies)
    changed = [n for n in strategies if once[n] is not strategies[n]]
    assert changed and all(once[n] is again[n] for n in strategies)
    assert all(once[n] == dataclasses.replace(strategies[n], regather=True) for n in changed)
    # another strategy at the same node gets its own re-gathering strategy, not the first one's
    n = changed[0]
    other = dataclasses.replace(strategies[n], local="other")
    assert with_regather({**strategies, n: other})[n] == dataclasses.replace(other, regather=True)
