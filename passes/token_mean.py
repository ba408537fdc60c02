"""A loss that is a mean over tokens, made exact over data-parallel ranks and microbatches.

A step's loss is the unsharded model's: a mean over the counted tokens of the whole global batch.
Each rank computes its loss on some of them (its dp rows, its cp chunks, one microbatch at a time)
and the runtime averages the ranks' and microbatches' losses and gradients. That average is the
global mean only when every (rank, microbatch) counts the same tokens; targets padded with
``ignore_index`` make the counts differ, and a rank whose rows are all padding divides 0 by 0.

So each token mean the graph shows is rewritten into this rank's token sum times a scale the
runtime feeds every step (a placeholder fed as a buffer, ``scale_name``), ``ranks / tokens``:
``tokens`` the count over the whole step (every microbatch of every dp rank), ``ranks`` the number
of losses the runtime averages (dp x cp x microbatches). Their average is (the sum over every
token) / tokens: the unsharded loss, and by linearity its gradients. A token mean is

- a cross-entropy or nll loss with reduction "mean": its count is the targets that are not
  ``ignore_index`` (with class weights, the sum of their targets' weights), as aten divides by;
- a quotient ``a / d`` of a parameter-dependent scalar by a 0-d count that depends on the inputs
  alone (a masked mean, ``(loss * mask).sum() / mask.sum()``): its count is ``d``.

A loss with reduction "sum" is a sum over the whole batch: its scale is ``ranks``.
``token_count_graph`` is the part of the captured graph that computes the means' counts from a
microbatch's inputs: the runtime runs it on every microbatch of the step, sums and all-reduces
over dp (the cp ranks of one dp rank see the same whole sequences) and writes the scales.
"""
from __future__ import annotations

import operator
from dataclasses import dataclass

import torch
from torch.fx import Graph, GraphModule, Node

from autopar.graph.capture import copy_graph

aten = torch.ops.aten

# the loss ops, whose arguments 2-4 are (weight, reduction, ignore_index), with these defaults
TOKEN_LOSS_OPS = _LOSSES = {aten.cross_entropy_loss.default, aten.nll_loss.default, aten.nll_loss_nd.default}
_NAMES = {2: "weight", 3: "reduction", 4: "ignore_index"}
_DEFAULTS = {2: None, 3: 1, 4: -100}
MEAN, SUM = 1, 2
SCALE_PREFIX = "autopar_token_scale_"


@dataclass(frozen=True)
class TokenLoss:
    """A loss node of the captured graph whose value is a mean (or sum) over tokens."""

    node: str                 # its name in the captured graph
    kind: str                 # "loss": a cross-entropy or nll loss; "ratio": a / d
    reduction: int            # MEAN or SUM

    @property
    def counted(self) -> bool:
        return self.reduction == MEAN


def scale_name(k: int) -> str:
    """The FQN the runtime feeds the k-th token mean's scale under (a buffer of the rank's graph)."""
    return f"{SCALE_PREFIX}{k}"


def is_token_sum(node: Node) -> bool:
    """Whether ``node`` is a token sum that ``token_mean_pass`` multiplies by a fed scale."""
    return any(u.target is operator.mul and isinstance(u.args[1], Node) and u.args[1].op == "placeholder"
               and str(u.args[1].meta.get("fqn", "")).startswith(SCALE_PREFIX) for u in node.users)


def _arg(n: Node, position: int):
    """Argument 2, 3 or 4 of a loss op (weight, reduction, ignore_index), given or by default."""
    if len(n.args) > position:
        return n.args[position]
    return n.kwargs.get(_NAMES[position], _DEFAULTS[position])


def _depends(graph: Graph, kinds: set[str]) -> set[Node]:
    """The nodes that depend on a placeholder of one of ``kinds`` ("param", "input", "buffer")."""
    found: set[Node] = set()
    for n in graph.nodes:
        if (n.op == "placeholder" and n.meta.get("kind") in kinds) or any(a in found for a in n.all_input_nodes):
            found.add(n)
    return found


def token_losses(gm: GraphModule) -> list[TokenLoss]:
    """The token means (and token sums) of ``gm``'s loss, in graph order."""
    on_params, on_inputs = _depends(gm.graph, {"param"}), _depends(gm.graph, {"input"})
    found = []
    for n in gm.graph.nodes:
        if n.op != "call_function" or n not in on_params:
            continue
        if n.target in _LOSSES:
            reduction, weight = _arg(n, 3), _arg(n, 2)
            if reduction in (MEAN, SUM) and (weight is None or weight not in on_params):
                found.append(TokenLoss(n.name, "loss", reduction))
        elif (n.target is aten.div.Tensor and isinstance(n.args[1], Node) and n.args[1] in on_inputs
              and n.args[1] not in on_params and _is_scalar(n.args[1]) and _is_scalar(n)):
            found.append(TokenLoss(n.name, "ratio", MEAN))
    return found


def _is_scalar(n: Node) -> bool:
    val = n.meta.get("val")
    return isinstance(val, torch.Tensor) and val.dim() == 0


def token_mean_pass(gm: GraphModule) -> GraphModule:
    """Make each token mean (or sum) of the loss this rank's token sum times a scale fed every step."""
    out = copy_graph(gm, lazy=True)   # the planner's cp check only reads it
    g = out.graph
    by_name = {n.name: n for n in g.nodes}
    last_input = [n for n in g.nodes if n.op == "placeholder"][-1]
    for k, loss in enumerate(token_losses(gm)):
        n = by_name[loss.node]
        users = list(n.users)
        if loss.kind == "loss":
            args = list(n.args) + [_arg(n, p) for p in range(len(n.args), 5)]
            args[3] = SUM
            n.args = tuple(args)
            n.kwargs = {key: v for key, v in n.kwargs.items() if key not in _NAMES.values()}
            summed = n
        else:
            summed = n.args[0]
        with g.inserting_after(last_input):
            scale = g.placeholder(scale_name(k))
        scale.meta.update(kind="buffer", fqn=scale_name(k), val=_scalar_like(n.meta.get("val")))
        last_input = scale
        with g.inserting_after(n):
            new = g.call_function(operator.mul, (summed, scale))
        new.meta.update(val=n.meta.get("val"), module_path=n.meta.get("module_path", ""),
                        origin=n.meta.get("origin", n.name))
        for u in users:
            if u is not new:
                u.replace_input_with(n, new)
        if loss.kind == "ratio":
            g.erase_node(n)
    g.eliminate_dead_code()
    out.recompile()
    return out


def _scalar_like(val) -> torch.Tensor:
    """A 0-d fp32 value like ``val`` (fake or meta as it is): the scale's traced value."""
    if isinstance(val, torch.Tensor):
        return val.new_empty((), dtype=torch.float32)
    return torch.empty((), dtype=torch.float32, device="meta")


def token_count_graph(gm: GraphModule) -> GraphModule | None:
    """The counts of ``gm``'s token means as a 1-D float64 tensor, computed from its inputs and buffers
    alone (a graph of the captured graph's parameter-free nodes); None when there is no token mean.
    Its placeholders are the captured graph's, by name, for the runtime to feed."""
    means = [t for t in token_losses(gm) if t.counted]
    if not means:
        return None
    on_params = _depends(gm.graph, {"param"})
    by_name = {n.name: n for n in gm.graph.nodes}
    g = Graph()
    env: dict[Node, Node] = {}

    def copy(n: Node) -> Node:
        if n not in env:
            if n in on_params:
                raise ValueError(f"the token count of the loss depends on the parameters ({n.name})")
            for a in n.all_input_nodes:
                copy(a)
            env[n] = g.placeholder(n.name) if n.op == "placeholder" else g.node_copy(n, env.__getitem__)
            env[n].meta.update(n.meta, name=n.name)
        return env[n]

    counts = []
    for t in means:
        n = by_name[t.node]
        if t.kind == "ratio":
            count = copy(n.args[1])
        else:
            target, weight, ignore = copy(n.args[1]), _arg(n, 2), _arg(n, 4)
            kept = g.call_function(aten.ne.Scalar, (target, ignore))
            if weight is None:
                count = g.call_function(aten.sum.default, (kept,))
            else:
                picked = g.call_function(aten.index.Tensor,
                                         (copy(weight), [g.call_function(aten.clamp_min.default, (target, 0))]))
                count = g.call_function(aten.sum.default, (g.call_function(aten.mul.Tensor, (picked, kept)),))
        counts.append(g.call_function(aten._to_copy.default, (count,), {"dtype": torch.float64}))
    g.output(g.call_function(aten.stack.default, (counts,)))
    out = GraphModule(torch.nn.Module(), g)
    out.graph.lint()
    return out
