"""Memory per rank and stage, and where to recompute: the plan's memory decisions.

Per stage: parameters and optimizer state (by ZeRO level) of the layers it holds, the
activations one microbatch keeps under torch.compile (``cost_model.memory.compiled_kept``) times
the microbatches the schedule keeps in flight there, the gradients when they outlive a backward
(several microbatches accumulate them), and what the backward adds at its highest above the
forward's end (``backward_excess``: gradients as they arrive, gradient buffers, net of the
activations freed by then); their sum is the peak. ``recompute="auto"`` picks per block none / selective / full
with the smallest recompute time that brings every stage under the memory budget (an ILP over
the blocks, ``autopar.planner.ilp``), or says the smallest peak any choice reaches.
"""
from __future__ import annotations

import functools

from autopar.cost_model.memory import attention_core, host_state, kept_bytes, stage_terms
from autopar.cost_model.repeats import shifted
from autopar.cost_model.strategy import strategy_time
from autopar.planner.ilp import InfeasibleError, solve_strategies
from autopar.plans import MemoryPlan
from autopar.errors import PlanError
from autopar.graph.capture import graph_cached
from autopar.graph.units import find_blocks
from autopar.graph.precision import working_copy_ratio

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


def memory_breakdown(cap, strategies, mesh, *, zero: int, regions, stage_nodes=None, inflight=None,
                     microbatches: int = 1, offload: bool = False, kept=()):
    """MemoryPlan per stage (one stage when pp = 1); with ``offload`` the optimizer's state on the host,
    with ``kept`` ZeRO-3's units kept gathered (``cost_model.memory.param_state``)."""
    stage_nodes = stage_nodes or [[n for n in cap.gm.graph.nodes if n.op == "call_function"]]
    inflight = inflight or [1] * len(stage_nodes)
    out = []
    working_copy = working_copy_ratio(cap)
    for s, nodes in enumerate(stage_nodes):
        params, grads, opt, act, excess = stage_terms(cap, strategies, mesh, nodes, regions, zero=zero,
                                                      microbatches=microbatches, working_copy=working_copy,
                                                      offload=offload, kept=kept)
        transient = max([0.0] + [b for _, b in excess])
        act *= inflight[s]
        host = host_state(cap, strategies, mesh, nodes, zero) if offload else 0.0
        out.append(MemoryPlan(s, params, grads, opt, act, params + grads + opt + act + transient, transient, host))
    return tuple(out)


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
    try:
        return tuple(solve_strategies(list(costs), [], node_memory=list(mems), memory_budget=budget).choice)
    except InfeasibleError:
        return None


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
                     stage_nodes=None, inflight=None, offload: bool = False):
    """Per block the cheapest recompute mode (by recomputed forward time) fitting ``budget`` bytes
    on every stage's rank (``stage_nodes`` and ``inflight`` as for ``memory_breakdown``; one
    stage by default). A block's choice moves only its own stage's memory, so each stage is its
    own ILP, with its activations kept for the microbatches it holds in flight. A stage that no
    choice fits gets its blocks fully recomputed, the least memory any choice reaches: its peak
    stays above ``budget``, for the caller to report with the other choices it searched
    (``autopar.planner.decide.no_fit_error``)."""
    blocks = find_blocks(cap) or []
    if not blocks:
        raise PlanError("recompute='auto' works per repeated block, and this model has none")
    ops, cores = _block_ops(cap)
    figures: dict = {}

    def row(k: int) -> tuple[list[float], list[float]]:
        """Block k's bytes kept for backward and recompute seconds per mode, once per run of blocks
        whose figures are the same (``cost_model.repeats``: the blocks of a GPT share them)."""
        calls, regions = ops[k], (cores[k], ops[k])
        run = shifted(cap, strategies, calls, regions)
        if run is not None:
            calls, regions, _ = run
        if calls not in figures:
            options = _mode_regions(*regions)
            # recomputing runs the region's forward again: about a third of its forward + backward
            figures[calls] = ([kept_bytes(cap, calls, strategies, mesh.tp, options[m]) for m in MODES],
                           [sum(strategy_time(n, strategies[n], mesh.tp, dev, False) for r in options[m] for n in r) / 3
                            for m in MODES])
        return figures[calls]

    stage_nodes = stage_nodes or [[n for n in cap.gm.graph.nodes if n.op == "call_function"]]
    inflight = inflight or [1] * len(stage_nodes)
    # the per-block ILP below adds each block's own activations to the fully recomputed peak, which
    # carries full recompute's backward transient: when nothing recomputed already fits, say so exactly
    plain = memory_breakdown(cap, strategies, mesh, zero=zero, regions=[], stage_nodes=stage_nodes,
                             inflight=inflight, microbatches=microbatches, offload=offload)
    if all(m.peak <= budget for m in plain):
        return [], ["none"] * len(blocks)
    bases = memory_breakdown(cap, strategies, mesh, zero=zero, regions=regions_for(cap, "full"),
                             stage_nodes=stage_nodes, inflight=inflight, microbatches=microbatches, offload=offload)
    chosen = {}
    for s, (nodes, base) in enumerate(zip(stage_nodes, bases)):
        members = set(nodes)
        mine = [k for k, b in enumerate(blocks) if not members.isdisjoint(b)]
        f = inflight[s]
        rows = [row(k) for k in mine]
        full_act = sum(kept[2] for kept, _ in rows)
        fixed = base.peak - f * full_act            # everything but the blocks' own activations
        mems = [[f * b for b in kept] for kept, _ in rows]
        costs = [seconds for _, seconds in rows]

        if not mine:   # no block to recompute here: the stage fits as it is or not at all
            continue
        choice = block_modes(tuple(map(tuple, costs)), tuple(map(tuple, mems)), budget - fixed)
        if choice is None:   # nothing fits this stage: its least memory
            chosen.update({k: "full" for k in mine})
        else:
            chosen.update({k: MODES[i] for k, i in zip(mine, choice)})
    modes = [chosen[k] for k in range(len(blocks))]
    regions = []
    for core, calls, mode in zip(cores, ops, modes):
        regions += [list(r) for r in _mode_regions(core, calls)[mode]]
    return regions, modes


def _mode_regions(core, calls) -> dict:
    """A block's recomputed regions per mode, from its attention core and its ops."""
    return {"none": [], "selective": [core], "full": [calls]}
