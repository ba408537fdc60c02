"""ZeRO: the optimizer's state (stage 1) sharded over the data-parallel axis.

Stage 1 keeps a flat copy of this rank's parameter shards, split evenly over dp: after backward
the gradients are reduce-scattered (averaged) into this rank's slice, the optimizer updates the
slice, and an all-gather rebuilds every local parameter. With a split dp (HSDP) the slices are
dp_shard's: each reduce-scattered slice is all-reduced across the dp_replicate ranks that step the
same slice before the mean over all of dp.

Parameter groups (``pm.optimizer(cls, [{"params": ..., "weight_decay": 0.0}, ...])``) keep that one
flat slice: each maximal run of it that one group's parameters fill is stepped as a view of the
slice, in that group (``SliceOptimizer``), so the optimizer state is still 1/dp of it and a slice
element of a parameter in no group is never stepped.
"""
from __future__ import annotations

import torch

from autopar import collectives as C


class Zero1:
    """ZeRO stage 1: each dp rank keeps optimizer state for 1/dp of a flat copy of the shards.

    After backward the gradients are reduce-scattered (averaged) into this rank's slice;
    the optimizer updates that slice; an all-gather rebuilds every local parameter.
    ``params``: this rank's shards by FQN; ``sharded``: the FQNs split over tp (their squares
    are summed over tp in the norm); ``norm(sq)``: the global norm from [sharded, replicated]
    sums of squares over this dp rank's slice, reduced over tp and pp. ``group``, ``size``, ``rank``:
    the ranks the state is split over (dp, or dp_shard with a split dp); ``replicate``: with a split
    dp, the group of the ``replicas`` that hold the same slice."""

    def __init__(self, params: dict[str, torch.nn.Parameter], sharded: set[str], *, group: str, size: int,
                 rank: int, norm, replicate: str | None = None, replicas: int = 1):
        self.params = list(params.values())
        self.fqns = list(params)
        self.group, self.size, self.rank, self.norm = group, size, rank, norm
        self.replicate, self.replicas = replicate, replicas
        self.sizes = [p.numel() for p in self.params]
        n, dp = sum(self.sizes), size
        self.chunk = -(-n // dp)
        self.total = self.chunk * dp
        self.lo = rank * self.chunk
        mask = torch.cat([torch.full((p.numel(),), float(f in sharded))
                          for f, p in params.items()] + [torch.zeros(self.total - n)])
        self.sharded_mask = mask[self.lo:self.lo + self.chunk]
        self.shard = torch.nn.Parameter(self._flat(self.params)[self.lo:self.lo + self.chunk].clone())

    def _flat(self, tensors):
        flat = tensors[0].new_zeros(self.total)   # one buffer, zero past the end: no padded second copy
        torch.cat([t.detach().reshape(-1) for t in tensors], out=flat[:sum(self.sizes)])
        return flat

    def make_optimizer(self, cls, groups=None, **defaults):
        """``cls`` over this rank's slice: ``groups`` None (every parameter, one group) or
        [(FQNs, options)] per parameter group, as ``ParallelModel.optimizer`` checked them."""
        return Zero1Optimizer(self, self.slice_optimizer(self.shard, groups, lambda g: cls(g, **defaults)))

    def slice_optimizer(self, flat: torch.Tensor, groups, make) -> SliceOptimizer:
        """``make(param_groups)`` (a torch optimizer) over ``flat``, this rank's slice or a copy of it
        (offload's host master), split by ``groups`` as ``make_optimizer`` takes them."""
        if groups is None:
            return SliceOptimizer(flat, [(0, 0, self.chunk)], [{}], dict.fromkeys(self.fqns, 0), make)
        group_of = {fqn: k for k, (fqns, _) in enumerate(groups) for fqn in fqns}
        runs: list[tuple[int, int, int]] = []
        for fqn, at, n in zip(self.fqns, self.offsets, self.sizes):
            a, b = max(at, self.lo) - self.lo, min(at + n, self.lo + self.chunk) - self.lo
            k = group_of.get(fqn)
            if k is None or a >= b:
                continue
            if runs and runs[-1][0] == k and runs[-1][2] == a:
                runs[-1] = (k, runs[-1][1], b)
            else:
                runs.append((k, a, b))
        return SliceOptimizer(flat, sorted(runs), [options for _, options in groups], group_of, make)

    def reduce_scatter_grads(self):
        grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in self.params]
        flat = self._flat(grads)
        grad = C.reduce_scatter(flat, 0, self.group, self.size)
        if self.replicate is not None:   # the replicas' sum of the same slice
            grad = C.all_reduce(grad, self.replicate)
        self.shard.grad = grad / (self.size * self.replicas)
        for p in self.params:
            p.grad = None   # the full gradients are not kept: that is ZeRO's saving

    def clip_grad_norm_(self, max_norm):
        # no gradient: an fp16 step dropped on overflow, whose norm is 0
        grad = self.shard.grad if self.shard.grad is not None else torch.zeros_like(self.shard)
        g = grad.float()
        sq = torch.stack([(g.pow(2) * self.sharded_mask).sum(), (g.pow(2) * (1 - self.sharded_mask)).sum()])
        sq = C.all_reduce(sq, self.group)
        norm = self.norm(sq)
        scale_to_norm([grad], max_norm, norm)
        return norm

    def all_gather_params(self):
        with torch.no_grad():
            flat = C.all_gather(self.shard.detach(), 0, self.group, self.size, self.rank,
                                self.total, False)
            for p, piece in zip(self.params, flat[:sum(self.sizes)].split(self.sizes)):
                p.copy_(piece.view_as(p))


    @property
    def offsets(self) -> list[int]:
        """Where each local shard starts in the flat vector (before it is split over dp)."""
        out, at = [], 0
        for n in self.sizes:
            out.append(at)
            at += n
        return out

    def refresh_slice(self) -> None:
        """This rank's slice (what the optimizer steps) copied from the local shards, after they were loaded."""
        hi = self.lo + self.chunk
        with torch.no_grad():
            for p, at in zip(self.params, self.offsets):
                a, b = max(at, self.lo), min(at + p.numel(), hi)
                if a < b:
                    self.shard[a - self.lo:b - self.lo].copy_(p.detach().reshape(-1)[a - at:b - at])


def clip_coefficient(max_norm, norm) -> float:
    """What gradients are multiplied by so that their norm ``norm`` becomes ``max_norm``."""
    return max_norm / (float(norm) + 1e-6)


def scale_to_norm(tensors, max_norm, norm) -> None:
    """Scale ``tensors`` (gradients of global norm ``norm``) in place down to ``max_norm``."""
    coef = clip_coefficient(max_norm, norm)
    if coef < 1:
        for t in tensors:
            t.mul_(coef)


class SliceOptimizer:
    """A torch optimizer over ranges of one flat tensor (ZeRO-1's slice, or its host master).

    ``ranges``: (group, start, stop) per tensor the optimizer steps, in the order it numbers them
    (by group, then position); a range is a view of ``flat`` (the whole range: ``flat`` itself)
    whose gradient, at each step, is the same range of ``flat.grad``. ``options``: each group's
    own hyperparameters; ``group_of``: FQN -> group of every parameter the optimizer steps
    (checkpoints file its state under its group). ``make(param_groups)`` builds the optimizer."""

    def __init__(self, flat: torch.Tensor, ranges: list[tuple[int, int, int]], options: list[dict],
                 group_of: dict[str, int], make):
        self.flat, self.ranges, self.group_of = flat, ranges, group_of
        whole = ranges == [(0, 0, flat.numel())]
        # plain views (no autograd): torch optimizers take them as leaves and update flat in place
        self.pieces = [flat] if whole else [flat.detach()[a:b] for _, a, b in ranges]
        self.inner = make([{**opts, "params": [t for t, (g, _, _) in zip(self.pieces, ranges) if g == k]}
                           for k, opts in enumerate(options)])

    def piece_of(self, begin: int, end: int) -> int | None:
        """The index of the range that overlaps elements [begin, end) of ``flat`` (a parameter's
        part of the slice lies in one range), None when none does."""
        return next((i for i, (_, a, b) in enumerate(self.ranges) if a < end and begin < b), None)

    def step(self, closure=None):
        """The inner optimizer's step over the ranges, with ``flat.grad``'s ranges as their gradients."""
        grad = self.flat.grad
        if self.pieces[0] is not self.flat:
            for t, (_, a, b) in zip(self.pieces, self.ranges):
                t.grad = None if grad is None else grad[a:b]
        try:
            return self.inner.step(closure)
        finally:
            if self.pieces[0] is not self.flat:
                for t in self.pieces:
                    t.grad = None


class Zero1Optimizer:
    """A torch optimizer over this rank's flat slice (``SliceOptimizer``), followed by the
    parameter all-gather. ``param_groups``, ``state_dict`` and ``load_state_dict`` are the inner
    optimizer's, one group per group given to ``pm.optimizer``."""

    def __init__(self, zero: Zero1, sliced: SliceOptimizer):
        self.zero, self.sliced, self.inner = zero, sliced, sliced.inner
        self.param_groups = self.inner.param_groups

    def step(self, closure=None):
        """The slice's update, then the all-gather that rebuilds every local shard."""
        loss = self.sliced.step(closure)
        self.zero.all_gather_params()
        return loss

    def zero_grad(self, set_to_none: bool = True):
        """Drop the slice's gradient and the local shards' (the slice's always set to None)."""
        self.inner.zero_grad(set_to_none=set_to_none)
        self.zero.shard.grad = None
        for p in self.zero.params:
            p.grad = None

    def state_dict(self):
        return self.inner.state_dict()

    def load_state_dict(self, state):
        self.inner.load_state_dict(state)
