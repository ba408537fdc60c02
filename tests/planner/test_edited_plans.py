"""A plan file edited by hand: every choice it makes is checked (the field, the bad value and the
valid ones named), keep_gathered outside zero=3 is refused alike as knob, CLI flag and plan field,
and the notes on automatic choices do not outlive an edit of that choice. Planned on the meta device
but for the parallelize job, which plans the model it runs."""
from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest

import autopar
import cli
import pool
from autopar.examples.gpt import build, example_inputs
from parity import BATCH, SEQ, TINY, make_model


@pytest.fixture(scope="module")
def tiny():
    model = build("tiny", device="meta")
    return model, example_inputs(model.config, 8, device="meta")


@pytest.fixture(scope="module")
def piped(tiny):
    """(2, 2, 1) at zero=3: a plan with stages and microbatches whose JSON the edits below start from."""
    model, x = tiny
    return json.loads(autopar.plan(model, (2, 2, 1), x, device="cpu", zero=3).to_json())


def _read(data: dict, **edits) -> autopar.Plan:
    return autopar.Plan.from_json(json.dumps(dict(data, **edits)))


@pytest.mark.parametrize("edits, words", [
    (dict(zero=5), ["plan.zero 5: expected 0, 1, 2 or 3"]),
    (dict(zero=5, keep_gathered=["transformer.h.0"]), ["plan.zero 5: expected 0, 1, 2 or 3"]),
    (dict(zero=-1), ["plan.zero -1: expected 0, 1, 2 or 3"]),
    (dict(schedule="1f1b"), ["plan.schedule '1f1b': expected 'GPipe', '1F1B', 'Interleaved1F1B' or "
                             "'InterleavedZeroBubble'"]),
    (dict(recompute="some"), ["plan.recompute 'some': expected 'none', 'selective', 'full' or 'auto'"]),
    (dict(precision="fp8"), ["plan.precision 'fp8': expected 'fp32', 'bf16' or 'fp16'"]),
    (dict(offload="gpu"), ["plan.offload 'gpu': expected 'none' or 'optimizer'"]),
    (dict(cp_attention="flash"), ["plan.cp_attention 'flash': expected 'allgather' or 'ring'"]),
    (dict(cp_attention="ring"), ["plan.cp_attention 'ring'", "this plan has cp=1", "set it to 'allgather'"]),
    (dict(virtual_stages=0), ["plan.virtual_stages 0: expected a positive integer"]),
    (dict(virtual_stages=2), ["plan.virtual_stages 2: schedule 1F1B runs one stage per pp rank",
                              "'Interleaved1F1B' or 'InterleavedZeroBubble'"]),
    (dict(microbatches=0), ["plan.microbatches 0: expected a positive integer"]),
    (dict(microbatches=1), ["plan.microbatches 1: fewer than the pp=2 pipeline stages; use at least 2"]),
    (dict(schedule="Interleaved1F1B", microbatches=3), ["plan.microbatches 3: Interleaved1F1B needs a multiple "
                                                        "of pp=2"]),
    (dict(mesh=[2, 2]), ["plan.mesh [2, 2]: expected [dp, pp, tp], three positive integers"]),
    (dict(mesh=[2, 0, 1]), ["plan.mesh [2, 0, 1]: expected [dp, pp, tp]"]),
    (dict(cp=0), ["plan.cp 0: expected a positive integer"]),
    (dict(dp_replicate=3), ["plan.dp_replicate 3: expected a positive divisor of dp=2"]),
    (dict(zero=2), ["plan.keep_gathered lists transformer.h.0", "only zero=3 reshards units (this plan has "
                                                                "zero=2); empty it or set zero to 3"]),
])
def test_every_choice_of_a_plan_file_is_checked(piped, edits, words):
    """One sentence naming the field, the bad value and the values it may take, when the file is read
    (``Plan.from_json``) and when a Plan is built with it by hand."""
    assert piped["keep_gathered"] and piped["mesh"] == [2, 2, 1] and piped["microbatches"] >= 2
    with pytest.raises(autopar.PlanFormatError) as read:
        _read(piped, **edits)
    with pytest.raises(autopar.PlanFormatError) as built:
        dataclasses.replace(autopar.Plan.from_json(json.dumps(piped)),
                            **{k: tuple(v) if isinstance(v, list) else v for k, v in edits.items()})
    for e in (read.value, built.value):
        for w in words:
            assert w in str(e), str(e)


def test_an_unedited_plan_file_reads_back(piped):
    assert _read(piped).zero == 3 and _read(piped, keep_gathered=[], zero=2).zero == 2


def test_keep_gathered_outside_zero_3_is_refused_as_knob_flag_and_field(tiny, tmp_path):
    """The same answer everywhere: a non-empty keep_gathered with zero 0-2 is an error naming the fix
    (it could not take effect); an empty one, and any under zero="auto" (kept if it picks 3), are fine."""
    model, x = tiny
    with pytest.raises(ValueError, match=r"keep_gathered=\['transformer.h.0'\] names units .* only zero=3 reshards "
                                         r"units \(zero=2 here\); use zero=3"):
        autopar.plan(model, (2, 1, 1), x, device="cpu", zero=2, keep_gathered=["transformer.h.0"])
    r = cli.main("plan", "tiny", "--mesh", "2,1,1", "--device", "cpu", "--zero", "1",
                 "--keep-gathered", "transformer.h.0")
    assert r.returncode == 2 and r.stderr.count("\n") == 1, r.stderr
    assert r.stderr.startswith("error: keep_gathered=['transformer.h.0'] names units") and "use zero=3" in r.stderr
    data = json.loads(autopar.plan(model, (2, 1, 1), x, device="cpu", zero=2).to_json())
    path = tmp_path / "plan.json"
    path.write_text(json.dumps(dict(data, keep_gathered=["transformer.h.0"])))
    with pytest.raises(autopar.PlanFormatError, match=r"only zero=3 reshards units \(this plan has zero=2\); "
                                                      "empty it or set zero to 3"):
        autopar.plan(model, (2, 1, 1), x, device="cpu", plan=str(path))
    assert autopar.plan(model, (2, 1, 1), x, device="cpu", zero=2, keep_gathered=()).keep_gathered == ()
    assert cli.main("plan", "tiny", "--mesh", "2,1,1", "--device", "cpu", "--zero", "2",
                    "--keep-gathered", "none").returncode == 0


def test_an_unknown_unit_is_named_without_a_garbled_prefix(tiny):
    r = cli.main("plan", "tiny", "--mesh", "2,1,1", "--device", "cpu", "--zero", "3", "--keep-gathered", "nope")
    assert r.returncode == 2, r.stderr
    assert r.stderr.startswith("error: keep_gathered=['nope']: the model has no unit nope; its units are "
                               "embedding, transformer.h.0, transformer.h.1, head"), r.stderr


def _rederived(model, x, plan: autopar.Plan, mesh, **edits) -> autopar.Plan:
    """``plan`` written to JSON, edited there and re-derived, as ``parallelize(..., plan=path)`` does."""
    data = dict(json.loads(plan.to_json()), **edits)
    return autopar.plan(model, mesh, x, device="cpu", plan=autopar.Plan.from_json(json.dumps(data)))


def test_a_note_on_an_automatic_choice_goes_with_an_edit_of_it(tiny):
    """"chosen automatically: X" after an edit to Y would be false: the re-derived plan drops it, and keeps
    every note of a plan read back unchanged."""
    model, x = tiny
    cp_mesh = {"dp": 2, "cp": 2}
    cp = autopar.plan(model, cp_mesh, x, device="cpu")
    assert any(n.startswith(f"cp attention chosen automatically: {cp.cp_attention}") for n in cp.notes), cp.notes
    assert _rederived(model, x, cp, cp_mesh).notes == cp.notes
    other = next(a for a in ("allgather", "ring") if a != cp.cp_attention)
    edited = _rederived(model, x, cp, cp_mesh, cp_attention=other)
    assert edited.cp_attention == other and edited.source == "edited from auto"
    assert not any(n.startswith("cp attention") for n in edited.notes), edited.notes

    zero3 = autopar.plan(model, (2, 1, 1), x, device="cpu", zero=3)
    assert zero3.keep_gathered and any(n.startswith("keep_gathered chosen automatically: 2 of 4 units")
                                       for n in zero3.notes), zero3.notes
    assert _rederived(model, x, zero3, (2, 1, 1)).notes == zero3.notes
    for kept in ([], ["transformer.h.1"]):
        edited = _rederived(model, x, zero3, (2, 1, 1), keep_gathered=kept)
        assert edited.keep_gathered == tuple(kept) and not any("keep_gathered" in n for n in edited.notes)

    auto = autopar.plan(model, (2, 1, 1), x, device="cpu", zero="auto")
    assert any(n.startswith(f"zero chosen automatically: zero={auto.zero},") for n in auto.notes), auto.notes
    assert _rederived(model, x, auto, (2, 1, 1)).notes == auto.notes
    edited = _rederived(model, x, auto, (2, 1, 1), zero=(auto.zero + 1) % 4, keep_gathered=[])
    assert not any(n.startswith("zero chosen automatically") for n in edited.notes), edited.notes


def test_a_note_on_the_zero_stage_is_derived_again(tiny):
    """HSDP at zero=0 says that it shards nothing; edited to zero=1 that note goes, and back at zero=0 it
    returns. On dp=1 the note on zero=3 planned as zero=0 stays as long as no other zero was written."""
    model, x = tiny
    hsdp = {"dp_replicate": 2, "dp_shard": 2}
    plain = autopar.plan(model, hsdp, x, device="cpu")
    assert plain.zero == 0 and any("zero=0 shards nothing" in n for n in plain.notes), plain.notes
    one = _rederived(model, x, plain, hsdp, zero=1)
    assert one.zero == 1 and not any("zero=0 shards nothing" in n for n in one.notes), one.notes
    assert _rederived(model, x, one, hsdp, zero=0).notes == plain.notes
    alone = autopar.plan(model, (1, 1, 1), x, device="cpu", zero=3)
    assert alone.zero == 0 and alone.notes and alone.notes[0].startswith("zero=3 asks to shard over dp, but dp=1")
    assert _rederived(model, x, alone, (1, 1, 1)).notes == alone.notes
    assert _rederived(model, x, alone, (1, 1, 1), zero=2).notes == (alone.notes[0].replace("zero=3", "zero=2", 1),)


def _zero_5(rank, world, path):
    """parallelize(plan=path) of a plan edited to zero=5, its kept units left in and emptied: refused on
    every rank before it builds anything."""
    x = example_inputs(TINY, BATCH, SEQ)
    out = []
    for kept in (None, []):
        file = Path(path) / f"plan-{kept}.json"
        if rank == 0:   # the one rank that reads it
            data = json.loads(autopar.plan(make_model(), (2, 1, 1), x, device="cpu", zero=3).to_json())
            file.write_text(json.dumps(dict(data, zero=5, **({} if kept is None else {"keep_gathered": kept}))))
        try:
            autopar.parallelize(make_model(), (2, 1, 1), x, plan=str(file), compile=False, device="cpu")
            out.append("accepted")
        except autopar.PlanFormatError as e:
            out.append(str(e))
    return out


ZERO_5 = pool.job(2, _zero_5, workdir=True, timeout=300)


def test_parallelize_refuses_a_plan_edited_to_zero_5():
    for messages in ZERO_5.result():
        for message in messages:
            assert message.startswith("plan.zero 5: expected 0, 1, 2 or 3"), message
