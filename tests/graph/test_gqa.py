"""Grouped-query attention written as Meta's Llama writes it, and ``sequence_parallel=True`` on it.

The model is hand-written: RMSNorm (as Llama spells it out, as torch's ``nn.RMSNorm``, or through
``x.norm()``, an op without a sharding rule), rotate-half rotary embedding, a SwiGLU MLP, and
attention with fewer key/value heads than query heads, the key/value heads repeated before a causal
sdpa either by ``repeat_interleave(n_rep, dim=1)`` or by ``x[:, :, None].expand(...).reshape(...)``
(Hugging Face's ``repeat_kv``). Offline plans (meta device) check that the planner splits attention by
heads with either spelling and honours an explicit ``sequence_parallel=True`` (or says, naming the
op, why it cannot); the parity runs train on 2 gloo ranks against the unsharded model.
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
from parity import FREE_LINKS, SLOW_COMPUTE
import pool
from parity import unsharded


@dataclasses.dataclass(frozen=True)
class Config:
    vocab: int = 64
    dim: int = 32
    n_heads: int = 4
    n_kv_heads: int = 2
    n_layers: int = 2
    max_seq: int = 12
    repeat: str = "interleave"   # how the key/value heads are repeated: "interleave" or "expand"
    norm: str = "llama"          # RMSNorm spelled out ("llama"), torch's ("torch"), or through x.norm() ("vector")

    @property
    def head_dim(self) -> int:
        return self.dim // self.n_heads


class RMSNorm(nn.Module):
    def __init__(self, dim: int, how: str, eps: float = 1e-6):
        super().__init__()
        self.how, self.eps = how, eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x):
        if self.how == "torch":
            return F.rms_norm(x, (x.shape[-1],), self.weight, self.eps)
        if self.how == "vector":   # the root mean square as a scaled 2-norm
            return x / (x.norm(2, dim=-1, keepdim=True) * x.shape[-1] ** -0.5 + self.eps) * self.weight
        return (x.float() * torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + self.eps)).type_as(x) * self.weight


def rotate_half(x):
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), -1)


class Attention(nn.Module):
    def __init__(self, cfg: Config):
        super().__init__()
        self.cfg = cfg
        self.wq = nn.Linear(cfg.dim, cfg.n_heads * cfg.head_dim, bias=False)
        self.wk = nn.Linear(cfg.dim, cfg.n_kv_heads * cfg.head_dim, bias=False)
        self.wv = nn.Linear(cfg.dim, cfg.n_kv_heads * cfg.head_dim, bias=False)
        self.wo = nn.Linear(cfg.n_heads * cfg.head_dim, cfg.dim, bias=False)

    def repeat_kv(self, x):
        """(B, kv heads, T, hd) -> (B, heads, T, hd): each key/value head serves n_rep query heads in a row."""
        c = self.cfg
        n_rep = c.n_heads // c.n_kv_heads
        if c.repeat == "interleave":
            return x.repeat_interleave(n_rep, dim=1)
        b, _, t, hd = x.shape
        return x[:, :, None].expand(b, c.n_kv_heads, n_rep, t, hd).reshape(b, c.n_heads, t, hd)

    def forward(self, x, cos, sin):                                      # x (B, T, dim); cos, sin (T, hd)
        c = self.cfg
        b, t, _ = x.shape
        q = self.wq(x).view(b, t, c.n_heads, c.head_dim).transpose(1, 2)     # (B, H, T, hd)
        k = self.wk(x).view(b, t, c.n_kv_heads, c.head_dim).transpose(1, 2)  # (B, KV, T, hd)
        v = self.wv(x).view(b, t, c.n_kv_heads, c.head_dim).transpose(1, 2)
        q, k = q * cos + rotate_half(q) * sin, k * cos + rotate_half(k) * sin
        out = F.scaled_dot_product_attention(q, self.repeat_kv(k), self.repeat_kv(v), is_causal=True)
        return self.wo(out.transpose(1, 2).reshape(b, t, -1))


class Block(nn.Module):
    def __init__(self, cfg: Config):
        super().__init__()
        self.attention = Attention(cfg)
        self.attention_norm, self.ffn_norm = RMSNorm(cfg.dim, cfg.norm), RMSNorm(cfg.dim, cfg.norm)
        self.w1 = nn.Linear(cfg.dim, 4 * cfg.dim, bias=False)
        self.w2 = nn.Linear(4 * cfg.dim, cfg.dim, bias=False)
        self.w3 = nn.Linear(cfg.dim, 4 * cfg.dim, bias=False)

    def forward(self, x, cos, sin):
        h = x + self.attention(self.attention_norm(x), cos, sin)
        n = self.ffn_norm(h)
        return h + self.w2(F.silu(self.w1(n)) * self.w3(n))


class Llama(nn.Module):
    """A Llama with grouped-query attention whose forward returns the loss."""

    def __init__(self, cfg: Config):
        super().__init__()
        self.tok_embeddings = nn.Embedding(cfg.vocab, cfg.dim)
        self.layers = nn.ModuleList(Block(cfg) for _ in range(cfg.n_layers))
        self.norm = RMSNorm(cfg.dim, cfg.norm)
        self.output = nn.Linear(cfg.dim, cfg.vocab, bias=False)
        freqs = 1.0 / (10000.0 ** (torch.arange(0, cfg.head_dim, 2).float() / cfg.head_dim))
        angles = torch.outer(torch.arange(cfg.max_seq).float(), freqs).repeat(1, 2)    # (T, hd)
        self.register_buffer("cos", angles.cos(), persistent=False)
        self.register_buffer("sin", angles.sin(), persistent=False)

    def forward(self, tokens, targets):                                  # (B, T) each
        t = tokens.shape[1]
        h = self.tok_embeddings(tokens)
        for layer in self.layers:
            h = layer(h, self.cos[:t], self.sin[:t])
        logits = self.output(self.norm(h))
        return F.cross_entropy(logits.view(-1, logits.shape[-1]), targets.view(-1))


REPEAT_OPS = {"aten.repeat_interleave.self_int", "aten.expand.default"}


def _plan(cfg: Config, mesh, batch: int = 1, **knobs):
    """(plan, warnings) of the model built on the meta device."""
    with torch.device("meta"):
        model = Llama(cfg)
    tokens = torch.zeros(batch, cfg.max_seq, dtype=torch.long, device="meta")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        plan = autopar.plan(model, mesh, (tokens, tokens), **knobs)
    return plan, [str(w.message) for w in caught]


def _tp(plan) -> dict[str, str]:
    return {p.fqn: p.placements["tp"] for p in plan.parameters}


def _check_megatron_layout(tp_of: dict[str, str], n_layers: int) -> None:
    for i in range(n_layers):
        block = f"layers.{i}"
        for name in ("wq", "wk", "wv"):   # column parallel: whole query and key/value heads per rank
            assert tp_of[f"{block}.attention.{name}.weight"] == "S(0)", (name, tp_of)
        assert tp_of[f"{block}.attention.wo.weight"] == "S(1)", tp_of
        assert tp_of[f"{block}.w1.weight"] == tp_of[f"{block}.w3.weight"] == "S(0)", tp_of
        assert tp_of[f"{block}.w2.weight"] == "S(1)", tp_of


# ---- offline plans: attention split by heads with either spelling of the repeat ------------------

PLAN_CFG = Config(vocab=8192, dim=1024, n_heads=16, n_kv_heads=4, n_layers=2, max_seq=512)


@functools.lru_cache(maxsize=None)
def _offline(repeat: str, tp: int):
    return _plan(dataclasses.replace(PLAN_CFG, repeat=repeat), (1, 1, tp), device=FREE_LINKS)


@pytest.mark.parametrize("tp", [2, 4])
@pytest.mark.parametrize("repeat", ["interleave", "expand"])
def test_grouped_query_attention_is_split_by_heads(repeat, tp):
    plan, caught = _offline(repeat, tp)
    assert caught == [], caught   # no op without a sharding rule
    _check_megatron_layout(_tp(plan), PLAN_CFG.n_layers)
    # the key/value heads are repeated on each rank's own heads, and attention moves nothing
    repeats = [n for n in plan.nodes if n.op in REPEAT_OPS and n.module.startswith("layers.")]
    assert repeats and all(n.inputs == ("S(1)",) and n.output == "S(1)" for n in repeats), repeats
    inside = [c for c in plan.collectives if c.axis == "tp" and c.phase == "fwd"
              and c.where in {f"layers.{i}.attention" for i in range(PLAN_CFG.n_layers)}]
    assert inside == [], inside


# ---- sequence_parallel=True: honoured, or the op that prevents it named ---------------------------

# a model small enough that the solver, on H100 links, leaves the norms whole unless told otherwise
SP_CFG = Config(vocab=32000, dim=512, n_heads=4, n_kv_heads=2, n_layers=2, max_seq=128)
NORM_OPS = {"llama": "aten.mean.dim", "torch": "aten.rms_norm.default"}


@pytest.mark.parametrize("norm", ["llama", "torch"])
def test_sequence_parallel_true_is_honoured(norm):
    plan, caught = _plan(dataclasses.replace(SP_CFG, norm=norm), (2, 1, 2), batch=4, device="h100",
                         sequence_parallel=True)
    assert plan.sequence_parallel
    norms = [n for n in plan.nodes if n.op == NORM_OPS[norm]]
    assert len(norms) == 2 * SP_CFG.n_layers + 1 and all(n.output == "S(1)" for n in norms), norms
    assert not any("sequence_parallel" in n for n in plan.notes), plan.notes
    assert caught == [], caught
    auto, _ = _plan(dataclasses.replace(SP_CFG, norm=norm), (2, 1, 2), batch=4, device="h100")
    assert not auto.sequence_parallel   # it is the knob that put them there


def test_sequence_parallel_true_names_the_op_that_prevents_it():
    plan, caught = _plan(dataclasses.replace(SP_CFG, norm="vector"), (2, 1, 2), batch=4, device="h100",
                         sequence_parallel=True)
    assert not plan.sequence_parallel
    note = next(n for n in plan.notes if n.startswith("sequence_parallel=True"))
    assert note.startswith("sequence_parallel=True is not honoured: aten.linalg_vector_norm.default in "
                           "layers.0.attention_norm (and 4 more nodes) cannot run on sequence shards: it has no "
                           "sharding rule"), note
    assert note.endswith("; sequence parallelism is off"), note
    assert f"autopar: {note}" in caught, caught   # said as a warning too, once
    assert sum("sequence_parallel=True" in w for w in caught) == 1, caught


class _Flattened(nn.Module):
    """A LayerNorm over the tokens laid out (B*T, dim): no dim of its own is the sequence."""

    def __init__(self):
        super().__init__()
        self.emb, self.norm, self.head = nn.Embedding(32, 16), nn.LayerNorm(16), nn.Linear(16, 32)

    def forward(self, ids, targets):
        return F.cross_entropy(self.head(self.norm(self.emb(ids).view(-1, 16))), targets.view(-1))


def _odd_gpt():
    from autopar.examples.gpt import GPT, GPTConfig, example_inputs
    cfg = GPTConfig(vocab_size=96, block_size=16, n_layer=2, n_head=4, n_embd=32)
    torch.manual_seed(0)
    return GPT(cfg), example_inputs(cfg, 4, 7)


@pytest.mark.parametrize("case, why", [
    ("gpt-7-tokens", "aten.layer_norm.default in transformer.h.0.ln_1 (and 4 more nodes) cannot run on sequence "
                     "shards: its 7-token sequence does not split evenly over tp=2"),
    ("flattened", "aten.layer_norm.default in norm cannot run on sequence shards: its input [32, 16] has no "
                  "sequence dim apart from the batch"),
], ids=["gpt-7-tokens", "flattened"])
def test_sequence_parallel_true_says_why_a_norm_stays_whole(case, why):
    if case == "flattened":
        ids = torch.randint(0, 32, (4, 8), generator=torch.Generator().manual_seed(0))
        model, inputs = _Flattened(), (ids, ids)
    else:
        model, inputs = _odd_gpt()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        plan = autopar.plan(model, (1, 1, 2), inputs, sequence_parallel=True)
    assert not plan.sequence_parallel
    note = next(n for n in plan.notes if n.startswith("sequence_parallel=True"))
    assert note.startswith(f"sequence_parallel=True is not honoured: {why}"), note
    assert f"autopar: {note}" in [str(w.message) for w in caught]


def test_no_rule_warning_is_said_once_per_planning():
    """A pipeline plan captures the model at every microbatch count it weighs: one warning, not one each."""
    cfg = dataclasses.replace(SP_CFG, norm="vector", n_layers=4)   # a model of its own: said once per model
    plan, caught = _plan(cfg, (1, 2, 2), batch=4, device="h100")
    said = [w for w in caught if "no sharding rule for aten.linalg_vector_norm.default" in w]
    assert len(said) == 1, caught
    assert plan.microbatches > 1   # more than one capture was planned


# ---- parity on 2 gloo ranks against the unsharded model -------------------------------------------

RUN_CFG = Config()
BATCH = 4
RUNS = {"interleave": dict(repeat="interleave"), "expand": dict(repeat="expand"),
        "interleave-sp": dict(repeat="interleave", sequence_parallel=True)}


def _model(repeat: str) -> Llama:
    torch.manual_seed(0)
    return Llama(dataclasses.replace(RUN_CFG, repeat=repeat))


def _batch():
    g = torch.Generator().manual_seed(1)
    return (torch.randint(0, RUN_CFG.vocab, (BATCH, RUN_CFG.max_seq), generator=g),
            torch.randint(0, RUN_CFG.vocab, (BATCH, RUN_CFG.max_seq), generator=g))


def _reference(repeat: str):
    return unsharded(functools.partial(_model, repeat), _batch())[:2]


def _parallel(rank, world):
    out = {}
    for name, run in RUNS.items():
        knobs = {k: v for k, v in run.items() if k != "repeat"}
        pm = autopar.parallelize(_model(run["repeat"]), (1, 1, world), _batch(), plan="auto", device=SLOW_COMPUTE,
                                 compile=False, **knobs)
        loss = pm.train_step(*_batch()).item()
        local = {fqn: tuple(p.shape) for fqn, p in pm.named_parameters()}
        out[name] = (loss, pm.full_grads(), local, pm.plan.to_json())
    return out


PARALLEL = pool.job(2, _parallel)


@pytest.fixture(scope="module")
def parallel_runs():
    return PARALLEL.result()


@pytest.mark.parametrize("name", list(RUNS))
def test_parity_tp2(parallel_runs, name):
    ref_loss, ref_grads = _reference(RUNS[name]["repeat"])
    full = dict(_model(RUNS[name]["repeat"]).named_parameters())
    for rank, per_run in enumerate(parallel_runs):
        loss, grads, local, plan = per_run[name]
        assert loss == pytest.approx(ref_loss, rel=1e-5), f"rank {rank} loss"
        assert set(grads) == set(ref_grads)
        for fqn, g in ref_grads.items():
            torch.testing.assert_close(grads[fqn], g, rtol=1e-5, atol=1e-6, msg=f"rank {rank} grad {fqn}")
        # tested where it shards: each rank holds half of every projection, split as Megatron splits them
        plan = json.loads(plan)
        _check_megatron_layout({p["fqn"]: p["placements"]["tp"] for p in plan["parameters"]}, RUN_CFG.n_layers)
        for i in range(RUN_CFG.n_layers):
            for fqn, dim in [(f"layers.{i}.attention.{w}.weight", 0) for w in ("wq", "wk", "wv")] + [
                    (f"layers.{i}.attention.wo.weight", 1), (f"layers.{i}.w1.weight", 0),
                    (f"layers.{i}.w3.weight", 0), (f"layers.{i}.w2.weight", 1)]:
                want = list(full[fqn].shape)
                want[dim] //= 2
                assert local[fqn] == tuple(want), (rank, fqn, local[fqn])
        repeats = [n for n in plan["nodes"] if n["op"] == "aten.repeat_interleave.self_int"]
        assert not repeats or all(n["output"] == "S(1)" for n in repeats), repeats
        if RUNS[name].get("sequence_parallel"):
            assert plan["sequence_parallel"]
            norms = [n for n in plan["nodes"] if n["op"] == "aten.mean.dim"]
            assert norms and all(n["output"] == "S(1)" for n in norms), norms
