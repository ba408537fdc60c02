"""The command line as a user runs it: `python -m autopar plan ...` and `python -m autopar demo`."""
from __future__ import annotations

import os
import re
import subprocess
import sys

import pytest


def _autopar(*args, timeout=120, cwd=None):
    env = {**os.environ, "PYTHONWARNINGS": "ignore::FutureWarning", "COLUMNS": "200"}
    return subprocess.run([sys.executable, "-m", "autopar", *args], capture_output=True, text=True,
                          timeout=timeout, env=env, cwd=cwd)


def test_plan_gpt2_prints_placements_and_step_time(tmp_path):
    out = tmp_path / "plan.json"
    r = _autopar("plan", "gpt2", "--mesh", "1,1,4", "--batch", "8", "--seq", "1024", "--out", str(out))
    assert r.returncode == 0, r.stderr
    assert "autopar plan (auto) for mesh dp=1 pp=1 tp=4 on h100" in r.stdout
    assert "S(0)" in r.stdout                                    # a sharded parameter
    assert re.search(r"Predicted step time [\d.]+ ms", r.stdout)
    assert re.search(r"planned gpt2 \(batch 8, seq 1024\) in [\d.]+ s", r.stdout)
    assert "Traceback" not in r.stderr

    from autopar import Plan
    plan = Plan.from_json(out)
    assert plan.mesh == (1, 1, 4) and plan.predicted_step_time > 0


def test_plan_takes_the_precision(tmp_path):
    out = tmp_path / "plan.json"
    r = _autopar("plan", "gpt2", "--mesh", "1,1,2", "--batch", "8", "--seq", "128", "--precision", "bf16",
                 "--out", str(out))
    assert r.returncode == 0, r.stderr
    assert "precision bf16 compute" in r.stdout

    from autopar import Plan
    assert Plan.from_json(out).precision == "bf16"


@pytest.mark.parametrize("mesh, words", [
    ("1,1,5", ["tp=5", "12 attention heads", "valid tp", "1, 2, 3, 4, 6, 12"]),
    ("1,16,1", ["cannot be split into at least pp=16 microbatches", "multiple of 16"]),
])
def test_plan_bad_mesh_is_one_line_and_exit_2(mesh, words):
    r = _autopar("plan", "gpt2", "--mesh", mesh, "--batch", "8", "--seq", "128")
    assert r.returncode == 2, (r.stdout, r.stderr)
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), r.stderr
    for w in words:
        assert w in lines[0]
    assert "Traceback" not in r.stderr


def test_demo_trains_and_prints_plan_and_losses(tmp_path):
    r = _autopar("demo", "--mesh", "1,1,2", "--steps", "3", "--out", "plan.json", timeout=240, cwd=tmp_path)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "autopar plan (auto) for mesh dp=1 pp=1 tp=2 on cpu" in r.stdout
    assert "Predicted step time" in r.stdout
    steps = re.findall(r"^\s+(\d+)\s+([\d.]+)\s+([\d.]+)", r.stdout, re.M)
    assert [int(s) for s, _, _ in steps] == [1, 2, 3], r.stdout
    m = re.search(r"first loss ([\d.]+), last loss ([\d.]+)", r.stdout)
    assert m, r.stdout
    first, last = float(m.group(1)), float(m.group(2))
    assert first == float(steps[0][1]) and last == float(steps[-1][1])
    assert last < first                                   # three AdamW steps on a fixed batch
    assert (tmp_path / "plan.json").exists()


def test_plan_a_user_module_with_html(tmp_path):
    """`plan path.py:factory` builds the user's model on the meta device; --html writes the view."""
    src = tmp_path / "mymodel.py"
    src.write_text("from autopar.examples.gpt import GPT, GPTConfig\n"
                   "def make():\n"
                   "    return GPT(GPTConfig(vocab_size=1000, block_size=256, n_layer=3, n_head=8, n_embd=256))\n")
    html = tmp_path / "plan.html"
    r = _autopar("plan", f"{src}:make", "--mesh", "1,1,4", "--batch", "8", "--html", str(html))
    assert r.returncode == 0, r.stderr
    assert "predicted MFU" in r.stdout and html.read_text().startswith("<!DOCTYPE html>")
    r = _autopar("plan", f"{src}:missing", "--mesh", "1,1,4")
    assert r.returncode == 2 and "has no function 'missing'" in r.stderr


def test_plan_a_factory_that_builds_on_the_cpu(tmp_path):
    """A factory that picks the CPU itself is planned as if built on meta, its tied weights still tied."""
    src = tmp_path / "cpumodel.py"
    src.write_text("import torch\n"
                   "from autopar.examples.gpt import GPT, GPTConfig\n"
                   "def make():\n"
                   "    with torch.device('cpu'):\n"
                   "        return GPT(GPTConfig(vocab_size=96, block_size=16, n_layer=2, n_head=4, n_embd=32))\n")
    out = tmp_path / "plan.json"
    r = _autopar("plan", f"{src}:make", "--mesh", "1,1,2", "--batch", "4", "--out", str(out))
    assert r.returncode == 0, r.stderr
    assert "Traceback" not in r.stderr

    from autopar import Plan
    [head] = [p for p in Plan.from_json(out).parameters if "lm_head.weight" in (p.fqn, *p.aliases)]
    assert {head.fqn, *head.aliases} == {"lm_head.weight", "transformer.wte.weight"}
