"""The public surface as a new user meets it: names, submodules, the default cost-model device."""
from __future__ import annotations

import importlib.util
import sys
import warnings

import pytest
import torch

import autopar
from autopar import api
from autopar.cost_model.devices import preset_for_gpu
import cli
import pool
from parity import BATCH, SEQ, TINY, make_model
from autopar.examples.gpt import example_inputs


def test_submodules_work_after_a_plain_import():
    """README writes ``autopar.launch.guard()`` and ``autopar.checkpoint.save_checkpoint`` after
    ``import autopar`` alone; a fresh interpreter has imported neither."""
    code = ("import sys, autopar; assert 'autopar.launch' not in sys.modules; "
            "print(callable(autopar.launch.guard), callable(autopar.checkpoint.save_checkpoint))")
    out = cli.run([sys.executable, "-c", code], check=True)
    assert out.stdout.split() == ["True", "True"]
    with pytest.raises(AttributeError, match="no attribute 'no_such_thing'"):
        autopar.no_such_thing


def test_no_public_name_hides_a_submodule():
    hidden = [name for name in autopar.__all__ if importlib.util.find_spec(f"autopar.{name}") is not None]
    assert hidden == []
    assert callable(autopar.plan) and autopar.plans.Plan is autopar.Plan
    assert callable(autopar.flops_report) and autopar.flops.FlopsReport is autopar.FlopsReport


@pytest.mark.parametrize("name,capability,expected", [
    ("NVIDIA H200", (9, 0), ("h200", True)),
    ("NVIDIA H100 80GB HBM3", (9, 0), ("h100", True)),
    ("NVIDIA H800", (9, 0), ("h100", True)),
    ("NVIDIA GH200 480GB", (9, 0), ("h100", True)),
    ("NVIDIA A100-SXM4-80GB", (8, 0), ("a100", True)),
    ("NVIDIA L4", (8, 9), ("a100", False)),
    ("Tesla V100-SXM2-32GB", (7, 0), ("a100", False)),
    ("NVIDIA B200", (10, 0), ("h200", False)),
])
def test_gpu_kind_picks_its_preset(name, capability, expected):
    assert preset_for_gpu(name, capability) == expected


def test_an_unknown_gpu_is_priced_as_the_nearest_preset_with_a_warning(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda *a: "NVIDIA L40S")
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda *a: (8, 9))
    with pytest.warns(UserWarning, match=r"no cost-model preset for the GPU 'NVIDIA L40S'; pricing it as 'a100'"):
        assert api.default_device() == "a100"
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda *a: "NVIDIA A100 80GB PCIe")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert api.default_device() == "a100"


def test_gpus_per_node_defaults_to_torchrun_local_world(monkeypatch):
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "4")
    assert api.default_gpus_per_node() == 4


def _dp_comm(rank, world):
    idx, tgt = example_inputs(TINY, BATCH, SEQ)
    return [autopar.parallelize(make_model(), (2, 1, 1), (idx, tgt), device="h100", gpus_per_node=g,
                                compile=False).plan.predicted_comm_s for g in (8, 1)]


DP_COMM = pool.job(2, _dp_comm, timeout=300)


def test_parallelize_takes_gpus_per_node():
    """With one GPU per node the dp all-reduce crosses nodes, priced at the slower tier."""
    intra, inter = DP_COMM.result()[0]
    assert inter > 2 * intra > 0


def test_the_readme_test_command_is_what_ci_runs():
    """README's test command must install every extra CI installs, or a user's run skips tests CI runs."""
    from pathlib import Path
    root = Path(__file__).resolve().parents[1]
    readme = [l.strip() for l in (root / "README.md").read_text().splitlines() if "python -m pytest" in l]
    ci = (root / ".ci" / "run").read_text()
    assert len(readme) == 1, readme
    extras = readme[0].split("pip install -e ")[1].split()[0]
    assert f"pip install -e {extras}" in ci
    assert "python -m pytest -q" in readme[0] and "python -m pytest -q" in ci
