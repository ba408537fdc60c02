"""Context parallelism on a hand-written Llama-style model (RMSNorm, rotate-half rotary, SwiGLU, causal
sdpa) whose rotary tables are not built from ``[batch, seq]`` position ids but written as torchtitan
and Meta's Llama write them: a ``[max_seq, hd]`` buffer sliced ``[:T]``, a ``[1, 1, max_seq, hd]``
buffer sliced on dim 2, and a table computed in forward from ``torch.arange(T)``. The cp rewrite cuts
each to the rank's chunks on the dim that lines up with the activations' sequence.

On gloo ranks, against the unsharded model (loss and every gathered gradient): each form on cp=2,
cp=4, cp=2 x tp=2 and dp=2 x cp=2 at ZeRO-3; and cp=2 with recompute="full" (all-gather and ring
attention), whose checkpoint regions take the cut tables made in the middle of them.
Offline (meta device): mesh="auto" ranks cp for such a model, and a model cp cannot split costs the
ranking one note line, with nothing of the fake tensors' tracebacks printed."""
from __future__ import annotations

import functools
import logging

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import autopar
import pool
from parity import unsharded
from autopar.mesh import Mesh
from autopar.passes.context_parallel import ContextParallelError

VOCAB, DIM, HEADS, LAYERS, MAX_SEQ = 64, 32, 4, 2, 32
BATCH, SEQ = 2, 16
FORMS = ("slice", "4d", "arange")
MESHES = [({"cp": 2}, {}), ({"cp": 4}, {}), ({"cp": 2, "tp": 2}, {}), ({"dp": 2, "cp": 2}, {"zero": 3})]
# (mesh, table form, knobs)
CASES = ([(mesh, form, knobs) for form in FORMS for mesh, knobs in MESHES]
         + [({"cp": 2}, "arange", {"recompute": "full"}),
            ({"cp": 2}, "slice", {"recompute": "full", "cp_attention": "ring"})])


def _rotate_half(x):
    a, b = x.chunk(2, dim=-1)
    return torch.cat((-b, a), dim=-1)


class RMSNorm(nn.Module):
    def __init__(self, dim: int):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6) * self.weight


class Attention(nn.Module):
    def __init__(self):
        super().__init__()
        self.wq, self.wk, self.wv, self.wo = (nn.Linear(DIM, DIM, bias=False) for _ in range(4))

    def forward(self, x, cos, sin):
        b, t, _ = x.shape
        q, k, v = (w(x).view(b, t, HEADS, DIM // HEADS).transpose(1, 2) for w in (self.wq, self.wk, self.wv))
        q = q * cos + _rotate_half(q) * sin
        k = k * cos + _rotate_half(k) * sin
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.wo(y.transpose(1, 2).reshape(b, t, DIM))


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.attention_norm, self.attention = RMSNorm(DIM), Attention()
        self.ffn_norm = RMSNorm(DIM)
        self.w1, self.w3 = nn.Linear(DIM, 2 * DIM, bias=False), nn.Linear(DIM, 2 * DIM, bias=False)
        self.w2 = nn.Linear(2 * DIM, DIM, bias=False)

    def forward(self, x, cos, sin):
        x = x + self.attention(self.attention_norm(x), cos, sin)
        h = self.ffn_norm(x)
        return x + self.w2(F.silu(self.w1(h)) * self.w3(h))


class Llama(nn.Module):
    """``form`` says how the rotary tables are kept: "slice" (``[MAX_SEQ, hd]`` buffers sliced
    ``[:T]``), "4d" (``[1, 1, MAX_SEQ, hd]`` buffers sliced on dim 2), "arange" (computed in
    forward from ``torch.arange(T)`` and the ``inv_freq`` buffer)."""

    def __init__(self, form: str):
        super().__init__()
        self.form = form
        self.tok_embeddings = nn.Embedding(VOCAB, DIM)
        self.layers = nn.ModuleList(Block() for _ in range(LAYERS))
        self.norm, self.output = RMSNorm(DIM), nn.Linear(DIM, VOCAB, bias=False)
        hd = DIM // HEADS
        self.register_buffer("inv_freq", 1.0 / 10000 ** (torch.arange(0, hd, 2).float() / hd), persistent=False)
        angles = torch.outer(torch.arange(MAX_SEQ).float(), self.inv_freq).repeat(1, 2)
        lead = (None, None) if form == "4d" else ()
        self.register_buffer("cos_cached", angles.cos()[lead], persistent=False)
        self.register_buffer("sin_cached", angles.sin()[lead], persistent=False)

    def tables(self, t: int):
        if self.form == "slice":
            return self.cos_cached[:t], self.sin_cached[:t]
        if self.form == "4d":
            return self.cos_cached[:, :, :t], self.sin_cached[:, :, :t]
        angles = torch.outer(torch.arange(t, device=self.inv_freq.device).float(), self.inv_freq)
        angles = torch.cat((angles, angles), dim=-1)
        return angles.cos(), angles.sin()

    def forward(self, idx, targets):
        cos, sin = self.tables(idx.shape[1])
        x = self.tok_embeddings(idx)
        for layer in self.layers:
            x = layer(x, cos, sin)
        return F.cross_entropy(self.output(self.norm(x)).flatten(0, 1), targets.flatten())


def build(form: str) -> Llama:
    torch.manual_seed(0)
    return Llama(form)


def batch(size: int = BATCH):
    ids = torch.randint(0, VOCAB, (size, SEQ + 1), generator=torch.Generator().manual_seed(1))
    return ids[:, :-1].contiguous(), ids[:, 1:].contiguous()


def _world(mesh: dict) -> int:
    return Mesh.parse(mesh).world_size


def _cases(rank, world, cases):
    """Per case: (loss, gathered gradients, recompute regions), or the error (the later cases still run)."""
    out = []
    for mesh, form, knobs in cases:
        inputs = batch()
        try:
            pm = autopar.parallelize(build(form), mesh, inputs, compile=False, device="cpu", **knobs)
            out.append((pm.train_step(*inputs).item(), pm.full_grads(), len(pm.plan.recompute_regions)))
        except Exception as e:
            out.append(f"{type(e).__name__}: {e}")
    return out


JOBS = {w: pool.job(w, _cases, [c for c in CASES if _world(c[0]) == w], timeout=600)
        for w in sorted({_world(c[0]) for c in CASES})}


@pytest.fixture(scope="module")
def refs():
    out = {}
    for form in FORMS:
        out[form] = unsharded(functools.partial(build, form), batch())[:2]
    return out


def _id(case) -> str:
    mesh, form, knobs = case
    return "-".join(f"{a}{n}" for a, n in mesh.items()) + f"-{form}" + "".join(f"-{k}{v}" for k, v in knobs.items())


@pytest.mark.parametrize("case", CASES, ids=_id)
def test_rotary_tables_match_one_device(case, refs):
    mesh, form, knobs = case
    ref_loss, ref_grads = refs[form]
    w = _world(mesh)
    index = [c for c in CASES if _world(c[0]) == w].index(case)
    for rank, per_rank in enumerate(JOBS[w].result()):
        assert not isinstance(per_rank[index], str), per_rank[index]
        loss, grads, regions = per_rank[index]
        assert loss == pytest.approx(ref_loss, rel=1e-5), rank
        for fqn, g in ref_grads.items():
            torch.testing.assert_close(grads[fqn], g, rtol=1e-5, atol=1e-6, msg=fqn)
        if "recompute" in knobs:
            assert regions > 0, "no recompute region was planned"


# ---- offline: mesh="auto" --------------------------------------------------------------------------

def _meta(cls, *args):
    with torch.device("meta"):
        return cls(*args)


def _auto(model):
    """mesh="auto" on 2 devices for one sequence (dp=2 cannot split it: cp=2 is planned): its ranking note."""
    plan = autopar.plan(model, "auto", batch(1), world_size=2, device="h100")
    return next(n for n in plan.notes if n.startswith("mesh chosen automatically"))


def _printed(capfd, caplog) -> str:
    """What was printed and what was logged at warning level or with a traceback (pytest's log capture
    holds the records that would otherwise reach stderr) since the last call."""
    out = capfd.readouterr()
    logged = [f"{r.name}: {r.getMessage()}" for r in caplog.records if r.levelno >= logging.WARNING or r.exc_info]
    caplog.clear()
    return out.out + out.err + "\n".join(logged)


@pytest.mark.parametrize("form", FORMS)
def test_auto_ranks_cp_with_rotary_tables(form, capfd, caplog):
    note = _auto(_meta(Llama, form))
    assert "(1, 1, cp2, 1)" in note and "not ranked" not in note, note
    assert not _printed(capfd, caplog)


class Mixer(Llama):
    """The Llama above with its tokens first mixed by a fixed ``[seq, seq]`` table (``x^T @ table``):
    each token's output needs every token, so cp cannot split it, and the op fails on the shard
    inside the fake tensor trace."""

    def __init__(self):
        super().__init__("slice")
        self.register_buffer("mix", torch.tril(torch.ones(SEQ, SEQ)) / SEQ)

    def forward(self, idx, targets):
        cos, sin = self.tables(idx.shape[1])
        x = (self.tok_embeddings(idx).transpose(1, 2) @ self.mix).transpose(1, 2)
        for layer in self.layers:
            x = layer(x, cos, sin)
        return F.cross_entropy(self.output(self.norm(x)).flatten(0, 1), targets.flatten())


def test_refused_cp_is_one_quiet_note_line(capfd, caplog):
    note = _auto(_meta(Mixer))
    refusals = [line for line in note.splitlines() if "not ranked" in line]
    assert len(refusals) == 1 and "cp 2 not ranked" in refusals[0] and "cp2" not in note, note
    assert not _printed(capfd, caplog)
    with pytest.raises(ContextParallelError, match="cannot run .* on a sequence shard"):
        autopar.plan(_meta(Mixer), {"cp": 2}, batch(), device="cpu")
    assert not _printed(capfd, caplog)
