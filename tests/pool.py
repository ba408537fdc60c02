"""One spawn per world size for the whole pytest session.

A test module registers its rank work at import time, ``JOB = pool.job(world, fn, *args)``; the
first test that asks any job of a world size for its result (``JOB.result()``) spawns that world
once and runs there every job registered for it so far, in registration order, in the same ranks.
Process start-up, the imports and the first collective of each process are then paid once per
world size instead of once per module.

A job that raises (on any rank) gives its traceback to the tests that read it; the jobs after it
still run. Work that must own its processes stays on ``autopar.launch.spawn``: expected rank
failures, extra environment variables, and global switches such as ``autopar.set_deterministic``.
"""
from __future__ import annotations

import atexit
import pickle
import shutil
import tempfile
import time
import traceback

from autopar.launch import spawn

_JOBS: dict[int, list["Job"]] = {}
_RESULTS: dict[int, list] = {}
_FAILED: dict[int, str] = {}
_WORKDIR: list[str] = []


class JobError(AssertionError):
    """A pooled job raised on some rank."""


class Job:
    def __init__(self, world: int, fn, args: tuple, timeout: float, workdir: bool, lazy):
        self.world, self.fn, self.args, self.timeout, self.workdir, self.lazy = world, fn, args, timeout, workdir, lazy
        self.path = None   # the workdir, once the pool has started
        self.index = len(_JOBS.setdefault(world, []))
        _JOBS[world].append(self)

    def result(self) -> list:
        """fn's return values, indexed by rank."""
        per_rank = _run(self.world)
        outcomes = [r[self.index] for r in per_rank]
        errors = [f"rank {rank}:\n{value}" for rank, (ok, value, _) in enumerate(outcomes) if not ok]
        if errors:
            raise JobError(f"{self.fn.__module__}.{self.fn.__qualname__} failed in the pool:\n" + "\n".join(errors))
        return [value for _, value, _ in outcomes]


def job(world: int, fn, *args, timeout: float = 600.0, workdir: bool = False, lazy=None) -> Job:
    """Registers ``fn(rank, world, *args)`` (or, with ``workdir``, ``fn(rank, world, path, *args)``
    with a fresh directory every rank of this job shares) to run in the pool of ``world`` ranks.
    ``lazy``, a callable, gives more arguments when the pool starts: the ranks import the test
    modules again, so a module's import should not compute them."""
    return Job(world, fn, args, timeout, workdir, lazy)


def _run_all(rank, world, jobs):
    out = []
    for fn, args in jobs:
        start = time.perf_counter()
        try:
            out.append((True, fn(rank, world, *args), time.perf_counter() - start))
        except Exception:
            out.append((False, traceback.format_exc(), time.perf_counter() - start))
    # plain pickle bytes: the pipe's own pickler would share every tensor through a file
    # descriptor, and a pool's worth of them runs out ("received 0 items of ancdata")
    return pickle.dumps(out)


def _run(world: int) -> list:
    if world in _FAILED:   # a new exception each time: re-raising one would grow its traceback per test
        raise JobError(f"the pool of {world} ranks failed: {_FAILED[world]}")
    jobs = _JOBS[world]
    done = _RESULTS.get(world, [[]])[0]
    if len(done) < len(jobs):   # jobs registered after the last spawn (a module imported late)
        if not _WORKDIR:
            _WORKDIR.append(tempfile.mkdtemp(prefix="autopar-pool-"))
            atexit.register(shutil.rmtree, _WORKDIR[0], ignore_errors=True)
        todo = jobs[len(done):]
        for j in todo:
            if j.workdir:
                j.path = tempfile.mkdtemp(dir=_WORKDIR[0])
        work = [(j.fn, ((j.path,) if j.workdir else ()) + j.args + (tuple(j.lazy()) if j.lazy else ()))
                for j in todo]
        try:
            res = spawn(_run_all, world, work, timeout=min(3600.0, sum(j.timeout for j in todo)))
        except Exception as e:
            _FAILED[world] = f"{type(e).__name__}: {e}"
            raise
        previous = _RESULTS.get(world, [[] for _ in range(world)])
        _RESULTS[world] = [previous[r] + pickle.loads(res[r]) for r in range(world)]
    return _RESULTS[world]


def timings() -> list[tuple[float, int, str]]:
    """(seconds on rank 0, world size, job) of every job run so far, slowest first."""
    out = []
    for world, results in _RESULTS.items():
        for j, (_, _, seconds) in zip(_JOBS[world], results[0]):
            out.append((seconds, world, f"{j.fn.__module__}.{j.fn.__qualname__}"))
    return sorted(out, reverse=True)
