"""Optimizer offload (ZeRO-Offload): fp32 master weights and optimizer state in host memory.

With ``plan.offload == "optimizer"`` a ParallelModel keeps on its device only the weights the
graph computes with and their gradients. ``HostMasters`` holds, in host memory, an fp32 copy of
each tensor the optimizer updates (pinned when CUDA is available, so the copies run as DMA): the
rank's local shards (its dp shards under ZeRO-2/3), or under ZeRO-1 the runs of its flat dp slice.
The torch optimizer that ``pm.optimizer(cls, ...)`` builds steps those host copies on the CPU
(fused where torch has a CPU kernel for ``cls``, else foreach), in the parameter groups it was
given (``runtime.offload_optimizer``).

Partial offload (``plan.offload_kept``): the parameters of the units named there (the units of
``graph.units.zero_units``, each parameter with its owner, ``graph.units.owner_units``) keep
their fp32 weight and optimizer state on the device, stepped by ``cls`` there (fused where the
device has the kernel); at 16 bits they stay fp32 parameters, cast to 16 bits in the graph. Under
ZeRO-1 the slice is cut into runs by the owners of the parameters in it, and only the offloaded
runs have host masters. A step launches the device's update first (asynchronous on a GPU), then
runs the host's beside it.

A host update runs over its tensors in chunks of about ``OFFLOAD_CHUNK`` elements, each

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
optimizer state (12 bytes per parameter for AdamW) plus at most two chunks of gradients.

When the host update runs (``Offload``):

    after the backward  the default where the gradients are not final inside the backward (a dp or
                        cp sum after it, ZeRO-1, pp > 1): ``opt.step()`` runs the chunked update
    in the backward     elsewhere (``Program.offload_marks``) a marker per unit reports the unit's
                        summed gradients as the compiled backward computes them
                        (``passes.offload_marks``); the unit's update starts then, on a host
                        worker thread beside the rest of the backward (without CUDA, at once, in
                        turn), and its weights are copied back once the next unit's marker has
                        fired (or the backward ended): by then no op of the backward reads them.
                        ``opt.step()`` waits for the host and steps the device-kept units. Only the
                        last microbatch's backward does this, and only for the optimizer
                        ``pm.optimizer`` built last; ``pm.offload_overlap = False`` turns it off
                        (needed to clip the gradients: ``clip_grad_norm_`` refuses after an update
                        already ran)
    one step late       ``plan.offload_delay = 1`` (ZeRO-Offload's delayed parameter update):
                        ``opt.step()`` of step t copies the host's update of step t-1 in, steps the
                        kept units, and starts the host's update of step t on the worker, which
                        overlaps step t+1's forward and backward. The offloaded weights the device
                        computes with lag one update behind their masters; the kept units are exact.

With bf16 the host copy is the master weight: the device parameters of offloaded units become
bf16 themselves (no fp32 copy stays on the device), except those whose gradient the graph sums
over tp (a replicated norm weight under sequence parallelism), which stay fp32 so that sum is not
rounded.

A device tensor changed other than by the step (a checkpoint load into ZeRO-1's slice, an edit
under ``torch.no_grad``) bumps its version counter, and the next step first copies it to its
master. Checkpoints hold the masters (``ParallelModel.stored_weights``: with a delayed update,
every update the host made, the pending one included) and the optimizer's state, laid out as an
unoffloaded optimizer's, so a checkpoint saved with any split loads with any other, or none.
"""
from __future__ import annotations

import contextlib
import functools
import inspect
import queue
import threading

import torch

from autopar.passes.offload_marks import set_listener

# Gradient elements a step stages on the host at once (1 GiB of fp32); the cost model prices this
# chunk (``cost_model.compute.OFFLOAD_CHUNK``, checked equal by tests/runtime/test_offload.py).
OFFLOAD_CHUNK = 2**28


class HostMasters:
    """fp32 host copies of the device tensors an optimizer updates, the pinned buffers their
    gradients pass through, and the chunked update (see the module docstring).

    ``device``: name -> device tensor; ``grads(name)``: its gradient (default the tensor's
    ``.grad``; given, every tensor with elements is held, e.g. views of ZeRO-1's slice). Tensors
    with no elements or (by default) no gradient are left on the device. ``dtype``: the 16-bit
    dtype the device tensors are narrowed to once their masters exist (None: kept as they are),
    except ``keep_fp32``. ``chunk``: gradient elements staged at once (at least the largest tensor's)."""

    def __init__(self, device: dict[str, torch.Tensor], *, grads=None, dtype: torch.dtype | None = None,
                 keep_fp32=frozenset(), chunk: int = OFFLOAD_CHUNK):
        self.pinned = torch.cuda.is_available()
        self.grad_of = grads if grads is not None else (lambda k: self.device[k].grad)
        self.device = {k: t for k, t in device.items() if t.numel() and (grads is not None or t.requires_grad)}
        self.chunk = chunk
        with torch.no_grad():
            self.masters = {k: _host_empty(t.numel(), self.pinned).view(t.shape).copy_(t)
                            for k, t in self.device.items()}
            if dtype is not None:
                for k, t in self.device.items():
                    if k not in keep_fp32:
                        t.data = t.data.to(dtype)
        self.chunks = _chunks({k: t.numel() for k, t in self.device.items()}, chunk)
        self.cuda = self.pinned and any(t.is_cuda for t in self.device.values())
        # (gradients out, weights in): the copy streams of a GPU; without one, copies run in turn
        self._streams = (torch.cuda.Stream(), torch.cuda.Stream()) if self.cuda else None
        largest = max((sum(self.device[k].numel() for k in c) for c in self.chunks), default=0)
        self._staging = [_host_empty(largest, self.pinned)
                         for _ in range(2 if self.cuda and len(self.chunks) > 1 else 1)]
        self.note_versions()

    def note_versions(self) -> None:
        """Take the device tensors as they are now as the masters' (after a step wrote both)."""
        self._version = {k: t._version for k, t in self.device.items()}

    @torch.no_grad()
    def pull_changed(self) -> None:
        """Copy into its master every device tensor changed since the step last wrote it."""
        for k, t in self.device.items():
            if t._version != self._version[k]:
                self.masters[k].copy_(t)
                self._version[k] = t._version

    def gradients(self, names=None) -> dict[str, torch.Tensor | None]:
        """The device gradients of ``names`` (default all) as they are now, by name."""
        return {k: self.grad_of(k) for k in (self.device if names is None else names)}

    def start(self) -> None:
        """Order the copy streams after the device's work queued so far (the backward, the dp sum):
        called before the device's own update is queued, so the copies do not wait for it."""
        if self._streams is not None:
            for stream in self._streams:
                stream.wait_stream(torch.cuda.current_stream())

    @torch.no_grad()
    def grads_out(self, grads: dict, staging: torch.Tensor) -> dict[str, torch.Tensor]:
        """Starts copying ``grads`` (name -> device gradient or None; one chunk), cast to fp32, into
        ``staging``; returns name -> its gradient's view of ``staging`` (none for a tensor with no
        gradient, so that the optimizer leaves its master). On a GPU the copies run on the
        outgoing stream: wait for the event ``_launch`` records before reading the views."""
        views, at = {}, 0
        with _on(self._streams, 0):
            for k, g in grads.items():
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
    def weights_in(self, names=None, *, wait: bool = True, after=None) -> None:
        """The masters of ``names`` (default all) copied back into their device tensors, at those
        tensors' dtypes, once the device's work reaches the CUDA event ``after`` (None: at once);
        with ``wait=False`` the copies may still run on the incoming stream when this returns."""
        if self._streams is not None and after is not None:
            self._streams[1].wait_event(after)
        with _on(self._streams, 1):
            for k in self.device if names is None else names:
                t, master = self.device[k], self.masters[k]
                # the fp32 weight crosses once and is cast on the device, where the bf16 copy lives
                t.copy_(master.to(t.device, non_blocking=self.pinned) if t.device != master.device else master)
                self._version[k] = t._version
        if wait:
            self.landed()

    def landed(self) -> None:
        """Waits for the incoming copies (a master may change once they are done: a load, the next
        step) and orders the device's next work after them."""
        if self._streams is not None:
            self._streams[1].synchronize()
            torch.cuda.current_stream().wait_stream(self._streams[1])

    def update(self, inner, grads: dict, *, ready=None, weights: bool = True) -> None:
        """``inner`` (an optimizer over the masters) stepped with ``grads`` (name -> device gradient,
        as ``gradients`` took them), chunk by chunk: each chunk's gradients out, its update, and with
        ``weights`` its weights back; the next chunk's gradients are already on their way while the
        host updates this one. ``ready``: the CUDA event after which the gradients are final (None:
        ``start`` ordered the copies). Weights copied in may still be on their way when it returns."""
        for master in self.masters.values():
            master.grad = None
        if self._streams is not None and ready is not None:
            self._streams[0].wait_event(ready)
        chunks = _chunks({k: self.device[k].numel() for k in grads}, self.chunk)
        ahead = self._streams is not None   # copies that run beside the host's update
        pending = self._launch(chunks, grads, 0)
        for i, names in enumerate(chunks):
            views, copied = pending
            if ahead:
                pending = self._launch(chunks, grads, i + 1)   # into the other staging buffer, meanwhile
            if copied is not None:
                copied.synchronize()
            for k, view in views.items():
                self.masters[k].grad = view
            inner.step()
            for k in views:
                self.masters[k].grad = None   # this staging buffer is chunk i+2's (i+1's with one buffer)
            if weights:
                self.weights_in(names, wait=False)
            if not ahead:
                pending = self._launch(chunks, grads, i + 1)

    def step(self, inner, closure=None):
        """One offloaded step of ``inner`` (over the masters) with every gradient: changed device
        tensors in, the chunked update, every copy landed when it returns."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        self.pull_changed()
        self.start()
        self.update(inner, self.gradients())
        self.landed()
        return loss

    def _launch(self, chunks, grads: dict, i: int):
        """(views, event) of chunk ``i``'s gradients, copying out; ({}, None) past the last chunk."""
        if i >= len(chunks):
            return {}, None
        views = self.grads_out({k: grads[k] for k in chunks[i]}, self._staging[i % len(self._staging)])
        return views, self._streams[0].record_event() if self._streams is not None else None

    def zero_grad(self) -> None:
        """Drop the device gradients (tensors whose gradients something else holds are left alone)."""
        for t in self.device.values():
            if t.requires_grad:
                t.grad = None


class Worker:
    """Runs the host's jobs in order: on a thread beside the device's work when ``threaded`` (a
    GPU's copies and kernels are asynchronous, and the host's optimizer releases the GIL), else
    each at once in the caller. ``drain`` waits for every job and raises the first one's error."""

    def __init__(self, threaded: bool):
        self.threaded = threaded
        self._jobs: queue.Queue = queue.Queue()
        self._error: list[BaseException] = []
        self._thread = None

    def submit(self, fn) -> None:
        """Run ``fn()`` after the jobs submitted before it."""
        if not self.threaded:
            fn()
            return
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name="autopar-offload", daemon=True)
            self._thread.start()
        self._jobs.put(fn)

    def _run(self) -> None:
        while True:
            fn = self._jobs.get()
            try:
                if not self._error:
                    fn()
            except BaseException as e:   # handed to the thread that drains
                self._error.append(e)
            finally:
                self._jobs.task_done()

    def drain(self) -> None:
        """Wait for every job submitted; raise the first error one of them raised."""
        if self.threaded:
            self._jobs.join()
        if self._error:
            e = self._error[0]
            self._error.clear()
            raise RuntimeError(f"optimizer offload: the host's update failed: {type(e).__name__}: {e}") from e


class Offload:
    """A rank's offload runtime: its ``HostMasters``, the worker that runs host updates, and when
    they land (the module docstring's three ways). ``units``: unit index -> the host masters'
    names a marker reports (None: no update in the backward); ``delay``: ``plan.offload_delay``."""

    def __init__(self, host: HostMasters, *, delay: int = 0, units: dict[int, tuple[str, ...]] | None = None):
        self.host, self.delay, self.units = host, delay, units
        self.worker = Worker(host.cuda)
        self.armed = None   # the optimizer pm.optimizer built last (its host part runs in the backward)
        self.overlap = units is not None   # pm.offload_overlap
        self.pending = False   # one step late: a host update whose weights are not in yet
        self.stepped = False   # this step's host update ran in the backward
        self._lock = threading.Lock()
        self._unreleased: list[int] = []   # units marked whose weights may still be read by the backward
        self._state: dict[int, list] = {}   # unit -> [updated, release event (False: not yet)]

    # ---- in the backward ---------------------------------------------------------------------

    def backward_begins(self) -> bool:
        """Before the step's last backward: whether its markers update the host (and then listen)."""
        opt = self.armed
        if not (self.overlap and self.units and opt is not None and opt.host_inner is not None):
            return False
        if self.stepped:   # a second update of the masters before opt.step() would step them twice
            raise RuntimeError("train_step ran again before opt.step(), but the host already updated its units in "
                               "the last backward; call opt.step() between steps, or set pm.offload_overlap = False "
                               "to add up gradients over several train_step calls")
        self.settle()
        opt.sync_groups()
        self.host.pull_changed()
        self.stepped, self._unreleased, self._state = True, [], {}
        set_listener(self._unit_ready)
        return True

    def _unit_ready(self, unit: int, grads) -> None:
        """A marker's backward: unit ``unit``'s gradients are final; earlier-marked units' weights may come in."""
        names = self.units.get(unit, ())
        final = {}
        for k, g in zip(names, grads):
            held = self.host.grad_of(k)   # earlier microbatches' sum: autograd adds this one after the backward
            final[k] = held if g is None else g if held is None else held + g
        event = torch.cuda.current_stream().record_event() if self.host.cuda else None
        self._release(event)
        self._unreleased.append(unit)
        with self._lock:
            self._state[unit] = [False, False]
        inner = self.armed.host_inner
        self.worker.submit(lambda: self._update(unit, inner, final, event))

    def _update(self, unit: int, inner, grads: dict, event) -> None:
        self.host.update(inner, grads, ready=event, weights=False)
        self._handoff(unit, updated=True)

    def _release(self, event) -> None:
        """The weights of every unit marked so far may be overwritten once the device reaches ``event``."""
        for unit in self._unreleased:
            self._handoff(unit, release=event)
        self._unreleased = []

    def _handoff(self, unit: int, *, updated: bool = False, release=False) -> None:
        """Copy unit ``unit``'s weights in once it is both updated and released, in whichever thread comes second."""
        with self._lock:
            state = self._state[unit]
            if updated:
                state[0] = True
            if release is not False:
                state[1] = release
            ready = state[0] and state[1] is not False
        if ready:
            event = state[1]
            self.host.weights_in([k for k in self.units[unit] if k in self.host.device], wait=False, after=event)

    def backward_ends(self) -> None:
        """After the step's last backward: every marked unit's weights may come in."""
        set_listener(None)
        self._release(torch.cuda.current_stream().record_event() if self.host.cuda else None)

    # ---- landing ------------------------------------------------------------------------------

    def settle(self) -> None:
        """Before anything reads the device weights or masters: every host update done, every copy
        landed (a delayed update stays pending: its weights come in at the next ``opt.step()``)."""
        self.worker.drain()
        self.host.landed()

    def discard(self) -> None:
        """After a checkpoint load: a pending delayed update, or one the backward ran, is dropped
        (its masters were loaded over)."""
        self.settle()
        self.pending = self.stepped = False


@contextlib.contextmanager
def backward_listening(offload: Offload | None, last: bool):
    """Around one backward of a step: with ``last`` (the step's last microbatch) and an ``offload``
    that updates in the backward, its markers start the host's updates."""
    active = offload is not None and last and offload.backward_begins()
    try:
        yield
    finally:
        if active:
            offload.backward_ends()


def host_optimizer(cls, params, **kwargs) -> torch.optim.Optimizer:
    """``cls(params, **kwargs)`` for fp32 host tensors, with ``fused=True`` when torch has a CPU
    kernel for ``cls`` (AdamW, Adam, SGD, ...), else ``foreach=True`` where ``cls`` takes it, unless
    ``kwargs`` chose either."""
    if "fused" not in kwargs and "foreach" not in kwargs:
        takes = inspect.signature(cls.__init__).parameters
        if "fused" in takes and _fused_on(cls, "cpu"):
            kwargs = {**kwargs, "fused": True}
        elif "foreach" in takes:
            kwargs = {**kwargs, "foreach": True}
    return cls(params, **kwargs)


def device_optimizer(cls, params, **kwargs) -> torch.optim.Optimizer:
    """``cls(params, **kwargs)`` for the device-kept pieces: ``fused=True`` on a GPU where torch
    has the kernel for ``cls`` and ``kwargs`` chose neither fused nor foreach; else torch's default."""
    first = next((p for g in params for p in g["params"]), None)
    if first is not None and first.is_cuda and "fused" not in kwargs and "foreach" not in kwargs:
        if "fused" in inspect.signature(cls.__init__).parameters and _fused_on(cls, "cuda"):
            kwargs = {**kwargs, "fused": True}
    return cls(params, **kwargs)


@functools.cache
def _fused_on(cls, device: str) -> bool:
    """Whether this torch build runs ``cls(fused=True)`` on ``device`` tensors (some refuse at
    construction, others at the first step)."""
    p = torch.zeros(1, requires_grad=True, device=device)
    p.grad = torch.zeros(1, device=device)
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
                           "(ulimit -l), free host memory, keep more units on the device (plan.offload_kept), "
                           "or plan with offload='none'") from None


def _on(streams, which: int):
    """The context that runs copies on side stream ``which`` (0 out, 1 in), or nothing without streams."""
    return torch.cuda.stream(streams[which]) if streams is not None else contextlib.nullcontext()
