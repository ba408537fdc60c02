"""Starting torch.distributed processes: `spawn` for tests and single-machine runs, `init_distributed`
for scripts started by `torchrun`. Everything else in autopar assumes a process group already exists.
"""

import contextlib
import multiprocessing as mp
import os
import signal
import socket
import time
import traceback
from datetime import timedelta
from multiprocessing.connection import wait

import torch
import torch.distributed as dist

# Collectives give up after this long even under a long overall timeout, so a stuck rank's peers
# fail with an error of their own instead of blocking forever.
_MAX_COLLECTIVE_TIMEOUT_S = 120.0
# How long a rank gets to die of SIGTERM before it is sent SIGKILL.
_TERMINATE_GRACE_S = 2.0


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
        dist.init_process_group(backend, timeout=timedelta(seconds=timeout_s))
    return dist.get_rank(), dist.get_world_size()


def spawn(fn, world_size, *args, backend="gloo", timeout=300.0, env=None) -> list:
    """Runs `fn(rank, world_size, *args)` on `world_size` new local processes, each inside a process group.

    Returns fn's return values (which must be picklable), indexed by rank. `env` holds extra environment
    variables for every rank, in place before the rank imports anything; OMP_NUM_THREADS defaults to this
    machine's cores shared out among the ranks.

    Raises RankError for the first rank that raised (with its traceback) or that died without raising
    (with its exit code), and TimeoutError naming the ranks still running after `timeout` seconds.
    Either way every rank is killed at once rather than left to hang in a collective.
    """
    ctx = mp.get_context("spawn")
    common_env = {
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": str(free_port()),
        "WORLD_SIZE": str(world_size),
        "OMP_NUM_THREADS": str(max(1, (os.cpu_count() or 1) // world_size)),
        **{key: str(value) for key, value in (env or {}).items()},
    }
    collective_timeout = min(timeout, _MAX_COLLECTIVE_TIMEOUT_S)
    deadline = time.monotonic() + timeout
    procs, conns = [], []
    try:
        for rank in range(world_size):
            parent_conn, child_conn = ctx.Pipe()
            proc = ctx.Process(
                target=_run_rank,
                args=(child_conn, fn, rank, world_size, args, backend, collective_timeout),
                name=f"autopar-rank{rank}",
            )
            # A spawned child copies the parent's environment when it starts, before it imports torch.
            with _environ({**common_env, "RANK": str(rank), "LOCAL_RANK": str(rank)}):
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


def _run_rank(conn, fn, rank, world_size, args, backend, collective_timeout):
    """Body of one spawned rank: init the process group, run fn, send ("ok", value) or ("error", time, traceback)."""
    try:
        if backend == "nccl":
            torch.cuda.set_device(rank)
        dist.init_process_group(backend, timeout=timedelta(seconds=collective_timeout))
        conn.send(("ok", fn(rank, world_size, *args)))
    except BaseException:
        # The wall-clock time lets the parent tell the rank that failed first from the peers it took down.
        conn.send(("error", time.time(), traceback.format_exc()))
    else:
        # Wait for the parent's word that every rank has returned: rank 0 hosts the TCPStore, and a peer
        # may still be finishing a collective with this rank; leaving early would break either.
        conn.recv()
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


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
        for rank in running:
            message = _receive(conns[rank])
            if message is None:
                continue
            if message[0] == "ok":
                results[rank] = message[1]
            else:
                errors[rank] = message[1:]
        silent = [rank for rank in exited if rank not in results and rank not in errors]
        # A dead rank's peers fail with connection errors a moment later, so its death is the cause.
        if silent:
            rank = silent[0]
            raise RankError(f"rank {rank} died without raising ({_describe_exit(procs[rank].exitcode)})")
        if errors:
            rank = min(errors, key=lambda r: errors[r][0])
            raise RankError(f"rank {rank} failed:\n{errors[rank][1]}")
    return results


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


@contextlib.contextmanager
def _environ(values):
    """Sets environment variables for the duration of the block, then restores the previous ones."""
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
