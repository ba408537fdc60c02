"""Prices of pipeline stages: each layer unit's time per microbatch, the point-to-point cost of a
cut, the microbatches a schedule keeps in flight per stage, and the pipeline's makespan over a step
(bubble included).

The formulas are written out in ``autopar.planner.stage_dp``'s module docstring, which searches over
them: with stage times T_s on p ranks, v stages per rank and m microbatches,

    v = 1:  step = sum_s T_s + (m - 1) * max_s T_s
    v > 1:  step = m * max_r R_r + (p - 1) * max_s T_s,   R_r = sum_{s mod p = r} T_s.
"""
from __future__ import annotations

import math

import numpy as np

from autopar.graph.rules import is_float
from autopar.placement import Shard

from .comm import axis_is_inter_node, collective_time
from .memo import cached, strategies_of
from .strategy import OP_OVERHEAD, strategy_time, tensor_bytes, tp_collectives

SCHEDULES = ("GPipe", "1F1B", "Interleaved1F1B", "InterleavedZeroBubble")
INTERLEAVED = ("Interleaved1F1B", "InterleavedZeroBubble")


def posint(x, name):
    """``x`` as an int, or a ValueError naming ``name`` when it is not a positive integer."""
    if isinstance(x, bool) or not isinstance(x, (int, np.integer)) or x < 1:
        raise ValueError(f"{name} must be a positive integer, got {x!r}")
    return int(x)


def check_schedule(schedule, v):
    """Refuse an unknown schedule, or virtual stages on a schedule that runs one stage per rank."""
    if schedule not in SCHEDULES:
        raise ValueError(f"unknown pipeline schedule {schedule!r}; choose one of {', '.join(SCHEDULES)}")
    if v > 1 and schedule not in INTERLEAVED:
        raise ValueError(f"schedule {schedule} runs one stage per rank, but v={v} virtual stages per "
                         f"rank were asked for; use v=1, or Interleaved1F1B / InterleavedZeroBubble")


def inflight_microbatches(p: int, m: int, v: int = 1, schedule: str = "1F1B") -> tuple[int, ...]:
    """f(s) for s = 0..p*v-1: microbatches whose activations stage s holds at its rank's peak
    (``autopar.planner.stage_dp``'s docstring derives them per schedule)."""
    p, m, v = posint(p, "p"), posint(m, "m"), posint(v, "v")
    check_schedule(schedule, v)
    S = p * v
    if schedule == "GPipe":
        return (m,) * S
    if v == 1:                                  # 1F1B, or an interleaved schedule with one chunk
        return tuple(min(m, p - s) for s in range(S))
    out = []
    for s in range(S):
        r, j = s % p, s // p
        n_r = min(m * v, (v - 1) * p + 2 * (p - 1 - r) + 1)
        q, rho = divmod(n_r, p * v)
        out.append(min(m, q * p + min(max(rho - j * p, 0), p)))
    return tuple(out)


def pipeline_time(stage_times, p: int, m: int, v: int, *, add=math.fsum, maximum=max):
    """Seconds of a step's m microbatches through the stages, fill and drain bubble included
    (the module docstring's formula). ``add`` and ``maximum`` combine the stage times: exact
    float sums by default, ``sympy`` ones for symbolic stage times."""
    if v == 1:
        return add(stage_times) + (m - 1) * maximum(stage_times)
    ranks = [add(stage_times[r::p]) for r in range(p)]
    return m * maximum(ranks) + (p - 1) * maximum(stage_times)


def pipeline_split(parts, p: int, m: int, v: int, makespan: float) -> dict:
    """A pipeline's ``makespan`` (``pipeline_time`` of the stage times) as terms that add up to it:
    the work of the busiest pipeline rank's m microbatches, term by term (``parts``: per stage, a
    dict of term -> seconds, e.g. compute / tp / pp, summing to its stage time), and "bubble", the
    rest: what that rank waits in the fill and drain ((p - 1) x the slowest stage when v > 1)."""
    times = [math.fsum(d.values()) for d in parts]
    busiest = max(range(p), key=lambda r: math.fsum(times[r::p]))
    out = {k: m * math.fsum(d[k] for d in parts[busiest::p]) for k in parts[0]}
    out["bubble"] = max(0.0, makespan - math.fsum(out.values()))   # >= 0 but for rounding (module docstring)
    return out


def unit_costs(cap, strategies: dict, units, mesh, dev, *, gpus_per_node: int):
    """Per unit (anything with the ``nodes`` it runs) per microbatch: seconds (fwd+bwd, with the launch
    overhead and the tp collectives its ops consume); the point-to-point seconds of a cut after each
    unit; and each unit's seconds of tp collectives (part of its seconds), for the step's split by
    term (``pipeline_split``). Its bytes are the memory model's (``cost_model.memory.unit_memory``)."""
    tp = mesh.tp
    tp_inter = axis_is_inter_node(tp, 1, gpus_per_node)
    pp_inter = axis_is_inter_node(mesh.pp, tp, gpus_per_node)
    units = tuple(units)
    unit_of = {n: k for k, u in enumerate(units) for n in u.nodes}
    nodes = tuple(cap.gm.graph.nodes)
    time, boundary, tp_time = cached(
        cap.gm.graph, ("unit_costs", units, tp, tp_inter, pp_inter),
        lambda: _unit_costs(cap, strategies, units, unit_of, tp, dev, tp_inter, pp_inter), dev,
        *strategies_of(strategies, nodes))
    return time.copy(), boundary.copy(), tp_time.copy()


def _unit_costs(cap, strategies, units, unit_of, tp: int, dev, tp_inter: bool, pp_inter: bool):
    """``unit_costs``' figures: seconds, cut seconds and tp seconds per unit, once per graph, units and
    strategies (``cost_model.memo``)."""
    time = np.zeros(len(units))
    for n, k in unit_of.items():
        time[k] += strategy_time(n, strategies[n], tp, dev, tp_inter) + OP_OVERHEAD
    tp_time = np.zeros(len(units))
    if tp > 1:
        for _, kind, _, nbytes, consumer in tp_collectives(cap, strategies, tp):
            if consumer in unit_of:
                tp_time[unit_of[consumer]] += collective_time(kind, nbytes, tp, dev, tp_inter)
    time += tp_time
    # a value crosses the cuts after its own unit up to the last unit that reads it
    sent = np.zeros(len(units) + 1)
    for a, k in unit_of.items():
        last = max((unit_of[u] for u in a.users if u in unit_of), default=k)
        if last > k and is_float(a):
            nbytes = tensor_bytes(a) / (tp if isinstance(strategies[a].output, Shard) else 1)
            sent[k] += nbytes
            sent[last] -= nbytes
    bw = dev.inter_node_bw if pp_inter else dev.intra_node_bw
    boundary = 2 * np.cumsum(sent)[:max(len(units) - 1, 0)] / bw   # activations forward, gradients back
    return time, boundary, tp_time


def rank_param_bytes(params, bounds, mesh) -> float:
    """Parameter bytes of the pipeline rank holding the most under the cut ``bounds``, from the units'
    parameter bytes (``cost_model.memory.unit_params``): what its dp sync and update move."""
    return max(sum(params[a:b].sum() for s, (a, b) in enumerate(bounds) if s % mesh.pp == r) for r in range(mesh.pp))
