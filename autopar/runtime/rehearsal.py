"""One rank of a plan run alone: ``run_rank`` builds its share of a model on this device, trains it
on random tokens in a world whose collectives move no data (``runtime.fake_group``), and measures
its step.

The model may be on the meta device: only the rank's shards are made, at their local shapes
(``runtime.parameters.materialize``), randomly initialised where the model has no
``init_parameter`` of its own, and a buffer on the meta device is made as zeros. The values do
not matter here: the rehearsal measures time and memory, not numerics, so the losses are
meaningless (collectives return what their buffers held).
"""
from __future__ import annotations

import contextlib
import dataclasses
import os
import statistics
import time

import torch

from autopar.runtime.fake_group import Tally
from autopar.runtime.parallel_model import ParallelModel

# the group names a collective's axis is read from, in this order: a group several axes share is
# the first one's (an unsplit dp is dp, not dp_shard or data)
AXES = ("tp", "cp", "pp", "dp", "dp_shard", "dp_replicate", "data")


@dataclasses.dataclass(frozen=True)
class Measured:
    """A rank's step as ``run_rank`` measured it: median seconds of the forward and backward over
    the step's microbatches (``train_step``) and of the optimizer step, the peak bytes and what
    they are (``memory``), the bytes of the parameters made, and the collectives issued per step,
    (kind, axis) -> (count, bytes)."""

    compute_s: float
    update_s: float
    peak_bytes: float
    memory: str
    param_bytes: int
    collectives: dict
    steps: int


def run_rank(model, program, cap, tally: Tally, *, steps: int, warmup: int, log=None) -> Measured:
    """Run ``program`` (``runtime.program.Program`` of one rank, built on the world ``tally`` counts)
    on ``model``'s share of it: ``warmup`` steps (compiling), then ``steps`` timed ones, each a
    ``train_step`` on random tokens and an AdamW step. ``log(line)`` hears progress."""
    say = log or (lambda line: None)
    device = program.device
    say(f"rank {program.rank}: making its shards and compiling its program ...")
    with _random_shards(model, device), _compile_alone():
        pm = ParallelModel(model, program, cap)
    param_bytes = sum(p.numel() * p.element_size() for p in pm.parameters())
    opt = pm.optimizer(torch.optim.AdamW, lr=1e-4)
    batch = _random_batch(program, cap)
    cuda = device.type == "cuda"
    compute, update = [], []
    tally.on = False
    for k in range(warmup + steps):
        if k == warmup:
            tally.clear()
            tally.on = True
            if cuda:
                torch.cuda.reset_peak_memory_stats(device)
            held = _held_bytes(pm, opt)
        say(f"rank {program.rank}: {'warm-up' if k < warmup else 'timed'} step {k + 1} of {warmup + steps}")
        _sync(cuda)
        t0 = time.perf_counter()
        pm.train_step(*batch)
        _sync(cuda)
        t1 = time.perf_counter()
        opt.step()
        opt.zero_grad(set_to_none=True)
        _sync(cuda)
        if k >= warmup:
            compute.append(t1 - t0)
            update.append(time.perf_counter() - t1)
    if cuda:
        peak, memory = float(torch.cuda.max_memory_allocated(device)), "the allocator's peak"
    else:
        peak = float(held)
        memory = "the tensors held between steps (parameters, optimizer state, buffers; no activations)"
    names = {program.groups.of(a): a for a in reversed(AXES) if program.groups.of(a) is not None}
    per_step = {}
    for (kind, group), calls in tally.calls.items():
        key = (kind, names.get(group, group))
        count, nbytes = per_step.get(key, (0, 0))
        per_step[key] = (count + calls // steps, nbytes + tally.bytes[(kind, group)] // steps)
    return Measured(statistics.median(compute), statistics.median(update), peak, memory, param_bytes,
                    per_step, steps)


def _sync(cuda: bool) -> None:
    if cuda:
        torch.cuda.synchronize()


@contextlib.contextmanager
def _random_shards(model, device):
    """While building: a model on the meta device without ``init_parameter`` gets one that fills a
    shard randomly (only the rank's shards are ever made), and its meta buffers become zeros."""
    for module in model.modules():
        for name, b in list(module.named_buffers(recurse=False)):
            if b.is_meta:
                persistent = name not in module._non_persistent_buffers_set
                module.register_buffer(name, torch.zeros(b.shape, dtype=b.dtype, device=device), persistent=persistent)
    added = getattr(model, "init_parameter", None) is None
    if added:
        model.init_parameter = _normal
    try:
        yield
    finally:
        if added:
            del model.init_parameter


def _normal(fqn: str, tensor: torch.Tensor) -> None:
    """A shard's values: what GPT-2 initialises its weights with (only their scale matters here)."""
    with torch.no_grad():
        tensor.normal_(0.0, 0.02)


@contextlib.contextmanager
def _compile_alone():
    """Inductor compiles without waiting on peers: a rank alone has none, and the order among
    them is agreed over objects that a world moving no data cannot carry
    (``runtime.compile_once``)."""
    before = os.environ.get("AUTOPAR_COMPILE_ONCE")
    os.environ["AUTOPAR_COMPILE_ONCE"] = "0"
    try:
        yield
    finally:
        if before is None:
            del os.environ["AUTOPAR_COMPILE_ONCE"]
        else:
            os.environ["AUTOPAR_COMPILE_ONCE"] = before


def _random_batch(program, cap) -> list[torch.Tensor]:
    """This rank's rows of a batch of the plan's shapes: random token ids below the smallest table
    an input indexes (an embedding's rows), random floats for a float input."""
    plan = program.plan
    rows = {n.args[0].meta.get("fqn") for n in cap.gm.graph.nodes
            if n.op == "call_function" and "embedding" in str(n.target) and n.args[0].op == "placeholder"}
    tables = [plan.param(f).shape[0] for f in rows if f is not None]
    high = min(tables) if tables else 2
    out = []
    for node, shape in zip(cap.inputs, plan.input_shapes):
        full = (shape[0] * plan.microbatches, *shape[1:]) if shape else ()
        val = node.meta.get("val")
        if val is not None and val.is_floating_point():
            out.append(torch.randn(full, dtype=val.dtype, device=program.device))
        else:
            out.append(torch.randint(0, high, full, device=program.device))
    return out


def _held_bytes(pm, opt) -> int:
    """Bytes of the tensors the rank holds between steps: its parameters, their gradients, its
    optimizer state and buffers (each storage once)."""
    seen, total = set(), 0
    tensors = [*pm.parameters(), *(p.grad for p in pm.parameters() if p.grad is not None),
               *(v for state in getattr(opt, "state", {}).values() for v in state.values() if isinstance(v, torch.Tensor)),
               *pm.persistent_buffers().values()]
    for t in tensors:
        key = (t.untyped_storage().data_ptr(), t.device)
        if key not in seen and t.device.type != "meta":
            seen.add(key)
            total += t.untyped_storage().nbytes()
    return total
