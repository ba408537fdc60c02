"""Measure this machine for the cost model (``python -m autopar calibrate``) and write a device profile.

What is measured, on CUDA when it is available, else on the CPU:

- Matmul throughput: for each dtype the device runs (fp32; tf32 on CUDA; bf16; fp16), a grid of
  (m, n, k) shapes from small to large, square and skinny. Each shape is run ``warmup`` times, then
  timed per call (CUDA events around each call on a GPU, ``time.perf_counter`` on the CPU) until
  enough calls or time have passed; the median time gives 2mnk / t FLOP/s. Shapes are taken from
  small to large and a dtype stops when the next shape would overrun its share of the time
  budget, so a slow dtype (fp16 on many CPUs) costs seconds, not minutes.
- Fused attention: ``scaled_dot_product_attention`` forward + backward, causal, at a few GPT-like
  (batch, heads, seq, head_dim) shapes in the 16-bit dtypes (fp32 on the CPU), with the backend
  torch picks (cuDNN on Hopper with torch 2.11): FLOP/s as the flop counter counts them over the
  median time.
- Memory-bound ops as Inductor compiles them: a reference bf16 GPT (4 layers, h=1536, 8 x 1024
  tokens, vocab 32768) runs forward and backward under torch.compile; the bytes the cost model
  counts for its ops without FLOPs (``cost_model.strategy.op_traffic``) over the GPU time of its
  kernels that are not matmuls, attention or the optimizer (torch.profiler) is ``fused_bandwidth``.
  GPU only: on the CPU the copy bandwidth stands in for it.
- The optimizer: one fused AdamW step (foreach on the CPU) over many fp32 tensors; its 7 reads
  and writes per parameter over the median time is ``optimizer_bandwidth``.
- Memory bandwidth: a copy of a large buffer, read + write bytes over the median time.
- For optimizer offload: ``host_bandwidth``, the slower direction of a copy between pinned host
  memory and the GPU (each way timed with CUDA events; on the CPU, where host and device are one,
  a memory copy's bytes over its time), and ``host_adam_rate``, fp32 parameters per second of one
  CPU AdamW step (fused where this torch build has the CPU kernel, else foreach) over 1e8
  parameters on a GPU host, 3.4e7 on a CPU-only one (a quarter of that with ``quick``), and
  ``host_memory_bytes``, the machine's memory over the ranks of a node.
- Kernel launch overhead: a run of tiny in-place adds, time per op. The cost model uses it as
  the floor of any op's time.
- Collectives, when a process group of several ranks exists (``torchrun``, or
  ``autopar.launch.spawn``): on every mesh axis with more than one rank, all-reduce, all-gather and
  reduce-scatter of several sizes. A sample's time is the slowest rank's (max over the axis),
  the least over repetitions: what other work on a shared host adds to a collective only ever
  lengthens it, and one slow repetition of a large message otherwise skews the whole fit. Each
  (axis, kind) is fitted to the ring model of ``cost_model.comm``,
      t = steps * latency + wire_bytes / bandwidth,
  (steps and wire bytes known per sample) by non-negative least squares on relative error. The
  fits of all axes on one network tier (inside a node, or across nodes) are pooled per kind into
  the profile's ``collective_fits``, and over all kinds into the tier's ``*_node_latency`` /
  ``*_node_bw``; the per-axis fits stay in the profile's ``calibration`` record. Times that do
  not grow with the message size (a host busy with other work) give no fit, and the base
  preset's numbers stay for that kind.

Fields nothing here measures (the data-sheet peaks behind MFU, the other network tier, memory
size on a CPU) come from a preset, ``base`` (guessed from the GPU's name, "cpu" without one).
``quick`` shrinks the grids and repetitions: about 60 s on a GPU, 30 s on the CPU.
"""
from __future__ import annotations

import datetime
import json
import math
import os
import statistics
import time
from dataclasses import replace
from typing import Callable

import numpy as np
import torch
import torch.distributed as dist
from scipy.optimize import nnls

from .comm import axis_is_inter_node, collective_bytes_on_wire
from .devices import DEVICES, AttentionSample, CollectiveFit, DeviceSpec, MatmulSample, get_device, machine_memory
from autopar.graph.views import VIEW_OPS
from .strategy import op_traffic
from autopar.rehearsal import MEMORY_BOUND_FAMILIES, kernel_families

MEASURED_KINDS = ("all_reduce", "all_gather", "reduce_scatter")
# (m, n, k) of the sample that keeps a preset's matmul rate for sizes above a rehearsal's (``with_rehearsals``)
_ANCHOR = (4096, 4096, 4096)
_RING_STEPS = {"all_reduce": 2, "all_gather": 1, "reduce_scatter": 1}
_DTYPES = {"fp32": torch.float32, "tf32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}

# (m, n, k) grids, each ordered by FLOPs so a dtype can stop at the first shape it cannot afford.
_GPU_SHAPES = [(256, 256, 256), (512, 512, 512), (1024, 1024, 1024), (2048, 2048, 2048),
               (4096, 4096, 4096), (8192, 8192, 8192), (8192, 1024, 1024), (16384, 4096, 1024),
               (4096, 16384, 4096), (16384, 8192, 8192)]
_GPU_QUICK = [(256, 256, 256), (1024, 1024, 1024), (4096, 4096, 4096), (8192, 8192, 8192),
              (16384, 4096, 1024)]
_CPU_SHAPES = [(64, 64, 64), (128, 128, 128), (256, 256, 256), (512, 512, 512), (2048, 256, 256),
               (1024, 1024, 1024), (2048, 2048, 2048)]
_CPU_QUICK = [(64, 64, 64), (128, 128, 128), (256, 256, 256), (512, 512, 512), (2048, 256, 256),
              (1024, 1024, 1024)]


def device_kind() -> str:
    """"cuda" when a GPU is visible, else "cpu": where the measurements run."""
    return "cuda" if torch.cuda.is_available() else "cpu"


def _sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def time_op(fn: Callable[[], object], device: str, *, warmup: int = 2, min_reps: int = 3,
            max_reps: int = 50, min_time: float = 0.1) -> float:
    """Median seconds of one call of ``fn`` after ``warmup`` calls, over at least ``min_reps``
    and at most ``max_reps`` calls, stopping once ``min_time`` seconds of calls were timed.

    On CUDA each call is bracketed by events (GPU time, no host sync inside the loop); on the
    CPU by ``time.perf_counter``."""
    for _ in range(warmup):
        fn()
    _sync(device)
    times: list[float] = []
    if device == "cuda":
        events = []
        start = time.perf_counter()
        while len(events) < max_reps and (len(events) < min_reps or time.perf_counter() - start < min_time):
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            fn()
            b.record()
            events.append((a, b))
            if len(events) % 8 == 0:   # keep the host from racing far ahead of the GPU
                torch.cuda.synchronize()
        torch.cuda.synchronize()
        times = [a.elapsed_time(b) / 1e3 for a, b in events]
    else:
        total = 0.0
        while len(times) < max_reps and (len(times) < min_reps or total < min_time):
            t0 = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t0)
            total += times[-1]
    return statistics.median(times)


def _supports(dtype: torch.dtype, device: str) -> bool:
    try:
        a = torch.ones(8, 8, dtype=dtype, device=device)
        (a @ a).sum().item()
        return True
    except (RuntimeError, TypeError):
        return False


def measure_matmuls(device: str, shapes: list[tuple[int, int, int]], *, budget_s: float,
                    dtypes: tuple[str, ...] | None = None, min_time: float = 0.1,
                    log: Callable[[str], None] = lambda s: None) -> list[MatmulSample]:
    """Achieved FLOP/s of (m x k) @ (k x n) per dtype and shape; ``budget_s`` seconds shared by the dtypes.

    ``dtypes`` defaults to fp32, bf16, fp16 (and tf32 on CUDA), those the device can run."""
    if dtypes is None:
        dtypes = ("fp32", "tf32", "bf16", "fp16") if device == "cuda" else ("fp32", "bf16", "fp16")
    dtypes = tuple(d for d in dtypes if _supports(_DTYPES[d], device))
    shapes = sorted(shapes, key=lambda s: s[0] * s[1] * s[2])
    samples: list[MatmulSample] = []
    tf32 = torch.backends.cuda.matmul.allow_tf32
    try:
        for d in dtypes:
            torch.backends.cuda.matmul.allow_tf32 = d == "tf32"
            share = budget_s / len(dtypes)
            t_start, rate = time.perf_counter(), None
            for m, n, k in shapes:
                spent = time.perf_counter() - t_start
                flops = 2 * m * n * k
                # warmup + at least three timed calls at the rate the last shape reached
                if rate is not None and spent + 5 * flops / rate > share:
                    log(f"  {d}: skipping {m}x{n}x{k} and larger (time budget)")
                    break
                a = torch.randn(m, k, device=device).to(_DTYPES[d])
                b = torch.randn(k, n, device=device).to(_DTYPES[d])
                t = time_op(lambda: torch.mm(a, b), device, warmup=1, min_time=min_time)
                rate = flops / t
                samples.append(MatmulSample(d, m, n, k, rate))
                log(f"  matmul {d:4s} {m:6d} x {n:6d} x {k:6d}: {_rate(rate)}")
    finally:
        torch.backends.cuda.matmul.allow_tf32 = tf32
    return samples


# (batch, heads, seq, head_dim), ordered by FLOPs
_GPU_ATTENTION = [(16, 16, 512, 64), (16, 16, 1024, 64), (16, 25, 1024, 64), (8, 16, 2048, 128),
                  (4, 32, 4096, 128)]
_GPU_ATTENTION_QUICK = [(16, 16, 1024, 64), (8, 16, 2048, 128)]
_CPU_ATTENTION = [(2, 4, 128, 32), (2, 4, 256, 64)]


def measure_attention(device: str, shapes: list[tuple[int, int, int, int]], *, dtypes: tuple[str, ...] | None = None,
                      min_time: float = 0.1, log: Callable[[str], None] = lambda s: None) -> list[AttentionSample]:
    """Achieved FLOP/s of causal fused attention, forward + backward, per dtype and shape."""
    from torch.utils.flop_counter import sdpa_backward_flop_count, sdpa_flop_count

    if dtypes is None:
        dtypes = ("bf16", "fp16") if device == "cuda" else ("fp32",)
    samples = []
    for d in dtypes:
        for b, h, s, hd in shapes:
            q, k, v = (torch.randn(b, h, s, hd, device=device, dtype=_DTYPES[d], requires_grad=True)
                       for _ in range(3))
            grad = torch.randn_like(q)

            def step():
                torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True).backward(grad)
            t = time_op(step, device, warmup=2, min_time=min_time)
            shape = (b, h, s, hd)
            flops = sdpa_flop_count(shape, shape, shape) + sdpa_backward_flop_count(shape, shape, shape, shape)
            samples.append(AttentionSample(d, b, h, s, hd, 1, flops / t))
            log(f"  attention {d:4s} causal {b}x{h}x{s}x{hd}: {_rate(flops / t)} (fwd+bwd {t * 1e3:.2f} ms)")
    return samples


def kernel_breakdown(step: Callable[[], object], steps: int = 3) -> dict:
    """GPU kernel seconds per call of ``step`` by family (``autopar.rehearsal.KERNEL_FAMILIES``), from
    torch.profiler over ``steps`` calls, with the wall time per call and the 15 costliest kernels."""
    from torch.profiler import ProfilerActivity, profile
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        t0 = time.perf_counter()
        for _ in range(steps):
            step()
        torch.cuda.synchronize()
        wall = (time.perf_counter() - t0) / steps
    return dict(kernel_families(prof, steps), wall_s=wall, gaps=idle_gaps(prof, steps))


def idle_gaps(prof, steps: int, most: int = 8) -> dict:
    """Where the GPU sat idle between kernels: the idle seconds per call, and the longest gaps
    with the kernels on either side (from the profiler's device timeline)."""
    spans = sorted((e.time_range.start, e.time_range.end, e.name) for e in prof.events()
                   if str(getattr(e, "device_type", "")).endswith("CUDA") and e.time_range.end > e.time_range.start)
    gaps, reach, last = [], None, None
    for start, end, name in spans:
        if reach is not None and start > reach:
            gaps.append(((start - reach) / 1e6, last, name))
        if reach is None or end > reach:
            reach, last = end, name
    gaps.sort(key=lambda g: -g[0])
    return dict(idle_s=sum(g[0] for g in gaps) / steps, longest=[(s, a[:80], b[:80]) for s, a, b in gaps[:most]])


def measure_fused_bandwidth(device: str, reference, log: Callable[[str], None] = lambda s: None) -> float:
    """Bytes/s Inductor's memory-bound kernels reach in a bf16 training step of a reference model,
    counting bytes as the cost model does: its memory-bound traffic (``cost_model.strategy.op_traffic``
    of its ops without FLOPs) over the GPU time of its kernels that are neither matmuls, attention
    nor the optimizer (torch.profiler, ``kernel_breakdown``). CUDA only. ``reference(device)``
    returns the model, in bf16, and a batch on ``device`` ("meta" included): the CLI's is the
    example GPT (``autopar.examples.gpt.reference_step``), which the cost model does not import."""
    from autopar.cost_model.compute import node_flops
    from autopar.graph.capture import capture_pass

    meta, meta_inputs, what = reference("meta")
    graph = capture_pass(meta, meta_inputs).gm.graph
    nbytes = sum(op_traffic(n) for n in graph.nodes if n.op == "call_function" and n.target not in VIEW_OPS
                 and node_flops(n) == (0.0, 0.0))
    torch.manual_seed(0)
    model, inputs, _ = reference(device)
    compiled = torch.compile(model)

    def step():
        compiled(*inputs).backward()
    for _ in range(3):   # compile, then settle
        step()
    seconds = sum(kernel_breakdown(step)["families"][f] for f in MEMORY_BOUND_FAMILIES)
    log(f"  memory-bound kernels of a bf16 step of {what}: {seconds * 1e3:.2f} ms for "
        f"{nbytes / 1e9:.2f} GB as counted = {nbytes / seconds / 1e9:.0f} GB/s")
    return nbytes / seconds


def measure_optimizer_bandwidth(device: str, numel: int, *, min_time: float = 0.1) -> float:
    """Bytes/s of AdamW's 7 fp32 reads and writes per parameter: fused on CUDA, foreach on the CPU."""
    params = [torch.nn.Parameter(torch.randn(numel // 64, device=device)) for _ in range(64)]
    for p in params:
        p.grad = torch.randn_like(p)
    kind = dict(fused=True) if device == "cuda" else dict(foreach=True)
    opt = torch.optim.AdamW(params, lr=1e-4, **kind)
    t = time_op(opt.step, device, warmup=2, min_time=min_time)
    return 7 * 4 * (numel // 64) * 64 / t


def measure_bandwidth(device: str, nbytes: int, *, min_time: float = 0.1) -> float:
    """Memory bandwidth in bytes/s: a copy of ``nbytes`` reads and writes ``nbytes`` each."""
    src = torch.empty(nbytes, dtype=torch.uint8, device=device).fill_(1)
    dst = torch.empty_like(src)
    t = time_op(lambda: dst.copy_(src), device, warmup=2, min_time=min_time)
    return 2 * nbytes / t


def measure_host_copies(nbytes: int, *, min_time: float = 0.1) -> tuple[float, float]:
    """(host -> GPU, GPU -> host) bytes/s of a copy of ``nbytes`` between pinned host memory and the GPU."""
    host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True).fill_(1)
    gpu = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    to_gpu = time_op(lambda: gpu.copy_(host, non_blocking=True), "cuda", warmup=2, min_time=min_time)
    to_host = time_op(lambda: host.copy_(gpu, non_blocking=True), "cuda", warmup=2, min_time=min_time)
    return nbytes / to_gpu, nbytes / to_host


def measure_host_adam(numel: int, *, min_time: float = 0.1) -> tuple[float, str]:
    """fp32 parameters per second of one CPU AdamW step over ``numel`` of them in 64 tensors, and
    the implementation torch ran ("fused" where it has the CPU kernel, else "foreach")."""
    params = [torch.randn(numel // 64, requires_grad=True) for _ in range(64)]
    for p in params:
        p.grad = torch.randn_like(p)
    try:
        opt, kind = torch.optim.AdamW(params, lr=1e-4, fused=True), "fused"
    except RuntimeError:   # no fused CPU kernel in this torch build
        opt, kind = torch.optim.AdamW(params, lr=1e-4, foreach=True), "foreach"
    return (numel // 64) * 64 / time_op(opt.step, "cpu", warmup=1, min_time=min_time), kind


def measure_launch_overhead(device: str, ops: int = 200, *, min_time: float = 0.1) -> float:
    """Seconds per op of ``ops`` back-to-back tiny in-place adds: the shortest time an op takes."""
    x = torch.zeros(1, device=device)

    def run():
        for _ in range(ops):
            x.add_(1.0)
    return time_op(run, device, warmup=1, min_time=min_time) / ops


def fit_alpha_beta(samples: list[tuple[float, float, float]]) -> tuple[float, float]:
    """(latency, bandwidth) of t = steps * latency + wire_bytes / bandwidth, from
    (steps, wire_bytes, seconds) samples: non-negative least squares on relative error.

    Raises ValueError when the samples cannot determine a bandwidth (one size only, or times
    that do not grow with the bytes)."""
    if len(samples) < 2:
        raise ValueError(f"fitting latency and bandwidth needs at least two message sizes, got {len(samples)}")
    A = np.array([[s, w] for s, w, _ in samples], dtype=float)
    t = np.array([x for _, _, x in samples], dtype=float)
    if (t <= 0).any():
        raise ValueError("collective times must be positive")
    weights = 1.0 / t
    (latency, inv_bw), _ = nnls(A * weights[:, None], t * weights)
    if inv_bw <= 0:
        raise ValueError("the measured times do not grow with the message size, so no bandwidth can be "
                         "fitted; measure larger messages")
    return float(latency), float(1.0 / inv_bw)


def measure_collectives(mesh: tuple[int, int, int], device: str, sizes: list[int], *, reps: int = 5,
                        log: Callable[[str], None] = lambda s: None) -> dict[str, dict]:
    """Per mesh axis with more than one rank: samples [kind, full-tensor bytes, seconds] and the
    (latency, bandwidth) fit per kind. Every rank of the process group must call this."""
    from autopar import collectives as C
    from autopar.mesh import AXES, Mesh, device_mesh

    m = Mesh(*mesh)
    dmesh = device_mesh(m, device)
    out: dict[str, dict] = {}
    for axis in AXES:
        n = m.size(axis)
        if n == 1:
            continue
        group, rank = dmesh.get_group(axis).group_name, dmesh.get_local_rank(axis)
        samples = []
        for kind in MEASURED_KINDS:
            for nbytes in sizes:
                numel = max(n, nbytes // 4 // n * n)   # fp32, divisible by the group size
                full = torch.ones(numel, device=device)
                part = torch.ones(numel // n, device=device)
                # autopar's own collectives (autopar.collectives), as the rewritten graphs issue them
                ops = {"all_reduce": lambda: C.all_reduce(full, group),
                       "all_gather": lambda: C.all_gather(part, 0, group, n, rank, numel, False),
                       "reduce_scatter": lambda: C.reduce_scatter(full, 0, group, n)}
                with torch.no_grad():
                    seconds = _time_collective(ops[kind], device, dmesh.get_group(axis), reps)
                samples.append([kind, numel * 4, seconds])
                log(f"  {axis} ({n} ranks) {kind:14s} {numel * 4 / 2**20:10.3f} MiB: {seconds * 1e6:10.1f} us")
        fits = {}
        for kind in MEASURED_KINDS:
            rows = [(_RING_STEPS[kind] * (n - 1), collective_bytes_on_wire(kind, b, n), t)
                    for k, b, t in samples if k == kind]
            try:
                latency, bandwidth = fit_alpha_beta(rows)
            except ValueError as e:   # a noisy host: keep the samples, say why there is no fit
                log(f"  {axis} {kind}: no fit ({e})")
                fits[kind] = {"error": str(e)}
                continue
            fits[kind] = {"latency": latency, "bandwidth": bandwidth}
        out[axis] = {"size": n, "inner": m.inner_size(axis), "samples": samples, "fits": fits}
    return out


def _time_collective(op: Callable[[], object], device: str, group, reps: int) -> float:
    """The least over ``reps`` of the slowest rank's time for one ``op`` started together."""
    op()
    _sync(device)
    times = []
    for _ in range(reps):
        dist.barrier(group=group)
        t0 = time.perf_counter()
        op()
        _sync(device)
        times.append(time.perf_counter() - t0)
    worst = torch.tensor(times, dtype=torch.float64, device=device)
    dist.all_reduce(worst, op=dist.ReduceOp.MAX, group=group)
    return min(worst.tolist())


def _guess_base(device: str) -> str:
    if device == "cpu":
        return "cpu"
    name = torch.cuda.get_device_name()
    for key in ("h200", "h100", "a100"):
        if key in name.lower():
            return key
    raise ValueError(f"no preset matches the GPU {name!r}, so its data-sheet peaks are unknown; "
                     f"pass --base with the closest preset ({', '.join(DEVICES)}) or a profile path")


def calibrate(*, quick: bool = False, base: str | DeviceSpec | None = None, name: str | None = None,
              mesh: tuple[int, int, int] | None = None, reference=None,
              log: Callable[[str], None] = lambda s: None) -> tuple[DeviceSpec, dict]:
    """Measure this machine; returns the profile's DeviceSpec and the raw ``calibration`` record.

    ``base``: the preset (or spec) supplying what is not measured (default: guessed from the GPU's
    name, "cpu" without a GPU). ``mesh``: (dp, pp, tp) whose axes get collective measurements when a
    process group of several ranks exists (default: all ranks on tp). Under a process group every
    rank must call this; the results agree only approximately between ranks, so keep rank 0's.
    ``reference``: the model whose bf16 step measures Inductor's memory-bound bandwidth on a GPU
    (``measure_fused_bandwidth``); without it that figure is left unmeasured (0)."""
    device = device_kind()
    base_spec = get_device(base if base is not None else _guess_base(device))
    started = time.perf_counter()
    gpu = device == "cuda"
    shapes = (_GPU_QUICK if quick else _GPU_SHAPES) if gpu else (_CPU_QUICK if quick else _CPU_SHAPES)
    min_time = 0.02 if quick else 0.2
    log(f"calibrating {torch.cuda.get_device_name() if gpu else 'the CPU'} "
        f"({'quick' if quick else 'full'}), unmeasured fields from {base_spec.name!r}")
    table = measure_matmuls(device, shapes, budget_s=(30.0 if gpu else 15.0) if quick else 240.0,
                            min_time=min_time, log=log)
    attention = measure_attention(device, (_GPU_ATTENTION_QUICK if quick else _GPU_ATTENTION) if gpu
                                  else _CPU_ATTENTION, min_time=min_time, log=log)
    copy_bytes = (2**30 if gpu else 2**27) // (4 if quick else 1)
    bandwidth = measure_bandwidth(device, copy_bytes, min_time=min_time)
    log(f"  memory bandwidth (copy of {copy_bytes / 2**20:.0f} MiB): {bandwidth / 1e9:.1f} GB/s")
    launch = measure_launch_overhead(device, min_time=min_time)
    log(f"  launch overhead: {launch * 1e6:.2f} us per op")
    fused = measure_fused_bandwidth(device, reference, log=log) if gpu and reference is not None else 0.0
    # large enough that the step's Python overhead does not count
    optimizer = measure_optimizer_bandwidth(device, 2**28 if gpu else 2**21, min_time=min_time)
    log(f"  AdamW update: {optimizer / 1e9:.1f} GB/s of parameter and state traffic")
    if gpu:
        host_copy = measure_host_copies(2**28 if quick else 2**30, min_time=min_time)
    else:   # the host is the device: a copy moves half the bytes measure_bandwidth counts (read + write)
        host_copy = (bandwidth / 2, bandwidth / 2)
    host_adam, host_adam_kind = measure_host_adam((2**27 if gpu else 2**25) // (4 if quick else 1), min_time=min_time)
    log(f"  offload: pinned copies {host_copy[0] / 1e9:.1f} GB/s to the device, {host_copy[1] / 1e9:.1f} GB/s back; "
        f"CPU AdamW ({host_adam_kind}) {host_adam / 1e9:.2f}e9 parameters/s")

    best = {d: max(s.flops_per_s for s in table if s.dtype == d) for d in {s.dtype for s in table}}
    peaks = dict(base_spec.peak_flops)
    for d, rate in best.items():
        # A CPU has no data-sheet peak here: its best measured rate is its peak. A GPU keeps the
        # data sheet's (so MFU keeps its usual meaning) unless a measurement beat it.
        peaks[d] = max(peaks.get(d, 0.0), rate) if gpu else rate
    ratios = [best[d] / peaks[d] for d in best]
    efficiency = min(1.0, statistics.median(ratios)) if ratios else base_spec.matmul_efficiency

    world = dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1
    if "LOCAL_WORLD_SIZE" in os.environ:     # torchrun: the ranks on this node
        per_node = int(os.environ["LOCAL_WORLD_SIZE"])
    else:
        per_node = torch.cuda.device_count() if gpu else (world if world > 1 else base_spec.gpus_per_node)
    network: dict[str, dict] = {}
    if world > 1:
        mesh = tuple(mesh) if mesh is not None else (1, 1, world)
        sizes = [2**12, 2**16, 2**20, 2**22] if quick else [2**12, 2**14, 2**16, 2**18, 2**20, 2**22, 2**24, 2**26]
        if gpu:
            sizes = [s * 16 for s in sizes]
        network = measure_collectives(mesh, device, sizes, reps=3 if quick else 10, log=log)
    spec = _with_network(base_spec, network, per_node)
    spec = replace(spec, name=name or f"{'cuda ' + torch.cuda.get_device_name() if gpu else 'cpu'} (measured)",
                   peak_flops=peaks, matmul_efficiency=efficiency, mem_bandwidth=bandwidth,
                   memory_bytes=torch.cuda.get_device_properties(0).total_memory if gpu else machine_memory(),
                   launch_overhead=launch, fused_bandwidth=fused, optimizer_bandwidth=optimizer,
                   host_bandwidth=min(host_copy), host_adam_rate=host_adam,
                   host_memory_bytes=machine_memory() // max(1, per_node),
                   matmul_table=tuple(table), attention_table=tuple(attention),
                   gpus_per_node=per_node)
    record = {
        "when": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "torch": torch.__version__,
        "device": torch.cuda.get_device_name() if gpu else "cpu",
        "threads": torch.get_num_threads(),
        "quick": quick,
        "base": base_spec.name,
        "copy_bytes": copy_bytes,
        "host_copy_bytes_per_s": {"to_device": host_copy[0], "to_host": host_copy[1]},
        "host_adam": host_adam_kind,
        "world_size": world,
        "mesh": list(mesh) if world > 1 else None,
        "collectives": network,
        "seconds": round(time.perf_counter() - started, 2),
    }
    return spec, record


def with_rehearsals(spec: DeviceSpec, rehearsals) -> tuple[DeviceSpec, dict]:
    """``spec`` taught what rehearsed ranks' ops really took (``autopar.rehearse``; ``rehearsals``,
    a plan's ``Rehearsal`` records, each with its ``ops``), and the record of what was taken.

    Each matmul shape a rank ran becomes a ``MatmulSample`` at its measured rate (2mnk over its
    seconds per call), in place of the profile's samples of the same dtype and FLOPs (the rank ran
    that size in situ; other sizes keep theirs); where the profile had no samples of a dtype, one
    more at ``_ANCHOR`` FLOPs keeps its former rate (peak times efficiency) for the larger matmuls
    the ranks did not run. Each fused attention shape (a GPU rank's) becomes a causal
    ``AttentionSample`` the same way, in place of the profile's of its dtype and FLOPs.
    ``launch_overhead``, the floor under every op's time, becomes the mean time of a CPU rank's
    other ops (what a small op took there; a GPU rank records none and keeps the profile's).
    ``fused_bandwidth``, what memory-bound ops are priced at, becomes the bytes the cost model
    counts for GPU ranks' memory-bound ops (``Rehearsal.memory_bound_bytes``) over the time of
    their memory-bound kernels (Triton's and the rest that are neither matmul, attention nor
    optimizer), pooled. Plans priced with the result predict those ranks' compute as their ops
    ran; the rehearsals should be of this device."""
    ops = [op for r in rehearsals for op in r.ops]
    if not ops:
        raise ValueError("these rehearsals recorded no op times (a plan file from before rehearsals timed their ops): "
                         "rehearse again (autopar.rehearse) to take its ops into a profile")
    taken = [MatmulSample(dtype, m, n, k, 2.0 * m * n * k * calls / seconds)
             for (dtype, m, n, k), (calls, seconds) in _pooled(ops, "matmul").items() if seconds > 0]
    rehearsed = {(t.dtype, t.m * t.n * t.k) for t in taken}
    kept = [t for t in spec.matmul_table if (t.dtype, t.m * t.n * t.k) not in rehearsed]
    anchors = [MatmulSample(d, *_ANCHOR, spec.flops(d) * spec.matmul_efficiency)
               for d in sorted({t.dtype for t in taken}) if spec.matmul_curve(d) is None and d in spec.peak_flops]
    attention = []
    for (dtype, *shape), (calls, seconds) in _pooled(ops, "attention").items():
        if seconds > 0:
            sample = AttentionSample(dtype, *shape, 1, 0.0)
            attention.append(replace(sample, flops_per_s=sample.flops * calls / seconds))
    seen = {(a.dtype, a.flops) for a in attention}
    kept_attention = [a for a in spec.attention_table if (a.dtype, a.flops) not in seen or not a.causal]
    other = [op for op in ops if op.op == "other"]
    calls = sum(op.calls for op in other)
    overhead = sum(op.calls * op.seconds for op in other) / calls if calls else spec.launch_overhead
    memory = [(r.memory_bound_bytes, sum(op.seconds for op in r.ops if op.op == "kernels" and op.dtype in MEMORY_BOUND_FAMILIES))
              for r in rehearsals if r.memory_bound_bytes]
    seconds = math.fsum(t for _, t in memory)
    fused = math.fsum(b for b, _ in memory) / seconds if seconds else spec.fused_bandwidth
    out = replace(spec, name=f"{spec.name} + rehearsed", matmul_table=(*kept, *taken, *anchors),
                  attention_table=(*kept_attention, *attention), launch_overhead=overhead, fused_bandwidth=fused)
    record = {"rehearsals": [{"rank": r.rank, "coords": r.coords, "device": r.device,
                              "matmul_shapes": sum(op.op == "matmul" for op in r.ops),
                              "attention_shapes": sum(op.op == "attention" for op in r.ops),
                              "other_ops": sum(op.calls for op in r.ops if op.op == "other")} for r in rehearsals],
              "launch_overhead": {"before": spec.launch_overhead, "rehearsed": overhead},
              "fused_bandwidth": {"before": spec.fused_bandwidth, "rehearsed": fused}}
    return out, record


def _pooled(ops, kind: str) -> dict[tuple, tuple[int, float]]:
    """(dtype, *dims) -> (calls, seconds) over the ``ops`` of ``kind``, pooled across ranks, sorted."""
    pooled: dict[tuple, tuple[int, float]] = {}
    for op in ops:
        if op.op == kind:
            calls, seconds = pooled.get((op.dtype, *op.dims), (0, 0.0))
            pooled[(op.dtype, *op.dims)] = (calls + op.calls, seconds + op.calls * op.seconds)
    return dict(sorted(pooled.items()))


def _with_network(base: DeviceSpec, network: dict[str, dict], per_node: int) -> DeviceSpec:
    """``base`` with the measured axes' fits: pooled per (tier, kind) and per tier over all kinds."""
    pooled: dict[tuple[str, str], list] = {}
    for axis in network.values():
        tier = "inter" if axis_is_inter_node(axis["size"], axis["inner"], per_node) else "intra"
        axis["tier"] = tier
        n = axis["size"]
        for kind, nbytes, seconds in axis["samples"]:
            row = (_RING_STEPS[kind] * (n - 1), collective_bytes_on_wire(kind, nbytes, n), seconds)
            pooled.setdefault((tier, kind), []).append(row)
            pooled.setdefault((tier, "*"), []).append(row)
    fits, changes = [], {}
    for (tier, kind), rows in sorted(pooled.items()):
        try:
            latency, bandwidth = fit_alpha_beta(rows)
        except ValueError:   # times too noisy to fit: this kind (or tier) keeps the base's numbers
            continue
        if kind == "*":
            changes.update({f"{tier}_node_latency": latency, f"{tier}_node_bw": bandwidth})
        else:
            fits.append(CollectiveFit(tier, kind, latency, bandwidth))
    return replace(base, collective_fits=tuple(fits), **changes)


def write_profile(spec: DeviceSpec, record: dict, path: str | os.PathLike) -> None:
    """Write the profile JSON: the DeviceSpec's fields plus the ``calibration`` record."""
    data = spec.to_dict()
    data["calibration"] = record
    with open(path, "w") as fh:
        fh.write(json.dumps(data, indent=2) + "\n")


def summary(spec: DeviceSpec) -> str:
    """A few lines on what the profile says: best matmul rate per dtype, bandwidths, overheads."""
    lines = [f"device profile {spec.name!r}:"]
    for d in sorted({s.dtype for s in spec.matmul_table}):
        xs, ys = spec.matmul_curve(d)
        lines.append(f"  matmul {d:4s}: {_rate(min(ys))} .. {_rate(max(ys))} over "
                     f"{len(xs)} sizes (2mnk from {xs[0]:.2g} to {xs[-1]:.2g})")
    for d, causal in sorted({(s.dtype, s.causal) for s in spec.attention_table}):
        xs, ys = spec.attention_curve(d, causal)
        lines.append(f"  attention {d:4s}{' causal' if causal else ''}: {_rate(min(ys))} .. {_rate(max(ys))} "
                     f"over {len(xs)} sizes")
    if spec.fused_bandwidth or spec.optimizer_bandwidth:
        lines.append(f"  memory-bound ops (Inductor) {spec.fused_bandwidth / 1e9:.1f} GB/s, AdamW "
                     f"{spec.optimizer_bandwidth / 1e9:.1f} GB/s (0: copy bandwidth)")
    if spec.host_bandwidth or spec.host_adam_rate:
        lines.append(f"  offload: host copies {spec.host_bandwidth / 1e9:.1f} GB/s each way, CPU AdamW "
                     f"{spec.host_adam_rate / 1e9:.2f}e9 parameters/s, "
                     f"{spec.host_memory_bytes / 2**30:.1f} GiB of host memory per device (0: unknown)")
    lines.append(f"  memory bandwidth {spec.mem_bandwidth / 1e9:.1f} GB/s, launch overhead "
                 f"{spec.launch_overhead * 1e6:.2f} us, matmul efficiency {spec.matmul_efficiency:.2f}")
    for f in spec.collective_fits:
        lines.append(f"  {f.kind:14s} {f.tier}-node: latency {f.latency * 1e6:.1f} us, "
                     f"bandwidth {f.bandwidth / 1e9:.2f} GB/s")
    if not spec.collective_fits:
        lines.append("  network: not measured (one rank); taken from the base preset")
    return "\n".join(lines)


def _rate(flops_per_s: float) -> str:
    if flops_per_s >= 1e12:
        return f"{flops_per_s / 1e12:.1f} TFLOP/s"
    return f"{flops_per_s / 1e9:.2f} GFLOP/s"
