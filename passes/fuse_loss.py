"""Loss rewrites: the head linear and its cross-entropy fused into the chunked op of
autopar.kernels.fused_linear_ce (``fuse_loss_pass``), or the cross-entropy alone routed through
the one-read kernel of autopar.kernels.cross_entropy (``cross_entropy_kernel_pass``).

    from autopar.passes.fuse_loss import fuse_loss_pass
    gm = fuse_loss_pass(cap.gm)                       # a captured graph (capture_pass), tp = 1
    gm = fuse_loss_pass(shard_pass(cap.gm, ...))      # one rank's graph after the tp rewrite
    fn = torch.compile(gm)                            # then lower it as usual

Two patterns, where the logits and every view between them and the loss have no other user:

    captured:  linear(x, w) -> view* -> aten.cross_entropy_loss(logits, y, None, mean|sum, ignore, 0.0)
               becomes torch.ops.autopar.linear_cross_entropy(flatten(x), w, y, ignore, reduction)[0]
    sharded:   linear(x, w) | gathered_linear(x, w, ...) -> view* -> ops.vocab_parallel_cross_entropy(...)
               becomes vocab_parallel_linear_cross_entropy(flatten(x), w, y, <same group arguments>)

A gathered (sequence-parallel) head input is all-gathered first, with the gradient
reduce-scattered back, as gathered_linear does. The view chain must end in (N, V) with V the
linear's output width, so that row i of the logits is row i of the flattened hidden states;
when a shape cannot be read from the graph the pattern is left alone. Anything else (a bias,
class weights, label smoothing, per-token losses on an unsharded graph) is left unfused.
Both passes rewrite a copy of the graph and return it.
"""
from __future__ import annotations

import inspect
import operator

import torch
from torch.fx import GraphModule, Node

from autopar import collectives as C
from autopar import ops
from autopar.kernels.cross_entropy import cross_entropy
from autopar.kernels.fused_linear_ce import vocab_parallel_linear_cross_entropy
from autopar.graph.capture import copy_graph
from autopar.placement import padded_size

aten = torch.ops.aten
_VIEWS = {aten.view.default, aten.reshape.default, aten._unsafe_view.default}
_CE_ARGS = ("self", "target", "weight", "reduction", "ignore_index", "label_smoothing")
_CE_DEFAULTS = {"weight": None, "reduction": 1, "ignore_index": -100, "label_smoothing": 0.0}
_VP_SIGNATURE = inspect.signature(ops.vocab_parallel_cross_entropy)
_REDUCTION_NAMES = {0: "none", 1: "mean", 2: "sum"}


def fuse_loss_pass(gm: GraphModule, *, chunk: int = 0) -> GraphModule:
    """Replace head linear -> views -> cross-entropy with the fused chunked linear cross-entropy.

    ``chunk``: vocabulary columns per chunk of the fused op (0: its default)."""
    out = copy_graph(gm)
    for node in list(out.graph.nodes):
        if node.op != "call_function":
            continue
        if node.target is aten.cross_entropy_loss.default:
            _fuse_captured(out, node, chunk)
        elif node.target is ops.vocab_parallel_cross_entropy:
            _fuse_sharded(out, node, chunk)
    out.graph.lint()
    out.recompile()
    return out


def cross_entropy_kernel_pass(gm: GraphModule) -> GraphModule:
    """Replace aten.cross_entropy_loss over 2-D logits with autopar.kernels.cross_entropy.

    Only plain losses are rewritten (no class weights or label smoothing); the logits reach the
    kernel in their own dtype, which reads them once and computes in fp32."""
    out = copy_graph(gm)
    for ce in list(out.graph.nodes):
        if ce.op != "call_function" or ce.target is not aten.cross_entropy_loss.default:
            continue
        args = dict(_CE_DEFAULTS, **dict(zip(_CE_ARGS, ce.args)), **ce.kwargs)
        if (args["weight"] is not None or args["label_smoothing"] != 0.0 or args["reduction"] not in _REDUCTION_NAMES
                or not _two_dim(args["self"])):
            continue
        with out.graph.inserting_before(ce):
            loss = out.graph.call_function(cross_entropy, (args["self"], args["target"], args["ignore_index"],
                                                           _REDUCTION_NAMES[args["reduction"]]))
        _replace(out, ce, loss, [])
    out.graph.lint()
    out.recompile()
    return out


def _two_dim(logits: Node) -> bool:
    val = logits.meta.get("val")
    if val is not None:
        return val.dim() == 2
    return logits.target in _VIEWS and len(logits.args[1]) == 2


def _fuse_captured(gm: GraphModule, ce: Node, chunk: int) -> None:
    args = dict(_CE_DEFAULTS, **dict(zip(_CE_ARGS, ce.args)), **ce.kwargs)
    if args["weight"] is not None or args["label_smoothing"] != 0.0 or args["reduction"] not in (1, 2):
        return
    chain = _head_chain(args["self"])
    if chain is None or chain[0].target is not aten.linear.default:
        return
    width = _width(chain[0])
    if width is None or _final_width(args["self"]) != width:
        return
    x, w = chain[0].args[:2]
    with gm.graph.inserting_before(ce):
        hidden = _flatten(gm, x, ce)
        both = gm.graph.call_function(torch.ops.autopar.linear_cross_entropy.default,
                                      (hidden, w, args["target"], args["ignore_index"], args["reduction"], chunk))
        _copy_meta(both, ce)
        fused = gm.graph.call_function(operator.getitem, (both, 0))
    _replace(gm, ce, fused, chain)


def _fuse_sharded(gm: GraphModule, ce: Node, chunk: int) -> None:
    bound = _VP_SIGNATURE.bind(*ce.args, **ce.kwargs)
    bound.apply_defaults()
    a = bound.arguments
    chain = _head_chain(a["logits"])
    if chain is None or _final_width(a["logits"]) != padded_size(a["vocab"], a["size"]):
        return
    head = chain[0]
    x, w = head.args[:2]
    with gm.graph.inserting_before(ce):
        if head.target is C.gathered_linear:
            dim, group, size, rank, full = head.args[2:7]
            x = gm.graph.call_function(C.all_gather, (x, dim, group, size, rank, full, True))
            _copy_meta(x, ce)
        hidden = _flatten(gm, x, ce)
        fused = gm.graph.call_function(vocab_parallel_linear_cross_entropy,
                                       (hidden, w, a["target"], a["group"], a["size"], a["rank"], a["start"],
                                        a["vocab"], a["reduction"], a["ignore_index"], chunk))
    _replace(gm, ce, fused, chain)


def _head_chain(logits) -> list[Node] | None:
    """[linear, view, ..., view] ending at ``logits``, each used only by the next; else None."""
    chain = []
    node = logits
    while isinstance(node, Node) and node.op == "call_function" and node.target in _VIEWS:
        chain.append(node)
        node = node.args[0]
    if not isinstance(node, Node) or node.target not in (aten.linear.default, C.gathered_linear):
        return None
    if node.target is aten.linear.default and len(node.args) > 2 and node.args[2] is not None:
        return None
    chain.append(node)
    chain.reverse()
    if any(len(n.users) != 1 for n in chain):
        return None
    return chain


def _width(linear: Node) -> int | None:
    """Output width of a linear, from the traced shapes of its output or its weight."""
    val = linear.meta.get("val")
    if val is None:
        val = getattr(linear.args[1], "meta", {}).get("val")
        return None if val is None else int(val.shape[0])
    return int(val.shape[-1])


def _final_width(logits: Node) -> int | None:
    """Last dim of the 2-D logits fed to the loss, from traced shapes or a concrete view shape."""
    val = logits.meta.get("val")
    if val is not None:
        return int(val.shape[-1]) if val.dim() == 2 else None
    if logits.target in _VIEWS:
        shape = logits.args[1]
        if len(shape) == 2 and isinstance(shape[-1], int) and shape[-1] >= 0:
            return shape[-1]
        return None
    return _width(logits)


def _flatten(gm: GraphModule, x: Node, like: Node) -> Node:
    node = gm.graph.call_function(aten.flatten.using_ints, (x, 0, -2))
    _copy_meta(node, like)
    return node


def _copy_meta(node: Node, like: Node) -> None:
    for key in ("module_path", "origin", "nn_module_stack"):
        if key in like.meta:
            node.meta[key] = like.meta[key]


def _replace(gm: GraphModule, ce: Node, fused: Node, chain: list[Node]) -> None:
    _copy_meta(fused, ce)
    if "val" in ce.meta:
        fused.meta["val"] = ce.meta["val"]
    ce.replace_all_uses_with(fused)
    gm.graph.erase_node(ce)
    for node in reversed(chain):
        gm.graph.erase_node(node)
