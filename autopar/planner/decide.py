"""The order of decisions: the request, the mesh, the candidate kept on it, the Plan.

``decide`` is what ``autopar.plan`` and rank 0 of ``autopar.parallelize`` run: it checks the knobs
once (``planner.request.Request``), ranks the meshes for mesh="auto" (``planner.choices.auto_mesh``),
chooses on the mesh (``planner.choices.plan_mesh``: microbatches, offload, ZeRO; each candidate
priced by ``planner.price``) and builds the one Plan (``Candidate.plan``). ``rebuild`` is what the
other ranks run: the plan's strategies on their own capture, pricing nothing. Every figure comes
from ``cost_model``; the searches are the modules beside this one.
"""
from __future__ import annotations

import functools
import gc

from autopar.graph.capture import Captured, capture_pass, example_args
from autopar.graph.precision import retyped
from autopar.mesh import Mesh
from autopar.planner.choices import auto_mesh, plan_mesh
from autopar.planner.other_shapes import plan_at_shapes
from autopar.planner.request import Job, Request, check_knobs, local_inputs
from autopar.planner.sharding import enumerate_strategies, strategies_from_plan
from autopar.plans import Plan

__all__ = ["check_knobs", "decide", "rebuild", "rebuild_at_shapes"]


def _collector_paused(fn):
    """``fn`` run with Python's cyclic garbage collector off (as it was, after): planning makes
    millions of small objects that live to its end (prices, memo entries, strategies), and every
    full collection while it runs scans them and the captured graphs again, finding almost nothing
    to free: a sixth of the planning time of a 70B model. Reference counting still frees what it
    can; the collector's next pass after planning frees the cycles left."""
    @functools.wraps(fn)
    def paused(*args, **kwargs):
        was = gc.isenabled()
        gc.disable()
        try:
            return fn(*args, **kwargs)
        finally:
            if was:
                gc.enable()
    return paused


@_collector_paused
def decide(model, mesh, example_inputs, **knobs) -> tuple[Captured, dict, Plan]:
    """Capture and plan: the graph, the strategy per node and the Plan (no process group needed).

    ``knobs`` are ``autopar.plan``'s (``Request``): plan, sequence_parallel, recompute, memory_budget,
    schedule, microbatches, zero, device, gpus_per_node, stages, virtual_stages, world_size,
    precision, offload, offload_delay, keep_gathered, cp_attention.

    ``keep_gathered`` (zero=3): "auto", the planner keeps gathered from forward to backward the
    units it can afford within the memory budget (``autopar.planner.reshard``); or the unit names
    to keep, () resharding every unit after its forward (FSDP2's default).

    ``cp_attention`` (cp > 1): "allgather", "ring", or "auto", the one of lower exposed
    communication (``planner.price``).

    With pp > 1 and no ``microbatches``, every count the schedule can take is priced and the one
    with the lowest predicted step time is kept. ``mesh="auto"`` needs ``world_size``: every valid
    (dp, pp, tp) is ranked first (``autopar.planner.mesh_search``) and the best one planned."""
    example_inputs = example_args(model, example_inputs)   # a lone tensor or a list too; counted against forward
    job = Job(model, example_inputs, Request.of(mesh, **knobs))
    notes, microbatches = (), job.request.microbatches
    if isinstance(mesh, str) and mesh == "auto":
        mesh, microbatches, notes = auto_mesh(job)
    best = plan_mesh(job, Mesh.parse(mesh), microbatches)
    return best.cap, best.strategies, best.plan(notes)


def rebuild(model, plan: Plan, example_inputs, *, sequence_parallel="auto") -> tuple[Captured, dict]:
    """The capture and the strategy per node that a decided ``plan`` names, pricing nothing: what
    a rank needs to build its program from the plan rank 0 broadcast."""
    cap, options = _captured_options(model, plan, example_inputs, sequence_parallel)
    return cap, strategies_from_plan(cap, options, plan)


def rebuild_at_shapes(model, plan: Plan, example_inputs, *, sequence_parallel="auto") -> tuple[Captured, dict, Plan]:
    """``rebuild`` for a global batch of other shapes than the plan's: the capture, the plan's
    strategies carried to it and the plan at those shapes (``planner.other_shapes``)."""
    cap, options = _captured_options(model, plan, example_inputs, sequence_parallel)
    return (cap, *plan_at_shapes(cap, options, plan))


def _captured_options(model, plan: Plan, example_inputs, sequence_parallel):
    """The capture of one dp rank's microbatch of ``example_inputs``, at the plan's compute dtype
    (which the rewrite reads), and each op's strategies."""
    mesh = Mesh(*plan.mesh)
    example_inputs = example_args(model, example_inputs)
    cap = capture_pass(model, local_inputs(example_inputs, mesh, plan.microbatches), require_loss=True)
    cap = retyped(cap, plan.precision)
    return cap, enumerate_strategies(cap, mesh.tp, sequence_parallel)
