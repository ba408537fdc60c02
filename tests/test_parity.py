"""Parallel runs against the unsharded model: loss, every gathered gradient, 10 AdamW steps.

All configurations of one world size share one spawn, the session's pool (process start-up dominates)."""
from __future__ import annotations

import functools
import json

import pytest
import torch

import pool
from parity import parallel_run, reference

STEPS = 10
CASES = {
    2: [((1, 1, 2), dict(plan="megatron", sequence_parallel=False)),
        ((1, 1, 2), dict(plan="megatron", sequence_parallel=True)),
        ((1, 1, 2), dict(plan="auto", device="h100", memory_budget=400_000)),
        ((2, 1, 1), dict(plan="auto")),
        ((2, 1, 1), dict(plan="auto", zero=1))],
    4: [((1, 1, 4), dict(plan="megatron", sequence_parallel=False)),
        ((1, 1, 4), dict(plan="megatron", sequence_parallel=True)),
        ((4, 1, 1), dict(plan="auto")),
        ((2, 1, 2), dict(plan="megatron", sequence_parallel=False)),
        ((2, 1, 2), dict(plan="megatron", sequence_parallel=True)),
        ((2, 1, 2), dict(plan="megatron", sequence_parallel=True, zero=1))],
}


def _rank_all(rank, world, cases):
    return [parallel_run(rank, world, mesh, dict(knobs, compile=False), steps=STEPS) for mesh, knobs in cases]


REFERENCE = functools.partial(reference, steps=STEPS)


JOBS = {w: pool.job(w, _rank_all, cases) for w, cases in CASES.items()}


@pytest.fixture(scope="module")
def results():
    return {w: j.result() for w, j in JOBS.items()}


@pytest.mark.parametrize("world,case", [(w, i) for w, cases in CASES.items() for i in range(len(cases))],
                         ids=[f"{c[0]}-{'-'.join(f'{k}={v}' for k, v in c[1].items())}"
                              for w, cases in CASES.items() for c in cases])
def test_parity(results, ref, world, case):
    ref_loss, ref_grads, ref_curve = ref
    for rank, per_case in enumerate(results[world]):
        loss, grads, curve, plan = per_case[case]
        assert loss == pytest.approx(ref_loss, rel=1e-5), f"rank {rank} loss"
        if grads is not None:
            assert set(grads) == set(ref_grads)
            for name, g in ref_grads.items():
                torch.testing.assert_close(grads[name], g, rtol=1e-5, atol=1e-6, msg=f"rank {rank} grad {name}")
        assert curve == pytest.approx(ref_curve, rel=1e-4), f"rank {rank} loss curve"
    assert ref_curve[-1] < ref_curve[0]


def test_sharded_cases_really_shard(results):
    """The tp cases must actually shard weights, or the parity above proves nothing."""
    for world, cases in CASES.items():
        for i, (mesh, knobs) in enumerate(cases):
            plan = json.loads(results[world][0][i][3])
            placements = {p["fqn"]: p["placements"]["tp"] for p in plan["parameters"]}
            if mesh[2] > 1:
                assert placements["transformer.wte.weight"] != "R" or knobs["plan"] == "auto"
                assert any(v != "R" for v in placements.values()), f"{mesh} {knobs}: nothing sharded"
