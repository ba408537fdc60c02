"""ZeRO-3's reshard choice per unit (FSDP2's ``reshard_after_forward``, per unit): which units keep
their weights gathered from their forward to their backward (``Plan.keep_gathered``).

A resharded unit frees its gathered weights after its forward and gathers them again for its
backward; a kept one skips that re-gather and holds its weights meanwhile. With s_k the seconds of
unit k's re-gather per step (the cost model's price of the collective not issued) and b_k the bytes
of its gathered weights, the choice is a knapsack: keep the set K maximising sum_{k in K} s_k with
every stage's peak(K) within the memory budget. ``choose_kept`` takes it greedily, best s_k / b_k
first (ties in forward order), keeping each unit whose addition still fits and skipping those that
do not (a smaller unit after them may still fit); units whose re-gather saves nothing priced (on a
pipeline rank other than the one whose dp sync the step prices) stay resharded. peak(K) grows with
K (a kept unit's weights are added; the two resharded units alive at once can only get smaller), so
a unit that does not fit never fits later in the walk. Pure: every figure comes from the caller.
"""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class KeptChoice:
    """The units kept gathered (forward order), the seconds they save per step, the peak with them,
    and the best unit left resharded for lack of memory with the peak it would have needed."""

    kept: tuple[str, ...]
    saved: float
    peak: float
    refused: str | None = None
    refused_peak: float = 0.0


def choose_kept(names, saved, size, peak, budget: float) -> KeptChoice:
    """Greedy per-unit reshard choice (module docstring). ``names``: the units in forward order;
    ``saved[k]`` seconds per step keeping unit k saves; ``size[k]`` its gathered bytes (orders the
    walk); ``peak(kept)``: the plan's peak with the units named in ``kept`` kept gathered."""
    order = sorted((k for k in range(len(names)) if saved[k] > 0 and size[k] > 0),
                   key=lambda k: (-saved[k] / size[k], k))
    kept: set[str] = set()
    refused, refused_peak = None, 0.0
    for k in order:
        with_it = peak(kept | {names[k]})
        if with_it <= budget:
            kept.add(names[k])
        elif refused is None:
            refused, refused_peak = names[k], with_it
    chosen = tuple(n for n in names if n in kept)
    return KeptChoice(chosen, sum(saved[k] for k, n in enumerate(names) if n in kept), peak(kept), refused,
                      refused_peak)
