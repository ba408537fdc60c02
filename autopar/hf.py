"""Hugging Face causal language models (GPT-2, Llama, ...) through ``autopar.parallelize``.

autopar needs a forward that returns the loss. A Hugging Face ``*ForCausalLM`` returns an
output object and takes its labels by keyword, so ``causal_lm_loss(model)`` wraps it in a
module whose ``forward(input_ids, labels)`` returns ``model(input_ids=..., labels=...).loss``:

    from transformers import LlamaConfig, LlamaForCausalLM
    from autopar.hf import causal_lm_loss

    lm = causal_lm_loss(LlamaForCausalLM(LlamaConfig(..., attn_implementation="sdpa")))
    pm = autopar.parallelize(lm, mesh=(1, 1, 2), example_inputs=(input_ids, input_ids))
    loss = pm.train_step(input_ids, input_ids)

Labels are what Hugging Face expects: it shifts them inside (position t is scored on
``labels[t + 1]``, the last position on nothing), so language modelling passes the input
ids as labels, exactly as to the model itself. The wrapper holds the model as ``lm``, so
plan names and ``full_state_dict()`` keys read ``lm.<the model's own names>``; that state
dict loads into the wrapper, whose tensors are the model's.

What the rest of autopar does with these graphs:
- GPT-2's Conv1D (``addmm`` with an [in, out] weight) is captured as ``mm`` plus a bias add;
  its column shard is on the weight's dim 1, and the fused ``c_attn`` is split on its last
  dim as q, k, v blocks (placement ``S(1)i3``).
- The causal mask, position ids and rotary tables depend on no input: every layer computes
  its own copy whole (``graph.capture``), so pipeline stages never send them.
- Grouped-query attention with fewer key/value heads than tp: the key/value projections
  are replicated and the attention, after the heads are repeated, is split by query heads
  (``autopar.planner.megatron``); every tp that divides the query heads works.
"""
from __future__ import annotations

import torch

# attention implementations torch.export can trace into aten ops (flash-attention kernels it cannot)
TRACEABLE_ATTENTION = ("sdpa", "eager")


class CausalLMLoss(torch.nn.Module):
    """A causal LM whose forward returns the loss: ``forward(input_ids, labels) -> loss``."""

    def __init__(self, model: torch.nn.Module):
        super().__init__()
        self.lm = model

    def forward(self, input_ids: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        """The model's mean next-token cross-entropy (Hugging Face shifts ``labels`` itself)."""
        return self.lm(input_ids=input_ids, labels=labels, use_cache=False).loss


def causal_lm_loss(model: torch.nn.Module) -> CausalLMLoss:
    """Wrap a Hugging Face ``*ForCausalLM`` so its forward returns the loss, for ``autopar.parallelize``.

    Raises ValueError when the model's attention cannot be captured by torch.export."""
    config = getattr(model, "config", None)
    if config is None:
        raise ValueError(f"{type(model).__name__} has no .config: causal_lm_loss expects a Hugging Face "
                         "*ForCausalLM model; for your own module, make its forward return the loss")
    attention = getattr(config, "_attn_implementation", None)
    if attention not in TRACEABLE_ATTENTION:
        raise ValueError(f"attn_implementation={attention!r} cannot be captured by torch.export; "
                         "build the model with attn_implementation='sdpa' (or 'eager')")
    return CausalLMLoss(model)
