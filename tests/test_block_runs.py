"""A run of repeated blocks is priced as the same run at block 1 (``cost_model.repeats``), twin ops share
their strategy objects, and a stage's backward excess is kept apart from its gradients' bytes: each
figure must be the one the stage computed whole on a fresh graph gives."""
from __future__ import annotations

import dataclasses

import pytest

import autopar
from autopar.examples.gpt import build, example_inputs
from autopar.mesh import Mesh
from autopar.graph.units import find_blocks, layer_units
from autopar.planner.decide import rebuild
from autopar.planner.recompute import regions_for


@pytest.fixture(scope="module")
def planned():
    """A 6-layer GPT-2 planned at tp=2 with sequence parallelism, bf16: its model, batch and plan."""
    model = build("gpt2", device="meta", n_layer=6)
    x = example_inputs(model.config, 4, 256, device="meta")
    plan = autopar.plan(model, (1, 1, 2), x, device="h100", sequence_parallel=True, precision="bf16")
    return model, x, plan


def _plan_graph(planned):
    """A fresh capture of the plan, retyped to bf16 (nothing kept for its graph yet), and its strategies."""
    model, x, plan = planned
    return rebuild(model, plan, x, sequence_parallel=True)


def _named(terms):
    """``stage_terms``' figures with each excess node by its name, to compare two graphs' answers."""
    params, grads, opt, act, excess = terms
    return params, grads, opt, act, [(n.name, b) for n, b in excess]


def _whole(cap, strategies, mesh, nodes, regions, zero, microbatches, offload=False):
    """``stage_terms`` computed on the stage's own nodes, not shifted and not kept."""
    from autopar.cost_model import memory

    nodes = tuple(nodes)
    mine = tuple(tuple(r) for r in regions if r and r[0] in set(nodes))
    read = memory.strategies_of(strategies, memory.read_nodes(nodes, mine))
    return memory._stage_terms(cap, strategies, mesh, nodes, mine, zero, microbatches, 0.5, offload, (), (), read)


def test_twin_ops_share_their_strategy_objects(planned):
    from autopar.planner.sharding import enumerate_strategies, with_regather

    model, x, plan = planned
    cap, solved = rebuild(model, plan, x, sequence_parallel=True)
    options = enumerate_strategies(cap, 2, True)
    blocks = find_blocks(cap)
    for block in blocks[1:]:
        for n, twin in zip(block, blocks[0]):
            assert len(options[n]) == len(options[twin])
            assert all(a is b for a, b in zip(options[n], options[twin]))
    regathered = with_regather(solved)
    changed = [n for n in solved if regathered[n] is not solved[n]]
    assert changed
    by_strategy = {}
    for n in changed:   # one re-gathering strategy per strategy it replaces, whichever node has it
        assert by_strategy.setdefault(id(solved[n]), regathered[n]) is regathered[n]


@pytest.mark.parametrize("mode", ["none", "selective", "full", "mixed"])
def test_a_run_of_blocks_is_priced_as_the_run_at_block_one(planned, mode):
    from autopar.cost_model.memory import stage_terms
    from autopar.cost_model.repeats import shifted

    cap, strategies = _plan_graph(planned)
    units = layer_units(cap)   # embedding, blocks 0..5, head
    sel, full = regions_for(cap, "selective"), regions_for(cap, "full")
    regions = {"none": [], "selective": sel, "full": full, "mixed": [full[1], sel[2], full[3], sel[4]]}[mode]
    mesh = Mesh(4, 1, 2)
    fresh, fresh_strategies = _plan_graph(planned)
    fresh_units = layer_units(fresh)
    fresh_regions = [[{n.name: n for n in fresh.gm.graph.nodes}[m.name] for m in r] for r in regions]
    for a, b in [(3, 5), (4, 7), (3, 4), (5, 7)]:   # runs of blocks from block 2 on
        nodes = tuple(n for u in units[a:b] for n in u.nodes)
        mine = tuple(tuple(r) for r in regions if r[0] in set(nodes))
        assert shifted(cap, strategies, nodes, mine) is not None
        fresh_nodes = [n for u in fresh_units[a:b] for n in u.nodes]
        for zero, microbatches, offload in [(0, 1, False), (1, 2, False), (2, 2, False), (3, 1, False), (2, 4, True)]:
            got = stage_terms(cap, strategies, mesh, nodes, regions, zero=zero, microbatches=microbatches,
                              working_copy=0.5, offload=offload)
            want = _whole(fresh, fresh_strategies, mesh, fresh_nodes, fresh_regions, zero, microbatches, offload)
            assert _named(got) == _named(want)


def test_a_run_after_a_block_with_other_strategies_is_not_shifted(planned):
    from autopar.cost_model.activations import kept_bytes
    from autopar.cost_model.memory import stage_terms
    from autopar.cost_model.repeats import shifted

    cap, strategies = _plan_graph(planned)
    units = layer_units(cap)
    blocks = find_blocks(cap)
    # block 3's output, read by block 4, placed another way: the run of blocks 4..5 reads it, and the
    # run at block 1 reads block 0's, whose strategy is the plan's
    last = [n for n in blocks[3] if n.op == "call_function"][-1]
    other = dict(strategies)
    other[last] = dataclasses.replace(strategies[last], local="other")
    nodes = tuple(n for u in units[5:7] for n in u.nodes)
    assert shifted(cap, strategies, nodes) is not None
    assert shifted(cap, other, nodes) is None
    mesh = Mesh(1, 1, 2)
    assert _named(stage_terms(cap, other, mesh, nodes, [], zero=0, microbatches=1, working_copy=0.5)) == \
        _named(_whole(cap, other, mesh, nodes, [], 0, 1))
    block = tuple(units[5].nodes)
    assert kept_bytes(cap, block, other, 2) == sum(_whole(cap, other, mesh, block, [], 0, 1)[3:4])


def test_block_kept_bytes_are_the_blocks_own(planned):
    from autopar.cost_model.activations import attention_core, compiled_kept, kept_bytes

    cap, strategies = _plan_graph(planned)
    fresh, fresh_strategies = _plan_graph(planned)
    for block, twin in zip(find_blocks(cap), find_blocks(fresh)):
        calls = tuple(n for n in block if n.op == "call_function")
        fresh_calls = tuple(n for n in twin if n.op == "call_function")
        for regions, fresh_regions in [((), ()), ((attention_core(block),), (attention_core(twin),)),
                                       ((calls,), (fresh_calls,))]:
            want = sum(compiled_kept(fresh_calls, fresh_strategies, 2, fresh_regions).values())
            assert kept_bytes(cap, calls, strategies, 2, regions) == want


def test_recompute_nothing_is_answered_without_the_solver_only_where_it_is_the_one_optimum():
    from autopar.planner.ilp import solve_strategies
    from autopar.planner.recompute import block_modes

    mems = ((10.0, 6.0, 1.0), (10.0, 6.0, 1.0))

    def figures(costs, choice):
        return sum(c[i] for c, i in zip(costs, choice)), sum(m[i] for m, i in zip(mems, choice))
    for costs in [((0.0, 1.0, 3.0), (0.0, 2.0, 3.0)), ((0.0, 0.0, 3.0), (0.0, 2.0, 3.0))]:
        for budget in (25.0, 20.0, 19.0):
            expected = tuple(solve_strategies(list(costs), [], node_memory=list(mems), memory_budget=budget).choice)
            seconds, memory = figures(costs, block_modes(costs, mems, budget))
            assert seconds == figures(costs, expected)[0] and memory <= budget   # an optimum, as the ILP's
    assert block_modes(((0.0, 1.0, 3.0), (0.0, 2.0, 3.0)), mems, 20.0) == (0, 0)
    # block 0's selective recompute is free: recomputing nothing ties with it, and the tie goes to less memory
    assert block_modes(((0.0, 0.0, 3.0), (0.0, 2.0, 3.0)), mems, 25.0) == (1, 0)
