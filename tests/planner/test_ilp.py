"""Tests of the strategy-selection ILP against exhaustive search."""

import time

import numpy as np
import pytest

from autopar.planner.ilp import InfeasibleError, Solution, brute_force, evaluate, solve_strategies


def random_instance(seed, *, inf_frac=0.15, with_memory=False):
    rng = np.random.default_rng(seed)
    n = int(rng.integers(6, 9))
    ks = rng.integers(2, 5, size=n)
    node_costs = []
    for k in ks:
        c = rng.uniform(0, 10, size=k)
        c[rng.random(k) < inf_frac / 2] = np.inf
        if not np.isfinite(c).any():
            c[0] = rng.uniform(0, 10)
        node_costs.append(c)
    edges = []
    order = rng.permutation(n)  # random DAG: edges follow a random topological order
    for a in range(n):
        for b in range(a + 1, n):
            if rng.random() < 0.35:
                u, v = int(order[a]), int(order[b])
                r = rng.uniform(0, 10, size=(ks[u], ks[v]))
                r[rng.random(r.shape) < inf_frac] = np.inf
                edges.append((u, v, r))
    # a self-loop (off-diagonal must not matter: make it huge/inf)
    s = int(rng.integers(n))
    loop = np.full((ks[s], ks[s]), np.inf)
    np.fill_diagonal(loop, rng.uniform(0, 5, size=ks[s]))
    edges.append((s, s, loop))
    # a parallel edge, both in the same and in the reverse direction
    u, v = (int(x) for x in rng.choice(n, size=2, replace=False))
    edges.append((u, v, rng.uniform(0, 3, size=(ks[u], ks[v]))))
    edges.append((v, u, rng.uniform(0, 3, size=(ks[v], ks[u]))))
    edges.append((u, v, rng.uniform(0, 3, size=(ks[u], ks[v]))))
    mem = [rng.integers(1, 100, size=k).astype(float) for k in ks] if with_memory else None
    return node_costs, edges, mem


def _feasible(node_costs, edges, mem=None, budget=None):
    try:
        return brute_force(node_costs, edges, mem, budget)
    except InfeasibleError:
        return None


@pytest.mark.parametrize("seed", range(50))
def test_matches_brute_force(seed):
    node_costs, edges, _ = random_instance(seed)
    ref = _feasible(node_costs, edges)
    if ref is None:
        with pytest.raises(InfeasibleError):
            solve_strategies(node_costs, edges)
        return
    sol = solve_strategies(node_costs, edges)
    assert isinstance(sol, Solution) and sol.status == "optimal"
    assert len(sol.choice) == len(node_costs)
    assert sol.objective == pytest.approx(ref.objective, rel=1e-9, abs=1e-9)
    assert evaluate(node_costs, edges, sol.choice)[0] == pytest.approx(sol.objective)
    assert isinstance(sol.objective, float)


def test_most_random_instances_are_feasible():
    feasible = sum(_feasible(*random_instance(s)[:2]) is not None for s in range(50))
    assert feasible >= 35


@pytest.mark.parametrize("seed", range(20))
def test_memory_budget_matches_brute_force(seed):
    node_costs, edges, mem = random_instance(100 + seed, inf_frac=0.05, with_memory=True)
    free = _feasible(node_costs, edges, mem)
    if free is None:
        pytest.skip("structurally infeasible instance")
    # budget strictly below the unconstrained optimum's memory, so it binds
    budget = free.memory - 1
    ref = _feasible(node_costs, edges, mem, budget)
    if ref is None:
        with pytest.raises(InfeasibleError, match="needs at least"):
            solve_strategies(node_costs, edges, node_memory=mem, memory_budget=budget)
        return
    sol = solve_strategies(node_costs, edges, node_memory=mem, memory_budget=budget)
    assert sol.memory <= budget
    assert sum(m[i] for m, i in zip(mem, sol.choice)) <= budget
    assert sol.objective == pytest.approx(ref.objective, rel=1e-9, abs=1e-9)
    assert sol.objective >= free.objective - 1e-9


def test_infeasible_budget_reports_minimum():
    node_costs = [[1.0, 2.0], [1.0, 5.0], [0.0, 0.0]]
    mem = [[10, 4], [7, 3], [2, 1]]
    # (0,1) edge forbids the pair (1, 1): the min-memory assignment is 4 + 7 + 1 = 12 or 10+3+1 = 14
    edges = [(0, 1, [[0.0, 0.0], [0.0, np.inf]]), (1, 2, np.zeros((2, 2)))]
    with pytest.raises(InfeasibleError, match=r"needs at least 12 bytes, budget is 11 bytes"):
        solve_strategies(node_costs, edges, node_memory=mem, memory_budget=11)
    with pytest.raises(InfeasibleError, match=r"needs at least 12 bytes"):
        brute_force(node_costs, edges, mem, 11)
    sol = solve_strategies(node_costs, edges, node_memory=mem, memory_budget=12)
    assert sol.choice == (1, 0, 1) and sol.memory == 12
    assert sol.objective == pytest.approx(3.0)


def test_infeasible_budget_with_all_nodes_fixed():
    with pytest.raises(InfeasibleError, match="needs at least 5 bytes, budget is 4"):
        solve_strategies([[1.0], [2.0, np.inf]], [(0, 1, [[1.0, 1.0]])],
                         node_memory=[[2], [3, 1]], memory_budget=4)


def test_all_forbidden_node_raises():
    with pytest.raises(InfeasibleError, match="node 1"):
        solve_strategies([[1.0, 2.0], [np.inf, np.inf]], [(0, 1, np.zeros((2, 2)))])


def test_loop_back_diagonal_forbids_all():
    with pytest.raises(InfeasibleError, match="node 0"):
        solve_strategies([[1.0, 2.0]], [(0, 0, [[np.inf, 0.0], [0.0, np.inf]])])


def test_no_compatible_pair_raises():
    with pytest.raises(InfeasibleError):
        solve_strategies([[1.0, 2.0], [1.0, 2.0]], [(0, 1, np.full((2, 2), np.inf))])


def test_odd_cycle_infeasible_not_caught_by_arc_consistency():
    # 3-colouring-like: 2 strategies, every edge forbids equal strategies: odd cycle infeasible
    neq = [[np.inf, 0.0], [0.0, np.inf]]
    with pytest.raises(InfeasibleError, match="forbidden"):
        solve_strategies([[0.0, 0.0]] * 3, [(0, 1, neq), (1, 2, neq), (2, 0, neq)])
    sol = solve_strategies([[0.0, 1.0]] * 4, [(0, 1, neq), (1, 2, neq), (2, 3, neq), (3, 0, neq)])
    assert sol.objective == 2.0


def test_self_loop_uses_only_diagonal():
    sol = solve_strategies([[1.0, 1.0]], [(0, 0, [[5.0, -100.0], [-100.0, 0.0]])])
    assert sol.choice == (1,) and sol.objective == 1.0


def test_bad_shapes_raise_value_error():
    with pytest.raises(ValueError, match="shape"):
        solve_strategies([[1.0, 2.0], [1.0]], [(0, 1, np.zeros((2, 2)))])
    with pytest.raises(ValueError):
        solve_strategies([[1.0, np.nan]], [])


def test_tiny_costs_scale_invariant():
    node_costs, edges, _ = random_instance(7, inf_frac=0.0)
    ref = brute_force(node_costs, edges)
    s = 1e-9
    sol = solve_strategies([c * s for c in node_costs], [(u, v, r * s) for u, v, r in edges])
    assert sol.objective == pytest.approx(ref.objective * s, rel=1e-7)


def test_chain_2000_nodes_is_fast():
    rng = np.random.default_rng(0)
    n, k = 2000, 4
    node_costs = [rng.uniform(0, 10, size=k) for _ in range(n)]
    edges = [(i, i + 1, rng.uniform(0, 10, size=(k, k))) for i in range(n - 1)]
    t0 = time.perf_counter()
    sol = solve_strategies(node_costs, edges)
    wall = time.perf_counter() - t0
    print(f"\n2000-node chain, 4 strategies: {wall:.2f} s (solve_seconds={sol.solve_seconds:.2f})")
    assert sol.status == "optimal"
    # exact optimum of a chain by dynamic programming
    best = node_costs[0].copy()
    for i in range(1, n):
        best = (best[:, None] + edges[i - 1][2]).min(axis=0) + node_costs[i]
    assert sol.objective == pytest.approx(float(best.min()), rel=1e-9)
    assert wall < 30.0


@pytest.mark.parametrize("seed", range(10))
def test_random_budget_at_and_below_minimum(seed):
    node_costs, edges, mem = random_instance(200 + seed, inf_frac=0.05, with_memory=True)
    if _feasible(node_costs, edges, mem) is None:
        pytest.skip("structurally infeasible instance")
    # smallest reachable memory by exhaustive search: the cost-minimal solution under a budget
    # that only memory-minimal assignments meet
    lo = min(brute_force(node_costs, edges, mem).memory, sum(float(m.max()) for m in mem))
    while True:
        try:
            brute_force(node_costs, edges, mem, lo - 1)
            lo -= 1
        except InfeasibleError:
            break
    with pytest.raises(InfeasibleError, match=f"needs at least {lo:.0f} bytes, budget is"):
        solve_strategies(node_costs, edges, node_memory=mem, memory_budget=lo - 1)
    sol = solve_strategies(node_costs, edges, node_memory=mem, memory_budget=lo)
    assert sol.memory == lo
    assert sol.objective == pytest.approx(brute_force(node_costs, edges, mem, lo).objective)


@pytest.mark.parametrize("seed", range(12))
def test_reused_structure_gives_the_fresh_answer(seed):
    """Solving with ``reuse`` (the structure kept between calls on the same edges) gives what a fresh
    solve gives, for costs that forbid the same entries and for costs that forbid others, which
    rebuild the structure; a call on other edges starts again."""
    node_costs, edges, _ = random_instance(seed)
    rng = np.random.default_rng(1000 + seed)
    reuse: dict = {}
    variants = []
    for k in range(6):
        costs = [np.where(np.isfinite(c), c + rng.uniform(0, 5, size=c.size), np.inf) for c in node_costs]
        if k in (2, 4):   # forbid one more strategy of a node that keeps another
            v = next(v for v, c in enumerate(costs) if np.isfinite(c).sum() > 1)
            costs[v][int(np.flatnonzero(np.isfinite(costs[v]))[0])] = np.inf
        variants.append(costs)
    for costs in variants + variants[::-1]:
        try:
            fresh = solve_strategies(costs, edges)
        except InfeasibleError:
            with pytest.raises(InfeasibleError):
                solve_strategies(costs, edges, reuse=reuse)
            continue
        again = solve_strategies(costs, edges, reuse=reuse)
        assert (again.choice, again.objective, again.status) == (fresh.choice, fresh.objective, fresh.status)
    other_costs, other_edges, _ = random_instance(seed + 100)
    fresh = solve_strategies(other_costs, other_edges)
    assert solve_strategies(other_costs, other_edges, reuse=reuse).choice == fresh.choice
