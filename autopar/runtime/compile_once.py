"""Peer ranks on one host compile each graph once through Inductor; the others load it from the cache.

The ranks of one pipeline stage on one host lower graphs of the same code: tensor and data
parallel shards differ in values, not in shapes or ops. Inductor keeps what it compiles in an
on-disk cache (its FX graph cache) that the ranks of a host share, but left alone every rank
compiles every graph at the same moment, each missing that cache, and a host with fewer cores than
ranks compiles the same graph side by side. Here the lowest rank of each group of peers (same host,
same Inductor cache directory, same pipeline and context-parallel coordinate) compiles each graph
first; the other peers wait, then compile the same graph, which the cache answers (tests/passes/test_overlap.py's tp=2 step of
the tiny GPT on two CPU ranks, forward and backward: about 26 CPU s per rank compiled cold, about
7 from the cache).

The order is kept per graph with the default process group's store: the leader writes
``.../k/start`` before its k-th compile and ``.../k/end`` after it (also when it fails); a peer
waits for both before its own k-th compile. Waiting is bounded, so a peer whose graphs are not
the leader's (rank-dependent code) costs time, never a hang: a peer gives the leader
``START_S`` seconds to begin the same compile, and ``END_S`` to finish it, then compiles alone. The
backward graph is compiled with the forward (AOTAutograd otherwise compiles it lazily, at the
first backward, outside this order). ``AUTOPAR_COMPILE_ONCE=0`` turns the order off.
"""
from __future__ import annotations

import contextlib
import functools
import logging
import os
import socket
from datetime import timedelta
from itertools import count

import torch.distributed as dist

log = logging.getLogger(__name__)

START_S = 60.0    # a leader in step with its peers begins the same compile within this
END_S = 1800.0    # the longest compile waited for
_MODELS = count()   # ParallelModels built in this process: the same sequence on every rank


def inductor_cache_dir() -> str:
    """The directory Inductor caches compiled graphs in, for this process."""
    from torch._inductor.runtime.cache_dir_utils import cache_dir
    return os.path.realpath(cache_dir())


def enabled() -> bool:
    return os.environ.get("AUTOPAR_COMPILE_ONCE", "1") != "0"


def peer_order(coords: dict[str, int]):
    """This rank's ``CompileOrder`` among the ranks of its host that share its Inductor cache and
    its pipeline and context-parallel coordinates, or None when it has no peer. Collective: every
    rank of the default group calls it, in the same order."""
    serial = next(_MODELS)
    if not (dist.is_initialized() and dist.get_world_size() > 1 and enabled()):
        return None
    mine = (socket.gethostname(), inductor_cache_dir(), coords.get("pp", 0), coords.get("cp", 0))
    everyone = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, mine)
    peers = [r for r, theirs in enumerate(everyone) if theirs == mine]
    if len(peers) < 2:
        return None
    return CompileOrder(f"autopar/compile-once/{serial}/{peers[0]}", leader=dist.get_rank() == peers[0])


class CompileOrder:
    """The k-th compile of a follower waits for the k-th compile of its leader (see the module)."""

    def __init__(self, prefix: str, leader: bool, store=None):
        self.prefix, self.leader, self._count = prefix, leader, count()
        self._store = store if store is not None else dist.distributed_c10d._get_default_store()

    def wrap(self, backend):
        """``backend`` (a torch.compile backend) with this rank's compiles kept in order."""
        return _Ordered(self, backend)

    @contextlib.contextmanager
    def turn(self):
        """The block of one compile: the leader's is announced, a follower's waits for the leader's."""
        key = f"{self.prefix}/{next(self._count)}"
        if self.leader:
            self._store.set(f"{key}/start", b"1")
            try:
                yield
            finally:
                self._store.set(f"{key}/end", b"1")
            return
        for stage, limit in (("start", START_S), ("end", END_S)):
            try:
                self._store.wait([f"{key}/{stage}"], timedelta(seconds=limit))
            except Exception:   # the store's timeout: the leader compiles something else, or nothing
                log.info("autopar: %s/%s not seen in %.0f s; this rank compiles on its own", key, stage, limit)
                break
        yield


class _Ordered:
    """A torch.compile backend whose compiles take their turn (``CompileOrder.turn``), the backward
    compiled with the forward."""

    def __init__(self, order: CompileOrder, backend):
        self.order, self.backend = order, backend
        functools.update_wrapper(self, backend, assigned=("__name__", "__qualname__"), updated=())

    def __call__(self, gm, example_inputs, **kwargs):
        with self.order.turn(), _backward_with_forward():
            return self.backend(gm, example_inputs, **kwargs)

    def reset(self):
        if hasattr(self.backend, "reset"):
            self.backend.reset()


def _backward_with_forward():
    """AOTAutograd compiles the backward graph now rather than at the first backward (a flag of
    torch._functorch.config; without it the backward compiles unordered, which is only slower)."""
    import torch._functorch.config as functorch_config
    if not hasattr(functorch_config, "force_non_lazy_backward_lowering"):
        return contextlib.nullcontext()
    return functorch_config.patch(force_non_lazy_backward_lowering=True)
