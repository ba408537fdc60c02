"""Plain torch.compile against autopar on one GPU (mesh (1,1,1)), 16-bit, side by side.

    python bench/compile_gpu.py [--configs h2048,gpt2-xl,h1024] [--contenders plain,autopar]
        [--steps 20] [--batch B] [--device PROFILE.json] [--no-matmul] [--no-predict] [--no-breakdown]
        [--cpu-smoke] [--predict-from RESULTS.json] [--inductor KEY=VALUE,...] [--save-code]

For each GPT config (h2048: h=2048, 8 layers, 16 heads, seq 2048, vocab 50304; gpt2-xl: h=1600,
48 layers, 25 heads, seq 1024; h1024: h=1024, 24 layers, 16 heads, seq 1024) it trains the same
model two ways in one process and reports tokens/s, MFU, peak memory and compile time:

- plain: ``torch.compile(model)`` (Inductor), the fused AdamW;
- autopar: ``autopar.parallelize(model, mesh=(1, 1, 1), ...)`` with ``compile=True``, the same
  optimizer over ``pm.parameters()``, stepping with ``pm.train_step``;
- plain-cudagraphs / autopar-cudagraphs (only when asked for with ``--contenders``): the same in
  torch.compile's "reduce-overhead" mode, which replays CUDA graphs;
- plain-autotune / autopar-autotune (also on request): mode "max-autotune-no-cudagraphs", which
  benchmarks Triton matmul templates against cuBLAS and tunes the generated kernels' launch configs;
- autopar-master: autopar with ``pm.optimizer(autopar.MasterAdamW)``: the graph computes on
  persistent bf16 weight copies and one fused kernel per tensor updates the fp32 master and its
  copy (``autopar.runtime.master_weights``).

``--inductor KEY=VALUE,...`` sets ``torch._inductor.config`` options for every contender alike;
``--save-code`` writes the code Inductor generated for each contender to ``$OUT/code/``.

Precision: when ``autopar.parallelize`` takes ``precision=`` (fp32 master weights, bf16 compute)
autopar runs ``precision="bf16"`` and the plain model runs its fp32 weights under
``torch.autocast("cuda", torch.bfloat16)``, the stock equivalent; otherwise both get a model cast to
bf16. MFU counts model FLOPs 72 B s L h^2 (1 + s/(6h) + V/(12 h L)) (Narayanan et al. 2021, no
recompute) against 989 TFLOP/s, the H100/H200 dense bf16 peak.

It also times a bf16 8192^3 matmul (the ceiling a GPT step's matmuls can reach) and, for every
config, puts autopar.plan(..., device="h200" or ``--device PROFILE.json``)'s predicted step time
and peak memory next to the measured ones (acceptance: within 15% on time, 10% on memory).
It checks what the (1,1,1) path runs: collectives left in autopar's graph, and the kernels
Inductor generated for each contender (read from ``run_and_get_code``); and where each contender's
GPU time goes, by kernel family (torch.profiler, ``cost_model.calibrate.kernel_breakdown``).
``--predict-from`` re-prices a saved run's results with the current cost model, on any machine.

Prints markdown tables and writes ``$OUT/compile_gpu.json`` (``$OUT`` defaults to ./out).
About 5-6 minutes on an H200 for all three configs, most of it Inductor compiling (first steps).
``--cpu-smoke`` runs a tiny config on CPU over gloo, a few steps, to check every code path.

Other scripts in bench/ import the shared pieces from here (``markdown``, ``model_flops``,
``out_dir``, ``timed_steps``, ``single_process_group``).
"""
from __future__ import annotations

import argparse
import gc
import inspect
import json
import os
import re
import sys
import time
from contextlib import nullcontext
from dataclasses import dataclass, replace

import torch

PEAK_BF16 = 989e12
GiB = 2**30


# ---- shared by the bench scripts ----------------------------------------------------------------

def out_dir() -> str:
    """``$OUT`` (default ./out), created."""
    path = os.environ.get("OUT", "./out")
    os.makedirs(path, exist_ok=True)
    return path


def write_report(report: dict, name: str, started: float) -> None:
    """Stamp the wall time on ``report`` and write it to ``$OUT/name``."""
    report["wall_s"] = time.perf_counter() - started
    path = os.path.join(out_dir(), name)
    with open(path, "w") as fh:
        json.dump(report, fh, indent=2, default=str)
    print(f"\n{report['wall_s']:.0f} s in all; wrote {path}", flush=True)


def markdown(header: list[str], rows: list[list]) -> str:
    """A markdown table; floats are printed as given (format them first)."""
    lines = ["| " + " | ".join(header) + " |", "|" + "|".join("---" for _ in header) + "|"]
    lines += ["| " + " | ".join(str(c) for c in r) + " |" for r in rows]
    return "\n".join(lines)


def model_flops(batch: int, seq: int, layers: int, hidden: int, vocab: int) -> float:
    """Forward + backward FLOPs of one GPT step without recompute (Narayanan et al. 2021, eq. 3)."""
    return 72 * batch * seq * layers * hidden**2 * (1 + seq / (6 * hidden) + vocab / (12 * hidden * layers))


def single_process_group(backend: str | None = None) -> None:
    """A one-rank process group (NCCL with CUDA, else gloo) for scripts started without torchrun."""
    from autopar.launch import free_port, init_distributed
    for key, value in (("MASTER_ADDR", "127.0.0.1"), ("MASTER_PORT", str(free_port())), ("RANK", "0"),
                       ("WORLD_SIZE", "1"), ("LOCAL_RANK", "0")):
        os.environ.setdefault(key, value)
    init_distributed(backend)


def sync(device: torch.device) -> None:
    """Wait for the device's queued work (CUDA); nothing on CPU."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def timed_steps(step, steps: int, device: torch.device, warmup: int = 2, breakdown: bool = False) -> dict:
    """Run ``step()`` once (it compiles), ``warmup`` more times, then ``steps`` timed.

    Returns times, the peak memory over the timed steps and the memory held between steps
    (``resting_bytes``: weights, optimizer state, what survives a step), the code Inductor generated
    in the first step (``codes``, to be popped before the result is saved), its kernel counts and,
    with ``breakdown``, GPU kernel time by family (``kernel_breakdown``)."""
    from torch._inductor.utils import run_and_get_code
    t0 = time.perf_counter()
    first, codes = run_and_get_code(lambda: float(step()))
    sync(device)
    first_s = time.perf_counter() - t0
    for _ in range(warmup):
        step()
    sync(device)
    resting = float("nan")
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
        resting = torch.cuda.memory_allocated(device)
    losses = []
    t0 = time.perf_counter()
    for _ in range(steps):
        losses.append(step())
    sync(device)
    step_s = (time.perf_counter() - t0) / steps
    peak = torch.cuda.max_memory_allocated(device) if device.type == "cuda" else float("nan")
    result = dict(first_step_s=first_s, compile_s=max(first_s - step_s, 0.0), step_s=step_s, peak_bytes=peak,
                  resting_bytes=resting, first_loss=first, last_loss=float(losses[-1]), kernels=count_kernels(codes),
                  codes=codes)
    if breakdown and device.type == "cuda":
        from autopar.cost_model.calibrate import kernel_breakdown
        result["breakdown"] = kernel_breakdown(step)
    return result


def free_memory() -> None:
    """Drop compiled graphs and cached blocks so the next contender starts from an empty device."""
    torch._dynamo.reset()
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def count_kernels(codes: list[str]) -> dict:
    """Kernel launches in Inductor's generated wrappers: Triton or C++ kernels, extern calls (matmuls, attention)."""
    text = "\n".join(codes)
    return dict(graphs=len(codes),
                generated=len(re.findall(r"\.run\(|\bcpp_fused\w*\(", text)),
                extern=len(re.findall(r"extern_kernels\.\w+\(|torch\.ops\.aten\.[\w.]+\(", text)),
                collectives=len(re.findall(r"torch\.ops\._c10d_functional\.(?!wait_tensor)\w+", text)))


# ---- this benchmark ---------------------------------------------------------------------------

@dataclass(frozen=True)
class Case:
    name: str
    vocab: int
    seq: int
    layers: int
    heads: int
    hidden: int
    batch: int

    def gpt_config(self):
        from autopar.examples.gpt import GPTConfig
        return GPTConfig(vocab_size=self.vocab, block_size=self.seq, n_layer=self.layers, n_head=self.heads,
                         n_embd=self.hidden)

    @property
    def flops(self) -> float:
        return model_flops(self.batch, self.seq, self.layers, self.hidden, self.vocab)


CASES = {
    "h2048": Case("h2048", 50304, 2048, 8, 16, 2048, 8),
    "gpt2-xl": Case("gpt2-xl", 50304, 1024, 48, 25, 1600, 16),
    "h1024": Case("h1024", 50304, 1024, 24, 16, 1024, 16),
}
SMOKE = Case("smoke", 512, 64, 2, 4, 64, 4)
# contender -> (who, torch.compile mode): "-cudagraphs" replays CUDA graphs (mode "reduce-overhead")
CONTENDERS = {"plain": ("plain", None), "autopar": ("autopar", None),
              "plain-cudagraphs": ("plain", "reduce-overhead"), "autopar-cudagraphs": ("autopar", "reduce-overhead"),
              "plain-autotune": ("plain", "max-autotune-no-cudagraphs"),
              "autopar-autotune": ("autopar", "max-autotune-no-cudagraphs"),
              "autopar-master": ("autopar-master", None)}


def has_precision_knob() -> bool:
    """Whether autopar.parallelize takes precision= (bf16 compute on fp32 master weights)."""
    import autopar
    return "precision" in inspect.signature(autopar.parallelize).parameters


def _build(case: Case, device, mixed: bool, dtype: torch.dtype):
    from autopar.examples.gpt import GPT, example_inputs
    torch.manual_seed(0)
    with torch.device(device):
        model = GPT(case.gpt_config())
    if not mixed:
        model = model.to(dtype)
    idx, tgt = example_inputs(case.gpt_config(), case.batch, case.seq, device=device)
    return model, idx, tgt


def run_plain(case: Case, device, mixed: bool, dtype, steps: int, breakdown: bool = False, mode=None) -> dict:
    """torch.compile of the unsharded model (in torch.compile ``mode``), fused AdamW."""
    free_memory()
    model, idx, tgt = _build(case, device, mixed, dtype)
    compiled = torch.compile(model, mode=mode)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True)
    autocast = (lambda: torch.autocast(device.type, dtype=dtype)) if mixed else nullcontext

    def step():
        opt.zero_grad(set_to_none=True)
        if mode == "reduce-overhead":
            torch.compiler.cudagraph_mark_step_begin()
        with autocast():
            loss = compiled(idx, tgt)
        loss.backward()
        opt.step()
        return loss.detach()

    result = timed_steps(step, steps, device, breakdown=breakdown)
    result.update(setup_s=0.0)
    return result


def run_autopar(case: Case, device, mixed: bool, dtype, steps: int, profile: str, breakdown: bool = False,
                mode=None, master: bool = False) -> dict:
    """autopar.parallelize on mesh (1, 1, 1), compiled with Inductor, the same optimizer (or with
    ``master`` autopar.MasterAdamW)."""
    import autopar
    free_memory()
    model, idx, tgt = _build(case, device, mixed, dtype)
    kw = dict(precision="bf16") if mixed else {}
    t0 = time.perf_counter()
    pm = autopar.parallelize(model, (1, 1, 1), (idx, tgt), compile=mode or True, device=profile, **kw)
    setup_s = time.perf_counter() - t0
    # parallelize copies the weights into its shards, which replace the model's own (those are freed)
    model_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    del model
    gc.collect()
    opt = (pm.optimizer(autopar.MasterAdamW, lr=1e-4) if master
           else pm.optimizer(torch.optim.AdamW, lr=1e-4, fused=True))

    def step():
        opt.zero_grad(set_to_none=True)
        loss = pm.train_step(idx, tgt)
        opt.step()
        return loss.detach()

    result = timed_steps(step, steps, device, breakdown=breakdown)
    graph_collectives = sum(1 for n in pm.graph_module.graph.nodes
                            if n.op == "call_function" and "c10d" in str(n.target))
    result.update(setup_s=setup_s, graph_collectives=graph_collectives,
                  model_bytes=model_bytes)
    return result


def predict(case: Case, mixed: bool, dtype, profile: str) -> dict:
    """autopar.plan's step time and peak memory for mesh (1, 1, 1), offline on the meta device."""
    import autopar
    from autopar.examples.gpt import GPT, example_inputs
    with torch.device("meta"):
        model = GPT(case.gpt_config())
    if not mixed:
        model = model.to(dtype)
    kw = dict(precision="bf16") if mixed else {}
    t0 = time.perf_counter()
    plan = autopar.plan(model, (1, 1, 1), example_inputs(case.gpt_config(), case.batch, case.seq, device="meta"),
                        device=profile, **kw)
    mem = max(plan.memory, key=lambda m: m.peak)
    return dict(step_s=plan.predicted_step_time, peak_bytes=mem.peak, plan_s=time.perf_counter() - t0,
                memory=dict(params=mem.params, grads=mem.grads, optimizer=mem.optimizer,
                            activations=mem.activations, transient=mem.transient))


def matmul_ceiling(device, n: int, dtype, repeats: int = 20) -> float:
    """FLOP/s of an n^3 matmul at ``dtype`` (median-free: one timed loop after warm-up)."""
    a = torch.randn(n, n, device=device, dtype=dtype)
    b = torch.randn(n, n, device=device, dtype=dtype)
    for _ in range(3):
        a @ b
    sync(device)
    t0 = time.perf_counter()
    for _ in range(repeats):
        a @ b
    sync(device)
    return 2 * n**3 * repeats / (time.perf_counter() - t0)


def _fmt(value, scale: float = 1.0, spec: str = ".3f") -> str:
    return "-" if value is None else format(value / scale, spec)


def _verdict(ok) -> str:
    return "-" if ok is None else "yes" if ok else "NO"


def _row(case: Case, name: str, r: dict) -> list:
    tok = case.batch * case.seq / r["step_s"]
    return [case.name, name, f"{case.batch} x {case.seq}", f"{tok:,.0f}", f"{case.flops / r['step_s'] / PEAK_BF16:.1%}",
            _fmt(r["peak_bytes"] if r["peak_bytes"] == r["peak_bytes"] else None, GiB, ".2f"), f"{r['compile_s']:.1f}", f"{r['setup_s']:.1f}", f"{r['step_s'] * 1e3:.1f}",
            f"{r['kernels']['generated']} / {r['kernels']['extern']}"]


def set_inductor_options(spec: str) -> dict:
    """Set ``torch._inductor.config`` from "key=value,..." (values as Python literals); returns them."""
    import ast
    import torch._inductor.config as cfg
    options = {}
    for item in filter(None, spec.split(",")):
        key, _, value = (part.strip() for part in item.partition("="))
        *parents, name = key.split(".")
        target = cfg
        for part in parents:
            target = getattr(target, part, None)
        if not hasattr(target, name):
            raise SystemExit(f"--inductor: torch._inductor.config has no option {key!r}")
        options[key] = ast.literal_eval(value)
        setattr(target, name, options[key])
    return options


def predictions(cases, measured: dict, mixed: bool, dtype, profile: str, report: dict) -> None:
    """autopar.plan's predicted step time and peak for each case beside ``measured`` (config -> run),
    printed as a table and added to ``report["predictions"]``."""
    prow = []
    for case in cases:
        p = predict(case, mixed, dtype, profile)
        m = measured.get(case.name)
        entry = dict(config=case.name, predicted_step_s=p["step_s"], predicted_peak_bytes=p["peak_bytes"],
                     plan_s=p["plan_s"])
        if m:
            entry.update(measured_step_s=m["step_s"], measured_by=m["contender"], time_ratio=m["step_s"] / p["step_s"])
            entry["time_ok"] = abs(entry["time_ratio"] - 1) <= 0.15
            if m["peak_bytes"] == m["peak_bytes"]:   # NaN where the device keeps no allocator statistics
                entry.update(measured_peak_bytes=m["peak_bytes"], memory_ratio=m["peak_bytes"] / p["peak_bytes"])
                entry["memory_ok"] = abs(entry["memory_ratio"] - 1) <= 0.10
        entry["predicted_memory"] = p["memory"]
        if m and m.get("resting_bytes") == m.get("resting_bytes"):
            entry["measured_resting_bytes"] = m["resting_bytes"]
        report["predictions"].append(entry)
        prow.append([case.name, f"{p['step_s'] * 1e3:.1f}",
                     f"{m['step_s'] * 1e3:.1f} ({m['contender']})" if m else "-",
                     _fmt(entry.get("time_ratio")), _verdict(entry.get("time_ok")),
                     f"{p['peak_bytes'] / GiB:.2f}", _fmt(entry.get("measured_peak_bytes"), GiB, ".2f"),
                     _fmt(entry.get("memory_ratio")), _verdict(entry.get("memory_ok"))])
    print(f"\n## autopar.plan(device={profile!r}) predicted vs measured (accept: time 15%, memory 10%)\n")
    print(markdown(["config", "pred ms", "meas ms", "meas/pred", "time ok", "pred GiB", "meas GiB", "meas/pred",
                    "mem ok"], prow))


def predict_from(path: str, profile: str) -> int:
    """The prediction table for the runs a GPU run saved in ``path`` (its compile_gpu.json), on this
    machine: ``autopar.plan`` prices on the meta device, so a changed cost model needs no GPU."""
    with open(path) as fh:
        saved = json.load(fh)
    started = time.perf_counter()
    measured: dict[str, dict] = {}
    for r in saved["runs"]:
        if r["contender"] == "autopar" or r["config"] not in measured:
            measured[r["config"]] = r
    cases = [replace(CASES[c], batch=measured[c]["batch"]) for c in measured]
    print(f"# predictions for the runs in {path} (measured with torch {saved['torch']} on {saved['device']})")
    report = dict(source=path, measured_with=saved["torch"], predictions=[])
    predictions(cases, measured, saved["mixed_precision"], torch.bfloat16, profile, report)
    write_report(report, "compile_gpu_predictions.json", started)
    return 0


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--configs", default="h2048,gpt2-xl,h1024",
                    help=f"comma-separated, from {', '.join(CASES)}")
    ap.add_argument("--contenders", default="plain,autopar", help=f"comma-separated, from {', '.join(CONTENDERS)}")
    ap.add_argument("--no-breakdown", action="store_true", help="skip the profiler's kernel-time breakdown")
    ap.add_argument("--predict-only", default="h1024",
                    help="configs for which only autopar runs (its numbers are what the prediction is checked "
                         "against); the others run every contender")
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--batch", type=int, help="override every config's batch")
    ap.add_argument("--device", default=None, help="cost-model device for the predictions: a preset or PROFILE.json "
                                                   "(default h200; cpu with --cpu-smoke)")
    ap.add_argument("--no-matmul", action="store_true")
    ap.add_argument("--no-predict", action="store_true")
    ap.add_argument("--cpu-smoke", action="store_true", help="tiny config on CPU/gloo, 3 steps")
    ap.add_argument("--inductor", default="", metavar="KEY=VALUE,...",
                    help="torch._inductor.config options for every contender (values read as Python literals)")
    ap.add_argument("--save-code", action="store_true", help="write Inductor's generated code to $OUT/code/")
    ap.add_argument("--predict-from", metavar="RESULTS.json",
                    help="run nothing: put the current cost model's predictions beside a saved GPU run's results")
    args = ap.parse_args(argv)
    if args.predict_from:
        return predict_from(args.predict_from, args.device or "h200")

    unknown = [c for c in args.configs.split(",") if c not in CASES]
    if unknown and not args.cpu_smoke:
        ap.error(f"unknown config(s) {', '.join(unknown)}; choose from {', '.join(CASES)}")
    contenders = args.contenders.split(",")
    if set(contenders) - set(CONTENDERS):
        ap.error(f"--contenders takes {', '.join(CONTENDERS)}")
    if args.cpu_smoke:
        device, cases, steps, profile = torch.device("cpu"), [SMOKE], 3, args.device or "cpu"
        predict_only: set[str] = set()
    else:
        if not torch.cuda.is_available():
            ap.error("no CUDA device: run on a GPU, or pass --cpu-smoke to check the script on CPU")
        device, steps, profile = torch.device("cuda", 0), args.steps, args.device or "h200"
        cases = [CASES[c] for c in args.configs.split(",")]
        predict_only = set(args.predict_only.split(",")) if args.predict_only else set()
    if args.batch:
        cases = [replace(c, batch=args.batch) for c in cases]
    dtype = torch.bfloat16
    inductor = set_inductor_options(args.inductor)
    single_process_group()
    mixed = has_precision_knob()
    started = time.perf_counter()
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    print(f"# compile_gpu: torch {torch.__version__}, {name}; precision: "
          f"{'autopar precision=bf16 vs plain autocast(bf16), fp32 master weights' if mixed else 'model cast to bf16'}",
          flush=True)
    report: dict = dict(torch=torch.__version__, device=name, mixed_precision=mixed, peak_flops=PEAK_BF16,
                        steps=steps, inductor=inductor, runs=[], predictions=[])

    if not args.no_matmul:
        n = 8192 if device.type == "cuda" else 256
        flops = matmul_ceiling(device, n, dtype)
        report["matmul"] = dict(n=n, flops=flops, fraction_of_peak=flops / PEAK_BF16)
        print(f"bf16 {n}^3 matmul: {flops / 1e12:.1f} TFLOP/s = {flops / PEAK_BF16:.1%} of {PEAK_BF16 / 1e12:.0f}",
              flush=True)

    rows = []
    measured: dict[str, dict] = {}
    for case in cases:
        results = {}
        for who in contenders:
            kind, mode = CONTENDERS[who]
            if case.name in predict_only and kind != "autopar":
                continue
            t0 = time.perf_counter()
            bd = not args.no_breakdown
            r = (run_plain(case, device, mixed, dtype, steps, bd, mode) if kind == "plain"
                 else run_autopar(case, device, mixed, dtype, steps, profile, bd, mode, kind == "autopar-master"))
            codes = r.pop("codes")
            if args.save_code:
                os.makedirs(os.path.join(out_dir(), "code"), exist_ok=True)
                for i, code in enumerate(codes):
                    with open(os.path.join(out_dir(), "code", f"{case.name}-{who}-{i}.py"), "w") as fh:
                        fh.write(code)
            r.update(config=case.name, contender=who, batch=case.batch, seq=case.seq,
                     tokens_per_s=case.batch * case.seq / r["step_s"], mfu=case.flops / r["step_s"] / PEAK_BF16,
                     wall_s=time.perf_counter() - t0)
            report["runs"].append(r)
            results[who] = r
            rows.append(_row(case, who, r))
            print(f"  {case.name} {who}: {r['step_s'] * 1e3:.1f} ms/step, MFU {r['mfu']:.1%}, "
                  f"{r['wall_s']:.0f} s in all", flush=True)
        for base, other in (("plain", "autopar"), ("plain-cudagraphs", "autopar-cudagraphs"), ("plain", "autopar-cudagraphs"),
                            ("plain", "autopar-master"), ("plain-autotune", "autopar-autotune")):
            if base in results and other in results:
                key = f"{case.name}: {other} / {base} speed"
                report.setdefault("speedup", {})[key] = results[base]["step_s"] / results[other]["step_s"]
        measured[case.name] = results.get("autopar") or results.get("plain")

    print("\n## Plain torch.compile vs autopar (1,1,1)\n")
    print(markdown(["config", "contender", "batch x seq", "tokens/s", "MFU", "peak GiB", "compile s", "setup s",
                    "step ms", "kernels gen / extern"], rows))
    for c, s in report.get("speedup", {}).items():
        print(f"\n{c} = {s:.3f}x")
    print("\n## What autopar's (1,1,1) path runs\n")
    for r in report["runs"]:
        if "graph_collectives" not in r:
            continue
        plain = next((p for p in report["runs"] if p["config"] == r["config"] and p["contender"] == "plain"), None)
        k = r["kernels"]
        versus = (f" (plain: {plain['kernels']['generated']} / {plain['kernels']['extern']})" if plain else "")
        print(f"- {r['config']}: {r['graph_collectives']} collectives in its graph, {k['collectives']} in the "
              f"generated code; Inductor kernels generated / extern {k['generated']} / {k['extern']}{versus}; "
              f"parallelize copied {r['model_bytes'] / GiB:.2f} GiB of weights into its own parameters")

    broken = [r for r in report["runs"] if "breakdown" in r]
    if broken:
        from autopar.rehearsal import KERNEL_FAMILIES
        names = [n for n, _ in KERNEL_FAMILIES]
        print("\n## GPU kernel time per step by family, ms (torch.profiler, 3 steps)\n")
        print(markdown(["config", "contender", *names, "all kernels", "step wall"],
                       [[r["config"], r["contender"], *(f"{r['breakdown']['families'][n] * 1e3:.1f}" for n in names),
                         f"{r['breakdown']['kernels_s'] * 1e3:.1f}", f"{r['breakdown']['wall_s'] * 1e3:.1f}"]
                        for r in broken]))

        for r in broken:
            gaps = r["breakdown"]["gaps"]
            print(f"\n{r['config']} {r['contender']}: GPU idle between kernels {gaps['idle_s'] * 1e3:.2f} ms per step; "
                  "longest gaps:")
            for seconds, before, after in gaps["longest"]:
                print(f"  {seconds * 1e6:8.1f} us  after {before}  before {after}")

    if not args.no_predict:
        predictions(cases, measured, mixed, dtype, profile, report)

    write_report(report, "compile_gpu.json", started)
    return 0


if __name__ == "__main__":
    sys.exit(main())
