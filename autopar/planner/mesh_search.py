"""mesh="auto": every valid (dp, pp, tp) for a world size, ranked by predicted step time.

All candidates use one microbatch size (``microbatch_size`` sequences; the rest of a dp
rank's batch is microbatches), so the model is captured once. Each candidate is planned as
``autopar.plan`` would plan it on that mesh (``price``), so its row in the ranking is that
plan's predicted step time (``cost_model.step.step_time``) and peak memory
(``Plan.memory``): the winner's row and the winner's plan are one computation. A row also shows
the zero stage, recompute and offload its plan chose and the step's terms as its plan added them
up (``Decision.terms``: compute, tp / pp / dp exposed communication, bubble, update), and a last
line says why the winner won. tp stays inside a node.

With ``hsdp`` (ZeRO may shard, zero >= 1 or "auto"), a dp that spans several nodes is also ranked
split as HSDP: dp_shard = the dp ranks of one node (gpus_per_node / (pp * tp), at least 2) and
dp_replicate = dp / dp_shard, so that the sharded collectives stay inside a node and only the
replicas' all-reduce crosses nodes; its row names the mesh (r x s, pp, tp).
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
    """One candidate mesh with the cost model's verdict and the choices its plan made."""

    mesh: Mesh
    microbatches: int
    step_time: float       # seconds per step (its plan's), inf when no plan fits
    peak_memory: float     # bytes on the fullest rank (its plan's), inf when no plan fits
    fits: bool
    reason: str = ""       # why no plan fits, when none does
    zero: int = 0
    recompute: str = "none"
    recompute_regions: int = 0
    offload: str = "none"
    kept_gathered: int = 0   # ZeRO-3's units kept gathered from forward to backward
    terms: dict | None = None   # the step time's terms: compute, tp, pp, bubble, dp, update (seconds)


TERMS = ("compute", "tp", "pp", "dp", "bubble", "update")


def hsdp_split(mesh: Mesh, gpus_per_node: int) -> Mesh | None:
    """``mesh`` with its dp split as HSDP (module docstring): dp_shard the dp ranks inside one node,
    dp_replicate the rest; None when dp fits in a node or a node holds fewer than two of its ranks."""
    inner = mesh.pp * mesh.tp
    if gpus_per_node % inner or mesh.dp * inner <= gpus_per_node:
        return None
    shard = gpus_per_node // inner
    if shard < 2 or mesh.dp % shard:
        return None
    return Mesh(mesh.dp, mesh.pp, mesh.tp, dp_replicate=mesh.dp // shard)


def mesh_name(mesh: Mesh) -> str:
    """A ranking row's mesh: (dp, pp, tp), with a split dp as (dp_replicate x dp_shard, pp, tp)."""
    if mesh.split:
        return f"({mesh.dp_replicate}x{mesh.dp_shard}, {mesh.pp}, {mesh.tp})"
    return str((mesh.dp, mesh.pp, mesh.tp))


def rank_meshes(world_size: int, example_inputs, *, price, capture, memory_budget: float,
                gpus_per_node: int = 8, microbatch_size: int = 1, hsdp: bool = False) -> list[MeshOption]:
    """Every (dp, pp, tp) with dp * pp * tp == world_size that the model and batch allow,
    fastest fitting mesh first.

    ``price(mesh, microbatches)``: the candidate's plan before it is built (its ``step_time``,
    ``peak_memory``, ``terms`` and ``fields``: the figures and choices its Plan will have), or a
    ValueError saying why none fits (no stage cut, or no recompute choice, within the memory);
    ``capture(inputs)``: the model traced at one microbatch, for the checks a mesh must pass before
    it is planned (tp divides the heads, pp at most the layer units); ``memory_budget``: bytes per
    device; ``hsdp``: also rank each multi-node dp split as HSDP (``hsdp_split``)."""
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
            plain = Mesh(dp, pp, tp)
            split = hsdp_split(plain, gpus_per_node) if hsdp else None
            for mesh in (plain, split) if split else (plain,):
                try:
                    decision = price(mesh, m)
                except ValueError as e:
                    out.append(MeshOption(mesh, m, math.inf, math.inf, False, str(e)))
                    continue
                peak, f = decision.peak_memory, decision.fields
                out.append(MeshOption(mesh, m, decision.step_time, peak, peak <= memory_budget, zero=f["zero"],
                                      recompute=f["recompute"], recompute_regions=len(f["recompute_regions"]),
                                      offload=f["offload"], kept_gathered=len(f.get("keep_gathered", ())),
                                      terms=decision.terms))
    if not out:
        raise PlanError(f"no (dp, pp, tp) for {world_size} devices suits this model and a batch of {batch}")
    return sorted(out, key=lambda o: (not o.fits, o.step_time, o.peak_memory))


def _choices(o: MeshOption) -> tuple[str, str, str]:
    """The zero, recompute and offload columns: ZeRO-3 with k units kept gathered prints "3 k5";
    recompute="auto" prints the regions it chose ("auto 12")."""
    zero = f"{o.zero}" + (f" k{o.kept_gathered}" if o.kept_gathered else "")
    recompute = f"auto {o.recompute_regions}" if o.recompute == "auto" else o.recompute
    return zero, recompute, o.offload


def ranking_table(options: list[MeshOption], limit: int = 12) -> str:
    """The ranking as text: mesh, microbatches, the zero stage, recompute and offload its plan chose,
    predicted step time and its terms (compute, tp / pp / dp exposed communication, pipeline
    bubble, optimizer update: the terms the step time adds up, ``Decision.terms``), peak memory,
    fit (the figures to the digits ``Plan.summary`` prints them with), then why the first won."""
    head = (f"{'rank':>4s}  {'mesh (dp,pp,tp)':16s} {'microbatches':>12s} {'zero':>5s} {'recompute':>9s} "
            f"{'offload':>9s} {'step ms':>11s} " + " ".join(f"{t:>10s}" for t in TERMS)
            + f" {'peak GiB':>9s}  fits")
    lines = [head]
    for k, o in enumerate(options[:limit]):
        step = f"{o.step_time * 1e3:11.3f}" if np.isfinite(o.step_time) else f"{'-':>11s}"
        peak = f"{o.peak_memory / 2**30:9.3f}" if np.isfinite(o.peak_memory) else f"{'-':>9s}"
        terms = " ".join(f"{o.terms.get(t, 0.0) * 1e3:10.3f}" if o.terms else f"{'-':>10s}" for t in TERMS)
        zero, recompute, offload = _choices(o) if o.terms else ("-", "-", "-")
        lines.append(f"{k + 1:4d}  {mesh_name(o.mesh):16s} {o.microbatches:12d} {zero:>5s} "
                     f"{recompute:>9s} {offload:>9s} {step} {terms} {peak}  {'yes' if o.fits else 'no'}")
    if len(options) > limit:
        lines.append(f"      ... and {len(options) - limit} more")
    lines.append("      (times in ms; zero k: units kept gathered; recompute auto: regions chosen; "
                 "dp: what prefetch leaves exposed)")
    lines.append(ranking_reason(options))
    return "\n".join(lines)


def ranking_reason(options: list[MeshOption]) -> str:
    """One line: why the first of the ranked ``options`` won (or that none fits)."""
    def name(o):
        return mesh_name(o.mesh)
    best = options[0]
    if not best.fits:
        return "      no candidate fits the memory"
    text = f"      winner {name(best)}: the fastest that fits"
    runner = next((o for o in options[1:] if o.fits), None)
    if runner is None:
        text = f"      winner {name(best)}: the only one that fits"
    else:
        text += (f", {best.step_time * 1e3:.3f} ms against the runner-up {name(runner)}'s "
                 f"{runner.step_time * 1e3:.3f} ms ({runner.step_time / best.step_time - 1:.1%} slower)")
    faster = [o for o in options if not o.fits and o.step_time < best.step_time]
    if faster:
        quick = min(faster, key=lambda o: o.step_time)
        text += (f"; {name(quick)} would be faster ({quick.step_time * 1e3:.3f} ms) but needs "
                 f"{quick.peak_memory / 2**30:.2f} GiB per device")
    return text
