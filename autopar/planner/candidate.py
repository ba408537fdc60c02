"""A candidate plan: one set of choices with its prices, before it becomes a Plan.

The planner prices candidates (``planner.price``) and compares them (``planner.choices``: the
microbatch count, ZeRO, offload, the mesh ranking); only the one kept becomes a Plan
(``Candidate.plan``), built once with its notes and warnings, which price remedies that the
losing candidates need not. A Candidate is frozen: a choice loop adds its note to a copy.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from autopar.cost_model.devices import host_memory
from autopar.cost_model.memory import cut_memory, unit_memory
from autopar.cost_model.offload import host_need
from autopar.cost_model.stages import unit_costs
from autopar.cost_model.terms import MemoryPlan, StepTerms
from autopar.errors import PlanError
from autopar.graph.capture import Captured
from autopar.graph.precision import compute_dtype, working_copy_ratio
from autopar.graph.units import layer_units
from autopar.mesh import Mesh
from autopar.planner.recompute import regions_for
from autopar.planner.request import Request
from autopar.planner.sharding import Sharding
from autopar.planner.stage_dp import min_peak_memory
from autopar.plans import Plan, StagePlan, axis_warnings, edited_source, fit_warning, standing_notes


@dataclass(frozen=True)
class Choices:
    """What a candidate chose, as its Plan records it (``source``: "auto", "megatron" or the given plan's)."""

    mesh: Mesh
    microbatches: int
    zero: int
    offload: str
    schedule: str
    virtual_stages: int
    precision: str
    cp_attention: str
    sequence_parallel: bool
    source: str
    recompute: str = "none"
    recompute_regions: tuple[tuple[str, ...], ...] = ()
    keep_gathered: tuple[str, ...] = ()
    offload_kept: tuple[str, ...] = ()
    offload_delay: int = 0


@dataclass(frozen=True, eq=False)
class Candidate:
    """One candidate's choices, the strategies and records they lay out (``sharding``, ``stages``),
    its memory per stage (``cost_model.memory``) and its step's terms (``cost_model.step``); with
    what re-pricing it reads: its stage cut (``bounds`` over the layer units), its recompute
    regions (nodes) and ``dp_units``, what its dp sync was priced from (the busiest rank's
    parameter bytes, ZeRO-2/3's per-unit figures and their unit names)."""

    choices: Choices
    cap: Captured
    strategies: dict
    request: Request
    sharding: Sharding
    memory: tuple[MemoryPlan, ...]
    terms: StepTerms
    stages: tuple[StagePlan, ...] = ()
    bounds: tuple = ()
    regions: tuple = ()
    dp_units: tuple = (0.0, None, ())
    notes: tuple[str, ...] = ()

    @property
    def step_time(self) -> float:
        """Seconds per step: the terms' one sum."""
        return self.terms.total

    @property
    def peak_memory(self) -> float:
        """Bytes on the fullest rank."""
        return max(m.peak for m in self.memory)

    @property
    def offload_split(self) -> tuple[str, ...]:
        """The units keeping their optimizer on the device under offload (() without offload)."""
        return self.choices.offload_kept if self.choices.offload != "none" else ()

    def with_note(self, note: str) -> "Candidate":
        """This candidate with ``note`` added to its plan's notes."""
        return dataclasses.replace(self, notes=self.notes + (note,))

    def memory_with(self, *, regions=None, mesh: Mesh | None = None, bounds=None) -> tuple[MemoryPlan, ...]:
        """This candidate's memory (``cost_model.memory.cut_memory``) with other ``regions`` recomputed,
        on another ``mesh`` or with another stage cut ``bounds``."""
        c = self.choices
        return cut_memory(self.cap, self.strategies, mesh or c.mesh, bounds=self.bounds if bounds is None else bounds,
                          microbatches=c.microbatches, virtual=c.virtual_stages, schedule=c.schedule, zero=c.zero,
                          regions=self.regions if regions is None else regions, offload=c.offload != "none",
                          kept=c.keep_gathered, attention=c.cp_attention, offload_kept=self.offload_split)

    def plan(self, notes: tuple[str, ...] = ()) -> Plan:
        """The Plan, built once: the choices and figures, the given plan's notes and model, ``notes``,
        the warnings."""
        c, s, t, dev = self.choices, self.sharding, self.terms, self.request.device
        plan = Plan(mesh=(c.mesh.dp, c.mesh.pp, c.mesh.tp), dp_replicate=c.mesh.dp_replicate, cp=c.mesh.cp,
                    cp_attention=c.cp_attention, input_shapes=s.input_shapes, sequence_parallel=c.sequence_parallel,
                    zero=c.zero, microbatches=c.microbatches, device=dev.name, parameters=s.parameters,
                    nodes=s.nodes, collectives=s.collectives, predicted_compute_s=t.compute_s,
                    predicted_comm_s=t.comm_s, predicted_update_s=t.update_s, solve_seconds=s.solve_seconds,
                    model_flops=s.model_flops, peak_flops=dev.flops(compute_dtype(c.precision)), schedule=c.schedule,
                    virtual_stages=c.virtual_stages, stages=self.stages, recompute=c.recompute,
                    recompute_regions=c.recompute_regions, keep_gathered=c.keep_gathered, offload=c.offload,
                    offload_kept=c.offload_kept, offload_delay=c.offload_delay,
                    memory=self.memory, precision=c.precision, source=c.source, step_terms=t)
        own, given = self.notes, self.request.given
        if given is not None:   # its notes less those an edit made untrue, with those derived for it now
            source = given.source if given.derives_as(plan) else edited_source(given.source)
            plan = dataclasses.replace(plan, source=source, model=given.model)
            own = standing_notes(given.notes, plan, own)
        plan = dataclasses.replace(plan, notes=own + tuple(notes))
        return dataclasses.replace(plan, warnings=self._warnings(plan))

    def _warnings(self, plan: Plan) -> tuple[str, ...]:
        """The plan's warnings: a mesh axis doing no work, a peak that the device (or memory_budget)
        cannot hold, with the remedies priced on this candidate (``fit_warning``)."""
        req = self.request
        where = "the memory budget" if req.memory_budget is not None else f"one {req.device.name}"
        fit = fit_warning(plan, req.limit, where, self._full_recompute_peak, self._deeper_pipeline)
        host = self._host_warning()
        return tuple(axis_warnings(plan)) + ((fit,) if fit else ()) + ((host,) if host else ())

    def _host_warning(self) -> str | None:
        """A sentence when the host cannot hold the offloaded optimizer of the busiest rank
        (``cost_model.offload.host_need`` against ``cost_model.devices.host_memory``), None when it can."""
        c, req = self.choices, self.request
        if c.offload == "none":
            return None
        need, have = host_need(self.memory, c.mesh.pp), host_memory(req.device, req.gpus_per_node)
        if need <= have:
            return None
        gib = 2**30
        source = (f"the {req.device.name} profile's host_memory_bytes" if req.device.host_memory_bytes
                  else f"this machine's memory over {req.gpus_per_node} devices")
        return (f"the host cannot hold this plan's offloaded optimizer: a rank needs {need / gib:.2f} GiB of host "
                f"memory (the fp32 master and optimizer state of its offloaded units and the gradients' staging "
                f"buffers) but has {have / gib:.2f} GiB ({source}); keep more units on the device (offload= a "
                "smaller fraction, or 'auto', which fits the host), use more devices, or give device= a profile "
                "with the host's memory (host_memory_bytes)")

    def _full_recompute_peak(self) -> float | None:
        """The peak with every block recomputed, on this candidate's cut; None without blocks."""
        try:
            regions = regions_for(self.cap, "full")
        except PlanError:   # no repeated blocks to recompute
            return None
        return max(m.peak for m in self.memory_with(regions=regions))

    def _deeper_pipeline(self):
        """((dp, pp, tp), peak) of the least pp, doubling this one (dp and tp kept, one sequence per
        microbatch), whose cut of least memory (``min_peak_memory`` of the stage DP's figures) fits
        by the memory model: the check the planner makes at that pp, on this capture's unit costs."""
        try:
            units = layer_units(self.cap)
        except PlanError:   # no blocks to cut between
            return None
        c = self.choices
        size = self.sharding.input_shapes[0][0]   # the captured microbatch; unit costs scale with it
        local = size * c.microbatches
        mesh = dataclasses.replace(c.mesh, pp=2 * c.mesh.pp)
        # a unit's figures do not depend on pp (only the cut and the microbatches in flight do): price them once
        time, boundary, _ = unit_costs(self.cap, self.strategies, units, mesh, self.request.device,
                                       gpus_per_node=self.request.gpus_per_node)
        static, act = unit_memory(self.cap, self.strategies, units, mesh, zero=c.zero,
                                  working_copy=working_copy_ratio(self.cap), regions=self.regions,
                                  offload=c.offload != "none", attention=c.cp_attention,
                                  offload_kept=self.offload_split)
        while mesh.pp * c.virtual_stages <= len(units) and mesh.pp <= local:
            if local % mesh.pp == 0:
                _, bounds = min_peak_memory(time / size, static, act / size, boundary / size, p=mesh.pp, m=local,
                                            v=c.virtual_stages, schedule=c.schedule)
                # one sequence per microbatch: each of the ``local`` microbatches 1/size of the captured one
                peaks = cut_memory(self.cap, self.strategies, mesh, bounds=bounds, microbatches=local,
                                   virtual=c.virtual_stages, schedule=c.schedule, zero=c.zero, regions=self.regions,
                                   offload=c.offload != "none", attention=c.cp_attention, tokens=1 / size,
                                   offload_kept=self.offload_split)
                peak = max(m.peak for m in peaks)
                if peak <= self.request.limit:
                    return (mesh.dp, mesh.pp, mesh.tp), peak
            mesh = dataclasses.replace(mesh, pp=2 * mesh.pp)
        return None
