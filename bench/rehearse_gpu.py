"""Rehearse the worst rank of the acceptance plans on one GPU and print predicted against rehearsed.

    python bench/rehearse_gpu.py --out DIR                  # every case, each in a process of its own
    python bench/rehearse_gpu.py --out DIR 8b-zero3 70b     # some of them
    python bench/rehearse_gpu.py --taught DIR               # then, anywhere: calibrate and re-price
    python bench/rehearse_gpu.py --list
    python bench/rehearse_gpu.py --out DIR tiny             # the script's smoke test (on the CPU too)
    python bench/rehearse_gpu.py --dry                      # every case planned, none run (on the CPU too)

Each case plans a model on the meta device for its full mesh (priced for this GPU's preset, or
--device PROFILE.json), runs one rank alone on this GPU under a world whose collectives move no
data (``autopar.rehearse``), and prints the rehearsal's lines: compute and peak memory against
the plan's (the acceptance asks within 10% and 5%), the priced communication and the step they
make, the collectives issued against the plan's. ``--out DIR`` writes each rehearsed plan as
DIR/CASE.json and the reports as DIR/results.json (both as each case ends). A case runs in a
child process so that one that runs out of memory does not end the others (its error is printed
in its place).

``--dry`` needs no GPU: each case is built and planned as a run would plan it (priced for h100
unless --device says otherwise), the program of the rank a run would rehearse is built for a GPU
(its passes run on the meta capture, as a run's first step), and the rank is printed with its
predicted compute and peak, each case in a child process as a run's; nothing is run.

``--taught DIR`` needs no GPU: it teaches the plans' device profile what the rehearsed ranks'
matmuls and fused attention took (``calibrate.with_rehearsals``), writes it to DIR/taught.json,
re-prices each rehearsed plan with it (the same choices: the plan is given back to the planner)
and prints the predicted compute before and after beside the rehearsed one.

"8b-tp8" and "70b" plan within 76 GiB: recompute="auto" fills the budget it is given, and an H100 of
"80 GB" gives a process 79.18 GiB (the h100 preset's figure) less its CUDA context and what the caching
allocator cannot reuse (0.67 and 2.97 GiB when 8b-tp8 ran out of memory there).
"70b" rehearses the layout ``bench/rankings.py 70b`` chooses on H100s (mesh, ZeRO stage,
microbatches, schedule), planned again for this GPU within those 76 GiB;
"70b-recipe" is NVIDIA's Llama 3.1 70B recipe on 64 GPUs (TP4 PP4 CP2, 5 virtual stages,
micro-batch 1, global batch 128 x 8192, no recompute; ``bench/published.py``'s row).
"""
from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))   # bench/rankings.py's shapes

# name: (model, mesh, global batch, sequence, knobs); Llama shapes as bench/rankings.py builds them
CASES = {
    "tiny": ("tiny", {"dp": 2, "pp": 2, "tp": 2}, 8, 32, dict(precision="bf16")),   # a smoke test, seconds
    "8b-tp8": ("llama-8b", (1, 1, 8), 8, 8192, dict(precision="bf16", recompute="auto", memory_budget="76GiB")),
    # its first 8 and 16 layers: where 8b-tp8 outgrows its plan, the two give the figures per layer
    "8b-tp8-8l": ("llama-8b:8", (1, 1, 8), 8, 8192, dict(precision="bf16", recompute="auto", memory_budget="76GiB")),
    "8b-tp8-16l": ("llama-8b:16", (1, 1, 8), 8, 8192, dict(precision="bf16", recompute="auto", memory_budget="76GiB")),
    "8b-zero3": ("llama-8b", (8, 1, 1), 8, 8192, dict(zero=3, precision="bf16")),
    "8b-cp2-ring": ("llama-8b", {"dp": 4, "cp": 2}, 4, 65536, dict(precision="bf16", zero=3, cp_attention="ring", recompute="full")),
    "175b": ("gpt3-175b", (8, 16, 4), 1536, 2048, dict(precision="bf16", zero=1)),
    "70b-recipe": ("llama-70b", {"dp": 2, "pp": 4, "cp": 2, "tp": 4}, 128, 8192,
                   dict(precision="bf16", zero=1, recompute="none", sequence_parallel=True,
                        schedule="Interleaved1F1B", virtual_stages=5, microbatches=64)),
    "70b": ("llama-70b", "ranking", 64, 8192, dict(precision="bf16", recompute="auto", memory_budget="76GiB")),
}


def ranking_layout(model, inputs) -> tuple[dict, dict]:
    """The mesh and knobs ``bench/rankings.py 70b`` chooses on H100s: its plan's layout, to plan again."""
    import autopar
    from autopar.mesh import Mesh
    from rankings import CASES as RANKED

    _, gpus, _, _, budget, _ = RANKED["70b"]
    won = autopar.plan(model, "auto", inputs, world_size=gpus, device="h100", zero="auto", recompute="auto",
                       precision="bf16", memory_budget=budget, sequence_parallel="auto")
    mesh = dict(Mesh.of_plan(won).dims())
    knobs = dict(zero=won.zero, microbatches=won.microbatches, schedule=won.schedule, sequence_parallel=won.sequence_parallel)
    if won.virtual_stages > 1:
        knobs["virtual_stages"] = won.virtual_stages
    return mesh, knobs


def _case(name: str):
    """Case ``name``'s model (meta), inputs (meta), mesh and knobs, the "ranking" mesh resolved."""
    import torch
    from rankings import build_model

    config, mesh, batch, seq, knobs = CASES[name]
    model = build_model(config, seq)
    inputs = tuple(torch.empty(batch, seq, dtype=torch.long, device="meta") for _ in range(2))
    if mesh == "ranking":
        mesh, layout = ranking_layout(model, inputs)
        knobs = {**knobs, **layout}
    return model, inputs, mesh, knobs


def dry_case(name: str, device: str | None) -> dict:
    """Plan case ``name`` in this process as ``run_case`` would, run nothing; the rank it would
    rehearse and the plan's figures for it, as a dict."""
    import torch

    from autopar.mesh import Mesh
    from autopar.planner.decide import decide
    from autopar.rehearsing import predicted_compute_s, predicted_peak, worst_rank
    from autopar.runtime.groups import Groups
    from autopar.runtime.lowering import rewritten
    from autopar.runtime.program import program_for

    model, inputs, mesh, knobs = _case(name)
    t0 = time.perf_counter()
    cap, strategies, plan = decide(model, mesh, inputs, device=device or "h100", **knobs)
    rank, why = worst_rank(plan)
    the_mesh = Mesh.of_plan(plan)
    program = program_for(plan, rank, cap, strategies, groups=Groups.placeholders(the_mesh, plan.zero, "nccl"),
                          device=torch.device("cuda"))
    rewritten(program, cap)
    pp = the_mesh.coords(rank)["pp"]
    peak, compute = predicted_peak(plan, pp), predicted_compute_s(plan, pp)
    lines = [f"planned {plan.mesh} cp={plan.cp} zero={plan.zero} microbatches={plan.microbatches} recompute "
             f"{len(plan.recompute_regions)} regions, priced for {plan.device}: rank {rank} ({why}) predicted "
             f"compute {compute * 1e3:.1f} ms, peak {peak / 2**30:.2f} GiB; its passes: {', '.join(program.pass_names)}"]
    return dict(case=name, seconds=time.perf_counter() - t0, mesh=mesh, knobs=knobs, device=device, lines=lines,
                dry=True)


def run_case(name: str, device: str | None, steps: int, warmup: int, out: Path | None) -> dict:
    """Rehearse case ``name`` in this process; its report as a dict."""
    import autopar

    model, inputs, mesh, knobs = _case(name)
    t0 = time.perf_counter()
    plan = autopar.rehearse(model, mesh, inputs, steps=steps, warmup=warmup, device=device,
                            log=lambda line: print(f"  [{name}] {line}", file=sys.stderr, flush=True), **knobs)
    r = plan.rehearsals[-1]
    if out is not None:
        out.mkdir(parents=True, exist_ok=True)
        plan.to_json(out / f"{name}.json")
    return dict(case=name, seconds=time.perf_counter() - t0, mesh=mesh, knobs=knobs, device=device,
                lines=r.lines(), compute_ratio=r.compute_ratio, memory_ratio=r.memory_ratio)


def taught(out: Path) -> int:
    """Teach the rehearsed plans' device profile what their ranks' ops took, write it to
    ``out``/taught.json, re-price each plan with it and print predicted compute before and after;
    and, where several cases were rehearsed, each re-priced by a profile taught by the others only
    (``out``/taught-without-CASE.json): what calibration predicts for a job it has not seen."""
    import autopar
    from autopar.cost_model.calibrate import with_rehearsals, write_profile
    from autopar.cost_model.devices import get_device
    from autopar.mesh import Mesh
    from autopar.plans import Plan
    from autopar.rehearsing import predicted_compute_s

    results = json.loads((out / "results.json").read_text())
    plans = {r["case"]: Plan.from_json(out / f"{r['case']}.json") for r in results if (out / f"{r['case']}.json").exists()}
    devices = {p.device for p in plans.values()}
    if len(devices) != 1:
        raise SystemExit(f"the rehearsed plans were priced for {sorted(devices)}: teach one device's profile at a time")
    base = get_device(devices.pop())

    def teach(cases, path):
        spec, record = with_rehearsals(base, [r for c in cases for r in plans[c].rehearsals])
        write_profile(spec, record, path)
        return spec, record
    spec, record = teach(list(plans), out / "taught.json")
    print(f"taught {spec.name}: {len(spec.matmul_table)} matmul and {len(spec.attention_table)} attention samples, "
          f"memory-bound ops at {record['fused_bandwidth']['rehearsed'] / 1e9:.0f} GB/s "
          f"(was {record['fused_bandwidth']['before'] / 1e9:.0f}) -> {out / 'taught.json'}\n")
    print("| case | rank | rehearsed compute | predicted (preset) | ratio | predicted (taught) | ratio | "
          "taught by the others | ratio | rehearsed peak GiB | predicted GiB | ratio |")
    print("|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    for r in results:
        if r["case"] not in plans:
            continue
        plan = plans[r["case"]]
        (rh,) = plan.rehearsals[-1:]
        model, inputs, _, _ = _case(r["case"])
        knobs = {k: v for k, v in r["knobs"].items() if k in ("precision", "cp_attention", "memory_budget")}

        def priced(path):
            again = autopar.plan(model, r["mesh"], inputs, plan=plan, device=str(path), **knobs)
            return predicted_compute_s(again, Mesh.of_plan(again).coords(rh.rank)["pp"])
        after = priced(out / "taught.json")
        others = [c for c in plans if c != r["case"]]
        held = ""
        if others:
            teach(others, out / f"taught-without-{r['case']}.json")
            unseen = priced(out / f"taught-without-{r['case']}.json")
            held = f"{unseen:.3f} s | x{rh.compute_s / unseen:.3f}"
        print(f"| {r['case']} | {rh.rank} ({rh.coords}) | {rh.compute_s:.3f} s | {rh.predicted_compute_s:.3f} s | "
              f"x{rh.compute_ratio:.3f} | {after:.3f} s | x{rh.compute_s / after:.3f} | {held or '- | -'} | "
              f"{rh.peak_bytes / 2**30:.2f} | {rh.predicted_peak_bytes / 2**30:.2f} | x{rh.memory_ratio:.3f} |")
    return 0


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("cases", nargs="*", help=f"cases to run (default all): {', '.join(CASES)}")
    parser.add_argument("--device", help="cost-model device or profile to price with (default: this GPU's preset)")
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--out", type=Path, help="directory for each rehearsed plan's JSON and the reports")
    parser.add_argument("--taught", type=Path, metavar="DIR", help="calibrate from DIR's rehearsals and re-price them")
    parser.add_argument("--list", action="store_true", help="print the cases and exit")
    parser.add_argument("--dry", action="store_true", help="plan each case as a run would, run none (no GPU needed)")
    parser.add_argument("--child", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.list:
        for name, (config, mesh, batch, seq, knobs) in CASES.items():
            print(f"{name:12s} {config} mesh {mesh} batch {batch} seq {seq} {knobs}")
        return 0
    if args.taught:
        return taught(args.taught)
    if args.child:
        report = (dry_case(args.child, args.device) if args.dry
                  else run_case(args.child, args.device, args.steps, args.warmup, args.out))
        print(json.dumps(report))
        return 0
    unknown = [name for name in args.cases if name not in CASES]
    if unknown:
        parser.error(f"unknown case(s) {', '.join(unknown)}: the cases are {', '.join(CASES)}")
    failed, results = 0, []
    for name in args.cases or list(CASES):
        cmd = [sys.executable, __file__, "--child", name, "--steps", str(args.steps), "--warmup", str(args.warmup)]
        cmd += ["--device", args.device] if args.device else []
        cmd += ["--out", str(args.out)] if args.out and not args.dry else []
        cmd += ["--dry"] if args.dry else []
        done = subprocess.run(cmd, stdout=subprocess.PIPE, text=True)
        print(f"== {name}: python bench/rehearse_gpu.py {name}" + (f" --device {args.device}" if args.device else ""),
              flush=True)
        if done.returncode:
            failed += 1
            print(f"  failed (exit {done.returncode}; its log above)", flush=True)
            continue
        report = json.loads(done.stdout.strip().splitlines()[-1])
        print("\n".join(report["lines"]))
        if args.dry:
            print(f"  {report['seconds']:.0f} s", flush=True)
            continue
        results.append(report)
        if args.out:
            (args.out / "results.json").write_text(json.dumps(results, indent=1))
        ok = abs(report["compute_ratio"] - 1) <= 0.10 and abs(report["memory_ratio"] - 1) <= 0.05
        print(f"  compute x{report['compute_ratio']:.3f}, peak memory x{report['memory_ratio']:.3f}: "
              f"{'within' if ok else 'outside'} 10% / 5%; {report['seconds']:.0f} s", flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
