"""The collectives context parallelism adds to a step, as the plan records them, and their prices.

With cp ranks splitting each sequence (``passes.context_parallel``), each attention runs as one of
two variants (``Plan.cp_attention``, ``collectives.CP_ATTENTIONS``); the loss counts its tokens with
one all-reduce; parameters are replicated over cp: zero=0 averages their gradients over dp x cp,
which the plan records as an all-reduce of the rank's parameter bytes on the cp axis; under ZeRO
the reduce-scattered shards are all-reduced across cp, 1/dp_shard of them.

Per attention and microbatch, with KV the bytes of its keys and values over the whole sequence
at this tp rank's heads (K + V), B = KV / cp one rank's block of them, G the bytes of that block's
gradient (fp32 at 16 bits: ring attention sums it in fp32), T(x) = ``comm.send_recv_time(x)``
(one ring step: every rank sends x to the next while receiving as much), and c_f, c_b the forward
and backward seconds of one block's compute (the attention's whole-sequence time / cp²: each rank
does 1/cp of the causal work, the balanced chunks spread it evenly over the cp steps):

- "allgather": K and V all-gathered over cp in the forward (each gathered tensor the whole
  sequence's), dK and dV reduce-scattered in the backward, priced as the eager program runs them,
  not overlapped (each gather is waited for before its attention):
      exposed = all_gather(K) + all_gather(V) + reduce_scatter(K) + reduce_scatter(V)
  It keeps the gathered K and V, all s tokens, to the backward.
- "ring": cp steps, in each of which a rank computes its queries against the block it holds while
  that block goes on to the next rank and the next block arrives (``collectives.ring_attention``):
      forward   (cp-1) · max(0, T(B) - c_f)
      backward  (cp-1) · max(0, T(B) + T(G) - c_b) + T(G)
  The first block is the rank's own, so no transfer precedes its compute; in the backward each
  step's transfers are the next block and the previous block's gradient (one step behind it), and
  the last gradient hop, back to the block's owner, has no compute left to hide behind. Recorded
  as "send_recv" on cp: forward (cp-1) transfers of B, backward (cp-1) of B and cp of G. It keeps
  nothing beyond the rank's share (its q, k, v, output and log-sum-exp, what fused attention
  keeps at cp=1); in flight in the backward: two key/value blocks and two gradient blocks,
  2·(B + G), added to the backward's transient.
"auto" (the planner's) takes the variant of lower exposed seconds (``cp_attention_seconds``).

Prices: the planner prices the captured, whole sequence; on cp ranks every op does 1/cp of that
work, exactly so with either attention (its scores are the rank's query rows against every key),
so compute, the tp collectives (tokens / cp), the activations and the backward's transient are
divided by cp (``cost_model.step.price_step``, ``cost_model.memory.memory``). Added: the step's cp
term, the collectives above (``cp_seconds``; with pipeline stages one pipeline rank's, its own
attentions and its share of the gradient sync, as every rank moves its own at once), and what each
attention keeps or holds beyond its 1/cp (``context_memory``).

Bytes: K and V are what the graph hands attention, which in Hugging Face's Llama is after
``repeat_kv`` (expand + reshape): with grouped-query attention the all-gather moves the expanded
heads, n_heads / n_kv_heads times the key/value projections' bytes (8x for Llama 3 70B), because
that is what ``passes.context_parallel`` gathers; gathering before the expansion would be that
pass's change, and these prices would follow it.

What a rank keeps for the backward with "allgather" (measured in tests/cost_model/test_context_memory.py,
every tensor autograd saves in the rewritten graph's forward, each storage once):
- the whole sequence's kept tensors at s/cp tokens, the rank's own keys and values among them:
  attention keeps the rank's queries, a view of the qkv projection's output, so that output
  (the local keys and values too) stays alive as it does at cp=1;
- the gathered keys and values in full, all s tokens: the gather's own buffers (its reordering
  copy), not views of the local ones, so the rank's share is held twice;
- the rank's rows of the causal mask that each attention keeps ((s/cp) x s in the queries'
  dtype: sdpa's additive form of the boolean mask, made per call). It grows as s^2 / cp where
  the gathered keys and values grow as s: relative to them it is s / (2 cp b h_kv) (b sequences
  per microbatch, h_kv key/value channels per tp rank), 1 at 4k tokens for Llama-3-8B's 1,024
  channels at cp=2, and 8 GiB per attention at 128k tokens and cp=4;
- left out, well under 0.1% at the test's shapes: the token ids, targets and positions cut to
  the rank's chunks.

``context_memory`` prices the gathered keys and values and the mask per stage, for each
microbatch it holds in flight: an attention inside a recompute region keeps neither (its
region's checkpoint keeps only its inputs); its backward gathers the keys and values again and
remakes the mask, one attention's at a time (a transient), and that second all-gather is added
to the cp term (``cp_seconds``).

With "ring" only the first item is kept (the ring gathers nothing and builds no mask for causal
attention); its blocks in flight are the backward's transient.
"""
from __future__ import annotations

import math

import torch
from torch.fx import Node

from autopar.graph.capture import graph_cached
from autopar.graph.rules import shape
from autopar.placement import local_shape

from .comm import axis_is_inter_node, axis_links, collective_time, send_recv_time
from .compute import node_flops
from .strategy import strategy_time

aten = torch.ops.aten

# the kinds of a cp attention's records (the loss count and the gradient sync are all-reduces)
_ATTENTION_KINDS = ("all_gather", "reduce_scatter", "send_recv")
GRADIENT_SYNC = "(all parameters)"   # where the gradient sync's record is (the whole model's parameters)


@graph_cached
def _sdpa(cap) -> tuple[Node, ...]:
    """The attentions of ``cap``'s graph, once per capture (the step's cp terms read them per rank)."""
    return tuple(n for n in cap.gm.graph.nodes if n.target is aten.scaled_dot_product_attention.default)


def _attentions(cap, strategies: dict[Node, object], tp: int):
    """(node, where, (K, V), element bytes) per attention of ``cap``'s graph: K and V the bytes of
    its keys and of its values over the whole sequence at this tp rank's heads."""
    for n in _sdpa(cap):
        kv = []
        for slot in (1, 2):
            x = n.args[slot]
            loc = local_shape(shape(x), strategies[n].inputs[slot], tp) if tp > 1 else shape(x)
            kv.append(math.prod(loc) * x.meta["val"].element_size())
        yield n, n.meta.get("module_path", ""), tuple(kv), n.args[1].meta["val"].element_size()


def _ring_blocks(kv: float, element: int, cp: int) -> tuple[float, float]:
    """(B, G): one rank's key/value block and its gradient as ring attention sends it (fp32 at 16 bits)."""
    block = kv / cp
    return block, block * max(element, 4) / element


def cp_collectives(cap, strategies: dict[Node, object], cp: int, tp: int, microbatches: int, param_bytes: float,
                   zero: int, dp_shard: int, attention: str = "allgather") -> list[tuple[str, str, str, str, int, float]]:
    """(kind, axis, phase, where, count, bytes) per step of the cp collectives of ``cap``'s graph
    under ``strategies`` (the tp placements), ``microbatches`` forward and backward passes with
    ``attention`` ("allgather" or "ring", see the module docstring), and the gradient sync across
    cp of ``param_bytes`` (one rank's parameter bytes)."""
    if cp == 1:
        return []
    m = microbatches
    out = []
    for _, where, kv, element in _attentions(cap, strategies, tp):
        if attention == "ring":
            block, grad = _ring_blocks(sum(kv), element, cp)
            out.append(("send_recv", "cp", "fwd", where, (cp - 1) * m, (cp - 1) * block * m))
            out.append(("send_recv", "cp", "bwd", where, (2 * cp - 1) * m, ((cp - 1) * block + cp * grad) * m))
            continue
        for nbytes in kv:   # the keys and the values: whole sequence, this tp rank's heads
            out.append(("all_gather", "cp", "fwd", where, m, nbytes * m))
            out.append(("reduce_scatter", "cp", "bwd", where, m, nbytes * m))
    if cap.loss is not None:
        out.append(("all_reduce", "cp", "fwd", cap.loss.meta.get("module_path", ""), m, 8 * m))
    share = 1.0 / dp_shard if zero else 1.0
    out.append(("all_reduce", "cp", "step", GRADIENT_SYNC, 1, param_bytes * share))
    return out


def cp_attention_seconds(cap, strategies: dict[Node, object], cp: int, tp: int, dev, gpus_per_node: int,
                         attention: str, nodes=None) -> float:
    """Exposed seconds of one microbatch's cp attention traffic, forward and backward, every
    attention of ``cap``'s graph (of ``nodes`` only, when given: one pipeline rank's), with
    ``attention`` "allgather" or "ring" (the module docstring's sums; 0 at cp=1)."""
    if cp == 1:
        return 0.0
    inter = axis_links(cp, tp, gpus_per_node)
    tp_inter = axis_is_inter_node(tp, 1, gpus_per_node)
    total = 0.0
    for n, _, kv, element in _attentions(cap, strategies, tp):
        if nodes is not None and n not in nodes:
            continue
        if attention != "ring":
            total += sum(collective_time("all_gather", x, cp, dev, inter) + collective_time("reduce_scatter", x, cp,
                                                                                            dev, inter) for x in kv)
            continue
        block, grad = _ring_blocks(sum(kv), element, cp)
        fwd, bwd = node_flops(n)
        whole = strategy_time(n, strategies[n], tp, dev, tp_inter, with_comm=False) / cp**2   # one step's block
        c_f, c_b = whole * fwd / (fwd + bwd), whole * bwd / (fwd + bwd)
        t_b, t_g = send_recv_time(block, dev, inter), send_recv_time(grad, dev, inter)
        total += (cp - 1) * (max(0.0, t_b - c_f) + max(0.0, t_b + t_g - c_b)) + t_g
    return total


def ring_in_flight(cap, strategies: dict[Node, object], cp: int, tp: int) -> float:
    """Bytes ring attention holds in flight at its backward's height: two key/value blocks and two
    gradient blocks of the largest attention, 2·(B + G)."""
    return max((2 * sum(_ring_blocks(sum(kv), element, cp)) for _, _, kv, element in _attentions(cap, strategies, tp)),
               default=0.0)


def cp_seconds(cap, strategies: dict[Node, object], cp: int, tp: int, dev, gpus_per_node: int, microbatches: int,
               attention: str, collectives, recomputed=frozenset(), *, nodes=None, sync_share: float = 1.0) -> float:
    """The step's cp term: exposed seconds of the cp collectives of ``microbatches`` forward and
    backward passes with ``attention`` (``cp_attention_seconds``), the others the plan records on
    cp (``collectives``: the loss's token count and the gradient sync, per ``cp_collectives``),
    and with "allgather" each recomputed attention's second all-gather of its keys and values in
    its backward (``recomputed``: the names of the recomputed nodes; module docstring).

    With pipeline stages every pipeline rank moves its own stages' traffic at once, so the step
    counts one rank's: ``nodes``, the ops of the rank priced (its attentions), and ``sync_share``,
    its share of the parameters whose gradient sync the plan records for the whole model."""
    if cp == 1:
        return 0.0
    inter = axis_links(cp, tp, gpus_per_node)
    seconds = microbatches * cp_attention_seconds(cap, strategies, cp, tp, dev, gpus_per_node, attention, nodes)
    for c in collectives:
        if c.axis == "cp" and c.kind not in _ATTENTION_KINDS:
            share = sync_share if c.where == GRADIENT_SYNC else 1.0
            seconds += c.count * collective_time(c.kind, share * c.bytes / c.count, cp, dev, inter)
    if attention == "allgather":
        for n, _, kv, _ in _attentions(cap, strategies, tp):
            if n.name in recomputed and (nodes is None or n in nodes):   # its backward gathers the keys and values again
                seconds += 2 * microbatches * collective_time("all_gather", sum(kv) / 2, cp, dev, inter)
    return seconds


def attention_mask_bytes(node: Node, cp: int) -> float:
    """Bytes of the mask an all-gather-KV attention (sdpa ``node`` of the whole-sequence graph) makes
    on a cp rank: its (s/cp) query rows against every key, in the queries' dtype."""
    q, k = node.args[0], node.args[1]
    return shape(q)[-2] / cp * shape(k)[-2] * q.meta["val"].element_size()


def context_memory(cap, strategies: dict[Node, object], cp: int, tp: int, attention: str, stage_nodes,
                   recomputed=frozenset()) -> list[tuple[float, float]]:
    """Per stage (``stage_nodes``: each stage's ops, of the whole-sequence graph), what cp adds to its
    memory beyond the rank's 1/cp of the whole sequence's (module docstring): (bytes each
    microbatch in flight keeps, bytes its backward holds at once). With "allgather", each
    attention outside the recompute regions (``recomputed``: the names of the recomputed nodes)
    keeps its gathered keys and values and its mask rows; a recomputed one makes them again in its
    backward, one attention's at a time. With "ring", two key/value blocks and their gradients in
    flight in the backward, on every stage."""
    if attention == "ring":
        return [(0.0, ring_in_flight(cap, strategies, cp, tp))] * len(stage_nodes)
    kv = {n: sum(both) for n, _, both, _ in _attentions(cap, strategies, tp)}
    out = []
    for nodes in stage_nodes:
        kept, transient = 0.0, 0.0
        for n in nodes:
            if n in kv:
                held = kv[n] + attention_mask_bytes(n, cp)
                if n.name in recomputed:
                    transient = max(transient, held)
                else:
                    kept += held
        out.append((kept, transient))
    return out


def attention_floor(cap, cp: int, tp: int, dev, gpus_per_node: int, attention: str = "auto") -> dict:
    """Per attention of ``cap``'s graph, at most the exposed seconds of its cp traffic in one
    microbatch under any tp strategy (``cp_attention_seconds``' sums, module docstring): its keys
    and values hold at least 1/tp of their bytes on a rank; "allgather" gathers and
    reduce-scatters them, "ring" sends at least its last gradient hop, T(G), after its compute
    (what that compute hides of the rest is not bounded here); "auto" the less of the two."""
    inter = axis_links(cp, tp, gpus_per_node)
    out = {}
    for n in cap.gm.graph.nodes:
        if n.target is not aten.scaled_dot_product_attention.default:
            continue
        kv = [math.prod(shape(n.args[slot])) * n.args[slot].meta["val"].element_size() / tp for slot in (1, 2)]
        gathered = sum(collective_time("all_gather", x, cp, dev, inter) + collective_time("reduce_scatter", x, cp, dev,
                                                                                          inter) for x in kv)
        ring = send_recv_time(_ring_blocks(sum(kv), n.args[1].meta["val"].element_size(), cp)[1], dev, inter)
        out[n] = gathered if attention == "allgather" else ring if attention == "ring" else min(gathered, ring)
    return out
