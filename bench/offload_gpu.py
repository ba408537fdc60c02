"""A ~9B-parameter GPT trained on one GPU with the optimizer offloaded to the host, beside the plan.

    python bench/offload_gpu.py                                  # 44 layers x 4096: 9.07e9 parameters
    python bench/offload_gpu.py --layers 2 --width 256 --heads 4 --seq 256 --batch 2   # a smoke test
    python bench/offload_gpu.py --device cpu --layers 2 --width 64 --heads 4 --seq 32  # the same on CPU
    python bench/offload_gpu.py --tiny                           # the CPU smoke test, in seconds
    python bench/offload_gpu.py --kept embedding,transformer.h.0 --delay 1   # a partial split, one step late
    python bench/offload_gpu.py --offload 0.5                    # the planner's split (offload=<fraction>|auto)

autopar.parallelize(mesh=(1,1,1), zero=0, precision="bf16", offload="optimizer",
recompute="full"): the GPU keeps the bf16 weights and their gradients (4 bytes per parameter) and
the activations of the recomputed blocks' inputs; the host keeps the fp32 masters and AdamW's two
moments (12 bytes per parameter: 109 GB for 9.07e9, on a host of 125 GB) and two staged chunks of
gradients (``autopar.cost_model.compute.OFFLOAD_CHUNK`` elements each, in turn).

``--kept`` keeps the named units' fp32 weights and AdamW state on the GPU (``plan.offload_kept``,
stepped there by the fused AdamW beside the host's update); ``--offload FRACTION|auto`` asks the
planner for the split instead, where this autopar's planner takes it. ``--delay 1`` applies the
host's update one step late (``plan.offload_delay``); ``--overlap off`` starts the host's update
after the backward instead of per unit within it (``pm.offload_overlap``).

The model is built in fp32 directly on the GPU (36 GB for 9B, the build's peak there), so no full
copy of it ever exists in host memory next to the optimizer state: ``parallelize`` copies each
weight once to its pinned fp32 master on the host and narrows the GPU's copy to bf16 in place.

One table row: parameters, peak GPU memory over the timed steps (``max_memory_allocated``), host
RSS (and its peak), the median step time after warm-up, achieved TFLOP/s (6 N tokens / step, and
the plan's model FLOPs with attention), the plan's predicted step time, device peak and host
bytes beside the measured ones, and the host's update: the seconds its CPU optimizer and copies
ran per step (on the worker thread where they overlap the backward) and the seconds ``opt.step()``
took (what is left exposed). Writes ``$OUT/offload_gpu.json`` when $OUT is set.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(__file__))
from compile_gpu import markdown, single_process_group  # noqa: E402

GB = 1e9


def host_memory() -> tuple[float, float]:
    """(resident, peak resident) bytes of this process (Linux /proc)."""
    fields = {}
    with open("/proc/self/status") as fh:
        for line in fh:
            key, _, value = line.partition(":")
            if key in ("VmRSS", "VmHWM"):
                fields[key] = float(value.split()[0]) * 1024
    return fields.get("VmRSS", 0.0), fields.get("VmHWM", 0.0)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--layers", type=int, default=44)
    ap.add_argument("--width", type=int, default=4096)
    ap.add_argument("--heads", type=int, default=32)
    ap.add_argument("--vocab", type=int, default=50257)
    ap.add_argument("--seq", type=int, default=2048)
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--steps", type=int, default=5, help="timed steps after the warm-up")
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    ap.add_argument("--profile", help="cost-model preset or profile JSON (default: h200 on cuda, cpu on cpu)")
    ap.add_argument("--compile", default="auto", choices=["auto", "on", "off"],
                    help="torch.compile the step (auto: on with cuda, off on cpu)")
    ap.add_argument("--kept", default="", help="units whose optimizer stays on the GPU, comma-separated "
                    "(embedding, transformer.h.<i>, head); default none: everything offloaded")
    ap.add_argument("--offload", default="optimizer",
                    help="the planner's offload= (optimizer, or a fraction / auto where the planner takes one)")
    ap.add_argument("--delay", type=int, default=0, choices=[0, 1], help="offload_delay: 1 applies the update a step late")
    ap.add_argument("--overlap", default="on", choices=["on", "off"],
                    help="start each unit's host update in the backward where the layout allows it")
    ap.add_argument("--tiny", action="store_true", help="a 2-layer model on the CPU: checks the script in seconds")
    args = ap.parse_args(argv)
    if args.tiny:
        args.device, args.layers, args.width, args.heads, args.vocab = "cpu", 2, 64, 4, 512
        args.seq, args.batch, args.steps, args.warmup = 32, 2, 3, 1
    if args.device == "cuda" and not torch.cuda.is_available():
        ap.error("no CUDA device: run with --device cpu for the smoke test")
    import autopar
    from autopar.examples.gpt import GPT, GPTConfig, example_inputs

    single_process_group()
    started = time.perf_counter()
    device = torch.device(args.device, 0) if args.device == "cuda" else torch.device("cpu")
    profile = args.profile or ("h200" if args.device == "cuda" else "cpu")
    compile = args.compile == "on" or (args.compile == "auto" and args.device == "cuda")
    cfg = GPTConfig(vocab_size=args.vocab, block_size=args.seq, n_layer=args.layers, n_head=args.heads,
                    n_embd=args.width)
    torch.manual_seed(0)
    with device:
        model = GPT(cfg)
    params = sum(p.numel() for p in model.parameters())
    print(f"GPT {args.layers} x {args.width}: {params:.3g} parameters; batch {args.batch} x {args.seq}",
          flush=True)
    idx, tgt = example_inputs(cfg, args.batch, args.seq, device=device)
    offload = args.offload if args.offload in ("optimizer", "auto") else float(args.offload)
    knobs = dict(zero=0, precision="bf16", recompute="full", device=profile)
    try:
        planned = autopar.plan(model, (1, 1, 1), (idx, tgt), offload=offload, **knobs)
    except (ValueError, TypeError) as e:
        if offload == "optimizer":
            raise
        ap.error(f"this autopar's planner does not take offload={offload!r} ({e}); split by hand with --kept")
    if args.kept or args.delay:
        kept = tuple(u for u in args.kept.split(",") if u) or planned.offload_kept
        planned = dataclasses.replace(planned, offload_kept=kept, offload_delay=args.delay)
    pm = autopar.parallelize(model, mesh=(1, 1, 1), example_inputs=(idx, tgt), plan=planned, compile=compile,
                             device=profile)
    del model
    plan = pm.plan
    if args.overlap == "off" and pm.offload_overlap:
        pm.offload_overlap = False
    opt = pm.optimizer(torch.optim.AdamW, lr=1e-4)
    host_s = [0.0]   # the host updates' seconds in this step (worker thread included)
    offloaded = pm._offload   # None where offload="auto" chose none: the model fits on the device
    if offloaded is not None:
        update = offloaded.host.update

        def timed(*a, **k):
            t = time.perf_counter()
            try:
                return update(*a, **k)
            finally:
                host_s[0] += time.perf_counter() - t
        offloaded.host.update = timed
    build_peak = torch.cuda.max_memory_allocated() if device.type == "cuda" else 0

    def sync():
        if device.type == "cuda":
            torch.cuda.synchronize()

    times, losses, host_times, step_calls = [], [], [], []
    for i in range(args.warmup + args.steps):
        if i == args.warmup and device.type == "cuda":
            torch.cuda.reset_peak_memory_stats()
        sync()
        if offloaded is not None:
            offloaded.worker.drain()   # a delayed update of the last step counts in that step's host time
        host_times.append(host_s[0])
        host_s[0] = 0.0
        t0 = time.perf_counter()
        opt.zero_grad()
        losses.append(pm.train_step(idx, tgt).item())
        t1 = time.perf_counter()
        opt.step()
        sync()
        times.append(time.perf_counter() - t0)
        step_calls.append(time.perf_counter() - t1)
    if offloaded is not None:
        offloaded.worker.drain()
    host_times = host_times[1:] + [host_s[0]]
    step = statistics.median(times[args.warmup:])
    host_update = statistics.median(host_times[args.warmup:])
    exposed = statistics.median(step_calls[args.warmup:])
    peak = torch.cuda.max_memory_allocated() if device.type == "cuda" else 0
    rss, rss_peak = host_memory()
    tokens = args.batch * args.seq
    dense = 6 * params * tokens / step
    with_attention = plan.model_flops / step
    predicted_peak = max(m.peak for m in plan.memory)
    predicted_host = sum(m.host for m in plan.memory)
    header = ["params", "kept units", "delay", "in backward", "GPU peak GB (pred)", "host RSS GB (peak; pred state)",
              "step s (pred)", "host update s", "opt.step() s", "TFLOP/s 6NT", "TFLOP/s plan FLOPs", "loss first -> last"]
    gpu = f"{peak / GB:.1f}" if peak else "-"   # no allocator statistics on the CPU
    row = [f"{params:.3g}", ", ".join(plan.offload_kept) or "none", str(plan.offload_delay),
           "yes" if pm.offload_overlap else "no", f"{gpu} ({predicted_peak / GB:.2f})",
           f"{rss / GB:.1f} ({rss_peak / GB:.1f}; {predicted_host / GB:.2f})",
           f"{step:.3f} ({plan.predicted_step_time:.3f})", f"{host_update:.3f}", f"{exposed:.3f}",
           f"{dense / 1e12:.1f}", f"{with_attention / 1e12:.1f}", f"{losses[0]:.3f} -> {losses[-1]:.3f}"]
    print()
    print(markdown(header, [row]))
    print(f"\n(build peak on the GPU {build_peak / GB:.1f} GB; predicted update {plan.predicted_update_s:.3f} s of "
          f"{plan.predicted_step_time:.3f} s; step times {', '.join(f'{t:.3f}' for t in times)})")
    out = os.environ.get("OUT")
    if out:
        report = dict(torch=torch.__version__, device=torch.cuda.get_device_name() if device.type == "cuda" else "cpu",
                      config=vars(args), params=params, step_times=times, losses=losses, gpu_peak=peak,
                      offload_kept=list(plan.offload_kept), offload_delay=plan.offload_delay,
                      in_backward=pm.offload_overlap, host_update_s=host_times, opt_step_s=step_calls,
                      build_peak=build_peak, host_rss=rss, host_rss_peak=rss_peak, tflops_6nt=dense / 1e12,
                      tflops_plan=with_attention / 1e12, predicted_step=plan.predicted_step_time,
                      predicted_update=plan.predicted_update_s, predicted_peak=predicted_peak,
                      predicted_host=predicted_host, wall_s=time.perf_counter() - started)
        with open(os.path.join(out, "offload_gpu.json"), "w") as fh:
            json.dump(report, fh, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
