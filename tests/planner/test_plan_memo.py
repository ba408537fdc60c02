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


def test_recompute_modes_are_kept_per_inputs_not_coarser():
    """``block_modes`` answers each (costs, memory, budget) as the ILP does, and a tighter budget
    is a new question with its own answer."""
    from autopar.planner.ilp import solve_strategies
    from autopar.planner.recompute import block_modes

    costs = ((0.0, 1.0, 3.0), (0.0, 2.0, 3.0))
    mems = ((10.0, 6.0, 1.0), (10.0, 6.0, 1.0))
    for budget in (20.0, 16.0, 12.0, 7.0):
        expected = tuple(solve_strategies(list(costs), [], node_memory=list(mems), memory_budget=budget).choice)
        assert block_modes(costs, mems, budget) == expected
    assert block_modes(costs, mems, 20.0) == (0, 0)
    assert block_modes(costs, mems, 16.0) == (1, 0)
    assert block_modes(costs, mems, 1.0) is None   # nothing fits


def test_per_node_memory_terms_follow_the_strategies_they_read():
    """What a node keeps and its backward transient are kept per node and the strategies of it and its
    inputs: another plan of the same graph gets its own figures, the ones a fresh graph gives."""
    from autopar.cost_model.activations import compiled_kept
    from autopar.cost_model.backward import backward_transient
    from autopar.planner.sharding import enumerate_strategies

    model = build("gpt2", device="meta", n_layer=2)
    x = example_inputs(model.config, 4, 256, device="meta")
    plan = autopar.plan(model, (1, 1, 2), x, device="h100", sequence_parallel=True)
    cap, solved = rebuild(model, plan, x, sequence_parallel=True)
    first = {n: opts[0] for n, opts in enumerate_strategies(cap, 2, True).items()}
    calls = [n for n in cap.gm.graph.nodes if n.op == "call_function"]
    assert any(first[n] != solved[n] for n in calls)
    warm = (compiled_kept(calls, first, 2), [backward_transient(n, first, 2) for n in calls])
    again = (compiled_kept(calls, solved, 2), [backward_transient(n, solved, 2) for n in calls])
    fresh_cap, fresh = rebuild(model, plan, x, sequence_parallel=True)   # a new graph: nothing kept for it
    fresh_calls = [n for n in fresh_cap.gm.graph.nodes if n.op == "call_function"]
    by_name = {n.name: n for n in calls}
    cold = compiled_kept(fresh_calls, fresh, 2)
    assert {(k[0].name, k[1]): b for k, b in again[0].items()} == {(k[0].name, k[1]): b for k, b in cold.items()}
    assert again[1] == [backward_transient(n, fresh, 2) for n in fresh_calls]
    assert again != warm and set(by_name) == {n.name for n in fresh_calls}


def test_recompute_auto_that_fits_without_recompute_is_the_plan_without_it():
    """Where nothing recomputed fits, recompute="auto" reuses the plan priced without recompute; where
    it does not fit, it still recomputes (the reuse is only for the first case)."""
    model = build("gpt2", device="meta", n_layer=4)
    x = example_inputs(model.config, 8, 1024, device="meta")
    kw = dict(device="h100", sequence_parallel=True, precision="bf16")
    none = autopar.plan(model, (1, 1, 2), x, recompute="none", memory_budget="80GiB", **kw)
    auto = autopar.plan(model, (1, 1, 2), x, recompute="auto", memory_budget="80GiB", **kw)
    assert auto.recompute == "auto" and not auto.recompute_regions
    assert dataclasses.replace(auto, recompute="none") == dataclasses.replace(none, solve_seconds=auto.solve_seconds)
    tight = max(m.peak for m in none.memory) * 0.9
    squeezed = autopar.plan(model, (1, 1, 2), x, recompute="auto", memory_budget=tight, **kw)
    assert squeezed.recompute_regions and max(m.peak for m in squeezed.memory) <= tight
