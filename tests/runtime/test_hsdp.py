"""HSDP: dp split into dp_replicate x dp_shard, ZeRO sharding over dp_shard and the sharded gradients
all-reduced across the replicas (FSDP2's ``fully_shard`` on a 2-D mesh).

On 4 gloo ranks, (dp_replicate=2, dp_shard=2) at ZeRO 1, 2 and 3 against the unsharded model: loss,
every gathered gradient and AdamW steps, with a plain torch optimizer over ``pm.parameters()`` and
with ``pm.optimizer``; each rank holds 1/dp_shard of every parameter's rows, the same rows as its
replica; the collectives a step issues (reduce-scatter and all-gather on the shard group, all-reduce
on the replicate group) are the plan's; a checkpoint moves between the HSDP mesh and a plain one.
Offline (meta device): mesh parsing, the plan's record of the split, and its pricing on 2 nodes of 8."""
from __future__ import annotations

import functools
import dataclasses
import json
from collections import Counter
from pathlib import Path

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

import autopar
import pool
from autopar import collectives as C
from autopar.checkpoint import load_checkpoint, save_checkpoint
from autopar.cost_model.comm import collective_time
from autopar.cost_model.devices import get_device
from autopar.cost_model.step import unit_sync_times
from autopar.errors import PlanError
from autopar.examples.gpt import build, example_inputs
from autopar.mesh import Mesh
from autopar.passes.zero import shard_rows
from autopar.plans import Plan
from parity import SEQ, TINY, adamw_for, make_model, pm_curve, reference, train_curve

HSDP = {"dp_replicate": 2, "dp_shard": 2}
STEPS, LR, BATCH = 3, 1e-3, 8
# (zero, optimizer): plain = torch.optim.AdamW(pm.parameters()), own = pm.optimizer(AdamW)
CASES = [(2, "plain"), (3, "own"), (1, "own")]
_OPS = torch.ops._c10d_functional
_KIND = {_OPS.all_gather_into_tensor.default: "all_gather", _OPS.reduce_scatter_tensor.default: "reduce_scatter",
         _OPS.all_reduce.default: "all_reduce", _OPS.all_reduce_.default: "all_reduce"}


class _Collectives(TorchDispatchMode):
    """Bytes of the functional collectives issued while active, by (kind, group name) (the tensor
    a ring collective is priced on: an all-gather's output, the others' input)."""

    def __init__(self):
        super().__init__()
        self.bytes = Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func in _KIND:
            x, group = args[0], args[-1]
            n = x.numel() * x.element_size() * (args[1] if _KIND[func] == "all_gather" else 1)
            self.bytes[(_KIND[func], group)] += n
        return func(*args, **(kwargs or {}))


def _one(rank, world, zero, optimizer):
    idx, tgt = example_inputs(TINY, BATCH, SEQ)
    plan = "auto"
    if zero == 3:   # every unit resharded: the planner keeps this tiny model's blocks gathered (they fit)
        plan = dataclasses.replace(autopar.plan(make_model(), HSDP, (idx, tgt), device="cpu", zero=3), keep_gathered=())
    pm = autopar.parallelize(make_model(), HSDP, (idx, tgt), zero=zero, plan=plan, device="cpu", compile=False)
    axis_of = {pm.group(a): a for a in ("dp_shard", "dp_replicate")}
    with _Collectives() as seen:
        loss = pm.train_step(idx, tgt).item()
    issued = Counter()
    for (kind, group), n in seen.bytes.items():
        if group in axis_of:
            issued[(kind, axis_of[group])] += n
    # the graph's gathers: on the shard group, their gradients all-reduced on the replicate group
    graphs = [m.graph for m in pm.graph_module.modules() if isinstance(m, torch.fx.GraphModule)]
    groups = [(n.args[1] if n.target is C.gather_param else n.args[2], n.kwargs.get("replicate"))
              for g in graphs for n in g.nodes if n.target in (C.gather_param, C.sharded_linear)]
    grads = pm.full_grads()
    held = {fqn: (p.shape[0], pm.plan.param(fqn).local_shape[0], pm.dp_rows(fqn)) for fqn, p in pm.named_parameters()}
    curve = pm_curve(pm, adamw_for(pm, optimizer, LR), (idx, tgt), STEPS)
    shards = {fqn: p.detach().clone() for fqn, p in pm.named_parameters()}
    planned = Counter()
    for c in pm.plan.collectives:
        if c.axis in ("dp_shard", "dp_replicate"):
            planned[(c.kind, c.axis)] += c.bytes
    return dict(loss=loss, grads=grads, curve=curve, held=held, shards=shards, coords=pm.coords, zero=pm.plan.zero,
                issued=dict(issued), planned=dict(planned), groups=groups, names=(pm.group("dp_shard"), pm.group("dp_replicate")),
                local_bytes=sum(4 * torch.Size(q.local_shape).numel() for q in pm.plan.parameters))


def _all(rank, world):
    return [_one(rank, world, *case) for case in CASES]


JOB = pool.job(4, _all, timeout=600)


REFERENCE = functools.partial(reference, TINY, steps=STEPS, lr=LR, batch=BATCH)


@pytest.mark.parametrize("case", CASES, ids=lambda c: f"zero{c[0]}-{c[1]}")
def test_hsdp_matches_one_device(case, ref):
    ref_loss, ref_grads, ref_curve = ref
    runs = [per_rank[CASES.index(case)] for per_rank in JOB.result()]
    for run in runs:
        assert run["zero"] == case[0]
        assert run["loss"] == pytest.approx(ref_loss, rel=1e-5)
        for name, g in ref_grads.items():
            torch.testing.assert_close(run["grads"][name], g, rtol=1e-4, atol=1e-6, msg=name)
        assert run["curve"] == pytest.approx(ref_curve, rel=1e-4)


@pytest.mark.parametrize("case", [c for c in CASES if c[0] >= 2], ids=lambda c: f"zero{c[0]}-{c[1]}")
def test_each_rank_holds_its_shard_share_as_its_replica_does(case):
    runs = [per_rank[CASES.index(case)] for per_rank in JOB.result()]
    assert [(r["coords"]["dp_replicate"], r["coords"]["dp_shard"]) for r in runs] == [(0, 0), (0, 1), (1, 0), (1, 1)]
    for run in runs:
        shard = run["coords"]["dp_shard"]
        for fqn, (held, rows, (start, stop)) in run["held"].items():
            c = shard_rows(rows, 2)   # 1/dp_shard of the rows, not 1/dp
            assert held == c and (start, stop) == (min(rows, shard * c), min(rows, (shard + 1) * c)), fqn
    for a, b in ((0, 2), (1, 3)):   # the two replicas of one shard step the same rows alike
        for fqn, t in runs[a]["shards"].items():
            torch.testing.assert_close(runs[b]["shards"][fqn], t, rtol=0, atol=0, msg=fqn)
    assert not torch.equal(runs[0]["shards"]["transformer.wte.weight"], runs[1]["shards"]["transformer.wte.weight"])


@pytest.mark.parametrize("case", [(2, "plain"), (3, "own")], ids=lambda c: f"zero{c[0]}-{c[1]}")
def test_step_collectives_are_the_plans(case):
    zero = case[0]
    for run in (per_rank[CASES.index(case)] for per_rank in JOB.result()):
        issued, planned, local = run["issued"], run["planned"], run["local_bytes"]
        assert set(issued) == set(planned) == {("all_gather", "dp_shard"), ("reduce_scatter", "dp_shard"),
                                               ("all_reduce", "dp_replicate")}
        # every gradient reduce-scattered over the shard group once, its half all-reduced across replicas
        assert issued[("reduce_scatter", "dp_shard")] == local == pytest.approx(planned[("reduce_scatter", "dp_shard")], abs=1)
        assert issued[("all_reduce", "dp_replicate")] == local // 2
        assert planned[("all_reduce", "dp_replicate")] == pytest.approx(local / 2, abs=1)
        if zero == 2:   # the weights gathered once per step (the tied embedding once for both its units)
            assert issued[("all_gather", "dp_shard")] == local == pytest.approx(planned[("all_gather", "dp_shard")], abs=1)
        if zero == 3:   # and the blocks' linear weights again in the backward, as the plan prices them
            regathered = issued[("all_gather", "dp_shard")] - local
            assert 0 < regathered < local
            assert issued[("all_gather", "dp_shard")] == pytest.approx(planned[("all_gather", "dp_shard")], abs=1)
        assert run["groups"] and set(run["groups"]) == {run["names"]}


# ---- checkpoints across an HSDP mesh and a plain one -------------------------------------------

CKPT = [(HSDP, 3, 2), ((4, 1, 1), 1, 2), (HSDP, 1, 2)]   # (mesh, zero, steps), each resuming the last


def _checkpoints(rank, world, workdir):
    idx, tgt = example_inputs(TINY, BATCH, SEQ)
    losses, root = [], Path(workdir)
    for k, (mesh, zero, steps) in enumerate(CKPT):
        pm = autopar.parallelize(make_model(), mesh, (idx, tgt), zero=zero, compile=False)
        opt = pm.optimizer(torch.optim.AdamW, lr=LR)
        if k:
            load_checkpoint(pm, opt, root / str(k - 1))
        for _ in range(steps):
            opt.zero_grad()
            losses.append(pm.train_step(idx, tgt).item())
            opt.step()
        save_checkpoint(pm, opt, root / str(k), step=len(losses))
    return losses


CKPT_JOB = pool.job(4, _checkpoints, workdir=True, timeout=300)


def test_checkpoints_move_between_hsdp_and_plain_meshes():
    want = train_curve(make_model(), *example_inputs(TINY, BATCH, SEQ), sum(s for _, _, s in CKPT), LR)
    for losses in CKPT_JOB.result():
        assert losses == pytest.approx(want, rel=1e-4)


# ---- offline: the mesh, the plan, the prices ---------------------------------------------------

def test_mesh_dicts():
    m = Mesh.parse({"dp_replicate": 2, "dp_shard": 4, "tp": 2})
    assert (m.dp, m.pp, m.tp, m.dp_replicate, m.dp_shard, m.world_size) == (8, 1, 2, 2, 4, 16)
    assert m.dims() == (("dp_replicate", 2), ("dp_shard", 4), ("pp", 1), ("tp", 2))
    # rank order: dp_replicate outermost, then dp_shard, pp, tp; dp index = replica * dp_shard + shard
    assert m.coords(13) == {"dp": 6, "dp_replicate": 1, "dp_shard": 2, "pp": 0, "cp": 0, "tp": 1}
    assert (m.inner_size("dp_replicate"), m.inner_size("dp_shard"), m.inner_size("dp")) == (8, 2, 2)
    assert Mesh.parse({"dp": 4, "tp": 2}) == Mesh(4, 1, 2) == Mesh.parse("4,1,2") == Mesh.parse((4, 1, 2))
    assert Mesh.parse({"dp": 4}).dp_shard == 4 and not Mesh.parse({"dp": 4}).split   # one replica of 4 shards
    assert Mesh.parse({"pp": 2}) == Mesh(1, 2, 1)
    assert str(m) == "(dp_replicate=2, dp_shard=4, pp=1, tp=2)" and m.dp_text() == "dp=8 (2 replicas x 4 shards)"


@pytest.mark.parametrize("bad, message", [
    ({"dp_replicate": 2, "ep": 2}, r"unknown mesh axis 'ep'; the known axes are dp, dp_replicate, dp_shard, pp, cp, tp"),
    ({"dp": 4, "dp_shard": 2}, r"give dp whole, or split as dp_replicate x dp_shard, not both"),
    ({"dp_shard": 0}, r"dp_shard must be a positive integer"),
    ({"dp_replicate": 1.5}, r"dp_replicate must be a positive integer"),
])
def test_bad_mesh_dicts(bad, message):
    with pytest.raises(ValueError, match=message):
        Mesh.parse(bad)


def test_mesh_must_cover_the_world():
    with pytest.raises(ValueError, match=r"mesh \(dp_replicate=2, dp_shard=2, pp=1, tp=2\) needs 8 ranks but the "
                                         r"world has 4; launch 8 processes or change the mesh"):
        Mesh.parse({**HSDP, "tp": 2}).check_world(4)
    Mesh.parse(HSDP).check_world(4)


@pytest.fixture(scope="module")
def tiny():
    return make_model(), example_inputs(TINY, BATCH, SEQ)


def test_plan_records_the_split(tiny):
    model, x = tiny
    plan = autopar.plan(model, HSDP, x, device="cpu", zero=2)
    assert plan.mesh == (4, 1, 1) and (plan.dp_replicate, plan.dp_shard) == (2, 2)
    assert plan.param("transformer.wte.weight").placements == {"dp_replicate": "R", "dp_shard": "S(0)", "tp": "R"}
    assert "for mesh dp=4 (2 replicas x 2 shards) pp=1 tp=1" in plan.summary()
    assert {(c.kind, c.axis, c.phase) for c in plan.collectives if c.axis.startswith("dp")} == {
        ("all_gather", "dp_shard", "fwd"), ("reduce_scatter", "dp_shard", "bwd"), ("all_reduce", "dp_replicate", "bwd")}
    assert Plan.from_json(plan.to_json()) == plan
    with pytest.raises(dataclasses.FrozenInstanceError):
        plan.dp_replicate = 1
    # a plan file written before the split was recorded (no dp_replicate, placements on dp): an unsplit dp
    old = json.loads(plan.to_json())
    del old["dp_replicate"]
    for p in old["parameters"]:
        p["placements"] = {"dp": "S(0)", "tp": p["placements"]["tp"]}
    old = Plan.from_json(json.dumps(old))
    assert old.dp_replicate == 1 and old.dp_shard == 4 and "for mesh dp=4 pp=1 tp=1" in old.summary()
    assert "dp_replicate: 2 -> 1" in plan.diff(old)
    # a plan for one split does not run on another
    with pytest.raises(PlanError, match=r"plan.mesh \(dp=4, pp=1, tp=1\) does not match the mesh "
                                        r"\(dp_replicate=2, dp_shard=2, pp=1, tp=1\)"):
        autopar.plan(model, HSDP, x, device="cpu", plan=old)


def test_zero_notes_on_a_split_dp(tiny):
    model, x = tiny
    plain = autopar.plan(model, HSDP, x, device="cpu", zero=0)
    assert plain.zero == 0 and any("zero=0 shards nothing: the gradients are all-reduced over all 4 dp ranks" in n
                                   for n in plain.notes)
    assert {(c.kind, c.axis) for c in plain.collectives if c.axis.startswith("dp")} == {("all_reduce", "dp")}
    replicated = autopar.plan(model, {"dp_replicate": 4}, x, device="cpu", zero=3)   # replicas of one shard each
    assert replicated.zero == 0 and any("dp_shard=1" in n and "nothing to shard" in n for n in replicated.notes)


@pytest.fixture(scope="module")
def gpt2():
    model = build("gpt2", device="meta")
    return model, example_inputs(model.config, 16, 1024, device="meta")


def test_two_nodes_price_the_replicas_all_reduce_on_a_shards_bytes(gpt2):
    """HSDP on 2 nodes of 8: reduce-scatter and all-gather inside a node, the all-reduce across the two
    nodes on 1/8 of the bytes; ZeRO state divided by 8, not 16."""
    model, x = gpt2
    dev = get_device("h100")
    split = {"dp_replicate": 2, "dp_shard": 8}
    plan = autopar.plan(model, split, x, device="h100", gpus_per_node=8, zero=1)
    nbytes = sum(4 * torch.Size(p.local_shape).numel() for p in plan.parameters)
    reduced = {(c.kind, c.axis): c.bytes for c in plan.collectives}
    assert reduced[("all_reduce", "dp_replicate")] == pytest.approx(nbytes / 8, abs=1)
    by_hand = (collective_time("reduce_scatter", nbytes, 8, dev, inter_node=False)
               + collective_time("all_reduce", nbytes / 8, 2, dev, inter_node=True)
               + collective_time("all_gather", nbytes, 8, dev, inter_node=False))
    assert plan.predicted_comm_s == pytest.approx(by_hand, rel=1e-9)
    flat = autopar.plan(model, (16, 1, 1), x, device="h100", gpus_per_node=8, zero=1)
    # plain dp: every byte crosses the nodes, on the 8 NICs of each node at once (8 of its ranks per node)
    assert flat.predicted_comm_s == pytest.approx(collective_time("reduce_scatter", nbytes, 16, dev, 8)
                                                  + collective_time("all_gather", nbytes, 16, dev, 8), rel=1e-9)
    assert plan.memory[0].optimizer == pytest.approx(2 * flat.memory[0].optimizer)   # 1/8 of the state, not 1/16
    # ZeRO-2/3 per unit: each reduce-scatter followed by the replicas' all-reduce of its shard
    mesh = Mesh.parse(split)
    gather, regather, scatter = unit_sync_times([1e6, 3e6], mesh, dev, 3, 8)
    for b, g, h, s in zip([1e6, 3e6], gather, regather, scatter):
        assert g == h == pytest.approx(collective_time("all_gather", b, 8, dev, False))
        assert s == pytest.approx(collective_time("reduce_scatter", b, 8, dev, False)
                                  + collective_time("all_reduce", b / 8, 2, dev, True))
