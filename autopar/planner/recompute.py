"""Where to recompute: the recompute regions per mode, and recompute="auto"'s choice per block.

A mode's regions (``regions_for``): none; Megatron's selective recompute, each block's attention
core; full, each block's ops. ``recompute="auto"`` picks per block none / selective / full with the
smallest recompute time that brings every rank under the memory budget, each rank's peak the
memory model's (``cost_model.memory``: the one sum), by an ILP over the blocks
(``autopar.planner.ilp``), or, where the blocks come in a few kinds as a GPT's do, exactly by how
many of each kind take each mode (``_by_counts``, without the solver), or says the smallest peak
any choice reaches.
"""
from __future__ import annotations

import functools

from autopar.cost_model.activations import attention_core, kept_bytes
from autopar.cost_model.context import context_memory
from autopar.cost_model.memory import all_ops, memory
from autopar.cost_model.repeats import shifted
from autopar.cost_model.step import recompute_seconds
from autopar.planner.ilp import InfeasibleError, solve_strategies
from autopar.errors import PlanError
from autopar.graph.capture import graph_cached
from autopar.graph.units import find_blocks

MODES = ("none", "selective", "full")


def regions_for(cap, mode: str) -> list[list]:
    """The recompute regions of every block for one mode (global nodes)."""
    if mode == "none":
        return []
    blocks = find_blocks(cap) or []
    if not blocks:
        raise PlanError(f"recompute={mode!r} works per repeated block, and this model has none")
    if mode == "selective":
        return [attention_core(b) for b in blocks if attention_core(b)]
    return [[n for n in b if n.op == "call_function"] for b in blocks]


@functools.lru_cache(maxsize=4096)
def block_modes(costs: tuple, mems: tuple, budget: float) -> tuple[int, ...] | None:
    """Per block the index (in ``MODES``) of its recompute mode: minimise sum_k costs[k][x_k]
    subject to sum_k mems[k][x_k] <= budget (the strategy ILP of ``autopar.planner.ilp`` with
    no edges); None when no choice fits. A pure function of its inputs, kept per inputs: the
    stages of one length in the middle of a pipeline, and the same stage on the meshes and ZeRO
    stages that share its figures, ask the same question.

    Where recomputing nothing fits and costs strictly less than any recompute in every block, that
    is the one optimum, which the ILP returns: it is answered without the solver (the stages
    that fit as they are, beside one that does not, ask it). Where the budget leaves one choice or
    none, clear of the solver's feasibility tolerance, that is the answer too (``_only_fit``)."""
    if sum(m[0] for m in mems) <= budget and all(c[0] < min(c[1:]) for c in costs):
        return (0,) * len(costs)
    only = _only_fit(mems, budget)
    if only is not False:
        return only
    counted = _by_counts(costs, mems, budget)
    if counted is not False:
        return counted
    try:
        return tuple(solve_strategies(list(costs), [], node_memory=list(mems), memory_budget=budget).choice)
    except InfeasibleError:
        return None


_PAIRS = 200_000   # the most pairs of two Pareto sets ``_by_counts`` merges before it leaves the question to the ILP


def _by_counts(costs: tuple, mems: tuple, budget: float):
    """``block_modes``' answer, exactly, where the blocks come in few kinds (a GPT's blocks share their
    figures): within a kind only how many blocks take each mode matters, so each kind's counts are
    priced, (memory, seconds) Pareto-pruned and merged kind by kind; the least seconds that fit,
    then the least memory. Each kind gives its first blocks the modes that recompute most: a
    block's recompute runs when its backward starts, and the blocks after it have freed what they
    kept by then, so the memory model's peak (with that transient) is least so. None where nothing
    fits; False (the ILP answers) where a merge would pass _PAIRS pairs, or where the answer is
    within ``_CLEAR`` of the budget and the solver's tolerances decide it (as ``_only_fit``)."""
    kinds: dict = {}
    for k, row in enumerate(zip(costs, mems)):
        kinds.setdefault(row, []).append(k)
    margin = _CLEAR * (max((abs(m) for row in mems for m in row), default=0.0) or 1.0)
    front = [(0.0, 0.0, ())]   # (memory, seconds, counts per kind), Pareto: memory up, seconds down
    for (cost, mem), members in kinds.items():
        options = [(sum(c * m for c, m in zip(counts, mem)), sum(c * t for c, t in zip(counts, cost)), counts)
                   for counts in _compositions(len(members), len(cost))]
        if len(front) * len(options) > _PAIRS:
            return False
        front = _pareto([(m0 + m1, t0 + t1, c0 + (c1,)) for m0, t0, c0 in front for m1, t1, c1 in options
                         if m0 + m1 <= budget + margin])
        if not front:
            return None
    clear = [x for x in front if x[0] <= budget - margin]
    if not clear or min(x[1] for x in clear) > front[-1][1]:
        return False   # the best is within the solver's tolerance of the budget: as the ILP answers it
    best = min(clear, key=lambda x: (x[1], x[0]))[2]
    modes = [0] * len(costs)
    for members, counts in zip(kinds.values(), best):
        it = iter(members)
        for mode in reversed(range(len(counts))):
            for _ in range(counts[mode]):
                modes[next(it)] = mode
    return tuple(modes)


def _compositions(total: int, parts: int):
    """Every tuple of ``parts`` counts >= 0 summing to ``total``."""
    if parts == 1:
        yield (total,)
        return
    for first in range(total + 1):
        for rest in _compositions(total - first, parts - 1):
            yield (first, *rest)


def _pareto(points: list) -> list:
    """The (memory, seconds, ...) points no other point beats in both, memory up (ties: least seconds)."""
    out = []
    for point in sorted(points, key=lambda x: (x[0], x[1])):
        if not out or point[1] < out[-1][1]:
            out.append(point)
    return out


# how far clear of the budget, relative to the largest figure (the ILP's scale for its memory row),
# ``_only_fit`` needs a choice to be: far above HiGHS's feasibility tolerances (1e-6 and below)
_CLEAR = 1e-4


def _only_fit(mems: tuple, budget: float):
    """``block_modes``' answer where the budget decides it alone: each block's least-memory mode when
    it fits and moving any block to another mode does not (the one feasible choice, so the optimum);
    None when even it does not fit; False when neither holds by ``_CLEAR`` (the solver decides)."""
    if not mems:
        return False
    margin = _CLEAR * (max(abs(m) for row in mems for m in row) or 1.0)
    least = [min(range(len(row)), key=row.__getitem__) for row in mems]
    floor = sum(row[i] for row, i in zip(mems, least))
    if floor > budget + margin:
        return None
    step = min(m - row[i] for row, i in zip(mems, least) for j, m in enumerate(row) if j != i)
    if floor <= budget - margin and step > 0 and floor + step > budget + margin:
        return tuple(least)
    return False


@graph_cached
def _block_ops(cap) -> tuple[list[tuple], list[tuple]]:
    """Per repeated block its ops (what it keeps is theirs) and its attention core, once per capture:
    every recompute choice asks for them."""
    blocks = find_blocks(cap) or []
    return [tuple(n for n in b if n.op == "call_function") for b in blocks], [tuple(attention_core(b)) for b in blocks]


def choose_recompute(cap, strategies, mesh, dev, *, zero: int, budget: float, microbatches: int = 1,
                     stage_nodes=None, inflight=None, offload: bool = False, kept=(), attention: str = "allgather",
                     offload_kept=()):
    """Per block the cheapest recompute mode (by recomputed forward time) fitting ``budget`` bytes on
    every rank (``stage_nodes`` and ``inflight`` as ``cost_model.memory.memory`` takes them, and
    ``offload``, ``offload_kept``, ``kept`` and cp's ``attention`` too; one stage by default). A block's choice moves
    only its own rank's memory, so each pipeline rank is its own ILP, over the blocks of its
    stages, each kept for the microbatches its stage holds in flight. A rank that no choice fits
    gets its blocks fully recomputed, the least memory any choice reaches: its peak stays above
    ``budget``, for the caller to report with the other choices it searched
    (``autopar.planner.choices.no_fit_error``)."""
    blocks = find_blocks(cap) or []
    if not blocks:
        raise PlanError("recompute='auto' works per repeated block, and this model has none")
    stage_nodes = stage_nodes or (all_ops(cap),)
    inflight = inflight or (1,) * len(stage_nodes)
    kw = dict(zero=zero, microbatches=microbatches, stage_nodes=stage_nodes, inflight=inflight, offload=offload,
              kept=kept, attention=attention, offload_kept=offload_kept)
    # the per-block ILP below adds each block's own activations to the fully recomputed peak, which
    # carries full recompute's backward transient: when nothing recomputed already fits, say so exactly
    if all(m.peak <= budget for m in memory(cap, strategies, mesh, regions=[], **kw)):
        return [], ["none"] * len(blocks)
    bases = memory(cap, strategies, mesh, regions=regions_for(cap, "full"), **kw)
    row = _block_rows(cap, strategies, mesh, dev, attention)
    chosen = {}
    held = [set(nodes) for nodes in stage_nodes]
    for r in range(min(mesh.pp, len(stage_nodes))):
        mine = [(k, inflight[s]) for s in range(r, len(stage_nodes), mesh.pp)
                for k, b in enumerate(blocks) if not held[s].isdisjoint(b)]
        if not mine:   # no block to recompute here: the rank fits as it is or not at all
            continue
        rows = [row(k) for k, _ in mine]
        # everything but the blocks' own activations (in flight as their stages hold them)
        fixed = bases[r].peak - sum(f * kept[2] for (_, f), (kept, _) in zip(mine, rows))
        choice = block_modes(tuple(tuple(seconds) for _, seconds in rows),
                             tuple(tuple(f * b for b in kept) for (_, f), (kept, _) in zip(mine, rows)), budget - fixed)
        modes = [2] * len(mine) if choice is None else choice   # nothing fits this rank: its least memory
        chosen.update({k: MODES[i] for (k, _), i in zip(mine, modes)})
    modes = [chosen[k] for k in range(len(blocks))]
    ops, cores = _block_ops(cap)
    regions = []
    for core, calls, mode in zip(cores, ops, modes):
        regions += [list(r) for r in _mode_regions(core, calls)[mode]]
    return regions, modes


def _block_rows(cap, strategies, mesh, dev, attention: str):
    """``row(k)``: block k's bytes kept for backward per microbatch and its recompute seconds, per mode
    (``MODES``), on ``mesh`` (its tp, and 1/cp of the whole sequence's bytes with what cp adds,
    ``cost_model.context.context_memory``), once per run of blocks whose figures are the same
    (``cost_model.repeats``: the blocks of a GPT share them)."""
    ops, cores = _block_ops(cap)
    figures: dict = {}

    def row(k: int) -> tuple[list[float], list[float]]:
        calls, regions = ops[k], (cores[k], ops[k])
        run = shifted(cap, strategies, calls, regions)
        if run is not None:
            calls, regions, _ = run
        if calls not in figures:
            options = _mode_regions(*regions)
            kv = context_memory(cap, strategies, mesh.cp, mesh.tp, attention, [calls])[0][0] if mesh.cp > 1 else 0.0
            # recomputing runs the region's forward again, as the step's compute prices it
            figures[calls] = ([kept_bytes(cap, calls, strategies, mesh.tp, options[m]) / mesh.cp
                               + (kv if m == "none" else 0.0) for m in MODES],
                              [recompute_seconds(strategies, [n for r in options[m] for n in r], mesh.tp, dev, False)
                               for m in MODES])
        return figures[calls]
    return row


def _mode_regions(core, calls) -> dict:
    """A block's recomputed regions per mode, from its attention core and its ops."""
    return {"none": [], "selective": [core], "full": [calls]}
