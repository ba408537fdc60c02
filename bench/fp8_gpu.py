"""Float8 linears (autopar.fp8) against bf16 on one Hopper GPU: matmuls, a training step, a loss curve.

    python bench/fp8_gpu.py [--parts gemm,linear,step,loss] [--steps 200] [--cpu-smoke]

- gemm: for the matmul shapes of the h=2048 GPT (8 x 2048 tokens; c_attn, attn c_proj, c_fc,
  mlp c_proj, lm_head), bf16 ``torch.mm`` against ``torch._scaled_mm`` on inputs already in
  float8, with fast accumulation (the forward's) and with fp32 accumulation (the gradients'):
  the ceiling of the speedup.
- linear: the same shapes as whole linears, forward and both gradients: bf16 ``F.linear`` (cuBLAS,
  eager) against ``fp8_linear`` under torch.compile, which includes the dynamic-scaling casts.
- step: one training step of that GPT (h=2048, 8 layers, 16 heads, seq 2048, vocab 50304, batch 8)
  in bf16 under torch.compile, against the same model after ``swap_linears`` (every block linear in
  float8, the tied lm_head in bf16); tokens/s and MFU at the bf16 peak (989 TFLOP/s; the float8 peak
  is 1979).
- loss: a small GPT (h=512, 4 layers, vocab 256: the bytes of examples/data) trained ``--steps``
  steps from the same initialisation on the same batches in bf16 and in float8 (eager: this part
  compares numerics, not speed); the largest relative gap between the two loss curves, per step and
  over a moving mean of 10 steps.

Prints markdown tables and writes ``$OUT/fp8_gpu.json``. About 2-3 minutes on an H200.
``--cpu-smoke`` runs every part with tiny shapes on CPU (where this torch's ``_scaled_mm`` runs).
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from compile_gpu import (GiB, PEAK_BF16, free_memory, markdown, model_flops, sync, timed_steps,  # noqa: E402
                         write_report)

PEAK_FP8 = 1979e12


def _time(fn, device, repeats: int) -> float:
    """Seconds per call: median of ``repeats`` timed calls after two warm-up calls."""
    for _ in range(2):
        fn()
    sync(device)
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        sync(device)
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def gpt_linear_shapes(tokens: int, hidden: int, vocab: int) -> dict[str, tuple[int, int, int]]:
    """(M, N, K) of y[M, N] = x[M, K] @ w[N, K].T for each linear of a GPT block and the head."""
    return {"c_attn": (tokens, 3 * hidden, hidden), "attn.c_proj": (tokens, hidden, hidden),
            "c_fc": (tokens, 4 * hidden, hidden), "mlp.c_proj": (tokens, hidden, 4 * hidden),
            "lm_head": (tokens, vocab, hidden)}


def bench_gemm(shapes, device, repeats: int) -> list[dict]:
    """bf16 mm against _scaled_mm of float8 inputs (scales of one), per shape."""
    from autopar.fp8 import E4M3, scaled_mm
    one = torch.ones((), device=device)
    out = []
    for name, (m, n, k) in shapes.items():
        a = torch.randn(m, k, device=device, dtype=torch.bfloat16)
        b = torch.randn(n, k, device=device, dtype=torch.bfloat16)
        aq, bq = a.to(E4M3), b.to(E4M3)
        bf16 = _time(lambda: a @ b.t(), device, repeats)
        fp8 = _time(lambda: scaled_mm(aq, one, bq.t(), one, torch.bfloat16, fast_accum=True), device, repeats)
        exact = _time(lambda: scaled_mm(aq, one, bq.t(), one, torch.bfloat16), device, repeats)
        flops = 2 * m * n * k
        out.append(dict(shape=name, m=m, n=n, k=k, bf16_s=bf16, fp8_s=fp8, fp8_fp32_accum_s=exact, speedup=bf16 / fp8,
                        bf16_tflops=flops / bf16 / 1e12, fp8_tflops=flops / fp8 / 1e12,
                        fp8_fp32_accum_tflops=flops / exact / 1e12))
    return out


def bench_linear(shapes, device, repeats: int) -> list[dict]:
    """Forward + backward of one linear: bf16 F.linear (eager) against compiled fp8_linear, per shape."""
    from autopar.fp8 import fp8_linear
    out = []
    for name, (m, n, k) in shapes.items():
        x = torch.randn(m, k, device=device, dtype=torch.bfloat16, requires_grad=True)
        w = (torch.randn(n, k, device=device, dtype=torch.bfloat16) * 0.02).requires_grad_()
        g = torch.randn(m, n, device=device, dtype=torch.bfloat16)
        compiled = torch.compile(fp8_linear)

        def run(fn):
            x.grad = w.grad = None
            fn(x, w).backward(g)

        bf16 = _time(lambda: run(F.linear), device, repeats)
        t0 = time.perf_counter()
        run(compiled)
        sync(device)
        compile_s = time.perf_counter() - t0
        fp8 = _time(lambda: run(compiled), device, repeats)
        out.append(dict(shape=name, m=m, n=n, k=k, bf16_s=bf16, fp8_s=fp8, speedup=bf16 / fp8, compile_s=compile_s))
        free_memory()
    return out


def _gpt(cfg, device, fp8: bool):
    from autopar.examples.gpt import GPT
    from autopar.fp8 import swap_linears
    torch.manual_seed(0)
    with torch.device(device):
        model = GPT(cfg).to(torch.bfloat16)
    if fp8:
        swap_linears(model)
    return model


def _step_variant(cfg, batch: int, seq: int, device, steps: int, fp8: bool) -> dict:
    from autopar.examples.gpt import example_inputs
    free_memory()
    idx, tgt = example_inputs(cfg, batch, seq, device=device)
    model = _gpt(cfg, device, fp8)
    compiled = torch.compile(model)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True)

    def step():
        opt.zero_grad(set_to_none=True)
        loss = compiled(idx, tgt)
        loss.backward()
        opt.step()
        return loss.detach()

    r = timed_steps(step, steps, device)
    r.pop("codes")
    flops = model_flops(batch, seq, cfg.n_layer, cfg.n_embd, cfg.vocab_size)
    r.update(variant="fp8" if fp8 else "bf16", tokens_per_s=batch * seq / r["step_s"],
             mfu_bf16_peak=flops / r["step_s"] / PEAK_BF16)
    return r


def bench_step(cfg, batch: int, seq: int, device, steps: int) -> list[dict]:
    """A compiled training step of the GPT in bf16 and with float8 block linears (one after the other)."""
    out = [_step_variant(cfg, batch, seq, device, steps, fp8) for fp8 in (False, True)]
    out[1]["speedup"] = out[0]["step_s"] / out[1]["step_s"]
    return out


def _moving_mean(values: list[float], window: int) -> list[float]:
    return [statistics.fmean(values[i - window:i]) for i in range(window, len(values) + 1)]


def loss_curves(cfg, batch: int, seq: int, device, steps: int, lr: float = 1e-3) -> dict:
    """bf16 and float8 loss curves from one initialisation on the same batches (eager)."""
    from autopar.examples.train_gpt import get_batch, load_corpus
    tokens = load_corpus()
    curves = {}
    for fp8 in (False, True):
        model = _gpt(cfg, device, fp8)
        opt = torch.optim.AdamW(model.parameters(), lr=lr, fused=device.type == "cuda")
        losses = []
        for s in range(steps):
            idx, tgt = (t.to(device) for t in get_batch(tokens, batch, seq, s, seed=0))
            opt.zero_grad(set_to_none=True)
            loss = model(idx, tgt)
            loss.backward()
            opt.step()
            losses.append(loss.detach())
        curves["fp8" if fp8 else "bf16"] = [float(x) for x in losses]
    a, b = curves["bf16"], curves["fp8"]
    gaps = [abs(x - y) / x for x, y in zip(a, b)]
    window = min(10, steps)
    smooth_gaps = [abs(x - y) / x for x, y in zip(_moving_mean(a, window), _moving_mean(b, window))]
    return dict(curves=curves, max_rel_gap=max(gaps), max_rel_gap_smoothed=max(smooth_gaps),
                first=(a[0], b[0]), last=(a[-1], b[-1]))


def main(argv=None) -> int:
    from autopar.examples.gpt import GPTConfig

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--parts", default="gemm,linear,step,loss")
    ap.add_argument("--steps", type=int, default=200, help="training steps of the loss comparison")
    ap.add_argument("--cpu-smoke", action="store_true", help="tiny shapes on CPU, to check every code path")
    args = ap.parse_args(argv)
    parts = args.parts.split(",")
    if set(parts) - {"gemm", "linear", "step", "loss"}:
        ap.error("--parts takes gemm, linear, step and/or loss")
    if args.cpu_smoke:
        device, repeats, step_steps, loss_steps = torch.device("cpu"), 3, 3, min(args.steps, 20)
        big = GPTConfig(vocab_size=512, block_size=64, n_layer=2, n_head=4, n_embd=64)
        big_batch, small = 4, GPTConfig(vocab_size=256, block_size=32, n_layer=2, n_head=4, n_embd=32)
        small_batch = 8
    else:
        if not torch.cuda.is_available():
            ap.error("no CUDA device: run on a Hopper GPU, or pass --cpu-smoke to check the script on CPU")
        if torch.cuda.get_device_capability() < (8, 9):
            ap.error(f"{torch.cuda.get_device_name()} has no float8 tensor cores (needs compute capability 8.9+)")
        device, repeats, step_steps, loss_steps = torch.device("cuda", 0), 20, 10, args.steps
        big = GPTConfig(vocab_size=50304, block_size=2048, n_layer=8, n_head=16, n_embd=2048)
        big_batch, small = 8, GPTConfig(vocab_size=256, block_size=256, n_layer=4, n_head=8, n_embd=512)
        small_batch = 32
    started = time.perf_counter()
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    print(f"# fp8_gpu: torch {torch.__version__}, {name}", flush=True)
    report: dict = dict(torch=torch.__version__, device=name)
    shapes = gpt_linear_shapes(big_batch * big.block_size, big.n_embd, big.vocab_size)

    if "gemm" in parts:
        report["gemm"] = bench_gemm(shapes, device, repeats)
        print("\n## GEMM: bf16 mm vs float8 _scaled_mm (inputs already float8)\n")
        print(markdown(["linear", "M x N x K", "bf16 TFLOP/s", "fp8 TFLOP/s (fast accum)", "fp8 TFLOP/s (fp32 accum)",
                        "speedup (fast accum)"],
                       [[r["shape"], f"{r['m']} x {r['n']} x {r['k']}", f"{r['bf16_tflops']:.1f}",
                         f"{r['fp8_tflops']:.1f}", f"{r['fp8_fp32_accum_tflops']:.1f}", f"{r['speedup']:.2f}x"]
                        for r in report["gemm"]]), flush=True)
    if "linear" in parts:
        report["linear"] = bench_linear(shapes, device, repeats)
        print("\n## Linear forward + backward: bf16 F.linear vs compiled fp8_linear (casts included)\n")
        print(markdown(["linear", "M x N x K", "bf16 ms", "fp8 ms", "speedup", "compile s"],
                       [[r["shape"], f"{r['m']} x {r['n']} x {r['k']}", f"{r['bf16_s'] * 1e3:.3f}",
                         f"{r['fp8_s'] * 1e3:.3f}", f"{r['speedup']:.2f}x", f"{r['compile_s']:.1f}"]
                        for r in report["linear"]]), flush=True)
    if "step" in parts:
        report["step"] = bench_step(big, big_batch, big.block_size, device, step_steps)
        print(f"\n## Training step, GPT h={big.n_embd} L={big.n_layer} batch {big_batch} x {big.block_size}\n")
        print(markdown(["variant", "step ms", "tokens/s", "MFU (bf16 peak)", "peak GiB", "compile s", "speedup"],
                       [[r["variant"], f"{r['step_s'] * 1e3:.1f}", f"{r['tokens_per_s']:,.0f}",
                         f"{r['mfu_bf16_peak']:.1%}",
                         f"{r['peak_bytes'] / GiB:.2f}" if r["peak_bytes"] == r["peak_bytes"] else "-",
                         f"{r['compile_s']:.1f}", f"{r.get('speedup', 1.0):.3f}x"] for r in report["step"]]),
              flush=True)
    if "loss" in parts:
        r = loss_curves(small, small_batch, small.block_size, device, loss_steps)
        report["loss"] = r
        print(f"\n## Loss, bf16 vs float8, GPT h={small.n_embd} L={small.n_layer}, {loss_steps} steps\n")
        print(markdown(["", "bf16", "fp8"], [["first loss", f"{r['first'][0]:.4f}", f"{r['first'][1]:.4f}"],
                                             ["last loss", f"{r['last'][0]:.4f}", f"{r['last'][1]:.4f}"]]))
        print(f"\nmax relative gap per step {r['max_rel_gap']:.2%}; over a 10-step moving mean "
              f"{r['max_rel_gap_smoothed']:.2%}", flush=True)

    write_report(report, "fp8_gpu.json", started)
    return 0


if __name__ == "__main__":
    sys.exit(main())
