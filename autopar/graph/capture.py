"""Capture: torch.export's training IR of a model, ready for planning.

The captured graph keeps high-level ops (aten.linear, layer_norm, sdpa, embedding,
cross_entropy_loss, views): sharding decisions are made on those, before any
decomposition. Every node carries ``meta["module_path"]`` (plans speak in module
names), parameter placeholders carry ``meta["fqn"]``, and weights tied to several
FQNs (GPT's wte / lm_head) become one placeholder, so one tensor gets one
placement and its gradient sums every use.

A few rewrites make library models (Hugging Face GPT-2, Llama) look like that too:
code export wrapped in a submodule (under ``torch.no_grad()`` or a disabled autocast)
is inlined; ``addmm(b, x, w)`` (GPT-2's Conv1D) becomes ``add(mm(x, w), b)`` as linear
biases do; ``_assert_tensor_metadata`` checks and casts that change nothing go; an attention
mask proven to be the causal pattern becomes sdpa's ``is_causal=True`` (``graph.causal_mask``:
flash attention, no (s x s) mask); and values that depend on no input and no parameter
(position ids, a mask that stays, rotary tables) are recomputed inside every layer that
uses them, so the layers stay identical and pipeline stages never send them.

Tensors the forward creates from data (``torch.tensor(0.5)``) are lifted by torch.export as
constant inputs. They are captured as buffers (``kind`` "buffer": replicated, priced and split
like any buffer), with their values in ``Captured.constants`` for the runtime to feed. A
Hugging Face forward called without ``use_cache=False`` builds a KV cache from empty constants
concatenated with each layer's keys and values; those concatenations change nothing and are
removed (with a warning), so no cache tensor reaches the plan. The forward must return the
scalar loss: planning refuses anything else here (``require_loss``), before it starts.
"""
from __future__ import annotations

import copy
import functools
import inspect
import re
import warnings
import weakref
from dataclasses import dataclass, field, replace

import torch
from torch.export.graph_signature import InputKind
from torch.fx import Graph, GraphModule, Node, map_arg
from torch.fx._lazy_graph_module import _LazyGraphModule

from autopar.graph.causal_mask import causal_mask_pass

aten = torch.ops.aten


@dataclass
class Captured:
    """A captured model: its graph and how the placeholders map to the model."""

    gm: GraphModule
    params: dict[str, Node]                  # canonical FQN -> placeholder
    aliases: dict[str, list[str]]            # canonical FQN -> other FQNs of the same tensor
    inputs: list[Node]                       # user input placeholders, in call order
    buffers: dict[str, Node] = field(default_factory=dict)   # buffers and lifted constants
    loss: Node | None = None
    constants: dict[str, torch.Tensor] = field(default_factory=dict)   # a lifted constant's FQN -> value
    # of a capture built by repeating layers (graph.block_capture): the model's trace with only its
    # first three repeated layers, whose graph this one's repeats node for node; a check whose verdict
    # depends only on each node's op, arguments and shape (cp's, ``passes.context_parallel``) runs on it
    excerpt: Captured | None = field(default=None, compare=False, repr=False)

    def with_graph(self, gm: GraphModule) -> Captured:
        """This capture on ``gm``, a rewrite of its graph (a pass's output) that keeps the names of
        its placeholders and loss; the capture itself is left as it is."""
        by_name = {n.name: n for n in gm.graph.nodes}
        return replace(self, gm=gm, params={f: by_name[n.name] for f, n in self.params.items()},
                       buffers={f: by_name[n.name] for f, n in self.buffers.items()},
                       inputs=[by_name[n.name] for n in self.inputs],
                       loss=by_name[self.loss.name] if self.loss is not None else None)

    def remapped(self, name_of) -> Captured:
        """This capture on a copy of its graph whose nodes are named by ``name_of(node)``."""
        g = Graph()
        env: dict[Node, Node] = {}
        for node in self.gm.graph.nodes:
            env[node] = g.create_node(node.op, node.target, map_arg(node.args, env.__getitem__),
                                      map_arg(node.kwargs, env.__getitem__), name_of(node), node.type)
            env[node].meta = dict(node.meta)
        # its Python code is generated when first run or read, not here (as driver.copy_graph's lazy
        # copies): the planner only reads the graph, and an 80-layer model's code takes about 0.5 s
        gm = _LazyGraphModule(self.gm, g)
        in_order = [nd for nd in self.gm.graph.nodes if nd.op == "placeholder"]   # the order export gives them
        params, buffers = set(self.params.values()), set(self.buffers.values())
        return replace(self, gm=gm,
                       params={nd.meta["fqn"]: env[nd] for nd in in_order if nd in params},
                       buffers={nd.meta["fqn"]: env[nd] for nd in in_order if nd in buffers},
                       inputs=[env[i] for i in self.inputs],
                       loss=env[self.loss] if self.loss is not None else None,
                       aliases={k: list(v) for k, v in self.aliases.items()}, constants=dict(self.constants))

    def copy(self) -> Captured:
        """This capture on a graph of its own (passes that grow a graph in place get this)."""
        return self.remapped(lambda node: node.name)

    def param_of(self, node: Node) -> str | None:
        return node.meta.get("fqn") if node.op == "placeholder" and node.meta.get("kind") == "param" else None

    def constant_tensors(self, device) -> dict[str, torch.Tensor]:
        """The lifted constants' values on ``device``, to feed their placeholders as buffers are fed.

        Raises ValueError for a constant made on the meta device: its value was never computed."""
        meta = [fqn for fqn, t in self.constants.items() if t.is_meta]
        if meta:
            raise ValueError(f"the forward creates the constant tensor(s) {', '.join(meta)} on the meta device, so "
                             "their values are unknown: build the model on a real device to train it, or create "
                             "them on the CPU (torch.tensor(..., device='cpu'))")
        return {fqn: t.to(device) for fqn, t in self.constants.items()}


def copy_graph(gm: GraphModule, *, lazy: bool = False) -> GraphModule:
    """A GraphModule on a copy of ``gm``'s graph, for a pass to rewrite.

    Its nodes are new (each with a shallow copy of its ``meta``, so setting a key on one leaves
    ``gm``'s node alone), its submodules and attributes are ``gm``'s own (a pass adds or replaces
    them, never edits them in place), and its ``meta`` is a shallow copy of ``gm.meta``. With
    ``lazy`` its Python code is generated when it is first run or read, not at each recompile: for
    a graph that is mostly only read (generating a large model's code takes seconds)."""
    out = (_LazyGraphModule if lazy else GraphModule)(gm, copy.deepcopy(gm.graph))
    out.meta.update(gm.meta)
    return out


def _module_path(node: Node) -> str:
    stack = node.meta.get("nn_module_stack")
    if not stack:
        return ""
    path = list(stack.values())[-1][0]
    # strict-mode traces spell paths as L['self'].a.b; plans want a.b
    return path.replace("L['self'].", "").replace("L['self']", "")


def example_args(model: torch.nn.Module, example_inputs) -> tuple:
    """``example_inputs`` as the tuple of positional inputs ``model``'s forward is called with: a lone
    tensor is a one-input tuple, a list a tuple. Raises ValueError, saying what forward takes and how
    to pass it, when their number does not fit forward's signature (rather than export's "too many
    positional arguments" from deep inside)."""
    if isinstance(example_inputs, torch.Tensor):
        args = (example_inputs,)
    elif isinstance(example_inputs, (tuple, list)):
        args = tuple(example_inputs)
    else:
        raise TypeError(f"example_inputs is a {type(example_inputs).__name__}; pass the forward's inputs as a tuple, "
                        "e.g. example_inputs=(idx, targets)")
    try:
        params = list(inspect.signature(model.forward).parameters.values())
    except (TypeError, ValueError):   # a forward without a signature Python can read: export will tell
        return args
    positional = [p for p in params if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    required = [p for p in positional if p.default is p.empty]
    unbounded = any(p.kind is p.VAR_POSITIONAL for p in params)
    if len(required) <= len(args) and (unbounded or len(args) <= len(positional)):
        return args
    takes = (f"{len(required)}" if len(required) == len(positional) else
             f"{len(required)} to {len(positional)}") + (" inputs" if len(positional) != 1 else " input")
    names = [p.name for p in (required if len(args) < len(required) else positional)]
    spelled = ", ".join(p.name if p.default is p.empty else f"{p.name}={p.default!r}" for p in positional)
    raise ValueError(f"{type(model).__name__}.forward({spelled}) takes {takes} but example_inputs gives "
                     f"{len(args)}: pass example_inputs=({', '.join(names)}{',' * (len(names) == 1)}), a tuple "
                     "with one value per input of forward")


def capture_pass(model: torch.nn.Module, example_inputs: tuple, dynamic_shapes=None, *,
                 require_loss: bool = False) -> Captured:
    """Export ``model(*example_inputs)`` to an FX graph annotated for planning (a long run of
    identical layers is traced as 2 and 3 layers and repeated: ``graph.block_capture``).

    ``dynamic_shapes`` (torch.export's) keeps sizes symbolic in ``meta["val"]`` and traces the
    whole model; the graph is otherwise the static one (``_fold_sizes``). ``require_loss``: raise
    ValueError, saying what to return, unless the forward returns one scalar (the training loss)."""
    from autopar.graph.block_capture import canonical_names, capture_repeated
    from autopar.graph.capture_cache import cached_capture, structure_key

    example_inputs = example_args(model, example_inputs)
    if any(p.is_meta for p in model.parameters()):   # a model built on meta traces with meta inputs
        example_inputs = tuple(x.to("meta") if isinstance(x, torch.Tensor) else x for x in example_inputs)
    if dynamic_shapes is not None:
        return canonical_names(_export(model, example_inputs, dynamic_shapes, require_loss=require_loss))

    def export(model, example_inputs):
        key = structure_key(model, example_inputs, require_loss=require_loss)
        return cached_capture(key, lambda: _export(model, example_inputs, require_loss=require_loss), Captured.copy)

    cap = capture_repeated(model, example_inputs, export)
    return cap if cap is not None else canonical_names(export(model, example_inputs))


def _export(model: torch.nn.Module, example_inputs: tuple, dynamic_shapes=None, *, require_loss=False) -> Captured:
    with torch.no_grad():
        try:
            ep = torch.export.export(model, tuple(example_inputs), dynamic_shapes=dynamic_shapes, strict=False)
        except RuntimeError as e:   # an output export cannot flatten, such as a whole Hugging Face output
            found = re.search(r"Found <class '([\w.]+)'> in output", str(e))
            if found is None:
                raise
            raise ValueError(_LOSS_HINT.format(what=f"an object holding a {found.group(1)}")) from e
    if require_loss:
        _check_returns_loss(ep)
    gm = ep.graph_module
    if dynamic_shapes is not None:
        _fold_sizes(gm)
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
    constants: dict[str, torch.Tensor] = {}
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
        elif spec.kind in (InputKind.BUFFER, InputKind.CONSTANT_TENSOR):
            node.meta.update(fqn=spec.target, kind="buffer")
            buffers[spec.target] = node
            if spec.kind == InputKind.CONSTANT_TENSOR:
                constants[spec.target] = ep.constants[spec.target]
        elif spec.kind == InputKind.USER_INPUT:
            node.meta["kind"] = "input"
            inputs.append(node)
        else:
            raise NotImplementedError(f"autopar: unsupported graph input {spec.kind} ({spec.target})")

    if _drop_empty_concats(gm):
        for fqn in [f for f in constants if not buffers[f].users]:
            gm.graph.erase_node(buffers.pop(fqn))
            del constants[fqn]
        if any(type(m).__module__.startswith("transformers.") for m in model.modules()):
            warnings.warn("autopar: the Hugging Face model was called without use_cache=False, so its forward "
                          "builds a KV cache; autopar removed the cache from the graph (the loss and gradients "
                          "are unchanged), but pass use_cache=False or wrap the model with "
                          "autopar.hf.causal_lm_loss to trace without it")
    _inline_wrappers(gm)
    for node in gm.graph.nodes:
        node.meta["module_path"] = _module_path(node)
    _drop_assertions(gm)
    _drop_identity_casts(gm)
    _split_linear_bias(gm)
    _split_addmm_bias(gm)
    causal_mask_pass(gm)
    _constants_per_layer(gm)
    gm.graph.lint()
    gm.recompile()
    out = next(n for n in gm.graph.nodes if n.op == "output")
    loss = out.args[0][0] if isinstance(out.args[0], (tuple, list)) else out.args[0]
    return Captured(gm, params, {k: v for k, v in aliases.items() if v}, inputs, buffers, loss, constants)


_LOSS_HINT = ("autopar: the model's forward must return the scalar training loss (e.g. `return "
              "F.cross_entropy(logits.view(-1, V), targets.view(-1))`); it returned {what}; wrap a Hugging "
              "Face model with autopar.hf.causal_lm_loss")


def _check_returns_loss(ep) -> None:
    """Refuse a forward that returns anything but one one-element tensor: backward starts from
    the loss, and a training step could not start from logits, a tuple or a dict."""
    spec = ep.call_spec.out_spec
    if not spec.is_leaf():
        keys = getattr(spec, "context", None)
        what = (f"a {spec.type.__name__} with keys {', '.join(map(repr, keys))}"
                if isinstance(keys, (list, tuple)) and keys else f"a {spec.type.__name__} of {spec.num_leaves} values")
        raise ValueError(_LOSS_HINT.format(what=what))
    out = next(n for n in ep.graph.nodes if n.op == "output").args[0]
    val = out[-1].meta.get("val") if out and isinstance(out[-1], Node) else None
    if not isinstance(val, torch.Tensor):
        raise ValueError(_LOSS_HINT.format(what=f"{type(val).__name__} {val!r}, not a tensor"))
    if val.numel() != 1:
        raise ValueError(_LOSS_HINT.format(what=f"a tensor of shape {list(val.shape)}"))


def _drop_empty_concats(gm: GraphModule) -> bool:
    """Remove the empty 1-D tensors from ``cat`` (which skips them), and the nodes that made them;
    whether any went. A Hugging Face KV cache starts as such tensors, concatenated with each
    layer's keys and values."""
    dropped: list[Node] = []
    for node in list(gm.graph.nodes):
        if node.target is not aten.cat.default:
            continue
        parts = [a for a in node.args[0] if not _empty_1d(a)]
        if len(parts) == len(node.args[0]) or not parts:
            continue
        dropped += [a for a in node.args[0] if a not in parts]
        if len(parts) == 1:
            node.replace_all_uses_with(parts[0])
            gm.graph.erase_node(node)
        else:
            node.args = (parts, *node.args[1:])
    found, erased = bool(dropped), set()
    while dropped:   # back to the placeholders: the copies and detaches that fed only the cat
        node = dropped.pop()
        if node.op == "call_function" and not node.users and node not in erased:
            dropped += node.all_input_nodes
            erased.add(node)
            gm.graph.erase_node(node)
    return found


def _empty_1d(node) -> bool:
    val = node.meta.get("val") if isinstance(node, Node) else None
    return isinstance(val, torch.Tensor) and tuple(val.shape) == (0,)


def _is_size(node) -> bool:
    return (isinstance(node, Node) and node.op == "call_function"
            and isinstance(node.meta.get("val"), (torch.SymInt, torch.SymFloat, torch.SymBool)))


def _fold_sizes(gm: GraphModule) -> None:
    """Make a dynamic-shape export the graph a static export has: sizes computed from the inputs
    (``sym_size`` nodes feeding view, arange, slice) become their example values, so the nodes,
    their names and their plans are the same. A node that took such a size keeps it in
    ``meta["sizes"]``: its flattened (args, kwargs) leaves, the size's SymInt where one was, else
    None, so a cost model can put the node's arguments at other sizes."""
    from torch.utils._pytree import tree_flatten, tree_unflatten

    for node in gm.graph.nodes:
        if node.op != "call_function" or _is_size(node):
            continue
        leaves, spec = tree_flatten((node.args, node.kwargs))
        if not any(_is_size(a) for a in leaves):
            continue
        node.meta["sizes"] = [a.meta["val"] if _is_size(a) else None for a in leaves]
        node.args, node.kwargs = tree_unflatten([_example_value(a) if _is_size(a) else a for a in leaves], spec)
    for node in reversed(list(gm.graph.nodes)):
        # the sizes, and the runtime checks on them (which have no output)
        if node.op == "call_function" and not node.users and (_is_size(node) or (
                node.meta.get("val") is None and node.all_input_nodes and all(map(_is_size, node.all_input_nodes)))):
            gm.graph.erase_node(node)


def _example_value(node: Node):
    hint = node.meta["val"].node.hint
    if hint is None:
        raise NotImplementedError(f"autopar: the size {node.name} = {node.meta['val']} depends on tensor values, "
                                  "not only on input shapes; this model cannot be captured with dynamic shapes")
    return hint


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


def _wrapped(node: Node):
    """(grad enabled, submodule node, operands) of a grad-mode or disabled-autocast wrapper, else None."""
    hop = torch.ops.higher_order
    if node.target is getattr(hop, "wrap_with_set_grad_enabled", None):
        return node.args[0], node.args[1], node.args[2:]
    if node.target is getattr(hop, "wrap_with_autocast", None) and not node.args[2]:
        return True, node.args[4], node.args[5:]
    return None


def _inline_wrappers(gm: GraphModule) -> None:
    """Inline the submodules torch.export wraps code under ``torch.no_grad()`` or a disabled autocast
    in (Hugging Face 4.x's rotary embedding): the rewrite places aten ops, not submodules. What ran
    without grad is detached, so no gradient flows through it now either."""
    while True:
        node = next((n for n in gm.graph.nodes if n.op == "call_function" and _wrapped(n)), None)
        if node is None:
            return
        grad, sub, operands = _wrapped(node)
        body = getattr(gm, sub.target)
        env = dict(zip((b for b in body.graph.nodes if b.op == "placeholder"), operands))
        with gm.graph.inserting_before(node):
            for b in body.graph.nodes:
                if b.op == "get_attr":   # a wrapper nested in the body: its submodule moves up
                    name = f"{sub.target}_{b.target}"
                    gm.add_submodule(name, getattr(body, b.target))
                    env[b] = gm.graph.get_attr(name)
                elif b.op == "call_function":
                    env[b] = gm.graph.node_copy(b, env.__getitem__)
                    env[b].meta.setdefault("nn_module_stack", node.meta.get("nn_module_stack"))
                elif b.op == "output":
                    outs = [env[o] for o in b.args[0]]
            if not grad:
                outs = [_detached(gm, o) for o in outs]
        for user in list(node.users):   # the wrapper's results are taken by getitem
            user.replace_all_uses_with(outs[user.args[1]])
            gm.graph.erase_node(user)
        gm.graph.erase_node(node)
        if not sub.users:
            gm.graph.erase_node(sub)
            gm.delete_submodule(sub.target)


def _detached(gm: GraphModule, value: Node) -> Node:
    out = gm.graph.call_function(aten.detach.default, (value,))
    out.meta.update(val=value.meta.get("val"), nn_module_stack=value.meta.get("nn_module_stack"))
    return out


def _drop_assertions(gm: GraphModule) -> None:
    """Remove dtype/device assertions on intermediate values: the rewrite keeps both, and a
    node without an output cannot be given a placement."""
    for node in list(gm.graph.nodes):
        if node.target is aten._assert_tensor_metadata.default:
            gm.graph.erase_node(node)


_CASTS = {aten.to.dtype, aten.to.dtype_layout, aten.to.device, aten._to_copy.default, aten.type_as.default}


def _drop_identity_casts(gm: GraphModule) -> None:
    """Remove casts that change nothing in the captured graph. They come from dtype-generic code
    (``x.to(input_dtype)``, ``x.to(device)``); kept, they would pin the captured fp32 when the
    plan computes at 16 bits, and the next op would mix dtypes."""
    for node in list(gm.graph.nodes):
        if node.target not in _CASTS or not isinstance(node.args[0], Node):
            continue
        src, out = node.args[0].meta.get("val"), node.meta.get("val")
        if (isinstance(src, torch.Tensor) and isinstance(out, torch.Tensor) and src.dtype == out.dtype
                and src.device == out.device and src.layout == out.layout):
            node.replace_all_uses_with(node.args[0])
            gm.graph.erase_node(node)


def _split_addmm_bias(gm: GraphModule) -> None:
    """addmm(b, x, w) -> add(mm(x, w), b): GPT-2's Conv1D is a linear with a [in, out] weight."""
    for node in list(gm.graph.nodes):
        if node.target is not aten.addmm.default or node.kwargs.get("beta", 1) != 1 or node.kwargs.get("alpha", 1) != 1:
            continue
        b, x, w = node.args[:3]
        with gm.graph.inserting_before(node):
            mm = gm.graph.call_function(aten.mm.default, (x, w))
            add = gm.graph.call_function(aten.add.Tensor, (mm, b))
        for new in (mm, add):
            new.meta.update(val=node.meta["val"], module_path=node.meta.get("module_path", ""),
                            nn_module_stack=node.meta.get("nn_module_stack"))
        node.replace_all_uses_with(add)
        gm.graph.erase_node(node)


def graph_cached(fn):
    """``fn(cap, *args)`` computed once per captured graph and arguments. A capture is never
    changed (passes return new graphs), so what is derived from it holds while it lives; the mesh
    search plans one capture on every candidate mesh. Callers must not change what it returns."""
    cache: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()

    @functools.wraps(fn)
    def cached(cap, *args):
        per_graph = cache.setdefault(cap.gm, {})
        if args not in per_graph:
            per_graph[args] = fn(cap, *args)
        return per_graph[args]
    return cached


def input_free(graph: torch.fx.Graph) -> set[Node]:
    """The nodes that depend on no user input and no parameter: buffers, and the (not random)
    ops on buffers and shapes only, such as position ids, causal masks and rotary tables."""
    found: set[Node] = set()
    for node in graph.nodes:
        if node.op == "placeholder" and node.meta.get("kind") == "buffer":
            found.add(node)
        elif (node.op == "call_function" and all(i in found for i in node.all_input_nodes)
              and torch.Tag.nondeterministic_seeded not in getattr(node.target, "tags", ())):
            found.add(node)
    return found


_LAYER = re.compile(r"^.*?\.\d+(?=\.|$)")


def _layer(node: Node) -> str | None:
    m = _LAYER.match(node.meta.get("module_path") or "")
    return m.group(0) if m else None


def _constants_per_layer(gm: GraphModule) -> None:
    """Recompute, inside each layer (``...h.3``, ``...layers.3``), every value it uses that depends
    on no user input and no parameter (only on buffers and shapes), instead of taking it from
    outside: identical layers stay identical, and a stage cut never has to send such values
    (a boolean causal mask cannot be sent)."""
    constant = input_free(gm.graph)
    copies: dict[tuple[str, Node], Node] = {}

    def local(value: Node, layer: str, before: Node) -> Node:
        if value.op != "call_function":
            return value
        if (layer, value) not in copies:
            args = {i: local(i, layer, before) for i in value.all_input_nodes}
            with gm.graph.inserting_before(before):
                copy = gm.graph.node_copy(value, args.__getitem__)
            copy.meta["module_path"] = layer
            copies[(layer, value)] = copy
        return copies[(layer, value)]

    replaced: set[Node] = set()
    for node in list(gm.graph.nodes):
        layer = _layer(node) if node.op == "call_function" else None
        if layer is None:
            continue
        for value in node.all_input_nodes:
            if value in constant and value.op == "call_function" and _layer(value) != layer:
                node.replace_input_with(value, local(value, layer, node))
                replaced.add(value)
    for node in reversed(list(gm.graph.nodes)):   # the originals no one uses any more
        if node in replaced and not node.users:
            replaced.update(i for i in node.all_input_nodes if i.op == "call_function")
            gm.graph.erase_node(node)
