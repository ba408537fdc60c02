"""Capture a model with many identical layers by tracing a few of them and repeating.

torch.export costs time in proportion to the ops it traces: about 5 s of GPT-3 175B's
96 layers on a CPU, which dominates planning. The layers of a GPT are identical modules
in one ``nn.ModuleList`` and the forward calls them in order, so the graph of L layers is
the graph of two layers with the second layer's nodes repeated L - 2 more times, each copy
reading the previous copy where the template reads the first layer and its own layer's
parameters where the template reads the second layer's.

That is an assumption about the forward (it does not depend on the layer count or the
layer index), so it is checked: the model is traced with 2 and with 3 layers, the 2-layer
graph is repeated to 3, and the result must equal the 3-layer trace node for node (op,
arguments, module path, parameter, shape, dtype). Otherwise the full model is traced.
Both routes end in the same names (``canonical_names``), so a plan made on one runs on
the other.
"""
from __future__ import annotations

import re
from contextlib import contextmanager
from dataclasses import replace

import torch
from torch.fx import Graph, Node, map_arg

MIN_LAYERS = 6   # below this, tracing 2 + 3 layers saves too little to be worth the check


def repeated_layers(model: torch.nn.Module) -> tuple[str, int] | None:
    """(FQN, count) of the longest ``nn.ModuleList`` of structurally identical modules."""
    best = None
    for fqn, mod in model.named_modules():
        if isinstance(mod, torch.nn.ModuleList) and len(mod) >= MIN_LAYERS and fqn:
            first = _structure(mod[0])
            if all(_structure(m) == first for m in mod) and (best is None or len(mod) > best[1]):
                best = (fqn, len(mod))
    return best


def _structure(module: torch.nn.Module):
    mods = tuple((n, type(m).__qualname__, m.extra_repr(), m.training) for n, m in module.named_modules())
    tensors = tuple((n, tuple(t.shape), t.dtype, t.requires_grad)
                    for n, t in [*module.named_parameters(), *module.named_buffers()])
    return mods, tensors


@contextmanager
def _first_layers(model: torch.nn.Module, fqn: str, k: int):
    parent_name, _, name = fqn.rpartition(".")
    parent = model.get_submodule(parent_name)
    full = parent._modules[name]
    parent._modules[name] = torch.nn.ModuleList(list(full)[:k])
    try:
        yield
    finally:
        parent._modules[name] = full


def capture_repeated(model: torch.nn.Module, example_inputs: tuple, capture):
    """``capture(model, inputs)`` of the whole model, built from 2- and 3-layer traces, or None
    when the model has no long run of identical layers or the repetition check fails."""
    found = repeated_layers(model)
    if found is None:
        return None
    fqn, n = found
    with _first_layers(model, fqn, 2):
        two = capture(model, example_inputs)
    with _first_layers(model, fqn, 3):
        three = canonical_names(capture(model, example_inputs))
    try:
        grown = _repeat(two.copy(), fqn, 3)
    except ValueError:
        return None
    if _signature(grown.gm.graph) != _signature(three.gm.graph):
        return None
    return replace(_repeat(two, fqn, n), excerpt=three)


def _layer_of(prefix: str, node: Node) -> int | None:
    path = (node.meta.get("fqn") if node.op == "placeholder" else node.meta.get("module_path")) or ""
    if not path.startswith(prefix):
        return None
    head = path[len(prefix):].split(".", 1)[0]
    return int(head) if head.isdigit() else None


def _in_layer(text: str, fqn: str, old: int, new: int) -> str:
    """``text`` (an FQN or module path inside layer ``old``) moved to layer ``new``."""
    head = f"{fqn}.{old}"
    if text == head or text.startswith(head + "."):
        return f"{fqn}.{new}" + text[len(head):]
    return text


def _repeat(cap, fqn: str, n: int):
    """The 2-layer capture ``cap`` grown to ``n`` layers."""
    g = cap.gm.graph
    original = list(g.nodes)
    where = {node: _layer_of(fqn + ".", node) for node in original}
    layer = {i: [nd for nd in original if where[nd] == i and nd.op == "call_function"] for i in (0, 1)}
    if [t.target for t in layer[0]] != [t.target for t in layer[1]] or not layer[1]:
        raise ValueError("the two traced layers differ")
    previous = dict(zip(layer[1], layer[0]))   # a template node -> its twin in the layer before
    own_inputs = [nd for nd in original if nd.op == "placeholder" and where[nd] == 1]
    anchor = own_inputs[-1] if own_inputs else None
    last = layer[1][-1]
    latest = {t: t for t in layer[1]}          # a template node -> its copy in the newest layer
    for i in range(2, n):
        env: dict[Node, Node] = {}
        for ph in own_inputs:
            new_fqn = _in_layer(ph.meta["fqn"], fqn, 1, i)
            old_tail, new_tail = ph.meta["fqn"].replace(".", "_"), new_fqn.replace(".", "_")
            with g.inserting_after(anchor):
                new = g.placeholder(ph.name[:-len(old_tail)] + new_tail if ph.name.endswith(old_tail)
                                    else f"{ph.name}_{i}")
            new.meta = {**ph.meta, "fqn": new_fqn}
            (cap.params if ph.meta.get("kind") == "param" else cap.buffers)[new_fqn] = new
            env[ph] = anchor = new
        back = {previous[t]: latest[t] for t in layer[1]}

        def arg(a: Node) -> Node:
            return env.get(a) or back.get(a) or a

        for t in layer[1]:
            with g.inserting_after(last):
                copy = g.create_node(t.op, t.target, map_arg(t.args, arg), map_arg(t.kwargs, arg), t.name, t.type)
            copy.meta = {**t.meta, "module_path": _in_layer(t.meta.get("module_path", ""), fqn, 1, i)}
            env[t] = last = copy
        latest = {t: env[t] for t in layer[1]}

    def after(a: Node) -> Node:
        return latest[a] if where.get(a) == 1 and a in latest else a

    for node in original:
        if where[node] is None and node.op != "placeholder":
            node.args, node.kwargs = map_arg(node.args, after), map_arg(node.kwargs, after)
    return canonical_names(cap)


_SUFFIX = re.compile(r"_\d+$")


def canonical_names(cap):
    """``cap`` with every op node named by its kind and rank in graph order (``linear``,
    ``linear_1``, ...), so a graph built by any route names its nodes the same way."""
    counts: dict[str, int] = {}

    def name_of(node: Node) -> str:
        if node.op in ("placeholder", "output"):
            return node.name
        base = _SUFFIX.sub("", node.name)
        k = counts.get(base, 0)
        counts[base] = k + 1
        return base if k == 0 else f"{base}_{k}"

    return cap.remapped(name_of)


def _signature(g: Graph):
    index = {nd: k for k, nd in enumerate(g.nodes)}

    def norm(a):
        return ("node", index[a]) if isinstance(a, Node) else a

    out = []
    for nd in g.nodes:
        val = nd.meta.get("val")
        shape = (tuple(val.shape), val.dtype) if isinstance(val, torch.Tensor) else None
        out.append((nd.name, nd.op, str(nd.target), nd.meta.get("module_path"), nd.meta.get("fqn"),
                    nd.meta.get("kind"), shape, repr(map_arg(nd.args, norm)), repr(map_arg(nd.kwargs, norm))))
    return out
