"""No folder of the repository shadows an installed package. ``python -m pytest``, ``python -c``
and ``python -m autopar`` run from the repository root put the root first on sys.path; a top-level
folder that is a regular package (has ``__init__.py``) would then win over an installed package of
its name, as ``kernels/`` once hid Hugging Face's ``kernels`` from transformers. The source folders
are autopar's subpackages through the links in ``autopar/`` and have no ``__init__.py``."""
from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
TOP = sorted(d.name for d in ROOT.iterdir() if d.is_dir() and not d.name.startswith((".", "_"))
             and d.name.isidentifier() and d.name != "autopar")


def _run(code: str, cwd: Path, pythonpath: str | None = None) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    if pythonpath:
        env["PYTHONPATH"] = pythonpath
    return subprocess.run([sys.executable, "-c", code], cwd=cwd, env=env, capture_output=True, text=True,
                          timeout=120)


def test_every_top_level_folder_yields_to_an_installed_package_of_its_name(tmp_path):
    assert {"passes", "cost_model", "kernels", "examples", "tests"} <= set(TOP)
    for name in TOP:
        (tmp_path / name).mkdir()
        (tmp_path / name / "__init__.py").write_text("INSTALLED = True\n")
    code = "; ".join(f"import {n}; assert getattr({n}, 'INSTALLED', False), {n}.__path__" for n in TOP)
    out = _run(code + "; print('ok')", ROOT, str(tmp_path))
    assert out.returncode == 0 and "ok" in out.stdout, out.stderr[-2000:]


def test_subpackages_import_from_anywhere(tmp_path):
    out = _run("import autopar.kernels.adamw, autopar.cost_model.devices, autopar.graph.capture, "
               "autopar.examples.gpt; from autopar.examples.train_gpt import DATA_DIR; "
               "assert any(DATA_DIR.iterdir()); print('ok')", tmp_path)
    assert out.returncode == 0 and "ok" in out.stdout, out.stderr[-2000:]


@pytest.mark.skipif(importlib.util.find_spec("transformers") is None, reason="transformers not installed")
def test_hugging_face_models_build_from_the_repository_root():
    out = _run("import transformers\n"
               "from transformers import LlamaConfig, LlamaForCausalLM\n"
               "LlamaForCausalLM(LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=1,\n"
               "    num_attention_heads=4, num_key_value_heads=2, vocab_size=64))\n"
               "import autopar.hf\nprint('ok')", ROOT)
    assert out.returncode == 0 and "ok" in out.stdout, out.stderr[-2000:]
