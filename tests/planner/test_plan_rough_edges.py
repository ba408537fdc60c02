"""What a plan says about itself: idle axes, a peak above the device, gradient bytes, the device's
peak, an edited plan's source, diffs of re-derived plans (cp and HSDP ones too), a shard of a dim a
weight lacks, a CLI warning printed once, and the local shapes a rank holds under ZeRO."""
from __future__ import annotations

import json
import re

import pytest

import autopar
import cli
from autopar.examples.gpt import build, example_inputs
from autopar.placement import Shard, local_shape


def _autopar(*args):
    return cli.main(*args)


@pytest.fixture(scope="module")
def tiny():
    model = build("tiny", device="meta")
    return model, example_inputs(model.config, 8, device="meta")


def _edit_layer_1_mlp(plan: autopar.Plan) -> dict:
    """The plan's JSON with layer 1's c_fc replicated by hand, its recorded numbers left stale."""
    data = json.loads(plan.to_json())
    for p in data["parameters"]:
        if p["fqn"].startswith("transformer.h.1.mlp.c_fc."):
            p["placements"]["tp"] = "R"
    for n in data["nodes"]:
        if n["module"] in ("transformer.h.1.mlp.c_fc", "transformer.h.1.mlp.gelu"):
            n["inputs"], n["output"] = ["R"] * len(n["inputs"]), "R"
    return data


def test_idle_tp_axis_is_named(tiny):
    """tp=2 on the CPU preset replicates everything: the summary says tp does no work and why."""
    model, x = tiny
    auto = autopar.plan(model, (1, 1, 2), x, device="cpu")
    assert all(p.placements["tp"] == "R" for p in auto.parameters) and auto.predicted_comm_s == 0
    text = auto.summary()
    assert "Warning: tp=2 does no work" in text and "replicated every weight" in text and "'cpu'" in text
    assert "use tp=1" in text
    megatron = autopar.plan(model, (1, 1, 2), x, device="cpu", plan="megatron")
    assert not megatron.warnings and "does no work" not in megatron.summary()


def test_plan_above_the_device_warns_with_a_mesh_that_fits():
    """GPT-3 175B at (1, 1, 8) peaks far above an H100's memory: the summary and the CLI say so,
    by how much, and which deeper pipeline the cost model fits; that mesh then plans."""
    r = _autopar("plan", "gpt3-175b", "--mesh", "1,1,8")
    assert r.returncode == 0, r.stderr
    m = re.search(r"Warning: this plan does not fit: its peak is ([\d.]+) GiB per rank but one h100 holds "
                  r"([\d.]+) GiB, so memory must shrink ([\d.]+)x", r.stdout)
    assert m, r.stdout[-2000:]
    peak, held, factor = map(float, m.groups())
    assert peak > held and factor == pytest.approx(peak / held, abs=0.06)
    assert "recompute='full' only lowers it to" in r.stdout
    assert "warning: this plan does not fit" in r.stderr
    suggested = re.search(r"`--mesh (\d+,\d+,\d+)`", r.stdout)
    assert suggested, r.stdout[-2000:]
    model = build("gpt3-175b", device="meta")
    x = example_inputs(model.config, 8, 2048, device="meta")
    deeper = autopar.plan(model, tuple(map(int, suggested.group(1).split(","))), x)
    assert not any("does not fit" in w for w in deeper.warnings)


def test_full_recompute_is_suggested_when_it_fits(tiny):
    model, x = tiny
    plain = autopar.plan(model, (1, 1, 1), x, device="cpu")
    full = autopar.plan(model, (1, 1, 1), x, device="cpu", recompute="full")
    budget = (plain.memory[0].peak + full.memory[0].peak) / 2
    assert full.memory[0].peak < budget < plain.memory[0].peak
    warned = autopar.plan(model, (1, 1, 1), x, device="cpu", memory_budget=budget)
    assert any("does not fit" in w and "the memory budget" in w and "recompute='full' fits it" in w
               for w in warned.warnings), warned.warnings


def test_gradients_at_one_microbatch_are_explained(tiny):
    """With one microbatch no gradient is held through a forward: the line says where they are
    counted instead of printing 0; with several microbatches the bytes are printed."""
    model, x = tiny
    one = autopar.plan(model, (1, 1, 1), x, device="cpu").summary()
    assert "grads 0.000" not in one
    assert "grads (in backward)" in one and "counted in 'backward above forward'" in one
    piped = autopar.plan(model, (1, 2, 1), x, device="cpu")
    assert piped.microbatches > 1 and all(m.grads > 0 for m in piped.memory)
    assert re.search(r"grads \d+\.\d{3} ", piped.summary()) and "grads (in backward)" not in piped.summary()


def test_device_peak_keeps_significant_digits(tiny):
    model, x = tiny
    plan = autopar.plan(model, (1, 1, 1), x, device="cpu")
    m = re.search(r"of ([\d.]+) TFLOP/s per device", plan.summary())
    assert m and float(m.group(1)) == pytest.approx(plan.peak_flops / 1e12, rel=0.01)
    h100 = autopar.plan(model, (1, 1, 1), x).summary()
    assert re.search(r"of \d{2,4} TFLOP/s per device", h100)


def test_edited_plan_says_so_and_a_read_back_one_does_not(tiny):
    model, x = tiny
    megatron = autopar.plan(model, (1, 1, 2), x, device="cpu", plan="megatron")
    again = autopar.plan(model, (1, 1, 2), x, device="cpu", plan=autopar.Plan.from_json(megatron.to_json()))
    assert again.source == "megatron"
    edited = autopar.plan(model, (1, 1, 2), x, device="cpu",
                          plan=autopar.Plan.from_json(json.dumps(_edit_layer_1_mlp(megatron))))
    assert edited.source == "edited from megatron"
    assert edited.summary().startswith("autopar plan (edited from megatron) for mesh dp=1 pp=1 tp=2")
    rerun = autopar.plan(model, (1, 1, 2), x, device="cpu", plan=autopar.Plan.from_json(edited.to_json()))
    assert rerun.source == "edited from megatron"


def test_diff_re_derives_edited_plans_from_the_recorded_model(tmp_path):
    """A hand edit of one layer in a CLI-written plan: diff shows that layer's real local shape,
    its collectives and the new step time, naming layer 1 (no folded pattern)."""
    a, b = tmp_path / "a.json", tmp_path / "b.json"
    r = _autopar("plan", "tiny", "--mesh", "1,1,2", "--device", "cpu", "--plan", "megatron", "--out", str(a))
    assert r.returncode == 0, r.stderr
    original = autopar.Plan.from_json(a)
    assert original.model == "tiny"
    b.write_text(json.dumps(_edit_layer_1_mlp(original)))
    r = _autopar("diff", str(a), str(b))
    assert r.returncode == 1, r.stderr
    lines = r.stdout.splitlines()
    assert "parameter transformer.h.1.mlp.c_fc.weight: tp S(0) local [64, 32] -> tp R local [128, 32]" in lines
    assert any(l.startswith("collective transformer.h.1.mlp") for l in lines), r.stdout
    assert any(l.startswith("predicted step time:") for l in lines), r.stdout
    assert "*" not in r.stdout and "re-derived" in r.stderr
    written = _autopar("diff", str(a), str(b), "--as-written")
    assert written.returncode == 1 and "collective" not in written.stdout and "re-derived" not in written.stderr


def test_diff_takes_the_model_for_plans_that_do_not_record_it(tiny, tmp_path):
    model, x = tiny
    megatron = autopar.plan(model, (1, 1, 2), x, device="cpu", plan="megatron")
    a, b = tmp_path / "a.json", tmp_path / "b.json"
    megatron.to_json(a)
    b.write_text(json.dumps(_edit_layer_1_mlp(megatron)))
    raw = _autopar("diff", str(a), str(b))
    assert "collective" not in raw.stdout   # the file's collectives are stale: nothing to compare
    r = _autopar("diff", str(a), str(b), "--model", "tiny")
    assert r.returncode == 1 and "collective transformer.h.1.mlp" in r.stdout, r.stdout + r.stderr


def test_diff_prints_axes_in_mesh_order(tiny):
    """dp before tp, as the summary's dp=... tp=...; only the axes that changed."""
    model, x = tiny
    zero0 = autopar.plan(model, (2, 1, 2), x, device="cpu", plan="megatron")
    zero1 = json.loads(autopar.plan(model, (2, 1, 2), x, device="cpu", plan="megatron", zero=1).to_json())
    fc = next(p for p in zero1["parameters"] if p["fqn"] == "transformer.h.0.mlp.c_fc.weight")
    fc["placements"]["tp"] = "R"
    report = zero0.diff(autopar.Plan.from_json(json.dumps(zero1))).splitlines()
    assert any(l.startswith("parameter transformer.h.0.mlp.c_fc.weight: dp R tp S(0) local") and
               "-> dp S(0) tp R local" in l for l in report), report
    assert any(l.startswith("parameter transformer.h.0.attn.c_proj.weight: dp R local") for l in report), report


def test_shard_of_a_missing_dim_is_a_plan_format_error(tiny):
    model, x = tiny
    data = json.loads(autopar.plan(model, (1, 1, 2), x, device="cpu", plan="megatron").to_json())
    i = next(k for k, p in enumerate(data["parameters"]) if p["fqn"] == "transformer.h.0.attn.c_proj.weight")
    data["parameters"][i]["placements"]["tp"] = "S(2)"
    with pytest.raises(autopar.PlanFormatError,
                       match=rf"plan.parameters\[{i}\].placements.tp \(transformer.h.0.attn.c_proj.weight\): "
                             r"S\(2\) shards dim 2.*2 dim\(s\)"):
        autopar.Plan.from_json(json.dumps(data))
    with pytest.raises(ValueError, match="use S\\(0\\)..S\\(1\\) or R"):
        local_shape((32, 32), Shard(2), 2)


def test_html_shows_the_warnings(tiny):
    model, x = tiny
    page = autopar.plan(model, (1, 1, 2), x, device="cpu").to_html()
    assert "<ul class='warn'><li>tp=2 does no work" in page


@pytest.mark.parametrize("mesh, flags", [("dp=2,cp=2,tp=1", []), ("dp_replicate=2,dp_shard=2,tp=1", ["--zero", "3"])])
def test_diff_of_a_cp_or_hsdp_plan(tmp_path, mesh, flags):
    """Re-derived on its own mesh (cp and dp's split included), a plan diffs clean against itself,
    and an edit of it shows."""
    a, b = tmp_path / "a.json", tmp_path / "b.json"
    r = _autopar("plan", "tiny", "--mesh", mesh, "--device", "cpu", *flags, "--out", str(a))
    assert r.returncode == 0, r.stderr
    r = _autopar("diff", str(a), str(a))
    assert (r.returncode, r.stdout.strip()) == (0, "no differences"), r.stdout + r.stderr
    data = json.loads(a.read_text())
    if data["cp"] > 1:
        edit = {"cp_attention": "ring" if data["cp_attention"] == "allgather" else "allgather"}
    else:
        edit = {"keep_gathered": []}
    b.write_text(json.dumps(dict(data, **edit)))
    r = _autopar("diff", str(a), str(b))
    [(field, value)] = edit.items()
    assert r.returncode == 1 and f"{field}: " in r.stdout and "Traceback" not in r.stderr, r.stdout + r.stderr


def _plan_cli_to(stdout, stderr):
    """`plan tiny --mesh 1,1,2 --device cpu` (tp=2 does no work there) with its two streams going to ``stdout``
    and ``stderr``, files of this process."""
    import contextlib
    import warnings

    from autopar.__main__ import main

    with contextlib.redirect_stdout(stdout), contextlib.redirect_stderr(stderr), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return main(["plan", "tiny", "--mesh", "1,1,2", "--device", "cpu"])


def test_a_cli_warning_is_printed_once_where_both_streams_meet(tmp_path):
    """Both streams to one place (a terminal, `2>&1`): the summary's warning alone; stdout to a file: the
    warning on stderr too."""
    with open(tmp_path / "both.txt", "w") as both:
        assert _plan_cli_to(both, both) == 0
    text = (tmp_path / "both.txt").read_text()
    assert text.count("tp=2 does no work") == 1 and "Warning: tp=2 does no work" in text, text
    with open(tmp_path / "out.txt", "w") as out, open(tmp_path / "err.txt", "w") as err:
        assert _plan_cli_to(out, err) == 0
    assert "Warning: tp=2 does no work" in (tmp_path / "out.txt").read_text()
    assert "warning: tp=2 does no work" in (tmp_path / "err.txt").read_text()


def test_summary_local_shape_is_what_a_rank_holds_under_zero(tiny):
    """ZeRO-2/3 hold a dp shard of each tp shard's rows (ceil, padded): the summary and the page show that
    shape; ZeRO-1 keeps the weights whole and says its dp S(0) is the optimizer state's."""
    model, x = tiny
    line = re.compile(r"^  transformer\.h\.\*\.mlp\.c_fc\.weight \(x2\)\s+\[128, 32\]\s+dp=S\(0\) tp=R\s+(\[.*\])$",
                      re.M)
    for zero, held in ((3, "[43, 32]"), (2, "[43, 32]"), (1, "[128, 32]")):
        plan = autopar.plan(model, (3, 1, 1), example_inputs(model.config, 6, device="meta"), device="cpu", zero=zero)
        text = plan.summary()
        m = line.search(text)
        assert m and m.group(1) == held, text
        assert plan.param("transformer.h.0.mlp.c_fc.weight").local_shape == (128, 32)   # what the runtime reads
        if zero > 1:
            assert f"local shape: this rank's ZeRO-{zero} dp shard, ceil(rows / 3) rows of the tp shard" in text
            row = re.search(r'<tr data-param="transformer\.h\.0\.mlp\.c_fc\.weight">.*?</tr>', plan.to_html())
            assert row and row.group(0).endswith(f'<td class="m">{held}</td><td class="muted"></td></tr>'), row
        else:
            assert "ZeRO-1's dp S(0) is the optimizer state's" in text
