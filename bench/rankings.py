"""Offline mesh rankings (meta device, no GPU): what mesh="auto" with zero="auto" and
recompute="auto" chooses for Llama-3-shaped models on H100s, and why.

    python bench/rankings.py            # every case
    python bench/rankings.py 8b         # one case, by name
    python bench/rankings.py titan      # torchtitan's long-sequence meshes, planned as given

Each case prints the planning time (wall clock, and this process's CPU time: the machine may be
shared), the ranking table (the plan notes), and the winner's predicted tokens/s per GPU. Llama
shapes are Hugging Face ``LlamaForCausalLM`` configs built on the meta device (Llama 3.1 8B and
70B: vocabulary 128,256, GQA with 8 key/value heads, SwiGLU). The long-sequence cases (32k-128k
tokens) rank context parallelism too; their batches are torchtitan's (local batch 1 on its meshes).

"titan" plans torchtitan's published 8-GPU FSDP x CP runs of Llama 3.1 8B (H100 96 GB at 500 W,
full recompute, local batch 1) on their own meshes, zero=3 (FSDP) and recompute="full", and prints
autopar's predicted tokens/s/GPU beside the published one.
"""
from __future__ import annotations

import sys
import time

import torch

import autopar
import autopar.hf
from autopar.cost_model.devices import DEVICES
from autopar.examples.gpt import build, example_inputs

LLAMA = {
    "8b": dict(hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32),
    "70b": dict(hidden_size=8192, intermediate_size=28672, num_hidden_layers=80, num_attention_heads=64),
}

DEVICE = "h100"
# name: (model, gpus, global batch, sequence, budget (None: the device's memory), what the case is about)
CASES = {
    "8b": ("llama-8b", 8, 16, 8192, None, "Llama 3.1 8B on one 8-GPU node; torchtitan's published run is "
           "FSDP 8, compile, local batch 2 (global 16), seq 8192, selective AC: 6,667 tokens/s/GPU on "
           "H100 96 GB at 500 W"),
    "8b-96": ("llama-8b", 8, 16, 8192, "96GB", "the same on torchtitan's 96 GB H100s"),
    "70b": ("llama-70b", 64, 64, 8192, None, "Llama 3.1 70B on 8 nodes of 8"),
    "8b-32k": ("llama-8b", 8, 8, 32768, None, "Llama 3.1 8B at 32k tokens per sequence on one 8-GPU node, "
               "torchtitan's batch (FSDP 8, local batch 1)"),
    "8b-64k": ("llama-8b", 8, 4, 65536, None, "the same at 64k tokens, torchtitan's batch (FSDP 4 x CP 2, "
               "local batch 1)"),
    "8b-128k": ("llama-8b", 8, 2, 131072, None, "the same at 128k tokens, torchtitan's batch (FSDP 2 x CP 4, "
                "local batch 1)"),
    "8b-128k-64": ("llama-8b", 64, 16, 131072, None, "Llama 3.1 8B at 128k tokens on 8 nodes of 8, "
                   "16 sequences (2M tokens) per step"),
    "175b": ("gpt3-175b", 512, 1536, 2048, None, "GPT-3 175B on 64 nodes of 8 (Megatron's 2021 run: "
             "tp 8, pp 12 on 1,536 A100s)"),
}


def build_model(name: str, seq: int):
    """The model of a case on the meta device: a Hugging Face Llama of ``LLAMA``'s shape ("llama-8b:8":
    its first 8 layers), or a GPT config."""
    if name.startswith("llama-"):
        from transformers import LlamaConfig, LlamaForCausalLM
        size, _, layers = name.split("-")[1].partition(":")
        shape = {**LLAMA[size], **({"num_hidden_layers": int(layers)} if layers else {})}
        cfg = LlamaConfig(vocab_size=128256, num_key_value_heads=8, max_position_embeddings=seq,
                          rope_theta=500000.0, **shape)
        with torch.device("meta"):
            return autopar.hf.causal_lm_loss(LlamaForCausalLM(cfg))
    return build(name, device="meta")


def _inputs(model, name: str, batch: int, seq: int):
    if name.startswith("llama-"):
        idx = torch.zeros(batch, seq, dtype=torch.long, device="meta")
        return idx, idx
    return example_inputs(model.config, batch, seq, device="meta")


# torchtitan's published Llama 3.1 8B runs on 8 H100s (96 GB, 500 W), full recompute, local batch 1:
# sequence: (mesh, global batch, tokens/s/GPU)
TITAN = {32768: ({"dp": 8}, 8, 3890), 65536: ({"dp": 4, "cp": 2}, 4, 2540), 131072: ({"dp": 2, "cp": 4}, 2, 1071)}


def run(case: str) -> None:
    name, gpus, batch, seq, budget, about = CASES[case]
    model = build_model(name, seq)
    inputs = _inputs(model, name, batch, seq)
    params = sum(p.numel() for p in model.parameters())
    start, cpu = time.perf_counter(), time.process_time()
    plan = autopar.plan(model, "auto", inputs, world_size=gpus, device=DEVICE, zero="auto", recompute="auto",
                        precision="bf16", memory_budget=budget, sequence_parallel="auto")
    seconds, cpu = time.perf_counter() - start, time.process_time() - cpu
    tokens = batch * seq / plan.predicted_step_time / gpus
    budget = budget or f"the device memory, {DEVICES[DEVICE].memory_bytes / 2**30:.2f} GiB"
    print(f"## {case}: {name} ({params / 1e9:.2f}B parameters), {gpus} H100, batch {batch} x {seq}, "
          f"budget {budget}\n{about}\n")
    split = f" (HSDP {plan.dp_replicate} x {plan.mesh[0] // plan.dp_replicate})" if plan.dp_replicate > 1 else ""
    split += f" cp={plan.cp}" if plan.cp > 1 else ""
    print(f"planned in {seconds:.1f} s ({cpu:.1f} s CPU); chosen {plan.mesh}{split} zero={plan.zero} "
          f"recompute {plan.recompute} ({len(plan.recompute_regions)} regions); predicted {plan.predicted_step_time * 1e3:.1f} ms/step, "
          f"{tokens:,.0f} tokens/s/GPU, MFU {plan.predicted_mfu:.1%}\n")
    for note in plan.notes:
        print(note)
    print()


def titan() -> None:
    """torchtitan's 8-GPU FSDP x CP runs planned on their meshes: predicted against published tokens/s/GPU."""
    print("## titan: Llama 3.1 8B on torchtitan's FSDP x CP meshes, zero=3, recompute=full, bf16, 8 H100\n")
    print("| sequence | mesh | batch | predicted step | peak GiB | predicted tokens/s/GPU | published | MFU |")
    print("|---:|---|---:|---:|---:|---:|---:|---:|")
    for seq, (mesh, batch, published) in TITAN.items():
        model = build_model("llama-8b", seq)
        plan = autopar.plan(model, mesh, _inputs(model, "llama-8b", batch, seq), device=DEVICE, zero=3,
                            recompute="full", precision="bf16", microbatches=1)
        tokens = batch * seq / plan.predicted_step_time / 8
        name = " x ".join(f"{'FSDP' if axis == 'dp' else 'CP'} {n}" for axis, n in mesh.items())
        print(f"| {seq:,} | {name} | {batch} | {plan.predicted_step_time:.3f} s | "
              f"{max(m.peak for m in plan.memory) / 2**30:.1f} | {tokens:,.0f} | {published:,} | "
              f"{plan.predicted_mfu:.1%} |")
    print()


def main(argv: list[str]) -> None:
    for case in argv or [*CASES, "titan"]:
        if case == "titan":
            titan()
        elif case not in CASES:
            raise SystemExit(f"unknown case {case!r}; cases: {', '.join(CASES)}, titan")
        else:
            run(case)


if __name__ == "__main__":
    main(sys.argv[1:])
