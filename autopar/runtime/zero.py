"""ZeRO: the optimizer's state (stage 1) sharded over the data-parallel axis.

Stage 1 keeps a flat copy of this rank's parameter shards, split evenly over dp: after backward
the gradients are reduce-scattered (averaged) into this rank's slice, the optimizer updates the
slice, and an all-gather rebuilds every local parameter. With a split dp (HSDP) the slices are
dp_shard's: each reduce-scattered slice is all-reduced across the dp_replicate ranks that step the
same slice before the mean over all of dp.
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

    def make_optimizer(self, cls, **kwargs):
        return Zero1Optimizer(self, cls([self.shard], **kwargs))

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


class Zero1Optimizer:
    """A torch optimizer over this rank's flat slice, followed by the parameter all-gather."""

    def __init__(self, zero: Zero1, inner: torch.optim.Optimizer):
        self.zero, self.inner = zero, inner
        self.param_groups = inner.param_groups

    def step(self):
        self.inner.step()
        self.zero.all_gather_params()

    def zero_grad(self, set_to_none: bool = True):
        self.inner.zero_grad(set_to_none=set_to_none)
        for p in self.zero.params:
            p.grad = None

    def state_dict(self):
        return self.inner.state_dict()

    def load_state_dict(self, state):
        self.inner.load_state_dict(state)
