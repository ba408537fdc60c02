"""Pipeline stage cuts: the cost model's, or a user's ``stages=`` override checked unit by unit.

The cost model prices each layer unit per microbatch under the chosen tensor-parallel strategies
(``cost_model.stages.unit_costs``); ``autopar.planner.stage_dp`` cuts them into stages.
"""
from __future__ import annotations

from autopar.graph.capture import Captured
from autopar.graph.units import Unit, layer_units, override_bounds, stage_of_nodes
from autopar.planner.sharding import enumerate_strategies, strategies_from_plan
from autopar.planner.stage_dp import cut_stages, evaluate_cut


def choose_cut(costs, units: list[Unit], mesh, *, schedule: str, microbatches: int, virtual: int,
               memory_budget: float | None, stages=None):
    """The stage cut: the cost model's, or a user's ``stages`` override validated unit by unit."""
    time, static, act, boundary = costs
    kw = dict(p=mesh.pp, m=microbatches, v=virtual, schedule=schedule)
    if stages is None:
        return cut_stages(time, static, act, boundary, memory_budget=memory_budget, **kw)
    return evaluate_cut(override_bounds(stages, units, mesh.pp * virtual), time, static, act, boundary, **kw)


def plan_layout(cap: Captured, plan) -> tuple[dict, list[Unit], dict[str, int]]:
    """A plan's decisions laid on a capture of its model, for pricing it there
    (``cost_model.symbolic``): the strategy per node and, with pipeline stages, the layer units
    and each node's stage (empty without)."""
    strategies = strategies_from_plan(cap, enumerate_strategies(cap, plan.mesh[2], "auto"), plan)
    if not plan.stages:
        return strategies, [], {}
    return strategies, layer_units(cap), stage_of_nodes(cap, plan)
