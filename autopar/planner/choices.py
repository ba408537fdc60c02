"""The choice loops: every walk over a knob's values, each candidate priced by ``planner.price``.

On one mesh (``plan_mesh``): the microbatch count (``best_microbatches``: every count the schedule
can take, priced from one capture), the optimizer's place (``choose_offload``) and the ZeRO stage
(``choose_zero``), each "auto" knob choosing the fastest candidate that fits the memory, else the
one of least peak, and saying so in the plan's notes. Over meshes (``auto_mesh``): every mesh
ranked by the plan made on it (``planner.mesh_search``), with ZeRO stages that cannot be chosen
left unplanned (``zero_floors``). Nothing here builds a Plan: the kept candidate does, once.
"""
from __future__ import annotations

import dataclasses
import math

import numpy as np

from autopar.cost_model.comm import axis_is_inter_node
from autopar.cost_model.devices import host_memory
from autopar.cost_model.memory import cut_memory, stage_nodes, unit_memory, unit_params
from autopar.cost_model.offload import host_need, host_needs, offload_timing, plan_update_terms, update_floor
from autopar.cost_model.stages import rank_param_bytes, unit_costs
from autopar.cost_model.state import state_floor
from autopar.cost_model.step import (BACKWARD_SHARE, dp_sync_time, price_step, rank_unit_figures, recompute_seconds,
                                     zero_sync_floor)
from autopar.cost_model.strategy import OP_OVERHEAD
from autopar.errors import PlanError
from autopar.graph.precision import retyped, working_copy_ratio
from autopar.graph.units import find_blocks, layer_units, zero_units
from autopar.mesh import Mesh
from autopar.planner.candidate import Candidate
from autopar.planner.floors import RowFloors
from autopar.planner.mesh_search import rank_meshes, ranking_table
from autopar.planner.offload_split import fraction_units, kept_units, offload_order, search_split
from autopar.planner.price import offload_pricer, pipeline_work, price
from autopar.planner.recompute import regions_for
from autopar.planner.request import Job, microbatch_options
from autopar.planner.stage_cut import choose_cut


def plan_mesh(job: Job, mesh: Mesh, microbatches) -> Candidate:
    """The candidate ``autopar.plan`` keeps on ``mesh``: at the most microbatches the schedule takes
    (``microbatches``, if given), offload and ZeRO chosen; at the count ``best_microbatches`` finds
    fastest, planned again with those choices; ``no_fit_error`` when an "auto" knob searched and
    nothing fits."""
    req = job.request
    options = microbatch_options(mesh, job.example_inputs[0].shape[0], req.schedule, microbatches)
    if req.given is not None:
        options = [req.given.microbatches]
    best = choose_offload(job, mesh, max(options), zero=req.zero, offload=req.offload)
    if len(options) > 1:
        m = best_microbatches(job, best, options)
        if m != best.choices.microbatches:   # a split (offload="auto", a fraction) is chosen again at m
            again = best.choices.offload if best.choices.offload == "none" else req.offload
            best = choose_offload(job, mesh, m, zero=best.choices.zero, offload=again)
    searched = req.searched()
    if searched and best.peak_memory > req.limit:
        c = best.choices
        raise no_fit_error((c.mesh.dp, c.mesh.pp, c.mesh.tp), c.zero, c.recompute, len(c.recompute_regions),
                           c.offload, best.peak_memory, req.limit, req.memory_budget is None, req.device.name,
                           searched, cp=c.mesh.cp)
    return best


def no_fit_error(mesh, zero, recompute, regions: int, offload, peak: float, limit: float, default_budget: bool,
                 device: str, searched, world_size=None, table: str = "", cp: int = 1) -> PlanError:
    """The error when no combination the planner searched (``searched``: the knobs it chose, "mesh"
    among them for mesh="auto") meets the memory: the smallest peak found, with its choices (``cp``:
    the ranks its sequences are split over), and what to change."""
    gib = 2**30
    where = (f"one {device}'s memory ({limit / gib:.2f} GiB)" if default_budget
             else f"the memory budget ({limit / gib:.2f} GiB)")
    rc = f"{recompute} ({regions} regions)" if recompute == "auto" else recompute
    text = (f"no plan fits {where} after choosing {', '.join(searched)}: the smallest peak found is "
            f"{peak / gib:.2f} GiB per device, with mesh (dp, pp, tp) = {tuple(mesh)}{f', cp={cp}' if cp > 1 else ''}, "
            f"zero={zero}, recompute={rc}, offload={offload}")
    fixes = [f"a device with at least {peak / gib:.1f} GiB (device=...)" if default_budget
             else f"a memory_budget of at least {peak / gib:.1f} GiB"]
    if "recompute" not in searched and recompute != "full":
        fixes.append("recompute='auto'")
    if "zero" not in searched and zero != 3 and mesh[0] > 1:
        fixes.append("zero='auto'")
    if "offload" not in searched and offload == "none":
        fixes.append("offload='auto'")
    more = 2 * (world_size or mesh[0] * mesh[1] * mesh[2] * cp)
    fixes.append(f"more GPUs (pp and tp divide the weights and activations): mesh='auto' with world_size={more} "
                 f"(`--mesh auto --gpus {more}`)")
    return PlanError(f"{text}; use {', or '.join(fixes)}" + (f"\n{table}" if table else ""))


def _each_choice(choices, decide_at, *, blame=None, quiet: bool = False) -> tuple[dict, dict]:
    """({choice: Candidate}, {choice: ValueError}) of ``decide_at(choice)`` for each choice, in order;
    when none gives a plan, raises the error of ``blame`` (default: the last choice), unless ``quiet``."""
    tried, failed = {}, {}
    for c in choices:
        try:
            tried[c] = decide_at(c)
        except ValueError as e:
            failed[c] = e
    if not tried and not quiet and choices:
        raise failed[choices[-1] if blame is None else blame]
    return tried, failed


def choose_offload(job: Job, mesh: Mesh, microbatches: int, *, zero, offload, prune: bool = False,
                   step_floors=None) -> Candidate:
    """``choose_zero`` at ``offload``: "none", "optimizer" (everything offloaded) or a fraction (that
    share of the optimizer state on the host, in whole units, ``planner.offload_split``). For
    offload="auto": nothing offloaded where the plan fits the memory without it; else, at each ZeRO
    stage, the split of fastest step that fits the device and the host, chosen together with
    recompute (``_split``); the choice and the alternatives priced are said in the plan's notes. A
    given plan keeps its own choice. ``prune``, ``step_floors``: as ``choose_zero``'s."""
    req = job.request
    if offload != "auto" or req.given is not None:
        return choose_zero(job, mesh, microbatches, zero=zero, offload="none" if offload == "auto" else offload,
                           prune=prune, step_floors=step_floors)
    # a choice fails with no plan within the budget, offload not possible here or not priced on this device
    tried, failed = _each_choice(["none"], lambda where: choose_zero(job, mesh, microbatches, zero=zero, offload=where,
                                                                     prune=prune, step_floors=step_floors),
                                 quiet=True)
    if not (tried and tried["none"].peak_memory <= req.limit):
        more, worse = _each_choice(["split"], lambda where: choose_zero(job, mesh, microbatches, zero=zero,
                                                                        offload=where, prune=prune),
                                   quiet=bool(tried))
        tried.update({"optimizer": c for c in more.values()})
        failed.update({"optimizer": e for e in worse.values()})
    fits = {where: d.peak_memory <= req.limit for where, d in tried.items()}
    chosen = "optimizer" if not fits.get("none") and fits.get("optimizer") else "none"
    if not any(fits.values()):   # the least memory, for the error that names it (``no_fit_error``)
        chosen = min(tried, key=lambda where: tried[where].peak_memory)
    why = ("it fits without offload" if fits.get("none") else "only with offload it fits" if fits.get("optimizer")
           else "it does not fit either way; the least memory")
    rows = "; ".join([f"offload={w}{_split_text(d)}: {d.step_time * 1e3:.3f} ms, {d.peak_memory / 2**30:.2f} GiB"
                      f"{'' if fits[w] else ' (does not fit)'}" for w, d in tried.items()]
                     + [f"offload={w}: no plan ({e})" for w, e in failed.items()])
    return tried[chosen].with_note(f"offload chosen automatically: offload={chosen}, {why} "
                                   f"(budget {req.limit / 2**30:.2f} GiB; {rows})")


def _split_text(cand: Candidate) -> str:
    """How many units a candidate's offload keeps on the device, for the notes ("" without offload)."""
    c = cand.choices
    if c.offload == "none":
        return ""
    n = len(zero_units(cand.cap))
    return f" ({n - len(c.offload_kept)} of {n} units on the host)"


def _offloaded(job: Job, mesh: Mesh, microbatches: int, zero: int, offload) -> Candidate:
    """The candidate at ZeRO stage ``zero`` with ``offload``: "none", "optimizer" (every unit's
    optimizer on the host), a fraction (``_fraction``) or "split" (offload="auto"'s search, ``_split``)."""
    if offload == "split":
        return _split(job, mesh, microbatches, zero)
    if isinstance(offload, float) and job.request.given is None:
        return _fraction(job, mesh, microbatches, zero, offload)
    return price(job, mesh, microbatches, zero, offload)


def _fraction(job: Job, mesh: Mesh, microbatches: int, zero: int, fraction: float) -> Candidate:
    """offload=``fraction``: the units holding the share of the optimizer state nearest it, by bytes,
    offloaded in the order ``planner.offload_split`` gives (nothing offloaded when that is no unit)."""
    at = offload_pricer(job, mesh, microbatches, zero)
    order = offload_order(at.cap, at.strategies, mesh.tp)
    k = fraction_units(order, fraction)
    share = sum(b for _, b in order[:k]) / (sum(b for _, b in order) or 1.0)
    if k == 0:
        return price(job, mesh, microbatches, zero, "none").with_note(
            f"offload={fraction}: no unit holds that little of the optimizer state (the smallest, {order[0][0]}, "
            f"holds {order[0][1] / sum(b for _, b in order):.1%}); nothing offloaded")
    cand = at(kept_units(order, k))
    return cand.with_note(f"offload={fraction}: {split_note(cand, order, k, job.request)} ({share:.1%} of the "
                          f"optimizer state by bytes)")


def _split(job: Job, mesh: Mesh, microbatches: int, zero: int) -> Candidate:
    """offload="auto"'s split at ZeRO stage ``zero`` (``planner.offload_split.search_split``): the
    fastest that fits the memory budget and the host's memory; where none does, the candidate of
    least peak the host can hold (for ``no_fit_error``), its note saying what the host lacks."""
    req = job.request
    at = offload_pricer(job, mesh, microbatches, zero)
    order = offload_order(at.cap, at.strategies, mesh.tp)
    host_limit = host_memory(req.device, req.gpus_per_node)
    needs = host_needs(order, mesh, zero)
    k_host = max((k for k, need in enumerate(needs) if need <= host_limit), default=0)

    def price_k(k):
        return at(kept_units(order, k))
    found = search_split(len(order), price_k, limit=req.limit, k_host=k_host,
                         floor=_split_floor(job, at, order, mesh, zero) if mesh.pp == 1 else None)
    rows = "; ".join([f"{k} on the host: {c.step_time * 1e3:.3f} ms, {c.peak_memory / 2**30:.2f} GiB, "
                      f"{len(c.regions)} recompute regions{'' if c.peak_memory <= req.limit else ' (does not fit)'}"
                      for k, c in sorted(found.tried.items())]
                     + [f"{k} on the host: no plan ({e})" for k, e in sorted(found.failed.items())])
    host = f"the host holds {host_limit / 2**30:.2f} GiB per device"
    if found.best is None:
        k = max(found.tried, default=None)
        if k is None:
            raise next(iter(found.failed.values())) if found.failed else PlanError(
                f"offload='auto': {host}, less than the {needs[1] / 2**30:.2f} GiB the first unit's optimizer "
                "state needs there; give device= a profile with the host's memory (host_memory_bytes)")
        lack = (f"; offloading more would need {needs[k + 1] / 2**30:.2f} GiB of host memory, and {host}"
                if k < len(order) else "")
        return found.tried[k].with_note(f"offload split chosen automatically: none fits {req.where()}{lack} "
                                        f"(units priced: {rows})")
    cand = found.tried[found.best]
    return cand.with_note(f"offload split chosen automatically: {split_note(cand, order, found.best, req)}; the "
                          f"fastest step that fits {req.where()} and the host ({host}), offloading first the units "
                          f"whose gradients are final earliest in the backward (units priced: {rows})")


def _split_floor(job: Job, at, order, mesh: Mesh, zero: int):
    """``search_split``'s floor (``planner.offload_split``'s F(k)) on one stage: the terms no split
    changes (W, read off any candidate priced), plus ``cost_model.offload.update_floor`` with the
    longest backward any recompute choice gives."""
    req = job.request
    tp_inter = axis_is_inter_node(mesh.tp, 1, req.gpus_per_node)
    most = regions_for(at.cap, "full") if req.recompute == "auto" and find_blocks(at.cap) else None

    def recomputed(cand, regions) -> float:
        return cand.choices.microbatches * recompute_seconds(cand.strategies, [n for r in regions for n in r],
                                                             mesh.tp, req.device, tp_inter) / mesh.cp

    def floor(k: int, priced: Candidate) -> float:
        t = priced.terms
        base = t.total - t.update - t.offload - recomputed(priced, priced.regions)
        longest = most if most is not None else priced.regions
        return base + update_floor(at.cap, at.strategies, mesh, req.device, zero=zero, precision=req.precision,
                                   offload_kept=kept_units(order, k), timing=offload_timing(mesh, zero, req.offload_delay),
                                   regions=longest, window=base + recomputed(priced, longest), tp_inter=tp_inter)
    return floor


def split_note(cand: Candidate, order, k: int, req) -> str:
    """The units a split puts on the host and keeps on the device, with their bytes there."""
    host = [name for name, _ in order[:k]]
    shown = ", ".join(host) if len(host) <= 4 else f"{host[-1]} .. {host[0]}"
    gib = 2**30
    state = sum(m.host for m in cand.memory)
    need = host_need(cand.memory, cand.choices.mesh.pp)
    kept = sum(m.optimizer for m in cand.memory)
    return (f"{k} of {len(order)} units on the host ({shown}: {state / gib:.2f} GiB of fp32 master and optimizer "
            f"state, {need / gib:.2f} GiB of host memory with the gradients' staging buffers), "
            f"{len(order) - k} keeping their optimizer on the device ({kept / gib:.2f} GiB of optimizer state); "
            f"step {cand.step_time * 1e3:.3f} ms at a peak of {cand.peak_memory / gib:.2f} GiB")


def choose_zero(job: Job, mesh: Mesh, microbatches: int, *, zero, offload, prune: bool = False,
                step_floors=None) -> Candidate:
    """The candidate at ``zero``; for zero="auto", at every ZeRO stage dp can shard, keeping the fastest
    that fits the memory, else the one with the least peak. A given plan keeps its own stage.

    ``prune`` (the mesh ranking, which plans its winner again without it): a stage whose floors
    (``zero_floors``) show it cannot be chosen is not planned (``_pruned``), so the choice, and
    every figure of the candidate returned, is the one planning every stage gives; only the note
    listing the stages is shorter. ``step_floors``: {stage: a floor of the step of its plans that
    fit, without offload} (the ranking's ``planner.floors.RowFloors.zero_steps``), raising the
    floors ``zero_floors`` derives."""
    req = job.request
    if zero != "auto" or req.given is not None:
        return _offloaded(job, mesh, microbatches, 0 if zero == "auto" else zero, offload)
    stages = (0, 1, 2, 3) if mesh.dp_shard > 1 else (0,)

    def at(z):
        return _offloaded(job, mesh, microbatches, z, offload)
    floors = zero_floors(job, mesh, microbatches, offload, stages, step_floors) if prune else None
    # a stage fails with no plan within the budget (the ILP's, the stage DP's)
    tried = list((_each_choice(stages, at)[0] if floors is None else _pruned(job, mesh, stages, floors, at)).values())
    fits = [d for d in tried if d.peak_memory <= req.limit]
    best = min(fits, key=lambda d: d.step_time) if fits else min(tried, key=lambda d: d.peak_memory)
    if len(tried) > 1:
        rows = "; ".join(f"zero={d.choices.zero}: {d.step_time * 1e3:.3f} ms, {d.peak_memory / 2**30:.2f} GiB"
                         f"{'' if d.peak_memory <= req.limit else ' (does not fit)'}" for d in tried)
        why = "the fastest that fits" if fits else "none fits; the least memory"
        best = best.with_note(f"zero chosen automatically: zero={best.choices.zero}, {why} ({rows})")
    return best


def _pruned(job: Job, mesh: Mesh, stages, floors: dict, at) -> dict:
    """{stage: Candidate} of the ZeRO ``stages`` that may be chosen, in order, each planned by ``at``.
    Once a stage fits, a stage whose peak floor is above the budget cannot fit, and one whose step
    floor exceeds the fastest fitting stage's step cannot be the fastest. While none fits, a stage
    whose peak floor is above the least peak planned cannot fit either (that peak is above the
    budget) nor have the least peak. With pipeline stages, a stage whose peak floor is above the
    budget has no stage cut within it (``cut_cannot_fit``) and its plan raises: it is not planned,
    but for the last stage, whose error is the one raised when no stage has a plan. The stages
    that may fit are planned first, least step floor first (the fastest found early rules out
    more), then the others by their peak floors, least first."""
    limit, tried, failed = job.request.limit, {}, {}
    for z in sorted(stages, key=lambda z: (floors[z][0] > limit, max(floors[z][0], limit), floors[z][1])):
        peak_floor, step_floor = floors[z]
        fitting = [d.step_time for d in tried.values() if d.peak_memory <= limit]
        if fitting and (peak_floor > limit or step_floor > min(fitting)):
            continue
        if not fitting and tried and peak_floor > min(d.peak_memory for d in tried.values()):
            continue
        if z != stages[-1] and cut_cannot_fit(mesh, peak_floor, limit, job.request.stages):
            continue
        one, bad = _each_choice([z], at, quiet=True)
        tried.update(one)
        failed.update(bad)
    if not tried:
        raise failed[stages[-1]]   # as planning every stage raises
    return {z: tried[z] for z in stages if z in tried}


def cut_cannot_fit(mesh: Mesh, peak_floor: float, limit: float, stages) -> bool:
    """Whether no pipeline stage cut fits ``limit`` bytes, so that planning raises (the stage DP's
    ValueError), given ``peak_floor`` (``zero_floors``): with pp > 1 and the cut the DP's own (no
    ``stages=``), every cut's busiest rank holds at least 1/pp of the units' static bytes, which are
    at least the parameter state the floor counts (``cost_model.state.state_floor``, whose per-byte
    figures are the units' ``state_bytes_per_param_byte``, less the gradients at one microbatch),
    and the DP's budget only falls below ``limit`` (``planner.stage_cut``). The DP accepts a rank
    within a relative 1e-9 of the budget: a margin of 1e-6 keeps clear of it."""
    return mesh.pp > 1 and stages is None and peak_floor > limit * (1 + 1e-6)


def zero_floors(job: Job, mesh: Mesh, microbatches: int, offload: str, choices, step_floors=None) -> dict | None:
    """Per ZeRO stage, floors of its plan's peak bytes and step seconds that hold for any strategies
    and stage cut (``cost_model.state.state_floor``, ``cost_model.step.zero_sync_floor``; 0 where no
    step floor is priced; the larger of it and ``step_floors[stage]`` where given), for
    ``choose_zero`` to skip the stages that cannot be chosen; None where
    these floors are not derived (the optimizer offloaded, a given plan), and nothing is skipped.
    They hold at cp > 1 too: cp divides activations and per-token terms, never the weights, their
    state or the dp sync that the floors bound. Both are lowered by a relative 1e-9, so that
    rounding in the plans' own sums cannot cross them."""
    req = job.request
    if offload != "none" or req.given is not None:
        return None
    cap = retyped(job.capture_at(mesh, microbatches), req.precision)
    full = sum(math.prod(p.meta["val"].shape) * p.meta["val"].element_size() for p in cap.params.values())
    working_copy = working_copy_ratio(cap)
    shard = full / mesh.tp   # every parameter's local shard holds at least 1/tp of it
    slack = 1 - 1e-9
    out = {}
    for z in choices:
        step = zero_sync_floor(shard / mesh.pp, mesh, req.device, z, req.gpus_per_node, microbatches=microbatches,
                               gathered=working_copy or 1.0)
        out[z] = (state_floor(shard, mesh, z, working_copy, microbatches, mesh.pp) * slack,
                  max(0.0 if step is None else step * slack, (step_floors or {}).get(z, 0.0)))
    return out


def best_microbatches(job: Job, planned: Candidate, options: list[int]) -> int:
    """The microbatch count of the fastest step, from one candidate planned at the most microbatches.

    Per-unit compute, activations, recomputed forwards and point-to-point bytes scale with the
    microbatch size; the per-op launch overhead does not. Each count's cut is the stage DP's, checked
    against the memory model at that microbatch size (``cost_model.memory``'s ``tokens``), with
    every unit recomputed as ``recompute`` asks (under "auto", none, else all); a count with no cut
    that fits is skipped. Its step is the one sum of its terms (``cost_model.step.price_step``),
    cp's taken from ``planned``: each count moves the same tokens over cp."""
    req, c = job.request, planned.choices
    cap, strategies, mesh, offload = planned.cap, planned.strategies, c.mesh, c.offload != "none"
    units = layer_units(cap)
    wc = working_copy_ratio(cap)
    dev = req.device
    time, boundary, tp = unit_costs(cap, strategies, units, mesh, dev, gpus_per_node=req.gpus_per_node)
    overhead = OP_OVERHEAD * np.array([len(u.nodes) for u in units])
    unit_bytes = unit_params(cap, strategies, units, mesh.tp)
    tp_inter = axis_is_inter_node(mesh.tp, 1, req.gpus_per_node)
    modes = ["none", "full"] if req.recompute == "auto" else [req.recompute]
    best, best_time = c.microbatches, float("inf")
    for m in options:
        grow = c.microbatches / m   # how much larger each microbatch is
        scaled = (time - overhead) * grow + overhead
        found = _cut_at(job, planned, units, (scaled, boundary * grow), modes, m, grow)
        if found is None:
            continue
        cut, regions, memory = found
        # the cut decides which parameters the busiest rank syncs and updates
        params = rank_param_bytes(unit_bytes, cut.bounds, mesh)
        figures = rank_unit_figures(scaled, unit_bytes, cut.bounds, mesh) if c.zero >= 2 and mesh.dp > 1 else None
        dp = dp_sync_time(params, mesh, dev, c.zero, req.gpus_per_node, microbatches=m, gathered=wc or 1.0,
                          units=figures)
        again = []
        for nodes in map(frozenset, stage_nodes(cap, cut.bounds)):
            mine = [n for r in regions for n in r if n in nodes]
            fixed = (1 - BACKWARD_SHARE) * OP_OVERHEAD * len(mine)   # what does not scale with the microbatch
            again.append((recompute_seconds(strategies, mine, mesh.tp, dev, tp_inter, with_comm=True) - fixed) * grow
                         + fixed)
        work, _ = pipeline_work(cut, tp * grow, boundary * grow, mesh.pp, m, c.virtual_stages, again=again)
        window = price_step(work, dp=dp, cp=planned.terms.cp, update=0.0, offload=0.0, cp_ranks=mesh.cp).total
        update, host = plan_update_terms(memory, mesh, c.zero, c.precision, dev, offload=offload,
                                         timing=offload_timing(mesh, c.zero, c.offload_delay), window=window)
        seconds = price_step(work, dp=dp, cp=planned.terms.cp, update=update, offload=host, cp_ranks=mesh.cp).total
        if seconds < best_time:
            best, best_time = m, seconds
    return best


def _cut_at(job: Job, planned: Candidate, units, prices, modes, m: int, grow: float):
    """(the stage cut, its recompute regions, its memory) at ``m`` microbatches of ``grow`` times the
    captured microbatch's tokens, with the first of ``modes`` whose cut fits the memory; None if
    none does."""
    req, c = job.request, planned.choices
    time, boundary = prices
    for mode in modes:
        regions = regions_for(planned.cap, mode)
        static, act = unit_memory(planned.cap, planned.strategies, units, c.mesh, zero=c.zero,
                                  working_copy=working_copy_ratio(planned.cap), regions=regions,
                                  offload=c.offload != "none", attention=c.cp_attention,
                                  offload_kept=planned.offload_split)

        def memory(bounds, regions=regions):
            return cut_memory(planned.cap, planned.strategies, c.mesh, bounds=bounds, microbatches=m,
                              virtual=c.virtual_stages, schedule=c.schedule, zero=c.zero, regions=regions,
                              offload=c.offload != "none", attention=c.cp_attention, tokens=grow,
                              offload_kept=planned.offload_split)
        try:
            cut = choose_cut((time, static, act * grow, boundary), units, c.mesh, schedule=c.schedule, microbatches=m,
                             virtual=c.virtual_stages, memory_budget=req.limit,
                             peaks=lambda bounds, memory=memory: [x.peak for x in memory(bounds)])
        except ValueError:
            continue
        return cut, regions, memory(cut.bounds)
    return None


class _Scheduled(Job):
    """``job`` planned with another pipeline schedule and virtual stage count: a Job of its own request
    that reads ``job``'s captures (the schedule changes no trace)."""

    def __init__(self, job: Job, schedule: str, virtual: int):
        super().__init__(job.model, job.example_inputs,
                         dataclasses.replace(job.request, schedule=schedule,
                                             virtual_stages=virtual if schedule.startswith("Interleaved") else None))
        self.capture = job.capture


def auto_mesh(job: Job) -> tuple[Mesh, int, tuple[str, ...]]:
    """The fastest (dp, pp, tp), or (dp, pp, cp, tp), that fits, with the pipeline schedule and virtual
    stages ranked beside it (``mesh_search.schedule_options``), its microbatch count, and the ranking
    as plan notes; ``no_fit_error`` when none fits. Each mesh's candidate is planned as ``plan_mesh``
    plans it but for the ZeRO stages it cannot choose (``choose_zero``'s ``prune``), which only
    the winner's notes list: the winner is planned again, in full, with ``job.request`` now the
    winner's schedule and virtual stages (a searched choice, like the mesh)."""
    req = job.request
    if not req.world_size:
        raise ValueError('mesh="auto" needs the number of devices: pass world_size= (the CLI\'s --gpus)')
    jobs = {(req.schedule, req.virtual): job}

    def scheduled(schedule: str, virtual: int) -> Job:
        if (schedule, virtual) not in jobs:
            jobs[schedule, virtual] = _Scheduled(job, schedule, virtual)
        return jobs[schedule, virtual]

    def candidate(mesh: Mesh, m: int, schedule: str, virtual: int) -> Candidate:
        return choose_offload(scheduled(schedule, virtual), mesh, m, zero=req.zero, offload=req.offload, prune=True,
                              step_floors=bound.zero_steps(mesh, m, schedule, virtual))
    bound = RowFloors(job, 1)
    options, context = rank_meshes(req.world_size, job.example_inputs, price=candidate, capture=job.capture,
                                   memory_budget=req.limit, gpus_per_node=req.gpus_per_node,
                                   hsdp=req.zero == "auto" or req.zero in (1, 2, 3),   # ZeRO shards dp_shard
                                   sequence_parallel=req.sequence_parallel, schedule=req.schedule,
                                   virtual=req.virtual_stages, bound=bound)
    table = ranking_table(options, context=context)
    best = options[0]
    if not best.fits:
        closest = min(options, key=lambda o: o.peak_memory)
        if not np.isfinite(closest.peak_memory):
            raise PlanError(f"no mesh of {req.world_size} devices fits in memory; for {closest.mesh}: "
                            f"{closest.reason}:\n{table}")
        raise no_fit_error((closest.mesh.dp, closest.mesh.pp, closest.mesh.tp), closest.zero, closest.recompute,
                           closest.recompute_regions, closest.offload, closest.peak_memory, req.limit,
                           req.memory_budget is None, req.device.name,
                           ["mesh"] + [k for k in ("zero", "offload", "recompute") if getattr(req, k) == "auto"],
                           req.world_size, table, cp=closest.mesh.cp)
    note = f"mesh chosen automatically among {len(options)} candidates for {req.world_size} devices:\n{table}"
    job.request = scheduled(best.schedule, best.virtual).request
    return best.mesh, best.microbatches, (note,)
