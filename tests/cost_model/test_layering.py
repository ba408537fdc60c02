"""cost_model/ prices; it imports nothing from the planner, the API or the runtime, at any level
(a function-level import is a dependency too, only a later one)."""
from __future__ import annotations

import ast
from pathlib import Path

import pytest

COST_MODEL = Path(__file__).resolve().parents[2] / "cost_model"
FORBIDDEN = ("autopar.planner", "autopar.api", "autopar.pipeline", "autopar.parallel_model", "autopar.mesh_search",
             "autopar.memory_plan", "autopar.stage_dp", "autopar.megatron", "autopar.checkpoint")


def _imported(tree: ast.AST) -> list[tuple[int, str]]:
    """(line, module) of every import in ``tree``, relative ones resolved; ``from autopar import x``
    also names autopar.x."""
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out += [(node.lineno, a.name) for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            # cost_model/ installs as autopar.cost_model, so ``..`` is autopar
            base = {0: "", 1: "autopar.cost_model", 2: "autopar"}.get(node.level, "")
            module = ".".join(p for p in (base, node.module) if p)
            out.append((node.lineno, module))
            out += [(node.lineno, f"{module}.{a.name}") for a in node.names]
    return out


def _forbidden(module: str) -> bool:
    return any(module == f or module.startswith(f + ".") for f in FORBIDDEN)


@pytest.mark.parametrize("path", sorted(COST_MODEL.glob("*.py")), ids=lambda p: p.name)
def test_cost_model_imports_no_planner_api_or_runtime(path):
    bad = [f"{path.name}:{line}: {module}" for line, module in _imported(ast.parse(path.read_text()))
           if _forbidden(module)]
    assert not bad, "cost_model/ must not import the planner, the API or the runtime:\n" + "\n".join(bad)


def test_the_check_sees_function_level_imports():
    tree = ast.parse("def f():\n    from autopar.planner import solve\n    from autopar import api\n"
                     "    from ..stage_dp import cut_stages\n")
    assert [m for _, m in _imported(tree) if _forbidden(m)] == ["autopar.planner", "autopar.planner.solve",
                                                                 "autopar.api", "autopar.stage_dp",
                                                                 "autopar.stage_dp.cut_stages"]
