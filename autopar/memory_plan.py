"""Memory per rank and stage, and where to recompute: the plan's memory decisions.

Per stage: parameters and optimizer state (by ZeRO level) of the layers it holds, the
activations one microbatch keeps under torch.compile (``cost_model.memory.compiled_kept``) times
the microbatches the schedule keeps in flight there, the gradients when they outlive a backward
(several microbatches accumulate them), and what the backward adds at its highest above the
forward's end (``backward_excess``: gradients as they arrive, gradient buffers, net of the
activations freed by then); their sum is the peak. ``recompute="auto"`` picks per block none / selective / full
with the smallest recompute time that brings every stage under the memory budget (an ILP over
the blocks, ``autopar.ilp``), or says the smallest peak any choice reaches.
"""
from __future__ import annotations

import numpy as np

from autopar.cost_model.memory import attention_core, backward_excess, compiled_kept
from autopar.ilp import InfeasibleError, solve_strategies
from autopar.placement import local_shape
from autopar.plans import MemoryPlan
from autopar.planner import PlanError, _strategy_time, find_blocks
from autopar.precision import working_copy_ratio

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


def _param_state(cap, strategies, fqns, tp: int, dp: int, zero: int):
    params = 0.0
    for fqn in fqns:
        node = cap.params[fqn]
        v = node.meta["val"]
        params += float(np.prod(local_shape(tuple(v.shape), strategies[node].output, tp))) * v.element_size()
    optimizer = 2 * params / (dp if zero else 1)   # Adam's two moments, fp32 like the weights here
    return params * (1 + working_copy_ratio(cap)), params, optimizer   # + a 16-bit step's working copy


def stage_terms(cap, strategies, mesh, nodes, regions, *, zero: int, microbatches: int):
    """(params, gradients held through the forward, optimizer, one microbatch's activations,
    [(node, backward excess)]) of one stage's ``nodes`` with ``regions`` recomputed: the terms
    of its peak (``memory_breakdown``)."""
    held = microbatches > 1   # gradients accumulate over the step's microbatches
    members = set(nodes)
    fqns = [f for f, p in cap.params.items() if any(u in members for u in p.users)]
    params, grads, opt = _param_state(cap, strategies, fqns, mesh.tp, mesh.dp, zero)
    mine = [r for r in regions if r and r[0] in members]
    kept = compiled_kept(nodes, strategies, mesh.tp, mine)
    per_param = {cap.params[f]: _param_state(cap, strategies, [f], mesh.tp, mesh.dp, zero)[1] for f in fqns}
    excess = backward_excess(nodes, kept, strategies, mesh.tp, per_param, held)
    return params, grads if held else 0.0, opt, sum(kept.values()), excess


def memory_breakdown(cap, strategies, mesh, *, zero: int, regions, stage_nodes=None, inflight=None,
                     microbatches: int = 1):
    """MemoryPlan per stage (one stage when pp = 1)."""
    stage_nodes = stage_nodes or [[n for n in cap.gm.graph.nodes if n.op == "call_function"]]
    inflight = inflight or [1] * len(stage_nodes)
    out = []
    for s, nodes in enumerate(stage_nodes):
        params, grads, opt, act, excess = stage_terms(cap, strategies, mesh, nodes, regions, zero=zero,
                                                      microbatches=microbatches)
        transient = max([0.0] + [b for _, b in excess])
        act *= inflight[s]
        out.append(MemoryPlan(s, params, grads, opt, act, params + grads + opt + act + transient, transient))
    return tuple(out)


def choose_recompute(cap, strategies, mesh, dev, *, zero: int, budget: float, microbatches: int = 1):
    """Per block the cheapest recompute mode (by recomputed forward time) fitting ``budget`` bytes."""
    blocks = find_blocks(cap) or []
    if not blocks:
        raise PlanError("recompute='auto' works per repeated block, and this model has none")
    def kept(nodes, regions) -> float:
        return sum(compiled_kept(nodes, strategies, mesh.tp, regions).values())

    base = memory_breakdown(cap, strategies, mesh, zero=zero, regions=regions_for(cap, "full"),
                            microbatches=microbatches)[0]
    full_act = sum(kept(b, [[n for n in b if n.op == "call_function"]]) for b in blocks)
    fixed = base.peak - full_act            # everything but the blocks' own activations
    costs, mems = [], []
    for b in blocks:
        calls = [n for n in b if n.op == "call_function"]
        options = {"none": [], "selective": [attention_core(b)], "full": [calls]}
        mems.append([kept(b, options[m]) for m in MODES])
        # recomputing runs the region's forward again: about a third of its forward + backward
        costs.append([sum(_strategy_time(n, strategies[n], mesh.tp, dev, False) for r in options[m] for n in r) / 3
                      for m in MODES])
    try:
        sol = solve_strategies(costs, [], node_memory=mems, memory_budget=budget - fixed)
    except InfeasibleError:
        raise PlanError(f"no recompute choice fits {budget / 2**30:.2f} GiB: the smallest peak, with every "
                        f"block fully recomputed, is {base.peak / 2**30:.2f} GiB") from None
    chosen = [MODES[i] for i in sol.choice]
    regions = []
    for b, mode in zip(blocks, chosen):
        calls = [n for n in b if n.op == "call_function"]
        regions += {"none": [], "selective": [attention_core(b)], "full": [calls]}[mode]
    return regions, chosen
