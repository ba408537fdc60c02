"""Automatic plan vs plan="megatron" vs the hand-written DTensor baseline, on the same data.

    python -m autopar compare --mesh dp,pp,tp [--steps N]

Each contender trains the example GPT for N AdamW steps on every rank of a CPU gloo mesh
(spawned here). Collectives are counted as they run (a TorchDispatchMode sees every
functional and c10d collective, with its bytes); the table has the loss after N steps and its
largest difference from the first contender, collectives per step by kind, the process's peak
resident memory, the median step time, and the planning + compile time.
"""
from __future__ import annotations

import resource
import statistics
import time
from collections import Counter

import torch
from torch.utils._python_dispatch import TorchDispatchMode

COLLECTIVES = {"all_reduce": "all_reduce", "allreduce_": "all_reduce", "all_gather_into_tensor": "all_gather",
               "_allgather_base_": "all_gather", "allgather_": "all_gather",
               "reduce_scatter_tensor": "reduce_scatter", "_reduce_scatter_base_": "reduce_scatter",
               "reducescatter_": "reduce_scatter", "all_to_all_single": "all_to_all", "broadcast_": "broadcast"}


class CollectiveCounter(TorchDispatchMode):
    """Counts collectives by kind, with the bytes of their full tensor (all-gather: its output)."""

    def __init__(self):
        super().__init__()
        self.count, self.bytes = Counter(), Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        ns, name = func.namespace, func.__name__.split(".")[0]
        if ns in ("_c10d_functional", "c10d") and name in COLLECTIVES:
            kind = COLLECTIVES[name]
            tensors = [a for a in torch.utils._pytree.tree_leaves(args) if isinstance(a, torch.Tensor)]
            nbytes = tensors[0].numel() * tensors[0].element_size() if tensors else 0
            if kind == "all_gather" and ns == "_c10d_functional":
                nbytes *= args[1]   # group size
            self.count[kind] += 1
            self.bytes[kind] += nbytes
        return func(*args, **(kwargs or {}))


def _contender(rank, world, name, mesh, steps, cfg, batch, seq, sp):
    """One contender on one rank: losses, collectives per step, peak RSS, step times, setup time."""
    import autopar
    from autopar.examples.gpt import GPT, example_inputs

    torch.manual_seed(0)
    model = GPT(cfg)
    idx, tgt = example_inputs(cfg, batch, seq)
    t0 = time.perf_counter()
    if name == "hand-written":
        from autopar.examples import handwritten as hw
        from torch.distributed.device_mesh import init_device_mesh
        dmesh = init_device_mesh("cpu", (mesh[0], mesh[2]), mesh_dim_names=("dp", "tp"))
        model = hw.parallelize_by_hand(model, dmesh, sequence_parallel=sp)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
        local = hw.local_batch_by_hand(dmesh, idx, tgt)

        def step():
            return float(hw.train_step_by_hand(model, *local))
    else:
        pm = autopar.parallelize(model, mesh, (idx, tgt), plan=name, sequence_parallel=sp, compile=False)
        opt = pm.optimizer(torch.optim.AdamW, lr=1e-3)

        def step():
            return float(pm.train_step(idx, tgt))
    losses, times, counter = [], [], CollectiveCounter()
    for k in range(steps):
        opt.zero_grad()
        t1 = time.perf_counter()
        if k == steps - 1:
            with counter:
                losses.append(step())
        else:
            losses.append(step())
        opt.step()
        times.append(time.perf_counter() - t1)
        if k == 0:
            setup = t1 - t0 + times[0]
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    return dict(losses=losses, count=dict(counter.count), bytes=dict(counter.bytes), rss=rss,
                step=statistics.median(times[1:] or times), setup=setup)


def compare(mesh, steps: int = 5, *, sequence_parallel: bool = True, contenders=("auto", "megatron", "hand-written"),
            cfg=None, batch: int = 8, seq: int = 64) -> list[dict]:
    """Run every contender on CPU gloo ranks; one row per contender (rank 0's view, losses of all)."""
    from autopar.examples.gpt import GPTConfig
    from autopar.launch import spawn

    cfg = cfg or GPTConfig(vocab_size=512, block_size=seq, n_layer=2, n_head=4, n_embd=128)
    world = mesh[0] * mesh[1] * mesh[2]
    rows = []
    for name in contenders:
        res = spawn(_contender, world, name, mesh, steps, cfg, batch, seq, sequence_parallel, timeout=900)
        rows.append(dict(name=name, **res[0]))
    first = rows[0]["losses"]
    for r in rows:
        r["max_diff"] = max(abs(a - b) for a, b in zip(r["losses"], first))
    return rows


def table(rows) -> str:
    """The comparison as text, one contender a line."""
    kinds = sorted({k for r in rows for k in r["count"]})
    head = f"{'contender':13s} {'final loss':>10s} {'max |diff|':>10s} " + " ".join(
        f"{k + ' n/MiB':>21s}" for k in kinds) + f" {'peak RSS MiB':>12s} {'step ms':>8s} {'setup s':>8s}"
    lines = [head]
    for r in rows:
        colls = " ".join(f"{r['count'].get(k, 0):>9d} / {r['bytes'].get(k, 0) / 2**20:9.3f}" for k in kinds)
        lines.append(f"{r['name']:13s} {r['losses'][-1]:10.6f} {r['max_diff']:10.2e} {colls} "
                     f"{r['rss'] / 2**20:12.1f} {r['step'] * 1e3:8.1f} {r['setup']:8.1f}")
    return "\n".join(lines)
