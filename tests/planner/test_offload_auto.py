"""offload="auto" and offload=<fraction> (planner/offload_split.py, planner/choices.py): the split of
units between the device and the host, chosen with recompute within the device's and the host's
memory, on a GPT built on the meta device and priced on the H200 profile; bad offload input."""
from __future__ import annotations

import dataclasses
import re

import pytest

import autopar
from autopar.cost_model.devices import get_device
from autopar.cost_model.offload import host_need
from autopar.errors import PlanError
from autopar.examples.gpt import build, example_inputs
from autopar.planner.offload_split import fraction_units, kept_units, search_split

H200 = get_device("h200")
KNOBS = dict(device="h200", precision="bf16")


@pytest.fixture(scope="module")
def gpt():
    model = build("gpt3-1.3b", device="meta", n_layer=8)
    return model, example_inputs(model.config, 8, 2048, device="meta")


@pytest.fixture(scope="module")
def ends(gpt):
    """The plans with nothing and with everything offloaded, recompute="full"."""
    model, x = gpt
    return {o: autopar.plan(model, (1, 1, 1), x, offload=o, recompute="full", **KNOBS) for o in ("none", "optimizer")}


UNITS = ("embedding", *(f"transformer.h.{i}" for i in range(8)), "head")   # zero_units, in forward order


def test_auto_offloads_nothing_where_the_plan_fits(gpt, ends):
    model, x = gpt
    roomy = autopar.plan(model, (1, 1, 1), x, offload="auto", recompute="full",
                         memory_budget=2 * ends["none"].memory[0].peak, **KNOBS)
    assert roomy.offload == "none" and roomy.offload_kept == ()
    assert any(n.startswith("offload chosen automatically: offload=none, it fits without offload") for n in roomy.notes)


def test_auto_splits_where_only_some_offload_fits(gpt, ends):
    model, x = gpt
    none, every = ends["none"], ends["optimizer"]
    budget = (none.memory[0].peak + every.memory[0].peak) / 2
    plan = autopar.plan(model, (1, 1, 1), x, offload="auto", recompute="full", memory_budget=budget, **KNOBS)
    assert plan.offload == "optimizer" and plan.memory[0].peak <= budget
    # the first units of the forward stay on the device, the last ones (final first in the backward) go
    kept = plan.offload_kept
    assert 0 < len(kept) < len(UNITS) and kept == tuple(UNITS[:len(kept)])
    assert plan.predicted_step_time < every.predicted_step_time
    assert every.memory[0].host > plan.memory[0].host > 0 and plan.memory[0].optimizer > 0
    # the note names the split, its bytes and the alternatives priced
    split = next(n for n in plan.notes if n.startswith("offload split chosen automatically"))
    host = len(UNITS) - len(kept)
    assert f"{host} of {len(UNITS)} units on the host" in split and "units priced:" in split
    priced = dict(re.findall(r"(\d+) on the host: ([\d.]+) ms", split))
    assert str(host) in priced and float(priced[str(host)]) == pytest.approx(plan.predicted_step_time * 1e3, abs=1e-3)
    assert any("(does not fit)" in part for part in split.split(";"))   # a smaller split was priced and refused
    assert any(n.startswith("offload chosen automatically: offload=optimizer, only with offload it fits")
               for n in plan.notes)
    # the plan runs as written: given back, it prices the same
    again = autopar.plan(model, (1, 1, 1), x, plan=plan, **KNOBS)
    assert again.offload_kept == kept and again.predicted_step_time == pytest.approx(plan.predicted_step_time)
    # shown: the summary's bytes on both sides, the diff, the HTML's unit marks
    summary = plan.summary()
    assert "GiB of optimizer state there" in summary and f"host memory: {plan.memory[0].host / 2**30:.2f} GiB" in summary
    assert "offload_kept: () ->" in every.diff(plan)
    page = plan.to_html()
    assert 'data-offload="host"' in page and 'data-offload="device"' in page


def test_auto_chooses_the_split_with_recompute(gpt, ends):
    """With recompute="auto" the room an offloaded unit frees goes to activations: the split and the
    regions are chosen together, no slower than the split with every block recomputed."""
    model, x = gpt
    budget = 0.98 * ends["none"].memory[0].peak   # nothing offloaded does not fit, even recomputing every block
    full = autopar.plan(model, (1, 1, 1), x, offload="auto", recompute="full", memory_budget=budget, **KNOBS)
    auto = autopar.plan(model, (1, 1, 1), x, offload="auto", recompute="auto", memory_budget=budget, **KNOBS)
    assert full.offload == auto.offload == "optimizer" and auto.memory[0].peak <= budget
    # no fewer units offloaded (recomputing less frees less), fewer blocks recomputed, a faster step
    assert len(auto.offload_kept) <= len(full.offload_kept) and auto.step_terms.compute < full.step_terms.compute
    assert auto.predicted_step_time < full.predicted_step_time
    # the recomputed forwards are in the step's compute: the same split recomputing everything is slower
    rerun = autopar.plan(model, (1, 1, 1), x, plan=dataclasses.replace(full, offload_kept=auto.offload_kept), **KNOBS)
    assert rerun.step_terms.compute > auto.step_terms.compute


def test_the_host_s_memory_bounds_the_split(gpt, ends):
    model, x = gpt
    budget = (ends["none"].memory[0].peak + ends["optimizer"].memory[0].peak) / 2
    roomy = autopar.plan(model, (1, 1, 1), x, offload="auto", recompute="full", memory_budget=budget, **KNOBS)
    need = roomy.memory[0].host
    # a host that holds less than that split needs: none fits both, and the note says what the host lacks
    small = dataclasses.replace(H200, host_memory_bytes=int(need / 2))
    with pytest.raises(PlanError, match="no plan fits"):
        autopar.plan(model, (1, 1, 1), x, offload="auto", recompute="full", memory_budget=budget,
                     device=small, precision="bf16")
    # forced: planned, with a warning naming what the host needs
    forced = autopar.plan(model, (1, 1, 1), x, offload="optimizer", recompute="full", device=small, precision="bf16")
    warning = next(w for w in forced.warnings if w.startswith("the host cannot hold"))
    assert f"needs {host_need(forced.memory, 1) / 2**30:.2f} GiB of host memory" in warning
    assert f"has {small.host_memory_bytes / 2**30:.2f} GiB" in warning
    assert "host_memory_bytes" in warning and "offload=" in warning
    assert not any(w.startswith("the host cannot hold") for w in ends["optimizer"].warnings)


def test_a_fraction_offloads_that_share_of_the_state_in_whole_units(gpt, ends):
    model, x = gpt
    half = autopar.plan(model, (1, 1, 1), x, offload=0.5, recompute="full", **KNOBS)
    every = ends["optimizer"]
    share = half.memory[0].host / every.memory[0].host
    assert half.offload == "optimizer" and 0.3 < share < 0.7 and half.offload_kept
    assert any(n.startswith("offload=0.5: ") for n in half.notes)
    assert autopar.plan(model, (1, 1, 1), x, offload=1.0, recompute="full", **KNOBS).offload_kept == ()
    assert autopar.plan(model, (1, 1, 1), x, offload=0, recompute="full", **KNOBS).offload == "none"
    late = autopar.plan(model, (1, 1, 1), x, offload=0.5, offload_delay=1, recompute="full", **KNOBS)
    assert late.offload_delay == 1 and late.offload_kept == half.offload_kept
    # one step late the host's job runs beside the whole next step: no more exposed than beside the backward
    assert late.step_terms.offload <= half.step_terms.offload


def test_fraction_rounding_and_the_search_alone():
    order = [("head", 1.0), ("h.1", 10.0), ("h.0", 10.0), ("embedding", 19.0)]
    assert fraction_units(order, 0.0) == 0 and fraction_units(order, 1.0) == 4
    assert fraction_units(order, 0.3) == 2 and fraction_units(order, 0.01) == 0 and fraction_units(order, 0.02) == 1
    assert kept_units(order, 2) == ("embedding", "h.0")

    @dataclasses.dataclass
    class C:
        peak_memory: float
        step_time: float
    # peaks fall with k; steps fall then rise; k = 1 does not fit
    peaks, steps = [9, 7, 5, 4, 3, 2], [1.0, 1.00, 0.90, 0.95, 2.0, 3.0]
    priced = []

    def price(k):
        priced.append(k)
        return C(peaks[k], steps[k])
    found = search_split(5, price, limit=6, k_host=5, floor=lambda k, c: 1.5 if k >= 4 else 0.0)
    assert found.best == 2 and 4 not in priced   # the floor at 4 is above the fastest: the scan stopped
    assert search_split(5, price, limit=6, k_host=1).best is None   # the host holds one unit, which does not fit
    # the fewest units within MARGIN of the fastest
    close = search_split(5, lambda k: C(peaks[k], [1, 1, 0.999, 0.998, 0.997, 2][k]), limit=6, k_host=5)
    assert close.best == 2


@pytest.mark.parametrize("knobs, message", [
    (dict(offload=1.5), r"offload=1.5: a fraction .* between 0 and 1"),
    (dict(offload=-0.1), r"offload=-0.1: a fraction"),
    (dict(offload="half"), r"offload='half': expected 'none'.*a fraction in \[0, 1\].*'auto'"),
    (dict(offload=True), r"offload=True: expected"),
    (dict(offload="optimizer", offload_delay=2), r"offload_delay=2: expected 0 .* or 1"),
    (dict(offload="none", offload_delay=1), r"offload_delay=1 .* offload='none'.*offload_delay=0"),
])
def test_bad_offload_input(gpt, knobs, message):
    model, x = gpt
    with pytest.raises(ValueError, match=message):
        autopar.plan(model, (1, 1, 1), x, **KNOBS, **knobs)


def test_the_cli_takes_a_fraction_and_the_delay(capsys):
    from autopar.__main__ import main

    assert main(["plan", "tiny", "--mesh", "1,1,1", "--batch", "4", "--seq", "32", "--device", "h200",
                 "--offload", "0.5", "--offload-delay", "1"]) == 0
    out = capsys.readouterr().out
    assert "optimizer offloaded to the host" in out and "applied one step late (offload_delay=1)" in out
    assert "Note: offload=0.5: " in out
    assert main(["plan", "tiny", "--mesh", "1,1,1", "--batch", "4", "--seq", "32", "--offload", "2"]) == 2
    assert "offload=2.0: a fraction" in capsys.readouterr().err
