"""ZeRO-2/3 on the graph: parameters enter as their dp shards and are all-gathered per unit.

Each parameter placeholder receives this rank's dp shard (rows ``[r·c, (r+1)·c)`` of its tp shard,
``c = ceil(rows / dp)``, zero-padded past the end). Before the first op of every unit (the
embedding, each block, the head) that uses it, ``gather_param`` all-gathers it at the compute
dtype; its backward reduce-scatters the gradient in fp32 and averages it over dp, so the shard's
``.grad`` is the dp-mean gradient of this rank's rows, as FSDP2 leaves it. A weight used by two
units (a tied embedding) is gathered once in each.

Without resharding the gathered weights live from the forward to the backward (ZeRO-2, FSDP's
SHARD_GRAD_OP). In a resharded unit (ZeRO-3, FSDP's FULL_SHARD, ``reshard_after_forward``) each
linear takes its weight's shard and gathers it itself, in the forward and again in the backward
(``sharded_linear``), so only the shard is kept between them; the unit's other weights (norms,
biases: small; an embedding table, which its backward does not keep) are gathered as above.
"""
from __future__ import annotations

import torch
from torch.fx import GraphModule

from autopar.collectives import gather_param, sharded_linear
from autopar.passes.driver import copy_graph

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
              dtype: torch.dtype | None, reshard: set[int] = frozenset()) -> GraphModule:
    """Feed the parameters of ``rows`` (FQN -> rows of its tp shard) as dp shards, all-gathered over ``group`` before each unit."""
    out = copy_graph(gm)
    g = out.graph
    unit = _unit_index(units)

    first_op: dict[int, torch.fx.Node] = {}
    for n in g.nodes:
        if n.op == "call_function":
            first_op.setdefault(unit(n), n)
    for ph in [n for n in g.nodes if n.op == "placeholder" and n.meta.get("kind") == "param"
               and n.meta.get("fqn") in rows]:
        fqn, full = ph.meta["fqn"], ph.meta.get("val")
        by_unit: dict[int, list[torch.fx.Node]] = {}
        for user in list(ph.users):
            by_unit.setdefault(unit(user), []).append(user)
        for k, users in sorted(by_unit.items()):
            if k in reshard:
                users = [u for u in users if not _reshard_linear(g, u, ph, (group, size, rows[fqn], dtype))]
                if not users:
                    continue
            with g.inserting_before(first_op[k]):
                gathered = g.call_function(gather_param, (ph, group, size, rows[fqn], dtype))
            gathered.meta.update(origin=gather_name(k, fqn), module_path=first_op[k].meta.get("module_path", ""))
            if full is not None:
                gathered.meta["val"] = full if dtype is None else full.to(dtype)
            for user in users:
                user.replace_input_with(ph, gathered)
        if full is not None:
            ph.meta["val"] = full.new_empty((shard_rows(rows[fqn], size), *full.shape[1:]))
    g.lint()
    out.recompile()
    return out


def _reshard_linear(g, user, ph, args) -> bool:
    """Replace ``user``, a linear whose weight is ``ph``, by a ``sharded_linear`` on the shard (and
    its bias added after); False when ``user`` is no such linear."""
    if user.target is not torch.ops.aten.linear.default or user.args[1] is not ph or ph in (user.args[0], *user.args[2:]):
        return False
    meta = {"origin": user.meta.get("origin", user.name),   # what recompute regions and stages name it by
            **{k: v for k, v in user.meta.items() if k in ("val", "module_path")}}
    with g.inserting_before(user):
        y = g.call_function(sharded_linear, (user.args[0], ph, *args))
        y.meta.update(meta)
        if len(user.args) > 2 and user.args[2] is not None:
            y = g.call_function(torch.ops.aten.add.Tensor, (y, user.args[2]))
            y.meta.update(meta)
    user.replace_all_uses_with(y)
    g.erase_node(user)
    return True
