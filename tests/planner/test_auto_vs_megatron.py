"""plan="auto" is never priced slower than plan="megatron": both are priced by one cost model, and
the solver minimises exactly what the plan is priced at.

The solver once disagreed with ``build_plan`` in three ways: it charged a value gathered once for
several consumers (q, k, v; gate, up) once per consumer, it left out the optimizer update (and
dp gradient sync) of the parameters, whose bytes the placements decide, and the plan priced the
latency of the vocab-parallel loss's collectives twice. On Qwen2 shapes over 8 H100s auto was
predicted at 255.8 ms against Megatron's 248.5 ms. The shared-gather pricing lives in the ILP
(``autopar.planner.ilp``'s shared groups), checked here against exhaustive search.
"""
from __future__ import annotations

import numpy as np
import pytest
import torch

import autopar
from autopar.cost_model.strategy import OP_OVERHEAD
from autopar.examples.gpt import build
from autopar.planner.ilp import brute_force, evaluate, solve_strategies
from autopar.cost_model.strategy import LAUNCH_OVERHEAD

transformers = pytest.importorskip("transformers")
from autopar.hf import causal_lm_loss  # noqa: E402


# ---- the ILP's shared groups ------------------------------------------------------------

def test_a_form_wanted_by_several_consumers_is_paid_once():
    # producer 0: strategy 0 keeps its value as it is, strategy 1 needs a move (cost 5) to form 0
    # consumers 1, 2, 3 each take form 0 (strategy 0) or form 1 (strategy 1, 2.0 more each)
    table = [[0.0, 0.0], [5.0, 0.0]]
    members = [(v, [0, 1]) for v in (1, 2, 3)]
    costs = [[0.0, 0.5], [0.0, 2.0], [0.0, 2.0], [0.0, 2.0]]
    edges = [(0, v, np.zeros((2, 2))) for v in (1, 2, 3)]
    shared = [(0, members, table)]
    assert evaluate(costs, edges, (1, 0, 0, 0), shared=shared)[0] == pytest.approx(5.5)   # not 15.5
    assert evaluate(costs, edges, (1, 1, 0, 0), shared=shared)[0] == pytest.approx(7.5)
    sol = solve_strategies(costs, edges, shared=shared)
    assert sol.choice == (0, 0, 0, 0) and sol.objective == 0.0
    costs[0] = [0.0, -6.0]   # now moving once for all three is the best (three moves would cost 15)
    sol = solve_strategies(costs, edges, shared=shared)
    assert sol.choice == (1, 0, 0, 0) and sol.objective == pytest.approx(-1.0)
    assert brute_force(costs, edges, shared=shared).choice == sol.choice


def _random_shared(seed):
    rng = np.random.default_rng(seed)
    n = int(rng.integers(5, 8))
    ks = rng.integers(2, 4, size=n)
    costs = [rng.uniform(0, 10, size=k) for k in ks]
    edges = []
    for a in range(n):
        for b in range(a + 1, n):
            if rng.random() < 0.3:
                r = rng.uniform(0, 5, size=(ks[a], ks[b]))
                r[rng.random(r.shape) < 0.15] = np.inf
                edges.append((a, b, r))
    shared = []
    for _ in range(3):
        u = int(rng.integers(n))
        forms = int(rng.integers(1, 4))
        members = [(int(v), rng.integers(0, forms, size=ks[v])) for v in rng.choice(n, size=int(rng.integers(1, 4)))]
        table = rng.uniform(0, 10, size=(ks[u], forms)) * (rng.random((ks[u], forms)) < 0.7)
        shared.append((u, members, table))
    mem = [rng.integers(1, 50, size=k).astype(float) for k in ks]
    return costs, edges, shared, mem


@pytest.mark.parametrize("seed", range(30))
def test_shared_groups_match_brute_force(seed):
    costs, edges, shared, mem = _random_shared(seed)
    try:
        free = brute_force(costs, edges, mem, shared=shared)
    except ValueError:
        pytest.skip("structurally infeasible instance")
    for budget in (None, free.memory - 1):
        try:
            ref = brute_force(costs, edges, mem, budget, shared=shared)
        except ValueError:
            continue
        sol = solve_strategies(costs, edges, shared=shared, node_memory=mem, memory_budget=budget)
        assert sol.objective == pytest.approx(ref.objective, rel=1e-9, abs=1e-9)
        assert evaluate(costs, edges, sol.choice, mem, shared)[0] == pytest.approx(sol.objective)


def test_shared_group_tables_must_be_non_negative():
    with pytest.raises(ValueError, match=">= 0"):
        solve_strategies([[0.0, 0.0], [0.0]], [], shared=[(0, [(1, [0])], [[-1.0], [0.0]])])


# ---- auto against megatron on the same cost model -------------------------------------------

def _hf(kind: str, layers: int = 2):
    if kind == "qwen2":
        cfg = transformers.Qwen2Config(vocab_size=151936, hidden_size=4096, intermediate_size=11008,
                                       num_hidden_layers=layers, num_attention_heads=32, num_key_value_heads=8,
                                       max_position_embeddings=4096, attn_implementation="sdpa")
        cls = transformers.Qwen2ForCausalLM
    else:
        cfg = transformers.LlamaConfig(vocab_size=32000, hidden_size=2048, intermediate_size=5632,
                                       num_hidden_layers=layers, num_attention_heads=16, num_key_value_heads=8,
                                       max_position_embeddings=4096, attn_implementation="sdpa")
        cls = transformers.LlamaForCausalLM
    with torch.device("meta"):
        return causal_lm_loss(cls(cfg))


def _ids(batch, seq):
    return (torch.empty(batch, seq, dtype=torch.long, device="meta"),) * 2


MODELS = {
    "qwen2": lambda: (_hf("qwen2"), _ids(8, 2048)),
    "llama": lambda: (_hf("llama"), _ids(8, 1024)),
    "gpt3-1.3b": lambda: (build("gpt3-1.3b", device="meta", n_layer=2), _ids(4, 2048)),
    "gpt2-medium": lambda: (build("gpt2-medium", device="meta", n_layer=2), _ids(8, 1024)),
}


@pytest.fixture(scope="module")
def models():
    return {name: make() for name, make in MODELS.items()}


CASES = [(name, mesh) for name in MODELS for mesh in ((1, 1, 2), (1, 1, 4), (1, 1, 8))] + [("qwen2", (2, 1, 4))]


@pytest.mark.parametrize("sequence_parallel", [False, True])
@pytest.mark.parametrize("name,mesh", CASES)
def test_auto_is_never_priced_above_megatron(models, name, mesh, sequence_parallel):
    model, x = models[name]
    auto = autopar.plan(model, mesh, x, device="h100", sequence_parallel=sequence_parallel)
    megatron = autopar.plan(model, mesh, x, device="h100", sequence_parallel=sequence_parallel, plan="megatron")
    assert auto.predicted_step_time <= megatron.predicted_step_time * (1 + 1e-9), auto.diff(megatron)


def test_qwen2_on_8_h100s(models):
    """The reported case: auto was predicted 255.8 ms, Megatron 248.5 ms; now no slower. (Those
    figures were priced without the ops' launch overhead, which pp = 1 plans now pay as pipeline
    stages do: the same for every strategy, so it is taken off before comparing with them.)"""
    model, x = models["qwen2"]
    auto = autopar.plan(model, (1, 1, 8), x, device="h100")
    megatron = autopar.plan(model, (1, 1, 8), x, device="h100", plan="megatron")
    assert auto.predicted_step_time <= megatron.predicted_step_time * (1 + 1e-9)
    assert auto.predicted_step_time - OP_OVERHEAD * len(auto.nodes) < 0.250


@pytest.mark.parametrize("name,mesh", [("qwen2", (1, 1, 8)), ("llama", (1, 1, 4)), ("gpt3-1.3b", (1, 1, 2))])
def test_the_solver_minimises_what_the_plan_is_priced_at(models, name, mesh):
    """The ILP's objective is the plan's predicted step time, but for the per-collective launch
    overhead the solver adds to break ties (dp = pp = 1: no stage schedule, no dp sync latency)."""
    from autopar.planner.decide import decide
    from autopar.cost_model.devices import get_device
    from autopar.mesh import Mesh
    from autopar.cost_model.step import param_byte_time
    from autopar.planner.sharding import enumerate_strategies, solve

    model, x = models[name]
    cap, strategies, plan = decide(model, mesh, x, device="h100")
    dev, m = get_device("h100"), Mesh(*mesh)
    assignment = solve(cap, enumerate_strategies(cap, m.tp, "auto"), m.tp, dev,
                       param_byte_seconds=param_byte_time(m, dev, zero=0, working_copy=False))
    assert assignment.strategies == strategies
    launches = sum(c.count for c in plan.collectives)
    assert 0 <= assignment.objective - plan.predicted_step_time <= LAUNCH_OVERHEAD * launches + 1e-9
