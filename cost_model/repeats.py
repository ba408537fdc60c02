"""Runs of repeated blocks priced as the same run further up the graph.

A GPT is L identical blocks, and a pipeline stage in the middle of it is a run of them. What the
memory model prices for a run (``memory.stage_terms``, ``activations.compiled_kept``) reads only the
run's nodes, the nodes they read and the strategies of both: a run of n blocks from block a >= 2
reads what the run of n blocks from block 1 reads, shifted by a - 1 blocks (block a - 1's outputs
where block 0's are read; a node outside the blocks is the same node for both). Where the blocks
are the same ops on the same arguments (``block_shift``, once per capture) and the strategies of
blocks a - 1 .. a + n - 1 equal those of blocks 0 .. n (``shifted``, per question), every figure
of the run at a is the run at 1's, node for node, so the memo (``cost_model.memo``) keeps one
answer per run length, recompute regions and strategies instead of one per stage cut.

The first run (block 0 reads the embedding's outputs) and a run with the embedding or the head
are asked as they are: they are one per length already.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
from torch.fx import Node

from autopar.graph.capture import graph_cached
from autopar.graph.units import find_blocks
from autopar.graph.views import looks_through

from .memo import cached, strategies_of


@dataclass(frozen=True)
class BlockShift:
    """The repeated blocks of a capture laid out flat: ``nodes`` every block's nodes (its parameters
    and ops, ``find_blocks`` order), ``calls`` every block's ops, ``size`` and ``ops`` their counts per
    block, and ``call_at`` each op's position in ``calls``."""

    nodes: tuple
    calls: tuple
    size: int
    ops: int
    call_at: dict


@graph_cached
def block_shift(cap) -> BlockShift | None:
    """The capture's blocks when a run of them may be priced as the run shifted to block 1: each
    block from block 1 on is block 1 with its nodes shifted (same op, target, metadata and
    arguments, a node of its own block or of the one before it where block 1 reads block 1's or
    block 0's, and any other node the same one), its parameters used in it alone, and what it
    reads of the block before it a tensor of its own, not a view or cast (the memory model looks
    through those to what they read, which a shift would not map). None otherwise."""

    blocks = find_blocks(cap)
    if not blocks or len(blocks) < 3 or len({len(b) for b in blocks}) != 1:
        return None
    where = {n: (k, i) for k, b in enumerate(blocks) for i, n in enumerate(b)}

    def shape_of(val):
        """A traced value as the memory model reads it: shapes and dtypes, or the value itself."""
        if isinstance(val, torch.Tensor):
            return tuple(val.shape), val.dtype
        if isinstance(val, (list, tuple)):
            return tuple(map(shape_of, val))
        return type(val), val

    def read(node: Node):
        """What is read of a node besides its arguments (a placeholder's target is its own name)."""
        target = node.target if node.op == "call_function" else None
        return node.op, target, node.meta.get("kind"), shape_of(node.meta.get("val"))

    def form(node: Node, k: int):
        """``node`` with its references to block k and k - 1 written relative to k."""
        def ref(a: Node):
            """``a`` as block k reads it; LookupError where a shift would not map it."""
            at = where.get(a)
            if at is None:
                return a
            if at[0] == k:
                return ("own", at[1])
            if at[0] == k - 1 and a.op != "placeholder":
                if looks_through(a):
                    raise LookupError
                return ("before", at[1])
            raise LookupError
        args = torch.fx.node.map_arg((node.args, node.kwargs), ref)
        users = node.op == "placeholder" and any(where.get(u, (None,))[0] != k for u in node.users)
        return (*read(node), args, users)

    try:
        first = [form(n, 1) for n in blocks[1]]
        if any(f[-1] for f in first) or any([form(n, k) for n in blocks[k]] != first for k in range(2, len(blocks))):
            return None
    except LookupError:
        return None
    if list(map(read, blocks[0])) != list(map(read, blocks[1])):
        return None
    nodes = tuple(n for b in blocks for n in b)
    calls = tuple(n for n in nodes if n.op == "call_function")
    ops = len(calls) // len(blocks)
    _twins(calls[0].graph).update((n, calls[ops + i % ops]) for i, n in enumerate(calls) if i >= 2 * ops)
    return BlockShift(nodes, calls, len(blocks[0]), ops, {n: i for i, n in enumerate(calls)})


def twin(node: Node) -> Node:
    """The op of block 1 that ``node``, an op of block 2 on, is shifted from, once ``block_shift`` has
    laid out its capture's blocks; else ``node``. The twins read the same op on arguments of the same
    shapes and dtypes (``block_shift``), so what is read off one op alone, its time under a strategy,
    is its twin's: priced once for all the blocks."""
    return _twins(node.graph).get(node, node)


def _twins(graph) -> dict:
    """{op of block 2 on: its twin in block 1} of ``graph``'s capture, empty until ``block_shift`` fills it."""
    return cached(graph, ("twins",), dict)


def shifted(cap, strategies: dict, nodes: tuple, regions: tuple = ()):
    """(the ops of the run at block 1, its ``regions`` (tuples of nodes), the offset from a node's
    position in ``block_shift(cap).calls`` to its twin's in ``nodes``, for ``back``) when ``nodes``
    (ops in graph order) are the ops of a run of whole blocks from block 2 on whose figures are that
    run's (the module docstring); None when they are not, or when they are the run at block 1."""
    shift = block_shift(cap)
    if shift is None or not nodes:
        return None
    at, ops, size = shift.call_at, shift.ops, shift.size
    start = at.get(nodes[0])
    if start is None or start % ops or start < 2 * ops or len(nodes) % ops:
        return None
    if shift.calls[start:start + len(nodes)] != nodes:
        return None
    a, n = start // ops, len(nodes) // ops
    if strategies_of(strategies, shift.nodes[(a - 1) * size:(a + n) * size]) != \
            strategies_of(strategies, shift.nodes[:(n + 1) * size]):
        return None
    offset, moved = start - ops, []
    for region in regions:
        pos = list(map(at.get, region))   # None for a node outside the blocks
        if pos and (None in pos or min(pos) < start or max(pos) >= start + len(nodes)):
            return None
        moved.append(tuple(map(shift.calls.__getitem__, map(offset.__rsub__, pos))))
    return shift.calls[ops:ops + len(nodes)], tuple(moved), offset


def back(cap, pairs, offset: int) -> list:
    """``pairs`` ((node, figure) of the run at block 1) with each node the twin in the run that
    ``shifted`` moved there by ``offset``."""
    if not pairs:
        return []
    shift = block_shift(cap)
    nodes, figures = zip(*pairs)
    return list(zip(map(shift.calls.__getitem__, map(offset.__add__, map(shift.call_at.__getitem__, nodes))), figures))
