"""The hand-written DTensor TP/SP + FSDP2 baseline (examples/handwritten.py) against the unsharded GPT.

All cases of one world size run in one job of the session's pool (tests/pool.py, module-level cache):
2 ranks for mesh (dp, tp) = (1, 2), 4 ranks for (2, 2).
"""
import functools
import math

import pytest
import torch

import pool

CFG = dict(vocab_size=96, block_size=16, n_layer=2, n_head=4, n_embd=32)
BATCH, SEQ, STEPS, LR = 4, 12, 5, 1e-2

# (dp, tp, sequence_parallel, options) per world size; options go to parallelize_by_hand
CASES = {
    2: [
        (1, 2, True, {}),
        (1, 2, False, {}),
        (1, 2, True, {"attention_explicit": True}),
        (1, 2, True, {"permute_qkv": False}),   # the fused-QKV trap
        (1, 2, False, {"permute_qkv": False}),
    ],
    4: [
        (2, 2, True, {}),
        (2, 2, False, {}),
        (2, 2, True, {"dp_wrapper": "replicate"}),
    ],
}


def _case_name(dp, tp, sp, opts):
    extra = ",".join(f"{k}={v}" for k, v in sorted(opts.items()))
    return f"dp{dp}-tp{tp}-sp{int(sp)}" + (f"-{extra}" if extra else "")


def _run_case(dp, tp, sp, opts):
    """One configuration on this rank: loss, every gradient and a short AdamW run, each with the reference."""
    from dataclasses import replace

    from torch.distributed.tensor import DTensor, Shard

    from autopar.examples.gpt import GPT, GPTConfig, example_inputs
    from autopar.mesh import made_device_mesh
    from autopar.examples.handwritten import (full_state_dict_by_hand, local_batch_by_hand,
                                      parallelize_by_hand, train_step_by_hand)

    opts = dict(opts)
    cfg = GPTConfig(**CFG)
    if opts.pop("attention_explicit", False):
        cfg = replace(cfg, attention="explicit")
    batches = [example_inputs(cfg, BATCH, SEQ, seed=s) for s in range(STEPS)]

    # the reference: unsharded, whole batch, same seed
    torch.manual_seed(0)
    ref = GPT(cfg)
    init_state = {k: v.clone() for k, v in ref.state_dict().items()}
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=LR)
    ref_curve = []
    for step, (idx, tgt) in enumerate(batches):
        ref_opt.zero_grad(set_to_none=True)
        loss = ref(idx, tgt)
        loss.backward()
        ref_curve.append(loss.item())
        if step == 0:
            ref_grads = {n: p.grad.clone() for n, p in ref.named_parameters(remove_duplicate=False)}
        ref_opt.step()

    torch.manual_seed(0)
    model = GPT(cfg)
    mesh = made_device_mesh("cpu", (dp, tp), ("dp", "tp"))   # made once per rank, not per case
    model = parallelize_by_hand(model, mesh, sequence_parallel=sp, **opts)
    gathered = full_state_dict_by_hand(model)   # gathered and un-permuted: the initial weights exactly
    state_dict_diff = {k: "missing" if k not in gathered else (gathered[k] - v).abs().max().item()
                       for k, v in init_state.items() if k not in gathered or not torch.equal(gathered[k], v)}
    opt = torch.optim.AdamW(model.parameters(), lr=LR)
    curve = []
    for step, (idx, tgt) in enumerate(batches):
        opt.zero_grad(set_to_none=True)
        curve.append(train_step_by_hand(model, *local_batch_by_hand(mesh, idx, tgt)))
        if step == 0:
            grads = full_state_dict_by_hand(model, grads=True)
        opt.step()

    bad_grads = {}
    for name, expect in ref_grads.items():
        got = grads.get(name)
        if got is None or got.shape != expect.shape:
            bad_grads[name] = "missing" if got is None else f"shape {tuple(got.shape)}"
        elif not torch.allclose(got, expect, rtol=1e-5, atol=1e-6):
            bad_grads[name] = f"max abs err {(got - expect).abs().max().item():.3g}"

    w = model.transformer.h[0].attn.c_attn.weight
    return {
        "loss": curve[0],
        "ref_loss": ref_curve[0],
        "curve": curve,
        "ref_curve": ref_curve,
        "bad_grads": bad_grads,
        "state_dict_diff": state_dict_diff,
        "tied": model.lm_head.weight is model.transformer.wte.weight,
        "c_attn_local_shape": tuple(w.to_local().shape) if isinstance(w, DTensor) else None,
        "c_attn_tp_shard0": isinstance(w, DTensor) and w.placements[-1] == Shard(0),
        # the state dict gathers, un-permutes and loads into the unsharded GPT
        "state_dict_loads": _loads(GPT(cfg), full_state_dict_by_hand(model)),
    }


def _loads(fresh, state_dict):
    fresh.load_state_dict(state_dict)
    return True


def _world(rank, world, cases):
    return {_case_name(*case): _run_case(*case) for case in cases}


JOBS = {world: pool.job(world, _world, cases, timeout=240) for world, cases in CASES.items()}


@functools.lru_cache(maxsize=None)
def _results(world):
    per_rank = JOBS[world].result()
    # every rank reports the same loss curve (tp ranks and, after averaging, dp ranks)
    for name in per_rank[0]:
        curves = [r[name]["curve"] for r in per_rank]
        assert all(c == curves[0] for c in curves), f"{name}: ranks disagree on the loss: {curves}"
    return per_rank[0]


def _good_cases():
    return [(w, c) for w in CASES for c in CASES[w] if c[3].get("permute_qkv", True)]


@pytest.mark.parametrize("world,case", _good_cases(), ids=lambda x: _case_name(*x) if isinstance(x, tuple) else f"w{x}")
def test_matches_unsharded(world, case):
    dp, tp, sp, opts = case
    r = _results(world)[_case_name(*case)]
    assert r["tied"], "lm_head and wte must share one parameter after parallelizing"
    assert r["c_attn_tp_shard0"]
    C = CFG["n_embd"]
    dp_shards = dp if opts.get("dp_wrapper", "fully_shard") == "fully_shard" else 1
    assert r["c_attn_local_shape"] == (3 * C // tp // dp_shards, C), "c_attn is not sharded as planned"
    assert math.isclose(r["loss"], r["ref_loss"], rel_tol=1e-5), (r["loss"], r["ref_loss"])
    assert not r["bad_grads"], f"gradients differ from the unsharded GPT: {r['bad_grads']}"
    for step, (got, want) in enumerate(zip(r["curve"], r["ref_curve"])):
        assert math.isclose(got, want, rel_tol=1e-4), f"step {step}: {r['curve']} vs {r['ref_curve']}"
    assert not r["state_dict_diff"], f"gathered state dict differs from the initial weights: {r['state_dict_diff']}"
    assert r["state_dict_loads"]


@pytest.mark.parametrize("sp", [True, False], ids=["sp1", "sp0"])
def test_naive_colwise_fused_qkv_is_wrong(sp):
    """ColwiseParallel on the fused [3C, C] c_attn without the row permutation mixes Q, K and V heads."""
    r = _results(2)[_case_name(1, 2, sp, {"permute_qkv": False})]
    assert abs(r["loss"] - r["ref_loss"]) > 1e-3, (r["loss"], r["ref_loss"])
    assert {n for n in r["bad_grads"] if "c_attn" in n}, "naive c_attn gradients should be wrong too"
    # and the permuted plan, run in the same processes, is right: the difference is the permutation
    good = _results(2)[_case_name(1, 2, sp, {})]
    assert abs(good["loss"] - good["ref_loss"]) < 1e-5 * abs(good["ref_loss"])
