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

Prices (``context_priced``): the planner prices the captured, whole sequence; on cp ranks every op
does 1/cp of that work, exactly so with either attention (its scores are the rank's query rows
against every key), so compute, the tp collectives (tokens / cp) and the activations are divided
by cp. Added: the cp collectives above, and with "allgather" the gathered keys and values each
attention keeps for its backward, spread evenly over the pipeline stages. Choices made on the
whole-sequence prices (recompute="auto", the stage cut) are not re-made at the local length.

What a rank keeps for the backward with "allgather" (measured in tests/test_context_memory.py,
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

``attention_priced`` prices the gathered keys and values and the mask per stage, for the
microbatches it holds in flight: an attention inside a recompute region keeps neither (its
region's checkpoint keeps only its inputs); its backward gathers the keys and values again and
remakes the mask, one attention's at a time (a transient), and that second all-gather is added
to the cp term.

With "ring" only the first item is kept (the ring gathers nothing and builds no mask for causal
attention), and ``attention_priced`` does not apply.
"""
from __future__ import annotations

import dataclasses
import math

import torch
from torch.fx import Node

from autopar.graph.rules import shape
from autopar.placement import local_shape

from .comm import axis_is_inter_node, collective_time, send_recv_time
from .compute import node_flops
from .strategy import strategy_time

aten = torch.ops.aten

# the kinds of a cp attention's records (the loss count and the gradient sync are all-reduces)
_ATTENTION_KINDS = ("all_gather", "reduce_scatter", "send_recv")


def _attentions(cap, strategies: dict[Node, object], tp: int):
    """(node, where, (K, V), element bytes) per attention of ``cap``'s graph: K and V the bytes of
    its keys and of its values over the whole sequence at this tp rank's heads."""
    for n in cap.gm.graph.nodes:
        if n.target is not aten.scaled_dot_product_attention.default:
            continue
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
    out.append(("all_reduce", "cp", "step", "(all parameters)", 1, param_bytes * share))
    return out


def cp_attention_seconds(cap, strategies: dict[Node, object], cp: int, tp: int, dev, gpus_per_node: int,
                         attention: str) -> float:
    """Exposed seconds of one microbatch's cp attention traffic, forward and backward, every
    attention of ``cap``'s graph, with ``attention`` "allgather" or "ring" (the module docstring's
    sums; 0 at cp=1)."""
    if cp == 1:
        return 0.0
    inter = axis_is_inter_node(cp, tp, gpus_per_node)
    tp_inter = axis_is_inter_node(tp, 1, gpus_per_node)
    total = 0.0
    for n, _, kv, element in _attentions(cap, strategies, tp):
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


# the step's terms that scale with the rank's tokens (the rest: dp sync, update)
_PER_TOKEN = ("dp", "update")


def context_priced(fields: dict, cp: int, tp: int, dev, gpus_per_node: int, *, cap, strategies) -> dict:
    """A plan's ``fields`` priced on whole sequences (``planner.sharding.sharding_fields`` and the
    memory and stage fields, ``cap``'s graph under ``strategies``) re-priced for ``cp`` ranks per
    sequence with ``fields["cp_attention"]`` (see the module docstring): the per-token terms and
    activations divided by cp, the cp collectives' exposed seconds added to ``predicted_comm_s``
    (and to the step terms as "cp"); with "allgather" the gathered keys and values (whole
    sequence: the rank's own are kept apart, as at cp=1) added to the activations, with "ring" its
    blocks in flight to the backward's transient. The all-gather's keys and values are spread evenly
    over the stages (``attention_priced`` re-prices them per stage and recompute region)."""
    if cp == 1:
        return fields
    ring = fields["cp_attention"] == "ring"
    inter = axis_is_inter_node(cp, tp, gpus_per_node)
    cp_seconds = fields["microbatches"] * cp_attention_seconds(cap, strategies, cp, tp, dev, gpus_per_node,
                                                               fields["cp_attention"])
    gathered = 0.0
    for c in fields["collectives"]:
        if c.axis != "cp":
            continue
        if c.kind not in _ATTENTION_KINDS:
            cp_seconds += c.count * collective_time(c.kind, c.bytes / c.count, cp, dev, inter)
        elif (c.kind, c.phase) == ("all_gather", "fwd"):
            gathered += c.bytes / fields["microbatches"]   # one microbatch's, all s tokens, kept to its backward
    in_flight = ring_in_flight(cap, strategies, cp, tp) if ring else 0.0
    terms = dict(fields["step_terms"])
    scaled = {k: (v if k in _PER_TOKEN else v / cp) for k, v in terms.items()}
    comm = fields["predicted_comm_s"] - terms.get("tp", 0.0) + scaled.get("tp", 0.0) + cp_seconds
    stages = max(1, len(fields.get("memory", ())))

    def memory(m):
        activations = m.activations / cp + gathered / stages
        transient = m.transient / cp + in_flight
        return dataclasses.replace(m, activations=activations, transient=transient,
                                   peak=m.peak - m.activations - m.transient + activations + transient)

    return dict(fields, predicted_compute_s=fields["predicted_compute_s"] / cp, predicted_comm_s=comm,
                step_terms=dict(scaled, cp=cp_seconds), memory=tuple(memory(m) for m in fields.get("memory", ())))


def attention_mask_bytes(node: Node, cp: int) -> float:
    """Bytes of the mask an all-gather-KV attention (sdpa ``node`` of the whole-sequence graph) makes
    on a cp rank: its (s/cp) query rows against every key, in the queries' dtype."""
    q, k = node.args[0], node.args[1]
    return shape(q)[-2] / cp * shape(k)[-2] * q.meta["val"].element_size()


def attention_priced(fields: dict, cp: int, tp: int, dev, gpus_per_node: int, stage_nodes: list[list[Node]],
                     inflight: list[int]) -> dict:
    """``fields`` as ``context_priced`` left them, with what each attention keeps at cp priced per stage
    (module docstring): its gathered keys and values (``context_priced`` spread them evenly over the
    stages, every attention kept) and its mask rows, kept for each of the ``inflight`` microbatches
    a stage holds when the attention is outside the recompute regions; for a recomputed attention,
    both made again in its backward (one attention's at a time, a transient) and its keys and
    values all-gathered again (the cp term). ``stage_nodes``: each stage's ops, of the
    whole-sequence graph."""
    if cp == 1:
        return fields
    m = fields["microbatches"]
    gathers = [c for c in fields["collectives"] if (c.kind, c.axis, c.phase) == ("all_gather", "cp", "fwd")]
    kv = {}   # one microbatch's gathered keys and values, per attention (by module)
    for c in gathers:
        kv[c.where] = kv.get(c.where, 0.0) + c.bytes / m
    share = sum(kv.values()) / max(1, len(fields["memory"]))   # what context_priced put on each stage
    inter = axis_is_inter_node(cp, tp, gpus_per_node)
    recomputed = {name for region in fields["recompute_regions"] for name in region}
    memory, again_seconds = [], 0.0
    for mem, nodes, held in zip(fields["memory"], stage_nodes, inflight):
        kept, transient = 0.0, 0.0
        for n in nodes:
            if n.target is not aten.scaled_dot_product_attention.default:
                continue
            keys = kv.get(n.meta.get("module_path", ""), 0.0)
            if n.name in recomputed:
                transient = max(transient, keys + attention_mask_bytes(n, cp))
                # its backward gathers the keys and the values again, each at half these bytes
                again_seconds += 2 * m * collective_time("all_gather", keys / 2, cp, dev, inter)
            else:
                kept += held * (keys + attention_mask_bytes(n, cp))
        activations = mem.activations - share + kept
        memory.append(dataclasses.replace(mem, activations=activations, transient=mem.transient + transient,
                                          peak=mem.peak - mem.activations + activations + transient))
    terms = fields["step_terms"]
    return dict(fields, memory=tuple(memory), predicted_comm_s=fields["predicted_comm_s"] + again_seconds,
                step_terms=dict(terms, cp=terms["cp"] + again_seconds))
