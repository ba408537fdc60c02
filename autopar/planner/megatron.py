"""The hand-written Megatron-LM plan, derived from the graph's structure.

Megatron-LM (Shoeybi et al. 2019; Korthikanti et al. 2022) shards by hand: in every
layer the first linear of attention (q, k, v, fused or not) and of the MLP is
column-parallel, the second row-parallel, so each pair needs one all-reduce
forward and one backward; the token embedding and the head are vocab-parallel;
norms are replicated. ``megatron_placements`` finds those roles in the captured
graph, never from module names:

- A linear (``aten.linear``, or ``aten.mm`` with a weight stored [in, out], GPT-2's
  Conv1D) is *column-parallel* when its output, split on its output features,
  can flow without any communication, through pointwise ops, head reshapes,
  transposes, splits, rotary embeddings and attention, until every path ends in
  either a linear that contracts over that split (*row-parallel*: it yields a
  partial sum) or a cross-entropy that takes its logits split on the vocabulary
  (the head). "Can flow" is what the sharding rules already say: each op on the
  path must have a strategy taking the incoming placement and giving a shard,
  the one the rewrite will run. A norm over the features, or the graph output,
  ends a path without a row-parallel linear, so the residual stream never
  becomes a region.
- The first linear's weight placement is the one its strategy reads: dim 0 of a
  [out, in] weight, dim 1 of a Conv1D's. When the output is split into q, k, v
  blocks before the heads (GPT-2's ``c_attn``: [q | k | v] along the features) only
  an interleaved shard ``S(dim)i3`` reaches the heads whole, and that is the one
  kept; a per-head fused layout ([heads, 3, head_dim], GPT-NeoX) is reached by the
  plain shard, each rank holding whole heads with their q, k and v.
- Grouped-query key/value projections with fewer heads than tp cannot reach
  attention split by heads (a rank would hold part of a head), so they stay
  replicated, as Megatron-LM and vLLM do; attention, after the key/value heads are
  repeated, is still split by query heads.
- Parameters the region's ops read besides the flowing value (a column linear's
  bias) take the placement the chosen strategy gives them; the token embedding
  (an embedding indexed by the input, not by positions) is vocab-parallel; every
  other parameter (norms, row-parallel biases, position embeddings) is replicated.

The activations' layout is then completed by the same solver with these
placements pinned, so hand-written and automatic plans go through the same passes.
"""
from __future__ import annotations

import torch
from torch.fx import Node

from autopar.graph.capture import Captured, input_free
from autopar.graph.rules import Strategy
from autopar.placement import P, R, Placement, Shard

aten = torch.ops.aten
_LINEARS = (aten.linear.default, aten.mm.default)


def _param_weight(node: Node, cap: Captured) -> Node | None:
    """The parameter a linear multiplies by (its weight), or None for another op."""
    if node.op != "call_function" or node.target not in _LINEARS or len(node.args) < 2:
        return None
    w = node.args[1]
    return w if isinstance(w, Node) and cap.param_of(w) is not None else None


def _flow(cap: Captured, start: Node, placement: Placement, options: dict[Node, list[Strategy]]):
    """Follow ``start``'s output laid out as ``placement`` through every consumer that keeps it
    sharded. Returns (row-parallel linears with their strategies, other parameters' placements)
    when every path ends in a row-parallel linear or a vocab-parallel loss; None otherwise."""
    at: dict[Node, Placement] = {start: placement}
    todo = [start]
    rows: dict[Node, Strategy] = {}
    params: dict[Node, Placement] = {}
    while todo:
        node = todo.pop()
        if not node.users:
            return None
        for user in node.users:
            if user.op != "call_function":
                return None   # the graph output wants it whole
            slots = [k for k, i in enumerate(user.all_input_nodes) if i is node]
            takes = [s for s in options.get(user, []) if all(s.inputs[k] == at[node] for k in slots)]
            if _param_weight(user, cap) is not None and user.args[0] is node and user.args[1] is not node:
                ends = [s for s in takes if s.output == P]
                if not ends:
                    return None
                rows[user] = ends[0]
                continue
            if any(s.local == "vocab_parallel_cross_entropy" for s in takes):
                continue
            onward = [s for s in takes if isinstance(s.output, Shard)]
            if not onward:
                return None
            s = onward[0]
            for k, i in enumerate(user.all_input_nodes):
                if k not in slots and cap.param_of(i) is not None:
                    if params.setdefault(i, s.inputs[k]) != s.inputs[k]:
                        return None
            if user in at:
                if at[user] != s.output:
                    return None
                continue
            at[user] = s.output
            todo.append(user)
    return rows, params


def megatron_placements(cap: Captured, options: dict[Node, list[Strategy]]) -> dict[str, Placement]:
    """Megatron's tp placement for every parameter of ``cap`` (see the module docstring), read off
    the graph's structure and the strategy ``options`` of its nodes; replicated where no role fits."""
    claims: dict[Node, set[Placement]] = {}
    rows: set[Node] = set()

    def claim(param: Node, pl: Placement) -> None:
        claims.setdefault(param, set()).add(pl)

    constant = input_free(cap.gm.graph)
    for node in cap.gm.graph.nodes:
        weight = _param_weight(node, cap)
        if weight is not None and node not in rows:
            slot = node.all_input_nodes.index(weight)
            for s in options.get(node, []):
                if not (isinstance(s.output, Shard) and isinstance(s.inputs[slot], Shard)):
                    continue
                found = _flow(cap, node, s.output, options)
                if found is None:
                    continue
                ends, params = found
                claim(weight, s.inputs[slot])
                for p, pl in params.items():
                    claim(p, pl)
                for row, rs in ends.items():
                    rows.add(row)
                    w = _param_weight(row, cap)
                    claim(w, rs.inputs[row.all_input_nodes.index(w)])
                break
        elif node.target is aten.embedding.default and node.args[1] not in constant:
            w = node.args[0]
            vocab = [s for s in options.get(node, []) if s.local == "vocab_parallel_embedding"]
            if cap.param_of(w) is not None and vocab:
                claim(w, vocab[0].inputs[0])
    # a tensor asked for in two layouts (a weight shared between roles) is left whole
    return {fqn: next(iter(claims[n])) if len(claims.get(n, ())) == 1 else R for fqn, n in cap.params.items()}


def megatron_options(cap: Captured, options: dict, sequence_parallel: bool) -> dict:
    """Strategy options restricted to Megatron's: its parameter placements taken as they lie,
    the loss computed vocab-parallel (the logits are never gathered), and with sequence
    parallelism every activation of the transformer layers outside their tensor-parallel
    regions sharded on sequence (the embeddings' layout is left to the solver)."""
    from autopar.graph.rules import dim_labels
    from autopar.graph.units import find_blocks
    from autopar.planner.sharding import pin_parameters

    out = pin_parameters(options, cap, megatron_placements(cap, options))
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
