"""The order of decisions: capture, tensor-parallel strategies, stage cuts, recompute, memory, the Plan.

``decide`` is what ``autopar.plan`` and rank 0 of ``autopar.parallelize`` run. Every figure comes
from ``cost_model``; the searches are the modules beside this one.
"""
from __future__ import annotations

import dataclasses
import functools
import gc
import math
import re
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import torch

from autopar.cost_model.devices import get_device
from autopar.cost_model.memo import cached
from autopar.cost_model.memory import kept_gathered_bytes
from autopar.cost_model.repeats import block_shift
from autopar.cost_model.stages import (SCHEDULES, pipeline_split, rank_param_bytes, state_bytes_per_param_byte,
                                       state_floor, unit_costs)
from autopar.cost_model.strategy import OP_OVERHEAD
from autopar.cost_model.step import (dp_sync_time, param_byte_time, plan_update_time, rank_unit_figures, rank_units,
                                     rank_update_time, step_time, unit_sync_times, zero_sync_floor)
from autopar.errors import PlanError, PlanFormatError
from autopar.mesh import Mesh
from autopar.passes.context_parallel import check_context, ring_refusal
from autopar.collectives import CP_ATTENTIONS
from autopar.cost_model.context import attention_priced, context_priced, cp_attention_seconds
from autopar.graph.capture import Captured, capture_pass, example_args
from autopar.graph.precision import compute_dtype, retyped, working_copy_ratio
from autopar.graph.units import find_blocks, layer_units, stage_of_nodes, zero_units
from autopar.planner.megatron import megatron_options
from autopar.planner.mesh_search import rank_meshes, ranking_table
from autopar.planner.other_shapes import plan_at_shapes
from autopar.planner.recompute import choose_recompute, memory_breakdown, regions_for
from autopar.planner.reshard import choose_kept
from autopar.planner.sharding import (Assignment, check_tp, enumerate_strategies, sequence_parallel_notes,
                                      sequence_sharded, sharding_fields, solve, strategies_from_plan, with_regather)
from autopar.planner.stage_cut import choose_cut
from autopar.planner.stage_dp import cut_stages, inflight_microbatches, min_peak_memory
from autopar.plans import (OFFLOADS, Plan, StagePlan, axis_warnings, edited_source, fit_warning,
                           offload_limit, standing_notes, zero_on_mesh)

_UNITS = {"": 1, "B": 1, "KB": 1e3, "MB": 1e6, "GB": 1e9, "TB": 1e12,
          "KIB": 2**10, "MIB": 2**20, "GIB": 2**30, "TIB": 2**40}


def parse_bytes(value) -> float | None:
    """``"60GiB"``, ``"500MB"`` or a number of bytes."""
    if value is None or isinstance(value, (int, float)):
        return value
    m = re.fullmatch(r"\s*([\d.]+)\s*([A-Za-z]*)\s*", str(value))
    if not m or m.group(2).upper() not in _UNITS:
        raise ValueError(f"memory_budget {value!r}: expected a size such as '60GiB' or '500MB'")
    return float(m.group(1)) * _UNITS[m.group(2).upper()]


def check_knobs(mesh: Mesh, recompute, schedule, zero, sequence_parallel, offload="none"):
    """Refuse a knob value the planner does not know, with the values it does."""
    if schedule not in SCHEDULES:
        raise ValueError(f"schedule={schedule!r}: expected one of {', '.join(SCHEDULES)}")
    if recompute not in ("none", "selective", "full", "auto"):
        raise ValueError(f"recompute={recompute!r}: expected 'none', 'selective', 'full' or 'auto'")
    if zero not in (0, 1, 2, 3, "auto"):
        raise ValueError(f"zero={zero!r}: expected 0 (nothing sharded over dp), 1 (optimizer state), "
                         "2 (and gradients), 3 (and weights, gathered per unit) or 'auto'")
    if sequence_parallel not in (True, False, "auto"):
        raise ValueError(f"sequence_parallel={sequence_parallel!r}: expected True, False or 'auto'")
    if offload not in (*OFFLOADS, "auto"):
        raise ValueError(f"offload={offload!r}: expected 'none' (everything on the device), 'optimizer' (the fp32 "
                         "master weights and AdamW state in host memory, stepped by the CPU) or 'auto' (offload "
                         "only when the plan fits the memory budget with it and not without)")


def _keep_knob(keep_gathered, zero):
    """``keep_gathered`` as the planner takes it: "auto", or a tuple of unit names, which only zero=3
    (or "auto", should it choose 3) can keep: refused with another zero, as a plan file's are."""
    if isinstance(keep_gathered, str) and keep_gathered == "auto":
        return keep_gathered
    if isinstance(keep_gathered, (list, tuple)) and all(isinstance(n, str) for n in keep_gathered):
        if keep_gathered and zero not in (3, "auto"):
            raise ValueError(f"keep_gathered={list(keep_gathered)} names units to keep gathered from forward to "
                             f"backward, but only zero=3 reshards units (zero={zero!r} here); use zero=3 (or "
                             "'auto'), or leave keep_gathered='auto'")
        return tuple(keep_gathered)
    raise ValueError(f"keep_gathered={keep_gathered!r}: expected 'auto' (the planner keeps what fits the memory "
                     "budget under zero=3) or a list of unit names to keep gathered from forward to backward "
                     "(() reshards every unit)")


def _local_inputs(example_inputs, mesh: Mesh, microbatches: int):
    """One dp rank's microbatch of the global example batch (dim 0 of every tensor)."""
    batch = example_inputs[0].shape[0]
    if batch % (mesh.dp * microbatches):
        raise ValueError(f"batch size {batch} is not divisible by dp={mesh.dp} x microbatches="
                         f"{microbatches}; use a batch that is a multiple of {mesh.dp * microbatches}")
    b = batch // (mesh.dp * microbatches)
    return tuple(x[:b] if isinstance(x, torch.Tensor) and x.dim() > 0 else x for x in example_inputs)


def _virtual(schedule: str, virtual_stages) -> int:
    v = virtual_stages or (2 if schedule.startswith("Interleaved") else 1)
    if v > 1 and not schedule.startswith("Interleaved"):
        raise ValueError(f"virtual_stages={v} needs an interleaved schedule, not {schedule}")
    return v


def _microbatch_options(mesh: Mesh, batch: int, schedule: str, microbatches) -> list[int]:
    """The microbatch counts the schedule can take for this batch (one, if the user fixed it)."""
    local = batch // mesh.dp if batch % mesh.dp == 0 else batch
    if microbatches is not None:
        if mesh.pp > 1 and microbatches < mesh.pp:
            raise ValueError(f"microbatches={microbatches} is fewer than the {mesh.pp} pipeline stages; "
                             f"use at least {mesh.pp} so every stage has work")
        if schedule.startswith("Interleaved") and microbatches % mesh.pp:
            raise ValueError(f"{schedule} needs the microbatch count to be a multiple of pp={mesh.pp}; "
                             f"got {microbatches}")
        return [microbatches]
    if mesh.pp == 1:
        return [1]
    ok = [m for m in range(mesh.pp, local + 1) if local % m == 0
          and (not schedule.startswith("Interleaved") or m % mesh.pp == 0)]
    if not ok:
        raise ValueError(f"a dp-local batch of {local} cannot be split into at least pp={mesh.pp} "
                         f"microbatches for {schedule}; use a batch that is a multiple of {mesh.dp * mesh.pp}")
    return ok


def _collector_paused(fn):
    """``fn`` run with Python's cyclic garbage collector off (as it was, after): planning makes
    millions of small objects that live to its end (prices, memo entries, strategies), and every
    full collection while it runs scans them and the captured graphs again, finding almost nothing
    to free: a sixth of the planning time of a 70B model. Reference counting still frees what it
    can; the collector's next pass after planning frees the cycles left."""
    @functools.wraps(fn)
    def paused(*args, **kwargs):
        was = gc.isenabled()
        gc.disable()
        try:
            return fn(*args, **kwargs)
        finally:
            if was:
                gc.enable()
    return paused


@_collector_paused
def decide(model, mesh, example_inputs, *, plan="auto", sequence_parallel="auto", recompute="none",
           memory_budget=None, schedule="1F1B", microbatches=None, zero=0, device="h100",
           gpus_per_node=8, stages=None, virtual_stages=None, world_size=None,
           precision="fp32", offload="none", keep_gathered="auto", cp_attention="auto") -> tuple[Captured, dict, Plan]:
    """Capture and plan: the graph, the strategy per node and the Plan (no process group needed).

    ``keep_gathered`` (zero=3): "auto", the planner keeps gathered from forward to backward the
    units it can afford within the memory budget (``autopar.planner.reshard``); or the unit names
    to keep, () resharding every unit after its forward (FSDP2's default).

    ``cp_attention`` (cp > 1): "allgather", "ring", or "auto", the one of lower exposed
    communication (``_cp_attention``).

    With pp > 1 and no ``microbatches``, every count the schedule can take is planned and
    the one with the lowest predicted step time is kept. ``mesh="auto"`` needs ``world_size``:
    every valid (dp, pp, tp) is ranked first (``autopar.planner.mesh_search``) and the best one planned."""
    notes = ()
    example_inputs = example_args(model, example_inputs)   # a lone tensor or a list too; counted against forward
    compute_dtype(precision)   # an unknown precision fails before any planning
    offload = "none" if offload is None else offload   # the design's spelling of "none"
    captures: dict = {}

    def capture(inputs) -> Captured:   # the mesh search and the plan often trace the same shapes
        key = tuple((tuple(x.shape), x.dtype) for x in inputs)
        if key not in captures:
            captures[key] = capture_pass(model, inputs, require_loss=True)
        return captures[key]

    _check_cp_attention(cp_attention, mesh)
    knobs = dict(plan=plan, sequence_parallel=sequence_parallel, memory_budget=memory_budget, cp_attention=cp_attention,
                 schedule=schedule, zero=zero, device=device, gpus_per_node=gpus_per_node, stages=stages,
                 virtual_stages=virtual_stages, recompute=recompute, precision=precision, capture=capture,
                 offload=offload, keep_gathered=_keep_knob(keep_gathered, zero))
    if isinstance(mesh, str) and mesh == "auto":
        def price(candidate: Mesh, m: int) -> Decision:
            # the candidate's plan as it is made below, but for the ZeRO stages it cannot choose (``_decide_zero``'s
            # bounds), which only the winner's notes list: the winner is planned again, in full, below
            check_knobs(candidate, recompute, schedule, zero, sequence_parallel, offload)
            return _decide_offload(model, candidate, example_inputs, microbatches=m, prune=True, **knobs)

        budget = parse_bytes(memory_budget)
        mesh, microbatches, notes = _auto_mesh(example_inputs, world_size, price=price, capture=capture,
                                               sequence_parallel=sequence_parallel,
                                               hsdp=zero == "auto" or zero in (1, 2, 3),   # ZeRO shards dp_shard
                                               gpus_per_node=gpus_per_node, default_budget=budget is None,
                                               device=get_device(device).name,
                                               searched=dict(zero=zero, offload=offload, recompute=recompute),
                                               memory_budget=get_device(device).memory_bytes if budget is None
                                               else budget)
    mesh = Mesh.parse(mesh)
    check_knobs(mesh, recompute, schedule, zero, sequence_parallel, offload)
    options = _microbatch_options(mesh, example_inputs[0].shape[0], schedule, microbatches)
    if isinstance(plan, Plan):
        options = [plan.microbatches]
    best = _decide_offload(model, mesh, example_inputs, microbatches=max(options), **knobs)
    if len(options) > 1:
        m = _best_microbatches(best, mesh, options, knobs)
        if m != best.fields["microbatches"]:
            best = _decide_offload(model, mesh, example_inputs, microbatches=m,
                                   **{**knobs, "zero": best.fields["zero"], "offload": best.fields["offload"]})
    searched = [knob for knob, value in (("zero", zero), ("offload", offload), ("recompute", recompute))
                if value == "auto" and plan in ("auto", "megatron")]   # a given plan keeps its own choices
    budget = parse_bytes(memory_budget)
    limit = get_device(device).memory_bytes if budget is None else budget
    if searched and best.peak_memory > limit:
        f = best.fields
        raise no_fit_error(f["mesh"], f["zero"], f["recompute"], len(f["recompute_regions"]), f["offload"],
                           best.peak_memory, limit, budget is None, best.dev.name, searched, cp=f["cp"])
    return best.cap, best.strategies, best.plan(notes)


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
    devices = mesh[0] * mesh[1] * mesh[2] * cp
    more = 2 * (world_size or devices)
    fixes.append(f"more GPUs (pp and tp divide the weights and activations): mesh='auto' with world_size={more} "
                 f"(`--mesh auto --gpus {more}`)")
    return PlanError(f"{text}; use {', or '.join(fixes)}" + (f"\n{table}" if table else ""))


def _best_microbatches(planned: Decision, mesh: Mesh, options: list[int], knobs: dict) -> int:
    """The microbatch count with the lowest predicted step time, from one plan at the most microbatches.

    Per-unit compute, activations and point-to-point bytes scale with the microbatch size; the
    per-op launch overhead does not. Counts whose stages cannot fit the memory budget are skipped."""

    cap, strategies, planned_m = planned.cap, planned.strategies, planned.fields["microbatches"]
    dev = get_device(knobs["device"])
    units = layer_units(cap)
    recompute = knobs["recompute"]
    # the activations each cut is priced with, as _stage_fields tries them
    modes = ["none", "full"] if recompute == "auto" else [recompute]
    acts = []
    for mode in modes:
        time, static, act, boundary = unit_costs(cap, strategies, units, mesh, dev, zero=planned.fields["zero"],
                                                 gpus_per_node=knobs["gpus_per_node"],
                                                 working_copy=working_copy_ratio(cap), regions=regions_for(cap, mode))
        acts.append(act)
    overhead = OP_OVERHEAD * np.array([len(u.nodes) for u in units])
    budget = parse_bytes(knobs["memory_budget"])
    budget = dev.memory_bytes if budget is None else budget
    zero, gpus_per_node, working_copy = planned.fields["zero"], knobs["gpus_per_node"], working_copy_ratio(cap)
    offload = planned.fields["offload"] != "none"
    best, best_time = planned_m, float("inf")
    for m in options:
        grow = planned_m / m   # how much larger each microbatch is
        cut = None
        for act in acts:
            try:
                cut = cut_stages((time - overhead) * grow + overhead, static, act * grow, boundary * grow, p=mesh.pp,
                                 m=m, v=_virtual(knobs["schedule"], knobs["virtual_stages"]),
                                 schedule=knobs["schedule"], memory_budget=budget)
                break
            except ValueError:
                continue
        if cut is None:
            continue
        # the cut decides which parameters the busiest rank syncs and updates
        params = rank_param_bytes(static, cut.bounds, mesh, zero, working_copy)
        scaled = (time - overhead) * grow + overhead
        seconds = step_time(cut.step_time, [dp_sync_time(params, mesh, dev, zero, gpus_per_node, microbatches=m,
                                                         gathered=working_copy or 1.0,
                                                         units=_zero_units(scaled, static, cut.bounds, mesh, zero,
                                                                           working_copy)[0])],
                            rank_update_time(params, mesh, dev, zero, working_copy > 0, offload=offload))
        if seconds < best_time:
            best, best_time = m, seconds
    return best


def _auto_mesh(example_inputs, world_size, *, default_budget: bool, device: str, searched: dict, **kw):
    """The fastest (dp, pp, tp), or (dp, pp, cp, tp), that fits, its microbatch count, and the ranking as
    plan notes; ``no_fit_error`` when none fits (``searched``: the knobs and their values, ``device`` its name)."""
    if not world_size:
        raise ValueError('mesh="auto" needs the number of devices: pass world_size= (the CLI\'s --gpus)')
    options, context = rank_meshes(world_size, example_inputs, **kw)
    table = ranking_table(options, context=context)
    best = options[0]
    if not best.fits:
        closest = min(options, key=lambda o: o.peak_memory)
        if not np.isfinite(closest.peak_memory):
            raise PlanError(f"no mesh of {world_size} devices fits in memory; for {closest.mesh}: "
                            f"{closest.reason}:\n{table}")
        raise no_fit_error((closest.mesh.dp, closest.mesh.pp, closest.mesh.tp), closest.zero, closest.recompute,
                           closest.recompute_regions, closest.offload, closest.peak_memory, kw["memory_budget"],
                           default_budget, device, ["mesh"] + [k for k, v in searched.items() if v == "auto"],
                           world_size, table, cp=closest.mesh.cp)
    note = f"mesh chosen automatically among {len(options)} candidates for {world_size} devices:\n{table}"
    return best.mesh, best.microbatches, (note,)


@dataclass
class Decision:
    """One candidate's decisions and figures, before they become a Plan: what the mesh ranking and
    the microbatch choice compare, and what ``plan`` turns into the one Plan once it has won.

    ``fields``: every field of the Plan except its notes and warnings (derived only for the plan
    that is kept: they price remedies, which the losing candidates need not)."""

    cap: Captured
    strategies: dict
    fields: dict
    dev: object
    budget: float | None
    gpus_per_node: int
    given: Plan | None = None
    terms: dict | None = None   # the step time's terms (compute, tp, cp, pp, bubble, dp, update) that the ranking shows

    @property
    def step_time(self) -> float:
        f = self.fields
        return step_time(f["predicted_compute_s"], [f["predicted_comm_s"]], f["predicted_update_s"])

    @property
    def peak_memory(self) -> float:
        return max(m.peak for m in self.fields["memory"])

    def plan(self, notes: tuple[str, ...] = ()) -> Plan:
        """The Plan, built once: the fields, the given plan's notes and model, ``notes``, the warnings."""
        fields = dict(self.fields)
        if self.given is not None:   # its notes less those an edit made untrue, with those derived for it now
            fields.update(notes=standing_notes(self.given.notes, _view(fields), fields.get("notes", ())),
                          model=self.given.model)
        fields["notes"] = fields.get("notes", ()) + tuple(notes)
        fields["warnings"] = _warnings(_view(fields), self.cap, self.strategies, Mesh.of_plan(_view(fields)),
                                       self.dev, self.budget, self.gpus_per_node)
        return Plan(**fields)


def _check_units(cap, names: tuple[str, ...], what: str = "plan.keep_gathered ") -> None:
    """A plan's ``keep_gathered`` (or the knob, ``what``) names units of this model (that it names them
    only under zero=3 is ``Plan``'s check, and ``_keep_knob``'s)."""
    known = [u.name for u in zero_units(cap)]
    unknown = [n for n in names if n not in known]
    if unknown:
        raise PlanFormatError(f"{what}{list(names)}: the model has no unit {', '.join(unknown)}; its units are "
                              f"{', '.join(known)}")


def _view(fields: dict) -> SimpleNamespace:
    """A Plan's fields read as its attributes, its defaults where ``fields`` has none: what the checks
    that read a plan (``derives_as``, the warnings) see before the Plan is built."""
    defaults = {f.name: f.default for f in dataclasses.fields(Plan) if f.default is not dataclasses.MISSING}
    return SimpleNamespace(**{**defaults, **fields})


def _decide_offload(model, mesh, example_inputs, *, offload, memory_budget, device, prune: bool = False,
                    **knobs) -> Decision:
    """``_decide_zero`` at ``offload``; for offload="auto", with the optimizer on the device and on
    the host, keeping the host ("optimizer") only when the plan misses the memory budget (the
    device's memory by default) without it and fits with it, else "none" (the one with the least
    peak when neither fits); the choice is said in the plan's notes. A given plan keeps its own choice.
    ``prune``: as ``_decide_zero``'s."""
    if offload != "auto" or isinstance(knobs["plan"], Plan):
        return _decide_zero(model, mesh, example_inputs, offload="none" if offload == "auto" else offload,
                            memory_budget=memory_budget, device=device, prune=prune, **knobs)
    limit = _limit(memory_budget, device)
    # a choice fails with no plan within the budget, offload not possible here or not priced on this device
    tried, failed = _each_choice(OFFLOADS, lambda where: _decide_zero(
        model, mesh, example_inputs, offload=where, memory_budget=memory_budget, device=device, prune=prune, **knobs),
        blame="none")
    fits = {where: d.peak_memory <= limit for where, d in tried.items()}
    chosen = "optimizer" if not fits.get("none") and fits.get("optimizer") else "none"
    if not any(fits.values()):   # the least memory, for the error that names it (``no_fit_error``)
        chosen = min(tried, key=lambda where: tried[where].peak_memory)
    why = ("it fits without offload" if fits.get("none") else "only with offload it fits" if fits.get("optimizer")
           else "it does not fit either way; the least memory")
    rows = "; ".join([f"offload={w}: {d.step_time * 1e3:.3f} ms, {d.peak_memory / 2**30:.2f} GiB"
                      f"{'' if fits[w] else ' (does not fit)'}" for w, d in tried.items()]
                     + [f"offload={w}: no plan ({e})" for w, e in failed.items()])
    best = tried[chosen]
    best.fields["notes"] = best.fields.get("notes", ()) + (
        f"offload chosen automatically: offload={chosen}, {why} (budget {limit / 2**30:.2f} GiB; {rows})",)
    return best


def _limit(memory_budget, device) -> float:
    """The bytes a plan must fit: ``memory_budget``, else the device's memory."""
    budget = parse_bytes(memory_budget)
    return get_device(device).memory_bytes if budget is None else budget


def _each_choice(choices, decide_at, *, blame=None, quiet: bool = False) -> tuple[dict, dict]:
    """({choice: Decision}, {choice: ValueError}) of ``decide_at(choice)`` for each choice, in order;
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


def _decide_zero(model, mesh, example_inputs, *, zero, memory_budget, device, prune: bool = False,
                 **knobs) -> Decision:
    """``_decide`` at ``zero``; for zero="auto", at every ZeRO stage dp can shard, keeping the fastest
    that fits the memory budget (the device's memory by default), else the one with the least peak.
    A given plan keeps its own stage.

    ``prune`` (the mesh ranking, which plans its winner again without it): a stage whose floors
    (``_zero_floors``) show it cannot be chosen is not planned, so the choice, and every figure of
    the Decision returned, is the one planning every stage gives; only the note listing the stages
    is shorter. Once a stage fits, a stage whose peak floor is above the budget cannot fit, and one
    whose step floor exceeds the fastest fitting stage's step cannot be the fastest. While none
    fits, a stage whose peak floor is above the least peak planned cannot fit either (that peak is
    above the budget) nor have the least peak. With pipeline stages, a stage whose peak floor is
    above the budget has no stage cut within it (``_cut_cannot_fit``) and its plan raises: it is
    not planned, but for the last stage, whose error is the one raised when no stage has a plan.
    The stages that may fit are planned first, then the others by their peak floors, least first."""
    if zero != "auto" or isinstance(knobs["plan"], Plan):
        return _decide(model, mesh, example_inputs, zero=0 if zero == "auto" else zero,
                       memory_budget=memory_budget, device=device, **knobs)
    limit = _limit(memory_budget, device)
    stages = (0, 1, 2, 3) if mesh.dp_shard > 1 else (0,)

    def decide_at(z):
        return _decide(model, mesh, example_inputs, zero=z, memory_budget=memory_budget, device=device, **knobs)
    floors = _zero_floors(mesh, example_inputs, choices=stages, device=device, **knobs) if prune else None
    if floors is None:
        # a stage fails with no plan within the budget (the ILP's, the stage DP's)
        tried, _ = _each_choice(stages, decide_at)
    else:
        tried, failed = {}, {}
        for z in sorted(stages, key=lambda z: (floors[z][0] > limit, max(floors[z][0], limit))):
            peak_floor, step_floor = floors[z]
            fitting = [d.step_time for d in tried.values() if d.peak_memory <= limit]
            if fitting and (peak_floor > limit or step_floor > min(fitting)):
                continue
            if not fitting and tried and peak_floor > min(d.peak_memory for d in tried.values()):
                continue
            if z != stages[-1] and _cut_cannot_fit(mesh, peak_floor, limit, knobs["stages"]):
                continue
            one, bad = _each_choice([z], decide_at, quiet=True)
            tried.update(one)
            failed.update(bad)
        if not tried:
            raise failed[stages[-1]]   # as planning every stage raises
        tried = {z: tried[z] for z in stages if z in tried}
    tried = list(tried.values())
    fits = [d for d in tried if d.peak_memory <= limit]
    best = min(fits, key=lambda d: d.step_time) if fits else min(tried, key=lambda d: d.peak_memory)
    if len(tried) > 1:
        rows = "; ".join(f"zero={d.fields['zero']}: {d.step_time * 1e3:.3f} ms, {d.peak_memory / 2**30:.2f} GiB"
                         f"{'' if d.peak_memory <= limit else ' (does not fit)'}" for d in tried)
        why = "the fastest that fits" if fits else "none fits; the least memory"
        best.fields["notes"] = best.fields.get("notes", ()) + (
            f"zero chosen automatically: zero={best.fields['zero']}, {why} ({rows})",)
    return best


def _cut_cannot_fit(mesh, peak_floor: float, limit: float, stages) -> bool:
    """Whether no pipeline stage cut fits ``limit`` bytes, so that planning raises (the stage DP's
    ValueError), given ``peak_floor`` (``_zero_floors``): with pp > 1 and the cut the DP's own (no
    ``stages=``), every cut's busiest rank holds at least 1/pp of the units' static bytes, which are
    at least the parameter state the floor counts (``cost_model.stages.state_floor``, whose per-byte
    figure is the units' ``state_bytes_per_param_byte``, less the gradients at one microbatch).
    The DP accepts a rank within a relative 1e-9 of the budget: a margin of 1e-6 keeps clear of it."""
    return mesh.pp > 1 and stages is None and peak_floor > limit * (1 + 1e-6)


def _zero_floors(mesh, example_inputs, *, choices, device, plan, microbatches, capture, precision, gpus_per_node,
                 schedule, virtual_stages, offload, **_) -> dict | None:
    """Per ZeRO stage, floors of its plan's peak bytes and step seconds that hold for any strategies
    and stage cut (``cost_model.stages.state_floor``, ``cost_model.step.zero_sync_floor``; 0 where no
    step floor is priced), for ``_decide_zero`` to skip the stages that cannot be chosen; None where
    these floors are not derived (the optimizer offloaded, a given plan), and nothing is skipped. They
    hold at cp > 1 too: ``cost_model.context`` divides activations and per-token terms by cp, never
    the weights, their state or the dp sync that the floors bound.
    Both are lowered by a relative 1e-9, so that rounding in the plans' own sums cannot cross them."""
    if offload != "none" or isinstance(plan, Plan):
        return None
    cap = retyped(capture(_local_inputs(example_inputs, mesh, microbatches)), precision)
    full = sum(math.prod(p.meta["val"].shape) * p.meta["val"].element_size() for p in cap.params.values())
    working_copy = working_copy_ratio(cap)
    dev = get_device(device)
    n_stages = mesh.pp * _virtual(schedule, virtual_stages) if mesh.pp > 1 else 1
    shard = full / mesh.tp   # every parameter's local shard holds at least 1/tp of it
    slack = 1 - 1e-9
    out = {}
    for z in choices:
        step = zero_sync_floor(shard / mesh.pp, mesh, dev, z, gpus_per_node, microbatches=microbatches,
                               gathered=working_copy or 1.0)
        out[z] = (state_floor(shard, mesh, z, working_copy, microbatches, n_stages) * slack,
                  0.0 if step is None else step * slack)
    return out


def _decide(model, mesh, example_inputs, *, plan, sequence_parallel, memory_budget, schedule, microbatches,
            zero, device, gpus_per_node, stages, virtual_stages, recompute, precision, capture, offload,
            keep_gathered="auto", cp_attention="auto") -> Decision:
    m = microbatches
    v = _virtual(schedule, virtual_stages)
    dev = get_device(device)
    cap = capture(_local_inputs(example_inputs, mesh, m))
    check_tp(cap, mesh.tp)
    check_context(cap, mesh.cp)
    if isinstance(plan, str) and plan not in ("auto", "megatron"):
        if not plan.lstrip().startswith("{") and not Path(plan).exists():
            raise ValueError(f"plan={plan!r}: expected 'auto', 'megatron', a Plan or a plan JSON path")
        plan = Plan.from_json(plan)
    given = plan if isinstance(plan, Plan) else None
    precision = given.precision if given is not None else precision
    cap = retyped(cap, precision)   # price compute, activations and collectives at the compute dtype
    block_shift(cap)   # laid out before any op is priced, so that the repeated blocks' ops are priced as block 1's
    options = enumerate_strategies(cap, mesh.tp, sequence_parallel)   # on the retyped graph's nodes
    regions = None
    if given is not None:   # run as written: re-derive its collectives, times and memory from its choices
        if Mesh.of_plan(given) != mesh:
            raise PlanError(f"plan.mesh {Mesh.of_plan(given)} does not match the mesh {mesh}; re-plan for this mesh")
        if tuple(map(tuple, given.input_shapes)) != tuple(tuple(i.meta["val"].shape) for i in cap.inputs):
            raise PlanError(f"plan.input_shapes {given.input_shapes} do not match this batch's "
                            "microbatch shapes; re-plan for this batch size")
        assignment = Assignment(strategies_from_plan(cap, options, given), options, given.solve_seconds, 0.0)
        schedule, v, zero, recompute, offload = (given.schedule, given.virtual_stages, given.zero, given.recompute,
                                                 given.offload)
        stages = [s.modules for s in given.stages] or None
        regions = _regions_from_plan(cap, given)
        plan = given.source
    elif plan == "megatron" or plan == "auto":
        if plan == "megatron" and mesh.tp > 1:
            options = megatron_options(cap, options, sequence_parallel is not False)
        assignment = solve(cap, options, mesh.tp, dev, inter_node=mesh.tp > gpus_per_node,
                           memory_budget=parse_bytes(memory_budget) if recompute != "auto" else None,
                           param_state_bytes=state_bytes_per_param_byte(mesh, zero, working_copy_ratio(cap),
                                                                       offload != "none"),
                           param_byte_seconds=param_byte_time(mesh, dev, zero=zero, working_copy=precision != "fp32",
                                                              gpus_per_node=gpus_per_node))
    else:
        raise ValueError(f"plan={plan!r}: expected 'auto', 'megatron', a Plan or a plan JSON path")
    zero, notes = zero_on_mesh(zero, mesh)
    attention, why = _cp_attention(cp_attention if given is None else given.cp_attention, cap, assignment.strategies,
                                   mesh, dev, gpus_per_node)
    notes += why
    refused = offload_limit(offload, precision, zero, (mesh.dp, mesh.pp, mesh.tp), m)
    if refused:
        raise ValueError(refused)
    budget = parse_bytes(memory_budget)
    limit = dev.memory_bytes if budget is None else budget   # what recompute="auto" and keep_gathered fit in
    sp = sequence_sharded(cap, assignment.strategies)
    notes += sequence_parallel_notes(cap, mesh.tp, sequence_parallel)
    kept = tuple(given.keep_gathered) if given is not None else () if keep_gathered == "auto" else keep_gathered
    if kept:
        _check_units(cap, kept, "plan.keep_gathered " if given is not None else "keep_gathered=")
    kept = kept if zero == 3 else ()   # zero="auto"'s other stages; zero=3 without dp to shard (its note says so)

    def fields_of(assignment, recompute, kept=()) -> dict:
        fields = sharding_fields(cap, assignment, mesh, dev, sequence_parallel=sp, zero=zero, microbatches=m,
                                 source=plan, gpus_per_node=gpus_per_node, kept=kept, cp_attention=attention)
        fields.update(schedule=schedule, virtual_stages=v)
        if mesh.pp > 1:
            fields.update(_stage_fields(cap, assignment.strategies, mesh, dev, schedule=schedule, virtual=v,
                                        microbatches=m, zero=zero, gpus_per_node=gpus_per_node, memory_budget=budget,
                                        stages=stages, recompute=recompute, regions=regions, kept=kept))
        fields.update(_memory_fields(cap, assignment.strategies, mesh, dev, fields, recompute=recompute,
                                     budget=limit, zero=zero, regions=regions, offload=offload, kept=kept))
        return fields

    fields = None
    if given is None and sp and budget is not None:
        plain = _fields_or_none(lambda: fields_of(assignment, "none"))
        if plain is None or max(m.peak for m in plain["memory"]) > budget:
            # Megatron's storage rule before any recompute: an all-gather is cheaper than a forward
            assignment = dataclasses.replace(assignment, strategies=with_regather(assignment.strategies))
        elif recompute == "auto" and not kept and find_blocks(cap):
            # recompute="auto" recomputes nothing where nothing recomputed fits (``choose_recompute``; the
            # cut, too, is the one made without recompute): these are its fields, already priced
            fields = dict(plain, recompute="auto")
    if fields is None:
        fields = fields_of(assignment, recompute, kept)
    if given is None and keep_gathered == "auto" and zero == 3 and mesh.dp > 1:
        choice = _choose_kept(cap, assignment.strategies, mesh, dev, fields, limit, gpus_per_node)
        if choice.kept:
            fields = _with_kept(cap, mesh, dev, fields, choice.kept, gpus_per_node=gpus_per_node,
                                sharding=lambda: sharding_fields(cap, assignment, mesh, dev, sequence_parallel=sp,
                                                                 zero=zero, microbatches=m, source=plan,
                                                                 gpus_per_node=gpus_per_node, kept=choice.kept,
                                                                 cp_attention=attention),
                                memory=lambda f: _memory_fields(cap, assignment.strategies, mesh, dev, f,
                                                                recompute=recompute, budget=limit, zero=zero,
                                                                regions=_regions_from_plan(cap, _view(f)),
                                                                offload=offload, kept=choice.kept))
        kept = choice.kept
        notes += (_kept_note(choice, len(zero_units(cap)), limit, budget is None, dev),)
    fields = context_priced(fields, mesh.cp, mesh.tp, dev, gpus_per_node, cap=cap,
                            strategies=assignment.strategies)   # priced whole, run on 1/cp of it
    if mesh.cp > 1 and fields["cp_attention"] == "allgather":
        # what each attention keeps per stage for its microbatches in flight (the ring keeps neither
        # gathered keys and values nor a mask)
        inflight = inflight_microbatches(mesh.pp, m, v, schedule) if fields.get("stages") else [1]
        fields = attention_priced(fields, mesh.cp, mesh.tp, dev, gpus_per_node, _stage_nodes(cap, fields), inflight)
    if given is not None:   # a plan read back unchanged (parallelize broadcasts JSON) keeps its source
        fields["source"] = given.source if given.derives_as(_view(fields)) else edited_source(given.source)
    terms = fields.pop("step_terms")
    fields.pop("dp_units")
    fields.update(notes=notes, keep_gathered=kept, offload=offload)
    fields.update(precision=precision, peak_flops=dev.flops(compute_dtype(precision)),
                  predicted_update_s=plan_update_time(fields["memory"], mesh, zero, precision, dev,
                                                      offload=offload != "none"))
    terms["update"] = fields["predicted_update_s"]
    return Decision(cap, assignment.strategies, fields, dev, budget, gpus_per_node, given, terms)


def _check_cp_attention(knob, mesh) -> None:
    """Refuse a ``cp_attention`` the planner does not know, or one named for a given mesh without cp
    (it could not take effect)."""
    if knob != "auto" and knob not in CP_ATTENTIONS:
        raise ValueError(f"cp_attention={knob!r}: expected 'auto' or {' or '.join(map(repr, CP_ATTENTIONS))}")
    if knob != "auto" and not (isinstance(mesh, str) and mesh == "auto") and Mesh.parse(mesh).cp == 1:
        raise ValueError(f"cp_attention={knob!r} chooses how attention runs over cp, but the mesh {Mesh.parse(mesh)} "
                         "has cp=1; give the mesh a cp axis (mesh={'cp': 2, ...}) or leave cp_attention='auto'")


def _cp_attention(knob: str, cap, strategies, mesh: Mesh, dev, gpus_per_node: int) -> tuple[str, tuple[str, ...]]:
    """The cp attention variant (``Plan.cp_attention``) and a note on its choice: the knob's (or the
    given plan's), or for "auto" the variant of lower exposed seconds
    (``cost_model.context.cp_attention_seconds``; ring on a tie, it keeps less), all-gather where
    ring attention cannot run the graph (``ring_refusal``)."""
    if mesh.cp == 1:
        return "allgather", ()
    refused = ring_refusal(cap.gm)
    if knob == "ring" and refused:
        raise PlanError(f"cp_attention='ring': {refused}; use cp_attention='allgather'")
    if knob != "auto":
        return knob, ()
    if refused:
        return "allgather", (f"cp attention: allgather, as ring attention cannot run here ({refused})",)
    seconds = {a: cp_attention_seconds(cap, strategies, mesh.cp, mesh.tp, dev, gpus_per_node, a) for a in CP_ATTENTIONS}
    chosen = "ring" if seconds["ring"] <= seconds["allgather"] else "allgather"
    rows = ", ".join(f"{a} {s * 1e3:.3f} ms" for a, s in seconds.items())
    return chosen, (f"cp attention chosen automatically: {chosen}, the least exposed communication per microbatch "
                    f"({rows})",)


def _choose_kept(cap, strategies, mesh, dev, fields: dict, limit: float, gpus_per_node: int):
    """ZeRO-3's units kept gathered for this plan (``autopar.planner.reshard.choose_kept``): each
    unit's saved re-gather seconds per step from the dp sync's own per-unit figures (``dp_units``:
    the busiest pipeline rank's units), its gathered bytes and every stage's peak with it from the
    memory model (``cost_model.memory.kept_gathered_bytes``), within ``limit`` bytes."""
    _, figures, names = fields["dp_units"]
    working_copy = working_copy_ratio(cap)
    regather = unit_sync_times([b for b, _ in figures], mesh, dev, 3, gpus_per_node, gathered=working_copy or 1.0)[1]
    saved = dict(zip(names, (fields["microbatches"] * t for t in regather)))
    stage_nodes = _stage_nodes(cap, fields)
    extras = [kept_gathered_bytes(cap, strategies, mesh, nodes, working_copy) for nodes in stage_nodes]
    order = [u.name for u in zero_units(cap)]
    size = {u: b for _, sizes in extras for u, b in sizes.items()}
    peaks = [m.peak for m in fields["memory"]]

    def peak(kept) -> float:
        return max(p + extra(kept) for p, (extra, _) in zip(peaks, extras))
    return choose_kept(order, [saved.get(u, 0.0) for u in order], [size.get(u, 0.0) for u in order], peak, limit)


def _with_kept(cap, mesh, dev, fields: dict, kept, *, gpus_per_node: int, sharding, memory) -> dict:
    """``fields`` re-priced with ZeRO-3's ``kept`` units kept gathered: the collectives and (pp = 1)
    the step's communication from ``sharding()`` (``sharding_fields`` with them), with pipeline
    stages the dp sync from the stages' own per-unit figures, and the memory from ``memory(fields)``
    (``_memory_fields`` with them, the recompute regions as chosen); the stage cut stays."""
    out = dict(fields)
    flat = sharding()
    out.update(collectives=flat["collectives"])
    if mesh.pp == 1:
        out.update(predicted_comm_s=flat["predicted_comm_s"], step_terms=flat["step_terms"], dp_units=flat["dp_units"])
    else:
        params, figures, names = fields["dp_units"]
        dp = dp_sync_time(params, mesh, dev, 3, gpus_per_node, microbatches=fields["microbatches"],
                          gathered=working_copy_ratio(cap) or 1.0, units=figures, kept=_positions(names, kept))
        out.update(predicted_comm_s=dp, step_terms=dict(fields["step_terms"], dp=dp))
    out.update(memory(out))
    return out


def _kept_note(choice, units: int, limit: float, default_budget: bool, dev) -> str:
    """The plan note that says which units stay gathered under ZeRO-3 and why."""
    where = f"one {dev.name}'s memory" if default_budget else "the memory budget"
    budget = f"{where} ({limit / 2**30:.2f} GiB)"
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


def _warnings(result, cap, strategies, mesh, dev, budget, gpus_per_node: int) -> tuple[str, ...]:
    """The plan's warnings: a mesh axis doing no work, a peak that the device (or memory_budget) cannot
    hold. ``result``: the plan's fields, as attributes."""
    def full_recompute_peak():
        try:
            full = _memory_fields(cap, strategies, mesh, dev, vars(result), recompute="full", budget=budget,
                                  zero=result.zero, offload=result.offload, kept=result.keep_gathered)
        except PlanError:   # no repeated blocks to recompute
            return None
        return max(m.peak for m in full["memory"])

    def deeper_pipeline():
        """The least pp, doubling this one (dp and tp kept, one sequence per microbatch), whose best
        stage cut fits: the check the planner makes at that pp, on this capture's unit costs."""

        try:
            units = layer_units(cap)
        except PlanError:   # no blocks to cut between
            return None
        size = result.input_shapes[0][0]   # the captured microbatch; unit costs scale with it
        local = size * result.microbatches
        pp = 2 * mesh.pp
        # a unit's bytes do not depend on pp (only the cut and the microbatches in flight do): price them once
        time, static, act, boundary = unit_costs(cap, strategies, units, dataclasses.replace(mesh, pp=pp), dev,
                                                 zero=result.zero, gpus_per_node=gpus_per_node,
                                                 working_copy=working_copy_ratio(cap),
                                                 regions=_regions_from_plan(cap, result))
        while pp * result.virtual_stages <= len(units) and pp <= local:
            if local % pp == 0:
                peak, _ = min_peak_memory(time / size, static, act / size, boundary / size, p=pp, m=local,
                                          v=result.virtual_stages, schedule=result.schedule)
                if peak <= limit:
                    return (mesh.dp, pp, mesh.tp), peak
            pp *= 2
        return None

    limit, where = (budget, "the memory budget") if budget is not None else (dev.memory_bytes, f"one {dev.name}")
    fit = fit_warning(result, limit, where, full_recompute_peak, deeper_pipeline)
    return tuple(axis_warnings(result)) + ((fit,) if fit else ())


def _fields_or_none(make_fields) -> dict | None:
    """The fields ``make_fields()`` gives, or None when it finds no plan (no cut fits the budget)."""
    try:
        return make_fields()
    except ValueError:   # a PlanError, or the stage DP's: no cut fits the budget
        return None


def _regions_from_plan(cap, plan: Plan) -> list:
    by_name = {n.name: n for n in cap.gm.graph.nodes}
    for i, region in enumerate(plan.recompute_regions):
        unknown = [n for n in region if n not in by_name]
        if unknown:
            raise PlanFormatError(f"plan.recompute_regions[{i}]: the graph has no node {', '.join(unknown)}")
    return [[by_name[n] for n in region] for region in plan.recompute_regions]


def _stage_nodes(cap, fields: dict) -> tuple[tuple, ...]:
    """The ops of each pipeline stage of ``fields`` (one tuple of every op without stages); callers must
    not change it."""
    stages = fields.get("stages", ())

    def compute():
        calls = [n for n in cap.gm.graph.nodes if n.op == "call_function"]
        if not stages:
            return (tuple(calls),)
        where = stage_of_nodes(cap, SimpleNamespace(stages=stages))
        out = [[] for _ in stages]
        for n in calls:
            out[where.get(n.name, len(stages) - 1)].append(n)
        return tuple(map(tuple, out))
    # once per cut: a candidate's memory, its recompute choice and its kept units each ask
    return cached(cap.gm.graph, ("stage_nodes", tuple(s.modules for s in stages)), compute)


def _memory_fields(cap, strategies, mesh, dev, fields: dict, *, recompute: str, budget, zero: int,
                   regions=None, offload: str = "none", kept=()) -> dict:
    """The plan's recompute regions (chosen for ``recompute``, or as given) and memory per stage, for
    the stages, microbatches and schedule in ``fields``; with ``offload`` the optimizer's share on
    the host, with ``kept`` ZeRO-3's units kept gathered. recompute="auto" fits ``budget`` bytes
    (the caller's memory budget, the device's memory by default)."""

    stage_nodes = inflight = None
    stages, microbatches = fields.get("stages", ()), fields["microbatches"]
    if stages:
        stage_nodes = _stage_nodes(cap, fields)
        inflight = inflight_microbatches(mesh.pp, microbatches, fields["virtual_stages"], fields["schedule"])
    if regions is None and recompute == "auto":
        regions, _ = choose_recompute(cap, strategies, mesh, dev, zero=zero, budget=budget,
                                      microbatches=microbatches, stage_nodes=stage_nodes, inflight=inflight,
                                      offload=offload != "none")
    elif regions is None:
        regions = regions_for(cap, recompute)
    memory = memory_breakdown(cap, strategies, mesh, zero=zero, regions=regions, stage_nodes=stage_nodes,
                              inflight=inflight, microbatches=microbatches, offload=offload != "none", kept=kept)
    return dict(recompute=recompute, memory=memory, recompute_regions=tuple(tuple(n.name for n in r) for r in regions))


def _stage_fields(cap, strategies, mesh, dev, *, schedule, virtual, microbatches: int, zero, gpus_per_node,
                  memory_budget, stages, recompute: str, regions=None, kept=()) -> dict:
    """The plan's pipeline stages, cut by the cost model (or as ``stages`` says), and the step's
    compute and dp communication they give (``kept``: ZeRO-3's units kept gathered, by name), with
    its terms as ``step_terms``: the pipeline's makespan split (``pipeline_split``) and dp.

    The cut prices each unit's activations with ``regions`` recomputed (a given plan's) or those
    ``recompute`` names; under recompute="auto", with none when a cut fits so, else with every
    block recomputed (the least any choice keeps); ``_memory_fields`` then chooses per block."""

    units = layer_units(cap)
    working_copy = working_copy_ratio(cap)

    def cut_with(recomputed):
        *costs, tp = unit_costs(cap, strategies, units, mesh, dev, zero=zero, gpus_per_node=gpus_per_node,
                                working_copy=working_copy, regions=recomputed, tp_seconds=True)
        return (costs, tp), choose_cut(costs, units, mesh, schedule=schedule, microbatches=microbatches,
                                       virtual=virtual, stages=stages,
                                       memory_budget=memory_budget if memory_budget is not None else dev.memory_bytes)

    if regions is None and recompute == "auto":
        try:
            (costs, tp), cut = cut_with(regions_for(cap, "none"))
        except PlanError:   # the stages= override itself is wrong: recompute does not mend it
            raise
        except ValueError:   # no cut fits without recompute
            (costs, tp), cut = cut_with(regions_for(cap, "full"))
    else:
        (costs, tp), cut = cut_with(regions if regions is not None else regions_for(cap, recompute))
    stage_plans = tuple(StagePlan(s, s % mesh.pp, tuple(m for u in units[a:b] for m in u.modules),
                                  float(cut.stage_times[s]), float(cut.rank_memory[s % mesh.pp]))
                        for s, (a, b) in enumerate(cut.bounds))
    rank_params = rank_param_bytes(costs[1], cut.bounds, mesh, zero, working_copy)
    figures, names = _zero_units(costs[0], costs[1], cut.bounds, mesh, zero, working_copy, units)
    dp = dp_sync_time(rank_params, mesh, dev, zero, gpus_per_node, microbatches=microbatches,
                      gathered=working_copy or 1.0, units=figures, kept=_positions(names, kept))
    # each stage's time is its units' (compute with their tp collectives) and its incoming activations' p2p
    parts = []
    for s, (a, b) in enumerate(cut.bounds):
        tp_s, pp_s = float(tp[a:b].sum()), float(costs[3][a - 1]) if s else 0.0
        parts.append(dict(compute=cut.stage_times[s] - tp_s - pp_s, tp=tp_s, pp=pp_s))
    terms = pipeline_split(parts, mesh.pp, microbatches, virtual, float(cut.step_time))
    return dict(stages=stage_plans, predicted_compute_s=float(cut.step_time), predicted_comm_s=dp,
                step_terms=dict(terms, dp=dp), dp_units=(rank_params, figures, names))


def _zero_units(time, static, bounds, mesh, zero: int, working_copy: float, units=()):
    """ZeRO-2/3's per-unit (bytes, seconds) of the busiest pipeline rank, for ``dp_sync_time``, and
    the names of those of ``units`` (the layer units); (None, ()) without ZeRO-2/3."""
    if zero < 2 or mesh.dp == 1:
        return None, ()
    figures = rank_unit_figures(time, static, bounds, mesh, state_bytes_per_param_byte(mesh, zero, working_copy))
    return figures, tuple(units[k].name for k in rank_units(static, bounds, mesh)) if units else ()


def _positions(names, kept) -> set[int]:
    """The positions in ``names`` (units priced in order) of the units named in ``kept``."""
    return {i for i, name in enumerate(names) if name in kept}


def rebuild(model, plan: Plan, example_inputs, *, sequence_parallel="auto") -> tuple[Captured, dict]:
    """The capture and the strategy per node that a decided ``plan`` names, pricing nothing: what
    a rank needs to build its program from the plan rank 0 broadcast."""
    cap, options = _captured_options(model, plan, example_inputs, sequence_parallel)
    return cap, strategies_from_plan(cap, options, plan)


def rebuild_at_shapes(model, plan: Plan, example_inputs, *, sequence_parallel="auto") -> tuple[Captured, dict, Plan]:
    """``rebuild`` for a global batch of other shapes than the plan's: the capture, the plan's
    strategies carried to it and the plan at those shapes (``planner.other_shapes``)."""
    cap, options = _captured_options(model, plan, example_inputs, sequence_parallel)
    return (cap, *plan_at_shapes(cap, options, plan))


def _captured_options(model, plan: Plan, example_inputs, sequence_parallel):
    """The capture of one dp rank's microbatch of ``example_inputs``, at the plan's compute dtype
    (which the rewrite reads), and each op's strategies."""
    mesh = Mesh(*plan.mesh)
    example_inputs = example_args(model, example_inputs)
    cap = capture_pass(model, _local_inputs(example_inputs, mesh, plan.microbatches), require_loss=True)
    cap = retyped(cap, plan.precision)
    return cap, enumerate_strategies(cap, mesh.tp, sequence_parallel)
