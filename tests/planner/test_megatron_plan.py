"""plan="megatron" is Megatron-LM's plan on any GPT-style model, found from the graph's structure.

Three small models written here name and lay out their layers unlike GPT-2 or Llama: (a) a GPT
whose MLP is ``up``/``down`` (ratio 3), embedding ``tok`` and head ``out``; (b) a GPT-NeoX-like
model whose fused q,k,v weight is laid out per head ([heads, 3, head_dim] along dim 0) with a
parallel residual and partial rotary embeddings; (c) an OPT-like model with separate q, k, v
projections with biases and a tied head. With the example GPT and tiny Hugging Face GPT-2,
Llama (grouped-query), GPT-NeoX and OPT, every parameter's tp placement is checked against a
table written out by hand from Megatron-LM's rules (planned offline on the meta device), and
the models train on 2 gloo ranks as they do whole (one job for all of them in the session's pool of 2 ranks).
"""
from __future__ import annotations

import re

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import autopar
from autopar.examples.gpt import GPT, GPTConfig
import pool

transformers = pytest.importorskip("transformers")
from autopar.hf import causal_lm_loss  # noqa: E402

VOCAB, BLOCK, EMBD, HEADS, LAYERS = 96, 16, 32, 4, 2
BATCH, SEQ = 4, 12


# ---- (a) a GPT with other names: tok / pos, mix / merge, up / down (ratio 3), out ----------

class Attention(nn.Module):
    def __init__(self):
        super().__init__()
        self.mix = nn.Linear(EMBD, 3 * EMBD)     # [q | k | v] along the output features
        self.merge = nn.Linear(EMBD, EMBD)

    def forward(self, x):
        B, T, C = x.shape
        q, k, v = self.mix(x).split(C, dim=2)                           # 3 x (B, T, C)
        q, k, v = (t.view(B, T, HEADS, C // HEADS).transpose(1, 2) for t in (q, k, v))  # (B, nh, T, hd)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)     # (B, nh, T, hd)
        return self.merge(y.transpose(1, 2).contiguous().view(B, T, C))  # (B, T, C)


class Feed(nn.Module):
    def __init__(self, ratio: int):
        super().__init__()
        self.up = nn.Linear(EMBD, ratio * EMBD)
        self.down = nn.Linear(ratio * EMBD, EMBD)

    def forward(self, x):
        return self.down(F.gelu(self.up(x)))                            # (B, T, C)


class Layer(nn.Module):
    def __init__(self):
        super().__init__()
        self.pre = nn.LayerNorm(EMBD)
        self.attn = Attention()
        self.post = nn.LayerNorm(EMBD)
        self.mlp = Feed(3)

    def forward(self, x):
        x = x + self.attn(self.pre(x))
        return x + self.mlp(self.post(x))


class RenamedGPT(nn.Module):
    def __init__(self):
        super().__init__()
        self.tok = nn.Embedding(VOCAB, EMBD)
        self.pos = nn.Embedding(BLOCK, EMBD)
        self.layers = nn.ModuleList([Layer() for _ in range(LAYERS)])
        self.norm = nn.LayerNorm(EMBD)
        self.out = nn.Linear(EMBD, VOCAB, bias=False)                   # untied head

    def forward(self, idx, targets):
        B, T = idx.shape
        x = self.tok(idx) + self.pos(torch.arange(T, device=idx.device))  # (B, T, C)
        for layer in self.layers:
            x = layer(x)
        logits = self.out(self.norm(x))                                  # (B, T, V)
        return F.cross_entropy(logits.view(-1, VOCAB), targets.view(-1))


# ---- (b) GPT-NeoX-like: per-head fused q,k,v, partial rotary, parallel residual ------------

class NeoXAttention(nn.Module):
    def __init__(self):
        super().__init__()
        self.hd = EMBD // HEADS
        self.rot = self.hd // 2                                          # rotary on half of each head
        self.qkv = nn.Linear(EMBD, 3 * EMBD)     # rows laid out [n_head, 3, head_dim]
        self.dense = nn.Linear(EMBD, EMBD)
        self.register_buffer("inv_freq", 1.0 / 10000 ** (torch.arange(0, self.rot, 2).float() / self.rot),
                             persistent=False)

    def rotate(self, x, cos, sin):
        r, rest = x[..., :self.rot], x[..., self.rot:]
        a, b = r[..., :self.rot // 2], r[..., self.rot // 2:]
        return torch.cat([r * cos + torch.cat([-b, a], dim=-1) * sin, rest], dim=-1)

    def forward(self, x):
        B, T, C = x.shape
        qkv = self.qkv(x).view(B, T, HEADS, 3 * self.hd).transpose(1, 2)  # (B, nh, T, 3 hd)
        q, k, v = qkv.chunk(3, dim=-1)                                     # 3 x (B, nh, T, hd)
        angles = torch.arange(T, device=x.device).float()[:, None] * self.inv_freq[None, :]  # (T, rot/2)
        emb = torch.cat([angles, angles], dim=-1)                           # (T, rot)
        cos, sin = emb.cos(), emb.sin()
        q, k = self.rotate(q, cos, sin), self.rotate(k, cos, sin)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)        # (B, nh, T, hd)
        return self.dense(y.transpose(1, 2).reshape(B, T, C))              # (B, T, C)


class NeoXFeed(nn.Module):
    def __init__(self):
        super().__init__()
        self.wi = nn.Linear(EMBD, 4 * EMBD)
        self.wo = nn.Linear(4 * EMBD, EMBD)

    def forward(self, x):
        return self.wo(F.gelu(self.wi(x)))


class NeoXLayer(nn.Module):
    def __init__(self):
        super().__init__()
        self.ln_attn = nn.LayerNorm(EMBD)
        self.ln_ff = nn.LayerNorm(EMBD)
        self.attn = NeoXAttention()
        self.ff = NeoXFeed()

    def forward(self, x):
        return x + self.attn(self.ln_attn(x)) + self.ff(self.ln_ff(x))    # parallel residual


class NeoXLike(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(VOCAB, EMBD)
        self.layers = nn.ModuleList([NeoXLayer() for _ in range(LAYERS)])
        self.ln = nn.LayerNorm(EMBD)
        self.unembed = nn.Linear(EMBD, VOCAB, bias=False)

    def forward(self, idx, targets):
        x = self.embed(idx)                                                # (B, T, C)
        for layer in self.layers:
            x = layer(x)
        logits = self.unembed(self.ln(x))                                  # (B, T, V)
        return F.cross_entropy(logits.view(-1, VOCAB), targets.view(-1))


# ---- (c) OPT-like: separate q, k, v with biases, scaled q, offset positions, tied head -------

class OPTAttention(nn.Module):
    def __init__(self):
        super().__init__()
        self.query = nn.Linear(EMBD, EMBD)
        self.key = nn.Linear(EMBD, EMBD)
        self.value = nn.Linear(EMBD, EMBD)
        self.output = nn.Linear(EMBD, EMBD)

    def forward(self, x):
        B, T, C = x.shape
        hd = C // HEADS
        q = self.query(x) * hd ** -0.5                                      # (B, T, C)
        q, k, v = (t.view(B, T, HEADS, hd).transpose(1, 2) for t in (q, self.key(x), self.value(x)))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=1.0)  # (B, nh, T, hd)
        return self.output(y.transpose(1, 2).reshape(B, T, C))


class OPTFeed(nn.Module):
    def __init__(self):
        super().__init__()
        self.expand = nn.Linear(EMBD, 2 * EMBD)
        self.contract = nn.Linear(2 * EMBD, EMBD)

    def forward(self, x):
        return self.contract(F.relu(self.expand(x)))


class OPTLayer(nn.Module):
    def __init__(self):
        super().__init__()
        self.attn_norm = nn.LayerNorm(EMBD)
        self.attn = OPTAttention()
        self.ffn_norm = nn.LayerNorm(EMBD)
        self.ffn = OPTFeed()

    def forward(self, x):
        x = x + self.attn(self.attn_norm(x))
        return x + self.ffn(self.ffn_norm(x))


class OPTLike(nn.Module):
    OFFSET = 2   # OPT's learned positions start at index 2

    def __init__(self):
        super().__init__()
        self.words = nn.Embedding(VOCAB, EMBD)
        self.positions = nn.Embedding(BLOCK + self.OFFSET, EMBD)
        self.blocks = nn.ModuleList([OPTLayer() for _ in range(LAYERS)])
        self.final = nn.LayerNorm(EMBD)
        self.head = nn.Linear(EMBD, VOCAB, bias=False)
        self.head.weight = self.words.weight

    def forward(self, idx, targets):
        B, T = idx.shape
        x = self.words(idx) + self.positions(torch.arange(T, device=idx.device) + self.OFFSET)  # (B, T, C)
        for block in self.blocks:
            x = block(x)
        logits = self.head(self.final(x))                                   # (B, T, V)
        return F.cross_entropy(logits.view(-1, VOCAB), targets.view(-1))


# ---- Hugging Face and the example GPT -------------------------------------------------------

def _hf(name: str) -> nn.Module:
    common = dict(vocab_size=VOCAB, bos_token_id=0, eos_token_id=0, attn_implementation="sdpa")
    if name == "hf-gpt2":
        cfg = transformers.GPT2Config(n_positions=BLOCK, n_embd=EMBD, n_layer=LAYERS, n_head=HEADS, resid_pdrop=0.0,
                                      embd_pdrop=0.0, attn_pdrop=0.0, **common)
        return transformers.GPT2LMHeadModel(cfg)
    if name.startswith("hf-llama"):
        heads, kv = (8, 2) if name == "hf-llama-gqa" else (HEADS, 2)
        cfg = transformers.LlamaConfig(hidden_size=EMBD, intermediate_size=2 * EMBD, num_hidden_layers=LAYERS,
                                       num_attention_heads=heads, num_key_value_heads=kv,
                                       max_position_embeddings=BLOCK, **common)
        return transformers.LlamaForCausalLM(cfg)
    if name == "hf-neox":
        cfg = transformers.GPTNeoXConfig(hidden_size=EMBD, num_hidden_layers=LAYERS, num_attention_heads=HEADS,
                                         intermediate_size=2 * EMBD, max_position_embeddings=BLOCK, rotary_pct=0.5,
                                         hidden_dropout=0.0, attention_dropout=0.0, **common)
        return transformers.GPTNeoXForCausalLM(cfg)
    cfg = transformers.OPTConfig(hidden_size=EMBD, num_hidden_layers=LAYERS, ffn_dim=2 * EMBD, num_attention_heads=HEADS,
                                 max_position_embeddings=BLOCK, word_embed_proj_dim=EMBD, dropout=0.0,
                                 attention_dropout=0.0, activation_dropout=0.0, layerdrop=0.0, pad_token_id=1, **common)
    return transformers.OPTForCausalLM(cfg)


def build(name: str, device: str = "cpu") -> nn.Module:
    """A tiny model (seeded) whose forward(ids, targets) returns the loss."""
    torch.manual_seed(0)
    with torch.device(device):
        if name == "gpt":
            return GPT(GPTConfig(vocab_size=VOCAB, block_size=BLOCK, n_layer=LAYERS, n_head=HEADS, n_embd=EMBD))
        if name.startswith("hf-"):
            return causal_lm_loss(_hf(name))
        return {"renamed": RenamedGPT, "neox-like": NeoXLike, "opt-like": OPTLike}[name]()


def batch(device: str = "cpu"):
    if device == "meta":
        return tuple(torch.empty(BATCH, SEQ, dtype=torch.long, device="meta") for _ in range(2))
    ids = torch.randint(0, VOCAB, (BATCH, SEQ + 1), generator=torch.Generator().manual_seed(1))
    return ids[:, :-1].contiguous(), ids[:, 1:].contiguous()


# Megatron-LM's placements, per parameter with the layer index as "*": column-parallel weights
# and their biases split on the output features (S(0) of an [out, in] weight, S(1) of GPT-2's
# [in, out] Conv1D), a [q | k | v] fused weight interleaved (i3) so each rank holds its heads of
# each, a per-head fused one plainly; row-parallel weights on the input features, their biases,
# the norms and the position embeddings whole; the token embedding and the head on the vocabulary.
EXPECTED = {
    ("gpt", 2): {
        "transformer.wte.weight": "S(0)", "transformer.wpe.weight": "R",
        "transformer.h.*.ln_1.weight": "R", "transformer.h.*.ln_1.bias": "R",
        "transformer.h.*.attn.c_attn.weight": "S(0)i3", "transformer.h.*.attn.c_attn.bias": "S(0)i3",
        "transformer.h.*.attn.c_proj.weight": "S(1)", "transformer.h.*.attn.c_proj.bias": "R",
        "transformer.h.*.ln_2.weight": "R", "transformer.h.*.ln_2.bias": "R",
        "transformer.h.*.mlp.c_fc.weight": "S(0)", "transformer.h.*.mlp.c_fc.bias": "S(0)",
        "transformer.h.*.mlp.c_proj.weight": "S(1)", "transformer.h.*.mlp.c_proj.bias": "R",
        "transformer.ln_f.weight": "R", "transformer.ln_f.bias": "R",
    },
    ("renamed", 2): {
        "tok.weight": "S(0)", "pos.weight": "R",
        "layers.*.pre.weight": "R", "layers.*.pre.bias": "R",
        "layers.*.attn.mix.weight": "S(0)i3", "layers.*.attn.mix.bias": "S(0)i3",
        "layers.*.attn.merge.weight": "S(1)", "layers.*.attn.merge.bias": "R",
        "layers.*.post.weight": "R", "layers.*.post.bias": "R",
        "layers.*.mlp.up.weight": "S(0)", "layers.*.mlp.up.bias": "S(0)",
        "layers.*.mlp.down.weight": "S(1)", "layers.*.mlp.down.bias": "R",
        "norm.weight": "R", "norm.bias": "R", "out.weight": "S(0)",
    },
    ("neox-like", 2): {
        "embed.weight": "S(0)",
        "layers.*.ln_attn.weight": "R", "layers.*.ln_attn.bias": "R",
        "layers.*.ln_ff.weight": "R", "layers.*.ln_ff.bias": "R",
        "layers.*.attn.qkv.weight": "S(0)", "layers.*.attn.qkv.bias": "S(0)",
        "layers.*.attn.dense.weight": "S(1)", "layers.*.attn.dense.bias": "R",
        "layers.*.ff.wi.weight": "S(0)", "layers.*.ff.wi.bias": "S(0)",
        "layers.*.ff.wo.weight": "S(1)", "layers.*.ff.wo.bias": "R",
        "ln.weight": "R", "ln.bias": "R", "unembed.weight": "S(0)",
    },
    ("opt-like", 2): {
        "words.weight": "S(0)", "positions.weight": "R",
        "blocks.*.attn_norm.weight": "R", "blocks.*.attn_norm.bias": "R",
        "blocks.*.attn.query.weight": "S(0)", "blocks.*.attn.query.bias": "S(0)",
        "blocks.*.attn.key.weight": "S(0)", "blocks.*.attn.key.bias": "S(0)",
        "blocks.*.attn.value.weight": "S(0)", "blocks.*.attn.value.bias": "S(0)",
        "blocks.*.attn.output.weight": "S(1)", "blocks.*.attn.output.bias": "R",
        "blocks.*.ffn_norm.weight": "R", "blocks.*.ffn_norm.bias": "R",
        "blocks.*.ffn.expand.weight": "S(0)", "blocks.*.ffn.expand.bias": "S(0)",
        "blocks.*.ffn.contract.weight": "S(1)", "blocks.*.ffn.contract.bias": "R",
        "final.weight": "R", "final.bias": "R",
    },
    ("hf-gpt2", 2): {
        "lm.transformer.wte.weight": "S(0)", "lm.transformer.wpe.weight": "R",
        "lm.transformer.h.*.ln_1.weight": "R", "lm.transformer.h.*.ln_1.bias": "R",
        "lm.transformer.h.*.attn.c_attn.weight": "S(1)i3", "lm.transformer.h.*.attn.c_attn.bias": "S(0)i3",
        "lm.transformer.h.*.attn.c_proj.weight": "S(0)", "lm.transformer.h.*.attn.c_proj.bias": "R",
        "lm.transformer.h.*.ln_2.weight": "R", "lm.transformer.h.*.ln_2.bias": "R",
        "lm.transformer.h.*.mlp.c_fc.weight": "S(1)", "lm.transformer.h.*.mlp.c_fc.bias": "S(0)",
        "lm.transformer.h.*.mlp.c_proj.weight": "S(0)", "lm.transformer.h.*.mlp.c_proj.bias": "R",
        "lm.transformer.ln_f.weight": "R", "lm.transformer.ln_f.bias": "R",
    },
    ("hf-llama", 2): {
        "lm.model.embed_tokens.weight": "S(0)",
        "lm.model.layers.*.input_layernorm.weight": "R",
        "lm.model.layers.*.self_attn.q_proj.weight": "S(0)", "lm.model.layers.*.self_attn.k_proj.weight": "S(0)",
        "lm.model.layers.*.self_attn.v_proj.weight": "S(0)", "lm.model.layers.*.self_attn.o_proj.weight": "S(1)",
        "lm.model.layers.*.post_attention_layernorm.weight": "R",
        "lm.model.layers.*.mlp.gate_proj.weight": "S(0)", "lm.model.layers.*.mlp.up_proj.weight": "S(0)",
        "lm.model.layers.*.mlp.down_proj.weight": "S(1)",
        "lm.model.norm.weight": "R", "lm.lm_head.weight": "S(0)",
    },
    ("hf-llama-gqa", 4): {   # 2 key/value heads cannot be split 4 ways: k and v stay whole
        "lm.model.embed_tokens.weight": "S(0)",
        "lm.model.layers.*.input_layernorm.weight": "R",
        "lm.model.layers.*.self_attn.q_proj.weight": "S(0)", "lm.model.layers.*.self_attn.k_proj.weight": "R",
        "lm.model.layers.*.self_attn.v_proj.weight": "R", "lm.model.layers.*.self_attn.o_proj.weight": "S(1)",
        "lm.model.layers.*.post_attention_layernorm.weight": "R",
        "lm.model.layers.*.mlp.gate_proj.weight": "S(0)", "lm.model.layers.*.mlp.up_proj.weight": "S(0)",
        "lm.model.layers.*.mlp.down_proj.weight": "S(1)",
        "lm.model.norm.weight": "R", "lm.lm_head.weight": "S(0)",
    },
    ("hf-neox", 2): {
        "lm.gpt_neox.embed_in.weight": "S(0)",
        "lm.gpt_neox.layers.*.input_layernorm.weight": "R", "lm.gpt_neox.layers.*.input_layernorm.bias": "R",
        "lm.gpt_neox.layers.*.post_attention_layernorm.weight": "R",
        "lm.gpt_neox.layers.*.post_attention_layernorm.bias": "R",
        "lm.gpt_neox.layers.*.attention.query_key_value.weight": "S(0)",
        "lm.gpt_neox.layers.*.attention.query_key_value.bias": "S(0)",
        "lm.gpt_neox.layers.*.attention.dense.weight": "S(1)", "lm.gpt_neox.layers.*.attention.dense.bias": "R",
        "lm.gpt_neox.layers.*.mlp.dense_h_to_4h.weight": "S(0)", "lm.gpt_neox.layers.*.mlp.dense_h_to_4h.bias": "S(0)",
        "lm.gpt_neox.layers.*.mlp.dense_4h_to_h.weight": "S(1)", "lm.gpt_neox.layers.*.mlp.dense_4h_to_h.bias": "R",
        "lm.gpt_neox.final_layer_norm.weight": "R", "lm.gpt_neox.final_layer_norm.bias": "R",
        "lm.lm_head.weight": "S(0)",
    },
    ("hf-opt", 2): {
        "lm.model.decoder.embed_tokens.weight": "S(0)", "lm.model.decoder.embed_positions.weight": "R",
        "lm.model.decoder.layers.*.self_attn_layer_norm.weight": "R",
        "lm.model.decoder.layers.*.self_attn_layer_norm.bias": "R",
        "lm.model.decoder.layers.*.self_attn.q_proj.weight": "S(0)",
        "lm.model.decoder.layers.*.self_attn.q_proj.bias": "S(0)",
        "lm.model.decoder.layers.*.self_attn.k_proj.weight": "S(0)",
        "lm.model.decoder.layers.*.self_attn.k_proj.bias": "S(0)",
        "lm.model.decoder.layers.*.self_attn.v_proj.weight": "S(0)",
        "lm.model.decoder.layers.*.self_attn.v_proj.bias": "S(0)",
        "lm.model.decoder.layers.*.self_attn.out_proj.weight": "S(1)",
        "lm.model.decoder.layers.*.self_attn.out_proj.bias": "R",
        "lm.model.decoder.layers.*.final_layer_norm.weight": "R",
        "lm.model.decoder.layers.*.final_layer_norm.bias": "R",
        "lm.model.decoder.layers.*.fc1.weight": "S(0)", "lm.model.decoder.layers.*.fc1.bias": "S(0)",
        "lm.model.decoder.layers.*.fc2.weight": "S(1)", "lm.model.decoder.layers.*.fc2.bias": "R",
        "lm.model.decoder.final_layer_norm.weight": "R", "lm.model.decoder.final_layer_norm.bias": "R",
    },
}


def _by_layer(plan) -> dict[str, str]:
    """The plan's tp placement per parameter with layer indices as "*" (every layer must agree)."""
    out: dict[str, set] = {}
    for p in plan.parameters:
        out.setdefault(re.sub(r"\.\d+\.", ".*.", p.fqn), set()).add(p.placements["tp"])
    assert all(len(v) == 1 for v in out.values()), {k: v for k, v in out.items() if len(v) > 1}
    return {k: v.pop() for k, v in out.items()}


@pytest.mark.parametrize("sequence_parallel", [False, True])
@pytest.mark.parametrize("name,tp", list(EXPECTED))
def test_megatron_places_every_parameter(name, tp, sequence_parallel):
    plan = autopar.plan(build(name, "meta"), (1, 1, tp), batch("meta"), device="h100", plan="megatron",
                        sequence_parallel=sequence_parallel)
    assert _by_layer(plan) == EXPECTED[name, tp]


# ---- training on 2 ranks --------------------------------------------------------------------

STEPS = 3
PARITY = [("renamed", dict(sequence_parallel=False)), ("renamed", dict(sequence_parallel=True)),
          ("neox-like", dict(sequence_parallel=False)), ("neox-like", dict(sequence_parallel=True)),
          ("opt-like", dict(sequence_parallel=True)),
          ("hf-neox", dict(sequence_parallel=True)), ("hf-opt", dict(sequence_parallel=True))]
PARITY_IDS = [f"{n}-sp={k['sequence_parallel']}" for n, k in PARITY]


def _curve(step, params, ids, tgt) -> list[float]:
    opt = torch.optim.AdamW(params, lr=1e-2)
    losses = []
    for _ in range(STEPS):
        opt.zero_grad()
        losses.append(step(ids, tgt))
        opt.step()
    return losses


def _rank_all(rank, world, cases):
    out = []
    ids, tgt = batch()
    for name, knobs in cases:
        pm = autopar.parallelize(build(name), (1, 1, 2), (ids, tgt), plan="megatron", compile=False, **knobs)
        loss = pm.train_step(ids, tgt).item()
        grads = pm.full_grads()
        pm = autopar.parallelize(build(name), (1, 1, 2), (ids, tgt), plan="megatron", compile=False, **knobs)
        curve = _curve(lambda i, t: pm.train_step(i, t).item(), pm.parameters(), ids, tgt)
        out.append((loss, grads, curve, _by_layer(pm.plan)))
    return out


def _reference(name: str):
    ids, tgt = batch()
    model = build(name)
    loss = model(ids, tgt)
    loss.backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters(remove_duplicate=False)}
    model = build(name)

    def step(i, t):
        loss = model(i, t)
        loss.backward()
        return loss.item()
    curve = _curve(step, model.parameters(), ids, tgt)
    return loss.item(), grads, curve


PARITY_JOB = pool.job(2, _rank_all, PARITY, timeout=900)


@pytest.fixture(scope="module")
def parity_results():
    return dict(zip(PARITY_IDS, zip(*PARITY_JOB.result())))


@pytest.mark.parametrize("case", range(len(PARITY)), ids=PARITY_IDS)
def test_megatron_trains_like_the_whole_model(parity_results, case):
    name = PARITY[case][0]
    ref_loss, ref_grads, ref_curve = _reference(name)
    for rank, (loss, grads, curve, placements) in enumerate(parity_results[PARITY_IDS[case]]):
        assert placements == EXPECTED[name, 2], f"rank {rank} ran another plan"
        assert loss == pytest.approx(ref_loss, rel=1e-5), f"rank {rank} loss"
        assert set(grads) == set(ref_grads)
        for fqn, g in ref_grads.items():
            torch.testing.assert_close(grads[fqn], g, rtol=1e-5, atol=1e-6, msg=f"rank {rank} grad {fqn}")
        assert curve == pytest.approx(ref_curve, rel=1e-4), f"rank {rank} loss curve"
    assert ref_curve[-1] < ref_curve[0]
