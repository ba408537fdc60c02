"""Tracing 2 and 3 layers and repeating gives the graph a full trace gives, or is refused."""
from __future__ import annotations

import torch

from autopar.examples.gpt import build, example_inputs
from autopar.graph.block_capture import _signature, canonical_names, capture_repeated, repeated_layers
from autopar.graph.capture import _export, capture_pass


def _inputs(model, batch=2, seq=8):
    return example_inputs(model.config, batch, seq)


def test_repeated_graph_equals_the_full_trace():
    model = build("tiny", n_layer=7)
    x = _inputs(model)
    fast = capture_repeated(model, x, _export)
    slow = canonical_names(_export(model, x))
    assert fast is not None
    assert _signature(fast.gm.graph) == _signature(slow.gm.graph)
    assert list(fast.params) == list(slow.params) and list(fast.buffers) == list(slow.buffers)
    assert [i.name for i in fast.inputs] == [i.name for i in slow.inputs] and fast.loss.name == slow.loss.name
    assert fast.aliases == slow.aliases
    # the repeated graph runs: same loss as the model itself
    values = {**dict(model.named_parameters()), **dict(model.named_buffers())}
    args = [x[fast.inputs.index(n)] if n.meta["kind"] == "input" else values[n.meta["fqn"]]
            for n in fast.gm.graph.nodes if n.op == "placeholder"]
    with torch.no_grad():
        torch.testing.assert_close(fast.gm(*args)[0], model(*x), rtol=0, atol=0)


def test_capture_pass_uses_it_for_long_stacks():
    model = build("tiny", n_layer=8)
    assert repeated_layers(model) == ("transformer.h", 8)
    assert repeated_layers(build("tiny", n_layer=2)) is None   # too short to pay
    cap = capture_pass(model, _inputs(model))
    assert sum(1 for f in cap.params if f.startswith("transformer.h.7.")) == 12


class _Scaled(torch.nn.Module):
    """Layer i's output is scaled by 1/(i+1): the forward depends on the layer index."""

    def __init__(self, n=6, width=8):
        super().__init__()
        self.layers = torch.nn.ModuleList(torch.nn.Linear(width, width) for _ in range(n))

    def forward(self, x):
        for i, layer in enumerate(self.layers):
            x = layer(x) * (1.0 / (i + 1))   # layers 0 and 1 look alike; layer 2 differs
        return x.sum()


def test_index_dependent_forward_is_traced_whole():
    model = _Scaled()
    x = (torch.randn(3, 8),)
    assert repeated_layers(model) == ("layers", 6)
    assert capture_repeated(model, x, _export) is None
    cap = capture_pass(model, x)
    assert len(cap.params) == 12
    assert _signature(cap.gm.graph) == _signature(canonical_names(_export(model, x)).gm.graph)


def test_unlike_layers_are_not_repeated():
    model = _Scaled()
    model.layers[3] = torch.nn.Linear(8, 8, bias=False)
    assert repeated_layers(model) is None
