"""The mesh ranking's floors (planner.floors): no plan of a layout that fits is faster than its step
floor, none holds less than its peak floor; the searches over cuts they rest on against brute force;
the ranking plans no schedule variant or count of fewer microbatches they rule out."""
from __future__ import annotations

import itertools

import numpy as np
import pytest

from autopar.examples.gpt import build, example_inputs
from autopar.mesh import Mesh
from autopar.planner.choices import _Scheduled, choose_offload
from autopar.planner.floors import RowFloors, busiest_rank, least_slowest, least_weighted
from autopar.planner.mesh_search import context_sizes, hsdp_split, schedule_options
from autopar.planner.request import Job, Request
from autopar.planner.sharding import divisors


def _job(layers, batch, seq, world, budget_mib, **knobs):
    model = build("gpt2", device="meta", n_layer=layers, block_size=seq)
    inputs = example_inputs(model.config, batch, seq, device="meta")
    req = Request.of("auto", zero="auto", recompute="auto", memory_budget=budget_mib * 2**20, world_size=world,
                     **knobs)
    return Job(model, inputs, req)


def _layouts(job, units: int):
    """Every (mesh, microbatches, schedule, virtual) of the job's world, HSDP splits and cp included."""
    world, (batch, seq) = job.request.world_size, job.example_inputs[0].shape
    for tp in (t for t in divisors(world) if t <= 8):
        for pp in (p for p in divisors(world // tp) if p <= units):
            data = world // (tp * pp)
            for cp in (1, *context_sizes(seq, data, tp=tp)[0]):
                dp = data // cp
                if batch % dp:
                    continue
                for m in (m for m in divisors(batch // dp) if pp == 1 or m >= pp):
                    for mesh in filter(None, (Mesh(dp, pp, tp, cp=cp), hsdp_split(Mesh(dp, pp, tp, cp=cp), 8))):
                        for sched in schedule_options(pp, units, m, "1F1B", None):
                            yield mesh, m, sched


@pytest.mark.parametrize("layers, batch, seq, world, budget, knobs", [
    (4, 8, 256, 4, 640, {}),                      # tight: recompute, cp and fewer microbatches matter
    (4, 8, 256, 8, 2000, {"precision": "bf16"}),   # roomy, 16-bit: tp 8, HSDP, interleaving
])
def test_no_fitting_plan_is_faster_than_its_floor(layers, batch, seq, world, budget, knobs):
    job = _job(layers, batch, seq, world, budget, **knobs)
    floors = RowFloors(job, 1)
    ratios = []
    for mesh, m, (schedule, virtual) in _layouts(job, layers + 2):
        planned = job if virtual == 1 else _Scheduled(job, schedule, virtual)
        try:
            plan = choose_offload(planned, mesh, m, zero="auto", offload="none", prune=True)
        except ValueError:   # no cut or no recompute choice within the memory: nothing to bound
            continue
        floor = floors(mesh, m, schedule, virtual)
        assert floor.peak <= plan.peak_memory, (mesh, m, schedule, virtual)
        if plan.peak_memory <= job.request.limit:
            assert 0 < floor.step <= plan.step_time, (mesh, m, schedule, virtual, floor, plan.terms)
            ratios.append(floor.step / plan.step_time)
    assert len(ratios) > 15 and max(ratios) > 0.95   # many layouts fit, and the floors are close to some


def test_a_zero_stage_that_cannot_fit_bounds_nothing():
    """64 layers of 8192 on 64 H100s of 80 GiB, pp = 4: ZeRO-1's state alone is more than a rank holds, so
    the layout's step floor is that of the stages that may fit (ZeRO-2, 3), whose gradient syncs every
    microbatch make it several times ZeRO-1's; the plan, at ZeRO-2, is no faster."""
    model = build("gpt2", device="meta", n_layer=64, n_embd=8192, n_head=64, block_size=8192)
    knobs = dict(device="h100", precision="bf16", world_size=64, memory_budget=80 * 2**30, recompute="auto")
    job = Job(model, example_inputs(model.config, 128, 8192, device="meta"), Request.of("auto", **knobs))
    for mesh, m in ((Mesh(4, 4, 1, cp=4), 32), (Mesh(16, 4, 1), 8)):
        floor = {}
        for zero in ("auto", 1, 2, 3):
            job.request = Request.of("auto", zero=zero, **knobs)
            floor[zero] = RowFloors(job, 1)(mesh, m, "1F1B", 1).step
        job.request = Request.of("auto", zero="auto", **knobs)
        plan = choose_offload(job, mesh, m, zero="auto", offload="none", prune=True)
        assert plan.choices.zero >= 2 and plan.peak_memory <= job.request.limit
        assert floor["auto"] == min(floor[2], floor[3]) > 1.2 * floor[1], (mesh, floor)
        assert floor["auto"] <= plan.step_time


def test_the_rankings_step_floors_skip_zero_stages_and_keep_the_choice(monkeypatch):
    """48 layers of 8192 on 64 H100s: with the layout's per-stage step floors (``RowFloors.zero_steps``),
    ``choose_zero`` skips ZeRO-2 and 3, whose gradient syncs every microbatch make them slower than the
    ZeRO-1 plan found first, which its own floors (the syncs alone) cannot rule out; the choice and
    its figures are those of planning every stage, and no stage's plan that fits beats its floor."""
    from autopar.planner import choices

    model = build("gpt2", device="meta", n_layer=48, n_embd=8192, n_head=64, block_size=8192)
    knobs = dict(device="h100", precision="bf16", world_size=64, memory_budget=80 * 2**30, recompute="auto")
    job = Job(model, example_inputs(model.config, 128, 8192, device="meta"), Request.of("auto", zero="auto", **knobs))
    bound = RowFloors(job, 1)
    price, planned = choices.price, []
    monkeypatch.setattr(choices, "price", lambda j, mesh, m, z, o: planned.append(z) or price(j, mesh, m, z, o))
    for mesh, m in ((Mesh(8, 2, 4), 8), (Mesh(4, 8, 2), 16)):
        steps = bound.zero_steps(mesh, m, "1F1B", 1)
        outcome = {}
        for name, knob in (("all", {}), ("own floors", dict(prune=True)),
                           ("ranking's floors", dict(prune=True, step_floors=steps))):
            planned.clear()
            c = choices.choose_zero(job, mesh, m, zero="auto", offload="none", **knob)
            outcome[name] = (c.choices.zero, c.step_time, c.peak_memory), set(planned)
        assert outcome["all"][0] == outcome["own floors"][0] == outcome["ranking's floors"][0], mesh
        assert outcome["ranking's floors"][1] < outcome["own floors"][1] and {2, 3}.isdisjoint(
            outcome["ranking's floors"][1]), (mesh, outcome)
        for z in (0, 1, 2, 3):
            try:
                one = price(job, mesh, m, z, "none")
            except ValueError:
                continue
            if one.peak_memory <= job.request.limit:
                assert steps[z] <= one.step_time, (mesh, z)


def test_zero_peak_floors_count_a_ranks_virtual_stages_together():
    """A pipeline rank holds all its virtual stages at once: ZeRO's peak floors (``zero_floors``) are the
    same at 1 and 2 virtual stages per rank, and below every plan's peak at 2."""
    from autopar.planner.choices import _Scheduled, price, zero_floors

    model = build("gpt2", device="meta", n_layer=48, n_embd=8192, n_head=64, block_size=8192)
    knobs = dict(device="h100", precision="bf16", world_size=64, memory_budget=80 * 2**30, recompute="auto")
    job = Job(model, example_inputs(model.config, 128, 8192, device="meta"), Request.of("auto", zero="auto", **knobs))
    mesh, m = Mesh(4, 8, 2), 16
    interleaved = _Scheduled(job, "Interleaved1F1B", 2)
    floors = zero_floors(interleaved, mesh, m, "none", (0, 1, 2, 3))
    assert floors == zero_floors(job, mesh, m, "none", (0, 1, 2, 3))
    for z in (0, 1, 2, 3):
        try:
            assert floors[z][0] <= price(interleaved, mesh, m, z, "none").peak_memory, z
        except ValueError:   # no cut within the budget: its floor is below what it needs
            continue


def test_the_cut_searches_against_brute_force():
    rng = np.random.default_rng(0)
    for _ in range(150):
        n = int(rng.integers(2, 8))
        stages = int(rng.integers(1, n + 1))
        sizes = rng.random(n)
        weights = tuple(int(w) for w in rng.integers(1, 5, stages))
        cuts = [(0, *c, n) for c in itertools.combinations(range(1, n), stages - 1)]
        least = min(sum(weights[s] * sizes[c[s]:c[s + 1]].sum() for s in range(stages)) for c in cuts)
        assert least_weighted(sizes, weights) == pytest.approx(least, rel=1e-12)
        slowest = min(max(sizes[c[s]:c[s + 1]].sum() for s in range(stages)) for c in cuts)
        assert slowest * (1 - 1e-9) <= least_slowest(sizes, stages) <= slowest
        ranks = int(rng.integers(1, 4))
        busiest = min(max(sum(sizes[i] for i in range(n) if at[i] == r) for r in range(ranks))
                      for at in itertools.product(range(ranks), repeat=n))
        assert busiest_rank(sizes, ranks) <= busiest + 1e-12


def test_the_ranking_plans_no_variant_or_count_its_floor_rules_out():
    """A schedule variant, or a count of fewer microbatches, whose step floor is no faster than the
    fastest fitting row is not planned; one whose floor is below it is."""
    from types import SimpleNamespace

    from autopar.planner.floors import Floor
    from autopar.planner.mesh_search import MeshOption, _fewer_microbatches, _variants
    asked = []

    def price(mesh, m, schedule, virtual):
        asked.append((m, virtual))
        bubble = 0.4 / virtual
        terms = SimpleNamespace(as_dict=lambda: dict(compute=1.0, bubble=bubble))
        choices = SimpleNamespace(zero=1, recompute="none", recompute_regions=(), offload="none", keep_gathered=(),
                                  schedule=schedule, virtual_stages=virtual)
        return SimpleNamespace(step_time=1.0 + bubble / m, peak_memory=1.0, choices=choices, terms=terms)

    def bound(mesh, m, schedule, virtual):   # variants past v=2 and counts below 4 ruled out
        return Floor(2.0 if virtual > 2 or m < 4 else 0.0, 0.0)
    rival = MeshOption(Mesh(4, 1, 1), 1, 1.3, 1.0, True)
    rows = _variants(Mesh(2, 2, 1), 4, price, 2.0, [rival], schedule_options(2, 8, 4, "1F1B", None), bound)
    assert [o.virtual for o in rows] == [1, 2] and asked == [(4, 1), (4, 2)]
    asked.clear()
    flat = _variants(Mesh(2, 1, 1), 8, price, 2.0, [rival], [("1F1B", 1)], bound)[0]
    assert [o.microbatches for o in _fewer_microbatches(flat, price, 2.0, [rival, flat], bound)] == [4]
    assert asked == [(8, 1), (4, 1)]   # 7, 6 and 5 do not divide 8; 2 and 1 ruled out


def test_fewer_microbatches_are_tried_for_a_row_that_is_not_the_fastest():
    """With floors, a row without pipeline stages that is not the fastest so far is still planned
    at fewer microbatches where their floors pass: which rows are tried does not depend on the
    order the search planned the layouts in (a pipeline planned first must not hide them)."""
    from types import SimpleNamespace

    from autopar.planner.floors import Floor
    from autopar.planner.mesh_search import MeshOption, _fewer_microbatches, _variants

    def price(mesh, m, schedule, virtual):
        terms = SimpleNamespace(as_dict=lambda: dict(compute=1.0))
        choices = SimpleNamespace(zero=1, recompute="none", recompute_regions=(), offload="none", keep_gathered=(),
                                  schedule=schedule, virtual_stages=virtual)
        return SimpleNamespace(step_time=1.0 + 0.05 * m, peak_memory=1.0, choices=choices, terms=terms)

    def bound(mesh, m, schedule, virtual):
        return Floor(0.0, 0.0)
    pipeline = MeshOption(Mesh(2, 2, 1), 4, 1.2, 1.0, True, schedule="1F1B")   # planned first, faster
    flat = _variants(Mesh(4, 1, 1), 4, price, 2.0, [pipeline], [("1F1B", 1)], bound)[0]   # 1.2 at m=4
    assert [o.microbatches for o in _fewer_microbatches(flat, price, 2.0, [pipeline, flat], bound)] == [2, 1]
    # without floors, only the fastest row is tried (the planning-time bound of the search without them)
    assert _fewer_microbatches(flat, price, 2.0, [MeshOption(Mesh(2, 2, 1), 4, 1.1, 1.0, True), flat]) == []
