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
memory uses. The peak is not the sum of everything ever allocated: ``backward_excess`` walks the
backward op by op, freeing what is no longer read and adding gradients as they arrive.
"""
from __future__ import annotations

import math
import operator
from itertools import accumulate

import torch
from torch.fx import Node

from autopar.graph.capture import graph_cached
from autopar.graph.units import zero_units
from autopar.graph.views import CASTS, VIEW_OPS, base_of, drops
from autopar.placement import local_shape

from .compute import node_flops
from .memo import cached, strategies_of
from .repeats import back, block_shift, shifted

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


def _bytes(shape, dtype) -> float:
    return float(math.prod(shape)) * dtype.itemsize   # no tensor made per call: this runs per kept tensor


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
    is log-softmax then NLL: two (N, V) buffers, the NLL gradient and the logits' gradient; for a
    GPT's large vocabulary this is the step's largest transient (measured on an H200: 1.59 GiB
    for two 0.77 GiB buffers). ``s``: the node's strategy."""
    ins = [(a, s.inputs[k]) for k, a in enumerate(node.all_input_nodes)
           if a.meta.get("kind") not in ("param", "buffer") and isinstance(a.meta.get("val"), torch.Tensor)
           and a.meta["val"].is_floating_point()]
    in_bytes = sum(_bytes(local_shape(tuple(a.meta["val"].shape), pl, size), a.meta["val"].dtype) for a, pl in ins)
    if node.target is aten.cross_entropy_loss.default:
        return 2 * in_bytes
    val = node.meta["val"]
    return _bytes(local_shape(tuple(val.shape), s.output, size), val.dtype) + in_bytes


# ---- what Inductor keeps ----------------------------------------------------------------------

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


def _graph_input(node: Node):
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
      prices once per step (``autopar.passes.precision.working_copy_ratio``), so it is left out here.
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
    read = _read_nodes(nodes, recompute)
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


def _read_nodes(nodes: tuple, recompute: tuple) -> tuple:
    """The nodes whose strategies ``compiled_kept`` of ``nodes`` reads: theirs, their inputs' and the
    regions'."""
    def compute():
        members = set(nodes)
        if recompute and all(n in members for region in recompute for n in region):
            # regions among the nodes add none, nor their order: the nodes' own, for every choice of regions
            return _read_nodes(nodes, ())
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
            src = _graph_input(key[0])
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
                  *strategies_of(strategies, _read_nodes(block, ())))


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
                    if _graph_input(key[0]) is None and key not in kept:
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
            if not (_graph_input(b) is not None or b in recomputed or at.get(b) in kept):
                extra.setdefault(*_kept_storage(a, strategies[n].inputs[k], size))
        if sum(extra.values()) < kept[key]:
            del kept[key]
            recomputed.add(n)
            for k2, nbytes in extra.items():
                kept.setdefault(k2, nbytes)
                fused_only.setdefault(k2, False)
                at.setdefault(k2[0], k2)
    return kept


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


def excess_parts(nodes, kept: dict, strategies: dict, size: int, params: tuple, whole_weights: bool = True) -> tuple:
    """What ``backward_excess`` reads of ``nodes`` apart from the parameter gradients' bytes (``params``:
    the parameter nodes it is given gradients of): per op that allocates in its backward, its
    position, alive(t), held(t), its transient and the 16-bit weight gradients it writes (its
    parameters, its dtype's size); where each parameter's gradient arrives; and sum(kept). The ZeRO
    stages, microbatch counts and offload choices of one stage differ only in those bytes, so
    ``excess_with_grads`` prices each of them from one set of parts."""
    index, users_of, priced = _backward_ops(nodes, strategies, size, params)
    total = sum(kept.values())
    before = [0.0] * (len(nodes) + 1)   # before[t]: kept bytes produced before op t (graph inputs: -1)
    own: dict = {}                      # an op's statistics and masks, alive during its own backward
    for k, b in kept.items():
        before[index.get(k[0], -1) + 1] += b
        if k[1] in ("mask", "stats", "lse"):
            own[k[0]] = own.get(k[0], 0.0) + b
    before = list(accumulate(before))
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
            grad_out = _bytes(local_shape(tuple(val.shape), strategies[user].output, size), val.dtype)
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
            if n.op != "call_function" or node_flops(n) == (0.0, 0.0):
                continue
            dtype = getattr(n.meta.get("val"), "dtype", None)
            # a 16-bit weight gradient is a buffer of its own until it is cast into the fp32 gradient
            weights = (tuple(a for a in n.all_input_nodes if a in mine), dtype.itemsize) \
                if dtype is not None and dtype.itemsize < 4 else None
            priced.append((n, t, backward_transient(n, strategies, size), weights))
        return index, users_of, priced
    if not nodes:
        return compute()
    return cached(nodes[0].graph, ("backward_ops", nodes, size, tuple(params)), compute,
                  *strategies_of(strategies, nodes))


def excess_with_grads(parts: tuple, grads: dict, grads_held: bool) -> list:
    """``backward_excess`` from its ``excess_parts`` and the gradients' bytes (``grads``: parameter node ->
    bytes, for the parameters the parts were made with; ``grads_held`` as there)."""
    ops, arrivals, total, length = parts
    after = [0.0] * (length + 1)        # after[t]: gradients that exist once op t's backward has run
    if not grads_held:
        for t, p in arrivals:
            after[t] += grads[p]
    after = list(accumulate(after[::-1]))[::-1]
    out = []
    for n, t, alive, held, transient, weights in ops:
        spent = sum(grads[a] * weights[1] / 4 for a in weights[0]) if weights is not None else 0.0
        out.append((n, alive + after[t] + held + transient + spent - total))
    return out


def param_state(cap, strategies, fqns, tp: int, dp: int, zero: int, working_copy: float, offload: bool = False,
                kept=()):
    """(parameter bytes with a 16-bit step's working copy, gradient bytes, optimizer bytes) one
    rank holds on its device of the parameters ``fqns``: their local shards under ``strategies``,
    Adam's two fp32 moments sharded over dp from ZeRO-1 on (ZeRO-1 also keeps the 1/dp slice of
    the weights it steps as a flat fp32 copy, ``autopar.runtime.zero.Zero1.shard``); ``working_copy``
    as ``autopar.passes.precision.working_copy_ratio``.

    ZeRO-2 and 3 hold 1/dp of the weights and gradients too, and the gathered weights at the
    compute dtype on top: ZeRO-2 every unit's, from its forward to its backward; ZeRO-3 two units'
    at a time (the one computing and the next, being gathered), the largest two, and those of the
    units in ``kept`` (a plan's ``keep_gathered``, by unit name) from their forward to their
    backward: ``gathered_weights``.

    With ``offload`` (the optimizer on the host, ``autopar.runtime.offload``) the moments and the
    fp32 master live in host memory (three fp32 numbers per parameter the moments cover): the
    device keeps no optimizer bytes, and at 16 bits its parameters and gradients are the 16-bit
    working weights alone."""
    local = local_param_bytes(cap, strategies, fqns, tp)
    params = sum(local.values())
    if zero >= 2 and dp > 1:
        gathered = params if zero == 2 else gathered_weights(*unit_gathered_bytes(cap, local), kept)
        return params / dp + gathered * (working_copy or 1.0), params / dp, 0.0 if offload else 2 * params / dp
    if offload:
        held = params * (working_copy or 1.0)
        return held, held, 0.0
    optimizer = 2 * params / (dp if zero else 1)   # Adam's two moments, fp32 like the weights here
    stepped = params / dp if zero == 1 else 0.0   # ZeRO-1's flat copy of the slice its optimizer steps
    return params * (1 + working_copy) + stepped, params, optimizer


def param_grad_bytes(cap, strategies, fqns, tp: int, dp: int, zero: int, working_copy: float,
                     offload: bool = False) -> dict[str, float]:
    """FQN -> the gradient bytes ``param_state`` counts for that parameter alone (its second term,
    one parameter at a time), without pricing the weights and state the gradient does not need."""
    out = {}
    for f, b in local_param_bytes(cap, strategies, fqns, tp).items():
        if zero >= 2 and dp > 1:
            out[f] = b / dp
        elif offload:
            out[f] = b * (working_copy or 1.0)
        else:
            out[f] = b
    return out


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
    for n in unit.nodes:
        if n.target is aten.linear.default and len(n.args) > 1 and isinstance(n.args[1], Node):
            weight = _graph_input(n.args[1])
            if weight is not None and weight.meta.get("kind") == "param" and weight.meta.get("fqn") not in shared:
                return True
    return False


def host_state(cap, strategies, mesh, nodes, zero: int) -> float:
    """Host bytes of one stage's offloaded optimizer (``autopar.runtime.offload``): the fp32 master
    beside Adam's two fp32 moments of what this rank steps, half the moments' bytes again."""
    return 1.5 * param_state(cap, strategies, stage_fqns(cap, nodes), mesh.tp, mesh.dp_shard, zero, 0.0)[2]


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


def stage_terms(cap, strategies, mesh, nodes, regions, *, zero: int, microbatches: int, working_copy: float,
                offload: bool = False, kept=()):
    """(params, gradients held through the forward, optimizer, one microbatch's activations,
    [(node, backward excess)]) of one stage's ``nodes`` with ``regions`` recomputed: the terms
    of its peak (``autopar.planner.recompute.memory_breakdown``); ``offload`` and ``kept`` (ZeRO-3's
    units kept gathered) as ``param_state``. Computed once per question (``cost_model.memo``), and
    for a run of repeated blocks as the same run at block 1 where its figures are that run's
    (``cost_model.repeats``; not with units kept gathered, which are named)."""
    nodes = tuple(nodes)
    members = set(nodes)
    mine = tuple(tuple(r) for r in regions if r and r[0] in members)
    if not nodes:
        return _stage_terms(cap, strategies, mesh, nodes, mine, zero, microbatches, working_copy, offload, kept)
    run = None if kept else shifted(cap, strategies, nodes, mine)
    if run is None:
        return _stage_terms_once(cap, strategies, mesh, nodes, mine, zero, microbatches, working_copy, offload, kept)
    canon, moved, offset = run
    params, grads, opt, act, excess = _stage_terms_once(cap, strategies, mesh, canon, moved, zero, microbatches,
                                                        working_copy, offload, kept)
    return params, grads, opt, act, back(cap, excess, offset)


def _stage_terms_once(cap, strategies, mesh, nodes, mine, zero, microbatches, working_copy, offload, kept):
    """``_stage_terms``, once per question (``cost_model.memo``)."""
    read = strategies_of(strategies, _read_nodes(nodes, mine))
    key = ("stage_terms", nodes, mine, mesh.tp, mesh.dp_shard, zero, microbatches, working_copy, offload,
           frozenset(kept))
    return cached(nodes[0].graph, key, lambda: _stage_terms(cap, strategies, mesh, nodes, mine, zero, microbatches,
                                                            working_copy, offload, kept, read), *read)


def _stage_terms(cap, strategies, mesh, nodes, mine, zero, microbatches, working_copy, offload, kept, read):
    """``stage_terms`` computed; ``read``: the strategies its figures read, those of ``_read_nodes``. What
    the backward keeps and its excess but the gradients' bytes are the same for every ZeRO stage,
    microbatch count and offload choice: kept once per stage, regions and strategies."""
    held = microbatches > 1   # gradients accumulate over the step's microbatches
    fqns = stage_fqns(cap, nodes)
    params, grads, opt = param_state(cap, strategies, fqns, mesh.tp, mesh.dp_shard, zero, working_copy, offload, kept)
    kept = compiled_kept(nodes, strategies, mesh.tp, mine, cap)
    per_param = {cap.params[f]: b for f, b in param_grad_bytes(cap, strategies, fqns, mesh.tp, mesh.dp_shard, zero,
                                                               working_copy, offload).items()}
    parts = cached(nodes[0].graph, ("excess_parts", nodes, mine, mesh.tp),
                   lambda: excess_parts(nodes, kept, strategies, mesh.tp, tuple(per_param)), *read)
    excess = excess_with_grads(parts, per_param, held)
    return params, grads if held else 0.0, opt, sum(kept.values()), excess
