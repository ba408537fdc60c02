"""ZeRO-1 and the distributed optimizer: fp32 optimizer state (and at 16 bits the fp32 master
weights) for a flat slice of a rank's shards, split over data-parallel ranks.

Stage 1 keeps a flat copy of this rank's parameter shards, split evenly over the ranks it shards
over (``d``): after backward the gradients are reduce-scattered (averaged) into this rank's slice,
the optimizer updates the slice, and an all-gather rebuilds every local parameter. With a split
dp (HSDP) the slices are dp_shard's: each reduce-scattered slice is all-reduced across the
replicas that step the same slice before the mean over all of them.

At 16 bits (``dtype``; ``Program.main_grads``) this is Megatron-LM's distributed optimizer, for
zero=0 (d = 1) and zero=1 alike:

    parameters     the local shards themselves, narrowed to ``dtype`` (2 bytes per parameter):
                   what the graph computes with, no other copy of the weights on the device
    main gradients one flat fp32 buffer over the shards (4 bytes); each parameter's 16-bit
                   gradient is added into its view of it as autograd accumulates it (a
                   post-accumulate-grad hook; under a zero-bubble schedule, whose weight pass
                   writes ``p.grad`` itself, a tensor hook as it is computed) and dropped, so
                   microbatches and pipeline stages add up in fp32; zeroed when a step begins
    master, moments the fp32 slice ``shard`` (this rank's 1/d of the flat weights) and the
                   optimizer's state over it (12/d bytes with AdamW)

After backward the buffer is reduce-scattered (averaged) over the d ranks, the result written
into the buffer's own slice, which is the master's gradient (no other copy). After the update the
master slice is rounded to ``dtype`` and all-gathered into the parameters. d is dp x cp for
zero=1 (cp ranks train the same weights on other tokens), dp_shard with a split dp (its
replicas, cp ranks included, sum the slice), and 1 for zero=0, whose gradient buffer is
all-reduced over dp x cp. A parameter changed other than by the step (an edit under
``torch.no_grad``) bumps its version counter and is copied into the master before the next update.

Parameter groups (``pm.optimizer(cls, [{"params": ..., "weight_decay": 0.0}, ...])``) keep that one
flat slice: each maximal run of it that one group's parameters fill is stepped as a view of the
slice, in that group (``SliceOptimizer``), so the optimizer state is still 1/d of it and a slice
element of a parameter in no group is never stepped.
"""
from __future__ import annotations

import functools

import torch

from autopar import collectives as C
from autopar.graph.precision import compute_dtype


class Zero1:
    """ZeRO-1 (and at 16 bits the distributed optimizer): optimizer state for this rank's 1/``size``
    of a flat copy of the shards (see the module docstring).

    ``params``: this rank's shards by FQN; ``sharded``: the FQNs split over tp (their squares are
    summed over tp in the norm); ``owned``: those whose squares this rank counts (a weight on
    several pipeline stages counts on one; default all); ``norm(sq)``: the global norm from
    [sharded, replicated] sums of squares over this rank's slice, reduced over tp and pp.
    ``group``, ``size``, ``rank``: the
    ranks the state is split over (None, 1, 0: not split); ``replicate``: the group of the
    ``replicas`` that hold the same slice, whose gradients are summed with this rank's. ``dtype``:
    the 16-bit dtype the parameters are narrowed to, with fp32 gradient buffers and the fp32 master
    in ``shard`` (None: fp32 parameters, their own ``.grad``, and ``shard`` a copy of the slice).
    ``weight_pass``: the backward computes weight gradients apart (a zero-bubble schedule, whose
    weight pass writes ``p.grad`` itself): they are taken into the buffer as they are computed."""

    def __init__(self, params: dict[str, torch.nn.Parameter], sharded: set[str], *, group: str | None, size: int,
                 rank: int, norm, replicate: str | None = None, replicas: int = 1, dtype: torch.dtype | None = None,
                 owned: set[str] | None = None, weight_pass: bool = False):
        self.params = list(params.values())
        self.fqns = list(params)
        self.group, self.size, self.rank, self.norm = group, size, rank, norm
        self.replicate, self.replicas, self.dtype, self.weight_pass = replicate, replicas, dtype, weight_pass
        self.sizes = [p.numel() for p in self.params]
        n, dp = sum(self.sizes), size
        self.chunk = -(-n // dp)
        self.total = self.chunk * dp
        self.lo = rank * self.chunk
        # (start, stop, 0 for a tp shard else 1) of each parameter's run of the slice that the norm
        # counts: runs, not per-element masks, which would hold 4 more bytes per slice element each
        self._norm_runs = []
        for f, at, k in zip(self.fqns, self.offsets, self.sizes):
            a, b = max(at, self.lo) - self.lo, min(at + k, self.lo + self.chunk) - self.lo
            if a < b and (owned is None or f in owned):
                self._norm_runs.append((a, b, int(f not in sharded)))
        # copied from the shards part by part: no flat copy of every weight, even for a moment (fp32
        # at 16 bits, the master; else the shards' own dtype, as their gradients are)
        first = self.params[0]
        self.shard = torch.nn.Parameter(torch.zeros(self.chunk, dtype=first.dtype if dtype is None else torch.float32,
                                                    device=first.device))
        self.refresh_slice()
        self.main: torch.Tensor | None = None   # the fp32 gradient buffer (16 bits)
        self.main_grads: dict[str, torch.Tensor] = {}
        if dtype is not None:
            self._distribute(params, dtype)

    def _distribute(self, params: dict[str, torch.nn.Parameter], dtype: torch.dtype) -> None:
        """The 16-bit layout: parameters narrowed, one fp32 gradient buffer, the hooks that fill it."""
        self.main = torch.zeros(self.total, dtype=torch.float32, device=self.shard.device)
        for (fqn, p), piece in zip(params.items(), self.main[:sum(self.sizes)].split(self.sizes)):
            if p.is_floating_point():
                p.data = p.data.to(dtype)
            self.main_grads[fqn] = piece.view(p.shape)
            if p.requires_grad:
                # as autograd accumulates it (after any hook of the user's), or for a weight pass
                # outside the accumulation, as it is computed
                p.register_hook(functools.partial(self._computed, piece.view(p.shape)))
                p.register_post_accumulate_grad_hook(functools.partial(self._accumulated, piece.view(p.shape)))
        self._versions = [p._version for p in self.params]

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
        return SliceOptimizer(flat, sorted(self.slice_runs(group_of.get)), [options for _, options in groups],
                              group_of, make)

    def slice_runs(self, key) -> list[tuple]:
        """(key, start, stop) of each maximal run of this rank's slice whose parameters have the same
        ``key(fqn)``, in slice order (a parameter whose key is None is left out, as is the padding)."""
        runs: list[tuple] = []
        for fqn, at, n in zip(self.fqns, self.offsets, self.sizes):
            a, b = max(at, self.lo) - self.lo, min(at + n, self.lo + self.chunk) - self.lo
            k = key(fqn)
            if k is None or a >= b:
                continue
            if runs and runs[-1][0] == k and runs[-1][2] == a:
                runs[-1] = (k, runs[-1][1], b)
            else:
                runs.append((k, a, b))
        return runs

    def _computed(self, main: torch.Tensor, grad: torch.Tensor) -> None:
        """A tensor hook: with ``weight_pass``, a 16-bit gradient added into its fp32 buffer ``main``."""
        if self.weight_pass:
            main.add_(grad)

    def _accumulated(self, main: torch.Tensor, p: torch.Tensor) -> None:
        """A post-accumulate-grad hook: ``p``'s 16-bit gradient added into its fp32 buffer ``main``
        (unless ``_computed`` took it), then dropped."""
        if not self.weight_pass:
            main.add_(p.grad)
        p.grad = None

    def begin_step(self) -> None:
        """Before a step's first backward: the fp32 gradient buffer zeroed (16 bits; each step's
        gradients replace the last's, as the slice's always have)."""
        if self.main is not None:
            self.main.zero_()

    def reduce_scatter_grads(self):
        """After the step's backward: this rank's slice of the gradients' mean over the ranks it
        shards over and its replicas, as ``shard.grad`` (at 16 bits the gradient buffer's own slice,
        reduced in place: no other copy)."""
        n = self.size * self.replicas
        if self.main is not None:
            mine = self.main[self.lo:self.lo + self.chunk]
            if self.size > 1:
                mine.copy_(C.reduce_scatter(self.main, 0, self.group, self.size))
            if self.replicate is not None:   # the replicas' sum of the same slice
                C.all_reduce_mean_(mine, self.replicate, n)
            elif n > 1:
                mine.div_(n)
            self.shard.grad = mine
            return
        grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in self.params]
        flat = self._flat(grads)
        grad = C.reduce_scatter(flat, 0, self.group, self.size) if self.size > 1 else flat
        if self.replicate is not None:
            grad = C.all_reduce(grad, self.replicate)
        self.shard.grad = grad / n
        for p in self.params:
            p.grad = None   # the full gradients are not kept: that is ZeRO's saving

    def clip_grad_norm_(self, max_norm):
        # no gradient: an fp16 step dropped on overflow, whose norm is 0
        grad = self.shard.grad if self.shard.grad is not None else torch.zeros_like(self.shard)
        sq = torch.zeros(2, device=grad.device)
        for a, b, kind in self._norm_runs:
            sq[kind] += grad[a:b].float().pow(2).sum()
        if self.size > 1:
            sq = C.all_reduce(sq, self.group)
        norm = self.norm(sq)
        scale_to_norm([grad], max_norm, norm)
        return norm

    def gathered_slices(self, slice_: torch.Tensor) -> torch.Tensor:
        """Every rank's ``slice_`` (this rank's part of a flat vector), whole again: the flat vector."""
        if self.size == 1:
            return slice_
        return C.all_gather(slice_, 0, self.group, self.size, self.rank, self.total, False)

    def all_gather_params(self):
        """Every local shard rebuilt from the slices (at 16 bits: the masters rounded to ``dtype``)."""
        with torch.no_grad():
            mine = self.shard.detach() if self.dtype is None else self.shard.detach().to(self.dtype)
            flat = self.gathered_slices(mine)
            for p, piece in zip(self.params, flat[:sum(self.sizes)].split(self.sizes)):
                p.copy_(piece.view_as(p))
        if self.dtype is not None:
            self._versions = [p._version for p in self.params]

    def pull_changed(self) -> None:
        """At 16 bits: the master slice's part of every parameter changed since the last all-gather
        (an edit under ``torch.no_grad``), copied from it."""
        if self.dtype is None:
            return
        changed = [k for k, p in enumerate(self.params) if p._version != self._versions[k]]
        self._refresh(changed)
        for k in changed:
            self._versions[k] = self.params[k]._version

    def master_weights(self) -> list[torch.Tensor]:
        """At 16 bits, each local shard's fp32 master, shaped like it (gathered over the ranks the
        slice is split over: collective); at fp32 the shards themselves."""
        if self.dtype is None:
            return list(self.params)
        self.pull_changed()
        return self.weights_from(self.shard.detach())

    def weights_from(self, slice_: torch.Tensor) -> list[torch.Tensor]:
        """Each local shard's weights rebuilt from every rank's ``slice_`` (gathered: collective),
        shaped like it (offload's host masters, whose update the device has not taken yet)."""
        with torch.no_grad():
            flat = self.gathered_slices(slice_)
        return [piece.view(p.shape) for p, piece in zip(self.params, flat[:sum(self.sizes)].split(self.sizes))]

    def loaded(self) -> None:
        """After a checkpoint load: at 16 bits the master slice was loaded, and the parameters are
        rebuilt from it; at fp32 the shards were, and the slice is copied from them."""
        if self.dtype is not None:
            self.all_gather_params()
        else:
            self.refresh_slice()

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
        self._refresh(range(len(self.params)))

    def _refresh(self, which) -> None:
        hi, offsets = self.lo + self.chunk, self.offsets
        with torch.no_grad():
            for k in which:
                p, at = self.params[k], offsets[k]
                a, b = max(at, self.lo), min(at + p.numel(), hi)
                if a < b:
                    self.shard[a - self.lo:b - self.lo].copy_(p.detach().reshape(-1)[a - at:b - at])




def zero1_layout(program) -> dict:
    """``Zero1``'s keyword arguments for a rank's ``runtime.program.Program`` that keeps a flat
    slice (``program.zero1`` or ``program.main_grads``): the group its slice is split over and the
    replicas summed with it (module docstring), and its 16-bit ``dtype`` (None at fp32)."""
    mesh, groups, coords = program.mesh, program.groups, program.coords
    dtype = compute_dtype(program.plan.precision) if program.main_grads else None
    if program.zero1 and (dtype is None or mesh.split):   # over dp_shard; replicas and cp ranks summed
        return dict(group=groups.dp_shard, size=mesh.dp_shard, rank=coords["dp_shard"],
                    replicate=groups.dp_replicate, replicas=program.replicas, dtype=dtype,
                    weight_pass=program.splits_backward)
    if program.zero1:   # Megatron's distributed optimizer: over every data-parallel rank, cp included
        return dict(group=groups.data, size=mesh.data, rank=coords["dp"] * mesh.cp + coords["cp"], dtype=dtype,
                    weight_pass=program.splits_backward)
    return dict(group=None, size=1, rank=0, replicate=groups.data if mesh.data > 1 else None,
                replicas=mesh.data, dtype=dtype, weight_pass=program.splits_backward)


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
    (checkpoints file its state under its group). ``make(param_groups)`` builds the optimizer.
    ``pieces``: the tensor each range steps, when not a view of ``flat`` (offload's host masters:
    ``runtime.offload_optimizer``, which steps them itself)."""

    def __init__(self, flat: torch.Tensor, ranges: list[tuple[int, int, int]], options: list[dict],
                 group_of: dict[str, int], make, pieces: list[torch.Tensor] | None = None):
        self.flat, self.ranges, self.group_of = flat, ranges, group_of
        whole = ranges == [(0, 0, flat.numel())] and pieces is None
        # plain views (no autograd): torch optimizers take them as leaves and update flat in place
        self.pieces = pieces if pieces is not None else [flat] if whole else [flat.detach()[a:b] for _, a, b in ranges]
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
        """The slice's update (after any edit of the 16-bit parameters is taken into the master),
        then the all-gather that rebuilds every local shard."""
        self.zero.pull_changed()
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
