"""The collectives context parallelism adds to a step, as the plan records them.

With cp ranks splitting each sequence (``passes.context_parallel``), every attention all-gathers
its keys and values over cp in the forward (each gathered tensor is the whole sequence's, at
this tp rank's heads) and reduce-scatters their gradients in the backward, and the loss counts
its tokens with one all-reduce. Parameters are replicated over cp: zero=0 averages their
gradients over dp x cp, which the plan records as an all-reduce of the rank's parameter bytes on
the cp axis; under ZeRO the reduce-scattered shards are all-reduced across cp, 1/dp_shard of them.

Prices (``context_priced``): the planner prices the captured, whole sequence; on cp ranks every op
does 1/cp of that work, exactly so with the all-gather-KV attention (its scores are the rank's
query rows against every key), so compute, the tp collectives (tokens / cp) and the activations
are divided by cp. Added: the cp collectives above, priced as the eager program runs them, not
overlapped (each gather is waited for before its attention), and the gathered keys and values
each attention keeps for its backward, spread evenly over the pipeline stages. Choices made on
the whole-sequence prices (recompute="auto", the stage cut) are not re-made at the local length.

What a rank keeps for the backward (measured in tests/test_context_memory.py, every tensor
autograd saves in the rewritten graph's forward, each storage once):
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
"""
from __future__ import annotations

import dataclasses
import math

import torch
from torch.fx import Node

from autopar.passes.rules import shape
from autopar.placement import local_shape

from .comm import axis_is_inter_node, collective_time

aten = torch.ops.aten


def cp_collectives(cap, strategies: dict[Node, object], cp: int, tp: int, microbatches: int, param_bytes: float,
                   zero: int, dp_shard: int) -> list[tuple[str, str, str, str, int, float]]:
    """(kind, axis, phase, where, count, bytes) per step of the cp collectives of ``cap``'s graph
    under ``strategies`` (the tp placements), ``microbatches`` forward and backward passes, and
    the gradient sync across cp of ``param_bytes`` (one rank's parameter bytes)."""
    if cp == 1:
        return []
    out = []
    for n in cap.gm.graph.nodes:
        if n.target is not aten.scaled_dot_product_attention.default:
            continue
        where = n.meta.get("module_path", "")
        for slot in (1, 2):   # the keys and the values: whole sequence, this tp rank's heads
            x = n.args[slot]
            loc = local_shape(shape(x), strategies[n].inputs[slot], tp) if tp > 1 else shape(x)
            nbytes = math.prod(loc) * x.meta["val"].element_size() * microbatches
            out.append(("all_gather", "cp", "fwd", where, microbatches, nbytes))
            out.append(("reduce_scatter", "cp", "bwd", where, microbatches, nbytes))
    if cap.loss is not None:
        out.append(("all_reduce", "cp", "fwd", cap.loss.meta.get("module_path", ""), microbatches, 8 * microbatches))
    share = 1.0 / dp_shard if zero else 1.0
    out.append(("all_reduce", "cp", "step", "(all parameters)", 1, param_bytes * share))
    return out


# the step's terms that scale with the rank's tokens (the rest: dp sync, update)
_PER_TOKEN = ("dp", "update")


def context_priced(fields: dict, cp: int, tp: int, dev, gpus_per_node: int) -> dict:
    """A plan's ``fields`` priced on whole sequences (``planner.sharding.sharding_fields`` and the
    memory and stage fields) re-priced for ``cp`` ranks per sequence (see the module docstring):
    the per-token terms and activations divided by cp, the cp collectives' seconds added to
    ``predicted_comm_s`` (and to the step terms as "cp"), the gathered keys and values (whole
    sequence: the rank's own are kept apart, as at cp=1) to the activations, spread evenly over the
    stages (``attention_priced`` re-prices them per stage and recompute region)."""
    if cp == 1:
        return fields
    inter = axis_is_inter_node(cp, tp, gpus_per_node)
    cp_seconds, gathered = 0.0, 0.0
    for c in fields["collectives"]:
        if c.axis != "cp":
            continue
        cp_seconds += c.count * collective_time(c.kind, c.bytes / c.count, cp, dev, inter)
        if (c.kind, c.phase) == ("all_gather", "fwd"):
            gathered += c.bytes / fields["microbatches"]   # one microbatch's, all s tokens, kept to its backward
    terms = dict(fields["step_terms"])
    scaled = {k: (v if k in _PER_TOKEN else v / cp) for k, v in terms.items()}
    comm = fields["predicted_comm_s"] - terms.get("tp", 0.0) + scaled.get("tp", 0.0) + cp_seconds
    stages = max(1, len(fields.get("memory", ())))

    def memory(m):
        activations = m.activations / cp + gathered / stages
        transient = m.transient / cp
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
