"""The pass driver (autopar.passes.driver): it lints and recompiles after each pass, times it, dumps
the graphs before and after under AUTOPAR_DUMP, refuses a pass that changes its input; and every
graph pass of autopar.passes has the driver's one shape."""
from __future__ import annotations

import importlib
import inspect
import operator
import pkgutil
import re
import typing
from pathlib import Path

import pytest
import torch
from torch.fx import GraphModule

import autopar
import autopar.graph
import autopar.passes
from autopar.passes.driver import fingerprint, rank_prefix, run_passes
from autopar.graph.capture import copy_graph

# the two passes whose input or output is not one graph (see the driver's docstring)
NOT_GRAPH_TO_GRAPH = {"capture_pass", "pipeline_split_pass"}


class _AddThenRelu(torch.nn.Module):
    def forward(self, x, y):
        return torch.relu(x + y)


def _traced() -> GraphModule:
    return torch.fx.symbolic_trace(_AddThenRelu())


def add_to_mul_pass(gm: GraphModule) -> GraphModule:
    """Every ``+`` becomes ``*``; the driver, not this pass, recompiles."""
    out = copy_graph(gm)
    for n in out.graph.nodes:
        if n.op == "call_function" and n.target is operator.add:
            n.target = operator.mul
    return out


def relu_to_neg_pass(gm: GraphModule, *, scale: float) -> GraphModule:
    """``relu(v)`` becomes ``-scale * v``."""
    out = copy_graph(gm)
    for n in out.graph.nodes:
        if n.op == "call_function" and n.target is torch.relu:
            n.target, n.args = torch.mul, (n.args[0], -scale)
    return out


def test_runs_the_passes_in_order_recompiles_and_times_them():
    gm = _traced()
    x, y = torch.full((3,), 2.0), torch.full((3,), 5.0)
    out, seconds = run_passes(gm, [(add_to_mul_pass, {}), (relu_to_neg_pass, {"scale": 0.5})])
    torch.testing.assert_close(out(x, y), -0.5 * x * y)   # the code is the rewritten graph's: recompiled
    torch.testing.assert_close(gm(x, y), torch.relu(x + y))   # the input is untouched
    assert [name for name, _ in seconds] == ["add_to_mul_pass", "relu_to_neg_pass"]
    assert all(isinstance(s, float) and s >= 0 for _, s in seconds)


def test_no_steps_give_the_input_back():
    gm = _traced()
    assert run_passes(gm, []) == (gm, [])


def test_lints_after_each_pass():
    def dangling_pass(gm: GraphModule) -> GraphModule:
        """Uses a node before the node that defines it."""
        out = copy_graph(gm)
        add, relu = [n for n in out.graph.nodes if n.op == "call_function"]
        add.args = (relu, add.args[1])
        return out

    with pytest.raises(RuntimeError, match="used before it has been defined"):
        run_passes(_traced(), [(dangling_pass, {})])


def test_dumps_each_graph_before_and_after(tmp_path, monkeypatch):
    monkeypatch.setenv("AUTOPAR_DUMP", str(tmp_path / "dump"))
    run_passes(_traced(), [(add_to_mul_pass, {}), (relu_to_neg_pass, {"scale": 1.0})], prefix="rank3")
    run_passes(_traced(), [(add_to_mul_pass, {})], prefix="rank4")   # another rank, same directory
    files = sorted(p.name for p in (tmp_path / "dump").iterdir())
    assert files == ["rank3-01-add_to_mul-after.txt", "rank3-01-add_to_mul-before.txt",
                     "rank3-02-relu_to_neg-after.txt", "rank3-02-relu_to_neg-before.txt",
                     "rank4-01-add_to_mul-after.txt", "rank4-01-add_to_mul-before.txt"]
    before = (tmp_path / "dump" / "rank3-01-add_to_mul-before.txt").read_text()
    after = (tmp_path / "dump" / "rank3-01-add_to_mul-after.txt").read_text()
    assert "x + y" in before and "x * y" in after
    assert (tmp_path / "dump" / "rank3-02-relu_to_neg-before.txt").read_text() == after


def test_dump_argument_and_no_prefix(tmp_path, monkeypatch):
    monkeypatch.delenv("AUTOPAR_DUMP", raising=False)
    run_passes(_traced(), [(add_to_mul_pass, {})])
    assert not list(tmp_path.iterdir())   # no AUTOPAR_DUMP, no dump argument: nothing written
    run_passes(_traced(), [(add_to_mul_pass, {})], dump=tmp_path)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["01-add_to_mul-after.txt", "01-add_to_mul-before.txt"]


def test_refuses_a_pass_that_changes_its_input():
    def in_place_pass(gm: GraphModule) -> GraphModule:
        """Edits its input and returns it."""
        for n in gm.graph.nodes:
            if n.op == "call_function" and n.target is torch.relu:
                n.target = torch.sigmoid
        gm.recompile()
        return gm

    def edits_then_copies_pass(gm: GraphModule) -> GraphModule:
        """Edits its input, then returns a copy of it."""
        return copy_graph(in_place_pass(gm))

    def same_graph_pass(gm: GraphModule) -> GraphModule:
        """A new module on the input's own graph object."""
        return GraphModule(gm, gm.graph)

    for bad in (in_place_pass, edits_then_copies_pass, same_graph_pass):
        with pytest.raises(RuntimeError, match=f"{bad.__name__} changed its input graph in place"):
            run_passes(_traced(), [(bad, {})])


def test_refuses_a_pass_that_retypes_its_input():
    """Changing a node's traced dtype is a change too (what retype did to the cached capture)."""
    gm = torch.fx.experimental.proxy_tensor.make_fx(lambda x, y: torch.relu(x + y))(torch.ones(3), torch.ones(3))

    def retype_in_place_pass(gm: GraphModule) -> GraphModule:
        """Gives the input's nodes bf16 values, then returns a copy."""
        for n in gm.graph.nodes:
            if isinstance(n.meta.get("val"), torch.Tensor):
                n.meta["val"] = n.meta["val"].to(torch.bfloat16)
        return copy_graph(gm)

    with pytest.raises(RuntimeError, match="retype_in_place_pass changed its input graph in place"):
        run_passes(gm, [(retype_in_place_pass, {})])


def test_refuses_a_pass_that_returns_no_graph():
    def returns_none_pass(gm: GraphModule) -> GraphModule:
        """Forgets to return."""

    with pytest.raises(TypeError, match="returns_none_pass returned NoneType, not a GraphModule"):
        run_passes(_traced(), [(returns_none_pass, {})])


def test_fingerprint_sees_structure_and_copies_match():
    gm = _traced()
    assert fingerprint(copy_graph(gm)) == fingerprint(gm)
    assert fingerprint(run_passes(gm, [(add_to_mul_pass, {})])[0]) != fingerprint(gm)


# ---- every pass has the one shape ----------------------------------------------------------------

def _passes() -> dict[str, typing.Callable]:
    """Every ``*_pass`` function: the rewrites of autopar.passes and the analysis views of autopar.graph
    (``capture_pass``, ``retype_pass``)."""
    found = {}
    for package in (autopar.passes, autopar.graph):
        found.update(_passes_of(package))
    return found


def _passes_of(package) -> dict[str, typing.Callable]:
    found = {}
    for info in pkgutil.iter_modules(package.__path__):
        module = importlib.import_module(f"{package.__name__}.{info.name}")
        for name, fn in inspect.getmembers(module, inspect.isfunction):
            if name.endswith("_pass") and fn.__module__ == module.__name__:
                found[name] = fn
    return found


def test_every_graph_pass_has_the_one_shape():
    """``name_pass(gm: GraphModule, *, keyword options) -> GraphModule`` with a docstring."""
    passes = _passes()
    assert {"shard_pass", "recompute_pass", "fuse_loss_pass", "cross_entropy_kernel_pass", "precision_pass",
            "retype_pass", "fp8_linear_pass"} | NOT_GRAPH_TO_GRAPH <= set(passes)
    for name, fn in passes.items():
        if name in NOT_GRAPH_TO_GRAPH:
            continue
        params = list(inspect.signature(fn).parameters.values())
        hints = typing.get_type_hints(fn)
        assert params[0].name == "gm" and params[0].kind is inspect.Parameter.POSITIONAL_OR_KEYWORD, name
        assert hints["gm"] is GraphModule and hints["return"] is GraphModule, name
        assert all(p.kind is inspect.Parameter.KEYWORD_ONLY for p in params[1:]), name
        assert (fn.__doc__ or "").strip(), name


def test_no_pass_lives_outside_passes():
    """Graph passes are defined in passes/ (the rewrites) and autopar/graph/ (the analysis views) only."""
    root = Path(__file__).resolve().parents[2]
    files = [p for folder in ("autopar", "cost_model", "kernels", "examples") for p in (root / folder).rglob("*.py")
             if not any(part.is_symlink() for part in p.parents)   # autopar/passes is a link to passes/
             and root / "autopar" / "graph" not in p.parents]
    outside = [f"{path}: {m.group(1)}" for path in files
               for m in re.finditer(r"^def (\w+_pass)\(", path.read_text(), re.M)]
    assert outside == []


def test_the_passes_leave_a_capture_as_it_was():
    """autopar's own passes, run by the driver on a captured GPT, pass its check that the input is
    unchanged, and the capture's fingerprint is the same afterwards."""
    from autopar.examples.gpt import build, example_inputs
    from autopar.planner.recompute import regions_for
    from autopar.graph.capture import capture_pass
    from autopar.passes.fp8 import fp8_linear_pass
    from autopar.passes.fuse_loss import cross_entropy_kernel_pass, fuse_loss_pass
    from autopar.passes.precision import precision_pass
    from autopar.graph.precision import retype_pass
    from autopar.passes.recompute import recompute_pass

    torch.manual_seed(0)
    model = build("tiny")
    cap = capture_pass(model, example_inputs(model.config, 2, 16))
    before = fingerprint(cap.gm)
    floats = {n.name for n in cap.gm.graph.nodes if n.op == "placeholder" and n.meta["val"].is_floating_point()}
    regions = [{n.name for n in r} for r in regions_for(cap, "full")]
    assert regions
    for steps in ([(retype_pass, {"precision": "bf16"}), (fuse_loss_pass, {"chunk": 8})],
                  [(cross_entropy_kernel_pass, {}), (precision_pass, {"precision": "bf16", "floats": floats}),
                   (recompute_pass, {"regions": regions}), (fp8_linear_pass, {"emulate": True})]):
        out, seconds = run_passes(cap.gm, steps)
        assert [name for name, _ in seconds] == [fn.__name__ for fn, _ in steps]
        assert fingerprint(out) != before
    assert fingerprint(cap.gm) == before and "compute_dtype" not in cap.gm.meta


def test_rank_prefix(monkeypatch):
    monkeypatch.setattr(torch.distributed, "is_initialized", lambda: False)
    assert rank_prefix("fp8") == "fp8" and rank_prefix() == ""
    monkeypatch.setattr(torch.distributed, "is_initialized", lambda: True)
    monkeypatch.setattr(torch.distributed, "get_rank", lambda: 3)
    assert rank_prefix("fp8") == "fp8-rank3" and rank_prefix() == "rank3"
