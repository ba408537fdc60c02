"""One spawn per world size (and lane) for the whole pytest session.

A test module registers its rank work at import time, ``JOB = pool.job(world, fn, *args)``; the
pool spawns that world once and runs there every job registered for it, in registration order, in
the same ranks; a test reads a job's return values with ``JOB.result()``. Process start-up and the
first collective of each process are then paid once per world size instead of once per module.
The ranks are forked from multiprocessing's fork server
(``spawn(..., start_method="forkserver")``), which imports torch, autopar and the test modules that
registered jobs once for the session: a rank starts in a fraction of a second instead of the
seconds its imports took.

A world's jobs may be split into lanes (``lane=``), each lane a spawn of its own: the jobs that
compile through Inductor take the lane "inductor". Their ranks take turns (``compile_once``: one
compiles, its peers wait to load the cache), so a spawn of them alone keeps about one core busy;
beside the world's other jobs, in a second spawn, the two use both cores. The 2-rank world's other
compiling jobs take the lane "compiled" (``compiled``), so that its default lane, the last spawn
to end before, is about half as long.

Once collection is over, ``start()`` (called by conftest) runs every registered spawn in three
background threads, the named lanes first, then the heaviest worlds, while the main process goes
on with the tests that need no ranks (conftest puts the modules that read pooled jobs last, in the
order the spawns they read end). The ranks run at a lower priority than the main process, whose
tests are the longest chain of work that cannot spread over both cores; those of the named lanes,
the next longest, above the other ranks (``NICE``). A test that asks for a spawn the threads have
not reached yet moves it to the front of their queue and waits for it.
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

# A spawn's key: (world size, lane); the lane "" holds the jobs registered without one.
_JOBS: dict[tuple[int, str], list["Job"]] = {}
_RESULTS: dict[tuple[int, str], list] = {}
_FAILED: dict[tuple[int, str], str] = {}
_WORKDIR: list[str] = []
_LOCKS: dict[tuple[int, str], threading.Lock] = {}
_LOCK = threading.Lock()   # guards _LOCKS, _WORKDIR and _PENDING
_ENV: dict[str, str] = {}   # the environment ranks run with, taken by start()
_BACKGROUND: list[threading.Thread] = []
# Spawns at once, for two cores: a spawn often keeps one core busy at most (its ranks take turns to
# compile; a world of one rank). Not four: of two runs back to back, the one with four took 1.2 times
# the CPU seconds in the 4-rank world's jobs (ranks that wait on each other's collectives) and
# ended a minute later.
_THREADS = 3
# The ranks yield the core to this process's own tests: those run one after another, so a core they
# wait for is lost at the end of the session, while the ranks of the spawns fill whatever is left.
# NICE[0] for the ranks of a default lane, NICE[1] for those of a named lane: before the others.
NICE = (10, 5)
_PENDING: list[tuple[int, str]] = []   # the spawns the background threads have yet to run, next first
_DONE: dict[tuple[int, str], threading.Event] = {}   # set once a background thread has run a spawn
# (key, start, end, CPU seconds of its ranks (their children's included), of their start-up) of each spawn
_SPANS: list[tuple[tuple[int, str], float, float, float, float]] = []
_WAITED: list[float] = [0.0]   # seconds the tests spent blocked on pooled results
_T0: list[float] = []   # when start() ran


class JobError(AssertionError):
    """A pooled job raised on some rank."""


class Job:
    def __init__(self, world: int, fn, args: tuple, timeout: float, workdir: bool, lazy, module: str, lane: str):
        self.world, self.fn, self.args, self.timeout, self.workdir, self.lazy = world, fn, args, timeout, workdir, lazy
        self.key = (world, lane)
        self.module = module   # the test module that registered the job
        self.path = None   # the workdir, once the pool has started
        self.index = len(_JOBS.setdefault(self.key, []))
        _JOBS[self.key].append(self)

    def result(self) -> list:
        """fn's return values, indexed by rank."""
        waiting = time.perf_counter()
        per_rank = _run(self.key)
        _WAITED[0] += time.perf_counter() - waiting
        outcomes = [r[self.index] for r in per_rank]
        errors = [f"rank {rank}:\n{value}" for rank, (ok, value, *_) in enumerate(outcomes) if not ok]
        if errors:
            raise JobError(f"{self.fn.__module__}.{self.fn.__qualname__} failed in the pool:\n" + "\n".join(errors))
        return [value for _, value, *_ in outcomes]


def job(world: int, fn, *args, timeout: float = 600.0, workdir: bool = False, lazy=None, lane: str = "") -> Job:
    """Registers ``fn(rank, world, *args)`` (or, with ``workdir``, ``fn(rank, world, path, *args)``
    with a fresh directory every rank of this job shares) to run in the pool of ``world`` ranks, in
    the spawn of its ``lane``. ``lazy``, a callable, gives more arguments when the pool starts: the
    ranks import the test modules again, so a module's import should not compute them."""
    return Job(world, fn, args, timeout, workdir, lazy, sys._getframe(1).f_globals.get("__name__", ""), lane)


def compiled(world: int) -> str:
    """The lane of a job that compiles (aot_eager or Inductor) in ``world`` ranks: the 2-rank world holds
    most of the pool's work, and its compiling jobs, about half of it, run beside the others in a spawn
    of their own ("compiled"); in the other worlds they stay in the default lane."""
    return "compiled" if world == 2 else ""


def per_world(fn, cases: list, *, timeout: float) -> tuple[dict[int, list], dict[int, "Job"]]:
    """Cases grouped by their world size (each case starts with its (dp, pp, tp) mesh), and per world
    one job that runs ``fn(rank, world, *case)`` for each of its cases in turn (a list, case order)."""
    by_world: dict[int, list] = {}
    for case in cases:
        by_world.setdefault(case[0][0] * case[0][1] * case[0][2], []).append(case)
    module = sys._getframe(1).f_globals.get("__name__", "")
    return by_world, {w: Job(w, _each_case, (fn, todo), timeout, False, None, module, "") for w, todo in by_world.items()}


def _each_case(rank, world, fn, cases):
    return [fn(rank, world, *case) for case in cases]


def modules() -> set[str]:
    """The test modules that registered pooled jobs."""
    return {j.module for jobs in _JOBS.values() for j in jobs}


def _weight(key: tuple[int, str]) -> float:
    """How long a spawn may run: the sum of its jobs' timeouts."""
    return sum(j.timeout for j in _JOBS[key])


def _order(key: tuple[int, str]) -> tuple:
    """The pool's order: the named lanes first (their ranks take turns, so they run longest for
    their CPU), then the spawns by weight, largest first."""
    return (key[1] == "", -_weight(key))


def wait_order(module: str) -> float:
    """Where a test module goes among those that read pooled results: by the last spawn it waits for
    in the pool's order, so that the tests read the spawns about as they end (a spawn hands its
    results back only when it ends) and a test that waits leaves its core to the spawns still running."""
    order = sorted(_JOBS, key=_order)
    return max((order.index(k) for k, jobs in _JOBS.items() if any(j.module == module for j in jobs)), default=0)


def start() -> None:
    """Runs every spawn registered so far in ``_THREADS`` background threads, in the pool's order."""
    _ENV.update(os.environ)
    _T0.append(time.perf_counter())
    # Inductor's modules too: most spawns compile something, and each rank would import them (seconds).
    # The fork server imports the pooled test modules: none may start a thread at import (a module-level
    # torch.cuda check initialises the CUDA driver on a CUDA build, which can), or a rank forked while
    # that thread holds a lock blocks for ever; their skipif conditions on CUDA are strings for that.
    preload_in_forkserver(["pool", "parity", "torch._inductor.compile_fx", *sorted(modules())])
    with _LOCK:
        _PENDING[:] = sorted(_JOBS, key=_order)
        for key in _PENDING:
            _DONE[key] = threading.Event()
    for n in range(_THREADS):
        thread = threading.Thread(target=_run_quietly, name=f"autopar-test-pool-{n}", daemon=True)
        _BACKGROUND.append(thread)
        thread.start()


def stop() -> None:
    """Ends the session's pool: ranks still running (the session was interrupted) are terminated."""
    if any(t.is_alive() for t in _BACKGROUND):
        for child in multiprocessing.active_children():
            child.terminate()


def _run_quietly() -> None:
    """A background thread: the pending spawns one at a time."""
    while True:
        with _LOCK:
            if not _PENDING:
                return
            key = _PENDING.pop(0)
        try:
            _run_spawn(key)
        except Exception:   # recorded in _FAILED: the tests that read the spawn report it
            pass
        finally:
            _DONE[key].set()


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


def _run_all(rank, world, jobs, env, nice):
    _restore_environment(env)
    os.nice(nice)
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


def _run(key: tuple[int, str]) -> list:
    """A test's request: a spawn the background threads have yet to run goes first, and is waited for."""
    with _LOCK:
        if key in _PENDING:
            _PENDING.remove(key)
            _PENDING.insert(0, key)
        done = _DONE.get(key)
    if done is not None and any(t.is_alive() for t in _BACKGROUND):
        done.wait()
    return _run_spawn(key)


def _run_spawn(key: tuple[int, str]) -> list:
    with _LOCK:
        lock = _LOCKS.setdefault(key, threading.Lock())
    with lock:
        return _run_locked(key)


def _run_locked(key: tuple[int, str]) -> list:
    world = key[0]
    if key in _FAILED:   # a new exception each time: re-raising one would grow its traceback per test
        raise JobError(f"the pool of {_name(key)} failed: {_FAILED[key]}")
    jobs = _JOBS[key]
    done = _RESULTS.get(key, [[]])[0]
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
            res = spawn(_run_all, world, work, dict(_ENV), NICE[bool(key[1])], timeout=min(3600.0, sum(j.timeout for j in todo)),
                        start_method="forkserver")
        except Exception as e:
            _FAILED[key] = f"{type(e).__name__}: {e}"
            raise
        finally:
            t0 = _T0[0] if _T0 else began
            returned = [pickle.loads(r) for r in res] if res else []
            _SPANS.append((key, began - t0, time.perf_counter() - t0, sum(used for _, used, _ in returned),
                           sum(started for started, _, _ in returned)))
        previous = _RESULTS.get(key, [[] for _ in range(world)])
        _RESULTS[key] = [previous[r] + returned[r][2] for r in range(world)]
    return _RESULTS[key]


def _name(key: tuple[int, str]) -> str:
    world, lane = key
    return f"{world} ranks" + (f" ({lane})" if lane else "")


def timeline() -> str:
    """When each spawn ran (seconds since the pool started) and how long tests waited for results."""
    spans = ", ".join(f"{_name(k)} {a:.0f}-{b:.0f} s ({cpu:.0f} CPU s, {start:.0f} starting)"
                      for k, a, b, cpu, start in _SPANS)
    return f"pool timeline: {spans}; tests waited {_WAITED[0]:.0f} s for pooled results"


def timings() -> list[tuple[float, float, int, str, int]]:
    """(seconds on rank 0, CPU seconds of all ranks, world size, job, frames compiled on rank 0) of
    every job run so far, slowest first."""
    out = []
    for key, results in _RESULTS.items():
        for k, j in enumerate(_JOBS[key]):
            if k < len(results[0]):
                cpu = sum(r[k][3] for r in results)
                out.append((results[0][k][2], cpu, key[0], f"{j.fn.__module__}.{j.fn.__qualname__}", results[0][k][4]))
    return sorted(out, reverse=True)
