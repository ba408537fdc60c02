"""Calibration: measuring this machine into a device profile, loading it, and planning with it."""
from __future__ import annotations

import dataclasses
import json

import pytest
import torch

import autopar
from autopar.cost_model.comm import collective_time
from autopar.cost_model.compute import compute_time, node_flops
from autopar.cost_model.devices import DEVICES, DeviceSpec, get_device
from autopar.cost_model.calibrate import fit_alpha_beta, measure_collectives
from autopar.cost_model.comm import collective_bytes_on_wire
from autopar.cost_model.compute import matmul_rate
from autopar.cost_model.devices import AttentionSample, CollectiveFit, MatmulSample
from autopar.examples.gpt import build, example_inputs
import cli
import pool


@pytest.fixture(scope="module")
def profile(tmp_path_factory):
    """A quick calibration of this machine, run as a user runs it."""
    path = tmp_path_factory.mktemp("calibrate") / "device.json"
    r = cli.autopar("calibrate", "--quick", "--out", str(path), timeout=300)
    assert r.returncode == 0, r.stdout + r.stderr
    assert f"profile written to {path}" in r.stdout
    return path


def test_quick_calibration_writes_a_profile_that_loads(profile):
    data = json.loads(profile.read_text())
    assert data["calibration"]["quick"] is True and data["calibration"]["torch"] == torch.__version__
    spec = get_device(str(profile))
    assert spec.name == "cpu (measured)"
    fp32 = [s for s in spec.matmul_table if s.dtype == "fp32"]
    assert len(fp32) >= 3 and all(s.flops_per_s > 0 for s in fp32)
    assert len({(s.m, s.n, s.k) for s in fp32}) == len(fp32)
    assert spec.matmul_curve(torch.float32)[1] and spec.peak_flops["fp32"] == max(s.flops_per_s for s in fp32)
    assert 1e8 < spec.mem_bandwidth < 1e13          # a copy on any CPU of this decade
    assert 0 < spec.launch_overhead < 1e-3
    assert spec.collective_fits == ()                # one process: no collectives measured
    assert DeviceSpec.from_json(spec.to_json()) == spec
    # the quick mode's promise on a CPU (with slack for a machine shared by other jobs)
    assert data["calibration"]["seconds"] < 60

    r = cli.main("plan", "tiny", "--mesh", "1,1,1", "--device", str(profile))
    assert r.returncode == 0, r.stderr
    assert "for mesh dp=1 pp=1 tp=1 on cpu (measured)" in r.stdout


def _matmul_bound_gpt():
    return build("tiny", device="meta", n_layer=2, n_embd=256, n_head=4, vocab_size=512, block_size=64)


def _scaled(spec: DeviceSpec, factor: float, name: str) -> DeviceSpec:
    """``spec`` with its matmul curve's shape kept and every rate multiplied by ``factor``."""
    table = tuple(dataclasses.replace(s, flops_per_s=s.flops_per_s * factor) for s in spec.matmul_table)
    return dataclasses.replace(spec, name=name, matmul_table=table)


def test_planning_with_the_profile_follows_its_numbers(profile):
    model = _matmul_bound_gpt()
    inputs = example_inputs(model.config, 8, 64, device="meta")
    measured = autopar.plan(model, (1, 1, 1), inputs, device=str(profile))
    assert measured.device == "cpu (measured)"
    preset = autopar.plan(model, (1, 1, 1), inputs, device="cpu")
    assert measured.predicted_step_time != pytest.approx(preset.predicted_step_time, rel=1e-3)

    # The preset with only the measured matmul curve added, scaled below / above the preset's
    # peak * efficiency at every size: predictions must move the same way.
    cpu = DEVICES["cpu"]
    spec = dataclasses.replace(cpu, matmul_table=get_device(str(profile)).matmul_table)
    rates = [s.flops_per_s for s in spec.matmul_table if s.dtype == "fp32"]
    ceiling = cpu.flops("fp32") * cpu.matmul_efficiency
    slow = _scaled(spec, 0.5 * ceiling / max(rates), "slow matmuls")
    fast = _scaled(spec, 2.0 * ceiling / min(rates), "fast matmuls")
    t_slow = autopar.plan(model, (1, 1, 1), inputs, device=slow).predicted_compute_s
    t_fast = autopar.plan(model, (1, 1, 1), inputs, device=fast).predicted_compute_s
    assert t_slow > preset.predicted_compute_s > t_fast


def test_matmul_curve_drives_matmul_time():
    table = (MatmulSample("bf16", 128, 128, 128, 1e12), MatmulSample("bf16", 512, 512, 512, 2e12),
             MatmulSample("bf16", 1024, 1024, 1024, 4e12), MatmulSample("bf16", 4096, 1024, 256, 2e12))
    dev = dataclasses.replace(DEVICES["h100"], matmul_table=table)
    small, middle, large = 2 * 128**3, 2 * 512**3, 2 * 1024**3
    # 4096 x 1024 x 256 has 1024^3's FLOPs: the two are averaged
    assert dev.matmul_curve(torch.bfloat16) == ((small, middle, large), (1e12, 2e12, 3e12))
    assert matmul_rate(small, dev, "bf16") == 1e12 and matmul_rate(large, dev, "bf16") == 3e12
    assert matmul_rate(small / 10, dev, "bf16") == 1e12 and matmul_rate(large * 10, dev, "bf16") == 3e12
    assert matmul_rate((small * middle) ** 0.5, dev, "bf16") == pytest.approx(1.5e12)   # halfway in log FLOPs
    assert matmul_rate((middle * large) ** 0.5, dev, "bf16") == pytest.approx(2.5e12)
    assert compute_time(large, 0, dev, torch.bfloat16) == pytest.approx(large / 3e12)
    # dtypes the table lacks keep the data-sheet peak times the efficiency
    assert compute_time(large, 0, dev, torch.float32) == pytest.approx(large / (67e12 * 0.8))
    floor = dataclasses.replace(dev, launch_overhead=5e-6)
    assert compute_time(1e3, 8, floor, torch.bfloat16) == 5e-6


def test_attention_table_prices_fused_attention_only():
    """A profile's attention rate prices the sdpa nodes and nothing else; without it they are matmuls."""
    from autopar.cost_model.compute import attention_kind
    from autopar.cost_model.strategy import strategy_time
    from autopar.planner.decide import decide

    model = build("tiny", device="meta", n_layer=2, block_size=64)
    inputs = example_inputs(model.config, 4, 64, device="meta")
    cap, strategies, _ = decide(model, (1, 1, 1), inputs, device="cpu")
    sdpa = [n for n in strategies if attention_kind(n) is not None]
    assert sdpa and all(attention_kind(n) for n in sdpa)   # the GPT's attention is causal
    base = DEVICES["cpu"]
    slow = dataclasses.replace(base, attention_table=(AttentionSample("fp32", 4, 4, 64, 16, 1, 1e6),))
    fwd, bwd = node_flops(sdpa[0])
    assert strategy_time(sdpa[0], strategies[sdpa[0]], 1, slow, False) == pytest.approx((fwd + bwd) / 1e6)
    assert strategy_time(sdpa[0], strategies[sdpa[0]], 1, base, False) < (fwd + bwd) / 1e8
    others = [n for n in strategies if n.op == "call_function" and attention_kind(n) is None]
    assert [strategy_time(n, strategies[n], 1, slow, False) for n in others] == \
           [strategy_time(n, strategies[n], 1, base, False) for n in others]
    # non-causal samples do not price causal attention
    acausal = dataclasses.replace(base, attention_table=(AttentionSample("fp32", 4, 4, 64, 16, 0, 1e6),))
    assert strategy_time(sdpa[0], strategies[sdpa[0]], 1, acausal, False) == \
           strategy_time(sdpa[0], strategies[sdpa[0]], 1, base, False)


def test_update_time_is_adamw_and_the_working_copy():
    """The plan's update term: 7 fp32 bytes moved per parameter byte at the optimizer bandwidth,
    1/dp of them under ZeRO-1, plus 3 per byte of casts at the fused bandwidth with 16-bit compute."""
    model = build("tiny", device="meta", n_layer=2, block_size=64)
    inputs = example_inputs(model.config, 8, 64, device="meta")
    dev = dataclasses.replace(DEVICES["cpu"], optimizer_bandwidth=1e9, fused_bandwidth=2e9)
    param_bytes = 4.0 * sum(p.numel() for p in model.parameters())
    fp32 = autopar.plan(model, (1, 1, 1), inputs, device=dev)
    assert fp32.predicted_update_s == pytest.approx(7 * param_bytes / 1e9)
    bf16 = autopar.plan(model, (1, 1, 1), inputs, device=dev, precision="bf16")
    assert bf16.predicted_update_s == pytest.approx(7 * param_bytes / 1e9 + 3 * param_bytes / 2e9)
    zero = autopar.plan(model, (2, 1, 1), inputs, device=dev, zero=1)
    assert zero.predicted_update_s == pytest.approx(7 * param_bytes / 2 / 1e9)
    assert fp32.predicted_step_time == pytest.approx(
        fp32.predicted_compute_s + fp32.predicted_comm_s + fp32.predicted_update_s)


def test_collective_fits_drive_collective_time():
    fit = CollectiveFit("intra", "all_gather", 7e-6, 1e11)
    dev = dataclasses.replace(DEVICES["h100"], collective_fits=(fit,))
    nbytes = 64e6
    assert collective_time("all_gather", nbytes, 8, dev) == pytest.approx(7 / 8 * nbytes / 1e11 + 7 * 7e-6)
    # kinds and tiers without a fit keep the tier's numbers
    assert collective_time("all_reduce", nbytes, 8, dev) == collective_time("all_reduce", nbytes, 8, DEVICES["h100"])
    assert collective_time("all_gather", nbytes, 8, dev, inter_node=True) == \
        collective_time("all_gather", nbytes, 8, DEVICES["h100"], inter_node=True)


def test_fit_alpha_beta_recovers_latency_and_bandwidth():
    latency, bandwidth = 2e-5, 3e10
    samples = [(steps, wire, steps * latency + wire / bandwidth)
               for steps in (1, 2, 6) for wire in (1e3, 1e5, 1e7, 1e9)]
    fitted = fit_alpha_beta(samples)
    assert fitted == pytest.approx((latency, bandwidth), rel=1e-6)
    with pytest.raises(ValueError, match="two message sizes"):
        fit_alpha_beta(samples[:1])
    with pytest.raises(ValueError, match="larger messages"):
        fit_alpha_beta([(1, 1e3, 1e-3), (1, 1e6, 1e-3)])


def _collectives(rank, world):
    return measure_collectives((1, 1, world), "cpu", [2**12, 2**18, 2**23], reps=5)


COLLECTIVES = pool.job(2, _collectives, timeout=240)


def test_collectives_are_measured_and_fitted_per_axis():
    result = COLLECTIVES.result()[0]
    tp = result["tp"]
    assert tp["size"] == 2 and {k for k, _, _ in tp["samples"]} == {"all_reduce", "all_gather", "reduce_scatter"}
    fitted = {kind: fit for kind, fit in tp["fits"].items() if "error" not in fit}
    assert fitted, tp   # times that never grow with 2000x the bytes would be a broken measurement
    for kind, fit in fitted.items():
        assert fit["latency"] >= 0 and fit["bandwidth"] > 0
        rows = [(b, t) for k, b, t in tp["samples"] if k == kind]
        # the fit describes what was measured: within a factor 3 at the largest message
        b, t = max(rows)
        steps = 2 if kind == "all_reduce" else 1
        predicted = steps * fit["latency"] + collective_bytes_on_wire(kind, b, 2) / fit["bandwidth"]
        assert t / 3 < predicted < 3 * t


@pytest.mark.parametrize("change, words", [
    (lambda d: d.pop("mem_bandwidth"), ["mem_bandwidth", "missing"]),
    (lambda d: d.update(launch_overhead="fast"), ["launch_overhead", "number"]),
    (lambda d: d.update(matmul_table={"fp32": 1}), ["matmul_table", "list"]),
    (lambda d: d["matmul_table"][0].pop("k"), ["matmul_table", "[0]", "k"]),
    (lambda d: d["matmul_table"][1].update(flops_per_s=-1.0), ["matmul_table", "[1]", "flops_per_s", "> 0"]),
    (lambda d: d["matmul_table"][0].update(dtype="float32"), ["matmul_table", "dtype", "fp32"]),
    (lambda d: d["collective_fits"][0].update(tier="rack"), ["collective_fits", "tier", "intra"]),
    (lambda d: d["collective_fits"].append(dict(d["collective_fits"][0])), ["collective_fits", "second fit"]),
    (lambda d: d.update(calibration=[1, 2]), ["calibration", "object"]),
    (lambda d: d["attention_table"][0].update(causal=2), ["attention_table", "causal must be 0 or 1"]),
    (lambda d: d.update(fused_bandwidth=-1.0), ["fused_bandwidth", ">= 0"]),
])
def test_malformed_profile_is_refused_naming_the_field(change, words):
    spec = dataclasses.replace(
        DEVICES["cpu"], launch_overhead=3e-6,
        matmul_table=(MatmulSample("fp32", 64, 64, 64, 1e9), MatmulSample("fp32", 256, 256, 256, 2e10)),
        attention_table=(AttentionSample("fp32", 2, 4, 128, 32, 1, 5e10),),
        collective_fits=(CollectiveFit("intra", "all_reduce", 5e-5, 1e9),))
    data = spec.to_dict()
    assert DeviceSpec.from_json(json.dumps(data)) == spec
    change(data)
    with pytest.raises(ValueError) as e:
        get_device(json.dumps(data))
    for w in words:
        assert w in str(e.value)


def test_presets_round_trip_with_the_measured_fields(tmp_path):
    for spec in DEVICES.values():
        path = tmp_path / f"{spec.name}.json"
        spec.to_json(path)
        loaded = get_device(str(path))
        assert loaded == spec and hash(loaded) == hash(spec)
        assert loaded.matmul_table == () and loaded.collective_fits == () and loaded.launch_overhead == 0.0
    # profiles written before these fields existed still load
    old = {k: v for k, v in DEVICES["h100"].to_dict().items()
           if k not in ("launch_overhead", "matmul_table", "collective_fits")}
    assert DeviceSpec.from_json(json.dumps(old)) == DEVICES["h100"]


@pytest.mark.skipif("not torch.cuda.is_available()", reason="needs a CUDA GPU")
def test_quick_calibration_on_a_gpu(tmp_path):
    from autopar.cost_model.calibrate import calibrate, write_profile

    spec, record = calibrate(quick=True)
    write_profile(spec, record, tmp_path / "gpu.json")
    loaded = get_device(str(tmp_path / "gpu.json"))
    assert loaded == spec
    assert {"fp32", "tf32", "bf16"} <= {s.dtype for s in spec.matmul_table}
    best = max(s.flops_per_s for s in spec.matmul_table if s.dtype == "bf16")
    # the base preset's data-sheet peak stays (MFU keeps its meaning); a large bf16 matmul gets near it
    assert 0.3 * spec.peak_flops["bf16"] < best <= spec.peak_flops["bf16"]
    assert spec.mem_bandwidth > 5e11 and 0 < spec.launch_overhead < 1e-4
    assert record["seconds"] < 90
