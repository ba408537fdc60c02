"""The hand-written Megatron-LM plan, expressed as parameter placements.

Megatron-LM (Shoeybi et al. 2019; Korthikanti et al. 2022) shards by hand: the first
linear of attention (fused q,k,v) and of the MLP column-parallel, the second
row-parallel, the embedding and the head vocab-parallel, norms replicated.
``megatron_placements`` names those choices per parameter from the usual module
names; the activations' layout is then completed by the same solver with these
placements pinned, so hand-written and automatic plans go through the same passes.

A weight multiplied as the right operand of ``mm`` (GPT-2's Conv1D) is stored
[in, out], so its column and row shards are on the other dim. A column-parallel
projection whose output cannot reach its head reshape sharded (grouped-query
attention's key/value projections when tp exceeds the key/value heads: a rank would
hold part of a head) is replicated instead, as Megatron-LM and vLLM do; attention,
after the key/value heads are repeated, is still split by query heads.
"""
from __future__ import annotations

import torch
from torch.fx import Node

from autopar.passes.capture import Captured
from autopar.passes.rules import POINTWISE, Strategy, shape
from autopar.placement import R, Placement, Shard

aten = torch.ops.aten
_RESHAPES = (aten.view.default, aten.reshape.default, aten._unsafe_view.default)

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
        matrix = kind == "weight" and len(shape(node)) == 2
        out_dim = 1 if matrix and _stored_in_out(node) else 0
        if any(n.rpartition(".")[0].rpartition(".")[2] in VOCAB for n in names) and kind == "weight":
            out[fqn] = Shard(0)
        elif leaf in COLUMN:
            out[fqn] = Shard(out_dim, k)
        elif leaf in ROW and matrix:
            out[fqn] = Shard(1 - out_dim)
        else:
            out[fqn] = R
    return out


def _stored_in_out(weight: Node) -> bool:
    """Whether a weight is the right operand of ``mm``, i.e. stored [in, out] (Conv1D)."""
    return any(u.target is aten.mm.default and u.args[1] is weight for u in weight.users)


def _reaches_heads(weight: Node, pl: Placement, options: dict[Node, list[Strategy]]) -> bool:
    """Whether a column-parallel weight's output can stay sharded up to the reshape that splits
    it into heads (through pointwise ops such as its bias add)."""
    for user in weight.users:
        slot = user.all_input_nodes.index(weight)
        outs = [s.output for s in options.get(user, []) if s.inputs[slot] == pl]
        if not outs:
            return False
        node, out = user, outs[0]
        while len(node.users) == 1:
            (nxt,) = node.users
            slot = nxt.all_input_nodes.index(node)
            takes = [s for s in options.get(nxt, []) if s.inputs[slot] == out]
            if nxt.target in _RESHAPES:
                if not takes:
                    return False
                break
            if nxt.target not in POINTWISE or not takes:
                break
            node, out = nxt, takes[0].output
    return True


def megatron_options(cap: Captured, options: dict, sequence_parallel: bool) -> dict:
    """Strategy options restricted to Megatron's: its parameter placements taken as they lie,
    the loss computed vocab-parallel (the logits are never gathered), and with sequence
    parallelism every activation of the transformer layers outside their tensor-parallel
    regions sharded on sequence (the embeddings' layout is left to the solver)."""
    from autopar.passes.rules import dim_labels
    from autopar.planner import find_blocks, pin_parameters

    placements = megatron_placements(cap)
    split_heads = {fqn.rpartition(".")[0]: _reaches_heads(cap.params[fqn], pl, options)
                   for fqn, pl in placements.items() if fqn.endswith(".weight") and isinstance(pl, Shard)
                   and fqn.rpartition(".")[0].rpartition(".")[2] in COLUMN}
    for fqn in placements:
        if not split_heads.get(fqn.rpartition(".")[0], True):
            placements[fqn] = R
    out = pin_parameters(options, cap, placements)
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
