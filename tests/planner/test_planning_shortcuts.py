"""What the planner keeps or leaves undone to plan faster gives the answers doing the work gives: the
ParamPlans kept per layout and dp placements, the ops of a stage cut kept per cut, the parameters'
local bytes kept per their strategies, the retyped copy's and the capture's code generated only when
read, the strategies of repeated blocks enumerated once, and the garbage collector paused only while
planning."""
from __future__ import annotations

import copy
import gc

import pytest
import torch
from torch.fx import GraphModule

import autopar
from autopar.cost_model.devices import get_device
from autopar.cost_model import memo
from autopar.cost_model.activations import compiled_kept, read_nodes
from autopar.cost_model.backward import excess_parts
from autopar.cost_model.state import local_param_bytes
from autopar.graph.views import VIEW_OPS
from autopar.cost_model.repeats import block_shift, twin
from autopar.cost_model.strategy import _strategy_time, strategy_time
from autopar.examples.gpt import build, example_inputs
from autopar.graph.capture import capture_pass
from autopar.graph.precision import retyped
from autopar.graph.rules import Strategy
from autopar.graph.units import stage_of_nodes
from autopar.cost_model.memory import all_ops, stage_nodes
from autopar.graph.units import layer_units, override_bounds
from autopar.planner.decide import decide, rebuild
from autopar.planner.recompute import regions_for
from autopar.planner.sharding import enumerate_strategies
from autopar.plans import dp_placements
from autopar.mesh import Mesh
from autopar.placement import R


def _model(n_layer: int = 2):
    model = build("gpt2", device="meta", n_layer=n_layer)
    return model, example_inputs(model.config, 8, 256, device="meta")


def test_parameter_plans_follow_the_zero_stage_and_mesh_of_each_plan():
    """Plans of one model on one tp share the layout's ParamPlans only where their dp placements match:
    each plan's parameters are those a fresh capture gives it."""
    model, x = _model()
    plans = {z: autopar.plan(model, (2, 1, 2), x, device="h100", zero=z) for z in (0, 1, 3)}
    for z, plan in plans.items():
        fresh_model, _ = _model()
        fresh = autopar.plan(fresh_model, (2, 1, 2), x, device="h100", zero=z)
        assert plan.parameters == fresh.parameters
        dp = dp_placements(Mesh(2, 1, 2), z)
        assert all({a: p.placements[a] for a in dp} == dp for p in plan.parameters)
    assert plans[0].parameters[0].placements["dp"] == "R" and plans[1].parameters[0].placements["dp"] == "S(0)"


def test_stage_ops_are_the_cut_asked_for():
    """The ops of each stage are kept per cut (its stages' unit bounds): another cut of the same capture
    gets its own, those the cut's units hold, in graph order."""
    model, x = _model(n_layer=4)
    two = autopar.plan(model, (1, 2, 1), x, device="h100", microbatches=2)
    four = autopar.plan(model, (1, 4, 1), x, device="h100", microbatches=4)
    cap, _ = rebuild(model, two, x)
    calls = [n for n in cap.gm.graph.nodes if n.op == "call_function"]
    for plan in (two, four, two):
        where = stage_of_nodes(cap, plan)
        expected = tuple(tuple(n for n in calls if where.get(n.name, len(plan.stages) - 1) == s)
                         for s in range(len(plan.stages)))
        bounds = override_bounds([st.modules for st in plan.stages], layer_units(cap), len(plan.stages))
        assert stage_nodes(cap, bounds) == expected
    assert all_ops(cap) == tuple(calls)


def test_local_parameter_bytes_follow_the_strategies_of_the_parameters():
    """Another placement of one parameter is another question: its bytes change, the others' stay."""
    model, x = _model()
    plan = autopar.plan(model, (1, 1, 2), x, device="h100")
    cap, strategies = rebuild(model, plan, x)
    fqns = list(cap.params)
    sharded = next(f for f in fqns if strategies[cap.params[f]].output != R)
    first = dict(local_param_bytes(cap, strategies, fqns, 2))
    whole = {**strategies, cap.params[sharded]: Strategy((), R)}
    again = local_param_bytes(cap, whole, fqns, 2)
    val = cap.params[sharded].meta["val"]
    assert first[sharded] < again[sharded] == val.numel() * val.element_size()
    assert {f: b for f, b in again.items() if f != sharded} == {f: b for f, b in first.items() if f != sharded}
    assert local_param_bytes(cap, strategies, fqns, 2) == first


def test_retyped_code_is_generated_when_read_or_run():
    """The retyped copy generates its code on first use, the code a GraphModule of its graph has."""
    model, x = _model()
    cap = retyped(capture_pass(model, x, require_loss=True), "bf16")
    assert cap.gm.meta["compute_dtype"] is torch.bfloat16
    assert cap.gm.code == GraphModule(cap.gm, copy.deepcopy(cap.gm.graph)).code


def test_planning_leaves_the_garbage_collector_as_it_found_it():
    model, x = _model()
    was = gc.isenabled()
    try:
        for enabled in (True, False):
            (gc.enable if enabled else gc.disable)()
            autopar.plan(model, (1, 1, 2), x, device="h100")
            assert gc.isenabled() is enabled
    finally:
        (gc.enable if was else gc.disable)()


def test_ops_of_repeated_blocks_are_priced_as_their_twins_in_block_one():
    """An op of a repeated block is priced once for all its twins, as block 1's op: its time under every
    strategy it may take, with and without its collectives, is the one worked out on the op itself."""
    model, x = _model(n_layer=4)
    cap = retyped(capture_pass(model, x, require_loss=True), "bf16")
    shift = block_shift(cap)
    ops = [n for n in cap.gm.graph.nodes if n.op == "call_function" and n.target not in VIEW_OPS]
    twinned = [n for n in ops if twin(n) is not n]
    assert twinned and twinned == [n for n in ops if shift.call_at.get(n, -1) >= 2 * shift.ops]   # blocks 2 and 3
    dev = get_device("h100")
    for tp in (1, 2):
        options = enumerate_strategies(cap, tp, True)
        for n in reversed(ops):   # the last blocks first: their twins are priced through them
            for s in options[n]:
                for with_comm in (False, True):
                    assert strategy_time(n, s, tp, dev, False, with_comm) == \
                        _strategy_time(n, s, tp, dev, False, with_comm)


def test_ops_of_repeated_blocks_take_the_strategies_enumerated_for_them():
    """An op of block 2 on takes its twin's strategies in block 1: those the rules give the op itself,
    at every tp and sequence-parallel choice, on the example GPT and on Hugging Face Llama (RoPE)."""
    import transformers

    from autopar.hf import causal_lm_loss
    from autopar.planner import sharding

    gpt, x = _model(n_layer=4)
    cfg = transformers.LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=4,
                                   num_attention_heads=8, num_key_value_heads=4, max_position_embeddings=64)
    with torch.device("meta"):
        hf = causal_lm_loss(transformers.LlamaForCausalLM(cfg))
    ids = torch.zeros(2, 32, dtype=torch.long, device="meta")
    for model, inputs in ((gpt, x), (hf, (ids, ids))):
        cap = capture_pass(model, inputs, require_loss=True)
        block_shift(cap)   # lays out the twins
        twinned = [n for n in cap.gm.graph.nodes if twin(n) is not n]
        for tp in (2, 4):
            for sp in (False, True, None):
                kept = enumerate_strategies(cap, tp, sp)
                assert twinned and all(kept[n] == kept[twin(n)] for n in twinned)
                real = sharding.twin, sharding.strategies_for
                asked = []
                try:
                    sharding.strategies_for = lambda n, ctx: asked.append(n) or real[1](n, ctx)
                    assert enumerate_strategies.__wrapped__(cap, tp, sp) == kept
                    assert asked and not set(asked) & set(twinned)   # the rules were asked for no twin
                    sharding.twin = lambda n: n
                    full = enumerate_strategies.__wrapped__(cap, tp, sp)
                finally:
                    sharding.twin, sharding.strategies_for = real
                assert kept == full


def test_captured_code_is_generated_when_read():
    """The capture of a repeated model generates its Python code on first use, the code a GraphModule of
    its graph has."""
    from torch.fx._lazy_graph_module import _LazyGraphModule

    model, x = _model(n_layer=4)
    cap = capture_pass(model, x, require_loss=True)
    assert isinstance(cap.gm, _LazyGraphModule) and cap.gm._needs_recompile()
    assert cap.gm.code == GraphModule(cap.gm, copy.deepcopy(cap.gm.graph)).code
    assert not cap.gm._needs_recompile()


def test_a_graph_whose_code_waits_to_be_generated_compiles_as_one_frame():
    """``lower`` hands torch.compile the graph's own code, not the wrapper that generates it, which
    dynamo would compile as frames of their own."""
    from torch._dynamo.utils import counters
    from torch.fx._lazy_graph_module import _LazyGraphModule

    from autopar.runtime.parallel_model import lower

    traced = torch.fx.symbolic_trace(lambda x: torch.relu(x) * 2)
    gm = _LazyGraphModule(traced, copy.deepcopy(traced.graph))
    assert gm._needs_recompile()
    torch._dynamo.reset()
    before = counters["frames"]["total"]
    x = torch.randn(4)
    assert torch.equal(lower(gm, "aot_eager")(x), torch.relu(x) * 2)
    assert counters["frames"]["total"] - before == 1


def test_backward_walk_of_a_stage_is_the_one_worked_out_afresh():
    """What a stage's backward walk reads of its ops but not of what they keep (positions, transients,
    16-bit weight gradients, the parameters' users) is kept per stage and strategies: the walk's parts
    under other recompute regions or other strategies are those worked out with nothing kept."""
    model, x = _model(n_layer=4)
    cap, strategies, _ = decide(model, (1, 1, 2), x, device="h100", precision="bf16")
    nodes = tuple(n for n in cap.gm.graph.nodes if n.op == "call_function")
    params = tuple(cap.params.values())
    replicated = {n: options[0] for n, options in enumerate_strategies(cap, 2, True).items()}
    asked = []
    for chosen in (strategies, replicated):
        for mode in ("none", "selective", "full"):
            kept = compiled_kept(nodes, chosen, 2, regions_for(cap, mode))
            asked.append((chosen, kept, excess_parts(nodes, kept, chosen, 2, params)))
    assert asked[0][2] != asked[3][2]   # the strategies change the walk
    for chosen, kept, parts in asked:
        memo._CACHE.clear()
        assert excess_parts(nodes, kept, chosen, 2, params) == parts


def test_prices_kept_per_graph_go_with_their_graph():
    """The memo finds a graph's prices by its id, and drops them as the graph is freed: a graph made
    later, which may take the same id, asks afresh."""
    graph = torch.fx.Graph()
    assert memo.cached(graph, ("answer",), lambda: 1) == 1
    assert memo.cached(graph, ("answer",), lambda: 2) == 1
    key = id(graph)
    del graph
    gc.collect()
    assert key not in memo._CACHE
    assert memo.cached(torch.fx.Graph(), ("answer",), lambda: 3) == 3


def test_nodes_read_under_recompute_regions_are_those_worked_out_in_full():
    """The nodes whose strategies a stage's kept bytes read, under regions within the stage (the
    stage's own, worked out once) or reaching outside it, are those collected region by region."""
    model, x = _model(n_layer=4)
    cap = capture_pass(model, x, require_loss=True)
    calls = tuple(n for n in cap.gm.graph.nodes if n.op == "call_function")
    stage = calls[len(calls) // 3:]
    for mode in ("selective", "full"):
        regions = tuple(map(tuple, regions_for(cap, mode)))
        for nodes, recompute in ((stage, tuple(r for r in regions if r[0] in stage)), (stage, regions)):
            full = dict.fromkeys(nodes)
            for region in recompute:
                full.update(dict.fromkeys(region))
            for n in list(full):
                full.update(dict.fromkeys(n.all_input_nodes))
            assert read_nodes(nodes, recompute) == tuple(full)


def test_recompute_modes_the_budget_decides_alone_are_the_solvers():
    """Where the memory budget leaves one choice of recompute modes or none, the answer given without
    the solver is the solver's: on budgets at, just inside and just outside the least memory and the
    least memory plus one block's smallest step up, and between."""
    import random

    from autopar.planner.ilp import InfeasibleError, solve_strategies
    from autopar.planner.recompute import _only_fit, block_modes

    rng = random.Random(0)
    decided = 0
    for _ in range(20):
        n = rng.randint(1, 6)
        rows = [(rng.uniform(5, 10) * 2**30, rng.uniform(2, 5) * 2**30, rng.uniform(0.5, 2) * 2**30) for _ in range(n)]
        if rng.random() < 0.5:
            rows = [rows[0]] * n   # a stage of identical blocks
        costs = tuple((0.0, rng.uniform(0.1, 1), rng.uniform(1, 3)) for _ in range(n))
        mems = tuple(rows)
        floor = sum(min(r) for r in mems)
        step = min(m - min(r) for r in mems for m in r if m != min(r))
        for budget in (floor - 2**20, floor - 1, floor, floor + 1, floor + step / 2, floor + step - 1,
                       floor + step, floor + step + 2**20, floor + 3 * step):
            try:
                solved = tuple(solve_strategies(list(costs), [], node_memory=list(mems), memory_budget=budget).choice)
            except InfeasibleError:
                solved = None
            decided += _only_fit(mems, budget) is not False
            assert block_modes(costs, mems, budget) == solved
    assert decided > 30, decided


def test_recompute_modes_by_counts_are_optimal_and_recompute_the_first_blocks():
    """Blocks of a few kinds (a GPT's stages): the answer by counts per kind is an optimum of the
    ILP's (its seconds, within the budget; None exactly where the ILP finds nothing), and within a
    kind the blocks that recompute most come first."""
    import random

    from autopar.planner.ilp import InfeasibleError, solve_strategies
    from autopar.planner.recompute import _by_counts

    rng = random.Random(3)
    answered = 0
    for _ in range(60):
        kinds = [((0.0, rng.uniform(0.1, 1), rng.uniform(1, 3)),
                  (rng.uniform(5, 10) * 2**30, rng.uniform(2, 5) * 2**30, rng.uniform(0.5, 2) * 2**30))
                 for _ in range(rng.randint(1, 3))]
        blocks = [kinds[k] for k in sorted(rng.randrange(len(kinds)) for _ in range(rng.randint(2, 9)))]
        costs, mems = tuple(c for c, _ in blocks), tuple(m for _, m in blocks)
        budget = rng.uniform(sum(min(m) for m in mems), sum(m[0] for m in mems))
        got = _by_counts(costs, mems, budget)
        if got is False:
            continue
        answered += 1
        try:
            want = solve_strategies(list(costs), [], node_memory=list(mems), memory_budget=budget).choice
        except InfeasibleError:
            assert got is None
            continue
        assert got is not None
        assert sum(m[i] for m, i in zip(mems, got)) <= budget
        assert sum(c[i] for c, i in zip(costs, got)) == pytest.approx(sum(c[i] for c, i in zip(costs, want)), rel=1e-9)
        for kind in kinds:
            modes = [i for b, i in zip(blocks, got) if b == kind]
            assert modes == sorted(modes, reverse=True)
    assert answered > 40
