"""Plan: everything autopar decided, as frozen data with a JSON round trip.

A plan names parameters by FQN and graph nodes by their export names (with module
paths for people). It is what the passes carry out, so an edited plan file runs
exactly as written; ``autopar.planner.sharding.strategies_from_plan`` checks it against the model.
"""
from __future__ import annotations

import json
import re
from collections import defaultdict
from dataclasses import MISSING, asdict, dataclass, field, fields
from pathlib import Path

from autopar.collectives import CP_ATTENTIONS
from autopar.cost_model.stages import INTERLEAVED, SCHEDULES
from autopar.cost_model.terms import MemoryPlan, StepTerms, step_time
from autopar.errors import PlanFormatError
from autopar.mesh import AXIS_ORDER, Mesh
from autopar.rehearsal import CollectiveCount, OpTime, Rehearsal

PLAN_VERSION = 1

# what ``offload`` may say: "optimizer" steps AdamW on the host (``autopar.runtime.offload``)
OFFLOADS = ("none", "optimizer")

PRECISION_NOTES = {"fp32": "fp32",
                   "bf16": "bf16 compute, fp32 master weights and reductions",
                   "fp16": "fp16 compute, fp32 master weights and reductions, dynamic loss scaling"}

# what a plan's recompute says: "auto" is the per-block choice recompute="auto" made (its regions)
RECOMPUTES = ("none", "selective", "full", "auto")

# the fields a plan chooses from a list: the values each may take, and what they mean
_CHOICES = {"zero": ((0, 1, 2, 3), " (the ZeRO stage: 1 shards the optimizer state over dp, 2 the gradients too, "
                                   "3 the weights too)"),
            "schedule": (SCHEDULES, " (the pipeline schedule)"),
            "recompute": (RECOMPUTES, ""),
            "precision": (tuple(PRECISION_NOTES), " (the compute dtype)"),
            "offload": (OFFLOADS, ""),
            "cp_attention": (CP_ATTENTIONS, " (how attention runs over cp)")}


@dataclass(frozen=True)
class ParamPlan:
    """One parameter: global shape, placement per mesh axis, this rank's shape."""

    fqn: str
    shape: tuple[int, ...]
    placements: dict[str, str]          # axis -> "R" | "S(0)" | "S(0)i3"; dp shows ZeRO sharding
    local_shape: tuple[int, ...]
    aliases: tuple[str, ...] = ()       # other FQNs of the same (tied) tensor


@dataclass(frozen=True)
class NodePlan:
    """One graph node's strategy on the tp axis."""

    name: str
    op: str
    module: str
    inputs: tuple[str, ...]
    output: str
    local: str | None = None
    regather: bool = False   # keeps its input's sequence shard and all-gathers it again in backward


@dataclass(frozen=True)
class CollectivePlan:
    """Collectives of one kind issued at one place per training step."""

    kind: str
    axis: str
    phase: str          # "fwd", "bwd" or "step" (gradient/optimizer sync)
    where: str          # module path
    count: int
    bytes: int          # per step, all counted instances together (full tensor sizes)


@dataclass(frozen=True)
class StagePlan:
    """One pipeline stage: where it runs, what it holds, what the cost model expects of it."""

    index: int
    rank: int                      # pipeline rank (pp coordinate) that runs it
    modules: tuple[str, ...]
    predicted_time_s: float        # forward + backward of one microbatch, whole sequences, tp and pp transfers too
    memory_bytes: float            # static state plus in-flight activations, per rank share
    predicted_compute_s: float = 0.0   # of which the ops' (recomputed forwards too); 0: not recorded (older plans)


@dataclass(frozen=True)
class Plan:
    """A complete parallelization decision for one model, mesh and input shape."""

    mesh: tuple[int, int, int]
    input_shapes: tuple[tuple[int, ...], ...]   # one microbatch on one dp rank
    sequence_parallel: bool
    zero: int
    microbatches: int
    device: str
    parameters: tuple[ParamPlan, ...]
    nodes: tuple[NodePlan, ...]
    collectives: tuple[CollectivePlan, ...]
    predicted_compute_s: float      # with pp > 1: the pipeline step (tp communication and bubble included)
    predicted_comm_s: float         # communication not inside that: tp collectives (pp = 1), cp, dp sync
    predicted_update_s: float = 0.0   # the optimizer update and 16-bit weight casts of the busiest rank (host's too)
    solve_seconds: float = 0.0
    model_flops: float = 0.0        # forward + backward FLOPs of one step, all ranks together
    peak_flops: float = 0.0         # one device's peak at the model's dtype
    schedule: str = "1F1B"
    virtual_stages: int = 1
    stages: tuple[StagePlan, ...] = ()
    recompute: str = "none"
    recompute_regions: tuple[tuple[str, ...], ...] = ()   # global node names recomputed together
    keep_gathered: tuple[str, ...] = ()   # zero=3: units whose weights stay gathered from forward to backward
    offload: str = "none"           # "optimizer": fp32 master and AdamW state on the host, stepped by the CPU
    offload_kept: tuple[str, ...] = ()   # offload="optimizer": units whose master and state stay on the device (partial offload)
    offload_delay: int = 0          # 1: the host's update lands one step late, overlapping the next step (ZeRO-Offload's DPU)
    memory: tuple[MemoryPlan, ...] = ()
    precision: str = "fp32"         # compute dtype: "fp32", "bf16" or "fp16"; weights, grads, reductions stay fp32
    source: str = "auto"            # "auto", "megatron", or "edited from ..." once its choices were changed by hand
    version: int = PLAN_VERSION
    notes: tuple[str, ...] = field(default=())
    model: str = ""                 # what `python -m autopar plan` was given (a config or file.py:factory), for `diff`
    warnings: tuple[str, ...] = ()  # an axis doing no work, a peak above the device: derived anew at every planning
    dp_replicate: int = 1           # HSDP: dp = dp_replicate x dp_shard; ZeRO shards over dp_shard, all-reduces across replicas
    cp: int = 1                     # context parallelism: each sequence split over cp ranks (2·cp chunks); 1 in older files
    cp_attention: str = "allgather"   # how attention runs over cp: "allgather" (K, V gathered) or "ring" (blocks passed on)
    step_terms: StepTerms | None = None   # the step term by term (the predicted figures add them); None in older files
    rehearsals: tuple[Rehearsal, ...] = ()   # ranks run alone on one device (``autopar.rehearse``); () in older files

    @property
    def dp_shard(self) -> int:
        """The dp ranks ZeRO shards over: dp / dp_replicate (all of dp unless dp is split)."""
        return self.mesh[0] // self.dp_replicate

    def __post_init__(self):
        """Refuse what autopar cannot run as written (a hand-edited file, a Plan built by hand): a
        PlanFormatError naming the field, its value and the values it may take."""
        if len(self.mesh) != 3 or not all(_positive(n) for n in self.mesh):
            raise PlanFormatError(f"plan.mesh {list(self.mesh)}: expected [dp, pp, tp], three positive integers")
        for name, (valid, meaning) in _CHOICES.items():   # before the checks of their combinations below
            value = getattr(self, name)
            if isinstance(value, bool) or value not in valid:
                raise PlanFormatError(f"plan.{name} {value!r}: expected {_one_of(valid)}{meaning}")
        for name, meaning in (("virtual_stages", "pipeline stages per pp rank"), ("microbatches", "per step"),
                              ("cp", "the context-parallel degree"), ("dp_replicate", "HSDP's replicas")):
            if not _positive(getattr(self, name)):
                raise PlanFormatError(f"plan.{name} {getattr(self, name)!r}: expected a positive integer ({meaning})")
        if self.mesh[0] % self.dp_replicate:
            raise PlanFormatError(f"plan.dp_replicate {self.dp_replicate}: expected a positive divisor of "
                                  f"dp={self.mesh[0]} (dp = dp_replicate x dp_shard)")
        why = _combination_refused(self)
        if why:
            raise PlanFormatError(why)

    @property
    def predicted_step_time(self) -> float:
        """Seconds per training step: compute, (unoverlapped) communication and the weight update
        (``cost_model.terms.step_time``)."""
        return step_time(self.predicted_compute_s, [self.predicted_comm_s], self.predicted_update_s)

    @property
    def predicted_mfu(self) -> float:
        """Model FLOPs utilisation the prediction implies: model FLOPs / (step time x peak x devices)."""
        devices = self.mesh[0] * self.mesh[1] * self.mesh[2] * self.cp
        denom = self.predicted_step_time * self.peak_flops * devices
        return self.model_flops / denom if denom else 0.0

    def derives_as(self, derived: "Plan") -> bool:
        """Whether ``derived``, this plan re-derived from its own choices, records the same local
        shapes, collectives, stages and memory as this plan does: false once a choice was edited
        by hand without the numbers that follow from it. Times are left out: they depend on the
        device they were priced on."""
        def facts(plan):
            return (plan.parameters, plan.nodes, _collective_totals(plan.collectives),
                    tuple((s.rank, s.modules) for s in plan.stages), plan.recompute_regions)
        return facts(self) == facts(derived) and len(self.memory) == len(derived.memory) and all(
            _close(a, b) for a, b in zip(self.memory, derived.memory))

    def held_shape(self, p: ParamPlan) -> tuple[int, ...]:
        """The shape of ``p`` one rank holds: its tp shard (``local_shape``), of which ZeRO-2/3 keep only
        this rank's dp shard of rows, ceil(rows / dp_shard) of them, the last shard zero-padded
        (``autopar.passes.zero``)."""
        if self.zero < 2 or self.dp_shard == 1 or not p.local_shape:
            return p.local_shape
        return (-(-p.local_shape[0] // self.dp_shard), *p.local_shape[1:])

    def param(self, fqn: str) -> ParamPlan:
        for p in self.parameters:
            if p.fqn == fqn or fqn in p.aliases:
                return p
        raise KeyError(fqn)

    # ---- JSON --------------------------------------------------------------------------

    def to_json(self, path=None) -> str:
        """The plan as JSON text; also written to ``path`` when given."""
        text = json.dumps(asdict(self), indent=1)
        if path is not None:
            Path(path).write_text(text)
        return text

    def to_html(self, path=None) -> str:
        """The plan as a self-contained HTML page (autopar.plan_html); also written to ``path`` when given."""
        from autopar.plan_html import render
        text = render(self)
        if path is not None:
            Path(path).write_text(text, encoding="utf-8")
        return text

    @classmethod
    def from_json(cls, path_or_str) -> "Plan":
        """Read a plan from a JSON file path or a JSON string, checking every field's type."""
        text = str(path_or_str)
        if not text.lstrip().startswith("{"):
            try:
                text = Path(path_or_str).read_text()
            except OSError as e:
                raise PlanFormatError(f"cannot read plan file {path_or_str}: {e}") from None
        try:
            data = json.loads(text)
        except json.JSONDecodeError as e:
            raise PlanFormatError(f"plan is not valid JSON: {e}") from None
        plan = _build(cls, data, "plan")
        _check_placements(plan)
        return plan

    # ---- comparison --------------------------------------------------------------------

    def diff(self, other: "Plan") -> str:
        """What differs from ``other``, one line each: settings, parameter placements, node
        strategies, collectives (count and bytes per place), stages, memory, predicted time.
        Returns "no differences" when the two plans decide the same things."""
        out: list[str] = []
        for f in ("mesh", "dp_replicate", "cp", "cp_attention", "input_shapes", "sequence_parallel", "zero", "keep_gathered", "offload", "offload_kept",
                  "offload_delay", "microbatches",
                  "schedule", "virtual_stages", "recompute", "precision", "device"):
            a, b = getattr(self, f), getattr(other, f)
            if a != b:
                out.append(f"{f}: {a} -> {b}")
        params_b = {p.fqn: p for p in other.parameters}
        changed = {p.fqn: [a for a in _axis_order(p.placements, params_b[p.fqn].placements)
                           if p.placements.get(a) != params_b[p.fqn].placements.get(a)]
                   for p in self.parameters if p.fqn in params_b}

        def show_param(p):   # a changed parameter shows only the axes that changed, in mesh order
            axes = changed[p.fqn] if p.fqn in changed else _axis_order(p.placements)
            return " ".join([f"{a} {p.placements.get(a)}" for a in axes] + [f"local {list(p.local_shape)}"])

        _diff_keyed(out, "parameter", {p.fqn: p for p in self.parameters}, params_b, show_param)
        _diff_keyed(out, "node", {n.name: n for n in self.nodes}, {n.name: n for n in other.nodes},
                    lambda n: f"({', '.join(n.inputs)}) -> {n.output}" + (f" [{n.local}]" if n.local else ""),
                    label=lambda n: f"{n.name} in {n.module or 'top level'}")
        _diff_keyed(out, "collective", _collective_totals(self.collectives), _collective_totals(other.collectives),
                    lambda c: f"x{c[0]} {c[1] / 2**20:.2f} MiB")
        _diff_keyed(out, "stage", {s.index: s for s in self.stages}, {s.index: s for s in other.stages},
                    lambda s: f"pp rank {s.rank}, {s.modules[0]} .. {s.modules[-1]} ({len(s.modules)} modules), "
                              f"{s.predicted_time_s * 1e3:.3f} ms (ops {s.predicted_compute_s * 1e3:.3f})", same=_close)
        _diff_keyed(out, "memory of stage", {m.stage: m for m in self.memory}, {m.stage: m for m in other.memory},
                    lambda m: f"peak {m.peak / 2**30:.3f} GiB (activations {m.activations / 2**30:.3f})", same=_close)
        if self.recompute_regions != other.recompute_regions:
            out.append(f"recompute regions: {len(self.recompute_regions)} -> {len(other.recompute_regions)}")
        if not _close(self.predicted_step_time, other.predicted_step_time):
            out.append(f"predicted step time: {self.predicted_step_time * 1e3:.3f} ms -> "
                       f"{other.predicted_step_time * 1e3:.3f} ms")
        return "\n".join(out) or "no differences"

    # ---- text --------------------------------------------------------------------------

    def summary(self) -> str:
        """A readable account: mesh, parameters and their placements, collectives per layer, memory,
        times, then the notes and warnings (an idle axis, a peak above the device)."""
        mesh = Mesh.of_plan(self)
        lines = [f"autopar plan ({self.source}) for mesh {mesh.dp_text()} pp={mesh.pp}{mesh.cp_text()} tp={mesh.tp} on {self.device}",
                 f"  microbatch input shapes {list(map(list, self.input_shapes))}, microbatches "
                 f"{self.microbatches}, sequence parallel {'on' if self.sequence_parallel else 'off'}, "
                 f"ZeRO-{self.zero}{_zero_axes(self.zero, mesh)}{_kept_gathered(self.keep_gathered)}{_offloaded(self.offload, self.offload_kept, self.offload_delay, self.memory)}, "
                 f"precision {PRECISION_NOTES[self.precision]}{_cp_attention_text(self.cp, self.cp_attention)}",
                 "  placements: R replicated, P partial sum, S(d) sharded on dim d, "
                 "S(d)ik interleaved: dim d is k blocks (fused q,k,v) and each rank holds its slice of each",
                 "", f"Parameters (placement per axis, local shape{_held_text(self.zero, mesh)}):"]
        for p in _collapse_layers(self.parameters):
            pl = " ".join(f"{a}={v}" for a, v in p.placements.items())
            alias = f"  (tied: {', '.join(p.aliases)})" if p.aliases else ""
            held = list(self.held_shape(p))
            lines.append(f"  {p.fqn:44s} {str(list(p.shape)):16s} {pl:22s} {held}{alias}")
        lines += ["", "Collectives per step (count, MiB, by place):"]
        for c in _collapse_collectives(self.collectives):
            lines.append(f"  {c.where or '(top level)':44s} {c.phase:4s} {c.kind:15s} {c.axis:3s} x{c.count:<5d} "
                         f"{c.bytes / 2**20:10.2f} MiB")
        if self.stages:
            lines += ["", f"Pipeline: {len(self.stages)} stages ({self.virtual_stages} per rank), schedule "
                          f"{self.schedule}, {self.microbatches} microbatches:"]
            for s in self.stages:   # its memory is the one figure of the memory section below
                mods = s.modules[0] + (f" .. {s.modules[-1]}" if len(s.modules) > 1 else "")
                lines.append(f"  stage {s.index} on pp rank {s.rank}: {mods:50s} "
                             f"{s.predicted_time_s * 1e3:9.3f} ms/microbatch")
        if self.memory:
            lines += ["", f"Memory per rank (GiB; recompute {self.recompute}, "
                          f"{len(self.recompute_regions)} regions):"]
            for mem in self.memory:
                grads = "(in backward)" if self.microbatches == 1 else f"{mem.grads / 2**30:.3f}"
                lines.append(f"  stage {mem.stage}: params {mem.params / 2**30:.3f}  grads {grads}  "
                             f"optimizer {mem.optimizer / 2**30:.3f}  activations {mem.activations / 2**30:.3f}  "
                             f"backward above forward {mem.transient / 2**30:.3f}  "
                             f"peak {mem.peak / 2**30:.3f}"
                             + (f"  host (offloaded master and optimizer) {mem.host / 2**30:.3f}" if mem.host else ""))
        if self.memory and self.microbatches == 1:
            lines.append("  grads (in backward): with one microbatch no gradient outlives the backward; each "
                         "arrives during it and is counted in 'backward above forward'")
        lines += ["", f"Predicted step time {self.predicted_step_time * 1e3:.3f} ms "
                      f"(compute {self.predicted_compute_s * 1e3:.3f} ms, "
                      f"communication {self.predicted_comm_s * 1e3:.3f} ms, "
                      f"update {self.predicted_update_s * 1e3:.3f} ms); solved in {self.solve_seconds:.2f} s"]
        if self.step_terms is not None:
            terms = ", ".join(f"{k} {v * 1e3:.3f}" for k, v in self.step_terms.as_dict().items())
            lines.append(f"  terms (ms): {terms}"
                         + (" (tp, pp and bubble inside the pipeline's compute)" if self.step_terms.pipelined else ""))
        lines.append(f"Model FLOPs per step {self.model_flops:.3e}; predicted MFU {self.predicted_mfu:.1%} "
                     f"of {_significant(self.peak_flops / 1e12)} TFLOP/s per device")
        for r in self.rehearsals:
            lines += ["", *r.lines()]
        lines += [f"Note: {n}" for n in self.notes]
        lines += [f"Warning: {w}" for w in self.warnings]
        return "\n".join(lines)


def _positive(n) -> bool:
    """Whether ``n`` is a positive integer (a bool is not)."""
    return isinstance(n, int) and not isinstance(n, bool) and n >= 1


def _one_of(valid) -> str:
    """``valid`` as a sentence's list: "'a', 'b' or 'c'"."""
    shown = list(map(repr, valid))
    return shown[0] if len(shown) == 1 else f"{', '.join(shown[:-1])} or {shown[-1]}"


def _combination_refused(plan: Plan) -> str | None:
    """Why ``plan``'s choices, each valid alone, cannot run together (a sentence naming the field and
    the fix), or None: the checks ``autopar.plan`` makes of its knobs, made of a plan's fields."""
    pp = plan.mesh[1]
    if plan.virtual_stages > 1 and plan.schedule not in INTERLEAVED:
        return (f"plan.virtual_stages {plan.virtual_stages}: schedule {plan.schedule} runs one stage per pp rank; "
                f"set virtual_stages to 1, or the schedule to {_one_of(INTERLEAVED)}")
    if pp > 1 and plan.microbatches < pp:
        return (f"plan.microbatches {plan.microbatches}: fewer than the pp={pp} pipeline stages; use at least {pp} "
                "so every stage has work")
    if plan.schedule in INTERLEAVED and plan.microbatches % pp:
        return f"plan.microbatches {plan.microbatches}: {plan.schedule} needs a multiple of pp={pp}"
    if plan.cp == 1 and plan.cp_attention != "allgather":
        return (f"plan.cp_attention {plan.cp_attention!r} chooses how attention runs over cp, but this plan has "
                "cp=1; set it to 'allgather' (or re-plan on a mesh with a cp axis)")
    if plan.offload == "none" and (plan.offload_kept or plan.offload_delay):
        field_ = "offload_kept" if plan.offload_kept else "offload_delay"
        return (f"plan.{field_} {getattr(plan, field_)!r} says how the optimizer is offloaded, but this plan has "
                "offload='none'; empty it (offload_delay 0) or set offload to 'optimizer'")
    if isinstance(plan.offload_delay, bool) or plan.offload_delay not in (0, 1):
        return f"plan.offload_delay {plan.offload_delay!r}: expected 0 (exact update) or 1 (one step late)"
    if plan.keep_gathered and plan.zero != 3:
        return (f"plan.keep_gathered lists {', '.join(plan.keep_gathered)}, but only zero=3 reshards units "
                f"(this plan has zero={plan.zero}); empty it or set zero to 3")
    why = offload_limit(plan.offload, plan.precision, plan.zero, plan.mesh, plan.microbatches)
    return f"plan.offload: {why}" if why else None


def _cp_attention_text(cp: int, attention: str) -> str:
    """How attention runs over cp, for the summary (nothing without cp)."""
    if cp == 1:
        return ""
    how = {"allgather": "keys and values all-gathered over cp",
           "ring": "ring attention, key/value blocks passed around cp"}[attention]
    return f", attention over cp: {attention} ({how})"


def _significant(x: float) -> str:
    """``x`` with three significant digits, without an exponent for the sizes a device's peak takes."""
    return f"{x:.0f}" if x >= 100 else f"{x:.3g}"


def _axis_order(*placements: dict) -> list[str]:
    """The axes named in ``placements`` in the mesh's order (``AXIS_ORDER``), any others after."""
    named = dict.fromkeys(a for pl in placements for a in pl)
    return [a for a in AXIS_ORDER if a in named] + [a for a in named if a not in AXIS_ORDER]


def edited_source(source: str) -> str:
    """The ``source`` of a plan whose choices were changed by hand from a plan of ``source``."""
    return source if source.startswith("edited from ") else f"edited from {source}"


def _offloaded(offload: str, kept: tuple[str, ...] = (), delay: int = 0, memory=()) -> str:
    """The summary's phrase for offload: where the optimizer lives, unit by unit, and its bytes there."""
    if offload == "none":
        return ""
    gib = 2**30
    host = sum(m.host for m in memory)
    shown = ", ".join(kept) if len(kept) <= 4 else f"{len(kept)} units, {kept[0]} .. {kept[-1]}"
    where = (f" except for the units {shown}, whose state stays on the device"
             f" ({sum(m.optimizer for m in memory) / gib:.2f} GiB of optimizer state there)" if kept else "")
    late = ", applied one step late (offload_delay=1)" if delay else ""
    return (f", optimizer offloaded to the host (fp32 master and AdamW state in host memory: {host / gib:.2f} GiB)"
            f"{where}{late}")


def offload_limit(offload: str, precision: str, zero: int, mesh, microbatches: int) -> str | None:
    """Why ``offload`` cannot run with these choices (a sentence naming the fix), None when it can.

    At 16 bits the device keeps only 16-bit weights, whose gradients autograd leaves at 16 bits:
    that holds the sums to fp32 for bf16 with one forward and backward per step whose gradient sums run in fp32
    (ZeRO-0's all-reduce), but microbatches would add up in 16 bits, ZeRO-1/2/3 reduce at the
    weights' dtype, and fp16's loss scale would be divided out at 16 bits; so there offload runs
    at fp32 only."""
    if offload == "none" or precision == "fp32":
        return None
    if precision == "fp16":
        return (f"offload={offload!r} with precision='fp16' would unscale the loss-scaled gradients at 16 bits; "
                "use precision='bf16' (no loss scaling) or 'fp32'")
    why = [what for what, bad in ((f"zero={zero}", zero == 1 or (zero and mesh[0] > 1)), (f"pp={mesh[1]}", mesh[1] > 1),
                                  (f"{microbatches} microbatches", microbatches > 1)) if bad]
    if not why:
        return None
    return (f"offload={offload!r} with precision={precision!r} needs one forward and backward per step on one stage "
            f"without ZeRO (the 16-bit gradients would be summed in 16 bits); this plan has {', '.join(why)}: "
            "use zero=0, pp=1 and one microbatch, or precision='fp32'")


def _zero_axes(zero: int, mesh: Mesh) -> str:
    """Where a split dp's ZeRO shards and reduces (nothing for an unsplit dp or zero=0)."""
    if not zero or not mesh.split:
        return ""
    return (f" (sharded over the {mesh.dp_shard} dp_shard ranks, gradients all-reduced across the "
            f"{mesh.dp_replicate} dp_replicate replicas)")


def dp_placements(mesh: Mesh, zero: int) -> dict[str, str]:
    """A parameter's placements on the dp axes: sharded by rows where ZeRO shards it (from zero=1
    on, over dp, or over dp_shard and replicated across dp_replicate when dp is split), else replicated."""
    sharded = "S(0)" if zero and mesh.dp_shard > 1 else "R"
    dp = {"dp_replicate": "R", "dp_shard": sharded} if mesh.split else {"dp": sharded}
    return {**dp, "cp": "R"} if mesh.cp > 1 else dp   # replicated over cp: every rank runs all the weights


def zero_on_mesh(zero: int, mesh: Mesh) -> tuple[int, tuple[str, ...]]:
    """The ZeRO stage a plan runs ``zero`` at on ``mesh``, and notes saying where that is not what it
    asked: without dp ranks to shard over (dp=1, or a split dp of one shard per replica: plain
    replication) zero=2 and 3 become 0 (so does 1 across replicas: each would step its whole
    state); zero=0 on a split dp shards nothing and all-reduces over all of dp."""
    if zero and mesh.dp_shard == 1 and (zero >= 2 or mesh.split):
        why = (f"dp_shard=1 ({mesh.dp_replicate} replicas of one rank each: plain replication)" if mesh.split
               else "dp=1")
        return 0, (f"zero={zero} asks to shard over dp, but {why}: nothing to shard; planned as zero=0",)
    if not zero and mesh.split:
        return 0, (f"{mesh.dp_text()}, but zero=0 shards nothing: the gradients are all-reduced over all "
                   f"{mesh.dp} dp ranks; zero=1-3 shard over dp_shard and all-reduce across dp_replicate",)
    return zero, ()


def standing_notes(given: tuple[str, ...], plan, derived: tuple[str, ...]) -> tuple[str, ...]:
    """The notes of ``plan`` (its fields, as attributes) re-derived from a plan file whose notes were
    ``given``, its re-derivation having written ``derived``: ``given`` in order, less what an edit
    by hand made untrue, then what ``derived`` adds. Untrue: a note on a choice the planner made
    automatically (zero, offload, cp attention, the units kept gathered) that ``plan`` no longer
    makes, and a note of ``zero_on_mesh`` (each says why a plan runs at zero=0) when the plan's
    zero is no longer 0 or the re-derivation wrote another one in its place."""
    mesh = Mesh.of_plan(plan)
    on_mesh = {n for zero in range(4) for n in zero_on_mesh(zero, mesh)[1]}
    replaced = plan.zero != 0 or any(n in on_mesh for n in derived)
    kept = [n for n in given if _holds(n, plan) and (n not in on_mesh or n in derived or not replaced)]
    return tuple(kept + [n for n in derived if n not in kept])


def _holds(note: str, plan) -> bool:
    """False for a note on a choice the planner made automatically that ``plan`` no longer makes (its
    words are those ``autopar.planner.decide`` writes), True for any other note."""
    m = re.match(r"(zero|offload) chosen automatically: \1=(\w+)", note)
    if m:
        return str(getattr(plan, m[1])) == m[2]
    m = re.match(r"cp attention(?: chosen automatically)?: (\w+)", note)
    if m:
        return plan.cp_attention == m[1]
    m = re.match(r"keep_gathered chosen automatically: (?:none\b|(\d+) of \d+ units \((.*?)\) keep)", note)
    if m:
        kept = tuple(plan.keep_gathered)
        if m[1] is None:
            return not kept
        # the note lists at most four units, else the first and the last
        return bool(kept) and len(kept) == int(m[1]) and m[2] in (", ".join(kept), f"{kept[0]} .. {kept[-1]}")
    return True


def _held_text(zero: int, mesh: Mesh) -> str:
    """What the summary's local shapes are where ZeRO shards over dp (nothing elsewhere)."""
    if not zero or mesh.dp_shard == 1:
        return ""
    if zero == 1:
        return ": the weights' whole tp shard; ZeRO-1's dp S(0) is the optimizer state's"
    return f": this rank's ZeRO-{zero} dp shard, ceil(rows / {mesh.dp_shard}) rows of the tp shard"


def _kept_gathered(units: tuple[str, ...]) -> str:
    return f" (kept gathered from forward to backward: {', '.join(units)})" if units else ""


def axis_warnings(plan: Plan) -> list[str]:
    """A sentence for each mesh axis the plan gives no work. Only tp can be idle: over it every
    weight and activation may be replicated (its ranks then repeat one computation), while dp
    always splits the batch and every pipeline stage holds at least one unit."""
    dp, _, tp = plan.mesh
    out = []
    replicated = (all(p.placements.get("tp", "R") == "R" for p in plan.parameters)
                  and all(n.output == "R" and set(n.inputs) <= {"R"} for n in plan.nodes))
    if tp > 1 and replicated and not any(c.axis == "tp" for c in plan.collectives):
        why = (f"the cost model replicated every weight (sharding costs more in communication than it saves "
               f"on device {plan.device!r})" if plan.source == "auto" else
               "this plan replicates every weight and activation")
        local = plan.input_shapes[0][0] * plan.microbatches if plan.input_shapes and plan.input_shapes[0] else 0
        instead = f" (or dp={dp * tp}, splitting the batch instead)" if local and local % tp == 0 else ""
        out.append(f"tp={tp} does no work: {why}, so its {tp} ranks repeat the same computation; "
                   f"use tp=1{instead} or a device with faster links")
    return out


def fit_warning(plan: Plan, memory_bytes: float, where: str, full_recompute_peak=None,
                deeper_pipeline=None) -> str | None:
    """A sentence when the fullest rank's predicted peak exceeds ``memory_bytes`` (``where``: the
    device or budget it is measured against), None when the plan fits. It says by what factor
    memory must shrink and what would fit, trying the cheap remedies the caller can price:
    ``full_recompute_peak()``, the peak with recompute="full" at this mesh (or None), and
    ``deeper_pipeline()``, ((dp, pp, tp), peak) of a mesh with more pipeline stages that fits (or
    None). Failing both, it gives the least factor of devices the weights, gradients and optimizer
    state need (a lower bound: pp and ZeRO divide that state, at best evenly)."""
    if not plan.memory or memory_bytes <= 0:
        return None
    fullest = max(plan.memory, key=lambda m: m.peak)
    if fullest.peak <= memory_bytes:
        return None
    gib = 2**30
    text = (f"this plan does not fit: its peak is {fullest.peak / gib:.1f} GiB per rank but {where} holds "
            f"{memory_bytes / gib:.1f} GiB, so memory must shrink {fullest.peak / memory_bytes:.1f}x")
    if plan.recompute != "full" and full_recompute_peak is not None:
        peak = full_recompute_peak()
        if peak is not None and peak <= memory_bytes:
            return text + f"; recompute='full' fits it (peak {peak / gib:.1f} GiB)"
        if peak is not None:
            text += f"; recompute='full' only lowers it to {peak / gib:.1f} GiB"
    found = deeper_pipeline() if deeper_pipeline is not None else None
    if found is not None:
        mesh, peak = found
        factor = mesh[1] // plan.mesh[1]
        return text + (f"; mesh dp={mesh[0]} pp={mesh[1]} tp={mesh[2]} ({factor}x the devices) fits, its best "
                       f"stage cut peaking at {peak / gib:.1f} GiB per rank: `--mesh {','.join(map(str, mesh))}`")
    # with several microbatches the gradients are held too, as many bytes as the fp32 weights
    # (params also counts a 16-bit working copy: half their bytes)
    weights = fullest.params / (1.5 if plan.precision != "fp32" else 1.0)
    state = fullest.params + fullest.optimizer + max(fullest.grads, weights)
    if state > memory_bytes:
        devices = plan.mesh[0] * plan.mesh[1] * plan.mesh[2]
        need = -(-state // memory_bytes)
        zero = " or zero=1 over a larger dp for the optimizer state" if not plan.zero else ""
        return text + (f"; the weights, gradients and optimizer state alone take {state / gib:.1f} GiB per rank, "
                       f"so the model needs at least {need:.0f}x the devices (more pp{zero}): rank the meshes "
                       f"of {devices * need:.0f} devices with `--mesh auto --gpus {devices * need:.0f}`")
    return text + "; use more pp or tp (they divide the weights and activations), or a smaller batch per rank"


def _check_placements(plan: Plan) -> None:
    """Every parameter placement parses and shards a dim its tensor has (PlanFormatError naming it)."""
    from autopar.placement import check_dim, parse_placement

    for i, p in enumerate(plan.parameters):
        for axis, text in p.placements.items():
            try:
                check_dim(p.shape, parse_placement(text))
            except ValueError as e:
                raise PlanFormatError(f"plan.parameters[{i}].placements.{axis} ({p.fqn}): {e}") from None


def _close(a, b) -> bool:
    """Equal, with floats (or dataclasses of floats) compared to a relative 1e-9."""
    if hasattr(a, "__dataclass_fields__"):
        return all(_close(getattr(a, f), getattr(b, f)) for f in a.__dataclass_fields__)
    if isinstance(a, float) and isinstance(b, float):
        return abs(a - b) <= 1e-9 * max(abs(a), abs(b), 1e-30)
    return a == b


def _diff_keyed(out: list, kind: str, a: dict, b: dict, show, label=str, same=lambda x, y: x == y) -> None:
    for key in list(a) + [k for k in b if k not in a]:
        x, y = a.get(key), b.get(key)
        name = label(x if x is not None else y) if label is not str else str(key)
        if x is None:
            out.append(f"{kind} {name}: only in the second plan: {show(y)}")
        elif y is None:
            out.append(f"{kind} {name}: only in the first plan: {show(x)}")
        elif not same(x, y):
            out.append(f"{kind} {name}: {show(x)} -> {show(y)}")


def _collective_totals(colls) -> dict:
    totals: dict = {}
    for c in colls:
        key = f"{c.where or '(top level)'} {c.phase} {c.kind} on {c.axis}"
        n, b = totals.get(key, (0, 0))
        totals[key] = (n + c.count, b + c.bytes)
    return totals


def _layer_key(name: str) -> str:
    return re.sub(r"\.(\d+)\.", ".*.", name, count=1)


def _collapse_layers(params):
    """Show repeated layers once (h.*.attn...) when every layer has the same plan."""
    groups = defaultdict(list)
    for p in params:
        groups[_layer_key(p.fqn)].append(p)
    out = []
    for key, ps in groups.items():
        same = all((q.placements, q.local_shape) == (ps[0].placements, ps[0].local_shape) for q in ps)
        if len(ps) > 1 and same:
            out.append(ParamPlan(f"{key} (x{len(ps)})", ps[0].shape, ps[0].placements, ps[0].local_shape))
        else:
            out.extend(ps)
    return out


def _collapse_collectives(colls):
    groups = defaultdict(lambda: [0, 0])
    for c in colls:
        k = (_layer_key(c.where + "."), c.phase, c.kind, c.axis)
        groups[k][0] += c.count
        groups[k][1] += c.bytes
    return [CollectivePlan(kind, axis, phase, where.rstrip("."), n, b)
            for (where, phase, kind, axis), (n, b) in groups.items()]


def _build(cls, data, where: str):
    """Construct dataclass ``cls`` from JSON ``data``, naming the bad field on error."""
    if not isinstance(data, dict):
        raise PlanFormatError(f"{where}: expected an object, got {type(data).__name__}")
    kwargs = {}
    for f in fields(cls):
        name = f"{where}.{f.name}"
        if f.name not in data:
            if f.default is not MISSING or f.default_factory is not MISSING:
                continue
            raise PlanFormatError(f"{name} is missing")
        kwargs[f.name] = _convert(f.type, data[f.name], name)
    extra = set(data) - {f.name for f in fields(cls)}
    if extra:
        raise PlanFormatError(f"{where}: unknown field(s) {', '.join(sorted(extra))}")
    return cls(**kwargs)


_NESTED = {"ParamPlan": ParamPlan, "NodePlan": NodePlan, "CollectivePlan": CollectivePlan,
           "StagePlan": StagePlan, "MemoryPlan": MemoryPlan, "Rehearsal": Rehearsal,
           "CollectiveCount": CollectiveCount, "OpTime": OpTime}


def _convert(tp: str, value, name: str):
    tp = str(tp).replace(" ", "")
    for key, sub in _NESTED.items():
        if tp.startswith(f"tuple[{key},"):
            if not isinstance(value, list):
                raise PlanFormatError(f"{name}: expected a list")
            return tuple(_build(sub, v, f"{name}[{i}]") for i, v in enumerate(value))
    checks = {"str": str, "int": int, "float": (int, float), "bool": bool}
    if tp in checks:
        if not isinstance(value, checks[tp]) or (tp != "bool" and isinstance(value, bool)):
            raise PlanFormatError(f"{name}: expected {tp}, got {value!r}")
        return float(value) if tp == "float" else value
    if tp == "StepTerms|None":
        if value is not None and not isinstance(value, dict):
            raise PlanFormatError(f"{name}: expected an object or null, got {value!r}")
        return None if value is None else _build(StepTerms, value, name)
    if tp == "str|None":
        if value is not None and not isinstance(value, str):
            raise PlanFormatError(f"{name}: expected a string or null, got {value!r}")
        return value
    if tp.startswith("tuple[") or tp.startswith("dict["):
        if tp.startswith("dict["):
            if not isinstance(value, dict) or not all(isinstance(v, str) for v in value.values()):
                raise PlanFormatError(f"{name}: expected an object of strings")
            return dict(value)
        if not isinstance(value, list):
            raise PlanFormatError(f"{name}: expected a list, got {value!r}")
        inner = tp[len("tuple["):-1]
        if inner.startswith("tuple[int") or inner.startswith("tuple[str"):
            kind = inner[len("tuple["):].split(",")[0]
            return tuple(_convert(f"tuple[{kind},...]", v, f"{name}[{i}]") for i, v in enumerate(value))
        kind = inner.split(",")[0]
        return tuple(_convert(kind, v, f"{name}[{i}]") for i, v in enumerate(value))
    raise AssertionError(f"unhandled plan field type {tp}")
