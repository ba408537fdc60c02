"""The float8 graph pass: every linear call of a graph rewritten into ``autopar.fp8.fp8_linear``, and
the torch.compile backend that runs it (``fp8_backend``).

``autopar.fp8`` has the recipe and the float8 linear itself; ``swap_linears`` there is the
module-level way in, for a plain model.
"""
from __future__ import annotations

import functools
import itertools

import torch
import torch.nn.functional as F
from torch.fx import GraphModule, Node

from autopar.fp8 import check_fp8_dtypes, fp8_linear
from autopar.graph.capture import copy_graph
from autopar.passes.driver import rank_prefix, run_passes

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


# ---- the torch.compile backend -----------------------------------------------------------------

def fp8_backend(inner="inductor", *, keep_head: bool = True, emulate: bool = False):
    """A torch.compile backend: ``fp8_linear_pass`` on the graph (through the pass
    driver), then ``inner`` (a backend name or callable). The pass's counts are also written to the
    ``meta["fp8_linears"]`` of the graph Dynamo hands in.

    ``inner`` may be another backend of this project, e.g. ``autopar.overlap.overlap_backend()``."""
    check_fp8_dtypes()
    if isinstance(inner, str):
        from torch._dynamo import lookup_backend
        inner = lookup_backend(inner)
    if not callable(inner):
        raise TypeError(f"inner={inner!r}: expected a torch.compile backend name or callable")
    return functools.partial(_fp8_compile, inner=inner, keep_head=keep_head, emulate=emulate)


_compiled_graphs = itertools.count()   # graphs fp8_backend has rewritten in this process


def _fp8_compile(gm, example_inputs, *, inner, keep_head, emulate):
    # AUTOPAR_DUMP file names: a process compiles a graph per stage and per graph break
    out, _ = run_passes(gm, [(fp8_linear_pass, {"keep_head": keep_head, "emulate": emulate})],
                        prefix=rank_prefix(f"fp8-graph{next(_compiled_graphs)}"))
    gm.meta["fp8_linears"] = out.meta["fp8_linears"]   # reported on Dynamo's graph too, for a wrapping backend
    return inner(out, example_inputs)
