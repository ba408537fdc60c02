"""The stage DP prices a unit's memory as the plan does (``cost_model.memory``: what torch.compile
keeps, with the recompute regions), so recompute can make a cut fit that misses without it."""
from __future__ import annotations

import pytest

import autopar
from autopar.planner.decide import decide
from autopar.cost_model.devices import get_device
from autopar.cost_model.memory import unit_memory
from autopar.cost_model.stages import unit_costs
from autopar.examples.gpt import build, example_inputs
from autopar.planner.recompute import regions_for
from autopar.mesh import Mesh
from autopar.graph.units import layer_units
from autopar.planner.stage_dp import cut_stages


def test_recompute_lets_the_stage_dp_take_a_cut_that_misses_without_it():
    model = build("gpt3-2.7b", device="meta", n_layer=8)
    inputs = example_inputs(model.config, 16, 2048, device="meta")
    budget = 2.5 * 2**30
    cap, strategies, plan = decide(model, (1, 2, 4), inputs, microbatches=8, recompute="auto", memory_budget=budget)
    assert plan.recompute_regions and max(m.peak for m in plan.memory) <= budget
    assert all(s.memory_bytes <= budget for s in plan.stages)
    units = layer_units(cap)

    def cut(mode):
        time, boundary, _ = unit_costs(cap, strategies, units, Mesh(1, 2, 4), get_device("h100"), gpus_per_node=8)
        static, act = unit_memory(cap, strategies, units, Mesh(1, 2, 4), zero=0, working_copy=0.0,
                                  regions=regions_for(cap, mode))
        return cut_stages(time, static, act, boundary, p=2, m=8, memory_budget=budget)

    with pytest.raises(ValueError, match="the pipeline needs"):
        cut("none")
    assert [s.modules for s in plan.stages] == [tuple(m for u in units[a:b] for m in u.modules)
                                                for a, b in cut("full").bounds]


def test_the_summary_shows_one_memory_figure_per_stage():
    """The pipeline section names each stage's time; its memory is the memory section's alone."""
    model = build("gpt2", device="meta")
    plan = autopar.plan(model, (1, 2, 4), example_inputs(model.config, 8, 1024, device="meta"))
    text = plan.summary()
    pipeline = text[text.index("Pipeline:"):text.index("Memory per rank")]
    assert "GiB" not in pipeline
    for mem in plan.memory:
        assert f"stage {mem.stage}:" in text and f"peak {mem.peak / 2**30:.3f}" in text
