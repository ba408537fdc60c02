"""Train the example GPT on English text, one byte per token, on any (dp, pp, tp) mesh.

    python -m autopar.examples.train_gpt --mesh 1,1,2 --steps 200        # spawns 2 local ranks
    python -m autopar.examples.train_gpt --mesh 1,1,2 --checkpoint-dir ckpt --checkpoint-every 50
    python -m autopar.examples.train_gpt --mesh 2,1,1 --checkpoint-dir ckpt --resume   # another mesh
    torchrun --nproc-per-node 8 -m autopar.examples.train_gpt --mesh 2,2,2          # one process per rank

The corpus is the text shipped in ``examples/data`` (see its README for source and licence), read
as raw bytes: vocabulary 256, nothing to download. Started with ``python -m``, the script spawns one
process per rank of the mesh (gloo on CPU, NCCL with CUDA); under ``torchrun`` it is one of them.

The batch of step s is drawn from a generator seeded with (seed, s) on every rank alike, so a run
resumed from a checkpoint sees the batches an uninterrupted run would have seen, and with
``--deterministic`` (``autopar.set_deterministic``) reproduces its losses. Checkpoints are
``autopar.checkpoint`` directories, ``<dir>/step-<N>``, loadable on any mesh.

Rank 0 shows a progress bar and, every ``--log-every`` steps, a line with the loss, tokens per
second, MFU and memory. MFU is the plan's model FLOPs per step (forward and backward, every rank)
over the measured step time times the peak FLOP/s of the cost model's device (``--device``;
default this machine's kind) times the number of devices. Memory is the peak allocated by PyTorch
on the GPU, or the process's peak resident set on CPU (which includes the PyTorch runtime).
"""
from __future__ import annotations

import argparse
import math
import os
import re
import resource
import sys
import tempfile
import time
from pathlib import Path

import torch

DATA_DIR = Path(__file__).resolve().parent / "data"
VOCAB = 256   # one token per byte
_STEP_DIR = re.compile(r"step-(\d+)$")


def load_corpus(data_dir: Path = DATA_DIR) -> torch.Tensor:
    """Every ``*.txt`` file under ``data_dir`` (in name order), concatenated, as a uint8 tensor of bytes."""
    files = sorted(Path(data_dir).glob("*.txt"))
    if not files:
        raise FileNotFoundError(f"no .txt files in {data_dir}: the training text ships in examples/data; "
                                "reinstall autopar or point --data at a folder of text files")
    return torch.frombuffer(bytearray(b"".join(f.read_bytes() for f in files)), dtype=torch.uint8)


def get_batch(tokens: torch.Tensor, batch: int, seq: int, step: int, seed: int):
    """The global batch of ``step``: ``batch`` random windows of ``seq + 1`` bytes as (idx, targets).

    It depends only on (seed, step), so every rank, and a resumed run, draws the same batch."""
    if tokens.numel() <= seq + 1:
        raise ValueError(f"the corpus has {tokens.numel()} bytes, too few for sequences of {seq}; "
                         "use a shorter --seq or more text")
    g = torch.Generator().manual_seed(seed * 1_000_003 + step)
    starts = torch.randint(0, tokens.numel() - seq - 1, (batch,), generator=g)
    windows = torch.stack([tokens[s:s + seq + 1] for s in starts.tolist()]).long()
    return windows[:, :-1].contiguous(), windows[:, 1:].contiguous()


def build_parser() -> argparse.ArgumentParser:
    """The script's options."""
    p = argparse.ArgumentParser(prog="python -m autopar.examples.train_gpt",
                                description="Train the example GPT on byte-level English text with autopar.")
    p.add_argument("--mesh", default="1,1,2", help="dp,pp,tp (default 1,1,2); one process per rank")
    p.add_argument("--layers", type=int, default=4, help="transformer blocks (default 4)")
    p.add_argument("--heads", type=int, default=4, help="attention heads (default 4)")
    p.add_argument("--embd", type=int, default=128, help="model width (default 128)")
    p.add_argument("--seq", type=int, default=128, help="sequence length, also the block size (default 128)")
    p.add_argument("--batch", type=int, default=16, help="global batch in sequences (default 16)")
    p.add_argument("--steps", type=int, default=200, help="train until this step (default 200)")
    p.add_argument("--lr", type=float, default=3e-3, help="AdamW learning rate (default 3e-3)")
    p.add_argument("--grad-clip", type=float, default=1.0, help="global gradient norm cap; 0 turns it off")
    p.add_argument("--seed", type=int, default=0, help="model initialisation and batch order (default 0)")
    p.add_argument("--deterministic", action="store_true",
                   help="autopar.set_deterministic(seed): bitwise-reproducible losses, some speed lost")
    p.add_argument("--compile", default="auto", metavar="auto|inductor|aot_eager|eager",
                   help="torch.compile backend; auto: inductor with CUDA, aot_eager on CPU (compiles in seconds)")
    p.add_argument("--zero", type=int, default=0, choices=[0, 1], help="1 shards optimizer state over dp")
    p.add_argument("--schedule", default="1F1B", help="pipeline schedule when pp > 1 (default 1F1B)")
    p.add_argument("--microbatches", type=int, help="microbatches per step (default: the cost model's choice)")
    p.add_argument("--device", help="cost model device for the plan and MFU (default: this machine's kind)")
    p.add_argument("--data", type=Path, default=DATA_DIR, help="folder of .txt files (default: the shipped text)")
    p.add_argument("--checkpoint-dir", type=Path, help="write checkpoints to DIR/step-<N>")
    p.add_argument("--checkpoint-every", type=int, default=100, help="steps between checkpoints (default 100)")
    p.add_argument("--resume", nargs="?", const="latest", metavar="PATH",
                   help="continue from a checkpoint: PATH, or the latest in --checkpoint-dir")
    p.add_argument("--log-every", type=int, default=10, help="steps between log lines (default 10)")
    p.add_argument("--timeout", type=float, default=3600.0,
                   help="seconds before spawned ranks are stopped (default 3600)")
    return p


def latest_checkpoint(directory: Path) -> Path:
    """The ``step-<N>`` checkpoint with the largest N under ``directory`` that finished saving."""
    done = [d for d in Path(directory).glob("step-*") if _STEP_DIR.search(d.name) and (d / ".metadata").is_file()]
    if not done:
        raise FileNotFoundError(f"--resume: no finished checkpoint (step-<N> with a .metadata file) in {directory}; "
                                "run without --resume to start from scratch")
    return max(done, key=lambda d: int(_STEP_DIR.search(d.name).group(1)))


def make_job(args) -> dict:
    """Checks the options and turns them into the picklable job every rank runs; raises ValueError."""
    from autopar.examples.gpt import GPTConfig
    from autopar.mesh import Mesh

    mesh = Mesh.parse(args.mesh)
    for name in ("layers", "heads", "embd", "seq", "batch", "steps", "checkpoint_every", "log_every"):
        if getattr(args, name) < 1:
            raise ValueError(f"--{name.replace('_', '-')} must be a positive integer, got {getattr(args, name)}")
    if args.embd % args.heads:
        raise ValueError(f"--embd {args.embd} is not a multiple of --heads {args.heads}")
    if args.batch % mesh.dp:
        raise ValueError(f"--batch {args.batch} is not divisible by dp={mesh.dp}; use a multiple of {mesh.dp}")
    resume = None
    if args.resume == "latest":
        if args.checkpoint_dir is None:
            raise ValueError("--resume without a PATH needs --checkpoint-dir to look for the latest checkpoint")
        resume = str(latest_checkpoint(args.checkpoint_dir))
    elif args.resume is not None:
        resume = str(Path(args.resume).resolve())
    backend = args.compile
    if backend == "auto":
        backend = "inductor" if torch.cuda.is_available() else "aot_eager"
    cfg = GPTConfig(vocab_size=VOCAB, block_size=args.seq, n_layer=args.layers, n_head=args.heads,
                    n_embd=args.embd)
    return dict(cfg=cfg, mesh=(mesh.dp, mesh.pp, mesh.tp), batch=args.batch, steps=args.steps, lr=args.lr,
                grad_clip=args.grad_clip, seed=args.seed, deterministic=args.deterministic,
                compile={"inductor": True, "eager": False}.get(backend, backend), zero=args.zero,
                schedule=args.schedule, microbatches=args.microbatches, device=args.device,
                data=str(Path(args.data).resolve()),
                checkpoint_dir=str(args.checkpoint_dir.resolve()) if args.checkpoint_dir else None,
                checkpoint_every=args.checkpoint_every, resume=resume, log_every=args.log_every,
                timeout=args.timeout)


def train_rank(rank: int, world_size: int, job: dict) -> dict:
    """One rank's training run. Returns {"first_step", "losses" (one per step run), "tokens_per_s",
    "mfu"}, or {"error": message} when autopar refuses the request or the checkpoint (every rank alike)."""
    import autopar
    from autopar.checkpoint import load_checkpoint, save_checkpoint
    from autopar.examples.gpt import GPT

    cfg, batch, seq, seed = job["cfg"], job["batch"], job["cfg"].block_size, job["seed"]
    if job["deterministic"]:
        autopar.set_deterministic(seed)
    else:
        torch.manual_seed(seed)   # every rank must build the same model
    device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")
    tokens = load_corpus(Path(job["data"]))
    console = _console() if rank == 0 else None
    with torch.device(device):
        model = GPT(cfg)
    example = tuple(t.to(device) for t in get_batch(tokens, batch, seq, 0, seed))
    try:
        pm = autopar.parallelize(model, job["mesh"], example, zero=job["zero"], compile=job["compile"],
                                 schedule=job["schedule"], microbatches=job["microbatches"], device=job["device"])
        opt = pm.optimizer(torch.optim.AdamW, lr=job["lr"])
        saved = load_checkpoint(pm, opt, job["resume"]) if job["resume"] else {"step": 0, "extra": None}
    except (ValueError, NotImplementedError, FileNotFoundError) as e:   # PlanError, checkpoint mismatch
        return {"error": " ".join(str(e).split())}
    del model   # the ranks keep only their shards
    start, data_order = saved["step"], {"seed": seed, "batch": batch, "seq": seq}
    if start >= job["steps"]:
        return {"error": f"the checkpoint is at step {start}, not before --steps {job['steps']}; "
                         "ask for more steps to continue training"}
    if console:
        _print_header(console, pm, cfg, job, start)
        if start and saved["extra"] != data_order:
            console.print(f"note: the checkpoint was trained with {saved['extra']}, this run uses {data_order}: "
                          "its batches differ from those an uninterrupted run would have drawn")
    losses, times = [], []
    with _Progress(console, start, job["steps"]) as bar:
        for step in range(start + 1, job["steps"] + 1):
            idx, targets = (t.to(device) for t in get_batch(tokens, batch, seq, step, seed))
            t0 = time.perf_counter()
            opt.zero_grad()
            loss = pm.train_step(idx, targets)
            if job["grad_clip"] > 0:
                pm.clip_grad_norm_(job["grad_clip"])
            opt.step()
            losses.append(float(loss))   # waits for the device, so the time below is the step's
            times.append(time.perf_counter() - t0)
            rate = _rates(pm, times[1:] or times, batch * seq)   # the first step also compiles
            bar.update(step, losses[-1], *rate, _memory_bytes(device))
            if job["checkpoint_dir"] and (step % job["checkpoint_every"] == 0 or step == job["steps"]):
                path = Path(job["checkpoint_dir"]) / f"step-{step:06d}"
                save_checkpoint(pm, opt, path, step=step, extra=data_order)
                bar.log(f"checkpoint written to {path}")
            if step % job["log_every"] == 0 or step == job["steps"]:
                bar.log_step(step, losses[-1], *rate, _memory_bytes(device))
    tokens_per_s, mfu = _rates(pm, times[1:] or times, batch * seq, window=len(times))
    if console:
        console.print(f"loss {losses[0]:.4f} at step {start + 1} -> {losses[-1]:.4f} at step {job['steps']}; "
                      f"{tokens_per_s:,.0f} tokens/s, MFU {mfu:.2%} after the first step")
    return {"first_step": start + 1, "losses": losses, "tokens_per_s": tokens_per_s, "mfu": mfu}


def _rates(pm, times, tokens_per_step, window=10):
    """(tokens/s, MFU) from the mean of the last ``window`` step times."""
    recent = times[-window:]
    dt = sum(recent) / len(recent)
    plan = pm.plan
    devices = plan.mesh[0] * plan.mesh[1] * plan.mesh[2]
    mfu = plan.model_flops / (dt * plan.peak_flops * devices) if plan.peak_flops else 0.0
    return tokens_per_step / dt, mfu


def _memory_bytes(device) -> int:
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device)
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024   # Linux reports KiB


def _bytes(n: float) -> str:
    return f"{n / 2**30:.2f} GiB" if n >= 2**30 else f"{n / 2**20:.1f} MiB"


def _print_header(console, pm, cfg, job, start):
    plan = pm.plan
    n_params = sum(math.prod(q.shape) for q in plan.parameters)
    peak = max((m.peak for m in plan.memory), default=0.0)
    console.print(f"GPT: {cfg.n_layer} layers, {cfg.n_head} heads, width {cfg.n_embd}, vocab {cfg.vocab_size}, "
                  f"{n_params / 1e6:.2f} M parameters; batch {job['batch']} x {cfg.block_size} bytes")
    console.print(f"mesh (dp, pp, tp) = {tuple(plan.mesh)}, {plan.microbatches} microbatch(es), device "
                  f"{plan.device!r}: predicted {plan.predicted_step_time * 1e3:.1f} ms/step, MFU "
                  f"{plan.predicted_mfu:.1%}, peak memory {_bytes(peak)} per rank; compile={job['compile']!r}")
    if start:
        console.print(f"resumed from {job['resume']} at step {start}")


class _Progress:
    """Rank 0's rich progress bar and log lines; on other ranks (console None) it does nothing."""

    def __init__(self, console, start: int, total: int):
        self.console, self.start, self.total, self.progress = console, start, total, None

    def __enter__(self):
        if self.console is not None:
            from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn
            self.progress = Progress(
                TextColumn("step"), MofNCompleteColumn(), BarColumn(),
                TextColumn("loss {task.fields[loss]}  {task.fields[rate]} tok/s  MFU {task.fields[mfu]}  "
                           "mem {task.fields[mem]}"),
                TimeRemainingColumn(), console=self.console)
            self.progress.start()
            self.task = self.progress.add_task("train", total=self.total, completed=self.start,
                                               loss="-", rate="-", mfu="-", mem="-")
        return self

    def __exit__(self, *exc):
        if self.progress is not None:
            self.progress.stop()
        return False

    def update(self, step, loss, rate, mfu, mem):
        if self.progress is not None:
            self.progress.update(self.task, completed=step, loss=f"{loss:.4f}", rate=f"{rate:,.0f}",
                                 mfu=f"{mfu:.2%}", mem=_bytes(mem))

    def log_step(self, step, loss, rate, mfu, mem):
        self.log(f"step {step:>6d}  loss {loss:.4f}  {rate:>10,.0f} tok/s  MFU {mfu:6.2%}  mem {_bytes(mem)}")

    def log(self, text: str):
        if self.progress is not None:
            self.progress.console.print(text)


def _console():
    from rich.console import Console
    return Console(stderr=True, soft_wrap=True)   # a log line stays one line in a file


def _under_torchrun() -> bool:
    return "RANK" in os.environ and "WORLD_SIZE" in os.environ


def run(argv=None, start_method: str = "spawn") -> dict:
    """Parses ``argv``, trains, and returns rank 0's result (see ``train_rank``); raises ValueError on bad options.

    Under ``torchrun`` this process is one rank; otherwise it starts one process per rank of the mesh
    (``start_method``: ``autopar.launch.spawn``'s)."""
    from autopar.launch import guard, init_distributed, spawn

    job = make_job(build_parser().parse_args(argv))
    world = job["mesh"][0] * job["mesh"][1] * job["mesh"][2]
    if _under_torchrun():
        with guard():
            rank, world_size = init_distributed()
            return train_rank(rank, world_size, job)
    # Inductor's cache must be chosen before the ranks import torch, and shared between them.
    cache = os.environ.get("TORCHINDUCTOR_CACHE_DIR", os.path.join(tempfile.gettempdir(), "autopar-inductor-cache"))
    from autopar.examples import train_gpt as this   # by import name, so spawned ranks can unpickle it
    backend = "nccl" if torch.cuda.is_available() and torch.cuda.device_count() >= world else "gloo"
    return spawn(this.train_rank, world, job, backend=backend, timeout=job["timeout"],
                 env={"TORCHINDUCTOR_CACHE_DIR": cache}, start_method=start_method)[0]


def main(argv=None) -> int:
    """The command line: 0 when training finished, 2 (with a one-line message) when the options are refused."""
    try:
        result = run(argv)
    except (ValueError, FileNotFoundError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    if "error" in result:
        print(f"error: {result['error']}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
