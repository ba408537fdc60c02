"""Predicted vs measured peak memory and step time for recompute none / selective / full (one GPU).

    python bench/recompute_gpu.py [--layers 8] [--embd 2048] [--heads 16] [--seq 2048] [--batch 4]

A bf16 GPT (weights, gradients, Adam state and activations all bf16) on mesh (1,1,1): for each
recompute mode, the plan's predicted per-rank peak (parameters + gradients + optimizer state +
activations kept for backward) against torch.cuda.max_memory_allocated over a training step,
and the median step time, eager and under torch.compile (Inductor).
"""
from __future__ import annotations

import argparse
import statistics
import time

import torch


def _run(rank, world, args, mode, compile_):
    import autopar
    from autopar.examples.gpt import GPTConfig, GPT, example_inputs

    cfg = GPTConfig(vocab_size=args.vocab, block_size=args.seq, n_layer=args.layers, n_head=args.heads,
                    n_embd=args.embd, attention=args.attention)
    torch.manual_seed(0)
    with torch.device("cuda"):
        model = GPT(cfg).to(torch.bfloat16)
    idx, tgt = (t.cuda() for t in example_inputs(cfg, args.batch, args.seq))
    pm = autopar.parallelize(model, (1, 1, 1), (idx, tgt), recompute=mode, compile=compile_, device="h200")
    del model
    opt = pm.optimizer(torch.optim.AdamW, lr=1e-4)
    times = []
    for step in range(args.steps):
        torch.cuda.synchronize()
        if step == 1:
            torch.cuda.reset_peak_memory_stats()
        t0 = time.perf_counter()
        opt.zero_grad(set_to_none=True)
        pm.train_step(idx, tgt)
        opt.step()
        torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
    mem = pm.plan.memory[0]
    return dict(mode=mode, compile=compile_, predicted=mem.peak, activations=mem.activations,
                measured=torch.cuda.max_memory_allocated(), step=statistics.median(times[2:]))


def main(argv=None):
    from autopar.launch import spawn

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--embd", type=int, default=2048)
    ap.add_argument("--heads", type=int, default=16)
    ap.add_argument("--seq", type=int, default=2048)
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--vocab", type=int, default=50304)
    ap.add_argument("--attention", default="sdpa", choices=["sdpa", "explicit"])
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--compile", default="eager,inductor")
    args = ap.parse_args(argv)
    print(f"GPT {args.layers} layers, h={args.embd}, {args.heads} heads, seq {args.seq}, batch {args.batch}, "
          f"vocab {args.vocab}, {args.attention} attention, bf16, {torch.cuda.get_device_name()}")
    print(f"{'backend':9s} {'recompute':10s} {'pred GiB':>9s} {'meas GiB':>9s} {'meas/pred':>9s} "
          f"{'pred act GiB':>12s} {'step ms':>8s} {'vs none':>8s}")
    for backend in args.compile.split(","):
        base = None
        for mode in ("none", "selective", "full"):
            r = spawn(_run, 1, args, mode, backend == "inductor" or False, backend="nccl", timeout=900)[0]
            base = base or r["step"]
            print(f"{backend:9s} {mode:10s} {r['predicted'] / 2**30:9.2f} {r['measured'] / 2**30:9.2f} "
                  f"{r['measured'] / r['predicted']:9.3f} {r['activations'] / 2**30:12.2f} "
                  f"{r['step'] * 1e3:8.1f} {r['step'] / base:8.3f}", flush=True)


if __name__ == "__main__":
    main()
