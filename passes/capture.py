"""Capture: torch.export's training IR of a model, ready for planning.

The captured graph keeps high-level ops (aten.linear, layer_norm, sdpa, embedding,
cross_entropy_loss, views): sharding decisions are made on those, before any
decomposition. Every node carries ``meta["module_path"]`` (plans speak in module
names), parameter placeholders carry ``meta["fqn"]``, and weights tied to several
FQNs (GPT's wte / lm_head) become one placeholder, so one tensor gets one
placement and its gradient sums every use.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch.export.graph_signature import InputKind
from torch.fx import GraphModule, Node

aten = torch.ops.aten


@dataclass
class Captured:
    """A captured model: its graph and how the placeholders map to the model."""

    gm: GraphModule
    params: dict[str, Node]                  # canonical FQN -> placeholder
    aliases: dict[str, list[str]]            # canonical FQN -> other FQNs of the same tensor
    inputs: list[Node]                       # user input placeholders, in call order
    buffers: dict[str, Node] = field(default_factory=dict)
    loss: Node | None = None

    def param_of(self, node: Node) -> str | None:
        return node.meta.get("fqn") if node.op == "placeholder" and node.meta.get("kind") == "param" else None


def _module_path(node: Node) -> str:
    stack = node.meta.get("nn_module_stack")
    if not stack:
        return ""
    path = list(stack.values())[-1][0]
    # strict-mode traces spell paths as L['self'].a.b; plans want a.b
    return path.replace("L['self'].", "").replace("L['self']", "")


def capture_pass(model: torch.nn.Module, example_inputs: tuple) -> Captured:
    """Export ``model(*example_inputs)`` to an FX graph annotated for planning."""
    with torch.no_grad():
        ep = torch.export.export(model, tuple(example_inputs), strict=False)
    gm = ep.graph_module
    sig = ep.graph_signature
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    by_name = {n.name: n for n in placeholders}

    # One placeholder per distinct parameter tensor, named by its first FQN.
    canonical: dict[int, str] = {}
    aliases: dict[str, list[str]] = {}
    for fqn, p in model.named_parameters(remove_duplicate=False):
        first = canonical.setdefault(id(p), fqn)
        aliases.setdefault(first, [])
        if first != fqn:
            aliases[first].append(fqn)
    fqn_to_canonical = {a: c for c, al in aliases.items() for a in [c, *al]}

    params: dict[str, Node] = {}
    buffers: dict[str, Node] = {}
    inputs: list[Node] = []
    for spec in sig.input_specs:
        node = by_name[spec.arg.name]
        if spec.kind == InputKind.PARAMETER:
            canon = fqn_to_canonical[spec.target]
            if canon in params:
                node.replace_all_uses_with(params[canon])
                gm.graph.erase_node(node)
                continue
            node.meta.update(fqn=canon, kind="param")
            params[canon] = node
        elif spec.kind == InputKind.BUFFER:
            node.meta.update(fqn=spec.target, kind="buffer")
            buffers[spec.target] = node
        elif spec.kind == InputKind.USER_INPUT:
            node.meta["kind"] = "input"
            inputs.append(node)
        else:
            raise NotImplementedError(f"autopar: unsupported graph input {spec.kind} ({spec.target})")

    for node in gm.graph.nodes:
        node.meta["module_path"] = _module_path(node)
    _split_linear_bias(gm)
    gm.graph.lint()
    gm.recompile()
    out = next(n for n in gm.graph.nodes if n.op == "output")
    loss = out.args[0][0] if isinstance(out.args[0], (tuple, list)) else out.args[0]
    return Captured(gm, params, {k: v for k, v in aliases.items() if v}, inputs, buffers, loss)


def _split_linear_bias(gm: GraphModule) -> None:
    """linear(x, w, b) -> add(linear(x, w), b), so a row-parallel linear can sum before its bias."""
    for node in list(gm.graph.nodes):
        if node.target is aten.linear.default and len(node.args) > 2 and node.args[2] is not None:
            x, w, b = node.args[:3]
            with gm.graph.inserting_after(node):
                add = gm.graph.call_function(aten.add.Tensor, (node, b))
            node.replace_all_uses_with(add, delete_user_cb=lambda u: u is not add)
            node.args = (x, w)
            add.meta.update(val=node.meta["val"], module_path=node.meta.get("module_path", ""),
                            nn_module_stack=node.meta.get("nn_module_stack"))
