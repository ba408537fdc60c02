"""The pipeline split: one GraphModule per stage, plus the loss tail.

Stages are cut between layers. A value produced in one stage and used in a later one
is an output of every stage in between (passed through), so stage s's outputs are
exactly stage s+1's inputs, as torch.distributed.pipelining expects. Nodes that depend
on the label inputs (inputs the first stage does not use, e.g. ``targets``) form the
tail: the schedule's ``loss_fn`` on the last stage runs it, so labels never travel
between stages. Values computed from buffers, constants and shapes alone are never sent
either: every stage (and the tail) computes the ones it uses (a 0-d constant cannot be
sent, a boolean mask neither).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
from torch.fx import Graph, GraphModule, Node

from autopar.graph.capture import input_free


@dataclass
class StageGraphs:
    """Per stage: its graph, the parameter FQNs it takes first, then its activation inputs."""

    stages: list[GraphModule]
    stage_params: list[list[str]]
    tail: GraphModule
    tail_params: list[str]
    first_inputs: list[str]          # user inputs the first stage takes, in call order
    label_inputs: list[str]          # user inputs only the loss tail takes


def _kind(n: Node) -> str | None:
    return n.meta.get("kind") if n.op == "placeholder" else None


def pipeline_split_pass(gm: GraphModule, stage_of: dict[str, int], n_stages: int) -> StageGraphs:
    """Split ``gm`` into ``n_stages`` stage graphs and a loss tail; ``stage_of`` maps each global
    node name (``meta["origin"]`` in a rewritten graph) to its stage."""
    nodes = list(gm.graph.nodes)
    origin = {n: n.meta.get("origin", n.name) for n in nodes}
    compute = [n for n in nodes if n.op in ("call_function", "get_attr")]   # get_attr: recompute regions
    stage = {n: stage_of.get(origin[n], n_stages - 1) for n in compute}
    inputs = [n for n in nodes if _kind(n) == "input"]
    first_users = {u for i in inputs for u in i.users if stage.get(u) == 0}
    labels = [i for i in inputs if not any(u in first_users for u in i.users)]
    tail: set[Node] = set()
    for n in compute:
        if any(a in labels or a in tail for a in n.all_input_nodes):
            tail.add(n)
            if stage[n] != n_stages - 1:
                raise ValueError(f"{n.meta.get('module_path') or n.name} uses the labels "
                                 f"({', '.join(l.name for l in labels)}) but is placed in stage {stage[n]}, "
                                 "not the last stage")
    TAIL = n_stages
    for n in tail:
        stage[n] = TAIL
    out_node = next(n for n in nodes if n.op == "output")
    for a in out_node.all_input_nodes:
        if a not in tail and a.op == "call_function":
            raise ValueError("the model's output does not depend on its labels; pipeline parallelism "
                             "needs forward() to return the loss")

    def produced(n: Node) -> int:
        return -1 if _kind(n) == "input" else stage[n]

    free = {n for n in input_free(gm.graph) if n.op == "call_function"}
    members = {s: _with_free_inputs([n for n in compute if stage[n] == s and n not in free], free, compute)
               for s in range(TAIL + 1)}
    last_use = {}
    for s, ms in members.items():
        for n in ms:
            for a in n.all_input_nodes:
                if a not in free and (a.op in ("call_function", "get_attr") or (_kind(a) == "input" and a not in labels)):
                    last_use[a] = max(last_use.get(a, -1), s)
    values = [v for v in nodes if v in last_use]

    def live_in(s: int) -> list[Node]:
        return [v for v in values if produced(v) < s <= last_use[v]]

    for s in range(1, TAIL + 1):
        for v in live_in(s):
            val = v.meta.get("val")
            if isinstance(val, torch.Tensor) and not val.is_floating_point():
                raise NotImplementedError(f"{v.name} ({val.dtype}) would cross a pipeline stage boundary; "
                                          "only floating-point activations can be sent between stages")
    graphs, params = [], []
    for s in range(TAIL + 1):
        outs = live_in(s + 1) if s < TAIL else [a for a in out_node.all_input_nodes]
        ins = live_in(s) if s > 0 else [i for i in inputs if i not in labels]
        if s == TAIL:
            ins = ins + labels
        gm_s, p = _build(gm, members[s], ins, outs, single_output=s == TAIL)
        graphs.append(gm_s)
        params.append(p)
    return StageGraphs(graphs[:TAIL], params[:TAIL], graphs[TAIL], params[TAIL],
                       [i.name for i in inputs if i not in labels], [l.name for l in labels])


def _with_free_inputs(nodes: list[Node], free: set[Node], order: list[Node]) -> list[Node]:
    """``nodes`` and the input-free values they use, in graph order."""
    need, stack = set(nodes), [a for n in nodes for a in n.all_input_nodes if a in free]
    while stack:
        a = stack.pop()
        if a not in need:
            need.add(a)
            stack += [b for b in a.all_input_nodes if b in free]
    return [n for n in order if n in need]


def _build(gm: GraphModule, members: list[Node], ins: list[Node], outs: list[Node], single_output: bool):
    g = Graph()
    env: dict[Node, Node] = {}
    used = {a for n in members for a in n.all_input_nodes}
    params = [n for n in gm.graph.nodes if _kind(n) in ("param", "buffer") and n in used]
    for p in params:
        env[p] = g.placeholder(p.name)
        env[p].meta.update(p.meta)
    for v in ins:
        env[v] = g.placeholder(v.name if v.op == "placeholder" else f"in_{v.name}")
        env[v].meta.update(v.meta)
    for n in members:
        env[n] = g.node_copy(n, env.__getitem__)
    g.output(env[outs[0]] if single_output else tuple(env[v] for v in outs))
    out = GraphModule(gm, g)
    out.graph.lint()
    return out, [p.meta["fqn"] for p in params]
