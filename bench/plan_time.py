"""Planning time on the meta device: capture + solve, per config (prints a table).

    python bench/plan_time.py
    python bench/plan_time.py --auto nemo-70b-64 --repeat 2 [--profile]

``--auto ROW``: the CPU seconds of ``autopar.plan(model, "auto", ...)`` for a row of
bench/published.py (its model, GPUs and batch, bf16, ZeRO and recompute "auto", priced with
cost_model/profiles/h100.json), the model built and autopar imported before the clock starts;
``--profile`` prints cProfile's 30 costliest calls of the last repeat.
"""
from __future__ import annotations

import argparse
import cProfile
import pstats
import sys
import time
from pathlib import Path

from autopar.examples.gpt import build, example_inputs
from autopar.planner.decide import decide

CASES = [("gpt2", (1, 1, 4), 8, 1024), ("gpt3-1.3b", (1, 1, 8), 8, 2048), ("gpt3-175b", (1, 1, 8), 8, 2048)]


def main():
    print(f"{'config':12s} {'mesh':10s} {'layers':>6s} {'nodes':>6s} {'build s':>8s} {'plan s':>8s} {'ILP s':>7s} {'pred ms':>9s}")
    for name, mesh, batch, seq in CASES:
        t0 = time.perf_counter()
        model = build(name, device="meta")
        inputs = example_inputs(model.config, batch, seq, device="meta")
        t1 = time.perf_counter()
        cap, _, plan = decide(model, mesh, inputs, sequence_parallel=True, device="h100")
        t2 = time.perf_counter()
        print(f"{name:12s} {str(mesh):10s} {model.config.n_layer:6d} {len(cap.gm.graph.nodes):6d} "
              f"{t1 - t0:8.2f} {t2 - t1:8.2f} {plan.solve_seconds:7.3f} {plan.predicted_step_time * 1e3:9.1f}")


def auto(row: str, repeat: int, profile: bool) -> None:
    """Time mesh="auto" planning of published row ``row`` (see the module docstring)."""
    import autopar
    sys.path.insert(0, str(Path(__file__).parent))
    from published import ROWS, build
    run = ROWS[row]
    model, inputs = build(run)
    profiler = cProfile.Profile() if profile else None
    for i in range(repeat):
        if profiler and i == repeat - 1:
            profiler.enable()
        cpu = time.process_time()
        plan = autopar.plan(model, "auto", inputs, world_size=run.gpus, gpus_per_node=run.gpus_per_node,
                            device=str(Path(__file__).parents[1] / "cost_model/profiles/h100.json"),
                            precision="bf16", zero="auto", recompute="auto")
        cpu = time.process_time() - cpu
        if profiler and i == repeat - 1:
            profiler.disable()
        print(f"{row}: planned in {cpu:.2f} CPU s: {plan.mesh} zero={plan.zero} {plan.schedule} "
              f"v={plan.virtual_stages} {len(plan.recompute_regions)} recompute regions, predicted step "
              f"{plan.predicted_step_time * 1e3:.3f} ms", flush=True)
    if profiler:
        pstats.Stats(profiler).sort_stats("cumulative").print_stats(30)


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--auto", metavar="ROW", help="time mesh='auto' planning of a bench/published.py row")
    parser.add_argument("--repeat", type=int, default=1)
    parser.add_argument("--profile", action="store_true")
    args = parser.parse_args()
    if args.auto:
        auto(args.auto, args.repeat, args.profile)
    else:
        main()
