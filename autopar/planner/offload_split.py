"""Partial optimizer offload: which units' optimizer goes to the host (offload=<fraction> and "auto").

The units are ``autopar.graph.units.zero_units``' (embedding, each block, head); each parameter's
master and optimizer state live with its owner unit (``owner_units``), on the device or the host.
The host's update of a unit can start once the unit's gradients are final, and the backward
finishes the units in reverse order: the last units of the forward (the head, the last blocks)
first. Offloading those gives the host the most backward to run beside, and the most time before
the next step needs their weights (``cost_model.offload``'s "backward" recurrence: a unit offloaded
later in that order queues after the others and is ready later, so it can only lengthen what is
exposed). So a split is a count k: the last k units of the forward go to the host, the first
n - k keep their state on the device (``Plan.offload_kept``). ``offload_order`` lists the units
and their state's bytes in the order they go.

offload=f (a fraction in (0, 1)): the k whose units hold the share of the optimizer state, by
bytes, nearest f (``fraction_units``; a tie takes fewer units).

offload="auto", when the plan does not fit without offload (``search_split``): with peak(k) the
rank's peak bytes, host(k) the host bytes its offloaded state needs and T(k) the predicted step,

    minimise T(k) over 1 <= k <= n  subject to  peak(k) <= budget,  host(k) <= host budget

    T(k) = W + R(k) + U(k) + X(k)

W the step's terms that do not depend on the split (the ops, communication), R(k) the recomputed
forwards recompute="auto" chooses with the room the split leaves (each unit offloaded frees its
state: 12 bytes per parameter at 16 bits, 8 at fp32, which the recompute ILP spends on
activations; so the split and the recompute regions are chosen together: at each k, the
cheapest recompute that fits), U(k) the device's update of the kept state and X(k) what the
host's leaves exposed. peak(k) does not rise with k (an offloaded unit holds less on the device)
and host(k) does not fall, so the ks that fit both are one range [k_lo, k_hi]: k_lo the least k
that fits the device, by bisection over the priced peaks, k_hi the most the host holds.
R(k) and U(k) do not rise with k; X(k) has a floor X_lb(k) that does not fall: after the backward
or one step late X itself, beside the backward the end of the host's last job past the backward's
end (``cost_model.offload.backward_floor``; X itself can fall by a little as a smaller unit is
added, whose weights copy in sooner after the backward). So a floor of T at every k' >= k is

    F(k) = W + C + X_lb(k)

with C the 16-bit casts (U's part that no split removes) and X_lb(k) priced with the longest
backward any recompute choice gives (every block recomputed: the backward hides at least that
much less at any k' >= k, ``cost_model.offload.update_floor``).
The scan prices k = k_lo, k_lo + 1, ... and stops at the first k whose floor is no less than the
fastest step found (without a floor, at the first k no faster than the one before). The split
kept is the one offloading the fewest units whose step is within ``MARGIN`` (relative) of the
fastest: more host memory, and with offload_delay=1 more weights a step stale, are costs the
step does not price, and the host's overlap is the least certain part of it.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from autopar.cost_model.state import local_param_bytes
from autopar.graph.units import owner_units, zero_units

# how much faster (relative) a split offloading more units must be to win (module docstring)
MARGIN = 0.005


def offload_order(cap, strategies, tp: int) -> list[tuple[str, float]]:
    """(unit name, local fp32 bytes of the parameters it owns) of every unit of ``zero_units(cap)``, in
    the order a split offloads them: the reverse of the forward's (module docstring)."""
    owners = owner_units(cap)
    owned = {u.name: 0.0 for u in zero_units(cap)}
    for fqn, nbytes in local_param_bytes(cap, strategies, tuple(cap.params), tp).items():
        owned[owners[fqn]] += nbytes
    return list(reversed(owned.items()))


def kept_units(order: list[tuple[str, float]], k: int) -> tuple[str, ...]:
    """The units a split offloading the first ``k`` of ``order`` keeps on the device, in forward order."""
    return tuple(name for name, _ in reversed(order[k:]))


def fraction_units(order: list[tuple[str, float]], fraction: float) -> int:
    """The k whose first k units of ``order`` hold the share of its bytes nearest ``fraction``
    (fewer units on a tie)."""
    total = sum(b for _, b in order) or 1.0
    shares, held = [0.0], 0.0
    for _, b in order:
        held += b
        shares.append(held / total)
    return min(range(len(shares)), key=lambda k: (abs(shares[k] - fraction), k))


@dataclass
class SplitSearch:
    """What ``search_split`` found: ``best`` (k), and ``tried`` {k: candidate} and ``failed`` {k: the
    error pricing raised}, for the notes; ``best`` is None when no k fits both budgets."""

    best: int | None
    tried: dict = field(default_factory=dict)
    failed: dict = field(default_factory=dict)


def search_split(n: int, price, *, limit: float, k_host: int, floor=None) -> SplitSearch:
    """The module docstring's search over k in 1..``n``: ``price(k)`` the candidate at k (anything with
    ``peak_memory`` and ``step_time``; a ValueError where k has no plan), ``limit`` the device's
    budget, ``k_host`` the most units the host holds, ``floor(k, priced)`` a lower bound of the step
    at every k' >= k, ``priced`` a candidate priced already (without it the scan goes on while
    each k is faster than the one before); the fewest units within ``MARGIN`` of the fastest."""
    out = SplitSearch(None)

    def at(k):
        if k not in out.tried and k not in out.failed:
            try:
                out.tried[k] = price(k)
            except ValueError as e:
                out.failed[k] = e
        return out.tried.get(k)

    def fits(k) -> bool:
        c = at(k)
        return c is not None and c.peak_memory <= limit

    top = min(n, k_host)
    if top < 1 or not fits(top):
        return out
    lo, hi = 0, top   # fits(hi), and not fits(lo) (k = 0 is the plan without offload, which the caller found too big)
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if fits(mid):
            hi = mid
        else:
            lo = mid
    fastest = hi
    for k in range(hi + 1, top + 1):
        step = out.tried[fastest].step_time
        if floor is not None and floor(k, out.tried[fastest]) >= step:
            break
        c = at(k)
        if c is None or c.peak_memory > limit:
            continue
        if c.step_time < step:
            fastest = k
        elif floor is None:
            break
    least = out.tried[fastest].step_time * (1 + MARGIN)
    out.best = min(k for k, c in out.tried.items() if c.peak_memory <= limit and c.step_time <= least)
    return out
