"""Pipeline parallelism: parity with the unsharded model, stage cuts, bad input."""
from __future__ import annotations

import json
from dataclasses import replace

import pytest
import torch

import autopar
from autopar.examples.gpt import GPT, example_inputs
import pool
from parity import BATCH, SEQ, TINY, parallel_run, reference

STEPS = 10
SEVEN = replace(TINY, n_layer=7)
CASES = [((1, 2, 1), dict(schedule="GPipe")),
         ((1, 2, 1), dict(schedule="1F1B")),
         ((1, 2, 1), dict(schedule="Interleaved1F1B", virtual_stages=2)),
         ((1, 2, 1), dict(schedule="InterleavedZeroBubble", virtual_stages=2)),
         ((1, 2, 1), dict(schedule="1F1B", cfg=SEVEN)),
         ((1, 3, 1), dict(schedule="1F1B", cfg=SEVEN, microbatches=4, batch=8)),
         ((1, 4, 1), dict(schedule="GPipe")),
         ((1, 4, 1), dict(schedule="1F1B")),
         ((1, 2, 2), dict(schedule="GPipe", plan="megatron", sequence_parallel=True)),
         ((1, 2, 2), dict(schedule="1F1B", plan="megatron", sequence_parallel=False)),
         ((2, 2, 2), dict(schedule="GPipe", plan="megatron", sequence_parallel=True)),
         ((2, 2, 2), dict(schedule="1F1B", plan="megatron", sequence_parallel=True, zero=1))]
IDS = [f"{m}-{k['schedule']}-{k.get('cfg', TINY).n_layer}L{'-zero1' if k.get('zero') else ''}" for m, k in CASES]


def _world(mesh) -> int:
    return mesh[0] * mesh[1] * mesh[2]


def _rank_all(rank, world, cases):
    out = []
    for mesh, knobs in cases:
        knobs = dict(knobs, compile=False)
        cfg, batch = knobs.pop("cfg", TINY), knobs.pop("batch", BATCH)
        out.append(parallel_run(rank, world, mesh, knobs, cfg=cfg, steps=STEPS, batch=batch))
    return out


# All cases of one world size share one spawn, the session's pool.
GROUPS = {size: [i for i, c in enumerate(CASES) if _world(c[0]) == size] for size in sorted({_world(m) for m, _ in CASES})}
JOBS = {size: pool.job(size, _rank_all, [CASES[i] for i in group], timeout=900) for size, group in GROUPS.items()}


@pytest.fixture(scope="module")
def results():
    out = {}
    for size, group in GROUPS.items():
        res = JOBS[size].result()
        for k, i in enumerate(group):
            out[i] = [r[k] for r in res]
    return out


@pytest.fixture(scope="module")
def refs():
    return {(cfg.n_layer, b): reference(cfg, steps=STEPS, batch=b) for cfg, b in ((TINY, BATCH), (SEVEN, BATCH), (SEVEN, 8))}


@pytest.mark.parametrize("case", range(len(CASES)), ids=IDS)
def test_pipeline_parity(results, refs, case):
    mesh, knobs = CASES[case]
    cfg = knobs.get("cfg", TINY)
    ref_loss, ref_grads, ref_curve = refs[(cfg.n_layer, knobs.get("batch", BATCH))]
    for rank, (loss, grads, curve, plan) in enumerate(results[case]):
        assert loss == pytest.approx(ref_loss, rel=1e-5), f"rank {rank}"
        if grads is not None:
            for name, g in ref_grads.items():
                torch.testing.assert_close(grads[name], g, rtol=1e-5, atol=1e-6, msg=f"rank {rank} {name}")
        assert curve == pytest.approx(ref_curve, rel=1e-4), f"rank {rank} loss curve"
        stages = json.loads(plan)["stages"]
        assert len(stages) == mesh[1] * knobs.get("virtual_stages", 1)
        mods = [m for s in stages for m in s["modules"]]
        blocks = [m for m in mods if m.startswith("transformer.h.") and m.count(".") == 2]
        assert sorted(blocks) == sorted(f"transformer.h.{i}" for i in range(cfg.n_layer)), "each block once"
        assert len(mods) == len(set(mods))


def _plan(cfg, mesh, batch=8, seq=SEQ, **kw):
    with torch.device("meta"):   # .to("meta") would untie the embedding and the head
        model = GPT(cfg)
    return autopar.plan(model, mesh, example_inputs(cfg, batch, seq, device="meta"), **kw)


def test_heavy_head_moves_the_cut():
    """A huge vocabulary makes the head the heaviest layer: the cut moves blocks away from it."""
    light = _plan(replace(TINY, n_layer=8, n_embd=256, n_head=4, vocab_size=64, block_size=64),
                  (1, 2, 1), seq=64, device="h100", microbatches=2)
    heavy = _plan(replace(TINY, n_layer=8, n_embd=256, n_head=4, vocab_size=200_000, block_size=64),
                  (1, 2, 1), seq=64, device="h100", microbatches=2)
    def blocks_in(plan, s):
        return sum(1 for m in plan.stages[s].modules if m.startswith("transformer.h.") and m.count(".") == 2)
    print("light:", [f"{s.predicted_time_s * 1e6:.1f}us" for s in light.stages], [blocks_in(light, s) for s in (0, 1)])
    print("heavy:", [f"{s.predicted_time_s * 1e6:.1f}us" for s in heavy.stages], [blocks_in(heavy, s) for s in (0, 1)])
    assert blocks_in(light, 0) == blocks_in(light, 1) == 4
    assert blocks_in(heavy, 1) < blocks_in(heavy, 0)
    assert "Pipeline: 2 stages" in heavy.summary()


def test_stage_override_and_its_errors():
    cfg = replace(TINY, n_layer=3)
    emb = ["transformer.wte", "transformer.wpe", "transformer.drop"]
    head = ["transformer.ln_f", "lm_head"]
    plan = _plan(cfg, (1, 2, 1), stages=[emb + ["transformer.h.0"], ["transformer.h.1", "transformer.h.2"] + head])
    assert plan.stages[0].modules[-1] == "transformer.h.0"
    with pytest.raises(autopar.PlanError, match=r"transformer.h.2.*in no stage"):
        _plan(cfg, (1, 2, 1), stages=[emb + ["transformer.h.0"], ["transformer.h.1"] + head])
    with pytest.raises(autopar.PlanError, match=r"transformer.h.1.*stage 0 and stage 1"):
        _plan(cfg, (1, 2, 1), stages=[emb + ["transformer.h.0", "transformer.h.1"],
                                      ["transformer.h.1", "transformer.h.2"] + head])


def test_pipeline_bad_input():
    with pytest.raises(ValueError, match=r"6 pipeline stages need at least 6 units.*only 4 units \(embedding, 2 blocks, head\)"):
        _plan(TINY, (1, 6, 1), batch=12)
    with pytest.raises(ValueError, match=r"microbatches=1 is fewer than the 2 pipeline stages"):
        _plan(TINY, (1, 2, 1), microbatches=1)
    with pytest.raises(ValueError, match=r"multiple of pp=2"):
        _plan(TINY, (1, 2, 1), schedule="Interleaved1F1B", microbatches=3, batch=6)
    with pytest.raises(ValueError, match=r"batch size 8 is not divisible by dp=1 x microbatches=3"):
        _plan(TINY, (1, 2, 1), microbatches=3)
    with pytest.raises(ValueError, match=r"schedule='2F2B'"):
        _plan(TINY, (1, 2, 1), schedule="2F2B")


def test_auto_mesh_offline_ranks_candidates():
    cfg = replace(TINY, n_layer=4)
    plan = _plan(cfg, "auto", batch=8, world_size=4, device="h100")
    assert plan.mesh[0] * plan.mesh[1] * plan.mesh[2] == 4
    assert "mesh chosen automatically among" in plan.notes[0] and "(4, 1, 1)" in plan.notes[0]
    with pytest.raises(ValueError, match="world_size"):
        _plan(cfg, "auto")


def _auto_run(rank, world):
    return parallel_run(rank, world, "auto", dict(compile=False, device="cpu"))


AUTO_JOB = pool.job(2, _auto_run, timeout=300)


def test_auto_mesh_trains_like_the_unsharded_model():
    ref_loss, ref_grads, _ = reference()
    for loss, grads, _, plan in AUTO_JOB.result():
        assert loss == pytest.approx(ref_loss, rel=1e-5)
        for name, g in ref_grads.items():
            torch.testing.assert_close(grads[name], g, rtol=1e-5, atol=1e-6)
        assert "mesh chosen automatically" in json.loads(plan)["notes"][0]
