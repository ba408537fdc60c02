"""A choice taken between two byte prices at which the solver proved it optimal, without a solve, is the
choice a solve at that price gives: on random ILP families, and on the tp ILP of a model."""
from __future__ import annotations

import numpy as np
import pytest

from autopar.planner.ilp import solve_strategies
from autopar.planner.parametric import choice_at

from test_ilp import random_instance


def _family(seed):
    node_costs, edges, _ = random_instance(seed, inf_frac=0.0)
    rng = np.random.default_rng(500 + seed)
    slopes = [rng.uniform(0, 10, size=c.size) for c in node_costs]
    return node_costs, slopes, edges


@pytest.mark.parametrize("seed", range(20))
def test_choices_between_proven_prices_are_the_solved_ones(seed):
    """Every λ asked gets the choice a fresh solve at λ gives, over a range wide enough that the
    choice changes; and some λ get it without a solve."""
    a, b, edges = _family(seed)
    rng = np.random.default_rng(seed)
    asked = np.concatenate([np.geomspace(1e-3, 1e2, 12), rng.uniform(0, 3, size=12)])
    rng.shuffle(asked)
    solves = []

    def solve(lam):
        solves.append(lam)
        sol = solve_strategies([x + lam * y for x, y in zip(a, b)], edges)
        return sol.choice, sol.status == "optimal"

    proven: dict = {}
    got = {float(lam): choice_at(proven, float(lam), solve) for lam in asked}
    fresh = {lam: solve_strategies([x + lam * y for x, y in zip(a, b)], edges).choice for lam in got}
    assert got == fresh
    assert len(set(got.values())) > 1   # the range moves the choice
    assert len([lam for lam in got if lam not in solves]) > 0


def test_a_choice_is_not_taken_past_a_price_where_another_was_proven():
    """Two proven λ with different choices around λ: λ is solved, not given either end's choice."""
    calls = []

    def solve(lam):
        calls.append(lam)
        return ("mid",), True

    proven = {1.0: ("low",), 3.0: ("high",)}
    assert choice_at(proven, 2.0, solve) == ("mid",) and calls == [2.0]
    proven = {1.0: ("low",), 3.0: None}   # no proof at 3.0: nothing is taken from it
    assert choice_at(proven, 2.0, solve) == ("mid",)


def test_the_tp_ilp_gives_a_fresh_solve_choice_at_every_byte_price():
    """``sharding.solve`` asked one tp's ILP at falling, then rising, byte prices gives each the strategies
    a capture solved afresh at that price gives."""
    from autopar.cost_model.devices import get_device
    from autopar.examples.gpt import build, example_inputs
    from autopar.graph.capture import capture_pass
    from autopar.planner.sharding import enumerate_strategies, solve

    dev = get_device("h100")

    def captured():
        model = build("gpt2", device="meta", n_layer=2)
        cap = capture_pass(model, example_inputs(model.config, 2, 256, device="meta"))
        return cap, enumerate_strategies(cap, 2, "auto")

    cap, options = captured()
    prices = [4e-11, 6e-11, 1.3e-11, 2e-11, 4e-12, 1e-13, 3e-12, 1e-9, 1e-8, 5e-10]
    kept = [solve(cap, options, 2, dev, param_byte_seconds=p).strategies for p in prices]
    for p, strategies in zip(prices, kept):
        cap2, options2 = captured()
        fresh = solve(cap2, options2, 2, dev, param_byte_seconds=p).strategies
        names = {n.name: options2[n].index(s) for n, s in fresh.items()}
        assert {n.name: options[n].index(s) for n, s in strategies.items()} == names
