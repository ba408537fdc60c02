"""The tensor-parallel planner: one strategy per node, chosen by an ILP over the cost model.

For every node the sharding rules list strategies; the cost of a strategy is its
compute time (divided as the strategy divides the work) plus the collectives inside
it; the cost of an edge is the collectives that move the producer's placement into
the one the consumer asks for, forward and backward (``graph.reshard``), paid once
per producer and form however many consumers want it so (the rewrite moves it once);
a parameter's strategy also pays the optimizer update and dp gradient sync of its
local shard. That is the step time the planner prices (``autopar.planner.price``). The ILP (``autopar.planner.ilp``)
picks the cheapest consistent assignment.

Repeated transformer blocks are solved once: the ILP sees the non-block nodes plus
one block whose node and internal-edge costs are multiplied by the block count L,
plus a loop edge from the block's output back to its input consumers weighted L-1
(block i's output feeds block i+1). That is exact over assignments that repeat
per block, and the ILP's size no longer grows with depth.
"""
from __future__ import annotations

import time
from collections import Counter
import dataclasses
from dataclasses import dataclass

import numpy as np
import torch
from torch.fx import Node

from autopar.cost_model.comm import axis_is_inter_node
from autopar.cost_model.compute import node_flops
from autopar.cost_model.memo import cached, strategies_of
from autopar.cost_model.repeats import block_shift, twin
from autopar.cost_model.context import cp_collectives
from autopar.cost_model.state import regathered_bytes
from autopar.cost_model.step import dp_sync_bytes, dp_sync_collectives, zero_unit_figures
from autopar.cost_model.strategy import OP_OVERHEAD, move_time, param_memory, strategy_time, tp_collectives
from autopar.errors import PlanError
from autopar.graph.units import find_blocks, zero_units
from autopar.planner.ilp import evaluate, solve_strategies
from autopar.planner.parametric import choice_at
from autopar.graph.capture import Captured, graph_cached
from autopar.graph.precision import working_copy_ratio
from autopar.graph.reshard import regather_candidate
from autopar.graph.rules import RULES, RuleContext, Strategy, dim_labels, is_float, say_once, shape, strategies_for
from autopar.placement import R, Placement, Shard, local_shape

aten = torch.ops.aten


@dataclass
class Assignment:
    """The planner's answer: a strategy per node, and how long the ILP took."""

    strategies: dict[Node, Strategy]
    options: dict[Node, list[Strategy]]
    solve_seconds: float
    objective: float


def divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


@graph_cached
def ops_of(cap: Captured, target) -> tuple[Node, ...]:
    """The nodes of ``cap`` calling ``target``, in graph order, found once per capture: the planner
    asks on every candidate mesh and ZeRO stage."""
    return tuple(n for n in cap.gm.graph.nodes if n.target is target)


def check_tp(cap: Captured, tp: int) -> None:
    """Fail early, with the valid choices, when tp cannot split the attention heads or hidden size."""
    for node in ops_of(cap, aten.scaled_dot_product_attention.default):
        heads, head_dim = shape(node.args[0])[1], shape(node.args[0])[-1]
        kv_heads = shape(node.args[1])[1]
        if heads % tp or kv_heads % tp:
            valid = [d for d in divisors(heads) if kv_heads % d == 0]
            raise PlanError(f"tp={tp} does not divide {heads} attention heads"
                            + (f" ({kv_heads} key/value heads)" if kv_heads != heads else "")
                            + f" in {node.meta.get('module_path') or 'the model'}; "
                            f"valid tp for this model: {', '.join(map(str, valid))}")
        hidden = heads * head_dim
        if hidden % tp:
            raise PlanError(f"tp={tp} does not divide the hidden size {hidden}; "
                            f"valid tp: {', '.join(map(str, divisors(hidden)))}")


def _labelled_alike(labels: dict, node: Node, other: Node) -> bool:
    """Whether ``node`` and ``other`` and their arguments, in order, have the same dim labels."""
    return labels.get(node) == labels.get(other) and all(
        labels.get(a) == labels.get(b) for a, b in zip(node.all_input_nodes, other.all_input_nodes, strict=True))


@graph_cached
def labels_of(cap: Captured) -> dict[Node, tuple[str, ...]]:
    """``rules.dim_labels`` of ``cap``'s activations, found once per capture."""
    return dim_labels(cap.gm, cap.inputs)


def _seq_sharded(labels: dict, p: Placement, node: Node) -> bool:
    """Whether ``node``'s value laid out as ``p`` is split along its sequence dim."""
    return isinstance(p, Shard) and labels.get(node, ())[p.dim:p.dim + 1] == ("seq",)


@graph_cached
def norm_nodes(cap: Captured) -> tuple[Node, ...]:
    """The ops that normalise tokens over their features, in graph order: what sequence parallelism
    runs on sequence shards. A norm op (layer_norm, torch's rms_norm, or one without a rule, such as
    linalg_vector_norm) or the mean over the features of an RMSNorm written out (Llama's), applied
    to an activation of the tokens (a dim labelled batch or seq)."""
    labels = labels_of(cap)
    found = []
    for node in cap.gm.graph.nodes:
        x = node.args[0] if node.op == "call_function" and node.args else None
        lab = labels.get(x, ()) if isinstance(x, Node) else ()
        if not ("batch" in lab or "seq" in lab):
            continue
        if node.target is aten.mean.dim:
            dims = {d % len(lab) for d in node.args[1]} if node.args[1] else set(range(len(lab)))
            if len(dims) < len(lab) and all(lab[d] == "other" for d in dims):
                found.append(node)
        elif isinstance(node.target, torch._ops.OpOverload) and "norm" in str(node.target).split(".")[1]:
            found.append(node)
    return tuple(found)


def sequence_sharded(cap: Captured, strategies: dict[Node, Strategy]) -> bool:
    """Whether ``strategies`` run sequence parallel: some norm (``norm_nodes``) on sequence shards."""
    labels = labels_of(cap)
    return any(_seq_sharded(labels, strategies[n].output, n) for n in norm_nodes(cap))


def sequence_parallel_notes(cap: Captured, tp: int, sequence_parallel) -> tuple[str, ...]:
    """The plan's note where ``sequence_parallel=True`` cannot be honoured (naming the op that
    prevents it and why, as ``enumerate_strategies`` warns), or does nothing (tp=1); else none."""
    if sequence_parallel is not True:
        return ()
    if tp == 1:
        return ("sequence_parallel=True does nothing at tp=1: sequence parallelism splits the norms' tokens "
                "over the tp ranks",)
    refused = _sequence_refusal(cap, tp, enumerate_strategies(cap, tp, True))
    return (refused,) if refused else ()


def _sequence_refusal(cap: Captured, tp: int, options: dict[Node, list[Strategy]]) -> str | None:
    """Why ``options`` (made with sequence_parallel=True) leave norms off sequence shards, per op
    kind and reason, or None where every norm is on them."""
    labels, norms = labels_of(cap), norm_nodes(cap)
    if not norms:
        return ("sequence_parallel=True: the model has no norm over its tokens' features (layer_norm, rms_norm, "
                "or an RMSNorm's mean) for sequence parallelism to split by tokens; it is off")
    refused: dict[tuple, list[Node]] = {}
    for n in norms:
        if not any(_seq_sharded(labels, s.output, n) for s in options[n]):
            refused.setdefault((n.target, _why_not_on_tokens(n, tp, labels)), []).append(n)
    if not refused:
        return None
    parts = []
    for (target, why), nodes in refused.items():
        where = nodes[0].meta.get("module_path") or "<top level>"
        more = f" (and {len(nodes) - 1} more node{'s' * (len(nodes) > 2)})" if len(nodes) > 1 else ""
        parts.append(f"{target} in {where}{more} cannot run on sequence shards: {why}")
    off = sum(map(len, refused.values())) == len(norms)
    return ("sequence_parallel=True is not honoured: " + "; ".join(parts)
            + ("; sequence parallelism is off" if off else "; the other norms run on sequence shards"))


def _why_not_on_tokens(node: Node, tp: int, labels: dict) -> str:
    """Why the rules give norm ``node`` no strategy on sequence shards."""
    if node.target not in RULES:
        return "it has no sharding rule, so it runs whole on every tp rank"
    x = node.args[0]
    lab, dims = labels.get(x, ()), shape(x)
    if "seq" not in lab:
        return (f"its input {list(dims)} has no sequence dim apart from the batch (a reshape merged the tokens "
                "into it), and tp never splits the batch")
    if dims[lab.index("seq")] % tp:
        return f"its {dims[lab.index('seq')]}-token sequence does not split evenly over tp={tp}"
    return "its sharding rule has no strategy on sequence shards"


@graph_cached
def enumerate_strategies(cap: Captured, tp: int, sequence_parallel) -> dict[Node, list[Strategy]]:
    """Candidate strategies per node, with the sequence-parallel choice applied: False keeps every
    value off sequence shards, True puts every norm (``norm_nodes``) on them where its rule can,
    and warns, naming the op, where it cannot. Equal strategies are
    one object: the prices kept per strategy object (``cost_model.memo``) are then shared by the
    twin ops of repeated blocks, and a run of blocks is recognised as another by the identity of its
    strategies (``cost_model.repeats``). An op of block 2 on takes its twin's strategies in block 1
    where their dims are labelled alike: the rules read an op's target, arguments, shapes and
    labels, and ``block_shift`` has checked the rest are the same."""
    g = cap.gm.graph
    block_shift(cap)   # lays out the twins
    shared: dict[Strategy, Strategy] = {}
    chunks = {len(n.meta["val"]) for n in g.nodes if n.target in (aten.split.Tensor, aten.chunk.default)
              and len({tuple(v.shape) for v in n.meta["val"]}) == 1}
    labels = labels_of(cap)
    ctx = RuleContext(tp, tuple(sorted({1} | chunks)), labels)
    forced = sequence_parallel is True and tp > 1
    norms = set(norm_nodes(cap)) if forced else set()

    def seq_sharded(p: Placement, node: Node) -> bool:
        return _seq_sharded(labels, p, node)

    options: dict[Node, list[Strategy]] = {}
    for node in g.nodes:
        if node.op == "call_function" and tp == 1:
            options[node] = [Strategy(tuple(R for _ in node.all_input_nodes), R)]
        elif node.op == "call_function":
            first = twin(node)
            if first is not node and _labelled_alike(labels, node, first):
                options[node] = options[first]
                continue
            opts = strategies_for(node, ctx)
            if sequence_parallel is False:
                opts = [s for s in opts if not seq_sharded(s.output, node)
                        and not any(seq_sharded(p, i) for p, i in zip(s.inputs, node.all_input_nodes))]
            elif node in norms:
                opts = [s for s in opts if seq_sharded(s.output, node)] or opts
            options[node] = opts
        elif node.op == "placeholder":
            options[node] = [Strategy((), R)]
    for node, fqn in ((n, n.meta["fqn"]) for n in cap.params.values()):
        wanted = {R}
        for user in node.users:
            for s in options.get(user, []):
                wanted.update(p for p, i in zip(s.inputs, user.all_input_nodes) if i is node)
        options[node] = [Strategy((), p) for p in sorted(wanted, key=str)]
    refused = _sequence_refusal(cap, tp, options) if forced else None
    if refused:
        say_once(("sequence parallel", refused), g, "autopar: " + refused, stacklevel=3)
    return {n: [shared.setdefault(s, s) for s in opts] for n, opts in options.items()}


def solve(cap: Captured, options: dict[Node, list[Strategy]], tp: int, dev, *,
          inter_node: bool = False, memory_budget: float | None = None,
          param_state_bytes: float = 4.0, param_byte_seconds: float = 0.0) -> Assignment:
    """Choose a strategy per node minimising predicted step time (ILP, blocks solved once).

    Every node and edge of the full graph is charged to its twin in block 0 (in the first
    block with the same options), so a block's internal edges count L times and the
    block-to-block edges L-1 times.
    A value wanted by several consumers in the same form is moved once, as the rewrite
    moves it (``tp_collectives``): those edges are priced as one shared group per producer.
    ``param_state_bytes``: bytes of parameter + gradient + optimizer state held per
    parameter byte, for the optional per-rank ``memory_budget``; ``param_byte_seconds``:
    step time per byte of a parameter's local shard outside the ops (``param_byte_time``).

    The problem's tables but the parameters' byte price are the same for every ZeRO stage and
    mesh of one tp (``_problem``), and an ILP the same as one solved before has its answer
    (``cost_model.memo``): the mesh search asks both many times. A byte price between two at which
    the solver proved one choice optimal gets that choice without a solve (``autopar.planner.parametric``)."""
    g = cap.gm.graph
    problem = cached(g, ("ilp_problem", tp, inter_node), lambda: _problem(cap, options, tp, dev, inter_node),
                     options, dev)
    # the ILP's structure and constraints, built once for the problem's parameter byte prices (``solve_strategies``)
    reused = cached(g, ("ilp_reuse", tp, inter_node), dict, options, dev)
    budget = (memory_budget, param_state_bytes if memory_budget is not None else None)
    # the λ (parameter byte prices) of this feasible set each choice was proven optimal at (``parametric``)
    proven = cached(g, ("ilp_proven", tp, inter_node, *budget), dict, options, dev)

    def run():
        nodes, ids, rep, mult, base, param_bytes, edges, shared = problem

        def costs(byte_seconds: float) -> list:
            # an op's launch overhead is the same under every strategy: in the objective, so that it is the
            # step time the plan is priced at, not in the choice
            return [mult[n] * np.array([b + byte_seconds * m for b, m in zip(base[n], param_bytes[n])])
                    for n in nodes]

        memory = None
        if memory_budget is not None:
            memory = [mult[n] * np.array([m * param_state_bytes for m in param_bytes[n]]) for n in nodes]

        def solved(byte_seconds: float) -> tuple:
            sol = solve_strategies(costs(byte_seconds), edges, node_memory=memory, memory_budget=memory_budget,
                                   shared=shared, reuse=reused)
            return sol.choice, sol.status == "optimal"

        t0 = time.perf_counter()
        choice = choice_at(proven, param_byte_seconds, solved)
        seconds = time.perf_counter() - t0
        objective = evaluate(costs(param_byte_seconds), edges, choice, shared=shared)[0]
        return {n: options[n][choice[ids[rep[n]]]] for n in options}, seconds, objective

    key = ("ilp", tp, inter_node, *budget, param_byte_seconds)
    strategies, seconds, objective = cached(g, key, run, options, dev)
    return Assignment(dict(strategies), options, seconds, objective)


def _problem(cap: Captured, options, tp: int, dev, inter_node: bool):
    """The ILP's tables for ``solve`` that do not depend on what a parameter byte costs: the nodes
    solved (one per block twin), their ids, twins and multiplicities, per node and strategy its
    time with the launch overhead and its parameter bytes, the edges and the shared groups."""
    nodes, ids, rep, mult, uses, masked, groups = _layout(cap, options)

    def move(moved, consumer, slot, form, fl):
        return move_time(moved, consumer.target, slot, form, tp, dev, inter_node, fl)
    base = {n: [strategy_time(n, s, tp, dev, inter_node) + (OP_OVERHEAD if n.op == "call_function" else 0.0)
                for s in options[n]] for n in nodes}
    param_bytes = {n: [param_memory(n, s, tp, 1.0) for s in options[n]] for n in nodes}
    edges, shared = _edges(options, ids, uses, masked, groups, move)
    return nodes, ids, rep, mult, base, param_bytes, edges, shared


def _layout(cap: Captured, options):
    """The ILP's structure: the nodes solved (one per block twin), their ids, twins and
    multiplicities, the edges between them with their counts, the edges priced by a shared group
    instead, and the shared groups with their counts; once per capture and options."""
    return cached(cap.gm.graph, ("ilp_layout",), lambda: _laid_problem(cap, options), options)


def _laid_problem(cap: Captured, options):
    g = cap.gm.graph
    rep: dict[Node, Node] = {n: n for n in options}
    # A block is charged to the first one whose nodes have the same options in the same order:
    # a strategy index of one is then the same strategy in the other (restricted options, e.g.
    # a plan's sequence-parallel rule over layers whose dims are labelled apart, can differ).
    first: dict[tuple, list[Node]] = {}
    for block in find_blocks(cap) or []:
        twin = first.setdefault(tuple(tuple(options.get(n, ())) for n in block), block)
        rep.update(zip(block, twin))
    nodes = [n for n in options if rep[n] is n]
    ids = {n: k for k, n in enumerate(nodes)}
    mult = Counter(rep[n] for n in options)
    fan_out: dict[Node, list[tuple[Node, int]]] = {}
    for c in g.nodes:
        if c.op == "call_function":
            for slot, p in enumerate(c.all_input_nodes):
                fan_out.setdefault(p, []).append((c, slot))
    # lists and dicts in graph order, never sets of Nodes: a set iterates in address order, which
    # changes from run to run, and so would the solver's choice between equally priced plans
    shared_at = [p for p, outs in fan_out.items()
                 if len(outs) > 1 and not isinstance(p.meta.get("val"), (list, tuple))]
    shared_set = set(shared_at)
    uses = Counter((rep[p], rep[c], slot) for p, outs in fan_out.items() if p not in shared_set for c, slot in outs)
    masked = dict.fromkeys((rep[p], rep[c], slot) for p in shared_at for c, slot in fan_out[p])
    groups = Counter((rep[p], tuple((rep[c], slot) for c, slot in fan_out[p])) for p in shared_at)
    return nodes, ids, rep, mult, uses, masked, groups


def _edges(options, ids, uses, masked, groups, move):
    """The ILP's edge matrices and shared groups, each move priced by ``move(moved, consumer, slot,
    (source placement, wanted placement, divergent), is_float)``."""
    edges = [(ids[p], ids[c], k * _edge_matrix(p, c, slot, options, move)) for (p, c, slot), k in uses.items()]
    edges += [(ids[p], ids[c], np.where(np.isinf(_edge_matrix(p, c, slot, options, move)), np.inf, 0.0))
              for p, c, slot in masked if (p, c, slot) not in uses]
    shared = [_shared_group(p, members, k, ids, options, move) for (p, members), k in groups.items()]
    return edges, shared


def _edge_matrix(producer: Node, consumer: Node, slot: int, options, move) -> np.ndarray:
    srcs, dsts = options[producer], options[consumer]
    moved = consumer if isinstance(producer.meta.get("val"), (list, tuple)) else producer
    fl = is_float(producer)
    tuple_out = isinstance(producer.meta.get("val"), (list, tuple))
    m = np.zeros((len(srcs), len(dsts)))
    cache: dict = {}
    for i, a in enumerate(srcs):
        for j, b in enumerate(dsts):
            key = (a.output, b.inputs[slot], b.divergent(slot) and fl)
            if tuple_out and key[0] != key[1]:
                m[i, j] = np.inf   # a multi-output op's pieces are taken as they are
                continue
            if key not in cache:
                cache[key] = move(moved, consumer, slot, key, fl)
            m[i, j] = cache[key]
    return m


def _shared_group(producer: Node, members, count: int, ids, options, move):
    """The ILP's shared group (``autopar.planner.ilp``) of one producer's consumers: each consumer strategy
    asks for a form (placement, divergent) of the value, and every distinct form is paid once."""
    fl = is_float(producer)
    forms: dict[tuple, int] = {}
    keyed = []
    for c, slot in members:
        keys = [forms.setdefault((b.inputs[slot], b.divergent(slot) and fl), len(forms)) for b in options[c]]
        keyed.append((ids[c], keys))
    c0, slot0 = members[0]
    table = np.array([[move(producer, c0, slot0, (a.output, *form), fl) for form in forms] for a in options[producer]])
    # an impossible move is forbidden by the pairwise edge; the group only prices possible ones
    return ids[producer], keyed, count * np.where(np.isinf(table), 0.0, table)


def least_step_seconds(cap: Captured, options, op_seconds, move_seconds) -> float | None:
    """The least seconds of one microbatch's ops and tp collectives over every assignment ``solve``
    can choose (block twins alike), each op under a strategy priced ``op_seconds(node, strategy)``
    (its collectives inside it included) plus ``OP_OVERHEAD``, each move between them
    ``move_seconds(moved node, consumer, slot, (source placement, wanted placement, divergent),
    is_float)``: the ILP's optimum, without parameter byte prices or a memory row; None where the
    solver does not prove it optimal. With ``strategy_time`` and the moves' collectives without
    their launch overhead this is a floor of what a plan's compute and tp terms add up to per
    microbatch (``planner.floors``), the ILP's own objective being those terms and one
    ``LAUNCH_OVERHEAD`` per collective between ops."""
    nodes, ids, rep, mult, uses, masked, groups = _layout(cap, options)
    costs = [mult[n] * np.array([op_seconds(n, s) + (OP_OVERHEAD if n.op == "call_function" else 0.0)
                                 for s in options[n]]) for n in nodes]
    edges, shared = _edges(options, ids, uses, masked, groups, move_seconds)
    sol = solve_strategies(costs, edges, shared=shared)
    if sol.status != "optimal":
        return None
    return evaluate(costs, edges, sol.choice, shared=shared)[0]


# ---- from an assignment to a Plan, and back ------------------------------------------------

def _op_name(node: Node) -> str:
    if node.op != "call_function":
        return node.op
    return str(node.target) if isinstance(node.target, torch._ops.OpOverload) else node.target.__name__


@dataclass(frozen=True)
class Sharding:
    """What the chosen strategies decide, as a Plan records it: the placements, the node strategies,
    the collectives per step (tp, dp and cp), the microbatch's input shapes, the model FLOPs of a
    step, how long the ILP took, and one rank's parameter bytes (its tp shards: what the dp sync
    and the update move without pipeline stages)."""

    parameters: tuple
    nodes: tuple
    collectives: tuple
    input_shapes: tuple
    model_flops: float
    solve_seconds: float
    local_bytes: float


def sharding_record(cap: Captured, assignment: Assignment, mesh, dev, *, zero: int, microbatches: int,
                    gpus_per_node: int = 8, kept=(), cp_attention="allgather") -> Sharding:
    """The ``Sharding`` of ``assignment`` on ``mesh`` with ``microbatches`` per step under ``zero``:
    the collectives summed as one pass over them would sum them. ``kept``: ZeRO-3's units kept
    gathered (names), whose backward re-gather is not issued. ``cp_attention``: how attention runs
    over cp, whose collectives it records."""
    from autopar.plans import CollectivePlan, ParamPlan, dp_placements

    strategies = assignment.strategies
    tp, dp = mesh.tp, mesh.dp
    tp_inter = axis_is_inter_node(tp, 1, gpus_per_node)
    laid, local_bytes, nodes, tp_bytes = _laid_out(cap, strategies, tp)
    on_dp = dp_placements(mesh, zero)
    # one tuple per layout and dp placements: the ZeRO stages and meshes of one tp often share both
    params = cached(cap.gm.graph, ("param_plans", tuple(on_dp.items())),
                    lambda: tuple(ParamPlan(fqn, full, {**on_dp, "tp": pl}, loc, aliases)
                                  for fqn, full, pl, loc, aliases in laid), laid)
    m = microbatches
    agg: dict[tuple, list] = {}
    for key, sizes in tp_bytes.items():   # summed as one pass over the collectives would sum them
        a = agg[key] = [0, 0.0]
        for nbytes in sizes:
            a[0] += m
            a[1] += nbytes * m
    gathered = working_copy_ratio(cap) or 1.0   # ZeRO-2/3 gather the weights at the compute dtype
    times = m if zero >= 2 else 1
    units = zero_unit_figures(strategies, zero_units(cap), tp, dev, tp_inter) if zero >= 2 and dp > 1 else None
    names = tuple(u.name for u in zero_units(cap)) if units else ()
    again = regathered_bytes(cap, strategies, zero_units(cap), tp) if units else ()
    for phase, kind, axis, share in dp_sync_collectives(mesh, zero):   # a split dp's on dp_shard and dp_replicate
        nbytes = local_bytes
        if (phase, kind) == ("bwd", "all_gather"):   # the units' linear weights, but the kept units'
            nbytes = sum(b for name, b in zip(names, again) if name not in kept)
            if nbytes <= 0:
                continue
        agg[(kind, axis, phase, "(all parameters)")] = [times, times * share * dp_sync_bytes(kind, nbytes, zero, gathered)]
    for kind, axis, phase, where, n, b in cp_collectives(cap, strategies, mesh.cp, tp, m, local_bytes, zero, mesh.dp_shard,
                                                        cp_attention):
        a = agg.setdefault((kind, axis, phase, where), [0, 0.0])
        a[0] += n
        a[1] += b
    colls = tuple(CollectivePlan(k, axis, ph, w, n, int(b)) for (k, axis, ph, w), (n, b) in agg.items())
    return Sharding(params, nodes, colls, tuple(shape(i) for i in cap.inputs), m * mesh.dp * _graph_flops(cap),
                    assignment.solve_seconds, local_bytes)


def _laid_out(cap: Captured, strategies: dict, tp: int):
    """What ``sharding_record`` reads off the strategies alone, once per graph, tp and strategies
    (``cost_model.memo``): per parameter (FQN, shape, tp placement, local shape, aliases), their
    local bytes, the NodePlans, and the bytes of each tp collective grouped by (kind, axis, phase,
    where) in the order they are emitted."""
    from autopar.plans import NodePlan

    def compute():
        laid, local_bytes = [], 0.0
        for fqn, node in cap.params.items():
            pl = strategies[node].output
            full = shape(node)
            loc = local_shape(full, pl, tp)
            local_bytes += float(np.prod(loc)) * node.meta["val"].element_size()
            laid.append((fqn, full, str(pl), loc, tuple(cap.aliases.get(fqn, ()))))
        nodes = tuple(NodePlan(n.name, _op_name(n), n.meta.get("module_path", ""),
                               tuple(map(str, strategies[n].inputs)), str(strategies[n].output),
                               strategies[n].local, strategies[n].regather)
                      for n in cap.gm.graph.nodes if n.op == "call_function")
        tp_bytes: dict[tuple, list] = {}
        for phase, kind, where, nbytes, _ in tp_collectives(cap, strategies, tp) if tp > 1 else []:
            tp_bytes.setdefault((kind, "tp", phase, where), []).append(nbytes)
        return laid, local_bytes, nodes, tp_bytes
    g = cap.gm.graph
    nodes = tuple(g.nodes)
    return cached(g, ("laid_out", tp, nodes), compute, *strategies_of(strategies, nodes))


@graph_cached
def _graph_flops(cap: Captured) -> float:
    """The FLOPs of one microbatch's forward and backward over every op of the graph."""
    return sum(sum(node_flops(n)) for n in cap.gm.graph.nodes if n.op == "call_function")


def strategies_from_plan(cap: Captured, options: dict[Node, list[Strategy]], plan) -> dict[Node, Strategy]:
    """The strategy per node a (possibly hand-edited) plan asks for, checked against the model."""
    from autopar.plans import PlanFormatError
    from autopar.placement import parse_placement

    by_name = {n.name: n for n in cap.gm.graph.nodes}
    chosen: dict[Node, Strategy] = {n: options[n][0] for n in options}
    for i, p in enumerate(plan.parameters):
        node = cap.params.get(p.fqn)
        if node is None:
            raise PlanFormatError(f"plan.parameters[{i}].fqn: the model has no parameter {p.fqn!r}")
        if tuple(p.shape) != shape(node):
            raise PlanFormatError(f"plan.parameters[{i}] ({p.fqn}): shape {list(p.shape)} does not match "
                                  f"the model's {list(shape(node))}")
        try:
            pl = parse_placement(p.placements.get("tp", "R"))
        except ValueError as e:
            raise PlanFormatError(f"plan.parameters[{i}].placements.tp ({p.fqn}): {e}") from None
        chosen[node] = Strategy((), pl)
    missing = set(cap.params) - {p.fqn for p in plan.parameters}
    if missing:
        raise PlanFormatError(f"plan.parameters: no entry for {', '.join(sorted(missing))}")
    for i, np_ in enumerate(plan.nodes):
        node = by_name.get(np_.name)
        where = f"plan.nodes[{i}] ({np_.name} in {np_.module or 'the top level'})"
        if node is None or _op_name(node) != np_.op:
            raise PlanFormatError(f"{where}: the model's graph has no {np_.op} node of that name")
        match = [s for s in options[node] if tuple(map(str, s.inputs)) == tuple(np_.inputs)
                 and str(s.output) == np_.output]
        if not match:
            valid = "; ".join(str(s) for s in options[node])
            raise PlanFormatError(f"{where}: no strategy ({', '.join(np_.inputs)}) -> {np_.output}; "
                                  f"valid: {valid}")
        chosen[node] = dataclasses.replace(match[0], regather=np_.regather)
    for i, np_ in enumerate(plan.nodes):
        node = by_name[np_.name]
        if np_.regather and not regather_candidate(node, chosen):
            raise PlanFormatError(f"plan.nodes[{i}].regather ({np_.name} in {np_.module or 'the top level'}): "
                                  "only a linear whose input is all-gathered from sequence shards can re-gather it")
    for node in options:
        if node.op == "call_function" and node.name not in {n.name for n in plan.nodes}:
            raise PlanFormatError(f"plan.nodes: no entry for node {node.name} "
                                  f"({node.meta.get('module_path') or 'top level'})")
    return chosen


def with_regather(strategies: dict[Node, Strategy]) -> dict[Node, Strategy]:
    """The strategies with every eligible sequence-parallel linear re-gathering its input in
    backward: (t-1)/t of those inputs' activation memory traded for one all-gather each. A node's
    re-gathering strategy is made once per strategy it replaces (``cost_model.memo``), so plans that
    re-gather the same way share the prices computed for its objects, and so do the twin ops of
    repeated blocks, which share their strategies (``enumerate_strategies``)."""
    return {n: cached(n.graph, ("regather",), lambda s=s: dataclasses.replace(s, regather=True), s)
            if regather_candidate(n, strategies) else s for n, s in strategies.items()}


def pin_parameters(options: dict[Node, list[Strategy]], cap: Captured, placements: dict[str, Placement]):
    """Options with each named parameter's placement fixed, and its consumers made to use it
    as it lies (a hand-written plan shards the compute, never gathers the weight)."""
    out = dict(options)
    for fqn, pl in placements.items():
        node = cap.params[fqn]
        out[node] = [Strategy((), pl)]
        for user in node.users:
            slots = [k for k, i in enumerate(user.all_input_nodes) if i is node]
            keep = [s for s in out[user] if all(s.inputs[k] == pl for k in slots)]
            out[user] = keep or out[user]
    return out
