"""Moving a tensor from one placement to another on one mesh axis.

``reshard_steps`` is the single table both the cost model and the rewrite read, so
the collectives the planner prices are exactly the ones the rewrite inserts. Each
step names a wrapper of ``autopar.collectives``; its forward and backward
collectives are fixed by ``STEP_COLLECTIVES``.
"""
from __future__ import annotations

from autopar.placement import Partial, Placement, Replicate, Shard

# step -> (forward collective, backward collective); None = no communication
STEP_COLLECTIVES = {
    "copy_to": (None, "all_reduce"),
    "all_reduce": ("all_reduce", None),
    "split": (None, "all_gather"),
    "gather": ("all_gather", None),            # backward keeps this rank's slice
    "gather_reduce": ("all_gather", "reduce_scatter"),
    "reduce_scatter": ("reduce_scatter", "all_gather"),
}


class ReshardError(ValueError):
    """A placement change autopar cannot express (e.g. anything into Partial)."""


def reshard_steps(src: Placement, dst: Placement, divergent: bool) -> list[tuple[str, Placement]]:
    """Steps taking ``src`` to ``dst``: [(step, placement after the step), ...].

    ``divergent``: the consumer's gradient for this input is partial, so the
    backward must sum it over the axis (Megatron's f / the all-gather's dual)."""
    if src == dst:
        return [("copy_to", dst)] if divergent and isinstance(dst, Replicate) else []
    if isinstance(dst, Partial):
        raise ReshardError(f"cannot turn {src} into P")
    if isinstance(src, Replicate):               # dst is a Shard
        return [("split", dst)]
    if isinstance(src, Partial):
        if isinstance(dst, Shard):
            return [("reduce_scatter", dst)]
        return [("all_reduce", dst)] + ([("copy_to", dst)] if divergent else [])
    # src is a Shard
    if isinstance(dst, Replicate):
        return [("gather_reduce" if divergent else "gather", dst)]
    return [("gather", Replicate()), ("split", dst)]


def step_collectives(steps, is_float: bool):
    """(phase, kind) pairs of the communication ``steps`` cause; ints have no backward."""
    out = []
    for step, _ in steps:
        fwd, bwd = STEP_COLLECTIVES[step]
        if fwd:
            out.append(("fwd", fwd))
        if bwd and is_float:
            out.append(("bwd", bwd))
    return out


def can_regather(consumer_target, slot: int, src: Placement, steps) -> bool:
    """Whether this input of a linear arrives by a sequence all-gather, so that the linear may
    gather it itself and keep only the shard for backward (Megatron's storage rule)."""
    import torch
    return (consumer_target is torch.ops.aten.linear.default and slot == 0
            and isinstance(src, Shard) and src.interleave == 1 and [s for s, _ in steps] == ["gather_reduce"])


def regather_candidate(node, strategies) -> bool:
    """Whether ``node`` is a linear whose input arrives by a sequence all-gather (Megatron's
    storage rule may apply to it: see ``graph.reshard.regathers``)."""
    import torch

    from autopar.graph.rules import is_float

    if node.op != "call_function" or node.target is not torch.ops.aten.linear.default or node.args[0] is node.args[1]:
        return False
    x, s = node.args[0], strategies[node]
    steps = reshard_steps(strategies[x].output, s.inputs[0], s.divergent(0) and is_float(x))
    return can_regather(node.target, 0, strategies[x].output, steps)


def regathers(consumer_target, strategy, slot: int, src: Placement, steps) -> bool:
    """Whether a linear running ``strategy`` gathers this input again in backward.

    Megatron's sequence-parallel linear: its input arrives sequence-sharded, is all-gathered
    forward, and all-gathered again in backward instead of kept whole: one more all-gather
    for (t-1)/t less activation memory. A memory decision, so off unless the plan turns it on."""
    return strategy.regather and can_regather(consumer_target, slot, src, steps)
