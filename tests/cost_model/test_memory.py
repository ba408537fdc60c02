"""The activation memory model against Korthikanti et al. 2022, Table 2 (per layer, 16-bit)."""
from __future__ import annotations

import pytest
import torch

from autopar.planner.decide import decide
from autopar.cost_model.activations import activation_bytes, attention_core
from autopar.examples.gpt import build
from autopar.graph.units import find_blocks
from autopar.planner.sharding import with_regather


def _per_layer(s, b, h, a, t, sp, selective, attention="explicit"):
    """Bytes one layer keeps for backward, over s*b*h, from the traced graph under the plan."""
    model = build("gpt3-1.3b", device="meta", n_layer=2, n_embd=h, n_head=a, block_size=s, vocab_size=512,
                  attention=attention, dropout=0.1).to(torch.bfloat16)
    inputs = tuple(torch.empty(b, s, dtype=torch.long, device="meta") for _ in range(2))
    cap, strategies, _ = decide(model, (1, 1, t), inputs, plan="megatron" if t > 1 else "auto",
                                sequence_parallel=sp)
    if sp:   # the paper's sequence-parallel rows keep the linears' inputs sharded
        strategies = with_regather(strategies)
    block = find_blocks(cap)[0]
    regions = [attention_core(block)] if selective else []
    return activation_bytes(block, strategies, t, regions) / (s * b * h)


TABLE_2 = {   # (tp, sequence parallel, selective recompute) -> bytes / (s b h)
    (1, False, False): lambda a, s, h, t: 34 + 5 * a * s / h,
    ("t", False, False): lambda a, s, h, t: 10 + 24 / t + 5 * a * s / (h * t),
    ("t", True, False): lambda a, s, h, t: (34 + 5 * a * s / h) / t,
    ("t", False, True): lambda a, s, h, t: 10 + 24 / t,
    ("t", True, True): lambda a, s, h, t: 34 / t,
}
SHAPES = [(2048, 4, 6144, 64, 8),     # the paper's 22B model (a=64, h=6144, s=2048, t=8)
          (2048, 2, 12288, 96, 8),    # GPT-3 175B shapes
          (1024, 8, 2048, 16, 4),
          (512, 4, 1024, 16, 2)]


@pytest.mark.parametrize("s,b,h,a,t", SHAPES)
@pytest.mark.parametrize("row", list(TABLE_2), ids=lambda r: f"tp={r[0]}-sp={r[1]}-selective={r[2]}")
def test_table_2(s, b, h, a, t, row):
    tp = 1 if row[0] == 1 else t
    got = _per_layer(s, b, h, a, tp, row[1], row[2])
    want = TABLE_2[row](a, s, h, tp)
    assert got == pytest.approx(want, rel=0.01), f"{got:.3f} sbh vs Table 2's {want:.3f} sbh"


def test_fused_attention_replaces_the_score_term():
    """With scaled_dot_product_attention nothing of size a*s*s is kept: 36 + 4a/h per layer."""
    s, b, h, a = 2048, 4, 6144, 64
    got = _per_layer(s, b, h, a, 1, False, False, attention="sdpa")
    assert got == pytest.approx(36 + 4 * a / h, rel=0.01)


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_peak_walks_the_backward(precision):
    """The peak counts gradients only when they outlive a backward (several microbatches, or the
    fp32 buffer 16-bit weights keep), and the backward's excess lies between nothing and the sum of
    every gradient and the largest transient."""
    from autopar.cost_model.backward import backward_transient
    from autopar.examples.gpt import example_inputs

    model = build("tiny", device="meta", n_layer=2, block_size=64)
    param_bytes = 4.0 * sum(p.numel() for p in model.parameters())
    mems = {}
    for m in (1, 2):
        cap, strategies, plan = decide(model, (1, 1, 1), example_inputs(model.config, 8, 64, device="meta"),
                                       device="cpu", precision=precision, microbatches=m)
        mem = plan.memory[0]
        assert mem.peak == pytest.approx(mem.params + mem.grads + mem.optimizer + mem.activations + mem.transient)
        largest = max(backward_transient(n, strategies, 1) for n in strategies if n.op == "call_function")
        assert 0 <= mem.transient <= param_bytes + 2 * largest
        mems[m] = mem, largest
    (one, largest), (two, _) = mems[1], mems[2]
    assert one.grads == (0 if precision == "fp32" else pytest.approx(param_bytes))
    assert two.grads == pytest.approx(param_bytes)
    if precision == "bf16":   # 16-bit weights, the fp32 master and both moments (2 + 4 + 12 bytes per parameter)
        assert (one.params, one.optimizer) == pytest.approx((param_bytes / 2, 3 * param_bytes))
    # one microbatch's gradients arrive while its activations are freed, and the loss's gradient
    # buffers come after the logits die: less than holding every gradient and the largest transient
    assert one.peak < one.params + param_bytes + one.optimizer + one.activations + largest


def test_tied_head_keeps_its_gradient_operands_to_the_sum():
    """A tied table's gradient is one sum, made where the backward reaches the embedding (Inductor
    folds the head's weight-gradient matmul into it): until then the logits' gradient and the head's
    input stay alive and the table's gradient does not exist; weights gathered per unit (ZeRO-2/3)
    reduce each use's gradient apart, as the walk without the sum counts them."""
    from autopar.cost_model.activations import compiled_kept
    from autopar.cost_model.backward import backward_excess
    from autopar.examples.gpt import example_inputs

    model = build("tiny", device="meta", n_layer=2, block_size=64, vocab_size=512)
    cap, strategies, _ = decide(model, (1, 1, 1), example_inputs(model.config, 8, 64, device="meta"), device="cpu")
    nodes = [n for n in cap.gm.graph.nodes if n.op == "call_function"]
    kept = compiled_kept(nodes, strategies, 1)
    grads = {p: 4.0 * p.meta["val"].numel() for p in cap.params.values()}
    summed = dict(backward_excess(nodes, kept, strategies, 1, grads, False))
    apart = dict(backward_excess(nodes, kept, strategies, 1, grads, False, whole_weights=False))
    table = next(p for p in cap.params.values() if len(p.users) > 1)
    head = next(u for u in table.users if u.target is torch.ops.aten.linear.default)
    before = max((n for n in summed if nodes.index(n) < nodes.index(head)), key=nodes.index)   # the last block's
    logits_grad, head_input = (4.0 * t.meta["val"].numel() for t in (head, head.args[0]))
    assert summed[head] == pytest.approx(apart[head] - grads[table])
    assert summed[before] == pytest.approx(apart[before] + logits_grad + head_input - grads[table])


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_a_vocab_parallel_loss_holds_its_fp32_gradient(precision):
    """Over logits sharded by vocabulary the loss's backward scatters its gradient into an fp32 (N, V/tp)
    buffer beside the kept logits (Inductor on CPU: a scaled-down Llama-3-8B rank at tp 8, bf16,
    predicted 68.18 MiB without it against 96.09 MiB measured, 96.51 MiB with it); a whole-vocabulary
    loss writes its gradient into its logits."""
    from autopar.cost_model.backward import backward_transient
    from autopar.examples.gpt import example_inputs

    model = build("tiny", device="meta", n_layer=2, block_size=64, vocab_size=4096)
    rows = 8 * 64
    for tp in (1, 4):
        cap, strategies, plan = decide(model, (1, 1, tp), example_inputs(model.config, 8, 64, device="meta"),
                                       device="cpu", precision=precision, plan="megatron" if tp > 1 else "auto")
        (loss,) = [n for n in strategies if n.target is torch.ops.aten.cross_entropy_loss.default]
        assert (strategies[loss].local == "vocab_parallel_cross_entropy") == (tp > 1)
        fp32_grad = 4.0 * rows * 4096 / tp
        assert backward_transient(loss, strategies, tp) == (fp32_grad if tp > 1 else 0.0)
        if tp > 1:   # the step's largest rise: the logits dominate this model's activations
            assert plan.memory[0].transient >= fp32_grad


def test_zero3_reduce_scatters_each_whole_gradient_in_fp32():
    """Under ZeRO-3 a weight's whole gradient exists at the compute dtype and again in fp32, the dtype its
    reduce-scatter sums in (``collectives.gather_param``); an untied embedding sums its table's in fp32
    (Inductor on CPU, bf16, a 70B-shaped Llama at (64, 1, 1): two fp32 tables at the end of the backward,
    and after the head's logits gradient dies, its weight's gradient at 16 bits and in fp32). With few
    tokens the end of the backward is the largest rise: the two tables, beside the shards' gradients."""
    transformers = pytest.importorskip("transformers")
    from autopar.hf import causal_lm_loss

    vocab, hidden = 4096, 64
    cfg = transformers.LlamaConfig(vocab_size=vocab, hidden_size=hidden, intermediate_size=128, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=1, max_position_embeddings=8)
    with torch.device("meta"):
        model = causal_lm_loss(transformers.LlamaForCausalLM(cfg))
    ids = torch.zeros(4, 8, dtype=torch.long, device="meta")
    tables = 2 * 4.0 * vocab * hidden
    for zero in (1, 3):
        _, _, plan = decide(model, (4, 1, 1), (ids, ids), device="cpu", precision="bf16", zero=zero,
                            keep_gathered=() if zero == 3 else "auto")
        if zero == 3:
            assert plan.memory[0].transient >= tables
        else:   # the 16-bit parameters' gradients go into the fp32 buffer, the table's too
            assert plan.memory[0].transient < tables / 2


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_a_recomputed_block_is_made_again_in_its_backward(precision):
    """When the backward reaches a recomputed block its forward runs again: what the block keeps
    without recompute is alive again there, beside the other blocks' inputs (Inductor on CPU: a
    70B-shaped Llama rank under full recompute peaked at 1.85 times a plan without it, 23.54 MiB
    against 12.75; 22.97 with it)."""
    from autopar.examples.gpt import example_inputs

    layers = 4
    model = build("tiny", device="meta", n_layer=layers, block_size=128)
    mems = {r: decide(model, (1, 1, 1), example_inputs(model.config, 8, 128, device="meta"), device="cpu",
                      recompute=r, precision=precision)[2].memory[0] for r in ("none", "full")}
    block = (mems["none"].activations - mems["full"].activations) / layers   # one block's activations
    assert mems["full"].transient >= block > mems["none"].transient
