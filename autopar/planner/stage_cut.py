"""Pipeline stage cuts: the cost model's, or a user's ``stages=`` override checked unit by unit.

The cost model prices each layer unit per microbatch under the chosen tensor-parallel strategies
(``cost_model.stages.unit_costs``) and gives it the memory figures the stage DP adds up
(``cost_model.memory.unit_memory``); ``autopar.planner.stage_dp`` cuts the units into stages.
The DP's memory is a bound of the memory model's peak that leaves out what does not add up unit
by unit, chiefly the backward's transient (``cost_model.memory``'s docstring), so the cut it takes
is checked against the peak itself (``peaks``): where the peak misses the budget, the DP is asked
again with its budget lowered by the miss below the cut's own figure, until a cut fits or none is
left. Every cut it is asked again for fits the budget by the DP's figure, so the answer is the
fastest cut the DP finds whose peak fits (exact where the transients of the cuts it passes over
are alike, as a model's repeated blocks make them).

Where no cut fits, the refusal (``NoCutFits``, a ``PlanError``) names the memory model's peak, the
figure a plan's summary shows: of the cut the DP's figure missed by least when it found one, else of
the cut of least DP memory (``stage_dp.BudgetMissed``), never the DP's bound alone.
"""
from __future__ import annotations

from autopar.errors import PlanError
from autopar.graph.capture import Captured
from autopar.graph.units import Unit, layer_units, override_bounds, stage_of_nodes
from autopar.planner.sharding import enumerate_strategies, strategies_from_plan
from autopar.planner.stage_dp import BudgetMissed, StageCut, cut_stages, evaluate_cut

_GIB = float(2 ** 30)


class NoCutFits(PlanError):
    """No pipeline stage cut fits the memory budget (recompute or more stages may mend it, unlike the
    other PlanErrors of a cut: a wrong ``stages=``). Its message is made once first read
    (``explain()``): it prices the least-memory cut, which a caller that tries another recompute
    next never reads."""

    def __init__(self, explain):
        super().__init__()
        self._explain, self._text = explain, None

    def __str__(self) -> str:
        if self._text is None:
            self._text = self._explain()
        return self._text


def choose_cut(costs, units: list[Unit], mesh, *, schedule: str, microbatches: int, virtual: int,
               memory_budget: float | None, stages=None, bounds=None, peaks=None, recut: bool = True) -> StageCut:
    """The stage cut: ``bounds`` as given, a user's ``stages`` override validated unit by unit, or the
    cost model's, the fastest whose ``peaks(bounds)`` (each pipeline rank's peak bytes by the
    memory model) fit ``memory_budget`` (module docstring). ``costs``: the units' (time, static
    bytes, activation bytes, cut seconds), as ``stage_dp.cut_stages`` takes them. ``recut=False``:
    the DP's first cut or none, a ValueError where its peak misses."""
    time, static, act, boundary = costs
    kw = dict(p=mesh.pp, m=microbatches, v=virtual, schedule=schedule)
    if bounds is not None:
        return evaluate_cut(bounds, time, static, act, boundary, **kw)
    if stages is not None:
        return evaluate_cut(override_bounds(stages, units, mesh.pp * virtual), time, static, act, boundary, **kw)
    budget, missed = memory_budget, None
    while True:
        try:
            cut = cut_stages(time, static, act, boundary, memory_budget=budget, **kw)
        except BudgetMissed as e:
            if peaks is None:
                raise NoCutFits(e.__str__) from None

            def explain(e=e, missed=missed):
                if missed is None:   # the DP's figure misses with every cut: the peak of its least-memory cut
                    missed = max(peaks(e.least))
                return (f"the pipeline needs {missed / _GIB:.4g} GiB per rank with the least-memory cut found under "
                        f"{schedule} (pp={mesh.pp}, v={virtual}, {microbatches} microbatches), its backward's "
                        f"transient included, but the memory budget is {memory_budget / _GIB:.4g} GiB; use "
                        "more pipeline stages, tensor parallelism or recompute")
            raise NoCutFits(explain) from None
        if peaks is None or memory_budget is None:
            return cut
        peak = max(peaks(cut.bounds))
        if peak <= memory_budget * (1 + 1e-9):   # the DP's own slack
            return cut
        missed = peak if missed is None else min(missed, peak)
        if not recut:
            text = (f"the pipeline's fastest cut needs {peak / _GIB:.4g} GiB per rank, its backward's "
                    f"transient included, but the memory budget is {memory_budget / _GIB:.4g} GiB")
            raise NoCutFits(lambda: text)
        budget = max(cut.rank_memory) - (peak - memory_budget)


def plan_layout(cap: Captured, plan) -> tuple[dict, list[Unit], dict[str, int]]:
    """A plan's decisions laid on a capture of its model, for pricing it there
    (``cost_model.symbolic``): the strategy per node and, with pipeline stages, the layer units
    and each node's stage (empty without)."""
    strategies = strategies_from_plan(cap, enumerate_strategies(cap, plan.mesh[2], "auto"), plan)
    if not plan.stages:
        return strategies, [], {}
    return strategies, layer_units(cap), stage_of_nodes(cap, plan)
