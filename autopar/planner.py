"""The tensor-parallel planner: one strategy per node, chosen by an ILP over the cost model.

For every node the sharding rules list strategies; the cost of a strategy is its
compute time (divided as the strategy divides the work) plus the collectives inside
it; the cost of an edge is the collectives that move the producer's placement into
the one the consumer asks for, forward and backward (``passes.reshard``), paid once
per producer and form however many consumers want it so (the rewrite moves it once);
a parameter's strategy also pays the optimizer update and dp gradient sync of its
local shard. That is the step time ``build_plan`` prices. The ILP (``autopar.ilp``)
picks the cheapest consistent assignment.

Repeated transformer blocks are solved once: the ILP sees the non-block nodes plus
one block whose node and internal-edge costs are multiplied by the block count L,
plus a loop edge from the block's output back to its input consumers weighted L-1
(block i's output feeds block i+1). That is exact over assignments that repeat
per block, and the ILP's size no longer grows with depth.
"""
from __future__ import annotations

import re
import time
from collections import Counter
import dataclasses
from dataclasses import dataclass

import numpy as np
import torch
from torch.fx import Node

from autopar.cost_model import attention_kind, collective_time, compute_time, node_bytes, node_flops, summed_bytes
from autopar.cost_model.memory import VIEW_OPS
from autopar.ilp import solve_strategies
from autopar.passes.capture import Captured
from autopar.passes.reshard import ReshardError, can_regather, regather_candidate, reshard_steps, step_collectives
from autopar.passes.rules import POINTWISE, RuleContext, Strategy, dim_labels, is_float, shape, strategies_for
from autopar.placement import R, Placement, Shard, local_shape

aten = torch.ops.aten


# Fixed host-side cost of issuing one collective (kernel launch, stream sync). Besides being
# real, it decides ties: ring all-reduce moves the same bytes as reduce-scatter + all-gather.
LAUNCH_OVERHEAD = 2e-6


class PlanError(ValueError):
    """The model cannot be planned on this mesh; the message says why and what would work."""


@dataclass
class Assignment:
    """The planner's answer: a strategy per node, and how long the ILP took."""

    strategies: dict[Node, Strategy]
    options: dict[Node, list[Strategy]]
    solve_seconds: float
    objective: float


def tensor_bytes(node: Node) -> float:
    val = node.meta.get("val")
    vals = val if isinstance(val, (list, tuple)) else [val]
    return float(sum(v.numel() * v.element_size() for v in vals if isinstance(v, torch.Tensor)))


def divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def check_tp(cap: Captured, tp: int) -> None:
    """Fail early, with the valid choices, when tp cannot split the attention heads or hidden size."""
    for node in cap.gm.graph.nodes:
        if node.target is aten.scaled_dot_product_attention.default:
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


def enumerate_strategies(cap: Captured, tp: int, sequence_parallel) -> dict[Node, list[Strategy]]:
    """Candidate strategies per node, with the sequence-parallel choice applied."""
    g = cap.gm.graph
    chunks = {len(n.meta["val"]) for n in g.nodes if n.target in (aten.split.Tensor, aten.chunk.default)
              and len({tuple(v.shape) for v in n.meta["val"]}) == 1}
    labels = dim_labels(cap.gm, cap.inputs)
    ctx = RuleContext(tp, tuple(sorted({1} | chunks)), labels)

    def seq_sharded(p: Placement, node: Node) -> bool:
        return isinstance(p, Shard) and labels.get(node, ())[p.dim:p.dim + 1] == ("seq",)

    options: dict[Node, list[Strategy]] = {}
    for node in g.nodes:
        if node.op == "call_function" and tp == 1:
            opts = [Strategy(tuple(R for _ in node.all_input_nodes), R)]
            options[node] = opts
        elif node.op == "call_function":
            opts = strategies_for(node, ctx)
            if sequence_parallel is False:
                opts = [s for s in opts if not seq_sharded(s.output, node)
                        and not any(seq_sharded(p, i) for p, i in zip(s.inputs, node.all_input_nodes))]
            elif sequence_parallel is True and node.target is aten.layer_norm.default:
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
    return options


def _block_of(path: str) -> tuple[str, int] | None:
    m = re.match(r"^(.*?)\.(\d+)(\.|$)", path)
    return (m.group(1), int(m.group(2))) if m else None


def find_blocks(cap: Captured) -> list[list[Node]] | None:
    """The repeated blocks (nodes per block, in order) if the graph has identical ones."""
    blocks: dict[int, list[Node]] = {}
    prefix = None
    for node in cap.gm.graph.nodes:
        key = _block_of(node.meta.get("module_path") or "")
        if node.op == "placeholder" and node.meta.get("kind") == "param":
            key = _block_of(node.meta["fqn"])
        if key is None:
            continue
        if prefix not in (None, key[0]):
            return None
        prefix = key[0]
        blocks.setdefault(key[1], []).append(node)
    if len(blocks) < 2 or sorted(blocks) != list(range(len(blocks))):
        return None
    ordered = [blocks[i] for i in range(len(blocks))]

    def signature(nodes: list[Node]):
        index = {n: k for k, n in enumerate(nodes)}
        return [(n.op, str(n.target) if n.op == "call_function" else "", shape(n) if n.op != "output" and "val" in n.meta else None,
                 tuple(index.get(i, -1) for i in n.all_input_nodes)) for n in nodes]
    first = signature(ordered[0])
    if any(signature(b) != first for b in ordered[1:]):
        return None
    return ordered


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
    step time per byte of a parameter's local shard outside the ops (``param_byte_time``)."""
    g = cap.gm.graph
    rep: dict[Node, Node] = {n: n for n in options}
    # A block is charged to the first one whose nodes have the same options in the same order:
    # a strategy index of one is then the same strategy in the other (restricted options, e.g.
    # a plan's sequence-parallel rule over layers whose dims are labelled apart, can differ).
    first: dict[tuple, list[Node]] = {}
    for block in find_blocks(cap) or []:
        twin = first.setdefault(tuple(tuple(map(str, options.get(n, ()))) for n in block), block)
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

    node_costs = [mult[n] * np.array([_strategy_time(n, s, tp, dev, inter_node)
                                      + param_byte_seconds * _param_memory(n, s, tp, 1.0) for s in options[n]])
                  for n in nodes]
    memory = None
    if memory_budget is not None:
        memory = [mult[n] * np.array([_param_memory(n, s, tp, param_state_bytes) for s in options[n]])
                  for n in nodes]
    edges = [(ids[p], ids[c], k * _edge_matrix(p, c, slot, options, tp, dev, inter_node))
             for (p, c, slot), k in uses.items()]
    edges += [(ids[p], ids[c], np.where(np.isinf(_edge_matrix(p, c, slot, options, tp, dev, inter_node)), np.inf, 0.0))
              for p, c, slot in masked if (p, c, slot) not in uses]
    shared = [_shared_group(p, members, k, ids, options, tp, dev, inter_node) for (p, members), k in groups.items()]
    t0 = time.perf_counter()
    sol = solve_strategies(node_costs, edges, node_memory=memory, memory_budget=memory_budget, shared=shared)
    seconds = time.perf_counter() - t0
    return Assignment({n: options[n][sol.choice[ids[rep[n]]]] for n in options},
                      options, seconds, sol.objective)


def param_byte_time(mesh, dev, *, zero: int, working_copy: bool, gpus_per_node: int = 8) -> float:
    """Step seconds per byte of one rank's parameter shards spent outside the forward and
    backward ops: the optimizer update (``update_time``) and the dp gradient sync, both
    linear in those bytes as ``build_plan`` and ``plan_update_time`` price them (with
    pipeline stages each rank holds about 1/pp of the layers, so 1/pp of it is charged)."""
    from autopar.cost_model import axis_is_inter_node
    from autopar.cost_model.compute import update_time

    seconds = update_time(1.0, dev, working_copy=working_copy, optimizer_shards=mesh.dp if zero else 1)
    if mesh.dp > 1:
        inter = axis_is_inter_node(mesh.dp, mesh.pp * mesh.tp, gpus_per_node)
        kinds = ["reduce_scatter", "all_gather"] if zero else ["all_reduce"]
        # the latency of the one bucketed collective per kind does not depend on the placements
        seconds += sum(collective_time(k, 1.0, mesh.dp, dev, inter) - collective_time(k, 0.0, mesh.dp, dev, inter)
                       for k in kinds)
    return seconds / mesh.pp


def _edge_matrix(producer: Node, consumer: Node, slot: int, options, tp, dev, inter_node) -> np.ndarray:
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
                cache[key] = _move_time(moved, consumer.target, slot, key, tp, dev, inter_node, fl)
            m[i, j] = cache[key]
    return m


def _move_time(moved: Node, consumer_target, slot: int, form: tuple, tp: int, dev, inter_node: bool,
               fl: bool) -> float:
    """Seconds of the collectives moving the value ``moved`` from placement ``form[0]`` to
    ``form[1]`` (``form[2]``: its gradient is partial) for one consumer input; inf where no
    reshard exists."""
    nbytes, dtype = tensor_bytes(moved), getattr(moved.meta.get("val"), "dtype", None)
    try:
        kinds = edge_collectives(consumer_target, slot, *form, fl)
    except ReshardError:
        return np.inf
    return sum(collective_time(kind, summed_bytes(kind, nbytes, dtype), tp, dev, inter_node) + LAUNCH_OVERHEAD
               for _, kind in kinds)


def _shared_group(producer: Node, members, count: int, ids, options, tp, dev, inter_node):
    """The ILP's shared group (``autopar.ilp``) of one producer's consumers: each consumer strategy
    asks for a form (placement, divergent) of the value, and every distinct form is paid once."""
    fl = is_float(producer)
    forms: dict[tuple, int] = {}
    keyed = []
    for c, slot in members:
        keys = [forms.setdefault((b.inputs[slot], b.divergent(slot) and fl), len(forms)) for b in options[c]]
        keyed.append((ids[c], keys))
    c0, slot0 = members[0]
    table = np.array([[_move_time(producer, c0.target, slot0, (a.output, *form), tp, dev, inter_node, fl)
                       for form in forms] for a in options[producer]])
    # an impossible move is forbidden by the pairwise edge; the group only prices possible ones
    return ids[producer], keyed, count * np.where(np.isinf(table), 0.0, table)


def strategy_work(node: Node, s: Strategy) -> tuple[float, float, torch.dtype]:
    """(FLOPs, bytes moved, dtype) of a call_function node's forward and backward on one rank
    under strategy ``s``: what ``compute_time`` prices (views excluded by the caller)."""
    fwd, bwd = node_flops(node)   # cached by the cost model per op signature
    val = node.meta["val"]
    dtype = val.dtype if isinstance(val, torch.Tensor) else torch.float32
    return (fwd + bwd) / s.divisor, op_traffic(node) / s.divisor, dtype


def op_traffic(node: Node) -> float:
    """Bytes a call_function node's forward and backward move, unsharded, as the cost model counts them."""
    # Inductor fuses chains of pointwise ops, so one costs about a write of its output
    # forward and one backward; other ops read and write their tensors, backward ~2x.
    return 2 * tensor_bytes(node) if node.target in POINTWISE else 3 * node_bytes(node)


def _strategy_time(node: Node, s: Strategy, tp: int, dev, inter_node: bool, with_comm: bool = True) -> float:
    if node.op != "call_function" or node.target in VIEW_OPS:
        return 0.0
    flops, nbytes, dtype = strategy_work(node, s)
    t = compute_time(flops, nbytes, dev, dtype, attention_kind(node))
    if not with_comm:   # the plan prices the in-op collectives, latency too, with the others
        return t
    rows = shape(node.args[0])[0] if s.comm else 0
    return t + sum(collective_time(kind, _comm_bytes(kind, rows, tp), tp, dev, inter_node) for kind, _ in s.comm)


def _comm_bytes(kind: str, rows: int, tp: int) -> float:
    """Full size of a per-row fp32 collective inside an op (an all-gather's output is tp rows deep)."""
    return rows * 4.0 * (tp if kind == "all_gather" else 1)


def _param_memory(node: Node, s: Strategy, tp: int, state_bytes: float) -> float:
    if node.meta.get("kind") != "param":
        return 0.0
    # padded as the shard really is: the plan prices the update and dp sync of these bytes
    return float(np.prod(local_shape(shape(node), s.output, tp))) * node.meta["val"].element_size() * state_bytes


# ---- from an assignment to a Plan, and back ------------------------------------------------

def _op_name(node: Node) -> str:
    if node.op != "call_function":
        return node.op
    return str(node.target) if isinstance(node.target, torch._ops.OpOverload) else node.target.__name__


def tp_collectives(cap: Captured, strategies: dict[Node, Strategy], tp: int):
    """(phase, kind, where, bytes, consumer node) of every tp collective the rewrite will emit."""
    out, seen = [], set()
    for c in cap.gm.graph.nodes:
        regather = False
        if c.op == "output":
            pairs = [(p, R, False) for p in c.all_input_nodes]
        elif c.op == "call_function":
            s = strategies[c]
            regather = s.regather
            pairs = [(p, s.inputs[k], s.divergent(k) and is_float(p)) for k, p in enumerate(c.all_input_nodes)]
            rows = shape(c.args[0])[0] if s.comm else 0
            out += [("fwd", kind, c.meta.get("module_path", ""), _comm_bytes(kind, rows, tp), c)
                    for kind, _ in s.comm]
        else:
            continue
        for slot, (p, dst, div) in enumerate(pairs):
            kinds = edge_collectives(c.target, slot, strategies[p].output, dst, div, is_float(p), regather=regather)
            own = regather and can_regather(c.target, slot, strategies[p].output,
                                            reshard_steps(strategies[p].output, dst, div))
            if not own:   # the rewrite moves a value once for all consumers wanting it the same way
                if (p, dst, div) in seen:
                    continue
                seen.add((p, dst, div))
            moved = c if isinstance(p.meta.get("val"), (list, tuple)) else p
            nbytes, dtype = tensor_bytes(moved), getattr(moved.meta.get("val"), "dtype", None)
            where = c.meta.get("module_path", "") or p.meta.get("module_path", "")
            out += [(phase, kind, where, summed_bytes(kind, nbytes, dtype), c) for phase, kind in kinds]
    return out


def edge_collectives(consumer_target, slot: int, src: Placement, dst: Placement, divergent: bool, is_float_: bool,
                     *, regather: bool = False):
    """(phase, kind) of the collectives moving one input from ``src`` to ``dst`` for its consumer
    (``regather``: the consumer keeps only the shard and gathers again in backward)."""
    steps = reshard_steps(src, dst, divergent)
    kinds = step_collectives(steps, is_float_)
    if regather and can_regather(consumer_target, slot, src, steps):
        kinds.append(("bwd", "all_gather"))
    return kinds


def build_plan(cap: Captured, assignment: Assignment, mesh, dev, *, sequence_parallel: bool,
               zero: int, microbatches: int, source: str, gpus_per_node: int = 8):
    """Turn the chosen strategies into a ``Plan`` with placements, collectives and predicted times."""
    from autopar.cost_model import axis_is_inter_node
    from autopar.plans import CollectivePlan, NodePlan, ParamPlan, Plan

    strategies = assignment.strategies
    tp, dp = mesh.tp, mesh.dp
    tp_inter = axis_is_inter_node(tp, 1, gpus_per_node)
    dp_inter = axis_is_inter_node(dp, mesh.pp * tp, gpus_per_node)
    params, local_bytes = [], 0.0
    for fqn, node in cap.params.items():
        pl = strategies[node].output
        full = shape(node)
        loc = local_shape(full, pl, tp)
        local_bytes += float(np.prod(loc)) * node.meta["val"].element_size()
        params.append(ParamPlan(fqn, full, {"dp": "S(0)" if zero and dp > 1 else "R", "tp": str(pl)},
                                loc, tuple(cap.aliases.get(fqn, ()))))
    nodes = tuple(NodePlan(n.name, _op_name(n), n.meta.get("module_path", ""),
                           tuple(map(str, strategies[n].inputs)), str(strategies[n].output),
                           strategies[n].local, strategies[n].regather)
                  for n in cap.gm.graph.nodes if n.op == "call_function")
    m = microbatches
    agg: dict[tuple, list] = {}
    for phase, kind, where, nbytes, _ in tp_collectives(cap, strategies, tp) if tp > 1 else []:
        a = agg.setdefault((kind, "tp", phase, where), [0, 0.0])
        a[0] += m
        a[1] += nbytes * m
    comm = sum(collective_time(k, b / n, tp, dev, tp_inter) * n for (k, _, _, _), (n, b) in agg.items())
    if dp > 1:
        kinds = ["reduce_scatter", "all_gather"] if zero else ["all_reduce"]
        for kind in kinds:
            agg[(kind, "dp", "step", "(all parameters)")] = [1, local_bytes]
            comm += collective_time(kind, local_bytes, dp, dev, dp_inter)
    compute = m * sum(_strategy_time(n, s, tp, dev, tp_inter, False) for n, s in strategies.items())
    colls = tuple(CollectivePlan(k, axis, ph, w, n, int(b)) for (k, axis, ph, w), (n, b) in agg.items())
    input_shapes = tuple(shape(i) for i in cap.inputs)
    model_flops = m * mesh.dp * sum(sum(node_flops(n)) for n in cap.gm.graph.nodes if n.op == "call_function")
    dtype = next(iter(cap.params.values())).meta["val"].dtype if cap.params else torch.float32
    return Plan((mesh.dp, mesh.pp, mesh.tp), input_shapes, bool(sequence_parallel), zero, m, dev.name,
                tuple(params), nodes, colls, compute, comm, solve_seconds=assignment.solve_seconds, source=source,
                model_flops=model_flops, peak_flops=dev.flops(dtype))


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
    backward: (t-1)/t of those inputs' activation memory traded for one all-gather each."""
    return {n: dataclasses.replace(s, regather=True) if regather_candidate(n, strategies) else s
            for n, s in strategies.items()}


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
