"""The tensor-parallel rewrite: one rank's local graph from the global graph and its strategies.

Every node of the local graph records in ``meta["origin"]`` the global node it serves (a
collective inserted for an input belongs to its consumer), so later passes such as the
pipeline split can place it."""
from __future__ import annotations

import torch
from torch.fx import Graph, GraphModule, Node
from torch.fx.node import map_arg

from autopar import collectives as C
from autopar import ops
from autopar.graph.reshard import regather_candidate, reshard_steps
from autopar.graph.rules import Strategy, is_float, shape
from autopar.placement import R, Shard, local_shape, padded_size

aten = torch.ops.aten
_RESHAPES = {aten.view.default, aten.reshape.default, aten._unsafe_view.default, aten.expand.default}
_SPLITS = {aten.split.Tensor, aten.split_with_sizes.default}


class _Rank:
    def __init__(self, size: int, rank: int, group: str):
        self.size, self.rank, self.group = size, rank, group


def shard_pass(gm: GraphModule, *, strategies: dict[Node, Strategy], size: int, rank: int,
               group: str) -> GraphModule:
    """Rewrite ``gm`` into rank ``rank``'s local program on a tp axis of ``size`` ranks."""
    me = _Rank(size, rank, group)
    g = Graph()
    env: dict[Node, Node] = {}
    moved: dict[tuple, Node] = {}

    def fetch(node: Node, dst, divergent: bool) -> Node:
        key = (node, dst, divergent)
        if key not in moved:
            x, src = env[node], strategies[node].output
            for step, after in reshard_steps(src, dst, divergent):
                x = _emit_step(g, step, x, src, after, shape(node), me)
                src = after
            moved[key] = x
        return moved[key]

    for node in gm.graph.nodes:
        if node.op == "placeholder":
            env[node] = g.placeholder(node.name)
            env[node].meta.update({k: v for k, v in node.meta.items() if k in ("fqn", "kind", "module_path")})
        elif node.op == "output":
            out = node.args[0]
            g.output(map_arg(out, lambda n: fetch(n, R, False)))
        elif node.op == "call_function" and _regathered(node, strategies):
            x, w = node.args[:2]
            src = strategies[x].output
            env[node] = g.call_function(C.gathered_linear, (env[x], fetch(w, strategies[node].inputs[1], False),
                                                            src.dim, me.group, me.size, me.rank, shape(x)[src.dim]))
            env[node].meta["module_path"] = node.meta.get("module_path", "")
        elif node.op == "call_function":
            s = strategies[node]
            local = {i: fetch(i, s.inputs[k], s.divergent(k) and is_float(i))
                     for k, i in enumerate(node.all_input_nodes)}
            args = map_arg(node.args, local.__getitem__)
            kwargs = map_arg(node.kwargs, local.__getitem__)
            target, args, kwargs = _localize(node, s, args, kwargs, me)
            env[node] = g.call_function(target, tuple(args), dict(kwargs))
            env[node].meta["module_path"] = node.meta.get("module_path", "")
        else:
            raise NotImplementedError(f"autopar: cannot rewrite graph node {node.op} {node.target}")
        for new in reversed(g.nodes):   # this node and the collectives inserted for its inputs
            if "origin" in new.meta:
                break
            new.meta["origin"] = node.name
    out = GraphModule(gm, g)
    out.graph.lint()
    return out


def _regathered(node: Node, strategies) -> bool:
    """A linear told to gather its sequence-sharded input itself (see reshard.regathers)."""
    return node.op == "call_function" and strategies[node].regather and regather_candidate(node, strategies)


def _emit_step(g: Graph, step: str, x: Node, src, dst, full_shape, me: _Rank) -> Node:
    if step == "copy_to":
        return g.call_function(C.copy_to, (x, me.group))
    if step == "all_reduce":
        return g.call_function(C.all_reduce, (x, me.group))
    if step in ("gather", "gather_reduce"):
        full = full_shape[src.dim] // src.interleave
        return g.call_function(C.all_gather, (x, src.dim, me.group, me.size, me.rank, full,
                                              step == "gather_reduce", src.interleave))
    if step == "split":
        return g.call_function(C.split, (x, dst.dim, me.group, me.size, me.rank, dst.interleave))
    if step == "reduce_scatter":
        return g.call_function(C.reduce_scatter, (x, dst.dim, me.group, me.size, dst.interleave))
    raise AssertionError(step)


def _localize(node: Node, s: Strategy, args, kwargs, me: _Rank):
    """The op and arguments that compute this rank's piece of ``node``'s output."""
    target = node.target
    if s.local == "vocab_parallel_embedding":
        rows = padded_size(shape(node.args[0])[0], me.size)
        padding_idx = args[2] if len(args) > 2 else kwargs.get("padding_idx", -1)
        return ops.vocab_parallel_embedding, (args[0], args[1], me.rank * rows, padding_idx), {}
    if s.local == "vocab_parallel_cross_entropy":
        vocab = shape(node.args[0])[1]
        cols = padded_size(vocab, me.size)
        full = dict(zip(("weight", "reduction", "ignore_index", "label_smoothing"), args[2:]))
        full.update(kwargs)
        return ops.vocab_parallel_cross_entropy, (args[0], args[1], me.group, me.size, me.rank, me.rank * cols, vocab,
                                                  full.get("reduction", 1), full.get("ignore_index", -100)), {}
    if target in _RESHAPES:
        args = list(args)
        args[1] = list(local_shape(shape(node), s.output, me.size))
        # export drops a .contiguous() that was a no-op at trace time; a shard's kernels may lay
        # out their outputs differently, so a view may not apply where reshape (a copy then) does
        target = aten.reshape.default if target is aten.view.default else target
    elif target is aten.unflatten.int:   # the sizes a dim splits into are global ones, (n_heads, head_dim)
        args = list(args)
        dim = args[1] % len(shape(node.args[0]))
        args[2] = list(local_shape(shape(node), s.output, me.size)[dim:dim + len(args[2])])
    elif target in _SPLITS and isinstance(s.output, Shard):
        dim = (args[2] if len(args) > 2 else kwargs.get("dim", 0)) % len(shape(node.args[0]))
        if s.output.dim == dim:
            pieces = [local_shape(tuple(v.shape), s.output, me.size)[dim] for v in node.meta["val"]]
            args = list(args)
            args[1] = pieces[0] if target is aten.split.Tensor else pieces
    return target, args, kwargs
