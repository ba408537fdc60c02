"""Layer units: the pieces of a captured graph that a pipeline cut moves whole and ZeRO-3 gathers at once.

The repeated blocks are found from module paths (``layers.0``, ``layers.1``, ...) and checked
identical node by node; the ordered units are the embedding (everything before the first block),
each block, and the head (everything after the last block, loss included). A plan's stages name
their modules; ``stage_of_nodes`` lays them back on a capture.
"""
from __future__ import annotations

import re
from dataclasses import dataclass

from torch.fx import Node

from autopar.errors import PlanError
from autopar.graph.capture import Captured, graph_cached
from autopar.graph.rules import shape


def _block_of(path: str) -> tuple[str, int] | None:
    m = re.match(r"^(.*?)\.(\d+)(\.|$)", path)
    return (m.group(1), int(m.group(2))) if m else None


@graph_cached
def find_blocks(cap: Captured) -> list[list[Node]] | None:
    """The repeated blocks (nodes per block, in order) if the graph has identical ones."""
    blocks: dict[int, list[Node]] = {}
    prefix = None
    for node in cap.gm.graph.nodes:
        key = _block_of(node.meta.get("module_path") or "")
        if node.op == "placeholder" and node.meta.get("kind") == "param":
            key = _block_of(node.meta["fqn"])
        if key is None:
            continue
        if prefix not in (None, key[0]):
            return None
        prefix = key[0]
        blocks.setdefault(key[1], []).append(node)
    if len(blocks) < 2 or sorted(blocks) != list(range(len(blocks))):
        return None
    ordered = [blocks[i] for i in range(len(blocks))]

    def signature(nodes: list[Node]):
        index = {n: k for k, n in enumerate(nodes)}
        return [(n.op, str(n.target) if n.op == "call_function" else "", shape(n) if n.op != "output" and "val" in n.meta else None,
                 tuple(index.get(i, -1) for i in n.all_input_nodes)) for n in nodes]
    first = signature(ordered[0])
    if any(signature(b) != first for b in ordered[1:]):
        return None
    return ordered


@dataclass(frozen=True)
class Unit:
    name: str
    modules: tuple[str, ...]
    nodes: tuple[Node, ...]


@graph_cached
def layer_units(cap: Captured) -> list[Unit]:
    """Embedding, each block, head: the pieces a stage cut may not split."""
    blocks = find_blocks(cap)
    if not blocks:
        raise PlanError("pipeline parallelism cuts between repeated blocks (an nn.ModuleList of "
                        "identical layers), and this model has none")
    in_block = {n: i for i, b in enumerate(blocks) for n in b}
    before, after, body = [], [], [[] for _ in blocks]
    for n in cap.gm.graph.nodes:
        if n.op != "call_function":
            continue
        if n in in_block:
            body[in_block[n]].append(n)
        else:
            (after if any(body) else before).append(n)
    units = []
    for name, nodes in [("embedding", before)] + [(None, b) for b in body] + [("head", after)]:
        paths = dict.fromkeys(n.meta.get("module_path") for n in nodes if n.meta.get("module_path"))
        mods = tuple(p for p in paths if not any(p.startswith(q + ".") for q in paths))   # outermost only
        if name is None:
            name = min(mods, key=len)
        if nodes:
            units.append(Unit(name, mods, tuple(nodes)))
    return units


def override_bounds(stages, units: list[Unit], n_stages: int):
    if len(stages) != n_stages:
        raise PlanError(f"stages= lists {len(stages)} stages but the mesh and schedule have {n_stages}")
    owner: dict[str, int] = {}
    for s, mods in enumerate(stages):
        for m in mods:
            if m in owner:
                raise PlanError(f"stages=: module {m!r} is listed in stage {owner[m]} and stage {s}")
            owner[m] = s
    def listed(module: str):
        """The stage of ``module`` or of the innermost listed module that contains it: a stage that
        lists a model's outer module (a Hugging Face ``model`` whose forward has ops of its own) does
        not take the layers that other stages list inside it."""
        while True:
            if module in owner:
                return owner[module]
            if "." not in module:
                return None
            module = module.rsplit(".", 1)[0]

    placed = []
    for u in units:
        where = {listed(m) for m in u.modules}
        if None in where:
            missing = [m for m in u.modules if listed(m) is None]
            raise PlanError(f"stages=: {', '.join(missing)} (part of {u.name}) is in no stage; "
                            f"list every module of {u.name} in one stage")
        if len(where) > 1:
            raise PlanError(f"stages=: {u.name} is split across stages {sorted(where)}; a layer stays whole")
        placed.append(where.pop())
    known = [m for u in units for m in u.modules]
    unknown = sorted(m for m in owner if not any(k == m or k.startswith(m + ".") or m.startswith(k + ".")
                                                 for k in known))
    if unknown:
        raise PlanError(f"stages=: the model has no module {', '.join(unknown)}")
    if placed != sorted(placed) or sorted(set(placed)) != list(range(n_stages)):
        raise PlanError("stages=: each stage must be a non-empty run of consecutive layers, in order")
    return tuple((placed.index(s), len(placed) - placed[::-1].index(s)) for s in range(n_stages))


def stage_of_nodes(cap: Captured, plan) -> dict[str, int]:
    """Global node name -> stage index, from the plan's stage module lists."""
    units = layer_units(cap)
    bounds = override_bounds([s.modules for s in plan.stages], units, len(plan.stages))
    return {n.name: s for s, (a, b) in enumerate(bounds) for u in units[a:b] for n in u.nodes}


def zero_units(cap: Captured) -> list[Unit]:
    """What ZeRO gathers at once: the layer units, or for a model without repeated blocks one unit,
    "model", of all its ops."""
    try:
        return layer_units(cap)
    except PlanError:
        ops = tuple(n for n in cap.gm.graph.nodes if n.op == "call_function")
        return [Unit("model", tuple(dict.fromkeys(n.meta.get("module_path") or "" for n in ops)), ops)]


@graph_cached
def owner_units(cap: Captured) -> dict[str, str]:
    """FQN -> the name of the unit of ``zero_units(cap)`` that owns the parameter: the first, in
    forward order, whose ops use it. A partial optimizer offload places each parameter's master and
    optimizer state with its owner (``plan.offload_kept``); a weight several units share (a tied
    embedding) belongs to the first, whose backward is the last to add to its gradient."""
    first: dict[Node, str] = {}
    for u in zero_units(cap):
        for n in u.nodes:
            first.setdefault(n, u.name)
    units = [u.name for u in zero_units(cap)]
    owners = {}
    for fqn, p in cap.params.items():
        users = [first[n] for n in p.users if n in first]
        owners[fqn] = min(users, key=units.index) if users else units[0]
    return owners
