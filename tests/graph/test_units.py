"""Pipeline stages laid back on a capture (``graph.units``): each layer's nodes land in the stage
that lists the layer, also where a stage lists a module that contains the layers (a Hugging Face
``model`` whose forward has ops of its own: the rotary table, the mask)."""
from __future__ import annotations

import pytest
import torch

import autopar
from autopar.graph.capture import capture_pass
from autopar.graph.units import layer_units, override_bounds, stage_of_nodes

transformers = pytest.importorskip("transformers")


@pytest.fixture(scope="module")
def llama():
    from autopar.hf import causal_lm_loss
    cfg = transformers.LlamaConfig(vocab_size=1024, hidden_size=256, intermediate_size=512, num_hidden_layers=8,
                                   num_attention_heads=8, num_key_value_heads=4, attn_implementation="sdpa")
    with torch.device("meta"):
        model = causal_lm_loss(transformers.LlamaForCausalLM(cfg))
    ids = torch.zeros(8, 32, dtype=torch.long, device="meta")
    return model, (ids, ids)


@pytest.mark.parametrize("pp", [2, 4])
def test_each_layer_lands_in_the_stage_that_lists_it(llama, pp):
    model, inputs = llama
    plan = autopar.plan(model, (1, pp, 1), inputs, device="h100", microbatches=pp)
    assert "lm.model" in plan.stages[0].modules   # the outer model's own ops open the pipeline
    cap = capture_pass(model, inputs)
    units = layer_units(cap)
    where = stage_of_nodes(cap, plan)
    layers = [u for u in units if ".layers." in u.name]
    assert len(layers) == 8
    for u in layers:
        listed = [s for s, stage in enumerate(plan.stages) if u.name in stage.modules]
        assert len(listed) == 1, u.name
        assert {where[n.name] for n in u.nodes} == set(listed), u.name
    # every stage holds layers, 8 / pp of them
    assert [sum(u.name in stage.modules for u in layers) for stage in plan.stages] == [8 // pp] * pp
    bounds = override_bounds([s.modules for s in plan.stages], units, pp)
    assert [b - a for a, b in bounds][1:-1] == [8 // pp] * (pp - 2)
