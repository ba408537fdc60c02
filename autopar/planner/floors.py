"""Floors of a mesh ranking's rows: the least step time that any plan of a layout (mesh, microbatch
count, pipeline schedule and virtual stages) fitting the memory can have, and the least peak bytes
any plan of it has, whatever the ZeRO stage, offload, recompute, tensor-parallel strategies and
stage cut its planning chooses, read off the capture without planning the layout.
``planner.mesh_search`` skips a schedule variant, or a count of fewer microbatches, whose step
floor is no faster than the fastest fitting plan ranked: it cannot be faster and fit.

A plan's step is the sum of its terms (``cost_model.terms.StepTerms``), none negative, so a sum of
floors of some of them is a floor of it; the others (pp's point-to-point beyond the cuts counted,
what prefetch leaves exposed of ZeRO's gathers) count 0. Below, ``s`` is the layout's sequences per
microbatch, k = s / s0 with s0 those of the capture read, m its microbatches, p, v, c and tp its
pipeline ranks, virtual stages per rank, cp and tp; P = N / (tp p) with N the bytes of the
parameters the ops use: each parameter's local shard holds at least 1/tp of it, and the pipeline
rank holding the most parameters (whose dp sync, update and cp gradient sync a plan prices) at
least 1/p of them.

Captures. At k = 1 the floors read the capture of s0 sequences, at k = 2 that of 2 s0, each op
with its own strategies (``enumerate_strategies``, among which the plan's ILP chooses). At k > 2
they read the capture of 2 s0, each op matched to the one of s0 (per module, the longest runs of
the same op kinds in order: torch.export specialises a dim of size 1, so the capture of one
sequence may have ops the other has not), on two premises: a capture of k s0 sequences runs the
ops of the capture of 2 s0, and each of their dims is that capture's or grows in proportion to the
batch. An op whose shapes are the same in both captures then does not grow, and has the same
strategies at k; any other op's FLOPs and bytes, sums of products of its dims, are convex in k,
so at least the line through its figures at 1 and 2 (``_beyond``; its figure at 2 where it has no
match), and a strategy divides them by at most tp (the tp axis never splits a batch dim, so no
strategy appears that k = 2 lacks). Its seconds are then at least ``time_floor``: its bytes at the
op bandwidth, its FLOPs at the fastest rate the profile's curve reaches at those FLOPs or beyond.

- Compute and tp: per op the least seconds under its strategies (``strategy_time`` without the
  collectives inside it) and ``OP_OVERHEAD``, summed, is a floor of a microbatch's compute; with
  tp > 1, so is the strategy ILP's optimum with every op priced with its collectives and every
  move between ops at its collectives' seconds without their launch overhead
  (``sharding.least_step_seconds``: the ILP's objective is a plan's compute and tp terms per
  microbatch plus one ``LAUNCH_OVERHEAD`` per collective between ops). Without stages the compute
  and tp terms are at least m times the larger. With stages, w_u = the least seconds of unit u's
  ops, W the larger of their sum and the ILP's optimum, cuts the S - 1 least of the seconds of the
  values crossing each place a cut may go (their bytes over tp, both ways, ``stages.unit_costs``),
  of S = p v stages; ``stages.pipeline_time``'s makespan (compute, tp, pp and bubble) is at least
      v = 1:  W + cuts + (m - 1) MM_S
      v > 1:  m max((W + cuts) / p, G_p) + (p - 1) MM_S
  with MM_S the least slowest stage of any contiguous cut of the w_u into S stages and
  G_p = max_q (the sum of the ceil(q / p) least of the q largest w_u): of any q units some rank
  holds ceil(q / p). Each divides by c (``step.price_step``).
- Recompute, at k <= 2, per ZeRO stage and offload: a plan that fits has, on every rank, its
  stages' unit figures sum_u (w_u + f_s a_u) under the budget B (``cost_model.memory``'s bound of
  the peak, which the stage DP's refusals rest on too), f_s the microbatches its stage s holds in
  flight (``stages.inflight_microbatches``). Summed over the p ranks: the parameter state, at
  least p times P's (``state_bytes``), plus sum_s f_s A_s(none) less what recompute frees,
  sum_s f_s R_s, is at most p B. A unit keeps at least a 1/(tp c) share of what it keeps at tp = 1
  without recompute (``unit_memory``), so sum_s f_s A_s(none) is at least the least over cuts of
  that weighted sum (``least_weighted``); a block's mode frees at most its tp = 1 figures' difference
  (its kept bytes at the mode over tp, and cp's kept keys and values), each microbatch it holds,
  for its recomputed forward's seconds (``step.recompute_seconds`` of its ops' least seconds): at
  least rho seconds per byte, the least over blocks and modes. So the recomputed forwards take at
  least rho X / max f_s seconds per microbatch, X = p P-state + least sum - p B, which the
  pipeline's ranks share: the compute term is at least m (W + rho X / max f_s) / p, or without
  stages m (W + rho X). Each unit keeps at least a 1/(tp c) share of the least it keeps at tp = 1
  under any mode, so where p P-state plus the least weighted sum of those is above p B, no plan at
  that ZeRO stage and offload fits, recompute what it may: the floor is the least over the others
  (over all of them where none may fit, so that the layout is planned and its plan says by how much).
- dp, update, cp's gradient sync, per ZeRO stage z and offload o the layout may be planned at
  (``choose_zero``, ``choose_offload``): ``step.dp_sync_time`` of P bytes at z < 2 (one sync per
  step, linear in the bytes), ``step.zero_sync_floor`` at z >= 2; ``step.update_terms`` of P bytes;
  with c > 1 the all-reduce over cp of P bytes (P / dp_shard under ZeRO) and the loss's token
  count, once per microbatch (``context.cp_collectives``). The least over (z, o) of these and the
  recompute floor.
- cp's attention traffic, with c > 1: each attention's least exposed seconds per microbatch
  (``context.attention_floor``), m times, for the attentions of the layout: all of them without
  stages; with stages those of the rank holding the most parameters, at least
  ceil((P - N_o) / N_a) of the units with attention, N_o the whole bytes of the units without
  attention and N_a the most a unit with attention reads.

Peak floor: the least over (z, o) of P times the weights, optimizer state and, with several
microbatches or a 16-bit gradient buffer, gradients per parameter byte (``state.state_bytes``):
the fullest pipeline rank holds at least that. Both floors are lowered by a relative 1e-9 (the
ILP's optimum by 1e-6, the solver's tolerance), so that rounding in a plan's sums cannot cross them.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from difflib import SequenceMatcher

import numpy as np
import torch

from autopar.cost_model.comm import axis_is_inter_node, axis_links, collective_time, summed_bytes
from autopar.cost_model.compute import attention_kind, curve_rate, node_flops
from autopar.cost_model.context import attention_floor, context_memory
from autopar.cost_model.memory import unit_memory
from autopar.cost_model.repeats import block_shift, twin
from autopar.cost_model.state import state_bytes, state_shards
from autopar.cost_model.stages import inflight_microbatches
from autopar.cost_model.step import BACKWARD_SHARE, dp_sync_time, update_terms, zero_sync_floor
from autopar.cost_model.strategy import (OP_OVERHEAD, comm_bytes, edge_collectives, op_traffic, strategy_time,
                                         tensor_bytes)
from autopar.graph.reshard import ReshardError
from autopar.graph.precision import retyped, working_copy_ratio
from autopar.graph.rules import is_float, shape
from autopar.graph.units import layer_units
from autopar.graph.views import VIEW_OPS
from autopar.mesh import Mesh
from autopar.planner.recompute import MODES, regions_for
from autopar.planner.sharding import enumerate_strategies, least_step_seconds
from autopar.plans import zero_on_mesh

_SLACK = 1 - 1e-9


@dataclass(frozen=True)
class Floor:
    """A layout's floors: of its plan's step seconds and of its peak bytes per device."""

    step: float
    peak: float


class _Capture:
    """One capture as the floors read it: at the compute dtype with its blocks' twins laid out, its
    ops, its layer units and which unit each op is in."""

    def __init__(self, job, sequences: int):
        req = job.request
        self.cap = retyped(job.capture(tuple(x[:sequences] for x in job.example_inputs)), req.precision)
        block_shift(self.cap)   # the twins its ops are priced as, as a plan prices them
        self.calls = [n for n in self.cap.gm.graph.nodes if n.op == "call_function"]
        try:
            self.units = layer_units(self.cap)
        except ValueError:   # a PlanError: no repeated blocks, so no pipeline stages are ranked
            self.units = []
        self.unit_of = {n: u for u, unit in enumerate(self.units) for n in unit.nodes}


class RowFloors:
    """``floor(mesh, microbatches, schedule, virtual)``: the ``Floor`` of a layout of ``job`` (module
    docstring), from its captures of ``sequences`` and, once a layout of more sequences per
    microbatch is asked, of twice as many. What each tp and microbatch size share is computed once."""

    def __init__(self, job, sequences: int):
        self.job, self.req, self.s0 = job, job.request, sequences
        self.batch = job.example_inputs[0].shape[0]
        self.one = _Capture(job, sequences)
        self._two = None   # the capture of 2 s0 sequences and its ops' matches in this one (``_second``)
        cap = self.one.cap
        self.wc = working_copy_ratio(cap)
        used = [p for p in cap.params.values() if p.users]
        self.param_bytes = float(sum(math.prod(p.meta["val"].shape) * p.meta["val"].element_size() for p in used))
        self._memo: dict = {}

    def __call__(self, mesh: Mesh, microbatches: int, schedule: str, virtual: int) -> Floor:
        steps, peak = self._steps(mesh, microbatches, schedule, virtual)
        fitting = [step for step, fits in steps.values() if fits]
        # where none can fit, the least over all of them: the layout is planned, and its plan says by how much
        best = min(fitting) if fitting else min(step for step, _ in steps.values())
        return Floor(best * _SLACK, peak * _SLACK)

    def zero_steps(self, mesh: Mesh, microbatches: int, schedule: str, virtual: int) -> dict[int, float]:
        """Per ZeRO stage the layout may be planned at without offload, the floor of the step of its
        plans that fit (inf where none can), for ``choices.choose_zero`` to skip the stages that
        cannot be the fastest."""
        steps, _ = self._steps(mesh, microbatches, schedule, virtual)
        return {z: step * _SLACK if fits else math.inf for (z, o), (step, fits) in steps.items() if o == "none"}

    def _steps(self, mesh: Mesh, microbatches: int, schedule: str, virtual: int) -> tuple[dict, float]:
        """({(zero, offload): (step floor, whether a plan at them may fit)}, the peak floor) of a layout
        (module docstring), before the slack; once per layout (the ranking and its ZeRO choice ask)."""
        return self._kept(("steps", mesh, microbatches, schedule, virtual),
                          lambda: self._layout_steps(mesh, microbatches, schedule, virtual))

    def _layout_steps(self, mesh: Mesh, microbatches: int, schedule: str, virtual: int) -> tuple[dict, float]:
        m, p = microbatches, mesh.pp
        k = self.batch // (mesh.dp * m) // self.s0
        flat, units, cuts = self._times(mesh, k)
        ops = max(flat, self._with_tp(mesh.tp, k))   # a microbatch's ops and tp collectives, at least
        if p == 1:
            compute, work, flight = m * ops, ops, (1,)
        else:
            stages = p * virtual
            work = max(ops, float(units.sum())) + self._kept(("cuts", id(cuts), stages),
                                                             lambda: float(np.sort(cuts)[:stages - 1].sum()))
            slowest = self._kept(("slowest", mesh.tp, k, stages), lambda: least_slowest(units, stages))
            if virtual == 1:
                compute = work + (m - 1) * slowest
            else:
                busiest = self._kept(("busiest", mesh.tp, k, p), lambda: busiest_rank(units, p))
                compute = m * max(work / p, busiest) + (p - 1) * slowest
            flight = inflight_microbatches(p, m, virtual, schedule)
        keys, fixed, per_microbatch, peak, state = self._kept(("sync", mesh), lambda: self._sync(mesh))
        kept, rho, recomputed = self._recompute(mesh, k, flight)
        attention = m * self._attention_floor(mesh, k)
        out = {}
        for key, f, g, held in zip(keys, fixed, per_microbatch, state[m > 1]):
            # the recomputed forwards every fitting plan runs at least (module docstring)
            again = rho * max(0.0, held * p + kept - p * self.req.limit) / max(flight)
            total = max(compute, m * (work + again) / p) if p > 1 else compute + m * again
            # no plan fits where the state and the least any recompute keeps do not (module docstring)
            out[key] = (total / mesh.cp + f + m * g + attention, held * p + recomputed <= p * self.req.limit)
        return out, peak[m > 1]

    def _recompute(self, mesh: Mesh, k: int, flight: tuple) -> tuple[float, float, float]:
        """(the least sum over stages of the microbatches in ``flight`` times what their units keep without
        recompute, over every stage cut; the least recompute seconds per byte it frees; the same least
        sum with each unit at the least it keeps under any mode), at the mesh's tp and cp and k (module
        docstring); (0, 0, 0) where not known (k > 2, no repeated blocks)."""
        if k > 2 or not self.one.units:
            return 0.0, 0.0, 0.0
        on = self.one if k == 1 else self._second()[0]
        tp, cp = mesh.tp, mesh.cp

        def figures():
            """Per unit at tp = 1: kept bytes without recompute, and per mode its kept bytes and seconds."""
            strategies = {n: o[0] for n, o in enumerate_strategies(on.cap, 1, self.req.sequence_parallel).items()}
            kept = {mode: unit_memory(on.cap, strategies, on.units, Mesh(1, 1, 1), zero=0, working_copy=self.wc,
                                      regions=regions_for(on.cap, mode))[1] for mode in MODES}
            extra = np.array([x for x, _ in context_memory(on.cap, strategies, cp, 1, "allgather",
                                                           [u.nodes for u in on.units])]) if cp > 1 else 0.0
            return strategies, kept, extra
        strategies, kept, extra = self._kept(("recompute figures", id(on), cp), figures)
        exact = self._exact(on.cap, tp)

        def rho():
            best = math.inf
            for mode in MODES[1:]:
                seconds = np.zeros(len(on.units))
                for region in regions_for(on.cap, mode):
                    calls = [n for n in region if n.op == "call_function"]
                    seconds[on.unit_of[calls[0]]] += (1 - BACKWARD_SHARE) * (sum(exact[n] for n in calls)
                                                                            + OP_OVERHEAD * len(calls))
                freed = (kept["none"] - kept[mode] / tp) / cp + extra
                for t, b in zip(seconds, freed):
                    if t > 0 and b > 0:
                        best = min(best, t / b)
            return best if math.isfinite(best) else 0.0
        ratio = self._kept(("rho", id(on), tp, cp), rho)
        least = self._kept(("flight", id(on), tp, cp, flight),
                           lambda: least_weighted(kept["none"] / (tp * cp), flight))
        recomputed = self._kept(("flight recomputed", id(on), tp, cp, flight),
                                lambda: least_weighted(np.minimum.reduce([kept[mode] for mode in MODES]) / (tp * cp),
                                                       flight))
        return least, ratio, recomputed

    def _sync(self, mesh: Mesh):
        """The (ZeRO stage, offload) pairs the row may be planned at; per pair, the floors of its dp sync,
        update and cp gradient sync: their seconds per step and per microbatch; the least peak floor
        with one microbatch and with several; and per pair its parameter state floor per pipeline
        rank, with one microbatch and with several (module docstring)."""
        req, gpn = self.req, self.req.gpus_per_node
        shard = self.param_bytes / (mesh.tp * mesh.pp)
        zeros = (0, 1, 2, 3) if req.zero == "auto" and mesh.dp_shard > 1 else \
            (0,) if req.zero == "auto" else (zero_on_mesh(req.zero, mesh)[0],)
        offloads = ("none", "optimizer") if req.offload == "auto" else (req.offload,)
        keys, fixed, per_microbatch, one, several = [], [], [], [], []
        for z in zeros:
            dp, each = 0.0, 0.0
            if z >= 2:   # per microbatch: the floor at one, times m (``zero_sync_floor``)
                each = zero_sync_floor(shard, mesh, req.device, z, gpn, microbatches=1, gathered=self.wc or 1.0) or 0.0
            else:
                dp = dp_sync_time(shard, mesh, req.device, z, gpn)
            if mesh.cp > 1:
                inter = axis_links(mesh.cp, mesh.tp, gpn)
                dp += collective_time("all_reduce", shard / (mesh.dp_shard if z else 1), mesh.cp, req.device, inter)
                if self.one.cap.loss is not None:
                    each += collective_time("all_reduce", 8, mesh.cp, req.device, inter)
            for o in offloads:
                offload = o != "none"
                keys.append((z, o))
                # the device's part alone: a partial offload's host may hide behind the kept units'
                # AdamW or the next step (``cost_model.offload.update_split``), so its exposure floors at 0
                fixed.append(dp + update_terms(shard, mesh, req.device, z, self.wc > 0, offload=offload)[0])
                per_microbatch.append(each)
                per = state_bytes(z, state_shards(mesh, z, self.wc, offload), self.wc, offload)
                one.append(shard * (per.weights + per.optimizer + (per.grads if per.buffered else 0.0)))
                several.append(shard * (per.weights + per.optimizer + per.grads))
        return keys, fixed, per_microbatch, (min(one), min(several)), (one, several)

    def _kept(self, key, compute):
        if key not in self._memo:
            self._memo[key] = compute()
        return self._memo[key]

    def _second(self) -> tuple[_Capture, dict]:
        """The capture of 2 s0 sequences, and its ops' matches in the capture of s0: per module, the
        longest runs of the same op kinds in order (a capture of one sequence may have ops the other
        has not: torch.export specialises a dim of size 1)."""
        if self._two is None:
            two = _Capture(self.job, 2 * self.s0)
            mine: dict = {}
            for n in self.one.calls:
                mine.setdefault(n.meta.get("module_path", ""), []).append(n)
            theirs: dict = {}
            for n in two.calls:
                theirs.setdefault(n.meta.get("module_path", ""), []).append(n)
            match = {}
            for path, ops in theirs.items():
                old = mine.get(path, [])
                runs = SequenceMatcher(None, [str(n.target) for n in old], [str(n.target) for n in ops], autojunk=False)
                for run in runs.get_matching_blocks():
                    match.update(zip(ops[run.b:run.b + run.size], old[run.a:run.a + run.size]))
            self._two = (two, match)
        return self._two

    def _exact(self, cap, tp: int) -> dict:
        """Each op's least seconds under its own strategies on ``cap`` (``enumerate_strategies``); twins
        with the same options are priced once."""
        def compute():
            options = enumerate_strategies(cap, tp, self.req.sequence_parallel)
            dev, inter = self.req.device, axis_is_inter_node(tp, 1, self.req.gpus_per_node)
            seen, out = {}, {}
            for n in (x for x in cap.gm.graph.nodes if x.op == "call_function"):
                key = (twin(n), id(options[n]))
                if key not in seen:
                    seen[key] = min(strategy_time(n, s, tp, dev, inter, False) for s in options[n])
                out[n] = seen[key]
            return out
        return self._kept(("exact", id(cap), tp), compute)

    def _op_times(self, tp: int, k: int) -> tuple[_Capture, dict]:
        """The capture the floors at k read (of s0 sequences at k = 1, else of 2 s0) and per op its
        floor at k without tp's collectives (module docstring)."""
        if k == 1:
            return self.one, self._exact(self.one.cap, tp)
        two, match = self._second()
        exact = self._exact(two.cap, tp)
        if k == 2:
            return two, exact

        def compute():
            out, seen = {}, {}
            for n in two.calls:
                old = match.get(n)
                key = (twin(n), old is not None and twin(old), self._static(n, old))
                if key not in seen:
                    if key[2] or n.target in VIEW_OPS:   # what it reads and makes does not grow with the batch
                        seen[key] = exact[n]
                    else:
                        a = key[0]
                        flops, nbytes = sum(node_flops(a)), op_traffic(a)
                        if old is not None:
                            b = key[1]
                            flops, nbytes = _beyond(sum(node_flops(b)), flops, k), _beyond(op_traffic(b), nbytes, k)
                        seen[key] = time_floor(flops / tp, nbytes / tp, self.req.device,
                                               getattr(a.meta["val"], "dtype", torch.float32), attention_kind(a))
                out[n] = seen[key]
            return out
        return two, self._kept(("op times", tp, k), compute)

    def _static(self, node, old) -> bool:
        """Whether an op of the capture of 2 s0 reads and makes the shapes its match in the capture of
        s0 does (None: it has none), so that it does not grow with the batch."""
        return self._kept(("static", node), lambda: old is not None and _shapes(node) == _shapes(old))

    def _with_tp(self, tp: int, k: int) -> float:
        """One microbatch's ops with tp's collectives between them, at least, at tp and k: the strategy
        ILP's optimum (``sharding.least_step_seconds``) with every price a floor of its price at k
        (module docstring); 0 where the solver proves no optimum."""
        if tp == 1:
            return 0.0

        def compute():
            dev, inter = self.req.device, axis_is_inter_node(tp, 1, self.req.gpus_per_node)
            on, match = (self.one, {}) if k == 1 else self._second()
            options = enumerate_strategies(on.cap, tp, self.req.sequence_parallel)
            if k <= 2:
                def op(n, strategy):
                    return strategy_time(n, strategy, tp, dev, inter)

                def grown(n, figure):
                    return figure(n)
            else:
                def grown(n, figure):   # a floor at k of what ``figure`` reads off a node of the capture of 2 s0
                    old = match.get(n)
                    return figure(n) if old is None else _beyond(figure(old), figure(n), k)

                def op(n, strategy):
                    old = match.get(n)
                    if n.op != "call_function" or n.target in VIEW_OPS:
                        return 0.0
                    if self._static(n, old):   # it does not grow with the batch
                        return strategy_time(n, strategy, tp, dev, inter)
                    a = twin(n)
                    flops = grown(a, lambda x: sum(node_flops(twin(x))))
                    nbytes = grown(a, lambda x: op_traffic(twin(x)))
                    rows = grown(n, lambda x: shape(x.args[0])[0]) if strategy.comm else 0
                    val = a.meta["val"]
                    seconds = time_floor(flops / strategy.divisor, nbytes / strategy.divisor, dev,
                                         getattr(val, "dtype", torch.float32), attention_kind(a))
                    return seconds + sum(collective_time(kind, comm_bytes(kind, rows, tp), tp, dev, inter)
                                         for kind, _ in strategy.comm)

            def move(moved, consumer, slot, form, fl):
                try:
                    kinds = edge_collectives(consumer.target, slot, *form, fl)
                except ReshardError:
                    return math.inf
                nbytes = grown(moved, tensor_bytes)
                dtype = getattr(moved.meta.get("val"), "dtype", None)
                return sum(collective_time(kind, summed_bytes(kind, nbytes, dtype), tp, dev, inter) for _, kind in kinds)
            least = least_step_seconds(on.cap, options, op, move)
            return 0.0 if least is None else least * (1 - 1e-6)   # within the solver's tolerances
        return self._kept(("with tp", tp, k), compute)

    def _times(self, mesh: Mesh, k: int):
        """(every op's floor summed, per unit the same, per cut position the pipeline's seconds) at tp and k."""
        tp = mesh.tp
        pp_inter = axis_is_inter_node(mesh.pp, tp, self.req.gpus_per_node)

        def compute():
            on, times = self._op_times(tp, k)
            units = np.zeros(len(on.units))
            for n, t in times.items():
                if n in on.unit_of:
                    units[on.unit_of[n]] += t + OP_OVERHEAD
            flat = math.fsum(times.values()) + OP_OVERHEAD * len(on.calls)
            return flat, units, self._cuts(on, tp, k, pp_inter)
        return self._kept(("times", tp, k, pp_inter), compute)

    def _cuts(self, on: _Capture, tp: int, k: int, pp_inter: bool) -> np.ndarray:
        """Per place a cut may go (after each unit but the last), the least point-to-point seconds of the
        values crossing it (``stages.unit_costs``' with every value sharded over tp)."""
        match = self._second()[1] if k > 2 else {}
        sent = np.zeros(len(on.units) + 1)
        for a, u in on.unit_of.items():
            last = max((on.unit_of[x] for x in a.users if x in on.unit_of), default=u)
            if last > u and is_float(a):
                nbytes = tensor_bytes(a)
                if a in match:
                    nbytes = _beyond(tensor_bytes(match[a]), nbytes, k)
                sent[u] += nbytes / tp
                sent[last] -= nbytes / tp
        bw = self.req.device.inter_node_bw if pp_inter else self.req.device.intra_node_bw
        return 2 * np.cumsum(sent)[:max(len(on.units) - 1, 0)] / bw

    def _attention_floor(self, mesh: Mesh, k: int) -> float:
        """cp's attention traffic per microbatch, at least (module docstring); 0 without cp."""
        if mesh.cp == 1:
            return 0.0
        on = self.one if k == 1 else self._second()[0]

        def per_unit():
            """The units' attention floors, least first, and the bytes the count of them is read from."""
            each = attention_floor(on.cap, mesh.cp, mesh.tp, self.req.device, self.req.gpus_per_node,
                                   self.req.cp_attention)
            has = [any(n in each for n in u.nodes) for u in on.units]
            whole = [_unit_param_bytes(u) for u in on.units]
            others = sum(b for b, h in zip(whole, has) if not h)
            most = max((b for b, h in zip(whole, has) if h), default=0.0)
            units = sorted(math.fsum(each[n] for n in u.nodes if n in each) for u, h in zip(on.units, has) if h)
            return math.fsum(each.values()), units, others, most
        total, units, others, most = self._kept(("attention", id(on), mesh.cp, mesh.tp), per_unit)
        if mesh.pp == 1 or not units:
            return total
        shard = self.param_bytes / (mesh.tp * mesh.pp)
        return math.fsum(units[:max(0, math.ceil((shard - others) / most * _SLACK))])


def time_floor(flops: float, nbytes: float, dev, dtype, causal) -> float:
    """At most ``compute_time`` of an op of at least ``flops`` FLOPs and ``nbytes`` bytes: its bytes at
    the op bandwidth, its FLOPs at the fastest rate its curve reaches at ``flops`` or above, the launch
    overhead."""
    terms = [nbytes / dev.op_bandwidth, dev.launch_overhead]
    if flops > 0:
        curve = dev.attention_curve(dtype, causal) if causal is not None else None
        curve = curve or dev.matmul_curve(dtype)
        if curve is None:
            rate = dev.flops(dtype) * dev.matmul_efficiency
        else:
            rate = max([curve_rate(flops, curve)] + [y for x, y in zip(*curve) if x >= flops])
        terms.append(flops / rate)
    return max(terms)


def _shapes(node) -> tuple:
    """The shapes a node reads and makes."""
    def of(n):
        val = n.meta.get("val")
        return tuple(val.shape) if hasattr(val, "shape") else None
    return of(node), tuple(map(of, node.all_input_nodes))


def _beyond(at_one: float, at_two: float, k: int) -> float:
    """A floor at k >= 2 of a figure that is at_one at k = 1 and at_two at k = 2 and convex in k (a sum
    of products of dims that grow in proportion to the batch or not at all): the line through both."""
    return at_two + (at_two - at_one) * (k - 2)


def _unit_param_bytes(unit) -> float:
    """Bytes of every parameter a unit's ops read, whole (at most what a plan counts for the unit)."""
    params = {a for n in unit.nodes for a in n.all_input_nodes
              if a.op == "placeholder" and a.meta.get("kind") == "param"}
    return float(sum(math.prod(p.meta["val"].shape) * p.meta["val"].element_size() for p in params))


def least_slowest(times: np.ndarray, stages: int) -> float:
    """The least slowest stage of any cut of ``times`` (in order) into ``stages`` contiguous non-empty
    stages, at most (the lower end of a bisection on the greedy cut's feasibility, which is exact)."""
    if stages >= len(times):
        return float(times.max(initial=0.0))
    lo, hi = float(times.max()), float(times.sum())
    for _ in range(64):
        mid = (lo + hi) / 2
        if mid <= lo or mid >= hi:
            break
        parts, acc = 1, 0.0
        for t in times:
            acc += t
            if acc > mid:
                parts, acc = parts + 1, t
        if parts <= stages:
            hi = mid
        else:
            lo = mid
    return lo


def least_weighted(sizes: np.ndarray, weights: tuple) -> float:
    """The least sum over stages of ``weights[s]`` times the ``sizes`` stage s holds, over every cut of
    ``sizes`` (in order) into len(weights) contiguous non-empty stages (a DP over the cut's ends)."""
    n, stages = len(sizes), len(weights)
    if stages > n:
        return 0.0
    prefix = np.concatenate(([0.0], np.cumsum(sizes)))
    best = weights[0] * prefix   # best[e]: stages 0..s end at unit e
    best[0] = math.inf
    for s in range(1, stages):
        w = weights[s]
        start = np.minimum.accumulate(best - w * prefix)   # min over b <= e of best[b] - w P[b]
        nxt = np.full(n + 1, math.inf)
        nxt[1:] = start[:-1] + w * prefix[1:]
        nxt[:s + 1] = math.inf
        best = nxt
    return float(best[n])


def busiest_rank(times: np.ndarray, ranks: int) -> float:
    """A floor of the busiest of ``ranks`` ranks' total, however the units (``times``) are shared out:
    of the q largest, some rank holds ceil(q / ranks), at least their ceil(q / ranks) least."""
    desc = np.sort(times)[::-1]
    csum = np.concatenate(([0.0], np.cumsum(desc)))
    best = 0.0
    for q in range(1, len(desc) + 1):
        c = -(-q // ranks)
        best = max(best, float(csum[q] - csum[q - c]))
    return best
