"""One candidate, priced: the decisions in order for one mesh, microbatch count, ZeRO stage and offload.

``price`` captures one dp rank's microbatch (at the compute dtype), chooses the tensor-parallel
strategies (``planner.sharding``; a given plan's are read off it), then lays them out
(``_priced``): the records they decide, the stage cut (``planner.stage_cut``), the recompute
regions (``planner.recompute``), the memory per stage (``cost_model.memory``, the one sum) and the
step's terms (``cost_model.step.price_step``, made once). Where the memory budget is given and
the plan runs sequence parallel, the storage rule comes first: linears re-gather their inputs in
backward when the plan does not fit without it (an all-gather is cheaper than a forward, or
than moving layers off a full pipeline stage). Under
zero=3 the units kept gathered are chosen last (``planner.reshard``), the cut kept. ("Does not
fit" there: the fastest stage cut misses the memory by its peak, where another cut would take
layers from a full stage rather than re-gather.)
"""
from __future__ import annotations

import dataclasses
import math
import warnings
from dataclasses import dataclass

from autopar.collectives import CP_ATTENTIONS
from autopar.cost_model.comm import axis_is_inter_node
from autopar.cost_model.context import cp_attention_seconds, cp_seconds
from autopar.cost_model.memory import all_ops, cut_memory, stage_nodes, unit_memory, unit_params, with_weights
from autopar.cost_model.offload import backward_units, offload_timing, plan_update_terms
from autopar.cost_model.repeats import block_shift
from autopar.cost_model.stages import (inflight_microbatches, pipeline_split, pipeline_time, rank_param_bytes,
                                       unit_costs)
from autopar.cost_model.state import kept_gathered_bytes, regathered_bytes, state_bytes_per_param_byte
from autopar.cost_model.step import (dp_sync_time, flat_compute_time, param_byte_time, price_step, rank_unit_figures,
                                     rank_units, recompute_seconds, tp_comm_time, unit_sync_times, zero_unit_figures)
from autopar.errors import PlanError, PlanFormatError
from autopar.graph.capture import Captured
from autopar.graph.precision import retyped, working_copy_ratio
from autopar.graph.units import find_blocks, layer_units, zero_units
from autopar.mesh import Mesh
from autopar.passes.context_parallel import check_context, ring_refusal, ring_unfused
from autopar.planner.candidate import Candidate, Choices
from autopar.planner.megatron import megatron_options
from autopar.planner.recompute import choose_recompute, regions_for
from autopar.planner.request import Job, local_inputs
from autopar.planner.reshard import choose_kept
from autopar.planner.sharding import (Assignment, check_tp, enumerate_strategies, sequence_parallel_notes,
                                      sequence_sharded, sharding_record, solve, strategies_from_plan, with_regather)
from autopar.planner.stage_cut import NoCutFits, choose_cut
from autopar.plans import StagePlan, offload_limit, zero_on_mesh


@dataclass(frozen=True, eq=False)
class _Base:
    """What one candidate's pricing starts from: the capture, the request, the strategies' options
    and solution, the choices made before memory is weighed, the given plan's recompute regions
    (nodes) and stage lists, the units kept gathered as asked, and the notes so far."""

    job: Job
    cap: Captured
    assignment: Assignment
    choices: Choices
    regions: tuple | None
    stages: object
    kept: tuple[str, ...]
    notes: tuple[str, ...]


def price(job: Job, mesh: Mesh, microbatches: int, zero: int, offload: str, offload_kept=()) -> Candidate:
    """The candidate on ``mesh`` with ``microbatches`` per step at ZeRO stage ``zero`` and ``offload``,
    the units ``offload_kept`` keeping their optimizer on the device (a given plan's own choices
    instead, re-derived from them), priced as the module docstring says. Raises ValueError where
    no plan exists (no stage cut within the memory budget)."""
    return _price_base(_base(job, mesh, microbatches, zero, offload, offload_kept))


def offload_pricer(job: Job, mesh: Mesh, microbatches: int, zero: int):
    """``at(kept)``: the candidate ``price`` makes with offload="optimizer" and the units ``kept``
    keeping their optimizer on the device, for any split, from one capture and one solve of the
    strategies (the splits' searches price many); its capture and strategies as ``at.cap`` and
    ``at.strategies``."""
    base = _base(job, mesh, microbatches, zero, "optimizer")

    def at(kept) -> Candidate:
        return _price_base(dataclasses.replace(base, choices=dataclasses.replace(base.choices,
                                                                                 offload_kept=tuple(kept))))
    at.cap, at.strategies = base.cap, base.assignment.strategies
    return at


def _price_base(base: "_Base") -> Candidate:
    """``price`` from its ``_base``."""
    job, mesh = base.job, base.choices.mesh
    req, c = job.request, base.choices
    strategies, cand = base.assignment.strategies, None
    if req.given is None and c.sequence_parallel:
        # the fastest cut, each linear keeping its whole input, recomputing nothing under recompute="auto":
        # where it misses the budget, memory binds
        first = _priced_or_none(base, strategies, "none" if c.recompute == "auto" else c.recompute, base.kept,
                                recut=False)
        if first is None or first.peak_memory > req.limit:
            # Megatron's storage rule: each sequence-parallel linear keeps its input's shard and gathers it
            # again in the backward. It is one way to make room, recompute another, and an all-gather is
            # not always cheaper than the forward that recomputing its block runs again: both are priced
            cand = _fitting_faster(_priced(base, with_regather(strategies), c.recompute, base.kept),
                                   _priced_or_none(base, strategies, c.recompute, base.kept), req.limit)
        elif c.recompute != "auto":
            cand = first
        elif find_blocks(base.cap):
            # recompute="auto" recomputes nothing where nothing recomputed fits: these are its figures, priced
            cand = dataclasses.replace(first, choices=dataclasses.replace(first.choices, recompute="auto"))
    if cand is None:
        cand = _priced(base, strategies, c.recompute, base.kept)
    if req.given is None and req.keep_gathered == "auto" and c.zero == 3 and mesh.dp > 1:
        cand = _keep_gathered(base, cand)
    return cand


def _priced_or_none(base: "_Base", strategies, recompute: str, kept, recut: bool = True) -> Candidate | None:
    """``_priced``, or None where no cut of the stages fits (a PlanError, or the stage DP's ValueError)."""
    try:
        return _priced(base, strategies, recompute, kept, recut=recut)
    except ValueError:
        return None


def _fitting_faster(first: Candidate, second: Candidate | None, limit: float) -> Candidate:
    """Of two pricings of one candidate, the faster of those that fit ``limit``; ``first`` where
    neither fits (the caller's choice of least memory)."""
    fits = [c for c in (first, second) if c is not None and c.peak_memory <= limit]
    return min(fits, key=lambda c: c.step_time) if fits else first


def _base(job: Job, mesh: Mesh, microbatches: int, zero: int, offload: str, offload_kept=()) -> _Base:
    """Capture, check and solve the candidate's strategies; its choices but recompute's regions."""
    req, given = job.request, job.request.given
    cap = job.capture(local_inputs(job.example_inputs, mesh, microbatches))
    check_tp(cap, mesh.tp)
    check_context(cap, mesh.cp)
    precision = given.precision if given is not None else req.precision
    cap = retyped(cap, precision)   # price compute, activations and collectives at the compute dtype
    block_shift(cap)   # laid out before any op is priced, so that the repeated blocks' ops are priced as block 1's
    options = enumerate_strategies(cap, mesh.tp, req.sequence_parallel)   # on the retyped graph's nodes
    schedule, virtual, recompute = req.schedule, req.virtual, req.recompute
    if given is not None:   # run as written: its collectives, times and memory re-derived from its choices
        _check_given(given, mesh, cap)
        schedule, virtual, recompute = given.schedule, given.virtual_stages, given.recompute
        zero, offload = given.zero, given.offload
    zero, notes = zero_on_mesh(zero, mesh)
    assignment = _assignment(job, cap, options, mesh, zero, offload, recompute, precision)
    attention, why = _cp_attention(req.cp_attention if given is None else given.cp_attention, cap,
                                   assignment.strategies, mesh, req)
    refused = offload_limit(offload, precision, zero, (mesh.dp, mesh.pp, mesh.tp), microbatches)
    if refused:
        raise ValueError(refused)
    kept = tuple(given.keep_gathered) if given is not None else () if req.keep_gathered == "auto" \
        else req.keep_gathered
    if kept:
        _check_units(cap, kept, "plan.keep_gathered " if given is not None else "keep_gathered=")
    choices = Choices(mesh, microbatches, zero, offload, schedule, virtual, precision, attention,
                      sequence_sharded(cap, assignment.strategies), given.source if given is not None else req.plan,
                      recompute, offload_kept=tuple(given.offload_kept) if given is not None else tuple(offload_kept),
                      offload_delay=(given.offload_delay if given is not None
                                     else req.offload_delay if offload != "none" else 0))
    if offload != "none" and choices.offload_kept:
        _check_units(cap, choices.offload_kept, "plan.offload_kept " if given is not None else "offload_kept ")
    return _Base(job, cap, assignment, choices, _regions_from_plan(cap, given) if given is not None else None,
                 ([s.modules for s in given.stages] or None) if given is not None else req.stages,
                 kept if zero == 3 else (),   # zero="auto"'s other stages; zero=3 without dp (its note says so)
                 notes + why + sequence_parallel_notes(cap, mesh.tp, req.sequence_parallel))


def _check_given(given, mesh: Mesh, cap) -> None:
    """A given plan runs only on its own mesh and microbatch shapes."""
    if Mesh.of_plan(given) != mesh:
        raise PlanError(f"plan.mesh {Mesh.of_plan(given)} does not match the mesh {mesh}; re-plan for this mesh")
    if tuple(map(tuple, given.input_shapes)) != tuple(tuple(i.meta["val"].shape) for i in cap.inputs):
        raise PlanError(f"plan.input_shapes {given.input_shapes} do not match this batch's "
                        "microbatch shapes; re-plan for this batch size")


def _assignment(job: Job, cap, options, mesh: Mesh, zero: int, offload: str, recompute: str,
                precision: str) -> Assignment:
    """The strategy per node: the given plan's, the Megatron-LM plan's, or the ILP's (``solve``)."""
    req, given = job.request, job.request.given
    if given is not None:
        return Assignment(strategies_from_plan(cap, options, given), options, given.solve_seconds, 0.0)
    if req.plan == "megatron" and mesh.tp > 1:
        options = megatron_options(cap, options, req.sequence_parallel is not False)
    dev = req.device
    return solve(cap, options, mesh.tp, dev, inter_node=mesh.tp > req.gpus_per_node,
                 memory_budget=req.memory_budget if recompute != "auto" else None,
                 param_state_bytes=state_bytes_per_param_byte(mesh, zero, working_copy_ratio(cap), offload != "none"),
                 param_byte_seconds=param_byte_time(mesh, dev, zero=zero, working_copy=precision != "fp32",
                                                    gpus_per_node=req.gpus_per_node))


def _priced(base: _Base, strategies: dict, recompute: str, kept=(), bounds=None, regions=None,
            recut: bool = True) -> Candidate:
    """``base`` laid out with ``strategies``: its records, stage cut (``bounds``, else the cost
    model's or the given one; ``recut`` as ``choose_cut``'s), recompute regions (``regions``, else
    the given plan's or those ``recompute`` chooses), memory and step terms (the regions' forwards
    run again in the compute, ``step.recompute_seconds``; the optimizer's update where it runs,
    ``cost_model.offload``), with ZeRO-3's ``kept`` units kept gathered."""
    cap, req, c = base.cap, base.job.request, base.choices
    mesh, dev = c.mesh, req.device
    offload, split = c.offload != "none", c.offload_kept if c.offload != "none" else ()
    tp_inter = axis_is_inter_node(mesh.tp, 1, req.gpus_per_node)
    sharding = sharding_record(cap, dataclasses.replace(base.assignment, strategies=strategies), mesh, dev,
                               zero=c.zero, microbatches=c.microbatches, gpus_per_node=req.gpus_per_node, kept=kept,
                               cp_attention=c.cp_attention)
    regions = base.regions if regions is None else regions
    rank_nodes, rank_share = None, 1.0   # the attentions and the share of the parameters whose cp traffic is priced
    if mesh.pp > 1:
        cut, unit_tp, boundary, dp, dp_units, rank = _pipelined(base, strategies, recompute, regions, kept, bounds,
                                                                recut)
        bounds = cut.bounds
        units = layer_units(cap)
        rank_nodes = frozenset(n for k in rank for n in units[k].nodes)
        rank_share = min(1.0, dp_units[0] / sharding.local_bytes) if sharding.local_bytes else 1.0
    else:
        (work, dp, dp_units), bounds = _flat(base, strategies, sharding, kept), ()
    if regions is None:
        regions = _chosen_regions(base, strategies, recompute, bounds, kept)
    if mesh.pp > 1:
        recomputed = [n for r in regions for n in r]
        again = [recompute_seconds(strategies, [n for n in recomputed if n in mine], mesh.tp, dev, tp_inter,
                                   with_comm=True) for mine in map(frozenset, stage_nodes(cap, bounds))]
        work, stage_parts = pipeline_work(cut, unit_tp, boundary, mesh.pp, c.microbatches, c.virtual_stages,
                                          again=again)
    else:
        work["compute"] += c.microbatches * recompute_seconds(strategies, [n for r in regions for n in r], mesh.tp,
                                                              dev, tp_inter)
    memory = cut_memory(cap, strategies, mesh, bounds=bounds, microbatches=c.microbatches, virtual=c.virtual_stages,
                        schedule=c.schedule, zero=c.zero, regions=regions, offload=offload, kept=kept,
                        attention=c.cp_attention, offload_kept=split)
    cp = cp_seconds(cap, strategies, mesh.cp, mesh.tp, dev, req.gpus_per_node, c.microbatches, c.cp_attention,
                    sharding.collectives, frozenset(n.name for r in regions for n in r), nodes=rank_nodes,
                    sync_share=rank_share)
    update, host = _update(base, strategies, memory, regions, price_step(work, dp=dp, cp=cp, update=0.0, offload=0.0,
                                                                           cp_ranks=mesh.cp).total)
    stages = ()
    if mesh.pp > 1:
        units = layer_units(cap)
        stages = tuple(StagePlan(s, s % mesh.pp, tuple(m for u in units[a:b] for m in u.modules),
                                 math.fsum(stage_parts[s].values()), float(memory[s].peak),
                                 stage_parts[s]["compute"]) for s, (a, b) in enumerate(bounds))
    names = tuple(tuple(n.name for n in r) for r in regions)
    return Candidate(dataclasses.replace(c, recompute=recompute, recompute_regions=names, keep_gathered=tuple(kept)),
                     cap, strategies, req, sharding, memory,
                     price_step(work, dp=dp, cp=cp, update=update, offload=host, cp_ranks=mesh.cp), stages,
                     tuple(bounds), tuple(map(tuple, regions)), dp_units, base.notes)


def _update(base: _Base, strategies: dict, memory, regions, window: float) -> tuple[float, float]:
    """The update's (device, exposed host) seconds (``cost_model.offload.plan_update_terms``) at the
    time the candidate's host updates (``offload_timing``): beside its backward, unit by unit, whose
    seconds its ``regions`` lengthen (``backward_units``); after it; or beside the next step's other
    terms (``window`` seconds)."""
    req, c = base.job.request, base.choices
    mesh, dev, offload = c.mesh, req.device, c.offload != "none"
    timing = offload_timing(mesh, c.zero, c.offload_delay)
    units, backward = (), 0.0
    if offload and timing == "backward":
        units, backward = backward_units(base.cap, strategies, mesh, dev, zero=c.zero, offload_kept=c.offload_kept,
                                         regions=regions, tp_inter=axis_is_inter_node(mesh.tp, 1, req.gpus_per_node))
    return plan_update_terms(memory, mesh, c.zero, c.precision, dev, offload=offload, timing=timing, units=units,
                             backward=backward, window=window)


def _flat(base: _Base, strategies: dict, sharding, kept) -> tuple[dict, float, tuple]:
    """Without pipeline stages: the ops' compute and tp terms, the dp sync, and what it was priced
    from (``Candidate.dp_units``)."""
    req, c = base.job.request, base.choices
    mesh, dev = c.mesh, req.device
    tp_inter = axis_is_inter_node(mesh.tp, 1, req.gpus_per_node)
    tp = tp_comm_time([(k.kind, k.count, k.bytes) for k in sharding.collectives if k.axis == "tp"], mesh.tp, dev,
                      tp_inter)
    work = dict(compute=flat_compute_time(strategies, mesh.tp, dev, tp_inter, c.microbatches), tp=tp)
    units = zero_unit_figures(strategies, zero_units(base.cap), mesh.tp, dev, tp_inter) \
        if c.zero >= 2 and mesh.dp > 1 else None
    names = tuple(u.name for u in zero_units(base.cap)) if units else ()
    again = regathered_bytes(base.cap, strategies, zero_units(base.cap), mesh.tp) if units else None
    dp = dp_sync_time(sharding.local_bytes, mesh, dev, c.zero, req.gpus_per_node, microbatches=c.microbatches,
                      gathered=working_copy_ratio(base.cap) or 1.0, units=units, kept=_positions(names, kept),
                      regathered=again)
    return work, dp, (sharding.local_bytes, units, names)


def _pipelined(base: _Base, strategies: dict, recompute: str, regions, kept, bounds, recut: bool = True):
    """With pipeline stages: the cut (``bounds``, else the cost model's or ``stages=``), the units'
    tp and cut seconds (``pipeline_work``'s), the dp sync, what it was
    priced from, and the units of the pipeline rank it was priced for (``rank_units``: its
    attentions and parameters are the ones whose cp traffic the step counts). The cut prices each unit's activations with ``regions`` recomputed, or those
    ``recompute`` names; under recompute="auto", with none when a cut fits so, else with every
    block recomputed (the least any choice keeps); ``_chosen_regions`` then chooses per block."""
    cap, req, c = base.cap, base.job.request, base.choices
    mesh, dev, wc = c.mesh, req.device, working_copy_ratio(cap)
    split = c.offload_kept if c.offload != "none" else ()
    units = layer_units(cap)
    time, boundary, tp = unit_costs(cap, strategies, units, mesh, dev, gpus_per_node=req.gpus_per_node)

    def cut_with(recomputed):
        static, act = unit_memory(cap, strategies, units, mesh, zero=c.zero, working_copy=wc, regions=recomputed,
                                  offload=c.offload != "none", attention=c.cp_attention, offload_kept=split)

        def peaks(cut_bounds) -> list[float]:   # the one memory sum of a cut the DP took
            return [m.peak for m in cut_memory(cap, strategies, mesh, bounds=cut_bounds, microbatches=c.microbatches,
                                               virtual=c.virtual_stages, schedule=c.schedule, zero=c.zero,
                                               regions=recomputed, offload=c.offload != "none", kept=kept,
                                               attention=c.cp_attention, offload_kept=split)]
        return static, choose_cut((time, static, act, boundary), units, mesh, schedule=c.schedule,
                                  microbatches=c.microbatches, virtual=c.virtual_stages, memory_budget=req.limit,
                                  stages=base.stages, bounds=bounds, peaks=peaks, recut=recut)

    if bounds is None and regions is None and recompute == "auto":
        try:
            static, cut = cut_with(regions_for(cap, "none"))
        except NoCutFits:   # no cut fits without recompute
            static, cut = cut_with(regions_for(cap, "full"))
    else:
        static, cut = cut_with(regions if regions is not None else regions_for(cap, recompute))
    params = unit_params(cap, strategies, units, mesh.tp)
    return cut, tp, boundary, *_rank_dp(base, strategies, time, params, cut.bounds, units, kept), \
        rank_units(params, cut.bounds, mesh)


def pipeline_work(cut, tp, boundary, pp: int, microbatches: int, virtual: int, again=None) -> tuple[dict, list]:
    """The busiest pipeline rank's compute, tp and pp work and the bubble of the stage ``cut``
    (``pipeline_split``), and each stage's seconds per microbatch by term: "compute", its units'
    ops and ``again[s]``, the forwards its recomputed regions run again in its backward
    (``step.recompute_seconds``); "tp", its units' tp collectives (``tp`` per unit); "pp", its
    incoming activations' point-to-point seconds (``boundary`` per cut). A stage's time is their
    sum; the makespan is then ``pipeline_time``'s of those stage times."""
    again = [0.0] * len(cut.bounds) if again is None else again
    parts = []
    for s, (a, b) in enumerate(cut.bounds):
        tp_s, pp_s = float(tp[a:b].sum()), float(boundary[a - 1]) if s else 0.0
        parts.append(dict(compute=float(cut.stage_times[s]) - tp_s - pp_s + again[s], tp=tp_s, pp=pp_s))
    times = [math.fsum(p.values()) for p in parts]
    makespan = pipeline_time(times, pp, microbatches, virtual) if any(again) else float(cut.step_time)
    return pipeline_split(parts, pp, microbatches, virtual, makespan), parts


def _rank_dp(base: _Base, strategies: dict, time, unit_bytes, bounds, units, kept) -> tuple[float, tuple]:
    """The dp sync of the pipeline rank holding the most parameters under the cut ``bounds``
    (``unit_bytes``: each unit's, ``memory.unit_params``), and what it was priced from
    (``Candidate.dp_units``; ZeRO-2/3's per-unit figures of that rank)."""
    req, c = base.job.request, base.choices
    mesh, wc = c.mesh, working_copy_ratio(base.cap)
    params = rank_param_bytes(unit_bytes, bounds, mesh)
    figures, names, again = None, (), None
    if c.zero >= 2 and mesh.dp > 1:
        figures = rank_unit_figures(time, unit_bytes, bounds, mesh)
        ranked = [units[k] for k in rank_units(unit_bytes, bounds, mesh)]
        names = tuple(u.name for u in ranked)
        again = regathered_bytes(base.cap, strategies, ranked, mesh.tp)
    dp = dp_sync_time(params, mesh, req.device, c.zero, req.gpus_per_node, microbatches=c.microbatches,
                      gathered=wc or 1.0, units=figures, kept=_positions(names, kept), regathered=again)
    return dp, (params, figures, names)


def _chosen_regions(base: _Base, strategies: dict, recompute: str, bounds, kept) -> list:
    """The recompute regions ``recompute`` names; for "auto", per block the least recompute that fits
    the memory (``choose_recompute``) on the cut ``bounds``."""
    if recompute != "auto":
        return regions_for(base.cap, recompute)
    req, c = base.job.request, base.choices
    nodes = stage_nodes(base.cap, bounds) if bounds else (all_ops(base.cap),)
    inflight = inflight_microbatches(c.mesh.pp, c.microbatches, c.virtual_stages, c.schedule) if bounds else (1,)
    return choose_recompute(base.cap, strategies, c.mesh, req.device, zero=c.zero, budget=req.limit,
                            microbatches=c.microbatches, stage_nodes=nodes, inflight=inflight,
                            offload=c.offload != "none", kept=kept, attention=c.cp_attention,
                            offload_kept=c.offload_kept if c.offload != "none" else ())[0]


def _keep_gathered(base: _Base, cand: Candidate) -> Candidate:
    """``cand`` with ZeRO-3's units kept gathered as ``planner.reshard.choose_kept`` chooses them: each
    unit's saved re-gather seconds per step from the dp sync's own per-unit figures (the busiest
    pipeline rank's units), its gathered bytes and every rank's peak with it (``state.kept_gathered_bytes``
    summed by ``memory.with_weights``), within the memory limit; re-priced with them on its cut,
    with the note that says which and why."""
    cap, req, c = base.cap, base.job.request, cand.choices
    _, figures, names = cand.dp_units
    wc = working_copy_ratio(cap)
    by_name = {u.name: u for u in (layer_units(cap) if cand.bounds else zero_units(cap))}   # as dp_units named them
    again = regathered_bytes(cap, cand.strategies, [by_name[n] for n in names], c.mesh.tp)
    regather = unit_sync_times([b for b, _ in figures], c.mesh, req.device, 3, req.gpus_per_node, gathered=wc or 1.0,
                               regathered=again)[1]
    saved = dict(zip(names, (c.microbatches * t for t in regather)))
    nodes = stage_nodes(cap, cand.bounds) if cand.bounds else (all_ops(cap),)
    extras = [kept_gathered_bytes(cap, cand.strategies, c.mesh, n, wc) for n in nodes]
    order = [u.name for u in zero_units(cap)]
    size = {u: b for _, sizes in extras for u, b in sizes.items()}

    def peak(kept) -> float:
        return max(m.peak for m in with_weights(cand.memory, [extra(kept) for extra, _ in extras], c.mesh.pp))
    choice = choose_kept(order, [saved.get(u, 0.0) for u in order], [size.get(u, 0.0) for u in order], peak, req.limit)
    if choice.kept:
        cand = _priced(base, cand.strategies, c.recompute, choice.kept, bounds=cand.bounds, regions=cand.regions)
    return cand.with_note(_kept_note(choice, len(order), req))


def _kept_note(choice, units: int, req) -> str:
    """The plan note that says which units stay gathered under ZeRO-3 and why."""
    budget = req.where()
    if not choice.kept:
        if choice.refused is None:
            return "keep_gathered chosen automatically: none (no unit's backward re-gather is priced on this mesh)"
        return (f"keep_gathered chosen automatically: none; every unit reshards after its forward, since keeping "
                f"even {choice.refused} gathered would raise the peak to {choice.refused_peak / 2**30:.2f} GiB, "
                f"above {budget}")
    shown = ", ".join(choice.kept) if len(choice.kept) <= 4 else f"{choice.kept[0]} .. {choice.kept[-1]}"
    text = (f"keep_gathered chosen automatically: {len(choice.kept)} of {units} units ({shown}) keep their weights "
            f"gathered from forward to backward, saving {choice.saved * 1e3:.3f} ms of backward re-gathers per step "
            f"(best saved time per byte first) at a peak of {choice.peak / 2**30:.2f} GiB within {budget}")
    if choice.refused is not None:
        text += (f"; the rest reshard after forward: keeping {choice.refused} too would need "
                 f"{choice.refused_peak / 2**30:.2f} GiB")
    return text


def _cp_attention(knob: str, cap, strategies, mesh: Mesh, req) -> tuple[str, tuple[str, ...]]:
    """The cp attention variant (``Plan.cp_attention``) and a note on its choice: the knob's (or the
    given plan's), or for "auto" the variant of lower exposed seconds
    (``cost_model.context.cp_attention_seconds``; ring on a tie, it keeps less), all-gather where
    ring attention cannot run the graph (``ring_refusal``) or would run it unfused (``ring_unfused``:
    "ring" asked for anyway is planned, with a warning)."""
    if mesh.cp == 1:
        return "allgather", ()
    refused = ring_refusal(cap.gm)
    if knob == "ring" and refused:
        raise PlanError(f"cp_attention='ring': {refused}; use cp_attention='allgather'")
    unfused = ring_unfused(cap.gm)
    if knob == "ring" and unfused:
        note = f"cp_attention='ring': {unfused}; cp_attention='allgather' runs it fused"
        warnings.warn(f"autopar: {note}", stacklevel=3)
        return knob, (note,)
    if knob != "auto":
        return knob, ()
    if refused or unfused:
        why = f"ring attention cannot run here ({refused})" if refused else unfused
        return "allgather", (f"cp attention: allgather, as {why}",)
    seconds = {a: cp_attention_seconds(cap, strategies, mesh.cp, mesh.tp, req.device, req.gpus_per_node, a)
               for a in CP_ATTENTIONS}
    chosen = "ring" if seconds["ring"] <= seconds["allgather"] else "allgather"
    rows = ", ".join(f"{a} {s * 1e3:.3f} ms" for a, s in seconds.items())
    return chosen, (f"cp attention chosen automatically: {chosen}, the least exposed communication per microbatch "
                    f"({rows})",)


def _check_units(cap, names: tuple[str, ...], what: str) -> None:
    """A plan's ``keep_gathered`` (or the knob, ``what``) names units of this model (that it names them
    only under zero=3 is ``Plan``'s check, and the request's)."""
    known = [u.name for u in zero_units(cap)]
    unknown = [n for n in names if n not in known]
    if unknown:
        raise PlanFormatError(f"{what}{list(names)}: the model has no unit {', '.join(unknown)}; its units are "
                              f"{', '.join(known)}")


def _regions_from_plan(cap, plan) -> tuple:
    """A plan's recompute regions as lists of this capture's nodes."""
    by_name = {n.name: n for n in cap.gm.graph.nodes}
    for i, region in enumerate(plan.recompute_regions):
        unknown = [n for n in region if n not in by_name]
        if unknown:
            raise PlanFormatError(f"plan.recompute_regions[{i}]: the graph has no node {', '.join(unknown)}")
    return tuple([by_name[n] for n in region] for region in plan.recompute_regions)


def _positions(names, kept) -> set[int]:
    """The positions in ``names`` (units priced in order) of the units named in ``kept``."""
    return {i for i, name in enumerate(names) if name in kept}
