"""autopar.rehearse on CPU, in this process: one rank of a plan for a larger world, built from a model
on the meta device, run under a world whose collectives move no data. The collectives it issues
are the plan's (ZeRO-3 over 4 ranks, Megatron's tp over 4, and both pipeline ranks of a (1, 2, 2)
mesh, whose tp collectives add up to the plan's; ZeRO-3's per phase too, its backward re-gather with
units kept gathered or none; a sequence-parallel linear's re-gather), only the rank's shards are made (their bytes are the
plan's), the report round-trips through JSON and shows in the summary and the HTML view, and bad
input fails with a sentence: a rank outside the world, a rank that does not fit the device, a plan
priced for another chip. The CLI runs one."""
from __future__ import annotations

import dataclasses
import functools
import json
import sys
from pathlib import Path

import pytest
import torch

import autopar
from autopar import rehearsing
from autopar.examples.gpt import GPT, example_inputs
from autopar.plans import Plan
import cli
from cli import main as cli_main
from parity import SEQ, TINY

BATCH = 8
# compiled as parallelize compiles where the compile changes what a rank issues or holds (ZeRO-3's
# backward re-gathers, a sequence-parallel linear's kept shard); eager where it does not (shards, tp and
# pipeline collectives, sends): the same passes, without Dynamo's seconds per rank
FAST = dict(device="cpu", compile="aot_eager", steps=1, warmup=1)
EAGER = dict(FAST, compile=False)


def _meta_model():
    with torch.device("meta"):
        return GPT(TINY)


@functools.cache
def _rehearsed(mesh, rank="worst", compiled=False, **knobs) -> Plan:
    return autopar.rehearse(_meta_model(), mesh, example_inputs(TINY, BATCH, SEQ, device="meta"), rank=rank,
                            **(FAST if compiled else EAGER), **knobs)


def _issued(r) -> dict:
    """(kind, axis) -> (count, bytes) the rank issued per step, over every phase."""
    return _summed((c.kind, c.axis, c.count, c.bytes) for c in r.collectives if c.count)


def _planned(r) -> dict:
    """(kind, axis) -> (count, bytes) the plan records, over every phase."""
    return _summed((c.kind, c.axis, c.planned_count, c.planned_bytes) for c in r.collectives if c.planned_count)


def _summed(rows) -> dict:
    out = {}
    for kind, axis, n, b in rows:
        count, nbytes = out.get((kind, axis), (0, 0))
        out[(kind, axis)] = (count + n, nbytes + b)
    return out


def test_zero3_rank_gathers_and_scatters_what_the_plan_says():
    plan = _rehearsed((4, 1, 1), rank=1, compiled=True, zero=3)
    (r,) = plan.rehearsals
    assert r.rank == 1 and r.coords == "dp 1"
    issued = _issued(r)
    # one gather and one reduce-scatter per parameter: the plan's bytes of the forward's gathers and the
    # backward's reduce-scatter (the backward's re-gathers of units not kept are priced in "bwd")
    forward = sum(c.bytes for c in plan.collectives if (c.kind, c.phase) == ("all_gather", "fwd"))
    scatter = sum(c.bytes for c in plan.collectives if c.kind == "reduce_scatter")
    assert issued[("all_gather", "dp")] == (len(plan.parameters), forward)
    assert issued[("reduce_scatter", "dp")] == (len(plan.parameters), scatter)
    # beside them, only the step's bookkeeping: the loss's mean and the token count, one scalar each
    assert set(issued) == {("all_gather", "dp"), ("reduce_scatter", "dp"), ("all_reduce", "dp")}
    assert issued[("all_reduce", "dp")][0] == 2 and issued[("all_reduce", "dp")][1] <= 16


# the program (passes/zero.py) gathers again in the backward only a resharded unit's linear weights (not a
# tied table, gathered once and kept; not a norm's or an embedding's), and so does the plan
# (cost_model.state.regathered_bytes); "aot_eager" reshards as Inductor does (runtime.compiler.lower)
@pytest.mark.parametrize("keep", ["auto", ()])
def test_zero3_moves_the_plans_bytes_per_kind_axis_and_phase(keep):
    plan = autopar.rehearse(_meta_model(), (4, 1, 1), example_inputs(TINY, BATCH, SEQ, device="meta"), rank=1,
                            zero=3, keep_gathered=keep, **FAST)
    (r,) = plan.rehearsals
    issued = {(c.kind, c.axis, c.phase): c.bytes for c in r.collectives if c.count and c.kind != "all_reduce"}
    # the backward gathers again the linear weights (GPT-2's c_attn, c_proj, c_fc) of the blocks not kept
    regathered = sum(4 * torch.Size(p.shape).numel() for p in plan.parameters
                     if p.fqn.endswith(("c_attn.weight", "c_proj.weight", "c_fc.weight"))
                     and not p.fqn.startswith(tuple(f"{unit}." for unit in plan.keep_gathered)))
    assert issued.get(("all_gather", "dp", "bwd"), 0) == regathered
    assert issued == {(c.kind, c.axis, c.phase): c.planned_bytes for c in r.collectives if c.planned_count}


def test_tp_rank_issues_exactly_the_plans_collectives():
    (r,) = _rehearsed((1, 1, 4), rank=2, plan="megatron").rehearsals
    assert r.coords == "tp 2"
    assert _issued(r) == _planned(r) and len(_issued(r)) == 3


# Megatron's storage rule, compiled: the column-parallel linears a plan marks ``regather`` keep their input's
# sequence shard and gather it again in the backward (AOTAutograd would merge the gathers and keep the whole
# input: the plan's memory, not the run's); one more backward gather each, less memory, as the plan says
def test_sequence_parallel_linears_marked_regather_keep_the_shard_when_compiled():
    x = example_inputs(TINY, BATCH, SEQ, device="meta")
    base = autopar.plan(_meta_model(), (1, 1, 4), x, device="cpu", plan="megatron", sequence_parallel=True)
    edited = dataclasses.replace(base, nodes=tuple(
        dataclasses.replace(n, regather=n.op == "aten.linear.default" and n.module.endswith(("c_attn", "c_fc")))
        for n in base.nodes))
    (whole,), (kept,) = (autopar.rehearse(_meta_model(), (1, 1, 4), x, rank=1, plan=p, **FAST).rehearsals
                         for p in (base, edited))
    marked = sum(n.regather for n in edited.nodes)
    assert marked == 2 * TINY.n_layer
    backward = {r: sum(c.count for c in r.collectives if (c.kind, c.axis, c.phase) == ("all_gather", "tp", "bwd"))
                for r in (whole, kept)}
    assert backward[kept] == backward[whole] + marked
    assert all(c.agrees for c in kept.collectives if c.planned_count)
    assert kept.peak_bytes < whole.peak_bytes and kept.memory_ratio == pytest.approx(1, abs=0.05)


# a plan records the whole model's collectives; a pipeline rank is compared with its stages' and its share
# of the gradient sync (the tied embedding and head: on both stages, each syncs its copy)
def test_each_pipeline_rank_issues_its_stages_collectives_and_sends_each_microbatch():
    first = _rehearsed((2, 2, 2), rank=0, plan="megatron", zero=1)
    last = _rehearsed((2, 2, 2), rank=7, plan="megatron", zero=1)
    m = first.microbatches
    act = BATCH // 2 // m * SEQ * TINY.n_embd * 4 // (2 if first.sequence_parallel else 1)   # sequence-sharded over tp
    whole = _summed((c.kind, c.axis, c.count, c.bytes) for c in first.collectives)
    tp, sync = {}, {}
    for plan in (first, last):
        (r,) = plan.rehearsals
        issued = _issued(r)
        assert issued[("send", "pp")] == issued[("recv", "pp")] == (m, m * act)   # activations one way, gradients back
        assert all(c.agrees for c in r.collectives if c.planned_count)
        assert {k for k in issued if k[1] == "tp"} == {k for k in _planned(r) if k[1] == "tp"}
        for key, (n, b) in issued.items():
            into = tp if key[1] == "tp" else sync if key[1] == "dp" and key[0] != "all_reduce" else {}
            into[key] = (into.get(key, (0, 0))[0] + n, into.get(key, (0, 0))[1] + b)
    assert tp == {k: v for k, v in whole.items() if k[1] == "tp"}
    for key in (("reduce_scatter", "dp"), ("all_gather", "dp")):
        assert whole[key][1] < sync[key][1] < 2 * whole[key][1]
    assert first.rehearsals[0].coords == "dp 0 pp 0 tp 0" and last.rehearsals[0].coords == "dp 1 pp 1 tp 1"


# at bf16 the fp32 model's parameters are held at 16 bits below ZeRO-2 (the distributed optimizer's), and
# ZeRO-3's dp shards stay fp32 (the masters): the plan's figure is at the dtype its state table holds them
@pytest.mark.parametrize("case", [((4, 1, 1), 1, dict(zero=3, compiled=True)), ((1, 1, 4), 2, dict(plan="megatron")),
                                  ((1, 2, 2), 3, dict(plan="megatron")),
                                  ((2, 1, 2), 1, dict(plan="megatron", zero=1, precision="bf16")),
                                  ((4, 1, 1), 1, dict(zero=3, precision="bf16"))])
def test_only_the_ranks_shards_are_made(case):
    mesh, rank, knobs = case
    plan = _rehearsed(mesh, rank=rank, **knobs)
    (r,) = plan.rehearsals
    full = sum(4 * torch.Size(p.shape).numel() for p in plan.parameters)
    assert r.param_bytes == r.planned_param_bytes and 0 < r.param_bytes < full
    if plan.mesh[1] > 1:
        return   # a pipeline rank holds its stages' parameters only
    held = sum(torch.Size(plan.held_shape(p)).numel() for p in plan.parameters)
    assert r.param_bytes == held * (2 if knobs.get("precision") == "bf16" and knobs.get("zero") == 1 else 4)


def test_a_cpu_peak_counts_the_distributed_optimizers_state():
    plan = _rehearsed((2, 1, 2), rank=1, plan="megatron", zero=1, precision="bf16")
    (r,) = plan.rehearsals
    # held through the step beside the 16-bit parameters: their fp32 gradient buffer (twice their
    # bytes), the fp32 master and AdamW's two moments split over dp 2 (three times): docs/design.md's table
    assert r.peak_bytes >= r.param_bytes * (1 + 2 + 3)


def test_worst_rank_is_the_fullest_pipeline_rank():
    plan = _rehearsed((1, 2, 2), plan="megatron")
    (r,) = plan.rehearsals
    peaks = [max(m.peak for m in plan.memory if m.stage % 2 == pp) for pp in range(2)]
    pp = max(range(2), key=lambda k: peaks[k])
    assert r.coords == f"pp {pp} tp 0" and "fullest" in r.why
    assert r.predicted_peak_bytes == peaks[pp]


def test_report_fields_round_trip_and_show():
    plan = _rehearsed((1, 1, 4), rank=2, plan="megatron")
    (r,) = plan.rehearsals
    assert r.compute_s > 0 and r.update_s > 0 and r.peak_bytes > 0 and r.predicted_compute_s > 0
    assert r.step_s == pytest.approx(r.compute_s + r.comm_s + r.bubble_s + r.update_s)
    assert "tensors held" in r.memory   # on CPU: what was measured is said
    assert r.ops and {op.op for op in r.ops} == {"matmul", "other"}   # on CPU its ops are timed
    assert r.memory_bound_bytes > 0
    (m,) = plan.memory
    assert 0 < r.held_bytes < r.peak_bytes and r.predicted_terms == (m.params, m.grads, m.optimizer, m.activations, m.transient)
    assert {c.phase for c in r.collectives} == {"fwd", "bwd"}
    again = Plan.from_json(plan.to_json())
    assert again == plan and again.rehearsals[0].collectives == r.collectives and again.rehearsals[0].ops == r.ops
    older = json.loads(plan.to_json())
    del older["rehearsals"]
    assert Plan.from_json(json.dumps(older)).rehearsals == ()
    text = plan.summary()
    assert "Rehearsed rank 2 (tp 2; as asked) on cpu" in text and "issued vs plan" in text
    assert f"the plan's terms: params {m.params / 2**30:.4f}" in text
    page = plan.to_html()
    assert "data-rehearsed-rank='2'" in page and "Rehearsed ranks" in page


@pytest.mark.parametrize("recompute", ["none", "full"])
def test_a_pipeline_ranks_predicted_compute_is_its_share_of_the_steps(recompute):
    """Over a (dp 1, pp 2, cp 2, tp 2) mesh the busiest pipeline rank's predicted compute is the
    step's compute term: its stages' ops (recomputed forwards too), not their tp and pp transfers,
    on its half of each sequence (the stage times are priced on whole sequences)."""
    cfg = dataclasses.replace(TINY, block_size=4 * SEQ)
    with torch.device("meta"):
        model = GPT(cfg)
    plan = autopar.plan(model, {"pp": 2, "cp": 2, "tp": 2}, example_inputs(cfg, BATCH, 4 * SEQ, device="meta"),
                        device="h100", plan="megatron", microbatches=4, recompute=recompute)
    ranks = [rehearsing.predicted_compute_s(plan, pp) for pp in range(2)]
    assert max(ranks) == pytest.approx(plan.step_terms.compute)
    assert all(0 < s.predicted_compute_s < s.predicted_time_s for s in plan.stages)   # tp transfers are not ops
    whole = [plan.microbatches * sum(s.predicted_time_s for s in plan.stages if s.rank == pp) for pp in range(2)]
    assert all(r < w / 2 for r, w in zip(ranks, whole))


def test_the_peaks_holders_are_what_was_alive_at_the_peak_by_the_line_that_made_it(tmp_path):
    """A CUDA allocator's trace, written out: 1 GiB held before the step; the step allocates a
    (model.py:10) and b (model.py:20), frees a, allocates c (model.py:10 again), frees b and c. The
    peak (held + b + c) holds b and c, not a; torch's own frames are skipped for the model's line."""
    from autopar.runtime.rehearsal import peak_holders

    source = tmp_path / "model.py"
    source.write_text("\n".join(f"line{i}" for i in range(1, 31)))
    GiB = 2**30

    def at(line):
        return [{"filename": "/x/site-packages/torch/nn/functional.py", "line": 1, "name": "linear"},
                {"filename": str(source), "line": line, "name": "forward"}]
    trace = [dict(action="alloc", addr=1, size=4 * GiB, frames=at(10)),
             dict(action="alloc", addr=2, size=2 * GiB, frames=at(20)),
             dict(action="free_requested", addr=1, size=4 * GiB),
             dict(action="free_completed", addr=1, size=4 * GiB),
             dict(action="alloc", addr=3, size=5 * GiB, frames=at(10)),
             dict(action="free_requested", addr=2, size=2 * GiB),
             dict(action="free_requested", addr=3, size=5 * GiB)]
    lines = peak_holders({"device_traces": [trace]}, held=1 * GiB)
    assert lines[0].startswith("at the step's peak (8.000 GiB by its trace): 1.000 GiB held before it, 7.000 GiB "
                               "allocated during it in 2 blocks")
    assert lines[1].split() == ["5.000", "GiB", "in", "1", "blocks", "model.py:10", "forward:", "line10"]
    assert lines[2].split() == ["2.000", "GiB", "in", "1", "blocks", "model.py:20", "forward:", "line20"]
    assert len(lines) == 3


def test_memory_bound_bytes_of_the_pipeline_ranks_add_up_to_the_models():
    """Each pipeline rank counts the memory-bound traffic of its stages' ops: the two ranks of a
    (1, 2, 1) mesh together count what the same plan without stages counts, for as many
    microbatches count; each counts some, and a recomputed block counts its forward once more."""
    from autopar.planner.decide import decide

    inputs = example_inputs(TINY, BATCH, SEQ, device="meta")
    _, strategies, staged = decide(_meta_model(), (1, 2, 1), inputs, device="cpu", plan="megatron", microbatches=2)
    _, flat_strategies, flat = decide(_meta_model(), (1, 1, 1), inputs, device="cpu", plan="megatron", microbatches=2)
    ranks = [rehearsing.memory_bound_bytes(staged, pp, strategies) for pp in range(2)]
    whole = rehearsing.memory_bound_bytes(flat, 0, flat_strategies)
    assert min(ranks) > 0 and sum(ranks) == pytest.approx(whole)
    _, rs, recomputed = decide(_meta_model(), (1, 1, 1), inputs, device="cpu", plan="megatron", microbatches=2,
                               recompute="full")
    assert recomputed.recompute_regions and rehearsing.memory_bound_bytes(recomputed, 0, rs) > whole


# a meta model's capture makes its tables (rotary positions) from meta buffers, which the rank's program
# makes on its device: the cp rewrite traces the capture as it was made, so two devices never meet there
@pytest.mark.parametrize("attention", ["allgather", "ring"])
def test_cp_rank_of_a_meta_llama_runs_its_attention(attention):
    transformers = pytest.importorskip("transformers")
    from autopar.hf import causal_lm_loss
    cfg = transformers.LlamaConfig(vocab_size=96, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=SEQ,
                                   attn_implementation="sdpa")
    with torch.device("meta"):
        model = causal_lm_loss(transformers.LlamaForCausalLM(cfg))
    ids = torch.zeros(BATCH, SEQ, dtype=torch.long, device="meta")
    plan = autopar.rehearse(model, {"dp": 2, "cp": 2}, (ids, ids), rank=1, cp_attention=attention, **EAGER)
    (r,) = plan.rehearsals
    assert r.coords == "dp 0 cp 1"
    cp = {(c.kind, c.phase): c for c in r.collectives if c.axis == "cp" and c.count}
    if attention == "allgather":   # each layer gathers its keys and values, and reduce-scatters their gradients
        assert cp[("all_gather", "fwd")].count == 4 and cp[("all_gather", "fwd")].agrees
        assert cp[("reduce_scatter", "bwd")].count == 4 and cp[("reduce_scatter", "bwd")].agrees
    else:   # each layer passes its key/value block on once in the forward: a ring step, as the plan records it
        assert cp[("send_recv", "fwd")].count == 2 and cp[("send_recv", "fwd")].agrees and ("send_recv", "bwd") in cp


def test_a_rank_outside_the_world_is_refused():
    with pytest.raises(ValueError, match=r"rank=4 is outside the plan's world of 4 ranks.*from 0 to 3"):
        _rehearsed((1, 1, 4), rank=4, plan="megatron")


def test_a_rank_that_does_not_fit_says_by_how_much(monkeypatch):
    monkeypatch.setattr(rehearsing, "_capacity", lambda device: (1000.0, "this test's device"))
    with pytest.raises(ValueError, match=r"GiB more than this test's device holds"):
        autopar.rehearse(_meta_model(), (2, 1, 1), example_inputs(TINY, BATCH, SEQ, device="meta"), **EAGER)


def test_a_plan_priced_for_another_chip_warns():
    with pytest.warns(UserWarning, match="priced for 'h100' but runs here on 'cpu'.*different chips"):
        plan = autopar.rehearse(_meta_model(), (2, 1, 1), example_inputs(TINY, BATCH, SEQ, device="meta"),
                                **{**EAGER, "device": "h100"})
    assert plan.rehearsals[0].priced_on == "h100" and "priced for h100" in plan.summary()


def test_cli_rehearses_a_rank(tmp_path):
    (tmp_path / "tiny.py").write_text(
        "from autopar.examples.gpt import GPT, GPTConfig\n"
        "def make():\n"
        "    return GPT(GPTConfig(vocab_size=96, block_size=16, n_layer=2, n_head=4, n_embd=32))\n")
    out = tmp_path / "plan.json"
    done = cli_main("rehearse", f"{tmp_path / 'tiny.py'}:make", "--mesh", "2,1,2", "--rank", "3",
                             "--batch", "8", "--seq", "12", "--device", "cpu", "--compile", "aot_eager",
                             "--steps", "1", "--warmup", "1", "--plan", "megatron", "--out", str(out))
    assert done.returncode == 0, done.stderr
    assert "Rehearsed rank 3 (dp 1 tp 1; as asked)" in done.stdout
    assert Plan.from_json(out).rehearsals[0].rank == 3
    bad = cli_main("rehearse", f"{tmp_path / 'tiny.py'}:make", "--mesh", "2,1,2", "--rank", "9",
                            "--batch", "8", "--seq", "12", "--device", "cpu")
    assert bad.returncode == 2 and "outside the plan's world of 4 ranks" in bad.stderr


def test_the_gpu_script_plans_its_cases_without_a_gpu():
    """bench/rehearse_gpu.py: its cases list, and --dry plans a case in a child process as a run
    would (the Llama cases take a minute or so together: ``--dry`` with no case names)."""
    script = str(Path(__file__).resolve().parents[2] / "bench" / "rehearse_gpu.py")
    listed = cli.run([sys.executable, script, "--list"])
    assert listed.returncode == 0 and "70b-recipe" in listed.stdout, listed.stderr[-2000:]
    dry = cli.run([sys.executable, script, "--dry", "tiny"], timeout=300)
    assert dry.returncode == 0, dry.stderr[-3000:]
    assert "== tiny" in dry.stdout and "rank 0 (the fullest pipeline rank, pp 0" in dry.stdout
    bad = cli.run([sys.executable, script, "--dry", "nonesuch"])
    assert bad.returncode == 2 and "unknown case(s) nonesuch" in bad.stderr
