"""Causal masks proven causal: an attention whose mask is the causal pattern becomes ``is_causal=True``.

Hugging Face models build their causal mask inside the forward from ``arange``s (``kv_idx <= q_idx``,
and-ed with an all-true padding mask and a packed-sequence check on derived position ids); under
torch.export they never drop it. A mask makes sdpa leave flash attention for a masked kernel,
holds a (batch, 1, s, s) tensor per copy (4 GiB of booleans at 65,536 tokens), and makes ring
attention compute its blocks in fp32 with their scores in full. ``causal_mask_pass`` replaces a
mask by ``is_causal=True`` where it proves the mask equal to sdpa's causal pattern (key k seen by
query q iff k <= q; boolean True there, or additive 0 there and -inf or the dtype's lowest
elsewhere) for every batch and head; a mask it cannot prove (a sliding window shorter than the
sequence, padding, documents, anything read from an input or a buffer) stays as it is.

The proof, with no (s x s) tensor made. The mask's ancestors depend on no placeholder; each is
evaluated on the CPU while its value has at most ``LIMIT`` elements; a larger one must be a
pointwise op (comparisons, logic, ``where``, ``masked_fill``, ``tril``/``triu``, broadcasts,
casts), a tensor of one value (``ones``, ``full``) or a view that keeps each element's trailing
coordinates (a slice from 0, leading dims added), and is kept as that op over its operands (``_Lazy``). The mask is then a function
F(q, k) of small leaves, each identical over the batch and head dims (checked) and varying over
q, over k, both or neither. Per query row q, F is constant between
consecutive *breakpoints* in k:
- a comparison u(q) <op> v(k) with v monotone in k changes truth only where ``searchsorted(v, u)``
  (left and right) lands; integer sides that are sums of values over q alone and over k alone (a
  window, q - k < w) are rearranged to that form first;
- ``tril``/``triu`` of diagonal d change at k = q + d + 1 / q + d;
- a value over k used otherwise (a boolean leaf, a ``where`` branch) changes where its k-vector
  does, a table over both (small enough to be evaluated) where its row does (at most ``MAX_STEPS``
  places, else not proven);
- any op mixing q and k otherwise is not proven.
With k = 0 and k = q + 1 (where the causal pattern changes) added, F equals the causal pattern
everywhere iff it does at every breakpoint: O(s x breakpoints) point evaluations instead of s^2.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
from torch.fx import GraphModule, Node
from torch.fx.operator_schemas import normalize_function

aten = torch.ops.aten

LIMIT = 1 << 22       # elements a value of the mask's making may hold and be evaluated whole
MAX_STEPS = 64        # changes along k a k-only value may have

_COMPARE = {aten.le.Tensor, aten.le.Scalar, aten.lt.Tensor, aten.lt.Scalar, aten.ge.Tensor, aten.ge.Scalar,
            aten.gt.Tensor, aten.gt.Scalar, aten.eq.Tensor, aten.eq.Scalar, aten.ne.Tensor, aten.ne.Scalar}
_LOGIC = {aten.__and__.Tensor, aten.__or__.Tensor, aten.__xor__.Tensor, aten.bitwise_and.Tensor,
          aten.bitwise_or.Tensor, aten.bitwise_xor.Tensor, aten.logical_and.default, aten.logical_or.default,
          aten.logical_xor.default, aten.logical_not.default, aten.bitwise_not.default, aten.where.self,
          aten.where.Scalar, aten.where.ScalarSelf, aten.where.ScalarOther, aten.masked_fill.Scalar,
          aten.masked_fill.Tensor, aten.mul.Tensor}
_SAME = {aten.expand.default, aten.alias.default, aten.clone.default, aten._to_copy.default, aten.to.dtype,
         aten.to.dtype_layout, aten.contiguous.default}
_BAND = {aten.tril.default, aten.triu.default}
_SUMS = {aten.add.Tensor, aten.sub.Tensor, aten.add.Scalar, aten.sub.Scalar, aten.neg.default, aten.rsub.Scalar}
_RESHAPES = {aten.view.default, aten.reshape.default, aten._unsafe_view.default, aten.unsqueeze.default,
             aten.squeeze.dim, aten.squeeze.default}
_FILLED = {aten.ones.default: 1, aten.zeros.default: 0, aten.full.default: None, aten.new_ones.default: 1,
           aten.new_zeros.default: 0, aten.new_full.default: None, aten.ones_like.default: 1,
           aten.zeros_like.default: 0, aten.full_like.default: None}
_SEEDED = torch.Tag.nondeterministic_seeded


class _Unproven(Exception):
    pass


@dataclass(eq=False)
class _Lazy:
    """A value too large to evaluate whole: ``op`` over ``args`` (tensors, _Lazy, scalars), broadcast to ``shape``."""
    op: object
    args: tuple
    kwargs: dict
    shape: tuple


def causal_mask_pass(gm: GraphModule) -> GraphModule:
    """Replace each sdpa mask proven equal to the causal pattern by ``is_causal=True``; drop what made it."""
    cache: dict[Node, object] = {}
    proven: dict[Node, bool] = {}
    for node in list(gm.graph.nodes):
        if node.target is not aten.scaled_dot_product_attention.default:
            continue
        given = sdpa_arguments(node)
        mask = given["attn_mask"]
        if not isinstance(mask, Node) or given["is_causal"]:
            continue
        if mask not in proven:
            try:
                proven[mask] = _is_causal(_value(mask, cache), _size(mask))
            except (_Unproven, RuntimeError, TypeError, ValueError, IndexError, NotImplementedError):
                proven[mask] = False   # an op this evaluation cannot run (on the CPU, at these shapes): not proven
        if proven[mask]:
            kwargs = {key: val for key, val in node.kwargs.items() if key in ("scale", "enable_gqa")}
            node.args = (given["query"], given["key"], given["value"], None, given["dropout_p"], True)
            node.kwargs = kwargs
            _erase_unused(gm, mask)
    gm.graph.lint()
    gm.recompile()
    return gm


def sdpa_arguments(node: Node) -> dict:
    """An sdpa call's arguments by name, positional or keyword, defaults filled in."""
    return normalize_function(node.target, node.args, node.kwargs, normalize_to_only_use_kwargs=True).kwargs


def _size(node: Node) -> tuple[int, ...]:
    val = node.meta.get("val")
    if not isinstance(val, torch.Tensor) or val.dim() < 2 or not all(isinstance(s, int) for s in val.shape):
        raise _Unproven
    return tuple(val.shape)


def _erase_unused(gm: GraphModule, node: Node) -> None:
    todo, erased = [node], set()
    while todo:
        n = todo.pop()
        if n not in erased and n.op == "call_function" and not n.users:
            erased.add(n)
            todo += n.all_input_nodes
            gm.graph.erase_node(n)


def _on_cpu(a):
    return torch.device("cpu") if isinstance(a, torch.device) else a


def _value(node: Node, cache: dict):
    """``node``'s value: a CPU tensor, or a ``_Lazy`` where it would exceed ``LIMIT`` elements."""
    if node in cache:
        return cache[node]
    if node.op != "call_function" or _SEEDED in getattr(node.target, "tags", ()) or node.target in (
            aten.empty.memory_format, aten.empty_strided.default, aten.new_empty.default):
        raise _Unproven   # a placeholder (input, parameter, buffer) or a value with no defined content
    args = torch.fx.node.map_arg(node.args, lambda n: _value(n, cache))
    kwargs = {k: _on_cpu(v) for k, v in torch.fx.node.map_arg(node.kwargs, lambda n: _value(n, cache)).items()}
    val = node.meta.get("val")
    shape = tuple(val.shape) if isinstance(val, torch.Tensor) else ()
    parts = val if isinstance(val, (tuple, list)) else (val,)   # an op of several outputs makes them all
    size = sum(_numel(v.shape) for v in parts if isinstance(v, torch.Tensor))
    lazy = any(isinstance(a, _Lazy) for a in [*args, *kwargs.values()])
    if not lazy and size <= LIMIT:
        out = node.target(*args, **kwargs)
    elif isinstance(args[0], _Lazy) and _keeps_points(node.target, args, args[0].shape, shape):
        out = _Lazy(aten.alias.default, (args[0],), {}, shape)
    elif node.target in _FILLED:   # one value everywhere: that value, broadcast
        fill = _FILLED[node.target]
        fill = args[-1] if fill is None else fill
        out = _Lazy(aten.expand.default, (torch.tensor(fill, dtype=val.dtype), shape), {}, shape)
    elif _pointwise(node.target) or node.target in _SAME or node.target in _BAND:
        out = _Lazy(node.target, args, kwargs, shape)
    else:
        raise _Unproven
    cache[node] = out
    return out


def _keeps_points(op, args, before: tuple, after: tuple) -> bool:
    """Whether ``op`` leaves each element at the same trailing coordinates (shapes aligned on the right, as
    broadcasting aligns them): a slice from 0 by 1, or a reshape that only adds or drops leading 1s."""
    if op is aten.slice.Tensor:
        start = args[2] if len(args) > 2 else 0
        step = args[4] if len(args) > 4 else 1
        return start in (0, None) and step == 1
    if op in _RESHAPES:
        strip = lambda s: tuple(s[next((i for i, n in enumerate(s) if n != 1), len(s)):])   # noqa: E731
        return strip(before) == strip(after)
    return False


def _pointwise(op) -> bool:
    return op in _COMPARE or op in _LOGIC or torch.Tag.pointwise in getattr(op, "tags", ())


def _numel(shape) -> int:
    n = 1
    for s in shape:
        n *= s
    return n


def _leaf2d(t, rank: int) -> torch.Tensor:
    """A leaf tensor as a (rows over q or 1, columns over k or 1) table; raise where it varies over a batch dim."""
    if not isinstance(t, torch.Tensor):
        return torch.tensor(t).reshape(1, 1)
    t = t.reshape((1,) * (rank - t.dim()) + tuple(t.shape)) if t.dim() < rank else t
    for d in range(t.dim() - 2):
        if t.shape[d] > 1:
            first = t.narrow(d, 0, 1)
            if not torch.equal(t, first.expand_as(t)):
                raise _Unproven
            t = first
    return t.reshape(t.shape[-2], t.shape[-1])


class _Points:
    """Evaluates a mask's tree at points (q, k) and finds the breakpoints of its rows."""

    def __init__(self, shape: tuple):
        self.rank, self.sq, self.sk = len(shape), shape[-2], shape[-1]
        self.tables: dict[int, torch.Tensor] = {}

    def table(self, t) -> torch.Tensor:
        key = id(t)
        if key not in self.tables:
            self.tables[key] = _leaf2d(t, self.rank)
        return self.tables[key]

    def deps(self, x) -> set[str]:
        """Which of q, k the value ``x`` varies over."""
        if isinstance(x, _Lazy):
            out = set().union(*(self.deps(a) for a in [*x.args, *x.kwargs.values()]))
            return out | ({"q", "k"} if x.op in _BAND else set())
        if isinstance(x, torch.Tensor):
            t = self.table(x)
            return {d for d, n in (("q", t.shape[0]), ("k", t.shape[1])) if n > 1}
        return set()

    def at(self, x, q: torch.Tensor, k: torch.Tensor):
        """``x`` at the points (q[i], k[i])."""
        if isinstance(x, _Lazy):
            if x.op in _BAND:
                d = x.args[1] if len(x.args) > 1 else x.kwargs.get("diagonal", 0)
                keep = (k - q <= d) if x.op is aten.tril.default else (k - q >= d)
                v = self.at(x.args[0], q, k)
                return torch.where(keep, v, torch.zeros((), dtype=v.dtype))
            args = [self.at(a, q, k) for a in x.args]
            kwargs = {n: self.at(a, q, k) for n, a in x.kwargs.items()}
            if x.op is aten.expand.default or x.op is aten.contiguous.default or x.op is aten.alias.default:
                return args[0]
            if x.op is aten.clone.default:
                return args[0].clone()
            return x.op(*args, **kwargs)
        if isinstance(x, torch.Tensor):
            t = self.table(x)
            return t[q if t.shape[0] > 1 else torch.zeros_like(q), k if t.shape[1] > 1 else torch.zeros_like(k)]
        return x

    def along_k(self, x) -> torch.Tensor:
        k = torch.arange(self.sk)
        return self.at(x, torch.zeros_like(k), k)

    def along_q(self, x) -> torch.Tensor:
        q = torch.arange(self.sq)
        return self.at(x, q, torch.zeros_like(q))

    def steps(self, v: torch.Tensor) -> torch.Tensor:
        """The k where a vector over k changes, as one column of breakpoints for every row."""
        where = torch.nonzero(v[1:] != v[:-1]).flatten() + 1
        if where.numel() > MAX_STEPS:
            raise _Unproven
        return where.reshape(1, -1).expand(self.sq, -1)

    def _row_steps(self, t: torch.Tensor) -> torch.Tensor:
        """Where each row of a (q x k) table changes, padded with sk: at most ``MAX_STEPS`` a row."""
        changed = t[:, 1:] != t[:, :-1]
        most = int(changed.sum(1).max()) if changed.numel() else 0
        if most > MAX_STEPS:
            raise _Unproven
        rows, cols = torch.nonzero(changed, as_tuple=True)
        nth = changed.long().cumsum(1)[rows, cols] - 1   # which change of its row each one is
        out = torch.full((self.sq, max(most, 1)), self.sk, dtype=torch.long)
        out[rows, nth] = cols + 1
        return out

    def breakpoints(self, x) -> list[torch.Tensor]:
        """Columns (sq, n) of the k at which row q of ``x`` may change value."""
        deps = self.deps(x)
        if "k" not in deps:
            return []
        if deps == {"k"}:
            return [self.steps(self.along_k(x))]
        if not isinstance(x, _Lazy):
            return [self._row_steps(self.table(x))]
        q = torch.arange(self.sq)
        if x.op in _BAND:
            d = x.args[1] if len(x.args) > 1 else x.kwargs.get("diagonal", 0)
            return [(q + d + (1 if x.op is aten.tril.default else 0)).reshape(-1, 1), *self.breakpoints(x.args[0])]
        if x.op in _COMPARE:
            found = self._threshold(*x.args[:2])
            if found is not None:
                return found
        # a pointwise op is constant where each of its operands is
        return [c for a in [*x.args, *x.kwargs.values()] for c in self.breakpoints(a)]

    def _threshold(self, a, b) -> list[torch.Tensor] | None:
        """Where a <op> b may change along row q, when it is v(k) <op> u(q) for vectors v and u: with
        v monotone, where u would be inserted in v on its left and on its right; else where v changes.
        Either side over k and the other not, compared as they are; or integer sides that are sums of
        values over q alone and over k alone, a - b = D(q, k) = D(0, k) - (D(0, 0) - D(q, 0)) exactly.
        None where neither holds."""
        da, db = self.deps(a), self.deps(b)
        if "k" not in da & db and "q" not in (da if "k" in da else db):
            kside, other = (a, b) if "k" in da else (b, a)
            v, u = self.along_k(kside), torch.as_tensor(self.along_q(other)).expand(self.sq)
        elif self._separable(a) and self._separable(b):
            v = torch.as_tensor(self.along_k(a) - self.along_k(b)).expand(self.sk)
            at0 = self.at(a, torch.zeros(1, dtype=torch.long), torch.zeros(1, dtype=torch.long)) - self.at(
                b, torch.zeros(1, dtype=torch.long), torch.zeros(1, dtype=torch.long))
            u = torch.as_tensor(at0 - (self.along_q(a) - self.along_q(b))).expand(self.sq)
            if v.is_floating_point() or u.is_floating_point():
                return None   # rounding would move the boundary
        else:
            return None
        common = torch.promote_types(v.dtype, u.dtype)
        common = common if common.is_floating_point else torch.long   # signed, so that it negates
        v, u = v.to(common), u.to(common)
        if torch.is_floating_point(v) and not (torch.isfinite(v).all() and torch.isfinite(u).all()):
            raise _Unproven
        rising = bool((v[1:] >= v[:-1]).all())
        if not rising and not bool((v[1:] <= v[:-1]).all()):
            return [self.steps(v)]
        v, u = (v, u) if rising else (-v, -u)
        u = u.contiguous()
        return [torch.searchsorted(v, u).reshape(-1, 1), torch.searchsorted(v, u, right=True).reshape(-1, 1)]

    def _separable(self, x) -> bool:
        """Whether ``x`` is a sum of values over q alone and over k alone (adds, subtracts, negations)."""
        if isinstance(x, _Lazy) and x.op in _SUMS and x.kwargs.get("alpha", 1) == 1:
            return all(self._separable(a) for a in x.args)
        if isinstance(x, _Lazy) and x.op in _SAME:
            return self._separable(x.args[0])
        return self.deps(x) != {"q", "k"}


def _is_causal(value, shape: tuple) -> bool:
    """Whether ``value``, broadcast to ``shape`` (..., q, k), is sdpa's causal pattern for every leading index."""
    sq, sk = shape[-2], shape[-1]
    points = _Points(shape)
    if isinstance(value, torch.Tensor):
        value = points.table(value).expand(sq, sk)   # raises where the mask differs over a batch or head
        seen = torch.ones(sq, sk, dtype=torch.bool).tril()
        return _matches(value, seen)
    rows = torch.arange(sq)
    cols = [torch.zeros(sq, 1, dtype=torch.long), (rows + 1).reshape(-1, 1), *points.breakpoints(value)]
    k = torch.cat([c.to(torch.long).reshape(sq, -1) for c in cols], 1)
    q = rows.reshape(-1, 1).expand_as(k)
    inside = k < sk
    q, k = q[inside], k[inside]
    got = torch.as_tensor(points.at(value, q, k)).expand(q.shape)
    return _matches(got, k <= q)


def _matches(got: torch.Tensor, seen: torch.Tensor) -> bool:
    """Whether mask values ``got`` are sdpa's for keys ``seen`` (True, or 0) and hidden (False, or -inf)."""
    if got.dtype == torch.bool:
        return bool(torch.equal(got, seen))
    if not torch.is_floating_point(got):
        return False
    hidden = got[~seen]
    return bool((got[seen] == 0).all()) and bool(((hidden == float("-inf")) | (hidden <= torch.finfo(got.dtype).min)).all())
