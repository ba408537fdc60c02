"""Tables computed from buffers under mixed precision: the ops computing them keep their traced dtype.

Hugging Face Llama (transformers 5.17, the H200 image's) computes its rotary table as
``inv_freq[None, :, None].float() @ position_ids[:, None, :].float()`` with autocast disabled.
Traced at fp32 the two ``.float()`` are no-ops and export drops them, so a bf16 ``inv_freq``
meets fp32 positions in that matmul: "expected mat1 and mat2 to have the same dtype". Newer
transformers (5.24, this machine's) writes the product as a broadcast multiply, which promotes
to fp32 and hides the defect, so the CPU tests of the Hugging Face model passed. This model
writes the table the 5.17 way and runs on CPU, where ``mm`` refuses mixed dtypes as CUDA does.
"""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import autopar
import pool

VOCAB, DIM, HEADS, BATCH, SEQ = 64, 32, 4, 4, 16


class Rotary(torch.nn.Module):
    """cos/sin tables [B, T, head_dim] from a fp32 ``inv_freq`` buffer, as transformers 5.17 does."""

    def __init__(self, head_dim: int):
        super().__init__()
        inv_freq = 1.0 / (10000 ** (torch.arange(0, head_dim, 2).float() / head_dim))
        self.register_buffer("inv_freq", inv_freq, persistent=False)

    def forward(self, x, positions):
        b = positions.shape[0]
        inv = self.inv_freq[None, :, None].float().expand(b, -1, 1)          # [B, hd/2, 1]
        pos = positions[:, None, :].float()                                  # [B, 1, T]
        with torch.autocast(device_type=x.device.type, enabled=False):
            freqs = (inv.float() @ pos.float()).transpose(1, 2)              # [B, T, hd/2]
        emb = torch.cat((freqs, freqs), dim=-1)
        return emb.cos().to(x.dtype), emb.sin().to(x.dtype)


def rotate_half(x):
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


class TinyRopeLM(torch.nn.Module):
    """One attention block with rotary positions and a tied-free head; forward returns the loss."""

    def __init__(self):
        super().__init__()
        self.tok = torch.nn.Embedding(VOCAB, DIM)
        self.rotary = Rotary(DIM // HEADS)
        self.qkv = torch.nn.Linear(DIM, 3 * DIM, bias=False)
        self.proj = torch.nn.Linear(DIM, DIM, bias=False)
        self.norm = torch.nn.LayerNorm(DIM)
        self.head = torch.nn.Linear(DIM, VOCAB, bias=False)

    def forward(self, idx, targets):
        b, t = idx.shape
        x = self.tok(idx)                                                    # [B, T, C]
        positions = torch.arange(t, device=idx.device).unsqueeze(0).expand(b, -1)
        cos, sin = self.rotary(x, positions)
        q, k, v = self.qkv(x).view(b, t, 3, HEADS, DIM // HEADS).unbind(2)   # each [B, T, H, hd]
        q, k, v = (y.transpose(1, 2) for y in (q, k, v))                     # [B, H, T, hd]
        cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
        q, k = q * cos + rotate_half(q) * sin, k * cos + rotate_half(k) * sin
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(y.transpose(1, 2).reshape(b, t, DIM))
        logits = self.head(self.norm(x))
        return F.cross_entropy(logits.view(-1, VOCAB), targets.view(-1))


def _batch():
    g = torch.Generator().manual_seed(1)
    idx = torch.randint(0, VOCAB, (BATCH, SEQ), generator=g)
    return idx, torch.roll(idx, -1, 1)


def _bf16_losses(rank, world):
    """bf16 losses at (1,1,1), weights cast in the graph (one microbatch) and shared (two)."""
    idx, tgt = _batch()
    out = {}
    for microbatches in (1, 2):
        torch.manual_seed(0)
        pm = autopar.parallelize(TinyRopeLM(), (1, 1, 1), (idx, tgt), precision="bf16",
                                 microbatches=microbatches, compile=False)
        out[microbatches] = pm.train_step(idx, tgt).item()
    return out


BF16_LOSSES = pool.job(1, _bf16_losses, timeout=300)


def test_the_table_form_fails_at_16_bits_without_the_rule():
    """The premise: the matmul of a 16-bit ``inv_freq`` with fp32 positions is refused on CPU."""
    with pytest.raises(RuntimeError, match="dtype"):
        torch.ones(2, 1, dtype=torch.bfloat16) @ torch.ones(1, 3)


def test_rotary_table_from_an_fp32_buffer_trains_in_bf16():
    torch.manual_seed(0)
    idx, tgt = _batch()
    ref = TinyRopeLM()(idx, tgt).item()
    losses = BF16_LOSSES.result()[0]
    for microbatches, loss in losses.items():
        assert loss == pytest.approx(ref, rel=2e-2), microbatches
