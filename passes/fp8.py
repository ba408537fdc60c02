"""The float8 graph pass: every linear call of a graph rewritten into ``autopar.fp8.fp8_linear``.

``autopar.fp8`` has the recipe, the float8 linear itself and the torch.compile backend that runs
this pass (``fp8_backend``); ``swap_linears`` there is the module-level way in, for a plain model.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch.fx import GraphModule, Node

from autopar.fp8 import fp8_linear
from autopar.passes.driver import copy_graph

# the spellings of a linear: torch.export's aten op, and a Dynamo graph's torch-level calls
_LINEARS = {torch.ops.aten.linear.default, F.linear, torch._C._nn.linear}


def fp8_linear_pass(gm: GraphModule, *, keep_head: bool = True, emulate: bool = False) -> GraphModule:
    """Every linear call of ``gm`` (aten or torch level) rewritten into ``fp8_linear``.

    With ``keep_head`` a linear that no other linear depends on (a GPT's logits projection) stays
    as it was. Counts per outcome land in the result's ``meta["fp8_linears"]``."""
    out = copy_graph(gm)
    nodes = list(out.graph.nodes)
    feeds_linear: set[Node] = set()
    for node in reversed(nodes):
        if any(u.target in _LINEARS or u in feeds_linear for u in node.users):
            feeds_linear.add(node)
    converted = kept = 0
    for node in nodes:
        if node.op != "call_function" or node.target not in _LINEARS:
            continue
        if keep_head and node not in feeds_linear:
            kept += 1
            continue
        args = list(node.args) + [None] * (3 - len(node.args))
        bias = node.kwargs.get("bias", args[2])
        node.target = fp8_linear
        node.args = (args[0], args[1], bias)
        node.kwargs = {"emulate": emulate}
        converted += 1
    out.graph.lint()
    out.recompile()
    out.meta["fp8_linears"] = {"converted": converted, "kept": kept}
    return out
