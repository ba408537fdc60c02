"""Rehearse the worst rank of the acceptance plans on one GPU and print predicted against rehearsed.

    python bench/rehearse_gpu.py                  # every case, each in a process of its own
    python bench/rehearse_gpu.py 8b-zero3 70b     # some of them
    python bench/rehearse_gpu.py --list

Each case plans a model on the meta device for its full mesh (priced for this GPU's preset, or
--device PROFILE.json), runs one rank alone on this GPU under a world whose collectives move no
data (``autopar.rehearse``), and prints the rehearsal's lines: compute and peak memory against
the plan's (the acceptance asks within 10% and 5%), the priced communication and the step they
make, the collectives issued against the plan's. ``--out DIR`` writes each rehearsed plan as JSON
and HTML. A case runs in a child process so that one that runs out of memory does not end the
others (its error is printed in its place).
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
    "8b-zero3": ("llama-8b", (8, 1, 1), 8, 8192, dict(zero=3, precision="bf16")),
    "8b-tp8": ("llama-8b", (1, 1, 8), 8, 8192, dict(precision="bf16")),
    "70b": ("llama-70b", "auto", 64, 8192, dict(zero="auto", recompute="auto", precision="bf16", world_size=64)),
    "175b": ("gpt3-175b", (8, 16, 4), 1536, 2048, dict(precision="bf16", zero=1)),
    "8b-cp2-ring": ("llama-8b", {"dp": 4, "cp": 2}, 4, 65536, dict(precision="bf16", zero=3, cp_attention="ring")),
}


def run_case(name: str, device: str | None, steps: int, out: Path | None) -> dict:
    """Rehearse case ``name`` in this process; its report as a dict."""
    import torch

    import autopar
    from rankings import build_model

    config, mesh, batch, seq, knobs = CASES[name]
    model = build_model(config, seq)
    inputs = tuple(torch.empty(batch, seq, dtype=torch.long, device="meta") for _ in range(2))
    t0 = time.perf_counter()
    plan = autopar.rehearse(model, mesh, inputs, steps=steps, device=device,
                            log=lambda line: print(f"  [{name}] {line}", file=sys.stderr, flush=True), **knobs)
    r = plan.rehearsals[-1]
    if out is not None:
        out.mkdir(parents=True, exist_ok=True)
        plan.to_json(out / f"{name}.json")
        plan.to_html(out / f"{name}.html")
    return dict(case=name, seconds=time.perf_counter() - t0, mesh=list(plan.mesh), cp=plan.cp, zero=plan.zero,
                lines=r.lines(), compute_ratio=r.compute_ratio, memory_ratio=r.memory_ratio)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("cases", nargs="*", help=f"cases to run (default all): {', '.join(CASES)}")
    parser.add_argument("--device", help="cost-model device or profile to price with (default: this GPU's preset)")
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--out", type=Path, help="directory for each rehearsed plan's JSON and HTML")
    parser.add_argument("--list", action="store_true", help="print the cases and exit")
    parser.add_argument("--child", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.list:
        for name, (config, mesh, batch, seq, knobs) in CASES.items():
            print(f"{name:12s} {config} mesh {mesh} batch {batch} seq {seq} {knobs}")
        return 0
    if args.child:
        print(json.dumps(run_case(args.child, args.device, args.steps, args.out)))
        return 0
    failed = 0
    for name in args.cases or list(CASES):
        cmd = [sys.executable, __file__, "--child", name, "--steps", str(args.steps)]
        cmd += ["--device", args.device] if args.device else []
        cmd += ["--out", str(args.out)] if args.out else []
        done = subprocess.run(cmd, capture_output=True, text=True)
        print(f"== {name}: python bench/rehearse_gpu.py {name}" + (f" --device {args.device}" if args.device else ""))
        if done.returncode:
            failed += 1
            print("  failed: " + (done.stderr.strip().splitlines() or ["(no output)"])[-1])
            continue
        report = json.loads(done.stdout.strip().splitlines()[-1])
        print("\n".join(report["lines"]))
        ok = abs(report["compute_ratio"] - 1) <= 0.10 and abs(report["memory_ratio"] - 1) <= 0.05
        print(f"  compute x{report['compute_ratio']:.3f}, peak memory x{report['memory_ratio']:.3f}: "
              f"{'within' if ok else 'outside'} 10% / 5%; {report['seconds']:.0f} s")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
