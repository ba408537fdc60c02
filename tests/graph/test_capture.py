"""Capture refuses a forward that does not return the loss, and keeps lifted constants (offline, meta)."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import autopar
from autopar.graph.capture import capture_pass

V, B, T, C = 64, 4, 16, 32


class TinyLM(torch.nn.Module):
    """An embedding and a head whose forward returns what ``returns`` names."""

    def __init__(self, returns: str = "loss"):
        super().__init__()
        self.returns = returns
        self.wte = torch.nn.Embedding(V, C)
        self.head = torch.nn.Linear(C, V, bias=False)

    def forward(self, idx, targets):
        logits = self.head(self.wte(idx))
        loss = F.cross_entropy(logits.view(-1, V), targets.view(-1))
        return {"loss": loss, "logits": logits, "tuple": (loss, logits),
                "dict": {"loss": loss, "logits": logits}}[self.returns]


def _meta(returns: str = "loss"):
    with torch.device("meta"):
        model = TinyLM(returns)
    return model, tuple(torch.empty(B, T, dtype=torch.long, device="meta") for _ in range(2))


def test_logits_are_refused_before_planning_with_what_to_return():
    model, inputs = _meta("logits")
    with pytest.raises(ValueError, match=r"forward must return the scalar training loss") as e:
        autopar.plan(model, (1, 1, 1), inputs, device="cpu")
    assert f"a tensor of shape [{B}, {T}, {V}]" in str(e.value)
    assert "F.cross_entropy(logits.view(-1, V), targets.view(-1))" in str(e.value)
    assert "autopar.hf.causal_lm_loss" in str(e.value)


@pytest.mark.parametrize("returns, what", [("tuple", "a tuple of 2 values"),
                                           ("dict", "a dict with keys 'loss', 'logits'")])
def test_structured_outputs_are_refused(returns, what):
    model, inputs = _meta(returns)
    with pytest.raises(ValueError, match=r"must return the scalar training loss") as e:
        capture_pass(model, inputs, require_loss=True)
    assert what in str(e.value)


def test_a_whole_hugging_face_output_is_refused():
    transformers = pytest.importorskip("transformers")
    cfg = transformers.LlamaConfig(vocab_size=V, hidden_size=C, intermediate_size=64, num_hidden_layers=1,
                                   num_attention_heads=4, max_position_embeddings=T, attn_implementation="sdpa")

    class Whole(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.lm = transformers.LlamaForCausalLM(cfg)

        def forward(self, ids, labels):
            return self.lm(input_ids=ids, labels=labels)

    with torch.device("meta"):
        model = Whole()
    ids = torch.empty(B, T, dtype=torch.long, device="meta")
    with pytest.raises(ValueError, match=r"must return the scalar training loss.*causal_lm_loss"):
        capture_pass(model, (ids, ids), require_loss=True)


class Halved(TinyLM):
    """Its forward makes a tensor from data, which torch.export lifts as a constant input."""

    def forward(self, idx, targets):
        logits = self.head(self.wte(idx) * torch.tensor(0.5))
        return F.cross_entropy(logits.view(-1, V), targets.view(-1))


def test_lifted_constants_are_buffers_with_their_values():
    cap = capture_pass(Halved(), tuple(torch.zeros(B, T, dtype=torch.long) for _ in range(2)))
    [(fqn, value)] = cap.constants.items()
    assert value.item() == 0.5
    assert cap.buffers[fqn].meta["kind"] == "buffer"
    assert cap.constant_tensors("cpu")[fqn].item() == 0.5


def test_a_constant_made_on_meta_cannot_be_fed():
    class OnInputDevice(TinyLM):
        def forward(self, idx, targets):
            logits = self.head(self.wte(idx)) * torch.tensor([2.0], device=idx.device)
            return F.cross_entropy(logits.view(-1, V), targets.view(-1))

    with torch.device("meta"):
        model = OnInputDevice()
    cap = capture_pass(model, _meta()[1])
    with pytest.raises(ValueError, match=r"on the meta device, so their values are unknown"):
        cap.constant_tensors("cpu")


def test_hugging_face_cache_is_removed_with_a_warning():
    transformers = pytest.importorskip("transformers")
    cfg = transformers.LlamaConfig(vocab_size=V, hidden_size=C, intermediate_size=64, num_hidden_layers=2,
                                   num_attention_heads=4, max_position_embeddings=T, attn_implementation="sdpa")

    class Natural(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.lm = transformers.LlamaForCausalLM(cfg)

        def forward(self, ids, labels):
            return self.lm(input_ids=ids, labels=labels).loss

    with torch.device("meta"):
        model = Natural()
    ids = torch.empty(B, T, dtype=torch.long, device="meta")
    with pytest.warns(UserWarning, match=r"without use_cache=False.*autopar.hf.causal_lm_loss"):
        cap = capture_pass(model, (ids, ids))
    assert not cap.constants
    assert not any(n.op == "placeholder" and "lifted" in n.name for n in cap.gm.graph.nodes)
