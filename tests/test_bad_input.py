"""Bad input fails early with a sentence a user can act on."""
from __future__ import annotations

import json
from dataclasses import replace

import pytest
import torch

import autopar
from autopar.examples.gpt import GPT, example_inputs
import pool
from parity import BATCH, SEQ, TINY, make_model


def _plan(mesh, cfg=TINY, batch=BATCH, **kw):
    with torch.device("meta"):   # .to("meta") would untie the embedding and the head
        model = GPT(cfg)
    return autopar.plan(model, mesh, example_inputs(cfg, batch, SEQ, device="meta"), **kw)


def test_tp_not_dividing_heads_lists_valid_tp():
    with pytest.raises(autopar.PlanError, match=r"tp=3 does not divide 4 attention heads.*valid tp for this model: 1, 2, 4"):
        _plan((1, 1, 3))


def test_dp_not_dividing_batch():
    with pytest.raises(ValueError, match=r"batch size 4 is not divisible by dp=3"):
        _plan((3, 1, 1))


def test_bad_mesh_shapes():
    with pytest.raises(ValueError, match="positive integer"):
        autopar.Mesh(0, 1, 1)
    with pytest.raises(ValueError, match=r"expected three integers"):
        autopar.Mesh.parse("2,x,1")
    with pytest.raises(ValueError, match=r"schedule='GPipe2'"):
        _plan((1, 2, 1), schedule="GPipe2")


def test_unknown_plan_name():
    with pytest.raises(ValueError, match="expected 'auto', 'megatron'"):
        _plan((1, 1, 2), plan="fastest")


def test_memory_budget_too_small_says_minimum():
    with pytest.raises(ValueError, match="needs at least"):
        _plan((1, 1, 2), memory_budget="1KiB")
    with pytest.raises(ValueError, match="expected a size"):
        _plan((1, 1, 2), memory_budget="lots")


def test_plan_json_round_trip_and_reuse(tmp_path):
    plan = _plan((1, 1, 2), plan="megatron")
    path = tmp_path / "plan.json"
    plan.to_json(path)
    again = autopar.Plan.from_json(path)
    assert again == plan
    assert _plan((1, 1, 2), plan=str(path)) == plan
    assert "S(0)i3" in plan.summary() and "Predicted step time" in plan.summary()


def test_malformed_plan_names_field(tmp_path):
    data = json.loads(_plan((1, 1, 2), plan="megatron").to_json())
    broken = dict(data, zero="one")
    with pytest.raises(autopar.PlanFormatError, match=r"plan.zero: expected int"):
        autopar.Plan.from_json(json.dumps(broken))
    del broken["zero"]
    broken["zero"] = 0
    broken.pop("nodes")
    with pytest.raises(autopar.PlanFormatError, match=r"plan.nodes is missing"):
        autopar.Plan.from_json(json.dumps(broken))
    with pytest.raises(autopar.PlanFormatError, match="not valid JSON"):
        autopar.Plan.from_json("{nope")


def test_plan_that_does_not_fit_the_model(tmp_path):
    data = json.loads(_plan((1, 1, 2), plan="megatron").to_json())
    wrong = json.loads(json.dumps(data))
    fc = next(p for p in wrong["parameters"] if p["fqn"] == "transformer.h.1.mlp.c_fc.weight")
    fc["shape"] = [7, 7]
    with pytest.raises(autopar.PlanFormatError, match=r"transformer.h.1.mlp.c_fc.weight.*shape"):
        _plan((1, 1, 2), plan=autopar.Plan.from_json(json.dumps(wrong)))
    wrong = json.loads(json.dumps(data))
    node = next(n for n in wrong["nodes"] if n["module"] == "transformer.h.1.mlp.c_fc" and n["op"].startswith("aten.linear"))
    node["output"] = "S(0)"
    with pytest.raises(autopar.PlanFormatError, match=r"transformer.h.1.mlp.c_fc.*valid"):
        _plan((1, 1, 2), plan=autopar.Plan.from_json(json.dumps(wrong)))
    with pytest.raises(autopar.PlanError, match="does not match the mesh"):
        _plan((2, 1, 1), plan=autopar.Plan.from_json(json.dumps(data)))


def _wrong_world(rank, world):
    idx, tgt = example_inputs(TINY, BATCH, SEQ)
    autopar.parallelize(make_model(), (1, 1, 4), (idx, tgt), compile=False)


WRONG_WORLD = pool.job(2, _wrong_world, timeout=120)


def test_mesh_not_matching_world_size():
    with pytest.raises(pool.JobError, match=r"mesh \(dp=1, pp=1, tp=4\) needs 4 ranks but the world has 2"):
        WRONG_WORLD.result()


def _padded_vocab(rank, world, cfg):
    from parity import parallel_run
    return parallel_run(rank, world, (1, 1, 2), dict(plan="megatron", sequence_parallel=True, compile=False), cfg=cfg)


PADDED_VOCAB = pool.job(2, _padded_vocab, replace(TINY, vocab_size=95), timeout=300)


def test_vocab_not_divisible_by_tp_is_padded():
    """GPT-2's 50257 does not divide by tp: the vocabulary is padded and the loss unchanged."""
    from parity import reference
    ref_loss, ref_grads, _ = reference(PADDED_VOCAB.args[0])
    for loss, grads, _, plan in PADDED_VOCAB.result():
        assert loss == pytest.approx(ref_loss, rel=1e-5)
        for name, g in ref_grads.items():
            torch.testing.assert_close(grads[name], g, rtol=1e-5, atol=1e-6)
        wte = next(p for p in json.loads(plan)["parameters"] if p["fqn"] == "transformer.wte.weight")
        assert wte["shape"] == [95, 32] and wte["local_shape"] == [48, 32]


class _Echo(torch.nn.Module):
    """A model whose forward takes one input (it predicts each token itself): a lone tensor is its
    whole example batch."""

    def __init__(self, gpt):
        super().__init__()
        self.gpt = gpt

    def forward(self, idx):
        return self.gpt(idx, idx)


def _decisions(plan) -> dict:
    """A plan's JSON without the solver's wall time, which differs between two plannings."""
    data = json.loads(plan.to_json())
    data.pop("solve_seconds")
    return data


def test_example_inputs_of_the_wrong_count_say_what_forward_takes():
    """example_inputs=idx for forward(idx, targets) (or a third input) names forward's inputs and the fix."""
    idx, tgt = example_inputs(TINY, BATCH, SEQ, device="meta")
    with torch.device("meta"):
        model = GPT(TINY)
    fix = "pass example_inputs=(idx, targets)"
    with pytest.raises(ValueError) as lone:
        autopar.plan(model, (1, 1, 2), idx)
    assert f"GPT.forward(idx, targets) takes 2 inputs but example_inputs gives 1: {fix}" in str(lone.value)
    with pytest.raises(ValueError) as three:
        autopar.plan(model, (1, 1, 2), (idx, tgt, tgt))
    assert f"takes 2 inputs but example_inputs gives 3: {fix}" in str(three.value)
    with pytest.raises(TypeError) as named:
        autopar.plan(model, (1, 1, 2), {"idx": idx, "targets": tgt})
    assert "pass the forward's inputs as a tuple" in str(named.value)


def test_a_lone_tensor_or_a_list_is_taken_as_the_inputs_tuple():
    idx, tgt = example_inputs(TINY, BATCH, SEQ, device="meta")
    with torch.device("meta"):
        echo, model = _Echo(GPT(TINY)), GPT(TINY)
    lone = autopar.plan(echo, (2, 1, 1), idx)
    assert lone.input_shapes == ((BATCH // 2, SEQ),)
    assert _decisions(lone) == _decisions(autopar.plan(echo, (2, 1, 1), (idx,)))
    listed = autopar.plan(model, (1, 1, 2), [idx, tgt])
    assert _decisions(listed) == _decisions(autopar.plan(model, (1, 1, 2), (idx, tgt)))


def _lone_tensor(rank, world):
    """parallelize with example_inputs=idx: every rank gets the planner's sentence."""
    idx, _ = example_inputs(TINY, BATCH, SEQ)
    try:
        autopar.parallelize(make_model(), (world, 1, 1), idx, compile=False)
    except ValueError as e:
        return str(e)
    return None


LONE_TENSOR = pool.job(2, _lone_tensor, timeout=120)


def test_parallelize_checks_the_example_inputs_too():
    for message in LONE_TENSOR.result():
        assert message is not None and "takes 2 inputs but example_inputs gives 1" in message
