"""The FLOPs and parameter report: totals against the unsharded model, per-rank sums and replication,
recompute, MFU, the 6ND formula, the command line, and per-rank counts against real steps on gloo ranks."""
from __future__ import annotations

import dataclasses
import math
import re

import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode

import autopar
import cli
import pool
from autopar.planner.decide import decide
from autopar.cost_model.devices import DEVICES
from autopar.examples.gpt import GPT, GPTConfig, build, example_inputs
from autopar.flops import FlopsReport, flops_report, mfu, report_for, report_table

CFG = GPTConfig(vocab_size=96, block_size=16, n_layer=2, n_head=4, n_embd=32)
BATCH, SEQ = 8, 16
MESHES = [(1, 1, 2), (1, 2, 1), (1, 2, 2), (2, 1, 2)]


def _meta_model(cfg: GPTConfig = CFG) -> GPT:
    with torch.device("meta"):
        return GPT(cfg)


def _decided(mesh, cfg: GPTConfig = CFG, **knobs):
    model = _meta_model(cfg)
    cap, strategies, plan = decide(model, mesh, example_inputs(cfg, BATCH, SEQ, device="meta"), **knobs)
    return model, plan, report_for(cap, strategies, plan, model_name="GPT")


@pytest.fixture(scope="module")
def unsharded():
    """Parameter count and FlopCounterMode's forward and backward FLOPs of one step of the unsharded model."""
    model = _meta_model()
    idx, tgt = example_inputs(CFG, BATCH, SEQ, device="meta")
    with FlopCounterMode(display=False) as fwd:
        loss = model(idx, tgt)
    with FlopCounterMode(display=False) as bwd:
        loss.backward()
    return sum(p.numel() for p in model.parameters()), fwd.get_total_flops(), bwd.get_total_flops()


@pytest.fixture(scope="module")
def decided():
    return {mesh: _decided(mesh) for mesh in MESHES}


@pytest.mark.parametrize("mesh", MESHES, ids=str)
def test_totals_are_the_unsharded_models(decided, unsharded, mesh):
    params, fwd, bwd = unsharded
    _, plan, r = decided[mesh]
    assert (r.params, r.fwd_flops, r.bwd_flops) == (params, fwd, bwd)
    assert r.model_flops == pytest.approx(plan.model_flops, rel=1e-12)   # the cost model's count agrees
    root = r.modules[0]
    assert (root.name, root.params, root.flops) == ("", params, fwd + bwd)
    blocks = [m for m in r.modules if re.fullmatch(r"transformer\.h\.\d+", m.name)]
    head = next(m for m in r.modules if m.name == "lm_head")
    assert len(blocks) == CFG.n_layer
    assert sum(b.flops for b in blocks) + head.flops == pytest.approx(r.model_flops, rel=1e-12)


def _expected_held(model, plan, pp_rank: int, tp: int) -> int:
    """Entries a (pp, tp) rank holds, from the plan's stage modules and placements (tiny: no padding)."""
    mods = [mod for s in plan.stages if s.rank == pp_rank for mod in s.modules] if plan.stages else [""]
    held = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        if any(not mod or name.startswith(mod + ".") for mod in mods):
            pp_ = plan.param(name)
            held[pp_.fqn] = p.numel() // (1 if pp_.placements["tp"] == "R" else tp)
    return sum(held.values())


@pytest.mark.parametrize("mesh", MESHES, ids=str)
def test_per_rank_sums_equal_the_total_after_replication(decided, unsharded, mesh):
    params, fwd, bwd = unsharded
    model, plan, r = decided[mesh]
    dp, pp, tp = mesh
    assert sorted((x.pp, x.tp) for x in r.ranks) == [(a, b) for a in range(pp) for b in range(tp)]
    for x in r.ranks:
        assert x.params == _expected_held(model, plan, x.pp, x.tp), (x.pp, x.tp)
        assert x.padding_params == 0 and x.padding_flops == pytest.approx(0, abs=1e-6)
    assert sum(x.unique_params for x in r.ranks) == pytest.approx(params, rel=1e-12)
    executed = dp * sum(x.flops - x.padding_flops - x.replicated_flops * (tp - 1) / tp for x in r.ranks)
    assert executed == pytest.approx(fwd + bwd, rel=1e-12)
    if pp > 1 and tp == 1:   # the tied embedding/head weight is held by the first and the last stage
        assert sum(x.params for x in r.ranks) == params + CFG.vocab_size * CFG.n_embd


def test_layernorm_and_row_parallel_biases_are_held_by_every_tp_rank():
    model, _, r = _decided((1, 1, 2), plan="megatron")
    replicated = sum(p.numel() for n, p in model.named_parameters()
                     if ".ln_" in n or n.endswith("c_proj.bias") or n == "transformer.wpe.weight")
    sharded = sum(p.numel() for p in model.parameters()) - replicated
    assert replicated == CFG.n_layer * 6 * CFG.n_embd + 2 * CFG.n_embd + CFG.block_size * CFG.n_embd
    for x in r.ranks:
        assert x.replicated_params == replicated
        assert x.params == replicated + sharded // 2
        assert x.unique_params == pytest.approx(replicated / 2 + sharded / 2)
        assert x.replicated_flops == 0   # megatron shards every matmul
    assert r.params == replicated + sharded


def test_padded_vocabulary_shard_reports_its_padding():
    cfg = GPTConfig(vocab_size=97, block_size=16, n_layer=2, n_head=4, n_embd=32)
    model, plan, r = _decided((1, 1, 2), cfg, plan="megatron")
    assert plan.param("transformer.wte.weight").local_shape == (49, 32)
    first, second = sorted(r.ranks, key=lambda x: x.tp)
    assert (first.padding_params, second.padding_params) == (0, cfg.n_embd)   # 97 rows = 49 + 48 and a pad row
    assert first.params - second.params == cfg.n_embd
    # the head computes 49 vocabulary columns on each rank, half a column more than an even share
    half_column = 0.5 * 2 * BATCH * SEQ * cfg.n_embd * 3
    assert first.padding_flops == pytest.approx(half_column) and second.padding_flops == pytest.approx(half_column)
    assert sum(x.unique_params for x in r.ranks) == pytest.approx(sum(p.numel() for p in model.parameters()))
    executed = sum(x.flops - x.padding_flops for x in r.ranks)
    assert executed == pytest.approx(r.model_flops, rel=1e-12)


def test_recompute_counts_hardware_flops():
    _, _, full = _decided((1, 1, 2), plan="megatron", recompute="full")
    by_name = {m.name: m for m in full.modules}
    last_matmuls = sum(by_name[f"transformer.h.{i}.mlp.c_proj"].fwd_flops for i in range(CFG.n_layer))
    # every block's forward again, but its last matmul (output only feeds the residual sum)
    assert full.recompute_flops == pytest.approx(by_name["transformer.h"].fwd_flops - last_matmuls, rel=1e-12)
    assert full.hardware_flops == full.model_flops + full.recompute_flops
    assert sum(x.recompute_flops for x in full.ranks) == pytest.approx(full.recompute_flops, rel=1e-12)
    assert full.hfu(1.0) / full.mfu(1.0) == pytest.approx(full.hardware_flops / full.model_flops)

    _, _, selective = _decided((1, 1, 2), plan="megatron", recompute="selective")
    attention_core = 4 * BATCH * SEQ * SEQ * CFG.n_embd * CFG.n_layer   # q k^T and p v, forward
    assert selective.recompute_flops == attention_core
    assert selective.model_flops == full.model_flops


def test_mfu_arithmetic():
    assert mfu(989e12 * 8 * 0.5, 0.5, 8, 989e12) == pytest.approx(1.0)
    assert mfu(3e15, 2.0, 4, 1e15) == pytest.approx(0.375)
    model = _meta_model()
    r = flops_report(model, (1, 1, 2), example_inputs(CFG, BATCH, SEQ, device="meta"), step_time=0.5,
                     device="h100")
    peak = DEVICES["h100"].flops(torch.float32)
    assert (r.dtype, r.peak_flops, r.device) == ("fp32", peak, "h100")
    assert r.mfu() == pytest.approx(r.model_flops / (2 * peak * 0.5), rel=1e-12)
    assert r.mfu(0.25) == pytest.approx(2 * r.mfu(), rel=1e-12)
    assert r.hfu() == pytest.approx(r.mfu(), rel=1e-12)   # no recompute
    bf16 = flops_report(model, (1, 1, 2), example_inputs(CFG, BATCH, SEQ, device="meta"), step_time=0.5,
                        device="h100", precision="bf16")
    assert (bf16.dtype, bf16.peak_flops) == ("bf16", DEVICES["h100"].flops("bf16"))
    assert bf16.model_flops == r.model_flops and bf16.mfu() == pytest.approx(r.mfu() * peak / bf16.peak_flops)
    with pytest.raises(ValueError, match="positive number of seconds"):
        mfu(1.0, 0.0, 1, 1.0)
    with pytest.raises(ValueError, match="positive number of seconds"):
        flops_report(model, (1, 1, 2), example_inputs(CFG, BATCH, SEQ, device="meta"), step_time=-1.0)
    with pytest.raises(ValueError, match="no step time"):
        dataclasses.replace(r, step_time=None).mfu()


def test_json_round_trip_and_table():
    r = _decided((1, 2, 2))[2]
    assert FlopsReport.from_json(r.to_json()) == r
    text = report_table(r)
    assert "transformer.h.{0..1} (x2, each)" in text   # identical blocks shown once
    assert "Per rank (pp, tp)" in text and "Totals per step" in text
    assert f"{r.params:,}" in text


def test_model_flops_agree_with_6nd_plus_attention():
    """Per step, model FLOPs = 6 x (matmul weights) x tokens + 12 x layers x width x seq x tokens exactly
    (causal attention counted in full, as FlopCounterMode does); against 6 N tokens with N every
    parameter, within 1%: the gap is the position embedding, biases and LayerNorms, which do no matmul."""
    model = build("gpt2", device="meta")
    c = model.config
    batch, seq = 2, 1024
    r = flops_report(model, (1, 1, 1), example_inputs(c, batch, seq, device="meta"))
    tokens = batch * seq
    attention = 12 * c.n_layer * c.n_embd * seq * tokens
    matmul_weights = 12 * c.n_layer * c.n_embd ** 2 + c.vocab_size * c.n_embd
    assert r.tokens == tokens
    assert r.model_flops == 6 * matmul_weights * tokens + attention
    n = sum(p.numel() for p in model.parameters())
    assert r.params == n
    assert r.model_flops == pytest.approx(6 * n * tokens + attention, rel=0.01)


def _autopar(*args):
    return cli.main(*args)


def test_cli_flops_tiny_and_gpt3_175b():
    tiny, big, bad = [_autopar(*args) for args in (
        ("flops", "tiny", "--mesh", "1,2,2", "--batch", "8", "--seq", "32", "--step-time", "0.01"),
        ("flops", "gpt3-175b", "--mesh", "1,1,8", "--batch", "8"),
        ("flops", "tiny", "--mesh", "1,1,3"))]
    r = tiny
    assert r.returncode == 0, r.stderr
    assert "GPT on mesh dp=1 pp=2 tp=2" in r.stdout and "MFU / HFU" in r.stdout
    assert "Per rank (pp, tp)" in r.stdout and "transformer.h" in r.stdout
    assert "Traceback" not in r.stderr

    r = big
    assert r.returncode == 0, r.stderr
    assert "174,604,259,328" in r.stdout   # GPT-3 175B with its position embedding, the head tied
    assert re.search(r"counted gpt3-175b \(batch 8, seq 2048\) in [\d.]+ s", r.stdout)

    r = bad
    assert r.returncode == 2
    assert r.stderr.startswith("error: tp=3 does not divide 4 attention heads") and "Traceback" not in r.stderr


# ---- against real steps of the rewritten per-rank programs ---------------------------------

# attention spelled out: FlopCounterMode has no formula for the CPU sdpa kernel
EXPLICIT = GPTConfig(vocab_size=97, block_size=16, n_layer=2, n_head=4, n_embd=32, attention="explicit")
RUNS = [((1, 1, 2), dict(plan="megatron", sequence_parallel=True, recompute="full")),
        ((1, 2, 1), dict(microbatches=2))]


def _counted_steps(rank, world):
    out = []
    for mesh, knobs in RUNS:
        torch.manual_seed(0)
        idx, tgt = example_inputs(EXPLICIT, BATCH, SEQ)
        pm = autopar.parallelize(GPT(EXPLICIT), mesh, (idx, tgt), compile=False, **knobs)
        pm.train_step(idx, tgt)   # the first step also sets the pipeline up
        with FlopCounterMode(display=False) as counter:
            pm.train_step(idx, tgt)
        out.append((pm.coords["pp"], pm.coords["tp"], counter.get_total_flops()))
    return out


COUNTED_STEPS = pool.job(2, _counted_steps)


def test_rank_flops_match_flopcountermode_on_real_steps():
    results = COUNTED_STEPS.result()
    for k, (mesh, knobs) in enumerate(RUNS):
        r = _decided(mesh, EXPLICIT, **knobs)[2]
        rows = {(x.pp, x.tp): x for x in r.ranks}
        for per_rank in results:
            pp, tp, counted = per_rank[k]
            assert counted == rows[(pp, tp)].hardware_flops, (mesh, pp, tp)
        if knobs.get("recompute"):
            assert all(x.recompute_flops > 0 for x in r.ranks)
        assert math.isclose(sum(x.flops for x in r.ranks) - sum(x.padding_flops for x in r.ranks),
                            r.model_flops, rel_tol=1e-12)
