"""A plan's step time and peak memory as sympy expressions in the global batch B and sequence length S.

``cost_expr(model, plan)`` (or ``autopar.cost_expr(plan, model)``) returns a ``CostExpr``; ``.at(B, S)``
re-evaluates it for new sizes by substitution, with no tracing and no planning. It equals the
numeric model (``Plan.predicted_step_time``, the largest ``MemoryPlan.peak``) of the same plan
run at (B, S): the same strategies, stages, microbatch count and recompute regions.

How it is built
---------------
1. One capture with dynamic shapes. The model is exported with dim 0 (batch) and dim 1
   (sequence) of every input left symbolic (``torch.export.Dim.AUTO``). Every node's shape is
   then a sympy expression in the microbatch size b and S, and every size a node takes as an
   argument (a view's shape, an arange's end) keeps its expression (``meta["sizes"]``). The
   graph is otherwise node for node the static graph the plan was made on
   (``capture_pass(dynamic_shapes=...)``), so the plan's strategies apply to it by name.

2. Per-node records, each a polynomial in (b, S). The numeric model prices a plan from a few
   quantities per node or per stage: an op's FLOPs and bytes moved under its strategy
   (``cost_model.strategy.strategy_work``), the rows of a collective inside it, the bytes of each tp
   collective between ops, the bytes crossing each pipeline cut, each stage's parameter,
   gradient, optimizer and activation bytes, each op's backward excess. Tensor sizes are
   products of dims, each dim a product of b, S and constants, and FLOPs are products of sizes,
   so each record is a polynomial. A sample's computation does not depend on the other samples,
   so each record is linear in b; attention makes some quadratic in S. Rather than re-derive
   PyTorch's FLOP formulas and the memory rules symbolically (a second copy that would drift
   from the first), each record is computed by the numeric code itself on the graph re-sized to
   a 2 x 3 grid of (b, S) -- re-sizing substitutes numbers for the symbols in ``meta["val"]``
   and ``meta["sizes"]``; nothing is traced again -- and interpolated exactly (degree 1 in b,
   2 in S, rational arithmetic). The fit is then checked at the plan's own (b, S), which is
   not on the grid: a record that is not such a polynomial is reported, not extrapolated.

3. The same formulas as the numeric model, fed sympy. ``compute_time`` (a roofline:
   ``sympy.Max``; a measured matmul curve becomes a ``Piecewise`` in log FLOPs) and
   ``collective_time`` (linear in bytes) take sympy as they take numbers; sums stay sums, and
   where the numeric model takes a max (the slowest pipeline stage, the busiest rank, the
   backward's largest excess, the stage with the most memory) the expression has
   ``sympy.Max``. Finally b = B / (dp * microbatches).

Grid sizes are multiples of tp, so every sharded dim divides evenly there. At sizes where a
shard does not divide evenly the numeric model pads (ceil division) and the expression is the
unpadded value.
"""
from __future__ import annotations

import dataclasses
from collections import Counter
from fractions import Fraction

import sympy
import torch
from torch.fx import Node
from torch.utils._pytree import tree_flatten, tree_unflatten

from autopar.graph.rules import shape
from autopar.graph.units import zero_units
from autopar.placement import local_shape

from .comm import axis_is_inter_node, collective_time
from .compute import attention_kind, compute_time
from .devices import DeviceSpec, get_device
from autopar.graph.views import VIEW_OPS

from .memory import stage_terms, unit_params
from .stages import inflight_microbatches, pipeline_time, rank_param_bytes, unit_costs
from .state import regathered_bytes
from .step import BACKWARD_SHARE, dp_sync_time, rank_unit_figures, rank_units, zero_unit_figures
from .strategy import OP_OVERHEAD, comm_bytes, strategy_work, tp_collectives
from .terms import rank_peaks, step_time

# Degrees of every record in (b, S); the fit is checked, so a model outside them is reported.
_DEG_B, _DEG_S = 1, 2


@dataclasses.dataclass(frozen=True)
class CostExpr:
    """Predicted costs of one plan as expressions in the global batch ``B`` and sequence length ``S``.

    ``step_time`` = ``compute`` + ``communication`` + ``update`` (seconds, as
    ``Plan.predicted_step_time`` splits them; the weight update does not depend on B or S); ``peak_memory`` (bytes) is the largest of ``stage_memory``, the peak of each
    pipeline stage's rank. ``traced`` is the plan's own (B, S)."""

    step_time: sympy.Expr
    compute: sympy.Expr
    communication: sympy.Expr
    update: sympy.Expr
    peak_memory: sympy.Expr
    stage_memory: tuple[sympy.Expr, ...]
    B: sympy.Symbol
    S: sympy.Symbol
    traced: tuple[int, int]

    def at(self, batch: int, seq: int) -> tuple[float, float]:
        """(step time in seconds, peak memory in bytes) at global batch ``batch`` and sequence ``seq``."""
        env = {self.B: sympy.Integer(batch), self.S: sympy.Integer(seq)}
        return float(self.step_time.subs(env)), float(self.peak_memory.subs(env))


def cost_expr(model: torch.nn.Module, plan, layout, example_inputs=None, *, device: str | DeviceSpec | None = None,
              gpus_per_node: int = 8) -> CostExpr:
    """Step time and peak memory of ``plan`` for ``model`` as sympy expressions in B and S.

    ``layout(cap, plan)``: the plan's decisions on a capture of the model, (strategy per node,
    layer units, node name -> stage; the last two empty without stages), as
    ``autopar.planner.stage_cut.plan_layout`` reads them; it is given, not imported, because the
    strategies and the units are the planner's, which the cost model does not import.

    ``example_inputs``: tensors whose dtypes (and dims past the second) the inputs have; by
    default every input is int64 token ids of the plan's input shapes. Dim 0 of every input is
    the batch and dim 1 the sequence. ``device``: what the plan was priced on (default: the
    plan's device, which must then be a preset; pass a profile's path or DeviceSpec otherwise).
    ``gpus_per_node`` as given to ``autopar.plan``."""
    from autopar.mesh import Mesh
    from autopar.graph.capture import capture_pass

    dev = _device(plan, device)
    mesh = Mesh.of_plan(plan)
    shapes = [tuple(s) for s in plan.input_shapes]
    if not shapes or any(len(s) < 2 or s[:2] != shapes[0][:2] for s in shapes):
        raise ValueError(f"cost_expr reads dim 0 of every input as the batch and dim 1 as the sequence, "
                         f"but the plan's input shapes are {shapes}")
    b0, s0 = shapes[0][:2]
    dtypes = ([x.dtype for x in example_inputs] if example_inputs is not None else [torch.long] * len(shapes))
    if len(dtypes) != len(shapes):
        raise ValueError(f"example_inputs has {len(dtypes)} tensors, the plan {len(shapes)} inputs")
    # Sizes of 0 and 1 are specialised by torch.export, so trace at 2 or more.
    traced = [torch.empty((max(b0, 2), max(s0, 2), *s[2:]), dtype=d, device="meta") for s, d in zip(shapes, dtypes)]
    auto = torch.export.Dim.AUTO
    cap = capture_pass(model, traced, dynamic_shapes=tuple({0: auto, 1: auto} for _ in traced))
    b, S = sympy.symbols("b S", positive=True, integer=True)
    graph = _SymbolicGraph(cap, b, S)
    graph.retype(plan.precision, max(b0, 2), max(s0, 2))

    rec, structure = _fit(graph, plan, layout, mesh, dev, gpus_per_node, b0, s0)
    compute, comm = _step_time(rec, structure, plan, mesh, dev, gpus_per_node)
    stage_memory = _stage_memory(rec, structure, mesh.pp)
    B = sympy.Symbol("B", positive=True, integer=True)
    to_global = {b: B / (mesh.dp * plan.microbatches)}
    compute, comm = compute.subs(to_global), comm.subs(to_global)
    stage_memory = tuple(m.subs(to_global) for m in stage_memory)
    # the optimizer's update as the plan priced it: its bytes do not depend on (B, S); the part of
    # an offloaded host update that the backward hides does, and is taken at the plan's own sizes
    update = sympy.Float(plan.predicted_update_s)
    return CostExpr(step_time(compute, [comm], update), compute, comm, update, _max(stage_memory), stage_memory, B, S,
                    (b0 * mesh.dp * plan.microbatches, s0))


def _fit(graph: "_SymbolicGraph", plan, layout, mesh, dev: DeviceSpec, gpus_per_node: int, b0: int, s0: int):
    """Every record as a polynomial in (b, S), fitted on a grid and checked at the plan's (b0, s0),
    and what does not depend on the sizes."""
    b, S = graph.b, graph.S
    q = mesh.tp   # grid sizes divisible by tp, so every shard is even there
    bs = [k * q for k in range(2, 5) if k * q != b0][:_DEG_B + 1]
    ss = [k * q for k in range(2, 6) if k * q != s0][:_DEG_S + 1]
    grid = {(x, y): _records(graph.at(x, y), plan, layout, mesh, gpus_per_node)[0] for x in bs for y in ss}
    check, structure = _records(graph.at(b0, s0), plan, layout, mesh, gpus_per_node, dev=dev)
    for (x, y), values in grid.items():
        if values.keys() != check.keys():
            raise ValueError(f"the model's graph at batch {x}, sequence {y} prices different ops than at "
                             f"batch {b0}, sequence {s0}; cost_expr needs one graph for all sizes")
    poly = _Interpolator(b, S, bs, ss)
    rec = {}
    for key, value in check.items():
        rec[key] = poly.fit([[grid[(x, y)][key] for y in ss] for x in bs])
        fitted = float(rec[key].subs({b: b0, S: s0}))
        if abs(fitted - value) > 1e-9 * max(abs(value), 1.0):
            raise ValueError(f"the cost record {key} is not a polynomial of degree {_DEG_B} in the batch and "
                             f"{_DEG_S} in the sequence length ({fitted} fitted, {value} measured at "
                             f"b={b0}, S={s0}); cost_expr cannot express this model's costs")
    return rec, structure


def _device(plan, device) -> DeviceSpec:
    try:
        return get_device(device if device is not None else plan.device)
    except ValueError as e:
        if device is not None:
            raise
        raise ValueError(f"the plan was priced on device {plan.device!r}, which is not a preset: pass "
                         f"device= the profile's JSON path or its DeviceSpec ({e})") from None


class _SymbolicGraph:
    """A dynamic-shape capture that can be re-sized: every node's shapes and size arguments
    as expressions in the symbols ``b`` and ``S``, and ``at(b, S)`` to make them numbers."""

    def __init__(self, cap, b: sympy.Symbol, S: sympy.Symbol):
        self.cap = cap
        names = {}
        for k, node in enumerate(cap.inputs):
            dims = node.meta["val"].shape
            for d, (sym, what) in enumerate(((b, "batch"), (S, "sequence length"))):
                expr = _expr(dims[d])
                if not isinstance(expr, sympy.Symbol):
                    raise ValueError(f"the model fixes the {what} (dim {d} of input {k}, {node.name}) at {expr} "
                                     f"when exported with dynamic shapes, so its cost cannot be a function of it")
                names[expr] = sym
        self.shapes: dict[Node, tuple[list, object]] = {}   # node -> (flattened value, its tree spec)
        self.sizes: dict[Node, list] = {}
        for node in cap.gm.graph.nodes:
            val = node.meta.get("val")
            if isinstance(val, (torch.Tensor, list, tuple)):
                leaves, spec = tree_flatten(val)
                self.shapes[node] = ([_Shape(tuple(_expr(d).subs(names) for d in t.shape), t.dtype)
                                      if isinstance(t, torch.Tensor) else t for t in leaves], spec)
            if "sizes" in node.meta:
                self.sizes[node] = [None if v is None else _expr(v).subs(names) for v in node.meta["sizes"]]
        free = {s for leaves, _ in self.shapes.values() for t in leaves if isinstance(t, _Shape)
                for d in t.dims for s in d.free_symbols}
        free |= {s for v in self.sizes.values() for e in v if e is not None for s in e.free_symbols}
        if free - {b, S}:
            raise ValueError(f"the exported model has sizes that depend on more than the batch and sequence "
                             f"length ({', '.join(map(str, sorted(free - {b, S}, key=str)))})")
        self.b, self.S = b, S

    def at(self, b: int, S: int, mode=None):
        """The capture, its tensors and size arguments put at microbatch ``b`` and sequence ``S``
        (meta tensors, or fake tensors of ``mode``)."""
        env = {self.b: b, self.S: S}

        def tensor(x):
            if not isinstance(x, _Shape):
                return x
            size = [int(d.subs(env)) for d in x.dims]
            if mode is None:
                return torch.empty(size, dtype=x.dtype, device="meta")
            with mode:
                return torch.empty(size, dtype=x.dtype, device="meta")

        for node, (leaves, spec) in self.shapes.items():
            node.meta.pop("flops", None)   # node_flops' cache of the old sizes
            node.meta["val"] = tree_unflatten([tensor(x) for x in leaves], spec)
        for node, template in self.sizes.items():
            leaves, spec = tree_flatten((node.args, node.kwargs))
            node.args, node.kwargs = tree_unflatten(
                [v if e is None else int(e.subs(env)) for v, e in zip(leaves, template)], spec)
        return self.cap

    def retype(self, precision: str, b: int, S: int) -> None:
        """Give every value the dtype ``autopar.passes.precision.retyped`` gives it at ``precision``.

        Dtypes do not depend on sizes, so one propagation, at (b, S), serves every size."""
        from torch._subclasses.fake_tensor import FakeTensorMode

        from autopar.graph.precision import retyped

        self.at(b, S, mode=FakeTensorMode())
        typed = retyped(self.cap, precision)   # a copy: this graph re-sizes its own capture, which takes its dtypes
        self.cap.gm.meta.update(typed.gm.meta)
        typed_nodes = {n.name: n for n in typed.gm.graph.nodes}
        for node, (leaves, spec) in self.shapes.items():
            vals = tree_flatten(typed_nodes[node.name].meta["val"])[0]
            self.shapes[node] = ([_Shape(x.dims, v.dtype) if isinstance(x, _Shape) else x
                                  for x, v in zip(leaves, vals)], spec)


@dataclasses.dataclass(frozen=True)
class _Shape:
    """A tensor's size as expressions in (b, S), and its dtype."""

    dims: tuple[sympy.Expr, ...]
    dtype: torch.dtype


def _expr(d) -> sympy.Expr:
    return sympy.sympify(d.node.expr) if isinstance(d, torch.SymInt) else sympy.Integer(int(d))


def _records(cap, plan, layout, mesh, gpus_per_node: int, dev: DeviceSpec | None = None) -> tuple[dict, dict]:
    """The numeric model's per-node and per-stage quantities at the capture's current sizes
    ({key: number}), and what does not depend on the sizes (dtypes, collective kinds, stages;
    with ``dev``, the seconds of the data-parallel gradient sync)."""
    from autopar.graph.precision import working_copy_ratio

    strategies, units, where = layout(cap, plan)
    working_copy = working_copy_ratio(cap)
    calls = [n for n in cap.gm.graph.nodes if n.op == "call_function"]
    rec, structure = {}, {"ops": {}, "tp": [], "calls": [n.name for n in calls]}
    for n in calls:
        if n.target in VIEW_OPS:
            continue
        s = strategies[n]
        flops, nbytes, dtype = strategy_work(n, s)
        rec[("flops", n.name)], rec[("bytes", n.name)] = flops, nbytes
        if s.comm:
            rec[("rows", n.name)] = shape(n.args[0])[0]
        structure["ops"][n.name] = (dtype, tuple(kind for kind, _ in s.comm), attention_kind(n))
    if mesh.tp > 1:
        for i, (_, kind, _, nbytes, consumer) in enumerate(tp_collectives(cap, strategies, mesh.tp)):
            rec[("tp", i)] = nbytes
            structure["tp"].append((kind, consumer.name))

    regions = [[{n.name: n for n in calls}[name] for name in region] for region in plan.recompute_regions]
    structure["recomputed"] = [n.name for region in regions for n in region]
    stage_nodes = inflight = None
    if plan.stages:
        structure.update(_pipeline(cap, strategies, units, where, plan, mesh, gpus_per_node, working_copy, rec))
        stage_nodes = [[n for n in calls if where.get(n.name, len(plan.stages) - 1) == s]
                       for s in range(len(plan.stages))]
        inflight = inflight_microbatches(mesh.pp, plan.microbatches, plan.virtual_stages, plan.schedule)
    structure["excess_nodes"] = []
    for s, nodes in enumerate(stage_nodes or [calls]):
        params, grads, opt, act, excess = stage_terms(cap, strategies, mesh, nodes, regions, zero=plan.zero,
                                                      microbatches=plan.microbatches, working_copy=working_copy,
                                                      offload=plan.offload != "none", kept=plan.keep_gathered,
                                                      offload_kept=plan.offload_kept)
        terms = dict(params=params, grads=grads, optimizer=opt, activations=act * (inflight[s] if inflight else 1))
        for field, value in terms.items():
            rec[("memory", s, field)] = value
        for n, value in excess:
            rec[("excess", n.name)] = value
        structure["excess_nodes"].append([n.name for n, _ in excess])
    if dev is not None:
        structure["dp_sync"] = _dp_sync(cap, strategies, units, structure.get("bounds"), plan, mesh, dev,
                                        gpus_per_node, working_copy)
    return rec, structure


def _pipeline(cap, strategies, units, where, plan, mesh, gpus_per_node: int, working_copy: float, rec: dict) -> dict:
    """Units, stage bounds and the pipeline's cut records."""
    # unit_costs gives a cut's seconds as 2 * bytes / link bandwidth: on links of 2 bytes/s they are
    # the bytes themselves, which are the record (the plan's device prices them afterwards).
    link = dataclasses.replace(get_device("cpu"), intra_node_bw=2.0, inter_node_bw=2.0)
    boundary = unit_costs(cap, strategies, units, mesh, link, gpus_per_node=gpus_per_node)[1]
    first = [where[u.nodes[0].name] for u in units]
    bounds = [(first.index(s), len(first) - first[::-1].index(s)) for s in range(len(plan.stages))]
    for k, nbytes in enumerate(boundary):
        rec[("cut", k)] = float(nbytes)
    return {"units": [[n.name for n in u.nodes] for u in units], "bounds": bounds, "stage_of": where}


def _dp_sync(cap, strategies, units, bounds, plan, mesh, dev: DeviceSpec, gpus_per_node: int,
             working_copy: float) -> float:
    """Seconds of the gradient sync over dp, as the numeric model prices it: over the parameters of
    the busiest pipeline rank, or of the whole model without stages. It holds no (b, S): ZeRO-2/3's
    prefetch hides it behind the units' compute at the plan's own shapes."""
    zero_units_, ranked = None, ()
    if plan.stages:
        time = unit_costs(cap, strategies, units, mesh, dev, gpus_per_node=gpus_per_node)[0]
        params = unit_params(cap, strategies, units, mesh.tp)
        local = rank_param_bytes(params, bounds, mesh)
        if plan.zero >= 2 and mesh.dp > 1:
            zero_units_ = rank_unit_figures(time, params, bounds, mesh)
            ranked = [units[k] for k in rank_units(params, bounds, mesh)]
    else:
        local = sum(float(torch.Size(local_shape(tuple(n.meta["val"].shape), strategies[n].output, mesh.tp)).numel())
                    * n.meta["val"].element_size() for n in cap.params.values())
        if plan.zero >= 2 and mesh.dp > 1:
            zero_units_ = zero_unit_figures(strategies, zero_units(cap), mesh.tp, dev,
                                            axis_is_inter_node(mesh.tp, 1, gpus_per_node))
            ranked = zero_units(cap)
    kept = tuple(k for k, u in enumerate(ranked) if u.name in plan.keep_gathered)
    again = regathered_bytes(cap, strategies, ranked, mesh.tp) if zero_units_ is not None else None
    return dp_sync_time(local, mesh, dev, plan.zero, gpus_per_node, microbatches=plan.microbatches,
                        gathered=working_copy or 1.0, units=zero_units_, kept=kept, regathered=again)


class _Interpolator:
    """Exact polynomial interpolation on a tensor grid: degree len(bs)-1 in b, len(ss)-1 in S."""

    def __init__(self, b, S, bs, ss):
        self.basis = [[sympy.expand(_lagrange(b, bs, i) * _lagrange(S, ss, j)) for j in range(len(ss))]
                      for i in range(len(bs))]
        self.cache: dict[tuple, sympy.Expr] = {}

    def fit(self, values: list[list[float]]) -> sympy.Expr:
        key = tuple(tuple(row) for row in values)
        if key not in self.cache:
            # floats hold integers (or integers over tp) exactly: keep them exact
            self.cache[key] = sympy.expand(sympy.Add(*[
                sympy.Rational(Fraction(v)) * self.basis[i][j] for i, row in enumerate(values)
                for j, v in enumerate(row) if v]))
        return self.cache[key]


def _lagrange(x, points, i):
    out = sympy.Integer(1)
    for j, p in enumerate(points):
        if j != i:
            out *= (x - p) / sympy.Integer(points[i] - p)
    return out


def _sum(terms) -> sympy.Expr:
    """A sum of many (often repeated) expressions, built once rather than term by term."""
    counts = Counter(terms)
    return sympy.Add(*[c * t for t, c in counts.items()])


def _max(terms) -> sympy.Expr:
    unique = list(dict.fromkeys(terms))
    # unevaluated: sympy's evaluation compares every pair of arguments symbolically, seconds for a
    # stage's hundreds of excess terms; substituting sizes evaluates the Max all the same
    return unique[0] if len(unique) == 1 else sympy.Max(*unique, evaluate=False)


def _step_time(rec: dict, st: dict, plan, mesh, dev: DeviceSpec, gpus_per_node: int):
    """(compute, communication) seconds in (b, S), as the numeric model adds them up."""
    tp, m = mesh.tp, plan.microbatches
    tp_inter = axis_is_inter_node(tp, 1, gpus_per_node)

    def op_time(name: str, with_comm: bool) -> sympy.Expr:
        if name not in st["ops"]:   # a view
            return sympy.Integer(0)
        dtype, kinds, causal = st["ops"][name]
        t = compute_time(rec[("flops", name)], rec[("bytes", name)], dev, dtype, causal)
        if with_comm:
            t += _sum(collective_time(k, comm_bytes(k, rec[("rows", name)], tp), tp, dev, tp_inter) for k in kinds)
        return t

    tp_time = [collective_time(kind, rec[("tp", i)], tp, dev, tp_inter) for i, (kind, _) in enumerate(st["tp"])]
    forward = 1 - BACKWARD_SHARE   # a recomputed op runs its forward again (``step.recompute_seconds``)
    if not plan.stages:
        compute = m * (_sum(op_time(n, False) for n in st["calls"]) + OP_OVERHEAD * len(st["calls"])
                       + forward * (_sum(op_time(n, False) for n in st["recomputed"])
                                    + OP_OVERHEAD * len(st["recomputed"])))
        return compute, m * _sum(tp_time) + st["dp_sync"]

    unit_of = {n: k for k, names in enumerate(st["units"]) for n in names}
    unit_terms = [[OP_OVERHEAD * len(names)] + [op_time(n, True) for n in names] for names in st["units"]]
    for n in st["recomputed"]:
        unit_terms[unit_of[n]] += [forward * OP_OVERHEAD, forward * op_time(n, True)]
    for t, (_, consumer) in zip(tp_time, st["tp"]):
        if consumer in unit_of:
            unit_terms[unit_of[consumer]].append(t)
    pp_inter = axis_is_inter_node(mesh.pp, tp, gpus_per_node)
    bw = dev.inter_node_bw if pp_inter else dev.intra_node_bw
    stage_times = []
    for s, (a, e) in enumerate(st["bounds"]):
        terms = [x for u in range(a, e) for x in unit_terms[u]]
        if s > 0:
            terms.append(2 * rec[("cut", a - 1)] / bw)
        stage_times.append(_sum(terms))
    step = pipeline_time(stage_times, mesh.pp, m, plan.virtual_stages, add=_sum, maximum=_max)
    return step, sympy.Float(st["dp_sync"])


def _stage_memory(rec: dict, st: dict, pp: int) -> list[sympy.Expr]:
    """Each stage rank's peak bytes in (b, S): static state, activations, the backward's largest excess
    (``terms.rank_peaks``, the numeric model's sum)."""
    held = [[rec[("memory", s, f)] for f in ("params", "grads", "optimizer", "activations")]
            for s in range(len(st["excess_nodes"]))]
    transients = [_max([sympy.Integer(0)] + [rec[("excess", n)] for n in names]) for names in st["excess_nodes"]]
    return rank_peaks(held, transients, pp, add=_sum, maximum=_max)
