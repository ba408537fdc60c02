"""Pipeline stage cuts: which consecutive layer units each pipeline stage runs (pure search; no torch).

Inputs
------
n ordered units u = 0..n-1 (embedding, each transformer block, final norm + head + loss), each
with, per microbatch,
    t[u]   seconds of forward + backward,
    w[u]   static bytes that do not depend on the microbatches in flight (parameters, gradients,
           optimizer state),
    a[u]   activation bytes one microbatch keeps alive until its backward,
and c[u] (u = 0..n-2), the seconds of point-to-point traffic (activations forward, their gradients
backward) if a cut is placed after unit u; it is charged to the stage that starts at u + 1.

p pipeline ranks, v virtual stages (model chunks) per rank, S = p * v stages; stage s lives on
rank r(s) = s mod p and is that rank's chunk j(s) = s // p. m microbatches per step.

A cut is a list of S contiguous, non-empty, in-order unit ranges [b_s, e_s) with b_0 = 0,
e_{S-1} = n, b_{s+1} = e_s. It needs n >= S.

Stage time
----------
    T_s = sum_{u in [b_s, e_s)} t[u]  +  (c[b_s - 1] if s > 0 else 0)
    R_r = sum_{s : r(s) = r} T_s                    (a rank's work per microbatch)

Predicted step time
-------------------
v = 1 (GPipe, 1F1B; the GPipe / Megatron-LM formula; for these two schedules only the order of
forwards and backwards differs, not the makespan):

    step = sum_s T_s + (m - 1) * max_s T_s

  The first microbatch crosses every stage once; the other m - 1 are paced by the slowest stage.
  With S equal stages of time T this is (m + p - 1) T = m T (1 + (p - 1)/m): bubble (p - 1)/m.

v > 1 (Interleaved1F1B, InterleavedZeroBubble; Narayanan et al. 2021):

    step = m * max_r R_r + (p - 1) * max_s T_s

  The busiest rank does m microbatches of all its chunks, plus a fill/drain bubble of p - 1
  virtual-stage slots, each priced at the slowest stage. With equal stages (R = v T) this is
  m v T (1 + (p - 1)/(v m)): bubble (p - 1)/(v m). The zero-bubble schedule's smaller bubble is
  NOT modelled: its prediction is the interleaved 1F1B one, an upper bound.

``bubble_fraction(p, m, v) = (p - 1) / (v m)`` is the equal-stage idle fraction, relative to the
ideal m * max_r R_r.

Microbatches in flight (activation memory)
------------------------------------------
f(s) = how many microbatches' activations stage s holds at its rank's peak:

    GPipe:           f(s) = m                     (all forwards before any backward)
    1F1B:            f(s) = min(m, p - s)         (warmup p - s - 1 forwards, then one more)
    interleaved, v = 1:  the same as 1F1B.
    interleaved, v > 1 (approximation): rank r runs
            N_r = min(m v, (v - 1) p + 2 (p - 1 - r) + 1)
        forwards before its first backward -- the warmup count of Megatron-LM's and
        torch.distributed.pipelining's Interleaved1F1B, (v - 1) p + 2 (p - 1 - r), plus the first
        steady-state forward; rank 0 holds p v + p - 1 microbatch-chunks, i.e. the
        (1 + (p - 1)/(p v)) factor of Korthikanti et al. 2022 over 1F1B. Forward k on a rank runs
        chunk (k // p) mod v (groups of p microbatches per chunk), so with q, rho = divmod(N_r, p v)
            f(s) = min(m, q p + clamp(rho - j(s) p, 0, p)).
        The steady state keeps the rank total N_r (one forward in, one backward out) but may move
        it between chunks; this counts the end-of-warmup distribution. InterleavedZeroBubble
        (ZB-H1-like) uses the same counts.

    mem_r = sum_{s : r(s) = r} ( sum_{u in s} w[u]  +  f(s) * sum_{u in s} a[u] )

Every rank must satisfy mem_r <= M (the per-rank memory budget, bytes; None = unlimited), checked
with a relative slack of 1e-9 so prefix-sum rounding never flips a decision.

Search
------
Minimise step subject to mem_r <= M for all r.

v = 1 (exact, a bottleneck sweep over a DP). Every rank is one stage, so the memory constraint is
per stage: allowed(s, b, e) = [w(b, e) + f(s) a(b, e) <= M]. For a bound B on the slowest stage let
    g(B) = min sum_s T_s  over cuts with every stage allowed and T_s <= B
computed by the DP
    D_0(e) = T(0, e);   D_s(e) = min_b D_{s-1}(b) + T(b, e)   (allowed, T(b, e) <= B);   g = D_{S-1}(n),
O(n^2) per stage, vectorised with numpy. The optimum cut C* with slowest stage B* is among the cuts
the DP sees at B = B*, so
    min_step = min over candidate B of g(B) + (m - 1) B,
where the candidates are the distinct segment times T(b, e) (O(n^2) values). The smallest feasible B
is found by binary search (feasibility is monotone in B); the sweep then runs upward and stops at
the first B with g(inf) + (m - 1) B >= best, since g(B) >= g(inf) for every B. sum_s T_s only varies
through the boundary costs c, so with c = 0 the sweep stops after one candidate. Every candidate
cut is re-priced with the exact step formula, and the best is kept.

v > 1 (branch and bound; exact when it completes). A rank's work and memory now add up over its
v chunks, which are p stages apart in the unit order, so neither is decomposable per stage and no
polynomial DP applies (its state would need all p running sums). Depth-first search places stages
in order. A partial cut (stages 0..s-1, the last ending at unit b, running sums R_r and mem_r,
slowest stage so far T*) is pruned when
  - mem_r > M for some rank, or the least memory the remaining stages can take, MM(s, b) (a suffix
    DP over the per-stage f), exceeds the open ranks' total headroom sum_r (M - mem_r);
  - its lower bound is >= the best step found:
        LB = m * max(max_r R_r, L) + (p - 1) * max(T*, TB(b, S - s)),
    TB(b, k) = the smallest possible slowest stage when [b, n) is cut into k stages (DP), and L =
    the water level at which the least remaining work, MS(b, S - s) (the minimum sum of stage times
    of [b, n) in S - s stages, DP), fills the ranks that still get stages;
  - a relaxation is infeasible: every remaining stage q on its own gets the full remaining
    capacity of its rank, min((best - (p-1) TB)/m - R_r, (best - m L)/(p-1)) seconds (boundary costs
    dropped) and M - mem_r bytes; greedy furthest reach decides this relaxation where every stage
    can take the unit it is left, else the set of ends each stage can reach, stage by stage;
  - the counting bounds, for whole units. Stage 0 holds unit 0 and stage S - 1 unit n - 1, so both
    go onto their ranks first; every other remaining stage holds at least one of the units between
    (each at least tq = min t seconds and wq + f(q) aq bytes, wq and aq the least w and a among
    them, and each stage after the first costs at least cq = min c to enter). The K units still free
    are then given out whole: rank r can take at most k_r = floor((M - mem'_r) / (wq + fq_r aq))
    of them by memory (fq_r the fewest microbatches in flight among r's stages to come; the node is
    infeasible if sum k_r < K), and the busiest rank's work is at least
        min over integers 0 <= j_r <= k_r, sum j_r = K, of max_r (R'_r + j_r tq)
    (``_count_level``: the water level, then the bins' next multiples of tq, smallest first). For
    GPT-like models, whose blocks are equal, the fluid bound L leaves up to one block in R/tq open
    (7% at 80 blocks on 8 ranks x 2 chunks); this bound closes it, and searches that stopped at
    SEARCH_LIMIT complete. The least-memory search bounds the same way, the free units spread as
    a fluid at wq + fq_r aq bytes each (``_rate_level``);
  - under a budget, the slowest stage memory forces. If the busiest rank's work is L, rank r takes
    at most j_r(L) = min(k_r, floor((L - R'_r) / tq)) free units, so rank r holds at least
    need_r(L) = K - sum_{r' != r} j_r'(L); its stages to come hold them at wq + f(q) aq bytes each
    within its headroom, and the fewest-in-flight-first fill gives the least Y for which at most Y
    per stage fits: one of its stages runs at least its base + Y tq (``stage_floor``). The bound
    is then min over L >= the work bound above of m L + (p - 1) max(T*, TB, that stage), tried at
    the work bound and at each L where some j_r steps up, while m L alone stays below the best so
    far (``step_floor``). Interleaved pipelines hold the most microbatches on their first ranks,
    so those take few units and the last ranks' cheap chunks grow long: the bubble term, not the
    work term, is what the fluid bounds missed there.
Children are visited in increasing LB order; states reached twice (values rounded to 1e-12 of the
totals) are skipped, and so are bounds within 1e-9 (relative) of the best cut: the rounding slack of
the bounds must not keep a search open that has met its bound. The incumbent starts from two
cuts -- the min-sum DP without memory (balanced stage times) and the per-stage min-max memory DP. A
search not settled after FIRST_LOOK partial cuts hill-climbs them and its
best cut (shift a run of consecutive cut positions by 1 or 2 units while the score improves) and
searches again from the root with that incumbent: most searches settle in the first look, where
climbing first cost more than the search, and the rest reach their optimum sooner from a climbed
incumbent.

The search stops after SEARCH_LIMIT partial cuts priced in all (about a second) and returns the
best cut found; StageCut.gap then holds the proven bound (best - smallest unexplored LB) / best.
Planning Llama 3.1 70B on 64 H100s (bench/published.py's nemo-70b-64 row, mesh="auto") ran 66 of
these searches: before the counting bounds 59 stopped at the limit (gaps of 3-7% without a binding
budget, up to 60% with one); with them 3 did, each under a binding memory budget with a gap of
about 5%; with the memory-forced stage floor none does. For v = 1 the search is always exact and
gap = 0.

Infeasible budget: the smallest achievable per-rank peak, min over cuts of max_r mem_r, is computed
(a min-max DP for v = 1, the same branch and bound with max_r mem_r as objective for v > 1) and
reported in the ValueError.
"""
from __future__ import annotations

import math
from bisect import bisect_left, bisect_right
from dataclasses import dataclass

import numpy as np

from autopar.cost_model.stages import SCHEDULES, check_schedule, inflight_microbatches, pipeline_time, posint

__all__ = ["SCHEDULES", "StageCut", "BudgetMissed", "cut_stages", "evaluate_cut", "bubble_fraction",
           "inflight_microbatches", "min_peak_memory", "SEARCH_LIMIT"]

_MEM_RTOL = 1e-9
_BB_RTOL = 1e-9      # the branch and bound drops cuts that would beat the best by less than this
SEARCH_LIMIT = 100_000
FIRST_LOOK = 2_000   # partial cuts priced before the incumbent is hill-climbed (``_BB.run``)
_GIB = float(2 ** 30)


@dataclass(frozen=True)
class StageCut:
    bounds: tuple[tuple[int, int], ...]   # [start, end) unit index per stage, stages in order
    stage_times: tuple[float, ...]        # T_s, seconds per microbatch (fwd+bwd, incoming p2p)
    rank_memory: tuple[float, ...]        # mem_r, bytes per pipeline rank
    step_time: float                      # predicted seconds per step (all m microbatches)
    gap: float = 0.0                      # proven bound on (step_time - optimum) / step_time;
                                          # 0 = optimal (always for v = 1 and complete searches),
                                          # inf = no bound proven


class BudgetMissed(ValueError):
    """No cut fits the memory budget; ``least`` is the cut of least per-rank memory found. Given as
    ``explain()`` -> (message, least), both are found once first asked for: a caller that only needs
    to know that no cut fits (recompute="auto" trying a cut without recompute first) pays for no
    least-memory search, which for v > 1 is a branch and bound of its own."""

    def __init__(self, explain):
        super().__init__()
        self._explain, self._told = explain, None

    def _answer(self):
        if self._told is None:
            self._told = self._explain()
        return self._told

    def __str__(self) -> str:
        return self._answer()[0]

    @property
    def least(self):
        return self._answer()[1]


# --------------------------------------------------------------------------- small helpers

def bubble_fraction(p: int, m: int, v: int = 1) -> float:
    """(p - 1) / (v m): the idle fraction of equal stages (GPipe/1F1B for v = 1, interleaved)."""
    p, m, v = posint(p, "p"), posint(m, "m"), posint(v, "v")
    return (p - 1) / (v * m)


def _fits(mem: float, budget) -> bool:
    return budget is None or mem <= budget * (1.0 + _MEM_RTOL)


def _gib(x: float) -> str:
    return f"{x / _GIB:.4g} GiB"


def _arrays(time, static_mem, act_mem, boundary):
    def arr(x, name, length):
        a = np.asarray(x, dtype=float).reshape(-1)
        if a.size != length:
            raise ValueError(f"{name} has {a.size} entries, expected {length}")
        if not np.all(np.isfinite(a)) or (a < 0).any():
            raise ValueError(f"{name} must be finite and >= 0")
        return a
    t = np.asarray(time, dtype=float).reshape(-1)
    n = t.size
    if n == 0:
        raise ValueError("there are no units to cut into pipeline stages")
    t = arr(t, "time", n)
    w = arr(static_mem, "static_mem", n)
    a = arr(act_mem, "act_mem", n)
    c = np.zeros(n - 1) if boundary is None else arr(boundary, "boundary (one entry per gap between "
                                                                "units, n - 1)", n - 1)
    return t, w, a, c


def _setup(time, static_mem, act_mem, boundary, p, m, v, schedule):
    p, m, v = posint(p, "p"), posint(m, "m"), posint(v, "v")
    check_schedule(schedule, v)
    t, w, a, c = _arrays(time, static_mem, act_mem, boundary)
    n, S = t.size, p * v
    if n < S:
        raise ValueError(
            f"pp*v = {p}*{v} = {S} pipeline stages need at least {S} units to cut, but the model has "
            f"only {n} units (embedding, {max(n - 2, 0)} blocks, head); use at most {n} stages "
            f"(a smaller pp or v) or a deeper model")
    return t, w, a, c, p, m, v, S


# --------------------------------------------------------------------------- evaluation

def evaluate_cut(bounds, time, static_mem, act_mem, boundary, *, p, m, v=1,
                 schedule="1F1B") -> StageCut:
    """Stage times, per-rank memory and predicted step time of a given cut (see module doc)."""
    t, w, a, c, p, m, v, S = _setup(time, static_mem, act_mem, boundary, p, m, v, schedule)
    n = t.size
    bounds = tuple((int(b), int(e)) for b, e in bounds)
    if len(bounds) != S:
        raise ValueError(f"the cut has {len(bounds)} stages; p*v = {p}*{v} = {S} are needed")
    prev = 0
    for s, (b, e) in enumerate(bounds):
        if b != prev or e <= b:
            raise ValueError(f"stage {s} = [{b}, {e}) breaks the cut: stages must be non-empty, "
                             f"consecutive unit ranges starting at unit 0 (expected start {prev})")
        prev = e
    if prev != n:
        raise ValueError(f"the cut ends at unit {prev}, but the model has {n} units")
    f = inflight_microbatches(p, m, v, schedule)
    times, mem = [], [0.0] * p
    for s, (b, e) in enumerate(bounds):
        times.append(math.fsum(t[b:e]) + (float(c[b - 1]) if s > 0 else 0.0))
        mem[s % p] += math.fsum(w[b:e]) + f[s] * math.fsum(a[b:e])
    return StageCut(bounds, tuple(times), tuple(mem), pipeline_time(times, p, m, v))


# --------------------------------------------------------------------------- v = 1: sweep + DP

class _Prefix:
    def __init__(self, t, w, a, c):
        n = t.size
        self.n = n
        self.P = np.concatenate([[0.0], np.cumsum(t)])
        self.W = np.concatenate([[0.0], np.cumsum(w)])
        self.A = np.concatenate([[0.0], np.cumsum(a)])
        self.cb = np.concatenate([[0.0], c, [0.0]])          # boundary charged to a stage starting at b
        idx = np.arange(n + 1)
        self.valid = idx[None, :] > idx[:, None]              # [b, e) with e > b
        self.seg_t = np.where(self.valid, self.P[None, :] - self.P[:, None] + self.cb[:, None], np.inf)
        self.seg_w = self.W[None, :] - self.W[:, None]
        self.seg_a = self.A[None, :] - self.A[:, None]


def _stage_masks(pre, f, budget):
    """Per stage s: segment times where the segment is allowed as stage s (memory), else inf."""
    out = np.empty((len(f),) + pre.seg_t.shape)
    for s, fs in enumerate(f):
        ok = pre.valid.copy()
        if budget is not None:
            ok &= pre.seg_w + fs * pre.seg_a <= budget * (1.0 + _MEM_RTOL)
        out[s] = np.where(ok, pre.seg_t, np.inf)
    return out


def _backtrack(args, n: int, S: int) -> tuple[tuple[int, int], ...]:
    """Stage bounds from a DP's argmin tables: args[s - 1][e] is where stage s starts if it ends at e."""
    bounds, e = [], n
    for s in range(S - 1, 0, -1):
        b = int(args[s - 1][e])
        bounds.append((b, e))
        e = b
    bounds.append((0, e))
    return tuple(reversed(bounds))


def _dp_min_sum(base, n, B):
    """min sum_s T_s with every stage allowed and T_s <= B; returns (value, bounds) or (inf, None)."""
    S = base.shape[0]
    cost = base if B == np.inf else np.where(base <= B, base, np.inf)
    cur = cost[0, 0].copy()
    cols = np.arange(n + 1)
    args = []
    for s in range(1, S):
        tot = cur[:, None] + cost[s]
        arg = tot.argmin(axis=0)
        cur = tot[arg, cols]
        args.append(arg)
    val = cur[n]
    if not np.isfinite(val):
        return np.inf, None
    return float(val), _backtrack(args, n, S)


def _search_v1(pre, f, budget, m):
    n = pre.n
    base = _stage_masks(pre, f, budget)
    g_inf, cut_inf = _dp_min_sum(base, n, np.inf)
    if cut_inf is None:
        return None
    T = pre.seg_t

    def price(bounds):
        times = [float(T[b, e]) for b, e in bounds]
        return sum(times) + (m - 1) * max(times)

    best_cut, best = cut_inf, price(cut_inf)
    if m == 1:
        return best_cut
    cand = np.unique(base[np.isfinite(base)])
    lo, hi = 0, cand.size - 1                     # smallest feasible candidate (hi is feasible)
    while lo < hi:
        mid = (lo + hi) // 2
        if _dp_min_sum(base, n, cand[mid])[1] is None:
            lo = mid + 1
        else:
            hi = mid
    for B in cand[lo:]:
        if g_inf + (m - 1) * B >= best:
            break
        val, bounds = _dp_min_sum(base, n, B)
        if bounds is not None:
            fb = price(bounds)
            if fb < best:
                best, best_cut = fb, bounds
    return best_cut


def _min_peak_v1(pre, f):
    """min over cuts of max_s mem_s (v = 1): a min-max DP. Returns (peak, bounds)."""
    n, S = pre.n, len(f)
    mem = np.where(pre.valid[None], pre.seg_w[None] + np.asarray(f, float)[:, None, None] * pre.seg_a[None],
                   np.inf)
    cur = mem[0, 0].copy()
    cols = np.arange(n + 1)
    args = []
    for s in range(1, S):
        tot = np.maximum(cur[:, None], mem[s])
        arg = tot.argmin(axis=0)
        cur = tot[arg, cols]
        args.append(arg)
    return float(cur[n]), _backtrack(args, n, S)


# --------------------------------------------------------------------------- v > 1: branch and bound

def _water_level(vals, work):
    """Smallest L with sum_i max(0, L - vals_i) >= work (vals non-empty, work >= 0)."""
    vs = sorted(vals)
    acc = 0.0
    for i, x in enumerate(vs):
        acc += x
        L = (acc + work) / (i + 1)
        if i + 1 == len(vs) or L <= vs[i + 1]:
            return L
    return vs[-1]


def _count_level(loads, count, quantum, caps=None):
    """Smallest L such that ``count`` items of size >= ``quantum`` can be given to bins already
    holding ``loads``, bin i taking at most caps[i] (None: no cap), with no bin above L: min over
    integers 0 <= k_i <= caps_i, sum k_i = count, of max_i(loads_i + k_i quantum), less 1e-9 quantum
    so that rounding never overshoots (inf if the caps cannot hold count).
    Without caps: at the water level Lw of count * quantum each bin below Lw holds
    floor((Lw - load_i) / quantum) items; every further item raises one of those bins to its next
    multiple, the smallest first. With caps: a bin that would take more than its cap at that level
    takes its cap (it would at any higher level too) and leaves the level to the others."""
    top = max(loads)
    bins = list(zip(loads, caps if caps is not None else [math.inf] * len(loads)))
    while count > 0 and bins:
        xs = [x for x, _ in bins]
        level = _water_level(xs, count * quantum)
        steps = [math.floor((level - x) / quantum + 1e-9) if x <= level else 0 for x in xs]
        need = count - sum(steps)
        if need > 0:
            nxt = sorted(x + (k + 1) * quantum for x, k in zip(xs, steps) if x <= level)
            level = nxt[min(need, len(nxt)) - 1]
        taken = [math.floor((level - x) / quantum + 1e-9) if x <= level else 0 for x in xs]
        over = [k > c for (_, c), k in zip(bins, taken)]
        if not any(over):
            return max(top, level - 1e-9 * quantum)
        count -= sum(c for (_, c), o in zip(bins, over) if o)
        bins = [bin_ for bin_, o in zip(bins, over) if not o]
    return top if count <= 0 else math.inf


def _rate_level(loads, units, count):
    """Smallest L with sum_i max(0, L - loads_i) / units_i >= count (units_i > 0): bins that take
    items of size units_i, filled as a fluid, less 1e-9 of the smallest unit for rounding."""
    order = sorted(range(len(loads)), key=loads.__getitem__)
    num = den = 0.0
    for k, i in enumerate(order):
        num += loads[i] / units[i]
        den += 1.0 / units[i]
        level = (count + num) / den
        if k + 1 == len(order) or level <= loads[order[k + 1]]:
            return level - 1e-9 * min(units)
    return level


def _suffix_tables(P, cb, S):
    """(tb, ms): tb[b][k] the least slowest stage and ms[b][k] the least sum of stage times over cuts
    of units [b, n) into k stages, stage [b, e) taking P[e] - P[b] + cb[b] (a DP over k, each step
    one numpy min over the stage's end)."""
    n = len(P) - 1
    ends = np.arange(n + 1)
    seg = np.asarray(P)[None, :] - np.asarray(P)[:, None] + np.asarray(cb)[:n + 1, None]   # seg[b, e]
    seg[ends[None, :] <= ends[:, None]] = np.inf   # a stage holds at least one unit
    tb, ms = np.full((S + 1, n + 1), np.inf), np.full((S + 1, n + 1), np.inf)
    tb[0, n] = ms[0, n] = 0.0
    for k in range(1, S + 1):
        tb[k] = np.min(np.maximum(seg, tb[k - 1][None, :]), axis=1)
        ms[k] = np.min(seg + ms[k - 1][None, :], axis=1)
    return tb.T.tolist(), ms.T.tolist()


class _BB:
    """Depth-first branch and bound over cuts for v > 1 (see module doc)."""

    def __init__(self, t, w, a, c, p, m, v, f, budget, mode):
        self.n, self.p, self.m, self.v, self.S = t.size, p, m, v, p * v
        n, S = self.n, self.S
        self.P = [0.0] + np.cumsum(t).tolist()
        self.W = [0.0] + np.cumsum(w).tolist()
        self.A = [0.0] + np.cumsum(a).tolist()
        self.cb = [0.0] + [float(x) for x in c] + [0.0]
        self.f = list(f)
        # G[s][e] = W[e] + f(s) A[e]: mem(s, b, e) = G[s][e] - G[s][b], non-decreasing in e
        self.G = [(np.asarray(self.W) + fs * np.asarray(self.A)).tolist() for fs in self.f]
        self.budget = None if budget is None else budget * (1.0 + _MEM_RTOL)
        self.mode = mode                       # "time": min step s.t. memory; "memory": min max mem_r
        # ranks that still receive a stage when stages s..S-1 remain
        self.open = [sorted({q % p for q in range(s, S)}) for s in range(S + 1)]
        self.all_open = [len(o) == p for o in self.open]   # every rank: its loads are the list itself
        self.keyed_memory = budget is not None or mode == "memory"
        self.last = [n - (S - 1 - s) for s in range(S)]
        # mm[s][e]: least total memory stages s..S-1 can have when they cover units [e, n)
        mm = np.full((S + 1, n + 1), np.inf)
        mm[S, n] = 0.0
        ends = np.arange(n + 1)
        for q in range(S - 1, -1, -1):   # mm[q][b] = min over b < e <= last[q] of G[q][e] - G[q][b] + mm[q + 1][e]
            G = np.asarray(self.G[q])
            room = np.where(ends <= self.last[q], G + mm[q + 1], np.inf)
            after = np.minimum.accumulate(room[::-1])[::-1]   # after[e]: the least of room[e:]
            mm[q, q:self.last[q]] = after[q + 1:self.last[q] + 1] - G[q:self.last[q]]
        self.mm = mm.tolist()
        # the counting bound (module doc): units 1..n-2 at least tq[e] seconds and mq[e] bytes each
        # from unit e on; every stage after the first pays at least cq[e] to enter; stage 0 always
        # holds unit 0 and stage S - 1 unit n - 1, so those two are placed before the rest is counted
        inner = range(1, n - 1)
        self.tq, self.wq, self.aq, self.cq = ([math.inf] * (n + 1) for _ in range(4))
        for e in range(n - 1, -1, -1):
            u = e if e in inner else None
            self.tq[e] = min(self.tq[e + 1], float(t[u]) if u is not None else math.inf)
            self.wq[e] = min(self.wq[e + 1], float(w[u]) if u is not None else math.inf)
            self.aq[e] = min(self.aq[e + 1], float(a[u]) if u is not None else math.inf)
            self.cq[e] = min(self.cq[e + 1], self.cb[e] if 1 <= e <= n - 1 else math.inf)
        self.fixed_t = (float(t[0]), float(t[n - 1]))
        self.fixed_m = (float(w[0] + self.f[0] * a[0]), float(w[n - 1] + self.f[S - 1] * a[n - 1]))
        self.entries = [[sum(1 for q in range(max(s, 1), S) if q % p == r) for r in range(p)]
                        for s in range(S + 1)]
        # forced[s][r]: rank r's stages among s..S-1 that hold neither the first nor the last unit
        # (each takes one of the others); forced_f[s][r]: their microbatches in flight, summed
        held = [[q for q in range(max(s, 1), S - 1) if q % p == r] for s in range(S + 1) for r in range(p)]
        self.forced = [[len(held[s * p + r]) for r in range(p)] for s in range(S + 1)]
        self.forced_f = [[sum(self.f[q] for q in held[s * p + r]) for r in range(p)] for s in range(S + 1)]
        # fq[s][r]: the fewest microbatches in flight among rank r's stages s..S-1 (inf: none left)
        self.fq = [[min((self.f[q] for q in range(s, S) if q % p == r), default=math.inf) for r in range(p)]
                   for s in range(S + 1)]
        if mode == "time":
            self.tb, self.ms = _suffix_tables(self.P, self.cb, S)
        # slack for the relaxations (prefix-sum rounding) and quanta for recognising repeated states
        self.t_eps = 1e-12 * max(self.P[n] + sum(self.cb), 1e-300)
        self.m_eps = 1e-12 * max(self.W[n] + max(self.f) * self.A[n], 1e-300)
        self.best = math.inf
        self.bar = math.inf                    # a bound at or above this cannot beat best (_BB_RTOL)
        self.best_cut = None
        self.nodes = 0
        self.work = 0                          # partial cuts priced
        self.seen = set()
        self.complete = True
        self.open_lb = math.inf               # smallest bound left unexplored when the search stops

    def seg_t(self, b, e):
        return self.P[e] - self.P[b] + self.cb[b]

    def offer(self, bounds):
        """Price a complete cut and keep it if better."""
        R = [0.0] * self.p
        M = [0.0] * self.p
        mt = 0.0
        for s, (b, e) in enumerate(bounds):
            x = self.seg_t(b, e)
            R[s % self.p] += x
            M[s % self.p] += self.G[s][e] - self.G[s][b]
            mt = max(mt, x)
        if self.budget is not None and max(M) > self.budget and self.mode == "time":
            return
        val = self.m * max(R) + (self.p - 1) * mt if self.mode == "time" else max(M)
        if val < self.best:
            self.best, self.best_cut = val, tuple(bounds)
            self.bar = val * (1.0 - _BB_RTOL)

    def reachable(self, s, e, capt, capm):
        """Relaxation: can stages s..S-1 cover [e, n) if stage q may use up to capt[r(q)] seconds
        (boundary costs left out) and capm[r(q)] bytes each (a rank's stages not sharing)? Greedy
        furthest reach answers it when every stage may take any unit, and it is tried first; where a
        stage could not take the unit the greedy leaves it, a shorter reach before may have spared it
        that unit, so a False is checked over every end each stage can reach (``_covers``)."""
        b = e
        for q in range(s, self.S):
            hi = self._reach(q, b, capt, capm)
            if hi <= b:
                return self._covers(s, e, capt, capm)
            b = hi
        return b == self.n

    def _reach(self, q, b, capt, capm):
        """The furthest end stage q, starting at unit b, may reach within its rank's caps and the
        units the later stages need."""
        r, hi = q % self.p, self.last[q]
        if capt is not None:
            hi = min(hi, bisect_right(self.P, self.P[b] + capt[r] + self.t_eps, b, hi + 1) - 1)
        if capm is not None:
            G = self.G[q]
            hi = min(hi, bisect_right(G, G[b] + capm[r] + self.m_eps, b, hi + 1) - 1)
        return hi

    def _covers(self, s, e, capt, capm):
        """``reachable`` exactly: the set of ends each stage can reach, stage by stage; end x is
        reachable by stage q if some end b < x of the stages before is at least the first start
        from which [b, x) is within q's caps (both caps fall as the start moves right)."""
        ends = [e]
        for q in range(s, self.S):
            r, G = q % self.p, self.G[q]
            nxt, i, below = [], 0, -1
            for x in range(ends[0] + 1, self.last[q] + 1):
                while i < len(ends) and ends[i] < x:
                    below, i = ends[i], i + 1
                start = 0
                if capt is not None:
                    start = bisect_left(self.P, self.P[x] - capt[r] - self.t_eps, 0, x)
                if capm is not None:
                    start = max(start, bisect_left(G, G[x] - capm[r] - self.m_eps, 0, x))
                if below >= start:
                    nxt.append(x)
            if not nxt:
                return False
            ends = nxt
        return ends[-1] == self.n

    def _counted(self, s, e, loads, timed):
        """(the open ranks' loads, units left to give out) once every unit that must land on a known
        rank is there: the first unit (stage 0) if e = 0, the last (stage S - 1), and one of the
        others (at least tq[e] seconds, or wq[e] + f(q) aq[e] bytes) in each other stage q >= s;
        for time, each stage entered also costs at least cq[e]."""
        x = list(loads)
        fixed = self.fixed_t if timed else self.fixed_m
        if e == 0:
            x[0] += fixed[0]
        x[(self.S - 1) % self.p] += fixed[1]
        count = self.n - 1 - max(e, 1)
        if count > 0:
            if timed:
                x = [xr + k * self.cq[e] + j * self.tq[e]
                     for xr, k, j in zip(x, self.entries[s], self.forced[s])]
            else:
                x = [xr + j * self.wq[e] + fs * self.aq[e]
                     for xr, j, fs in zip(x, self.forced[s], self.forced_f[s])]
            count -= sum(self.forced[s])
        return [x[r] for r in self.open[s]], count

    def time_counted(self, s, e, R, caps=None):
        """The counting bound on the busiest rank's work: the units still free to move, each at
        least tq[e] seconds, given out whole (at most caps[i] to the i-th open rank, where memory
        limits them)."""
        x, count = self._counted(s, e, R, True)
        if count <= 0:
            return max(x)
        return _count_level(x, count, self.tq[e], caps)

    def memory_caps(self, s, e, M, cap):
        """How many of the units still free to move each open rank can take without exceeding cap
        bytes (on rank r each takes at least wq + fq[s][r] aq: its fewest microbatches in flight
        among r's stages to come), in open[s]'s order; None when they cannot all be placed: no
        completion fits cap."""
        x, count = self._counted(s, e, M, False)
        if max(x) > cap:
            return None
        if count <= 0 or cap == math.inf:
            return [max(count, 0)] * len(x)
        caps = []
        for r, xr in zip(self.open[s], x):
            unit = self.wq[e] + self.fq[s][r] * self.aq[e]
            caps.append(count if unit <= 0 else min(count, math.floor((cap - xr) / unit + 1e-9)))
        return caps if sum(caps) >= count else None

    def memory_level(self, s, e, M):
        """A lower bound on the fullest open rank's final memory: the units still free to move
        spread as a fluid, rank r's at wq + fq[s][r] aq bytes each."""
        x, count = self._counted(s, e, M, False)
        if count <= 0:
            return max(x)
        units = [self.wq[e] + self.fq[s][r] * self.aq[e] for r in self.open[s]]
        if min(units) <= 0:
            return max(x)
        return max(max(x), _rate_level(x, units, count))

    def stage_floor(self, s, e, counted, caps):
        """A lower bound on the slowest stage that memory forces: the free units the other open ranks
        cannot take (``caps``, in open[s]'s order) land on rank r, need_r = count - sum of the others'
        caps; r's stages to come hold them at wq + f(q) aq bytes each within r's headroom, so the
        fullest of them holds at least the least Y for which giving up to Y to each, fewest
        microbatches in flight first, fits; it then runs at least Y tq seconds beyond the least base
        of r's stages (tq + cq for one holding a unit of the others, the last unit's t + cq for
        stage S - 1, the first unit's t for stage 0). ``counted``: ``_counted`` of the ranks' bytes."""
        x, count = counted
        if count <= 0:
            return 0.0
        total, tq, aq, wq, S, p = sum(caps), self.tq[e], self.aq[e], self.wq[e], self.S, self.p
        best = 0.0
        for i, r in enumerate(self.open[s]):
            need = count - (total - caps[i])
            if need <= 0:
                continue
            stages = range(s + (r - s) % p, S, p)
            costs = sorted(wq + self.f[q] * aq for q in stages)
            room = self.budget - x[i]
            lo, hi = -(-need // len(costs)), need
            while lo < hi:   # the least Y whose cheapest-first fill of need units fits room
                mid = (lo + hi) // 2
                left, used = need, 0.0
                for cost in costs:
                    take = min(mid, left)
                    used += take * cost
                    left -= take
                if used <= room:
                    hi = mid
                else:
                    lo = mid + 1
            base = min((self.fixed_t[1] if q == S - 1 else tq if q else self.fixed_t[0]) + (self.cq[e] if q else 0.0)
                       for q in stages)
            best = max(best, base + lo * tq)
        return best

    def step_floor(self, s, e, R, M, caps, lr, bt):
        """The least m L + (p - 1) max(bt, slowest stage) over the busiest rank's work L >= lr: at work
        L, rank r takes at most floor((L - R'_r) / tq) of the free units besides its memory cap, so
        the others leave more to each rank and ``stage_floor`` rises as L falls. The minimum is at lr
        or where some rank's time cap steps up, tried in order while m L alone stays below it."""
        m, p = self.m, self.p
        x, count = self._counted(s, e, R, True)
        held = self._counted(s, e, M, False)   # the same at every level
        tq = self.tq[e]

        def at(level):
            timed = [min(c, max(0, math.floor((level - xr) / tq + 1e-9))) for c, xr in zip(caps, x)]
            return m * level + (p - 1) * max(bt, self.stage_floor(s, e, held, timed))
        best = at(lr)
        if count <= 0 or tq <= 0:
            return best
        steps = [max(0, math.floor((lr - xr) / tq + 1e-9)) + 1 for xr in x]
        while True:
            i = min(range(len(x)), key=lambda j: x[j] + steps[j] * tq)
            level = x[i] + steps[i] * tq
            if m * level + (p - 1) * bt >= best or steps[i] > caps[i]:
                return best
            best = min(best, at(level))
            steps[i] += 1

    def bound(self, s, e, R, M, mt):
        """Lower bound after stages 0..s-1 (the last ends at unit e); inf if ruled out."""
        p, k = self.p, self.S - s
        if k == 0:
            return self.m * max(R) + (p - 1) * mt if self.mode == "time" else max(M)
        openr, every = self.open[s], self.all_open[s]
        rem_mem = self.mm[s][e]
        if self.mode == "memory":
            lb = max(max(M), _water_level(M if every else [M[r] for r in openr], rem_mem),
                     self.memory_level(s, e, M))
            if lb >= self.bar:
                return lb
            if self.memory_caps(s, e, M, self.best) is None:
                return math.inf
            if self.best < math.inf and not self.reachable(s, e, None, [self.best - x for x in M]):
                return math.inf
            return lb
        capm = caps = None
        if self.budget is not None:
            if rem_mem > sum(self.budget - M[r] for r in openr):
                return math.inf
            caps = self.memory_caps(s, e, M, self.budget)
            if caps is None:
                return math.inf
            capm = [self.budget - x for x in M]
        lr = max(max(R), _water_level(R if every else [R[r] for r in openr], self.ms[e][k]),
                 self.time_counted(s, e, R, caps))
        bt = max(mt, self.tb[e][k])
        lb = self.m * lr + (p - 1) * bt
        if caps is not None and p > 1 and lb < self.bar:
            lb = self.step_floor(s, e, R, M, caps, lr, bt)
        if lb >= self.bar:
            return lb
        capt = None
        if self.best < math.inf:
            c_max = (self.best - (p - 1) * bt) / self.m
            b_max = (self.best - self.m * lr) / (p - 1) if p > 1 else math.inf
            capt = [min(c_max - x, b_max) for x in R]
        if (capt is not None or capm is not None) and not self.reachable(s, e, capt, capm):
            return math.inf
        return lb

    def key(self, s, b, R, M, mt):
        qt, qm = self.t_eps, self.m_eps
        km = tuple([round(x / qm) for x in M]) if self.keyed_memory else ()
        return (s, b, tuple([round(x / qt) for x in R]), km, round(mt / qt))

    def dfs(self, s, b, R, M, mt):
        if s == self.S:
            self.offer(self.path)
            return
        self.nodes += 1
        if self.work > self.limit:
            self.complete = False
            return
        key = self.key(s, b, R, M, mt)
        if key in self.seen:
            return
        self.seen.add(key)
        r = s % self.p
        G = self.G[s]
        first = self.n if s == self.S - 1 else b + 1           # the last stage ends at unit n
        kids = []
        timed = self.mode == "time"
        P, Pb, cbb, Gb = self.P, self.P[b], self.cb[b], G[b]
        for e in range(first, self.last[s] + 1):
            x = P[e] - Pb + cbb
            mm = M[r] + (G[e] - Gb)
            # both grow with e: once over, every later e is too
            if self.budget is not None and mm > self.budget:
                break
            if (self.m * (R[r] + x) + (self.p - 1) * max(mt, x) if timed else mm) >= self.best:
                break
            self.work += 1
            R2 = R.copy(); R2[r] += x
            M2 = M.copy(); M2[r] = mm
            mt2 = mt if mt >= x else x
            lb = self.bound(s + 1, e, R2, M2, mt2)
            if lb < self.bar:
                kids.append((lb, e, R2, M2, mt2))
        kids.sort(key=lambda k: (k[0], k[1]))
        for lb, e, R2, M2, mt2 in kids:
            if lb >= self.bar:
                break
            self.path.append((b, e))
            self.dfs(s + 1, e, R2, M2, mt2)
            self.path.pop()
            if not self.complete:        # this kid's subtree and the later kids are left unexplored
                self.open_lb = min(self.open_lb, lb)
                break

    def score(self, cuts):
        """Local-search score of the cut given by its S - 1 cut positions (smaller is better):
        over budget first by memory, then the objective, then the sorted loads (to leave plateaus)."""
        p, n, P, cb, G = self.p, self.n, self.P, self.cb, self.G
        R = [0.0] * p
        M = [0.0] * p
        T = []
        b = 0
        for s, e in enumerate([*cuts, n]):
            x = P[e] - P[b] + cb[b]
            r = s % p
            R[r] += x
            M[r] += G[s][e] - G[s][b]
            T.append(x)
            b = e
        Ms = sorted(M, reverse=True)
        if self.mode == "memory":
            return (0, Ms[0], Ms)
        if self.budget is not None and Ms[0] > self.budget:
            return (1, Ms[0], Ms)
        Rs = sorted(R, reverse=True)
        return (0, self.m * Rs[0] + (p - 1) * max(T), Rs, sorted(T, reverse=True))

    def improve(self, bounds):
        """Hill climbing: shift a run of consecutive cut positions i..j together by 1 or 2 units
        (a unit moves from stage i to stage j + 1, or back) while the score improves."""
        cuts = [e for _, e in bounds[:-1]]
        k = len(cuts)
        cur = self.score(cuts)
        for _ in range(20 * self.n):
            moved = False
            for i in range(k):
                lo = cuts[i - 1] if i else 0
                for j in range(i, k):
                    hi = cuts[j + 1] if j + 1 < k else self.n
                    for d in (-1, 1, -2, 2):
                        if not (lo < cuts[i] + d and cuts[j] + d < hi):
                            continue
                        trial = cuts[:i] + [x + d for x in cuts[i:j + 1]] + cuts[j + 1:]
                        sc = self.score(trial)
                        if sc < cur:
                            cur, cuts, moved = sc, trial, True
                            break
                    if moved:
                        break
                if moved:
                    break
            if not moved:
                break
        edges = [0] + cuts + [self.n]
        return tuple(zip(edges[:-1], edges[1:]))

    def run(self, seeds=()):
        """The best cut (None if none fits): the branch and bound from the seeds for FIRST_LOOK partial
        cuts; if that does not settle it, the seeds and the best cut found hill-climbed, and the
        search again from the start with that incumbent, up to SEARCH_LIMIT (most searches finish
        in the first look, where climbing would cost more than the search; the rest find their
        optimum sooner from a climbed incumbent)."""
        seeds = [cut for cut in seeds if cut is not None]
        for cut in seeds:
            self.offer(cut)
        self._search(FIRST_LOOK)
        if not self.complete:
            for cut in [*seeds, self.best_cut]:
                if cut is not None:
                    self.offer(self.improve(cut))
            self.complete, self.seen, self.open_lb = True, set(), math.inf
            self._search(SEARCH_LIMIT)
        return self.best_cut

    def _search(self, limit):
        """The depth-first search from the root, stopping once ``limit`` partial cuts are priced."""
        self.limit = limit
        zero = [0.0] * self.p
        if self.bound(0, 0, zero, zero, 0.0) < self.bar:
            self.path = []
            self.dfs(0, 0, list(zero), list(zero), 0.0)

    def gap(self):
        """Proven relative gap of the best cut (0 when the search completed)."""
        if self.complete:
            return 0.0
        if self.best == math.inf:
            return math.inf
        return max(0.0, (self.best - self.open_lb) / self.best)


def _seeds_v(pre, p, m, v, f):
    """Cuts to start the branch and bound from (hill-climbed if the first look does not settle it): the
    min-sum DP without memory (balanced stage times) and the per-stage min-max memory DP. The v = 1
    sweep was a third: it cost more than the searches it seeded, which complete from these."""
    S = p * v
    base = _stage_masks(pre, [1] * S, None)
    return [_dp_min_sum(base, pre.n, np.inf)[1], _min_peak_v1(pre, f)[1]]


# --------------------------------------------------------------------------- public search

def _min_peak(t, w, a, c, p, m, v, f):
    """(peak, bounds, lower bound) of min over cuts of max_r mem_r."""
    pre = _Prefix(t, w, a, c)
    if v == 1:
        peak, bounds = _min_peak_v1(pre, f)
        return peak, bounds, peak
    bb = _BB(t, w, a, c, p, m, v, f, None, "memory")
    bounds = bb.run([_min_peak_v1(pre, f)[1]])
    return bb.best, bounds, bb.best * (1.0 - bb.gap())


def min_peak_memory(time, static_mem, act_mem, boundary, *, p, m, v=1, schedule="1F1B"):
    """(min over cuts of max_r mem_r, a cut reaching it): the least per-rank memory budget that
    any cut fits in. For v > 1 a search that hits SEARCH_LIMIT returns the best cut found."""
    t, w, a, c, p, m, v, S = _setup(time, static_mem, act_mem, boundary, p, m, v, schedule)
    peak, bounds, _ = _min_peak(t, w, a, c, p, m, v, inflight_microbatches(p, m, v, schedule))
    return peak, bounds


# the answers of cut_stages by their plain inputs (the units' floats and the knobs), newest last: the
# mesh search asks again for cuts it priced (a ZeRO stage or schedule variant that leaves a mesh's
# unit costs and budget as they were), and a search that stops at SEARCH_LIMIT costs seconds
_CUTS: dict[tuple, StageCut | BudgetMissed] = {}
_CUTS_KEPT = 1024


def cut_stages(time, static_mem, act_mem, boundary, *, p, m, v=1, schedule="1F1B",
               memory_budget=None) -> StageCut:
    """The cut with the smallest predicted step time whose every rank fits memory_budget (bytes).
    Pure in its inputs: an answer (or refusal) is kept by their values and given again."""
    key = (*(tuple(np.asarray(x, dtype=float).ravel().tolist()) for x in (time, static_mem, act_mem, boundary)),
           p, m, v, schedule, memory_budget)
    answer = _CUTS.get(key)
    if answer is None:
        try:
            answer = _cut_stages(time, static_mem, act_mem, boundary, p=p, m=m, v=v, schedule=schedule,
                                 memory_budget=memory_budget)
        except BudgetMissed as e:
            answer = e
        if len(_CUTS) >= _CUTS_KEPT:
            del _CUTS[next(iter(_CUTS))]
        _CUTS[key] = answer
    if isinstance(answer, BudgetMissed):
        raise BudgetMissed(answer._answer)   # the kept refusal's message and cut, found once
    return answer


def _cut_stages(time, static_mem, act_mem, boundary, *, p, m, v, schedule, memory_budget) -> StageCut:
    """``cut_stages``' search, once per inputs."""
    t, w, a, c, p, m, v, S = _setup(time, static_mem, act_mem, boundary, p, m, v, schedule)
    if memory_budget is not None:
        memory_budget = float(memory_budget)
        if not memory_budget >= 0:
            raise ValueError(f"memory_budget must be a number of bytes >= 0 or None, got {memory_budget!r}")
    f = inflight_microbatches(p, m, v, schedule)
    pre = _Prefix(t, w, a, c)
    gap, peaks = 0.0, []

    def least_peak():   # _min_peak's answer, searched once
        if not peaks:
            peaks.append(_min_peak(t, w, a, c, p, m, v, f))
        return peaks[0]
    if v == 1:
        bounds = _search_v1(pre, f, memory_budget, m)
    else:
        bb = _BB(t, w, a, c, p, m, v, f, memory_budget, "time")
        bounds = bb.run(_seeds_v(pre, p, m, v, f))
        if bounds is None and not bb.complete:       # gave up before finding a cut that fits
            peak, mcut, _ = least_peak()
            if _fits(peak, memory_budget):          # a cut fits: hill-climb it, no bound proven
                bb2 = _BB(t, w, a, c, p, m, v, f, memory_budget, "time")
                bb2.offer(mcut)
                bb2.offer(bb2.improve(mcut))
                bounds, gap = bb2.best_cut, math.inf
        else:
            gap = bb.gap()
    if bounds is None:
        def explain():
            need, least, low = least_peak()
            exact = need <= low * (1.0 + 1e-9)
            needs = (f"needs at least {_gib(need)} ({need:.6g} bytes) per rank" if exact else
                     f"needs {_gib(need)} ({need:.6g} bytes) per rank with the best cut found (no cut "
                     f"needs less than {_gib(low)})")
            return (f"the pipeline {needs} under {schedule} (pp={p}, v={v}, {m} microbatches), but the "
                    f"memory budget is {_gib(memory_budget)} ({memory_budget:.6g} bytes); use more "
                    f"pipeline stages, tensor parallelism or recompute", least)
        raise BudgetMissed(explain)
    cut = evaluate_cut(bounds, t, w, a, c, p=p, m=m, v=v, schedule=schedule)
    assert all(_fits(x, memory_budget) for x in cut.rank_memory)
    return StageCut(cut.bounds, cut.stage_times, cut.rank_memory, cut.step_time, gap)
