"""A nanoGPT-style GPT: the model autopar is built and tested against.

Token + position embedding, pre-LN blocks with a fused QKV Linear, causal
scaled_dot_product_attention, GELU MLP, optional dropout, final LayerNorm and an
lm_head tied to the token embedding. ``forward(idx, targets)`` returns the mean
cross-entropy loss, so the model is its own training objective.

Named configs (``CONFIGS``) run from ``tiny`` (tests) through GPT-2 small/medium/
large/XL to the GPT-3 shapes of Brown et al. 2020, Table 2.1; every one can be
built on the meta device (``GPT(cfg).to("meta")`` or ``build(name, device="meta")``).
"""
from __future__ import annotations

import math
from dataclasses import dataclass, replace

import torch
import torch.nn as nn
import torch.nn.functional as F


@dataclass(frozen=True)
class GPTConfig:
    """Shape of a GPT. ``block_size`` is the longest sequence it accepts."""

    vocab_size: int = 50257
    block_size: int = 1024
    n_layer: int = 12
    n_head: int = 12
    n_embd: int = 768
    dropout: float = 0.0
    bias: bool = True
    attention: str = "sdpa"   # "sdpa": fused kernel; "explicit": softmax(q k^T) v spelled out

    @property
    def head_dim(self) -> int:
        return self.n_embd // self.n_head


CONFIGS: dict[str, GPTConfig] = {
    "tiny": GPTConfig(vocab_size=128, block_size=32, n_layer=2, n_head=4, n_embd=32),
    "gpt2": GPTConfig(n_layer=12, n_head=12, n_embd=768),
    "gpt2-medium": GPTConfig(n_layer=24, n_head=16, n_embd=1024),
    "gpt2-large": GPTConfig(n_layer=36, n_head=20, n_embd=1280),
    "gpt2-xl": GPTConfig(n_layer=48, n_head=25, n_embd=1600),
    "gpt3-1.3b": GPTConfig(block_size=2048, n_layer=24, n_head=32, n_embd=2048),
    "gpt3-2.7b": GPTConfig(block_size=2048, n_layer=32, n_head=32, n_embd=2560),
    "gpt3-6.7b": GPTConfig(block_size=2048, n_layer=32, n_head=32, n_embd=4096),
    "gpt3-13b": GPTConfig(block_size=2048, n_layer=40, n_head=40, n_embd=5120),
    "gpt3-175b": GPTConfig(block_size=2048, n_layer=96, n_head=96, n_embd=12288),
}


class CausalSelfAttention(nn.Module):
    def __init__(self, cfg: GPTConfig):
        super().__init__()
        assert cfg.n_embd % cfg.n_head == 0, "n_embd must be a multiple of n_head"
        self.n_head = cfg.n_head
        self.c_attn = nn.Linear(cfg.n_embd, 3 * cfg.n_embd, bias=cfg.bias)  # fused q, k, v
        self.c_proj = nn.Linear(cfg.n_embd, cfg.n_embd, bias=cfg.bias)
        self.dropout = cfg.dropout
        self.resid_dropout = nn.Dropout(cfg.dropout)
        self.explicit = cfg.attention == "explicit"
        if cfg.attention not in ("sdpa", "explicit"):
            raise ValueError(f"attention={cfg.attention!r}: expected 'sdpa' or 'explicit'")
        if self.explicit:
            self.attn_dropout = nn.Dropout(cfg.dropout)
            causal = torch.tril(torch.ones(cfg.block_size, cfg.block_size, dtype=torch.bool))
            self.register_buffer("causal", causal.view(1, 1, cfg.block_size, cfg.block_size), persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T, C = x.shape
        q, k, v = self.c_attn(x).split(C, dim=2)                      # 3 x (B, T, C)
        q = q.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)  # (B, nh, T, hd)
        k = k.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)
        v = v.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)
        if self.explicit:   # the attention core Megatron's selective recompute targets
            att = (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(k.size(-1)))   # (B, nh, T, T)
            att = att.masked_fill(~self.causal[:, :, :T, :T], float("-inf"))
            y = self.attn_dropout(F.softmax(att, dim=-1)) @ v                 # (B, nh, T, hd)
        else:
            p = self.dropout if self.training else 0.0
            y = F.scaled_dot_product_attention(q, k, v, dropout_p=p, is_causal=True)
        y = y.transpose(1, 2).contiguous().view(B, T, C)               # (B, T, C)
        return self.resid_dropout(self.c_proj(y))


class MLP(nn.Module):
    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.c_fc = nn.Linear(cfg.n_embd, 4 * cfg.n_embd, bias=cfg.bias)
        self.gelu = nn.GELU(approximate="tanh")
        self.c_proj = nn.Linear(4 * cfg.n_embd, cfg.n_embd, bias=cfg.bias)
        self.dropout = nn.Dropout(cfg.dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.dropout(self.c_proj(self.gelu(self.c_fc(x))))    # (B, T, C)


class Block(nn.Module):
    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.ln_1 = nn.LayerNorm(cfg.n_embd, bias=cfg.bias)
        self.attn = CausalSelfAttention(cfg)
        self.ln_2 = nn.LayerNorm(cfg.n_embd, bias=cfg.bias)
        self.mlp = MLP(cfg)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class GPT(nn.Module):
    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.config = cfg
        self.transformer = nn.ModuleDict(dict(
            wte=nn.Embedding(cfg.vocab_size, cfg.n_embd),
            wpe=nn.Embedding(cfg.block_size, cfg.n_embd),
            drop=nn.Dropout(cfg.dropout),
            h=nn.ModuleList([Block(cfg) for _ in range(cfg.n_layer)]),
            ln_f=nn.LayerNorm(cfg.n_embd, bias=cfg.bias),
        ))
        self.lm_head = nn.Linear(cfg.n_embd, cfg.vocab_size, bias=False)
        self.transformer.wte.weight = self.lm_head.weight  # weight tying
        self.apply(self._init_weights)
        # GPT-2's scaled init of the residual projections (1/sqrt(2 * n_layer)).
        for name, p in self.named_parameters():
            if name.endswith("c_proj.weight"):
                nn.init.normal_(p, mean=0.0, std=0.02 / math.sqrt(2 * cfg.n_layer))

    @staticmethod
    def _init_weights(module: nn.Module) -> None:
        if isinstance(module, nn.Linear):
            nn.init.normal_(module.weight, mean=0.0, std=0.02)
            if module.bias is not None:
                nn.init.zeros_(module.bias)
        elif isinstance(module, nn.Embedding):
            nn.init.normal_(module.weight, mean=0.0, std=0.02)

    def forward(self, idx: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        B, T = idx.shape
        assert T <= self.config.block_size, f"sequence length {T} exceeds block_size {self.config.block_size}"
        pos = torch.arange(0, T, dtype=torch.long, device=idx.device)   # (T,)
        x = self.transformer.drop(self.transformer.wte(idx) + self.transformer.wpe(pos))  # (B, T, C)
        for block in self.transformer.h:
            x = block(x)
        logits = self.lm_head(self.transformer.ln_f(x))                  # (B, T, V)
        return F.cross_entropy(logits.view(-1, logits.size(-1)), targets.view(-1), ignore_index=-1)


def build(name: str, device: str | torch.device = "cpu", **overrides) -> GPT:
    """Build a named config, with field overrides (e.g. ``n_layer=2``), on ``device``.

    On the meta device no storage is allocated, so GPT-3 175B builds in seconds."""
    if name not in CONFIGS:
        raise KeyError(f"unknown config {name!r}; known: {', '.join(CONFIGS)}")
    cfg = replace(CONFIGS[name], **overrides)
    with torch.device(device):
        return GPT(cfg)


def example_inputs(cfg: GPTConfig, batch: int, seq: int | None = None,
                   device: str | torch.device = "cpu", seed: int = 0):
    """Random (idx, targets) of shape (batch, seq) for ``cfg``."""
    seq = seq or cfg.block_size
    if device == "meta" or getattr(device, "type", None) == "meta":
        return tuple(torch.empty(batch, seq, dtype=torch.long, device="meta") for _ in range(2))
    g = torch.Generator().manual_seed(seed)
    idx = torch.randint(0, cfg.vocab_size, (batch, seq + 1), generator=g)
    return idx[:, :-1].contiguous().to(device), idx[:, 1:].contiguous().to(device)


# The GPT whose bf16 step calibrates Inductor's memory-bound bandwidth (``python -m autopar calibrate``)
_REFERENCE = GPTConfig(vocab_size=32768, block_size=1024, n_layer=4, n_head=12, n_embd=1536)


def reference_step(device: str | torch.device):
    """(model in bf16, a batch of 8 x 1024 tokens, a description) on ``device`` ("meta" included):
    the reference step ``autopar.cost_model.calibrate.measure_fused_bandwidth`` times."""
    torch.manual_seed(0)
    with torch.device(device):
        model = GPT(_REFERENCE).to(torch.bfloat16)
    cfg = _REFERENCE
    return (model, example_inputs(cfg, 8, cfg.block_size, device=device),
            f"the example GPT ({cfg.n_layer} x h={cfg.n_embd}, 8 x {cfg.block_size} tokens, vocab {cfg.vocab_size})")
