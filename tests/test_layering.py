"""The directions of the flow, checked on the source.

graph analysis (``autopar.graph``) sits under the passes, the cost model and the planner; the
cost model imports nothing from the planner, the plans, the passes, the runtime, the examples or
the API; the planner nothing from the runtime, the runtime nothing from the planner or the cost
model, the passes neither; ``plans.py`` (the Plan, data) nothing from the planner, the runtime, the
passes or the graph analysis; and the collectives and custom ops that rewritten graphs call sit
below all of them. No module imports itself back, however far round. A function-level import is a
dependency too, only a later one."""
from __future__ import annotations

import ast
from pathlib import Path

import networkx as nx
import pytest

ROOT = Path(__file__).resolve().parents[1]
TOP = ("autopar.api", "autopar.checkpoint", "autopar.launch", "autopar.compare", "autopar.flops", "autopar.__main__")
# the source folders, by the package they install as
FOLDERS = {"autopar": ROOT / "autopar", "autopar.passes": ROOT / "passes", "autopar.cost_model": ROOT / "cost_model",
           "autopar.kernels": ROOT / "kernels", "autopar.examples": ROOT / "examples"}
# package (or module) -> the modules it may not import
RULES = {
    "autopar.graph": ("autopar.passes", "autopar.cost_model", "autopar.planner", "autopar.runtime", "autopar.plans",
                      "autopar.examples") + TOP,
    "autopar.cost_model": ("autopar.planner", "autopar.runtime", "autopar.passes", "autopar.plans",
                           "autopar.examples") + TOP,
    "autopar.planner": ("autopar.runtime",) + TOP,
    "autopar.runtime": ("autopar.planner", "autopar.cost_model") + TOP,
    "autopar.passes": ("autopar.planner", "autopar.runtime", "autopar.cost_model") + TOP,
    "autopar.plans": ("autopar.planner", "autopar.runtime", "autopar.passes", "autopar.graph") + TOP,
}
LOW = ("autopar.collectives", "autopar.ops", "autopar.placement", "autopar.fp8")


def _modules() -> dict[str, Path]:
    """Every module of autopar by its installed name (the links in autopar/ not walked twice)."""
    out = {}
    for package, folder in FOLDERS.items():
        for path in sorted(folder.rglob("*.py")):
            if any(p.is_symlink() for p in path.parents):
                continue
            name = ".".join([package, *path.relative_to(folder).with_suffix("").parts]).removesuffix(".__init__")
            out[name] = path
    return out


MODULES = _modules()


def _imported(tree: ast.AST, module: str, is_package: bool = False) -> list[tuple[int, str]]:
    """(line, module) of every import in ``tree``, relative ones resolved against ``module``;
    ``from autopar import x`` also names autopar.x."""
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out += [(node.lineno, a.name) for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            parts = module.split(".") + ([""] if is_package else [])
            base = ".".join(parts[:len(parts) - node.level]) if node.level else ""
            target = ".".join(p for p in (base, node.module) if p)
            out.append((node.lineno, target))
            out += [(node.lineno, f"{target}.{a.name}") for a in node.names]
    return out


def _hits(module: str, forbidden) -> bool:
    return any(module == f or module.startswith(f + ".") for f in forbidden)


@pytest.mark.parametrize("package", sorted(RULES) + list(LOW))
def test_each_package_imports_only_downstream(package):
    forbidden = RULES.get(package, ("autopar.planner", "autopar.runtime", "autopar.passes", "autopar.cost_model",
                                    "autopar.graph", "autopar.plans") + TOP)
    mine = {m: p for m, p in MODULES.items() if m == package or m.startswith(package + ".")}
    assert mine, package
    bad = [f"{path.relative_to(ROOT)}:{line}: {imported}" for module, path in mine.items()
           for line, imported in _imported(ast.parse(path.read_text()), module, path.name == "__init__.py")
           if _hits(imported, forbidden)]
    assert not bad, f"{package} must not import {', '.join(forbidden)}:\n" + "\n".join(bad)


def _import_graph() -> nx.DiGraph:
    g = nx.DiGraph()
    for module, path in MODULES.items():
        for _, imported in _imported(ast.parse(path.read_text()), module, path.name == "__init__.py"):
            # the longest module name the import names: ``from autopar import x`` is autopar.x
            target = max((m for m in (imported, imported.rpartition(".")[0]) if m in MODULES and m != module),
                         key=len, default=None)
            if target is not None and target != "autopar":
                g.add_edge(module, target)
    return g


def test_no_module_imports_itself_back():
    g = _import_graph()
    assert g.number_of_edges() > 200, "the import graph is nearly empty: the walk is broken"
    cycles = list(nx.simple_cycles(g, length_bound=8))
    assert not cycles, "import circles:\n" + "\n".join(" -> ".join(c + c[:1]) for c in cycles[:10])


def test_the_checks_see_function_level_relative_and_package_imports():
    tree = ast.parse("def f():\n    from autopar.planner import solve\n    from autopar import api\n"
                     "    from ..planner.stage_dp import cut_stages\n")
    assert [m for _, m in _imported(tree, "autopar.cost_model.memory") if _hits(m, RULES["autopar.cost_model"])] == [
        "autopar.planner", "autopar.planner.solve", "autopar.api", "autopar.planner.stage_dp",
        "autopar.planner.stage_dp.cut_stages"]
    tree = ast.parse("from .rules import shape\n")
    assert "autopar.graph.rules" in [m for _, m in _imported(tree, "autopar.graph", is_package=True)]


def test_the_cost_models_records_import_nothing_of_autopars():
    """``cost_model/terms.py`` (StepTerms, MemoryPlan and their two sums) is what ``plans.py`` reads of the
    cost model besides the schedules: it imports no module of autopar, so the Plan's data can never
    pull a price back in."""
    path = MODULES["autopar.cost_model.terms"]
    imported = [m for _, m in _imported(ast.parse(path.read_text()), "autopar.cost_model.terms")]
    assert not [m for m in imported if _hits(m, ("autopar",))]
    plans = MODULES["autopar.plans"]
    read = [m for _, m in _imported(ast.parse(plans.read_text()), "autopar.plans") if _hits(m, ("autopar.cost_model",))]
    assert read and all(_hits(m, ("autopar.cost_model.terms", "autopar.cost_model.stages")) for m in read)
