"""One ILP asked at many prices of one quantity: costs a + λ·b over a feasible set that λ leaves alone.

The tp ILP is such a family: a parameter's strategy pays λ seconds per byte of its local shard
(``param_byte_time``, which the ZeRO stage and mesh set) and nothing else moves with λ, so the mesh
search asks one tp's ILP at a dozen λ or more, and its choice rarely changes.

The least cost f(λ) = min_x (a_x + λ·b_x) is a minimum of lines, so concave. A choice x optimal at
λ1 and at λ2 > λ1 has its line equal to f at both; a concave f lies above that chord between them,
and no line of a choice lies below f, so x's line is f on all of [λ1, λ2]: x is optimal at every λ
between, and any other choice optimal inside has the very same line (the same a and b). A λ between
two at which the solver proved one choice optimal gets that choice without a solve.

A λ below every λ solved so far gets a solve at λ / ``STRETCH`` first: when it returns the choice of
the least λ solved, λ lies between the two; otherwise λ is solved itself. The search's λ fall as its
ZeRO stages shard more and its dp grows, so one solve stretched below covers the ones that follow; a
λ above is solved itself (a choice proven at a far larger price, where sharding a parameter pays
more, is more often another).
"""
from __future__ import annotations

from typing import Callable

__all__ = ["STRETCH", "choice_at"]

STRETCH = 8.0


def choice_at(proven: dict, lam: float, solve: Callable) -> tuple:
    """The choice optimal at ``lam``: from two λ of ``proven`` around it that have one choice, or solved.

    ``proven``: λ -> the choice the solver proved optimal there, or None when it stopped without a proof
    (kept by the caller per family, updated here); ``solve(λ)``: (choice, proven optimal), raising as
    the solver raises. A stretched solve that raises is left for ``lam``'s own solve to report."""
    if lam in proven and proven[lam] is not None:
        return proven[lam]
    below = max((k for k in proven if k <= lam and proven[k] is not None), default=None)
    above = min((k for k in proven if k >= lam and proven[k] is not None), default=None)
    if below is not None and above is not None and proven[below] == proven[above]:
        return proven[below]
    if lam > 0 and below is None and above is not None:
        far = lam / STRETCH
        if far not in proven:
            try:
                choice, optimal = solve(far)
            except (ValueError, RuntimeError):
                choice, optimal = None, False
            proven[far] = choice if optimal else None
            if proven[far] is not None and proven[far] == proven[above]:
                return proven[far]
    choice, optimal = solve(lam)
    proven[lam] = choice if optimal else None
    return choice
