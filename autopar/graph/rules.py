"""Sharding rules: for each aten op, the ways it can run over one mesh axis.

A ``Strategy`` lists one placement per input node (``node.all_input_nodes`` order),
the output placement (for a multi-output op, the placement of every output), how
many ways the op's compute is divided, the collectives it issues inside itself,
and the name of the local implementation that replaces the op (``None``: the op
runs as is on local shards).

Gradient rule the rewrite relies on: an input placed ``R`` in a strategy that is
not all-replicated gets a per-rank *partial* gradient (the ranks used it for
different work), so the rewrite routes it through ``copy_to`` (all-reduce of the
gradient). ``Strategy.divergent`` names those inputs.

Dims carry labels ("batch", "seq", "other", see ``dim_labels``): the tp axis never
shards a batch dim (that is the dp axis's job), and sequence parallelism is
exactly the freedom to shard "seq" dims.

A value that depends on no user input and no parameter (position ids, a causal mask,
rotary tables: functions of shapes and buffers only) is computed whole on every rank,
whatever its op: it costs little, and no rule is needed for the integer and boolean
ops that build masks.
"""
from __future__ import annotations

import operator
import warnings
from dataclasses import dataclass, field
from typing import Callable

import torch
import torch.distributed as dist
from torch.fx import Node

from autopar.graph.capture import input_free
from autopar.placement import P, R, Placement, Shard

aten = torch.ops.aten


@dataclass(frozen=True)
class Strategy:
    inputs: tuple[Placement, ...]
    output: Placement
    divisor: int = 1
    comm: tuple[tuple[str, str], ...] = ()   # (collective kind, what it carries) inside the op
    local: str | None = None
    regather: bool = False   # a sequence-parallel linear keeps its input's shard (see reshard.regathers)

    @property
    def replicated(self) -> bool:
        return self.output == R and all(p == R for p in self.inputs)

    def divergent(self, i: int) -> bool:
        """Whether input ``i``'s gradient is partial across ranks under this strategy."""
        return self.inputs[i] == R and not self.replicated

    def __str__(self) -> str:
        ins = ", ".join(map(str, self.inputs))
        tags = [t for t in (self.local, "regather" if self.regather else None) if t]
        return f"({ins}) -> {self.output}" + "".join(f" [{t}]" for t in tags)


@dataclass
class RuleContext:
    """What a rule may know besides its node: the axis size and graph-wide facts."""

    size: int
    interleaves: tuple[int, ...] = (1,)
    labels: dict = field(default_factory=dict)   # Node -> tuple of dim labels
    unruled: set = field(default_factory=set)     # op kinds without a rule, already warned about
    _constants: dict = field(default_factory=dict, repr=False)   # Graph -> its input-free nodes

    def constant(self, node: Node) -> bool:
        """Whether ``node`` depends on no user input and no parameter (only on buffers and shapes)."""
        if node.graph not in self._constants:
            self._constants[node.graph] = input_free(node.graph)
        return node in self._constants[node.graph]

    def shardable(self, node: Node, dim: int, *, exact: bool = True) -> bool:
        """Whether ``dim`` of ``node``'s output may be sharded (``exact``: without padding)."""
        n = shape(node)[dim]
        if self.labels.get(node, ())[dim:dim + 1] == ("batch",):
            return False
        return n % self.size == 0 if exact else n >= self.size


def shape(node: Node) -> tuple[int, ...]:
    val = node.meta["val"]
    if isinstance(val, (list, tuple)):
        val = val[0]
    if node.meta.get("shape_of") is not val:   # a fake tensor's .shape is slow to read
        node.meta["shape"], node.meta["shape_of"] = tuple(val.shape), val
    return node.meta["shape"]


def is_float(node: Node) -> bool:
    """Whether ``node``'s value carries a gradient: a real or complex floating tensor (complex
    rotary products are differentiable like any other activation)."""
    val = node.meta.get("val")
    if isinstance(val, (list, tuple)):
        val = val[0]
    return isinstance(val, torch.Tensor) and (val.is_floating_point() or val.is_complex())


RULES: dict[object, Callable[[Node, RuleContext], list[Strategy]]] = {}


def rule(*targets):
    def register(fn):
        for t in targets:
            RULES[t] = fn
        return fn
    return register


def replicate_only(node: Node, ctx: RuleContext) -> list[Strategy]:
    return [Strategy(tuple(R for _ in node.all_input_nodes), R)]


def strategies_for(node: Node, ctx: RuleContext) -> list[Strategy]:
    """All strategies of one call_function node; an op without a rule stays replicated."""
    if ctx.constant(node):
        return replicate_only(node, ctx)
    fn = RULES.get(node.target)
    if fn is None:
        _warn_no_rule(node, ctx)
        return replicate_only(node, ctx)
    return fn(node, ctx)


# What ``say_once`` has said in this process, keyed without shapes (see there).
_SAID: set = set()


def say_once(key: tuple, graph: torch.fx.Graph, message: str, stacklevel: int = 2) -> None:
    """Warn ``message`` from rank 0 only, once per process for ``key`` and the model ``graph`` was
    captured from (its parameters' names and shapes); ``stacklevel`` as ``warnings.warn``'s in the caller.

    A planning captures the model once per microbatch shape (pipeline microbatch counts, the mesh
    search), and what is said about its ops depends on the model, not on those shapes: keyed on the
    model, not on the capture or the text (whose byte counts follow the shapes), it is said once."""
    params = tuple((n.meta.get("fqn"), tuple(n.meta["val"].shape)) for n in graph.nodes
                   if n.op == "placeholder" and n.meta.get("kind") == "param" and "val" in n.meta)
    if (key, params) in _SAID:
        return
    _SAID.add((key, params))
    if dist.is_available() and dist.is_initialized() and dist.get_rank() != 0:
        return
    warnings.warn(message, stacklevel=stacklevel + 1)


def _warn_no_rule(node: Node, ctx: RuleContext) -> None:
    """Say once per op kind and model (``say_once``) that an op has no rule and what that costs.

    One line per node (18 for a 2-layer interleaved RoPE) on every rank buries the point; the text
    depends only on the model, so planning it again in one process, at any shapes, repeats nothing."""
    if node.target in ctx.unruled:
        return
    ctx.unruled.add(node.target)
    same = [n for n in node.graph.nodes if n.op == "call_function" and n.target == node.target
            and not ctx.constant(n)]
    gathered = sum(_value_bytes(i) for n in same for i in n.all_input_nodes)
    where = node.meta.get("module_path") or "<top level>"
    more = f" (and {len(same) - 1} more node{'s' * (len(same) > 2)})" if len(same) > 1 else ""
    say_once(("no rule", node.target, where, len(same)), node.graph,
             f"autopar: no sharding rule for {node.target} in {where}{more}; it runs replicated on every "
             f"tp rank: its inputs ({gathered / 2**20:.3g} MiB in all) are gathered whole wherever their "
             "producers shard them, and its work is repeated on each rank instead of divided", stacklevel=3)


def _value_bytes(node: Node) -> int:
    val = node.meta.get("val")
    vals = val if isinstance(val, (list, tuple)) else [val]
    return sum(v.numel() * v.element_size() for v in vals if isinstance(v, torch.Tensor))


# ---- elementwise ------------------------------------------------------------------------

_LINEAR_BINARY = {aten.add.Tensor, aten.sub.Tensor}
_SCALING = {aten.mul.Tensor, aten.div.Tensor}
POINTWISE = [
    aten.add.Tensor, aten.sub.Tensor, aten.mul.Tensor, aten.div.Tensor, aten.gelu.default,
    aten.dropout.default, aten.relu.default, aten.silu.default, aten.tanh.default,
    aten.neg.default, aten.rsqrt.default, aten.pow.Tensor_Scalar, aten.exp.default,
    aten.sigmoid.default, aten.add.Scalar, aten.mul.Scalar, aten._to_copy.default,
    aten.clone.default, aten.contiguous.default, aten.alias.default, aten.detach.default,
    aten.to.dtype, aten.type_as.default, aten.bitwise_not.default, aten.eq.Scalar,
    aten.masked_fill.Scalar, aten.to.dtype_layout, aten.to.device, aten.cos.default, aten.sin.default,
]


# f(0) == 0: padding of an uneven shard stays zero through these, so they may run on it
ZERO_PRESERVING = {aten.add.Tensor, aten.sub.Tensor, aten.mul.Tensor, aten.gelu.default,
                   aten.dropout.default, aten.relu.default, aten.silu.default, aten.tanh.default,
                   aten.neg.default, aten.mul.Scalar, aten._to_copy.default, aten.clone.default,
                   aten.contiguous.default, aten.alias.default, aten.detach.default, aten.to.dtype,
                   aten.type_as.default, aten.to.dtype_layout, aten.to.device, aten.sin.default}


@rule(*POINTWISE)
def elementwise(node: Node, ctx: RuleContext) -> list[Strategy]:
    out = shape(node)
    ins = node.all_input_nodes
    out_strats = [Strategy(tuple(R for _ in ins), R)]
    for d in range(len(out)):
        if not ctx.shardable(node, d, exact=node.target not in ZERO_PRESERVING):
            continue
        for k in ctx.interleaves:
            if out[d] % k or (node.target not in ZERO_PRESERVING and (out[d] // k) % ctx.size):
                continue
            placements = []
            for i in ins:
                s = shape(i)
                di = d - (len(out) - len(s))
                placements.append(Shard(di, k) if di >= 0 and s[di] == out[d] else R)
            out_strats.append(Strategy(tuple(placements), Shard(d, k), ctx.size))
    out_strats += _partial_strategies(node, out)
    return out_strats


def _partial_strategies(node: Node, out: tuple[int, ...]) -> list[Strategy]:
    """Where a sum of per-rank summands passes through: p + q, p - q, p * r, p / r, p * c."""
    a, b = (list(node.args) + [None, None])[:2]
    two = isinstance(a, Node) and isinstance(b, Node) and a is not b
    if node.target in _LINEAR_BINARY and two and shape(a) == shape(b) == out:
        return [Strategy((P, P), P)]
    if node.target in _SCALING and two and shape(a) == out:
        return [Strategy((P, R), P)] + ([Strategy((R, P), P)] if node.target is aten.mul.Tensor
                                        and shape(b) == out else [])
    if node.target in _SCALING and isinstance(a, Node) and not isinstance(b, Node):
        return [Strategy((P,), P)]
    return []


# ---- views and layout ops ---------------------------------------------------------------

def view_groups(src: tuple[int, ...], dst: tuple[int, ...]) -> list[tuple[list[int], list[int]]]:
    """Pair up runs of dims with equal products: [(src dims, dst dims), ...]."""
    groups, i, j = [], 0, 0
    while i < len(src) or j < len(dst):
        gi, gj = [i] if i < len(src) else [], [j] if j < len(dst) else []
        a = src[i] if i < len(src) else 1
        b = dst[j] if j < len(dst) else 1
        i, j = i + bool(gi), j + bool(gj)
        while a != b:
            if a < b:
                gi.append(i); a *= src[i]; i += 1
            else:
                gj.append(j); b *= dst[j]; j += 1
        groups.append((gi, gj))
    return groups


def view_map(src: tuple[int, ...], dst: tuple[int, ...], dim: int, size: int, interleave: int):
    """Where a shard of ``src`` dim ``dim`` lands after a reshape to ``dst`` (None: nowhere)."""
    for gi, gj in view_groups(src, dst):
        if dim not in gi:
            continue
        if not gj or gi[0] != dim:
            return None   # only the outermost dim of a group keeps a contiguous shard
        if len(gi) == 1 and len(gj) == 1:
            return gj[0]
        if interleave == 1 and src[dim] % size == 0 and dst[gj[0]] % size == 0:
            return gj[0]
        return None
    return None


@rule(aten.view.default, aten.reshape.default, aten._unsafe_view.default, aten.flatten.using_ints,
      aten.unflatten.int)
def view(node: Node, ctx: RuleContext) -> list[Strategy]:
    """A reshape, flatten or unflatten: read off the input's and the output's shapes alone."""
    src, dst = shape(node.args[0]), shape(node)
    out = [Strategy((R,), R), Strategy((P,), P)]
    for d in range(len(src)):
        for k in ctx.interleaves:
            if src[d] % k or not ctx.shardable(node.args[0], d, exact=False):
                continue
            e = view_map(src, dst, d, ctx.size, k)
            if e is not None and ctx.shardable(node, e, exact=False):
                out.append(Strategy((Shard(d, k),), Shard(e, k)))
    return out


def _permuted(node: Node, ctx: RuleContext, perm: list[int], skip: int | None = None) -> list[Strategy]:
    """Output dim e is input dim perm[e] (``skip``: an output dim no input dim maps to)."""
    out = [Strategy((R,), R), Strategy((P,), P)]
    outs = [e for e in range(len(shape(node))) if e != skip]
    for e, d in zip(outs, perm):
        if ctx.shardable(node.args[0], d, exact=False):
            out += [Strategy((Shard(d, k),), Shard(e, k)) for k in ctx.interleaves
                    if shape(node)[e] % k == 0]
    return out


@rule(aten.transpose.int)
def transpose(node: Node, ctx: RuleContext) -> list[Strategy]:
    n = len(shape(node))
    a, b = (d % n for d in node.args[1:3])
    perm = list(range(n))
    perm[a], perm[b] = perm[b], perm[a]
    return _permuted(node, ctx, perm)


@rule(aten.permute.default)
def permute(node: Node, ctx: RuleContext) -> list[Strategy]:
    n = len(shape(node))
    return _permuted(node, ctx, [d % n for d in node.args[1]])


@rule(aten.t.default)
def t(node: Node, ctx: RuleContext) -> list[Strategy]:
    return _permuted(node, ctx, list(reversed(range(len(shape(node))))))


@rule(aten.unsqueeze.default)
def unsqueeze(node: Node, ctx: RuleContext) -> list[Strategy]:
    """A new size-1 dim: the input's dims keep their shards, shifted past it."""
    n = len(shape(node))
    new = node.args[1] % n
    return _permuted(node, ctx, list(range(n - 1)), skip=new)


@rule(aten.view_as_complex.default)
def view_as_complex(node: Node, ctx: RuleContext) -> list[Strategy]:
    """(..., n, 2) real pairs -> (..., n) complex (interleaved RoPE): the pair dim stays whole."""
    return _permuted(node, ctx, list(range(len(shape(node)))))


@rule(aten.view_as_real.default)
def view_as_real(node: Node, ctx: RuleContext) -> list[Strategy]:
    """(..., n) complex -> (..., n, 2) real pairs: a new last dim that no input dim maps to."""
    n = len(shape(node))
    return _permuted(node, ctx, list(range(n - 1)), skip=n - 1)


@rule(aten.select.int)
def select(node: Node, ctx: RuleContext) -> list[Strategy]:
    """One index of one dim (``x[..., 0]`` of a rotary pair): the other dims keep their shards."""
    n = len(shape(node.args[0]))
    dim = node.args[1] % n
    return _permuted(node, ctx, [d for d in range(n) if d != dim])


@rule(aten.expand.default)
def expand(node: Node, ctx: RuleContext) -> list[Strategy]:
    """Input dims align right with the output's; a dim that is broadcast (1 -> n) stays whole."""
    src, out = shape(node.args[0]), shape(node)
    lead = len(out) - len(src)
    res = [Strategy((R,), R), Strategy((P,), P)]
    for d in range(len(src)):
        if src[d] == out[d + lead] and ctx.shardable(node.args[0], d, exact=False):
            res += [Strategy((Shard(d, k),), Shard(d + lead, k)) for k in ctx.interleaves if src[d] % k == 0]
    return res


@rule(aten.repeat_interleave.self_int)
def repeat_interleave(node: Node, ctx: RuleContext) -> list[Strategy]:
    """Each slice of one dim repeated n times in place (grouped-query attention's key/value heads,
    ``k.repeat_interleave(n_rep, dim=1)``): a rank's block of that dim repeats into its block of the
    output (whole blocks only: a padded slice would be repeated into the middle of the output), the
    other dims keep their shards, and a sum of per-rank inputs repeats into the sum."""
    src = shape(node.args[0])
    dim = node.args[2] if len(node.args) > 2 else node.kwargs.get("dim")
    out = [Strategy((R,), R), Strategy((P,), P)]
    if dim is None:   # the input flattened first: its dims do not survive
        return out
    dim %= len(src)
    for d in range(len(src)):
        if d == dim and (node.kwargs.get("output_size") is not None or not ctx.shardable(node.args[0], d)):
            continue   # a local output_size would be the global one
        if d != dim and not ctx.shardable(node.args[0], d, exact=False):
            continue
        out += [Strategy((Shard(d, k),), Shard(d, k)) for k in ctx.interleaves
                if src[d] % k == 0 and (d != dim or (src[d] // k) % ctx.size == 0)]
    return out


@rule(aten.cat.default)
def cat(node: Node, ctx: RuleContext) -> list[Strategy]:
    """Concatenation along one dim: every other dim may be sharded alike in all inputs."""
    ins = node.all_input_nodes
    out = shape(node)
    dim = (node.args[1] if len(node.args) > 1 else node.kwargs.get("dim", 0)) % len(out)
    res = [Strategy(tuple(R for _ in ins), R), Strategy(tuple(P for _ in ins), P)]
    for d in range(len(out)):
        if d != dim and ctx.shardable(node, d, exact=False):
            res += [Strategy(tuple(Shard(d, k) for _ in ins), Shard(d, k)) for k in ctx.interleaves
                    if out[d] % k == 0]
    return res


@rule(aten.stack.default)
def stack(node: Node, ctx: RuleContext) -> list[Strategy]:
    """Equal-shaped tensors stacked along a new dim: the other dims may be sharded alike in all
    inputs; a sum of per-rank stacks is the stack of the sums."""
    ins = node.all_input_nodes
    out = shape(node)
    dim = (node.args[1] if len(node.args) > 1 else node.kwargs.get("dim", 0)) % len(out)
    res = [Strategy(tuple(R for _ in ins), R), Strategy(tuple(P for _ in ins), P)]
    for e in range(len(out)):
        if e != dim and ctx.shardable(node, e, exact=False):
            d = e - (e > dim)
            res += [Strategy(tuple(Shard(d, k) for _ in ins), Shard(e, k)) for k in ctx.interleaves
                    if out[e] % k == 0]
    return res


@rule(aten.pad.default)
def pad(node: Node, ctx: RuleContext) -> list[Strategy]:
    """Padding touches its last len(pad)/2 dims; the others may be sharded (evenly: the pad value
    would otherwise land in a shard's padding)."""
    out = shape(node)
    padded = len(node.args[1]) // 2
    return [Strategy((R,), R)] + [Strategy((Shard(d),), Shard(d)) for d in range(len(out) - padded)
                                  if ctx.shardable(node, d)]


@rule(aten.split.Tensor, aten.split_with_sizes.default, aten.chunk.default)
def split(node: Node, ctx: RuleContext) -> list[Strategy]:
    src = shape(node.args[0])
    dim = (node.args[2] if len(node.args) > 2 else node.kwargs.get("dim", 0)) % len(src)
    pieces = [tuple(v.shape) for v in node.meta["val"]]
    out = [Strategy((R,), R)]
    for d in range(len(src)):
        if not ctx.shardable(node.args[0], d, exact=d == dim):
            continue
        if d != dim:
            out.append(Strategy((Shard(d),), Shard(d)))
        elif len(set(pieces)) == 1 and len(pieces) in ctx.interleaves and len(pieces) > 1:
            # each rank holds its slice of every piece, so the pieces split locally
            if (src[d] // len(pieces)) % ctx.size == 0:
                out.append(Strategy((Shard(d, len(pieces)),), Shard(d)))
    return out


@rule(aten.unbind.int)
def unbind(node: Node, ctx: RuleContext) -> list[Strategy]:
    """The slices of one dim as separate tensors (``x1, x2 = pairs.unbind(-1)``): every other
    dim keeps its shard, and a partial input gives partial pieces."""
    src = shape(node.args[0])
    dim = (node.args[1] if len(node.args) > 1 else node.kwargs.get("dim", 0)) % len(src)
    out = [Strategy((R,), R), Strategy((P,), P)]
    for d in range(len(src)):
        if d != dim and ctx.shardable(node.args[0], d, exact=False):
            out += [Strategy((Shard(d, k),), Shard(d - (d > dim), k)) for k in ctx.interleaves if src[d] % k == 0]
    return out


@rule(operator.getitem)
def getitem(node: Node, ctx: RuleContext) -> list[Strategy]:
    return _permuted(node, ctx, list(range(len(shape(node)))))


@rule(aten.arange.start, aten.arange.default, aten.arange.start_step, aten.zeros.default,
      aten.ones.default, aten.full.default, aten.empty.memory_format)
def factory(node: Node, ctx: RuleContext) -> list[Strategy]:
    return [Strategy((), R)]


# ---- nn ops -----------------------------------------------------------------------------

@rule(aten.linear.default)
def linear(node: Node, ctx: RuleContext) -> list[Strategy]:
    """y = x @ w.T (bias adds are separate nodes after capture)."""
    w = node.args[1]
    r = len(shape(node))
    n_out, k_in = shape(w)
    out = [Strategy((R, R), R)]
    for k in ctx.interleaves:   # column parallel: each rank computes its output features
        if n_out % k == 0 and (k == 1 or (n_out // k) % ctx.size == 0) and n_out >= ctx.size:
            out.append(Strategy((R, Shard(0, k)), Shard(r - 1, k), ctx.size))
    if k_in >= ctx.size:        # row parallel: each rank sums over its input features
        out.append(Strategy((Shard(r - 1), Shard(1)), P, ctx.size))
    # No token-parallel strategy (tokens sharded, weight replicated): that is data
    # parallelism with a weight-gradient all-reduce, the dp axis's job. Sequence
    # parallelism shards only the norm/dropout/residual regions between linears.
    return out


@rule(aten.mm.default)
def mm(node: Node, ctx: RuleContext) -> list[Strategy]:
    """y = x @ w with w stored [in, out] (GPT-2's Conv1D): the linear rule with the weight's dims swapped."""
    k_in, n_out = shape(node.args[1])
    out = [Strategy((R, R), R)]
    for k in ctx.interleaves:   # column parallel
        if n_out % k == 0 and (k == 1 or (n_out // k) % ctx.size == 0) and n_out >= ctx.size:
            out.append(Strategy((R, Shard(1, k)), Shard(1, k), ctx.size))
    if k_in >= ctx.size:        # row parallel
        out.append(Strategy((Shard(1), Shard(0)), P, ctx.size))
    return out


@rule(aten.mean.dim)
def mean(node: Node, ctx: RuleContext) -> list[Strategy]:
    """A mean over some dims (RMSNorm's): the other dims may be sharded; it is linear, so P passes."""
    src = shape(node.args[0])
    dims = {d % len(src) for d in node.args[1]} if node.args[1] else set(range(len(src)))
    keep = node.args[2] if len(node.args) > 2 else node.kwargs.get("keepdim", False)
    out = [Strategy((R,), R), Strategy((P,), P)]
    for d in range(len(src)):
        if d not in dims and ctx.shardable(node.args[0], d, exact=False):
            e = d if keep else d - sum(1 for r in dims if r < d)
            out.append(Strategy((Shard(d),), Shard(e), ctx.size))
    return out


@rule(aten.embedding.default)
def embedding(node: Node, ctx: RuleContext) -> list[Strategy]:
    w, idx = node.args[0], node.args[1]
    vocab, dim = shape(w)
    r = len(shape(node))
    out = [Strategy((R, R), R)]
    if vocab >= ctx.size:
        out.append(Strategy((Shard(0), R), P, ctx.size, local="vocab_parallel_embedding"))
    if dim % ctx.size == 0:
        out.append(Strategy((Shard(1), R), Shard(r - 1), ctx.size))
    for d in range(r - 1):
        if ctx.shardable(idx, d):
            out.append(Strategy((R, Shard(d)), Shard(d), ctx.size))
    return out


@rule(aten.matmul.default, aten.bmm.default)
def matmul(node: Node, ctx: RuleContext) -> list[Strategy]:
    """Batched a @ b over equal leading (batch) dims: shard a batch dim, or the contraction (-> P)."""
    a, b = node.args[0], node.args[1]
    ra, rb, r = len(shape(a)), len(shape(b)), len(shape(node))
    out = [Strategy((R, R), R)]
    if ra != rb or ra < 3:
        return out
    for d in range(r - 2):
        if ctx.shardable(node, d):
            out.append(Strategy((Shard(d), Shard(d)), Shard(d), ctx.size))
    if shape(a)[-1] >= ctx.size:
        out.append(Strategy((Shard(ra - 1), Shard(rb - 2)), P, ctx.size))
    return out


@rule(aten.softmax.int, aten._softmax.default, aten._log_softmax.default, aten.log_softmax.int)
def softmax(node: Node, ctx: RuleContext) -> list[Strategy]:
    r = len(shape(node))
    dim = node.args[1] % r
    out = [Strategy((R,), R)]
    out += [Strategy((Shard(d),), Shard(d), ctx.size) for d in range(r) if d != dim and ctx.shardable(node, d)]
    return out


@rule(aten.slice.Tensor)
def slice_(node: Node, ctx: RuleContext) -> list[Strategy]:
    r = len(shape(node))
    dim = (node.args[1] if len(node.args) > 1 else 0) % r
    return [Strategy((R,), R)] + [Strategy((Shard(d),), Shard(d)) for d in range(r)
                                  if d != dim and ctx.shardable(node.args[0], d, exact=False)]


@rule(aten.layer_norm.default)
def layer_norm(node: Node, ctx: RuleContext) -> list[Strategy]:
    x = node.args[0]
    n_norm = len(node.args[1])
    ins = node.all_input_nodes
    r = len(shape(x))
    out = [Strategy(tuple(R for _ in ins), R)]
    for d in range(r - n_norm):
        if ctx.shardable(x, d):
            out.append(Strategy((Shard(d),) + tuple(R for _ in ins[1:]), Shard(d), ctx.size))
    return out


@rule(aten.rms_norm.default)
def rms_norm(node: Node, ctx: RuleContext) -> list[Strategy]:
    """torch's RMSNorm over its last dims: the others may be sharded, the weight (if any) whole. A
    zero row normalises to zero, so a shard's padding may run through it."""
    x = node.args[0]
    n_norm = len(node.args[1])
    ins = node.all_input_nodes
    out = [Strategy(tuple(R for _ in ins), R)]
    for d in range(len(shape(x)) - n_norm):
        if ctx.shardable(x, d, exact=False):
            out.append(Strategy((Shard(d),) + tuple(R for _ in ins[1:]), Shard(d), ctx.size))
    return out


@rule(aten.scaled_dot_product_attention.default)
def sdpa(node: Node, ctx: RuleContext) -> list[Strategy]:
    """Attention over (B, heads, T, head_dim): heads are independent."""
    ins = node.all_input_nodes
    out = [Strategy(tuple(R for _ in ins), R)]
    q, k, v = node.args[:3]
    heads_q, heads_kv = shape(q)[1], shape(k)[1]
    if heads_q % ctx.size == 0 and heads_kv % ctx.size == 0 and not ctx.labels.get(q, ("",) * 2)[1] == "seq":
        # a mask broadcast over heads stays whole; one with a heads dim is split like q
        def placement(i: Node):
            if i in (q, k, v) or (len(shape(i)) == 4 and shape(i)[1] == heads_q):
                return Shard(1)
            return R
        out.append(Strategy(tuple(placement(i) for i in ins), Shard(1), ctx.size))
    return out


@rule(aten.cross_entropy_loss.default)
def cross_entropy(node: Node, ctx: RuleContext) -> list[Strategy]:
    logits = node.args[0]
    ins = node.all_input_nodes
    out = [Strategy(tuple(R for _ in ins), R)]
    weight = node.args[2] if len(node.args) > 2 else node.kwargs.get("weight")
    smoothing = node.args[5] if len(node.args) > 5 else node.kwargs.get("label_smoothing", 0.0)
    if len(shape(logits)) == 2 and weight is None and not smoothing and shape(logits)[1] >= ctx.size:
        comm = (("all_gather", "row log-sum-exp"), ("all_reduce", "target logit"))
        out.append(Strategy((Shard(1), R), R, ctx.size, comm, local="vocab_parallel_cross_entropy"))
    return out


# ---- dim labels -------------------------------------------------------------------------

def dim_labels(gm: torch.fx.GraphModule, inputs: list[Node]) -> dict[Node, tuple[str, ...]]:
    """Label each dim of each activation "batch", "seq" or "other".

    Graph inputs (token ids) are (batch, seq, ...); labels flow through the ops by the
    same dim correspondences the rules use. A dim merging batch and seq is "batch"
    (sharding it would split the batch)."""
    labels: dict[Node, tuple[str, ...]] = {}
    for x in inputs:
        n = len(shape(x))
        labels[x] = tuple(["batch", "seq"][:n] + ["other"] * max(0, n - 2))
    for node in gm.graph.nodes:
        if node.op != "call_function" or node in labels or "val" not in node.meta:
            continue
        labels[node] = _label(node, labels)
    return labels


def _label(node: Node, labels: dict) -> tuple[str, ...]:
    try:
        out = shape(node)
    except (AttributeError, IndexError, TypeError):
        return ()
    tgt = node.target
    src = node.args[0] if node.args and isinstance(node.args[0], Node) else None
    lab = labels.get(src, ())
    if tgt in (aten.arange.start, aten.arange.default, aten.arange.start_step):
        return ("seq",) * len(out)
    if tgt == aten.embedding.default:
        return labels.get(node.args[1], ()) + ("other",)
    if tgt in (aten.view.default, aten.reshape.default, aten._unsafe_view.default, aten.flatten.using_ints,
               aten.unflatten.int) and lab:
        res = ["other"] * len(out)
        for gi, gj in view_groups(shape(src), out):
            names = {lab[i] for i in gi}
            name = "batch" if "batch" in names else ("seq" if "seq" in names else "other")
            for j in gj[:1]:
                res[j] = name
        return tuple(res)
    if tgt == aten.transpose.int and lab:
        a, b = (d % len(out) for d in node.args[1:3])
        res = list(lab)
        res[a], res[b] = res[b], res[a]
        return tuple(res)
    if tgt == aten.permute.default and lab:
        return tuple(lab[d % len(out)] for d in node.args[1])
    if tgt == aten.unsqueeze.default and lab:
        new = node.args[1] % len(out)
        return lab[:new] + ("other",) + lab[new:]
    if tgt == aten.mean.dim and lab and not (node.args[2] if len(node.args) > 2 else node.kwargs.get("keepdim")):
        dims = {d % len(lab) for d in node.args[1]} if node.args[1] else set(range(len(lab)))
        return tuple(name for d, name in enumerate(lab) if d not in dims)
    if tgt in (aten.linear.default,) and lab:
        return lab[:-1] + ("other",)
    if tgt in (aten.matmul.default, aten.bmm.default) and lab:
        return lab[:-1] + labels.get(node.args[1], ("other",))[-1:]
    if tgt == aten.view_as_complex.default and lab:
        return lab[:-1]
    if tgt == aten.view_as_real.default and lab:
        return lab + ("other",)
    if tgt in (aten.select.int, aten.unbind.int) and lab:
        dim = (node.args[1] if len(node.args) > 1 else 0) % len(lab)
        return lab[:dim] + lab[dim + 1:]
    if tgt == aten.stack.default and labels.get(node.args[0][0]):
        first = labels[node.args[0][0]]
        dim = (node.args[1] if len(node.args) > 1 else 0) % len(out)
        return first[:dim] + ("other",) + first[dim:]
    if tgt == aten.repeat_interleave.self_int and lab and (node.args[2] if len(node.args) > 2
                                                          else node.kwargs.get("dim")) is None:
        return ("batch" if "batch" in lab else "seq" if "seq" in lab else "other",)   # flattened first
    if tgt == operator.getitem:
        return lab
    if tgt == aten.scaled_dot_product_attention.default:
        return lab   # laid out as the query; the mask's (query, key) positions must not leak into it
    # elementwise and everything else: right-aligned broadcast of the inputs' labels
    res = ["other"] * len(out)
    for i in node.all_input_nodes:
        li = labels.get(i, ())
        for k, name in enumerate(reversed(li)):
            if k < len(res) and name != "other":
                res[-1 - k] = name
    return tuple(res)
