"""mesh="auto" ranks each candidate by the plan made on it: a row of the ranking is that plan's
predicted step time and peak memory, so the winner's row is the winner's plan."""
from __future__ import annotations

import re

import pytest

import autopar
from autopar.examples.gpt import build, example_inputs

# rank, mesh (dp or HSDP's "r x s", pp, cp where above 1, tp), schedule (not captured), microbatches, zero ("3 k5": 5 units kept gathered),
# recompute ("auto 12": regions), offload,
# step ms, its terms (compute, tp, cp, pp, dp, bubble, update, host), peak GiB, fits
ROW = re.compile(r"^\s*\d+\s+\((\d+(?:x\d+)?), (\d+), (?:cp(\d+), )?(\d+)\)\s+(?:-|GPipe|1F1B|I\w+ v\d+)\s+(\d+)\s+(\d(?: k\d+)?)\s+(none|selective|full|auto \d+)"
                 r"\s+(none|optimizer)\s+([\d.]+)((?:\s+-?[\d.]+){8})\s+([\d.]+)\s+(yes|no)$")


def _dp(text: str) -> int:
    """A row's dp: "16", or an HSDP split "2x8" (dp_replicate x dp_shard)."""
    r, _, s = text.partition("x")
    return int(r) * int(s or 1)


def _rows(note: str):
    """(mesh (dp, pp, cp, tp), microbatches, step ms, peak GiB) per ranked row, as printed."""
    return [((_dp(m[1]), int(m[2]), int(m[3] or 1), int(m[4])), int(m[5]), m[9], m[11])
            for m in map(ROW.match, note.splitlines()) if m]


SCHEDULE = re.compile(r"\)\s+(-|GPipe|1F1B|I(\w+) v(\d+))\s")


def _schedules(note: str) -> list[dict]:
    """The schedule knobs of each ranked row (``_rows``' order): {} without pipeline stages."""
    out = []
    for line in note.splitlines():
        if ROW.match(line):
            m = SCHEDULE.search(line)
            out.append({} if m[1] == "-" else dict(schedule=m[1]) if not m[2] else
                       dict(schedule=f"Interleaved{m[2]}", virtual_stages=int(m[3])))
    return out


def _table(plan) -> str:
    return next(n for n in plan.notes if n.startswith("mesh chosen automatically"))


def _printed(plan):
    return f"{plan.predicted_step_time * 1e3:.3f}", f"{max(m.peak for m in plan.memory) / 2**30:.3f}"


# a budget the plain dp plan misses: the fastest fitting rows come late in the search, so the step
# floors leave several meshes to plan (with room, the first row wins and rules the others out)
TIGHT = "300MiB"


def test_each_ranked_row_is_the_plan_of_its_mesh():
    model = build("gpt2", device="meta", n_layer=4)
    inputs = example_inputs(model.config, 16, 512, device="meta")
    chosen = autopar.plan(model, "auto", inputs, world_size=16, memory_budget=TIGHT)
    rows = _rows(_table(chosen))
    assert len(rows) > 3 and {pp for (_, pp, _, _), *_ in rows} >= {1, 2}   # both kinds of step are ranked
    mesh, m, step, peak = rows[0]
    dp, pp, tp = chosen.mesh
    assert (mesh, m) == ((dp, pp, chosen.cp, tp), chosen.microbatches)
    assert (step, peak) == _printed(chosen)
    fitting = [(row, knobs) for row, knobs, fits in zip(rows, _schedules(_table(chosen)), _fits(_table(chosen)))
               if fits]
    assert len(fitting) >= 3
    for (mesh, m, step, peak), knobs in fitting[1:4]:
        again = autopar.plan(model, dict(zip(("dp", "pp", "cp", "tp"), mesh)), inputs, microbatches=m,
                             memory_budget=TIGHT, **knobs)
        assert (step, peak) == _printed(again), mesh


def _fits(note: str) -> list[bool]:
    """Whether each ranked row (``_rows``' order) fits."""
    return [m[12] == "yes" for m in map(ROW.match, note.splitlines()) if m]


def test_a_mesh_its_floor_rules_out_is_counted_not_planned():
    """With room the first row planned, dp over every device, is the fastest: each other mesh's step
    floor is no faster, so it is not planned, and the table counts it in one line."""
    model, inputs = _gpt2()
    chosen = autopar.plan(model, "auto", inputs, world_size=16)
    table = _table(chosen)
    planned = [line for line in table.splitlines() if re.match(r"^\s*\d+\s+\(", line)]   # cp rows too
    skipped = int(re.search(r"(\d+) more not planned: each one's step floor", table)[1])
    total = int(re.search(r"among (\d+) candidates", table)[1])
    assert _rows(table)[0][0] == (16, 1, 1, 1) and skipped > 0 and len(planned) + skipped == total


def _gpt2():
    model = build("gpt2", device="meta", n_layer=4)
    return model, example_inputs(model.config, 16, 512, device="meta")


def test_each_row_shows_the_choices_and_the_terms_of_its_step():
    model, inputs = _gpt2()
    chosen = autopar.plan(model, "auto", inputs, world_size=16, zero="auto", memory_budget=TIGHT)
    table = _table(chosen)
    rows = [m for m in map(ROW.match, table.splitlines()) if m]
    assert len(rows) > 3
    for m in rows:
        terms = [float(t) for t in m[10].split()]
        assert sum(terms) == pytest.approx(float(m[9]), abs=4e-3), m[0]   # printed to 3 decimals each
        pp = int(m[2])
        assert (terms[3] > 0 or terms[5] > 0) if pp > 1 else terms[3] == terms[5] == 0.0, m[0]   # pp, bubble
        assert (terms[1] > 0) == (int(m[4]) > 1), m[0]   # tp communication only with tp > 1
        assert (terms[2] > 0) == (m[3] is not None), m[0]   # cp communication only with cp > 1
    first = rows[0]
    assert (int(first[6].split()[0]), first[8]) == (chosen.zero, chosen.offload)
    assert (first[9], first[11]) == _printed(chosen)
    why = table.splitlines()[-1]
    runner = rows[1]

    def name(m):
        return f"({m[1]}, {m[2]}, {f'cp{m[3]}, ' if m[3] else ''}{m[4]})"
    assert why.strip().startswith(f"winner {name(first)}: the fastest that fits")
    assert f"runner-up {name(runner)}'s {runner[9]} ms" in why


def test_the_split_is_the_plans_own_step_sum():
    from autopar.mesh import Mesh
    from autopar.planner.choices import choose_offload
    from autopar.planner.request import Job, Request
    model, inputs = _gpt2()
    for mesh, m in (((4, 2, 2), 4), ((8, 1, 2), 2)):
        job = Job(model, inputs, Request.of(mesh, zero=3, device="h100"))
        d = choose_offload(job, Mesh(*mesh), m, zero=3, offload="none")
        assert sum(d.terms.as_dict().values()) == pytest.approx(d.step_time, rel=1e-12), mesh
        assert d.terms.dp == pytest.approx(d.terms.comm_s - (d.terms.tp if mesh[1] == 1 else 0))
        assert d.plan().predicted_step_time == pytest.approx(d.step_time, rel=1e-12)


def test_recompute_auto_with_mesh_auto_fits_the_device_by_default():
    from autopar.cost_model.devices import get_device
    model, inputs = _gpt2()
    default = autopar.plan(model, "auto", inputs, world_size=4, recompute="auto")
    given = autopar.plan(model, "auto", inputs, world_size=4, recompute="auto",
                         memory_budget=get_device("h100").memory_bytes)
    assert default.diff(given) == "no differences"
    assert default.mesh == given.mesh and max(m.peak for m in default.memory) <= get_device("h100").memory_bytes
    # and at a fixed mesh too
    fixed = autopar.plan(model, (4, 1, 1), inputs, recompute="auto")
    assert fixed.recompute == "auto" and fixed.recompute_regions == ()   # it fits one H100 without recompute


def test_no_mesh_fits_names_the_smallest_peak_and_what_to_change():
    model, inputs = _gpt2()
    with pytest.raises(autopar.PlanError) as e:
        autopar.plan(model, "auto", inputs, world_size=4, zero="auto", recompute="auto", memory_budget="200MiB")
    text = str(e.value)
    peaks = re.findall(r"the smallest peak found is ([\d.]+) GiB per device, with mesh \(dp, pp, tp\) = "
                       r"\((\d+), (\d+), (\d+)\), zero=(\d), recompute=auto \((\d+) regions\), offload=none", text)
    assert peaks, text
    assert "after choosing mesh, zero, recompute" in text and "--gpus 8" in text and "memory_budget of at least" in text
    # the smallest peak is at most the least of the rows the table shows (it follows the message, ranked by
    # step time: each mesh at every microbatch count that could fit, the least-memory ones may be cut off)
    rows = [float(m[11]) for m in map(ROW.match, text.splitlines()) if m]
    assert rows and float(peaks[0][0]) <= min(rows) + 6e-3


HSDP_ROW = re.compile(r"^\s*\d+\s+\((\d+)x(\d+), (\d+), (\d+)\)\s+(?:-|GPipe|1F1B|I\w+ v\d+)\s+(\d+)\s+(\d(?: k\d+)?)\s+(none|selective|full|auto \d+)"
                      r"\s+(none|optimizer)\s+([\d.]+)((?:\s+-?[\d.]+){8})\s+([\d.]+)\s+(yes|no)$")


def test_a_dp_across_nodes_is_ranked_split_as_hsdp_too():
    model, inputs = _gpt2()
    budget = "512MiB"   # one the plain dp plans miss, so that the floors leave both splits to plan
    chosen = autopar.plan(model, "auto", inputs, world_size=16, zero="auto", gpus_per_node=8, memory_budget=budget)
    rows = [m for m in map(HSDP_ROW.match, _table(chosen).splitlines()) if m]
    # dp_shard = the dp ranks of one node: (16,1,1) -> 2 x 8, (8,1,2) -> 2 x 4, (4,2,2) -> 2 x 2
    assert {(int(m[1]), int(m[2]), int(m[3]), int(m[4])) for m in rows} >= {(2, 8, 1, 1), (2, 4, 1, 2)}
    r, s, pp, tp, mb, zero = (int(rows[0][k]) for k in range(1, 7))
    mesh = {"dp_replicate": r, "dp_shard": s, "pp": pp, "tp": tp}
    alone = autopar.plan(model, mesh, inputs, zero=zero, microbatches=mb, gpus_per_node=8, memory_budget=budget)
    assert (rows[0][9], rows[0][11]) == _printed(alone)   # the row is the plan of its HSDP mesh
    # without ZeRO nothing shards over dp_shard: no split is ranked
    plain = autopar.plan(model, "auto", inputs, world_size=16, zero=0, gpus_per_node=8)
    assert not any(map(HSDP_ROW.match, _table(plain).splitlines()))


# ---- context parallelism in the ranking ----------------------------------------------------------

CP_ROW = re.compile(r"^\s*\d+\s+\((\d+), (\d+), cp(\d+), (\d+)\)\s+(?:-|GPipe|1F1B|I\w+ v\d+)\s+(\d+)\s+(\d(?: k\d+)?)\s+(none|selective|full|auto \d+)"
                    r"\s+(none|optimizer)\s+([\d.]+)((?:\s+-?[\d.]+){8})\s+([\d.]+)\s+(yes|no)$")


def _cp_rows(plan):
    """(dp, pp, cp, tp), microbatches, step ms, peak GiB and the terms of each ranked cp > 1 row."""
    return [((int(m[1]), int(m[2]), int(m[3]), int(m[4])), int(m[5]), m[9], m[11], [float(t) for t in m[10].split()])
            for m in map(CP_ROW.match, _table(plan).splitlines()) if m]


def test_a_batch_smaller_than_the_world_ranks_cp_rows_each_the_plan_of_its_mesh():
    """One 1,024-token sequence on 4 devices: dp cannot use them, so each (pp, tp) splits the sequence
    over the least cp the batch allows; every cp row planned is the plan of its mesh, cp's collectives
    its own term."""
    model = build("gpt2", device="meta", n_layer=4)
    inputs = example_inputs(model.config, 1, 1024, device="meta")
    chosen = autopar.plan(model, "auto", inputs, world_size=4)
    rows = _cp_rows(chosen)
    # (1, 1, cp4, 1), if not planned, is ruled out by its step floor: counted, with no figures
    assert {mesh for mesh, *_ in rows} in ({(1, 1, 2, 2), (1, 1, 4, 1)}, {(1, 1, 2, 2)}), _table(chosen)
    skipped = re.search(r"(\d+) more not planned", _table(chosen))
    total = int(re.search(r"among (\d+) candidates", _table(chosen))[1])
    assert len(rows) + (int(skipped[1]) if skipped else 0) == total
    for (dp, pp, cp, tp), m, step, peak, terms in rows:
        alone = autopar.plan(model, {"dp": dp, "pp": pp, "cp": cp, "tp": tp}, inputs, microbatches=m)
        assert (step, peak) == _printed(alone), (dp, pp, cp, tp)
        assert terms[2] > 0 and sum(terms) == pytest.approx(float(step), abs=4e-3)   # cp's collectives
    assert "cp 2, 4 split the 1024-token sequence" in _table(chosen)
    assert chosen.cp > 1   # here (1, 1, 4)'s tp collectives cost more than cp's
    winner = next(r for r in rows if r[0] == (chosen.mesh[0], chosen.mesh[1], chosen.cp, chosen.mesh[2]))
    assert winner[2:4] == _printed(chosen)   # the winner's row is its plan's
    why = _table(chosen).splitlines()[-1]
    assert f"cp {chosen.cp} is the least cp at pp=1, tp={chosen.mesh[2]} that the batch allows" in why


def _long():
    """Two 4,096-token sequences of a model whose 3 heads tp=2 cannot split: dp=2 or cp=2 on 2 devices."""
    model = build("gpt2", device="meta", n_layer=2, n_head=3, n_embd=192, block_size=4096)
    return model, example_inputs(model.config, 2, 4096, device="meta")


def test_a_memory_budget_pushes_cp_up():
    """dp=2 keeps a whole sequence's activations per device, cp=2 half of them plus the gathered keys
    and values and the mask rows: with the room for both, dp=2 wins and cp is not planned; with a budget
    only cp=2 fits, it wins, and the reason line says what dp=2 needed."""
    model, inputs = _long()
    roomy = autopar.plan(model, "auto", inputs, world_size=2)
    assert (tuple(roomy.mesh), roomy.cp) == ((2, 1, 1), 1) and not _cp_rows(roomy)
    dp_peak = max(m.peak for m in roomy.memory)
    cp_peak = max(m.peak for m in autopar.plan(model, {"cp": 2}, inputs, microbatches=2).memory)
    assert cp_peak < dp_peak
    budget = (cp_peak + dp_peak) / 2
    tight = autopar.plan(model, "auto", inputs, world_size=2, memory_budget=budget)
    assert (tuple(tight.mesh), tight.cp) == ((1, 1, 1), 2)
    [(mesh, m, step, peak, _)] = [row for row in _cp_rows(tight) if float(row[3]) * 2**30 <= budget]
    assert (mesh, m) == ((1, 1, 2, 1), 2) and (step, peak) == _printed(tight)
    why = _table(tight).splitlines()[-1]
    assert f"cp 2 is the least cp at pp=1, tp=1 that fits ((2, 1, 1) needs {dp_peak / 2**30:.2f} GiB)" in why


def test_cp_rows_are_skipped_where_2cp_does_not_divide_the_sequence():
    model = build("gpt2", device="meta", n_layer=2)
    inputs = example_inputs(model.config, 1, 20, device="meta")   # 2·cp | 20: cp 2 (and 5, 10), not 4
    chosen = autopar.plan(model, "auto", inputs, world_size=4)
    assert {mesh for mesh, *_ in _cp_rows(chosen)} == {(1, 1, 2, 2)}, _table(chosen)
    assert "cp 2 splits the 20-token sequence (cp 4: 2·cp does not divide it)" in _table(chosen)
