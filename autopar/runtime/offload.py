"""Optimizer offload (ZeRO-Offload): fp32 master weights and optimizer state in host memory.

With ``plan.offload == "optimizer"`` a ParallelModel keeps on its device only the weights the
graph computes with and their gradients. ``HostMasters`` holds, in host memory, an fp32 copy of
each tensor the optimizer updates (pinned when CUDA is available, so the copies run as DMA): the
rank's local shards (its dp shards under ZeRO-2/3), or under ZeRO-1 its flat dp slice. The torch
optimizer that ``pm.optimizer(cls, ...)`` builds steps those host copies on the CPU (fused where
torch has a CPU kernel for ``cls``, else foreach), in the parameter groups it was given (each
parameter's master in its group; under ZeRO-1 the runs of the slice's master that each group fills,
``zero.SliceOptimizer``). A step runs over the tensors in chunks of
about ``OFFLOAD_CHUNK`` elements, each

    gradients out     each device gradient, cast to fp32 on the device, copied into the chunk's
                      pinned staging buffer
    host update       the CPU optimizer over the chunk's fp32 masters (the only ones with a
                      gradient then: a torch optimizer skips the rest)
    weights in        each master copied back to the device and cast there to the parameter's
                      dtype (a bf16 working weight gets the rounding)

On a GPU the copies run on two side streams, one each way, so that they overlap the host's
work: chunk i+1's gradients travel out and chunk i-1's weights in while the CPU updates chunk i
(two staging buffers take turns; ``cost_model.compute.offload_update_time`` prices this
pipeline). Without a GPU the three run in turn. Either way the host holds the masters and the
optimizer state (12 bytes per parameter for AdamW) plus at most two chunks of gradients, not a
second full fp32 copy for them.

With bf16 the host copy is the master weight: the device parameters themselves become bf16 (no
fp32 copy stays on the device), except those whose gradient the graph sums over tp (a replicated
norm weight under sequence parallelism), which stay fp32 so that sum is not rounded. The gradient copies start after the step's
backward and its dp sum, not during it: a compiled backward is one autograd node whose gradients
all land at its end, so per-parameter hooks would overlap nothing there.

A device tensor changed other than by the step (a checkpoint load into ZeRO-1's slice, an edit
under ``torch.no_grad``) bumps its version counter, and the next step first copies it to its
master. Checkpoints hold the masters (``ParallelModel.stored_weights``) and the inner optimizer's
state, laid out as an unoffloaded optimizer's, so a checkpoint saved with offload loads without
it and back.
"""
from __future__ import annotations

import contextlib
import functools
import inspect

import torch

from autopar.runtime.zero import SliceOptimizer, Zero1, Zero1Optimizer

# Gradient elements a step stages on the host at once (1 GiB of fp32); the cost model prices this
# chunk (``cost_model.compute.OFFLOAD_CHUNK``, checked equal by tests/runtime/test_offload.py).
OFFLOAD_CHUNK = 2**28


class HostMasters:
    """fp32 host copies of the device tensors an optimizer updates, the pinned buffer their
    gradients pass through, and the chunked step (see the module docstring).

    ``device``: name -> device tensor (a parameter, whose ``.grad`` the step reads); tensors with
    no elements or no gradient are left on the device. ``dtype``: the 16-bit dtype the device
    tensors are narrowed to once their masters exist (None: kept as they are), except ``keep_fp32``.
    ``chunk``: gradient elements staged at once (at least the largest tensor's)."""

    def __init__(self, device: dict[str, torch.Tensor], *, dtype: torch.dtype | None = None,
                 keep_fp32=frozenset(), chunk: int = OFFLOAD_CHUNK):
        self.pinned = torch.cuda.is_available()
        self.device = {k: t for k, t in device.items() if t.numel() and t.requires_grad}
        with torch.no_grad():
            self.masters = {k: _host_empty(t.numel(), self.pinned).view(t.shape).copy_(t)
                            for k, t in self.device.items()}
            if dtype is not None:
                for k, t in self.device.items():
                    if k not in keep_fp32:
                        t.data = t.data.to(dtype)
        self.chunks = _chunks({k: t.numel() for k, t in self.device.items()}, chunk)
        cuda = self.pinned and any(t.is_cuda for t in self.device.values())
        # (gradients out, weights in): the copy streams of a GPU; without one, copies run in turn
        self._streams = (torch.cuda.Stream(), torch.cuda.Stream()) if cuda else None
        largest = max((sum(self.device[k].numel() for k in c) for c in self.chunks), default=0)
        self._staging = [_host_empty(largest, self.pinned)
                         for _ in range(2 if cuda and len(self.chunks) > 1 else 1)]
        self._version = {k: t._version for k, t in self.device.items()}

    @torch.no_grad()
    def pull_changed(self) -> None:
        """Copy into its master every device tensor changed since the step last wrote it."""
        for k, t in self.device.items():
            if t._version != self._version[k]:
                self.masters[k].copy_(t)
                self._version[k] = t._version

    @torch.no_grad()
    def grads_out(self, names, staging: torch.Tensor) -> dict[str, torch.Tensor]:
        """Starts copying the gradients of ``names`` (one chunk), cast to fp32, into ``staging``;
        returns name -> its gradient's view of ``staging`` (none for a tensor with no gradient, so
        that the optimizer leaves its master). On a GPU the copies run on the outgoing stream:
        wait for the event ``_launch`` records before reading the views."""
        views, at = {}, 0
        with _on(self._streams, 0):
            for k in names:
                g = self.device[k].grad
                if g is None:
                    continue
                if self._streams is not None:
                    g.record_stream(self._streams[0])   # the step may drop the gradient before the copy ends
                views[k] = staging[at:at + g.numel()].view(g.shape)
                at += g.numel()
                # cast on the device: a copy that converts on its way to the host would not be DMA
                views[k].copy_(g.float(), non_blocking=self.pinned)
        return views

    @torch.no_grad()
    def weights_in(self, names=None, *, wait: bool = True) -> None:
        """The masters of ``names`` (default all) copied back into their device tensors, at those
        tensors' dtypes; with ``wait=False`` (``step``) the copies may still run on the incoming
        stream when this returns."""
        with _on(self._streams, 1):
            for k in self.device if names is None else names:
                t, master = self.device[k], self.masters[k]
                # the fp32 weight crosses once and is cast on the device, where the bf16 copy lives
                t.copy_(master.to(t.device, non_blocking=self.pinned) if t.device != master.device else master)
                self._version[k] = t._version
        if wait:
            self._landed()

    def _landed(self) -> None:
        """Waits for the incoming copies (a master may change once they are done: a load, the next
        step) and orders the device's next work after them."""
        if self._streams is not None:
            self._streams[1].synchronize()
            torch.cuda.current_stream().wait_stream(self._streams[1])

    def step(self, inner: torch.optim.Optimizer, closure=None):
        """One offloaded step of ``inner`` (over the masters): changed device tensors in, then per
        chunk its gradients out, ``inner`` over it on the host, its weights back; the next chunk's
        gradients are already on their way while the host updates this one. Every copy has
        landed when it returns."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        self.pull_changed()
        for master in self.masters.values():
            master.grad = None
        if self._streams is not None:   # the side streams start after the backward and the dp sum
            for stream in self._streams:
                stream.wait_stream(torch.cuda.current_stream())
        ahead = self._streams is not None   # copies that run beside the host's update
        pending = self._launch(0)
        for i, names in enumerate(self.chunks):
            views, copied = pending
            if ahead:
                pending = self._launch(i + 1)   # into the other staging buffer, during this chunk's update
            if copied is not None:
                copied.synchronize()
            for k, view in views.items():
                self.masters[k].grad = view
            inner.step()
            for k in views:
                self.masters[k].grad = None   # this staging buffer is chunk i+2's (i+1's with one buffer)
            self.weights_in(names, wait=False)
            if not ahead:
                pending = self._launch(i + 1)
        self._landed()
        return loss

    def _launch(self, i: int):
        """(views, event) of chunk ``i``'s gradients, copying out; ((), None) past the last chunk."""
        if i >= len(self.chunks):
            return {}, None
        views = self.grads_out(self.chunks[i], self._staging[i % len(self._staging)])
        return views, self._streams[0].record_event() if self._streams is not None else None

    def zero_grad(self) -> None:
        """Drop the device gradients."""
        for t in self.device.values():
            t.grad = None


class OffloadOptimizer:
    """A torch optimizer over a rank's host masters, stepped on the CPU, its result copied to the
    device parameters. ``param_groups``, ``state_dict`` and ``load_state_dict`` are the inner
    optimizer's (its parameters are the masters, shaped like the local shards)."""

    def __init__(self, host: HostMasters, inner: torch.optim.Optimizer):
        self.host, self.inner = host, inner
        self.param_groups = inner.param_groups

    def step(self, closure=None):
        """Gradients to the host, the inner optimizer's step there, the weights back."""
        return self.host.step(self.inner, closure)

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Drop every gradient (always set to None)."""
        self.host.zero_grad()

    def state_dict(self):
        """The inner optimizer's state (on the host)."""
        return self.inner.state_dict()

    def load_state_dict(self, state) -> None:
        """Load the inner optimizer's state (torch moves it to the host masters)."""
        self.inner.load_state_dict(state)


class Zero1OffloadOptimizer(Zero1Optimizer):
    """ZeRO-1 with its flat dp slice's master and optimizer state on the host: the reduce-scattered
    slice gradient goes out, the host steps, the slice comes back and is all-gathered. To
    checkpoints it is a ``Zero1Optimizer`` (the same state over the same slice)."""

    def __init__(self, zero: Zero1, host: HostMasters, sliced: SliceOptimizer):
        super().__init__(zero, sliced)
        self.host = host

    def step(self, closure=None):
        """The host step over the slice, then the all-gather that rebuilds every local shard."""
        loss = self.host.step(self.sliced, closure)
        self.zero.all_gather_params()
        return loss

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Drop the slice's gradient and the local shards' (always set to None)."""
        self.host.zero_grad()
        for p in self.zero.params:
            p.grad = None


def offloaded_optimizer(cls, host: HostMasters, groups, defaults: dict, zero: Zero1 | None = None):
    """``cls`` over ``host``'s masters, as ``pm.optimizer`` builds it with offload: ``groups`` None
    (every master) or [(FQNs, options)] per parameter group; with ``zero``, over the masters of
    ZeRO-1's slice (``host.masters["slice"]``), split by group as ``Zero1.slice_optimizer`` splits it."""
    def make(param_groups):
        return host_optimizer(cls, param_groups, **defaults)

    if zero is not None:
        return Zero1OffloadOptimizer(zero, host, zero.slice_optimizer(host.masters["slice"], groups, make))
    if groups is None:
        return OffloadOptimizer(host, make(list(host.masters.values())))
    # a parameter with no master (no elements, or no gradient) is never stepped: left out of its group
    return OffloadOptimizer(host, make([{**options, "params": [host.masters[f] for f in fqns if f in host.masters]}
                                        for fqns, options in groups]))


def host_optimizer(cls, params, **kwargs) -> torch.optim.Optimizer:
    """``cls(params, **kwargs)`` for fp32 host tensors, with ``fused=True`` when torch has a CPU
    kernel for ``cls`` (AdamW, Adam, SGD, ...), else ``foreach=True`` where ``cls`` takes it, unless
    ``kwargs`` chose either."""
    if "fused" not in kwargs and "foreach" not in kwargs:
        takes = inspect.signature(cls.__init__).parameters
        if "fused" in takes and _fused_on_cpu(cls):
            kwargs = {**kwargs, "fused": True}
        elif "foreach" in takes:
            kwargs = {**kwargs, "foreach": True}
    return cls(params, **kwargs)


@functools.cache
def _fused_on_cpu(cls) -> bool:
    """Whether this torch build runs ``cls(fused=True)`` on CPU tensors (some refuse at construction,
    others at the first step)."""
    p = torch.zeros(1, requires_grad=True)
    p.grad = torch.zeros(1)
    try:
        cls([p], fused=True).step()
    except (RuntimeError, ValueError, TypeError):
        return False
    return True


def _chunks(sizes: dict[str, int], chunk: int) -> list[list[str]]:
    """``sizes``' names in order, in runs of at most ``chunk`` elements (a larger tensor alone)."""
    out, total = [], chunk
    for k, n in sizes.items():
        if total + n > chunk:
            out.append([])
            total = 0
        out[-1].append(k)
        total += n
    return out


def _host_empty(numel: int, pinned: bool) -> torch.Tensor:
    """``numel`` fp32 numbers in host memory, page-locked when ``pinned``."""
    try:
        return torch.empty(numel, dtype=torch.float32, device="cpu", pin_memory=pinned)
    except RuntimeError as e:
        raise RuntimeError(f"offload='optimizer' keeps the optimizer in pinned (page-locked) host memory, and "
                           f"pinning {numel * 4 / 2**20:.1f} MiB failed ({e}); raise the locked-memory limit "
                           "(ulimit -l), free host memory, or plan with offload='none'") from None


def _on(streams, which: int):
    """The context that runs copies on side stream ``which`` (0 out, 1 in), or nothing without streams."""
    return torch.cuda.stream(streams[which]) if streams is not None else contextlib.nullcontext()
