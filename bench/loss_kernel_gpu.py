"""The loss alone on one GPU: Inductor's cross-entropy against autopar's (``loss_kernel``).

    python bench/loss_kernel_gpu.py [--rows 16384,65536] [--vocab 50304]

For bf16 logits of each size, forward + backward of F.cross_entropy on the fp32-cast logits
(what a bf16 model's loss runs, under torch.compile) and of ``autopar.kernels.cross_entropy``
(its Triton forward, aten backward; compiled the same way): ms per call, the GPU time of each
kernel (torch.profiler), and the largest gradient difference between the two. 16384 and 65536
rows are the bench's h=2048 GPT at batch 8 and 32 (past 2^31 logits). Writes
``$OUT/loss_kernel_gpu.json``.
"""
from __future__ import annotations

import argparse
import os
import sys
import time

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from compile_gpu import free_memory, markdown, write_report  # noqa: E402


def run(fn, logits, target, repeats: int = 10) -> dict:
    """ms per forward + backward, the kernels' GPU time, and the gradient."""
    from autopar.cost_model.calibrate import kernel_breakdown
    x = logits.detach().requires_grad_()

    def step():
        x.grad = None
        fn(x, target).backward()

    for _ in range(3):
        step()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(repeats):
        step()
    torch.cuda.synchronize()
    ms = (time.perf_counter() - t0) / repeats * 1e3
    top = kernel_breakdown(step)["top"]
    return dict(ms=ms, kernels=[(name, t * 1e3) for name, t in top], grad=x.grad.float())


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", default="16384,65536")
    ap.add_argument("--vocab", type=int, default=50304)
    args = ap.parse_args(argv)
    from autopar.kernels.cross_entropy import cross_entropy
    started = time.perf_counter()
    contenders = {"inductor": lambda x, t: F.cross_entropy(x.float(), t, ignore_index=-1),
                  "autopar": lambda x, t: cross_entropy(x, t, -1)}
    report, rows = dict(torch=torch.__version__, device=torch.cuda.get_device_name(), runs=[]), []
    for n in map(int, args.rows.split(",")):
        g = torch.Generator(device="cuda").manual_seed(0)
        logits = (2 * torch.randn(n, args.vocab, device="cuda", generator=g)).to(torch.bfloat16)
        target = torch.randint(0, args.vocab, (n,), device="cuda", generator=g)
        target[::7] = -1
        grads = {}
        for name, fn in contenders.items():
            free_memory()
            r = run(torch.compile(fn), logits, target)
            grads[name] = r.pop("grad")
            report["runs"].append(dict(rows=n, contender=name, **r))
            rows.append([n, name, f"{r['ms']:.2f}", "; ".join(f"{k[:48]} {t:.2f}" for k, t in r["kernels"][:3])])
            print(f"  {n} {name}: {r['ms']:.2f} ms", flush=True)
        diff = (grads["autopar"] - grads["inductor"]).abs().max().item()
        report.setdefault("max_grad_diff", {})[n] = diff
        print(f"  {n}: largest gradient difference {diff:.3e}", flush=True)
        del logits, grads
    print("\n" + markdown(["rows", "loss", "fwd+bwd ms", "top kernels (ms)"], rows))
    write_report(report, "loss_kernel_gpu.json", started)
    return 0


if __name__ == "__main__":
    sys.exit(main())
