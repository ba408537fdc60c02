"""Planning time on the meta device: capture + solve, per config (prints a table).

    python bench/plan_time.py
"""
from __future__ import annotations

import time

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


if __name__ == "__main__":
    main()
