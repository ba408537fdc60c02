"""What the cost model prices a candidate into: its step's terms and each stage's memory, with the
two sums over them (the step time, a rank's peak).

Plain frozen data and arithmetic, imported by the planner, the rest of the cost model and
``autopar.plans`` (a Plan stores both records), so this module imports nothing of autopar's.

The step time is one sum of the terms in ``StepTerms`` (``step_time``); a rank's peak is one sum
of its stages' terms (``rank_peaks``): every search, report and Plan adds them up here.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, fields


def step_time(compute, comm, update):
    """Seconds per training step: ``compute`` + every axis's communication in ``comm`` + ``update``.
    Plain arithmetic, so that the symbolic costs' sympy terms add up as floats do."""
    total = compute
    for seconds in comm:
        total = total + seconds
    return total + update


@dataclass(frozen=True)
class StepTerms:
    """Seconds of one training step, term by term (``cost_model.step.price_step`` makes them, once
    per candidate):

    - ``compute``: the ops' forward and backward over the step's microbatches (with pipeline
      stages, those of the busiest pipeline rank);
    - ``tp``, ``cp``, ``pp``, ``dp``: each axis's communication that nothing overlaps (tp's
      collectives, cp's attention traffic and gradient sync, the stages' point-to-point
      activations, the dp gradient sync or what ZeRO's prefetch leaves exposed);
    - ``bubble``: the pipeline's fill and drain, what the busiest rank waits;
    - ``update``: the optimizer step and 16-bit weight casts on the device;
    - ``offload``: the offloaded optimizer step (copies and the host's AdamW).

    ``pipelined``: the tp, pp and bubble terms are inside the pipeline's makespan, which a Plan
    records as its ``predicted_compute_s``.

    No term is negative (a ValueError names one that is): each is seconds spent, and an overlap is
    credited inside the term whose communication it hides (``step.zero_exposed_time``, the ring
    attention's ``context.cp_attention_seconds``), never as a negative term that would hide
    another's. So ``comm_s`` is exactly the terms outside the makespan (dp and cp when pipelined,
    tp too without stages), never less than any one of them."""

    compute: float = 0.0
    tp: float = 0.0
    cp: float = 0.0
    pp: float = 0.0
    dp: float = 0.0
    bubble: float = 0.0
    update: float = 0.0
    offload: float = 0.0
    pipelined: bool = False

    def __post_init__(self) -> None:
        for f in fields(self):
            x = getattr(self, f.name)
            if f.name != "pipelined" and isinstance(x, (int, float)) and x < 0:   # sympy terms are left as they are
                raise ValueError(f"step term {f.name} = {x!r} s is negative: a term is seconds spent, and an overlap "
                                 "is credited inside the term it hides")

    @property
    def total(self) -> float:
        """The step time: the one sum of the terms."""
        return step_time(self.compute_s, [self.comm_s], self.update_s)

    @property
    def compute_s(self) -> float:
        """What a Plan records as ``predicted_compute_s``: the compute, with pipeline stages the
        makespan (tp, pp and the bubble inside it)."""
        return self.compute + self.tp + self.pp + self.bubble if self.pipelined else self.compute

    @property
    def comm_s(self) -> float:
        """What a Plan records as ``predicted_comm_s``: the communication outside ``compute_s``."""
        return self.dp + self.cp if self.pipelined else self.tp + self.dp + self.cp

    @property
    def update_s(self) -> float:
        """What a Plan records as ``predicted_update_s``: the device's update and the host's."""
        return self.update + self.offload

    def as_dict(self) -> dict[str, float]:
        """The terms by name (``pipelined`` left out)."""
        return {f.name: getattr(self, f.name) for f in fields(self) if f.name != "pipelined"}


@dataclass(frozen=True)
class MemoryPlan:
    """Predicted bytes on the rank of one pipeline stage (for pp = 1, the one stage): the stage's own
    terms, and ``peak``, the peak of the rank that runs it (``rank_peaks``; with one stage per rank,
    its terms' sum)."""

    stage: int
    params: float            # weights (fp32, ZeRO's shard, gathered units) and, at 16 bits, their working copy
    grads: float             # gradients held through a forward: with several microbatches (they accumulate)
    optimizer: float
    activations: float       # kept for backward, times the microbatches in flight there
    peak: float              # the rank's: its stages' params + grads + optimizer + activations, + the largest transient
    transient: float = 0.0   # the backward's highest rise above the forward's end (arriving gradients included)
    host: float = 0.0        # host memory: with optimizer offload the fp32 master and Adam's moments (not in peak)


def rank_peaks(held, transients, pp: int, *, add=math.fsum, maximum=max) -> list:
    """Per stage, the peak bytes of the pipeline rank that runs it (stage s runs on rank s mod pp):
    the one peak sum. ``held[s]``: stage s's terms alive through its rank's step (weights,
    gradients, optimizer state, activations of its microbatches in flight), ``transients[s]``:
    what its backward adds at its highest (>= 0). A rank holds every one of its stages' terms at
    once and runs one stage's backward at a time:

        peak(r) = sum_{s on r} held(s) + max_{s on r} transient(s)

    ``add`` and ``maximum`` combine the terms: exact float sums by default, ``sympy`` ones for the
    symbolic costs."""
    ranks = [([x for terms in held[r::pp] for x in terms], list(transients[r::pp])) for r in range(pp)]
    peaks = [add(terms) + maximum(most) for terms, most in ranks]
    return [peaks[s % pp] for s in range(len(held))]


def memory_plans(stages, pp: int) -> tuple[MemoryPlan, ...]:
    """MemoryPlans of ``stages`` (per stage a dict of MemoryPlan's fields but ``stage`` and ``peak``),
    each with its rank's peak (``rank_peaks``)."""
    held = [[d["params"], d["grads"], d["optimizer"], d["activations"]] for d in stages]
    peaks = rank_peaks(held, [d["transient"] for d in stages], pp)
    return tuple(MemoryPlan(stage=s, peak=peak, **d) for s, (d, peak) in enumerate(zip(stages, peaks)))
