"""autopar.plan and autopar.parallelize: the two entry points."""
from __future__ import annotations

import dataclasses
import os
import re
import warnings
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist

from autopar.cost_model import get_device, preset_for_gpu
from autopar.cost_model.stages import OP_OVERHEAD, SCHEDULES, rank_param_bytes, unit_costs
from autopar.cost_model.step import dp_sync_time, param_byte_time, plan_update_time, rank_update_time, step_time
from autopar.megatron import megatron_options
from autopar.mesh import Mesh, default_device_type, device_mesh
from autopar.passes.capture import Captured, capture_pass
from autopar.plans import Plan, edited_source
from autopar.planner import (Assignment, PlanError, build_plan, check_tp, enumerate_strategies, solve,
                             strategies_from_plan, with_regather)
from autopar.placement import Shard
from autopar.passes.precision import retyped
from autopar.precision import compute_dtype, working_copy_ratio

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


def _check_knobs(mesh: Mesh, recompute, schedule, zero, sequence_parallel):
    if schedule not in SCHEDULES:
        raise ValueError(f"schedule={schedule!r}: expected one of {', '.join(SCHEDULES)}")
    if recompute not in ("none", "selective", "full", "auto"):
        raise ValueError(f"recompute={recompute!r}: expected 'none', 'selective', 'full' or 'auto'")
    if zero not in (0, 1):
        raise ValueError(f"zero={zero!r}: autopar supports zero=0 (replicated optimizer state) "
                         "and zero=1 (optimizer state sharded over dp)")
    if sequence_parallel not in (True, False, "auto"):
        raise ValueError(f"sequence_parallel={sequence_parallel!r}: expected True, False or 'auto'")


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


def decide(model, mesh, example_inputs, *, plan="auto", sequence_parallel="auto", recompute="none",
           memory_budget=None, schedule="1F1B", microbatches=None, zero=0, device="h100",
           gpus_per_node=8, stages=None, virtual_stages=None, world_size=None,
           precision="fp32") -> tuple[Captured, dict, Plan]:
    """Capture and plan: the graph, the strategy per node and the Plan (no process group needed).

    With pp > 1 and no ``microbatches``, every count the schedule can take is planned and
    the one with the lowest predicted step time is kept. ``mesh="auto"`` needs ``world_size``:
    every valid (dp, pp, tp) is ranked first (``autopar.mesh_search``) and the best one planned."""
    notes = ()
    compute_dtype(precision)   # an unknown precision fails before any planning
    captures: dict = {}

    def capture(inputs) -> Captured:   # the mesh search and the plan often trace the same shapes
        key = tuple((tuple(x.shape), x.dtype) for x in inputs)
        if key not in captures:
            captures[key] = capture_pass(model, inputs, require_loss=True)
        return captures[key]

    knobs = dict(plan=plan, sequence_parallel=sequence_parallel, memory_budget=memory_budget,
                 schedule=schedule, zero=zero, device=device, gpus_per_node=gpus_per_node, stages=stages,
                 virtual_stages=virtual_stages, recompute=recompute, precision=precision, capture=capture)
    planned: dict = {}
    if isinstance(mesh, str) and mesh == "auto":
        def price(candidate: Mesh, m: int) -> Plan:   # the candidate's plan, as it is made below
            _check_knobs(candidate, recompute, schedule, zero, sequence_parallel)
            planned[(candidate, m)] = _decide(model, candidate, example_inputs, microbatches=m, **knobs)
            return planned[(candidate, m)][2]

        budget = parse_bytes(memory_budget)
        mesh, microbatches, notes = _auto_mesh(example_inputs, world_size, price=price, capture=capture,
                                               gpus_per_node=gpus_per_node,
                                               memory_budget=get_device(device).memory_bytes if budget is None
                                               else budget)
    mesh = Mesh.parse(mesh)
    _check_knobs(mesh, recompute, schedule, zero, sequence_parallel)
    options = _microbatch_options(mesh, example_inputs[0].shape[0], schedule, microbatches)
    if isinstance(plan, Plan):
        options = [plan.microbatches]
    cap, strategies, best = (planned.get((mesh, max(options)))
                             or _decide(model, mesh, example_inputs, microbatches=max(options), **knobs))
    if len(options) > 1:
        m = _best_microbatches(cap, strategies, best, mesh, options, knobs)
        if m != best.microbatches:
            cap, strategies, best = _decide(model, mesh, example_inputs, microbatches=m, **knobs)
    return cap, strategies, dataclasses.replace(best, notes=best.notes + notes) if notes else best


def _best_microbatches(cap, strategies, planned: Plan, mesh: Mesh, options: list[int], knobs: dict) -> int:
    """The microbatch count with the lowest predicted step time, from one plan at the most microbatches.

    Per-unit compute, activations and point-to-point bytes scale with the microbatch size; the
    per-op launch overhead does not. Counts whose stages cannot fit the memory budget are skipped."""
    from autopar.memory_plan import regions_for
    from autopar.pipeline import layer_units
    from autopar.stage_dp import cut_stages

    dev = get_device(knobs["device"])
    units = layer_units(cap)
    recompute = knobs["recompute"]
    # the activations each cut is priced with, as _with_stages tries them
    modes = ["none", "full"] if recompute == "auto" else [recompute]
    acts = []
    for mode in modes:
        time, static, act, boundary = unit_costs(cap, strategies, units, mesh, dev, zero=knobs["zero"],
                                                 gpus_per_node=knobs["gpus_per_node"],
                                                 working_copy=working_copy_ratio(cap), regions=regions_for(cap, mode))
        acts.append(act)
    overhead = OP_OVERHEAD * np.array([len(u.nodes) for u in units])
    budget = parse_bytes(knobs["memory_budget"])
    budget = dev.memory_bytes if budget is None else budget
    zero, gpus_per_node, working_copy = knobs["zero"], knobs["gpus_per_node"], working_copy_ratio(cap)
    best, best_time = planned.microbatches, float("inf")
    for m in options:
        grow = planned.microbatches / m   # how much larger each microbatch is
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
        seconds = step_time(cut.step_time, [dp_sync_time(params, mesh, dev, zero, gpus_per_node)],
                            rank_update_time(params, mesh, dev, zero, working_copy > 0))
        if seconds < best_time:
            best, best_time = m, seconds
    return best


def _auto_mesh(example_inputs, world_size, **kw):
    """The fastest (dp, pp, tp) that fits, its microbatch count, and the ranking as plan notes."""
    from autopar.mesh_search import rank_meshes, ranking_table

    if not world_size:
        raise ValueError('mesh="auto" needs the number of devices: pass world_size= (the CLI\'s --gpus)')
    options = rank_meshes(world_size, example_inputs, **kw)
    table = ranking_table(options)
    best = options[0]
    if not best.fits:
        closest = min(options, key=lambda o: o.peak_memory)
        need = (f"the closest, {closest.mesh}, needs {closest.peak_memory / 2**30:.1f} GiB per device"
                if np.isfinite(closest.peak_memory) else f"for {closest.mesh}: {closest.reason}")
        raise PlanError(f"no mesh of {world_size} devices fits in memory; {need}:\n{table}")
    note = f"mesh chosen automatically among {len(options)} candidates for {world_size} devices:\n{table}"
    return best.mesh, best.microbatches, (note,)


def _decide(model, mesh, example_inputs, *, plan, sequence_parallel, memory_budget, schedule, microbatches,
            zero, device, gpus_per_node, stages, virtual_stages, recompute, precision, capture):
    m = microbatches
    v = _virtual(schedule, virtual_stages)
    dev = get_device(device)
    cap = capture(_local_inputs(example_inputs, mesh, m))
    check_tp(cap, mesh.tp)
    if isinstance(plan, str) and plan not in ("auto", "megatron"):
        if not plan.lstrip().startswith("{") and not Path(plan).exists():
            raise ValueError(f"plan={plan!r}: expected 'auto', 'megatron', a Plan or a plan JSON path")
        plan = Plan.from_json(plan)
    given = plan if isinstance(plan, Plan) else None
    precision = given.precision if given is not None else precision
    cap = retyped(cap, precision)   # price compute, activations and collectives at the compute dtype
    options = enumerate_strategies(cap, mesh.tp, sequence_parallel)   # on the retyped graph's nodes
    regions = None
    if given is not None:   # run as written: re-derive its collectives, times and memory from its choices
        if tuple(given.mesh) != (mesh.dp, mesh.pp, mesh.tp):
            raise PlanError(f"plan.mesh {tuple(given.mesh)} does not match the mesh {mesh}")
        if tuple(map(tuple, given.input_shapes)) != tuple(tuple(i.meta["val"].shape) for i in cap.inputs):
            raise PlanError(f"plan.input_shapes {given.input_shapes} do not match this batch's "
                            "microbatch shapes; re-plan for this batch size")
        assignment = Assignment(strategies_from_plan(cap, options, given), options, given.solve_seconds, 0.0)
        schedule, v, zero, recompute = given.schedule, given.virtual_stages, given.zero, given.recompute
        stages = [s.modules for s in given.stages] or None
        regions = _regions_from_plan(cap, given)
        plan = given.source
    elif plan == "megatron" or plan == "auto":
        if plan == "megatron" and mesh.tp > 1:
            options = megatron_options(cap, options, sequence_parallel is not False)
        assignment = solve(cap, options, mesh.tp, dev, inter_node=mesh.tp > gpus_per_node,
                           memory_budget=parse_bytes(memory_budget) if recompute != "auto" else None,
                           param_byte_seconds=param_byte_time(mesh, dev, zero=zero, working_copy=precision != "fp32",
                                                              gpus_per_node=gpus_per_node))
    else:
        raise ValueError(f"plan={plan!r}: expected 'auto', 'megatron', a Plan or a plan JSON path")
    budget = parse_bytes(memory_budget)
    sp = any(isinstance(s.output, Shard) and n.target is torch.ops.aten.layer_norm.default
             for n, s in assignment.strategies.items())

    def finish(assignment, recompute):
        result = build_plan(cap, assignment, mesh, dev, sequence_parallel=sp, zero=zero, microbatches=m,
                            source=plan, gpus_per_node=gpus_per_node)
        if mesh.pp > 1:
            result = _with_stages(result, cap, assignment.strategies, mesh, dev, schedule=schedule, virtual=v,
                                  zero=zero, gpus_per_node=gpus_per_node, memory_budget=budget, stages=stages,
                                  recompute=recompute, regions=regions)
        return _with_memory(result, cap, assignment.strategies, mesh, dev, recompute=recompute, budget=budget,
                            zero=zero, regions=regions)

    if given is None and sp and budget is not None and _over(lambda: finish(assignment, "none"), budget):
        # Megatron's storage rule before any recompute: an all-gather is cheaper than a forward
        assignment = dataclasses.replace(assignment, strategies=with_regather(assignment.strategies))
    result = finish(assignment, recompute)
    if given is not None:   # a plan read back unchanged (parallelize broadcasts JSON) keeps its source
        result = dataclasses.replace(result, notes=given.notes, model=given.model,
                                     source=given.source if given.derives_as(result) else edited_source(given.source))
    result = dataclasses.replace(result, precision=precision, peak_flops=dev.flops(compute_dtype(precision)))
    result = dataclasses.replace(result, predicted_update_s=plan_update_time(result, dev))
    result = dataclasses.replace(result, warnings=_warnings(result, cap, assignment.strategies, mesh, dev, budget,
                                                                 gpus_per_node))
    return cap, assignment.strategies, result


def _warnings(result: Plan, cap, strategies, mesh, dev, budget, gpus_per_node: int) -> tuple[str, ...]:
    """The plan's warnings: a mesh axis doing no work, a peak that the device (or memory_budget) cannot hold."""
    from autopar.plans import axis_warnings, fit_warning

    def full_recompute_peak():
        try:
            full = _with_memory(result, cap, strategies, mesh, dev, recompute="full", budget=budget, zero=result.zero)
        except PlanError:   # no repeated blocks to recompute
            return None
        return max(m.peak for m in full.memory)

    def deeper_pipeline():
        """The least pp, doubling this one (dp and tp kept, one sequence per microbatch), whose best
        stage cut fits: the check the planner makes at that pp, on this capture's unit costs."""
        from autopar.pipeline import layer_units
        from autopar.stage_dp import min_peak_memory

        try:
            units = layer_units(cap)
        except PlanError:   # no blocks to cut between
            return None
        size = result.input_shapes[0][0]   # the captured microbatch; unit costs scale with it
        local = size * result.microbatches
        pp = 2 * mesh.pp
        # a unit's bytes do not depend on pp (only the cut and the microbatches in flight do): price them once
        time, static, act, boundary = unit_costs(cap, strategies, units, Mesh(mesh.dp, pp, mesh.tp), dev,
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


def _over(make_plan, budget: float) -> bool:
    """Whether the plan ``make_plan()`` builds misses the memory budget (or no cut fits it)."""
    try:
        result = make_plan()
    except ValueError:   # a PlanError, or the stage DP's: no cut fits the budget
        return True
    return max(m.peak for m in result.memory) > budget


def _regions_from_plan(cap, plan: Plan) -> list:
    from autopar.plans import PlanFormatError

    by_name = {n.name: n for n in cap.gm.graph.nodes}
    for i, region in enumerate(plan.recompute_regions):
        unknown = [n for n in region if n not in by_name]
        if unknown:
            raise PlanFormatError(f"plan.recompute_regions[{i}]: the graph has no node {', '.join(unknown)}")
    return [[by_name[n] for n in region] for region in plan.recompute_regions]


def _with_memory(result: Plan, cap, strategies, mesh, dev, *, recompute: str, budget, zero: int,
                 regions=None) -> Plan:
    """The plan with its recompute regions (chosen for ``recompute``, or as given) and per-stage memory."""
    from autopar.memory_plan import choose_recompute, memory_breakdown, regions_for
    from autopar.stage_dp import inflight_microbatches

    stage_nodes = inflight = None
    if result.stages:
        from autopar.pipeline import stage_of_nodes
        where = stage_of_nodes(cap, result)
        stage_nodes = [[n for n in cap.gm.graph.nodes if n.op == "call_function" and where.get(n.name, len(result.stages) - 1) == s]
                       for s in range(len(result.stages))]
        inflight = inflight_microbatches(mesh.pp, result.microbatches, result.virtual_stages, result.schedule)
    if regions is None and recompute == "auto":
        if budget is None:
            raise ValueError("recompute='auto' needs memory_budget= (e.g. '60GiB')")
        regions, _ = choose_recompute(cap, strategies, mesh, dev, zero=zero, budget=budget,
                                      microbatches=result.microbatches, stage_nodes=stage_nodes, inflight=inflight)
    elif regions is None:
        regions = regions_for(cap, recompute)
    memory = memory_breakdown(cap, strategies, mesh, zero=zero, regions=regions, stage_nodes=stage_nodes,
                              inflight=inflight, microbatches=result.microbatches)
    return dataclasses.replace(result, recompute=recompute, memory=memory,
                               recompute_regions=tuple(tuple(n.name for n in r) for r in regions))


def _with_stages(result: Plan, cap, strategies, mesh, dev, *, schedule, virtual, zero, gpus_per_node,
                 memory_budget, stages, recompute: str, regions=None) -> Plan:
    """The plan with its pipeline stages cut by the cost model (or as ``stages`` says).

    The cut prices each unit's activations with ``regions`` recomputed (a given plan's) or those
    ``recompute`` names; under recompute="auto", with none when a cut fits so, else with every
    block recomputed (the least any choice keeps); ``_with_memory`` then chooses per block."""
    from autopar.memory_plan import regions_for
    from autopar.pipeline import choose_cut, layer_units
    from autopar.plans import StagePlan

    units = layer_units(cap)
    working_copy = working_copy_ratio(cap)

    def cut_with(recomputed):
        costs = unit_costs(cap, strategies, units, mesh, dev, zero=zero, gpus_per_node=gpus_per_node,
                           working_copy=working_copy, regions=recomputed)
        return costs, choose_cut(costs, units, mesh, schedule=schedule, microbatches=result.microbatches,
                                 virtual=virtual, stages=stages,
                                 memory_budget=memory_budget if memory_budget is not None else dev.memory_bytes)

    if regions is None and recompute == "auto":
        try:
            costs, cut = cut_with(regions_for(cap, "none"))
        except PlanError:   # the stages= override itself is wrong: recompute does not mend it
            raise
        except ValueError:   # no cut fits without recompute
            costs, cut = cut_with(regions_for(cap, "full"))
    else:
        costs, cut = cut_with(regions if regions is not None else regions_for(cap, recompute))
    stage_plans = tuple(StagePlan(s, s % mesh.pp, tuple(m for u in units[a:b] for m in u.modules),
                                  float(cut.stage_times[s]), float(cut.rank_memory[s % mesh.pp]))
                        for s, (a, b) in enumerate(cut.bounds))
    rank_params = rank_param_bytes(costs[1], cut.bounds, mesh, zero, working_copy)
    return dataclasses.replace(result, schedule=schedule, virtual_stages=virtual, stages=stage_plans,
                               predicted_compute_s=float(cut.step_time),
                               predicted_comm_s=dp_sync_time(rank_params, mesh, dev, zero, gpus_per_node))


def rebuild(model, plan: Plan, example_inputs, *, sequence_parallel="auto") -> tuple[Captured, dict]:
    """The capture and the strategy per node that a decided ``plan`` names, pricing nothing: what
    a rank needs to build its program from the plan rank 0 broadcast."""
    mesh = Mesh(*plan.mesh)
    cap = capture_pass(model, _local_inputs(example_inputs, mesh, plan.microbatches), require_loss=True)
    cap = retyped(cap, plan.precision)   # the rewrite reads the compute dtype the plan was made at
    options = enumerate_strategies(cap, mesh.tp, sequence_parallel)
    return cap, strategies_from_plan(cap, options, plan)


def plan(model, mesh, example_inputs, *, device="h100", gpus_per_node=8, world_size=None, **knobs) -> Plan:
    """Plan offline: no process group, no GPU; ``model`` may live on the meta device.

    ``mesh`` is (dp, pp, tp) or "auto" (then ``world_size`` devices are ranked; the ranking
    is in the plan's notes). ``knobs`` are parallelize's: plan, sequence_parallel, recompute,
    memory_budget, schedule, microbatches, zero, stages, virtual_stages, precision."""
    return decide(model, mesh, example_inputs, device=device, gpus_per_node=gpus_per_node, world_size=world_size,
                  **knobs)[2]


def default_device() -> str:
    """The cost-model preset for this machine: its GPU's kind (A100, H100, H200; another GPU gets
    the nearest preset, with a warning), or "cpu"."""
    if not torch.cuda.is_available():
        return "cpu"
    name = torch.cuda.get_device_name()
    preset, exact = preset_for_gpu(name, torch.cuda.get_device_capability())
    if not exact:
        warnings.warn(f"autopar: no cost-model preset for the GPU {name!r}; pricing it as {preset!r}, the "
                      f"nearest by compute capability. Pass device= a preset or a profile measured by "
                      f"`python -m autopar calibrate --out dev.json`", stacklevel=3)
    return preset


def default_gpus_per_node() -> int:
    """Ranks that share this node's fast links: torchrun's LOCAL_WORLD_SIZE, else the visible GPUs, else 8."""
    local = os.environ.get("LOCAL_WORLD_SIZE")
    if local and local.isdigit():
        return int(local)
    return torch.cuda.device_count() if torch.cuda.is_available() else 8


def parallelize(model, mesh, example_inputs, *, plan="auto", sequence_parallel="auto", recompute="none",
                memory_budget=None, schedule="1F1B", microbatches=None, zero=0, compile=True,
                device=None, gpus_per_node=None, stages=None, virtual_stages=None, precision="fp32",
                loss_kernel="auto"):
    """Plan ``model`` for ``mesh`` and build this rank's parallel program.

    Call it on every rank of an initialised process group (``torchrun``, or
    ``autopar.launch.spawn`` for CPU ranks). ``example_inputs`` is one global batch.
    Rank 0 plans and broadcasts the plan, so every rank runs the same decisions.
    ``compile``: True lowers through torch.compile (Inductor); "reduce-overhead" (Inductor
    replaying CUDA graphs: no launch gaps; weights and buffers are marked as static addresses),
    "max-autotune" or "max-autotune-no-cudagraphs" through Inductor in that mode; another string
    or a callable names a torch.compile backend (e.g. "aot_eager"); False runs the rewritten
    graph eagerly.
    ``device``: the cost model's device preset or profile (default: this machine's kind,
    ``default_device``). ``gpus_per_node``: ranks sharing a node's fast links, for pricing
    axes that span nodes (default: ``default_gpus_per_node``).
    ``stages``: with pp > 1, module FQNs per stage to override the cost model's cut.
    ``virtual_stages``: stages per pipeline rank (interleaved schedules; default 2 there).
    ``precision``: "fp32"; "bf16" (bf16 compute on fp32 master weights, every gradient and
    partial-sum reduction in fp32, fp32 loss); "fp16" (the same at fp16, with dynamic loss
    scaling). A given plan runs at its own precision (``autopar.precision``).
    ``loss_kernel``: route a cross-entropy over 2-D logits (tp = 1) through autopar's one-read
    kernel (``autopar.kernels.cross_entropy``); "auto" does where it pays, when compiling with
    Inductor on CUDA with Triton; True always (its torch reference off CUDA); False never."""
    from autopar.launch import init_distributed
    from autopar.parallel_model import ParallelModel

    if loss_kernel not in (True, False, "auto"):
        raise ValueError(f"loss_kernel={loss_kernel!r}: expected True, False or 'auto'")
    if not dist.is_initialized():
        init_distributed()
    world = dist.get_world_size()
    auto = isinstance(mesh, str) and mesh == "auto"
    mesh_ = None if auto else Mesh.parse(mesh)
    if mesh_ is not None:
        _check_knobs(mesh_, recompute, schedule, zero, sequence_parallel)
        if world != mesh_.world_size:
            raise ValueError(f"mesh {mesh_} needs {mesh_.world_size} ranks but the world has {world}; "
                             f"launch {mesh_.world_size} processes or change the mesh")
    knobs = dict(sequence_parallel=sequence_parallel, recompute=recompute, memory_budget=memory_budget,
                 schedule=schedule, microbatches=microbatches, zero=zero, device=device or default_device(),
                 gpus_per_node=gpus_per_node or default_gpus_per_node(),
                 stages=stages, virtual_stages=virtual_stages, precision=precision)
    # rank 0 plans once; the others capture the same graph and take its strategies from the plan,
    # pricing nothing (they would only repeat rank 0's figures and its capture warnings)
    box, decided = [None], None
    if dist.get_rank() == 0:
        try:
            decided = decide(model, mesh, example_inputs, plan=plan, world_size=world, **knobs)
            box[0] = decided[2].to_json()
        except Exception as e:   # every rank must learn of the failure, not hang in the broadcast
            box[0] = e
    dist.broadcast_object_list(box, src=0)
    if isinstance(box[0], Exception):
        raise box[0]
    the_plan = Plan.from_json(box[0])
    if decided is not None:
        cap, strategies = decided[0], decided[1]
    else:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            cap, strategies = rebuild(model, the_plan, example_inputs, sequence_parallel=sequence_parallel)
    mesh_ = Mesh(*the_plan.mesh)
    dmesh = device_mesh(mesh_, default_device_type())
    return ParallelModel(model, cap, strategies, the_plan, mesh_, dmesh, compile=compile, loss_kernel=loss_kernel)
