"""mesh="auto": every valid (dp, pp, tp) for a world size, ranked by predicted step time.

All candidates use one microbatch size (``microbatch_size`` sequences; the rest of a dp
rank's batch is microbatches), so the model is captured once and the tensor-parallel ILP
runs once per tp; each (dp, pp) then only needs the stage cut. tp stays inside a node.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from autopar.cost_model import get_device
from autopar.cost_model.compute import update_time
from autopar.mesh import Mesh
from autopar.passes.capture import capture_pass
from autopar.pipeline import dp_sync_time, layer_units, state_bytes_per_param_byte, unit_costs
from autopar.planner import PlanError, check_tp, divisors, enumerate_strategies, param_byte_time, solve
from autopar.precision import retype_pass, working_copy_ratio
from autopar.stage_dp import cut_stages, min_peak_memory


@dataclass(frozen=True)
class MeshOption:
    """One candidate mesh with the cost model's verdict."""

    mesh: Mesh
    microbatches: int
    step_time: float       # seconds per step, inf when it does not fit
    peak_memory: float     # bytes on the fullest rank (the smallest any stage cut reaches)
    fits: bool


def rank_meshes(model, world_size: int, example_inputs, *, device="h100", gpus_per_node: int = 8,
                microbatch_size: int = 1, schedule: str = "1F1B", zero: int = 0, sequence_parallel="auto",
                memory_budget: float | None = None, progress=None, precision: str = "fp32",
                capture=None) -> list[MeshOption]:
    """Every (dp, pp, tp) with dp * pp * tp == world_size that the model and batch allow,
    fastest fitting mesh first. ``capture(inputs)``: how to trace the model (default capture_pass)."""
    dev = get_device(device)
    budget = memory_budget if memory_budget is not None else dev.memory_bytes
    batch = example_inputs[0].shape[0]
    capture = capture or (lambda inputs: capture_pass(model, inputs))
    cap = retype_pass(capture(tuple(x[:microbatch_size] for x in example_inputs)), precision)
    units = layer_units(cap)
    out = []
    for tp in (t for t in divisors(world_size) if t <= gpus_per_node):
        try:
            check_tp(cap, tp)
        except PlanError:
            continue
        if progress:
            progress(f"tp={tp}: solving the sharding ILP")
        # the sharding is solved once per tp; its update and dp-sync price is that of dp filling the rest
        per_byte = param_byte_time(Mesh(world_size // tp, 1, tp), dev, zero=zero, working_copy=precision != "fp32",
                                   gpus_per_node=gpus_per_node)
        strategies = solve(cap, enumerate_strategies(cap, tp, sequence_parallel), tp, dev,
                           param_byte_seconds=per_byte).strategies
        for pp in divisors(world_size // tp):
            dp = world_size // (tp * pp)
            if batch % (dp * microbatch_size) or pp > len(units):
                continue
            m = batch // (dp * microbatch_size)
            if pp > 1 and m < pp:
                continue
            mesh = Mesh(dp, pp, tp)
            costs = unit_costs(cap, strategies, units, mesh, dev, zero=zero, gpus_per_node=gpus_per_node)
            out.append(_evaluate(mesh, m, costs, dev, budget, schedule, zero, gpus_per_node,
                                 working_copy_ratio(cap)))
    if not out:
        raise PlanError(f"no (dp, pp, tp) for {world_size} devices suits this model and a batch of {batch}")
    return sorted(out, key=lambda o: (not o.fits, o.step_time, o.peak_memory))


def _evaluate(mesh: Mesh, m: int, costs, dev, budget, schedule: str, zero: int, gpus_per_node: int,
              working_copy: float) -> MeshOption:
    time, static, act, boundary = costs
    state = state_bytes_per_param_byte(mesh, zero, working_copy)
    if mesh.pp == 1:
        step, peak = m * float(time.sum()), float(static.sum() + act.sum())
        param_bytes = float(static.sum()) / state
    else:
        kw = dict(p=mesh.pp, m=m, schedule=schedule)
        try:
            cut = cut_stages(time, static, act, boundary, memory_budget=budget, **kw)
        except ValueError:
            peak = min_peak_memory(time, static, act, boundary, **kw)[0]
            return MeshOption(mesh, m, float("inf"), peak, False)
        step, peak = cut.step_time, max(cut.rank_memory)
        param_bytes = max(static[a:b].sum() for a, b in cut.bounds) / state
    step += dp_sync_time(param_bytes, mesh, dev, zero, gpus_per_node) + update_time(
        param_bytes, dev, working_copy=working_copy > 0, optimizer_shards=mesh.dp if zero else 1)
    return MeshOption(mesh, m, step, peak, peak <= budget)


def ranking_table(options: list[MeshOption], limit: int = 12) -> str:
    """The ranking as text: mesh, microbatches, predicted step time, peak memory, fit."""
    lines = [f"{'rank':>4s}  {'mesh (dp,pp,tp)':16s} {'microbatches':>12s} {'step s':>10s} {'peak GiB':>9s}  fits"]
    for k, o in enumerate(options[:limit]):
        step = f"{o.step_time:10.3f}" if np.isfinite(o.step_time) else f"{'-':>10s}"
        lines.append(f"{k + 1:4d}  {str((o.mesh.dp, o.mesh.pp, o.mesh.tp)):16s} {o.microbatches:12d} {step} "
                     f"{o.peak_memory / 2**30:9.1f}  {'yes' if o.fits else 'no'}")
    if len(options) > limit:
        lines.append(f"      ... and {len(options) - limit} more")
    return "\n".join(lines)
