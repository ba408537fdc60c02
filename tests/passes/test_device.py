"""A model built on the meta device trains once its parameters are initialised shard by shard:
the tensors its forward creates (the position ids) are made on the rank's device, not on meta."""
from __future__ import annotations

import pytest
import torch

import autopar
import pool
from autopar.examples.gpt import GPT, example_inputs
from autopar.graph.capture import capture_pass
from autopar.passes.device import device_pass
from parity import BATCH, SEQ, TINY, make_model, reference


class InitFromWeights(GPT):
    """A GPT built on meta whose ``init_parameter`` fills each shard from known weights."""

    def __init__(self, cfg, weights):
        super().__init__(cfg)
        self.weights = weights

    def init_parameter(self, fqn, tensor):
        tensor.copy_(self.weights[fqn])


def _meta_model_trains(rank, world):
    weights = {k: v.detach().clone() for k, v in make_model().named_parameters()}
    with torch.device("meta"):
        model = InitFromWeights(TINY, weights)
    idx, tgt = example_inputs(TINY, BATCH, SEQ)
    pm = autopar.parallelize(model, (1, 1, 1), (idx, tgt), compile=False)
    return pm.train_step(idx, tgt).item()


META = pool.job(1, _meta_model_trains, timeout=300)


def test_meta_model_trains_like_the_real_one():
    loss, _, _ = reference(TINY)
    assert META.result()[0] == pytest.approx(loss, rel=1e-6)


def test_factory_ops_move_and_explicit_moves_stay():
    with torch.device("meta"):
        model = GPT(TINY)
    cap = capture_pass(model, example_inputs(TINY, BATCH, SEQ, device="meta"), require_loss=True)
    made = [n for n in cap.gm.graph.nodes if n.op == "call_function" and "device" in n.kwargs]
    assert made and all(torch.device(n.kwargs["device"]) == torch.device("meta") for n in made)
    moved = device_pass(cap.gm, device=torch.device("cpu"))
    assert all(torch.device(n.kwargs["device"]) == torch.device("cpu")
               for n in moved.graph.nodes if n.op == "call_function" and "device" in n.kwargs)
    assert all(torch.device(n.kwargs["device"]) == torch.device("meta") for n in made)   # the capture is kept
