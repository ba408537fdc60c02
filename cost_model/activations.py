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

``activation_bytes`` is what eager autograd keeps (``compile=False``); ``compiled_kept`` is what
AOTAutograd's partitioner keeps under torch.compile, the default lowering, which the plan's
memory uses (``cost_model.memory``, with the backward's walk above it, ``cost_model.backward``).
"""
from __future__ import annotations

import math
import operator

import torch
from torch.fx import Node

from autopar.graph.views import CASTS, VIEW_OPS, base_of, drops
from autopar.placement import local_shape

from .memo import cached, strategies_of
from .repeats import block_shift, shifted

aten = torch.ops.aten

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


def shape_bytes(shape, dtype) -> float:
    """Bytes of a tensor of ``shape`` and ``dtype``."""
    return float(math.prod(shape)) * dtype.itemsize   # no tensor made per call: this runs per kept tensor


def _kept_storage(arg: Node, pl, size: int):
    """(key, bytes) of the storage that keeping ``arg`` (placed ``pl``) keeps alive: a view keeps
    its whole base (q, k and v split from one qkv tensor keep all of it)."""
    base = base_of(arg)
    v, bv = arg.meta["val"], base.meta["val"]
    if isinstance(bv, (list, tuple)):
        bv = v
    local = shape_bytes(local_shape(tuple(v.shape), pl, size), v.dtype)
    return (base, str(pl)), local * (bv.numel() / max(v.numel(), 1))


def saved_tensors(node: Node, strategies: dict, size: int):
    """[(storage key, bytes)] that ``node`` keeps for backward under the plan, on an axis of ``size``."""
    from autopar.graph.reshard import regathers, reshard_steps

    strategy = strategies[node]
    out = []
    val = node.meta.get("val")
    ins = node.all_input_nodes
    rules = SAVES.get(node.target, [])
    if node.target is aten.dropout.default and drops(node):
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
            out.append(((node, str(strategy.output)),
                        shape_bytes(local_shape(tuple(val.shape), strategy.output, size), val.dtype)))
        elif rule[0] == "mask":
            out.append(((node, "mask"), shape_bytes(local_shape(tuple(val.shape), strategy.output, size), torch.bool)))
        elif rule[0] == "stats":
            shp = local_shape(tuple(val.shape), strategy.output, size)
            rows = math.prod(shp[:len(shp) - len(node.args[1])])
            out.append(((node, "stats"), rule[1] * rows * 4.0))
        elif rule[0] == "lse":
            shp = local_shape(tuple(val.shape), strategy.output, size)
            out.append(((node, "lse"), math.prod(shp[:-1]) * 4.0))
    return out


def activation_bytes(nodes, strategies: dict, size: int, recompute=()) -> float:
    """Bytes eager autograd keeps for backward of ``nodes`` (one microbatch, one rank). ``recompute``: sets of
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



# ops whose backward reads what they keep only elementwise or in row reductions, which Inductor
# fuses into the gradient kernel; matmuls, attention and embeddings read it in a library kernel,
# so a tensor kept for one of those must exist in memory (the partitioner bans its recompute)
FUSED_BACKWARD = {aten.layer_norm.default, aten.softmax.int, aten._softmax.default, aten.log_softmax.int,
                  aten.cross_entropy_loss.default}
def _fused_backward(node: Node) -> bool:
    t = node.target
    return t in FUSED_BACKWARD or isinstance(t, torch._ops.OpOverload) and torch.Tag.pointwise in t.tags


def _recomputable(node: Node) -> bool:
    """Whether the partitioner may rerun ``node`` in backward: a view, a cast or a pointwise op
    (not a random one: a dropout that drops is kept as its mask)."""
    t = node.target
    return node.op == "call_function" and (t in VIEW_OPS or t in CASTS or t is operator.getitem or (
        isinstance(t, torch._ops.OpOverload) and torch.Tag.pointwise in t.tags
        and torch.Tag.nondeterministic_seeded not in t.tags))


def graph_input(node: Node):
    """The graph input that ``node`` is a view or cast of, else None."""
    while node.op == "call_function" and (base_of(node) is not node or node.target in CASTS):
        node = node.args[0] if base_of(node) is node else base_of(node)
    return node if node.op == "placeholder" else None


def _input_bytes(node: Node, src: Node, nbytes: float) -> float:
    """What keeping graph input ``src`` for ``node`` costs: nothing, it is alive anyway, except when
    ``node`` computes at a narrower dtype and its backward reads the input in a matmul: then the
    16-bit copy made in the graph is kept (once per microbatch for a data input; for a weight it
    is the step's working copy, which the planner prices as ``working_copy_ratio``)."""
    have, want = src.meta["val"].dtype, getattr(node.meta.get("val"), "dtype", None)
    if src.meta.get("kind") in ("param", "buffer") or _fused_backward(node) or want is None \
            or not have.is_floating_point or want.itemsize >= have.itemsize:
        return 0.0
    return nbytes * want.itemsize / have.itemsize


def compiled_activation_bytes(nodes, strategies: dict, size: int, recompute=()) -> float:
    """Bytes kept for backward by ``nodes`` (one microbatch, one rank) under torch.compile: the sum of ``compiled_kept``."""
    return float(sum(compiled_kept(nodes, strategies, size, recompute).values()))


def compiled_kept(nodes, strategies: dict, size: int, recompute=(), cap=None) -> dict:
    """{storage key: bytes} kept for backward by ``nodes`` (one microbatch, one rank) when the step is lowered by
    torch.compile: what AOTAutograd's min-cut partitioner (``min_cut_rematerialization_partition``,
    after Inductor's decompositions) saves, against ``activation_bytes``' eager autograd.

    It starts from the eager set (``SAVES``) and applies the partitioner's rules:

    - A graph input costs nothing: parameters, buffers and the batch are alive anyway. A 16-bit
      copy of one that a matmul's backward reads is kept, though: for a float data input it is
      counted at the compute dtype; for a weight it is the step's working copy, which the planner
      prices once per step (``autopar.graph.precision.working_copy_ratio``), so it is left out here.
    - A tensor some backward reads in a library kernel (matmul, attention, embedding) must exist,
      so it is saved (the partitioner bans its recompute). One read only by fused backward code
      (pointwise gradients, LayerNorm's or softmax's) may be recomputed there when it is a view,
      cast or pointwise op: the cut keeps the smaller of the tensor and those of its inputs not
      kept already (nothing when all are; a 16-bit tensor rather than its fp32 upcast; a bias
      add's input rather than its output, at the same bytes).
    - Cross-entropy keeps its logits at their (16-bit) dtype and, per row, the max and the
      log-sum-exp in fp32; its softmax gradient is recomputed from them.

    For a GPT (LayerNorm, fused attention, GELU, tied head, cross-entropy) nothing more is
    dropped: every tensor the eager rules keep is read by a matmul or the attention's backward,
    or is a residual sum whose summands are not kept. So this is ``activation_bytes`` less the
    token ids and targets, plus 8 bytes a token for the loss: measured within 0.5% of the
    partitioner (torch 2.13, CPU, ``tests/cost_model/test_compiled_memory.py``) and within 0.01%
    on an H200 (torch 2.11, h=2048, s=2048, bf16). LayerNorm statistics stay 8 bytes a row: the
    CPU decomposition rounds them to the compute dtype, the CUDA one does not.
    ``recompute``: as for ``activation_bytes``. Computed once per question (``cost_model.memo``):
    callers must not change the dict. ``cap``, the capture of ``nodes``, lets it read what the
    ops of its repeated blocks keep a block at a time (``_saves``)."""
    nodes, recompute = tuple(nodes), tuple(tuple(r) for r in recompute)
    if not nodes:
        return {}
    read = read_nodes(nodes, recompute)
    shift = block_shift(cap) if cap is not None else None
    return cached(nodes[0].graph, ("compiled_kept", nodes, recompute, size),
                  lambda: _compiled_kept(nodes, strategies, size, recompute, shift), *strategies_of(strategies, read))


def kept_bytes(cap, nodes, strategies: dict, size: int, recompute=()) -> float:
    """The sum of ``compiled_kept``, for a run of repeated blocks the run's at block 1 where their
    figures are the same (``cost_model.repeats``): the unit costs and the recompute choice ask it
    of every block."""
    nodes, recompute = tuple(nodes), tuple(tuple(r) for r in recompute)
    run = shifted(cap, strategies, nodes, recompute)
    if run is not None:
        nodes, recompute, _ = run
    return sum(compiled_kept(nodes, strategies, size, recompute, cap).values())


def read_nodes(nodes: tuple, recompute: tuple) -> tuple:
    """The nodes whose strategies ``compiled_kept`` of ``nodes`` reads: theirs, their inputs' and the
    regions'."""
    def compute():
        members = set(nodes)
        if recompute and all(n in members for region in recompute for n in region):
            # regions among the nodes add none, nor their order: the nodes' own, for every choice of regions
            return read_nodes(nodes, ())
        out = dict.fromkeys(nodes)
        for region in recompute:
            out.update(dict.fromkeys(region))
        for n in list(out):
            out.update(dict.fromkeys(n.all_input_nodes))
        return tuple(out)
    return cached(nodes[0].graph, ("read_nodes", nodes, recompute), compute)


def _eager_saves(n: Node, strategies: dict, size: int) -> tuple:
    """((storage key, bytes, whether only fused backward code reads it), ...) of what ``n`` keeps
    under eager autograd and still costs under torch.compile (``_input_bytes`` for graph inputs):
    ``_compiled_kept``'s starting set, node by node. It reads only the strategies of ``n`` and its
    inputs, so it is computed once per node, axis size and those strategies (``cost_model.memo``):
    each stage cut of the ranking asks again for the nodes of its stages."""
    def compute():
        out = []
        for key, nbytes in saved_tensors(n, strategies, size):
            src = graph_input(key[0])
            nbytes = nbytes if src is None else _input_bytes(n, src, nbytes)
            if nbytes:
                out.append((key, nbytes, _fused_backward(n)))
        return tuple(out)
    return cached(n.graph, ("eager_saves", n, size), compute, strategies[n], *map(strategies.get, n.all_input_nodes))


def _saves(nodes: tuple, strategies: dict, size: int, shift) -> list:
    """Per node of ``nodes``, its ``_eager_saves`` (() for a node that is not an op), those of a whole
    repeated block (``shift``: ``cost_model.repeats.block_shift``'s layout) asked of the memo at once:
    a stage of many blocks asks it once per block, not once per op."""
    out, i, ops = [], 0, shift.ops if shift is not None else 0
    at = shift.call_at if shift is not None else {}
    while i < len(nodes):
        p = at.get(nodes[i])
        if p is not None and p % ops == 0 and nodes[i:i + ops] == shift.calls[p:p + ops]:
            out += _block_saves(shift.calls[p:p + ops], strategies, size)
            i += ops
            continue
        out.append(_eager_saves(nodes[i], strategies, size) if nodes[i].op == "call_function" else ())
        i += 1
    return out


def _block_saves(block: tuple, strategies: dict, size: int) -> list:
    """``_eager_saves`` of each op of ``block``, once per block, axis size and the strategies it reads."""
    return cached(block[0].graph, ("block_saves", block, size),
                  lambda: [_eager_saves(n, strategies, size) for n in block],
                  *strategies_of(strategies, read_nodes(block, ())))


def _compiled_kept(nodes, strategies: dict, size: int, recompute, shift=None) -> dict:
    """``compiled_kept`` computed; ``shift`` as ``_saves``."""
    in_region = {n for region in recompute for n in region}
    kept, fused_only, at = {}, {}, {}
    for n, saves in zip(nodes, _saves(nodes, strategies, size, shift)):
        if n.op != "call_function" or n in in_region:
            continue
        for key, nbytes, fused in saves:
            kept.setdefault(key, nbytes)
            fused_only[key] = fused_only.get(key, True) and fused
            if key[1] not in ("mask", "stats", "lse"):   # the tensor itself, not a by-product
                at.setdefault(key[0], key)
        if n.target is aten.cross_entropy_loss.default:
            shp = local_shape(tuple(n.args[0].meta["val"].shape), strategies[n].inputs[0], size)
            kept[(n, "lse")] = 8.0 * math.prod(shp[:-1])
    for region in recompute:
        region = set(region)
        for n in region:
            for k, a in enumerate(n.all_input_nodes):
                if a not in region and a.op == "call_function" and isinstance(a.meta.get("val"), torch.Tensor):
                    key, nbytes = _kept_storage(a, strategies[n].inputs[k], size)
                    if graph_input(key[0]) is None and key not in kept:
                        kept[key], fused_only[key] = nbytes, False
                        at.setdefault(key[0], key)
    recomputed = set()
    for n in nodes:   # in order, so a tensor recomputed from recomputed ones is a fused chain
        key = at.get(n)
        if key is None or not fused_only[key] or not _recomputable(n):
            continue
        extra = {}
        for k, a in enumerate(n.all_input_nodes):
            b = base_of(a)
            if not (graph_input(b) is not None or b in recomputed or at.get(b) in kept):
                extra.setdefault(*_kept_storage(a, strategies[n].inputs[k], size))
        if sum(extra.values()) < kept[key]:
            del kept[key]
            recomputed.add(n)
            for k2, nbytes in extra.items():
                kept.setdefault(k2, nbytes)
                fused_only.setdefault(k2, False)
                at.setdefault(k2[0], k2)
    return kept
