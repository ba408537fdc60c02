"""Every sharding rule, checked by brute force against the unsharded op on a gloo group.

For every call_function node of a few captured graphs (the tiny GPT with an even and
an uneven vocabulary, an op zoo exported from a small module, the layer ops of Hugging
Face GPT-2 and Llama written out in a small module, and a hand-built graph for ops
torch.export does not emit) and every strategy its rule offers, a one-op FX
graph is built (placeholders for the op's inputs, the op, its getitems for a split,
output), given the strategy under test with placeholders placed as the strategy's
inputs, rewritten by ``shard_pass`` into each rank's local graph (which reshards the
output to R) and run on gloo ranks:

- forward: every rank's (replicated) output equals the unsharded op's, and the op's
  local output (before the inserted collective) has the local shape its placement
  says, holding its shard (R: the full value; S: its slice, padding ignored);
- backward: with a fixed random cotangent, each floating input's local gradient is,
  per its placement, the full gradient (R, P) on every rank, or this rank's shard of
  it (S; padding rows must get a zero gradient so padded parameters stay zero).

Inputs are unit-scale random tensors (token ids in range, cross-entropy targets with
some ``ignore_index``); an S input is ``shard_tensor`` of the full one (zero padding),
a P input random per-rank summands of it. At tp=2 every case also runs fed from R and
from P producers ("-fromR", "-fromP"), so the split / reduce-scatter / all-reduce +
copy_to steps the rewrite inserts in front of the op are checked with it. Tolerance:
rtol 1e-5, atol 1e-6 scaled by the reference tensor's magnitude (see ``_ratio``).

All cases of one world size run in one job of the session's pool (tests/pool.py); the rank function loops over them
and sends back local outputs and gradients, which the parent compares. Cases are
built from the graphs in the parent at collection time and shipped as picklable
specs (op name, argument template, full inputs, placements, summands of partial
inputs, cotangents).

Known library bugs are listed in ``KNOWN_BUGS`` and marked strict xfail, so a fix
shows up as an XPASS failure asking for the entry to be removed.
"""
from __future__ import annotations

import functools
import operator
import traceback
import warnings
from dataclasses import dataclass, field

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.fx import Graph, GraphModule, Node
from torch.fx.node import map_aggregate, map_arg

from autopar import collectives as C
from autopar.examples.gpt import GPT, GPTConfig, example_inputs
import pool
from autopar.graph.capture import Captured, capture_pass
from autopar.graph.rules import RULES, Strategy, is_float
from autopar.passes.shard import shard_pass
from autopar.placement import Partial, R, Replicate, Shard, local_shape, shard_tensor
from autopar.planner.sharding import enumerate_strategies

aten = torch.ops.aten
RTOL, ATOL = 1e-5, 1e-6
WORLDS = (2, 4)
VARIANT_WORLDS = (2,)     # world sizes that also run the fromR / fromP resharding variants
BATCH, SEQ = 4, 12

# Strategies that are wrong in the library today, by case id ("tpN-" prefix optional: both world
# sizes). Strict xfail: once the rule is fixed the case XPASSes, which fails until it is removed here.
KNOWN_BUGS: dict[str, str] = {}


def _known_bug(case_id: str) -> str | None:
    """The reason a case is a known bug; the fromR / fromP variants share their base case's."""
    base = case_id.removesuffix("-fromR").removesuffix("-fromP")
    return KNOWN_BUGS.get(base) or KNOWN_BUGS.get(base.split("-", 1)[1])


# ---- case specs -----------------------------------------------------------------------------

@dataclass(frozen=True)
class _In:
    """Marker for input ``k`` inside an argument template."""
    k: int


@dataclass
class Case:
    id: str
    target: str                      # "aten.linear.default" or "getitem" (OpOverloads do not pickle)
    args: tuple
    kwargs: dict
    inputs: list                     # full tensors; a list of tensors for a tuple input (getitem)
    strategy: Strategy
    pieces: int | None = None        # multi-output op: number of getitem outputs
    partials: dict = field(default_factory=dict)   # input k -> per-rank summands (P inputs)
    cot: list = field(default_factory=list)        # cotangent per output (None for int outputs)
    check_values: bool = True        # False for ops with undefined values (aten.empty)
    sources: tuple | None = None     # placeholders' placements if not the strategy's inputs

    @property
    def placements(self):
        return self.sources or self.strategy.inputs


def _resolve(name: str):
    if name == "getitem":
        return operator.getitem
    ns, op, overload = name.split(".")
    return getattr(getattr(getattr(torch.ops, ns), op), overload)


def _target_name(target) -> str:
    return "getitem" if target is operator.getitem else str(target)


def _fill(template, values):
    return map_aggregate(template, lambda v: values[v.k] if isinstance(v, _In) else v)


def _val(node: Node):
    return node.meta.get("val")


def _is_tensor_val(v) -> bool:
    if isinstance(v, (list, tuple)):
        return len(v) > 0 and all(isinstance(t, torch.Tensor) for t in v)
    return isinstance(v, torch.Tensor)


def _gen_input(case_target, k, node_inputs, val, g: torch.Generator, target_node: Node):
    """A random full tensor for input ``k`` of the op, valid for what the op does with it."""
    if isinstance(val, (list, tuple)):
        return [_gen_input(case_target, k, node_inputs, v, g, target_node) for v in val]
    shape, dtype = tuple(val.shape), val.dtype
    if dtype.is_complex:
        return torch.randn(shape, generator=g, dtype=dtype)
    if dtype.is_floating_point:
        if case_target in (aten.div.Tensor, aten.rsqrt.default, aten.pow.Tensor_Scalar):
            return (torch.rand(shape, generator=g) + 0.5).to(dtype)
        return torch.randn(shape, generator=g).to(dtype)
    if dtype == torch.bool:
        return torch.rand(shape, generator=g) > 0.5
    if case_target is aten.embedding.default and k == 1:
        return torch.randint(0, tuple(_val(node_inputs[0]).shape)[0], shape, generator=g, dtype=dtype)
    if case_target is aten.cross_entropy_loss.default and k == 1:
        vocab = tuple(_val(node_inputs[0]).shape)[1]
        t = torch.randint(0, vocab, shape, generator=g, dtype=dtype)
        ignore = target_node.args[4] if len(target_node.args) > 4 else target_node.kwargs.get("ignore_index", -100)
        drop = torch.rand(shape, generator=g) < 0.25
        drop.view(-1)[0] = False                      # at least one counted target
        return t.masked_fill(drop, ignore)
    return torch.randint(-1, 96, shape, generator=g, dtype=dtype)   # e.g. a view of the targets


def _summands(full, size: int, g: torch.Generator):
    """Random per-rank summands of ``full`` (the last rank gets the remainder)."""
    if isinstance(full, list):
        per = [_summands(t, size, g) for t in full]
        return [[p[r] for p in per] for r in range(size)]
    if full.dtype.is_complex:
        parts = [torch.randn(full.shape, generator=g, dtype=full.dtype) for _ in range(size - 1)]
    elif full.dtype.is_floating_point:
        parts = [torch.randn(full.shape, generator=g).to(full.dtype) for _ in range(size - 1)]
    else:
        parts = [torch.randint(-5, 6, full.shape, generator=g, dtype=full.dtype) for _ in range(size - 1)]
    return parts + [full - sum(parts, torch.zeros_like(full))]


def _differentiable(t: torch.Tensor) -> bool:
    return t.is_floating_point() or t.is_complex()


def _dot(o: torch.Tensor, c: torch.Tensor) -> torch.Tensor:
    """The real loss <o, c> whose gradient the backward checks compare (complex: as pairs of reals)."""
    if o.is_complex():
        return (torch.view_as_real(o) * torch.view_as_real(c)).sum()
    return (o * c).sum()


def _reference_outputs(case: Case, inputs):
    out = _resolve(case.target)(*_fill(case.args, inputs), **_fill(case.kwargs, inputs))
    return list(out) if case.pieces else [out]


def make_case(cid: str, node: Node, strategy: Strategy, size: int, seed: int,
              placements=None) -> Case:
    """The spec of one (node, strategy) case; ``placements`` overrides the inputs' placements."""
    ins = node.all_input_nodes
    index = {n: k for k, n in enumerate(ins)}
    args = map_arg(node.args, lambda n: _In(index[n]))
    kwargs = map_arg(node.kwargs, lambda n: _In(index[n]))
    g = torch.Generator().manual_seed(seed)
    inputs = [_gen_input(node.target, k, ins, _val(i), g, node) for k, i in enumerate(ins)]
    val = _val(node)
    pieces = len(val) if isinstance(val, (list, tuple)) else None
    case = Case(cid, _target_name(node.target), args, kwargs, inputs, strategy, pieces,
                check_values=node.target is not aten.empty.memory_format, sources=placements)
    case.partials = {k: _summands(inputs[k], size, g) for k, p in enumerate(case.placements)
                     if isinstance(p, Partial)}
    with torch.no_grad():
        outs = _reference_outputs(case, inputs)
    case.cot = [_gen_input(None, 0, [], o, g, node) if _differentiable(o) else None for o in outs]
    return case


# ---- graphs the cases come from ---------------------------------------------------------------

def _gpt(vocab: int, attention: str = "sdpa") -> Captured:
    cfg = GPTConfig(vocab_size=vocab, block_size=16, n_layer=1, n_head=4, n_embd=32, attention=attention)
    torch.manual_seed(0)
    return capture_pass(GPT(cfg), example_inputs(cfg, BATCH, SEQ))


class _Zoo(nn.Module):
    """Pointwise, layout and attention ops as torch.export spells them for ordinary code."""

    def __init__(self):
        super().__init__()
        self.b = nn.Parameter(torch.randn(16))
        self.register_buffer("mask", torch.randn(SEQ, SEQ))
        self.register_buffer("mask4", torch.randn(1, 1, SEQ, SEQ))

    def forward(self, x, y):
        a = x - y
        b = x * self.b
        c = x * x
        d = x / y
        e = x / x
        f = (torch.relu(a) + F.silu(b) + torch.tanh(c) + (-d) + torch.rsqrt(e) + d.pow(2)
             + torch.exp(a) + torch.sigmoid(b))
        g = (f + 1.0) * 2.0 - 0.5
        h = g.to(torch.float64).to(torch.float32).clone()
        i = h.reshape(BATCH, SEQ * 16).view(BATCH * SEQ, 16).t().permute(1, 0)
        j, k = i.split([6, 10], dim=1)
        l0, l1 = torch.chunk(h, 2, dim=2)
        q = h.view(BATCH, SEQ, 2, 8).transpose(1, 2)
        att = F.scaled_dot_product_attention(q, q, q, attn_mask=self.mask)
        kv = g.view(BATCH, SEQ, 2, 8).transpose(1, 2)
        att = att + F.scaled_dot_product_attention(q, kv, kv * 2.0, attn_mask=self.mask4)
        m = torch.zeros(16) + torch.ones(16) + torch.full((16,), 2.0)
        z = torch.arange(3, 15, 1)
        return (j.sum() + k.sum() + l0.sum() + l1.sum() + m.sum() + z.sum() + h.type_as(x).sum()
                + x.detach().sum() + att.sum())


def _zoo() -> Captured:
    torch.manual_seed(0)
    return capture_pass(_Zoo(), (torch.randn(BATCH, SEQ, 16), torch.rand(BATCH, SEQ, 16) + 0.5))


class _Library(nn.Module):
    """The ops of Hugging Face GPT-2 and Llama layers (written out, so no transformers needed):
    Conv1D's addmm with an [in, out] weight, rotary embedding, RMSNorm, repeat_kv of
    grouped-query attention, the label shift, an embedding with a padding row."""

    def __init__(self):
        super().__init__()
        self.w = nn.Parameter(torch.randn(16, 24))
        self.b = nn.Parameter(torch.randn(24))
        self.emb = nn.Embedding(10, 16, padding_idx=0)
        self.norm = nn.Parameter(torch.ones(16))

    def forward(self, x, ids, labels):
        h = torch.addmm(self.b, x.view(-1, 16), self.w).view(BATCH, SEQ, 24)
        q = h.view(BATCH, SEQ, 4, 6).transpose(1, 2)
        rot = torch.cat([-q[..., 3:], q[..., :3]], dim=-1)
        q = q * torch.cos(q) + rot * torch.sin(q)
        n = self.norm * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6))
        rep = q[:, :2, None].expand(BATCH, 2, 2, SEQ, 6).reshape(BATCH, 4, SEQ, 6)
        shifted = F.pad(labels, (0, 1), value=-100)[:, 1:]
        wide = x.to("cpu", torch.float64)
        loss = F.cross_entropy(F.linear(n, self.emb.weight).reshape(-1, 10), shifted.reshape(-1))
        return loss + (q * rep).sum() + x.mean(dim=[1]).sum() + self.emb(ids).sum() + x.type_as(wide).sum()


def _library() -> Captured:
    torch.manual_seed(0)
    return capture_pass(_Library(), (torch.randn(BATCH, SEQ, 16), torch.randint(0, 10, (BATCH, SEQ)),
                                     torch.randint(0, 10, (BATCH, SEQ))))


def _hand() -> Captured:
    """Ops with rules that torch.export does not emit for ordinary code, built by hand."""
    g = Graph()
    x = g.placeholder("x")
    vals = {x: torch.randn(BATCH, SEQ, 16)}

    def op(target, *args, **kwargs):
        n = g.call_function(target, args, kwargs)
        vals[n] = target(*map_arg(args, vals.__getitem__), **map_arg(kwargs, vals.__getitem__))
        return n

    outs = [op(aten.add.Scalar, x, 1.5), op(aten.mul.Scalar, x, 3.0),
            op(aten._to_copy.default, x, dtype=torch.float64), op(aten.contiguous.default, x),
            op(aten.alias.default, x), op(aten._unsafe_view.default, x, [BATCH * SEQ, 16]),
            op(aten.dropout.default, x, 0.0, True), op(aten.gelu.default, x, approximate="tanh"),
            op(aten.arange.default, SEQ), op(aten.arange.start, 2, 2 + SEQ),
            op(aten.empty.memory_format, [16]), op(aten.ones.default, [16]),
            op(aten.to.dtype_layout, x, dtype=torch.float64, layout=torch.strided, device=torch.device("cpu")),
            op(aten.pad.default, x, [0, 2], "constant", 0.5)]
    xt = op(aten.transpose.int, x, 1, 2)
    outs += [op(aten.bmm.default, x, xt), op(aten._softmax.default, x, -1, False),
             op(aten.log_softmax.int, x, -1), op(aten._log_softmax.default, x, -1, False),
             op(aten.eq.Scalar, x, 0.0)]
    sp = op(aten.split.Tensor, x, 8, 2)
    outs += [op(operator.getitem, sp, 0), op(operator.getitem, sp, 1)]
    g.output(tuple(outs))
    for n, v in vals.items():
        n.meta["val"] = v
    return Captured(GraphModule(nn.Module(), g), {}, {}, [x])


SOURCES = {"gpt96": lambda: _gpt(96), "gpt95": lambda: _gpt(95), "gptx": lambda: _gpt(96, "explicit"),
           "zoo": _zoo, "library": _library, "hand": _hand}


@functools.lru_cache(maxsize=None)
def _captured(name: str) -> Captured:
    return SOURCES[name]()


def _strategy_key(s: Strategy) -> str:
    return str(s).replace(" ", "")


@functools.lru_cache(maxsize=None)
def cases(size: int) -> tuple[Case, ...]:
    """One case per distinct (op, arguments, input shapes, strategy) over all sources."""
    out, seen = [], set()
    for src in SOURCES:
        cap = _captured(src)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            options = enumerate_strategies(cap, size, "auto")
        for node in cap.gm.graph.nodes:
            if node.op != "call_function" or not _is_tensor_val(_val(node)):
                continue
            ins = node.all_input_nodes
            for s in options[node]:
                sig = (str(node.target), str(map_arg(node.args, lambda n: ins.index(n))),
                       str(node.kwargs), tuple(_sig_val(_val(i)) for i in ins), _sig_val(_val(node)), str(s))
                if sig in seen:
                    continue
                seen.add(sig)
                cid = f"tp{size}-{src}-{node.name}-{_strategy_key(s)}"
                out.append(make_case(cid, node, s, size, seed=len(out)))
                for suffix, sources in _reshard_variants(s, ins, size):
                    out.append(make_case(cid + suffix, node, s, size, seed=len(out), placements=sources))
    return tuple(out)


def _reshard_variants(s: Strategy, ins: list[Node], size: int):
    """The same strategy fed from replicated / partial producers, so the rewrite inserts the
    split, reduce-scatter and all-reduce (+ copy_to) steps of ``reshard_steps`` in front of it.

    Only at tp=2 (runtime), and not for tuple inputs (the planner never reshards those)."""
    if size not in VARIANT_WORLDS or any(isinstance(_val(i), (list, tuple)) for i in ins):
        return []
    from_r = tuple(p if isinstance(p, Partial) else R for p in s.inputs)
    from_p = tuple(Partial() if is_float(i) else p for p, i in zip(s.inputs, ins))
    return [(sfx, src) for sfx, src in (("-fromR", from_r), ("-fromP", from_p)) if src != s.inputs]


def _sig_val(v):
    if isinstance(v, (list, tuple)):
        return tuple(_sig_val(t) for t in v)
    return (tuple(v.shape), v.dtype) if isinstance(v, torch.Tensor) else repr(v)


# ---- the rank side ----------------------------------------------------------------------------

def _one_op_graph(case: Case):
    """The global one-op graph of a case and the strategy of every node in it."""
    g = Graph()
    phs = []
    for k, t in enumerate(case.inputs):
        ph = g.placeholder(f"in{k}")
        ph.meta["val"] = t
        phs.append(ph)
    node = g.call_function(_resolve(case.target), _fill(case.args, phs), _fill(case.kwargs, phs))
    with torch.no_grad():
        outs = _reference_outputs(case, case.inputs)
    node.meta["val"] = outs if case.pieces else outs[0]
    strategies = {ph: Strategy((), p) for ph, p in zip(phs, case.placements)}
    strategies[node] = case.strategy
    if case.pieces:
        items = []
        for i in range(case.pieces):
            it = g.call_function(operator.getitem, (node, i))
            it.meta["val"] = outs[i]
            strategies[it] = Strategy((case.strategy.output,), case.strategy.output)
            items.append(it)
        g.output(tuple(items))
    else:
        g.output(node)
    return GraphModule(nn.Module(), g), strategies


def _local_input(case: Case, k: int, size: int, rank: int):
    p, full = case.placements[k], case.inputs[k]
    if isinstance(p, Partial):
        t = case.partials[k][rank]
        return [x.clone() for x in t] if isinstance(t, list) else t.clone()
    if isinstance(full, list):
        return [shard_tensor(x, p, size, rank) for x in full]
    return shard_tensor(full, p, size, rank)


def _leaves(t):
    if isinstance(t, list):
        return [_leaves(x) for x in t]
    return t.detach().clone().requires_grad_(_differentiable(t))


def _grads(inputs):
    return [[x.grad for x in t] if isinstance(t, list) else t.grad for t in inputs]


def run_case(case: Case, size: int, rank: int, group: str) -> dict:
    gm, strategies = _one_op_graph(case)
    local = shard_pass(gm, strategies=strategies, size=size, rank=rank, group=group)
    inputs = [_leaves(_local_input(case, k, size, rank)) for k in range(len(case.inputs))]
    # also return the op's own local outputs: the output's arguments before the inserted collectives
    out_node = next(n for n in local.graph.nodes if n.op == "output")
    outs = list(out_node.args[0]) if case.pieces else [out_node.args[0]]
    pre = []
    for n in outs:
        while n.op == "call_function" and n.target in C.COLLECTIVE_FUNCTIONS:
            n = n.args[0]
        pre.append(n)
    out_node.args = (tuple(outs) + tuple(pre),)
    local.recompile()
    res = local(*inputs)
    outs, pre = list(res[:len(outs)]), list(res[len(outs):])
    result = {"out": [o.detach() for o in outs], "local": [v.detach() for v in pre], "grads": None}
    terms = [_dot(o, c) for o, c in zip(outs, case.cot)
             if c is not None and o.requires_grad and o.shape == c.shape]
    if any(c is not None and o.shape != c.shape for o, c in zip(outs, case.cot)):
        result["bwd_error"] = "output shape differs from the unsharded op's; backward skipped"
    elif terms:
        try:   # a backward failure must not hide the forward verdict
            sum(terms).backward()
            result["grads"] = _grads(inputs)
        except Exception:
            result["bwd_error"] = traceback.format_exc(limit=-3)
    return result


def rank_main(rank: int, world: int, case_list) -> list[dict]:
    """Spawned on every rank: run every case, never raise (errors are per case).

    A case that raises does so on every rank at the same op (local shapes are the same on
    all ranks, padding included), so the ranks' collectives stay paired for the next case."""
    torch.manual_seed(1234)
    group = dist.group.WORLD.group_name
    out = []
    for case in case_list:
        try:
            out.append(run_case(case, world, rank, group))
        except Exception:
            out.append({"error": traceback.format_exc(limit=-4)})
    return out


# ---- comparison in the parent ----------------------------------------------------------------

def _ratio(a: torch.Tensor, b: torch.Tensor, mask=None) -> tuple[float, float]:
    """(max |a-b| / tolerance, max |a-b|); inf when shapes differ or a NaN appears.

    tolerance = atol * max(1, max |b|) + rtol * |b|: the inputs are unit-scale random
    tensors, so a sharded reduction (row-parallel linear, partial weight gradients) sums
    up to 128 terms of size ~10 in another order and differs by ~1e-5 in fp32 where the
    result happens to cancel to ~0; atol is scaled by the tensor's magnitude for that."""
    if tuple(a.shape) != tuple(b.shape):
        return float("inf"), float("inf")
    if b.is_complex():   # compare real and imaginary parts alike
        a, b = torch.view_as_real(a), torch.view_as_real(b)
        mask = mask if mask is None else mask.unsqueeze(-1).expand(b.shape)
    a, b = a.double(), b.double()
    diff = torch.where(a == b, torch.zeros_like(a), (a - b).abs())   # equal infinities (masked scores) agree
    b = torch.where(torch.isinf(b), torch.zeros_like(b), b)
    if mask is not None:
        diff = diff[mask]
        b = b[mask]
    if diff.numel() == 0:
        return 0.0, 0.0
    if torch.isnan(diff).any():
        return float("inf"), float("inf")
    tol = ATOL * max(1.0, float(b.abs().max())) + RTOL * b.abs()
    return float((diff / tol).max()), float(diff.max())


def _reference(case: Case):
    inputs = [_leaves(t) for t in case.inputs]
    outs = _reference_outputs(case, inputs)
    terms = [_dot(o, c) for o, c in zip(outs, case.cot) if c is not None and o.requires_grad]
    if terms:
        sum(terms).backward()
    grads = _grads(inputs)
    return [o.detach() for o in outs], inputs, grads


def _check_grad(name, p, full_grad, leaf, rank_grads, size, errs):
    """Each rank's gradient of one input against the unsharded gradient, per its placement."""
    if not _differentiable(leaf):
        return
    ref = full_grad if full_grad is not None else torch.zeros_like(leaf)
    for r, gr in enumerate(rank_grads):
        if isinstance(p, Shard):
            want = shard_tensor(ref, p, size, r)
            real = shard_tensor(torch.ones(ref.shape, dtype=torch.bool), p, size, r)
            got = gr if gr is not None else torch.zeros_like(want)
            errs.append((f"grad {name} rank {r} ({p})", *_ratio(got, want, real)))
            if got.shape == want.shape and (got.detach()[~real] != 0).any():
                errs.append((f"grad {name} rank {r}: padding gets a nonzero gradient", float("inf"),
                             float(got.detach()[~real].abs().max())))
        else:   # R: already the full gradient; P: a partial input's gradient is the full one
            got = gr if gr is not None else torch.zeros_like(ref)
            errs.append((f"grad {name} rank {r} ({p})", *_ratio(got, ref)))


def compare(case: Case, per_rank: list[dict], size: int) -> dict:
    """Per-case verdict: forward and backward worst ratios and the failing checks."""
    for r, res in enumerate(per_rank):
        if "out" not in res:
            return {"ok": False, "fwd": float("inf"), "bwd": float("inf"),
                    "failures": [f"rank {r} raised:\n{res['error']}"]}
    ref_outs, leaves, ref_grads = _reference(case)
    fwd, bwd = [], []
    out_pl = case.strategy.output
    for i, ref in enumerate(ref_outs):
        for r, res in enumerate(per_rank):
            if case.check_values:
                fwd.append((f"output {i} rank {r}", *_ratio(res["out"][i], ref)))
            elif tuple(res["out"][i].shape) != tuple(ref.shape):
                fwd.append((f"output {i} rank {r} shape", float("inf"), float("inf")))
            loc = res["local"][i]
            want_shape = local_shape(ref.shape, out_pl, size)
            if tuple(loc.shape) != tuple(want_shape):
                fwd.append((f"local output {i} rank {r}: shape {tuple(loc.shape)}, "
                            f"{out_pl} wants {tuple(want_shape)}", float("inf"), float("inf")))
            elif case.check_values and isinstance(out_pl, Shard):
                real = shard_tensor(torch.ones(ref.shape, dtype=torch.bool), out_pl, size, r)
                fwd.append((f"local output {i} rank {r} ({out_pl})",
                            *_ratio(loc, shard_tensor(ref, out_pl, size, r), real)))
            elif case.check_values and isinstance(out_pl, Replicate):
                fwd.append((f"local output {i} rank {r} (R)", *_ratio(loc, ref)))
    for r, res in enumerate(per_rank):
        if "bwd_error" in res:
            bwd.append((f"backward on rank {r}: {res['bwd_error']}", float("inf"), float("inf")))
    if any(c is not None for c in case.cot) and not bwd:
        for k, (p, leaf) in enumerate(zip(case.placements, leaves)):
            rank_grads = [res["grads"][k] if res["grads"] is not None else None for res in per_rank]
            if isinstance(leaf, list):
                for j, lf in enumerate(leaf):
                    _check_grad(f"input {k}[{j}]", p, ref_grads[k][j], lf,
                                [g[j] if g is not None else None for g in rank_grads], size, bwd)
            else:
                _check_grad(f"input {k}", p, ref_grads[k], leaf, rank_grads, size, bwd)
    worst = lambda errs: max((e[1] for e in errs), default=0.0)   # noqa: E731
    failures = [f"{what}: error/tolerance {ratio:.3g}, max abs error {abs_:.3g}"
                for what, ratio, abs_ in fwd + bwd if not ratio <= 1.0]
    return {"ok": not failures, "fwd": worst(fwd), "bwd": worst(bwd),
            "fwd_abs": max((e[2] for e in fwd), default=0.0),
            "bwd_abs": max((e[2] for e in bwd), default=0.0), "failures": failures}


# ---- sanity cases: the harness must catch wrong strategies --------------------------------------

@dataclass(frozen=True)
class _NoReduce(Strategy):
    """A strategy that forgets its replicated inputs' gradients are per-rank partials."""

    def divergent(self, i: int) -> bool:
        return False


def _find(cap: Captured, target, module_path: str) -> Node:
    return next(n for n in cap.gm.graph.nodes
                if n.target is target and n.meta.get("module_path") == module_path)


@functools.lru_cache(maxsize=None)
def sanity_cases() -> tuple[Case, ...]:
    cap = _captured("gpt96")
    fc = _find(cap, aten.linear.default, "transformer.h.0.mlp.c_fc")
    mul = next(n for n in _captured("zoo").gm.graph.nodes
               if n.target is aten.mul.Tensor and len(n.all_input_nodes) == 2
               and n.all_input_nodes[0].op == "placeholder")
    S = Shard
    return (
        # the brief's: token-sharded x with a replicated weight claimed to give feature shards
        make_case("wrong-shape", fc, Strategy((S(1), R), S(2), 2), 2, seed=1),
        # right shapes, wrong values: row-parallel partial sums claimed replicated (no all-reduce)
        make_case("wrong-values", fc, Strategy((S(2), S(1)), R, 2), 2, seed=2),
        # x * w with both partial is not partial
        make_case("wrong-partial", mul, Strategy((Partial(), Partial()), Partial()), 2, seed=3),
        # right forward, partial weight gradient never summed (a missing copy_to)
        make_case("wrong-grad", fc, _NoReduce((S(1), R), S(1), 2), 2, seed=4),
    )


# ---- running and caching ----------------------------------------------------------------------

def _todo(size: int) -> list[Case]:
    return list(cases(size)) + (list(sanity_cases()) if size == 2 else [])


JOBS = {size: pool.job(size, rank_main, timeout=240, lazy=lambda size=size: (_todo(size),)) for size in (2, 4)}


@functools.lru_cache(maxsize=None)
def results(size: int) -> dict[str, dict]:
    """Run every case of one world size (plus the sanity cases at 2) in the session's pool; verdicts by id."""
    todo = _todo(size)
    per_rank = JOBS[size].result()
    return {c.id: compare(c, [per_rank[r][i] for r in range(size)], size) for i, c in enumerate(todo)}


def _params(size: int):
    out = []
    for c in cases(size):
        why = _known_bug(c.id)
        marks = [pytest.mark.xfail(strict=True, reason=why)] if why else []
        out.append(pytest.param(c.id, id=c.id, marks=marks))
    return out


def pytest_generate_tests(metafunc):
    if "rule_case" in metafunc.fixturenames:
        size = metafunc.function.world
        metafunc.parametrize("rule_case", _params(size))


def _check(case_id: str, size: int):
    v = results(size)[case_id]
    assert v["ok"], f"{case_id}:\n  " + "\n  ".join(v["failures"][:8])


def test_rule_tp2(rule_case):
    _check(rule_case, 2)


test_rule_tp2.world = 2


def test_rule_tp4(rule_case):
    _check(rule_case, 4)


test_rule_tp4.world = 4


# ---- the harness can fail ---------------------------------------------------------------------

def test_harness_catches_wrong_shape():
    v = results(2)["wrong-shape"]
    assert not v["ok"] and v["fwd"] == float("inf"), v


def test_harness_catches_wrong_values():
    v = results(2)["wrong-values"]
    assert not v["ok"] and 1.0 < v["fwd"] < float("inf"), v
    assert v["bwd"] <= 1.0, v                    # its gradients are right: only the values are off


def test_harness_catches_wrong_partial():
    v = results(2)["wrong-partial"]
    assert not v["ok"] and v["fwd"] > 1.0, v


def test_harness_catches_unreduced_gradient():
    v = results(2)["wrong-grad"]
    assert v["fwd"] <= 1.0, v                    # the forward is right...
    assert not v["ok"] and v["bwd"] > 1.0, v     # ...the weight gradient is a per-rank partial
    assert any("input 1" in f for f in v["failures"]), v


def test_every_rule_is_exercised():
    """Every op with a rule appears in some case (the brute force covers all of RULES)."""
    seen = {c.target for size in WORLDS for c in cases(size)}
    missing = sorted(_target_name(t) for t in RULES if _target_name(t) not in seen)
    assert not missing, f"rules without a case: {missing}"


def test_known_bugs_name_real_cases():
    ids = {c.id for size in WORLDS for c in cases(size)}
    stale = [k for k in KNOWN_BUGS if k not in ids and not any(i.split("-", 1)[1] == k for i in ids)]
    assert not stale, f"KNOWN_BUGS entries that match no case (renamed?): {stale}"


def test_counts():
    for size in WORLDS:
        assert len(cases(size)) > 100, (size, len(cases(size)))


# ---- coverage of the GPT's ops and the no-rule fallback -----------------------------------------

def test_gpt_ops_all_have_rules():
    for name in ("gpt96", "gpt95"):
        cap = _captured(name)
        missing = sorted({str(n.target) for n in cap.gm.graph.nodes
                          if n.op == "call_function" and n.target not in RULES})
        assert not missing, f"{name}: ops that would fall back to replicate-only: {missing}"
        with warnings.catch_warnings():
            warnings.simplefilter("error")           # no "no sharding rule" warning either
            enumerate_strategies(cap, 2, "auto")


class _CumsumInner(nn.Module):
    def forward(self, x):
        return torch.cumsum(x, dim=1)


class _CumsumModel(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(8, 8)
        self.blk = nn.Sequential(_CumsumInner())

    def forward(self, x):
        return self.blk(self.lin(x))


def test_op_without_rule_warns_and_replicates():
    cap = capture_pass(_CumsumModel(), (torch.randn(2, 6, 8),))
    with pytest.warns(UserWarning, match=r"no sharding rule for aten\.cumsum\.default in blk\.0"):
        options = enumerate_strategies(cap, 2, "auto")
    node = next(n for n in cap.gm.graph.nodes if n.target is aten.cumsum.default)
    assert options[node] == [Strategy((R,), R)]


# ---- interleaved-pair RoPE (Meta's Llama): complex, stack and unbind spellings ------------------

class _Rope(nn.Module):
    """The ops of rotary embedding over (even, odd) feature pairs, as torch.export spells them:
    view_as_complex / complex mul / view_as_real / flatten, the real form's select and stack,
    and the unflatten / unbind way of taking the pairs apart."""

    def __init__(self):
        super().__init__()
        self.w = nn.Parameter(torch.randn(32, 32))
        angles = torch.outer(torch.arange(SEQ).float(), torch.rand(4))                  # (T, hd/2)
        self.register_buffer("freqs_cis", torch.polar(torch.ones_like(angles), angles))  # complex

    def forward(self, x, y):                                               # (B, T, 32) each
        q = F.linear(x, self.w).view(BATCH, SEQ, 4, 8)                     # (B, T, H, hd)
        c = torch.view_as_complex(q.reshape(BATCH, SEQ, 4, 4, 2))          # (B, T, H, hd/2) complex
        rot = torch.view_as_real(c * self.freqs_cis.view(1, SEQ, 1, 4)).flatten(3)   # (B, T, H, hd)
        other = torch.view_as_complex(y.unflatten(-1, (4, 4, 2)))          # (B, T, H, hd/2) complex
        mixed = torch.view_as_real(c * other)                              # (B, T, H, hd/2, 2)
        pairs = q.unflatten(-1, (-1, 2))                                   # (B, T, H, hd/2, 2)
        x1, x2 = pairs[..., 0], pairs[..., 1]                              # (B, T, H, hd/2)
        e1, e2 = pairs.unbind(-1)
        last = torch.stack((x1 * e2 - x2, x1 + e1), -1).flatten(-2)        # (B, T, H, hd)
        middle = torch.stack((x1, x2), 1)                                  # (B, 2, T, H, hd/2)
        head = q.select(2, 1)                                              # (B, T, hd)
        return rot.sum() + mixed.sum() + last.sum() + middle.sum() + head.sum()


def _rope() -> Captured:
    torch.manual_seed(0)
    return capture_pass(_Rope(), (torch.randn(BATCH, SEQ, 32), torch.randn(BATCH, SEQ, 32)))


SOURCES["rope"] = _rope


def test_rope_ops_have_sharded_strategies():
    """Every op of the interleaved RoPE forms has a rule, and it offers sharded strategies."""
    cap = _captured("rope")
    rope_ops = {aten.view_as_complex.default, aten.view_as_real.default, aten.flatten.using_ints,
                aten.unflatten.int, aten.select.int, aten.unbind.int, aten.stack.default}
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        options = enumerate_strategies(cap, 2, "auto")
    assert not [str(w.message) for w in caught if any(str(t) in str(w.message) for t in rope_ops)]
    nodes = [n for n in cap.gm.graph.nodes if n.target in rope_ops]
    assert {n.target for n in nodes} == rope_ops
    for n in nodes:
        assert any(isinstance(s.output, Shard) for s in options[n]), (n.name, [str(s) for s in options[n]])


# ---- grouped-query attention's repeat_interleave and torch's RMSNorm ----------------------------

class _Gqa(nn.Module):
    """Grouped-query attention's key/value heads repeated by ``repeat_interleave`` (on the heads, and
    flattened; a chunk makes two interleaved groups a strategy too), and torch's RMSNorm with and
    without a weight, over a dim that tp=2 splits unevenly."""

    def __init__(self):
        super().__init__()
        self.w = nn.Parameter(torch.randn(32, 32))
        self.norm = nn.Parameter(torch.rand(16) + 0.5)

    def forward(self, x, y):                                               # (B, T, 32), (B, T, 3, 16)
        kv = F.linear(x, self.w).view(BATCH, SEQ, 4, 8).transpose(1, 2)    # (B, 4 kv heads, T, hd)
        heads = kv.repeat_interleave(2, dim=1)                             # (B, 8 heads, T, hd)
        first, second = kv.chunk(2, dim=1)
        flat = kv.repeat_interleave(2)                                     # (B * 4 * T * hd * 2,)
        plain = F.rms_norm(x, (32,))
        weighted = F.rms_norm(y, (16,), self.norm, 1e-6)
        return heads.sum() + first.sum() + second.sum() + flat.sum() + plain.sum() + weighted.sum()


def _gqa() -> Captured:
    torch.manual_seed(0)
    return capture_pass(_Gqa(), (torch.randn(BATCH, SEQ, 32), torch.randn(BATCH, SEQ, 3, 16)))


SOURCES["gqa"] = _gqa


def test_gqa_ops_have_sharded_strategies():
    """repeat_interleave keeps each rank's key/value heads (plain and interleaved), and torch's
    RMSNorm runs on sequence shards: both have a rule with the strategies that matter."""
    cap = _captured("gqa")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        options = enumerate_strategies(cap, 2, "auto")
    assert not [str(w.message) for w in caught if "no sharding rule" in str(w.message)]
    heads = next(n for n in cap.gm.graph.nodes if n.target is aten.repeat_interleave.self_int)
    assert {str(s) for s in options[heads]} >= {"(S(1)) -> S(1)", "(S(1)i2) -> S(1)i2", "(P) -> P"}
    norms = [n for n in cap.gm.graph.nodes if n.target is aten.rms_norm.default]
    assert len(norms) == 2 and all(any(s.output == Shard(1) for s in options[n]) for n in norms)
