"""mesh="auto": every valid (dp, pp, tp) for a world size, ranked by predicted step time.

All candidates use one microbatch size (``microbatch_size`` sequences; the rest of a dp
rank's batch is microbatches), so the model is captured once. Each candidate is planned as
``autopar.plan`` would plan it on that mesh (``price``), so its row in the ranking is that
plan's predicted step time (``cost_model.step.step_time``) and peak memory
(``Plan.memory``): the winner's row and the winner's plan are one computation. tp stays
inside a node.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from autopar.mesh import Mesh
from autopar.passes.units import layer_units
from autopar.errors import PlanError
from autopar.planner.sharding import check_tp, divisors


@dataclass(frozen=True)
class MeshOption:
    """One candidate mesh with the cost model's verdict."""

    mesh: Mesh
    microbatches: int
    step_time: float       # seconds per step (its plan's), inf when no plan fits
    peak_memory: float     # bytes on the fullest rank (its plan's), inf when no plan fits
    fits: bool
    reason: str = ""       # why no plan fits, when none does


def rank_meshes(world_size: int, example_inputs, *, price, capture, memory_budget: float,
                gpus_per_node: int = 8, microbatch_size: int = 1) -> list[MeshOption]:
    """Every (dp, pp, tp) with dp * pp * tp == world_size that the model and batch allow,
    fastest fitting mesh first.

    ``price(mesh, microbatches)``: the candidate's plan before it is built (its ``step_time`` and
    ``peak_memory``: the figures its Plan will have), or a ValueError saying why none fits
    (no stage cut, or no recompute choice, within the memory); ``capture(inputs)``: the model
    traced at one microbatch, for the checks a mesh must pass before it is planned (tp divides
    the heads, pp at most the layer units); ``memory_budget``: bytes per device."""
    batch = example_inputs[0].shape[0]
    cap = capture(tuple(x[:microbatch_size] for x in example_inputs))
    units = layer_units(cap)
    out = []
    for tp in (t for t in divisors(world_size) if t <= gpus_per_node):
        try:
            check_tp(cap, tp)
        except PlanError:
            continue
        for pp in divisors(world_size // tp):
            dp = world_size // (tp * pp)
            if batch % (dp * microbatch_size) or pp > len(units):
                continue
            m = batch // (dp * microbatch_size)
            if pp > 1 and m < pp:
                continue
            mesh = Mesh(dp, pp, tp)
            try:
                decision = price(mesh, m)
            except ValueError as e:
                out.append(MeshOption(mesh, m, math.inf, math.inf, False, str(e)))
                continue
            peak = decision.peak_memory
            out.append(MeshOption(mesh, m, decision.step_time, peak, peak <= memory_budget))
    if not out:
        raise PlanError(f"no (dp, pp, tp) for {world_size} devices suits this model and a batch of {batch}")
    return sorted(out, key=lambda o: (not o.fits, o.step_time, o.peak_memory))


def ranking_table(options: list[MeshOption], limit: int = 12) -> str:
    """The ranking as text: mesh, microbatches, predicted step time, peak memory, fit (the figures
    to the digits ``Plan.summary`` prints them with)."""
    lines = [f"{'rank':>4s}  {'mesh (dp,pp,tp)':16s} {'microbatches':>12s} {'step ms':>10s} {'peak GiB':>9s}  fits"]
    for k, o in enumerate(options[:limit]):
        step = f"{o.step_time * 1e3:10.3f}" if np.isfinite(o.step_time) else f"{'-':>10s}"
        peak = f"{o.peak_memory / 2**30:9.3f}" if np.isfinite(o.peak_memory) else f"{'-':>9s}"
        lines.append(f"{k + 1:4d}  {str((o.mesh.dp, o.mesh.pp, o.mesh.tp)):16s} {o.microbatches:12d} {step} "
                     f"{peak}  {'yes' if o.fits else 'no'}")
    if len(options) > limit:
        lines.append(f"      ... and {len(options) - limit} more")
    return "\n".join(lines)
