"""Partial optimizer offload's prices (cost_model/offload.py, cost_model/state.py): each unit's state on
the device or the host, the update where the runtime runs the host's part (beside the backward unit
by unit, after it, one step late), never a negative term, the floors the split search stops by, and
a rank's bytes against what the runtime allocates for the same split (one gloo rank)."""
from __future__ import annotations

import dataclasses
import random
from types import SimpleNamespace

import pytest
import torch

import autopar
import pool
from autopar.cost_model.compute import offload_update_time, update_time
from autopar.cost_model.devices import get_device
from autopar.cost_model.offload import (backward_exposed, backward_floor, copy_in_time, host_job_time, host_need, offload_timing,
                                        staging_bytes, update_split)
from autopar.cost_model.state import kept_params, local_param_bytes, param_state, state_bytes
from autopar.examples.gpt import example_inputs
from autopar.graph.units import owner_units
from autopar.mesh import Mesh
from autopar.planner.decide import decide
from parity import SEQ, TINY, make_model

DEV = get_device("h100")
KEPT = ("embedding", "transformer.h.0")


# ---- bytes per unit -------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def tiny():
    model = make_model()
    return {p: decide(model, (1, 1, 1), example_inputs(TINY, 4, SEQ), device="cpu", precision=p, offload="optimizer")
            for p in ("fp32", "bf16")}


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_kept_units_hold_the_fp32_row_and_the_others_the_offload_row(tiny, precision):
    cap, strategies, _ = tiny[precision]
    wc = 0.5 if precision == "bf16" else 0.0
    fqns = list(cap.params)
    local = local_param_bytes(cap, strategies, tuple(fqns), 1)
    on_device = kept_params(cap, KEPT)
    owners = owner_units(cap)
    assert on_device == {f for f in fqns if owners[f] in KEPT} and 0 < len(on_device) < len(fqns)
    kept = sum(b for f, b in local.items() if f in on_device)
    rest = sum(local.values()) - kept
    weights, grads, opt = param_state(cap, strategies, fqns, 1, 1, 0, wc, True, offload_kept=KEPT)
    # kept: an fp32 weight, its fp32 gradient, two fp32 moments; offloaded: the compute dtype's weight and gradient
    held = 0.5 if precision == "bf16" else 1.0
    assert (weights, grads, opt) == pytest.approx((kept + held * rest, kept + held * rest, 2 * kept))
    none = param_state(cap, strategies, fqns, 1, 1, 0, wc, True)
    assert none == pytest.approx((held * (kept + rest), held * (kept + rest), 0.0))
    # the host: fp32 master and two moments of the offloaded units only
    plan = autopar.plan(make_model(), (1, 1, 1), example_inputs(TINY, 4, SEQ), device="cpu", precision=precision,
                        offload="optimizer")
    split = dataclasses.replace(plan, offload_kept=KEPT)
    again = autopar.plan(make_model(), (1, 1, 1), example_inputs(TINY, 4, SEQ), device="cpu", plan=split)
    assert again.memory[0].host == pytest.approx(3 * rest) and plan.memory[0].host == pytest.approx(3 * (kept + rest))
    assert again.memory[0].optimizer == pytest.approx(2 * kept) and plan.memory[0].optimizer == 0
    assert again.memory[0].peak > plan.memory[0].peak
    assert state_bytes(0, 1, wc, True).host == 3.0


# ---- the update's terms ---------------------------------------------------------------------------

def test_timing_is_the_runtime_s_rule():
    from autopar.runtime.program import _updates_in_backward

    meshes = [Mesh(1, 1, 1), Mesh(2, 1, 1), Mesh(1, 2, 1), Mesh(1, 1, 2), Mesh(2, 1, 1, cp=2), Mesh(1, 1, 1, cp=2)]
    for mesh in meshes:
        for zero in (0, 1, 2, 3):
            for delay in (0, 1):
                plan = SimpleNamespace(zero=zero, offload_delay=delay)
                for compile in (True, "aot_eager"):
                    expected = ("delayed" if delay else "backward" if _updates_in_backward(plan, mesh, compile)
                                else "after")
                    assert offload_timing(mesh, zero, delay, inductor=compile is True) == expected, (mesh, zero, delay)
    assert offload_timing(Mesh(1, 1, 1), 0, 0) == "after" and offload_timing(Mesh(1, 1, 1), 0, 0, inductor=False) == "backward"


def test_after_the_backward_the_host_runs_beside_the_device_s_adamw():
    params = 3e8
    host = 4 * params
    # nothing kept: the chunked pipeline alone, as before partial offload
    assert update_split(0.0, host, DEV, shards=1, working_copy=False, timing="after") == \
        pytest.approx((0.0, offload_update_time(params, DEV)))
    kept = 4 * 5e9
    adam = update_time(kept, DEV, working_copy=False)
    update, exposed = update_split(kept, host, DEV, shards=1, working_copy=False, timing="after")
    assert update == pytest.approx(adam) and exposed == pytest.approx(max(0.0, offload_update_time(params, DEV) - adam))
    # enough kept state that the device's AdamW outlasts the host's: nothing exposed, the step never credited
    update, exposed = update_split(4 * 1e11, 4 * 1e6, DEV, shards=1, working_copy=True, timing="after")
    assert exposed == 0.0 and update == pytest.approx(update_time(4e11, DEV, working_copy=False)
                                                     + update_time(4e11 + 4e6, DEV, working_copy=True, offload=True))


def test_one_step_late_the_host_runs_beside_the_next_step():
    params, kept = 2e8, 4 * 1e9
    job, copy = host_job_time(params, DEV), copy_in_time(params, DEV)
    adam = update_time(kept, DEV, working_copy=False)
    for window in (0.0, job / 2, 10 * job):
        _, exposed = update_split(kept, 4 * params, DEV, shards=1, working_copy=False, timing="delayed", window=window)
        assert exposed == pytest.approx(max(0.0, job - window) + max(0.0, copy - adam))
    # a chunk: its gradients out, then its AdamW (each at the preset host's rates)
    assert job == pytest.approx(4 * params / DEV.host_bandwidth + params / DEV.host_adam_rate)


def test_beside_the_backward_each_unit_starts_once_its_gradients_are_final():
    p = 2e8   # one chunk per unit
    job, copy = host_job_time(p, DEV), copy_in_time(p, DEV)
    second = host_job_time(p, DEV, alongside=p)   # the first unit's weights come in during it
    assert second > job
    # two units, final at 0.1 s and 0.2 s of a 1 s backward: both jobs end inside it, and the last
    # unit's weights come in once the backward no longer reads them, after its end
    assert backward_exposed([(p, 0.1), (p, 0.2)], 1.0, DEV) == pytest.approx(copy)
    # a short backward: the recurrence by hand (the second job waits for the first; each unit's weights
    # come in once the next unit's marker fired, the last's at the backward's end)
    b = 0.05
    done1 = 0.01 + job
    done2 = max(0.02, done1) + second
    landed1 = max(done1, 0.02) + copy
    landed2 = max(done2, b, landed1) + copy
    assert backward_exposed([(p, 0.01), (p, 0.02)], b, DEV) == pytest.approx(landed2 - b)


def test_the_floor_holds_for_every_longer_split_and_a_longer_backward_hides_more():
    """The split search's floor (planner.offload_split) rests on both."""
    rng = random.Random(0)
    for _ in range(200):
        n = rng.randint(1, 8)
        seconds = [rng.uniform(0.001, 0.2) for _ in range(n)]
        params = [rng.uniform(1e6, 6e8) for _ in range(n)]
        ready = [sum(seconds[:j + 1]) for j in range(n)]
        backward = ready[-1] + rng.uniform(0.0, 0.3)
        units = list(zip(params, ready))
        exposed = [backward_exposed(units[:k], backward, DEV) for k in range(n + 1)]
        floors = [backward_floor(units[:k], backward, DEV) for k in range(n + 1)]
        assert all(x >= 0 for x in exposed)
        assert all(floors[k] <= min(exposed[k:]) + 1e-12 for k in range(n + 1))
        assert all(a <= b + 1e-12 for a, b in zip(floors, floors[1:]))
        # a longer backward (a unit recomputed: every later unit final later, the end later)
        j, more = rng.randrange(n), rng.uniform(0.0, 0.2)
        later = [(p, r + (more if i >= j else 0.0)) for i, (p, r) in enumerate(units)]
        assert backward_exposed(later, backward + more, DEV) <= exposed[-1] + 1e-12
        assert backward_floor(later, backward + more, DEV) <= floors[-1] + 1e-12


def test_no_update_term_is_negative():
    rng = random.Random(1)
    for _ in range(300):
        timing = rng.choice(["after", "delayed", "backward"])
        units = [(rng.uniform(0, 1e9), rng.uniform(0, 0.5)) for _ in range(rng.randint(0, 4))]
        terms = update_split(rng.uniform(0, 4e10), rng.uniform(0, 4e10), DEV, shards=rng.choice([1, 2, 8]),
                             working_copy=rng.random() < 0.5, timing=timing, units=sorted(units, key=lambda u: u[1]),
                             backward=rng.uniform(0, 1.0), window=rng.uniform(0, 2.0))
        assert min(terms) >= 0


def test_the_host_holds_state_and_two_staging_chunks():
    from autopar.cost_model.compute import OFFLOAD_CHUNK as c
    from autopar.cost_model.terms import MemoryPlan

    assert staging_bytes(0) == 0 and staging_bytes(c / 2) == 4 * c / 2 and staging_bytes(3 * c) == 8 * c
    memory = (MemoryPlan(0, 0, 0, 0, 0, 0, host=12.0 * 3 * c), MemoryPlan(1, 0, 0, 0, 0, 0, host=12.0 * c / 4))
    assert host_need(memory, 2) == pytest.approx(36 * c + 8 * c)
    assert host_need(memory, 1) == pytest.approx(12 * 3.25 * c + 8 * c)


# ---- against the runtime: one gloo rank, a partial split ----------------------------------------

def _allocated(rank, world, precision):
    model = make_model()
    inputs = example_inputs(TINY, 4, SEQ)
    plan = autopar.plan(model, (1, 1, 1), inputs, device="cpu", precision=precision, offload="optimizer")
    plan = dataclasses.replace(plan, offload_kept=KEPT)
    pm = autopar.parallelize(model, mesh=(1, 1, 1), example_inputs=inputs, plan=plan, compile=False, device="cpu")
    opt = pm.optimizer(torch.optim.AdamW, lr=1e-3)
    pm.train_step(*inputs)
    grads = sum(p.grad.numel() * p.grad.element_size() for p in pm.parameters() if p.grad is not None)
    opt.step()

    def state(side) -> float:   # AdamW's moments (its step counters are scalars)
        return float(sum(t.numel() * t.element_size() for s in side.optimizer.state.values() for t in s.values()
                         if torch.is_tensor(t) and t.numel() > 1))
    split = opt.split
    masters = sum(t.numel() * t.element_size() for t in pm._offload.host.masters.values())
    return dict(weights=float(sum(p.numel() * p.element_size() for p in pm.parameters())), grads=float(grads),
                device_state=state(split.device), host=float(masters) + state(split.host),
                kept=sorted(pm.program.offload_kept), plan=pm.plan.to_json())


ALLOCATED = {p: pool.job(1, _allocated, p) for p in ("fp32", "bf16")}


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_the_plan_counts_what_the_runtime_allocates(tiny, precision):
    got = ALLOCATED[precision].result()[0]
    plan = autopar.Plan.from_json(got["plan"])
    cap, strategies, _ = tiny[precision]
    owners = owner_units(cap)
    assert got["kept"] == sorted(f for f in cap.params if owners[f] in KEPT)
    wc = 0.5 if precision == "bf16" else 0.0
    weights, grads, opt = param_state(cap, strategies, list(cap.params), 1, 1, 0, wc, True, offload_kept=KEPT)
    assert (got["weights"], got["grads"], got["device_state"]) == pytest.approx((weights, grads, opt))
    memory = plan.memory[0]
    assert memory.optimizer == pytest.approx(got["device_state"]) and memory.host == pytest.approx(got["host"])
    # the plan's params are the weights, and at bf16 the 16-bit copies the kept linears keep for the backward
    copies = memory.params - got["weights"]
    assert copies == 0.0 if precision == "fp32" else 0 < copies < 0.5 * got["weights"]
