"""mesh="auto" ranks each candidate by the plan made on it: a row of the ranking is that plan's
predicted step time and peak memory, so the winner's row is the winner's plan."""
from __future__ import annotations

import re

import autopar
from autopar.examples.gpt import build, example_inputs

ROW = re.compile(r"^\s*\d+\s+\((\d+), (\d+), (\d+)\)\s+(\d+)\s+([\d.]+)\s+([\d.]+)\s+(yes|no)$")


def _rows(note: str):
    """(mesh, microbatches, step ms, peak GiB) per ranked row, as printed."""
    return [((int(m[1]), int(m[2]), int(m[3])), int(m[4]), m[5], m[6])
            for m in map(ROW.match, note.splitlines()) if m]


def _printed(plan):
    return f"{plan.predicted_step_time * 1e3:.3f}", f"{max(m.peak for m in plan.memory) / 2**30:.3f}"


def test_each_ranked_row_is_the_plan_of_its_mesh():
    model = build("gpt2", device="meta", n_layer=4)
    inputs = example_inputs(model.config, 16, 512, device="meta")
    chosen = autopar.plan(model, "auto", inputs, world_size=16)
    rows = _rows(chosen.notes[0])
    assert len(rows) > 3 and {pp for (_, pp, _), *_ in rows} >= {1, 2}   # both kinds of step are ranked
    mesh, m, step, peak = rows[0]
    assert (mesh, m) == (tuple(chosen.mesh), chosen.microbatches)
    assert (step, peak) == _printed(chosen)
    for mesh, m, step, peak in rows[1:4]:
        assert (step, peak) == _printed(autopar.plan(model, mesh, inputs, microbatches=m)), mesh
