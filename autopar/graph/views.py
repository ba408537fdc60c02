"""Which values of a graph are views of others: what memory accounting looks through.

A view (``VIEW_OPS``) keeps no storage of its own; ``base_of`` follows views (and a dropout that
drops nothing) to the node whose storage a value is; ``looks_through`` says whether what is kept
of a value is priced as what it views or casts (``CASTS``).
"""
from __future__ import annotations

import operator

import torch
from torch.fx import Node

aten = torch.ops.aten

# ops whose output aliases their input: free to run, and they keep no storage of their own
VIEW_OPS = {aten.view.default, aten.reshape.default, aten._unsafe_view.default, aten.transpose.int,
            aten.permute.default, aten.t.default, aten.split.Tensor, aten.split_with_sizes.default,
            aten.chunk.default, aten.alias.default, aten.expand.default, aten.slice.Tensor,
            aten.unsqueeze.default, aten.squeeze.dim, aten.detach.default, aten.select.int, aten.unbind.int,
            aten.unflatten.int, aten.flatten.using_ints, aten.view_as_complex.default, aten.view_as_real.default}


CASTS = {aten._to_copy.default, aten.to.dtype, aten.type_as.default}



_VIEWS_OR_ITEM = VIEW_OPS | {operator.getitem}


def base_of(node: Node) -> Node:
    """The node whose storage ``node`` views (a dropout that drops nothing is its input)."""
    while node.op == "call_function" and (node.target in _VIEWS_OR_ITEM
                                          or node.target is aten.dropout.default and not drops(node)):
        node = node.args[0]
    return node


def looks_through(node: Node) -> bool:
    """Whether what is kept of ``node`` is priced as what it views or casts (``base_of``, ``_graph_input``)."""
    return node.op == "call_function" and (base_of(node) is not node or node.target in CASTS)


def drops(node: Node) -> bool:
    """Whether a dropout node drops anything (p > 0 in training)."""
    return dropout_p(node) > 0 and len(node.args) > 2 and bool(node.args[2])


def dropout_p(node: Node) -> float:
    """A dropout node's p."""
    return float(node.args[1]) if len(node.args) > 1 else 0.5
