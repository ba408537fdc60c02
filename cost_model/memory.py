"""Activation memory: the bytes each op keeps for its backward, read off the traced graph.

For every op, ``SAVES`` says which tensors autograd keeps (its inputs, its output, a
dropout mask, normalisation statistics); their size is the *local* size under the
plan's placements, at their real dtype (masks 1 byte). A tensor kept by several ops,
or through several views of one storage, is counted once. Ops inside a recompute region
keep nothing; the region keeps its inputs instead.

With these rules a GPT with explicit softmax attention and dropout reproduces the
per-layer activation memory of Korthikanti et al. 2022 (Table 2) from its graph:
sbh(34 + 5as/h) bytes, and the TP / SP / selective-recompute variants. With fused
attention (scaled_dot_product_attention) the 5as/h term (scores, softmax, dropout mask
and its output: 2+2+1 bytes per score) is replaced by what the kernel saves: its output
(2sbh, a copy the projection saves again) and the row log-sum-exp (4 bytes per head and
token, fp32), i.e. sbh(36 + 4a/h) per layer without parallelism.
"""
from __future__ import annotations

import math
import operator

import torch
from torch.fx import Node

from autopar.placement import local_shape

aten = torch.ops.aten

# ops whose output aliases their input: free to run, and they keep no storage of their own
VIEW_OPS = {aten.view.default, aten.reshape.default, aten._unsafe_view.default, aten.transpose.int,
            aten.permute.default, aten.t.default, aten.split.Tensor, aten.split_with_sizes.default,
            aten.chunk.default, aten.alias.default, aten.expand.default, aten.slice.Tensor,
            aten.unsqueeze.default, aten.squeeze.dim, aten.detach.default}

# op -> what it keeps: ("in", k) input k, ("out",) its output, ("mask",) a bool of the output's
# shape, ("stats", k) k fp32 numbers per normalised row, ("lse",) fp32 per (batch, head, query)
SAVES = {
    aten.linear.default: [("in", 0)],
    aten.mm.default: [("in", 0)],   # GPT-2's Conv1D: x @ w with the weight a parameter
    aten.matmul.default: [("in", 0), ("in", 1)],
    aten.bmm.default: [("in", 0), ("in", 1)],
    aten.softmax.int: [("out",)],
    aten._softmax.default: [("out",)],
    aten.log_softmax.int: [("out",)],
    aten.gelu.default: [("in", 0)],
    aten.silu.default: [("in", 0)],
    aten.relu.default: [("out",)],
    aten.tanh.default: [("out",)],
    aten.sigmoid.default: [("out",)],
    aten.layer_norm.default: [("in", 0), ("stats", 2)],
    aten.masked_fill.Scalar: [("in", 1)],
    aten.embedding.default: [("in", 1)],
    aten.cross_entropy_loss.default: [("in", 0), ("in", 1)],
    aten.scaled_dot_product_attention.default: [("in", 0), ("in", 1), ("in", 2), ("out",), ("lse",)],
    aten.mul.Tensor: [("in", 0), ("in", 1)],
    aten.div.Tensor: [("in", 0), ("in", 1)],
}


def base_of(node: Node) -> Node:
    """The node whose storage ``node`` views (a dropout that drops nothing is its input)."""
    while node.op == "call_function" and (node.target in VIEW_OPS | {operator.getitem}
                                          or node.target is aten.dropout.default and not _drops(node)):
        node = node.args[0]
    return node


def _drops(node: Node) -> bool:
    return _dropout_p(node) > 0 and len(node.args) > 2 and bool(node.args[2])


def _dropout_p(node: Node) -> float:
    return float(node.args[1]) if len(node.args) > 1 else 0.5


def _bytes(shape, dtype) -> float:
    return float(math.prod(shape)) * (torch.empty((), dtype=dtype).element_size())


def _kept_storage(arg: Node, pl, size: int):
    """(key, bytes) of the storage that keeping ``arg`` (placed ``pl``) keeps alive: a view keeps
    its whole base (q, k and v split from one qkv tensor keep all of it)."""
    base = base_of(arg)
    v, bv = arg.meta["val"], base.meta["val"]
    if isinstance(bv, (list, tuple)):
        bv = v
    local = _bytes(local_shape(tuple(v.shape), pl, size), v.dtype)
    return (base, str(pl)), local * (bv.numel() / max(v.numel(), 1))


def saved_tensors(node: Node, strategies: dict, size: int):
    """[(storage key, bytes)] that ``node`` keeps for backward under the plan, on an axis of ``size``."""
    from autopar.passes.reshard import regathers, reshard_steps

    strategy = strategies[node]
    out = []
    val = node.meta.get("val")
    ins = node.all_input_nodes
    rules = SAVES.get(node.target, [])
    if node.target is aten.dropout.default and _drops(node):
        rules = [("mask",)]
    for rule in rules:
        if rule[0] == "in":
            arg = node.args[rule[1]] if rule[1] < len(node.args) else None
            if not isinstance(arg, Node) or arg.meta.get("kind") in ("param", "buffer"):
                continue
            if node.target in (aten.mul.Tensor, aten.div.Tensor) and not all(isinstance(a, Node) for a in node.args[:2]):
                continue
            pl = strategy.inputs[ins.index(arg)]
            src = strategies[arg].output if arg in strategies else pl
            steps = reshard_steps(src, pl, strategy.divergent(ins.index(arg))) if src != pl else []
            if regathers(node.target, strategy, rule[1], src, steps):
                pl = src   # the linear keeps its sequence shard and gathers again in backward
            out.append(_kept_storage(arg, pl, size))
        elif rule[0] == "out":
            out.append(((node, str(strategy.output)), _bytes(local_shape(tuple(val.shape), strategy.output, size), val.dtype)))
        elif rule[0] == "mask":
            out.append(((node, "mask"), _bytes(local_shape(tuple(val.shape), strategy.output, size), torch.bool)))
        elif rule[0] == "stats":
            shp = local_shape(tuple(val.shape), strategy.output, size)
            rows = math.prod(shp[:len(shp) - len(node.args[1])])
            out.append(((node, "stats"), rule[1] * rows * 4.0))
        elif rule[0] == "lse":
            shp = local_shape(tuple(val.shape), strategy.output, size)
            out.append(((node, "lse"), math.prod(shp[:-1]) * 4.0))
    return out


def activation_bytes(nodes, strategies: dict, size: int, recompute=()) -> float:
    """Bytes kept for backward by ``nodes`` (one microbatch, one rank). ``recompute``: sets of
    nodes recomputed in backward; each keeps only its inputs from outside the set."""
    kept: dict = {}
    in_region = {n for region in recompute for n in region}
    for n in nodes:
        if n.op == "call_function" and n not in in_region:
            for key, nbytes in saved_tensors(n, strategies, size):
                kept.setdefault(key, nbytes)
    for region in recompute:
        region = set(region)
        for n in region:
            for k, a in enumerate(n.all_input_nodes):
                if a not in region and a.op == "call_function" and a.meta.get("val") is not None:
                    if isinstance(a.meta["val"], torch.Tensor):
                        key, nbytes = _kept_storage(a, strategies[n].inputs[k], size)
                        kept.setdefault(key, nbytes)
    return float(sum(kept.values()))


def attention_core(block_nodes) -> list[Node]:
    """Megatron's selective-recompute region in one block: from q k^T to (softmax . dropout) v.

    It is the nodes between the first score matmul and the matmul with v, inclusive (for
    fused attention, the sdpa node itself)."""
    nodes = list(block_nodes)
    fused = [n for n in nodes if n.target is aten.scaled_dot_product_attention.default]
    if fused:
        return fused
    mm = [n for n in nodes if n.target in (aten.matmul.default, aten.bmm.default)]
    if len(mm) < 2:
        return []
    first, last = nodes.index(mm[0]), nodes.index(mm[1])
    return [n for n in nodes[first:last + 1] if n.op == "call_function"]


def backward_transient(node: Node, strategies: dict, size: int) -> float:
    """Bytes of gradient buffers alive at once while ``node``'s backward runs, on top of what is kept.

    An op's backward holds its output's gradient and writes its inputs' gradients. Cross-entropy
    is log-softmax then NLL: two (N, V) buffers, the NLL gradient and the logits' gradient; for a
    GPT's large vocabulary this is the step's largest transient (measured on an H200: 1.59 GiB
    for two 0.77 GiB buffers)."""
    if node.op != "call_function" or not isinstance(node.meta.get("val"), torch.Tensor):
        return 0.0
    s = strategies[node]
    ins = [(a, s.inputs[k]) for k, a in enumerate(node.all_input_nodes)
           if a.meta.get("kind") not in ("param", "buffer") and isinstance(a.meta.get("val"), torch.Tensor)
           and a.meta["val"].is_floating_point()]
    in_bytes = sum(_bytes(local_shape(tuple(a.meta["val"].shape), pl, size), a.meta["val"].dtype) for a, pl in ins)
    if node.target is aten.cross_entropy_loss.default:
        return 2 * in_bytes
    val = node.meta["val"]
    return _bytes(local_shape(tuple(val.shape), s.output, size), val.dtype) + in_bytes
