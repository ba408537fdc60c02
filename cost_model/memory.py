"""The memory model: one sum of a rank's peak bytes, per pipeline stage, and the stage DP's bound
derived from it.

Per stage s (the whole graph when pp = 1), with f_s the microbatches its rank holds in flight
there (``stages.inflight_microbatches``), c the cp ranks a sequence is split over and t the
microbatch's tokens relative to the capture's (1, but for the microbatch choice, which prices
other microbatch sizes from one capture):

    params, grads, optimizer   its parameters' state (``cost_model.state``: ``param_state``; the
                               gradients once several microbatches accumulate them, or
                               always in the 16-bit gradient buffer)
    activations  = f_s t (A_s / c + E_s)
    transient    = t (X_s / c + Y_s)

A_s is what torch.compile keeps for one microbatch's backward with the recompute regions
(``cost_model.activations.compiled_kept`` of the stage's ops), X_s the backward's largest rise
above the forward's end (``cost_model.backward``), E_s and Y_s what cp adds beyond the rank's
1/c of them (``cost_model.context.context_memory``: the gathered keys and values and mask rows
each attention keeps, or remakes in its backward; ring attention's blocks in flight). A rank
holds all of its stages at once, so its peak is ``terms.rank_peaks``: the sum of its stages'
params, grads, optimizer and activations plus the largest of their transients. ``memory``
returns the MemoryPlans of a stage cut with those peaks; every choice that weighs memory (the
stage cut, the microbatch count, recompute, ZeRO, the units kept gathered, offload, cp, the mesh
ranking) and ``Plan.memory`` read them.

The stage DP (``autopar.planner.stage_dp``) needs figures that add up unit by unit: per layer
unit u, w_u its parameters' bytes times ``state.state_bytes_per_param_byte`` and a_u
= t (A_u / c + E_u), its own kept bytes (``unit_memory``). For a cut, its figure for rank r,

    sum_{s on r} sum_{u in s} (w_u + f_s a_u)  =  peak(r) - max_{s on r} transient_s - G_r + D_r,

with G_r ZeRO-2/3's gathered weights (a stage's, not a unit's) and D_r the bytes of storage that
two units of one stage both keep (counted once by the stage's sum, once per unit here; none in
a GPT's or Llama's blocks, ``tests/cost_model/test_memory_bound.py``). Where D_r = 0 the DP's
figure is a lower bound of the peak: a cut it refuses cannot fit. The planner checks the cut it
takes against the peak itself and asks again with the budget lowered by what the transient adds
(``autopar.planner.stage_cut.choose_cut``).
"""
from __future__ import annotations

import numpy as np

from autopar.graph.capture import graph_cached
from autopar.graph.precision import working_copy_ratio
from autopar.graph.units import layer_units
from autopar.placement import local_shape

from .activations import read_nodes, compiled_kept, kept_bytes
from .backward import excess_parts, excess_with_grads
from .context import context_memory
from .memo import cached, strategies_of
from .repeats import back, shifted
from .stages import inflight_microbatches
from .state import (host_state, kept_params, kept_state_bytes, kept_working_copies, local_param_bytes, param_grad_bytes,
                    param_state, stage_fqns, state_bytes, state_bytes_per_param_byte, state_shards)
from .terms import MemoryPlan, memory_plans


def memory(cap, strategies, mesh, *, zero: int, microbatches: int, regions, stage_nodes=None, inflight=None,
           offload: bool = False, kept=(), attention: str = "allgather", tokens: float = 1.0,
           offload_kept=()) -> tuple[MemoryPlan, ...]:
    """The MemoryPlan of each stage (``stage_nodes``: each stage's ops, graph order; all of them as one
    stage by default) whose rank holds ``inflight[s]`` of the step's ``microbatches`` there, with
    ``regions`` (lists of nodes) recomputed, on ``mesh`` (its tp, cp, dp_shard and pp), each
    ``peak`` its rank's (module docstring). ``offload``: the optimizer on the host, but for the
    units ``offload_kept`` (``cost_model.state``); ``kept``: ZeRO-3's units kept gathered;
    ``attention``: how attention runs over cp; ``tokens``: the microbatch's tokens relative to the
    capture's."""
    stage_nodes = stage_nodes or (all_ops(cap),)
    inflight = inflight or (1,) * len(stage_nodes)
    working_copy = working_copy_ratio(cap)
    cp = mesh.cp
    extra = context_memory(cap, strategies, cp, mesh.tp, attention, stage_nodes, _recomputed(regions)) if cp > 1 \
        else [(0.0, 0.0)] * len(stage_nodes)
    stages = []
    for nodes, f, (kv, in_flight) in zip(stage_nodes, inflight, extra):
        params, grads, optimizer, act, excess = stage_terms(cap, strategies, mesh, nodes, regions, zero=zero,
                                                            microbatches=microbatches, working_copy=working_copy,
                                                            offload=offload, kept=kept, offload_kept=offload_kept)
        transient = max([0.0] + [b for _, b in excess])
        stages.append(dict(params=params, grads=grads, optimizer=optimizer,
                           activations=f * tokens * (act / cp + kv), transient=tokens * (transient / cp + in_flight),
                           host=host_state(cap, strategies, mesh, nodes, zero, offload_kept) if offload else 0.0))
    return memory_plans(stages, mesh.pp)


def cut_memory(cap, strategies, mesh, *, bounds, microbatches: int, virtual: int, schedule: str, zero: int,
               regions, offload: bool = False, kept=(), attention: str = "allgather",
               tokens: float = 1.0, offload_kept=()) -> tuple[MemoryPlan, ...]:
    """``memory`` of the stage cut ``bounds`` (over ``layer_units(cap)``; () without pipeline stages)
    on ``mesh``, its stages holding the microbatches in flight that ``schedule`` keeps with
    ``virtual`` stages per pp rank (``stages.inflight_microbatches``)."""
    if not bounds:
        return memory(cap, strategies, mesh, zero=zero, microbatches=microbatches, regions=regions, offload=offload,
                      kept=kept, attention=attention, tokens=tokens, offload_kept=offload_kept)
    return memory(cap, strategies, mesh, zero=zero, microbatches=microbatches, regions=regions,
                  stage_nodes=stage_nodes(cap, bounds),
                  inflight=inflight_microbatches(mesh.pp, microbatches, virtual, schedule), offload=offload,
                  kept=kept, attention=attention, tokens=tokens, offload_kept=offload_kept)


def with_weights(plans: tuple[MemoryPlan, ...], extra, pp: int) -> tuple[MemoryPlan, ...]:
    """``plans`` with ``extra[s]`` more weight bytes on stage s (ZeRO-3's units kept gathered,
    ``state.kept_gathered_bytes``), the peaks summed again."""
    fields = ("params", "grads", "optimizer", "activations", "transient", "host")
    stages = [{f: getattr(m, f) for f in fields} for m in plans]
    for d, more in zip(stages, extra):
        d["params"] += more
    return memory_plans(stages, pp)


def _recomputed(regions) -> frozenset[str]:
    """The names of the nodes in ``regions``."""
    return frozenset(n.name for region in regions for n in region)


@graph_cached
def all_ops(cap) -> tuple:
    """Every op of ``cap``'s graph, in order: the one stage without pipeline stages."""
    return tuple(n for n in cap.gm.graph.nodes if n.op == "call_function")


def stage_nodes(cap, bounds) -> tuple[tuple, ...]:
    """The ops of each stage of the cut ``bounds`` ([start, end) over ``layer_units(cap)``), in graph
    order, once per cut (``cost_model.memo``): a candidate's memory, its recompute choice and its
    kept units each ask. Callers must not change it."""
    bounds = tuple(map(tuple, bounds))

    def compute():
        stage_of = {n: s for s, (a, b) in enumerate(bounds) for u in layer_units(cap)[a:b] for n in u.nodes}
        out = [[] for _ in bounds]
        for n in all_ops(cap):
            out[stage_of.get(n, len(bounds) - 1)].append(n)
        return tuple(map(tuple, out))
    return cached(cap.gm.graph, ("stage_nodes", bounds), compute)


def unit_memory(cap, strategies, units, mesh, *, zero: int, working_copy: float, regions=(), offload: bool = False,
                attention: str = "allgather", tokens: float = 1.0, offload_kept=()):
    """(static, act): per layer unit (anything with the ``nodes`` it runs) the stage DP's w_u and a_u
    of the module docstring, with ``regions`` recomputed: its parameters' state with their
    gradients held (``state_bytes_per_param_byte``; under ``offload`` a parameter of a unit in
    ``offload_kept`` at the kept row's figures, ``state.kept_state_bytes``) and one microbatch's
    kept bytes."""
    tp = mesh.tp
    units = tuple(units)
    state = state_bytes_per_param_byte(mesh, zero, working_copy, offload)
    on_device = kept_params(cap, offload_kept) if offload else frozenset()
    mine = kept_state_bytes(zero, state_shards(mesh, zero, working_copy, offload), working_copy)
    rate = {False: state, True: mine.weights + mine.grads + mine.optimizer}
    static = np.zeros(len(units))
    for k, sizes in enumerate(_param_sizes(cap, strategies, units, tp)):
        for fqn, nbytes in sizes:   # in the order the parameters are summed
            static[k] += nbytes * rate[fqn in on_device]
    regions = tuple(tuple(r) for r in regions)
    act = cached(cap.gm.graph, ("unit_act", units, tp, regions), lambda: _unit_act(cap, strategies, units, tp, regions),
                 *strategies_of(strategies, tuple(cap.gm.graph.nodes))).copy()
    if mesh.cp > 1:
        extra = context_memory(cap, strategies, mesh.cp, tp, attention, [u.nodes for u in units], _recomputed(regions))
        act = act / mesh.cp + np.array([kv for kv, _ in extra])
    return static, act * tokens


def unit_params(cap, strategies, units, tp: int) -> np.ndarray:
    """Per layer unit, the local bytes of the parameters its ops use (a weight two units use counts in
    both, as ``unit_memory`` counts it): what a pipeline rank's dp sync and update move
    (``stages.rank_param_bytes``)."""
    out = np.zeros(len(tuple(units)))
    for k, sizes in enumerate(_param_sizes(cap, strategies, units, tp)):
        for _, nbytes in sizes:
            out[k] += nbytes
    return out


def _param_sizes(cap, strategies, units, tp: int) -> list[list[tuple[str, float]]]:
    """Per unit, (FQN, local bytes) of each parameter its ops use, in ``cap.params`` order, once per
    units, tp and the parameters' strategies (``cost_model.memo``)."""
    units = tuple(units)
    return cached(cap.gm.graph, ("unit_param_sizes", units, tp), lambda: _unit_param_sizes(cap, strategies, units, tp),
                  *strategies_of(strategies, tuple(cap.params.values())))


def _unit_param_sizes(cap, strategies, units, tp: int) -> list[list[tuple[str, float]]]:
    unit_of = {n: k for k, u in enumerate(units) for n in u.nodes}
    out = [[] for _ in units]
    for fqn, node in cap.params.items():
        pl = strategies[node].output
        nbytes = float(np.prod(local_shape(tuple(node.meta["val"].shape), pl, tp))) * node.meta["val"].element_size()
        for k in {unit_of[u] for u in node.users if u in unit_of}:
            out[k].append((fqn, nbytes))
    return out


def _unit_act(cap, strategies, units, tp: int, regions) -> np.ndarray:
    """Each unit's kept bytes for one microbatch with ``regions`` recomputed (``kept_bytes``)."""
    act = np.zeros(len(units))
    for k, u in enumerate(units):
        members = set(u.nodes)
        act[k] = kept_bytes(cap, u.nodes, strategies, tp, [r for r in regions if r and r[0] in members])
    return act


def stage_terms(cap, strategies, mesh, nodes, regions, *, zero: int, microbatches: int, working_copy: float,
                offload: bool = False, kept=(), offload_kept=()):
    """(params, gradients held through the forward, optimizer, one microbatch's activations,
    [(node, backward excess)]) of one stage's ``nodes`` with ``regions`` recomputed, whole
    sequences: the terms ``memory`` sums; ``offload``, ``offload_kept`` and ``kept`` (ZeRO-3's
    units kept gathered) as ``param_state``. Computed once per question (``cost_model.memo``), and for a run of repeated
    blocks as the same run at block 1 where its figures are that run's (``cost_model.repeats``; not
    with units kept gathered, which are named)."""
    nodes = tuple(nodes)
    members = set(nodes)
    mine = tuple(tuple(r) for r in regions if r and r[0] in members)
    split = tuple(offload_kept) if offload else ()
    run = None if kept or split else shifted(cap, strategies, nodes, mine)
    if run is None:
        return _stage_terms_once(cap, strategies, mesh, nodes, mine, zero, microbatches, working_copy, offload, kept,
                                 split)
    canon, moved, offset = run
    params, grads, opt, act, excess = _stage_terms_once(cap, strategies, mesh, canon, moved, zero, microbatches,
                                                        working_copy, offload, kept, split)
    return params, grads, opt, act, back(cap, excess, offset)


def _stage_terms_once(cap, strategies, mesh, nodes, mine, zero, microbatches, working_copy, offload, kept, split):
    """``_stage_terms``, once per question (``cost_model.memo``)."""
    read = strategies_of(strategies, read_nodes(nodes, mine))
    key = ("stage_terms", nodes, mine, mesh.tp, state_shards(mesh, zero, working_copy, offload), zero, microbatches,
           working_copy, offload, frozenset(kept), frozenset(split))
    return cached(nodes[0].graph, key, lambda: _stage_terms(cap, strategies, mesh, nodes, mine, zero, microbatches,
                                                            working_copy, offload, kept, split, read), *read)


def _stage_terms(cap, strategies, mesh, nodes, mine, zero, microbatches, working_copy, offload, kept, split, read):
    """``stage_terms`` computed; ``read``: the strategies its figures read, those of ``read_nodes``. What
    the backward keeps and its excess but the gradients' bytes are the same for every ZeRO stage,
    microbatch count and offload choice: kept once per stage, regions and strategies."""
    shards = state_shards(mesh, zero, working_copy, offload)
    # gradients accumulate over the step's microbatches, or into a buffer held through the step
    held = microbatches > 1 or state_bytes(zero, shards, working_copy, offload).buffered
    fqns = stage_fqns(cap, nodes)
    params, grads, opt = param_state(cap, strategies, fqns, mesh.tp, shards, zero, working_copy, offload, kept, split)
    if offload:
        params += kept_working_copies(cap, strategies, fqns, mesh.tp, working_copy, split,
                                      frozenset(n for r in mine for n in r))
    kept = compiled_kept(nodes, strategies, mesh.tp, mine, cap)
    per_param = {cap.params[f]: b for f, b in param_grad_bytes(cap, strategies, fqns, mesh.tp, shards, zero,
                                                               working_copy, offload, split).items()}
    parts = cached(nodes[0].graph, ("excess_parts", nodes, mine, mesh.tp),
                   lambda: excess_parts(nodes, kept, strategies, mesh.tp, tuple(per_param), regions=mine), *read)
    # ZeRO-2/3 reduce-scatter each weight's whole gradient (its tp shard's elements)
    whole = {cap.params[f]: b / cap.params[f].meta["val"].element_size()
             for f, b in local_param_bytes(cap, strategies, fqns, mesh.tp).items()} if zero >= 2 and shards > 1 else None
    excess = excess_with_grads(parts, per_param, held, whole)
    return params, grads if held else 0.0, opt, sum(kept.values()), excess
