"""The one memory sum (``cost_model.memory``, ``cost_model.terms.rank_peaks``) and the stage DP's bound
derived from it: per cut, the DP's figure for a rank is the rank's peak less its largest transient
(and ZeRO-2/3's gathered weights), so a cut the DP refuses cannot fit; and the bytes per parameter
of ``cost_model.state``'s table."""
from __future__ import annotations

import itertools

import pytest
import sympy
import torch

from autopar.cost_model.devices import get_device
from autopar.cost_model.memory import cut_memory, unit_memory
from autopar.cost_model.stages import unit_costs
from autopar.cost_model.state import state_bytes, state_bytes_per_param_byte, state_floor
from autopar.cost_model.terms import rank_peaks
from autopar.examples.gpt import build, example_inputs
from autopar.graph.precision import working_copy_ratio
from autopar.graph.units import layer_units
from autopar.mesh import Mesh
from autopar.planner.decide import decide
from autopar.planner.recompute import regions_for
from autopar.planner.stage_dp import evaluate_cut


def _llama():
    transformers = pytest.importorskip("transformers")
    from autopar.hf import causal_lm_loss
    cfg = transformers.LlamaConfig(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=4,
                                   num_attention_heads=4, num_key_value_heads=2, attn_implementation="sdpa")
    with torch.device("meta"):
        model = causal_lm_loss(transformers.LlamaForCausalLM(cfg))
    ids = torch.zeros(8, 64, dtype=torch.long, device="meta")
    return model, (ids, ids)


def _gpt():
    model = build("gpt2", device="meta", n_layer=4, n_embd=128, n_head=4, block_size=64, vocab_size=512)
    return model, example_inputs(model.config, 8, 64, device="meta")


def _cuts(n: int, stages: int):
    """Every cut of ``n`` units into ``stages`` non-empty runs."""
    for ends in itertools.combinations(range(1, n), stages - 1):
        edges = (0, *ends, n)
        yield tuple(zip(edges[:-1], edges[1:]))


@pytest.mark.parametrize("make", [_gpt, _llama], ids=["gpt", "llama"])
@pytest.mark.parametrize("mesh, knobs", [
    ({"pp": 2, "tp": 2}, dict(microbatches=4)),
    ({"pp": 2, "tp": 2}, dict(microbatches=4, schedule="Interleaved1F1B", precision="bf16")),
    ({"dp": 2, "pp": 2}, dict(microbatches=2, zero=1, recompute="selective")),
    ({"dp": 2, "pp": 2}, dict(microbatches=2, zero=3, precision="bf16")),
    ({"pp": 2, "cp": 2}, dict(microbatches=2, cp_attention="allgather")),
    ({"pp": 2, "cp": 2}, dict(microbatches=2, cp_attention="ring", recompute="full")),
], ids=["1f1b", "interleaved-bf16", "zero1-selective", "zero3-bf16", "cp-allgather", "cp-ring-full"])
def test_the_stage_dps_figure_is_the_peak_less_the_transient(make, mesh, knobs):
    model, inputs = make()
    cap, strategies, plan = decide(model, mesh, inputs, device="h100", **knobs)
    mesh = Mesh.of_plan(plan)
    units = layer_units(cap)
    regions = regions_for(cap, plan.recompute)
    time, boundary, _ = unit_costs(cap, strategies, units, mesh, get_device("h100"), gpus_per_node=8)
    static, act = unit_memory(cap, strategies, units, mesh, zero=plan.zero, working_copy=working_copy_ratio(cap),
                              regions=regions, attention=plan.cp_attention)
    checked = 0
    for bounds in _cuts(len(units), mesh.pp * plan.virtual_stages):
        dp = evaluate_cut(bounds, time, static, act, boundary, p=mesh.pp, m=plan.microbatches, v=plan.virtual_stages,
                          schedule=plan.schedule).rank_memory
        memory = cut_memory(cap, strategies, mesh, bounds=bounds, microbatches=plan.microbatches,
                            virtual=plan.virtual_stages, schedule=plan.schedule, zero=plan.zero, regions=regions,
                            attention=plan.cp_attention)
        for r in range(mesh.pp):
            mine = memory[r::mesh.pp]
            without = memory[r].peak - max(m.transient for m in mine)
            if plan.zero >= 2:   # the gathered weights are a stage's, not a unit's: the DP leaves them out
                assert dp[r] < without, (bounds, r)
            else:
                assert dp[r] == pytest.approx(without, rel=1e-9), (bounds, r)
            checked += 1
    assert checked >= 2 * mesh.pp


def test_a_rank_holds_all_its_stages_and_one_transient():
    """The one peak sum: a rank's peak is its stages' terms plus the largest of their transients, and the
    symbolic costs' sympy terms add up through the same function."""
    held = [[1.0, 2.0], [3.0], [4.0, 0.5], [6.0]]
    transients = [0.25, 2.0, 1.0, 0.5]
    assert rank_peaks(held, transients, 2) == [8.5, 11.0, 8.5, 11.0]   # ranks 0: stages 0 and 2; 1: 1 and 3
    assert rank_peaks(held[:2], transients[:2], 2) == [3.25, 5.0]
    x = sympy.Symbol("x", positive=True)
    peaks = rank_peaks([[x, 1], [2 * x]], [x, 3], 1, add=lambda t: sympy.Add(*t), maximum=lambda t: sympy.Max(*t))
    assert float(peaks[0].subs(x, 5.0)) == 5 + 1 + 10 + 5


def test_an_interleaved_plans_peak_is_its_ranks():
    """With two stages per pipeline rank, every stage's peak is its rank's (both stages' state and
    activations, one backward's transient), and the stage's pipeline figure is that peak."""
    model, inputs = _gpt()
    _, _, plan = decide(model, (1, 2, 1), inputs, microbatches=4, schedule="Interleaved1F1B", device="h100")
    assert len(plan.stages) == 4
    for s, mem in enumerate(plan.memory):
        mine = plan.memory[s % 2::2]
        assert mem.peak == pytest.approx(sum(m.params + m.grads + m.optimizer + m.activations for m in mine)
                                         + max(m.transient for m in mine), rel=1e-12)
        assert plan.stages[s].memory_bytes == mem.peak


@pytest.mark.parametrize("zero, shards, w, offload, per_param", [
    (0, 1, 0.0, False, (4, 4, 8, 0)),            # fp32: 16 bytes per parameter
    (1, 4, 0.0, False, (5, 4, 2, 0)),            # fp32 ZeRO-1: the moments and the stepped fp32 slice over d
    (0, 1, 0.5, False, (2, 4, 12, 0)),           # bf16: 16-bit weights, fp32 gradient buffer, master + moments
    (1, 4, 0.5, False, (2, 4, 3, 0)),            # bf16 ZeRO-1: Megatron's 2 + 4 + 12/d
    (2, 4, 0.5, False, (1, 1, 2, 0)),            # ZeRO-2/3: all of it over d (gathered weights apart)
    (0, 1, 0.5, True, (2, 2, 0, 12)),            # offload: 16-bit weights and gradients on the device
    (3, 4, 0.0, True, (1, 1, 0, 3)),
])
def test_the_bytes_per_parameter_table(zero, shards, w, offload, per_param):
    per = state_bytes(zero, shards, w, offload)
    assert tuple(4 * x for x in (per.weights, per.grads, per.optimizer, per.host)) == pytest.approx(per_param)
    mesh = Mesh(shards, 1, 1)
    assert state_bytes_per_param_byte(mesh, zero, w, offload) == pytest.approx(per.weights + per.grads + per.optimizer)
    if not offload:   # the floors are not derived with the optimizer offloaded
        assert state_floor(4.0, mesh, zero, w, 2, 1) == pytest.approx(4 * (per.weights + per.grads + per.optimizer))
