"""The model x mesh x knob combinations whose plans are kept as golden files.

``python tests/golden/cases.py [NAME ...]`` (re)writes ``tests/golden/NAME.json`` from the current
planner; ``tests/planner/test_golden_plans.py`` re-plans each case and diffs it against its file. A golden
file changes only on purpose, in the commit that changes the planner's decision or figure, with the
change and its reason said there.
"""
from __future__ import annotations

import sys
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent


def _gpt(name, batch, seq, **overrides):
    from autopar.examples.gpt import build, example_inputs
    model = build(name, device="meta", **overrides)
    return model, example_inputs(model.config, batch, seq, device="meta")


def _hf(kind, batch=8, seq=512):
    import transformers
    from autopar.hf import causal_lm_loss
    with torch.device("meta"):
        if kind == "gpt2":
            cfg = transformers.GPT2Config(vocab_size=50257, n_positions=1024, n_embd=768, n_layer=2, n_head=12,
                                          attn_implementation="sdpa")
            model = causal_lm_loss(transformers.GPT2LMHeadModel(cfg))
        elif kind == "llama":
            cfg = transformers.LlamaConfig(vocab_size=32000, hidden_size=2048, intermediate_size=5632,
                                           num_hidden_layers=2, num_attention_heads=16, num_key_value_heads=4,
                                           attn_implementation="sdpa")
            model = causal_lm_loss(transformers.LlamaForCausalLM(cfg))
        else:
            cfg = transformers.Qwen2Config(vocab_size=151936, hidden_size=4096, intermediate_size=11008,
                                           num_hidden_layers=2, num_attention_heads=32, num_key_value_heads=8,
                                           attn_implementation="sdpa")
            model = causal_lm_loss(transformers.Qwen2ForCausalLM(cfg))
    ids = torch.zeros(batch, seq, dtype=torch.long, device="meta")
    return model, (ids, ids)


# name -> (model and inputs, mesh, knobs for autopar.plan)
CASES = {
    "gpt2-tp4": (lambda: _gpt("gpt2", 8, 1024), (1, 1, 4), {}),
    "gpt2-tp4-selective": (lambda: _gpt("gpt2", 8, 1024), (1, 1, 4), dict(recompute="selective")),
    "gpt2-dp2-tp4-bf16": (lambda: _gpt("gpt2", 16, 1024), (2, 1, 4), dict(precision="bf16")),
    "gpt2-pp2-tp4": (lambda: _gpt("gpt2", 8, 1024), (1, 2, 4), {}),
    "gpt2-pp4-tp2-interleaved": (lambda: _gpt("gpt2", 8, 1024), (1, 4, 2), dict(schedule="Interleaved1F1B")),
    "gpt3-1.3b-tp8-sp": (lambda: _gpt("gpt3-1.3b", 8, 2048, n_layer=4), (1, 1, 8), dict(sequence_parallel=True)),
    "gpt3-1.3b-dp2-tp4-zero1": (lambda: _gpt("gpt3-1.3b", 16, 2048, n_layer=4), (2, 1, 4), dict(zero=1)),
    "gpt3-2.7b-pp2-tp4-recompute-auto": (lambda: _gpt("gpt3-2.7b", 16, 2048, n_layer=8), (1, 2, 4),
                                         dict(recompute="auto", memory_budget="5GiB", microbatches=8)),
    "gpt3-2.7b-tp4-recompute-auto": (lambda: _gpt("gpt3-2.7b", 8, 2048, n_layer=8), (1, 1, 4),
                                     dict(recompute="auto", memory_budget="6GiB")),
    "gpt3-13b-mesh-auto-64": (lambda: _gpt("gpt3-13b", 64, 2048), "auto", dict(world_size=64)),
    "gpt3-175b-tp8": (lambda: _gpt("gpt3-175b", 8, 2048), (1, 1, 8), {}),
    "tiny-tp2-cpu": (lambda: _gpt("tiny", 8, 32), (1, 1, 2), dict(device="cpu")),
    "hf-gpt2-tp2-megatron": (lambda: _hf("gpt2"), (1, 1, 2), dict(plan="megatron")),
    "hf-llama-tp4": (lambda: _hf("llama"), (1, 1, 4), {}),
    "hf-llama-pp2-tp2": (lambda: _hf("llama"), (1, 2, 2), dict(microbatches=4)),
    "hf-qwen2-tp8": (lambda: _hf("qwen2", 8, 2048), (1, 1, 8), {}),
}


def plan_case(name: str):
    """The plan autopar makes today for case ``name`` (h100 unless the case says otherwise)."""
    import autopar
    make, mesh, knobs = CASES[name]
    model, inputs = make()
    return autopar.plan(model, mesh, inputs, **{"device": "h100", **knobs})


def main(names):
    for name in names or CASES:
        plan_case(name).to_json(HERE / f"{name}.json")
        print(f"wrote {name}.json")


if __name__ == "__main__":
    main(sys.argv[1:])
