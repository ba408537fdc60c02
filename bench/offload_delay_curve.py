"""The loss curve of the one-step-late host update (``offload_delay=1``) beside the exact one.

    python bench/offload_delay_curve.py                 # 40 steps of a small GPT on the CPU, ~1 minute
    python bench/offload_delay_curve.py --steps 10      # quicker

A 4-layer GPT (width 128) trains with AdamW (lr 1e-3) on a cycle of 8 random batches, from the same
initial weights, four ways under ``offload="optimizer"``: exact (every unit offloaded, updated in
the backward), delayed with everything offloaded, delayed with the embedding, the first two blocks
and the head kept on the device (those stay exact), and exact with that split. It prints the loss
at every fifth step of each run, each delayed run's difference from the exact one, and the mean
loss over the last ten steps.
"""
from __future__ import annotations

import argparse
import dataclasses
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(__file__))
from compile_gpu import markdown, single_process_group  # noqa: E402

KEPT = ("embedding", "transformer.h.0", "transformer.h.1", "head")


def curve(cfg, batches, steps: int, kept=(), delay: int = 0) -> list[float]:
    """The losses of ``steps`` AdamW steps of the GPT of ``cfg`` over ``batches`` in turn, offloaded."""
    import autopar
    from autopar.examples.gpt import GPT

    torch.manual_seed(0)
    model = GPT(cfg)
    plan = autopar.plan(model, (1, 1, 1), batches[0], offload="optimizer", device="cpu")
    plan = dataclasses.replace(plan, offload_kept=kept, offload_delay=delay)
    pm = autopar.parallelize(model, mesh=(1, 1, 1), example_inputs=batches[0], plan=plan, compile=False, device="cpu")
    opt = pm.optimizer(torch.optim.AdamW, lr=1e-3)
    out = []
    for i in range(steps):
        opt.zero_grad()
        out.append(pm.train_step(*batches[i % len(batches)]).item())
        opt.step()
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=40)
    args = ap.parse_args(argv)
    from autopar.examples.gpt import GPTConfig, example_inputs

    single_process_group()
    torch.set_num_threads(1)   # the same sums in every run, whatever the machine's cores
    cfg = GPTConfig(vocab_size=256, block_size=64, n_layer=4, n_head=4, n_embd=128)
    batches = [example_inputs(cfg, 8, 64, seed=s) for s in range(8)]
    runs = {"exact": curve(cfg, batches, args.steps), "delayed, all offloaded": curve(cfg, batches, args.steps, delay=1),
            "exact, 2 blocks kept": curve(cfg, batches, args.steps, kept=KEPT),
            "delayed, 2 blocks kept": curve(cfg, batches, args.steps, kept=KEPT, delay=1)}
    exact = runs["exact"]
    rows = []
    for i in [*range(0, args.steps, 5), args.steps - 1]:
        rows.append([str(i + 1), *(f"{c[i]:.4f}" if name.startswith("exact") else f"{c[i]:.4f} ({c[i] - exact[i]:+.4f})"
                                   for name, c in runs.items())])
    tail = min(10, args.steps)
    rows.append([f"mean of the last {tail}", *(f"{sum(c[-tail:]) / tail:.4f}" for c in runs.values())])
    print(markdown(["step", *runs], rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
