"""autopar.rehearse: one rank of an N-rank plan, run on the one device this machine has.

The plan is made here, for the full world (``planner.decide``: no process group, nothing
broadcast); then only the chosen rank's program is built (``runtime.program.program_for``) on the
local device, under a world of the plan's size whose collectives move no data and are counted
(``runtime.fake_group``), and trained for a few steps through the same passes and torch.compile
as ``parallelize`` (``runtime.rehearsal.run_rank``). The report (``autopar.rehearsal.Rehearsal``)
puts the rank's measured compute, update, peak memory and collectives beside the plan's, and the
step those make with the communication and bubble the plan priced; the Plan returned carries it.
"""
from __future__ import annotations

import dataclasses
import math
import os
import warnings
from collections import Counter

import torch

from autopar.cost_model.context import GRADIENT_SYNC
from autopar.cost_model.state import regathered_bytes, state_bytes, state_shards
from autopar.cost_model.step import BACKWARD_SHARE
from autopar.cost_model.strategy import strategy_work
from autopar.cost_model.terms import step_time
from autopar.graph.precision import compute_dtype, working_copy_ratio
from autopar.graph.units import zero_units
from autopar.graph.views import VIEW_OPS
from autopar.mesh import Mesh
from autopar.plans import Plan
from autopar.rehearsal import MEMORY_TERMS, CollectiveCount, Rehearsal


def rehearse(model, mesh, example_inputs, *, rank="worst", steps: int = 5, warmup: int = 2, world_size=None,
             device=None, gpus_per_node: int = 8, compile=True, log=None, **knobs) -> Plan:
    """Plan ``model`` for ``mesh`` (as ``autopar.plan``; ``world_size`` for mesh="auto"), run one of
    its ranks alone on this machine's device and return the plan carrying the report
    (``plan.rehearsals``, shown by ``summary()``, the JSON and the HTML view).

    ``rank``: a rank number, or "worst": the pipeline rank the plan predicts fullest (then slowest),
    at coordinate 0 on the other axes (all ranks of a stage hold the same shapes). ``model`` may be
    on the meta device: only the rank's shards are made. ``steps`` timed steps follow ``warmup``
    ones, each a ``train_step`` on random tokens of the plan's shapes and an AdamW step; the losses
    are meaningless (no data moves). ``device``: the cost model's device (default: this machine's
    kind, as ``parallelize`` takes it); ``compile`` as ``parallelize`` takes it; ``knobs`` are
    ``autopar.plan``'s (plan, zero, microbatches, precision, recompute, ...). ``log(line)`` hears
    progress. Run it in a process without a torch.distributed world (not under torchrun)."""
    from autopar.api import default_device
    from autopar.planner.decide import decide
    from autopar.runtime.fake_group import fake_world
    from autopar.runtime.groups import process_groups
    from autopar.runtime.program import program_for
    from autopar.runtime.rehearsal import run_rank

    here = default_device()
    say = log or (lambda line: None)
    say(f"planning {type(model).__name__} for mesh {mesh} ...")
    cap, strategies, plan = decide(model, mesh, example_inputs, device=device or here, gpus_per_node=gpus_per_node,
                                   world_size=world_size, **knobs)
    the_mesh = Mesh.of_plan(plan)
    chosen, why = _chosen(plan, the_mesh, rank)
    local = _local_device()
    peak = predicted_peak(plan, the_mesh.coords(chosen)["pp"])
    _check_fits(peak, chosen, local)
    if plan.device != here:
        warnings.warn(f"autopar.rehearse: the plan was priced for {plan.device!r} but runs here on {here!r}: its "
                      "rehearsed figures compare different chips", stacklevel=2)
    stored = {f: p.dtype for f, p in model.named_parameters()}
    # the world stands for the backend a real run takes on this device (its name says which): the
    # program built is that run's (ZeRO's prefetch, the device the runtime reads off the backend)
    with fake_world(the_mesh.world_size, chosen, local.type) as tally:
        groups = process_groups(the_mesh, plan.zero, local.type)
        program = program_for(plan, chosen, cap, strategies, groups=groups, device=local, compile=compile)
        measured = run_rank(model, program, cap, tally, steps=steps, warmup=warmup, log=say)
    planned_params = planned_param_bytes(plan, cap, program.params, stored)
    report = _report(plan, program, measured, why, peak, planned_params, here, cap, strategies)
    say(" ".join(report.lines()[1].split()))
    return dataclasses.replace(plan, rehearsals=(*plan.rehearsals, report))


def worst_rank(plan: Plan) -> tuple[int, str]:
    """The rank of ``plan`` predicted fullest, then slowest, and why: with pipeline stages the pp
    rank of the highest peak (then of the most stage time), at coordinate 0 on every other axis;
    without, rank 0 (every rank holds the same shapes)."""
    mesh = Mesh.of_plan(plan)
    if mesh.pp == 1 or not plan.memory:
        return 0, "every rank alike: the first"
    peak = {r: predicted_peak(plan, r) for r in range(mesh.pp)}
    busy = Counter()
    for s in plan.stages:
        busy[s.rank] += s.predicted_time_s
    pp = max(range(mesh.pp), key=lambda r: (peak[r], busy[r]))
    rank = next(r for r in range(mesh.world_size)
                if mesh.coords(r)["pp"] == pp and all(c == 0 for a, c in mesh.coords(r).items() if a != "pp"))
    return rank, f"the fullest pipeline rank, pp {pp}: predicted peak {peak[pp] / 2**30:.3f} GiB"


def _chosen(plan: Plan, mesh: Mesh, rank) -> tuple[int, str]:
    """The rank to rehearse and why (``rank``: a number or "worst")."""
    if rank == "worst":
        return worst_rank(plan)
    if isinstance(rank, bool) or not isinstance(rank, int) or not 0 <= rank < mesh.world_size:
        raise ValueError(f"rank={rank!r} is outside the plan's world of {mesh.world_size} ranks (mesh {mesh}): pass a "
                         f"rank from 0 to {mesh.world_size - 1}, or 'worst'")
    return rank, "as asked"


def predicted_compute_s(plan: Plan, pp: int) -> float:
    """The plan's forward and backward seconds per step for pipeline rank ``pp``, what a rehearsal of
    that rank measures as its compute: with stages, the ops of each of the rank's stages per
    microbatch, on the rank's 1/cp of each sequence (a plan from before stages recorded their ops'
    share: their whole time); without, the step's compute term."""
    if plan.stages:
        mine = [s for s in plan.stages if s.rank == pp]
        per_microbatch = sum(s.predicted_compute_s or s.predicted_time_s for s in mine)
        return plan.microbatches * per_microbatch / plan.cp
    return plan.step_terms.compute if plan.step_terms is not None else plan.predicted_compute_s


def predicted_peak(plan: Plan, pp: int) -> float:
    """The plan's peak bytes for pipeline rank ``pp`` (each stage's MemoryPlan holds its rank's peak)."""
    peaks = [m.peak for m in plan.memory if m.stage % plan.mesh[1] == pp]
    return max(peaks, default=0.0)


def predicted_terms(plan: Plan, pp: int) -> tuple[float, ...]:
    """The plan's memory terms (``MEMORY_TERMS``) for pipeline rank ``pp``: its stages' sums, the
    backward's transient their largest (as ``cost_model.terms.rank_peaks`` adds them)."""
    mine = [m for m in plan.memory if m.stage % plan.mesh[1] == pp]
    if not mine:
        return ()
    return (*(math.fsum(getattr(m, name) for m in mine) for name in MEMORY_TERMS[:-1]), max(m.transient for m in mine))


def _local_device() -> torch.device:
    """This machine's device: its current GPU, else the CPU."""
    return torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")


def _capacity(device: torch.device) -> tuple[float, str]:
    """Bytes ``device`` holds, and what it is."""
    if device.type == "cuda":
        props = torch.cuda.get_device_properties(device)
        return float(props.total_memory), f"this GPU ({props.name})"
    return float(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")), "this machine's memory"


def _check_fits(peak: float, rank: int, device: torch.device) -> None:
    """Refuse a rank whose predicted peak exceeds what ``device`` holds, saying by how much."""
    capacity, what = _capacity(device)
    if peak > capacity:
        gib = 2**30
        raise ValueError(f"rank {rank} of this plan is predicted to peak at {peak / gib:.1f} GiB, {(peak - capacity) / gib:.1f} "
                         f"GiB more than {what} holds ({capacity / gib:.1f} GiB): rehearse it on a larger device, or plan "
                         "with a smaller microbatch (microbatches=...) or more recompute")


def planned_param_bytes(plan: Plan, cap, fqns, stored: dict) -> int:
    """The bytes of the parameter tensors the plan has a rank hold for ``fqns`` (its parameters;
    ``stored``: FQN -> the model's dtype of each): each at ``Plan.held_shape``, at the compute
    dtype where the plan's state table holds the weights so (``cost_model.state.state_bytes``:
    at 16 bits below a sharded ZeRO-2/3, the distributed optimizer's 16-bit parameters, with
    their fp32 masters in the optimizer's slice), else as stored (fp32, or ZeRO-2/3's dp shards,
    the masters themselves)."""
    mesh = Mesh.of_plan(plan)
    ratio = working_copy_ratio(cap)
    offload = plan.offload != "none"
    per = state_bytes(plan.zero, state_shards(mesh, plan.zero, ratio, offload), ratio, offload)
    narrowed = compute_dtype(plan.precision) if ratio and not per.gathered else None
    return sum(math.prod(plan.held_shape(plan.param(f)))
               * _itemsize(narrowed if narrowed is not None and stored[f].is_floating_point else stored[f])
               for f in fqns)


def _itemsize(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype, device="meta").element_size()


def planned_collectives(plan: Plan, pp: int, fqns, cap, strategies) -> tuple[Counter, Counter]:
    """(kind, axis, phase) -> count, and -> bytes, of the collectives ``plan`` records for one rank of
    pipeline rank ``pp`` holding the parameters ``fqns`` per step. A plan records the whole model's:
    with pipeline stages a rank issues only those of its stages' modules (a record at a module
    path no stage holds, the top level's, goes with the record before it: the ops between two
    modules run on the stage of the one before, those before every module on the first) and its
    share of the gradient sync recorded for all parameters (``GRADIENT_SYNC``): of the parameters'
    local elements, and for ZeRO-3's backward re-gather, of the bytes its units gather again."""
    count, nbytes = Counter(), Counter()
    mesh = Mesh.of_plan(plan)
    if mesh.pp == 1:
        for c in plan.collectives:
            count[(c.kind, c.axis, c.phase)] += c.count
            nbytes[(c.kind, c.axis, c.phase)] += c.bytes
        return count, nbytes
    mine = [m for st in plan.stages if st.rank == pp for m in st.modules]
    staged = [m for st in plan.stages for m in st.modules]
    every = math.fsum(math.prod(p.local_shape) for p in plan.parameters)
    share = math.fsum(math.prod(plan.param(f).local_shape) for f in fqns) / every if every else 1.0
    again = share
    if plan.zero == 3:
        units = zero_units(cap)
        regathered = [(b, any(_within(m, mine) for m in u.modules))
                      for u, b in zip(units, regathered_bytes(cap, strategies, units, mesh.tp))
                      if u.name not in plan.keep_gathered]
        total = math.fsum(b for b, _ in regathered)
        again = math.fsum(b for b, ours in regathered if ours) / total if total else 0.0
    ours = plan.stages[0].rank == pp
    for c in plan.collectives:
        key = (c.kind, c.axis, c.phase)
        if c.where == GRADIENT_SYNC:
            count[key] += c.count
            nbytes[key] += round(c.bytes * (again if (c.kind, c.phase) == ("all_gather", "bwd") else share))
            continue
        if _within(c.where, staged):
            ours = _within(c.where, mine)
        if ours:
            count[key] += c.count
            nbytes[key] += c.bytes
    return count, nbytes


def memory_bound_bytes(plan: Plan, pp: int, strategies) -> float:
    """Bytes the cost model counts, per step, for the memory-bound ops (no FLOPs, not views) that
    pipeline rank ``pp`` runs: their forward and backward traffic under their strategies
    (``cost_model.strategy.strategy_work``), a recomputed op's forward share once more
    (``cost_model.step.BACKWARD_SHARE``), for each microbatch. The ops of a stage are those at its
    modules' paths, as ``planned_collectives`` assigns records."""
    recomputed = {name for region in plan.recompute_regions for name in region}
    mine = [m for st in plan.stages if st.rank == pp for m in st.modules]
    staged = [m for st in plan.stages for m in st.modules]
    ours = not plan.stages or plan.stages[0].rank == pp
    total = 0.0
    for node, s in strategies.items():
        if node.op != "call_function" or node.target in VIEW_OPS:
            continue
        where = node.meta.get("module_path", "")
        if staged and _within(where, staged):
            ours = _within(where, mine)
        flops, nbytes, _ = strategy_work(node, s)
        if ours and not flops:
            total += nbytes * (1 + (1 - BACKWARD_SHARE) * (node.name in recomputed))
    return total * plan.microbatches


def _within(where: str, modules) -> bool:
    """Whether the module path ``where`` is one of ``modules`` or inside one."""
    return any(where == m or where.startswith(m + ".") for m in modules)


def _report(plan: Plan, program, measured, why: str, peak: float, planned_params: int,
            device: str, cap, strategies) -> Rehearsal:
    """The Rehearsal of ``measured`` (``runtime.rehearsal.Measured``), ``program``'s, against ``plan``."""
    mesh = program.mesh
    terms = plan.step_terms
    predicted_compute = predicted_compute_s(plan, program.coords["pp"])
    if terms is not None:
        comm = terms.tp + terms.cp + terms.pp + terms.dp
        bubble, predicted_update = terms.bubble, terms.update_s
    else:
        comm, bubble, predicted_update = plan.predicted_comm_s, 0.0, plan.predicted_update_s
    planned = planned_collectives(plan, program.coords["pp"], program.params, cap, strategies)
    keys = list(dict.fromkeys([*planned[0], *measured.collectives]))
    colls = tuple(CollectiveCount(kind, axis, *measured.collectives.get((kind, axis, phase), (0, 0)),
                                  planned[0][(kind, axis, phase)], planned[1][(kind, axis, phase)], phase)
                  for kind, axis, phase in keys)
    split = ("dp_replicate", "dp_shard") if mesh.split else ("dp",)   # an unsplit dp is its one shard axis
    coords = " ".join(f"{a} {c}" for a, c in program.coords.items()
                      if mesh.size(a) > 1 and (a in split or a not in ("dp", "dp_replicate", "dp_shard"))) or "rank 0"
    return Rehearsal(rank=program.rank, coords=coords, why=why, device=device, priced_on=plan.device,
                     steps=measured.steps, compute_s=measured.compute_s, predicted_compute_s=predicted_compute,
                     update_s=measured.update_s, predicted_update_s=predicted_update, peak_bytes=measured.peak_bytes,
                     predicted_peak_bytes=peak, memory=measured.memory, param_bytes=measured.param_bytes,
                     planned_param_bytes=int(planned_params), comm_s=comm, bubble_s=bubble,
                     step_s=step_time(measured.compute_s, [comm, bubble], measured.update_s),
                     predicted_step_s=plan.predicted_step_time, collectives=colls, ops=measured.ops,
                     memory_bound_bytes=memory_bound_bytes(plan, program.coords["pp"], strategies),
                     held_bytes=measured.held_bytes, predicted_terms=predicted_terms(plan, program.coords["pp"]))
