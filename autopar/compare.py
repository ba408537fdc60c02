"""autopar's plans against hand-written PyTorch parallelism, trained on the same data.

    python -m autopar compare --mesh dp,pp,tp [--steps N] [--contenders auto,megatron,hand-written]
    python -m autopar compare --mesh 2,1,1 --contenders zero3,fsdp2

Contenders (``CONTENDERS``):

    auto          autopar.parallelize(plan="auto"), ZeRO-0 (gradients all-reduced over dp)
    megatron      autopar.parallelize(plan="megatron"), ZeRO-0
    zero3         autopar.parallelize(plan="auto", zero=3): weights as dp shards, gathered per unit
    hand-written  examples/handwritten.py: TP/SP by hand (DTensor), FSDP2 ``fully_shard`` over dp
    fsdp2         examples/handwritten.py's FSDP2 over dp, per block and at the root; with tp = 1
                  plain FSDP2 on the module as written (no TP plan), with tp > 1 the hand-written TP
                  plan under it (then the same program as "hand-written")

Each contender trains the example GPT for N AdamW steps (lr 1e-3, one batch, the same seed) on
every rank of a CPU gloo mesh, one spawn per contender. The last step (forward, backward and
optimizer step) is measured, on every rank:

- collectives, by kind, counted as they run by a TorchDispatchMode that sees the functional
  collectives (``_c10d_functional``, ``_c10d_functional_autograd``: autopar, DTensor) and the
  c10d ones (``c10d``: FSDP2, ``torch.distributed.*``). Bytes are always those of the FULL tensor:
  an all-gather's output, a reduce-scatter's input, an all-reduce's, broadcast's or all-to-all's
  tensor, whichever API issued it (rank 0's count; the ranks run the same program);
- peak tensor memory (``StepMemory``): the bytes of CPU tensor storage the contender holds when the
  step starts ("held": every storage reachable from its model, ParallelModel and optimizer objects:
  weights, gradients, optimizer state, buffers, FSDP2's padded shards, ...) plus the most that the
  storages the step makes, resizes and frees add to it at any moment (every op's outputs seen
  through the dispatcher, FSDP2's ``UntypedStorage.resize_`` calls, each storage's free wherever
  it happens; scratch inside one kernel and gloo's own buffers are not seen). Each rank's figure
  is kept (``peaks`` in a row); the table prints the max over ranks. Frees that gloo's threads make
  can move a peak by a little between runs. The process's peak RSS (printed too) is dominated by
  the interpreter and torch, a few hundred MiB whatever the model. torch.profiler's memory events
  were tried first and dropped: they come from the profiled thread only, and the same run's peaks
  moved by 4-6% between repeats, which frees made on gloo's threads going unreported would explain;
- the loss of every step (rank 0's: every rank reports the dp mean), compared with the same steps of
  the unsharded model in this process (largest relative difference over the steps).

The step time is the median of the unmeasured steps after the first; setup is the time to
parallelize plus the first step (capture, planning, lazy initialisation).
"""
from __future__ import annotations

import contextlib
import gc
import resource
import statistics
import threading
import time
import weakref
from collections import Counter
from types import BuiltinFunctionType, CodeType, FrameType, FunctionType, ModuleType

import torch
from torch.utils._pytree import tree_leaves
from torch.utils._python_dispatch import TorchDispatchMode, is_traceable_wrapper_subclass

CONTENDERS = ("auto", "megatron", "zero3", "hand-written", "fsdp2")
DEFAULT_CONTENDERS = ("auto", "megatron", "hand-written")
_BY_HAND = ("hand-written", "fsdp2")

# op name -> (kind, the argument holding the full tensor(s) or one rank's share of it, whether it is
# a share that the group size, argument 1 of the functional all-gathers, multiplies)
_FUNCTIONAL = {
    "all_reduce": ("all_reduce", 0, False), "all_reduce_": ("all_reduce", 0, False),
    "all_reduce_coalesced": ("all_reduce", 0, False), "all_reduce_coalesced_": ("all_reduce", 0, False),
    "all_gather_into_tensor": ("all_gather", 0, True), "all_gather_into_tensor_out": ("all_gather", 0, True),
    "all_gather_into_tensor_coalesced": ("all_gather", 0, True),
    "reduce_scatter_tensor": ("reduce_scatter", 0, False), "reduce_scatter_tensor_out": ("reduce_scatter", 0, False),
    "reduce_scatter_tensor_coalesced": ("reduce_scatter", 0, False),
    "all_to_all_single": ("all_to_all", 0, False),
    "broadcast": ("broadcast", 0, False), "broadcast_": ("broadcast", 0, False),
}
_C10D = {
    "allreduce_": ("all_reduce", 0, False), "allreduce_coalesced_": ("all_reduce", 0, False),
    "_allgather_base_": ("all_gather", 0, False), "allgather_": ("all_gather", 0, False),
    "allgather_coalesced_": ("all_gather", 0, False), "allgather_into_tensor_coalesced_": ("all_gather", 0, False),
    "_reduce_scatter_base_": ("reduce_scatter", 1, False), "reduce_scatter_": ("reduce_scatter", 1, False),
    "reduce_scatter_tensor_coalesced_": ("reduce_scatter", 1, False),
    "alltoall_base_": ("all_to_all", 1, False), "alltoall_": ("all_to_all", 1, False),
    "broadcast_": ("broadcast", 0, False),
}
_TABLES = {"_c10d_functional": _FUNCTIONAL, "_c10d_functional_autograd": _FUNCTIONAL, "c10d": _C10D}


class CollectiveCounter(TorchDispatchMode):
    """Counts the collectives run inside it by kind, with the bytes of each one's full tensor (an
    all-gather's output, a reduce-scatter's input, the tensor of the others), functional and c10d alike."""

    def __init__(self):
        super().__init__()
        self.count, self.bytes = Counter(), Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        entry = _TABLES.get(func.namespace, {}).get(func.__name__.split(".")[0])
        if entry is not None:
            kind, where, share = entry
            nbytes = sum(t.numel() * t.element_size() for t in tree_leaves(args[where])
                         if isinstance(t, torch.Tensor))
            self.count[kind] += 1
            self.bytes[kind] += nbytes * (args[1] if share else 1)
        return func(*args, **(kwargs or {}))


# objects whose references lead out of a contender's state (classes, modules, functions' globals)
_OPAQUE = (type, ModuleType, FunctionType, BuiltinFunctionType, CodeType, FrameType, str, bytes, int, float)


def _inner(t: torch.Tensor) -> list[torch.Tensor]:
    """The tensors holding ``t``'s memory: itself, a wrapper subclass's (DTensor's local shard), or
    none (FakeTensor, FunctionalTensor, ...)."""
    if type(t) in (torch.Tensor, torch.nn.Parameter):
        return [t]
    if is_traceable_wrapper_subclass(t):
        return [x for name in t.__tensor_flatten__()[0] for x in _inner(getattr(t, name))]
    return []


def _cpu_storage(t: torch.Tensor):
    st = t.untyped_storage()
    return st if st.device.type == "cpu" else None


def held_storages(*roots) -> dict:
    """The CPU tensor storages reachable from ``roots`` through Python references (leaf tensors'
    ``.grad`` and wrapper subclasses' inner tensors followed), by storage id. Their ``nbytes()`` is
    the whole allocation (padding included; 0 for one resized to nothing, as FSDP2 leaves its
    gathered parameters between steps)."""
    seen, storages, todo = set(), {}, list(roots)
    while todo:
        obj = todo.pop()
        if obj is None or id(obj) in seen or isinstance(obj, _OPAQUE):
            continue
        seen.add(id(obj))
        if isinstance(obj, torch.Tensor):
            for t in _inner(obj):
                st = _cpu_storage(t)
                if st is not None:
                    storages[st._cdata] = st
            if obj.is_leaf:
                todo.append(obj.grad)
            if type(obj) not in (torch.Tensor, torch.nn.Parameter):
                continue   # a subclass's own fields (a FakeTensor's mode, ...) hold no memory of it
        todo += [r for r in gc.get_referents(obj) if not isinstance(r, _OPAQUE)]
    return storages


class StepMemory(TorchDispatchMode):
    """Peak bytes of CPU tensor storage a rank holds inside the block: ``held`` (what
    ``held_storages(*roots)`` finds when it starts) plus the most that the storages made, grown or
    shrunk inside add to it at any time. Every op's outputs are seen through the dispatcher, storage
    resizes (FSDP2 frees and refills its gathered parameters so) through ``UntypedStorage.resize_``,
    and a storage leaves the count when it is freed, on whichever thread. Scratch memory inside one
    kernel is not seen, and neither is gloo's on its own threads. The garbage collector is run
    before and paused inside, so the figure does not depend on when it would have run."""

    def __init__(self, *roots):
        super().__init__()
        self.roots, self.held, self.peak = roots, 0, 0
        self._lock = threading.RLock()

    def __enter__(self) -> "StepMemory":
        gc.collect()
        self._collecting = gc.isenabled()
        gc.disable()
        self._sizes: dict[int, int] = {}   # storage id -> bytes now, of every storage known alive
        self._finalizers = []
        for key, st in held_storages(*self.roots).items():
            self._sizes[key] = st.nbytes()
            self._finalizers.append(weakref.finalize(st, self._freed, key))
        self.held = sum(self._sizes.values())
        self._now = self._high = 0
        self._resize = torch.UntypedStorage.resize_
        note, resize = self._note, self._resize

        def resize_(st, size):
            out = resize(st, size)
            if st.device.type == "cpu":
                note(st)
            return out
        torch.UntypedStorage.resize_ = resize_
        return super().__enter__()

    def __exit__(self, *exc):
        super().__exit__(*exc)
        torch.UntypedStorage.resize_ = self._resize
        for f in self._finalizers:   # the storages that outlive the block no longer report to it
            f.detach()
        if self._collecting:
            gc.enable()
        self.peak = self.held + self._high

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in tree_leaves(out):
            if isinstance(t, torch.Tensor):
                for x in _inner(t):
                    st = _cpu_storage(x)
                    if st is not None:
                        self._note(st)
        return out

    def _note(self, st) -> None:
        """Count a storage seen (new, or one held from the start) at its size now."""
        key, nbytes = st._cdata, st.nbytes()
        with self._lock:
            if key not in self._sizes:
                self._sizes[key] = 0
                self._finalizers.append(weakref.finalize(st, self._freed, key))
            self._move(nbytes - self._sizes[key])
            self._sizes[key] = nbytes

    def _freed(self, key: int) -> None:
        # a storage whose last reference a gloo thread drops is freed there: the lock keeps its
        # update from interleaving with the main thread's
        with self._lock:
            self._move(-self._sizes.pop(key))

    def _move(self, nbytes: int) -> None:
        self._now += nbytes
        self._high = max(self._high, self._now)


def _build(name, mesh, model, idx, tgt, sp):
    """The contender's step function, its optimizer and the objects that hold its state."""
    import autopar

    if name in _BY_HAND:
        from autopar.examples import handwritten as hw
        from autopar.mesh import made_device_mesh
        dmesh = made_device_mesh("cpu", (mesh[0], mesh[2]), ("dp", "tp"))
        tensor_parallel = name == "hand-written" or mesh[2] > 1
        model = hw.parallelize_by_hand(model, dmesh, sequence_parallel=sp and tensor_parallel,
                                       dp_wrapper="fully_shard", tensor_parallel=tensor_parallel)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
        local = hw.local_batch_by_hand(dmesh, idx, tgt)
        return (lambda: float(hw.train_step_by_hand(model, *local))), opt, (model, opt)
    # FSDP2's FULL_SHARD: every unit resharded after its forward
    knobs = dict(plan="auto", zero=3, keep_gathered=()) if name == "zero3" else dict(plan=name)
    pm = autopar.parallelize(model, mesh, (idx, tgt), sequence_parallel=sp, compile=False, **knobs)
    opt = pm.optimizer(torch.optim.AdamW, lr=1e-3)
    return (lambda: float(pm.train_step(idx, tgt))), opt, (model, pm, opt)


def run_contender(rank, world, name, mesh, steps, cfg, batch, seq, sequence_parallel=True) -> dict:
    """One contender on this rank (every rank of the mesh calls it, in a process group of
    ``world`` = dp*pp*tp ranks): its losses, the last step's collectives and memory, its times."""
    from autopar.examples.gpt import GPT, example_inputs

    if name not in CONTENDERS:
        raise ValueError(f"unknown contender {name!r}; choose from {', '.join(CONTENDERS)}")
    torch.manual_seed(0)
    model = GPT(cfg)
    idx, tgt = example_inputs(cfg, batch, seq)
    t0 = time.perf_counter()
    step, opt, state = _build(name, mesh, model, idx, tgt, sequence_parallel)
    del model   # what the contender still holds of it is reachable from ``state``
    losses, times, counter, memory = [], [], CollectiveCounter(), StepMemory(*state)
    for k in range(steps):
        opt.zero_grad()
        last = k == steps - 1
        t1 = time.perf_counter()
        with memory if last else contextlib.nullcontext(), counter if last else contextlib.nullcontext():
            losses.append(step())
            opt.step()
        times.append(time.perf_counter() - t1)
        if k == 0:
            setup = t1 - t0 + times[0]
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    return dict(losses=losses, count=dict(counter.count), bytes=dict(counter.bytes), held=memory.held,
                peak=memory.peak, rss=rss, step=statistics.median(times[1:-1] or times[:-1] or times), setup=setup)


def train_curve(model, idx, tgt, steps: int, lr: float, optimizer=torch.optim.AdamW) -> list[float]:
    """The losses of ``steps`` steps of ``optimizer`` (AdamW) on the unsharded ``model``, one batch."""
    opt = optimizer(model.parameters(), lr=lr)
    curve = []
    for _ in range(steps):
        opt.zero_grad()
        loss = model(idx, tgt)
        loss.backward()
        opt.step()
        curve.append(loss.item())
    return curve


def reference_curve(cfg, batch: int, seq: int, steps: int) -> list[float]:
    """The losses of the same ``steps`` AdamW steps on the unsharded model, in this process."""
    from autopar.examples.gpt import GPT, example_inputs

    torch.manual_seed(0)
    return train_curve(GPT(cfg), *example_inputs(cfg, batch, seq), steps, 1e-3)


def row(name: str, per_rank: list[dict], reference: list[float]) -> dict:
    """One contender's table row from its ranks' ``run_contender`` results: rank 0's losses,
    collectives and times, every rank's peak tensor memory (``peaks``) and their max (``peak``)."""
    first = per_rank[0]
    diff = max(abs(a - b) / abs(b) for a, b in zip(first["losses"], reference))
    return dict(name=name, losses=first["losses"], max_rel_diff=diff, count=first["count"], bytes=first["bytes"],
                peaks=[r["peak"] for r in per_rank], peak=max(r["peak"] for r in per_rank),
                held=max(r["held"] for r in per_rank), rss=max(r["rss"] for r in per_rank),
                step=first["step"], setup=first["setup"])


def compare(mesh, steps: int = 5, *, sequence_parallel: bool = True, contenders=DEFAULT_CONTENDERS,
            cfg=None, batch: int = 8, seq: int = 64) -> list[dict]:
    """Run every contender on CPU gloo ranks (one spawn each); one ``row`` per contender."""
    from autopar.examples.gpt import GPTConfig
    from autopar.launch import spawn

    if not contenders:
        raise ValueError(f"no contenders given; choose from {', '.join(CONTENDERS)}")
    unknown = [c for c in contenders if c not in CONTENDERS]
    if unknown:
        raise ValueError(f"unknown contender {unknown[0]!r}; choose from {', '.join(CONTENDERS)}")
    if mesh[1] != 1 and any(c in _BY_HAND for c in contenders):
        raise ValueError(f"mesh {tuple(mesh)} has pp={mesh[1]}, but the hand-written contenders have no "
                         "pipeline; use pp=1 or leave out hand-written and fsdp2")
    if steps < 1:
        raise ValueError(f"steps={steps}: compare needs at least one step to measure")
    cfg = cfg or GPTConfig(vocab_size=512, block_size=seq, n_layer=2, n_head=4, n_embd=128)
    reference = reference_curve(cfg, batch, seq, steps)
    world = mesh[0] * mesh[1] * mesh[2]
    return [row(name, spawn(run_contender, world, name, tuple(mesh), steps, cfg, batch, seq, sequence_parallel,
                            timeout=900), reference) for name in contenders]


def table(rows) -> str:
    """The comparison as text, one contender a line: collectives per step as count / MiB of full
    tensors per kind, peak tensor memory and the state held at the step's start (max over ranks)."""
    kinds = sorted({k for r in rows for k in r["count"]})
    mib = 2 ** 20
    head = (f"{'contender':13s} {'final loss':>10s} {'rel diff':>8s} "
            + " ".join(f"{k + ' n / MiB':>21s}" for k in kinds)
            + f" {'total MiB':>9s} {'peak tensor MiB':>15s} {'held MiB':>8s} {'peak RSS MiB':>12s}"
              f" {'step ms':>8s} {'setup s':>7s}")
    lines = [head]
    for r in rows:
        colls = " ".join(f"{r['count'].get(k, 0):>9d} / {r['bytes'].get(k, 0) / mib:9.4f}" for k in kinds)
        lines.append(f"{r['name']:13s} {r['losses'][-1]:10.6f} {r['max_rel_diff']:8.1e} {colls} "
                     f"{sum(r['bytes'].values()) / mib:9.4f} {r['peak'] / mib:15.4f} {r['held'] / mib:8.4f} "
                     f"{r['rss'] / mib:12.1f} {r['step'] * 1e3:8.1f} {r['setup']:7.1f}")
    lines.append("bytes: full tensors (all-gather output, reduce-scatter input); rel diff: the largest over the "
                 "steps against the unsharded model; peak tensor and held: max over ranks")
    return "\n".join(lines)
