"""One rank failing mid-step (raising, or killed) stops every rank within a bounded time and names it."""
import os
import signal
import sys
import textwrap
import time

import pytest
import torch

import autopar
import cli
from autopar.examples.gpt import GPT, GPTConfig, example_inputs
from autopar.launch import RankError, free_port, spawn
from autopar.runtime.parallel_model import ParallelModel

CFG = GPTConfig(vocab_size=64, block_size=16, n_layer=1, n_head=2, n_embd=16)
# spawn's ranks are forked from the fork server (imports done once); torchrun starts its own below
BOUND_S = 60


def _train_and_fail(rank, world_size, how, pid_dir):
    """Two ranks train under tp=2; on its second step rank 1 fails between the forward's collectives and
    the backward's, so rank 0 is inside a backward all-reduce that rank 1 never joins."""
    (pid_dir / f"{rank}.pid").write_text(str(os.getpid()))
    torch.manual_seed(0)
    idx, tgt = example_inputs(CFG, 4, 8)
    pm = autopar.parallelize(GPT(CFG), (1, 1, 2), (idx, tgt), compile=False)
    forward = ParallelModel._forward   # one microbatch's forward of train_step

    def fail(grad):   # runs when the backward starts
        (pid_dir / "failed_at").write_text(repr(time.time()))
        if how == "sigkill":
            os.kill(os.getpid(), signal.SIGKILL)
        raise ValueError("injected failure in the backward of rank 1")

    def failing_forward(self, *args):
        loss = forward(self, *args)
        loss.register_hook(fail)
        return loss

    pm.train_step(idx, tgt)   # a whole step first: the failure comes mid-training
    if rank == 1:
        ParallelModel._forward = failing_forward
    pm.train_step(idx, tgt)
    time.sleep(3600)   # only the spawner's stopping the job may end rank 0's run


def _all_gone(pid_dir):
    for pid_file in pid_dir.glob("*.pid"):
        try:
            os.kill(int(pid_file.read_text()), 0)
        except ProcessLookupError:
            continue
        return False
    return len(list(pid_dir.glob("*.pid"))) == 2


def test_rank_killed_mid_step_stops_every_rank(tmp_path):
    with pytest.raises(RankError) as info:
        spawn(_train_and_fail, 2, "sigkill", tmp_path, timeout=300, start_method="forkserver")
    assert time.time() - float((tmp_path / "failed_at").read_text()) < BOUND_S
    assert "rank 1 died without raising (killed by SIGKILL" in str(info.value)
    assert _all_gone(tmp_path)


def test_rank_raising_mid_step_reaches_the_caller(tmp_path):
    with pytest.raises(RankError) as info:
        spawn(_train_and_fail, 2, "raise", tmp_path, timeout=300, start_method="forkserver")
    assert time.time() - float((tmp_path / "failed_at").read_text()) < BOUND_S
    message = str(info.value)
    assert message.startswith("rank 1 failed:")
    assert "ValueError: injected failure in the backward of rank 1" in message
    assert _all_gone(tmp_path)


_TORCHRUN_SCRIPT = textwrap.dedent("""
    import os, time
    import torch
    import torch.distributed as dist
    from autopar.launch import guard, init_distributed

    with guard():
        rank, world = init_distributed(timeout_s=3600)   # only the failure may end the wait below
        dist.barrier()
        if rank == 1:
            with open("failed_at", "w") as f:
                f.write(repr(time.time()))
            {failure}
        dist.all_reduce(torch.ones(1))                    # rank 0 waits here for rank 1
        time.sleep(3600)
""")


FAILURES = {
    "raise": ("raise RuntimeError('rank 1 gave up')", "RuntimeError: rank 1 gave up"),
    "sigkill": ("os.kill(os.getpid(), 9)", "Signal 9 (SIGKILL)"),
}


def _torchrun() -> list[str]:
    return [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-addr", "127.0.0.1",
            "--master-port", str(free_port()), "job.py"]


# started with the session's tests, beside them (tests/cli.py says why)
TORCHRUN = {name: cli.background(_torchrun, files={"job.py": _TORCHRUN_SCRIPT.format(failure=failure)}, timeout=900,
                                 OMP_NUM_THREADS="1")
            for name, (failure, _) in FAILURES.items()}


@pytest.mark.parametrize("name", list(FAILURES))
def test_torchrun_rank_failure_ends_the_job(name):
    done, ended, workdir = TORCHRUN[name].result()
    failed_at = workdir / "failed_at"
    assert failed_at.exists(), f"rank 1 never reached its failure; the job's stderr ends:\n{done.stderr[-3000:]}"
    # from the failure, not from the start: two ranks importing torch on a loaded machine take a while
    assert ended - float(failed_at.read_text()) < BOUND_S
    assert done.returncode != 0
    # torchrun's closing report names the failed rank and, from guard's error file, its error.
    report = done.stderr[done.stderr.rindex("Root Cause"):]
    assert "rank      : 1" in report
    assert FAILURES[name][1] in report
