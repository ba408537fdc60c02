"""A world of any size in one process whose collectives move no data and are counted: ``fake_world``.

Rehearsing one rank of an N-rank plan (``autopar.rehearse``) needs every collective its program
issues to return at once, with outputs of the right shapes, as if N-1 peers were there. torch's
own fake backend (``torch.testing._internal.distributed.fake_pg``) does that in C++, where a
collective cannot be seen; this backend is a Python ``ProcessGroup`` (the route torch's
multi-threaded test group takes, on torch 2.11-2.14) that does the same and records, per call,
the kind, the group, the phase and the bytes. Functional collectives (compiled or eager), ``torch.distributed``
calls and the pipeline's sends and receives all reach it, so the tally is what the rank issued.

Bytes are counted as a plan records them (``autopar.plans.CollectivePlan``: full tensor sizes):
an all-reduce its tensor, an all-gather its output, a reduce-scatter its input, an all-to-all its
input, a send or receive its tensor. An all-to-all that sends to one peer and receives from one
(ring attention's step) is a "send_recv", the kind plans record it as. Outputs are left as allocated (no data moves), but for a
receive's buffer, filled with ones (see ``SilentGroup.recv``).

Objects over the wire do not work (``all_gather_object``, ``broadcast_object_list``): their sizes
would be read from buffers no peer wrote. Whatever needs them must be done locally.
"""
from __future__ import annotations

import contextlib
import dataclasses
from collections import Counter

import torch
import torch.distributed as dist
from torch.futures import Future

BACKEND = "autopar_rehearsal"
# the backend a real run takes on each device, whose name the world's takes after BACKEND: code that
# reads the device or ZeRO's prefetch off the backend's name (``mesh.default_device_type``,
# ``runtime.compiler.prefetches``) then builds the program that run builds
REAL = {"cpu": "gloo", "cuda": "nccl"}


@dataclasses.dataclass
class Tally:
    """Collectives issued while counting: (kind, group name, phase) -> calls, and -> bytes; ``on``
    pauses it. The phase is "bwd" for a collective issued inside autograd's backward (an autograd
    Function's, or a compiled backward's), else ``phase``, which the caller sets to say where the
    step is ("fwd" by default; a rehearsal sets "step" around the gradient sync and the update)."""

    calls: Counter = dataclasses.field(default_factory=Counter)
    bytes: Counter = dataclasses.field(default_factory=Counter)
    on: bool = True
    phase: str = "fwd"

    def add(self, kind: str, group: str, nbytes: int) -> None:
        """Count one collective of ``kind`` on ``group`` moving ``nbytes``."""
        if self.on:
            # the engine runs a backward as a graph task; outside one the id is -1
            phase = "bwd" if torch._C._current_graph_task_id() != -1 else self.phase
            self.calls[(kind, group, phase)] += 1
            self.bytes[(kind, group, phase)] += int(nbytes)

    def clear(self) -> None:
        """Forget everything counted so far."""
        self.calls.clear()
        self.bytes.clear()


_TALLY = Tally()


def _nbytes(tensors) -> int:
    """Bytes of a tensor, or of a (nested) list of tensors."""
    if isinstance(tensors, torch.Tensor):
        return tensors.numel() * tensors.element_size()
    return sum(_nbytes(t) for t in tensors)


def _done(result=None):
    """A finished ``Work`` whose future holds ``result``."""
    from torch._C._distributed_c10d import _create_work_from_future

    fut = Future()
    fut.set_result(result)
    return _create_work_from_future(fut)


class SilentGroup(dist.ProcessGroup):
    """A process group of ``size`` ranks of which this process is ``rank``: each collective returns at
    once, its outputs as allocated, and is counted in the module's tally."""

    def __init__(self, rank: int, size: int, name: str):
        super().__init__(rank, size)
        self._size, self._name = size, name

    def size(self) -> int:
        return self._size

    def getBackendName(self) -> str:
        return self._name

    @property
    def group_name(self) -> str:
        """The name torch.distributed registered this group under (functional collectives take it)."""
        return dist.distributed_c10d._world.pg_names[self]

    def _count(self, kind: str, nbytes: int, result=None):
        _TALLY.add(kind, self.group_name, nbytes)
        return _done(result)

    # the methods torch's Python process-group trampoline calls: each C++ entry point reaches one of
    # them; where torch renamed one (torch 2.14's *_single names), it tries the new name, then the old
    def allreduce(self, tensors, opts=None):
        return self._count("all_reduce", _nbytes(tensors), tensors)

    def allreduce_coalesced(self, tensors, opts=None):
        return self._count("all_reduce", _nbytes(tensors), tensors)

    def allgather(self, outputs, inputs, opts=None):
        return self._count("all_gather", _nbytes(outputs), outputs)

    def all_gather_single(self, output, input, opts=None):
        return self._count("all_gather", _nbytes(output), output)

    def all_gather_single_coalesced(self, outputs, inputs, opts=None):
        return self._count("all_gather", _nbytes(outputs), outputs)

    allgather_into_tensor_coalesced = all_gather_single_coalesced   # the older name

    def reduce_scatter(self, outputs, inputs, opts=None):
        return self._count("reduce_scatter", _nbytes(inputs), outputs)

    def reduce_scatter_single(self, output, input, opts=None):
        return self._count("reduce_scatter", _nbytes(input), output)

    def reduce_scatter_single_coalesced(self, outputs, inputs, opts=None):
        return self._count("reduce_scatter", _nbytes(inputs), outputs)

    reduce_scatter_tensor_coalesced = reduce_scatter_single_coalesced   # the older name

    def all_to_all_single(self, output, input, output_splits=None, input_splits=None, opts=None):
        # one block to one peer and one from another: a ring's step (ring attention's), which plans
        # record as a send and receive
        ring = input_splits is not None and sum(1 for n in input_splits if n) == 1 \
            and sum(1 for n in output_splits or () if n) == 1
        return self._count("send_recv" if ring else "all_to_all", _nbytes(input), output)

    alltoall_base = all_to_all_single   # the older name

    def broadcast(self, tensors, opts=None):
        return self._count("broadcast", _nbytes(tensors), tensors)

    def barrier(self, opts=None):
        return self._count("barrier", 0)

    def send(self, tensors, dst, tag=0):
        return self._count("send", _nbytes(tensors))

    def recv(self, tensors, src, tag=0):
        # ones, not what was allocated: the values stay finite, and torch 2.13's pipeline warm-up vote
        # (a product of 1s, one per stage given its shapes, passed from stage to stage) reads "static"
        with torch.no_grad():   # a pipeline's activation buffer is a leaf that requires grad
            for t in tensors:
                t.fill_(1)
        return self._count("recv", _nbytes(tensors), tensors)


def moves_no_data(group) -> bool:
    """Whether ``group`` (a process group, None for the default one) is of this backend."""
    return dist.is_initialized() and str(dist.get_backend(group)).startswith(BACKEND)


def backend_name(device_type: str) -> str:
    """The name of the backend standing for a real run's on ``device_type`` ("cpu" or "cuda")."""
    return f"{BACKEND}_{REAL[device_type]}"


def _register(name: str) -> None:
    """Register the backend ``name`` once per process (torch refuses a second registration)."""
    if not hasattr(dist.Backend, name.upper()):
        dist.Backend.register_backend(name, lambda store, rank, size, timeout: SilentGroup(rank, size, name),
                                      devices=["cpu", "cuda"])


@contextlib.contextmanager
def fake_world(world_size: int, rank: int, device_type: str = "cpu"):
    """Within it, torch.distributed is a world of ``world_size`` ranks in which this process is
    ``rank`` and no collective moves data, standing for the backend a real run takes on
    ``device_type`` (``backend_name``); yields the ``Tally`` of what was issued. Refuses to start
    inside a world already initialised (a rehearsal is for a process of its own, or one with no
    world yet); destroys the world it made on leaving."""
    if dist.is_initialized():
        raise RuntimeError("torch.distributed is already initialised in this process; a rehearsal makes its own "
                           "world of the plan's size: run it in a process without one (not under torchrun)")
    name = backend_name(device_type)
    _register(name)
    dist.init_process_group(name, store=dist.HashStore(), rank=rank, world_size=world_size)
    _TALLY.clear()
    _TALLY.on = True
    _TALLY.phase = "fwd"
    try:
        yield _TALLY
    finally:
        dist.destroy_process_group()
