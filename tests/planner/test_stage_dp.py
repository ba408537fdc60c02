"""Pipeline stage-cut search (autopar.planner.stage_dp) against brute force over every cut."""
import itertools
import math
import time

import numpy as np
import pytest

from autopar.planner.stage_dp import StageCut, bubble_fraction, cut_stages, evaluate_cut, inflight_microbatches, min_peak_memory

V1_SCHEDULES = ("GPipe", "1F1B", "Interleaved1F1B", "InterleavedZeroBubble")
VN_SCHEDULES = ("Interleaved1F1B", "InterleavedZeroBubble")


def all_cuts(n, S):
    for cuts in itertools.combinations(range(1, n), S - 1):
        edges = (0,) + cuts + (n,)
        yield tuple(zip(edges[:-1], edges[1:]))


def brute(inst, *, p, m, v, schedule, budget=None):
    """Every cut evaluated; returns (best fitting StageCut or None, min over cuts of peak memory)."""
    t, w, a, c = inst
    best, min_peak = None, math.inf
    for bounds in all_cuts(len(t), p * v):
        cut = evaluate_cut(bounds, t, w, a, c, p=p, m=m, v=v, schedule=schedule)
        peak = max(cut.rank_memory)
        min_peak = min(min_peak, peak)
        if budget is not None and peak > budget:
            continue
        if best is None or cut.step_time < best.step_time:
            best = cut
    return best, min_peak


def random_instance(rng, n, *, heavy_boundary=False):
    t = rng.uniform(0.1, 2.0, n)
    w = rng.uniform(0.0, 3.0, n) * 1e6
    a = rng.uniform(0.0, 2.0, n) * 1e5
    c = rng.uniform(0.0, 1.5 if heavy_boundary else 0.2, n - 1)
    if rng.random() < 0.3:                     # sometimes integer costs: many exact ties
        t = np.round(t * 2) + 1
    return t, w, a, c


def binding_budget(inst, rng, *, p, m, v, schedule):
    """A budget between two distinct cut peaks, so some (not all) cuts are excluded. Peaks closer
    than 1e-6 relative (equal up to rounding) count as one: the search allows 1e-9 of slack."""
    t, w, a, c = inst
    peaks = []
    for x in sorted(max(evaluate_cut(b, t, w, a, c, p=p, m=m, v=v, schedule=schedule).rank_memory)
                    for b in all_cuts(len(t), p * v)):
        if not peaks or x > peaks[-1] * (1 + 1e-6):
            peaks.append(x)
    if len(peaks) < 2:
        return None
    i = int(rng.integers(0, len(peaks) - 1))
    return 0.5 * (peaks[i] + peaks[i + 1])


def check_structure(cut: StageCut, n, S):
    assert len(cut.bounds) == S == len(cut.stage_times)
    owner = []
    for s, (b, e) in enumerate(cut.bounds):
        assert e > b, f"stage {s} is empty: {cut.bounds}"
        owner += [s] * (e - b)
    assert owner == sorted(owner) and len(owner) == n       # each unit once, in order, contiguous
    assert cut.bounds[0][0] == 0 and cut.bounds[-1][1] == n
    assert all(x[1] == y[0] for x, y in zip(cut.bounds, cut.bounds[1:]))


def compare(inst, *, p, m, v, schedule, budget):
    t, w, a, c = inst
    want, min_peak = brute(inst, p=p, m=m, v=v, schedule=schedule, budget=budget)
    if want is None:
        with pytest.raises(ValueError, match="needs at least"):
            cut_stages(t, w, a, c, p=p, m=m, v=v, schedule=schedule, memory_budget=budget)
        return 0
    got = cut_stages(t, w, a, c, p=p, m=m, v=v, schedule=schedule, memory_budget=budget)
    check_structure(got, len(t), p * v)
    assert got.gap == 0.0
    assert got.step_time == pytest.approx(want.step_time, rel=1e-12, abs=0), (
        f"p={p} v={v} m={m} {schedule} budget={budget}: got {got.bounds} {got.step_time}, "
        f"brute force {want.bounds} {want.step_time}")
    again = evaluate_cut(got.bounds, t, w, a, c, p=p, m=m, v=v, schedule=schedule)
    assert again.step_time == got.step_time and again.rank_memory == got.rank_memory
    if budget is not None:
        assert max(got.rank_memory) <= budget * (1 + 1e-9)
    return 1


@pytest.mark.parametrize("seed", range(6))
def test_v1_matches_brute_force(seed):
    rng = np.random.default_rng(seed)
    solved = 0
    for _ in range(25):
        p = int(rng.integers(1, 5))
        n = int(rng.integers(p, 10))
        m = int(rng.choice([1, 2, 3, 5, 8]))
        schedule = V1_SCHEDULES[int(rng.integers(0, 4))]
        inst = random_instance(rng, n, heavy_boundary=rng.random() < 0.5)
        for budget in (None, binding_budget(inst, rng, p=p, m=m, v=1, schedule=schedule)):
            solved += compare(inst, p=p, m=m, v=1, schedule=schedule, budget=budget)
    assert solved >= 40


@pytest.mark.parametrize("seed", range(4))
def test_interleaved_matches_brute_force(seed):
    rng = np.random.default_rng(100 + seed)
    solved = 0
    for _ in range(20):
        p, v = [(2, 2), (1, 2), (1, 3), (1, 4), (2, 2)][int(rng.integers(0, 5))]
        n = int(rng.integers(p * v, 10))
        m = int(rng.choice([1, 2, 4, 7]))
        schedule = VN_SCHEDULES[int(rng.integers(0, 2))]
        inst = random_instance(rng, n, heavy_boundary=rng.random() < 0.5)
        for budget in (None, binding_budget(inst, rng, p=p, m=m, v=v, schedule=schedule)):
            solved += compare(inst, p=p, m=m, v=v, schedule=schedule, budget=budget)
    assert solved >= 30


def test_equal_units_bubble_fraction():
    for p, v, m, k in [(4, 1, 8, 3), (2, 1, 5, 2), (8, 1, 16, 1), (4, 2, 8, 2), (2, 3, 4, 3), (4, 4, 12, 1)]:
        n, T = p * v * k, 0.25
        t, w, a, c = np.full(n, T), np.ones(n), np.ones(n), np.zeros(n - 1)
        sched = "1F1B" if v == 1 else "Interleaved1F1B"
        cut = cut_stages(t, w, a, c, p=p, m=m, v=v, schedule=sched)
        ideal = m * v * k * T                        # the busiest rank's pure compute
        frac = cut.step_time / ideal - 1
        assert frac == pytest.approx((p - 1) / (v * m), rel=1e-12)
        assert frac == pytest.approx(bubble_fraction(p, m, v), rel=1e-12)
        assert all(e - b == k for b, e in cut.bounds)
    assert bubble_fraction(4, 8) == pytest.approx(3 / 8)
    assert bubble_fraction(4, 8, 2) == pytest.approx(3 / 16)


def test_heavy_last_unit_alone_in_last_stage():
    n, p = 9, 4
    t = np.ones(n)
    t[-1] = 10.0
    for m in (2, 4, 16):           # (m = 1 has no bottleneck term: every cut costs the same)
        cut = cut_stages(t, np.ones(n), np.ones(n), np.zeros(n - 1), p=p, m=m)
        assert cut.bounds[-1] == (n - 1, n), cut.bounds
        assert max(cut.stage_times) == 10.0


def test_fewer_units_than_stages():
    with pytest.raises(ValueError, match=r"pp\*v = 4\*2 = 8 pipeline stages need at least 8 units.*only 6 units"):
        cut_stages(np.ones(6), np.ones(6), np.ones(6), np.zeros(5), p=4, m=8, v=2,
                   schedule="Interleaved1F1B")


@pytest.mark.parametrize("p,v,schedule", [(3, 1, "1F1B"), (2, 1, "GPipe"), (2, 2, "Interleaved1F1B")])
def test_infeasible_budget_reports_minimum(p, v, schedule):
    rng = np.random.default_rng(7)
    t, w, a, c = random_instance(rng, 8)
    m = 4
    _, need = brute((t, w, a, c), p=p, m=m, v=v, schedule=schedule)
    got, _ = min_peak_memory(t, w, a, c, p=p, m=m, v=v, schedule=schedule)
    assert got == pytest.approx(need, rel=1e-12)
    with pytest.raises(ValueError) as err:
        cut_stages(t, w, a, c, p=p, m=m, v=v, schedule=schedule, memory_budget=0.9 * need)
    msg = str(err.value)
    assert f"needs at least {need / 2**30:.4g} GiB ({need:.6g} bytes) per rank under {schedule}" in msg
    assert f"budget is {0.9 * need / 2**30:.4g} GiB" in msg
    assert "pipeline stages, tensor parallelism or recompute" in msg
    cut = cut_stages(t, w, a, c, p=p, m=m, v=v, schedule=schedule, memory_budget=need)   # just fits
    assert max(cut.rank_memory) <= need * (1 + 1e-9)


def test_inflight_counts():
    for p in (1, 2, 4, 8):
        for m in (1, 3, 8, 32):
            one = inflight_microbatches(p, m, 1, "1F1B")
            assert one == tuple(min(m, p - s) for s in range(p))
            assert inflight_microbatches(p, m, 1, "Interleaved1F1B") == one
            assert inflight_microbatches(p, m, 1, "InterleavedZeroBubble") == one
            assert inflight_microbatches(p, m, 1, "GPipe") == (m,) * p
    # interleaved, many microbatches: rank 0 holds p*v + p - 1 microbatch-chunks (Megatron warmup + 1)
    for p, v in [(2, 2), (4, 2), (4, 4), (8, 2)]:
        f = inflight_microbatches(p, 64, v, "Interleaved1F1B")
        for r in range(p):
            assert sum(f[r::p]) == (v - 1) * p + 2 * (p - 1 - r) + 1
        assert sum(f[0::p]) == p * v + p - 1
    with pytest.raises(ValueError, match="one stage per rank"):
        inflight_microbatches(4, 8, 2, "1F1B")


def test_evaluate_cut_checks_bounds():
    t = np.ones(5)
    args = (t, t, t, np.zeros(4))
    for bad in [((0, 2), (3, 5)), ((0, 2), (2, 2), (2, 5)), ((0, 2), (2, 4)), ((0, 5),)]:
        with pytest.raises(ValueError):
            evaluate_cut(bad, *args, p=2, m=2)
    cut = evaluate_cut(((0, 2), (2, 5)), t, t, t, np.array([0, 0.5, 0, 0]), p=2, m=3)
    assert cut.stage_times == (2.0, 3.5)                      # the cut after unit 1 costs stage 1
    assert cut.rank_memory == (2 + 2 * 2, 3 + 1 * 3)          # 1F1B: 2 and 1 microbatches in flight
    assert cut.step_time == 5.5 + 2 * 3.5


def test_speed_100_units_8_stages():
    rng = np.random.default_rng(3)
    n = 100
    t = rng.uniform(1, 2, n)
    t[0], t[-1] = 3.0, 5.0
    w, a, c = rng.uniform(1, 2, n) * 1e9, rng.uniform(1, 2, n) * 1e8, rng.uniform(0, 0.2, n - 1)
    for p, v, sched, budget in [(8, 1, "1F1B", None), (8, 1, "1F1B", 3.2e10), (8, 1, "GPipe", 5.13e10),
                                (4, 2, "Interleaved1F1B", None)]:
        t0 = time.perf_counter()
        cut = cut_stages(t, w, a, c, p=p, m=16, v=v, schedule=sched, memory_budget=budget)
        dt = time.perf_counter() - t0
        print(f"\n100 units, p={p} v={v} {sched} budget={budget}: {dt * 1e3:.1f} ms, "
              f"step {cut.step_time:.2f}, gap {cut.gap}")
        check_structure(cut, n, 8)
        assert dt < 2.0
        if budget is not None:
            assert max(cut.rank_memory) <= budget * (1 + 1e-9)


def test_a_refusal_searches_its_least_memory_cut_only_once_asked(monkeypatch):
    """recompute="auto" asks for a cut without recompute first and moves on when none fits: the
    refusal's least-memory cut (a branch and bound of its own for v > 1) is searched only when its
    message or cut is read, once, and a refusal given again from the kept answers shares it."""
    import autopar.planner.stage_dp as dp
    rng = np.random.default_rng(7)
    t, w, a, c = random_instance(rng, 10)
    searched = []
    real = dp._min_peak

    def counted(*args):
        searched.append(1)
        return real(*args)
    monkeypatch.setattr(dp, "_min_peak", counted)
    need = min_peak_memory(t, w, a, c, p=2, m=4, v=2, schedule="Interleaved1F1B")[0]
    searched.clear()
    with pytest.raises(dp.BudgetMissed) as e:
        cut_stages(t, w, a, c, p=2, m=4, v=2, schedule="Interleaved1F1B", memory_budget=need * 0.9)
    assert searched == []
    assert "per rank" in str(e.value) and len(e.value.least) == 4 and searched == [1]
    with pytest.raises(dp.BudgetMissed) as again:
        cut_stages(t, w, a, c, p=2, m=4, v=2, schedule="Interleaved1F1B", memory_budget=need * 0.9)
    assert str(again.value) == str(e.value) and searched == [1]


def gpt_like_instance(rng, n):
    """An embedding (little time, much memory), n - 2 equal blocks (the first a little slower, as a
    block that builds a rotary table) and a head: the shape where whole units decide the optimum."""
    blk_t, blk_w, blk_a = rng.uniform(0.5, 1.5), rng.uniform(1.0, 3.0) * 1e6, rng.uniform(0.2, 2.0) * 1e5
    t = np.full(n, blk_t)
    w = np.full(n, blk_w)
    a = np.full(n, blk_a)
    t[0], w[0], a[0] = 0.01 * blk_t, rng.uniform(1.0, 4.0) * blk_w, 0.1 * blk_a
    t[1] *= 1.01
    t[-1], w[-1], a[-1] = rng.uniform(0.5, 2.0) * blk_t, rng.uniform(1.0, 4.0) * blk_w, rng.uniform(0.5, 3.0) * blk_a
    c = np.full(n - 1, rng.uniform(0.0, 0.1) * blk_t)
    return t, w, a, c


@pytest.mark.parametrize("seed", range(3))
def test_interleaved_gpt_like_matches_brute_force(seed):
    """The counting bounds (whole equal units, one per stage, memory caps per rank) are exact here:
    a bound too high would prune the optimum."""
    rng = np.random.default_rng(300 + seed)
    solved = 0
    for _ in range(12):
        p, v = [(2, 2), (2, 3), (3, 2), (1, 3)][int(rng.integers(0, 4))]
        n = int(rng.integers(p * v, 13))
        m = int(rng.choice([1, 3, 4, 8]))
        schedule = VN_SCHEDULES[int(rng.integers(0, 2))]
        inst = gpt_like_instance(rng, n)
        for budget in (None, binding_budget(inst, rng, p=p, m=m, v=v, schedule=schedule)):
            solved += compare(inst, p=p, m=m, v=v, schedule=schedule, budget=budget)
        want = brute(inst, p=p, m=m, v=v, schedule=schedule)[1]
        assert min_peak_memory(*inst, p=p, m=m, v=v, schedule=schedule)[0] == pytest.approx(want, rel=1e-12)
    assert solved >= 18


def test_count_level_against_enumeration():
    from autopar.planner.stage_dp import _count_level
    rng = np.random.default_rng(7)
    for _ in range(300):
        k = int(rng.integers(1, 5))
        loads = [float(x) for x in rng.uniform(0, 3, k)]
        if rng.random() < 0.3:
            loads = [float(round(x)) for x in loads]          # ties on the grid
        count, q = int(rng.integers(1, 7)), float(rng.choice([0.5, 1.0, 0.7]))
        caps = None if rng.random() < 0.5 else [int(x) for x in rng.integers(0, 5, k)]
        best = math.inf
        for ks in itertools.product(range(count + 1), repeat=k):
            if sum(ks) == count and (caps is None or all(x <= c for x, c in zip(ks, caps))):
                best = min(best, max(x + j * q for x, j in zip(loads, ks)))
        got = _count_level(loads, count, q, caps)
        if best == math.inf:
            assert got == math.inf
        else:
            assert got <= best and got == pytest.approx(best, abs=1e-6), (loads, count, q, caps)


def test_gpt_like_interleaved_search_completes():
    """82 units (Llama 70B's 80 blocks), 8 ranks x 2 chunks: the fluid bounds left the whole-unit gap
    of a block in ten open and the search stopped at SEARCH_LIMIT; the counting bound closes it."""
    rng = np.random.default_rng(1)
    t, w, a, c = gpt_like_instance(rng, 82)
    for p, v, m in [(8, 2, 32), (4, 3, 64), (4, 5, 64)]:
        cut = cut_stages(t, w, a, c, p=p, m=m, v=v, schedule="Interleaved1F1B")
        assert cut.gap == 0.0, (p, v, m)
        budget = 1.02 * min_peak_memory(t, w, a, c, p=p, m=m, v=v, schedule="Interleaved1F1B")[0]
        tight = cut_stages(t, w, a, c, p=p, m=m, v=v, schedule="Interleaved1F1B", memory_budget=budget)
        assert max(tight.rank_memory) <= budget * (1 + 1e-9) and tight.step_time >= cut.step_time


def test_memory_bound_interleaved_search_completes():
    """Llama 70B's 80 blocks on 8 ranks x 2 chunks at 64 microbatches under an 80 GiB budget: the first
    ranks hold 15, 13, ... microbatches in flight and take few blocks, so the last ranks' cheap
    chunks must take many, and their slowest stage is what the step pays in its bubble. Without the
    memory-forced stage floor the search stopped at SEARCH_LIMIT with a 5% gap."""
    gib, blk_t = 2.0 ** 30, 0.038
    t = np.full(82, blk_t)
    w = np.full(82, 3.188 * gib)
    a = np.full(82, 0.692 * gib)
    t[0], w[0], a[0] = 0.0004, 3.914 * gib, 0.0
    t[-1], w[-1], a[-1] = 0.0356, 3.914 * gib, 0.583 * gib
    c = np.full(81, 1e-4)
    for v in (2, 3):
        cut = cut_stages(t, w, a, c, p=8, m=64, v=v, schedule="Interleaved1F1B", memory_budget=80 * gib)
        assert cut.gap == 0.0, v
        assert max(cut.rank_memory) <= 80 * gib * (1 + 1e-9)
        sizes = [e - b for b, e in cut.bounds]
        assert max(sizes) > 2 * 82 / (8 * v)   # memory, not time, sets the slowest stage


def test_a_stage_that_cannot_take_the_next_unit_does_not_prune_the_optimum():
    """Under a budget the first rank (more microbatches in flight) cannot hold unit 8 in its last
    chunk; the greedy furthest reach of the stages before leaves it exactly that unit, so the
    relaxation must look at shorter reaches before it rules a partial cut out (it pruned the
    optimum here, 54.66 against the 59.50 it returned)."""
    t = np.array([1.920327, 0.891641, 0.992171, 0.61737, 1.216221, 0.489781, 1.115754, 1.818235, 1.061747, 1.671469])
    w = np.array([537578.401806, 2650552.846957, 369574.883443, 638584.73311, 2160715.837993, 905964.696395,
                  356737.684938, 260388.608639, 2379895.591216, 59297.350824])
    a = np.array([11268.651687, 189104.213144, 156430.036342, 74086.982647, 38475.038979, 173435.767464,
                  157529.075348, 133703.936132, 106076.802496, 105053.598201])
    c = np.array([0.195588, 0.104458, 0.016806, 0.014959, 0.119111, 0.146536, 0.125648, 0.148564, 0.058839])
    compare((t, w, a, c), p=2, m=8, v=4, schedule="InterleavedZeroBubble", budget=6437619.028779358)
