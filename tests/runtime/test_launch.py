import ctypes
import os
import sys
import textwrap
import time

import pytest
import torch
import torch.distributed as dist

import cli
from autopar.launch import RankError, free_port, init_distributed, preload_in_forkserver, spawn

# Functions handed to spawn are module-level so the spawned ranks can unpickle them.

# The failure tests fork their ranks from the fork server: how spawn catches a failed rank does not
# depend on how the rank's process started, and a new interpreter costs seconds of imports per rank.
# test_results_come_back_per_rank_with_env starts its ranks as spawn does by default.
FAILING = "forkserver"


def _report(rank, world_size, offset):
    value = torch.tensor([float(rank + offset)])
    dist.all_reduce(value)
    return {
        "sum": value.item(),
        "rank": rank,
        "init_distributed": init_distributed(),
        "mark": os.environ.get("AUTOPAR_TEST_MARK"),
        "omp": os.environ["OMP_NUM_THREADS"],
    }


def _forked(rank, world_size, tensors=()):
    value = torch.tensor([float(rank)])
    dist.all_reduce(value)
    return {"sum": value.item(), "threads": torch.get_num_threads(), "omp": os.environ["OMP_NUM_THREADS"],
            "mark": os.environ.get("AUTOPAR_TEST_MARK"), "parent": os.environ.get("AUTOPAR_TEST_PARENT"),
            "rank": os.environ["RANK"], "tensors": float(sum(t.sum() for t in tensors)),
            "server threads": len(os.listdir(f"/proc/{os.getppid()}/task"))}


def _boom_on_rank_1(rank, world_size, pid_dir):
    (pid_dir / f"{rank}.pid").write_text(str(os.getpid()))
    dist.barrier()  # every pid is written before anyone fails
    if rank == 1:
        (pid_dir / "failed_at").write_text(repr(time.time()))
        raise ValueError("boom on rank 1")
    if rank == 0:
        dist.all_reduce(torch.ones(1))  # waits for rank 1, which never comes
    time.sleep(3600)


def _exit_on_rank_1(rank, world_size):
    if rank == 1:
        os._exit(3)
    dist.barrier()


def _segfault_on_rank_1(rank, world_size):
    if rank == 1:
        ctypes.string_at(0)
    dist.barrier()


def _hang_on_rank_1(rank, world_size):
    if rank == 1:
        time.sleep(3600)


def test_forkserver_ranks_get_the_environment_of_the_call(monkeypatch):
    """Ranks forked from the fork server (started with torch imported) see this process's environment
    as it is at the call, ``env``, their RANK and a thread count of their share of the cores."""
    monkeypatch.setenv("AUTOPAR_TEST_PARENT", "there when the server may start")
    assert {r["parent"] for r in spawn(_forked, 2, start_method="forkserver")} == {"there when the server may start"}
    monkeypatch.setenv("AUTOPAR_TEST_PARENT", "set after the server started")
    # more tensors than the fork server could pass as file descriptors (256)
    tensors = [torch.full((2,), float(k)) for k in range(300)]
    results = spawn(_forked, 2, tensors, env={"AUTOPAR_TEST_MARK": "seen"}, start_method="forkserver")
    share = max(1, os.cpu_count() // 2)
    assert [r["sum"] for r in results] == [1.0, 1.0]
    assert [r["rank"] for r in results] == ["0", "1"]
    assert all(r["tensors"] == 2 * sum(range(300)) for r in results)
    assert all(r["threads"] == share and r["omp"] == str(share) for r in results)
    assert all(r["mark"] == "seen" and r["parent"] == "set after the server started" for r in results)
    # the session's fork server, which imported every pooled test module, runs no thread a fork would lose
    assert all(r["server threads"] == 1 for r in results)
    with pytest.raises(RuntimeError, match="fork server has started already"):
        preload_in_forkserver(["json"])
    with pytest.raises(ValueError, match="'spawn' or 'forkserver'"):
        spawn(_forked, 2, start_method="fork")


# A fork server whose preloaded module starts a thread at import, and one rank forked from it.
_THREADED_SERVER = {
    "threaded.py": "import threading, time\nthreading.Thread(target=time.sleep, args=(600,), daemon=True).start()\n",
    "job.py": textwrap.dedent("""
        from autopar.launch import preload_in_forkserver, spawn
        if __name__ == "__main__":
            preload_in_forkserver(["threaded"])
            print(spawn(max, 1, 1, start_method="forkserver"))
    """),
}
THREADED_SERVER = cli.background([sys.executable, "job.py"], files=_THREADED_SERVER, timeout=300)


def test_a_rank_forked_from_a_threaded_fork_server_says_so():
    """A fork copies only the forking thread, so a lock another thread of the fork server holds stays
    held in the rank: the rank says on stderr that its server ran threads, and which to keep out."""
    done, _, _ = THREADED_SERVER.result()
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "[1]"
    assert "forked from a fork server running 2 threads" in done.stderr
    assert "preload_in_forkserver" in done.stderr and "start_method='spawn'" in done.stderr


def test_results_come_back_per_rank_with_env():
    world = 2
    results = spawn(_report, world, 10, env={"AUTOPAR_TEST_MARK": "seen"})
    expected_sum = float(sum(range(world)) + 10 * world)
    assert [r["sum"] for r in results] == [expected_sum] * world
    assert [r["rank"] for r in results] == list(range(world))
    assert [r["init_distributed"] for r in results] == [(rank, world) for rank in range(world)]
    assert all(r["mark"] == "seen" for r in results)
    assert all(r["omp"] == str(max(1, os.cpu_count() // world)) for r in results)
    assert "AUTOPAR_TEST_MARK" not in os.environ  # the parent's environment is restored


def test_raising_rank_is_reported_and_others_are_killed(tmp_path):
    with pytest.raises(RankError) as info:
        spawn(_boom_on_rank_1, 3, tmp_path, timeout=120, start_method=FAILING)
    # from the failure, not from the start: three ranks importing torch on a loaded machine take a while
    assert time.time() - float((tmp_path / "failed_at").read_text()) < 30
    message = str(info.value)
    assert "rank 1" in message
    assert "Traceback" in message and "_boom_on_rank_1" in message
    assert "ValueError: boom on rank 1" in message
    for pid_file in tmp_path.glob("*.pid"):
        with pytest.raises(ProcessLookupError):
            os.kill(int(pid_file.read_text()), 0)
    assert len(list(tmp_path.glob("*.pid"))) == 3


@pytest.mark.parametrize(
    "fn, expected",
    [(_exit_on_rank_1, "exit code 3"), (_segfault_on_rank_1, "SIGSEGV")],
    ids=["os_exit", "segfault"],
)
def test_dead_rank_is_reported(fn, expected):
    with pytest.raises(RankError, match=r"rank 1 died without raising") as info:
        spawn(fn, 2, timeout=60, start_method=FAILING)
    assert expected in str(info.value)


def test_timeout_names_unfinished_ranks():
    start = time.monotonic()
    with pytest.raises(TimeoutError) as info:
        spawn(_hang_on_rank_1, 2, timeout=6, start_method=FAILING)  # a forked rank 0 starts and returns in far less
    assert time.monotonic() - start < 21
    assert str(info.value).endswith("ranks still running: [1]")


def test_init_distributed_needs_torchrun_environment(monkeypatch):
    monkeypatch.delenv("RANK", raising=False)
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    with pytest.raises(RuntimeError, match="torchrun"):
        init_distributed()


def test_init_distributed_from_environment(monkeypatch):
    for key, value in {"RANK": "0", "WORLD_SIZE": "1", "LOCAL_RANK": "0",
                       "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port())}.items():
        monkeypatch.setenv(key, value)
    try:
        assert init_distributed("gloo") == (0, 1)
        assert dist.get_backend() == "gloo"
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("backend, device", [("gloo", "cpu"), ("nccl", "cuda"), ("cpu:gloo,cuda:nccl", "cuda")])
def test_tensors_live_where_the_backend_talks(monkeypatch, backend, device):
    """On a GPU host, gloo ranks keep their tensors on the CPU; NCCL ranks on their GPU."""
    from autopar.mesh import default_device_type

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(dist, "is_initialized", lambda: True)
    monkeypatch.setattr(dist, "get_backend", lambda group=None: backend)
    assert default_device_type() == device


@pytest.mark.parametrize("compile, expected", [
    (True, dict(mode=None)), ("reduce-overhead", dict(mode="reduce-overhead")),
    ("max-autotune-no-cudagraphs", dict(mode="max-autotune-no-cudagraphs")), ("aot_eager", dict(backend="aot_eager")),
])
def test_compile_takes_inductor_modes_and_backends(monkeypatch, compile, expected):
    """``compile=`` names an Inductor mode or a torch.compile backend; False leaves the graph eager."""
    from autopar.runtime.parallel_model import lower

    seen = []
    monkeypatch.setattr(torch, "compile", lambda gm, **kw: seen.append(kw) or gm)
    gm = torch.fx.symbolic_trace(torch.nn.ReLU())
    assert lower(gm, compile) is gm and seen == [expected]
    assert lower(gm, False) is gm and len(seen) == 1
