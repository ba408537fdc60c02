"""mesh="auto": every valid (dp, pp, tp), and cp where it can pay, with the pipeline schedules and
microbatch counts that can pay, for a world size, ranked by predicted step time.

Candidates are planned at one microbatch size (``microbatch_size`` sequences; the rest of a dp
rank's batch is microbatches), so one capture serves them, but for the fewer microbatches below
(Microbatches). Each candidate is planned as
``autopar.plan`` would plan it on that mesh (``price``), so its row in the ranking is that
plan's predicted step time (``cost_model.terms.StepTerms.total``) and peak memory
(``Plan.memory``): the winner's row and the winner's plan are one computation. A row also shows
the zero stage, recompute and offload its plan chose and the step's terms as its plan added them
up (``Candidate.terms``: compute, tp / cp / pp / dp exposed communication, bubble, update, the
offloaded optimizer's host step), and a last line says why the winner won. tp stays inside a node.

With ``hsdp`` (ZeRO may shard, zero >= 1 or "auto"), a dp that spans several nodes is also ranked
split as HSDP: dp_shard = the dp ranks of one node (gpus_per_node / (pp * cp * tp), at least 2) and
dp_replicate = dp / dp_shard, so that the sharded collectives stay inside a node and only the
replicas' all-reduce crosses nodes; its row names the mesh (r x s, pp, tp).

Context parallelism (cp ranks per sequence, ``passes.context_parallel``) is ranked where the model
allows it (causal attention, ``check_context``) for the cp that split the sequence into 2·cp
chunks (``check_sequence``). For one (pp, tp), the ranks left, D = dp·cp, split the batch's tokens
either way: every (D/cp, pp, cp, tp) gives each rank the same tokens, while a larger cp adds its
collectives and saves activation memory (activations / cp). Without pipeline stages, per (pp, tp)
cp therefore rises from 1 while no plan fits, or while the plan that fits pays for its memory in
time (``_pays_for_memory``: recompute="auto" chose regions), since the next cp may fit with less
recompute or none, as NVIDIA's recipes pay for memory with cp at 8k tokens, not recompute; it stops
at the first cp that fits without recompute, or once one fitted and the next does not. With stages
the rise goes on through every cp the floors allow: a larger cp means fewer dp ranks and so more
microbatches per rank at the same batch, a smaller bubble (the 70B over 64 H100s: (2, 4, cp2, 4) at
7.429 s, which the rule's stop at pp 4, tp 4 left out for a 7.645 s plan; the 175B's planning took
34-40 CPU s instead of 21, BENCHMARKS.md). This rule is not exact: a
larger cp also swaps dp's gradient sync for cp's, and the cost model prices a cp rank's ops at the
whole sequence's matmul efficiency (``cost_model.context``), so a larger cp that the rule does not
plan can be priced faster; planning every cp is complete but cost over 100 s for a 70B model on
64 GPUs. A cp whose dp the batch does not divide is skipped as a dp would be. Rows with cp > 1
name the mesh (dp, pp, cpC, tp). A cp the model refuses is traced once, when a mesh of it is to be
planned (one its step floor rules out is not traced), and not ranked; the table says so in one
line with the reason (``rank_meshes``' context).

Microbatches: every mesh is planned at one sequence per microbatch (one capture serves them all;
with pipeline stages the recipes' micro-batch 1, the least bubble). Without pipeline stages fewer,
larger microbatches do the same work in larger matmuls with fewer launches and ZeRO gathers, and
keep more activations: once every layout is planned, each fitting row without pipeline stages
within ``FEWER_WITHIN`` (10%) of the fastest fitting step, fastest first, is planned again at each
count down the divisors of its own while the last fitted (``_fewer_microbatches``; each
sequences-per-microbatch is one capture, seconds for a 70B model), but a count whose step floor
is no faster than the fastest fitting row (below). After the search, not during it, so that
which rows are tried does not depend on the order the layouts were planned in. Not exact, to
bound the planning time: a row further from the fastest is not tried (the largest gain measured
from fewer microbatches is 5.3%, the 70B's (64, 1, 1) from 2 to 1: BENCHMARKS.md), and one
microbatch, which holds no gradients through its forward, may fit where two did not.

Pipeline schedules (``schedule_options``): each mesh with pp > 1 is planned with the request's
schedule and, unless the request fixes ``virtual_stages``, interleaved at every virtual stage count v
from 2 to ``VIRTUAL_MAX`` that the layer units and the microbatch count allow (pp·v units at least,
microbatches a multiple of pp). The variants do the same work; interleaving only shrinks the
fill/drain bubble ((p-1)/(v·m) of the work instead of (p-1)/m) while it adds point-to-point cuts and
keeps more microbatch-chunks in flight (Korthikanti et al.'s 1 + (p-1)/(p·v)), so more memory and
no less recompute. So a variant is planned only where its mesh's first plan, less its bubble, is
faster than the fastest fitting plan ranked so far: no variant below that bound can win; and v
rises only while its step falls (the bubble shrinks as 1/v, the cuts' point-to-point grows with v;
not exact where the stage cut moves with v). Each planned variant is a row of its own ("I1F1B v5").
A variant (and a count of fewer microbatches, above) is also skipped where its step floor
(``bound``: ``planner.floors``, the least step any plan of that layout can have, whatever its ZeRO
stage, offload, recompute, strategies and stage cut) is no faster than that fastest row: it cannot
be faster and fit. So is a whole mesh, where the floor of each of its schedules is: it becomes one
row marked not planned (``MeshOption.planned``), which the table counts in a line, and the first
schedule planned is the first whose floor passes. The layouts are taken best first, least floor
first (each (pp, tp)'s next cp joins once the rise of cp above allows it), so that the fastest
fitting rows come early and rule the most out. Floors cost milliseconds once a tp's op times are
read; planning a 70B candidate costs a tenth of a second to seconds. On Llama 3.1 70B over 64 GPUs
(``bench/published.py``'s nemo-70b-64) the search plans 30 of 87 candidates and the rest
are ruled out so.
"""
from __future__ import annotations

import heapq
import math
from dataclasses import dataclass

import numpy as np

from autopar.mesh import Mesh
from autopar.passes.context_parallel import ContextParallelError, check_context, check_sequence
from autopar.graph.units import layer_units
from autopar.errors import PlanError
from autopar.planner.sharding import check_tp, divisors


@dataclass(frozen=True)
class MeshOption:
    """One candidate mesh with the cost model's verdict and the choices its plan made."""

    mesh: Mesh
    microbatches: int
    step_time: float       # seconds per step (its plan's), inf when no plan fits
    peak_memory: float     # bytes on the fullest rank (its plan's), inf when no plan fits
    fits: bool
    reason: object = ""    # why no plan fits, when none does: its ValueError, whose text some make when printed
    zero: int = 0
    recompute: str = "none"
    recompute_regions: int = 0
    offload: str = "none"
    kept_gathered: int = 0   # ZeRO-3's units kept gathered from forward to backward
    terms: dict | None = None   # the step time's terms (``StepTerms.as_dict``, seconds)
    schedule: str = "1F1B"
    virtual: int = 1         # pipeline stages per pp rank
    planned: bool = True     # False: its step floor ruled it out before it was planned (``_variants``)


# the step's terms a row shows (``cost_model.terms.StepTerms``), and their column heads
TERMS = ("compute", "tp", "cp", "pp", "dp", "bubble", "update", "offload")
_HEADS = {"offload": "host"}


def hsdp_split(mesh: Mesh, gpus_per_node: int) -> Mesh | None:
    """``mesh`` with its dp split as HSDP (module docstring): dp_shard the dp ranks inside one node,
    dp_replicate the rest; None when dp fits in a node or a node holds fewer than two of its ranks."""
    inner = mesh.pp * mesh.cp * mesh.tp
    if gpus_per_node % inner or mesh.dp * inner <= gpus_per_node:
        return None
    shard = gpus_per_node // inner
    if shard < 2 or mesh.dp % shard:
        return None
    return Mesh(mesh.dp, mesh.pp, mesh.tp, dp_replicate=mesh.dp // shard, cp=mesh.cp)


def mesh_name(mesh: Mesh) -> str:
    """A ranking row's mesh: (dp, pp, tp), with a split dp as (dp_replicate x dp_shard, pp, tp), and
    with cp > 1 as (dp, pp, cpC, tp) (the rank order: cp between pp and tp)."""
    dp = f"{mesh.dp_replicate}x{mesh.dp_shard}" if mesh.split else f"{mesh.dp}"
    cp = f"cp{mesh.cp}, " if mesh.cp > 1 else ""
    return f"({dp}, {mesh.pp}, {cp}{mesh.tp})"


FEWER_WITHIN = 0.10   # rows planned at fewer microbatches: those within this of the fastest fitting step
VIRTUAL_MAX = 8   # the most virtual stages per pp rank ranked (NVIDIA's 70B to 405B recipes use 5 to 8)


def schedule_options(pp: int, units: int, microbatches: int, schedule: str, virtual) -> list[tuple[str, int]]:
    """(schedule, virtual stages) to plan a mesh with (module docstring): the request's ``schedule``
    (``virtual``: the request's ``virtual_stages``, None when not given), then, with pp > 1 and
    ``virtual`` not given, Interleaved1F1B (or the request's interleaved schedule) at each v from 2 to
    VIRTUAL_MAX with pp·v <= ``units`` and ``microbatches`` a multiple of pp."""
    interleaved = schedule.startswith("Interleaved")
    first = [(schedule, virtual or (2 if interleaved else 1))]
    if pp == 1 or virtual is not None or microbatches % pp:
        return first
    kind = schedule if interleaved else "Interleaved1F1B"
    more = [(kind, v) for v in range(2, VIRTUAL_MAX + 1) if pp * v <= units]
    return list(dict.fromkeys(first + more))


def context_sizes(seq: int, data: int, *, tp: int = 1, sequence_parallel=False) -> tuple[list[int], str]:
    """The cp > 1 that may split ``data`` ranks' sequences of ``seq`` tokens (cp divides ``data``,
    2·cp chunks divide the sequence, and, with ``sequence_parallel`` forced on, tp divides each rank's
    tokens), and a sentence saying which and why the others are not. Whether the model allows cp
    is asked only once a cp is to be planned (``allows_context``): it traces the rewrite, which
    costs seconds on a large model."""
    valid, refused = [], []
    for cp in (c for c in divisors(data) if c > 1):
        try:
            check_sequence(seq, cp, tp, sequence_parallel is True)
        except ContextParallelError:
            refused.append(cp)
            continue
        valid.append(cp)
    text = f"cp {', '.join(map(str, valid)) or 'none'} split{'s' if len(valid) == 1 else ''} the {seq}-token sequence"
    if refused:
        text += f" (cp {', '.join(map(str, refused))}: 2·cp does not divide it)"
    return valid, text


def allows_context(cap, cp: int) -> str:
    """"" when the model's graph can be split over cp ranks per sequence, else why not
    (``check_context``: causal sdpa, a loss over tokens, nothing else reducing over the sequence)."""
    try:
        check_context(cap, cp)
    except ContextParallelError as e:
        return str(e)
    return ""


def rank_meshes(world_size: int, example_inputs, *, price, capture, memory_budget: float,
                gpus_per_node: int = 8, microbatch_size: int = 1, hsdp: bool = False,
                sequence_parallel="auto", schedule: str = "1F1B", virtual=None,
                bound=None) -> tuple[list[MeshOption], str]:
    """Every (dp, pp, tp) with dp * pp * tp == world_size that the model and batch allow, and the
    (dp, pp, cp, tp) the module docstring says can pay, each with the pipeline schedules it says can
    pay (``schedule_options`` of the request's ``schedule`` and ``virtual`` stages), fastest fitting
    first; with a line saying which cp the sequence allows and one per reason the model refused a
    cp (those cp are not ranked; ``allows_context``).

    ``price(mesh, microbatches, schedule, virtual)``: the candidate's plan before it is built (a
    ``Candidate``: its ``step_time``, ``peak_memory``, ``terms`` and ``choices``, those its Plan will
    have), or a ValueError saying why none fits (no stage cut, or no recompute choice, within the memory);
    ``capture(inputs)``: the model traced at one microbatch, for the checks a mesh must pass before
    it is planned (tp divides the heads, pp at most the layer units, the model allows cp); ``memory_budget``: bytes per
    device; ``hsdp``: also rank each multi-node dp split as HSDP (``hsdp_split``);
    ``sequence_parallel``: the knob (True asks each cp rank's tokens to split over tp); ``bound(mesh,
    microbatches, schedule, virtual)``: a layout's floors (``planner.floors.Floor``), for the order the
    layouts are planned in and the meshes, variants and counts of fewer microbatches it skips
    (module docstring); without it, every layout in (tp, pp, cp) order."""
    first = example_inputs[0]
    batch, seq = first.shape[0], first.shape[1] if first.dim() > 1 else None   # cp splits dim 1, the sequence
    cap = capture(tuple(x[:microbatch_size] for x in example_inputs))
    units = layer_units(cap)
    ladders = []   # per (tp, pp): its layouts by rising cp, each (cp, meshes, microbatches, schedules)
    for tp in (t for t in divisors(world_size) if t <= gpus_per_node):
        try:
            check_tp(cap, tp)
        except PlanError:
            continue
        for pp in divisors(world_size // tp):
            if pp > len(units):
                continue
            data = world_size // (tp * pp)   # dp * cp: the ranks that split the tokens
            cps = context_sizes(seq, data, tp=tp, sequence_parallel=sequence_parallel)[0] if seq else []
            steps = []
            for cp in (1, *cps):
                dp = data // cp
                if batch % (dp * microbatch_size):
                    continue
                m = batch // (dp * microbatch_size)
                if pp > 1 and m < pp:
                    continue
                plain = Mesh(dp, pp, tp, cp=cp)
                split = hsdp_split(plain, gpus_per_node) if hsdp else None
                steps.append((cp, (plain, split) if split else (plain,), m,
                              schedule_options(pp, len(units), m, schedule, virtual)))
            if steps:
                ladders.append(steps)
    out, refused = [], {}

    def floor_of(step) -> float:
        _, meshes, m, schedules = step
        return min(bound(mesh, m, *sched).step for mesh in meshes for sched in schedules) if bound else 0.0
    queue = [(floor_of(steps[0]), k, 0) for k, steps in enumerate(ladders)]
    heapq.heapify(queue)
    while queue:   # best first: the least floor, so the fastest fitting rows come early and rule out the rest
        _, k, i = heapq.heappop(queue)
        cp, meshes, m, schedules = ladders[k][i]
        pp, tp = meshes[0].pp, meshes[0].tp
        planning = bound is None or not all(_ruled_out(mesh, m, schedules, bound, out)[0] for mesh in meshes)
        if cp > 1 and planning and cp not in refused:   # traced once per cp (the same on every mesh), if planned
            refused[cp] = allows_context(cap, cp)
        rows = []
        if not (cp > 1 and refused.get(cp)):
            for mesh in meshes:
                rows += _variants(mesh, m, price, memory_budget, out + rows, schedules, bound)
        out += rows
        planned = [o for o in rows if o.planned]   # a row its floor ruled out says nothing of the next cp
        # with stages, more cp is more microbatches per rank (a smaller bubble): the rise goes on
        if pp == 1 and (any(o.fits and not _pays_for_memory(o) for o in planned) or (
                planned and not any(o.fits for o in planned)
                and any(o.fits for o in out if (o.mesh.pp, o.mesh.tp) == (pp, tp)))):
            continue   # the rise of cp stops (module docstring)
        if i + 1 < len(ladders[k]):
            heapq.heappush(queue, (floor_of(ladders[k][i + 1]), k, i + 1))
    best = min((o.step_time for o in out if o.fits), default=math.inf)
    for o in sorted((o for o in out if o.fits and o.mesh.pp == 1 and o.step_time <= best * (1 + FEWER_WITHIN)),
                    key=lambda o: o.step_time):
        out += _fewer_microbatches(o, price, memory_budget, out, bound)
    if not out:
        raise PlanError(f"no (dp, pp, tp) for {world_size} devices suits this model and a batch of {batch}")
    out.sort(key=lambda o: (not o.fits, o.step_time, o.peak_memory))
    return out, _context_lines(seq, world_size, refused)


def _context_lines(seq, world_size: int, refused: dict) -> str:
    """The ranking's lines on cp: which cp the sequence allows, and one per reason the model refused
    a cp (``refused``: cp -> the reason, "" where it was allowed)."""
    if not seq:
        return "cp: none (the first input has no sequence dim)"
    why_not: dict[str, list[str]] = {}
    for cp, reason in refused.items():
        if reason:
            why_not.setdefault(reason, []).append(str(cp))
    return "\n".join([f"{context_sizes(seq, world_size)[1]}; a cp is planned where the meshes of less cp with "
                      f"its pp and tp do not fit, or fit by recomputing"]
                     + [f"cp {', '.join(cps)} not ranked, the model refuses it: {reason}"
                        for reason, cps in why_not.items()])


def _fewer_microbatches(o: MeshOption, price, memory_budget: float, ranked: list[MeshOption],
                        bound=None) -> list[MeshOption]:
    """Rows of ``o``'s mesh, if it fits without pipeline stages, planned at fewer, larger microbatches
    (module docstring): each count down the divisors of its count while the last fitted, but those
    whose step floor (``bound``) is no faster than the fastest fitting row among ``ranked`` and
    these; without floors, only where ``o`` is that fastest row."""
    out = []
    best = min((r.step_time for r in ranked if r.fits and r is not o), default=math.inf)
    if not (o.fits and o.mesh.pp == 1 and (bound is not None or o.step_time < best)):
        return out
    for count in (k for k in range(o.microbatches - 1, 0, -1) if o.microbatches % k == 0):
        fastest = min((r.step_time for r in ranked + out + [o] if r.fits), default=math.inf)
        if bound is not None and bound(o.mesh, count, o.schedule, o.virtual).step >= fastest:
            continue   # it cannot be faster and fit
        out.append(_priced(o.mesh, count, price, memory_budget, o.schedule, o.virtual))
        if not out[-1].fits:
            break
    return out


def _pays_for_memory(o: MeshOption) -> bool:
    """Whether a fitting row pays for its memory in time: recompute="auto" chose regions, which a
    larger cp (less activation memory per rank) may spare (module docstring)."""
    return o.recompute == "auto" and o.recompute_regions > 0


def _variants(mesh: Mesh, m: int, price, memory_budget: float, ranked: list[MeshOption], schedules,
              bound=None) -> list[MeshOption]:
    """The rows of ``mesh`` at ``m`` microbatches: the first of ``schedules`` whose step floor
    (``bound``) is below the fastest fitting step among ``ranked`` planned, then each other one
    while the first's step less its bubble is below the fastest fitting step among ``ranked`` and
    these rows (the module docstring's bound), but those whose step floor is not below it, and
    until a fitting variant is no faster than the fitting one before it. Where every schedule's
    floor rules it out, one row that was not planned (``planned=False``) stands for the mesh."""
    if bound is not None:
        ruled, first = _ruled_out(mesh, m, schedules, bound, ranked)
        if ruled:
            return [ruled]
        schedules = schedules[first:]
    first, *others = schedules
    rows = [_priced(mesh, m, price, memory_budget, *first)]
    base = rows[0]
    if not others or not base.terms:
        return rows
    floor = base.step_time - base.terms.get("bubble", 0.0)
    for sched in others:
        best = min((o.step_time for o in ranked + rows if o.fits), default=math.inf)
        if floor >= best:
            break
        if bound is not None and bound(mesh, m, *sched).step >= best:
            continue   # the floor falls as v rises: a larger v may still pass
        rows.append(_priced(mesh, m, price, memory_budget, *sched))
        if len(rows) > 2 and rows[-1].fits and rows[-2].fits and rows[-1].step_time >= rows[-2].step_time:
            break   # v past its best: its bubble falls as 1/v while its cuts' point-to-point grows with v
    return rows


def _ruled_out(mesh: Mesh, m: int, schedules, bound, ranked: list[MeshOption]) -> tuple[MeshOption | None, int]:
    """(the row not planned that stands for ``mesh`` at ``m`` microbatches where the step floor of each
    of its ``schedules`` is no faster than the fastest fitting row among ``ranked``, else None; the
    index of the first schedule whose floor is below it)."""
    best = min((o.step_time for o in ranked if o.fits), default=math.inf)
    floors = [bound(mesh, m, *sched).step for sched in schedules]
    passing = [i for i, f in enumerate(floors) if f < best]
    if passing:
        return None, passing[0]
    return MeshOption(mesh, m, math.inf, math.inf, False,
                      f"not planned: its step floor {min(floors) * 1e3:.3f} ms is no faster than the fastest "
                      f"fitting row's {best * 1e3:.3f} ms", schedule=schedules[0][0], virtual=schedules[0][1],
                      planned=False), len(schedules)


def _priced(mesh: Mesh, m: int, price, memory_budget: float, schedule: str, virtual: int) -> MeshOption:
    """The ranking's row of ``mesh`` at ``m`` microbatches with ``schedule`` and ``virtual`` stages per
    pp rank: its plan's figures, or why none fits."""
    try:
        candidate = price(mesh, m, schedule, virtual)
    except ValueError as e:
        # without its traceback, whose frames would keep the candidate's planning state alive
        return MeshOption(mesh, m, math.inf, math.inf, False, e.with_traceback(None), schedule=schedule,
                          virtual=virtual)
    peak, c = candidate.peak_memory, candidate.choices
    return MeshOption(mesh, m, candidate.step_time, peak, peak <= memory_budget, zero=c.zero, recompute=c.recompute,
                      recompute_regions=len(c.recompute_regions), offload=c.offload,
                      kept_gathered=len(c.keep_gathered), terms=candidate.terms.as_dict(),
                      schedule=c.schedule, virtual=c.virtual_stages)


def schedule_name(o: MeshOption) -> str:
    """A row's schedule: "-" without pipeline stages, else its name, interleaved ones short with their
    virtual stages ("I1F1B v5")."""
    if o.mesh.pp == 1:
        return "-"
    return f"I{o.schedule[len('Interleaved'):]} v{o.virtual}" if o.schedule.startswith("Interleaved") else o.schedule


def _choices(o: MeshOption) -> tuple[str, str, str]:
    """The zero, recompute and offload columns: ZeRO-3 with k units kept gathered prints "3 k5";
    recompute="auto" prints the regions it chose ("auto 12")."""
    zero = f"{o.zero}" + (f" k{o.kept_gathered}" if o.kept_gathered else "")
    recompute = f"auto {o.recompute_regions}" if o.recompute == "auto" else o.recompute
    return zero, recompute, o.offload


def ranking_table(options: list[MeshOption], limit: int = 12, context: str = "") -> str:
    """The ranking as text: mesh, microbatches, the zero stage, recompute and offload its plan chose,
    predicted step time and its terms (compute, tp / cp / pp / dp exposed communication, pipeline
    bubble, optimizer update, the host's offloaded step: the terms the step time adds up,
    ``Candidate.terms``), peak memory,
    fit (the figures to the digits ``Plan.summary`` prints them with), ``context`` (which cp were
    ranked and a line per reason the model refused a cp, ``rank_meshes``), then why the first won."""
    head = (f"{'rank':>4s}  {'mesh (dp,pp,tp)':18s} {'schedule':>10s} {'microbatches':>12s} {'zero':>5s} {'recompute':>9s} "
            f"{'offload':>9s} {'step ms':>11s} " + " ".join(f"{_HEADS.get(t, t):>10s}" for t in TERMS)
            + f" {'peak GiB':>9s}  fits")
    lines = [head]
    unplanned = [o for o in options if not o.planned]
    options = [o for o in options if o.planned]
    for k, o in enumerate(options[:limit]):
        step = f"{o.step_time * 1e3:11.3f}" if np.isfinite(o.step_time) else f"{'-':>11s}"
        peak = f"{o.peak_memory / 2**30:9.3f}" if np.isfinite(o.peak_memory) else f"{'-':>9s}"
        terms = " ".join(f"{o.terms.get(t, 0.0) * 1e3:10.3f}" if o.terms else f"{'-':>10s}" for t in TERMS)
        zero, recompute, offload = _choices(o) if o.terms else ("-", "-", "-")
        lines.append(f"{k + 1:4d}  {mesh_name(o.mesh):18s} {schedule_name(o):>10s} {o.microbatches:12d} {zero:>5s} "
                     f"{recompute:>9s} {offload:>9s} {step} {terms} {peak}  {'yes' if o.fits else 'no'}")
    if len(options) > limit:
        lines.append(f"      ... and {len(options) - limit} more")
    if unplanned:
        lines.append(f"      {len(unplanned)} more not planned: each one's step floor (planner.floors) was no faster "
                     "than the fastest fitting row ranked before it")
    lines.append("      (times in ms; zero k: units kept gathered; recompute auto: regions chosen; "
                 "dp: what prefetch leaves exposed; host: the offloaded optimizer step" + ("; (dp, pp, cpC, tp): sequences split over C ranks)"
                                                        if any(o.mesh.cp > 1 for o in options) else ")"))
    lines += [f"      {line}" for line in context.splitlines()]
    lines.append(ranking_reason(options))
    return "\n".join(lines)


def ranking_reason(options: list[MeshOption]) -> str:
    """One line: why the first of the ranked ``options`` won (or that none fits)."""
    def name(o):
        return mesh_name(o.mesh)
    best = options[0]
    if not best.fits:
        return "      no candidate fits the memory"
    text = f"      winner {name(best)}: the fastest that fits"
    runner = next((o for o in options[1:] if o.fits), None)
    if runner is None:
        text = f"      winner {name(best)}: the only one that fits"
    else:
        text += (f", {best.step_time * 1e3:.3f} ms against the runner-up {name(runner)}'s "
                 f"{runner.step_time * 1e3:.3f} ms ({runner.step_time / best.step_time - 1:.1%} slower)")
    faster = [o for o in options if not o.fits and o.step_time < best.step_time]
    if faster:
        quick = min(faster, key=lambda o: o.step_time)
        text += (f"; {name(quick)} would be faster ({quick.step_time * 1e3:.3f} ms) but needs "
                 f"{quick.peak_memory / 2**30:.2f} GiB per device")
    return text + _cp_reason(best, options)


def _cp_reason(best: MeshOption, options: list[MeshOption]) -> str:
    """Why the winner splits its sequences over cp > 1 ranks: what the ranked meshes of its (pp, tp)
    with less cp needed, or that they were slower (they fit by paying for memory, ``rank_meshes``), or that
    none took the batch (a larger dp needs more sequences)."""
    if best.mesh.cp == 1:
        return ""
    same = [o for o in options if (o.mesh.pp, o.mesh.tp) == (best.mesh.pp, best.mesh.tp) and o.mesh.cp < best.mesh.cp]
    less = [o for o in same if o.planned]
    if len(less) < len(same):   # a floor ruled them out: they cannot be faster, whatever they fit
        return f"; less cp at pp={best.mesh.pp}, tp={best.mesh.tp} cannot be faster (its step floor)"
    fitting = [o for o in less if o.fits]
    if fitting:
        rows = ", ".join(f"{mesh_name(o.mesh)} {o.step_time * 1e3:.3f} ms" for o in fitting)
        return f"; less cp at pp={best.mesh.pp}, tp={best.mesh.tp} fits only by recomputing, and is slower ({rows})"
    text = f"; cp {best.mesh.cp} is the least cp at pp={best.mesh.pp}, tp={best.mesh.tp} that "
    if not less:
        return text + "the batch allows (less cp needs a larger dp, and more sequences)"
    misses = ", ".join(f"{mesh_name(o.mesh)} needs {o.peak_memory / 2**30:.2f} GiB" if np.isfinite(o.peak_memory)
                       else f"{mesh_name(o.mesh)} has no plan ({o.reason})" for o in less)
    return text + f"fits ({misses})"
