"""Hugging Face Llama and Qwen2 in bf16 on one GPU: autopar (1,1,1) against plain torch.compile.

    python bench/hf_bf16_gpu.py [--models llama,qwen2] [--sizes tiny,1b] [--steps 20] [--cpu-smoke]

For each model and size it trains the same randomly initialised ``*ForCausalLM`` (wrapped by
``autopar.hf.causal_lm_loss``, sdpa attention) two ways in one process:

- plain: ``torch.compile`` of the wrapper, its fp32 weights run under
  ``torch.autocast("cuda", torch.bfloat16)``, fused AdamW;
- autopar: ``autopar.parallelize(..., mesh=(1, 1, 1), precision="bf16")`` (Inductor), fused AdamW
  over ``pm.parameters()``.

"tiny" is the configuration that failed on the H200 before the rotary tables kept their traced
dtype (hidden 256, 2 layers, 4 heads, 2 key/value heads, intermediate 512, vocab 512, batch 4 x 128);
it also runs autopar with ``compile="aot_eager"`` and ``compile=False``. "1b" is a Llama-shaped
model of about 0.5B parameters (hidden 2048, 8 layers, 16 heads, 8 key/value heads, intermediate
5632, vocab 32000, batch 8 x 1024). Qwen2 differs from Llama by its biased q/k/v projections.

Prints a markdown table (step time, tokens/s, peak memory, first and last loss) and writes
``$OUT/hf_bf16_gpu.json``. MFU counts the FLOPs torch's flop counter finds in one step of the
unsharded model at that batch, against 989 TFLOP/s.
"""
from __future__ import annotations

import argparse
import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(__file__))
from compile_gpu import (PEAK_BF16, GiB, free_memory, markdown, single_process_group,  # noqa: E402
                         timed_steps, write_report)

SIZES = {   # hidden, layers, heads, kv heads, intermediate, vocab, batch, seq
    "tiny": (256, 2, 4, 2, 512, 512, 4, 128),
    "1b": (2048, 8, 16, 8, 5632, 32000, 8, 1024),
}


def build(name: str, size: str, device):
    """A random HF causal LM wrapped to return its loss, and a batch (ids, labels)."""
    import transformers
    from autopar.hf import causal_lm_loss
    hidden, layers, heads, kv, inter, vocab, batch, seq = SIZES[size]
    common = dict(vocab_size=vocab, hidden_size=hidden, intermediate_size=inter, num_hidden_layers=layers,
                  num_attention_heads=heads, num_key_value_heads=kv, max_position_embeddings=seq,
                  attn_implementation="sdpa")
    cfg = (transformers.LlamaConfig(**common) if name == "llama" else transformers.Qwen2Config(**common))
    cls = transformers.LlamaForCausalLM if name == "llama" else transformers.Qwen2ForCausalLM
    torch.manual_seed(0)
    with torch.device(device):
        model = causal_lm_loss(cls(cfg))
    ids = torch.randint(0, vocab, (batch, seq), generator=torch.Generator().manual_seed(1)).to(device)
    return model, ids


def step_flops(name: str, size: str, device) -> float:
    """FLOPs of one forward + backward of the unsharded model (run once: Hugging Face's mask code
    reads tensor values, so the meta device will not do)."""
    from torch.utils.flop_counter import FlopCounterMode
    model, ids = build(name, size, device)
    with FlopCounterMode(display=False) as counter:
        model(ids, ids).backward()
    return float(counter.get_total_flops())


def run_plain(name, size, device, steps):
    free_memory()
    model, ids = build(name, size, device)
    compiled = torch.compile(model)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=device.type == "cuda")

    def step():
        opt.zero_grad(set_to_none=True)
        with torch.autocast(device.type, dtype=torch.bfloat16):
            loss = compiled(ids, ids)
        loss.backward()
        opt.step()
        return loss.detach()

    return timed_steps(step, steps, device)


def run_autopar(name, size, device, steps, compile=True):
    import autopar
    free_memory()
    model, ids = build(name, size, device)
    t0 = time.perf_counter()
    pm = autopar.parallelize(model, (1, 1, 1), (ids, ids), precision="bf16", compile=compile)
    setup_s = time.perf_counter() - t0
    opt = pm.optimizer(torch.optim.AdamW, lr=1e-4, fused=device.type == "cuda")

    def step():
        opt.zero_grad(set_to_none=True)
        loss = pm.train_step(ids, ids)
        opt.step()
        return loss.detach()

    result = timed_steps(step, steps, device)
    result.update(setup_s=setup_s)
    return result


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", default="llama,qwen2")
    ap.add_argument("--sizes", default="tiny,1b")
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--cpu-smoke", action="store_true", help="tiny size on CPU, 2 steps, every code path")
    args = ap.parse_args(argv)
    started = time.perf_counter()
    if args.cpu_smoke:
        device, sizes, steps = torch.device("cpu"), ["tiny"], 2
    else:
        device, sizes, steps = torch.device("cuda"), args.sizes.split(","), args.steps
    single_process_group()
    import transformers
    rows, report = [], dict(torch=torch.__version__, transformers=transformers.__version__,
                            gpu=torch.cuda.get_device_name() if device.type == "cuda" else "cpu", runs={})
    for name in args.models.split(","):
        for size in sizes:
            flops = step_flops(name, size, device)
            batch, seq = SIZES[size][6:]
            contenders = {"plain": lambda: run_plain(name, size, device, steps),
                          "autopar": lambda: run_autopar(name, size, device, steps)}
            if size == "tiny":
                contenders["autopar aot_eager"] = lambda: run_autopar(name, size, device, steps, "aot_eager")
                contenders["autopar eager"] = lambda: run_autopar(name, size, device, steps, False)
            for who, run in contenders.items():
                key = f"{name}-{size} {who}"
                try:
                    r = run()
                except Exception as e:   # one failing contender must not hide the others' figures
                    report["runs"][key] = dict(error=f"{type(e).__name__}: {e}"[:2000])
                    rows.append([name, size, who, "failed", "", "", "", f"{type(e).__name__}: {str(e)[:120]}"])
                    print(f"{key}: {report['runs'][key]['error']}", flush=True)
                    continue
                r.pop("codes", None)
                r.update(step_flops=flops, tokens_per_s=batch * seq / r["step_s"],
                         mfu=flops / r["step_s"] / PEAK_BF16)
                report["runs"][key] = r
                rows.append([name, size, who, f"{r['step_s'] * 1e3:.1f}", f"{r['tokens_per_s']:,.0f}",
                             f"{r['mfu']:.1%}", f"{r['peak_bytes'] / GiB:.2f}",
                             f"{r['first_loss']:.4f} -> {r['last_loss']:.4f}"])
                print(f"{key}: {r['step_s'] * 1e3:.1f} ms, peak {r['peak_bytes'] / GiB:.2f} GiB, "
                      f"loss {r['first_loss']:.4f} -> {r['last_loss']:.4f}", flush=True)
    print(markdown(["model", "size", "contender", "step ms", "tokens/s", "MFU", "peak GiB", "loss"], rows))
    write_report(report, "hf_bf16_gpu.json", started)


if __name__ == "__main__":
    main()
