"""Prices of one op under one sharding strategy, and of the tensor-parallel collectives a set of
strategies makes the rewrite emit.

A strategy (``graph.rules.Strategy``) divides an op's work by ``divisor`` and may run
collectives inside it (``comm``: per-row fp32 reductions); a parameter's strategy fixes its
local shard, whose bytes the optimizer update and the dp gradient sync are linear in. Between
ops, the collectives that move a producer's placement into the one its consumer asks for are
those of ``graph.reshard`` (forward and backward), each paying ``LAUNCH_OVERHEAD`` in the ILP.
The planner's ILP coefficients (``autopar.planner``), the pipeline's unit costs
(``cost_model.stages``), the plan's step time and the symbolic costs all price ops here.
"""
from __future__ import annotations

import numpy as np
import torch
from torch.fx import Node

from autopar.graph.reshard import ReshardError, can_regather, reshard_steps, step_collectives
from autopar.graph.rules import POINTWISE, is_float, shape
from autopar.placement import R, Placement, local_shape

from .comm import collective_time, summed_bytes
from .compute import attention_kind, compute_time, node_bytes, node_flops
from .memo import cached, strategies_of
from autopar.graph.views import VIEW_OPS
from .repeats import twin

# Fixed host-side cost of issuing one collective (kernel launch, stream sync). Besides being
# real, it decides ties: ring all-reduce moves the same bytes as reduce-scatter + all-gather.
LAUNCH_OVERHEAD = 2e-6


# Host-side cost of one op launch forward plus backward: what makes very small microbatches slow.
# Charged per op per microbatch wherever a step's compute is summed, with or without pipeline stages.
OP_OVERHEAD = 15e-6


def tensor_bytes(node: Node) -> float:
    """Bytes of the tensor(s) a node produces, at the dtype its metadata has."""
    val = node.meta.get("val")
    vals = val if isinstance(val, (list, tuple)) else [val]
    return float(sum(v.numel() * v.element_size() for v in vals if isinstance(v, torch.Tensor)))


def op_traffic(node: Node) -> float:
    """Bytes a call_function node's forward and backward move, unsharded, as the cost model counts them."""
    # Inductor fuses chains of pointwise ops, so one costs about a write of its output
    # forward and one backward; other ops read and write their tensors, backward ~2x.
    # Kept on the node with the metadata it was read from (a retyped copy of the graph carries
    # the meta over with new values): every strategy of every candidate mesh asks again.
    val = node.meta.get("val")
    cached = node.meta.get("autopar_traffic")
    if cached is None or cached[0] is not val:
        cached = node.meta["autopar_traffic"] = (val, 2 * tensor_bytes(node) if node.target in POINTWISE
                                                 else 3 * node_bytes(node))
    return cached[1]


def strategy_work(node: Node, s) -> tuple[float, float, torch.dtype]:
    """(FLOPs, bytes moved, dtype) of a call_function node's forward and backward on one rank
    under strategy ``s``: what ``compute_time`` prices (views excluded by the caller)."""
    fwd, bwd = node_flops(node)   # cached by the cost model per op signature
    val = node.meta["val"]
    dtype = val.dtype if isinstance(val, torch.Tensor) else torch.float32
    return (fwd + bwd) / s.divisor, op_traffic(node) / s.divisor, dtype


def comm_bytes(kind: str, rows: int, tp: int) -> float:
    """Full size of a per-row fp32 collective inside an op (an all-gather's output is tp rows deep)."""
    return rows * 4.0 * (tp if kind == "all_gather" else 1)


def strategy_time(node: Node, s, tp: int, dev, inter_node: bool, with_comm: bool = True) -> float:
    """Seconds of a node's forward and backward under strategy ``s`` on one rank, with the
    collectives inside the op unless ``with_comm`` is False (the plan prices those with the
    others); 0 for views and non-ops."""
    if node.op != "call_function" or node.target in VIEW_OPS:
        return 0.0
    node = twin(node)   # the repeated blocks' ops are priced once, as block 1's
    return cached(node.graph, ("strategy_time", node, tp, inter_node, with_comm),
                  lambda: _strategy_time(node, s, tp, dev, inter_node, with_comm), dev, s)


def _strategy_time(node: Node, s, tp: int, dev, inter_node: bool, with_comm: bool) -> float:
    flops, nbytes, dtype = strategy_work(node, s)
    t = compute_time(flops, nbytes, dev, dtype, attention_kind(node))
    if not with_comm:
        return t
    rows = shape(node.args[0])[0] if s.comm else 0
    return t + sum(collective_time(kind, comm_bytes(kind, rows, tp), tp, dev, inter_node) for kind, _ in s.comm)


def param_memory(node: Node, s, tp: int, state_bytes: float) -> float:
    """``state_bytes`` per byte of a parameter node's local shard under ``s`` (0 for other nodes)."""
    if node.meta.get("kind") != "param":
        return 0.0
    # padded as the shard really is: the plan prices the update and dp sync of these bytes
    return float(np.prod(local_shape(shape(node), s.output, tp))) * node.meta["val"].element_size() * state_bytes


def edge_collectives(consumer_target, slot: int, src: Placement, dst: Placement, divergent: bool, is_float_: bool,
                     *, regather: bool = False):
    """(phase, kind) of the collectives moving one input from ``src`` to ``dst`` for its consumer
    (``regather``: the consumer keeps only the shard and gathers again in backward)."""
    steps = reshard_steps(src, dst, divergent)
    kinds = step_collectives(steps, is_float_)
    if regather and can_regather(consumer_target, slot, src, steps):
        kinds.append(("bwd", "all_gather"))
    return kinds


def move_time(moved: Node, consumer_target, slot: int, form: tuple, tp: int, dev, inter_node: bool,
              fl: bool) -> float:
    """Seconds of the collectives moving the value ``moved`` from placement ``form[0]`` to
    ``form[1]`` (``form[2]``: its gradient is partial) for one consumer input, each with its
    launch overhead; inf where no reshard exists."""
    nbytes, dtype = tensor_bytes(moved), getattr(moved.meta.get("val"), "dtype", None)
    try:
        kinds = edge_collectives(consumer_target, slot, *form, fl)
    except ReshardError:
        return np.inf
    return sum(collective_time(kind, summed_bytes(kind, nbytes, dtype), tp, dev, inter_node) + LAUNCH_OVERHEAD
               for _, kind in kinds)


def tp_collectives(cap, strategies: dict, tp: int):
    """(phase, kind, where, bytes, consumer node) of every tp collective the rewrite will emit; once per
    graph, tp and strategies (``cost_model.memo``: a plan's fields and its stage costs ask for the same
    list, and so do the ZeRO stages of a mesh whose ILP chose alike)."""
    g = cap.gm.graph
    nodes = tuple(g.nodes)
    return list(cached(g, ("tp_collectives", tp, nodes), lambda: tuple(_tp_collectives(cap, strategies, tp)),
                       *strategies_of(strategies, nodes)))


def _tp_collectives(cap, strategies: dict, tp: int):
    out, seen = [], set()
    for c in cap.gm.graph.nodes:
        regather = False
        if c.op == "output":
            pairs = [(p, R, False) for p in c.all_input_nodes]
        elif c.op == "call_function":
            s = strategies[c]
            regather = s.regather
            pairs = [(p, s.inputs[k], s.divergent(k) and is_float(p)) for k, p in enumerate(c.all_input_nodes)]
            rows = shape(c.args[0])[0] if s.comm else 0
            out += [("fwd", kind, c.meta.get("module_path", ""), comm_bytes(kind, rows, tp), c)
                    for kind, _ in s.comm]
        else:
            continue
        for slot, (p, dst, div) in enumerate(pairs):
            kinds = edge_collectives(c.target, slot, strategies[p].output, dst, div, is_float(p), regather=regather)
            own = regather and can_regather(c.target, slot, strategies[p].output,
                                            reshard_steps(strategies[p].output, dst, div))
            if not own:   # the rewrite moves a value once for all consumers wanting it the same way
                if (p, dst, div) in seen:
                    continue
                seen.add((p, dst, div))
            moved = c if isinstance(p.meta.get("val"), (list, tuple)) else p
            nbytes, dtype = tensor_bytes(moved), getattr(moved.meta.get("val"), "dtype", None)
            where = c.meta.get("module_path", "") or p.meta.get("module_path", "")
            out += [(phase, kind, where, summed_bytes(kind, nbytes, dtype), c) for phase, kind in kinds]
    return out
