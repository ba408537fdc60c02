"""The directions of the flow, checked on the source: capture -> plan (priced by cost_model) ->
passes -> runtime. cost_model/ imports nothing from the planner, the API or the runtime; the
planner nothing from the runtime, the runtime nothing from the planner; passes/ neither, and the
collectives and custom ops that rewritten graphs call sit below all of them. A function-level
import is a dependency too, only a later one."""
from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
TOP = ("autopar.api", "autopar.checkpoint", "autopar.launch", "autopar.compare", "autopar.flops")
# folder (as installed) -> (its source directory, the modules it may not import)
RULES = {
    "autopar.cost_model": (ROOT / "cost_model", ("autopar.planner", "autopar.runtime") + TOP),
    "autopar.planner": (ROOT / "autopar" / "planner", ("autopar.runtime",) + TOP),
    "autopar.runtime": (ROOT / "autopar" / "runtime", ("autopar.planner",) + TOP),
    "autopar.passes": (ROOT / "passes", ("autopar.planner", "autopar.runtime") + TOP),
}
LOW = {"autopar.collectives": ROOT / "autopar" / "collectives.py", "autopar.ops": ROOT / "autopar" / "ops.py",
       "autopar.placement": ROOT / "autopar" / "placement.py"}


def _imported(tree: ast.AST, package: str) -> list[tuple[int, str]]:
    """(line, module) of every import in ``tree``, relative ones resolved against ``package``;
    ``from autopar import x`` also names autopar.x."""
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out += [(node.lineno, a.name) for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            parts = package.split(".")
            base = ".".join(parts[:len(parts) - node.level + 1]) if node.level else ""
            module = ".".join(p for p in (base, node.module) if p)
            out.append((node.lineno, module))
            out += [(node.lineno, f"{module}.{a.name}") for a in node.names]
    return out


def _hits(module: str, forbidden) -> bool:
    return any(module == f or module.startswith(f + ".") for f in forbidden)


def _violations(path: Path, package: str, forbidden) -> list[str]:
    return [f"{path.relative_to(ROOT)}:{line}: {module}"
            for line, module in _imported(ast.parse(path.read_text()), package) if _hits(module, forbidden)]


@pytest.mark.parametrize("package", sorted(RULES))
def test_each_folder_imports_only_downstream(package):
    folder, forbidden = RULES[package]
    files = sorted(folder.glob("*.py"))
    assert files, folder
    bad = [v for f in files for v in _violations(f, package, forbidden)]
    assert not bad, f"{package} must not import {', '.join(forbidden)}:\n" + "\n".join(bad)


@pytest.mark.parametrize("module", sorted(LOW))
def test_collectives_and_ops_sit_below_everything(module):
    forbidden = ("autopar.planner", "autopar.runtime", "autopar.passes", "autopar.cost_model") + TOP
    bad = _violations(LOW[module], "autopar", forbidden)
    assert not bad, "\n".join(bad)


def test_the_check_sees_function_level_and_relative_imports():
    tree = ast.parse("def f():\n    from autopar.planner import solve\n    from autopar import api\n"
                     "    from ..planner.stage_dp import cut_stages\n")
    forbidden = RULES["autopar.cost_model"][1]
    assert [m for _, m in _imported(tree, "autopar.cost_model") if _hits(m, forbidden)] == [
        "autopar.planner", "autopar.planner.solve", "autopar.api", "autopar.planner.stage_dp",
        "autopar.planner.stage_dp.cut_stages"]
