"""graph.causal_mask: a mask proven to be the causal pattern becomes is_causal=True; any other stays (CPU).

Hugging Face models train through the pass in tests/test_hf.py (parity with the model run whole)."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import autopar
from autopar.graph import causal_mask
from autopar.graph.capture import capture_pass

aten = torch.ops.aten
B, H, T, D = 2, 2, 16, 8


def _positions(t, device):
    q = torch.arange(t, device=device)
    return q[:, None], q[None, :]   # (t, 1) queries, (1, t) keys


MASKS = {   # name: (the mask from the sequence length and device, whether it is the causal pattern)
    "arange le": (lambda t, dev: _positions(t, dev)[1] <= _positions(t, dev)[0], True),
    "arange ge, flipped": (lambda t, dev: _positions(t, dev)[0] >= _positions(t, dev)[1], True),
    "tril of ones": (lambda t, dev: torch.ones(t, t, dtype=torch.bool, device=dev).tril(), True),
    "sliced to its own length": (lambda t, dev: (_positions(t + 4, dev)[1] <= _positions(t + 4, dev)[0])[:t, :t]
                                 [None, None, :, :t], True),
    "additive -inf": (lambda t, dev: torch.where(_positions(t, dev)[1] <= _positions(t, dev)[0], 0.0,
                                                 float("-inf")), True),
    "additive dtype min": (lambda t, dev: torch.zeros(t, t, device=dev).masked_fill(
        _positions(t, dev)[1] > _positions(t, dev)[0], torch.finfo(torch.float32).min), True),
    "and all-true padding": (lambda t, dev: (_positions(t, dev)[1] <= _positions(t, dev)[0])
                             & torch.ones(B, 1, 1, t, dtype=torch.bool, device=dev), True),
    "window as long as the sequence": (lambda t, dev: (_positions(t, dev)[1] <= _positions(t, dev)[0])
                                       & (_positions(t, dev)[1] > _positions(t, dev)[0] - t), True),
    "strict (no diagonal)": (lambda t, dev: (_positions(t, dev)[1] < _positions(t, dev)[0])
                             | (_positions(t, dev)[0] == 0) & (_positions(t, dev)[1] == 0), False),
    "sliding window of 4": (lambda t, dev: (_positions(t, dev)[1] <= _positions(t, dev)[0])
                            & (_positions(t, dev)[1] > _positions(t, dev)[0] - 4), False),
    "tril shifted": (lambda t, dev: torch.ones(t, t, dtype=torch.bool, device=dev).tril(1), False),
    "causal in batch 0 only": (lambda t, dev: (_positions(t, dev)[1] <= _positions(t, dev)[0])
                               | (torch.arange(B, device=dev) == 1).view(B, 1, 1, 1), False),
    "additive, a finite hide": (lambda t, dev: torch.where(_positions(t, dev)[1] <= _positions(t, dev)[0],
                                                           0.0, -1e4), False),
    "difference of positions": (lambda t, dev: (_positions(t, dev)[1] - _positions(t, dev)[0]) <= 0, True),
    "window as a difference": (lambda t, dev: (_positions(t, dev)[1] <= _positions(t, dev)[0])
                               & (_positions(t, dev)[0] - _positions(t, dev)[1] < 4), False),
    # q and k mixed in floats (rounding): proven through every change of the key positions (at most MAX_STEPS)
    "float difference of positions": (lambda t, dev: (_positions(t, dev)[1].float() - _positions(t, dev)[0])
                                      <= 0, True),
}


class Attention(torch.nn.Module):
    def __init__(self, mask):
        super().__init__()
        self.mask = mask

    def forward(self, q, k, v):
        return F.scaled_dot_product_attention(q, k, v, attn_mask=self.mask(q.shape[-2], q.device))


def _traced(mask, t=T):
    q, k, v = (torch.randn(B, H, t, D) for _ in range(3))
    gm = torch.export.export(Attention(mask), (q, k, v)).graph_module
    return gm, (q, k, v)


def _sdpa(gm):
    (node,) = [n for n in gm.graph.nodes if n.target is aten.scaled_dot_product_attention.default]
    return node


# at 2T + 8 elements, the masks' (T x T) values are kept as ops, the positions evaluated; at T x T
# the (T x T) tables are evaluated and what spans the batch too is kept as ops over them
@pytest.mark.parametrize("limit", [causal_mask.LIMIT, 2 * T + 8, T * T],
                         ids=["evaluated whole", "kept as ops", "tables evaluated, the batch kept as ops"])
@pytest.mark.parametrize("name", list(MASKS))
def test_only_the_causal_pattern_becomes_is_causal_and_the_output_is_unchanged(name, limit, monkeypatch):
    monkeypatch.setattr(causal_mask, "LIMIT", limit)
    mask, causal = MASKS[name]
    gm, qkv = _traced(mask)
    before = gm(*qkv)[0]
    causal_mask.causal_mask_pass(gm)
    node = _sdpa(gm)
    assert (len(node.args) > 5 and node.args[5] is True) == causal
    assert (node.args[3] is None) == causal
    torch.testing.assert_close(gm(*qkv)[0], before)


def test_q_and_k_mixed_in_floats_over_more_key_positions_than_it_follows_stays(monkeypatch):
    t = causal_mask.MAX_STEPS + 8
    monkeypatch.setattr(causal_mask, "LIMIT", t)   # the positions evaluated, the (t x t) difference kept as ops
    gm, qkv = _traced(MASKS["float difference of positions"][0], t=t)
    causal_mask.causal_mask_pass(gm)
    assert _sdpa(gm).args[3] is not None
    # in integers the difference is rearranged, k <= q, and proven at any length
    gm, qkv = _traced(MASKS["difference of positions"][0], t=t)
    before = gm(*qkv)[0]
    causal_mask.causal_mask_pass(gm)
    assert _sdpa(gm).args[3] is None
    torch.testing.assert_close(gm(*qkv)[0], before)


def test_a_mask_read_from_an_input_stays():
    class Padded(torch.nn.Module):
        def forward(self, q, keep):
            pos = torch.arange(q.shape[-2])
            return F.scaled_dot_product_attention(q, q, q, attn_mask=(pos[None, :] <= pos[:, None]) & keep[:, None, None, :])
    q = torch.randn(B, H, T, D)
    gm = torch.export.export(Padded(), (q, torch.ones(B, T, dtype=torch.bool))).graph_module
    causal_mask.causal_mask_pass(gm)
    assert _sdpa(gm).args[3] is not None


def _llama(seq, sliding=None):
    transformers = pytest.importorskip("transformers")
    kind = transformers.MistralConfig if sliding else transformers.LlamaConfig
    extra = dict(sliding_window=sliding) if sliding else {}
    cfg = kind(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
               num_key_value_heads=2, max_position_embeddings=seq, attn_implementation="sdpa", **extra)
    model = (transformers.MistralForCausalLM if sliding else transformers.LlamaForCausalLM)(cfg)
    return autopar.hf.causal_lm_loss(model)


@pytest.mark.parametrize("seq", [16, 4096], ids=["evaluated whole", "65536 times 2 mask elements, kept as ops"])
def test_hugging_face_llamas_mask_is_proven_causal_at_capture(seq):
    with torch.device("meta"):
        model = _llama(seq)
    idx = torch.zeros(2, seq, dtype=torch.long, device="meta")
    cap = capture_pass(model, (idx, idx))
    nodes = [n for n in cap.gm.graph.nodes if n.target is aten.scaled_dot_product_attention.default]
    assert len(nodes) == 2 and all(n.args[3] is None and n.args[5] is True for n in nodes)
    assert not [n for n in cap.gm.graph.nodes if n.target in (aten.le.Tensor, aten.cumsum.default)]


@pytest.mark.parametrize("window, causal", [(8, False), (64, True)])
def test_a_sliding_window_shorter_than_the_sequence_keeps_its_mask(window, causal):
    model = _llama(T * 2, sliding=window)
    idx = torch.randint(0, 64, (2, T * 2))
    cap = capture_pass(model, (idx, idx))
    nodes = [n for n in cap.gm.graph.nodes if n.target is aten.scaled_dot_product_attention.default]
    assert all((n.args[3] is None) == causal for n in nodes)



ARCHITECTURES = ["GPT2", "Qwen2", "Gemma", "Phi3", "GPTNeoX", "Falcon", "OPT"]


@pytest.mark.parametrize("name", ARCHITECTURES)
def test_other_hugging_face_architectures_masks_are_proven_causal(name):
    """At 2048 tokens on the meta device: the (1, 1, 2048, 2048) comparison is evaluated whole (LIMIT
    elements), the batch's 2 x 2048^2 kept as ops over it."""
    transformers = pytest.importorskip("transformers")
    seq = 2048
    shape = dict(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, max_position_embeddings=seq, pad_token_id=None, bos_token_id=None,
                 eos_token_id=None)
    if name == "GPT2":
        shape = dict(vocab_size=64, n_embd=32, n_layer=2, n_head=4, n_positions=seq, bos_token_id=0, eos_token_id=0)
    if name == "OPT":
        shape = dict(vocab_size=64, hidden_size=32, ffn_dim=64, num_hidden_layers=2, num_attention_heads=4,
                     max_position_embeddings=seq, word_embed_proj_dim=32, pad_token_id=0, bos_token_id=0,
                     eos_token_id=0)
    cfg = getattr(transformers, f"{name}Config")(**shape, attn_implementation="sdpa")
    model_class = getattr(transformers, f"{name}LMHeadModel" if name == "GPT2" else f"{name}ForCausalLM")
    with torch.device("meta"):
        model = autopar.hf.causal_lm_loss(model_class(cfg))
    idx = torch.zeros(2, seq, dtype=torch.long, device="meta")
    nodes = [n for n in capture_pass(model, (idx, idx)).gm.graph.nodes
             if n.target is aten.scaled_dot_product_attention.default]
    assert len(nodes) == 2 and all(n.args[3] is None and n.args[5] is True for n in nodes)
