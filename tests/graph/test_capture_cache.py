"""graph.capture_cache: a model of the same structure is traced once; anything that could change the
trace (an attribute, a method, a tied weight, an input shape, a hook) is a new trace."""
from __future__ import annotations

import warnings

import pytest
import torch
import torch.nn.functional as F

import autopar.graph.capture as capture_module
from autopar.graph import capture_cache
from autopar.graph.capture import capture_pass


class Net(torch.nn.Module):
    def __init__(self, width=8, scale=2.0, tie=False):
        super().__init__()
        self.emb = torch.nn.Embedding(16, width)
        self.out = torch.nn.Linear(width, 16, bias=False)
        if tie:
            self.out.weight = self.emb.weight
        self.scale = scale
        self.options = {"act": "gelu", "eps": (1e-5,)}

    def forward(self, idx, tgt):
        h = self.emb(idx) * self.scale
        h = F.gelu(h) if self.options["act"] == "gelu" else F.relu(h)
        return F.cross_entropy(self.out(h).flatten(0, 1), tgt.flatten())


def _inputs(batch=2, seq=4, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 16, (batch, seq), generator=g), torch.randint(0, 16, (batch, seq), generator=g)


@pytest.fixture
def traces(monkeypatch):
    """Counts the torch.export traces capture_pass runs, from an empty cache."""
    capture_cache.clear()
    calls = []
    real = capture_module._export

    def counted(*args, **kwargs):
        calls.append(args[0])
        return real(*args, **kwargs)
    monkeypatch.setattr(capture_module, "_export", counted)
    yield calls
    capture_cache.clear()


def _ops(cap) -> list[str]:
    return [str(n.target) for n in cap.gm.graph.nodes if n.op == "call_function"]


def test_same_structure_is_traced_once(traces):
    a = capture_pass(Net(), _inputs())
    b = capture_pass(Net(), _inputs(seed=1))          # other weights and other input values
    assert len(traces) == 1
    assert b.gm is not a.gm and b.gm.code == a.gm.code and set(b.params) == set(a.params)
    b.gm.graph.erase_node(b.loss.next)                 # the output node: a copy is the caller's own
    c = capture_pass(Net(), _inputs())
    assert len(traces) == 1 and c.gm.code == a.gm.code


@pytest.mark.parametrize("change", ["scale", "option", "width", "tie", "shape", "method", "train", "dtype"])
def test_anything_that_changes_the_trace_traces_again(traces, monkeypatch, change):
    base = capture_pass(Net(), _inputs())
    model, inputs = Net(), _inputs()
    if change == "scale":
        model.scale = 3.0
    elif change == "option":
        model.options["act"] = "relu"
    elif change == "width":
        model = Net(width=4)
    elif change == "tie":
        model = Net(tie=True)
    elif change == "shape":
        inputs = _inputs(seq=5)
    elif change == "method":
        monkeypatch.setattr(Net, "forward", lambda self, idx, tgt: self.out(self.emb(idx)).logsumexp(-1).mean())
    elif change == "train":
        model.eval()
    elif change == "dtype":
        model = model.double()
    again = capture_pass(model, inputs)
    assert len(traces) == 2, change
    if change in ("option", "method"):
        assert _ops(again) != _ops(base)


def test_hooks_and_unknown_attributes_are_not_kept(traces):
    hooked = Net()
    hooked.out.register_forward_hook(lambda m, args, out: out * 2)
    capture_pass(hooked, _inputs())
    capture_pass(hooked, _inputs())
    odd = Net()
    odd.helper = object()                               # nothing says what a trace does with it
    capture_pass(odd, _inputs())
    capture_pass(odd, _inputs())
    assert len(traces) == 4
    assert capture_cache.structure_key(hooked, _inputs()) is None
    assert capture_cache.structure_key(odd, _inputs()) is None


def test_switched_off_by_the_environment(traces, monkeypatch):
    monkeypatch.setenv("AUTOPAR_CAPTURE_CACHE", "0")
    capture_pass(Net(), _inputs())
    capture_pass(Net(), _inputs())
    assert len(traces) == 2


class Warns(Net):
    def forward(self, idx, tgt):
        warnings.warn("autopar-test: traced", UserWarning)
        return super().forward(idx, tgt)


def test_a_kept_trace_issues_its_warnings_again(traces):
    with pytest.warns(UserWarning, match="autopar-test: traced"):
        capture_pass(Warns(), _inputs())
    with pytest.warns(UserWarning, match="autopar-test: traced"):
        capture_pass(Warns(), _inputs())
    assert len(traces) == 1
