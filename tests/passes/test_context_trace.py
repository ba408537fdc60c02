"""The cp rewrite traces an op once per distinct op and input metadata (the layers of a model repeat
them): every value in its graph must be what tracing that node alone gives, and the planner's check
must refuse what the pass refuses."""
from __future__ import annotations

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.fx.node import map_arg

from autopar.examples.gpt import GPT, GPTConfig, example_inputs
from autopar.graph.capture import capture_pass
from autopar.passes.context_parallel import ContextParallelError, check_context, cp_pass
from autopar.passes.token_mean import token_mean_pass

CFG = GPTConfig(vocab_size=96, block_size=64, n_layer=6, n_head=4, n_embd=32)


def _capture(cfg=CFG):
    with torch.device("meta"):
        model = GPT(cfg)
    return capture_pass(model, example_inputs(cfg, 2, 64, device="meta"), require_loss=True)


def _meta(v):
    return tuple(v.shape), v.stride(), v.dtype, v.storage_offset()


@pytest.mark.parametrize("cp", [2, 4])
def test_every_value_is_its_own_trace(cp):
    out = cp_pass(token_mean_pass(_capture().gm), size=cp, rank=1, group="", seq=64)   # the runtime's order
    ops = [n for n in out.graph.nodes if isinstance(n.target, torch._ops.OpOverload)]
    # the layers' ops share values: without that this test would check nothing
    assert len({id(n.meta["val"]) for n in ops}) < len(ops) / 2
    mode = FakeTensorMode(allow_non_fake_inputs=True)
    with mode:
        for n in ops:
            args = map_arg(n.args, lambda a: a.meta["val"])
            kwargs = map_arg(n.kwargs, lambda a: a.meta["val"])
            fresh = n.target(*args, **kwargs)
            assert isinstance(fresh, torch.Tensor) == isinstance(n.meta["val"], torch.Tensor), n.name
            pairs = zip(fresh, n.meta["val"]) if isinstance(fresh, (list, tuple)) else [(fresh, n.meta["val"])]
            for a, b in pairs:
                assert _meta(a) == _meta(b), n.name


def test_the_check_refuses_what_the_pass_refuses():
    explicit = GPTConfig(vocab_size=96, block_size=64, n_layer=6, n_head=4, n_embd=32, attention="explicit")
    cap = _capture(explicit)
    with pytest.raises(ContextParallelError) as by_pass:
        cp_pass(token_mean_pass(cap.gm), size=2, rank=0, group="", seq=64)
    with pytest.raises(ContextParallelError) as by_check:
        check_context(cap, 2)
    assert str(by_check.value) == str(by_pass.value)
    check_context(_capture(), 2)   # and passes what it runs
