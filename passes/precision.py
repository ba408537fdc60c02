"""The precision pass: 16-bit compute on a graph captured at fp32 (``autopar.runtime.precision`` has the
recipe and the runtime's side of it: working copies, the working copy's bytes, loss scaling;
``autopar.graph.precision`` the planner's view of this rewrite, ``retype_pass``).

``precision_pass`` casts floating inputs and buffers to the compute dtype where first used, except
by the ops that compute tables from buffers (rotary cos/sin), which run at the dtype they were
traced at; loss ops (cross-entropy and the like) take fp32 inputs, and the graph returns an fp32 loss.
"""
from __future__ import annotations

import torch
from torch.fx import GraphModule, Node

from autopar import collectives as C
from autopar.graph.capture import copy_graph
from autopar.graph.precision import LOSS_OPS, cast, compute_dtype, tables


def precision_pass(gm: GraphModule, *, precision: str, floats: set[str],
                   stage_of: dict[str, int] | None = None) -> GraphModule:
    """Casts for ``precision``: floating inputs (``floats``) to the compute dtype where first used, loss ops in fp32.

    ``stage_of`` (global node name -> pipeline stage) gives each stage that uses an input its own cast."""
    dtype = compute_dtype(precision)
    out = copy_graph(gm)
    g = out.graph
    inputs = {n for n in g.nodes if n.op == "placeholder" and n.name in floats}
    made_from_buffers = tables(g)
    casts: dict[tuple, Node] = {}

    def origin(n: Node) -> str:
        return n.meta.get("origin", n.name)

    def from_input(n: Node) -> bool:
        while n.op == "call_function" and n.target in C.COLLECTIVE_FUNCTIONS:
            n = n.args[0]
        return n in inputs

    def cast_before(user: Node, value: Node, to: torch.dtype, key: tuple) -> None:
        if key not in casts:
            with g.inserting_before(user):
                c = g.call_function(cast, (value, to))
            c.meta.update(origin=origin(user), module_path=user.meta.get("module_path", ""))
            casts[key] = c
        user.replace_input_with(value, casts[key])

    for node in list(g.nodes):
        if node.op == "output":
            for value in node.all_input_nodes:
                cast_before(node, value, torch.float32, (value, node))
        if node.op != "call_function" or node.target in C.COLLECTIVE_FUNCTIONS:
            continue
        for value in node.all_input_nodes:
            if node.target in LOSS_OPS:
                cast_before(node, value, torch.float32, (value, node))
            elif node not in made_from_buffers and (from_input(value) or value in made_from_buffers):
                # one cast per pipeline stage that uses the value (``cast`` leaves non-floats alone);
                # an op computing a table takes its inputs uncast (see ``graph.precision.tables``)
                cast_before(node, value, dtype, (value, stage_of.get(origin(node)) if stage_of else None))
    g.lint()
    out.recompile()
    return out
