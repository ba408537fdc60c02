"""What a rehearsed rank measured, beside what its plan predicted: the records a Plan carries.

``autopar.rehearse`` runs one rank of a plan alone on the local device, its collectives moving no
data (``autopar.runtime.fake_group``), and records here its compute and update seconds, its peak
memory and the collectives it issued, each beside the plan's figure for that rank, and the step
time that results: the rehearsed compute and update plus the communication and pipeline bubble
the plan priced (``cost_model.terms.step_time``, the one step sum). Plain frozen data, so
``autopar.plans`` stores it and its JSON round trip reads it back, and the families GPU kernels
are counted in (``kernel_families``), shared by the runtime's rehearsal and the cost model's
calibration; this module imports nothing of autopar's. ``autopar.rehearsing`` makes it.
"""
from __future__ import annotations

import re
from dataclasses import dataclass

GIB = 2**30
# the plan's memory terms a rehearsal shows beside the bytes measured (``MemoryPlan``'s fields)
MEMORY_TERMS = ("params", "grads", "optimizer", "activations", "transient")
# Kernel families by name, first match wins: cuBLAS/CUTLASS matmuls, fused attention (FlashAttention,
# cuDNN, memory-efficient), the fused optimizer, Inductor's Triton kernels by kind, NCCL; "other"
# is every other kernel (eager elementwise, copies, embedding backward).
KERNEL_FAMILIES = [("matmul", r"gemm|nvjet|cutlass|xmma|cublas"), ("attention", r"flash|fmha|sdpa|attention"),
                   ("optimizer", r"multi_tensor|adam"), ("triton reduction", r"^triton_(red|per)_"),
                   ("triton pointwise", r"^triton_"), ("nccl", r"nccl"), ("other", r"")]
# the kernel families whose time is memory traffic
MEMORY_BOUND_FAMILIES = ("triton reduction", "triton pointwise", "other")


@dataclass(frozen=True)
class CollectiveCount:
    """The collectives of one ``kind`` on one mesh ``axis`` in one ``phase`` a rank issued per step
    (``count`` calls moving ``bytes``, full tensor sizes as plans count them) and what its plan
    records for them (``planned_count`` and ``planned_bytes``; 0 where the plan records none).

    ``phase`` as plans name it: "bwd" inside autograd's backward, "step" in the gradient sync after
    it and the update, "fwd" elsewhere ("" in files older than phases). Compare bytes, not counts:
    a plan records ZeRO's gathers and reduce-scatters as one collective per phase and microbatch
    (all the parameters' bytes), while the program issues one per parameter (``agrees``)."""

    kind: str
    axis: str
    count: int
    bytes: int
    planned_count: int
    planned_bytes: int
    phase: str = ""

    @property
    def agrees(self) -> bool:
        """Whether the rank issued the bytes its plan records (counts may differ: see the class)."""
        return self.bytes == self.planned_bytes


@dataclass(frozen=True)
class OpTime:
    """What one kind of op took on the rehearsed rank in one forward and backward: ``calls`` of it,
    ``seconds`` per call (the mean). ``op`` "matmul": ``dims`` (m, n, k) of a matmul of ``dtype``
    ("fp32", "bf16", "fp16"; a batched one's batch folded into m); "attention" (a GPU rank's): a
    fused attention's forward plus backward, ``dims`` the queries' (batch, heads, seq, head_dim),
    ``calls`` its forwards; "other" (a CPU rank's): every other op run at the top level but
    attention (``dims`` ()), its mean the floor under a small op's time; "kernels" (a GPU rank's):
    ``dtype`` a kernel family (``KERNEL_FAMILIES``), ``seconds`` the GPU time of
    all its kernels in the forward and backward.
    ``cost_model.calibrate.with_rehearsals`` takes them into a device profile."""

    op: str
    dtype: str
    dims: tuple[int, ...]
    calls: int
    seconds: float


@dataclass(frozen=True)
class Rehearsal:
    """One rank of a plan, rehearsed: seconds per step, peak bytes and collectives, measured and
    predicted.

    ``compute_s``: forward and backward over the step's microbatches with communication free (with
    pipeline stages, this rank's stages run their schedule without waiting); ``update_s``: the
    optimizer step; ``peak_bytes``: ``memory`` says what was measured (the allocator's peak on a
    GPU); ``comm_s`` and ``bubble_s``: the communication nothing overlaps and the pipeline's fill
    and drain, as the plan priced them; ``step_s``: the step those make (``cost_model.terms.step_time``);
    ``param_bytes``: the bytes of the parameters materialised on the device, against the plan's
    for the rank. ``device``: what ran it; ``priced_on``: the device the plan was priced for.
    ``ops``: what its ops took (``OpTime``; () in older files). ``memory_bound_bytes``: the bytes
    the cost model counts for the rank's ops without FLOPs in a step's forward and backward (what
    its memory-bound kernels move, priced at the profile's ``op_bandwidth``; 0 in older files).
    ``held_bytes``: what the rank held before the measured step (weights, optimizer state,
    buffers; the GPU allocator's bytes in use); ``predicted_terms``: the plan's memory terms for
    the rank (``MEMORY_TERMS``: its stages' sums, the backward's transient their largest)."""

    rank: int
    coords: str
    why: str
    device: str
    priced_on: str
    steps: int
    compute_s: float
    predicted_compute_s: float
    update_s: float
    predicted_update_s: float
    peak_bytes: float
    predicted_peak_bytes: float
    memory: str
    param_bytes: int
    planned_param_bytes: int
    comm_s: float
    bubble_s: float
    step_s: float
    predicted_step_s: float
    collectives: tuple[CollectiveCount, ...] = ()
    ops: tuple[OpTime, ...] = ()
    memory_bound_bytes: float = 0.0
    held_bytes: float = 0.0
    predicted_terms: tuple[float, ...] = ()

    @property
    def compute_ratio(self) -> float:
        """Rehearsed over predicted compute (0 where nothing was predicted)."""
        return self.compute_s / self.predicted_compute_s if self.predicted_compute_s else 0.0

    @property
    def memory_ratio(self) -> float:
        """Measured over predicted peak bytes (0 where nothing was predicted)."""
        return self.peak_bytes / self.predicted_peak_bytes if self.predicted_peak_bytes else 0.0

    def lines(self) -> list[str]:
        """The rehearsal as a plan summary's lines."""
        out = [f"Rehearsed rank {self.rank} ({self.coords}; {self.why}) on {self.device}, {self.steps} timed steps"
               + ("" if self.device == self.priced_on else f" (the plan was priced for {self.priced_on})") + ":",
               f"  compute {_ms(self.compute_s)} (predicted {_ms(self.predicted_compute_s)}, "
               f"x{self.compute_ratio:.2f}), update {_ms(self.update_s)} (predicted {_ms(self.predicted_update_s)})",
               f"  peak memory {self.peak_bytes / GIB:.4f} GiB, {self.memory} (predicted "
               f"{self.predicted_peak_bytes / GIB:.4f} GiB, x{self.memory_ratio:.2f}); parameters materialised "
               f"{self.param_bytes / GIB:.4f} GiB (plan {self.planned_param_bytes / GIB:.4f})",
               f"  priced communication {_ms(self.comm_s)} and pipeline bubble {_ms(self.bubble_s)} exposed: step "
               f"{_ms(self.step_s)} (predicted {_ms(self.predicted_step_s)})"]
        if self.predicted_terms:
            out.append(f"  held before the step {self.held_bytes / GIB:.4f} GiB, the step's rise above it "
                       f"{(self.peak_bytes - self.held_bytes) / GIB:.4f} GiB; the plan's terms: " + ", ".join(
                           f"{name} {v / GIB:.4f}" for name, v in zip(MEMORY_TERMS, self.predicted_terms)) + " GiB")
        kernels = {op.dtype: op.seconds for op in self.ops if op.op == "kernels"}
        if kernels:
            busy = sum(kernels.values())
            memory = sum(kernels.get(f, 0.0) for f in MEMORY_BOUND_FAMILIES)
            rate = (f" ({self.memory_bound_bytes / memory / 1e9:.0f} GB/s of the {self.memory_bound_bytes / 1e9:.1f} GB "
                    f"the cost model counts)" if memory and self.memory_bound_bytes else "")
            out.append("  GPU kernels per step (one profiled step): " + ", ".join(
                f"{family} {_ms(seconds)}" for family, seconds in sorted(kernels.items(), key=lambda kv: -kv[1]))
                + f"; memory-bound {_ms(memory)}{rate}; the timed compute less all kernels "
                f"{_ms(max(0.0, self.compute_s - busy))} (the GPU idle)")
        if self.collectives:
            out.append("  collectives per step, issued vs plan (count, MiB; the bytes agree or not: a plan counts "
                       "ZeRO's one per phase, the program one per parameter):")
            for c in self.collectives:
                out.append(f"    {c.kind:15s} {c.axis:12s} {c.phase or '-':4s} x{c.count:<5d} {c.bytes / 2**20:10.4f}   "
                           f"plan x{c.planned_count:<5d} {c.planned_bytes / 2**20:10.4f}   "
                           f"{'agree' if c.agrees else f'differ by {c.bytes - c.planned_bytes:+,d} B'}")
        return out


def _ms(seconds: float) -> str:
    return f"{seconds * 1e3:.3f} ms"


def kernel_families(prof, steps: int = 1) -> dict:
    """From a finished torch.profiler ``prof`` with CUDA activity over ``steps`` calls: GPU kernel
    seconds per call by family (``families``, ``KERNEL_FAMILIES``), their sum (``kernels_s``) and the
    15 costliest kernels (``top``)."""
    families = {name: 0.0 for name, _ in KERNEL_FAMILIES}
    kernels: dict[str, float] = {}
    for e in prof.key_averages():
        t = getattr(e, "self_device_time_total", None) or getattr(e, "self_cuda_time_total", 0.0)
        if not t or str(getattr(e, "device_type", "")).endswith("CPU"):
            continue
        family = next(name for name, pat in KERNEL_FAMILIES if re.search(pat, e.key, re.I))
        families[family] += t / 1e6 / steps
        kernels[e.key] = kernels.get(e.key, 0.0) + t / 1e6 / steps
    return dict(families=families, kernels_s=sum(families.values()),
                top=sorted(kernels.items(), key=lambda kv: -kv[1])[:15])
