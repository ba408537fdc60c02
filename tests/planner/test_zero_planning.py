"""The ZeRO stage as a planner choice, priced by the cost model (offline, on the meta device)."""
from __future__ import annotations

import pytest

import autopar
from autopar.examples.gpt import build, example_inputs
from autopar.plans import PlanFormatError

MESH = (8, 1, 1)


@pytest.fixture(scope="module")
def gpt():
    model = build("gpt3-1.3b", device="meta")
    return model, example_inputs(model.config, 8, 2048, device="meta")


@pytest.fixture(scope="module")
def stages(gpt):
    model, x = gpt
    return {z: autopar.plan(model, MESH, x, device="h100", zero=z) for z in (0, 1, 2, 3)}


def _peak(plan):
    return max(m.peak for m in plan.memory)


def test_each_stage_shards_more_state(stages, resharded):
    stages = {**stages, 3: resharded}   # ZeRO-3 with every unit resharded after its forward
    peaks = {z: _peak(stages[z]) for z in stages}
    # ZeRO-2 keeps every gathered weight through the step: with one microbatch its sharded
    # gradients do not lower the peak (at the forward's end) below ZeRO-1's, only ZeRO-0's
    assert peaks[3] < peaks[1] < peaks[0] and peaks[2] < peaks[0]
    mem = {z: stages[z].memory[0] for z in stages}
    assert mem[1].optimizer == mem[2].optimizer == mem[3].optimizer == pytest.approx(mem[0].optimizer / 8)
    assert mem[3].params < mem[0].params < mem[2].params
    kinds = {z: {(c.phase, c.kind) for c in stages[z].collectives if c.axis == "dp"} for z in stages}
    assert kinds[0] == {("step", "all_reduce")}
    assert kinds[2] == {("fwd", "all_gather"), ("bwd", "reduce_scatter")}
    assert kinds[3] == {("fwd", "all_gather"), ("bwd", "all_gather"), ("bwd", "reduce_scatter")}


def test_auto_takes_the_fastest_stage_that_fits(gpt, stages):
    model, x = gpt
    # a budget between ZeRO-1's peak and ZeRO-0's: stage 0 does not fit
    budget = (_peak(stages[0]) + _peak(stages[1])) / 2
    chosen = autopar.plan(model, MESH, x, device="h100", zero="auto", memory_budget=budget)
    fitting = [z for z in stages if _peak(stages[z]) <= budget]
    best = min(fitting, key=lambda z: stages[z].predicted_step_time)
    assert chosen.zero == best and 0 not in fitting
    assert chosen.predicted_step_time == pytest.approx(stages[best].predicted_step_time)
    assert any("zero chosen automatically" in n for n in chosen.notes)
    # with room for everything, the fastest of all
    roomy = autopar.plan(model, MESH, x, device="h100", zero="auto", memory_budget=10 * _peak(stages[0]))
    assert roomy.zero == min(stages, key=lambda z: stages[z].predicted_step_time)


def test_no_dp_no_sharding(gpt):
    model, x = gpt
    plan = autopar.plan(model, (1, 1, 8), x, device="h100", zero=3)
    assert plan.zero == 0 and any("dp=1" in n for n in plan.notes)
    assert autopar.plan(model, (1, 1, 8), x, device="h100", zero="auto").zero == 0


def test_bad_zero_and_bad_kept_units(gpt, stages):
    model, x = gpt
    with pytest.raises(ValueError, match="zero=4"):
        autopar.plan(model, MESH, x, device="h100", zero=4)
    import dataclasses
    edited = dataclasses.replace(stages[3], keep_gathered=("transformer.h.99",))
    with pytest.raises(PlanFormatError, match="no unit transformer.h.99"):
        autopar.plan(model, MESH, x, device="h100", plan=edited)
    kept = dataclasses.replace(stages[3], keep_gathered=("transformer.h.0",))
    assert autopar.plan(model, MESH, x, device="h100", plan=kept).keep_gathered == ("transformer.h.0",)
    with pytest.raises(PlanFormatError, match="only zero=3"):
        autopar.plan(model, MESH, x, device="h100", plan=dataclasses.replace(stages[2], keep_gathered=("transformer.h.0",)))


# ---- ZeRO-3's per-unit reshard choice (keep_gathered) ------------------------------------------

def _edited(plan, keep):
    import dataclasses
    return dataclasses.replace(plan, keep_gathered=tuple(keep), notes=())


@pytest.fixture(scope="module")
def resharded(gpt, stages):
    """The zero=3 plan with every unit resharded (an edited plan: kept as written)."""
    model, x = gpt
    return autopar.plan(model, MESH, x, device="h100", plan=_edited(stages[3], ()))


def test_zero3_keeps_every_block_gathered_when_memory_allows(gpt, stages, resharded):
    model, _ = gpt
    roomy = stages[3]   # planned against one H100's 79.18 GiB: every block fits kept
    blocks = tuple(f"transformer.h.{i}" for i in range(model.config.n_layer))
    # the embedding (no linear) and the tied head (its weight is gathered once) have no re-gather to save
    assert roomy.keep_gathered == blocks
    assert any(n.startswith("keep_gathered chosen automatically: 24 of 26 units") for n in roomy.notes)
    assert resharded.keep_gathered == () and not any("keep_gathered chosen" in n for n in resharded.notes)
    assert _peak(resharded) < _peak(roomy) <= 80 * 2**30
    # kept gathered, ZeRO-3 holds what ZeRO-2 holds and skips the same re-gathers
    assert _peak(roomy) == pytest.approx(_peak(stages[2]))
    assert roomy.predicted_comm_s < resharded.predicted_comm_s
    kept, every = (sum(c.bytes for c in p.collectives if (c.axis, c.phase, c.kind) == ("dp", "bwd", "all_gather"))
                   for p in (roomy, resharded))
    assert kept < every   # the kept blocks' re-gathers are not issued


def test_zero3_keeps_what_fits_the_budget_and_prices_the_saved_regathers(gpt, resharded, stages):
    from autopar.cost_model.comm import collective_time
    from autopar.cost_model.devices import get_device
    model, x = gpt
    budget = (_peak(resharded) + _peak(stages[3])) / 2
    part = autopar.plan(model, MESH, x, device="h100", zero=3, memory_budget=budget)
    kept = part.keep_gathered
    assert 0 < len(kept) < model.config.n_layer and _peak(part) <= budget
    # equal blocks save the same per byte: the first ones in forward order are kept
    assert kept == tuple(f"transformer.h.{i}" for i in range(len(kept)))
    note = next(n for n in part.notes if n.startswith("keep_gathered chosen automatically"))
    assert f"keeping transformer.h.{len(kept)} too would need" in note
    # each kept block adds its gathered weights to the peak ...
    block = sum(p.numel() * 4 for n, p in model.named_parameters() if n.startswith("transformer.h.0."))
    assert _peak(part) - _peak(resharded) == pytest.approx(len(kept) * block, rel=1e-9)
    # ... and saves the backward's all-gather over dp of its linears' weights (the norms and biases are
    # gathered once), one microbatch, not overlapped (by hand)
    linears = sum(p.numel() * 4 for n, p in model.named_parameters()
                  if n.startswith("transformer.h.0.") and n.endswith(("c_attn.weight", "c_proj.weight", "c_fc.weight")))
    dev = get_device("h100")
    saved = len(kept) * collective_time("all_gather", linears, MESH[0], dev, False)
    assert resharded.predicted_step_time - part.predicted_step_time == pytest.approx(saved, rel=1e-6)


def test_an_edited_keep_gathered_is_priced_and_shown(gpt, stages, resharded, tmp_path):
    model, x = gpt
    one = autopar.plan(model, MESH, x, device="h100", plan=_edited(stages[3], ["transformer.h.3"]))
    assert one.keep_gathered == ("transformer.h.3",)   # the edit stands: no automatic choice over it
    assert resharded.predicted_step_time > one.predicted_step_time > stages[3].predicted_step_time
    assert _peak(resharded) < _peak(one) < _peak(stages[3])
    assert "kept gathered from forward to backward: transformer.h.3" in one.summary()
    assert "keep_gathered: ('transformer.h.3',) -> ()" in one.diff(resharded)
    html = one.to_html()
    assert "kept gathered from forward to backward" in html and "transformer.h.3" in html
    # read back unchanged, it is the same plan
    again = autopar.plan(model, MESH, x, device="h100", plan=autopar.Plan.from_json(one.to_json()))
    assert again.diff(one) == "no differences" and again.source == one.source


def test_no_combination_fits_is_an_error_naming_the_smallest_peak(gpt, resharded):
    model, x = gpt
    # below the least peak, above the sharded state (the tp ILP's own memory check passes at zero=3)
    with pytest.raises(autopar.PlanError) as e:
        autopar.plan(model, MESH, x, device="h100", zero="auto", memory_budget=0.9 * _peak(resharded))
    text = str(e.value)
    # zero=3 with every unit resharded holds the least
    assert f"the smallest peak found is {_peak(resharded) / 2**30:.2f} GiB" in text
    assert "mesh (dp, pp, tp) = (8, 1, 1), zero=3, recompute=none, offload=none" in text
    assert "memory_budget of at least" in text and "recompute='auto'" in text and "--gpus 16" in text


def test_the_keep_gathered_knob(gpt, resharded):
    model, x = gpt
    none = autopar.plan(model, MESH, x, device="h100", zero=3, keep_gathered=())
    assert none.keep_gathered == () and none.predicted_step_time == pytest.approx(resharded.predicted_step_time)
    assert _peak(none) == pytest.approx(_peak(resharded))
    named = autopar.plan(model, MESH, x, device="h100", zero=3, keep_gathered=["transformer.h.3"])
    assert named.keep_gathered == ("transformer.h.3",)
    with pytest.raises(ValueError, match=r"only zero=3 reshards units \(zero=1 here\); use zero=3"):
        autopar.plan(model, MESH, x, device="h100", zero=1, keep_gathered=["transformer.h.3"])
    with pytest.raises(PlanFormatError, match=r"keep_gathered=\['transformer.h.99'\]: the model has no unit "
                                              "transformer.h.99"):
        autopar.plan(model, MESH, x, device="h100", zero=3, keep_gathered=["transformer.h.99"])
    with pytest.raises(ValueError, match="keep_gathered='some'"):
        autopar.plan(model, MESH, x, device="h100", zero=3, keep_gathered="some")


def test_pipeline_stages_keep_what_fits_too():
    import dataclasses
    model = build("gpt2", device="meta", n_layer=4)
    x = example_inputs(model.config, 16, 512, device="meta")
    mesh = (2, 2, 1)
    # at one microbatch count: the budget between two of its plans is to be met by keeping fewer units,
    # not by another count whose smaller activations leave room for them all
    every = autopar.plan(model, mesh, x, device="h100", zero=3, microbatches=2)
    none = autopar.plan(model, mesh, x, device="h100", zero=3, keep_gathered=(), microbatches=2)
    assert every.keep_gathered and _peak(none) < _peak(every)
    budget = (_peak(none) + _peak(every)) / 2
    part = autopar.plan(model, mesh, x, device="h100", zero=3, memory_budget=budget, microbatches=2)
    assert 0 < len(part.keep_gathered) < len(every.keep_gathered) and _peak(part) <= budget
    assert every.predicted_step_time < part.predicted_step_time < none.predicted_step_time
    assert [s.modules for s in part.stages] == [s.modules for s in none.stages]   # the cut stays
    again = autopar.plan(model, mesh, x, device="h100", plan=dataclasses.replace(part, notes=()))
    assert again.diff(part) == "no differences"


def _zero_search(monkeypatch):
    """(the planner's choices module, a 4-layer gpt2 on meta, ``job(budget)``: a planning Job of it at that
    memory budget, the list of the ZeRO stages a candidate is priced at, in order, and the pricing
    unrecorded) for the tests of the mesh search's pruning."""
    from autopar.planner import choices as d
    from autopar.planner.request import Job, Request

    model = build("gpt2", device="meta", n_layer=4)
    inputs = example_inputs(model.config, 16, 1024, device="meta")
    knobs = dict(plan="auto", sequence_parallel="auto", schedule="1F1B", gpus_per_node=8, stages=None,
                 virtual_stages=None, recompute="auto", precision="bf16", offload="none", keep_gathered="auto")

    def job(mesh, budget):
        return Job(model, inputs, Request.of(mesh, memory_budget=budget, device="h100", **knobs))
    planned = []
    price_one = d.price
    monkeypatch.setattr(d, "price", lambda j, mesh, m, z, offload: planned.append(z) or price_one(j, mesh, m, z, offload))
    return d, job, planned, price_one


def test_the_mesh_search_skips_only_zero_stages_that_cannot_be_chosen(monkeypatch):
    """``choose_zero(prune=True)`` skips a stage only when its floors lose: the candidate it keeps is the one
    planning every stage keeps, figure for figure, and each stage's floors are below its plan's figures."""
    from autopar.mesh import Mesh

    d, job, planned, price_one = _zero_search(monkeypatch)
    skipped = 0
    for mesh, m, budget in ((Mesh(16, 1, 1), 1, 2**29), (Mesh(8, 2, 1), 2, 2**29), (Mesh(4, 4, 1), 4, 80 * 2**30)):
        j = job(mesh, budget)
        full = d.choose_zero(j, mesh, m, zero="auto", offload="none")
        planned.clear()
        pruned = d.choose_zero(j, mesh, m, zero="auto", offload="none", prune=True)
        skipped += 4 - len(planned)
        assert pruned.choices.zero == full.choices.zero, mesh
        assert (pruned.step_time, pruned.peak_memory) == (full.step_time, full.peak_memory), mesh
        floors = d.zero_floors(j, mesh, m, "none", (0, 1, 2, 3))
        for z in (0, 1, 2, 3):
            try:
                one = price_one(j, mesh, m, z, "none")
            except ValueError:   # no plan at this stage (no cut within the budget)
                continue
            assert floors[z][0] <= one.peak_memory and floors[z][1] <= one.step_time, (mesh, z)
    assert skipped > 0   # the floors did skip stages here


def test_the_mesh_search_skips_stages_that_cannot_fit_or_have_no_cut(monkeypatch):
    """Where no ZeRO stage fits, ``choose_zero(prune=True)`` skips a stage whose peak floor is above the least
    peak planned, and with pipeline stages one whose peak floor is above the budget (it has no stage cut): the
    candidate it keeps, or the error it raises, is the one planning every stage gives; and each stage skipped
    for want of a cut does raise when planned."""
    from autopar.mesh import Mesh

    d, job, planned, price_one = _zero_search(monkeypatch)

    def outcome(j, prune):
        try:
            one = d.choose_zero(j, mesh, m, zero="auto", offload="none", prune=prune)
        except ValueError as e:
            return str(e)
        return one.choices.zero, one.step_time, one.peak_memory

    no_cut = least = 0
    for mesh, m, budget in ((Mesh(16, 1, 1), 1, 2**27), (Mesh(8, 2, 1), 2, 2**28), (Mesh(4, 4, 1), 4, 2**28),
                            (Mesh(4, 4, 1), 4, 2**26)):
        j = job(mesh, budget)
        full = outcome(j, False)
        planned.clear()
        assert outcome(j, True) == full, mesh
        floors = d.zero_floors(j, mesh, m, "none", (0, 1, 2, 3))
        peaks = {}
        for z in (0, 1, 2, 3):
            try:
                peaks[z] = price_one(j, mesh, m, z, "none").peak_memory
            except ValueError:
                peaks[z] = None
            assert peaks[z] is None or peaks[z] > budget, (mesh, z)   # no stage fits in these cases
            if d.cut_cannot_fit(mesh, floors[z][0], budget, None):
                assert peaks[z] is None, (mesh, z)
                no_cut += z not in planned
        for z in set(range(4)) - set(planned):
            if peaks[z] is not None:   # skipped with a plan: it does not have the least peak
                assert peaks[z] > min(p for p in peaks.values() if p is not None), (mesh, z)
                least += 1
    assert no_cut > 0 and least > 0   # both rules did skip stages here
