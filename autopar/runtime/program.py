"""One rank's program as data: ``program_for(plan, coords, cap, strategies)``.

A ``Program`` says everything a rank of a plan runs, before anything runs: the graph passes with
their options, in two runs (``pre``: the device move, the token-mean loss and the cp rewrite,
whose graph the tp rewrite then reads; ``passes``: the rest), which parameters the rank holds at
which local shapes, which pipeline stages it runs, which process groups by axis it uses, and the
runtime pieces (ZeRO-1's flat slice, ZeRO-2/3's gathers, optimizer offload, the 16-bit working
copies, master weights, loss scaling, the pipeline schedule, CUDA graphs). Building it needs no
process group and allocates no tensor: the groups are names (``runtime.groups.Groups``, real or
placeholders), the capture may be on the meta device, and every rank of a mesh can be built in
one process. ``runtime.lowering.lower_program`` runs it on a rank; ``ParallelModel`` holds it.

An option that names the nodes of the graph the first run leaves (the planner's strategies,
carried to the cp rewrite's graph; a pipeline's stage of each cp cut) is a ``FromPre``: the
function that computes it from that graph, called when the program is lowered.
"""
from __future__ import annotations

import dataclasses
from collections import Counter
from typing import Any, Callable

import torch

from autopar.graph.precision import compute_dtype
from autopar.graph.rules import is_float
from autopar.graph.units import owner_units, stage_of_nodes, zero_units
from autopar.mesh import Mesh, default_device_type
from autopar.passes.context_parallel import check_sequence, cp_cuts, cp_pass, local_strategies
from autopar.passes.device import device_pass
from autopar.passes.fuse_loss import cross_entropy_kernel_pass
from autopar.passes.offload_marks import offload_marks_pass
from autopar.passes.precision import precision_pass
from autopar.passes.recompute import recompute_pass
from autopar.passes.shard import shard_pass
from autopar.passes.token_mean import token_losses, token_mean_pass
from autopar.passes.zero import gather_name, shard_rows, unit_params, zero_pass
from autopar.placement import Placement, Shard, local_shape, parse_placement
from autopar.runtime.compiler import inductor_on_cuda, prefetches, replays_cuda_graphs, uses_inductor
from autopar.runtime.groups import Groups, comm_device, replicas


@dataclasses.dataclass(frozen=True)
class FromPre:
    """A pass option computed from the graph the first run of passes left: ``fn(graph, *args)``."""

    fn: Callable
    args: tuple = ()

    def __call__(self, graph: torch.fx.GraphModule):
        return self.fn(graph, *self.args)


@dataclasses.dataclass(frozen=True)
class PassStep:
    """One graph pass and its keyword options (values may be ``FromPre``)."""

    fn: Callable[..., torch.fx.GraphModule]
    options: dict[str, Any]

    @property
    def name(self) -> str:
        return self.fn.__name__

    def resolved(self, graph: torch.fx.GraphModule) -> tuple[Callable, dict[str, Any]]:
        """(pass, options) as the pass driver runs it, each ``FromPre`` computed from ``graph``."""
        return self.fn, {k: v(graph) if isinstance(v, FromPre) else v for k, v in self.options.items()}


@dataclasses.dataclass(frozen=True)
class ParamShard:
    """One parameter as this rank holds it: its full ``shape``, its ``placement`` over tp, the
    ``tp_shape`` of its tp shard, the ``local_shape`` of the tensor this rank holds (with ZeRO-2/3
    its ``rows`` [start, stop) of the tp shard, zero past ``stop``; None without), and whether it
    is ``sharded`` over tp (its squares are summed over tp in a norm)."""

    fqn: str
    shape: tuple[int, ...]
    placement: Placement
    tp_shape: tuple[int, ...]
    local_shape: tuple[int, ...]
    rows: tuple[int, int] | None
    sharded: bool


@dataclasses.dataclass(frozen=True)
class Program:
    """One rank's share of a plan, as data (see the module docstring). ``holders``: the pipeline
    ranks that hold each parameter (every parameter is on pp rank 0 without pp); ``params``: this
    rank's, in the capture's order; ``stages``: the pipeline stages this rank runs; ``stage_of``:
    global node name -> stage, for the pipeline split (None without pp); ``counted``: per token
    loss the token-mean pass rewrites, whether it is a mean (its scale counts tokens) or a sum.
    ``offload_kept``: with offload, this rank's parameters whose optimizer stays on the device
    (their owner unit is in ``plan.offload_kept``); ``offload_units``: unit index -> the offloaded
    parameters the graph's marker of that unit reports in the backward (``passes.offload_marks``;
    empty where the host updates after the backward, ``runtime.offload``)."""

    plan: Any
    rank: int
    coords: dict[str, int]
    mesh: Mesh
    groups: Groups
    device: torch.device
    compile: Any
    loss_kernel: Any
    pre: tuple[PassStep, ...]
    passes: tuple[PassStep, ...]
    params: dict[str, ParamShard]
    holders: dict[str, tuple[int, ...]]
    stages: tuple[int, ...]
    stage_of: dict[str, int] | FromPre | None
    counted: tuple[bool, ...]
    offload_kept: frozenset = frozenset()
    offload_units: dict[int, tuple[str, ...]] = dataclasses.field(default_factory=dict)

    @property
    def pass_names(self) -> list[str]:
        """The passes in the order they run, both runs."""
        return [s.name for s in (*self.pre, *self.passes)]

    @property
    def shapes(self) -> tuple[tuple[int, ...], ...]:
        """The microbatch input shapes it is built for (the plan's)."""
        return shape_key(self.plan.input_shapes)

    @property
    def fsdp(self) -> bool:
        """ZeRO-2/3 over more than one rank: each parameter enters as its dp shard, gathered in the graph."""
        return self.plan.zero >= 2 and self.mesh.dp_shard > 1

    @property
    def zero1(self) -> bool:
        """ZeRO-1: the gradients are reduce-scattered into a flat dp slice the optimizer steps."""
        return self.plan.zero == 1

    @property
    def replicas(self) -> int:
        """How many ranks hold the same ZeRO shards (``runtime.groups.replicas``)."""
        return replicas(self.mesh, self.plan.zero)

    @property
    def regather(self) -> bool:
        """The backward gathers again what the forward gathered (``compiler.lower``): ZeRO-3's weights,
        and the sequence shards of the linears the plan marks ``regather`` (Megatron's storage rule)."""
        return self.plan.zero == 3 or any(n.regather for n in self.plan.nodes)

    @property
    def main_grads(self) -> bool:
        """16 bits without offload or ZeRO-2/3 shards: Megatron-LM's layout (``runtime.zero``): the
        parameters held at the compute dtype, fp32 gradient buffers, and the fp32 master weights and
        optimizer state in a flat slice (split over dp x cp with zero=1)."""
        return self.plan.precision != "fp32" and not self.offload and not self.fsdp

    @property
    def splits_backward(self) -> bool:
        """A zero-bubble pipeline schedule: weight gradients are computed in a pass of their own
        (torch.distributed.pipelining's, which writes ``p.grad`` without autograd's accumulation)."""
        return self.mesh.pp > 1 and self.plan.schedule == "InterleavedZeroBubble"

    @property
    def casts(self) -> str:
        """The precision of the step's shared working copies (``runtime.precision.WorkingCopies``):
        "fp32" (none) where the parameters are held at the compute dtype (``main_grads``), the graph
        casts the weights itself (one microbatch on one stage), or ZeRO-2/3 gathers them at the
        compute dtype."""
        in_graph = self.mesh.pp == 1 and self.plan.microbatches == 1
        return "fp32" if in_graph or self.fsdp or self.main_grads else self.plan.precision

    @property
    def loss_scaling(self) -> bool:
        """fp16: the loss is scaled (``runtime.precision.LossScaler``)."""
        return self.plan.precision == "fp16"

    @property
    def offload(self) -> bool:
        """The optimizer steps fp32 masters in host memory (``runtime.offload``)."""
        return self.plan.offload != "none"

    @property
    def offload_in_backward(self) -> bool:
        """The graph's markers report each unit's gradients in the backward, where its host update
        starts (``runtime.offload``)."""
        return bool(self.offload_units)

    @property
    def host_dtype(self) -> torch.dtype | None:
        """With offload below ZeRO-1: the dtype the device weights narrow to once their host masters
        exist (the compute dtype at 16 bits; None at fp32)."""
        return None if self.plan.precision == "fp32" else compute_dtype(self.plan.precision)

    @property
    def cuda_graphs(self) -> bool:
        """Inductor replays CUDA graphs: weights and buffers are marked static."""
        return replays_cuda_graphs(self.compile)

    @property
    def runs_whole(self) -> bool:
        """Whether the model, once its parameters are this rank's, still computes the whole model
        on its own (no pp, no tp shard, no ZeRO-2/3 shard)."""
        return self.mesh.pp == 1 and not self.fsdp and not any(s.sharded for s in self.params.values())

    @property
    def axes(self) -> tuple[str, ...]:
        """The axes (``Groups.of``'s names) whose process groups this rank's collectives use:
        dp, pp, cp, tp of more than one rank, "data" where it spans dp and cp, ZeRO's "dp_shard"
        and "dp_replicate" where it shards over more than one rank or sums across replicas."""
        mesh = self.mesh
        out = [a for a in ("dp", "pp", "cp", "tp") if mesh.size(a) > 1]
        if mesh.dp > 1 and mesh.cp > 1:
            out.append("data")
        if self.plan.zero and mesh.dp_shard > 1:
            out.append("dp_shard")
        if self.groups.dp_replicate is not None:
            out.append("dp_replicate")
        return tuple(out)

    def owns(self, fqn: str) -> bool:
        """Whether this pipeline rank counts ``fqn``, the lowest of its holders (a weight on several
        stages counts once: in norms, gathers and checkpoints)."""
        return self.mesh.pp == 1 or min(self.holders[fqn]) == self.coords["pp"]

    def dp_rows(self, fqn: str) -> tuple[int, int] | None:
        """With ZeRO-2/3, the rows [start, stop) of ``fqn``'s tp shard that this rank holds (any
        parameter of the plan, by any of its names); None when parameters are whole over dp."""
        return _rows(self.plan.param(fqn).local_shape[0], self.mesh, self.coords) if self.fsdp else None


def program_for(plan, coords, cap, strategies, *, groups: Groups | None = None, device: torch.device | None = None,
                compile=True, loss_kernel="auto") -> Program:
    """The program of the rank at ``coords`` (a rank number, or its ``Mesh.coords``) of ``plan``,
    from the plan's capture ``cap`` and its strategy per node (``planner.decide.rebuild``'s).
    ``groups``: the process group names its passes and runtime use (default: placeholders named
    after their axes, ``Groups.placeholders``); ``device``: where it computes (default: the
    device collectives run on); ``compile`` and ``loss_kernel`` as ``parallelize`` takes them.
    Pure: no process group, no tensor made."""
    mesh = Mesh.of_plan(plan)
    rank = _rank_of(mesh, coords)
    coords = mesh.coords(rank)
    if groups is None:
        groups = Groups.placeholders(mesh, plan.zero, "nccl" if default_device_type() == "cuda" else "gloo")
    device = comm_device() if device is None else device
    pre = []
    # a mean over tokens is made the mean over the whole step's tokens (padding, ignore_index)
    losses = token_losses(cap.gm) if mesh.data * plan.microbatches > 1 else []
    if losses:
        pre.append(PassStep(token_mean_pass, {}))
    if mesh.cp > 1:
        check_sequence(plan.input_shapes[0][1], mesh.cp, mesh.tp, plan.sequence_parallel)
        pre.append(PassStep(cp_pass, dict(size=mesh.cp, rank=coords["cp"], group=groups.cp,
                                          seq=plan.input_shapes[0][1], attention=plan.cp_attention)))
    if any(n.meta["val"].device != device for n in cap.gm.graph.nodes
           if n.op == "placeholder" and isinstance(n.meta.get("val"), torch.Tensor)):
        # captured on meta or another device: the factories move last, as the passes before trace the
        # graph's values, all on the capture's device (a table made on the rank's device from a meta
        # buffer would meet two devices there)
        pre.append(PassStep(device_pass, dict(device=device)))
    # after a first run the tp rewrite sees the rewritten loss and the local sequence's shapes, on
    # nodes the planner's strategies are handed to by name
    passes = []
    if mesh.tp > 1:
        passes.append(PassStep(shard_pass, dict(
            strategies=FromPre(local_strategies, (strategies,)) if pre else strategies,
            size=mesh.tp, rank=coords["tp"], group=groups.tp)))
    if loss_kernel is True or (loss_kernel == "auto" and inductor_on_cuda(compile)):
        passes.append(PassStep(cross_entropy_kernel_pass, {}))
    units = gathers = None
    if plan.zero >= 2 and mesh.dp_shard > 1:   # every parameter enters as its dp shard, gathered per unit
        units, gathers, step = _zero_step(cap, plan, mesh, groups, compile)
        passes.append(step)
    where = _stage_of(cap, plan, units, gathers) if mesh.pp > 1 else None
    stage_of = FromPre(_with_cuts, (where, len(plan.stages) - 1)) if pre and where is not None else where
    if plan.precision != "fp32":
        # inputs and buffers are cast in the graph, where it can leave those computing tables alone;
        # weights too with one microbatch on one stage (else ``WorkingCopies`` shares one copy)
        # (ZeRO-2/3 gathers the weights at the compute dtype: none is cast here)
        in_graph = mesh.pp == 1 and plan.microbatches == 1 and units is None
        floats = {n.name for n in cap.gm.graph.nodes if n.op == "placeholder" and is_float(n)
                  and (in_graph or n.meta.get("kind") != "param")}
        passes.append(PassStep(precision_pass, dict(precision=plan.precision, floats=floats, stage_of=stage_of)))
    if plan.recompute_regions:
        passes.append(PassStep(recompute_pass, dict(regions=[set(r) for r in plan.recompute_regions])))
    holders = _holders(cap, plan, mesh, where)
    params = _params(plan, mesh, coords, cap, holders)
    kept, marked = _offload_split(cap, plan, params)
    if marked and _updates_in_backward(plan, mesh, compile):
        passes.append(PassStep(offload_marks_pass, dict(units=marked)))
    else:
        marked = {}
    n_stages = max(len(plan.stages), 1)
    return Program(plan=plan, rank=rank, coords=coords, mesh=mesh, groups=groups, device=device, compile=compile,
                   loss_kernel=loss_kernel, pre=tuple(pre), passes=tuple(passes),
                   params=params, holders=holders,
                   stages=tuple(s for s in range(n_stages) if s % mesh.pp == coords["pp"]),
                   stage_of=stage_of, counted=tuple(t.counted for t in losses), offload_kept=kept,
                   offload_units=marked)


def shape_key(shapes) -> tuple[tuple[int, ...], ...]:
    """Input shapes as a key: tuples of ints."""
    return tuple(tuple(int(d) for d in s) for s in shapes)


def _rank_of(mesh: Mesh, coords) -> int:
    """The rank number of ``coords`` (a rank number, or a dict of axis coordinates) on ``mesh``."""
    world = mesh.world_size
    if isinstance(coords, int) and not isinstance(coords, bool):
        if not 0 <= coords < world:
            raise ValueError(f"rank {coords} is outside the plan's mesh {mesh} of {world} ranks: "
                             f"pass a rank from 0 to {world - 1}")
        return coords
    if isinstance(coords, dict):
        matches = [r for r in range(world) if all(mesh.coords(r).get(a) == c for a, c in coords.items())]
        if len(matches) == 1:
            return matches[0]
    raise ValueError(f"coordinates {coords!r} do not name one rank of the plan's mesh {mesh}: pass a rank number "
                     f"(0 to {world - 1}) or a dict of axis coordinates, e.g. {mesh.coords(world - 1)}")


def _offload_split(cap, plan, params: dict[str, ParamShard]) -> tuple[frozenset, dict[int, tuple[str, ...]]]:
    """With offload: the FQNs of ``params`` whose owner unit ``plan.offload_kept`` keeps on the device,
    and unit index -> the offloaded ones each unit owns (in capture order)."""
    if plan.offload == "none":
        return frozenset(), {}
    names = [u.name for u in zero_units(cap)]
    unknown = [u for u in plan.offload_kept if u not in names]
    if unknown:
        raise ValueError(f"plan.offload_kept names {', '.join(map(repr, unknown))}, which this model does not have; "
                         f"its units are {', '.join(names)} (autopar.graph.units.zero_units): keep some of those "
                         "on the device, or leave offload_kept empty to offload every unit")
    owners = owner_units(cap)
    kept = frozenset(f for f in params if owners[f] in plan.offload_kept)
    marked: dict[int, tuple[str, ...]] = {}
    for f in params:
        if f not in kept:
            k = names.index(owners[f])
            marked[k] = (*marked.get(k, ()), f)
    return kept, marked


def _updates_in_backward(plan, mesh: Mesh, compile) -> bool:
    """Whether a unit's gradients are final inside the backward, where its host update may start
    (``runtime.offload``): the exact update on one stage, with no dp or cp sum after the backward
    (ZeRO-2/3 reduce-scatter within it; ZeRO-1 sums into its slice after it), not lowered through
    Inductor: on an H200 an Inductor backward's host jobs ended no sooner than had they started at
    its end, and its CUDA graphs replay no host work (``cost_model.offload.offload_timing``)."""
    fsdp = plan.zero >= 2 and mesh.dp_shard > 1
    return (not plan.offload_delay and mesh.pp == 1 and plan.zero != 1 and (mesh.data == 1 or fsdp)
            and not uses_inductor(compile))


def _zero_step(cap, plan, mesh: Mesh, groups: Groups, compile):
    """ZeRO-2/3's units, each unit's parameters, and its pass."""
    labels, units = zip(*((u.name, [n.name for n in u.nodes]) for u in zero_units(cap)))
    gathers = unit_params(cap.gm, units, set(cap.params))
    resharded = {k for k, label in enumerate(labels) if plan.zero == 3 and label not in plan.keep_gathered}
    # a weight several units of one stage use (a tied embedding) is gathered once for all of them
    shared = Counter(f for fqns in gathers.values() for f in fqns)
    across = dict(replicate=groups.dp_replicate, replicas=replicas(mesh, plan.zero))
    step = PassStep(zero_pass, dict(units=units, rows={p.fqn: p.local_shape[0] for p in plan.parameters},
                                    group=groups.dp_shard, size=mesh.dp_shard, **across,
                                    dtype=compute_dtype(plan.precision) if plan.precision != "fp32" else None,
                                    reshard=resharded, recomputed={n for r in plan.recompute_regions for n in r},
                                    once={f for f, n in shared.items() if n > 1} if mesh.pp == 1 else set(),
                                    prefetch=prefetches(compile, groups.backend)))
    return units, gathers, step


def _stage_of(cap, plan, units, gathers) -> dict[str, int]:
    """Global node name -> pipeline stage, ZeRO's gathers with their units."""
    where = stage_of_nodes(cap, plan)
    for k, fqns in (gathers or {}).items():
        where.update({gather_name(k, f): where.get(units[k][0], len(plan.stages) - 1) for f in fqns})
    return where


def _with_cuts(graph: torch.fx.GraphModule, where: dict[str, int], last: int) -> dict[str, int]:
    """``where`` with cp's cuts in ``graph`` (name -> the first node using it) on the stage of the node they feed."""
    return {**where, **{cut: where.get(user, last) for cut, user in cp_cuts(graph).items()}}


def _holders(cap, plan, mesh: Mesh, where: dict[str, int] | None) -> dict[str, tuple[int, ...]]:
    """Parameter FQN -> the pipeline ranks whose stages use it (the pipeline split's: a node no
    stage names runs on the last), in the capture's order."""
    last = len(plan.stages) - 1
    out = {}
    for n in cap.gm.graph.nodes:
        if n.op == "placeholder" and n.meta.get("kind") == "param" and n.meta.get("fqn") in cap.params:
            ranks = {0} if where is None else {where.get(u.name, last) % mesh.pp for u in n.users}
            if ranks:
                out[n.meta["fqn"]] = tuple(sorted(ranks))
    return {f: out[f] for f in cap.params if f in out}


def _params(plan, mesh: Mesh, coords: dict[str, int], cap, holders) -> dict[str, ParamShard]:
    """The parameters the rank at ``coords`` holds, in the capture's order."""
    fsdp = plan.zero >= 2 and mesh.dp_shard > 1
    out = {}
    for fqn in cap.params:
        if coords["pp"] not in holders.get(fqn, ()):
            continue
        p = plan.param(fqn)
        pl = parse_placement(p.placements["tp"])
        tp_shape = local_shape(p.shape, pl, mesh.tp)
        rows = _rows(tp_shape[0], mesh, coords) if fsdp and tp_shape else None
        held = (shard_rows(tp_shape[0], mesh.dp_shard), *tp_shape[1:]) if rows is not None else tp_shape
        out[fqn] = ParamShard(fqn, tuple(p.shape), pl, tp_shape, held, rows, isinstance(pl, Shard) and mesh.tp > 1)
    return out


def _rows(rows: int, mesh: Mesh, coords: dict[str, int]) -> tuple[int, int]:
    """The rows [start, stop) of ``rows`` that the dp_shard rank at ``coords`` holds under ZeRO-2/3."""
    c = shard_rows(rows, mesh.dp_shard)
    start = min(rows, coords["dp_shard"] * c)
    return start, min(rows, start + c)
