"""One spawn per world size for the whole pytest session.

A test module registers its rank work at import time, ``JOB = pool.job(world, fn, *args)``; the
first test that asks any job of a world size for its result (``JOB.result()``) spawns that world
once and runs there every job registered for it so far, in registration order, in the same ranks.
Process start-up and the first collective of each process are then paid once per world size
instead of once per module. The ranks are forked from multiprocessing's fork server
(``spawn(..., start_method="forkserver")``), which imports torch, autopar and the test modules that
registered jobs once for the session: a rank starts in a fraction of a second instead of the
seconds its imports took.

Once collection is over, ``start()`` (called by conftest) runs every registered world in a
background thread, one world after another, while the main process goes on with the tests that
need no ranks (conftest puts the modules that read pooled jobs last): on a 2-core machine the
main process keeps one core busy and the ranks the other. A test that asks for a world the
thread has not reached yet moves it to the front of the thread's queue and waits for it; while a
test waits, a second thread runs the worlds still pending beside the first (the waiting process
leaves its core to them), so the pool runs at most two spawns at once.
Each rank restores the environment the session had when ``start()`` ran, so a test that sets a
variable (monkeypatch) while a world starts does not leak it into the ranks.

A job that raises (on any rank) gives its traceback to the tests that read it; the jobs after it
still run. Work that must own its processes stays on ``autopar.launch.spawn``: expected rank
failures, extra environment variables, and global switches such as ``autopar.set_deterministic``.
"""
from __future__ import annotations

import atexit
import multiprocessing
import os
import pickle
import shutil
import sys
import tempfile
import threading
import time
import traceback

from autopar.launch import preload_in_forkserver, spawn

_JOBS: dict[int, list["Job"]] = {}
_RESULTS: dict[int, list] = {}
_FAILED: dict[int, str] = {}
_WORKDIR: list[str] = []
_LOCKS: dict[int, threading.Lock] = {}
_LOCK = threading.Lock()   # guards _LOCKS and _WORKDIR
_ENV: dict[str, str] = {}   # the environment ranks run with, taken by start()
_BACKGROUND: list[threading.Thread] = []
_PENDING: list[int] = []   # the worlds the background thread has yet to run, next first (guarded by _LOCK)
_DONE: dict[int, threading.Event] = {}   # set once the background thread has run a world
# (world, start, end, CPU seconds of its ranks (their children's included), of their start-up) of each spawn
_SPANS: list[tuple[int, float, float, float, float]] = []
_WAITED: list[float] = [0.0]   # seconds the tests spent blocked on pooled results
_T0: list[float] = []   # when start() ran


class JobError(AssertionError):
    """A pooled job raised on some rank."""


class Job:
    def __init__(self, world: int, fn, args: tuple, timeout: float, workdir: bool, lazy, module: str):
        self.world, self.fn, self.args, self.timeout, self.workdir, self.lazy = world, fn, args, timeout, workdir, lazy
        self.module = module   # the test module that registered the job
        self.path = None   # the workdir, once the pool has started
        self.index = len(_JOBS.setdefault(world, []))
        _JOBS[world].append(self)

    def result(self) -> list:
        """fn's return values, indexed by rank."""
        waiting = time.perf_counter()
        per_rank = _run(self.world)
        _WAITED[0] += time.perf_counter() - waiting
        outcomes = [r[self.index] for r in per_rank]
        errors = [f"rank {rank}:\n{value}" for rank, (ok, value, *_) in enumerate(outcomes) if not ok]
        if errors:
            raise JobError(f"{self.fn.__module__}.{self.fn.__qualname__} failed in the pool:\n" + "\n".join(errors))
        return [value for _, value, *_ in outcomes]


def job(world: int, fn, *args, timeout: float = 600.0, workdir: bool = False, lazy=None) -> Job:
    """Registers ``fn(rank, world, *args)`` (or, with ``workdir``, ``fn(rank, world, path, *args)``
    with a fresh directory every rank of this job shares) to run in the pool of ``world`` ranks.
    ``lazy``, a callable, gives more arguments when the pool starts: the ranks import the test
    modules again, so a module's import should not compute them."""
    return Job(world, fn, args, timeout, workdir, lazy, sys._getframe(1).f_globals.get("__name__", ""))


def per_world(fn, cases: list, *, timeout: float) -> tuple[dict[int, list], dict[int, "Job"]]:
    """Cases grouped by their world size (each case starts with its (dp, pp, tp) mesh), and per world
    one job that runs ``fn(rank, world, *case)`` for each of its cases in turn (a list, case order)."""
    by_world: dict[int, list] = {}
    for case in cases:
        by_world.setdefault(case[0][0] * case[0][1] * case[0][2], []).append(case)
    module = sys._getframe(1).f_globals.get("__name__", "")
    return by_world, {w: Job(w, _each_case, (fn, todo), timeout, False, None, module) for w, todo in by_world.items()}


def _each_case(rank, world, fn, cases):
    return [fn(rank, world, *case) for case in cases]


def modules() -> set[str]:
    """The test modules that registered pooled jobs."""
    return {j.module for jobs in _JOBS.values() for j in jobs}


def _weight(world: int) -> float:
    """How long a world's spawn may run: the sum of its jobs' timeouts (the pool's order, largest first)."""
    return sum(j.timeout for j in _JOBS[world])


def wait_order(module: str) -> float:
    """Where a test module goes among those that read pooled results: by the heaviest world it waits
    for, lightest first. The pool starts the heaviest world first and hands a world's results back
    only when its whole spawn ends, so a module waiting on it early would hold up every test after
    it, while the lighter worlds run on a second thread and return in minutes."""
    return max((_weight(w) for w, jobs in _JOBS.items() if any(j.module == module for j in jobs)), default=0.0)


def start() -> None:
    """Runs every world registered so far in a background thread, largest total job timeout first."""
    _ENV.update(os.environ)
    _T0.append(time.perf_counter())
    preload_in_forkserver(["pool", "parity", *sorted(modules())])
    with _LOCK:
        _PENDING[:] = sorted(_JOBS, key=lambda w: -_weight(w))
        for world in _PENDING:
            _DONE[world] = threading.Event()
    thread = threading.Thread(target=_run_quietly, name="autopar-test-pool", daemon=True)
    _BACKGROUND.append(thread)
    thread.start()


def stop() -> None:
    """Ends the session's pool: ranks still running (the session was interrupted) are terminated."""
    if any(t.is_alive() for t in _BACKGROUND):
        for child in multiprocessing.active_children():
            child.terminate()


def _run_quietly() -> None:
    """A background thread: the pending worlds one at a time (a second such thread may run beside
    it while a test waits, ``_second_thread``)."""
    while True:
        with _LOCK:
            if not _PENDING:
                return
            world = _PENDING.pop(0)
        try:
            _run_world(world)
        except Exception:   # recorded in _FAILED: the tests that read the world report it
            pass
        finally:
            _DONE[world].set()


def _restore_environment(env: dict[str, str]) -> None:
    """The session's environment, with what spawn set for this rank kept."""
    if not env:
        return
    own = {k: os.environ[k] for k in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT",
                                      "OMP_NUM_THREADS") if k in os.environ}
    os.environ.clear()
    os.environ.update({**env, **own})


def _cpu_seconds() -> float:
    """This process's CPU time, with that of its finished children (Inductor's compiler runs)."""
    return sum(os.times()[:4])


def _frames() -> int:
    """Frames torch.compile has compiled in this process so far (recompiles and graph breaks included)."""
    dynamo = sys.modules.get("torch._dynamo.utils")
    return dynamo.counters["frames"]["total"] if dynamo else 0


def _run_all(rank, world, jobs, env):
    _restore_environment(env)
    started, out = _cpu_seconds(), []
    for fn, args in jobs:
        start, cpu, frames = time.perf_counter(), _cpu_seconds(), _frames()
        try:
            ok, value = True, fn(rank, world, *args)
        except Exception:
            ok, value = False, traceback.format_exc()
        out.append((ok, value, time.perf_counter() - start, _cpu_seconds() - cpu, _frames() - frames))
    # plain pickle bytes: the pipe's own pickler would share every tensor through a file
    # descriptor, and a pool's worth of them runs out ("received 0 items of ancdata")
    return pickle.dumps((started, _cpu_seconds(), out))


def _run(world: int) -> list:
    """A test's request: a world the background thread has yet to run goes first, and is waited for."""
    with _LOCK:
        if world in _PENDING:
            _PENDING.remove(world)
            _PENDING.insert(0, world)
        done = _DONE.get(world)
    if done is not None and any(t.is_alive() for t in _BACKGROUND):
        _second_thread()
        done.wait()
    return _run_world(world)


def _second_thread() -> None:
    """While a test waits, this process leaves a core free: a second background thread runs the
    worlds still pending beside the first, at most two spawns at once."""
    with _LOCK:
        if len([t for t in _BACKGROUND if t.is_alive()]) >= 2 or not _PENDING:
            return
        thread = threading.Thread(target=_run_quietly, name="autopar-test-pool-2", daemon=True)
        _BACKGROUND.append(thread)
    thread.start()


def _run_world(world: int) -> list:
    with _LOCK:
        lock = _LOCKS.setdefault(world, threading.Lock())
    with lock:
        return _run_locked(world)


def _run_locked(world: int) -> list:
    if world in _FAILED:   # a new exception each time: re-raising one would grow its traceback per test
        raise JobError(f"the pool of {world} ranks failed: {_FAILED[world]}")
    jobs = _JOBS[world]
    done = _RESULTS.get(world, [[]])[0]
    if len(done) < len(jobs):   # jobs registered after the last spawn (a module imported late)
        with _LOCK:
            if not _WORKDIR:
                _WORKDIR.append(tempfile.mkdtemp(prefix="autopar-pool-"))
                atexit.register(shutil.rmtree, _WORKDIR[0], ignore_errors=True)
        todo = jobs[len(done):]
        for j in todo:
            if j.workdir:
                j.path = tempfile.mkdtemp(dir=_WORKDIR[0])
        work = [(j.fn, ((j.path,) if j.workdir else ()) + j.args + (tuple(j.lazy()) if j.lazy else ()))
                for j in todo]
        began, res = time.perf_counter(), None
        try:
            res = spawn(_run_all, world, work, dict(_ENV), timeout=min(3600.0, sum(j.timeout for j in todo)),
                        start_method="forkserver")
        except Exception as e:
            _FAILED[world] = f"{type(e).__name__}: {e}"
            raise
        finally:
            t0 = _T0[0] if _T0 else began
            returned = [pickle.loads(r) for r in res] if res else []
            _SPANS.append((world, began - t0, time.perf_counter() - t0, sum(used for _, used, _ in returned),
                           sum(started for started, _, _ in returned)))
        previous = _RESULTS.get(world, [[] for _ in range(world)])
        _RESULTS[world] = [previous[r] + returned[r][2] for r in range(world)]
    return _RESULTS[world]


def timeline() -> str:
    """When each world ran (seconds since the pool started) and how long tests waited for results."""
    spans = ", ".join(f"{w} ranks {a:.0f}-{b:.0f} s ({cpu:.0f} CPU s, {start:.0f} starting)"
                      for w, a, b, cpu, start in _SPANS)
    return f"pool timeline: {spans}; tests waited {_WAITED[0]:.0f} s for pooled results"


def timings() -> list[tuple[float, float, int, str, int]]:
    """(seconds on rank 0, CPU seconds of all ranks, world size, job, frames compiled on rank 0) of
    every job run so far, slowest first."""
    out = []
    for world, results in _RESULTS.items():
        for k, j in enumerate(_JOBS[world]):
            if k < len(results[0]):
                cpu = sum(r[k][3] for r in results)
                out.append((results[0][k][2], cpu, world, f"{j.fn.__module__}.{j.fn.__qualname__}", results[0][k][4]))
    return sorted(out, reverse=True)
