"""The command line as a user runs it: `python -m autopar plan ...` and `python -m autopar demo`."""
from __future__ import annotations

import re

import pytest

from cli import background_autopar, main as _in_process

MYMODEL = ("from autopar.examples.gpt import GPT, GPTConfig\n"
           "def make():\n"
           "    return GPT(GPTConfig(vocab_size=1000, block_size=256, n_layer=3, n_head=8, n_embd=256))\n")
CPUMODEL = ("import torch\n"
            "from autopar.examples.gpt import GPT, GPTConfig\n"
            "def make():\n"
            "    with torch.device('cpu'):\n"
            "        return GPT(GPTConfig(vocab_size=96, block_size=16, n_layer=2, n_head=4, n_embd=32))\n")
BAD_MESHES = {"1,1,5": ["tp=5", "12 attention heads", "valid tp", "1, 2, 3, 4, 6, 12"],
              "1,16,1": ["cannot be split into at least pp=16 microbatches", "multiple of 16"]}


def _commands(d):
    """The commands of this file run in this process, by name: their arguments; ``d`` is a directory."""
    return {
        "precision": ["plan", "gpt2", "--mesh", "1,1,2", "--batch", "8", "--seq", "128", "--precision", "bf16",
                      "--out", str(d / "bf16.json")],
        **{f"bad-{mesh}": ["plan", "gpt2", "--mesh", mesh, "--batch", "8", "--seq", "128"]
           for mesh in BAD_MESHES if f"bad-{mesh}" not in SUBPROCESS},
        "html": ["plan", f"{d / 'mymodel.py'}:make", "--mesh", "1,1,4", "--batch", "8", "--html", str(d / "plan.html")],
        "missing": ["plan", f"{d / 'mymodel.py'}:missing", "--mesh", "1,1,4"],
        "cpu": ["plan", f"{d / 'cpumodel.py'}:make", "--mesh", "1,1,2", "--batch", "4", "--out", str(d / "cpu.json")],
        "ranking": ["plan", "gpt2", "--mesh", "auto", "--gpus", "4", "--batch", "8", "--seq", "128", "--zero", "3",
                    "--recompute", "auto", "--memory-budget", "80GiB"],
        "no-fit": ["plan", "gpt2", "--mesh", "2,1,1", "--batch", "8", "--seq", "128", "--zero", "auto",
                   "--recompute", "auto", "--memory-budget", "1MiB"],
    }


# run as a user runs them, each its own Python start-up, beside the session's tests (tests/cli.py); the
# others through autopar.__main__.main in this process (the same code, without a new interpreter's
# seconds of imports)
SUBPROCESS = {
    "demo": background_autopar("demo", "--mesh", "1,1,2", "--steps", "3", "--out", "plan.json", timeout=600),
    "gpt2": background_autopar("plan", "gpt2", "--mesh", "1,1,4", "--batch", "8", "--seq", "1024",
                               "--out", "gpt2.json"),
    "bad-1,1,5": background_autopar("plan", "gpt2", "--mesh", "1,1,5", "--batch", "8", "--seq", "128"),
}


@pytest.fixture(scope="module")
def cli(tmp_path_factory):
    """``cli(name)`` waits for a command of ``SUBPROCESS`` or runs one in this process; ``cli.dir``
    holds the files of those run here, ``cli.where(name)`` the directory a subprocess ran in."""
    d = tmp_path_factory.mktemp("cli")
    (d / "mymodel.py").write_text(MYMODEL)
    (d / "cpumodel.py").write_text(CPUMODEL)
    commands = _commands(d)

    def result(name):
        return SUBPROCESS[name].result()[0] if name in SUBPROCESS else _in_process(*commands[name])

    result.dir = d
    result.where = lambda name: SUBPROCESS[name].result()[2]
    return result


def test_plan_gpt2_prints_placements_and_step_time(cli):
    r = cli("gpt2")
    out = cli.where("gpt2") / "gpt2.json"
    assert r.returncode == 0, r.stderr
    assert "autopar plan (auto) for mesh dp=1 pp=1 tp=4 on h100" in r.stdout
    assert "S(0)" in r.stdout                                    # a sharded parameter
    assert re.search(r"Predicted step time [\d.]+ ms", r.stdout)
    assert re.search(r"planned gpt2 \(batch 8, seq 1024\) in [\d.]+ s", r.stdout)
    assert "Traceback" not in r.stderr

    from autopar import Plan
    plan = Plan.from_json(out)
    assert plan.mesh == (1, 1, 4) and plan.predicted_step_time > 0


def test_plan_takes_the_precision(cli):
    out = cli.dir / "bf16.json"
    r = cli("precision")
    assert r.returncode == 0, r.stderr
    assert "precision bf16 compute" in r.stdout

    from autopar import Plan
    assert Plan.from_json(out).precision == "bf16"


@pytest.mark.parametrize("mesh, words", list(BAD_MESHES.items()))
def test_plan_bad_mesh_is_one_line_and_exit_2(cli, mesh, words):
    r = cli(f"bad-{mesh}")
    assert r.returncode == 2, (r.stdout, r.stderr)
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), r.stderr
    for w in words:
        assert w in lines[0]
    assert "Traceback" not in r.stderr


def test_demo_trains_and_prints_plan_and_losses(cli):
    r = cli("demo")
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
    assert (cli.where("demo") / "plan.json").exists()


def test_plan_a_user_module_with_html(cli):
    """`plan path.py:factory` builds the user's model on the meta device; --html writes the view."""
    html = cli.dir / "plan.html"
    r = cli("html")
    assert r.returncode == 0, r.stderr
    assert "predicted MFU" in r.stdout and html.read_text().startswith("<!DOCTYPE html>")
    r = cli("missing")
    assert r.returncode == 2 and "has no function 'missing'" in r.stderr


def test_plan_a_factory_that_builds_on_the_cpu(cli):
    """A factory that picks the CPU itself is planned as if built on meta, its tied weights still tied."""
    out = cli.dir / "cpu.json"
    r = cli("cpu")
    assert r.returncode == 0, r.stderr
    assert "Traceback" not in r.stderr

    from autopar import Plan
    [head] = [p for p in Plan.from_json(out).parameters if "lm_head.weight" in (p.fqn, *p.aliases)]
    assert {head.fqn, *head.aliases} == {"lm_head.weight", "transformer.wte.weight"}


def test_plan_ranks_meshes_with_their_choices_and_says_why(cli):
    r = cli("ranking")
    assert r.returncode == 0, r.stderr
    header = next(line for line in r.stdout.splitlines() if "mesh (dp,pp,tp)" in line)
    assert header.split()[-13:] == ["step", "ms", "compute", "tp", "cp", "pp", "dp", "bubble", "update", "host",
                                    "peak", "GiB", "fits"]
    assert re.search(r"winner \(\d+, \d+, \d+\): the fastest that fits", r.stdout)
    assert "keep_gathered chosen automatically" in r.stdout   # zero=3 with dp > 1 on the winner


def test_plan_that_fits_nowhere_says_the_smallest_peak(cli):
    r = cli("no-fit")
    assert r.returncode == 2 and "Traceback" not in r.stderr
    assert re.search(r"error: no plan fits the memory budget \(0\.00 GiB\) after choosing zero, recompute: the "
                     r"smallest peak found is [\d.]+ GiB per device, with mesh \(dp, pp, tp\) = \(2, 1, 1\), zero=\d",
                     r.stderr), r.stderr
