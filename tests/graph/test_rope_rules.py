"""Interleaved-pair RoPE, as Meta's original Llama writes it, plans like rotate-half RoPE.

Meta's code rotates (even, odd) pairs of each head's features, either through complex
numbers (``view_as_complex(x.reshape(..., -1, 2)) * freqs_cis`` then ``view_as_real(...)
.flatten(3)``) or through ``torch.stack((x1*cos - x2*sin, x1*sin + x2*cos), -1).flatten(-2)``.
Without rules for those ops the planner replicates them, gathers the heads in front of them
and picks an odd layout around them. These tests plan a Llama-style model written that way
offline (meta device, links nearly free so the solver shards all it can) and check it finds
Megatron's layout at the rotate-half model's predicted step time; then run the two
interleaved forms on 2 gloo ranks against the unsharded model.
"""
from __future__ import annotations

import dataclasses
import functools
import json
import warnings

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import autopar
from autopar.cost_model.strategy import OP_OVERHEAD
from autopar.cost_model.devices import get_device
import pool

FORMS = ("half", "stack", "complex")


@dataclasses.dataclass(frozen=True)
class Config:
    vocab: int = 64
    dim: int = 32
    n_heads: int = 4
    n_layers: int = 2
    max_seq: int = 16

    @property
    def head_dim(self) -> int:
        return self.dim // self.n_heads


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float = 1e-6):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def _norm(self, x):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)

    def forward(self, x):
        return self._norm(x.float()).type_as(x) * self.weight


def rotary_tables(cfg: Config):
    """Angles (max_seq, head_dim/2) of each (position, pair): freqs_cis = e^{i angle}."""
    freqs = 1.0 / (10000.0 ** (torch.arange(0, cfg.head_dim, 2).float() / cfg.head_dim))
    return torch.outer(torch.arange(cfg.max_seq).float(), freqs)


def rope_complex(x, freqs_cis):
    """x (B, T, H, hd); freqs_cis (T, hd/2) complex: Meta's apply_rotary_emb."""
    x_ = torch.view_as_complex(x.float().reshape(*x.shape[:-1], -1, 2))   # (B, T, H, hd/2)
    freqs_cis = freqs_cis.view(1, x_.shape[1], 1, x_.shape[-1])          # (1, T, 1, hd/2)
    return torch.view_as_real(x_ * freqs_cis).flatten(3).type_as(x)      # (B, T, H, hd)


def rope_stack(x, cos, sin):
    """x (B, T, H, hd); cos, sin (T, hd/2): the same rotation of (even, odd) pairs in reals."""
    pairs = x.float().reshape(*x.shape[:-1], -1, 2)                      # (B, T, H, hd/2, 2)
    x1, x2 = pairs[..., 0], pairs[..., 1]                                # (B, T, H, hd/2) each
    cos, sin = cos.view(1, x.shape[1], 1, -1), sin.view(1, x.shape[1], 1, -1)
    out = torch.stack((x1 * cos - x2 * sin, x1 * sin + x2 * cos), -1)    # (B, T, H, hd/2, 2)
    return out.flatten(-2).type_as(x)                                    # (B, T, H, hd)


def rope_half(x, cos, sin):
    """x (B, T, H, hd); cos, sin (T, hd/2): rotate-half RoPE (first half against second half)."""
    cos = torch.cat((cos, cos), -1).view(1, x.shape[1], 1, -1)           # (1, T, 1, hd)
    sin = torch.cat((sin, sin), -1).view(1, x.shape[1], 1, -1)
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), -1)             # (B, T, H, hd)
    return x * cos + rotated * sin


class Attention(nn.Module):
    def __init__(self, cfg: Config, form: str):
        super().__init__()
        self.n_heads, self.head_dim, self.form = cfg.n_heads, cfg.head_dim, form
        self.wq = nn.Linear(cfg.dim, cfg.dim, bias=False)
        self.wk = nn.Linear(cfg.dim, cfg.dim, bias=False)
        self.wv = nn.Linear(cfg.dim, cfg.dim, bias=False)
        self.wo = nn.Linear(cfg.dim, cfg.dim, bias=False)

    def forward(self, x, freqs_cis, cos, sin):
        bsz, seqlen, _ = x.shape                                         # x (B, T, dim)
        xq = self.wq(x).view(bsz, seqlen, self.n_heads, self.head_dim)   # (B, T, H, hd)
        xk = self.wk(x).view(bsz, seqlen, self.n_heads, self.head_dim)
        xv = self.wv(x).view(bsz, seqlen, self.n_heads, self.head_dim)
        if self.form == "complex":
            xq, xk = rope_complex(xq, freqs_cis), rope_complex(xk, freqs_cis)
        elif self.form == "stack":
            xq, xk = rope_stack(xq, cos, sin), rope_stack(xk, cos, sin)
        else:
            xq, xk = rope_half(xq, cos, sin), rope_half(xk, cos, sin)
        out = F.scaled_dot_product_attention(xq.transpose(1, 2), xk.transpose(1, 2), xv.transpose(1, 2),
                                             is_causal=True)             # (B, H, T, hd)
        return self.wo(out.transpose(1, 2).contiguous().view(bsz, seqlen, -1))


class TransformerBlock(nn.Module):
    def __init__(self, cfg: Config, form: str):
        super().__init__()
        self.attention = Attention(cfg, form)
        self.attention_norm = RMSNorm(cfg.dim)
        self.ffn_norm = RMSNorm(cfg.dim)
        self.w1 = nn.Linear(cfg.dim, 4 * cfg.dim, bias=False)
        self.w2 = nn.Linear(4 * cfg.dim, cfg.dim, bias=False)
        self.w3 = nn.Linear(cfg.dim, 4 * cfg.dim, bias=False)

    def forward(self, x, freqs_cis, cos, sin):
        h = x + self.attention(self.attention_norm(x), freqs_cis, cos, sin)
        n = self.ffn_norm(h)
        return h + self.w2(F.silu(self.w1(n)) * self.w3(n))


class Llama(nn.Module):
    """Meta-style Llama whose forward returns the loss; ``form`` picks the RoPE spelling."""

    def __init__(self, cfg: Config, form: str):
        super().__init__()
        self.tok_embeddings = nn.Embedding(cfg.vocab, cfg.dim)
        self.layers = nn.ModuleList(TransformerBlock(cfg, form) for _ in range(cfg.n_layers))
        self.norm = RMSNorm(cfg.dim)
        self.output = nn.Linear(cfg.dim, cfg.vocab, bias=False)
        angles = rotary_tables(cfg)
        self.register_buffer("freqs_cis", torch.polar(torch.ones_like(angles), angles), persistent=False)
        self.register_buffer("cos", angles.cos(), persistent=False)
        self.register_buffer("sin", angles.sin(), persistent=False)

    def forward(self, tokens, targets):                                  # (B, T) each
        seqlen = tokens.shape[1]
        h = self.tok_embeddings(tokens)                                  # (B, T, dim)
        freqs_cis, cos, sin = self.freqs_cis[:seqlen], self.cos[:seqlen], self.sin[:seqlen]
        for layer in self.layers:
            h = layer(h, freqs_cis, cos, sin)
        logits = self.output(self.norm(h))                               # (B, T, vocab)
        return F.cross_entropy(logits.view(-1, logits.shape[-1]), targets.view(-1))


# ---- offline plans: Megatron's layout, at rotate-half's predicted time ---------------------------

# Llama-7B-shaped layers (two of them): large enough that matmuls, not the RoPE kernels' few
# elementwise passes, set the step time, as in the models people plan.
PLAN_CFG = Config(vocab=32000, dim=4096, n_heads=32, n_layers=2, max_seq=2048)
# links nearly free, so the solver shards everything it can (on real links a tiny model stays replicated)
FREE_LINKS = dataclasses.replace(get_device("h100"), intra_node_bw=1e15, inter_node_bw=1e15,
                                 intra_node_latency=0.0, inter_node_latency=0.0, collective_fits=())
ROPE_OPS = {"aten.view_as_complex.default", "aten.view_as_real.default", "aten.flatten.using_ints",
            "aten.stack.default", "aten.select.int"}


@functools.lru_cache(maxsize=None)
def _offline(form: str, tp: int):
    """(plan, warnings) of the Meta-style Llama built on the meta device."""
    with torch.device("meta"):
        model = Llama(PLAN_CFG, form)
    tokens = torch.zeros(1, PLAN_CFG.max_seq, dtype=torch.long, device="meta")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        plan = autopar.plan(model, (1, 1, tp), (tokens, tokens), device=FREE_LINKS)
    return plan, [str(w.message) for w in caught]


@pytest.mark.parametrize("tp", [2, 4])
@pytest.mark.parametrize("form", ["stack", "complex"])
def test_interleaved_rope_plans_like_rotate_half(form, tp):
    plan, caught = _offline(form, tp)
    assert caught == [], caught
    tp_of = {p.fqn: p.placements["tp"] for p in plan.parameters}
    for i in range(PLAN_CFG.n_layers):
        block = f"layers.{i}"
        for name in ("wq", "wk", "wv"):   # column parallel: whole heads per rank, not interleaved
            assert tp_of[f"{block}.attention.{name}.weight"] == "S(0)", (name, tp_of)
        assert tp_of[f"{block}.attention.wo.weight"] == "S(1)", tp_of
        assert tp_of[f"{block}.w1.weight"] == tp_of[f"{block}.w3.weight"] == "S(0)", tp_of
        assert tp_of[f"{block}.w2.weight"] == "S(1)", tp_of
        for norm in ("attention_norm", "ffn_norm"):
            assert tp_of[f"{block}.{norm}.weight"] == "R", tp_of
    assert tp_of["norm.weight"] == "R"
    # the rotation itself runs on each rank's heads: (B, T, H, ...) sharded on H, nothing gathered for it
    rope = [n for n in plan.nodes if n.op in ROPE_OPS and n.module.startswith("layers.")]
    assert rope and all(n.output == "S(2)" for n in rope), [(n.name, n.output) for n in rope]
    inside = [c for c in plan.collectives if c.axis == "tp" and c.phase == "fwd"
              and c.where in {f"layers.{i}.attention" for i in range(PLAN_CFG.n_layers)}]
    assert inside == [], inside   # the attention's own ops (RoPE, sdpa, views) move nothing
    half, _ = _offline("half", tp)
    # the forms differ in how many ops they take, and each op's launch is priced: compare the rest
    def work(p):
        return p.predicted_step_time - OP_OVERHEAD * len(p.nodes)
    assert work(plan) == pytest.approx(work(half), rel=0.01)


# ---- the no-rule warning: one per op kind, from rank 0, with its cost ----------------------------

class _Cumsums(nn.Module):
    """Op kinds without a sharding rule: cumsum and cummax twice each, and the final sum."""

    def __init__(self):
        super().__init__()
        self.blocks = nn.ModuleList(nn.Linear(8, 8) for _ in range(2))

    def forward(self, x):                                                # (B, T, 8)
        for block in self.blocks:
            x = torch.cumsum(block(x), 1) + torch.cummax(x, 1).values
        return x.sum()


def _capture_cumsums():
    from autopar.graph.capture import capture_pass
    torch.manual_seed(0)
    return capture_pass(_Cumsums(), (torch.randn(2, 6, 8),))


def test_no_rule_warns_once_per_op_kind_with_its_cost():
    from autopar.planner.sharding import enumerate_strategies
    cap = _capture_cumsums()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        enumerate_strategies(cap, 2, "auto")
    messages = sorted(str(w.message) for w in caught if "no sharding rule" in str(w.message))
    kinds = [m.split("no sharding rule for ")[1].split()[0] for m in messages]
    assert kinds == ["aten.cummax.default", "aten.cumsum.default", "aten.sum.default"], messages
    cummax, cumsum, _ = messages
    assert "aten.cummax.default in <top level> (and 1 more node)" in cummax, cummax
    assert "aten.cumsum.default in <top level> (and 1 more node)" in cumsum, cumsum
    # what it costs: both cumsums' (2, 6, 8) fp32 inputs, 768 bytes, gathered and the work repeated
    assert "0.000732 MiB in all) are gathered whole" in cumsum and "repeated on each rank" in cumsum, cumsum


def _rank_warnings(rank, world):
    from autopar.planner.sharding import enumerate_strategies
    cap = _capture_cumsums()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        enumerate_strategies(cap, world, "auto")
    return [str(w.message) for w in caught if "no sharding rule" in str(w.message)]


RANK_WARNINGS = pool.job(2, _rank_warnings, timeout=120)


def test_no_rule_warns_on_rank_zero_only():
    per_rank = RANK_WARNINGS.result()
    assert len(per_rank[0]) == 3 and per_rank[1] == [], per_rank


# ---- parity on 2 gloo ranks: the interleaved forms against the unsharded model -----------------
# Gloo's functional collectives carry complex tensors (the rules harness reshards complex values);
# these plans never move one: the rotation stays on each rank's heads, and the replicated freqs_cis
# table entering its mul needs no gradient, so its copy_to never all-reduces.

RUN_CFG = Config(vocab=64, dim=32, n_heads=4, n_layers=2, max_seq=12)
BATCH = 4
# a model this small costs a few collective launches per op on free links alone: slow compute a
# millionfold so that dividing it pays, and the run shards (and communicates) all it can
SLOW_COMPUTE = dataclasses.replace(FREE_LINKS, peak_flops={k: v * 1e-6 for k, v in FREE_LINKS.peak_flops.items()},
                                   mem_bandwidth=FREE_LINKS.mem_bandwidth * 1e-6,
                                   fused_bandwidth=FREE_LINKS.fused_bandwidth * 1e-6)


def _model(form: str) -> Llama:
    torch.manual_seed(0)
    return Llama(RUN_CFG, form)


def _batch():
    g = torch.Generator().manual_seed(1)
    return (torch.randint(0, RUN_CFG.vocab, (BATCH, RUN_CFG.max_seq), generator=g),
            torch.randint(0, RUN_CFG.vocab, (BATCH, RUN_CFG.max_seq), generator=g))


def _reference(form: str):
    model = _model(form)
    loss = model(*_batch())
    loss.backward()
    return loss.item(), {n: p.grad for n, p in model.named_parameters()}


def _parallel(rank, world, forms):
    out = {}
    for form in forms:
        pm = autopar.parallelize(_model(form), (1, 1, world), _batch(), plan="auto", device=SLOW_COMPUTE,
                                 compile=False)
        loss = pm.train_step(*_batch()).item()
        out[form] = (loss, pm.full_grads(), pm.plan.to_json())
    return out


PARALLEL = pool.job(2, _parallel, ("stack", "complex"))


@pytest.fixture(scope="module")
def parallel_runs():
    return PARALLEL.result()


@pytest.mark.parametrize("form", ["stack", "complex"])
def test_interleaved_rope_parity_tp2(parallel_runs, form):
    ref_loss, ref_grads = _reference(form)
    for rank, per_form in enumerate(parallel_runs):
        loss, grads, plan = per_form[form]
        assert loss == pytest.approx(ref_loss, rel=1e-5), f"rank {rank} loss"
        assert set(grads) == set(ref_grads)
        for name, g in ref_grads.items():
            torch.testing.assert_close(grads[name], g, rtol=1e-5, atol=1e-6, msg=f"rank {rank} grad {name}")
        # tested where it shards: the projections are split by heads and the rotation runs on them
        plan = json.loads(plan)
        placements = {p["fqn"]: p["placements"]["tp"] for p in plan["parameters"]}
        assert placements["layers.0.attention.wq.weight"] == "S(0)", placements
        rope = [n for n in plan["nodes"] if n["op"] in ROPE_OPS]
        assert rope and all(n["output"] == "S(2)" for n in rope), rope
