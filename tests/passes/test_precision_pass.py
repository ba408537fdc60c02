"""The planner's retyping (autopar.passes.precision.retyped) works on a copy: the capture, which
the planner caches and shares across mesh candidates, keeps its traced dtypes, so what a plan at
one precision prices does not depend on what was planned before it from the same capture."""
from __future__ import annotations

import torch

from autopar.examples.gpt import build, example_inputs
from autopar.graph.capture import capture_pass
from autopar.passes.driver import fingerprint
from autopar.graph.precision import retyped
from autopar.graph.precision import working_copy_ratio


def _dtypes(cap, op: str) -> set[torch.dtype]:
    return {n.meta["val"].dtype for n in cap.gm.graph.nodes
            if n.op == op and isinstance(n.meta.get("val"), torch.Tensor) and n.meta["val"].is_floating_point()}


def test_retyped_leaves_the_capture_as_traced():
    torch.manual_seed(0)
    model = build("tiny")
    cap = capture_pass(model, example_inputs(model.config, 2, 16))
    before = fingerprint(cap.gm)
    bf16 = retyped(cap, "bf16")
    assert bf16 is not cap and bf16.gm is not cap.gm
    assert torch.bfloat16 in _dtypes(bf16, "call_function")
    assert _dtypes(bf16, "placeholder") == {torch.float32}   # the stored weights stay fp32
    assert working_copy_ratio(bf16) == 0.5
    assert [n.name for n in bf16.inputs] == [n.name for n in cap.inputs] and bf16.params.keys() == cap.params.keys()
    assert all(n.graph is bf16.gm.graph for n in [*bf16.params.values(), *bf16.inputs, *bf16.buffers.values()])
    # the capture itself: as traced, and an fp32 plan from it after the bf16 one sees fp32 values
    assert fingerprint(cap.gm) == before and "compute_dtype" not in cap.gm.meta
    fp32 = retyped(cap, "fp32")
    assert fp32 is cap and _dtypes(fp32, "call_function") == {torch.float32} and working_copy_ratio(fp32) == 0.0


def test_retyping_does_not_depend_on_what_was_retyped_before():
    """bf16, then fp16, then bf16 again from one capture: each as from a fresh capture."""
    torch.manual_seed(0)
    model = build("tiny")
    inputs = example_inputs(model.config, 2, 16)
    cap = capture_pass(model, inputs)
    first = fingerprint(retyped(cap, "bf16").gm)
    fp16 = retyped(cap, "fp16")
    assert torch.float16 in _dtypes(fp16, "call_function") and torch.bfloat16 not in _dtypes(fp16, "call_function")
    assert fingerprint(retyped(cap, "bf16").gm) == first == fingerprint(retyped(capture_pass(model, inputs), "bf16").gm)
