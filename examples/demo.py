"""Plan and train the example GPT on a CPU mesh of gloo ranks: autopar end to end in about a minute.

    python -m autopar demo                       # mesh 1,1,2: two ranks, tensor parallel
    python -m autopar demo --mesh 2,1,1 --zero 1 --steps 50
    python examples/demo.py --plan megatron --out plan.json

Every rank builds the same model (same seed) and the same fixed batch; ``autopar.parallelize``
plans on rank 0 (``--plan auto`` prices the choices for this CPU) and broadcasts the plan, each
rank keeps its shards, and ``train_step`` runs forward and backward (each dp rank takes its slice
of the batch). Rank 0 prints the plan summary, one line per step and the first and last loss.

The task is deterministic: each sequence is an arithmetic progression modulo the vocabulary,
x[t] = (start + stride * t) mod vocab, with a random start and a stride from 1 to 4, so the next
token follows from the two before it and the loss visibly falls within a few dozen steps.
"""
from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from dataclasses import replace

# The default model: small enough that a step takes milliseconds on two CPU cores,
# large enough that tensor parallelism has heads and columns to split.
DEMO_CONFIG_NAME = "demo"
MAX_STRIDE = 4


def _demo_config():
    from autopar.examples.gpt import GPTConfig
    return GPTConfig(vocab_size=256, block_size=64, n_layer=2, n_head=4, n_embd=64)


def build_parser(parser: argparse.ArgumentParser | None = None) -> argparse.ArgumentParser:
    """The demo's options (added to ``parser`` when given, e.g. a ``python -m autopar`` subcommand)."""
    from autopar.examples.gpt import CONFIGS

    p = parser or argparse.ArgumentParser(
        prog="python -m autopar demo",
        description="Plan and train the example GPT with autopar on a CPU mesh of gloo ranks.")
    p.add_argument("--mesh", default="1,1,2", help="dp,pp,tp mesh; one process per rank (default 1,1,2)")
    p.add_argument("--config", default=DEMO_CONFIG_NAME, choices=[DEMO_CONFIG_NAME, *CONFIGS],
                   help="model shape: 'demo' (vocab 256, 2 layers, 4 heads, 64 wide; the default) "
                        "or a name from autopar.examples.gpt.CONFIGS")
    p.add_argument("--layers", type=int, help="override the config's n_layer")
    p.add_argument("--heads", type=int, help="override the config's n_head")
    p.add_argument("--embd", type=int, help="override the config's n_embd")
    p.add_argument("--vocab", type=int, help="override the config's vocab_size")
    p.add_argument("--seq", type=int, help="sequence length (default: the block size, at most 64)")
    p.add_argument("--batch", type=int, default=8, help="global batch size (default 8)")
    p.add_argument("--steps", type=int, default=20, help="training steps (default 20)")
    p.add_argument("--lr", type=float, default=3e-3, help="AdamW learning rate (default 3e-3)")
    p.add_argument("--compile", action="store_true",
                   help="lower through torch.compile with Inductor (C++ on CPU; about 30-45 s cold "
                        "per rank); the default is the 'aot_eager' backend, which compiles in seconds")
    p.add_argument("--plan", default="auto", metavar="auto|megatron|PATH",
                   help="'auto' (the planner decides), 'megatron' (the hand-written plan) "
                        "or a plan JSON file (default auto)")
    p.add_argument("--sequence-parallel", default="auto", choices=["on", "off", "auto"],
                   help="sequence parallelism (default auto: the planner decides)")
    p.add_argument("--zero", type=int, default=0, choices=[0, 1],
                   help="1 shards the optimizer state over dp (default 0)")
    p.add_argument("--out", metavar="PLAN.json", help="write the plan used as JSON to this file")
    p.add_argument("--timeout", type=float, default=900.0,
                   help="seconds before the ranks are stopped (default 900)")
    return p


def model_config(args):
    """The GPTConfig the options ask for."""
    from autopar.examples.gpt import CONFIGS
    cfg = _demo_config() if args.config == DEMO_CONFIG_NAME else CONFIGS[args.config]
    overrides = {"n_layer": args.layers, "n_head": args.heads, "n_embd": args.embd,
                 "vocab_size": args.vocab}
    cfg = replace(cfg, **{k: v for k, v in overrides.items() if v is not None})
    seq = args.seq or min(cfg.block_size, 64)
    if seq > cfg.block_size:
        cfg = replace(cfg, block_size=seq)   # the position table grows to fit the sequence
    return cfg, seq


def make_batch(vocab: int, batch: int, seq: int, seed: int = 0):
    """A fixed batch of arithmetic progressions mod ``vocab``: (idx, targets), each (batch, seq)."""
    import torch
    g = torch.Generator().manual_seed(seed)
    start = torch.randint(0, vocab, (batch, 1), generator=g)
    stride = torch.randint(1, MAX_STRIDE + 1, (batch, 1), generator=g)
    seqs = (start + stride * torch.arange(seq + 1)) % vocab
    return seqs[:, :-1].contiguous(), seqs[:, 1:].contiguous()


def _sp(value: str):
    return {"on": True, "off": False, "auto": "auto"}[value]


def _check(args, cfg, seq):
    """Fail before starting any process on what can be checked here."""
    from autopar.mesh import Mesh
    mesh = Mesh.parse(args.mesh)
    if cfg.n_embd % cfg.n_head:
        raise ValueError(f"n_embd={cfg.n_embd} is not a multiple of n_head={cfg.n_head}")
    if args.batch < 1 or seq < 1 or args.steps < 1:
        raise ValueError("--batch, --seq and --steps must be positive")
    if args.batch % mesh.dp:
        raise ValueError(f"batch size {args.batch} is not divisible by dp={mesh.dp}; use a batch "
                         f"that is a multiple of {mesh.dp}")
    if args.plan not in ("auto", "megatron") and not os.path.isfile(args.plan):
        raise ValueError(f"--plan {args.plan!r}: expected 'auto', 'megatron' or a plan JSON file "
                         "(no such file)")
    return mesh


def train_rank(rank: int, world_size: int, args: dict):
    """One gloo rank: parallelize, train, and on rank 0 print as it goes. Returns the loss curve,
    or ("error", message) when autopar refuses the request (every rank learns of it the same way)."""
    import torch

    import autopar
    from autopar.examples.gpt import GPT

    cfg, seq = args["cfg"], args["seq"]
    console = _console() if rank == 0 else None
    torch.manual_seed(0)
    model = GPT(cfg)
    n_params = sum(p.numel() for p in model.parameters())   # parallelize leaves the model only its shards
    idx, targets = make_batch(cfg.vocab_size, args["batch"], seq)
    t0 = time.perf_counter()
    try:
        with (console.status("planning, rewriting and compiling ...") if console else _nothing()):
            pm = autopar.parallelize(model, args["mesh"], (idx, targets), plan=args["plan"],
                                     sequence_parallel=args["sequence_parallel"], zero=args["zero"],
                                     compile=args["compile"])
    except (ValueError, NotImplementedError) as e:   # PlanError and PlanFormatError are ValueErrors
        return ("error", str(e))
    opt = pm.optimizer(torch.optim.AdamW, lr=args["lr"])
    if console:
        print(pm.plan.summary())
        if args["out"]:
            pm.plan.to_json(args["out"])
            print(f"plan written to {args['out']}")
        print(f"\nmodel: {cfg.n_layer} layers, {cfg.n_head} heads, width {cfg.n_embd}, vocab "
              f"{cfg.vocab_size}, {n_params / 1e6:.2f} M parameters; batch {args['batch']} x seq {seq}; "
              f"parallelize took {time.perf_counter() - t0:.1f} s; compile={args['compile']!r}")
        print(f"{'step':>6} {'loss':>10} {'ms/step':>10}", flush=True)
    losses, times = [], []
    for step in range(1, args["steps"] + 1):
        t = time.perf_counter()
        opt.zero_grad()
        loss = pm.train_step(idx, targets)
        opt.step()
        times.append(time.perf_counter() - t)
        losses.append(float(loss))
        if console:
            note = "  (first step: compiles)" if step == 1 else ""
            print(f"{step:>6d} {losses[-1]:>10.4f} {times[-1] * 1e3:>10.1f}{note}", flush=True)
    if console:
        later = times[1:] or times
        print(f"\nfirst loss {losses[0]:.4f}, last loss {losses[-1]:.4f} after {len(losses)} steps; "
              f"{sum(later) / len(later) * 1e3:.1f} ms/step after the first", flush=True)
    return losses


def _console():
    from rich.console import Console
    return Console(stderr=True)


class _nothing:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


def main(argv=None) -> int:
    """Run the demo; returns the exit status (2 when autopar refuses the options, with its message)."""
    args = build_parser().parse_args(argv)
    try:
        cfg, seq = model_config(args)
        mesh = _check(args, cfg, seq)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    compile_ = True if args.compile else "aot_eager"
    job = dict(cfg=cfg, seq=seq, mesh=(mesh.dp, mesh.pp, mesh.tp), batch=args.batch, steps=args.steps,
               lr=args.lr, compile=compile_, plan=args.plan, sequence_parallel=_sp(args.sequence_parallel),
               zero=args.zero, out=os.path.abspath(args.out) if args.out else None)
    # Inductor's cache must be chosen before the ranks import torch, and shared between them.
    cache = os.environ.get("TORCHINDUCTOR_CACHE_DIR",
                           os.path.join(tempfile.gettempdir(), "autopar-inductor-cache"))
    print(f"autopar demo: {mesh.world_size} gloo rank(s) on mesh {mesh}, {args.steps} steps", flush=True)
    t0 = time.perf_counter()

    from autopar.examples import demo as this   # by import name, so spawned ranks can unpickle it
    from autopar.launch import spawn
    results = spawn(this.train_rank, mesh.world_size, job, timeout=args.timeout,
                    env={"TORCHINDUCTOR_CACHE_DIR": cache})
    first = results[0]
    if isinstance(first, tuple) and first[0] == "error":
        print(f"error: {' '.join(first[1].split())}", file=sys.stderr)
        return 2
    print(f"done in {time.perf_counter() - t0:.1f} s (process start, planning, compiling and training)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
