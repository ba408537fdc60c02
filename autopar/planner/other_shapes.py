"""A decided plan carried to a capture of the same model at other input shapes.

A batch or sequence length other than the example's (the last batch of an epoch, an evaluation at
another length) runs with the plan's choices on a capture of its own shapes. The two captures have
the same ops in the same order except where a shape changes what torch.export records: a
``contiguous`` that is a no-op at one shape and a copy at another, a view that becomes an expand.
So the plan's nodes, named after the capture it was made on, are matched to the new capture's by
aligning the two sequences of (module, op) keys (``difflib.SequenceMatcher``'s matching blocks:
the longest common runs, which keep graph order). A matched node takes its plan node's strategy,
which must be one of its options at the new shapes (a sequence shard needs a sequence that tp
divides); an unmatched node takes the option that leaves its inputs' placements as their
producers give them (no collective), else its first. Recompute regions are renamed through the
same matching; a region none of whose nodes match is dropped.
"""
from __future__ import annotations

import dataclasses
import difflib

from torch.fx import Node

from autopar.errors import PlanError, PlanFormatError
from autopar.graph.capture import Captured
from autopar.planner.sharding import _op_name, strategies_from_plan


def matched_names(cap: Captured, plan) -> dict[str, str]:
    """Plan node name -> the name of the new capture's node it matches (``plan.nodes`` in graph order)."""
    ops = [n for n in cap.gm.graph.nodes if n.op == "call_function"]
    theirs = [(p.module, p.op) for p in plan.nodes]
    ours = [(n.meta.get("module_path") or "", _op_name(n)) for n in ops]
    out = {}
    for block in difflib.SequenceMatcher(None, theirs, ours, autojunk=False).get_matching_blocks():
        for k in range(block.size):
            out[plan.nodes[block.a + k].name] = ops[block.b + k].name
    return out


def plan_at_shapes(cap: Captured, options: dict[Node, list], plan):
    """(strategies, plan) for ``cap``, a capture of the plan's model at other input shapes: the plan's
    strategies carried over by matching (module docstring), and the plan with these input shapes and
    its recompute regions renamed. Raises ``PlanError`` naming a node whose strategy has no
    counterpart at these shapes."""
    names = matched_names(cap, plan)
    kept = tuple(dataclasses.replace(p, name=names[p.name]) for p in plan.nodes if p.name in names)
    renamed = dataclasses.replace(plan, nodes=kept, input_shapes=tuple(tuple(i.meta["val"].shape) for i in cap.inputs),
                                  recompute_regions=tuple(r for r in (tuple(names[n] for n in region if n in names)
                                                                      for region in plan.recompute_regions) if r))
    plan_of = {p.name: p for p in kept}
    placement = {cap.params[p.fqn]: p.placements.get("tp", "R") for p in plan.parameters if p.fqn in cap.params}
    filled = []
    for n in cap.gm.graph.nodes:   # in graph order, so a producer's placement is known before its users'
        if n not in options or n.op != "call_function":
            continue
        if n.name in plan_of:
            placement[n] = plan_of[n.name].output
            continue
        given = tuple(placement.get(a, str(options[a][0].output) if a in options else "R") for a in n.all_input_nodes)
        chosen = next((s for s in options[n] if tuple(map(str, s.inputs)) == given), options[n][0])
        placement[n] = str(chosen.output)
        filled.append(_as_node_plan(n, chosen, plan))
    try:
        strategies = strategies_from_plan(cap, options, dataclasses.replace(renamed, nodes=kept + tuple(filled)))
    except PlanFormatError as e:
        raise PlanError(f"the plan's sharding cannot run at input shapes "
                        f"{[list(s) for s in renamed.input_shapes]}: {e}") from None
    return strategies, renamed


def _as_node_plan(node: Node, strategy, plan):
    """A NodePlan like the plan's own for ``node`` under ``strategy``."""
    template = plan.nodes[0]
    return dataclasses.replace(template, name=node.name, op=_op_name(node), module=node.meta.get("module_path") or "",
                               inputs=tuple(map(str, strategy.inputs)), output=str(strategy.output), local=None,
                               regather=False)
