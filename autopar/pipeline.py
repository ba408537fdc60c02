"""Pipeline parallelism: layer units, their costs, stage cuts, and the stages at run time.

The ordered units are the embedding (everything before the first block), each repeated
block, and the head (everything after the last block, loss included). The cost model
prices each unit per microbatch under the chosen tensor-parallel strategies
(``cost_model.stages.unit_costs``);
``autopar.stage_dp`` cuts them into stages; ``passes.pipeline_split`` makes the stage
graphs; torch.distributed.pipelining runs them.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
from torch.fx import Node

from autopar.passes.capture import Captured, graph_cached
from autopar.planner import PlanError, enumerate_strategies, find_blocks, strategies_from_plan
from autopar.stage_dp import cut_stages, evaluate_cut


@dataclass(frozen=True)
class Unit:
    name: str
    modules: tuple[str, ...]
    nodes: tuple[Node, ...]


@graph_cached
def layer_units(cap: Captured) -> list[Unit]:
    """Embedding, each block, head: the pieces a stage cut may not split."""
    blocks = find_blocks(cap)
    if not blocks:
        raise PlanError("pipeline parallelism cuts between repeated blocks (an nn.ModuleList of "
                        "identical layers), and this model has none")
    in_block = {n: i for i, b in enumerate(blocks) for n in b}
    before, after, body = [], [], [[] for _ in blocks]
    for n in cap.gm.graph.nodes:
        if n.op != "call_function":
            continue
        if n in in_block:
            body[in_block[n]].append(n)
        else:
            (after if any(body) else before).append(n)
    units = []
    for name, nodes in [("embedding", before)] + [(None, b) for b in body] + [("head", after)]:
        paths = dict.fromkeys(n.meta.get("module_path") for n in nodes if n.meta.get("module_path"))
        mods = tuple(p for p in paths if not any(p.startswith(q + ".") for q in paths))   # outermost only
        if name is None:
            name = min(mods, key=len)
        if nodes:
            units.append(Unit(name, mods, tuple(nodes)))
    return units


def choose_cut(costs, units: list[Unit], mesh, *, schedule: str, microbatches: int, virtual: int,
               memory_budget: float | None, stages=None):
    """The stage cut: the cost model's, or a user's ``stages`` override validated unit by unit."""
    time, static, act, boundary = costs
    kw = dict(p=mesh.pp, m=microbatches, v=virtual, schedule=schedule)
    if stages is None:
        return cut_stages(time, static, act, boundary, memory_budget=memory_budget, **kw)
    return evaluate_cut(_override_bounds(stages, units, mesh.pp * virtual), time, static, act, boundary, **kw)


def _override_bounds(stages, units: list[Unit], n_stages: int):
    if len(stages) != n_stages:
        raise PlanError(f"stages= lists {len(stages)} stages but the mesh and schedule have {n_stages}")
    owner: dict[str, int] = {}
    for s, mods in enumerate(stages):
        for m in mods:
            if m in owner:
                raise PlanError(f"stages=: module {m!r} is listed in stage {owner[m]} and stage {s}")
            owner[m] = s
    def listed(module: str):
        """The stage of ``module`` or of the listed module that contains it."""
        for m, s in owner.items():
            if module == m or module.startswith(m + "."):
                return s
        return None

    placed = []
    for u in units:
        where = {listed(m) for m in u.modules}
        if None in where:
            missing = [m for m in u.modules if listed(m) is None]
            raise PlanError(f"stages=: {', '.join(missing)} (part of {u.name}) is in no stage; "
                            f"list every module of {u.name} in one stage")
        if len(where) > 1:
            raise PlanError(f"stages=: {u.name} is split across stages {sorted(where)}; a layer stays whole")
        placed.append(where.pop())
    known = [m for u in units for m in u.modules]
    unknown = sorted(m for m in owner if not any(k == m or k.startswith(m + ".") or m.startswith(k + ".")
                                                 for k in known))
    if unknown:
        raise PlanError(f"stages=: the model has no module {', '.join(unknown)}")
    if placed != sorted(placed) or sorted(set(placed)) != list(range(n_stages)):
        raise PlanError("stages=: each stage must be a non-empty run of consecutive layers, in order")
    return tuple((placed.index(s), len(placed) - placed[::-1].index(s)) for s in range(n_stages))


# ---- run time ---------------------------------------------------------------------------------

class StageModule(torch.nn.Module):
    """One stage's graph with its (local) parameters and buffers registered, for a PipelineStage.

    ``prepare(fqn, tensor)`` gives what the graph computes with (the step's working copy)."""

    def __init__(self, fn, fqns: list[str], tensors: dict[str, torch.Tensor], prepare):
        super().__init__()
        self.fn = fn
        self.prepare = prepare
        self.fqns = fqns
        self.keys = [f.replace(".", "__") for f in fqns]
        for k, f in zip(self.keys, fqns):
            if isinstance(tensors[f], torch.nn.Parameter):
                self.register_parameter(k, tensors[f])
            else:
                self.register_buffer(k, tensors[f], persistent=False)

    def forward(self, *acts):
        return self.fn(*[self.prepare(f, getattr(self, k)) for f, k in zip(self.fqns, self.keys)], *acts)


def make_schedule(name: str, stages: list, microbatches: int, loss_fn):
    """A torch.distributed.pipelining schedule by name."""
    from torch.distributed.pipelining import schedules as S

    cls = {"GPipe": S.ScheduleGPipe, "1F1B": S.Schedule1F1B, "Interleaved1F1B": S.ScheduleInterleaved1F1B,
           "InterleavedZeroBubble": getattr(S, "ScheduleInterleavedZeroBubble", None)}[name]
    if cls is None:
        raise NotImplementedError(f"schedule {name!r} is not in this torch version")
    if name in ("GPipe", "1F1B"):
        return cls(stages[0], microbatches, loss_fn=loss_fn)
    return cls(stages, microbatches, loss_fn=loss_fn)


def stage_of_nodes(cap: Captured, plan) -> dict[str, int]:
    """Global node name -> stage index, from the plan's stage module lists."""
    units = layer_units(cap)
    bounds = _override_bounds([s.modules for s in plan.stages], units, len(plan.stages))
    return {n.name: s for s, (a, b) in enumerate(bounds) for u in units[a:b] for n in u.nodes}


def plan_layout(cap: Captured, plan) -> tuple[dict, list[Unit], dict[str, int]]:
    """A plan's decisions laid on a capture of its model, for pricing it there
    (``cost_model.symbolic``): the strategy per node and, with pipeline stages, the layer units
    and each node's stage (empty without)."""
    strategies = strategies_from_plan(cap, enumerate_strategies(cap, plan.mesh[2], "auto"), plan)
    if not plan.stages:
        return strategies, [], {}
    return strategies, layer_units(cap), stage_of_nodes(cap, plan)


class Pipeline:
    """This rank's stages, their schedule, and the cross-stage gradient sums."""

    def __init__(self, pm, gm, cap: Captured, plan, dmesh, wrap, materialize):
        from torch.distributed.pipelining import PipelineStage

        from autopar.mesh import group_name
        from autopar.passes.pipeline_split import pipeline_split_pass

        self.pm, self.plan = pm, plan
        n = len(plan.stages)
        pp, me = plan.mesh[1], pm.coords["pp"]
        self.sg = pipeline_split_pass(gm, stage_of_nodes(cap, plan), n)
        if len(self.sg.label_inputs) != 1:
            raise NotImplementedError("pipeline parallelism needs exactly one label input (the targets); "
                                      f"this model's loss uses {self.sg.label_inputs or 'none'}")
        self.mine = [s for s in range(n) if s % pp == me]
        self.last = (n - 1) % pp == me
        holders: dict[str, set[int]] = {}
        for s in range(n):
            for f in self.sg.stage_params[s] + (self.sg.tail_params if s == n - 1 else []):
                holders.setdefault(f, set()).add(s % pp)
        self.shared = [p.fqn for p in plan.parameters if len(holders.get(p.fqn, ())) > 1]
        self.owner = {f: min(r) for f, r in holders.items()}
        needed = {f for f, r in holders.items() if me in r}
        params = materialize(needed)
        tensors = {**params, **{f: b for f, b in pm._buffers.items() if f in needed}}
        device = pm._device
        self.pp_group = group_name(dmesh, "pp")
        pg = dmesh.get_group("pp")
        self.stages = [PipelineStage(StageModule(wrap(self.sg.stages[s]), self.sg.stage_params[s], tensors, pm._casts),
                                     s, n, device, group=pg) for s in self.mine]
        tail = wrap(self.sg.tail)
        tail_w = {f: tensors[f] for f in self.sg.tail_params} if self.last else {}

        def loss_fn(out, target):   # the loss backward starts from: scaled for fp16
            weights = [pm._casts(f, t) for f, t in tail_w.items()]
            return tail(*weights, *(out if isinstance(out, tuple) else (out,)), target) * pm.loss_scale

        self.schedule = make_schedule(plan.schedule, self.stages, plan.microbatches, loss_fn)
        self.params = params

    def step(self, inputs: dict[str, torch.Tensor]) -> torch.Tensor:
        from autopar import collectives as C

        losses: list = []
        # only the first stage's rank feeds the batch (torch 2.11's schedules refuse it elsewhere)
        first = [inputs[name] for name in self.sg.first_inputs] if 0 in self.mine else []
        self.schedule.step(*first, target=inputs[self.sg.label_inputs[0]], losses=losses)
        loss = torch.stack([l.detach() for l in losses]).mean() / self.pm.loss_scale if self.last else torch.zeros(())
        for f in self.shared:   # a weight on several stages: its gradient is the sum over them
            p = self.params.get(f)
            g = p.grad if p is not None and p.grad is not None else torch.zeros(self.pm._local_shape(f))
            total = C.all_reduce(g.to(self.pm._device), self.pp_group)
            if p is not None:
                p.grad = total
        return C.all_reduce(loss.to(self.pm._device).float(), self.pp_group)
