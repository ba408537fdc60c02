"""Plan.diff and `python -m autopar diff`: equal plans say so, an edited layer shows as that layer."""
from __future__ import annotations

import json

import pytest

import autopar
import cli
from autopar.examples.gpt import build, example_inputs


@pytest.fixture(scope="module")
def model_and_inputs():
    model = build("gpt3-1.3b", device="meta", n_layer=4)
    return model, example_inputs(model.config, 8, 2048, device="meta")


def test_auto_against_megatron_differs_only_at_the_position_table(model_and_inputs, tmp_path):
    """The automatic plan is Megatron's but for the batch-independent position table, a tie that the
    update's price decides (tests/planner/test_plan_structure.py); a plan planned twice diffs as equal."""
    model, x = model_and_inputs
    auto = autopar.plan(model, (1, 1, 8), x, sequence_parallel=True)
    megatron = autopar.plan(model, (1, 1, 8), x, sequence_parallel=True, plan="megatron")
    lines = auto.diff(megatron).splitlines()
    decisions = [line for line in lines if not line.startswith(("memory of stage", "predicted step time"))]
    assert decisions and all("transformer.wpe" in line for line in decisions), lines
    again = autopar.plan(model, (1, 1, 8), x, sequence_parallel=True, plan="megatron")
    assert megatron.diff(again) == "no differences"
    megatron.to_json(tmp_path / "a.json")
    again.to_json(tmp_path / "b.json")
    r = cli.main("diff", str(tmp_path / "a.json"), str(tmp_path / "b.json"))
    assert r.returncode == 0 and r.stdout.strip() == "no differences", r


def test_one_edited_layer_is_exactly_what_differs(model_and_inputs, tmp_path):
    """Replicate the MLP of layer 2 by hand in the JSON; the re-derived plan differs there only."""
    model, x = model_and_inputs
    megatron = autopar.plan(model, (1, 1, 8), x, sequence_parallel=False, plan="megatron")
    data = json.loads(megatron.to_json())
    for p in data["parameters"]:
        if p["fqn"].startswith("transformer.h.2.mlp.c_fc."):
            p["placements"]["tp"] = "R"
    for n in data["nodes"]:
        if n["module"] in ("transformer.h.2.mlp.c_fc", "transformer.h.2.mlp.gelu"):
            n["inputs"], n["output"] = ["R"] * len(n["inputs"]), "R"
    edited = autopar.plan(model, (1, 1, 8), x, plan=autopar.Plan.from_json(json.dumps(data)))
    report = megatron.diff(edited).splitlines()
    print("\n".join(report))
    layer_lines = [l for l in report if l.split(" ", 1)[0] in ("parameter", "node", "collective")]
    assert layer_lines and all("transformer.h.2.mlp" in l for l in layer_lines)
    assert {l.split(":")[0] for l in report if l not in layer_lines} <= {"memory of stage 0", "predicted step time"}
    assert any(l.startswith("parameter transformer.h.2.mlp.c_fc.weight: tp S(0)") for l in report)
    path_a, path_b = tmp_path / "a.json", tmp_path / "b.json"
    megatron.to_json(path_a)
    edited.to_json(path_b)
    r = cli.main("diff", str(path_a), str(path_b))
    assert r.returncode == 1 and "transformer.h.2.mlp.c_fc.weight" in r.stdout
