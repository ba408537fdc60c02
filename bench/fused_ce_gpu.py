"""Peak memory and time of the head linear + cross-entropy, unfused vs fused (one GPU, bf16).

    python bench/fused_ce_gpu.py [--tokens 8192,16384] [--hidden 2048] [--vocab 50304] [--chunks 0,4096,16384]

First checks the Triton row kernels against the torch reference of the same chunked op, and
the fused loss and gradients against an fp32 unfused computation (a full vocabulary and a
padded vocab-parallel shard); exits with status 1 on a mismatch. Then, per token count,
forward + backward of:

    unfused eager     F.cross_entropy(F.linear(h, w).float(), y)  (fp32 logits, as under autocast)
    unfused compile   the same under torch.compile (Inductor)
    fused torch       autopar::linear_cross_entropy, torch row ops (impl="torch")
    fused triton      autopar::linear_cross_entropy, Triton row kernels (impl="triton"), at each
                      of ``--chunks`` vocabulary columns per chunk (0: the op's default)

Peak is torch.cuda.max_memory_allocated during one step minus what was allocated before it
(the inputs), reset between variants; time is triton.testing.do_bench's median.
"""
from __future__ import annotations

import argparse
import sys

import torch
import torch.nn.functional as F

GiB = 2 ** 30


def _inputs(n, h, v, seed=0, device="cuda"):
    g = torch.Generator(device=device).manual_seed(seed)
    hidden = torch.randn(n, h, device=device, generator=g).bfloat16().requires_grad_()
    weight = (torch.randn(v, h, device=device, generator=g) / h ** 0.5).bfloat16().requires_grad_()
    labels = torch.randint(0, v, (n,), device=device, generator=g)
    labels[::17] = -100
    return hidden, weight, labels


def _unfused(h, w, y):
    return F.cross_entropy(F.linear(h, w).float(), y)


def _grads(fn, h, w, y):
    h.grad = w.grad = None
    loss = fn(h, w, y)
    loss.backward()
    return [loss.detach().float(), h.grad, w.grad]


def _rel(a, b) -> float:
    a, b = a.float(), b.float()
    return ((a - b).norm() / b.norm().clamp_min(1e-30)).item()


def check(n=4096, hidden=2048, vocab=50257, chunk=8192, tol=1e-2, device="cuda") -> bool:
    """Triton vs the torch reference, and fused vs unfused fp32; prints each relative error.

    The full-vocabulary check uses ``vocab`` + 47 columns; the shard check takes the last of 4
    padded shards of ``vocab`` (so it ends in padding rows when 4 does not divide it)."""
    from autopar.kernels.fused_linear_ce import linear_cross_entropy

    ok = True
    h, w, y = _inputs(n, hidden, vocab + 47, seed=1, device=device)
    tri = _grads(lambda *a: linear_cross_entropy(*a, chunk=chunk, impl="triton"), h, w, y)
    ref = _grads(lambda *a: linear_cross_entropy(*a, chunk=chunk, impl="torch"), h, w, y)
    full = _grads(lambda a, b, c: F.cross_entropy(F.linear(a.float(), b.float()), c), h, w, y)
    for name, t, r, f in zip(("loss", "grad_hidden", "grad_weight"), tri, ref, full):
        errs = _rel(t, r), _rel(t, f)
        ok &= max(errs) < tol
        print(f"check {name:12s} triton vs torch {errs[0]:.2e}   triton vs unfused fp32 {errs[1]:.2e}")

    size, rank = 4, 3
    rows = -(-vocab // size)
    shard = F.pad(w.detach()[:vocab], (0, 0, 0, rows * size - vocab))[rank * rows:].clone()
    out = {}
    for impl in ("triton", "torch"):
        hh, ww = h.detach().clone().requires_grad_(), shard.clone().requires_grad_()
        lse, picked = torch.ops.autopar.linear_ce_stats(hh, ww, y, rank * rows, vocab, chunk // 2, impl)
        (lse.sin().sum() + picked.cos().sum()).backward()
        out[impl] = (lse, picked, hh.grad, ww.grad)
    for name, t, r in zip(("shard lse", "shard picked", "shard grad_h", "shard grad_w"), out["triton"], out["torch"]):
        err = _rel(t, r)
        ok &= err < tol
        print(f"check {name:12s} triton vs torch {err:.2e}")
    return ok


def measure(fn, h, w, y):
    """(extra peak bytes over the inputs, median ms) of one forward + backward."""
    from triton.testing import do_bench

    def step():
        fn(h, w, y).backward()

    step()                                   # compile / autotune outside the measurement
    h.grad = w.grad = None
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    step()
    torch.cuda.synchronize()
    peak = torch.cuda.max_memory_allocated() - base
    h.grad = w.grad = None
    ms = do_bench(step, warmup=25, rep=200, grad_to_none=[h, w])
    return peak, ms


def _fused(chunk: int, impl: str):
    from autopar.kernels.fused_linear_ce import linear_cross_entropy

    return lambda h, w, y: linear_cross_entropy(h, w, y, chunk=chunk, impl=impl)


def main(argv=None) -> int:
    """Run the check, then print the memory/time table; the exit status is 1 if the check failed."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", default="8192,16384")
    ap.add_argument("--hidden", type=int, default=2048)
    ap.add_argument("--vocab", type=int, default=50304)
    ap.add_argument("--chunks", default="0,4096,16384",
                    help="vocabulary columns per chunk tried for the Triton path (0: the op's default)")
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        print("error: this benchmark needs a CUDA GPU", file=sys.stderr)
        return 2
    from autopar.kernels.fused_linear_ce import default_chunk

    ok = check()
    print("correctness:", "ok" if ok else "MISMATCH")
    compiled = torch.compile(_unfused, dynamic=False)
    print(f"\nH={args.hidden} V={args.vocab} bf16, forward + backward; matmul work 6NHV unfused, 8NHV fused")
    print(f"{'N':>6} {'variant':16s} {'chunk':>6} {'peak GiB':>9} {'ms':>8} {'TFLOP/s':>8}")
    for n in (int(t) for t in args.tokens.split(",")):
        h, w, y = _inputs(n, args.hidden, args.vocab)
        default = default_chunk(n, args.vocab)
        variants = [("unfused eager", None, _unfused), ("unfused compile", None, compiled),
                    ("fused torch", default, _fused(default, "torch"))]
        chunks = dict.fromkeys(int(c) or default for c in args.chunks.split(","))
        variants += [("fused triton", c, _fused(c, "triton")) for c in chunks]
        for name, chunk, fn in variants:
            peak, ms = measure(fn, h, w, y)
            flops = (8 if name.startswith("fused") else 6) * n * args.hidden * args.vocab
            print(f"{n:6d} {name:16s} {chunk or '-':>6} {peak / GiB:9.2f} {ms:8.2f} {flops / ms / 1e9:8.0f}")
        del h, w, y
        torch.cuda.empty_cache()
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
