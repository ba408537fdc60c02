"""The backward's walk: how far memory rises above the forward's end while the backward runs.

The peak is not the sum of everything ever allocated: ``backward_excess`` walks the backward op
by op, from the last op to the first, freeing what is no longer read (what the forward kept,
``cost_model.activations``) and adding gradients as they arrive and the buffers each op's
backward holds at once (``backward_transient``). Its largest value is a stage's transient in the
one memory sum (``cost_model.memory``).
"""
from __future__ import annotations

import math
from itertools import accumulate

import torch
from torch.fx import Node

from autopar.placement import local_shape

from .activations import compiled_kept, saved_tensors, shape_bytes
from .compute import node_flops
from .memo import cached, strategies_of

aten = torch.ops.aten


def backward_transient(node: Node, strategies: dict, size: int) -> float:
    """Bytes of gradient buffers alive at once while ``node``'s backward runs, on top of what is kept
    (``_backward_transient``), once per node, axis size and strategy (``cost_model.memo``): every
    stage cut's backward walk asks for its nodes again."""
    if node.op != "call_function" or not isinstance(node.meta.get("val"), torch.Tensor):
        return 0.0
    return cached(node.graph, ("backward_transient", node, size),
                  lambda: _backward_transient(node, strategies[node], size), strategies[node])


def _backward_transient(node: Node, s, size: int) -> float:
    """Bytes of gradient buffers alive at once while ``node``'s backward runs, on top of what is kept.

    An op's backward holds its output's gradient and writes its inputs' gradients. Cross-entropy
    (``loss_buffer``) holds one buffer: ``s``, the node's strategy, says which."""
    if node.target is aten.cross_entropy_loss.default:
        return loss_buffer(node, s, size)
    ins = [(a, s.inputs[k]) for k, a in enumerate(node.all_input_nodes)
           if a.meta.get("kind") not in ("param", "buffer") and isinstance(a.meta.get("val"), torch.Tensor)
           and a.meta["val"].is_floating_point()]
    in_bytes = sum(shape_bytes(local_shape(tuple(a.meta["val"].shape), pl, size), a.meta["val"].dtype) for a, pl in ins)
    val = node.meta["val"]
    return shape_bytes(local_shape(tuple(val.shape), s.output, size), val.dtype) + in_bytes




def loss_buffer(node: Node, s, size: int) -> float:
    """Bytes a cross-entropy ``node`` (strategy ``s``) adds in its backward beyond what is kept, under
    torch.compile. Over logits sharded by vocabulary (``ops.vocab_parallel_cross_entropy``) the
    gradient of its picked target logits is scattered into zeros of the rank's (N, V/tp) logits in
    fp32, the dtype a loss computes in (``graph.precision.LOSS_OPS``), and the softmax's gradient is
    added into it before it is cast into the logits' own buffer: one fp32 (N, V/tp) buffer, twice
    the 16-bit logits (Inductor's backward on CPU, torch 2.13: a (2048, 4000) fp32 buffer beside the
    kept bf16 logits at the step's peak, and at fp32 one buffer the logits' size). A whole-vocabulary
    cross-entropy's backward writes its gradient into its logits' buffer: none."""
    if s.local != "vocab_parallel_cross_entropy":
        return 0.0
    logits = node.args[0]
    return 4.0 * math.prod(local_shape(tuple(logits.meta["val"].shape), s.inputs[0], size))


def backward_excess(nodes, kept: dict, strategies: dict, size: int, grads: dict, grads_held: bool,
                    whole_weights: bool = True) -> list:
    """[(node, bytes)]: for each op that allocates in its backward, how far the memory then exceeds
    the forward's end (all of ``kept`` alive), walking the backward from the last op to the first.

    When op t's backward runs, a kept tensor is still alive if it was produced before t (its
    consumers' backwards may not have run; one produced at or after t is dead, its last reader
    done), so alive(t) = kept bytes of producers before t, plus t's own statistics and masks.
    Parameter gradients (``grads``: parameter node -> bytes) arrive with the backward of their
    last user; with ``grads_held`` they already exist (earlier microbatches) and are left out.
    On top, an op that runs a library kernel (matmul, attention: it has FLOPs) holds its output's
    gradient and writes its inputs' (``backward_transient``) and its weights' at its own dtype;
    Inductor writes the gradients of memory-bound ops into buffers their dying inputs free, so
    those add nothing. The excess is alive(t) + new gradients + held(t) + transient(t) - sum(kept).

    held(t): a weight that several ops use (a tied embedding and head) has one gradient, the sum
    of theirs, when it enters the graph whole (``whole_weights``; ZeRO-2/3 gather such a weight
    once for all its users, ``passes.zero``, so it enters whole there too). Inductor folds the later users' weight-gradient matmuls into that sum
    (an addmm where the backward reaches the first user), so each such matmul's operands, its
    output's gradient and the input it kept, stay alive from its own backward to the first
    user's, and the summed gradient arrives there (seen in the compiled backward on CPU and on an
    H200: a tied head keeps the logits' gradient through the whole backward)."""
    return excess_with_grads(excess_parts(nodes, kept, strategies, size, tuple(grads), whole_weights), grads,
                             grads_held)


def excess_parts(nodes, kept: dict, strategies: dict, size: int, params: tuple, whole_weights: bool = True,
                 regions=()) -> tuple:
    """What ``backward_excess`` reads of ``nodes`` apart from the parameter gradients' bytes (``params``:
    the parameter nodes it is given gradients of): per op that allocates in its backward, its
    position, alive(t), held(t), its transient and the 16-bit weight gradients it writes (its
    parameters, its dtype's size); where each parameter's gradient arrives; and sum(kept). The ZeRO
    stages, microbatch counts and offload choices of one stage differ only in those bytes, so
    ``excess_with_grads`` prices each of them from one set of parts.

    ``regions`` (node lists) are recomputed: when the backward reaches one, its forward runs again and
    what its ops keep without recompute (``compiled_kept`` of the region alone) is alive again for
    their backwards, by the same rule as the rest (produced before t: alive at t). Without it a
    Llama-shaped rank under full recompute peaked at 1.85 times its plan (Inductor, CPU, one layer's
    activations made again beside the others' inputs)."""
    index, users_of, priced = _backward_ops(nodes, strategies, size, params)
    total = sum(kept.values())
    before = [0.0] * (len(nodes) + 1)   # before[t]: kept bytes produced before op t (graph inputs: -1)
    own: dict = {}                      # an op's statistics and masks, alive during its own backward
    for k, b in kept.items():
        before[index.get(k[0], -1) + 1] += b
        if k[1] in ("mask", "stats", "lse"):
            own[k[0]] = own.get(k[0], 0.0) + b
    again = [0.0] * (len(nodes) + 1)    # again[t]: a recomputed region's bytes made again and alive at its op t
    for region in regions:
        inside = [index[n] for n in region if n in index]
        if not inside:
            continue
        made = [0.0] * (len(nodes) + 1)
        for k, b in compiled_kept(tuple(region), strategies, size).items():
            if k[0] in index and k not in kept and min(inside) <= index[k[0]] <= max(inside):
                made[index[k[0]] + 1] += b
        made = list(accumulate(made))
        for t in inside:
            again[t] += made[t]
    before = list(accumulate(before))
    before = [b + a for b, a in zip(before, again)]
    arrivals = []                       # (op position, parameter): its gradient exists once that op's backward has run
    held = [0.0] * len(nodes)           # held[t]: deferred weight-gradient operands alive at op t
    for p, users in users_of:
        summed = whole_weights and len(users) > 1
        arrivals.append((users[0] if summed else users[-1], p))
        for u in users[1:] if summed else ():
            user = nodes[u]
            if node_flops(user) == (0.0, 0.0):
                continue
            val = user.meta["val"]
            grad_out = shape_bytes(local_shape(tuple(val.shape), strategies[user].output, size), val.dtype)
            inputs = [(index.get(k[0], -1), kept[k]) for k, _ in saved_tensors(user, strategies, size) if k in kept]
            for t in range(users[0] + 1, u):
                held[t] += grad_out + sum(nbytes for at, nbytes in inputs if at >= t)
    ops = [(n, t, before[t] + own.get(n, 0.0), held[t], transient, weights) for n, t, transient, weights in priced]
    return ops, arrivals, total, len(nodes)


def _backward_ops(nodes, strategies: dict, size: int, params: tuple) -> tuple:
    """What ``excess_parts`` reads of ``nodes`` that what they keep does not change: each node's
    position, the positions of each of ``params``' users (parameters without one left out), and per
    op that allocates in its backward its position, its transient and the 16-bit weight gradients it
    writes. Once per nodes, parameters, axis size and the ops' strategies (``cost_model.memo``): the
    recompute choices of one stage differ only in what is kept."""
    nodes = tuple(nodes)

    def compute():
        index = {n: i for i, n in enumerate(nodes)}
        users_of = []
        for p in params:
            users = sorted({index[u] for u in p.users if u in index})
            if users:
                users_of.append((p, users))
        priced = []
        mine = set(params)
        for n in nodes:
            t = index[n]
            # an op that computes allocates in its backward, and so do a loss over sharded logits and
            # an embedding (its table's gradient)
            if n.op != "call_function" or (node_flops(n) == (0.0, 0.0) and n.target is not aten.embedding.default
                                           and not (n.target is aten.cross_entropy_loss.default
                                                    and loss_buffer(n, strategies[n], size))):
                continue
            dtype = getattr(n.meta.get("val"), "dtype", None)
            # the weight gradients it writes and its dtype's bytes (``excess_with_grads`` prices them)
            weights = (tuple(a for a in n.all_input_nodes if a in mine), dtype.itemsize,
                       n.target is aten.embedding.default) if dtype is not None else None
            priced.append((n, t, backward_transient(n, strategies, size), weights))
        return index, users_of, priced
    if not nodes:
        return compute()
    return cached(nodes[0].graph, ("backward_ops", nodes, size, tuple(params)), compute,
                  *strategies_of(strategies, nodes))


def excess_with_grads(parts: tuple, grads: dict, grads_held: bool, whole: dict | None = None) -> list:
    """``backward_excess`` from its ``excess_parts`` and the gradients' bytes (``grads``: parameter node ->
    bytes, for the parameters the parts were made with; ``grads_held`` as there).

    The weight gradient an op writes is a buffer of its own (``_written``) until it reaches the
    parameter's gradient: below ZeRO-2 at 16 bits, added into the fp32 buffer. ``whole`` (ZeRO-2/3:
    parameter node -> elements of the weight gathered, its tp shard): weights whose whole gradient
    is reduce-scattered (``collectives.gather_param``), in fp32, the dtype it sums in; the op's own
    gradients die first (Inductor on CPU: a Llama's head writes its weight's gradient beside its
    logits' gradient and casts it to fp32 once those are freed)."""
    ops, arrivals, total, length = parts
    whole = whole or {}
    after = [0.0] * (length + 1)        # after[t]: gradients that exist once op t's backward has run
    if not grads_held:
        for t, p in arrivals:
            after[t] += grads[p]
    after = list(accumulate(after[::-1]))[::-1]
    out = []
    for n, t, alive, held, transient, weights in ops:
        if weights is not None and weights[2] and not any(a in whole for a in weights[0]):
            continue   # below ZeRO-2 an embedding's table gradient is priced with the parameters' gradients
        beside, cast = (0.0, 0.0) if weights is None else _written(weights, grads, whole)
        out.append((n, alive + after[t] + held + max(transient + beside, cast) - total))
    return out


def _written(weights: tuple, grads: dict, whole: dict) -> tuple[float, float]:
    """(bytes beside the op's own gradients, bytes once they are freed) of the weight gradients one
    op writes (``weights``: the parameters, its dtype's bytes and whether it is an embedding),
    ``excess_with_grads``' rules. Below ZeRO-2 at 16 bits a matmul's weight gradient is at its
    dtype until added into the fp32 buffer (``grads``' bytes). Under ZeRO-2/3 (``whole``) it is cast
    to fp32 whole for the reduce-scatter; an embedding sums its table's gradient in fp32 (Inductor
    on CPU, bf16: two fp32 tables, the sum and the reduce-scatter's copy, at the end of the backward)."""
    params, itemsize, embedding = weights
    beside = cast = 0.0
    for a in params:
        if a in whole:
            mine = whole[a] * (4 if embedding else itemsize)
            beside += mine
            cast += mine + (whole[a] * 4 if itemsize < 4 or embedding else 0.0)
        elif itemsize < 4:
            beside += grads[a] * itemsize / 4
    return beside, cast
