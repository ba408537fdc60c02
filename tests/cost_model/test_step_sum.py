"""The step sum: every term is seconds spent (none negative), the communication outside the pipeline's
makespan is exactly the dp and cp terms, and a collective across nodes runs on as many NICs per node
as its group has ranks there."""
from __future__ import annotations

import pytest
import torch

import autopar
import autopar.hf
from autopar.cost_model.comm import axis_links, collective_time
from autopar.cost_model.devices import get_device
from autopar.cost_model.terms import StepTerms


def test_a_negative_term_is_refused():
    with pytest.raises(ValueError, match="step term dp = -0.5 s is negative"):
        StepTerms(compute=1.0, dp=-0.5)
    assert StepTerms(compute=1.0, tp=0.25, cp=0.5, pipelined=True).comm_s == 0.5


def _llama(layers: int = 4):
    """A small Llama with grouped-query attention on the meta device, and a batch of 8 sequences of 512 tokens."""
    from transformers import LlamaConfig, LlamaForCausalLM
    cfg = LlamaConfig(hidden_size=512, intermediate_size=1024, num_hidden_layers=layers, num_attention_heads=8,
                      num_key_value_heads=2, vocab_size=2048, max_position_embeddings=512)
    with torch.device("meta"):
        model = autopar.hf.causal_lm_loss(LlamaForCausalLM(cfg))
    idx = torch.zeros(8, 512, dtype=torch.long, device="meta")
    return model, (idx, idx)


def test_pipelined_cp_tp_step_adds_up_without_negative_communication():
    """NVIDIA's 70B recipe in small (pp, cp and tp at once, interleaved): its summary once printed a
    negative communication, the tp term removed from the communication although the pipeline's makespan
    holds it. The communication is dp + cp, each term >= 0, and the step is the sum of the terms."""
    model, inputs = _llama()
    plan = autopar.plan(model, {"dp": 1, "pp": 2, "cp": 2, "tp": 2}, inputs, precision="bf16", zero=1,
                        sequence_parallel=True, schedule="Interleaved1F1B", virtual_stages=2, microbatches=4,
                        memory_budget="10TB")
    t = plan.step_terms
    assert t.pipelined and t.tp > 0 and t.cp > 0 and t.pp > 0
    assert all(v >= 0 for v in t.as_dict().values()), t
    assert plan.predicted_comm_s == pytest.approx(t.dp + t.cp, rel=1e-12)
    assert plan.predicted_comm_s >= t.cp
    assert plan.predicted_compute_s == pytest.approx(t.compute + t.tp + t.pp + t.bubble, rel=1e-12)
    assert plan.predicted_step_time == pytest.approx(sum(t.as_dict().values()), rel=1e-12)
    assert "communication -" not in plan.summary()


def test_a_pipeline_rank_prices_the_cp_traffic_of_its_own_layers():
    """Each pipeline rank gathers the keys and values of its own attentions, all ranks at once: the step's
    cp term is one rank's, so twice the stages on the same layers halve it (about: the cuts differ)."""
    model, inputs = _llama(layers=8)
    cp = {pp: autopar.plan(model, {"dp": 1, "pp": pp, "cp": 2, "tp": 1}, inputs, precision="bf16", zero=1,
                           microbatches=4, memory_budget="10TB", cp_attention="allgather").step_terms.cp
          for pp in (2, 4)}
    assert 0.4 < cp[4] / cp[2] < 0.7, cp


@pytest.mark.parametrize("size, inner, links", [(48, 1, 8), (48, 2, 4), (48, 8, 1), (2, 32, 1), (4, 2, 0), (1, 64, 0)])
def test_axis_links_count_a_groups_ranks_per_node(size, inner, links):
    assert axis_links(size, inner, 8) == links


def test_a_dp_of_whole_nodes_crosses_on_every_nic():
    """A DGX H100 has a 400 Gb/s NIC per GPU: a ring over 16 ranks, 8 per node, crosses on 8 NICs at once
    (up to the NVLink fabric), one over 2 ranks a node apart on one."""
    dev = get_device("h100")
    nbytes = 1e9
    one = collective_time("all_reduce", nbytes, 16, dev, 1)
    assert one == collective_time("all_reduce", nbytes, 16, dev, True)
    eight = collective_time("all_reduce", nbytes, 16, dev, 8)
    wire = 2 * 15 / 16 * nbytes
    alpha = dev.collective_params("all_reduce", True)[0] * 2 * 15
    assert one == pytest.approx(wire / dev.inter_node_bw + alpha)
    assert eight == pytest.approx(wire / min(8 * dev.inter_node_bw, dev.collective_params("all_reduce", False)[1])
                                  + alpha)
    assert eight < one / 4
