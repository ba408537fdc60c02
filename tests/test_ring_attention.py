"""Ring attention over cp (``collectives.ring_attention``) and the planner's choice between it and the
all-gather-KV variant (``Plan.cp_attention``).

On gloo ranks (cp=2 and 4), the op alone against sdpa on the unsharded sequence in fp64, forward and
the gradients of q, k and v: causal, GQA (fewer key/value heads, ``enable_gqa``), a given ``scale``, a
boolean position mask (a sliding window) and an additive one; the example GPT with ring attention
through torch.compile (aot_eager) against the unsharded model. The same inputs cut into contiguous
chunks instead of each rank's head and tail chunk (``rank_chunks``) must not match. Offline: the
ring's schedule computes every causal pair of chunks exactly once, with the same work at every step
on every rank; the planner picks ring where its transfers hide behind the blocks' compute and the
all-gather where they cannot; the choice round-trips through plan JSON, shows in the summary, diff
and HTML view, and bad values are refused. Parity of whole models with ring attention is in
tests/test_context_parallel.py, its memory in tests/cost_model/test_context_memory.py."""
from __future__ import annotations

import json

import pytest
import torch
import torch.nn.functional as F

import autopar
import pool
from autopar import collectives as C
from autopar.errors import PlanError, PlanFormatError
from autopar.examples.gpt import GPT, GPTConfig, example_inputs
from autopar.plans import Plan

B, H, S, D = 2, 4, 16, 8
# (kv heads, mask, scale)
CASES = [(4, None, None), (2, None, 0.3), (1, "window", None), (2, "additive", 0.5)]


def _mask(kind):
    if kind is None:
        return None
    i, j = torch.arange(S)[:, None], torch.arange(S)[None, :]
    causal = i >= j
    if kind == "window":   # a position mask a model builds itself: causal within 5 tokens, per batch row
        return (causal & (i - j < 5))[None, None].expand(B, 1, S, S)
    return torch.where(causal, -0.1 * (i - j).double(), float("-inf"))   # ALiBi-like additive bias


def _ring_vs_sdpa(rank, world, cut):
    """Max |error| of the ring's output and q, k, v gradients against sdpa's, per case, with the
    inputs cut to the rank's chunks by ``cut`` ("balanced": ``rank_chunks``; "contiguous": the
    rank's 1/world of the sequence, which the ring must not take for its own)."""
    group = torch.distributed.group.WORLD.group_name

    def mine(x, dim):
        if cut == "balanced":
            return C.rank_chunks(x, dim, world, rank)
        return x.narrow(dim, rank * x.shape[dim] // world, x.shape[dim] // world)

    out = []
    for kv_heads, mask_kind, scale in CASES:
        g = torch.Generator().manual_seed(kv_heads)
        q, go = (torch.randn(B, H, S, D, generator=g, dtype=torch.float64) for _ in range(2))
        k, v = (torch.randn(B, kv_heads, S, D, generator=g, dtype=torch.float64) for _ in range(2))
        mask = _mask(mask_kind)
        whole = [x.clone().requires_grad_() for x in (q, k, v)]
        ref = F.scaled_dot_product_attention(*whole, attn_mask=mask, is_causal=mask is None, scale=scale,
                                             enable_gqa=kv_heads != H)
        ref.backward(go)
        local = [mine(x, 2).clone().requires_grad_() for x in (q, k, v)]
        got = C.ring_attention(*local, None if mask is None else mine(mask, -2), 0.0, scale, kv_heads != H,
                               group, world, rank)
        got.backward(mine(go, 2))
        errors = [(got - mine(ref, 2)).abs().max().item()]
        errors += [(x.grad - mine(w.grad, 2)).abs().max().item() for x, w in zip(local, whole)]
        out.append(errors)
    return out


JOBS = {(w, cut): pool.job(w, _ring_vs_sdpa, cut, timeout=300) for w in (2, 4) for cut in ("balanced", "contiguous")}


@pytest.mark.parametrize("world", [2, 4])
def test_ring_matches_sdpa_on_the_whole_sequence(world):
    for rank, per_case in enumerate(JOBS[(world, "balanced")].result()):
        for case, errors in zip(CASES, per_case):
            assert max(errors) < 1e-12, f"cp={world} rank {rank} {case}: |error| of out, dq, dk, dv {errors}"


@pytest.mark.parametrize("world", [2, 4])
def test_ring_needs_each_ranks_head_and_tail_chunk(world):
    """Fed contiguous shares of the sequence, the ring computes the wrong pairs: the check above can fail."""
    worst = max(max(errors) for per_case in JOBS[(world, "contiguous")].result() for errors in per_case)
    assert worst > 1e-2


TINY = GPTConfig(vocab_size=96, block_size=16, n_layer=2, n_head=4, n_embd=32)


def _compiled_gpt(rank, world):
    """Loss and gathered gradients of the example GPT at cp=2 with ring attention through torch.compile."""
    torch.manual_seed(0)
    inputs = example_inputs(TINY, 4, 16)
    pm = autopar.parallelize(GPT(TINY), {"cp": world}, inputs, compile="aot_eager", device="cpu",
                             cp_attention="ring")
    return pm.train_step(*inputs).item(), pm.full_grads()


COMPILED = pool.job(2, _compiled_gpt, timeout=300, lane=pool.compiled(2))


def test_ring_compiles():
    """torch.compile (aot_eager) traces the ring's autograd.Function and its functional collectives: the
    compiled step matches the unsharded model's loss and every gradient."""
    torch.manual_seed(0)
    model = GPT(TINY)
    loss = model(*example_inputs(TINY, 4, 16))
    loss.backward()
    for got, grads in COMPILED.result():
        assert got == pytest.approx(loss.item(), rel=1e-5)
        for fqn, p in model.named_parameters(remove_duplicate=False):
            torch.testing.assert_close(grads[fqn], p.grad, rtol=1e-5, atol=1e-6, msg=fqn)


@pytest.mark.parametrize("size", [2, 3, 4, 8])
def test_ring_schedule_covers_every_causal_pair_once_with_balanced_steps(size):
    """Over the cp steps each rank computes each (query chunk, key chunk) pair on or below the
    diagonal exactly once, the diagonal ones causally, and does the same work (in chunk pairs, a
    diagonal half of one) at every step."""
    q = torch.zeros(1, 1, 4, 1)
    for rank in range(size):
        ring = C._Ring(q, q, q, False, None, "", size, rank)
        mine = ring.chunks(rank)
        seen = []
        for t in range(size):
            src = (rank - t) % size
            pairs = list(ring.pairs(t))
            seen += [(mine[i], b) for i, _, b, _ in pairs]
            assert all(ring.chunks(src)[j] == b for _, j, b, _ in pairs)
            assert all(diagonal == (mine[i] == b) for i, _, b, diagonal in pairs)
            # two whole pairs' work: the rank's own block is two diagonals and one whole pair
            assert sum(0.5 if diagonal else 1.0 for *_, diagonal in pairs) == 2.0
        want = [(a, b) for a in mine for b in range(2 * size) if b <= a]
        assert sorted(seen) == sorted(want), rank


def test_ring_refuses_what_it_cannot_run():
    q = torch.zeros(B, H, S, D)
    with pytest.raises(ValueError, match="no dropout"):
        C.ring_attention(q, q, q, None, 0.1, None, False, "", 2, 0)
    with pytest.raises(ValueError, match="4 query heads and 3 key/value heads"):
        C.ring_attention(q, q[:, :3], q[:, :3], None, 0.0, None, True, "", 2, 0)


# ---- offline: the planner's choice, the plan field --------------------------------------------------

def _meta(cfg):
    with torch.device("meta"):
        return GPT(cfg)


def _plan(seq, cp=2, batch=1, width=512, **knobs):
    cfg = GPTConfig(vocab_size=512, block_size=seq, n_layer=2, n_head=8, n_embd=width)
    return autopar.plan(_meta(cfg), {"cp": cp}, example_inputs(cfg, batch, seq, device="meta"), device="h100", **knobs)


LONG, SHORT = dict(seq=16384), dict(seq=256, batch=16, width=2048)   # one sequence of 16k tokens; 16 short ones


@pytest.mark.parametrize("cp", [2, 4])
def test_planner_picks_ring_where_its_transfers_hide(cp):
    """One sequence of 16k tokens: a block's attention outlasts its transfer over NVLink, so ring
    exposes little more than its last gradient hop, less than the all-gathers. 16 sequences of 256
    tokens at width 2048: as many keys and values, computed in far less than their transfer, and the
    ring sends each block on 2cp-1 times and its fp32 gradient cp times where the all-gathers and
    reduce-scatters move (cp-1)/cp of them twice: the all-gather is cheaper."""
    long, short = _plan(cp=cp, **LONG), _plan(cp=cp, **SHORT)
    assert long.cp_attention == "ring" and short.cp_attention == "allgather"
    for plan, shape, other in ((long, LONG, "allgather"), (short, SHORT, "ring")):
        forced = _plan(cp=cp, cp_attention=other, **shape)
        assert forced.cp_attention == other
        assert plan.predicted_comm_s < forced.predicted_comm_s
        assert any(n.startswith(f"cp attention chosen automatically: {plan.cp_attention}") for n in plan.notes)
    ring, gathered = long, _plan(cp=cp, cp_attention="allgather", **LONG)
    # ring keeps no gathered keys and values (the whole sequence's K and V, 2 layers x batch 1 x 16384 x 512
    # x 4 B) and no causal-mask rows ((16384 / cp) x 16384 in fp32 per layer)
    kv = 2 * 2 * 16384 * 512 * 4
    masks = 2 * (16384 // cp) * 16384 * 4
    assert gathered.memory[0].activations - ring.memory[0].activations == pytest.approx(kv + masks)
    # in its collectives list: cp-1 steps forward, cp-1 blocks and cp gradients backward, per layer
    sends = {c.phase: c.count for c in ring.collectives if c.kind == "send_recv" and c.axis == "cp"
             and c.where == "transformer.h.0.attn"}
    assert sends == {"fwd": cp - 1, "bwd": 2 * cp - 1}
    assert not any(c.kind == "all_gather" and c.axis == "cp" for c in ring.collectives)


def test_plan_records_cp_attention():
    ring, gathered = _plan(256, cp_attention="ring"), _plan(256, cp_attention="allgather")
    assert Plan.from_json(ring.to_json()) == ring
    old = json.loads(ring.to_json())
    del old["cp_attention"]   # a plan file from before the choice: it ran the all-gather
    assert Plan.from_json(json.dumps(old)).cp_attention == "allgather"
    assert "attention over cp: ring" in ring.summary() and "attention over cp: allgather" in gathered.summary()
    assert "cp_attention: ring -> allgather" in ring.diff(gathered)
    assert "cp attention</b>ring" in ring.to_html()
    bad = json.loads(ring.to_json())
    bad["cp_attention"] = "p2p"
    with pytest.raises(PlanFormatError, match="plan.cp_attention 'p2p': expected 'allgather' or 'ring'"):
        Plan.from_json(json.dumps(bad))
    edited = json.loads(gathered.to_json())
    edited["cp_attention"] = "ring"   # an edited plan runs as written, its collectives re-derived
    replanned = _plan(256, plan=json.dumps(edited))
    assert replanned.cp_attention == "ring" and any(c.kind == "send_recv" for c in replanned.collectives)


def test_bad_cp_attention():
    with pytest.raises(ValueError, match="cp_attention='p2p': expected 'auto' or 'allgather' or 'ring'"):
        _plan(256, cp_attention="p2p")
    with pytest.raises(ValueError, match="has cp=1"):
        _plan(256, cp=1, cp_attention="ring")
    cfg = GPTConfig(vocab_size=512, block_size=256, n_layer=2, n_head=8, n_embd=512, dropout=0.1)
    inputs = example_inputs(cfg, 1, 256, device="meta")
    with pytest.raises(PlanError, match=r"transformer\.h\.0\.attn has dropout_p=0\.1"):
        autopar.plan(_meta(cfg), {"cp": 2}, inputs, device="h100", cp_attention="ring")
    plan = autopar.plan(_meta(cfg), {"cp": 2}, inputs, device="h100")
    assert plan.cp_attention == "allgather" and any("ring attention cannot run here" in n for n in plan.notes)


class Windowed(torch.nn.Module):
    """One attention layer whose mask it builds itself from positions: causal within ``window`` tokens."""

    def __init__(self, window: int, vocab=512, width=512, heads=8):
        super().__init__()
        self.window, self.heads = window, heads
        self.emb = torch.nn.Embedding(vocab, width)
        self.qkv = torch.nn.Linear(width, 3 * width)
        self.head = torch.nn.Linear(width, vocab)

    def forward(self, idx, targets):
        b, t = idx.shape
        q, k, v = (x.view(b, t, self.heads, -1).transpose(1, 2) for x in self.qkv(self.emb(idx)).chunk(3, -1))
        i = torch.arange(t, device=idx.device)
        seen = (i[None, :] <= i[:, None]) & (i[:, None] - i[None, :] < self.window)   # (t, t)
        y = F.scaled_dot_product_attention(q, k, v, attn_mask=seen).transpose(1, 2).reshape(b, t, -1)
        logits = self.head(y)
        return F.cross_entropy(logits.view(-1, logits.shape[-1]), targets.view(-1))


def test_a_masked_attention_takes_the_all_gather_and_ring_asked_for_warns():
    """At 16k tokens ring would be chosen (as above); with a window shorter than the sequence the
    ring's blocks would run unfused, unpriced: "auto" takes the all-gather and says why, "ring" warns.
    A window as long as the sequence is the causal pattern, proven at capture: ring again."""
    seq = LONG["seq"]
    inputs = tuple(torch.zeros(1, seq, dtype=torch.long, device="meta") for _ in range(2))

    def plan(window, **knobs):
        with torch.device("meta"):
            model = Windowed(window)
        return autopar.plan(model, {"cp": 2}, inputs, device="h100", **knobs)
    windowed = plan(1024)
    assert windowed.cp_attention == "allgather"
    assert any(n.startswith("cp attention: allgather, as the attention in the top level takes a mask other than "
                            "the causal pattern") for n in windowed.notes)
    with pytest.warns(UserWarning, match=r"cp_attention='ring': the attention in the top level takes a mask"):
        asked = plan(1024, cp_attention="ring")
    assert asked.cp_attention == "ring"
    assert plan(seq).cp_attention == "ring"


@pytest.mark.parametrize("causal", [False, True])
def test_fused_and_math_blocks_agree(causal):
    """A block as fused attention (the CPU's flash kernel, ``fused_blocks``' choice for unmasked blocks)
    and in math give the same output, log-sum-exp and, from a merged output and log-sum-exp, the same
    q, k, v gradients; the ring tests above run the fused kernel unmasked and the math masked."""
    g = torch.Generator().manual_seed(1)
    q, k, v, go = (torch.randn(2, 4, 6, 8, generator=g, dtype=torch.float64) for _ in range(4))
    out = {}
    for fused in (True, False):
        o, lse, state = C._block_forward(q, k, v, causal, 0.3, None, fused)
        out[fused] = (o, lse, *C._block_backward(go, q, k, v, o, lse, causal, 0.3, None, fused, state))
    for a, b in zip(out[True], out[False]):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-12)
    whole = [x.clone().requires_grad_() for x in (q, k, v)]
    F.scaled_dot_product_attention(*whole, is_causal=causal, scale=0.3).backward(go)
    for got, x in zip(out[True][2:], whole):
        torch.testing.assert_close(got, x.grad, rtol=0, atol=1e-12)


def test_cuda_blocks_call_flash_attention_as_torch_declares_it():
    """On CUDA in 16 bits the blocks run torch's flash attention kernels; their calls (forward, and the
    backward with the forward's random state) are checked against torch's own shape functions on fake
    CUDA tensors, as no GPU is needed for that. fp32 on CUDA, a head dim flash attention cannot take,
    or a mask: the fp32 math instead."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode(allow_non_fake_inputs=True):
        q = torch.empty(2, 8, 64, 128, dtype=torch.bfloat16, device="cuda")
        assert C.fused_blocks(q, masked=False)
        assert not C.fused_blocks(q, masked=True)
        assert not C.fused_blocks(q.float(), masked=False)
        assert not C.fused_blocks(torch.empty(2, 8, 64, 264, dtype=torch.bfloat16, device="cuda"), masked=False)
        o, lse, state = C._block_forward(q, q, q, True, 0.1, None, True)
        assert o.shape == q.shape and o.dtype == q.dtype and lse.shape == (2, 8, 64) and lse.dtype == torch.float32
        grads = C._block_backward(o, q, q, q, o, lse, True, 0.1, None, True, state)
        assert [tuple(x.shape) for x in grads] == [tuple(q.shape)] * 3
