"""A candidate's step time: the one sum, and the terms outside the ops that go into it.

    step = compute + sum over axes of unoverlapped communication + update

``compute`` is the ops' forward and backward over the step's microbatches; with pipeline stages it
is the pipeline's makespan (``cost_model.stages.pipeline_time``: the tp collectives the units
consume and the fill/drain bubble are inside it). The communication terms are the tp collectives
between ops (pp = 1) and the dp gradient sync (``dp_sync_time``); ``update`` is the optimizer step
and 16-bit weight casts of the busiest rank (``compute.update_time``). Every search and report
adds a step up with ``step_time``: the plan (``Plan.predicted_step_time``), the microbatch
choice, the mesh ranking (through the plans it ranks) and the symbolic costs, whose terms are
sympy expressions (the sum is plain arithmetic, so it takes them as it takes floats).
"""
from __future__ import annotations

from .comm import axis_is_inter_node, collective_time
from .compute import update_time
from .strategy import OP_OVERHEAD, strategy_time


def step_time(compute, comm, update):
    """Seconds per training step: ``compute`` + every axis's communication in ``comm`` + ``update``."""
    total = compute
    for seconds in comm:
        total = total + seconds
    return total + update


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


def dp_sync_bytes(kind: str, param_bytes: float, zero: int, gathered: float) -> float:
    """Bytes one dp collective of ``dp_sync_kinds`` moves for ``param_bytes`` of fp32 weights:
    ZeRO-2/3 gather at the compute dtype (``gathered`` bytes per stored byte) and reduce in fp32."""
    return param_bytes * gathered if zero >= 2 and kind == "all_gather" else param_bytes


def dp_sync_time(param_bytes: float, mesh, dev, zero: int, gpus_per_node: int, *, microbatches: int = 1,
                 gathered: float = 1.0) -> float:
    """Seconds of the dp collectives over one rank's ``param_bytes`` of weights (``dp_sync_kinds``),
    one bucketed collective per kind, per step (ZeRO-0/1) or per microbatch (ZeRO-2/3). None of it
    is counted as overlapped with compute."""
    if mesh.dp == 1:
        return 0.0
    inter = axis_is_inter_node(mesh.dp, mesh.pp * mesh.tp, gpus_per_node)
    times = microbatches if zero >= 2 else 1
    return times * sum(collective_time(k, dp_sync_bytes(k, param_bytes, zero, gathered), mesh.dp, dev, inter)
                       for _, k in dp_sync_kinds(zero))


def param_byte_time(mesh, dev, *, zero: int, working_copy: bool, gpus_per_node: int = 8) -> float:
    """Step seconds per byte of one rank's parameter shards spent outside the forward and
    backward ops: the slope in those bytes of the optimizer update (``update_time``) and of the
    dp gradient sync (``dp_sync_time``; its latency does not depend on the placements), as the
    plan prices them (with pipeline stages each rank holds about 1/pp of the layers, so 1/pp of
    it is charged). The tp ILP adds it to each parameter strategy's cost."""
    seconds = update_time(1.0, dev, working_copy=working_copy, optimizer_shards=mesh.dp if zero else 1)
    seconds += dp_sync_time(1.0, mesh, dev, zero, gpus_per_node) - dp_sync_time(0.0, mesh, dev, zero, gpus_per_node)
    return seconds / mesh.pp


def rank_update_time(param_bytes: float, mesh, dev, zero: int, working_copy: bool) -> float:
    """``update_time`` of a rank holding ``param_bytes`` of fp32 parameters, its optimizer state
    sharded over dp under ZeRO-1."""
    return update_time(param_bytes, dev, working_copy=working_copy, optimizer_shards=mesh.dp if zero else 1)


def plan_update_time(memory, mesh, zero: int, precision: str, dev) -> float:
    """``rank_update_time`` of the pipeline rank holding the most parameters, read off its stages'
    ``memory`` (a plan's MemoryPlans): AdamW state is two fp32 moments per fp32 parameter, 1/dp of
    them under ZeRO-1. ``mesh``: (dp, pp, tp)."""
    dp, pp = mesh[0], mesh[1]
    shards = dp if zero else 1
    per_rank = [sum(m.optimizer for m in memory if m.stage % pp == r) * shards / 2 for r in range(pp)]
    return update_time(max(per_rank, default=0.0), dev, working_copy=precision != "fp32",
                       optimizer_shards=shards)


def flat_compute_time(strategies: dict, tp: int, dev, tp_inter: bool, microbatches: int) -> float:
    """The compute term without pipeline stages: every op's forward and backward under its
    strategy and its launch overhead (``OP_OVERHEAD``, as the pipeline's units charge it), the
    collectives inside ops left to ``tp_comm_time``, for each microbatch."""
    ops = sum(1 for n in strategies if n.op == "call_function")
    return microbatches * (sum(strategy_time(n, s, tp, dev, tp_inter, False) for n, s in strategies.items())
                           + OP_OVERHEAD * ops)


def tp_comm_time(collectives, tp: int, dev, tp_inter: bool) -> float:
    """The tp communication term without pipeline stages: ``collectives`` as (kind, count, total
    bytes) per kind and place, each priced count times at its mean size."""
    return sum(collective_time(kind, nbytes / count, tp, dev, tp_inter) * count for kind, count, nbytes in collectives)
