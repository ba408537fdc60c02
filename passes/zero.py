"""ZeRO-2/3 on the graph: parameters enter as their dp shards and are all-gathered per unit.

Each parameter placeholder receives this rank's dp shard (rows ``[r·c, (r+1)·c)`` of its tp shard,
``c = ceil(rows / dp)``, zero-padded past the end). Before the first op of every unit (the
embedding, each block, the head) that uses it, ``gather_param`` all-gathers it at the compute
dtype; its backward reduce-scatters the gradient in fp32 and averages it over dp, so the shard's
``.grad`` is the dp-mean gradient of this rank's rows, as FSDP2 leaves it. A weight several units
of one stage use (a tied embedding: ``once``) is gathered once, before the first of them, and that
copy serves every use and lives to the last one's backward, so its summed gradient is
reduce-scattered once: FSDP2's root, which keeps the tied table gathered from the forward to the
backward. Gathered per unit instead, it would cost a gather in the embedding, two more for the
head's resharded linear and a second reduce-scatter. Units on different stages each gather their own.

Without resharding the gathered weights live from the forward to the backward (ZeRO-2, FSDP's
SHARD_GRAD_OP). In a resharded unit (ZeRO-3, FSDP's FULL_SHARD, ``reshard_after_forward``) each
linear takes its weight's shard and gathers it itself, in the forward and again in the backward
(``sharded_linear``), so only the shard is kept between them; the unit's other weights (norms,
biases: small; an embedding table, which its backward does not keep) are gathered as above.

Forward prefetch (FSDP2's, one unit ahead): each gather is two nodes, the launch
(``prefetch_gather``, an all-gather not yet waited) placed where the unit before starts, and the
wait inside ``gather_param`` / ``sharded_linear``, so unit k+1's weights are on the wire while unit
k computes; the first unit's are not hidden. Two units' gathered weights are then alive at once,
as the memory model counts them. A linear of a recompute region (``recomputed``) gathers its own
weight instead: its checkpoint would keep a prefetched one from the forward to the backward. The
launches carry their unit's gather name (``gather_name``), so a pipeline stage runs those of its
own units, at its start when the unit before is another stage's. The backward's collectives stay
inside the autograd Functions, as launch and ``wait_tensor``: eager runs them in place; compiled
with ``autopar.overlap.overlap_backend()``, its joint-graph pass keeps the re-gathers in the
backward and Inductor's reordering launches them early and sinks the reduce-scatters' waits.

HSDP (a split dp, ``replicate``): the shards are dp_shard's (``group``, ``size``) and each
reduce-scattered gradient is all-reduced across the dp_replicate ranks holding the same shard
before the mean over all of dp, inside the same backward (FSDP2's HSDP).
"""
from __future__ import annotations

import torch
from torch.fx import GraphModule

from autopar.collectives import gather_param, prefetch_gather, sharded_linear
from autopar.graph.capture import copy_graph

GATHER = "zero_gather"


def shard_rows(rows: int, size: int) -> int:
    """Rows of each rank's dp shard of a tensor with ``rows`` rows (the last ones padded)."""
    return -(-rows // size)


def _unit_index(units: list[list[str]]):
    """node -> the index of the unit its global node (``meta["origin"]``) is in; the last unit for none."""
    unit_of = {name: k for k, names in enumerate(units) for name in names}
    return lambda n: unit_of.get(n.meta.get("origin", n.name), len(units) - 1)


def unit_params(gm: GraphModule, units: list[list[str]], params: set[str]) -> dict[int, list[str]]:
    """Unit index -> the FQNs of ``params`` its ops use, in graph order (``units``: each unit's
    global node names)."""
    unit = _unit_index(units)
    out: dict[int, list[str]] = {}
    for n in gm.graph.nodes:
        if n.op == "placeholder" and n.meta.get("kind") == "param" and n.meta.get("fqn") in params:
            for k in dict.fromkeys(unit(u) for u in n.users):
                out.setdefault(k, []).append(n.meta["fqn"])
    return {k: out[k] for k in sorted(out)}


def gather_name(unit: int, fqn: str) -> str:
    """The global name (``meta["origin"]``) of the gather of ``fqn`` before unit ``unit``."""
    return f"{GATHER}.{unit}.{fqn}"


def zero_pass(gm: GraphModule, *, units: list[list[str]], rows: dict[str, int], group: str, size: int,
              dtype: torch.dtype | None, reshard: set[int] = frozenset(),
              recomputed: set[str] = frozenset(), once: set[str] = frozenset(), replicate: str | None = None,
              replicas: int = 1, prefetch: bool = True) -> GraphModule:
    """Feed the parameters of ``rows`` (FQN -> rows of its tp shard) as dp shards, all-gathered over ``group`` before each unit."""
    out = copy_graph(gm)
    # without prefetch each gather is launched where its weights are used (launch returns no node)
    launch = _launch if prefetch else (lambda *_: None)
    # where the reduce-scattered gradients are all-reduced next (HSDP), as keywords: an unsplit dp's graph is unchanged
    across = dict(replicate=replicate, replicas=replicas) if replicate is not None else {}
    g = out.graph
    unit = _unit_index(units)

    # a unit starts at its first op of the capture's: the nodes an earlier pass made outside every
    # unit (cp's cuts of whole values, placed before their first consumer) would start the last unit
    # where the graph starts, and its gathers before the launches they wait on
    named = {name for names in units for name in names}
    first_op: dict[int, torch.fx.Node] = {}
    for n in g.nodes:
        if n.op == "call_function" and n.meta.get("origin", n.name) in named:
            first_op.setdefault(unit(n), n)
    # unit k's gathers are launched where unit k-1 starts (the unit before it that has ops)
    order = sorted(first_op)
    launch_at = {k: first_op[order[max(i - 1, 0)]] for i, k in enumerate(order)}
    for ph in [n for n in g.nodes if n.op == "placeholder" and n.meta.get("kind") == "param"
               and n.meta.get("fqn") in rows]:
        fqn, full = ph.meta["fqn"], ph.meta.get("val")
        args = (group, size, rows[fqn], dtype)
        by_unit: dict[int, list[torch.fx.Node]] = {}
        for user in list(ph.users):
            by_unit.setdefault(unit(user), []).append(user)
        if fqn in once:   # one gather before its first unit serves them all, kept to the last backward
            by_unit = {min(by_unit): [u for users in by_unit.values() for u in users]}
        for k, users in sorted(by_unit.items()):
            meta = {"origin": gather_name(k, fqn), "module_path": first_op[k].meta.get("module_path", "")}
            if k in reshard and fqn not in once:
                linears = [u for u in users if _is_linear_of(u, ph)]
                for user in linears:
                    # a recomputed linear gathers its own weight: a prefetched one would be an input of
                    # its checkpoint region, kept whole from the forward to the backward
                    recomputes = user.meta.get("origin", user.name) in recomputed
                    _reshard_linear(g, user, ph, args,
                                    None if recomputes else launch(g, launch_at[k], ph, args, meta), across)
                users = [u for u in users if u not in linears]
                if not users:
                    continue
            pending = launch(g, launch_at[k], ph, args, meta)
            with g.inserting_before(first_op[k]):
                gathered = g.call_function(gather_param, (ph, *args, pending), across)
            gathered.meta.update(meta)
            if full is not None:
                gathered.meta["val"] = full if dtype is None else full.to(dtype)
            for user in users:
                user.replace_input_with(ph, gathered)
        if full is not None:
            ph.meta["val"] = full.new_empty((shard_rows(rows[fqn], size), *full.shape[1:]))
    g.lint()
    out.recompile()
    return out


def _launch(g, at, ph, args: tuple, meta: dict):
    """A ``prefetch_gather`` of the shard ``ph`` inserted before ``at``: the gather in flight.
    ``args``: (group, size, rows of the tp shard, dtype), as ``gather_param`` takes them."""
    group, size, rows, dtype = args
    with g.inserting_before(at):
        pending = g.call_function(prefetch_gather, (ph, group, size, dtype))
    pending.meta.update(meta)
    full = ph.meta.get("val")
    if full is not None:   # every rank's rows, padding included
        pending.meta["val"] = full.new_empty((size * shard_rows(rows, size), *full.shape[1:]), dtype=dtype or full.dtype)
    return pending


def _is_linear_of(user, ph) -> bool:
    """Whether ``user`` is a linear taking ``ph`` as its weight only."""
    return (user.target is torch.ops.aten.linear.default and user.args[1] is ph
            and ph not in (user.args[0], *user.args[2:]))


def _reshard_linear(g, user, ph, args, pending, across) -> None:
    """Replace ``user``, a linear whose weight is ``ph``, by a ``sharded_linear`` on the shard (and
    its bias added after) that waits on ``pending``, its weight's prefetched gather (None: it gathers);
    ``across``: the replicate group and replicas of its gradient's all-reduce (HSDP; empty without)."""
    meta = {"origin": user.meta.get("origin", user.name),   # what recompute regions and stages name it by
            **{k: v for k, v in user.meta.items() if k in ("val", "module_path")}}
    with g.inserting_before(user):
        y = g.call_function(sharded_linear, (user.args[0], ph, *args, pending), across)
        y.meta.update(meta)
        if len(user.args) > 2 and user.args[2] is not None:
            y = g.call_function(torch.ops.aten.add.Tensor, (y, user.args[2]))
            y.meta.update(meta)
    user.replace_all_uses_with(y)
    g.erase_node(user)
