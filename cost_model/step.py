"""A candidate's step time: its terms, and the prices outside the ops that go into them.

    step = compute + tp + cp + pp + dp + bubble + update + offload      (``terms.StepTerms.total``)

``price_step`` makes a candidate's ``StepTerms``, once. ``compute`` is the ops' forward and backward
over the step's microbatches (``flat_compute_time``); with pipeline stages, the pipeline's
makespan split into the busiest pipeline rank's compute, tp and pp work and the fill/drain
bubble (``cost_model.stages.pipeline_split``). The communication terms are the tp collectives
between ops (pp = 1, ``tp_comm_time``), the cp collectives (``cost_model.context.cp_seconds``) and
the dp gradient sync (``dp_sync_time``: with ZeRO-2/3 and the units' figures, only what prefetch
leaves exposed, ``zero_exposed_time``); ``update`` and ``offload`` are the optimizer step of the
busiest rank on the device and what the host's leaves exposed (``cost_model.offload``; without
offload ``update_terms``, ``compute.update_time``). The recomputed regions' forwards are compute
(``recompute_seconds``). Every search and report adds a step up with
``terms.step_time``: the plan (``Plan.predicted_step_time``), the microbatch choice, the mesh
ranking (through the candidates it ranks) and the symbolic costs, whose terms are sympy
expressions (the sum is plain arithmetic, so it takes them as it takes floats).
"""
from __future__ import annotations

import numpy as np

from autopar.placement import local_shape

from .comm import axis_links, collective_time
from .compute import offload_update_time, update_time
from .memo import cached, strategies_of
from .state import state_shards
from .strategy import OP_OVERHEAD, strategy_time
from .terms import StepTerms


def price_step(work: dict, *, dp: float, cp: float, update: float, offload: float, cp_ranks: int = 1) -> StepTerms:
    """A candidate's ``StepTerms``, the one place they are made. ``work``: the ops' terms priced on
    whole sequences: without pipeline stages "compute" and "tp" (``flat_compute_time``,
    ``tp_comm_time``), with them the busiest pipeline rank's "compute", "tp", "pp" and "bubble"
    (``stages.pipeline_split``); each is divided by ``cp_ranks``, which split every sequence
    (``cost_model.context``). ``dp``, ``cp``, ``update`` and ``offload``: seconds as priced."""
    def per_rank(term: str) -> float:
        return work.get(term, 0.0) / cp_ranks
    return StepTerms(compute=per_rank("compute"), tp=per_rank("tp"), cp=cp, pp=per_rank("pp"), dp=dp,
                     bubble=per_rank("bubble"), update=update, offload=offload, pipelined="bubble" in work)


def dp_sync_kinds(zero: int) -> list[tuple[str, str]]:
    """(phase, kind) of the dp collectives over the weights: an all-reduce of the gradients; with
    ZeRO-1 a reduce-scatter of them and an all-gather of the updated weights, once per step; with
    ZeRO-2 an all-gather of each unit's weights in the forward and a reduce-scatter of its
    gradients in the backward, per microbatch; ZeRO-3 gathers again in the backward."""
    if zero >= 3:
        return [("fwd", "all_gather"), ("bwd", "all_gather"), ("bwd", "reduce_scatter")]
    if zero == 2:
        return [("fwd", "all_gather"), ("bwd", "reduce_scatter")]
    return [("step", "reduce_scatter"), ("step", "all_gather")] if zero else [("step", "all_reduce")]


def dp_sync_collectives(mesh, zero: int) -> list[tuple[str, str, str, float]]:
    """(phase, kind, axis, share) of each dp collective over the weights on ``mesh``: those of
    ``dp_sync_kinds`` over all of dp, each moving ``dp_sync_bytes`` (share 1). With a split dp
    (HSDP) and ZeRO they run over dp_shard, and each reduce-scatter is followed by an all-reduce
    across dp_replicate of what it leaves, 1/dp_shard of the bytes (FSDP2's HSDP); zero=0
    all-reduces over all of dp. None without dp."""
    if mesh.dp == 1:
        return []
    if not zero or not mesh.split:
        return [(phase, kind, "dp", 1.0) for phase, kind in dp_sync_kinds(zero)]
    out = []
    for phase, kind in dp_sync_kinds(zero):
        out.append((phase, kind, "dp_shard", 1.0))
        if kind == "reduce_scatter":
            out.append((phase, "all_reduce", "dp_replicate", 1.0 / mesh.dp_shard))
    return out


def axis_collective_time(kind: str, nbytes: float, mesh, axis: str, dev, gpus_per_node: int) -> float:
    """``collective_time`` of ``kind`` over one mesh axis: its size, at the inter-node tier when
    its ranks span nodes, on as many NICs per node as the axis has ranks there (``axis_links`` with
    the axes inside it)."""
    n = mesh.size(axis)
    return collective_time(kind, nbytes, n, dev, axis_links(n, mesh.inner_size(axis), gpus_per_node))


def dp_sync_bytes(kind: str, param_bytes: float, zero: int, gathered: float) -> float:
    """Bytes one dp collective of ``dp_sync_kinds`` moves for ``param_bytes`` of fp32 weights:
    ZeRO-2/3 gather at the compute dtype (``gathered`` bytes per stored byte) and reduce in fp32."""
    return param_bytes * gathered if zero >= 2 and kind == "all_gather" else param_bytes


def dp_sync_time(param_bytes: float, mesh, dev, zero: int, gpus_per_node: int, *, microbatches: int = 1,
                 gathered: float = 1.0, units=None, kept=(), regathered=None) -> float:
    """Seconds of the dp collectives over one rank's ``param_bytes`` of weights (``dp_sync_kinds``),
    one bucketed collective per kind, per step (ZeRO-0/1) or per microbatch (ZeRO-2/3), none of it
    overlapped with compute.

    ``units``: (parameter bytes, forward+backward compute seconds) of each unit the rank runs, one
    microbatch, in forward order. Given, ZeRO-2/3's collectives are priced per unit as the graph
    issues them, and only the part that prefetch leaves exposed is counted (``zero_exposed_time``);
    ZeRO-0/1's sync after the backward is priced as without them. ``kept``, ``regathered``: as
    ``unit_sync_times``.
    Each collective runs over its axis of ``dp_sync_collectives`` (a split dp: dp_shard, and
    dp_replicate for the all-reduce of the sharded gradients)."""
    if mesh.dp == 1:
        return 0.0
    if units is not None and zero >= 2:
        unit_bytes, seconds = zip(*units) if units else ((), ())
        return microbatches * zero_exposed_time(*unit_sync_times(unit_bytes, mesh, dev, zero, gpus_per_node,
                                                                 gathered=gathered, kept=kept,
                                                                 regathered=regathered), seconds)
    times = microbatches if zero >= 2 else 1
    return times * sum(axis_collective_time(k, share * dp_sync_bytes(k, param_bytes, zero, gathered), mesh, axis, dev,
                                            gpus_per_node)
                       for _, k, axis, share in dp_sync_collectives(mesh, zero))


def unit_sync_times(unit_bytes, mesh, dev, zero: int, gpus_per_node: int, *, gathered: float = 1.0, kept=(),
                    regathered=None):
    """Per unit (its parameter bytes in ``unit_bytes``), seconds of ZeRO-2/3's collectives for one
    microbatch: the forward all-gather, the backward re-gather (ZeRO-3, of the unit's bytes in
    ``regathered``, ``state.regathered_bytes``, or all of them; 0 under ZeRO-2 and for the units at
    the positions ``kept``, a plan's ``keep_gathered``) and the gradient reduce-scatter,
    each one collective per unit (``dp_sync_bytes``); with a split dp the reduce-scatter's time
    includes the all-reduce across the replicas that follows it (``dp_sync_collectives``)."""
    if zero < 2:
        raise ValueError(f"zero={zero}: only ZeRO-2 and 3 gather and reduce-scatter per unit")
    colls = dp_sync_collectives(mesh, zero)

    def each(phase: str, kinds, sizes) -> list[float]:
        return [sum(axis_collective_time(k, share * dp_sync_bytes(k, b, zero, gathered), mesh, axis, dev, gpus_per_node)
                    for ph, k, axis, share in colls if ph == phase and k in kinds) for b in sizes]
    gather = each("fwd", ("all_gather",), unit_bytes)
    again = gather if regathered is None else each("fwd", ("all_gather",), regathered)
    issued = [True] * len(again) if regathered is None else [b > 0 for b in regathered]
    regather = [g if zero >= 3 and k not in kept and issued[k] else 0.0 for k, g in enumerate(again)]
    return gather, regather, each("bwd", ("reduce_scatter", "all_reduce"), unit_bytes)


def zero_sync_floor(param_bytes: float, mesh, dev, zero: int, gpus_per_node: int, *, microbatches: int,
                    gathered: float = 1.0) -> float:
    """A lower bound of a ZeRO-2/3 plan's step time (seconds), before its strategies and stage cut
    are known: the backward's reduce-scatters (and a split dp's all-reduces after them) of the
    busiest rank's units, which ``zero_exposed_time`` counts in full, every microbatch. That rank's
    units hold at least ``param_bytes`` (the model's bytes / (tp * pp)), and a collective's time is
    alpha * steps + bytes / bandwidth, so the per-unit collectives take at least one collective of
    all their bytes: ``microbatches * R(param_bytes)``. None when a latency is negative (a fitted
    profile's), where that sum would not bound it, or for ZeRO-0/1."""
    if zero < 2 or mesh.dp == 1:
        return None
    for _, kind, axis, _ in dp_sync_collectives(mesh, zero):
        inter = axis_links(mesh.size(axis), mesh.inner_size(axis), gpus_per_node)
        if dev.collective_params(kind, bool(inter))[0] < 0:
            return None
    _, _, scatter = unit_sync_times([param_bytes], mesh, dev, zero, gpus_per_node, gathered=gathered)
    return microbatches * scatter[0]


BACKWARD_SHARE = 2 / 3   # of a unit's compute: a matmul's backward is two matmuls of its forward's size


def recompute_seconds(strategies: dict, nodes, tp: int, dev, tp_inter: bool, *, with_comm: bool = False) -> float:
    """Seconds a backward spends running the forward of the recomputed ``nodes`` again (one
    microbatch): their share of forward and backward that is forward (1 - ``BACKWARD_SHARE``) under
    their strategies (``strategy_time``; ``with_comm``: with the collectives inside the ops, as the
    pipeline's unit seconds count them), launch overhead included. The step's compute counts it
    for every region (``price_step``'s callers), and recompute="auto" weighs each block's modes by it."""
    calls = [n for n in nodes if n.op == "call_function"]
    forward = 1 - BACKWARD_SHARE
    return forward * (sum(strategy_time(n, strategies[n], tp, dev, tp_inter, with_comm) for n in calls)
                      + OP_OVERHEAD * len(calls))


def zero_exposed_time(gather, regather, scatter, unit_seconds, *, backward_prefetch: bool = False) -> float:
    """Seconds of ZeRO-2/3's collectives (per unit, ``unit_sync_times``) that prefetch leaves
    exposed in one microbatch on one rank, whose units compute ``unit_seconds`` (forward+backward,
    forward order).

    The graph issues unit k+1's all-gather before unit k computes (``passes.zero``). The backward
    re-gathers and reduce-scatters each unit where its gradient needs them: exposed, unless
    ``backward_prefetch`` (Inductor's reordering, ``autopar.overlap``), where FSDP-style it
    re-gathers unit k-1 while unit k computes and reduce-scatters unit k+1's gradients then. With
    one communication stream, forward and backward compute F_k and B_k, gathers G_k, re-gathers
    H_k and reduce-scatters R_k (terms past either end are 0):

        forward  = G_0 + sum_{k>=1} max(0, G_k - F_{k-1})
        backward = sum_k (H_k + R_k)                                     (in place)
        backward = H_{n-1} + sum_k max(0, H_{k-1} + R_{k+1} - B_k) + R_0   (backward_prefetch)

    the first gather of each pass has no compute before it and the last reduce-scatter none after
    it. B_k is ``BACKWARD_SHARE`` of the unit's compute, F_k the rest: an approximation (ops whose
    backward is cheap, norms and elementwise, hide less in the backward than it assumes)."""
    n = len(unit_seconds)
    if not n:
        return 0.0
    fwd = [t * (1 - BACKWARD_SHARE) for t in unit_seconds]
    bwd = [t * BACKWARD_SHARE for t in unit_seconds]

    def at(xs, k):
        return xs[k] if 0 <= k < n else 0.0
    forward = gather[0] + sum(max(0.0, gather[k] - fwd[k - 1]) for k in range(1, n))
    if not backward_prefetch:
        return forward + sum(regather) + sum(scatter)
    backward = regather[n - 1] + scatter[0] + sum(max(0.0, at(regather, k - 1) + at(scatter, k + 1) - bwd[k])
                                                  for k in range(n))
    return forward + backward


def zero_unit_figures(strategies: dict, units, tp: int, dev, tp_inter: bool) -> list[tuple[float, float]]:
    """``dp_sync_time``'s ``units`` without pipeline stages: per unit (anything with the ``nodes`` it
    runs, ``graph.units.zero_units``), the local bytes of the parameters its ops use (a weight
    several units use, a tied embedding, counts in the first: one gather serves them all) and its
    ops' forward and backward seconds as ``flat_compute_time`` prices them, for one microbatch
    (once per graph, units and strategies, ``cost_model.memo``)."""
    units = tuple(units)
    if not units or not units[0].nodes:
        return _zero_unit_figures(strategies, units, tp, dev, tp_inter)
    graph = units[0].nodes[0].graph
    read = cached(graph, ("unit_inputs", units),
                  lambda: tuple(dict.fromkeys(a for u in units for n in u.nodes for a in (n, *n.all_input_nodes))))
    return list(cached(graph, ("zero_unit_figures", units, tp, tp_inter),
                       lambda: _zero_unit_figures(strategies, units, tp, dev, tp_inter), dev,
                       *strategies_of(strategies, read)))


def _zero_unit_figures(strategies: dict, units, tp: int, dev, tp_inter: bool) -> list[tuple[float, float]]:
    out, seen = [], set()
    for u in units:
        params = dict.fromkeys(a for n in u.nodes for a in n.all_input_nodes
                               if a.op == "placeholder" and a.meta.get("kind") == "param" and a not in seen)
        seen.update(params)
        nbytes = sum(float(np.prod(local_shape(tuple(p.meta["val"].shape), strategies[p].output, tp)))
                     * p.meta["val"].element_size() for p in params)
        seconds = sum(strategy_time(n, strategies[n], tp, dev, tp_inter, False) + OP_OVERHEAD for n in u.nodes)
        out.append((nbytes, seconds))
    return out


def rank_unit_figures(time, params, bounds, mesh) -> list[tuple[float, float]]:
    """``dp_sync_time``'s ``units`` with pipeline stages: (parameter bytes, seconds) of the units of
    the pipeline rank holding the most parameters (``stages.rank_param_bytes``'s), read off the
    units' seconds (``unit_costs``' ``time``) and parameter bytes (``memory.unit_params``) under
    the cut ``bounds``, in the order the rank runs them."""
    return [(float(params[k]), float(time[k])) for k in rank_units(params, bounds, mesh)]


def rank_units(params, bounds, mesh) -> list[int]:
    """The units (indices, in the order it runs them) of the pipeline rank whose units hold the most
    parameter bytes (``params`` per unit) under the cut ``bounds``: the rank ``rank_unit_figures``
    prices."""
    ranks = [[k for s, (a, b) in enumerate(bounds) if s % mesh.pp == r for k in range(a, b)] for r in range(mesh.pp)]
    return max(ranks, key=lambda ks: sum(params[k] for k in ks))


def param_byte_time(mesh, dev, *, zero: int, working_copy: bool, gpus_per_node: int = 8) -> float:
    """Step seconds per byte of one rank's parameter shards spent outside the forward and
    backward ops: the slope in those bytes of the optimizer update (``update_time``) and of the
    dp gradient sync (``dp_sync_time``; its latency does not depend on the placements), as the
    plan prices them (with pipeline stages each rank holds about 1/pp of the layers, so 1/pp of
    it is charged). The tp ILP adds it to each parameter strategy's cost."""
    seconds = update_time(1.0, dev, working_copy=working_copy, optimizer_shards=mesh.dp_shard if zero else 1)
    seconds += dp_sync_time(1.0, mesh, dev, zero, gpus_per_node) - dp_sync_time(0.0, mesh, dev, zero, gpus_per_node)
    return seconds / mesh.pp


def update_terms(param_bytes: float, mesh, dev, zero: int, working_copy: bool, *,
                 offload: bool = False) -> tuple[float, float]:
    """(update, offload) seconds of a rank holding ``param_bytes`` of fp32 parameters, its optimizer
    state sharded from ZeRO-1 on over the ranks ``cost_model.state.state_shards`` names (dp_shard;
    dp x cp for the 16-bit distributed optimizer): the device's AdamW and 16-bit casts
    (``update_time``), and with ``offload`` the host's step in their stead (``offload_update_time``,
    over the fp32 parameters it steps)."""
    shards = state_shards(mesh, zero, working_copy, offload) if zero else 1
    device = update_time(param_bytes, dev, working_copy=working_copy, optimizer_shards=shards, offload=offload)
    return device, offload_update_time(param_bytes / 4 / shards, dev) if offload else 0.0


def flat_compute_time(strategies: dict, tp: int, dev, tp_inter: bool, microbatches: int) -> float:
    """The compute term without pipeline stages: every op's forward and backward under its
    strategy and its launch overhead (``OP_OVERHEAD``, as the pipeline's units charge it), the
    collectives inside ops left to ``tp_comm_time``, for each microbatch (the sum once per graph and
    strategies, ``cost_model.memo``)."""
    if not strategies:
        return microbatches * 0.0
    nodes = tuple(strategies)

    def compute():
        # the op count is the nodes', kept with their time: counting thousands of nodes per call is its own cost
        return (sum(strategy_time(n, s, tp, dev, tp_inter, False) for n, s in strategies.items()),
                sum(1 for n in nodes if n.op == "call_function"))
    ops_time, ops = cached(nodes[0].graph, ("flat_compute", tp, tp_inter, nodes), compute, dev, *strategies.values())
    return microbatches * (ops_time + OP_OVERHEAD * ops)


def tp_comm_time(collectives, tp: int, dev, tp_inter: bool) -> float:
    """The tp communication term without pipeline stages: ``collectives`` as (kind, count, total
    bytes) per kind and place, each priced count times at its mean size."""
    return sum(collective_time(kind, nbytes / count, tp, dev, tp_inter) * count for kind, count, nbytes in collectives)
