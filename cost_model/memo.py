"""Prices computed once per graph: the planner prices one capture on every candidate mesh and ZeRO
stage, and most of what it asks for depends only on the strategies of a few nodes (an op's time,
the activations a unit keeps), which the candidates often share (every tp=1 mesh has the same
strategies; a ZeRO stage rarely changes the ILP's choice). ``cached`` keeps each answer beside its
graph, keyed by what it was computed from, so a repeated question gets the same float.

A key holds scalars and nodes; the objects an answer reads whole (a device profile, the strategies
of the nodes it prices) are keyed by identity and kept alive with the answer, so an id in a key
is always the object it was computed from (no other object can take the id while it lives).
Equal strategies that are different objects only miss the cache. Callers must not change what
they get back.
"""
from __future__ import annotations

import weakref

# id(fx Graph) -> {key: (held, answer)}, dropped as its graph is freed (before its id can be another's):
# looked up by id at C speed, as the planner asks hundreds of thousands of times
_CACHE: dict[int, dict] = {}


def cached(graph, key: tuple, compute, *held):
    """``compute()``, once per ``graph``, ``key`` (hashable) and the objects in ``held`` (by identity)."""
    per_graph = _CACHE.get(id(graph))
    if per_graph is None:
        per_graph = _CACHE[id(graph)] = {}
        weakref.finalize(graph, _CACHE.pop, id(graph), None)
    full = (key, tuple(map(id, held)))
    hit = per_graph.get(full)
    if hit is not None:
        return hit[1]
    answer = compute()
    per_graph[full] = (held, answer)
    return answer


def strategies_of(strategies: dict, nodes) -> tuple:
    """The strategies of ``nodes`` (None for a node without one): the part of a plan a price of
    those nodes reads, for ``cached``'s ``held``."""
    return tuple(map(strategies.get, nodes))   # a key of thousands of nodes: built at C speed
