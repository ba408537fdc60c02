"""Starting torch.distributed processes: `spawn` for tests and single-machine runs, `init_distributed`
for scripts started by `torchrun`. Everything else in autopar assumes a process group already exists.

Failure behaviour: one rank that raises or dies must not leave its peers waiting in a collective.
- Every collective has a timeout (gloo and NCCL); NCCL runs with asynchronous error handling, so
  its watchdog tears a rank down when a collective outlives the timeout.
- `spawn` kills every surviving rank as soon as one fails and raises `RankError` with that rank's
  traceback (or its exit code or signal).
- Under `torchrun`, `guard()` turns an uncaught exception into: the traceback, tagged with the
  rank, on stderr and in torchrun's error file (its "Root Cause" report), the process group torn
  down, and a non-zero exit two seconds later. The peers then fail at once (gloo sees the connection
  close) or are stopped by torchrun's agent, which ends the whole job when one worker exits non-zero.
"""

import contextlib
import multiprocessing as mp
import os
import pickle
import signal
import socket
import sys
import threading
import time
import traceback
from datetime import timedelta
from multiprocessing.connection import wait

import torch
import torch.distributed as dist

# Collectives give up after this long even under a long overall timeout, so a stuck rank's peers
# fail with an error of their own instead of blocking forever.
_MAX_COLLECTIVE_TIMEOUT_S = 120.0
# How long a rank's error waits for a peer's death to show (its likely cause): a crashing process
# can take seconds to exit on a loaded machine (a segfaulting rank took over 1 s in CI), and the
# wait ends as soon as one peer exits, so only a failure with no dead peer waits it out.
_DEATH_GRACE_S = 5.0
# How long a rank gets to die of SIGTERM before it is sent SIGKILL.
_TERMINATE_GRACE_S = 2.0
# How long a failed rank under guard() stays up before it exits. A rank that fails only because a peer
# died (gloo: "connection closed by peer") must not exit before torchrun's agent, which polls every
# 0.1 s, has seen the peer's failure: it then stops this rank and reports the peer as the root cause.
_LINGER_S = 2.0


# What the fork server imports once, so that the ranks it forks start with them imported.
_FORKSERVER_PRELOAD = ["torch", "torch.distributed", "autopar", "autopar.planner", "autopar.passes",
                       "autopar.runtime", "autopar.cost_model"]
_PRELOADED: list[bool] = []   # set once the fork server's list is given
_PRELOAD_LOCK = threading.Lock()


def preload_in_forkserver(modules) -> None:
    """Adds ``modules`` (importable names) to what the fork server of ``spawn(...,
    start_method="forkserver")`` imports when it starts, so that its ranks find them imported: the
    modules a rank's function lives in, for instance. Raises RuntimeError once the server has started.

    None of them may start a thread at import (a module-level ``torch.cuda.is_available()`` can, on
    a CUDA build, by initialising the driver): a fork copies only the forking thread, and a lock
    another thread held at that moment blocks the rank for ever. A rank forked from a server that
    runs threads says so on stderr."""
    with _PRELOAD_LOCK:
        if _PRELOADED:
            raise RuntimeError("the fork server has started already: preload_in_forkserver must come "
                               "before the first spawn(..., start_method='forkserver')")
        _FORKSERVER_PRELOAD.extend(m for m in modules if m not in _FORKSERVER_PRELOAD)


class RankError(RuntimeError):
    """A rank started by `spawn` raised or died; the message names the rank and carries its traceback."""


def free_port() -> int:
    """Returns a TCP port on 127.0.0.1 that was free a moment ago (the OS picks it for a port-0 bind).

    Another process may take it before it is used; that is the usual, accepted race for local launches.
    """
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def init_distributed(backend=None, timeout_s=600) -> tuple[int, int]:
    """Initialises the default process group from the environment that `torchrun` sets; returns (rank, world_size).

    Does nothing but report if a process group already exists (e.g. inside `spawn`). The backend defaults
    to "nccl" when CUDA is available, else "gloo"; with CUDA the current device becomes LOCAL_RANK.
    A collective that waits longer than `timeout_s` seconds fails (on NCCL, the watchdog then ends the
    process): keep it above the longest time one rank may spend away from the others, e.g. compiling.
    """
    if not dist.is_initialized():
        if "RANK" not in os.environ or "WORLD_SIZE" not in os.environ:
            raise RuntimeError(
                "RANK and WORLD_SIZE are not set: start this script with torchrun "
                "(e.g. `torchrun --nproc-per-node 4 train.py`) or run it through autopar.launch.spawn"
            )
        if torch.cuda.is_available():
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
        if backend is None:
            backend = "nccl" if torch.cuda.is_available() else "gloo"
        _init_process_group(backend, timeout_s)
    return dist.get_rank(), dist.get_world_size()


@contextlib.contextmanager
def guard(exit_code=1):
    """Context manager (or decorator) for a rank's main code under `torchrun`: a failure stops this rank
    at once, so that its peers are not left waiting for it in a collective.

    On an uncaught exception (or `sys.exit` with a non-zero status) it prints the traceback tagged with
    the rank, waits two seconds, records it in torchrun's error file (the "Root Cause" of torchrun's
    report is the earliest record), tears the process group down (an NCCL group is aborted rather than
    waited on) and exits with `exit_code` (a `sys.exit` keeps its own status) without running exit
    handlers that could block. The wait comes before the record so that a rank failing only because
    a peer died (killed, with no record of its own) is not taken for the root cause: torchrun sees
    the peer's exit within the wait.

        with autopar.launch.guard():
            init_distributed()
            train()
    """
    try:
        yield
    except SystemExit as e:
        if e.code in (None, 0):
            raise
        _fail(e, e.code if isinstance(e.code, int) else exit_code)
    except BaseException as e:
        _fail(e, exit_code)


def _fail(exc, exit_code):
    """Reports `exc` for this rank, tears the process group down and ends the process with `exit_code`."""
    from torch.distributed.elastic.multiprocessing.errors import ErrorHandler

    rank = dist.get_rank() if dist.is_initialized() else os.environ.get("RANK", "?")
    text = "".join(traceback.format_exception(exc))
    print(f"autopar: rank {rank} failed; stopping it so that its peers do not wait for it\n"
          f"[rank {rank}] {text}", file=sys.stderr, end="", flush=True)
    time.sleep(_LINGER_S)   # the peers stay connected meanwhile, so they do not fail before the agent looks
    ErrorHandler().record_exception(exc)
    _teardown()
    sys.stdout.flush()
    sys.stderr.flush()
    # os._exit: normal interpreter exit runs destructors that can wait on a peer which will never answer.
    os._exit(exit_code)


def _init_process_group(backend, timeout_s):
    """init_process_group with a bounded collective timeout; for NCCL, with the watchdog's error handling on."""
    if not timeout_s > 0:
        raise ValueError(f"timeout_s={timeout_s!r}: expected a positive number of seconds")
    if backend == "nccl":
        # Read when the NCCL process group is built: 1 = on a failed or timed-out collective, abort the
        # communicators and end the process, rather than leave it blocked. The user's own setting wins.
        os.environ.setdefault("TORCH_NCCL_ASYNC_ERROR_HANDLING", "1")
    dist.init_process_group(backend, timeout=timedelta(seconds=timeout_s))


def _teardown():
    """Destroys the default process group of a failed rank without waiting on its peers."""
    if not dist.is_initialized():
        return
    try:
        if dist.get_backend() == "nccl":
            # destroy_process_group could wait for the NCCL kernels a dead peer will never finish.
            dist.distributed_c10d._abort_process_group()
        else:
            dist.destroy_process_group()
    except Exception as e:   # the group may already be broken; the original failure is what matters
        print(f"autopar: tearing the process group down also failed: {e}", file=sys.stderr, flush=True)


def spawn(fn, world_size, *args, backend="gloo", timeout=300.0, env=None, start_method="spawn") -> list:
    """Runs `fn(rank, world_size, *args)` on `world_size` new local processes, each inside a process group.

    Returns fn's return values (which must be picklable), indexed by rank. `env` holds extra environment
    variables for every rank, in place before the rank imports anything; OMP_NUM_THREADS defaults to this
    machine's cores shared out among the ranks.

    `start_method` "spawn" starts each rank as a new interpreter, which imports torch (seconds of CPU
    per rank). "forkserver" forks each rank from multiprocessing's fork server instead: a process
    started once per session that has already imported torch, torch.distributed and autopar (and the
    modules given to `preload_in_forkserver` before the first such call), so that a rank starts in a
    fraction of a second. Its arguments travel as pickle bytes (copies: tensors are not shared
    through file descriptors, of which the fork server passes at most 256). A forked rank gets this
    process's current environment and `env` as a spawned one does, but only after torch is imported:
    a variable torch reads at import has no effect then (OMP_NUM_THREADS is applied through
    ``torch.set_num_threads``).

    Raises RankError for the first rank that raised (with its traceback) or that died without raising
    (with its exit code), and TimeoutError naming the ranks still running after `timeout` seconds.
    Either way every rank is killed at once rather than left to hang in a collective.
    """
    if start_method not in ("spawn", "forkserver"):
        raise ValueError(f"start_method={start_method!r}: expected 'spawn' or 'forkserver'")
    ctx = mp.get_context(start_method)
    if start_method == "forkserver":
        with _PRELOAD_LOCK:
            if not _PRELOADED:
                ctx.set_forkserver_preload(_FORKSERVER_PRELOAD)
                _PRELOADED.append(True)
    common_env = {
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": str(free_port()),
        "WORLD_SIZE": str(world_size),
        "OMP_NUM_THREADS": str(max(1, (os.cpu_count() or 1) // world_size)),
        **{key: str(value) for key, value in (env or {}).items()},
    }
    sent = pickle.dumps(args) if start_method == "forkserver" else args
    collective_timeout = min(timeout, _MAX_COLLECTIVE_TIMEOUT_S)
    deadline = time.monotonic() + timeout
    procs, conns = [], []
    try:
        for rank in range(world_size):
            parent_conn, child_conn = ctx.Pipe()
            rank_env = {**common_env, "RANK": str(rank), "LOCAL_RANK": str(rank)}
            # a forked rank copies the fork server's environment, not this process's: it is sent whole
            given = {**environment(), **rank_env} if start_method == "forkserver" else rank_env
            proc = ctx.Process(
                target=_run_rank,
                args=(child_conn, fn, rank, world_size, sent, backend, collective_timeout, given,
                      start_method == "forkserver"),
                name=f"autopar-rank{rank}",
            )
            # A spawned child copies the parent's environment when it starts, before it imports torch:
            # what must be there before the import (OMP_NUM_THREADS, the caller's env) is set for the
            # start. RANK, WORLD_SIZE and MASTER_* are not: another thread of this process reading
            # them meanwhile would take this process for a rank; the rank sets them itself first thing.
            with _environ({k: v for k, v in rank_env.items() if k not in _RANK_KEYS}):
                proc.start()
            child_conn.close()
            procs.append(proc)
            conns.append(parent_conn)
        results = _collect(procs, conns, deadline, timeout)
        for conn in conns:
            conn.send(None)  # every rank has returned, so all may tear down now
        for proc in procs:
            proc.join(max(0.0, deadline - time.monotonic()))
        return [results[rank] for rank in range(world_size)]
    finally:
        _stop(procs)
        for conn in conns:
            conn.close()


def _run_rank(conn, fn, rank, world_size, args, backend, collective_timeout, env, forked=False):
    """Body of one spawned rank: init the process group, run fn, send ("ok", value) or ("error", time, traceback).
    ``forked`` (a rank of the fork server): ``env`` replaces the environment instead of adding to it,
    and ``args`` are pickle bytes."""
    if forked:
        _warn_if_forked_from_threads()
        os.environ.clear()
        torch.set_num_threads(int(env["OMP_NUM_THREADS"]))
    os.environ.update(env)
    try:
        if forked:
            args = pickle.loads(args)
        if backend == "nccl":
            torch.cuda.set_device(rank)
        _init_process_group(backend, collective_timeout)
        conn.send(("ok", fn(rank, world_size, *args)))
    except BaseException:
        # The wall-clock time lets the parent tell the rank that failed first from the peers it took down.
        conn.send(("error", time.time(), traceback.format_exc()))
        _teardown()
    else:
        # Wait for the parent's word that every rank has returned: rank 0 hosts the TCPStore, and a peer
        # may still be finishing a collective with this rank; leaving early would break either.
        conn.recv()
        dist.destroy_process_group()


def _warn_if_forked_from_threads() -> None:
    """Says on stderr when the fork server this rank was forked from runs threads besides its own.

    A fork copies only the forking thread: a lock another thread held at that moment stays held in
    the child for ever, and the rank blocks without using any CPU. The fork server is started
    single-threaded; threads appear there when a module it preloads starts them at import (a
    check of ``torch.cuda.is_available()`` at module level initialises the CUDA driver on a CUDA build
    of torch, and the driver can start threads of its own)."""
    try:
        tasks = os.listdir(f"/proc/{os.getppid()}/task")
        names = sorted(open(f"/proc/{os.getppid()}/task/{t}/comm").read().strip() for t in tasks)
    except OSError:   # no /proc (not Linux), or the server is gone
        return
    if len(names) > 1:
        print(f"autopar: warning: this rank was forked from a fork server running {len(names)} threads "
              f"({', '.join(names)}); a rank forked while another thread holds a lock can block for ever. "
              "Keep modules that start threads at import (CUDA initialisation among them) out of "
              "preload_in_forkserver, or use start_method='spawn'.", file=sys.stderr, flush=True)


def _collect(procs, conns, deadline, timeout):
    """Waits for every rank's result; raises as soon as one rank fails or the deadline passes."""
    results = {}
    while len(results) < len(procs):
        running = [rank for rank in range(len(procs)) if rank not in results]
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            raise TimeoutError(f"spawn timed out after {timeout:g}s; ranks still running: {running}")
        wait([conns[rank] for rank in running] + [procs[rank].sentinel for rank in running], remaining)
        # Exit codes are read before the pipes: a rank sends its message before it exits, so a rank
        # that had exited and has nothing to read died without raising.
        exited = [rank for rank in running if procs[rank].exitcode is not None]
        errors = {}
        quiet = _drain(running, conns, results, errors)
        silent = [rank for rank in exited if rank in quiet]
        if errors and quiet and not silent:
            # A dead rank's peers fail with connection errors as its sockets close, which can reach
            # us before its exit does: give the other ranks a moment to show whether one died.
            wait([procs[rank].sentinel for rank in quiet], _DEATH_GRACE_S)
            silent = _drain([rank for rank in quiet if procs[rank].exitcode is not None], conns, results, errors)
        # A dead rank's peers fail with connection errors a moment later, so its death is the cause.
        if silent:
            rank = silent[0]
            raise RankError(f"rank {rank} died without raising ({_describe_exit(procs[rank].exitcode)})")
        if errors:
            rank = min(errors, key=lambda r: errors[r][0])
            raise RankError(f"rank {rank} failed:\n{errors[rank][1]}")
    return results


def _drain(ranks, conns, results: dict, errors: dict) -> list[int]:
    """Read each rank's message, if it has one, into ``results`` or ``errors``; the ranks without one."""
    quiet = []
    for rank in ranks:
        message = _receive(conns[rank])
        if message is None:
            quiet.append(rank)
        elif message[0] == "ok":
            results[rank] = message[1]
        else:
            errors[rank] = message[1:]
    return quiet


def _receive(conn):
    """The next message on conn, or None if there is none (EOF included: the exit code tells that story)."""
    try:
        return conn.recv() if conn.poll() else None
    except EOFError:
        return None


def _describe_exit(code):
    if code < 0:
        return f"killed by {signal.Signals(-code).name}, exit code {code}"
    return f"exit code {code}"


def _stop(procs):
    """Kills every rank still running: SIGTERM first, SIGKILL for any that outlive the grace period."""
    for proc in procs:
        if proc.is_alive():
            proc.terminate()
    grace_end = time.monotonic() + _TERMINATE_GRACE_S
    for proc in procs:
        proc.join(max(0.0, grace_end - time.monotonic()))
        if proc.is_alive():
            proc.kill()
            proc.join()


_ENVIRON_LOCK = threading.Lock()
# what each rank sets in its own environment before init_process_group, never in the parent's
_RANK_KEYS = ("MASTER_ADDR", "MASTER_PORT", "WORLD_SIZE", "RANK", "LOCAL_RANK")


def environment() -> dict[str, str]:
    """A copy of this process's environment, as it is outside the moments `spawn` starts a rank.

    `spawn` sets the variables a rank needs before it imports torch (OMP_NUM_THREADS, its ``env``) in
    this process's environment while that rank's process starts (a spawned child copies its
    parent's environment). A subprocess another thread starts meanwhile would inherit them; start
    it with ``env=autopar.launch.environment()`` instead of the inherited environment.
    """
    with _ENVIRON_LOCK:
        return dict(os.environ)


@contextlib.contextmanager
def _environ(values):
    """Sets environment variables for the duration of the block, then restores the previous ones.

    The environment is the process's: two threads spawning at once would start each other's
    ranks with the wrong RANK or MASTER_PORT, so one block runs at a time."""
    with _ENVIRON_LOCK:
        saved = {key: os.environ.get(key) for key in values}
        os.environ.update(values)
        try:
            yield
        finally:
            for key, value in saved.items():
                if value is None:
                    del os.environ[key]
                else:
                    os.environ[key] = value
