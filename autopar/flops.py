"""Parameters and FLOPs per module and per rank of a plan, in the manner of DeepSpeed's flops profiler.

What counts as a FLOP
    FLOPs are ``torch.utils.flop_counter.FlopCounterMode``'s: matmuls (mm, addmm, bmm, baddbmm)
    and attention, two FLOPs per multiply-add. Pointwise ops, bias adds, norms, softmax, embedding
    lookups and the loss count 0, as in the usual "model FLOPs" of Megatron-LM and PaLM. Every op
    of the captured graph runs once on meta tensors under the counter (cached per signature, so
    the 96 identical blocks of GPT-3 175B cost a few dozen runs).

Backward
    Counted by the counter on a real backward of each op (on meta tensors), asking for a gradient
    of exactly the inputs that need one in the model: those that depend on a parameter. So a
    matmul's backward is 2x its forward (input and weight gradients), 1x where its input needs no
    gradient. Attention runs on meta tensors as its math decomposition, whose backward is four
    bmm, 2x the forward; the causal mask is not discounted. The counter's formula for a GPU
    flash/efficient attention backward adds the recomputed scores (2.5x): that is hardware work,
    not model FLOPs, and it is not counted here.

Per rank: exact local shapes
    The tensor-parallel rewrite (``passes/shard.py``) runs each op on its inputs' local pieces, as
    the op's strategy places them. Each op is therefore counted again on meta tensors of those
    local shapes, rather than dividing the global count by the strategy's divisor: this is exact
    where the division is not. A padded vocabulary shard (50257 rows over tp=4 is 12565 rows a
    rank) computes its padding too, and an op the plan leaves replicated runs in full on every tp
    rank. The collectives the rewrite inserts count no FLOPs, and the local forms of the
    vocabulary-parallel embedding and cross-entropy do no matmul, like the ops they replace.

Replication
    Rows are per (pp rank, tp rank). Every dp replica holds the same parameters as its (pp, tp)
    peer (ZeRO-1 shards only the optimizer state) and runs the same FLOPs on its own slice of the
    batch, so per-step totals are dp times the sum over (pp, tp). Over tp, a parameter placed R
    (LayerNorm weights, row-parallel biases) is held whole by every tp rank, S(d) is split (padded
    shards: the last ranks hold padding, reported apart). Over pp, a parameter is held by every
    stage that uses it (GPT's tied embedding/head weight: the first and the last). A rank's
    ``unique_params`` is its share of the model's count: each entry divided by its number of
    holders, so the shares sum to the model's parameter count. For FLOPs:
        dp * sum over (pp, tp) of (flops - padding_flops - replicated_flops * (tp - 1) / tp)
          = model FLOPs per step.

MFU
    mfu = model FLOPs per step / (world size * peak FLOP/s * step time), the peak at the model's
    dtype from ``cost_model.devices``; hfu uses hardware FLOPs: model FLOPs plus the forward that
    recompute regions run again in backward (the ops whose values backward reads, and what they
    are computed from: ``_recomputed``).
"""
from __future__ import annotations

import io
import json
import math
import re
import warnings
from dataclasses import asdict, dataclass, fields
from pathlib import Path

import torch
from torch.fx import Node
from torch.fx.node import map_arg
from torch.utils._pytree import tree_flatten, tree_map
from torch.utils.flop_counter import FlopCounterMode

from autopar.cost_model.devices import get_device
from autopar.cost_model.devices import dtype_key
from autopar.placement import Replicate, Shard, local_shape, padded_size, parse_placement


@dataclass(frozen=True)
class ModuleStats:
    """One module of the model: its parameters and the FLOPs of the ops inside it, per step."""

    name: str                    # module FQN; "" is the whole model
    depth: int                   # 0 for the model, 1 for its children, ...
    params: int                  # a tied tensor counts once, under its first FQN
    fwd_flops: float
    bwd_flops: float
    recompute_flops: float = 0.0

    @property
    def flops(self) -> float:
        """Model FLOPs: forward + backward."""
        return self.fwd_flops + self.bwd_flops


@dataclass(frozen=True)
class RankStats:
    """What one (pp rank, tp rank) holds and executes per step; every dp replica of it the same."""

    pp: int
    tp: int
    stages: tuple[int, ...]
    modules: tuple[str, ...]     # first and last module of its stages
    params: int                  # entries held, padding excluded
    replicated_params: int       # of those, in tensors every tp rank holds whole
    padding_params: int          # padding entries of uneven shards, held besides ``params``
    unique_params: float         # share of the model's count (each entry / its holders)
    fwd_flops: float
    bwd_flops: float
    recompute_flops: float       # forward run again in backward by recompute regions
    replicated_flops: float      # of fwd + bwd, in ops every tp rank runs in full
    padding_flops: float         # of fwd + bwd, beyond an even 1/tp share (padded shards)

    @property
    def flops(self) -> float:
        """Model FLOPs this rank executes: forward + backward."""
        return self.fwd_flops + self.bwd_flops

    @property
    def hardware_flops(self) -> float:
        """FLOPs this rank executes, recompute included."""
        return self.flops + self.recompute_flops


@dataclass(frozen=True)
class FlopsReport:
    """Parameters and FLOPs of one plan: totals, per module, per (pp, tp) rank. JSON round-trips."""

    model: str
    mesh: tuple[int, int, int]
    device: str
    dtype: str
    peak_flops: float            # one device, at ``dtype``
    tokens: int                  # input elements per step (batch x sequence for a GPT)
    microbatches: int
    params: int
    fwd_flops: float             # per step, all ranks together
    bwd_flops: float
    recompute_flops: float
    modules: tuple[ModuleStats, ...]
    ranks: tuple[RankStats, ...]
    step_time: float | None = None
    notes: tuple[str, ...] = ()

    @property
    def world_size(self) -> int:
        """Devices in the mesh: dp x pp x tp."""
        return self.mesh[0] * self.mesh[1] * self.mesh[2]

    @property
    def model_flops(self) -> float:
        """Forward + backward FLOPs of one step, all ranks together."""
        return self.fwd_flops + self.bwd_flops

    @property
    def hardware_flops(self) -> float:
        """Model FLOPs plus the forward recomputed in backward."""
        return self.model_flops + self.recompute_flops

    def mfu(self, step_time: float | None = None) -> float:
        """Model FLOPs utilisation at ``step_time`` seconds per step (default: the report's)."""
        return mfu(self.model_flops, self._step_time(step_time), self.world_size, self.peak_flops)

    def hfu(self, step_time: float | None = None) -> float:
        """Hardware FLOPs utilisation (recompute counted) at ``step_time`` seconds per step."""
        return mfu(self.hardware_flops, self._step_time(step_time), self.world_size, self.peak_flops)

    def _step_time(self, step_time):
        t = self.step_time if step_time is None else step_time
        if t is None:
            raise ValueError("no step time: pass step_time= (seconds per training step, as measured)")
        return t

    def to_json(self, path=None) -> str:
        """The report as JSON text; also written to ``path`` when given."""
        text = json.dumps(asdict(self), indent=1)
        if path is not None:
            Path(path).write_text(text)
        return text

    @classmethod
    def from_json(cls, path_or_str) -> FlopsReport:
        """Read a report written by ``to_json`` (a path or the JSON text)."""
        text = str(path_or_str)
        data = json.loads(text if text.lstrip().startswith("{") else Path(path_or_str).read_text())
        nested = {"modules": ModuleStats, "ranks": RankStats}
        kwargs = {}
        for f in fields(cls):
            if f.name not in data:
                continue
            v = data[f.name]
            if f.name in nested:
                v = tuple(nested[f.name](**_tuples(item)) for item in v)
            elif isinstance(v, list):
                v = tuple(v)
            kwargs[f.name] = v
        return cls(**kwargs)


def _tuples(item: dict) -> dict:
    return {k: tuple(v) if isinstance(v, list) else v for k, v in item.items()}


def mfu(flops_per_step: float, step_time_s: float, world_size: int, peak_flops: float) -> float:
    """FLOPs per step / (world_size devices x peak FLOP/s x seconds per step)."""
    if not (isinstance(step_time_s, (int, float)) and math.isfinite(step_time_s) and step_time_s > 0):
        raise ValueError(f"step time must be a positive number of seconds, got {step_time_s!r}")
    if world_size < 1 or peak_flops <= 0:
        raise ValueError(f"need world_size >= 1 and a positive peak, got {world_size} and {peak_flops}")
    return flops_per_step / (world_size * peak_flops * step_time_s)


# ---- counting ------------------------------------------------------------------------------

@dataclass(frozen=True)
class _T:
    """A tensor to count with: shape, dtype, whether the model wants its gradient."""

    shape: tuple[int, ...]
    dtype: torch.dtype
    grad: bool


@dataclass(frozen=True)
class _Count:
    """One op's FLOPs and what its backward keeps: which argument tensors (flattened positions),
    and whether it keeps its output or a value computed inside it."""

    fwd: float
    bwd: float
    saved: frozenset = frozenset()
    saves_own: bool = False


_NONE = _Count(0.0, 0.0)
_CACHE: dict = {}
_CACHE_MAX = 8192


def _meta(x):
    if isinstance(x, _T):
        return torch.empty(x.shape, dtype=x.dtype, device="meta", requires_grad=x.grad)
    if isinstance(x, torch.device):   # factory ops carry the capture device
        return torch.device("meta")
    return x


def _storage(t: torch.Tensor) -> int:
    """Identity of ``t``'s storage: a view (linear keeps weight.t()) is the tensor it views."""
    return t.untyped_storage()._cdata


def _op_flops(target, args, kwargs) -> _Count:
    """Count ``target`` on meta tensors described by the ``_T`` in its arguments."""
    leaves, spec = tree_flatten((args, kwargs))
    key = (target, str(spec), tuple(leaves))
    try:
        return _CACHE[key]
    except KeyError:
        pass
    except TypeError:   # an unhashable argument: count without caching
        key = None
    kept: list[int] = []
    with torch.enable_grad():
        margs, mkwargs = tree_map(_meta, (args, kwargs))
        try:
            with (torch.autograd.graph.saved_tensors_hooks(lambda t: kept.append(_storage(t)) or t, lambda t: t),
                  FlopCounterMode(display=False) as fwd):
                out = target(*margs, **mkwargs)
            outs = [t for t in tree_flatten(out)[0] if isinstance(t, torch.Tensor) and t.requires_grad]
            bwd_flops = 0
            if outs:
                with FlopCounterMode(display=False) as bwd:
                    torch.autograd.backward(outs, [torch.ones_like(t) for t in outs])
                bwd_flops = bwd.get_total_flops()
        except Exception as e:  # noqa: BLE001 - an op meta tensors cannot run loses only its count
            warnings.warn(f"flops_report: {target} does not run on meta tensors ({type(e).__name__}: {e}); "
                          "counting 0 FLOPs for it", stacklevel=2)
            return _NONE
    inputs = {_storage(t): k for k, t in enumerate(tree_flatten((margs, mkwargs))[0]) if isinstance(t, torch.Tensor)}
    result = _Count(float(fwd.get_total_flops()), float(bwd_flops),
                    frozenset(inputs[s] for s in kept if s in inputs), any(s not in inputs for s in kept))
    if key is not None:
        if len(_CACHE) >= _CACHE_MAX:
            _CACHE.clear()
        _CACHE[key] = result
    return result


def _needs_grad(cap) -> dict[Node, bool]:
    """Whether each node's value depends on a parameter (so backward computes its gradient)."""
    need: dict[Node, bool] = {}
    for n in cap.gm.graph.nodes:
        if n.op == "placeholder":
            need[n] = n.meta.get("kind") == "param"
        else:
            need[n] = any(need.get(i, False) for i in n.all_input_nodes)
    return need


def _is_float(dtype) -> bool:
    return dtype.is_floating_point or dtype.is_complex


def _node_flops(node: Node, placements, tp: int, need: dict[Node, bool]) -> tuple[_Count, set[Node]]:
    """``node`` counted with input k laid out as ``placements[k]`` over ``tp`` ranks, and the
    input nodes its backward keeps."""
    if not isinstance(node.target, torch._ops.OpOverload):
        return _NONE, set()
    where = dict(zip(node.all_input_nodes, placements))

    def spec(i: Node):
        def one(v):
            return _T(local_shape(tuple(v.shape), where[i], tp), v.dtype, need[i] and _is_float(v.dtype))
        val = i.meta["val"]
        return [one(v) for v in val] if isinstance(val, (list, tuple)) else one(val)

    def owner(i: Node):
        val = i.meta["val"]
        return [i] * len(val) if isinstance(val, (list, tuple)) else i

    count = _op_flops(node.target, map_arg(node.args, spec), map_arg(node.kwargs, spec))
    owners = tree_flatten((map_arg(node.args, owner), map_arg(node.kwargs, owner)))[0]
    return count, {owners[k] for k in count.saved}


def _recomputed(cap, regions, counts: dict[Node, _Count], kept: dict[Node, set[Node]]) -> set[Node]:
    """The nodes of the recompute regions that backward runs again: those whose values backward
    reads (kept by an op of the region, or, like attention's probabilities, computed inside an op
    that keeps them), with everything in the region they are computed from. The rest is not
    rerun: a block's last matmul, whose output only feeds the residual sum, is not recomputed
    (torch.utils.checkpoint stops once backward has what it needs; AOTAutograd's partitioner
    recomputes only what backward reads)."""
    by_name = {n.name: n for n in cap.gm.graph.nodes}
    out: set[Node] = set()
    for region in regions:
        members = {by_name[name] for name in region}
        todo = [n for n in members if counts[n].saves_own] + [i for n in members for i in kept[n] if i in members]
        while todo:
            n = todo.pop()
            if n not in out:
                out.add(n)
                todo += [i for i in n.all_input_nodes if i in members]
    return out


# ---- the report ----------------------------------------------------------------------------

def _held(shape: tuple[int, ...], placement, tp: int, rank: int) -> tuple[int, int]:
    """(real entries, padding entries) of tp rank ``rank``'s piece of a parameter."""
    total = math.prod(shape)
    if not isinstance(placement, Shard) or tp == 1:
        return total, 0
    d, k = placement.dim, placement.interleave
    block = shape[d] // k
    per = padded_size(block, tp)
    rows = max(0, min(per, block - rank * per))
    real = k * rows * (total // shape[d])
    return real, math.prod(local_shape(shape, placement, tp)) - real


def _stages(cap, plan) -> dict[Node, int]:
    """Stage index of every call_function node (all 0 without a pipeline)."""
    calls = [n for n in cap.gm.graph.nodes if n.op == "call_function"]
    if not plan.stages:
        return {n: 0 for n in calls}
    from autopar.graph.units import stage_of_nodes
    where = stage_of_nodes(cap, plan)
    last = len(plan.stages) - 1
    return {n: where.get(n.name, last) for n in calls}   # the loss tail runs on the last stage


def _ancestors(module: str) -> list[str]:
    parts = module.split(".") if module else []
    return [""] + [".".join(parts[:k]) for k in range(1, len(parts) + 1)]


def _flops_by_place(cap, strategies, plan, stage_of, pp_of_stage):
    """Per step: per module [params (filled later), fwd, bwd, recompute] of the whole model, and per
    (pp, tp) rank its fwd, bwd, recompute, replicated and padding FLOPs."""
    dp, pp, tp = plan.mesh
    m = plan.microbatches
    need = _needs_grad(cap)
    replicate = Replicate()
    counts, kept = {}, {}
    for n in stage_of:
        counts[n], kept[n] = _node_flops(n, [replicate] * len(n.all_input_nodes), 1, need)
    recomputed = _recomputed(cap, plan.recompute_regions, counts, kept)
    modules: dict[str, list[float]] = {}
    for fqn in cap.params:   # parameter-only modules (an embedding) belong in the tree too
        for a in _ancestors(fqn.rpartition(".")[0]):
            modules.setdefault(a, [0, 0.0, 0.0, 0.0])
    ranks = {(r, t): dict(fwd=0.0, bwd=0.0, rec=0.0, rep=0.0, pad=0.0) for r in range(pp) for t in range(tp)}
    for n, s in stage_of.items():
        g = (counts[n].fwd, counts[n].bwd)
        loc = g
        # an op without FLOPs has none locally either; views would need their shape arguments localized
        if tp > 1 and sum(g):
            c = _node_flops(n, strategies[n].inputs, tp, need)[0]
            loc = (c.fwd, c.bwd)
        rec = n in recomputed
        for a in _ancestors(n.meta.get("module_path", "")):
            acc = modules.setdefault(a, [0, 0.0, 0.0, 0.0])
            acc[1] += g[0] * m * dp
            acc[2] += g[1] * m * dp
            acc[3] += g[0] * m * dp * rec
        replicated = tp > 1 and sum(g) > 0 and loc == g
        for t in range(tp):
            acc = ranks[(pp_of_stage[s], t)]
            acc["fwd"] += loc[0] * m
            acc["bwd"] += loc[1] * m
            acc["rec"] += loc[0] * m * rec
            acc["rep"] += sum(loc) * m * replicated
            acc["pad"] += 0.0 if replicated else (sum(loc) - sum(g) / tp) * m
    return modules, ranks


def _params_by_place(cap, plan, stage_of, pp_of_stage, modules):
    """Adds each parameter to its modules' counts; per (pp, tp) rank the entries it holds,
    tp-replicated, padding and its share; and the parameters no stage holds."""
    _, pp, tp = plan.mesh
    held = {(r, t): dict(params=0, rep=0, pad=0, unique=0.0) for r in range(pp) for t in range(tp)}
    unused = []
    for fqn, node in cap.params.items():
        shape = tuple(node.meta["val"].shape)
        for a in _ancestors(fqn.rpartition(".")[0]):
            modules[a][0] += math.prod(shape)
        holders = sorted({pp_of_stage[stage_of[u]] for u in node.users if u in stage_of})
        if not holders:
            if pp > 1:
                unused.append(fqn)
                continue
            holders = [0]
        pl = parse_placement(plan.param(fqn).placements.get("tp", "R"))
        whole = tp > 1 and not isinstance(pl, Shard)
        copies = len(holders) * (tp if whole else 1)
        for r in holders:
            for t in range(tp):
                real, pad = _held(shape, pl, tp, t)
                h = held[(r, t)]
                h["params"] += real
                h["pad"] += pad
                h["rep"] += real if whole else 0
                h["unique"] += real / copies
    return held, unused


def report_for(cap, strategies, plan, *, model_name: str = "model", device=None,
               step_time: float | None = None) -> FlopsReport:
    """The report of ``plan`` for a captured graph and its strategies (``autopar.api.decide``).

    ``device``: the device whose peak MFU is measured against (default: the plan's)."""
    dp = plan.mesh[0]
    m = plan.microbatches
    dev = get_device(device if device is not None else plan.device)
    stage_of = _stages(cap, plan)
    pp_of_stage = {s.index: s.rank for s in plan.stages} or {0: 0}
    modules, ranks = _flops_by_place(cap, strategies, plan, stage_of, pp_of_stage)
    held, unused = _params_by_place(cap, plan, stage_of, pp_of_stage, modules)

    rank_rows = []
    for (r, t), acc in ranks.items():
        mine = [s.index for s in plan.stages if s.rank == r] or [0]
        mods = [mod for s in plan.stages if s.rank == r for mod in s.modules] if plan.stages else []
        h = held[(r, t)]
        rank_rows.append(RankStats(r, t, tuple(mine), (mods[0], mods[-1]) if mods else ("(all)",),
                                   h["params"], h["rep"], h["pad"], h["unique"], acc["fwd"], acc["bwd"],
                                   acc["rec"], acc["rep"], acc["pad"]))
    module_rows = tuple(ModuleStats(name, 0 if not name else name.count(".") + 1, int(v[0]), v[1], v[2], v[3])
                        for name, v in modules.items())
    root = modules[""]
    # the peak is the compute dtype's: the plan's precision, else the parameters' own dtype
    dtype = plan.precision if plan.precision != "fp32" else next(
        (v.meta["val"].dtype for v in cap.params.values() if _is_float(v.meta["val"].dtype)), torch.float32)
    tokens = math.prod(cap.inputs[0].meta["val"].shape) * m * dp if cap.inputs else 0
    notes = [f"each of the dp={dp} replicas of a (pp, tp) rank holds the same parameters and runs the same "
             f"FLOPs on its slice of the batch" + (" (ZeRO-1 shards only the optimizer state)" if plan.zero else "")]
    notes += [f"{', '.join(al)} is {fqn} (tied): counted once in the model, under {fqn.rpartition('.')[0]}"
              for fqn, al in cap.aliases.items()]
    if unused:
        notes.append(f"no op uses {', '.join(unused)}: no pipeline stage holds it")
    return FlopsReport(model_name, tuple(plan.mesh), dev.name, dtype_key(dtype), dev.flops(dtype), int(tokens), m,
                       int(root[0]), root[1], root[2], root[3], module_rows, tuple(rank_rows),
                       step_time, tuple(notes))


def flops_report(model, mesh, example_inputs, *, plan=None, step_time=None, device="h100", **knobs) -> FlopsReport:
    """Plan ``model`` (or take ``plan``) and report its parameters and FLOPs per module and per rank.

    Offline: no process group, no GPU; the model may live on the meta device. ``mesh`` is
    (dp, pp, tp); ``example_inputs`` one global batch. ``plan``: None or "auto" (the planner
    decides), "megatron", a Plan or a plan JSON path. ``knobs`` are ``autopar.plan``'s
    (recompute, microbatches, schedule, sequence_parallel, zero, precision, ...). ``step_time``:
    measured seconds per step, for MFU; ``device``: the cost model's device, whose peak at the
    compute dtype (``precision``, else the parameters' dtype) MFU divides by."""
    from autopar.planner.decide import decide

    if step_time is not None:
        mfu(1.0, step_time, 1, 1.0)   # rejects a step time that is not a positive number of seconds
    cap, strategies, the_plan = decide(model, mesh, example_inputs, plan=plan or "auto", device=device, **knobs)
    return report_for(cap, strategies, the_plan, model_name=type(model).__name__, device=device,
                      step_time=step_time)


# ---- text ----------------------------------------------------------------------------------

def _si(x: float, unit: str = "") -> str:
    for div, prefix in ((1e15, "P"), (1e12, "T"), (1e9, "G"), (1e6, "M"), (1e3, "k")):
        if abs(x) >= div:
            return f"{x / div:.2f} {prefix}{unit}"
    return f"{x:.0f} {unit}".rstrip()


def _collapse(rows: list[tuple[str, tuple]]) -> list[tuple[str, tuple]]:
    """Runs of numbered siblings (h.0, h.1, ...) with equal numbers become one row h.{0..95}."""
    out: list[tuple[str, tuple]] = []
    run: list[tuple[str, tuple]] = []

    def flush():
        if len(run) > 1:
            first = re.match(r"^(.*)\.(\d+)$", run[0][0])
            last = run[-1][0].rsplit(".", 1)[1]
            out.append((f"{first.group(1)}.{{{first.group(2)}..{last}}} (x{len(run)}, each)", run[0][1]))
        else:
            out.extend(run)
        run.clear()

    for name, values in rows:
        mt = re.match(r"^(.*)\.(\d+)$", name)
        if run:
            prev = re.match(r"^(.*)\.(\d+)$", run[-1][0])
            if mt and mt.group(1) == prev.group(1) and int(mt.group(2)) == int(prev.group(2)) + 1 \
                    and values == run[-1][1]:
                run.append((name, values))
                continue
            flush()
        if mt:
            run.append((name, values))
        else:
            out.append((name, values))
    flush()
    return out


def report_table(report: FlopsReport, depth: int = 3, width: int = 170) -> str:
    """The report as text tables (rich): totals, modules down to ``depth``, then one row per rank."""
    from rich.console import Console
    from rich.table import Table

    dp, pp, tp = report.mesh
    buf = io.StringIO()
    console = Console(file=buf, width=width, color_system=None, highlight=False)
    console.print(f"{report.model} on mesh dp={dp} pp={pp} tp={tp} ({report.world_size} devices, {report.device}, "
                  f"{report.dtype} peak {_si(report.peak_flops, 'FLOP/s')}); {report.tokens:,} tokens and "
                  f"{report.microbatches} microbatch(es) per step")

    totals = Table(title="Totals per step", title_justify="left", show_header=False)
    totals.add_column("what")
    totals.add_column("value", justify="right")
    totals.add_row("parameters", f"{report.params:,} ({_si(report.params)})")
    totals.add_row("forward FLOPs", _si(report.fwd_flops, "FLOP"))
    totals.add_row("backward FLOPs", _si(report.bwd_flops, "FLOP"))
    totals.add_row("model FLOPs (fwd + bwd)", _si(report.model_flops, "FLOP"))
    totals.add_row("recomputed forward FLOPs", _si(report.recompute_flops, "FLOP"))
    totals.add_row("hardware FLOPs (with recompute)", _si(report.hardware_flops, "FLOP"))
    if report.tokens:
        totals.add_row("model FLOPs per token", _si(report.model_flops / report.tokens, "FLOP"))
    if report.step_time is not None:
        t = report.step_time
        totals.add_row("step time", f"{t * 1e3:.3f} ms")
        totals.add_row("model FLOP/s per device", _si(report.model_flops / report.world_size / t, "FLOP/s"))
        totals.add_row("MFU / HFU", f"{report.mfu():.1%} / {report.hfu():.1%}")
    console.print(totals)

    mods = Table(title=f"Modules (depth <= {depth}; a tied weight counts under its first name)", title_justify="left")
    for col in ("module", "params", "fwd FLOPs", "fwd+bwd FLOPs", "% model FLOPs", "recompute"):
        mods.add_column(col, justify="left" if col == "module" else "right")
    rows = [(m.name or "(model)", (m.depth, m.params, m.fwd_flops, m.bwd_flops, m.recompute_flops))
            for m in report.modules if m.depth <= depth]
    for name, (d, params, fwd, bwd, rec) in _collapse(rows):
        share = (fwd + bwd) / report.model_flops if report.model_flops else 0.0
        mods.add_row("  " * d + name, _si(params), _si(fwd), _si(fwd + bwd), f"{share:.1%}", _si(rec))
    console.print(mods)

    ranks = Table(title=f"Per rank (pp, tp), per step; each of the dp={dp} replicas the same", title_justify="left")
    ranks.caption = ("params: entries held (tp-repl.: of them in tensors every tp rank holds whole; pad: padding "
                     "held besides); share: of the model's count. FLOPs: fwd, bwd and recomputed forward executed; "
                     "repl.: of fwd+bwd, ops every tp rank runs in full; pad: beyond an even 1/tp share; FLOP/s: "
                     "all it executes, recompute included, per second of the step")
    ranks.caption_justify = "left"
    cols = ["pp", "tp", "stages", "modules", "params", "tp-repl.", "pad", "share",
            "fwd", "bwd", "repl.", "pad", "recomp."]
    if report.step_time is not None:
        cols.append("FLOP/s")
    for col in cols:
        ranks.add_column(col, justify="left" if col in ("stages", "modules") else "right", no_wrap=True)
    grouped: list[list[RankStats]] = []
    for r in report.ranks:
        if grouped and grouped[-1][0].pp == r.pp and _rank_numbers(grouped[-1][0]) == _rank_numbers(r):
            grouped[-1].append(r)
        else:
            grouped.append([r])
    for g in grouped:
        r = g[0]
        tps = str(r.tp) if len(g) == 1 else f"{r.tp}-{g[-1].tp}"
        row = [str(r.pp), tps, ",".join(map(str, r.stages)), _span(r.modules),
               _si(r.params), _si(r.replicated_params), _si(r.padding_params), _si(r.unique_params),
               _si(r.fwd_flops), _si(r.bwd_flops), _si(r.replicated_flops), _si(r.padding_flops),
               _si(r.recompute_flops)]
        if report.step_time is not None:
            row.append(_si(r.hardware_flops / report.step_time))
        ranks.add_row(*row)
    console.print(ranks)
    for note in report.notes:
        console.print(f"Note: {note}")
    return buf.getvalue()


def _span(modules: tuple[str, ...]) -> str:
    """"transformer.wte .. h.5": the last module without the dotted prefix it shares with the first."""
    first, last = modules[0], modules[-1]
    if first == last:
        return first
    a, b = first.split("."), last.split(".")
    k = 0
    while k < min(len(a), len(b)) - 1 and a[k] == b[k]:
        k += 1
    return f"{first} .. {'.'.join(b[k:])}"


def _rank_numbers(r: RankStats) -> tuple:
    return tuple(getattr(r, f.name) for f in fields(r) if f.name not in ("pp", "tp"))
