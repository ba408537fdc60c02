"""ZeRO-3's prefetch and overlap: in the rank graph, in the compiled per-rank code, and priced.

The compiled tests run one zero=3 rank graph of a small GPT (two blocks) on 2 gloo ranks, eager
and through Inductor's C++ backend with overlap on (``autopar.overlap.overlap_backend``, mode
"peak-memory"), and read the generated wrapper code, telling units apart by the parameter shard
each all-gather reads: in the forward, each block's and the head's all-gathers are launched before
the first matmul of the unit before them and waited after it; in the backward, the linears' weights
are gathered again (not kept from the forward), the re-gathers of the unit next in line are
launched before the current unit's first matmul, and a reduce-scatter issued during a unit's
backward is waited only after the next unit's first matmul. Loss and every gradient match the
eager run. The planning tests price the same overlap offline, on the meta device."""
from __future__ import annotations

import re

import pytest
import torch

import pool
from autopar.cost_model.devices import get_device
from autopar.cost_model.step import dp_sync_time, unit_sync_times, zero_exposed_time, zero_unit_figures
from autopar.examples.gpt import build, example_inputs
from autopar.mesh import Mesh
from autopar.overlap import code_events, collective_gaps
from autopar.graph.units import zero_units
from autopar.planner.decide import decide


# ---- the price (no processes) ------------------------------------------------------------------

def test_exposed_time_by_hand():
    one = [1.0, 1.0, 1.0]
    ahead = dict(backward_prefetch=True)
    # no compute: nothing hides, every collective of the three units is exposed
    assert zero_exposed_time(one, one, one, [0.0] * 3, **ahead) == pytest.approx(9.0)
    assert zero_exposed_time(one, one, one, [0.0] * 3) == pytest.approx(9.0)
    # forward 1 s and backward 2 s per unit: a gather hides behind the unit before it, a re-gather and
    # a reduce-scatter together behind the unit between them; the first of each pass and the last
    # reduce-scatter remain
    assert zero_exposed_time(one, one, one, [3.0] * 3, **ahead) == pytest.approx(3.0)
    # in place, the backward's six collectives stay exposed: only the forward's later gathers hide
    assert zero_exposed_time(one, one, one, [3.0] * 3) == pytest.approx(1.0 + 6.0)
    # forward 0.75 s leaves 0.25 s of each later gather; backward 1.5 s hides a lone re-gather or
    # reduce-scatter, but only 1.5 of the 2 s the middle unit's window carries
    assert zero_exposed_time(one, one, one, [2.25] * 3, **ahead) == pytest.approx(1.5 + 2.5)
    assert zero_exposed_time(one, one, one, [2.25] * 3) == pytest.approx(1.5 + 6.0)
    # ZeRO-2 has no re-gathers; one unit hides nothing
    assert zero_exposed_time(one, [0.0] * 3, one, [3.0] * 3, **ahead) == pytest.approx(2.0)
    assert zero_exposed_time([1.0], [1.0], [1.0], [100.0], **ahead) == pytest.approx(3.0)


@pytest.fixture(scope="module")
def planned():
    model = build("gpt3-1.3b", device="meta")
    x = example_inputs(model.config, 8, 2048, device="meta")
    return decide(model, (8, 1, 1), x, device="h100", zero=3, keep_gathered=())   # every unit resharded


def test_zero3_prefetch_hides_part_of_the_dp_traffic(planned):
    cap, strategies, plan = planned
    dev, mesh = get_device("h100"), Mesh(*plan.mesh)
    figures = zero_unit_figures(strategies, zero_units(cap), mesh.tp, dev, False)
    assert len(figures) == 24 + 2   # the embedding, 24 blocks, the head
    # the units' compute is the plan's (one microbatch, no pipeline)
    assert sum(s for _, s in figures) == pytest.approx(plan.predicted_compute_s, rel=1e-9)
    gather, regather, scatter = unit_sync_times([b for b, _ in figures], mesh, dev, 3, 8)
    total = sum(gather) + sum(regather) + sum(scatter)
    exposed = dp_sync_time(0.0, mesh, dev, 3, 8, units=figures)
    assert exposed == pytest.approx(zero_exposed_time(gather, regather, scatter, [s for _, s in figures]))
    assert gather[0] <= exposed < total
    # the forward's gathers hide behind the unit before; the backward's stay where the graph has them
    forward = gather[0] + sum(max(0.0, gather[k] - figures[k - 1][1] / 3) for k in range(1, len(figures)))
    assert exposed == pytest.approx(forward + sum(regather) + sum(scatter)) and forward < sum(gather)
    # in fp32 a block computes far longer than a unit's collectives take on H100 NVLink: reordered
    # (backward_prefetch), little is left beyond the embedding's gathers, the next unit's (behind
    # the embedding's short compute) and the last reduce-scatter
    ahead = zero_exposed_time(gather, regather, scatter, [s for _, s in figures], backward_prefetch=True)
    assert gather[0] <= ahead < total / 2 < exposed


def test_pipeline_rank_units_are_the_busiest_ranks():
    from autopar.cost_model.memory import unit_params
    from autopar.cost_model.stages import rank_param_bytes, unit_costs
    from autopar.cost_model.step import rank_unit_figures
    from autopar.graph.units import layer_units, override_bounds

    model = build("gpt3-1.3b", device="meta", n_layer=4)
    cap, strategies, plan = decide(model, (4, 2, 1), example_inputs(model.config, 16, 2048, device="meta"),
                                   device="h100", zero=3, keep_gathered=())
    dev, mesh, units = get_device("h100"), Mesh(*plan.mesh), layer_units(cap)
    time = unit_costs(cap, strategies, units, mesh, dev, gpus_per_node=8)[0]
    params = unit_params(cap, strategies, units, mesh.tp)
    bounds = override_bounds([s.modules for s in plan.stages], units, len(plan.stages))
    figures = rank_unit_figures(time, params, bounds, mesh)
    assert sum(b for b, _ in figures) == pytest.approx(rank_param_bytes(params, bounds, mesh))
    assert 0 < len(figures) < len(units)   # one of the two pipeline ranks' units
    total = dp_sync_time(sum(b for b, _ in figures), mesh, dev, 3, 8, microbatches=plan.microbatches)
    assert 0 < dp_sync_time(0.0, mesh, dev, 3, 8, microbatches=plan.microbatches, units=figures) < total


# ---- the rank graph (one process, nothing run) ---------------------------------------------------

def test_zero_pass_launches_each_gather_where_the_unit_before_starts():
    from autopar import collectives as C
    from autopar.graph.capture import capture_pass
    from autopar.passes.zero import zero_pass
    from parity import SEQ, TINY, make_model

    cap = capture_pass(make_model(), example_inputs(TINY, 4, SEQ), require_loss=True)
    units = [[n.name for n in u.nodes] for u in zero_units(cap)]
    rows = {f: n.meta["val"].shape[0] for f, n in cap.params.items()}
    gm = zero_pass(cap.gm, units=units, rows=rows, group="0", size=2, dtype=None, reshard=set(range(len(units))),
                   recomputed=set(units[2]))
    nodes = list(gm.graph.nodes)
    at = {n: i for i, n in enumerate(nodes)}
    unit_of = {name: k for k, names in enumerate(units) for name in names}
    starts = {}
    for n in nodes:
        if n.op == "call_function" and n.meta.get("origin", n.name) in unit_of:
            starts.setdefault(unit_of[n.meta.get("origin", n.name)], at[n])
    waits = [n for n in nodes if n.target in (C.gather_param, C.sharded_linear)]
    prefetched = 0
    for w in waits:
        pending = w.args[-1]
        k = int(pending.meta["origin"].split(".")[1]) if pending is not None else unit_of[w.meta["origin"]]
        if pending is None:   # only block 1's linears, which a recompute region would re-run
            assert w.target is C.sharded_linear and k == 2, w
            continue
        assert pending.target is C.prefetch_gather and pending.args[0] is w.args[w.target is C.sharded_linear]
        before = max(u for u in starts if u < k) if k > 0 else k
        assert at[pending] < starts[before], f"{pending} is launched after unit {before} starts"
        assert at[w] > starts[before] or k == 0, f"{w} waits before unit {before} starts"
        prefetched += 1
    linears = sum(1 for w in waits if w.target is C.sharded_linear)
    assert linears == 9 and prefetched == len(waits) - 4   # 4 linears per block, the tied head
    # without prefetch (eager on gloo) every gather and linear gathers its weights where it runs
    plain = zero_pass(cap.gm, units=units, rows=rows, group="0", size=2, dtype=None,
                      reshard=set(range(len(units))), prefetch=False)
    assert not any(n.target is C.prefetch_gather for n in plain.graph.nodes)
    pendings = [n.args[-1] for n in plain.graph.nodes if n.target in (C.gather_param, C.sharded_linear)]
    assert pendings == [None] * len(waits)


# ---- the compiled per-rank code (2 gloo ranks) ---------------------------------------------------

def _step(rank, world, compile_):
    import autopar
    from autopar import collectives as C
    from parity import ZERO_BATCH, ZERO_CFG, ZERO_SEQ, make_model
    from torch._inductor.utils import run_and_get_code

    # test_zero_memory's model and batch: its zero=3 compile (the pool runs it first) is this
    # one's plain-Inductor run, from Inductor's cache
    model = make_model(ZERO_CFG)
    idx, tgt = example_inputs(ZERO_CFG, ZERO_BATCH, ZERO_SEQ)
    pm = autopar.parallelize(model, (2, 1, 1), (idx, tgt), zero=3, compile=compile_, keep_gathered=())
    if compile_:
        loss, codes = run_and_get_code(pm.train_step, idx, tgt)
    else:
        loss, codes = pm.train_step(idx, tgt), []
    grads = {n: p.grad.clone() for n, p in pm.named_parameters()}
    # the units that gather each parameter (forward order) and the graph's inputs in the order the
    # compiled graph takes them (its primals): dynamo makes an input where the code first reads it
    cap = pm.graph_module
    read = list(dict.fromkeys(a for n in cap.graph.nodes for a in n.all_input_nodes if a.op == "placeholder"))
    fqns = [n.meta.get("fqn") if n.meta.get("kind") == "param" else None for n in read]
    shapes = [tuple(n.meta["val"].shape) for n in read]
    units, linears = {}, {}
    for n in cap.graph.nodes:
        if n.target is C.prefetch_gather:
            units.setdefault(n.args[0].meta["fqn"], []).append(int(n.meta["origin"].split(".")[1]))
        # what the backward gathers again, for the unit of its wait (the eager run on gloo launches
        # each gather where it is used: no prefetch to read the unit from)
        if n.target is C.sharded_linear and n.args[-1] is not None:
            linears[n.args[1].meta["fqn"]] = [int(n.args[-1].meta["origin"].split(".")[1])]
    return float(loss), grads, codes, fqns, shapes, (units, linears)


def _runs(rank, world):
    from autopar.overlap import overlap_backend
    # "peak-memory": the "scheduler" mode's global order of collectives makes every backward launch
    # wait for the collective before it, so no reduce-scatter outlives its unit there
    return (_step(rank, world, False), _step(rank, world, overlap_backend("peak-memory")),
            _step(rank, world, True))


# eager, overlap on, overlap off; Inductor's default cache directory, shared by both ranks: warm
# runs take seconds, not minutes
RUNS = pool.job(2, _runs, timeout=900, lane="inductor")


@pytest.fixture(scope="module")
def runs():
    return RUNS.result()


_PRIMAL = re.compile(r"^\s*(primals_(\d+)) = rand_strided\(\(([\d, ]*)\)", re.M)


def _inputs(code: str, fqns, shapes) -> dict[str, str]:
    """primals_k -> the FQN of the parameter it is, checked against the shapes the code was compiled for."""
    given = {name: (int(k), tuple(int(d) for d in dims.replace(" ", "").split(",") if d))
             for name, k, dims in _PRIMAL.findall(code)}
    out = {}
    for name, (k, shape) in given.items():
        assert shape == shapes[k - 1], f"{name} has shape {shape}, input {k - 1} of the graph {shapes[k - 1]}"
        if fqns[k - 1] is not None:
            out[name] = fqns[k - 1]
    return out


def _gathers(events, inputs, units) -> dict[str, int]:
    """All-gather result buffer -> the unit it gathers for, by the parameter shard it reads: a weight
    two units gather (the tied embedding) is theirs in the order its gathers are launched."""
    seen: dict[str, int] = {}
    out = {}
    for e in events:
        if e.kind == "launch" and e.op == "all_gather_into_tensor":
            fqn = next(inputs[n] for n in e.names[1:] if n in inputs)
            k = seen.get(fqn, 0)
            seen[fqn] = k + 1
            out[e.names[0]] = units[fqn][min(k, len(units[fqn]) - 1)]
    return out


def _matmuls(events, gathered: dict[str, int]) -> dict[int, list[int]]:
    """Unit -> the positions of the matmuls that read a weight gathered for it."""
    out: dict[int, list[int]] = {}
    for i, e in enumerate(events):
        if e.kind == "compute" and "mm" in e.op:
            for u in {gathered[n] for n in e.names if n in gathered}:
                out.setdefault(u, []).append(i)
    return out


def test_forward_gathers_are_launched_one_unit_ahead(runs):
    for rank, (_, (_, _, codes, fqns, shapes, (units, _)), _) in enumerate(runs):
        assert len(codes) == 2, "expected one forward and one backward graph"
        forward = code_events(codes[0])
        gathered = _gathers(forward, _inputs(codes[0], fqns, shapes), units)
        matmuls = _matmuls(forward, gathered)
        launch = {b: i for i, e in enumerate(forward) if e.kind == "launch" for b in e.names[:1]}
        wait = {e.names[0]: i for i, e in enumerate(forward) if e.kind == "wait"}
        # the blocks (units 1 and 2) and the unit after each; the embedding computes no matmul (the
        # head's reads its gathered table: Inductor merges the tied weight's two gathers into one)
        for u in (1, 2):
            later = [b for b, v in gathered.items() if v == u + 1]
            assert later and matmuls.get(u), f"rank {rank}: no gathers of unit {u + 1} or matmuls of unit {u}"
            first = matmuls[u][0]
            assert all(launch[b] < first < wait[b] for b in later), (
                f"rank {rank}: unit {u + 1}'s gathers are not in flight across unit {u}'s first matmul: "
                f"launched at {sorted(launch[b] for b in later)}, waited at {sorted(wait[b] for b in later)}, "
                f"matmul at {first}")


def test_backward_regathers_ahead_and_reduce_scatters_waited_late(runs):
    for rank, (_, (_, _, codes, fqns, shapes, (_, units)), _) in enumerate(runs):
        backward = code_events(codes[1])
        gathered = _gathers(backward, _inputs(codes[1], fqns, shapes), units)
        # ZeRO-3 gathers every block linear's weight again in the backward, and nothing else: the
        # head's weight is the tied embedding, gathered once for both and kept to the backward
        matmuls = _matmuls(backward, gathered)
        assert set(matmuls) == {1, 2}, f"rank {rank}: the backward re-gathers for units {sorted(matmuls)}"
        assert len(gathered) == 8, f"rank {rank}: {len(gathered)} re-gathers, expected one per block linear"
        first = {u: ms[0] for u, ms in matmuls.items()}
        launch = {e.names[0]: i for i, e in enumerate(backward) if e.kind == "launch"}
        wait = {e.names[0]: i for i, e in enumerate(backward) if e.kind == "wait"}
        for u in (2,):   # block 1's backward runs before block 0's
            ahead = [launch[b] for b, v in gathered.items() if v == u - 1]
            assert max(ahead) < first[u], (f"rank {rank}: unit {u - 1}'s re-gathers are launched at {ahead}, "
                                           f"not all before unit {u}'s first backward matmul ({first[u]})")
            # the reduce-scatters issued during unit u's backward: one at least still in flight when
            # the next unit computes
            during = [b for b, i in launch.items() if backward[i].op == "reduce_scatter_tensor"
                      and first[u] < i < first[u - 1]]
            assert during, f"rank {rank}: no reduce-scatter launched during unit {u}'s backward"
            assert any(wait[b] > first[u - 1] for b in during), (
                f"rank {rank}: every reduce-scatter of unit {u}'s backward is waited (at "
                f"{sorted(wait[b] for b in during)}) before unit {u - 1}'s first matmul ({first[u - 1]})")


def test_prefetch_survives_plain_inductor(runs):
    # overlap off, Inductor moves no launch away from its wait by itself (without the zero pass's
    # prefetch every gather is waited right after it is launched); the prefetch still leaves
    # matmuls between some gathers' launches and their waits
    for rank, (*_, (_, _, codes, *_)) in enumerate(runs):
        gaps = [g for g in collective_gaps(codes[0]) if g.op == "all_gather_into_tensor"]
        assert any("mm" in c for g in gaps for c in g.compute), f"rank {rank}: no gather in flight across a matmul"


def test_prefetched_compiled_step_matches_eager(runs):
    for rank, ((loss_eager, grads_eager, *_), *compiled) in enumerate(runs):
        for loss, grads, *_ in compiled:
            assert loss == pytest.approx(loss_eager, rel=1e-5, abs=1e-5)
            assert grads.keys() == grads_eager.keys()
            for name, g in grads_eager.items():
                torch.testing.assert_close(grads[name], g, rtol=1e-5, atol=1e-5, msg=f"rank {rank} grad {name}")
