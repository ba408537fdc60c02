"""One rank's program as data (``autopar.runtime.program.program_for``), built for every rank of a mesh in
one process without any process group: the passes per rank and their options, the parameters each rank
holds at which local shapes (they add up to the full ones, and the shards made from them rebuild every
weight), the pipeline stages, the process groups by axis and ZeRO's pieces, on (2, 2, 2), HSDP and cp
meshes. Each rank's graph is rewritten from its program without a process group and split into the
stages the program names. On gloo ranks, ``parallelize`` builds the same programs and holds exactly the
shards they name."""
from __future__ import annotations

import functools

import pytest
import torch
import torch.distributed as dist

import autopar
import pool
from autopar import collectives as C
from autopar.examples.gpt import GPT, example_inputs
from autopar.passes.pipeline_split import pipeline_split_pass
from autopar.placement import Shard
from autopar.planner.decide import rebuild
from autopar.runtime.groups import Groups
from autopar.runtime.lowering import node_stages, rewritten
from autopar.runtime.parameters import materialize
from autopar.runtime.program import FromPre, program_for
from parity import SEQ, TINY, make_model

BATCH = 8
HSDP = {"dp_replicate": 2, "dp_shard": 2}
CP = {"dp": 2, "cp": 2}
# mesh, knobs: each ZeRO path, tp, pp, cp and their groups
MESHES = {"3d-zero3": ((2, 2, 2), dict(zero=3)), "hsdp-zero3": (HSDP, dict(zero=3)), "hsdp-zero1": (HSDP, dict(zero=1)),
          "cp-zero1": (CP, dict(zero=1)), "cp-zero3": (CP, dict(zero=3)), "pp-cp-tp-bf16": ({"pp": 2, "cp": 2, "tp": 2}, dict(precision="bf16"))}


def _inputs():
    return example_inputs(TINY, BATCH, SEQ)


@functools.cache
def _planned(name: str, device: str = "meta"):
    """(model, plan, capture, strategies) of ``MESHES[name]``, the model on ``device``."""
    mesh, knobs = MESHES[name]
    model = make_model() if device != "meta" else _meta_model()
    plan = autopar.plan(model, mesh, _inputs(), device="cpu", **knobs)
    cap, strategies = rebuild(model, plan, _inputs())
    return model, plan, cap, strategies


def _meta_model():
    with torch.device("meta"):
        return GPT(TINY)


def _programs(name: str, device: str = "meta"):
    model, plan, cap, strategies = _planned(name, device)
    world = autopar.Mesh.of_plan(plan).world_size
    return [program_for(plan, r, cap, strategies) for r in range(world)]


def _options(program, name: str) -> dict:
    return next(s.options for s in (*program.pre, *program.passes) if s.name == name)


def test_every_rank_of_a_3d_mesh_is_built_without_a_process_group():
    programs = _programs("3d-zero3")
    assert not dist.is_initialized()
    assert len(programs) == 8
    for r, p in enumerate(programs):
        assert p.rank == r and p.coords == p.mesh.coords(r)
        # the loss a mean over the step's tokens; captured on meta; tp; ZeRO-3's gathers
        assert p.pass_names == ["token_mean_pass", "device_pass", "shard_pass", "zero_pass"]
        shard = _options(p, "shard_pass")
        assert (shard["rank"], shard["size"], shard["group"]) == (p.coords["tp"], 2, "tp")
        zero = _options(p, "zero_pass")
        assert (zero["group"], zero["size"], zero["replicate"], zero["replicas"]) == ("dp", 2, None, 1)
        assert p.stages == (p.coords["pp"],)
        assert p.axes == ("dp", "pp", "tp", "dp_shard")
        assert p.fsdp and not p.zero1 and p.regather and not p.runs_whole
        assert p.casts == "fp32" and not p.main_grads
    # the tied embedding and output weight is on both pipeline ranks, counted by the first
    tied = programs[0].holders["transformer.wte.weight"]
    assert tied == (0, 1) and programs[0].owns("transformer.wte.weight")
    assert not programs[2].owns("transformer.wte.weight")


@pytest.mark.parametrize("name", list(MESHES))
def test_local_shapes_add_up_to_the_full_ones(name):
    _, plan, cap, _ = _planned(name)
    programs = _programs(name)
    assert set().union(*(p.params for p in programs)) == set(cap.params)
    for fqn in cap.params:
        q = plan.param(fqn)
        holding = [p for p in programs if fqn in p.params]
        # every rank of the pipeline ranks that hold it, and no other
        assert {p.coords["pp"] for p in holding} == set(programs[0].holders[fqn])
        assert len(holding) == len(programs) // programs[0].mesh.pp * len(programs[0].holders[fqn])
        for p in holding:
            s = p.params[fqn]
            assert s.shape == tuple(q.shape) and s.local_shape == plan.held_shape(q)
            if isinstance(s.placement, Shard) and p.mesh.tp > 1:
                d = s.placement.dim
                assert s.sharded and s.tp_shape[d] * p.mesh.tp == s.shape[d]
            else:
                assert not s.sharded and s.tp_shape == s.shape
        # ZeRO-2/3: the dp_shard ranks' rows tile the tp shard, the same on every replica
        if holding[0].fsdp:
            for key in {(p.coords["pp"], p.coords["tp"], p.coords["dp_replicate"], p.coords["cp"]) for p in holding}:
                rows = sorted(p.params[fqn].rows for p in holding
                              if (p.coords["pp"], p.coords["tp"], p.coords["dp_replicate"], p.coords["cp"]) == key)
                assert rows[0][0] == 0 and rows[-1][1] == holding[0].params[fqn].tp_shape[0]
                assert all(a[1] == b[0] for a, b in zip(rows, rows[1:]))
                assert all(stop - start <= holding[0].params[fqn].local_shape[0] for start, stop in rows)
        else:
            assert all(p.params[fqn].rows is None for p in holding)


def test_the_shards_each_rank_materialises_rebuild_every_weight():
    """From a real model, without process groups: each rank's tensors at the program's local shapes,
    which put back together (dp rows, then tp shards) are the model's weights."""
    model, plan, _, _ = _planned("3d-zero3", device="cpu")
    programs = _programs("3d-zero3", device="cpu")
    tensors = [materialize(model, p) for p in programs]
    for p, t in zip(programs, tensors):
        assert {f: tuple(x.shape) for f, x in t.items()} == {f: s.local_shape for f, s in p.params.items()}
    full = dict(model.named_parameters())
    for fqn, weight in full.items():
        holders = [(p, t[fqn]) for p, t in zip(programs, tensors) if fqn in t]
        pp = holders[0][0].coords["pp"]
        tp_shards = []
        for tp in range(2):
            mine = sorted(((p.params[fqn].rows, x) for p, x in holders
                           if p.coords["pp"] == pp and p.coords["tp"] == tp), key=lambda rx: rx[0])
            tp_shards.append(torch.cat([x[:stop - start] for (start, stop), x in mine]))
        s = holders[0][0].params[fqn]
        if s.sharded:
            d, k = s.placement.dim, s.placement.interleave
            whole = torch.cat([x.unflatten(d, (k, -1)) for x in tp_shards], d + 1).flatten(d, d + 1)
        else:
            assert torch.equal(tp_shards[0], tp_shards[1])
            whole = tp_shards[0]
        assert torch.equal(whole, weight.detach()), fqn


@pytest.mark.parametrize("name", ["3d-zero3", "pp-cp-tp-bf16"])
def test_each_rank_s_graph_is_rewritten_without_a_process_group_and_split_as_its_program_says(name):
    """The passes run per rank on placeholder groups; the pipeline split of each rank's graph puts
    every parameter on the pipeline ranks the program says (the cp cuts' and tp strategies' options
    computed from the graph the first run left)."""
    _, plan, cap, _ = _planned(name)
    for p in _programs(name):
        if p.mesh.cp > 1:
            assert isinstance(_options(p, "shard_pass")["strategies"], FromPre)
            assert isinstance(p.stage_of, FromPre)
            assert _options(p, "cp_pass")["rank"] == p.coords["cp"]
        gm, start, seconds = rewritten(p, cap)
        assert [name for name, _ in seconds] == p.pass_names
        groups = {a for n in gm.graph.nodes if n.op == "call_function"
                  and (n.target in C.COLLECTIVE_FUNCTIONS or getattr(n.target, "__module__", "") == C.__name__)
                  for a in (*n.args, *n.kwargs.values()) if isinstance(a, str)}
        assert groups and groups <= {p.groups.of(axis) for axis in p.axes}
        split = pipeline_split_pass(gm, node_stages(p, start), len(plan.stages))
        holders: dict[str, set[int]] = {}
        for s, fqns in enumerate(split.stage_params):
            for f in fqns + (split.tail_params if s == len(plan.stages) - 1 else []):
                holders.setdefault(f, set()).add(s % p.mesh.pp)
        assert {f: tuple(sorted(r)) for f, r in holders.items() if f in cap.params} == p.holders


def test_hsdp_and_cp_programs_name_zero_s_groups():
    for p in _programs("hsdp-zero3"):
        zero = _options(p, "zero_pass")
        assert (zero["group"], zero["size"], zero["replicate"], zero["replicas"]) == ("dp_shard", 2, "dp_replicate", 2)
        assert p.axes == ("dp", "dp_shard", "dp_replicate")
    for p in _programs("hsdp-zero1"):
        assert p.zero1 and "zero_pass" not in p.pass_names
        assert (p.groups.dp_shard, p.groups.dp_replicate, p.replicas) == ("dp_shard", "dp_replicate", 2)
    for p in _programs("cp-zero1"):
        assert p.pass_names == ["token_mean_pass", "cp_pass", "device_pass"]
        cp = _options(p, "cp_pass")
        assert (cp["rank"], cp["size"], cp["group"]) == (p.coords["cp"], 2, "cp")
        # the cp ranks hold the same ZeRO-1 slice: its gradient is summed across them
        assert (p.groups.data, p.groups.dp_shard, p.groups.dp_replicate, p.replicas) == ("dp+cp", "dp", "cp", 2)
        assert p.axes == ("dp", "cp", "data", "dp_shard", "dp_replicate")


def test_a_rank_outside_the_mesh_is_refused_in_words():
    _, plan, cap, strategies = _planned("3d-zero3")
    with pytest.raises(ValueError, match=r"rank 8 is outside the plan's mesh \(dp=2, pp=2, tp=2\) of 8 ranks: "
                                         r"pass a rank from 0 to 7"):
        program_for(plan, 8, cap, strategies)
    with pytest.raises(ValueError, match=r"coordinates \{'tp': 1\} do not name one rank"):
        program_for(plan, {"tp": 1}, cap, strategies)
    assert program_for(plan, {"dp": 1, "pp": 1, "tp": 0}, cap, strategies).rank == 6


def _pattern(groups: Groups) -> tuple:
    """Which of the group names are None and which are the same group: what placeholders must share with real groups."""
    names = [groups.of(a) for a in ("dp", "tp", "pp", "cp", "data", "dp_shard", "dp_replicate")]
    return tuple(None if a is None else names.index(a) for a in names)


def _built(rank, world, names):
    """Per mesh: what parallelize's program says and holds, and the program built here without its groups."""
    out = []
    for name in names:
        mesh, knobs = MESHES[name]
        model = make_model()
        pm = autopar.parallelize(model, mesh, _inputs(), device="cpu", compile=False, **knobs)
        cap, strategies = rebuild(make_model(), pm.plan, _inputs())
        alone = program_for(pm.plan, rank, cap, strategies)
        out.append(dict(
            held={f: tuple(p.shape) for f, p in pm.named_parameters()},
            local={f: s.local_shape for f, s in pm.program.params.items()},
            same_params=alone.params == pm.program.params and alone.holders == pm.program.holders,
            same_passes=alone.pass_names == pm.program.pass_names,
            patterns=(_pattern(pm.program.groups), _pattern(alone.groups)),
            axes=pm.program.axes))
    return out


JOBS = {8: pool.job(8, _built, ["3d-zero3"], timeout=600),
        4: pool.job(4, _built, ["hsdp-zero3", "cp-zero1"], timeout=600)}


@pytest.mark.parametrize("world", [8, 4])
def test_parallelize_holds_exactly_what_its_program_names(world):
    for rank in JOBS[world].result():
        for case in rank:
            assert case["held"] == case["local"]
            assert case["same_params"] and case["same_passes"]
            real, placeholder = case["patterns"]
            assert real == placeholder


def test_a_cp_rank_launches_each_zero3_prefetch_before_its_gather():
    """cp's cuts of whole values (nodes of no unit, placed where the graph starts) do not start a unit:
    each gather waits on a launch made before it (the zero pass's lint refused the graph before)."""
    _, _, cap, _ = _planned("cp-zero3")
    for p in _programs("cp-zero3"):
        assert _options(p, "zero_pass")["prefetch"]
        gm, _, _ = rewritten(p, cap)
        order = {n: k for k, n in enumerate(gm.graph.nodes)}
        launches = [n for n in gm.graph.nodes if n.target is C.prefetch_gather]
        assert launches and all(order[n] < order[u] for n in launches for u in n.users)
