"""The hand-written Megatron-LM plan, expressed as parameter placements.

Megatron-LM (Shoeybi et al. 2019; Korthikanti et al. 2022) shards by hand: the first
linear of attention (fused q,k,v) and of the MLP column-parallel, the second
row-parallel, the embedding and the head vocab-parallel, norms replicated.
``megatron_placements`` names those choices per parameter from the usual module
names; the activations' layout is then completed by the same solver with these
placements pinned, so hand-written and automatic plans go through the same passes.
"""
from __future__ import annotations

from autopar.passes.capture import Captured
from autopar.passes.rules import shape
from autopar.placement import R, Placement, Shard

FUSED_QKV = ("c_attn", "query_key_value", "qkv_proj", "Wqkv")
COLUMN = FUSED_QKV + ("c_fc", "q_proj", "k_proj", "v_proj", "gate_proj", "up_proj", "dense_h_to_4h",
                      "fc1", "w1", "w3", "wq", "wk", "wv")
ROW = ("c_proj", "o_proj", "out_proj", "down_proj", "dense_4h_to_h", "fc2", "w2", "wo")
VOCAB = ("wte", "embed_tokens", "word_embeddings", "tok_embeddings", "lm_head")


def megatron_placements(cap: Captured) -> dict[str, Placement]:
    """Megatron's tp placement for every parameter of ``cap`` (replicated when no rule names it)."""
    out = {}
    for fqn, node in cap.params.items():
        names = [fqn, *cap.aliases.get(fqn, [])]
        module, _, kind = fqn.rpartition(".")
        leaf = module.rpartition(".")[2]
        k = 3 if leaf in FUSED_QKV else 1
        if any(n.rpartition(".")[0].rpartition(".")[2] in VOCAB for n in names) and kind == "weight":
            out[fqn] = Shard(0)
        elif leaf in COLUMN:
            out[fqn] = Shard(0, k)
        elif leaf in ROW and kind == "weight" and len(shape(node)) == 2:
            out[fqn] = Shard(1)
        else:
            out[fqn] = R
    return out


def megatron_options(cap: Captured, options: dict, sequence_parallel: bool) -> dict:
    """Strategy options restricted to Megatron's: its parameter placements taken as they lie,
    the loss computed vocab-parallel (the logits are never gathered), and with sequence
    parallelism every activation of the transformer layers outside their tensor-parallel
    regions sharded on sequence (the embeddings' layout is left to the solver)."""
    from autopar.passes.rules import dim_labels
    from autopar.planner import find_blocks, pin_parameters

    out = pin_parameters(options, cap, megatron_placements(cap))
    labels = dim_labels(cap.gm, cap.inputs)
    in_layers = {n for block in find_blocks(cap) or [] for n in block}

    def on_seq(node, s):
        return isinstance(s.output, Shard) and labels.get(node, ())[s.output.dim:s.output.dim + 1] == ("seq",)

    for node, opts in out.items():
        keep = [s for s in opts if s.local == "vocab_parallel_cross_entropy"]
        if not keep and sequence_parallel and node in in_layers and node.op == "call_function":
            keep = [s for s in opts if s.output != R] if any(on_seq(node, s) for s in opts) else []
        out[node] = keep or opts
    return out
