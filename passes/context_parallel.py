"""Context parallelism on the graph: every token-wise op runs on this cp rank's share of the sequence.

Each sequence of ``seq`` tokens is cut into ``2·size`` equal chunks and cp rank r holds chunks r
and ``2·size-1-r`` (``collectives.rank_chunks``): causal attention then gives every rank the same
work (a head chunk sees few keys, its tail chunk many), as in Megatron-LM and torchtitan.

What runs where. The graph is split by one question: does a value depend on a parameter?
- Values that do not (token ids, targets and the labels a model shifts from them, position ids,
  rotary tables, masks: integers and tables of shapes) are computed whole, as captured, on every
  rank. They are cheap, and computing them whole keeps what needs the whole sequence right: a
  label shift (Hugging Face's ``labels[..., 1:]``) crosses chunk borders, positions must be the
  rank's own.
- Where such a value meets the parameter-dependent part it is cut to the rank's chunks along its
  sequence dim (``rank_chunks``; the dim ``rules.dim_labels`` labels "seq", of the sequence's
  length). A table of buffers and shapes only has no labels to tell: where a pointwise op
  broadcasts it against the local activations, its dim lined up with their sequence dim is cut
  (rotary tables as torchtitan and Meta keep them: ``[max_seq, hd]`` sliced ``[:T]``,
  ``[1, 1, T, hd]``, or computed from ``arange(T)``; as ``context_parallel(buffers=...)`` shards
  them). A value with no sequence dim that depends on the inputs (``targets.view(-1)``) is
  recomputed on the cut values instead; one with none that depends on no input (``inv_freq``)
  is used as it is.
- Every parameter-dependent op runs on the rank's tokens: reshapes, expands and unflattens get
  their sizes from the local input (the sequence factor of each group of dims shrinks by cp).
- Attention (causal sdpa, or sdpa with a mask that depends on positions only, which Hugging Face
  Llama builds) becomes the plan's variant (``collectives.CP_ATTENTIONS``), the rank's queries
  local and the model's mask, if any, cut to the rank's rows: "allgather",
  ``collectives.context_attention``, all-gathers the keys and values over cp in sequence order
  (the backward reduce-scatters dK and dV); "ring", ``collectives.ring_attention``, passes each
  rank's key/value block around the cp ring (no dropout: ``ring_refusal``).
- The loss: ``passes.token_mean`` has already made each mean over tokens this rank's token sum
  times a scale the runtime feeds (tokens counted over the whole batch), so a sum over this rank's
  tokens is all a loss needs, and the runtime's mean over dp x cp of the ranks' losses, and of their
  gradients, is the whole batch's.

Refused, naming the module: attention spelled out (a matmul or a softmax over the sequence
dim of the local keys), a mask that depends on the inputs, a reduction over the sequence other
than a token loss's sum, and so a loss that is not a mean or sum over tokens.

The pass runs first, on the captured graph (before the tp rewrite, which then sees local shapes:
``local_strategies`` gives its strategies to the nodes this pass made).
"""
from __future__ import annotations

import collections
import contextlib
import logging
import math
import operator
import weakref
from types import SimpleNamespace

import torch
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.fx import GraphModule, Node
from torch.fx.node import map_arg

from autopar import collectives as C
from autopar.graph.capture import input_free
from autopar.graph.capture import copy_graph
from autopar.graph.causal_mask import sdpa_arguments
from autopar.graph.rules import Strategy, dim_labels, view_groups
from autopar.passes.token_mean import TOKEN_LOSS_OPS, is_token_sum, token_mean_pass
from autopar.placement import R

aten = torch.ops.aten
_RESHAPES = {aten.view.default, aten.reshape.default, aten._unsafe_view.default}
_CONTRACT = {aten.matmul.default, aten.bmm.default, aten.mm.default}
# ops reducing over the dims given as their second argument
_REDUCE = {aten.sum.dim_IntList, aten.mean.dim, aten._softmax.default, aten.softmax.int, aten._log_softmax.default,
           aten.log_softmax.int, aten.amax.default, aten.cumsum.default, aten.logsumexp.default,
           aten.var.correction, aten.std.correction}
_REDUCE_ALL = {aten.sum.default, aten.mean.default}


class ContextParallelError(ValueError):
    """The graph has something context parallelism cannot split over the sequence."""


def check_sequence(seq: int, cp: int, tp: int = 1, sequence_parallel: bool = False) -> None:
    """Raise unless a sequence of ``seq`` tokens splits into ``2·cp`` equal chunks (and, with
    sequence parallelism, each rank's ``seq / cp`` tokens over tp), naming the valid cp values."""
    if seq % (2 * cp) == 0 and (not sequence_parallel or (seq // cp) % tp == 0):
        return
    valid = [c for c in range(1, seq // 2 + 1) if seq % (2 * c) == 0
             and (not sequence_parallel or (seq // c) % tp == 0)]
    need = f"2·cp = {2 * cp} chunks" + (f" of a multiple of tp={tp} tokens per rank" if sequence_parallel else "")
    raise ContextParallelError(f"cp={cp}: the sequence of {seq} tokens does not split into {need} (each cp rank "
                               f"holds a head and a tail chunk); valid cp for this sequence: "
                               f"{', '.join(map(str, valid)) or 'none (use cp=1)'}")


def cp_pass(gm: GraphModule, *, size: int, rank: int, group: str, seq: int, attention: str = "allgather") -> GraphModule:
    """Run every parameter-dependent op on cp rank ``rank``'s two chunks of each ``seq``-token sequence."""
    check_sequence(seq, size)
    refused = ring_refusal(gm) if attention == "ring" else None
    if refused:
        raise ContextParallelError(f"cp_attention='ring': {refused}")
    out = copy_graph(gm)
    _split(out, size=size, rank=rank, group=group, seq=seq, attention=attention)
    out.recompile()
    return out


def _split(out, *, size: int, rank: int, group: str, seq: int, attention: str) -> None:
    """``cp_pass``'s rewrite of ``out`` (a copy of the captured graph, with its ``graph`` and ``meta``), in place."""
    g = out.graph
    inputs = [n for n in g.nodes if n.op == "placeholder" and n.meta.get("kind") == "input"]
    labels = dim_labels(out, inputs)
    free = input_free(g)
    local = _param_dependent(g)
    cuts = _cuts(g, local, labels, free, seq)
    made: dict[tuple[Node, int], Node] = {}
    out.meta["cp_cuts"] = {}   # cut node name -> its first consumer's (``cp_cuts``)
    order = {n: k for k, n in enumerate(g.nodes)}
    for consumer, swaps in sorted(cuts.items(), key=lambda kv: order[kv[0]]):   # a cut before its first use
        for u, dim in swaps.items():
            if (u, dim) not in made:
                with g.inserting_before(consumer):
                    made[(u, dim)] = g.call_function(C.rank_chunks, (u, dim, size, rank),
                                                     name=f"cp_chunks_{consumer.name}")
                # its "val" stays the whole value's until _localize traces the local one: the old shape
                made[(u, dim)].meta.update(module_path=consumer.meta.get("module_path", ""), val=u.meta["val"])
                out.meta["cp_cuts"][made[(u, dim)].name] = consumer.name
            consumer.replace_input_with(u, made[(u, dim)])
    _localize(out, local | set(made.values()), size, rank, group, seq, C.CP_ATTENTIONS[attention])


def _attentions(gm: GraphModule):
    """(node, its arguments by name) of each sdpa in ``gm``."""
    return ((n, sdpa_arguments(n)) for n in gm.graph.nodes if n.target is aten.scaled_dot_product_attention.default)


def ring_refusal(gm: GraphModule) -> str | None:
    """Why ring attention cannot run ``gm``'s attention (a sentence naming the module), None when it can."""
    for n, given in _attentions(gm):
        if given["dropout_p"]:
            return f"the attention in {_where(n)} has dropout_p={given['dropout_p']}, which ring attention does not apply"
    return None


def ring_unfused(gm: GraphModule) -> str | None:
    """Where ring attention would run ``gm``'s attention unfused (a sentence naming the module), None where
    every block is fused: an attention with a mask (one capture did not prove causal) computes each
    block in fp32 with its scores whole (``collectives.fused_blocks``), which the cost model does not price."""
    for n, given in _attentions(gm):
        if given["attn_mask"] is not None:
            return (f"the attention in {_where(n)} takes a mask other than the causal pattern (a window, "
                    "a bias), so ring attention would compute its blocks unfused, in fp32 with their scores "
                    "whole, which the plan does not price")
    return None


def cp_cuts(gm: GraphModule) -> dict[str, str]:
    """The nodes ``cp_pass`` made to cut whole values to the rank's chunks, by name, each with the
    name of the first node using it: where a pipeline stage split puts it (later passes keep the
    name as the node's or as its ``meta["origin"]``)."""
    return dict(gm.meta.get("cp_cuts", {}))


def local_strategies(gm: GraphModule, strategies: dict[Node, Strategy]) -> dict[Node, Strategy]:
    """The planner's strategies (keyed by the captured graph's nodes) for ``cp_pass``'s graph ``gm``:
    each kept node takes its namesake's; the nodes the passes made compute whole values on every tp
    rank (the cuts) or keep their input's placement (a token loss times its scale)."""
    by_name = {n.name: s for n, s in strategies.items()}
    out = {}
    for n in gm.graph.nodes:
        if n.name in by_name:
            out[n] = by_name[n.name]
        elif n.target is operator.mul and n.args[0] in out:   # a token loss times its scale (passes.token_mean)
            loss = out[n.args[0]].output
            out[n] = Strategy((loss, R), loss)
        else:
            out[n] = Strategy(tuple(R for _ in n.all_input_nodes), R)
    return out


def _param_dependent(g) -> set[Node]:
    found: set[Node] = set()
    for n in g.nodes:
        if n.op == "placeholder":
            if n.meta.get("kind") == "param":
                found.add(n)
        elif n.op == "call_function" and any(i in found for i in n.all_input_nodes):
            found.add(n)
    return {n for n in found if n.op != "placeholder"}


def _where(node: Node) -> str:
    return node.meta.get("module_path") or "the top level"


def _cuts(g, local: set[Node], labels, free: set[Node], seq: int) -> dict[Node, dict[Node, int]]:
    """consumer -> {whole value: the dim to cut it on} for every edge from a parameter-free value
    into the local part; widens ``local`` by the input-dependent values with no sequence dim."""
    cuts: dict[Node, dict[Node, int]] = {}
    # in graph order, so that of several refusals the first layer's is raised
    todo = collections.deque((u, c) for c in g.nodes if c in local for u in c.all_input_nodes if u not in local)
    while todo:
        u, consumer = todo.popleft()
        if u.op == "placeholder" and u.meta.get("kind") == "param":
            continue
        val = u.meta.get("val")
        if not isinstance(val, torch.Tensor):
            continue
        if consumer.target is aten.scaled_dot_product_attention.default and u in consumer.args[3:4]:
            if u not in free:
                raise ContextParallelError(
                    f"the attention in {_where(consumer)} takes a mask that depends on the inputs (a padding or "
                    "document mask); context parallelism supports causal sdpa and masks of positions only: "
                    "drop the mask (is_causal=True) or use cp=1")
            if val.dim() >= 2 and val.shape[-2] == seq:
                cuts.setdefault(consumer, {})[u] = val.dim() - 2   # the query rows; keys stay whole
            continue
        dims = _seq_dims(u, consumer, local, labels, seq, u in free)
        if len(dims) == 1:
            cuts.setdefault(consumer, {})[u] = dims[0]
        elif len(dims) > 1:
            raise ContextParallelError(
                f"{consumer.name} in {_where(consumer)} takes {u.name}, a value over the sequence twice "
                f"(shape {list(val.shape)}), as an explicit attention mask does; context parallelism supports "
                "causal scaled_dot_product_attention: use F.scaled_dot_product_attention(..., is_causal=True) "
                "or cp=1")
        elif u not in free and u.op != "placeholder":
            outside = [w for w in u.users if w not in local and w is not consumer]
            if outside:
                raise ContextParallelError(
                    f"{u.name} in {_where(u)} has no sequence dim that context parallelism can cut, and is used "
                    f"both by the model's weights and by {outside[0].name}; use cp=1")
            local.add(u)
            todo += [(i, u) for i in u.all_input_nodes if i not in local]
    return cuts


def _seq_dims(u: Node, consumer: Node, local: set[Node], labels, seq: int, free: bool) -> list[int]:
    """The dims to cut the whole value ``u`` on where the local ``consumer`` takes it: those its
    labels name "seq", of the sequence's length (token ids, targets, position ids). But the labels
    of a ``free`` value (of buffers and shapes only) follow no input, so they cannot say which of
    its dims is the sequence (a rotary table ``[seq, hd]`` or ``[1, 1, seq, hd]``, sliced from a
    longer buffer or computed from ``arange``): where a pointwise consumer broadcasts it against
    local operands, its dims lined up with their sequence dims are its sequence dims."""
    shape = _shape(u.meta["val"])
    if free and torch.Tag.pointwise in getattr(consumer.target, "tags", ()):
        dims = set()
        for x in consumer.all_input_nodes:
            if x not in local:
                continue
            mine = _shape(x.meta.get("val"))
            for k, name in enumerate(reversed(labels.get(x, ()))):
                if name == "seq" and k < min(len(shape), len(mine)) and shape[-1 - k] == mine[-1 - k] == seq:
                    dims.add(len(shape) - 1 - k)
        if dims:
            return sorted(dims)
    return [d for d, name in enumerate(labels.get(u, ())) if name == "seq" and shape[d] == seq]


def _localize(gm: GraphModule, local: set[Node], size: int, rank: int, group: str, seq: int, attention) -> None:
    """Give every local node the arguments and traced value (``meta["val"]``) of its sequence shard,
    in graph order; attention becomes its context-parallel form."""
    mode = FakeTensorMode(allow_non_fake_inputs=True)
    fake: dict[Node, object] = {}
    traced: dict[tuple, object] = {}   # ``_trace_key`` -> the value: each repeated layer's ops are traced once

    def val(n):
        return fake[n] if n in fake else n.meta.get("val")

    with mode, _quiet_fake_tensors():
        n = gm.graph._root
        while (n := n.next) is not gm.graph._root:
            if n.op == "placeholder":
                v = n.meta.get("val")
                fake[n] = mode.from_tensor(v) if isinstance(v, torch.Tensor) else v
                continue
            if n.op != "call_function":
                continue
            old_in = {i: i.meta.get("val") for i in n.all_input_nodes}
            new_in = {i: val(i) for i in n.all_input_nodes}
            if n in local:
                _check_ops(n, old_in, new_in)
                if n.target in _RESHAPES or n.target is aten.expand.default or n.target is aten.unflatten.int:
                    _resize(n, old_in, new_in, seq)
                elif n.target is aten.scaled_dot_product_attention.default:
                    _attention(n, size, rank, group, attention)
            args = map_arg(n.args, val)
            kwargs = map_arg(n.kwargs, val)
            try:
                if n.target is attention:
                    fake[n] = torch.empty_like(args[0])
                else:
                    key = _trace_key(n.target, args, kwargs)
                    if key is None:
                        fake[n] = n.target(*args, **kwargs)
                    else:
                        if key not in traced:
                            traced[key] = n.target(*args, **kwargs)
                        fake[n] = traced[key]
            except Exception as e:
                raise ContextParallelError(f"context parallelism cannot run {n.name} ({n.target}) in {_where(n)} on "
                                           f"a sequence shard: {e}") from None
    for n, v in fake.items():
        n.meta["val"] = v


@contextlib.contextmanager
def _quiet_fake_tensors():
    """Silence the fake tensor mode's log while the shard is traced: it logs the whole traceback of
    an op that fails on the shard before raising, which ``_localize`` turns into one sentence (and
    the mesh search into a note line), so the log would only bury it."""
    log = logging.getLogger("torch._subclasses.fake_tensor")
    was, log.disabled = log.disabled, True
    try:
        yield
    finally:
        log.disabled = was


class _Unkeyed(Exception):
    """An argument whose traced value may depend on more than ``_frozen`` keeps of it."""


def _trace_key(op, args, kwargs) -> tuple | None:
    """What a fake tensor op's traced value is a function of: the op and, for each argument, its
    value, or a tensor's metadata (shape, strides, dtype, device, offset, layout, flags; fake
    tensors have no data), as the fake mode's own dispatch cache keys it (its further fields, the
    grad mode and dispatch state, are the same for every op of one pass). None for an op whose
    value depends on more (data-dependent or dynamic output shapes, mutation, a fake tensor standing
    for a known constant), which is traced each time."""
    if not isinstance(op, torch._ops.OpOverload) or op._schema.is_mutable or any(
            t in op.tags for t in (torch.Tag.dynamic_output_shape, torch.Tag.data_dependent_output)):
        return None
    try:
        return op, _frozen(args), _frozen(kwargs)
    except _Unkeyed:
        return None


def _frozen(a):
    """``a`` as a hashable key (``_trace_key``): containers item by item, tensors by metadata."""
    if isinstance(a, torch.Tensor):
        if getattr(a, "constant", None) is not None:
            raise _Unkeyed
        return (type(a), tuple(a.shape), a.stride(), a.dtype, a.device, a.storage_offset(), a.layout,
                a.requires_grad, a.is_conj(), a.is_neg())
    if isinstance(a, (list, tuple)):
        return type(a), tuple(_frozen(x) for x in a)
    if isinstance(a, dict):
        return dict, tuple((k, _frozen(v)) for k, v in a.items())
    if a is None or isinstance(a, (bool, int, float, str, torch.dtype, torch.device, torch.layout,
                                   torch.memory_format)):
        return type(a), a   # the type too: 1, 1.0 and True are equal keys
    raise _Unkeyed


def _shape(v) -> tuple[int, ...]:
    return tuple(v.shape) if isinstance(v, torch.Tensor) else ()


def _changed(old, new) -> set[int]:
    """The dims a local value is shorter on than the whole one (its sequence dims)."""
    a, b = _shape(old), _shape(new)
    return {d for d in range(len(a)) if d < len(b) and a[d] != b[d]}


def _check_ops(n: Node, old_in: dict, new_in: dict) -> None:
    """Refuse ops that would mix tokens of different ranks: attention spelled out, reductions over the sequence."""
    x = n.args[0] if n.args and isinstance(n.args[0], Node) else None
    if x is None:
        return
    changed = _changed(old_in[x], new_in[x])
    if n.target in _CONTRACT and isinstance(n.args[1], Node):
        w = n.args[1]   # a weight is whole; a sequence of keys (k^T) or values is this rank's alone
        if _changed(old_in[w], new_in[w]):
            raise ContextParallelError(
                f"{n.name} in {_where(n)} multiplies by a sequence of keys (attention spelled out as "
                "softmax(q k^T) v); context parallelism gathers the keys only for scaled_dot_product_attention: "
                "use F.scaled_dot_product_attention(..., is_causal=True) there, or cp=1")
    if n.target in _REDUCE_ALL and changed and not (n.target is aten.sum.default and is_token_sum(n)):
        raise ContextParallelError(f"{n.name} in {_where(n)} reduces over the sequence; context parallelism "
                                   "supports a mean or sum over tokens as the loss only there (a cross-entropy, or "
                                   "(loss * mask).sum() / mask.sum()): use cp=1")
    if n.target in TOKEN_LOSS_OPS and not is_token_sum(n):
        raise ContextParallelError(f"the loss {n.name} in {_where(n)} is not a sum over tokens times its scale "
                                   "(passes.token_mean runs before context parallelism): use cp=1")
    if n.target in _REDUCE and changed:
        dims = n.args[1] if len(n.args) > 1 else None
        dims = [dims] if isinstance(dims, int) else list(dims or range(len(_shape(old_in[x]))))
        if {d % len(_shape(old_in[x])) for d in dims} & changed:
            raise ContextParallelError(f"{n.name} in {_where(n)} reduces over the sequence dim; context parallelism "
                                       "splits the sequence over ranks: only a mean or sum cross-entropy loss may "
                                       "reduce over it (use cp=1)")


def _resize(n: Node, old_in: dict, new_in: dict, seq: int) -> None:
    """A reshape's, expand's or unflatten's sizes for its local input: in each group of dims whose
    product shrank, the dim of the sequence's length shrinks (else the innermost one that divides:
    a flattened batch x sequence dim keeps the sequence inside)."""
    x = n.args[0]
    a, b = _shape(old_in[x]), _shape(new_in[x])
    if a == b:
        return
    out = _shape(n.meta["val"])
    args = list(n.args)
    if n.target is aten.expand.default:
        sizes, lead = list(args[1]), len(args[1]) - len(a)
        args[1] = [b[i - lead] if i >= lead and s != -1 and s != 1 and a[i - lead] == s else s
                   for i, s in enumerate(sizes)]
    else:
        new = list(out)
        for gi, gj in view_groups(a, out):
            whole, mine = math.prod(a[i] for i in gi), math.prod(b[i] for i in gi)
            if whole == mine:
                continue
            ratio = whole // mine
            fits = [j for j in gj if new[j] % ratio == 0]
            if whole % mine or not fits:
                raise ContextParallelError(f"{n.name} in {_where(n)} reshapes {list(a)} to {list(out)}, which does "
                                           f"not split by sequence as its local input {list(b)}; use cp=1")
            new[([j for j in fits if new[j] == seq] or fits)[-1]] //= ratio
        if n.target is aten.unflatten.int:
            dim = args[1] % len(a)
            args[2] = new[dim:dim + len(args[2])]
        else:
            args[1] = new
    n.args = tuple(args)


def _attention(n: Node, size: int, rank: int, group: str, attention) -> None:
    """sdpa -> ``attention`` (a ``collectives.CP_ATTENTIONS`` variant), the rank's rows of the mask."""
    names = ("query", "key", "value", "attn_mask", "dropout_p", "is_causal")
    given = {**dict(zip(names, n.args)), **n.kwargs}
    mask, causal = given.get("attn_mask"), given.get("is_causal", False)
    if mask is None and not causal:
        raise ContextParallelError(f"the attention in {_where(n)} is not causal (no mask, is_causal=False): every "
                                   "token sees the whole sequence; context parallelism supports causal attention "
                                   "only: use cp=1")
    n.target = attention
    n.args = (given["query"], given["key"], given["value"], mask, given.get("dropout_p", 0.0), given.get("scale"),
              bool(given.get("enable_gqa", False)), group, size, rank)
    n.kwargs = {}


_CHECKED: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()   # fx Graph -> the cp it splits over


def check_context(cap, cp: int) -> None:
    """Raise ``ContextParallelError`` now, at planning, for what ``cp_pass`` would refuse on the
    ranks: a sequence 2·cp does not divide, attention or a loss it cannot split (on rank 0's
    chunks; no process group needed, the graph is only traced). A cp that passed once for a graph
    is not traced again (captures are immutable): the mesh search asks it of every ZeRO stage."""
    if cp == 1 or cp in _CHECKED.get(cap.gm.graph, ()):
        return
    if not cap.inputs or len(shape_of(cap.inputs[0])) < 2:
        raise ContextParallelError(f"cp={cp} splits the sequence dim (dim 1) of the first input, but it is "
                                   f"{list(shape_of(cap.inputs[0])) if cap.inputs else 'missing'}: pass token ids "
                                   "of shape (batch, sequence), or use cp=1")
    check_sequence(shape_of(cap.inputs[0])[1], cp)
    # cp_pass's rewrite of what the runtime gives it (the loss made a token sum first), on a copy of
    # the graph, without the code a GraphModule would compile for it; on the trace of the first
    # layers where the graph repeats them (the rewrite's verdict on a node depends on its op,
    # arguments and shapes, which the repeated layers share): an 80-layer graph took 0.6 s per cp
    traced = cap.excerpt or cap
    _split(SimpleNamespace(graph=token_mean_pass(traced.gm).graph, meta={}), size=cp, rank=0, group="",
           seq=shape_of(traced.inputs[0])[1], attention="allgather")
    _CHECKED.setdefault(cap.gm.graph, set()).add(cp)


def shape_of(node: Node) -> tuple[int, ...]:
    return _shape(node.meta.get("val"))
