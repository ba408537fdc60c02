"""One rank of a plan run alone: ``run_rank`` builds its share of a model on this device, trains it
on random tokens in a world whose collectives move no data (``runtime.fake_group``), and measures
its step: seconds, the collectives by phase, the peak memory (``step_peak``, which a real run can
take too) and, on the CPU, what its ops took (``op_times``).

The model may be on the meta device: only the rank's shards are made, at their local shapes
(``runtime.parameters.materialize``), randomly initialised where the model has no
``init_parameter`` of its own, and a buffer on the meta device is made as zeros. The values do
not matter here: the rehearsal measures time and memory, not numerics, so the losses are
meaningless (collectives return what their buffers held).
"""
from __future__ import annotations

import contextlib
import dataclasses
import gc
import linecache
import math
import os
import statistics
import time

import torch

from autopar.rehearsal import OpTime, kernel_families
from autopar.runtime import step as runtime_step
from autopar.runtime.fake_group import Tally
from autopar.runtime.parallel_model import ParallelModel

# the group names a collective's axis is read from, in this order: a group several axes share is
# the first one's (an unsplit dp is dp, not dp_shard or data)
AXES = ("tp", "cp", "pp", "dp", "dp_shard", "dp_replicate", "data")


@dataclasses.dataclass(frozen=True)
class Measured:
    """A rank's step as ``run_rank`` measured it: median seconds of the forward and backward over
    the step's microbatches (``train_step``) and of the optimizer step, the peak bytes and what
    they are (``memory``), the bytes of the parameters made, the collectives issued per step,
    (kind, axis, phase) -> (count, bytes), what its forward and backward's ops took
    (``op_times`` on the CPU, ``cuda_op_times`` on a GPU) and the bytes held before a step
    (``step_peak``)."""

    compute_s: float
    update_s: float
    peak_bytes: float
    memory: str
    param_bytes: int
    collectives: dict
    steps: int
    ops: tuple = ()
    held_bytes: float = 0.0


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
    with _sync_in_step_phase(tally):
        for k in range(warmup + steps):
            if k == warmup:
                tally.clear()
                tally.on = True
            say(f"rank {program.rank}: {'warm-up' if k < warmup else 'timed'} step {k + 1} of {warmup + steps}")
            seconds = _timed_step(pm, opt, batch, tally, cuda)
            if k >= warmup:
                compute.append(seconds[0])
                update.append(seconds[1])
        tally.on = False
        say(f"rank {program.rank}: one more step, its memory measured")
        holders = [] if cuda else None
        peak, memory, held = step_peak(pm, opt, lambda: _timed_step(pm, opt, batch, tally, cuda), holders)
        for line in holders or ():
            say(f"rank {program.rank}: {line}")
        say(f"rank {program.rank}: one more step, its ops timed")
        try:
            ops = (cuda_op_times if cuda else op_times)(lambda: pm.train_step(*batch))
        except RuntimeError as err:   # the profiler's trace is a bonus: keep the step's figures without it
            say(f"rank {program.rank}: its ops could not be timed ({err}); the report has no op times")
            ops = ()
    names = {program.groups.of(a): a for a in reversed(AXES) if program.groups.of(a) is not None}
    per_step = {}
    for (kind, group, phase), calls in tally.calls.items():
        key = (kind, names.get(group, group), phase)
        count, nbytes = per_step.get(key, (0, 0))
        per_step[key] = (count + calls // steps, nbytes + tally.bytes[(kind, group, phase)] // steps)
    return Measured(statistics.median(compute), statistics.median(update), peak, memory, param_bytes,
                    per_step, steps, ops, held)


def _timed_step(pm, opt, batch, tally: Tally, cuda: bool) -> tuple[float, float]:
    """One training step: ``train_step`` and an AdamW step, their seconds (the update's collectives
    counted in the phase "step")."""
    _sync(cuda)
    t0 = time.perf_counter()
    pm.train_step(*batch)
    _sync(cuda)
    t1 = time.perf_counter()
    tally.phase = "step"
    opt.step()
    opt.zero_grad(set_to_none=True)
    tally.phase = "fwd"
    _sync(cuda)
    return t1 - t0, time.perf_counter() - t1


def _sync(cuda: bool) -> None:
    if cuda:
        torch.cuda.synchronize()


@contextlib.contextmanager
def _sync_in_step_phase(tally: Tally):
    """While in it, the gradient sync after a step's backward (``runtime.step.sync_gradients``,
    which ``ParallelModel.train_step`` calls) counts its collectives in the phase "step", as plans
    record ZeRO-0/1's: outside a backward, nothing else tells it from the forward."""
    original = runtime_step.sync_gradients

    def sync(*args, **kwargs):
        tally.phase = "step"
        try:
            return original(*args, **kwargs)
        finally:
            tally.phase = "fwd"
    runtime_step.sync_gradients = sync
    try:
        yield
    finally:
        runtime_step.sync_gradients = original


def step_peak(pm, opt, step, holders: list | None = None) -> tuple[float, str, float]:
    """The peak bytes of the device while ``step()`` (a training step of ``pm``, a ParallelModel,
    and ``opt``, its optimizer) runs, what they are, and the bytes held before it (what the rank
    keeps between steps: weights, optimizer state, buffers). On a GPU the allocator's peak and the
    bytes allocated before, and into ``holders`` (a list, if given) lines saying which source
    lines allocated what was alive at the peak (``peak_holders``); on the CPU
    the tensors held before the step (``held_bytes``) plus the highest the CPU allocator's bytes
    in use rose above them during it, activations and the backward's transients included
    (torch.profiler's memory events: every allocation and free, compiled code's too). A real run
    (gloo ranks) measured with this gives the figure its rehearsal gives."""
    device = next(iter(pm.parameters())).device
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
        held = torch.cuda.memory_allocated(device)
        with _memory_history(holders, held):
            step()
            torch.cuda.synchronize(device)
        return float(torch.cuda.max_memory_allocated(device)), "the allocator's peak", float(held)
    # the profiler counts the free of a block it saw allocated, in any earlier profile too: garbage of
    # earlier work collected during the step would lower the figure, so it is collected before, and
    # the collector waits meanwhile (a cycle freed mid-step would move the peak run to run)
    gc.collect()
    held = held_bytes(pm, opt)
    gc.disable()
    try:
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU], profile_memory=True) as prof:
            step()
    finally:
        gc.enable()
    deltas = sorted((e.start_ns(), e.nbytes()) for e in prof.profiler.kineto_results.events()
                    if e.name() == "[memory]" and e.device_type() == torch.autograd.DeviceType.CPU)
    rise = in_use = 0
    for _, nbytes in deltas:
        in_use += nbytes
        rise = max(rise, in_use)
    return float(held + rise), ("the tensors held before a step plus the most the CPU allocator's bytes in use "
                                "rose during it (activations and the backward's transients included)"), float(held)


@contextlib.contextmanager
def _memory_history(holders: list | None, held: float):
    """While in it, the CUDA allocator records every allocation with its Python stack; then
    ``holders`` gets ``peak_holders``' lines. Nothing where ``holders`` is None; a torch whose
    recorder fails leaves one line saying so (the peak itself is measured either way)."""
    if holders is None:
        yield
        return
    record = torch.cuda.memory._record_memory_history
    try:
        record(enabled="all", context="alloc", stacks="python", max_entries=2_000_000)
    except (RuntimeError, TypeError) as err:
        holders.append(f"no breakdown of the peak: the allocator's history could not be recorded ({err})")
        yield
        return
    try:
        yield
        try:
            holders.extend(peak_holders(torch.cuda.memory._snapshot(), held))
        except (RuntimeError, KeyError, TypeError) as err:   # the breakdown is a bonus: the peak stands without it
            holders.append(f"no breakdown of the peak: the allocator's history could not be read ({err!r})")
    finally:
        record(enabled=None)


def peak_holders(snapshot: dict, held: float, top: int = 10) -> list[str]:
    """What a step allocated and still held at its peak, by the source line that allocated it (the
    innermost frame outside torch's own files: the model's, autopar's or Inductor's generated code),
    the ``top`` that held most: lines for a report. ``snapshot``: ``torch.cuda.memory._snapshot()``
    of the step, recorded from its start; ``held``: the bytes allocated before it. The step's
    running total starts at ``held``: each "alloc" adds its size, each "free_requested" of a block
    takes it off (blocks allocated before the step too); the peak is where the total is highest."""
    events = [e for trace in snapshot.get("device_traces", ()) for e in trace
              if e.get("action") in ("alloc", "free_requested")]
    total, peak, at, since = held, held, -1, {}
    life = []   # [alloc index, free index or None, event]
    for i, e in enumerate(events):
        if e["action"] == "alloc":
            since[e["addr"]] = len(life)
            life.append([i, None, e])
            total += e["size"]
        else:
            k = since.pop(e["addr"], None)
            if k is not None:
                life[k][1] = i
            total -= e["size"]
        if total > peak:
            peak, at = total, i
    groups: dict[str, list] = {}
    for start, end, e in life:
        if start <= at and (end is None or end > at):
            where = _allocated_at(e.get("frames", ()))
            group = groups.setdefault(where, [0, 0])
            group[0] += e["size"]
            group[1] += 1
    alive = sum(g[0] for g in groups.values())
    lines = [f"at the step's peak ({peak / 2**30:.3f} GiB by its trace): {held / 2**30:.3f} GiB held before it, "
             f"{alive / 2**30:.3f} GiB allocated during it in {sum(g[1] for g in groups.values())} blocks, the most by:"]
    for where, (nbytes, count) in sorted(groups.items(), key=lambda kv: -kv[1][0])[:top]:
        lines.append(f"  {nbytes / 2**30:8.3f} GiB in {count:5d} blocks  {where}")
    return lines


def _allocated_at(frames) -> str:
    """The innermost frame outside torch's files, with its source line where it can be read."""
    for f in frames:
        name = f.get("filename", "")
        if "/torch/" not in name and not name.startswith("<"):
            text = linecache.getline(name, f.get("line", 0)).strip()
            return f"{os.path.basename(name)}:{f.get('line')} {f.get('name', '')}" + (f": {text[:90]}" if text else "")
    return "torch internals"


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


# the matmuls the profiler names, and where their (m, k) and (k, n) operands are among its inputs
MATMULS = {"aten::mm": (0, 1), "aten::addmm": (1, 2), "aten::bmm": (0, 1), "aten::baddbmm": (1, 2)}
DTYPES = {"float": "fp32", "c10::BFloat16": "bf16", "c10::Half": "fp16"}


def op_times(run) -> tuple[OpTime, ...]:
    """What the ops of ``run()`` (a forward and backward on the CPU) took, as torch.profiler timed
    each call: per matmul shape and dtype (``MATMULS``; a batched one's batch folded into m) its
    calls and mean seconds per call, then one "other" row: the calls of every other op run at the
    top level (an aten op inside no other, attention aside) and their mean seconds, the floor
    under a small op's time that the cost model calls launch overhead. Calls in the profiler's
    own start-up are not told apart: run it on a step already warm."""
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU], record_shapes=True) as prof:
        run()
    events = sorted((e for e in prof.profiler.kineto_results.events()
                     if e.device_type() == torch.autograd.DeviceType.CPU and e.name().startswith("aten::")),
                    key=lambda e: (e.start_thread_id(), e.start_ns(), -e.duration_ns()))
    matmuls: dict = {}
    tops: list[list] = []   # the top-level ops: [thread, end, name, seconds, whether a matmul runs in it]
    for e in events:
        thread, start = e.start_thread_id(), e.start_ns()
        top = tops[-1] if tops and tops[-1][0] == thread and start < tops[-1][1] else None
        matmul = e.name() in MATMULS and bool(e.dtypes()) and e.dtypes()[0] in DTYPES
        if matmul:
            a, b = (e.shapes()[i] for i in MATMULS[e.name()])
            key = (DTYPES[e.dtypes()[0]], math.prod(a[:-1]), b[-1], a[-1])
            calls, seconds = matmuls.get(key, (0, 0.0))
            matmuls[key] = (calls + 1, seconds + e.duration_ns() / 1e9)
        if top is None:
            tops.append([thread, start + e.duration_ns(), e.name(), e.duration_ns() / 1e9, matmul])
        elif matmul:
            top[4] = True
    other = [seconds for _, _, name, seconds, matmul in tops if not matmul and "attention" not in name]
    out = [OpTime("matmul", dtype, (m, n, k), calls, seconds / calls)
           for (dtype, m, n, k), (calls, seconds) in sorted(matmuls.items())]
    if other:
        out.append(OpTime("other", "", (), len(other), math.fsum(other) / len(other)))
    return tuple(out)


def cuda_op_times(run) -> tuple[OpTime, ...]:
    """What the matmuls and fused attention of ``run()`` (a forward and backward on a GPU) took on
    the device, as torch.profiler's CUDA activity timed the kernels each launched: per matmul
    shape and dtype (``MATMULS``) its calls and mean kernel seconds per call; per attention shape
    (batch, heads, sequence, head_dim of the queries) and dtype one "attention" row, its calls
    the forwards and its seconds per call a forward's kernels plus its backward's (as
    ``AttentionSample`` measures fused attention); then one "kernels" row per kernel family
    (``autopar.rehearsal.KERNEL_FAMILIES``: matmul, attention, Triton reduction and pointwise,
    other, ...), its dtype the family's name and its seconds the GPU time of all its kernels in the
    run. No "other" row: Inductor's own kernels are no aten ops, and the time a small op takes on
    a GPU is its launch, which the profile measures."""
    activities = [torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]
    with torch.profiler.profile(activities=activities, record_shapes=True) as prof:
        run()
        torch.cuda.synchronize()
    dtypes = {e.correlation_id(): e.dtypes() for e in prof.profiler.kineto_results.events()
              if e.device_type() == torch.autograd.DeviceType.CPU}
    matmuls, attention = {}, {}
    for e in prof.events():
        if e.device_type != torch.autograd.DeviceType.CPU or not e.input_shapes:
            continue
        kinds = dtypes.get(e.id) or []
        seconds = e.device_time_total / 1e6
        if e.name in MATMULS and kinds and kinds[0] in DTYPES:
            a, b = (e.input_shapes[i] for i in MATMULS[e.name])
            key = (DTYPES[kinds[0]], math.prod(a[:-1]), b[-1], a[-1])
            calls, total = matmuls.get(key, (0, 0.0))
            matmuls[key] = (calls + 1, total + seconds)
        elif _is_attention(e):
            shape, dtype = next(((tuple(s), DTYPES.get(d)) for s, d in zip(e.input_shapes, kinds) if len(s) == 4),
                                (None, None))
            if shape is None or dtype is None:
                continue
            calls, total = attention.get((dtype, shape), (0, 0.0))
            attention[(dtype, shape)] = (calls + ("backward" not in e.name), total + seconds)
    out = [OpTime("matmul", dtype, (m, n, k), calls, total / calls)
           for (dtype, m, n, k), (calls, total) in sorted(matmuls.items())]
    out += [OpTime("attention", dtype, shape, calls, total / calls)
            for (dtype, shape), (calls, total) in sorted(attention.items()) if calls]
    out += [OpTime("kernels", family, (), 1, seconds)
            for family, seconds in kernel_families(prof)["families"].items() if seconds > 0]
    return tuple(out)


def _is_attention(event) -> bool:
    """Whether ``event`` is a fused attention op (forward or backward) run inside no other one."""
    def attention(e):
        return e is not None and ("scaled_dot_product" in e.name or "efficient_attention" in e.name)
    return attention(event) and not attention(event.cpu_parent)


def held_bytes(pm, opt) -> int:
    """Bytes of the tensors a rank holds between steps: its parameters (``pm``, a ParallelModel),
    their gradients, its optimizer state (``opt``, or the torch optimizer it wraps: ZeRO-1's and the
    distributed optimizer's step a flat slice), the flat slice and the fp32 gradient buffer of
    ``pm.zero``, and its buffers (each storage once)."""
    while not hasattr(opt, "state") and hasattr(opt, "inner"):
        opt = opt.inner
    zero = pm.zero
    flat = [] if zero is None else [t for t in (zero.shard, zero.shard.grad, zero.main) if t is not None]
    seen, total = set(), 0
    tensors = [*pm.parameters(), *(p.grad for p in pm.parameters() if p.grad is not None), *flat,
               *(v for state in getattr(opt, "state", {}).values() for v in state.values() if isinstance(v, torch.Tensor)),
               *pm.persistent_buffers().values()]
    for t in tensors:
        key = (t.untyped_storage().data_ptr(), t.device)
        if key not in seen and t.device.type != "meta":
            seen.add(key)
            total += t.untyped_storage().nbytes()
    return total
