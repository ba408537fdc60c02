"""Parameter state: the bytes a rank holds for its weights, gradients and optimizer, per configuration.

Every figure here is a rank's local parameter bytes (its tp shards, fp32) times the bytes held
per parameter byte in ``state_bytes``, the one table of them, which the plan's memory
(``cost_model.memory``), the stage DP's per-unit figures, the tensor-parallel ILP's memory row
and the ZeRO floors all read. It is the runtime's layout (``autopar.runtime.zero``,
``autopar.runtime.offload``; tests/runtime/test_distributed_optimizer.py holds the two equal).
Per parameter, in bytes, with AdamW (two fp32 moments), d the ranks the state is split over
(``state_shards``) and g the 16-bit bytes a ZeRO-2/3 rank gathers:

    configuration                    weights        gradients     optimizer          host
    fp32, ZeRO-0                     4              4             8                  -
    fp32, ZeRO-1 (d = dp_shard)      4 + 4/d        4             8/d                -
    16-bit, ZeRO-0                   2              4 (buffer)    12                 -
    16-bit, ZeRO-1 (d = dp x cp)     2              4 (buffer)    12/d               -
    ZeRO-2/3 (d = dp_shard)          4/d + gathered 4/d           8/d                -
    offload, ZeRO-0/1                4 or 2         4 or 2        0                  12 (ZeRO-1: 12/d)
    offload, ZeRO-2/3                4/d + gathered 4/d           0                  12/d
    offload, a kept unit             the fp32 row of its ZeRO stage (``kept_state_bytes``)

So fp32 ZeRO-0 holds 16 bytes per parameter and ZeRO-1 8 + 12/d: its fp32 slice beside the
whole weights. At 16 bits (bf16 or fp16) ZeRO-0 and ZeRO-1 are Megatron-LM's distributed
optimizer: 16-bit parameters, an fp32 gradient buffer, and the fp32 master weights with both
moments (12 bytes) split over the d data-parallel ranks, 2 + 4 + 12/d (18 at ZeRO-0, as Megatron
without its distributed optimizer); d is dp x cp (cp ranks train the same weights), dp_shard when
dp is split (its replicas, cp ranks included, hold the same slice). ZeRO-2/3 keep the fp32 dp
shard itself as the master (FSDP2's mixed precision: 16/d) and gather it at the compute dtype
(g: 2 bytes per gathered parameter at 16 bits, 4 at fp32): ZeRO-2 a stage's every unit, ZeRO-3
two units at a time and those kept gathered (``gathered_weights``). The gradients count once
they outlive a backward (several microbatches accumulate them; with one they arrive during the
backward, its transient), except the 16-bit buffer, which is held through the step.

Under offload a plan's ``offload_kept`` names the units (``autopar.graph.units.zero_units``) whose
optimizer stays on the device, each parameter with its owner unit (``owner_units``): the runtime
keeps such a parameter an fp32 tensor (cast to the compute dtype in the graph at 16 bits) with
its fp32 gradient and the optimizer state beside it (``autopar.runtime.offload``), the fp32 row
of its ZeRO stage; every other parameter holds the offload row. So at 16 bits a kept unit holds
4 + 4 + 8 = 16 bytes per parameter on the device where an offloaded one holds 2 + 2 (and 12 on
the host); at fp32, 16 against 8.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch.fx import Node

from autopar.graph.capture import graph_cached
from autopar.graph.units import owner_units, zero_units
from autopar.graph.views import VIEW_OPS
from autopar.placement import local_shape

from .activations import graph_input
from .memo import cached, strategies_of

aten = torch.ops.aten


@dataclass(frozen=True)
class StateBytes:
    """Bytes held per byte of a rank's local fp32 parameter shards (``state_bytes``)."""

    weights: float          # on the device: the weights or their shard (16-bit, fp32), ZeRO-1's fp32 slice
    grads: float            # the gradients (counted once they outlive a backward, or always: ``buffered``)
    optimizer: float        # on the device: AdamW's two moments, and at 16 bits the fp32 master
    host: float = 0.0       # offload: the fp32 master and the moments in host memory
    gathered: float = 0.0   # ZeRO-2/3: bytes per gathered weight byte (the compute dtype's)
    buffered: bool = False  # the gradients live in a buffer held through the step (16 bits, below ZeRO-2)


def state_bytes(zero: int, shards: int, working_copy: float, offload: bool = False) -> StateBytes:
    """The table of the module docstring: bytes held per local parameter byte under ``zero``, over
    ``shards`` ranks (``state_shards``), at 16 bits where ``working_copy`` (the compute dtype's
    bytes per stored byte, ``autopar.graph.precision.working_copy_ratio``) is not 0, with the
    optimizer on the host with ``offload`` (``autopar.runtime.offload``: at 16 bits the device keeps
    the 16-bit weights and gradients alone). ZeRO-2/3 over one rank is ZeRO-0's."""
    d = shards
    if zero >= 2 and d > 1:
        return StateBytes(1.0 / d, 1.0 / d, 0.0 if offload else 2.0 / d, 3.0 / d if offload else 0.0,
                          working_copy or 1.0)
    if offload:
        held = working_copy or 1.0
        return StateBytes(held, held, 0.0, 3.0 / (d if zero else 1))
    if working_copy:   # the distributed optimizer: 16-bit weights, fp32 buffer, master + moments over d
        return StateBytes(working_copy, 1.0, 3.0 / (d if zero == 1 else 1), buffered=True)
    return StateBytes(1.0 + (1.0 / d if zero == 1 else 0.0), 1.0, 2.0 / (d if zero else 1))


def kept_state_bytes(zero: int, shards: int, working_copy: float) -> StateBytes:
    """What a parameter of a unit the plan keeps on the device under offload holds per local byte
    (module docstring): the fp32 row of ``state_bytes`` at ``zero`` over ``shards`` ranks, as the
    runtime keeps it an fp32 tensor stepped on the device; ZeRO-2/3 still gather it at the compute
    dtype (``working_copy``)."""
    per = state_bytes(zero, shards, 0.0)
    if per.gathered and working_copy:
        return StateBytes(per.weights, per.grads, per.optimizer, gathered=working_copy)
    return per


def kept_params(cap, offload_kept) -> frozenset[str]:
    """The FQNs whose owner unit (``owner_units``) is among ``offload_kept`` (unit names): under
    offload, the parameters whose optimizer stays on the device."""
    if not offload_kept:
        return frozenset()
    owners = owner_units(cap)
    return frozenset(f for f, unit in owners.items() if unit in offload_kept)


# ops whose backward reads their weight operand: they keep it (its 16-bit copy, cast in the graph) for the backward
_WEIGHT_SAVERS = {aten.linear.default, aten.mm.default, aten.matmul.default, aten.bmm.default, aten.addmm.default}


def kept_working_copies(cap, strategies, fqns, tp: int, working_copy: float, offload_kept, recomputed) -> float:
    """At 16 bits under offload, the bytes of the compute-dtype copies of the kept units' weights
    among ``fqns`` (fp32 parameters on the device, cast in the graph where first used) that live
    from the forward to the backward: those of weights a matmul outside the recompute regions
    (``recomputed``: their nodes) reads, whose backward needs them (directly or through a view);
    a recomputed region casts its copy again in its backward."""
    if not working_copy or not offload_kept:
        return 0.0
    on_device = kept_params(cap, offload_kept)
    local = local_param_bytes(cap, strategies, tuple(fqns), tp)

    def saved(node) -> bool:
        for user in node.users:
            if user.target in _WEIGHT_SAVERS and user not in recomputed:
                return True
            if user.target in VIEW_OPS and saved(user):
                return True
        return False
    return sum(b * working_copy for f, b in local.items() if f in on_device and saved(cap.params[f]))


def state_shards(mesh, zero: int, working_copy: float, offload: bool = False) -> int:
    """The ranks ``state_bytes``' d counts for ``mesh`` under ``zero``: dp x cp for the 16-bit
    distributed optimizer at ZeRO-1 over an unsplit dp (its slice is split over every
    data-parallel rank), else dp_shard (ZeRO-1 at fp32 and ZeRO-2/3 shard over dp_shard; cp ranks
    and a split dp's replicas hold the same shards)."""
    if zero == 1 and working_copy and not offload and not mesh.split:
        return mesh.dp_shard * mesh.cp
    return mesh.dp_shard


def state_bytes_per_param_byte(mesh, zero: int, working_copy: float = 0.0, offload: bool = False) -> float:
    """Weights, gradients and optimizer state per parameter byte (``state_bytes`` over
    ``state_shards``): what a layer unit's parameters hold when the gradients outlive a backward,
    as the stage DP and the ILP's memory row price them; ZeRO-2 and 3's gathered weights are a
    stage's, not a unit's (``param_state``)."""
    per = state_bytes(zero, state_shards(mesh, zero, working_copy, offload), working_copy, offload)
    return per.weights + per.grads + per.optimizer


def state_floor(param_bytes: float, mesh, zero: int, working_copy: float, microbatches: int, ranks: int) -> float:
    """A lower bound of a plan's peak bytes per device (``param_state``'s terms summed over the
    stages of its fullest pipeline rank, of ``ranks``), before its strategies and stage cut are
    known, from ``param_bytes``, the model's parameter bytes at least one rank's shards add up to
    (full / tp): each parameter's local shard is at least 1/tp of it and the ranks' stages together
    hold every parameter (a rank holds all its virtual stages at once), so the fullest rank holds
    at least 1/ranks of it times the weights and optimizer state per byte (``state_bytes``), and
    the gradients too with several microbatches or a gradient buffer (gathered weights, activations
    and the transient are >= 0)."""
    per = state_bytes(zero, state_shards(mesh, zero, working_copy), working_copy)
    held = per.grads if microbatches > 1 or per.buffered else 0.0
    return param_bytes * (per.weights + per.optimizer + held) / ranks


def param_state(cap, strategies, fqns, tp: int, dp: int, zero: int, working_copy: float, offload: bool = False,
                kept=(), offload_kept=()):
    """(weight bytes, gradient bytes, optimizer bytes) one rank holds on its device of the parameters
    ``fqns``: their local shards under ``strategies`` times ``state_bytes``' figures per byte
    (``dp``: the ranks the state is split over, ``state_shards``), and under ZeRO-2/3 the weights
    gathered at once at the compute dtype on top: ZeRO-2 every unit's, from its forward to its
    backward; ZeRO-3 two units' at a time (the one computing and the next, being gathered), the largest two, and those of the
    units in ``kept`` (a plan's ``keep_gathered``, by unit name) from their forward to their
    backward: ``gathered_weights``. Under ``offload`` the parameters of the units ``offload_kept``
    keep their optimizer on the device (``kept_state_bytes``)."""
    local = local_param_bytes(cap, strategies, fqns, tp)
    params = sum(local.values())
    per = state_bytes(zero, dp, working_copy, offload)
    on_device = kept_params(cap, offload_kept) if offload else frozenset()
    held = sum(b for f, b in local.items() if f in on_device)
    mine = kept_state_bytes(zero, dp, working_copy)
    weights = (params - held) * per.weights + held * mine.weights
    if per.gathered:
        gathered = params if zero == 2 else gathered_weights(*unit_gathered_bytes(cap, local), kept)
        weights += gathered * per.gathered
    return (weights, (params - held) * per.grads + held * mine.grads,
            (params - held) * per.optimizer + held * mine.optimizer)


def param_grad_bytes(cap, strategies, fqns, tp: int, dp: int, zero: int, working_copy: float,
                     offload: bool = False, offload_kept=()) -> dict[str, float]:
    """FQN -> the gradient bytes ``param_state`` counts for that parameter alone (its second term,
    one parameter at a time), without pricing the weights and state the gradient does not need."""
    grads = state_bytes(zero, dp, working_copy, offload).grads
    on_device = kept_params(cap, offload_kept) if offload else frozenset()
    mine = kept_state_bytes(zero, dp, working_copy).grads
    return {f: b * (mine if f in on_device else grads) for f, b in local_param_bytes(cap, strategies, fqns, tp).items()}


def local_param_bytes(cap, strategies, fqns, tp: int) -> dict[str, float]:
    """FQN -> bytes of its local (tp) shard under ``strategies``, for the parameters ``fqns``; once per
    parameters, tp and their strategies (``cost_model.memo``: a stage's weights, gradients and kept
    units ask it alike, and so do the ZeRO stages of a mesh). Callers must not change the dict."""
    fqns = tuple(fqns)
    nodes = [cap.params[f] for f in fqns]

    def compute():
        local = {}
        for fqn, node in zip(fqns, nodes):
            v = node.meta["val"]
            # an exact integer product (np.prod's, as the sizes are far below 2**63), without numpy's per-call cost
            local[fqn] = float(math.prod(local_shape(tuple(v.shape), strategies[node].output, tp))) * v.element_size()
        return local
    return cached(cap.gm.graph, ("local_param_bytes", fqns, tp), compute, *strategies_of(strategies, nodes))


def stage_fqns(cap, nodes) -> list[str]:
    """The FQNs of the parameters ``nodes`` (one stage's ops) use, once per stage (no strategy
    changes them; every ZeRO stage and microbatch count of a cut asks again). Callers must not
    change the list."""
    nodes = tuple(nodes)

    def compute():
        inputs = {a for n in nodes for a in n.all_input_nodes}   # p feeds u exactly when u is among p's users
        return [f for f, p in cap.params.items() if p in inputs]
    return cached(cap.gm.graph, ("stage_fqns", nodes), compute)


def kept_gathered_bytes(cap, strategies, mesh, nodes, working_copy: float):
    """What keeping units gathered adds to one ZeRO-3 stage's peak: ``extra(kept)``, the device
    bytes ``param_state`` counts with the units ``kept`` (names) kept gathered beyond those it
    counts with none (at the compute dtype), and the unit name -> gathered bytes of the units
    whose keeping changes the program (``regathers``), the ones to choose among."""
    local = local_param_bytes(cap, strategies, stage_fqns(cap, nodes), mesh.tp)
    unit_bytes, shared = unit_gathered_bytes(cap, local)
    scale, base = working_copy or 1.0, gathered_weights(unit_bytes, shared)
    tied = shared_params(cap, local)
    names = {u.name for u in zero_units(cap) if regathers(u, tied)}

    def extra(kept) -> float:
        return (gathered_weights(unit_bytes, shared, kept) - base) * scale
    return extra, {u: b * scale for u, b in unit_bytes.items() if u in names}


def regathers(unit, shared: set[str]) -> bool:
    """Whether ZeRO-3 gathers some of ``unit``'s weights again in its backward: those of its linears
    (``passes.zero``: each takes its own weight's shard), but not a weight several units share
    (``shared``, FQNs: gathered once and kept) nor any other op's (gathered once per unit)."""
    return any(_regathered(unit, shared))


def _regathered(unit, shared: set[str]):
    """The FQNs of ``unit``'s weights that ZeRO-3 gathers again in its backward (``regathers``)."""
    for n in unit.nodes:
        if n.target is aten.linear.default and len(n.args) > 1 and isinstance(n.args[1], Node):
            weight = graph_input(n.args[1])
            if weight is not None and weight.meta.get("kind") == "param" and weight.meta.get("fqn") not in shared:
                yield weight.meta["fqn"]


def regathered_bytes(cap, strategies, units, tp: int) -> list[float]:
    """Per unit of ``units``, the local (tp) bytes ZeRO-3 gathers again in its backward: its
    linears' weights (``passes.zero``) that no other unit shares (``regathers``' rule); a norm's,
    an embedding's or a tied table's are gathered once and kept."""
    everything = local_param_bytes(cap, strategies, tuple(cap.params), tp)
    shared = shared_params(cap, everything)
    return [sum(everything[f] for f in dict.fromkeys(_regathered(unit, shared))) for unit in units]


def host_state(cap, strategies, mesh, nodes, zero: int, offload_kept=()) -> float:
    """Host bytes of one stage's offloaded optimizer (``autopar.runtime.offload``): the fp32 master
    beside Adam's two fp32 moments of what this rank steps (``state_bytes``' ``host``), but for the
    parameters of the units ``offload_kept`` keeps on the device."""
    local = local_param_bytes(cap, strategies, stage_fqns(cap, nodes), mesh.tp)
    on_device = kept_params(cap, offload_kept)
    return sum(b for f, b in local.items() if f not in on_device) * state_bytes(zero, mesh.dp_shard, 0.0,
                                                                                 offload=True).host


@graph_cached
def _param_units(cap) -> dict[str, tuple[int, ...]]:
    """FQN -> the positions in ``zero_units(cap)`` of the units whose ops use the parameter, in order:
    what ``shared_params`` and ``unit_param_bytes`` read, computed once per capture (the planner
    asks for it on every candidate mesh and ZeRO stage)."""
    unit_of: dict = {}
    for k, u in enumerate(zero_units(cap)):
        for n in u.nodes:
            unit_of.setdefault(n, set()).add(k)
    return {f: tuple(sorted({k for user in p.users for k in unit_of.get(user, ())})) for f, p in cap.params.items()}


def shared_params(cap, local) -> set[str]:
    """The FQNs of ``local`` that several layer units use (a tied embedding): ZeRO-2/3 gather those
    once, before the first of the units, and keep them gathered to the last one's backward."""
    where = _param_units(cap)
    return {f for f in local if len(where[f]) > 1}


def unit_gathered_bytes(cap, local: dict[str, float]) -> tuple[dict[str, float], float]:
    """What ZeRO-3 gathers of ``local`` (FQN -> bytes): per layer unit the bytes of the weights it
    alone uses, and the bytes of those several units use (a tied embedding, gathered once and kept
    to the last use's backward, ``passes.zero``)."""
    shared = shared_params(cap, local)
    return unit_param_bytes(cap, {f: b for f, b in local.items() if f not in shared}), sum(local[f] for f in shared)


def gathered_weights(unit_bytes: dict[str, float], shared: float, kept=()) -> float:
    """Bytes of gathered weights alive at once under ZeRO-3 (at the stored dtype; ``param_state``
    scales them to the compute dtype), from ``unit_gathered_bytes``: a resharded unit's live from
    its gather to the end of its forward, and again in its backward, so two at a time (the one
    computing and the next, prefetched: the largest two); a unit in ``kept`` (unit names) keeps its
    weights from its forward to its backward, so all of them are alive where the backward starts;
    the shared weights live through the step."""
    resharded = sorted(b for u, b in unit_bytes.items() if u not in kept)
    return sum(b for u, b in unit_bytes.items() if u in kept) + sum(resharded[-2:]) + shared


def unit_param_bytes(cap, local: dict[str, float]) -> dict[str, float]:
    """Bytes of ``local`` (FQN -> bytes) per layer unit that uses them (a weight two units use
    counts in both)."""
    where = _param_units(cap)
    used: dict[int, list[float]] = {}
    for f, b in local.items():   # each unit's bytes summed in ``local``'s order
        for k in where[f]:
            used.setdefault(k, []).append(b)
    return {u.name: sum(used[k]) for k, u in enumerate(zero_units(cap)) if k in used}
