"""Recompute regions: parts of the forward that backward runs again instead of keeping.

Each region becomes a sub-GraphModule called through torch.utils.checkpoint (non-reentrant,
RNG state preserved so dropout masks repeat). torch.compile traces such a call as an
activation-checkpoint region and AOTAutograd's partitioner recomputes it, so the decision
survives compilation; no FX metadata has to outlive a re-trace. An op a region uses that an earlier
pass put in the middle of it (a cp cut of a rotary table) is recomputed with the region.
"""
from __future__ import annotations

import operator

from torch.fx import Graph, GraphModule, Node
from torch.utils.checkpoint import checkpoint

from autopar.graph.capture import copy_graph


def run_checkpointed(fn, *args):
    """fn(*args), its activations recomputed in backward instead of kept."""
    return checkpoint(fn, *args, use_reentrant=False)


def recompute_pass(gm: GraphModule, *, regions: list[set[str]]) -> GraphModule:
    """Wrap each region (a set of global node names, matched by ``meta["origin"]``) in a checkpoint."""
    out = copy_graph(gm)
    for k, names in enumerate(regions):
        members = [n for n in out.graph.nodes if n.op == "call_function"
                   and n.meta.get("origin", n.name) in names]
        if members:
            _wrap(out, members, f"recompute_{k}")
    out.graph.lint()
    out.recompile()
    return out


def _wrap(gm: GraphModule, members: list[Node], name: str) -> None:
    members = _with_late_inputs(gm, members, name)
    inside = set(members)
    ins = list(dict.fromkeys(a for n in members for a in n.all_input_nodes if a not in inside))
    outs = [n for n in members if any(u not in inside for u in n.users)]
    sub = Graph()
    env = {}
    for a in ins:
        env[a] = sub.placeholder(a.name)
        env[a].meta.update(a.meta)
    for n in members:
        env[n] = sub.node_copy(n, env.__getitem__)
    sub.output(tuple(env[n] for n in outs))
    gm.add_submodule(name, GraphModule(gm, sub))
    origin = members[0].meta.get("origin", members[0].name)
    with gm.graph.inserting_before(members[0]):
        fn = gm.graph.get_attr(name)
        call = gm.graph.call_function(run_checkpointed, (fn, *ins))
        call.meta["origin"] = fn.meta["origin"] = origin
        for i, n in enumerate(outs):
            got = gm.graph.call_function(operator.getitem, (call, i))
            got.meta.update({k: v for k, v in n.meta.items() if k in ("val", "module_path", "origin")})
            n.replace_all_uses_with(got, delete_user_cb=lambda u: u not in inside)
    for n in reversed(members):
        gm.graph.erase_node(n)


def _with_late_inputs(gm: GraphModule, members: list[Node], name: str) -> list[Node]:
    """``members`` (in graph order) and the ops they take that a later pass put in the middle of the
    region without naming them for it (the cp pass cuts a whole table to the rank's chunks just
    before the op that first takes it, ``context_parallel.cp_cuts``): in graph order, recomputed
    with the region, as they run inside the piece of the forward it is."""
    order = {n: k for k, n in enumerate(gm.graph.nodes)}
    first, inside = order[members[0]], set(members)
    todo = [a for n in members for a in n.all_input_nodes if a not in inside and order[a] > first]
    while todo:
        a = todo.pop()
        if a in inside:
            continue
        if a.op != "call_function":
            raise ValueError(f"recompute region {name} needs {a.name}, computed in the middle of it; "
                             "a region must be a contiguous piece of the forward")
        inside.add(a)
        todo += [i for i in a.all_input_nodes if i not in inside and order[i] > first]
    return sorted(inside, key=order.__getitem__)
