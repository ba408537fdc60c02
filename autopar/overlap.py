"""Compute/communication overlap in the per-rank graphs, through Inductor's own reordering passes.

Every collective autopar inserts is a functional collective: an asynchronous launch and a separate
``wait_tensor``. Inductor keeps the two apart, so its scheduler may issue a launch early and sink its
wait below compute that does not need the result; in a tensor-parallel backward, for instance, the
all-reduce of a column-parallel linear's input gradient can run behind the weight-gradient matmul.
Inductor ships those passes switched off. This module switches them on for the graphs autopar
compiles, without touching ``parallelize``: its ``compile=`` argument takes a torch.compile backend,
and ``overlap_backend()`` is one::

    pm = autopar.parallelize(model, (1, 1, 2), (idx, tgt), compile=overlap_backend())

or, around whatever compiles (the first ``train_step``: torch.compile compiles on first call)::

    with overlap():
        pm.train_step(idx, tgt)

Modes (``mode=``), with the Inductor config names each sets. Every name is looked up in this torch's
own config key list (and each pass in ``torch._inductor.comms``) first, and a missing one is an
error naming it, so a torch without a knob fails loudly instead of silently not overlapping. The
names are read from torch 2.13's ``torch/_inductor/config.py`` and ``comms.py``; torch 2.11 (the
GPU machines) was not at hand to read, which is why every name is checked where it is used:

- ``"scheduler"`` (default): ``reorder_for_compute_comm_overlap=True`` with
  ``reorder_for_compute_comm_overlap_passes = ["sink_waits", "raise_comms",
  "reorder_compute_for_overlap"]``: launches move up, waits move down, and independent compute
  (the weight-gradient matmuls of a tensor-parallel backward) is scheduled between them. Runs on both
  of Inductor's backends (C++ on CPU, Triton on GPU). It may keep more buffers alive at once.
- ``"peak-memory"``: the same switch with the pass list torch 2.13's config recommends,
  ``reorder_communication_preserving_peak_memory``, ``sink_waits_iterative``,
  ``reorder_communication_preserving_peak_memory``: launches and waits move only as far as peak
  memory allows, and compute is not reordered among itself, so less is hidden.
- ``"fx"``: ``aten_distributed_optimizations.enable_overlap_scheduling=True``, the newer FX-level
  overlap scheduler (with ``collective_bucketing`` when ``bucket=True``). It estimates runtimes with
  Triton, so it is GPU only: on the CPU build it fails with ``No module named 'triton'``.

Measured on torch 2.13 CPU (gloo, tp=2, a one-block GPT): off, every wait follows its launch
directly; "peak-memory" puts small elementwise kernels in between; "scheduler" also moves four
weight-gradient matmuls behind the last all-reduce of the backward.

``bucket=True`` also sets those of ``bucket_all_reduces_fx``, ``bucket_reduce_scatters_fx`` and
``bucket_all_gathers_fx`` this torch has to ``"all"`` (at least one must exist; merge independent collectives into one launch). Tensor
parallelism's collectives mostly depend on each other in sequence, so bucketing helps little there
and can delay a launch; it is off by default.

ZeRO-2/3 (passes/zero.py) prefetch their forward all-gathers in the graph itself, one unit ahead;
with overlap off Inductor's peak-memory ordering keeps part of that lead (every gather was waited
right after its launch before). Every mode also sets ``joint_custom_pre_pass`` to
``regather_in_backward``: without it AOTAutograd computes ZeRO-3's backward re-gathers in the
forward and saves the gathered weights (ZeRO-2's memory). Measured on torch 2.13 CPU (gloo, dp=2,
zero=3, a two-block GPT): "peak-memory" launches every gather of the forward and every re-gather of
the backward at the start of its graph and leaves reduce-scatters of one unit in flight across the
next unit's matmuls (tests/runtime/test_zero_overlap.py); "scheduler" orders the collectives globally, each
launch after the wait of the one before, so in the backward no reduce-scatter outlives its unit.

``collective_gaps(code)`` reads Inductor's generated wrapper code (``run_and_get_code``) and lists,
for every collective, the compute issued between its launch and its wait: what overlap can hide.
``code_events(code)`` lists the launches, waits and compute calls in order with the names they
mention, for a reader that needs to know which unit a collective serves.
"""
from __future__ import annotations

import contextlib
import functools
import re
from dataclasses import dataclass

import torch
from torch._inductor.custom_graph_pass import CustomGraphPass, get_hash_for_files

_PASSES = {
    "scheduler": ("sink_waits", "raise_comms", "reorder_compute_for_overlap"),
    "peak-memory": ("reorder_communication_preserving_peak_memory", "sink_waits_iterative",
                    "reorder_communication_preserving_peak_memory"),
}
MODES = (*_PASSES, "fx")
_BUCKET_KNOBS = ("bucket_all_reduces_fx", "bucket_reduce_scatters_fx", "bucket_all_gathers_fx")


def _known() -> set[str]:
    import torch._inductor.config as config
    return set(config.get_config_copy())


def _scheduler_passes(mode: str) -> list[str]:
    import torch._inductor.comms as comms
    missing = [p for p in _PASSES[mode] if not hasattr(comms, p)]
    if missing:
        others = [m for m in MODES if m != mode]
        raise RuntimeError(f"torch {torch.__version__} has no Inductor overlap pass {', '.join(missing)}; "
                           f"use mode={others[0]!r} or {others[1]!r}")
    return list(_PASSES[mode])


def overlap_config(mode: str = "scheduler", bucket: bool = False) -> dict[str, object]:
    """The Inductor config patches that turn overlap on in this torch (see the module docstring)."""
    if mode not in MODES:
        raise ValueError(f"overlap mode={mode!r}: expected one of {', '.join(MODES)}")
    known = _known()
    if mode in _PASSES:
        if "reorder_for_compute_comm_overlap" not in known:
            raise RuntimeError(f"torch {torch.__version__} has no Inductor option "
                               "reorder_for_compute_comm_overlap; use mode='fx'")
        patches = {"reorder_for_compute_comm_overlap": True,
                   "reorder_for_compute_comm_overlap_passes": _scheduler_passes(mode)}
    else:
        key = "aten_distributed_optimizations.enable_overlap_scheduling"
        if key not in known:
            raise RuntimeError(f"torch {torch.__version__} has no Inductor option {key}; "
                               "use mode='scheduler'")
        patches = {key: True}
        if bucket and "aten_distributed_optimizations.collective_bucketing" in known:
            patches["aten_distributed_optimizations.collective_bucketing"] = True
    if "joint_custom_pre_pass" not in known:
        raise RuntimeError(f"torch {torch.__version__} has no Inductor option joint_custom_pre_pass, which keeps "
                           "ZeRO-3's backward re-gathers in the backward")
    patches["joint_custom_pre_pass"] = RegatherInBackward()
    if bucket:
        present = [k for k in _BUCKET_KNOBS if k in known]
        if not present:
            raise RuntimeError(f"torch {torch.__version__} has none of the Inductor options "
                               f"{', '.join(_BUCKET_KNOBS)}; use bucket=False")
        patches.update({k: "all" for k in present})
    return patches


@contextlib.contextmanager
def overlap(mode: str = "scheduler", bucket: bool = False):
    """Overlap on for every Inductor compilation inside the block (torch.compile compiles on first call)."""
    import torch._inductor.config as config
    with config.patch(overlap_config(mode, bucket)):
        yield


def overlap_backend(mode: str = "scheduler", bucket: bool = False):
    """A torch.compile backend: Inductor with overlap on, for ``parallelize(..., compile=...)``.

    The patches travel with the backend (Inductor applies them to the forward graph and to the
    backward graph, which it compiles later), so no context needs to stay open."""
    from torch._inductor.compile_fx import compile_fx
    return functools.partial(compile_fx, config_patches=overlap_config(mode, bucket))


# ---- ZeRO-3's re-gathers stay in the backward ------------------------------------------------

def _plumbing(node) -> bool:
    """Whether ``node`` only waits on, views or copies its input (no compute of its own)."""
    aten, prims = torch.ops.aten, torch.ops.prims
    return node.op == "call_function" and (
        node.target is torch.ops._c10d_functional.wait_tensor.default
        or getattr(node.target, "is_view", False)
        or node.target in (aten.clone.default, aten._to_copy.default, aten.alias.default, aten.detach.default,
                           prims.convert_element_type.default))


def _source(node):
    """The value a gather's operand is a view or copy of: a graph input (a weight's shard) or an op's
    output (an activation's sequence shard)."""
    while node.op == "call_function" and _plumbing(node):
        node = node.all_input_nodes[0]
    return node


def regather_in_backward(graph: torch.fx.Graph) -> None:
    """Joint-graph pass: every all-gather of a shard that the backward gathers again (a weight's,
    ZeRO-3's ``sharded_linear``; an activation's sequence shard, ``gathered_linear``) is recomputed
    in the backward instead of saved from the forward.

    AOTAutograd's partitioner never recomputes a collective by itself: a re-gather needs no
    gradient, so it would run in the forward graph, and its CSE merges it with the forward's
    gather of the same shard; the gathered weight then lives from the forward to the backward
    (ZeRO-2's memory, not 3's). Marking those gathers and their waits ``MUST_RECOMPUTE`` (as
    activation checkpointing's policies mark ops) keeps only the shard, and puts the re-gather in
    the backward graph, where the overlap passes can launch it early. Gathers of shards the
    backward does not re-gather (ZeRO-2, norms, biases, the input of a sequence-parallel linear
    that the plan keeps whole) are left to be kept."""
    from torch.utils.checkpoint import CheckpointPolicy

    gather = torch.ops._c10d_functional.all_gather_into_tensor.default
    needs_grad = set()
    for n in graph.nodes:
        if (n.op == "placeholder" and n.name.startswith("tangents")) or any(a in needs_grad for a in n.all_input_nodes):
            needs_grad.add(n)

    def downstream(node):
        """``node``'s waits, views and copies outside the backward, and whether a forward op uses them."""
        seen, stack, forward = [], [node], False
        while stack:
            n = stack.pop()
            seen.append(n)
            for u in n.users:
                if u in needs_grad or u.op == "output":
                    continue
                if _plumbing(u):
                    stack.append(u)
                else:
                    forward = True
        return seen, forward

    by_source: dict = {}
    for n in graph.nodes:
        source = _source(n.args[0]) if n.target is gather else None
        if source is not None and source not in needs_grad:   # not a gradient's (the backward's own gathers)
            by_source.setdefault(source, []).append((n, *downstream(n)))
    for gathers in by_source.values():
        if all(forward for _, _, forward in gathers):
            continue   # no re-gather of this shard: the weight is kept (ZeRO-2's, or one gathered once)
        for _, nodes, _ in gathers:
            for n in nodes:
                n.meta["recompute"] = CheckpointPolicy.MUST_RECOMPUTE


class RegatherInBackward(CustomGraphPass):
    """``regather_in_backward`` as Inductor's ``joint_custom_pre_pass`` takes it (hashed for its cache)."""

    def __call__(self, graph: torch.fx.Graph) -> None:
        regather_in_backward(graph)

    def uuid(self):
        return get_hash_for_files((__file__,))


# ---- reading the generated code --------------------------------------------------------------

@dataclass(frozen=True)
class CollectiveGap:
    """One collective in generated code: its op, the buffer it waits on, and the compute between."""

    op: str                        # e.g. "all_reduce_", "all_gather_into_tensor"
    buffer: str
    compute: tuple[str, ...]       # the compute calls issued after the launch and before the wait

    @property
    def overlapped(self) -> bool:
        return bool(self.compute)


@dataclass(frozen=True)
class CodeEvent:
    """One line of a generated wrapper that launches a collective, waits on one, or computes."""

    kind: str                      # "launch", "wait" or "compute"
    op: str                        # the collective ("all_gather_into_tensor") or the compute call
    names: tuple[str, ...]         # what it names: a launch's result first, then its inputs; a wait's buffer


_C10D = "torch.ops._c10d_functional."
_WAIT = re.compile(r"wait_tensor\.default\((?:reinterpret_tensor\()?(\w+)")
_LAUNCH = re.compile(r"(?:(\w+)\s*=\s*)?torch\.ops\._c10d_functional\.(\w+)\.\w+\((.*)")
# extern matmuls, C++ and Triton kernels, and aten fallbacks (attention) are compute
_COMPUTE = re.compile(r"(extern_kernels\.\w+|\bcpp_fused\w*|\btriton_\w+\.run|torch\.ops\.aten\.[\w.]+)\((.*)")
_STRING = re.compile(r"'[^']*'|\"[^\"]*\"")
_NAME = re.compile(r"\b(?!reinterpret_tensor\b|out\b|stream\d*\b|torch\b|None\b)[A-Za-z_]\w*\b(?!\s*=[^=])")


def _names(args: str) -> list[str]:
    return _NAME.findall(_STRING.sub("", args))


def code_events(code: str) -> list[CodeEvent]:
    """The collective launches, waits and compute calls of one Inductor wrapper (as
    ``run_and_get_code`` returns it), in the order it issues them, each with the names its
    arguments mention: buffers (``buf3``) and graph inputs (``primals_5``), not string literals
    or keywords. A reader tells a unit's ops apart by the inputs they trace back to."""
    events = []
    for line in code.splitlines():
        line = line.strip()
        if line.startswith("#"):
            continue
        if _C10D in line:
            wait = _WAIT.search(line)
            if wait:
                events.append(CodeEvent("wait", "wait_tensor", (wait.group(1),)))
                continue
            launch = _LAUNCH.search(line)
            if launch:
                names = [launch.group(1)] if launch.group(1) else []
                events.append(CodeEvent("launch", launch.group(2), tuple(names + _names(launch.group(3)))))
            continue
        call = _COMPUTE.search(line)
        if call:
            events.append(CodeEvent("compute", call.group(1), tuple(_names(call.group(2)))))
    return events


def collective_gaps(code: str) -> list[CollectiveGap]:
    """Every collective in one Inductor wrapper (as ``run_and_get_code`` returns it), in order.

    A launch is matched to the first later ``wait_tensor`` on a buffer it reads or writes."""
    open_: list[tuple[str, set[str], list[str]]] = []
    gaps = []
    for event in code_events(code):
        if event.kind == "wait":
            for i, (op, names, compute) in enumerate(open_):
                if event.names[0] in names:
                    gaps.append(CollectiveGap(op, event.names[0], tuple(compute)))
                    del open_[i]
                    break
        elif event.kind == "launch":
            open_.append((event.op, set(event.names), []))
        else:
            for _, _, compute in open_:
                compute.append(event.op)
    return gaps
