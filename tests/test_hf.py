"""Hugging Face GPT-2 and Llama through autopar.parallelize unchanged, against the unsharded model.

Small random models built from config objects (no downloads), fp32, gloo on CPU: the loss and
every gathered gradient match the Hugging Face model run whole, on (1,1,2), (2,1,2) and (1,2,2);
Llama uses grouped-query attention (2 key/value heads for 4 query heads), and a Llama with one
key/value head checks the replicated key/value projections. bf16 runs of both track the fp32 loss.
All cases of one world size share one spawn, the session's pool (process start-up and imports dominate).
"""
from __future__ import annotations

import functools
import json

import pytest
import torch

transformers = pytest.importorskip("transformers")

import autopar  # noqa: E402
from autopar.hf import causal_lm_loss  # noqa: E402
import pool  # noqa: E402
from parity import unsharded

VOCAB, BATCH, SEQ = 96, 4, 12


def build(name: str, attention: str = "sdpa") -> torch.nn.Module:
    """A tiny random Hugging Face model wrapped to return its loss; ``name``: gpt2, llama, llama-mqa."""
    torch.manual_seed(0)
    if name == "gpt2":
        cfg = transformers.GPT2Config(vocab_size=VOCAB, n_positions=16, n_embd=32, n_layer=2, n_head=4,
                                      resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=0,
                                      eos_token_id=0, attn_implementation=attention)
        return causal_lm_loss(transformers.GPT2LMHeadModel(cfg))
    # pad_token_id gives the embedding a padding row, which must get no gradient when sharded too
    cfg = transformers.LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=1 if name == "llama-mqa" else 2,
                                   max_position_embeddings=16, bos_token_id=0, eos_token_id=0, pad_token_id=0,
                                   attn_implementation=attention)
    return causal_lm_loss(transformers.LlamaForCausalLM(cfg))


def batch() -> tuple[torch.Tensor, torch.Tensor]:
    """Token ids with the padding id among them; the labels are the ids (Hugging Face shifts them)."""
    ids = torch.randint(0, VOCAB, (BATCH, SEQ), generator=torch.Generator().manual_seed(1))
    ids[:, ::5] = 0
    return ids, ids.clone()


def reference(name: str):
    return unsharded(functools.partial(build, name), batch())[:2]


CASES = {
    2: [("gpt2", (1, 1, 2), dict(plan="megatron")),
        ("llama", (1, 1, 2), dict(plan="megatron")),
        ("llama-mqa", (1, 1, 2), dict(plan="megatron", sequence_parallel=False)),
        ("llama", (1, 1, 2), dict(plan="auto", device="h100", memory_budget=300_000)),
        ("gpt2", (1, 1, 2), dict(plan="megatron", precision="bf16")),
        ("llama", (1, 1, 2), dict(plan="megatron", precision="bf16"))],
    4: [("gpt2", (2, 1, 2), dict(plan="megatron")),
        ("llama", (2, 1, 2), dict(plan="megatron", sequence_parallel=False)),
        ("gpt2", (1, 2, 2), dict(plan="megatron", microbatches=2)),
        ("llama", (1, 2, 2), dict(plan="megatron", microbatches=2))],
}
IDS = [f"{name}-{mesh}-" + "-".join(f"{k}={v}" for k, v in knobs.items())
       for cases in CASES.values() for name, mesh, knobs in cases]


def _rank_all(rank, world, cases):
    out = []
    for name, mesh, knobs in cases:
        ids, labels = batch()
        pm = autopar.parallelize(build(name), mesh, (ids, labels), compile=False, **knobs)
        loss = pm.train_step(ids, labels).item()
        out.append((loss, pm.full_grads(), pm.plan.to_json()))
    return out


JOBS = {world: pool.job(world, _rank_all, cases, timeout=900) for world, cases in CASES.items()}


@pytest.fixture(scope="module")
def results():
    flat = {}
    for world, cases in CASES.items():
        for case, res in zip(cases, zip(*JOBS[world].result())):
            flat[IDS[len(flat)]] = (case, res)
    return flat


@pytest.fixture(scope="module")
def refs():
    return {name: reference(name) for name in ("gpt2", "llama", "llama-mqa")}


@pytest.mark.parametrize("case_id", IDS)
def test_matches_the_unsharded_model(results, refs, case_id):
    (name, mesh, knobs), per_rank = results[case_id]
    ref_loss, ref_grads = refs[name]
    bf16 = knobs.get("precision") == "bf16"
    for rank, (loss, grads, _) in enumerate(per_rank):
        assert loss == pytest.approx(ref_loss, rel=1e-2 if bf16 else 1e-5), f"rank {rank} loss"
        if bf16:
            continue
        assert set(grads) == set(ref_grads)
        for fqn, g in ref_grads.items():
            torch.testing.assert_close(grads[fqn], g, rtol=1e-5, atol=1e-6, msg=f"rank {rank} grad {fqn}")


def _placements(results, case_id) -> dict[str, str]:
    plan = json.loads(results[case_id][1][0][2])
    return {p["fqn"]: p["placements"]["tp"] for p in plan["parameters"]}


def test_the_tensor_parallel_cases_shard(results):
    """Parity above proves nothing for weights that were never sharded: check that they were."""
    gpt2 = _placements(results, IDS[0])
    assert gpt2["lm.transformer.h.0.attn.c_attn.weight"] == "S(1)i3"     # fused q,k,v on the last dim
    assert gpt2["lm.transformer.h.0.mlp.c_fc.weight"] == "S(1)"          # Conv1D stores [in, out]
    assert gpt2["lm.transformer.h.0.mlp.c_proj.weight"] == "S(0)"
    assert gpt2["lm.transformer.wte.weight"] == "S(0)"                   # tied with lm_head
    llama = _placements(results, IDS[1])
    for proj in ("q_proj", "k_proj", "v_proj"):
        assert llama[f"lm.model.layers.0.self_attn.{proj}.weight"] == "S(0)"
    assert llama["lm.model.layers.0.mlp.down_proj.weight"] == "S(1)"
    mqa = _placements(results, IDS[2])   # one key/value head cannot be split two ways: replicated
    assert mqa["lm.model.layers.0.self_attn.q_proj.weight"] == "S(0)"
    assert mqa["lm.model.layers.0.self_attn.k_proj.weight"] == "R"
    auto = _placements(results, IDS[3])
    assert any(v != "R" for v in auto.values()), "the memory budget should force the planner to shard"


def test_pipeline_stages_split_the_layers(results):
    for case_id in IDS:
        (name, mesh, _), per_rank = results[case_id]
        if mesh[1] > 1:
            stages = json.loads(per_rank[0][2])["stages"]
            assert len(stages) == 2, case_id
            modules = [m for s in stages for m in s["modules"]]
            assert len(modules) == len(set(modules)), case_id


@pytest.mark.parametrize("name,heads", [("gpt2", 4), ("llama", 4)])
def test_tp_not_dividing_the_heads_is_refused(name, heads):
    with pytest.raises(autopar.PlanError, match=rf"tp=3 does not divide {heads} attention heads.*"
                                                r"valid tp for this model: 1, 2, 4"):
        autopar.plan(build(name), (1, 1, 3), batch())


def test_untraceable_attention_is_refused():
    model = build("llama").lm
    model.config._attn_implementation = "flash_attention_2"
    with pytest.raises(ValueError, match=r"attn_implementation='flash_attention_2' cannot be captured.*'sdpa'"):
        causal_lm_loss(model)
