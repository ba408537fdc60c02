"""Device and network specs the cost model prices against.

A ``DeviceSpec`` is plain, frozen data: peak dense FLOP/s per dtype, HBM bandwidth and size,
and the alpha-beta parameters of the two network tiers (NVLink inside a node, InfiniBand
between nodes). Presets live in ``DEVICES``; a measured profile (``python -m autopar
calibrate``) is a JSON file that ``get_device`` loads the same way.

A profile may carry what was measured, and the cost model then prices with it:

- ``matmul_table``: matmuls (m x k) @ (k x n) per dtype and the FLOP/s each reached. The
  cost model reads it as achieved FLOP/s against a matmul's FLOPs (2mnk), interpolated
  linearly in log(FLOPs) and clamped at the smallest and largest measured sizes
  (``matmul_curve``); a dtype with no samples falls back to ``peak * matmul_efficiency``.
- ``attention_table``: fused attention (``scaled_dot_product_attention``, forward plus backward)
  per dtype, causal or not, with the backend torch picks, and the FLOP/s it reached, counting FLOPs as ``torch.utils.flop_counter`` does (all s^2 scores, also
  when causal). Read like the matmul table (``attention_curve``); without samples attention is
  priced as a matmul.
- ``launch_overhead``: the shortest time any kernel takes, a floor under every op's time.
- ``fused_bandwidth``: bytes/s that Inductor's generated memory-bound kernels reach, counting
  bytes as the cost model does (``cost_model.strategy.op_traffic``); the HBM copy bandwidth when 0.
- ``optimizer_bandwidth``: bytes/s of the fused AdamW update (7 fp32 reads and writes per
  parameter, ``cost_model.compute.update_time``); the HBM copy bandwidth when 0.
- ``host_bandwidth``: bytes/s of a copy between pinned host memory and the device, each way
  (what optimizer offload moves gradients out and weights back in at); 0 when unknown.
- ``host_adam_rate``: fp32 parameters per second the host's CPU AdamW updates (fused where
  torch has it on the CPU, else foreach), for optimizer offload; 0 when unknown.
- ``host_memory_bytes``: host memory one device's rank may fill with offloaded optimizer state
  (the node's memory over its GPUs); 0 when unknown: then this machine's (``host_memory``).
- ``collective_fits``: alpha-beta fits per collective kind and network tier, used instead of
  the tier's ``*_node_bw`` / ``*_node_latency`` for that kind (``collective_params``).

A profile file may also hold a ``"calibration"`` object: the raw measurements and how they
were taken, for people to read. It is checked to be an object and otherwise not used.
"""
from __future__ import annotations

import json
import math
import os
from dataclasses import asdict, dataclass, fields
from typing import Any, Mapping

import torch

# The dtype keys a profile may carry. "tf32" is only ever asked for by name: torch.float32 maps
# to "fp32" because a GPU runs fp32 matmuls on tensor cores only when the user enables TF32.
FLOP_KEYS = ("fp64", "fp32", "tf32", "bf16", "fp16", "fp8")

_DTYPE_KEYS: dict[Any, str] = {
    torch.float64: "fp64",
    torch.float32: "fp32",
    torch.bfloat16: "bf16",
    torch.float16: "fp16",
}
for _name in ("float8_e4m3fn", "float8_e5m2", "float8_e4m3fnuz", "float8_e5m2fnuz"):
    if hasattr(torch, _name):
        _DTYPE_KEYS[getattr(torch, _name)] = "fp8"

_STR_ALIASES = {
    "float64": "fp64", "double": "fp64",
    "float32": "fp32", "float": "fp32",
    "bfloat16": "bf16",
    "float16": "fp16", "half": "fp16",
    "float8": "fp8",
}

GiB = 2**30

TIERS = ("intra", "inter")
# the collectives a profile may fit (``cost_model.comm`` prices them)
COLLECTIVES = ("all_reduce", "all_gather", "reduce_scatter", "all_to_all")


@dataclass(frozen=True)
class MatmulSample:
    """One measured matmul: (m x k) @ (k x n) in ``dtype`` ran at ``flops_per_s`` = 2mnk / seconds."""

    dtype: str
    m: int
    n: int
    k: int
    flops_per_s: float

    @property
    def flops(self) -> int:
        """FLOPs of the matmul: 2mnk."""
        return 2 * self.m * self.n * self.k


@dataclass(frozen=True)
class AttentionSample:
    """One measured attention forward + backward: (batch, heads, seq, head_dim) queries, keys and
    values in ``dtype``, ``causal`` 1 or 0, at ``flops_per_s`` = its counted FLOPs / seconds."""

    dtype: str
    batch: int
    heads: int
    seq: int
    head_dim: int
    causal: int
    flops_per_s: float

    @property
    def flops(self) -> int:
        """Forward plus backward FLOPs as ``torch.utils.flop_counter`` counts them."""
        from torch.utils.flop_counter import sdpa_backward_flop_count, sdpa_flop_count
        q = (self.batch, self.heads, self.seq, self.head_dim)
        return int(sdpa_flop_count(q, q, q) + sdpa_backward_flop_count(q, q, q, q))


@dataclass(frozen=True)
class CollectiveFit:
    """A fitted collective: on network ``tier`` ("intra" or "inter" node), ``kind`` takes
    ring_bytes / ``bandwidth`` + ring_steps * ``latency`` seconds (see ``cost_model.comm``)."""

    tier: str
    kind: str
    latency: float
    bandwidth: float


@dataclass(frozen=True)
class DeviceSpec:
    """One accelerator (or CPU) and the links around it, in SI units (FLOP/s, bytes/s, s).

    ``peak_flops`` holds dense (non-sparse) peaks keyed by "fp32", "tf32", "bf16", "fp16",
    "fp8" (those the device has). ``intra_node_bw`` is the per-GPU, per-direction bus
    bandwidth of the intra-node fabric; ``inter_node_bw`` the per-GPU network bandwidth
    between nodes. ``matmul_efficiency`` is the fraction of peak a large matmul reaches.
    ``launch_overhead``, ``matmul_table``, ``attention_table`` and ``collective_fits`` hold measurements (see the
    module docstring); the presets have none.
    """

    name: str
    peak_flops: dict[str, float]
    mem_bandwidth: float
    memory_bytes: int
    intra_node_bw: float
    inter_node_bw: float
    intra_node_latency: float
    inter_node_latency: float
    matmul_efficiency: float
    gpus_per_node: int = 8
    launch_overhead: float = 0.0
    fused_bandwidth: float = 0.0
    optimizer_bandwidth: float = 0.0
    host_bandwidth: float = 0.0
    host_adam_rate: float = 0.0
    host_memory_bytes: int = 0
    matmul_table: tuple[MatmulSample, ...] = ()
    attention_table: tuple[AttentionSample, ...] = ()
    collective_fits: tuple[CollectiveFit, ...] = ()

    def __post_init__(self) -> None:
        # A defensive copy: the spec is frozen, so a caller's dict must not be able to change it.
        object.__setattr__(self, "peak_flops", {str(k): float(v) for k, v in self.peak_flops.items()})
        object.__setattr__(self, "matmul_table", tuple(self.matmul_table))
        object.__setattr__(self, "attention_table", tuple(self.attention_table))
        object.__setattr__(self, "collective_fits", tuple(self.collective_fits))
        _validate(self)
        # Derived once: the planner prices thousands of ops against the same spec.
        object.__setattr__(self, "_curves", _curves((s.dtype, s.flops, s.flops_per_s) for s in self.matmul_table))
        object.__setattr__(self, "_attention_curves",
                           _curves(((s.dtype, bool(s.causal)), s.flops, s.flops_per_s) for s in self.attention_table))
        object.__setattr__(self, "_fits", {(f.tier, f.kind): (f.latency, f.bandwidth)
                                           for f in self.collective_fits})

    def __hash__(self) -> int:
        # The generated hash would fail on the dict field; specs are used as cache keys.
        return hash(tuple((f.name, _freeze(getattr(self, f.name))) for f in fields(self)))

    def flops(self, dtype: torch.dtype | str) -> float:
        """Peak dense FLOP/s for ``dtype`` (a torch.dtype or a key such as "bf16", "tf32").

        torch.float32 means plain fp32, not tf32: ask for "tf32" explicitly when
        ``torch.backends.cuda.matmul.allow_tf32`` is on."""
        key = dtype_key(dtype)
        if key not in self.peak_flops:
            raise ValueError(
                f"device {self.name!r} has no peak FLOP/s for {key!r} (from {dtype!r}); "
                f"it has: {', '.join(sorted(self.peak_flops))}")
        return self.peak_flops[key]

    def matmul_curve(self, dtype: torch.dtype | str) -> tuple[tuple[float, ...], tuple[float, ...]] | None:
        """Measured (FLOPs, achieved FLOP/s) points for ``dtype``, FLOPs increasing, or None if
        the profile has no matmul samples of that dtype. Samples of equal FLOPs are averaged."""
        return self._curves.get(dtype_key(dtype))

    @property
    def op_bandwidth(self) -> float:
        """Bytes/s the cost model prices an op's memory traffic at: ``fused_bandwidth`` if measured."""
        return self.fused_bandwidth or self.mem_bandwidth

    def attention_curve(self, dtype: torch.dtype | str, causal: bool):
        """Measured (FLOPs, achieved FLOP/s) points of fused attention (forward + backward) for
        ``dtype`` and ``causal``, FLOPs increasing, or None without such samples."""
        return self._attention_curves.get((dtype_key(dtype), bool(causal)))

    def collective_params(self, kind: str, inter_node: bool) -> tuple[float, float]:
        """(latency, bandwidth) for collective ``kind`` on one network tier: the fitted pair
        when the profile has one, else the tier's ``*_node_latency`` and ``*_node_bw``."""
        tier = "inter" if inter_node else "intra"
        if (tier, kind) in self._fits:
            return self._fits[(tier, kind)]
        if inter_node:
            return self.inter_node_latency, self.inter_node_bw
        return self.intra_node_latency, self.intra_node_bw

    def to_dict(self) -> dict[str, Any]:
        """The spec as a plain JSON-able dict (field name -> value)."""
        out: dict[str, Any] = {}
        for f in fields(self):
            v = getattr(self, f.name)
            if f.name == "peak_flops":
                v = dict(v)
            elif f.name in ("matmul_table", "attention_table", "collective_fits"):
                v = [asdict(x) for x in v]
            out[f.name] = v
        return out

    def to_json(self, path: str | os.PathLike | None = None) -> str:
        """Serialise to a JSON string; also write it to ``path`` when one is given."""
        text = json.dumps(self.to_dict(), indent=2, sort_keys=False)
        if path is not None:
            with open(path, "w") as fh:
                fh.write(text + "\n")
        return text

    @classmethod
    def from_json(cls, path_or_str: str | os.PathLike | Mapping[str, Any]) -> "DeviceSpec":
        """Load a spec from a JSON string, a path to a JSON file, or an already-parsed dict.

        Raises ValueError naming the first missing, unknown or ill-typed field."""
        if isinstance(path_or_str, Mapping):
            data = dict(path_or_str)
            where = "device profile"
        else:
            text = str(path_or_str)
            if text.lstrip().startswith("{"):
                where = "device profile JSON"
            elif os.path.isfile(text):
                where = f"device profile {text!r}"
                with open(text) as fh:
                    text = fh.read()
            else:
                raise ValueError(f"{path_or_str!r} is neither a JSON object nor an existing file")
            try:
                data = json.loads(text)
            except json.JSONDecodeError as e:
                raise ValueError(f"{where} is not valid JSON: {e}") from None
        if not isinstance(data, dict):
            raise ValueError(f"{where} must be a JSON object, got {type(data).__name__}")
        data = dict(data)
        record = data.pop("calibration", {})
        if not isinstance(record, dict):
            raise ValueError(f"{where}: field 'calibration' must be an object (the raw measurements), "
                             f"got {type(record).__name__}")
        return cls(**_parse_fields(data, where))


def dtype_key(dtype: torch.dtype | str) -> str:
    """Map a torch.dtype or a dtype name to a ``peak_flops`` key ("fp32", "bf16", ...)."""
    if isinstance(dtype, torch.dtype):
        if dtype not in _DTYPE_KEYS:
            raise ValueError(f"no FLOP/s class for dtype {dtype}; known: "
                             f"{', '.join(str(d) for d in _DTYPE_KEYS)}")
        return _DTYPE_KEYS[dtype]
    if isinstance(dtype, str):
        s = dtype.lower().removeprefix("torch.")
        if s in FLOP_KEYS:
            return s
        if s in _STR_ALIASES:
            return _STR_ALIASES[s]
        if s.startswith("float8"):
            return "fp8"
        raise ValueError(f"unknown dtype name {dtype!r}; use one of {', '.join(FLOP_KEYS)}")
    raise TypeError(f"dtype must be a torch.dtype or a str, got {type(dtype).__name__}")


def _freeze(v: Any) -> Any:
    return tuple(sorted(v.items())) if isinstance(v, dict) else v


_FLOAT_FIELDS = ("mem_bandwidth", "intra_node_bw", "inter_node_bw", "intra_node_latency",
                 "inter_node_latency", "matmul_efficiency", "launch_overhead", "fused_bandwidth",
                 "optimizer_bandwidth", "host_bandwidth", "host_adam_rate")
_OPTIONAL = ("gpus_per_node", "launch_overhead", "fused_bandwidth", "optimizer_bandwidth", "host_bandwidth",
             "host_adam_rate", "host_memory_bytes", "matmul_table",
             "attention_table", "collective_fits")
_INT_FIELDS = ("memory_bytes", "gpus_per_node", "host_memory_bytes")


def _is_num(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)


def _parse_fields(data: dict[str, Any], where: str) -> dict[str, Any]:
    known = {f.name for f in fields(DeviceSpec)}
    unknown = sorted(set(data) - known)
    if unknown:
        raise ValueError(f"{where}: unknown field(s) {', '.join(unknown)}; "
                         f"fields are: {', '.join(f.name for f in fields(DeviceSpec))}")
    for f in fields(DeviceSpec):
        if f.name not in data and f.name not in _OPTIONAL:
            raise ValueError(f"{where}: missing field {f.name!r}")
    out = dict(data)
    if not isinstance(out["name"], str):
        raise ValueError(f"{where}: field 'name' must be a string, got {out['name']!r}")
    pf = out["peak_flops"]
    if not isinstance(pf, dict):
        raise ValueError(f"{where}: field 'peak_flops' must be an object like "
                         f'{{"bf16": 9.89e14}}, got {pf!r}')
    for k in _FLOAT_FIELDS:
        if k not in out:
            continue
        if not _is_num(out[k]):
            raise ValueError(f"{where}: field {k!r} must be a number, got {out[k]!r}")
        out[k] = float(out[k])
    for k in _INT_FIELDS:
        if k not in out:
            continue
        v = out[k]
        # JSON writers often emit 1.41e11; accept any integral number.
        if not _is_num(v) or float(v) != int(v):
            raise ValueError(f"{where}: field {k!r} must be an integer, got {v!r}")
        out[k] = int(v)
    if "matmul_table" in out:
        out["matmul_table"] = _parse_records(out["matmul_table"], MatmulSample, "matmul_table", where)
    if "attention_table" in out:
        out["attention_table"] = _parse_records(out["attention_table"], AttentionSample, "attention_table", where)
    if "collective_fits" in out:
        out["collective_fits"] = _parse_records(out["collective_fits"], CollectiveFit, "collective_fits", where)
    return out


def _parse_records(value: Any, cls: type, name: str, where: str) -> tuple:
    """A JSON list of objects -> a tuple of ``cls``, naming the entry and key that is wrong."""
    if not isinstance(value, list):
        raise ValueError(f"{where}: field {name!r} must be a list of objects, got {value!r}")
    keys = [f.name for f in fields(cls)]
    out = []
    for i, item in enumerate(value):
        at = f"{where}: field {name!r} [{i}]"
        if not isinstance(item, dict):
            raise ValueError(f"{at} must be an object with keys {', '.join(keys)}, got {item!r}")
        wrong = sorted(set(item) ^ set(keys))
        if wrong:
            raise ValueError(f"{at}: missing or unknown key(s) {', '.join(wrong)}; keys are: {', '.join(keys)}")
        kw = {}
        for f in fields(cls):
            v = item[f.name]
            if f.type == "str":
                if not isinstance(v, str):
                    raise ValueError(f"{at}.{f.name} must be a string, got {v!r}")
            elif f.type == "int":
                if not _is_num(v) or float(v) != int(v):
                    raise ValueError(f"{at}.{f.name} must be an integer, got {v!r}")
                v = int(v)
            elif not _is_num(v):
                raise ValueError(f"{at}.{f.name} must be a number, got {v!r}")
            kw[f.name] = v if f.type in ("str", "int") else float(v)
        out.append(cls(**kw))
    return tuple(out)


def _validate(spec: DeviceSpec) -> None:
    if not spec.peak_flops:
        raise ValueError(f"device {spec.name!r}: field 'peak_flops' is empty")
    for k, v in spec.peak_flops.items():
        if k not in FLOP_KEYS:
            raise ValueError(f"device {spec.name!r}: field 'peak_flops' has unknown key {k!r}; "
                             f"keys are: {', '.join(FLOP_KEYS)}")
        if not (v > 0 and math.isfinite(v)):
            raise ValueError(f"device {spec.name!r}: field 'peak_flops' [{k!r}] must be > 0, got {v!r}")
    for k in _FLOAT_FIELDS[:3] + ("memory_bytes", "gpus_per_node"):
        v = getattr(spec, k)
        if not (_is_num(v) and v > 0):
            raise ValueError(f"device {spec.name!r}: field {k!r} must be > 0, got {v!r}")
    for k in ("intra_node_latency", "inter_node_latency"):
        v = getattr(spec, k)
        if not (_is_num(v) and v >= 0):
            raise ValueError(f"device {spec.name!r}: field {k!r} must be >= 0, got {v!r}")
    if not (_is_num(spec.host_memory_bytes) and spec.host_memory_bytes >= 0):
        raise ValueError(f"device {spec.name!r}: field 'host_memory_bytes' must be >= 0 (0: unknown), "
                         f"got {spec.host_memory_bytes!r}")
    if not (_is_num(spec.matmul_efficiency) and 0 < spec.matmul_efficiency <= 1):
        raise ValueError(f"device {spec.name!r}: field 'matmul_efficiency' must be in (0, 1], "
                         f"got {spec.matmul_efficiency!r}")
    for k in ("launch_overhead", "fused_bandwidth", "optimizer_bandwidth", "host_bandwidth", "host_adam_rate"):
        v = getattr(spec, k)
        if not (_is_num(v) and v >= 0):
            raise ValueError(f"device {spec.name!r}: field {k!r} must be >= 0, got {v!r}")
    _check_samples(spec, "matmul_table", MatmulSample, ("m", "n", "k"))
    _check_samples(spec, "attention_table", AttentionSample, ("batch", "heads", "seq", "head_dim"))
    for i, s in enumerate(spec.attention_table):
        if s.causal not in (0, 1):
            raise ValueError(f"device {spec.name!r}: field 'attention_table' [{i}].causal must be 0 or 1, "
                             f"got {s.causal!r}")
    seen = set()
    for i, f in enumerate(spec.collective_fits):
        at = f"device {spec.name!r}: field 'collective_fits' [{i}]"
        if not isinstance(f, CollectiveFit):
            raise ValueError(f"{at} must be a CollectiveFit, got {f!r}")
        if f.tier not in TIERS:
            raise ValueError(f"{at}.tier {f.tier!r} is not one of {', '.join(TIERS)}")
        if f.kind not in COLLECTIVES:
            raise ValueError(f"{at}.kind {f.kind!r} is not one of {', '.join(COLLECTIVES)}")
        if not (_is_num(f.latency) and f.latency >= 0):
            raise ValueError(f"{at}.latency must be >= 0, got {f.latency!r}")
        if not (_is_num(f.bandwidth) and f.bandwidth > 0):
            raise ValueError(f"{at}.bandwidth must be > 0, got {f.bandwidth!r}")
        if (f.tier, f.kind) in seen:
            raise ValueError(f"{at}: a second fit for {f.kind} on the {f.tier} tier; keep one")
        seen.add((f.tier, f.kind))


def _check_samples(spec: DeviceSpec, name: str, cls: type, dims: tuple[str, ...]) -> None:
    """Each measured sample of field ``name``: a ``cls`` of a known dtype, sizes >= 1, a rate > 0."""
    for i, s in enumerate(getattr(spec, name)):
        at = f"device {spec.name!r}: field {name!r} [{i}]"
        if not isinstance(s, cls):
            raise ValueError(f"{at} must be a {cls.__name__}, got {s!r}")
        if s.dtype not in FLOP_KEYS:
            raise ValueError(f"{at}.dtype {s.dtype!r} is not one of {', '.join(FLOP_KEYS)}")
        if min(getattr(s, d) for d in dims) < 1:
            raise ValueError(f"{at}: {', '.join(dims)} must be >= 1, got "
                             f"{', '.join(str(getattr(s, d)) for d in dims)}")
        if not (_is_num(s.flops_per_s) and s.flops_per_s > 0):
            raise ValueError(f"{at}.flops_per_s must be > 0, got {s.flops_per_s!r}")


def _curves(samples) -> dict[Any, tuple[tuple[float, ...], tuple[float, ...]]]:
    """(key, FLOPs, FLOP/s) samples -> per key, the FLOPs in order and the mean rate at each."""
    by_key: dict[Any, dict[int, list[float]]] = {}
    for key, flops, rate in samples:
        by_key.setdefault(key, {}).setdefault(flops, []).append(rate)
    return {k: (tuple(float(f) for f in sorted(pts)), tuple(math.fsum(pts[f]) / len(pts[f]) for f in sorted(pts)))
            for k, pts in by_key.items()}


# Optimizer offload on an H100/H200 host (PCIe Gen5 x16 to each GPU: 64 GB/s raw per direction).
# Measured on an H200 host (16 cores, torch 2.11) with `python -m autopar calibrate` and
# cost_model.calibrate's measure_host_copies / measure_host_adam: pinned copies of 256 MiB and
# 1 GiB at 55.2-55.5 GB/s each way; torch's fused CPU AdamW at 4.18e9 fp32 parameters/s over
# 6.7e7 parameters and 4.34e9 over 2.7e8 (the larger, as an offloaded model's shard is).
HOPPER_HOST_BANDWIDTH = 55e9
HOPPER_HOST_ADAM_RATE = 4.3e9
# Host memory per GPU of NVIDIA's 8-GPU servers (DGX A100 640GB, DGX H100, DGX H200: 2 TB each),
# what offloaded optimizer state may fill on one GPU's behalf; a profile measured on the machine
# (`python -m autopar calibrate`) carries the machine's own.
DGX_HOST_MEMORY = 2 * 10**12 // 8

# Presets. Peak numbers are dense (no 2:4 sparsity) from NVIDIA's public data sheets; latencies
# and matmul efficiencies are estimates meant to be replaced by `python -m autopar calibrate`.
DEVICES: dict[str, DeviceSpec] = {
    # H100 SXM5 data sheet: FP32 67 TF, TF32 494.7 TF, BF16/FP16 989.4 TF, FP8 1978.9 TF (dense),
    # 80 GB HBM3 at 3.35 TB/s, NVLink 4 at 900 GB/s bidirectional (450 GB/s per direction).
    # Inter-node: one 400 Gb/s NDR InfiniBand NIC per GPU (DGX H100) = 50e9 B/s.
    # Memory: what CUDA gives a process on the card, 79.18 GiB on the H100 80GB lent to this project
    # (its out-of-memory report's "total capacity"), not the 80 GiB the data sheet's "80 GB" suggests.
    "h100": DeviceSpec(
        name="h100",
        peak_flops={"fp32": 67e12, "tf32": 494e12, "bf16": 989e12, "fp16": 989e12, "fp8": 1979e12},
        mem_bandwidth=3.35e12,
        memory_bytes=round(79.18 * GiB),
        intra_node_bw=450e9,
        inter_node_bw=50e9,
        intra_node_latency=3e-6,
        inter_node_latency=8e-6,
        matmul_efficiency=0.80,
        host_bandwidth=HOPPER_HOST_BANDWIDTH,
        host_adam_rate=HOPPER_HOST_ADAM_RATE,
        host_memory_bytes=DGX_HOST_MEMORY,
    ),
    # H200 SXM data sheet: same tensor-core peaks as H100 SXM, 141 GB HBM3e at 4.8 TB/s,
    # NVLink 900 GB/s bidirectional. Efficiency: a bf16 8192^3 matmul measured 816 of 989
    # TFLOP/s on the H200 lent to this project.
    "h200": DeviceSpec(
        name="h200",
        peak_flops={"fp32": 67e12, "tf32": 494e12, "bf16": 989e12, "fp16": 989e12, "fp8": 1979e12},
        mem_bandwidth=4.8e12,
        memory_bytes=141 * 10**9,
        intra_node_bw=450e9,
        inter_node_bw=50e9,
        intra_node_latency=3e-6,
        inter_node_latency=8e-6,
        matmul_efficiency=0.82,
        host_bandwidth=HOPPER_HOST_BANDWIDTH,
        host_adam_rate=HOPPER_HOST_ADAM_RATE,
        host_memory_bytes=DGX_HOST_MEMORY,
    ),
    # A100 80GB SXM data sheet: FP32 19.5 TF, TF32 156 TF, BF16/FP16 312 TF (dense),
    # HBM2e at 2,039 GB/s, NVLink 3 at 600 GB/s bidirectional (300 GB/s per direction).
    # Inter-node: one 200 Gb/s HDR InfiniBand NIC per GPU (DGX A100) = 25e9 B/s.
    "a100": DeviceSpec(
        name="a100",
        peak_flops={"fp32": 19.5e12, "tf32": 156e12, "bf16": 312e12, "fp16": 312e12},
        mem_bandwidth=2.04e12,
        memory_bytes=80 * GiB,
        intra_node_bw=300e9,
        inter_node_bw=25e9,
        intra_node_latency=4e-6,
        inter_node_latency=10e-6,
        matmul_efficiency=0.80,
        # PCIe 4.0 x16 (DGX A100): 31.5 GB/s raw per direction; pinned copies reach about 25 GB/s.
        # The host rate is an estimate (about half the Hopper hosts' per-core figure below).
        host_bandwidth=25e9,
        host_adam_rate=2e9,
        host_memory_bytes=DGX_HOST_MEMORY,
    ),
    # A modest multi-core CPU running gloo ranks on one host: both network tiers are loopback
    # TCP, so they share one bandwidth and latency. Rough figures, not a data sheet: without
    # native 16-bit matmul units, bf16 and fp16 run through conversions at about half fp32's rate.
    "cpu": DeviceSpec(
        name="cpu",
        peak_flops={"fp32": 1e11, "bf16": 5e10, "fp16": 5e10},
        mem_bandwidth=2e10,
        memory_bytes=24 * GiB,
        intra_node_bw=2e9,
        inter_node_bw=2e9,
        intra_node_latency=5e-5,
        inter_node_latency=5e-5,
        matmul_efficiency=0.7,
        # the "device" is the host: an offload copy is a memory copy (half of mem_bandwidth's
        # read + write), and CPU AdamW runs on the same few cores as everything else
        host_bandwidth=1e10,
        host_adam_rate=2e8,
    ),
}


def machine_memory() -> int:
    """Bytes of physical memory of this machine."""
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def host_memory(spec: DeviceSpec, gpus_per_node: int) -> float:
    """Host bytes one rank may fill with offloaded optimizer state: the profile's
    ``host_memory_bytes``, else this machine's memory shared by the ``gpus_per_node`` ranks of a node."""
    return float(spec.host_memory_bytes or machine_memory() // max(1, gpus_per_node))


def get_device(name_or_path: str | os.PathLike | DeviceSpec) -> DeviceSpec:
    """Resolve a preset name (case-insensitive), a JSON profile path, or a DeviceSpec."""
    if isinstance(name_or_path, DeviceSpec):
        return name_or_path
    text = os.fspath(name_or_path) if isinstance(name_or_path, os.PathLike) else name_or_path
    if not isinstance(text, str):
        raise TypeError(f"device must be a preset name, a JSON path or a DeviceSpec, "
                        f"got {type(name_or_path).__name__}")
    key = text.strip().lower()
    if key in DEVICES:
        return DEVICES[key]
    if os.path.isfile(text) or text.lstrip().startswith("{"):
        return DeviceSpec.from_json(text)
    hint = " (no such file)" if text.endswith(".json") else ""
    raise ValueError(f"unknown device {text!r}{hint}; presets: {', '.join(DEVICES)}, "
                     f"or pass a path to a JSON profile")


# GPU name fragments of each preset's family (data-sheet siblings priced alike); GH200 carries an
# H100 chip and must be matched before "H200"
_FAMILIES = (("h100", ("GH200", "H100", "H800")), ("h200", ("H200",)), ("a100", ("A100", "A800")))


def preset_for_gpu(name: str, capability: tuple[int, int] = (0, 0)) -> tuple[str, bool]:
    """The cost-model preset for a GPU named ``name`` (``torch.cuda.get_device_name()``), and whether
    it is that preset's own kind. An unknown GPU gets the nearest preset by compute capability:
    Hopper (9.x) prices as "h100", Ampere and Ada (8.x) and older as "a100", anything newer as "h200"."""
    upper = name.upper()
    for preset, fragments in _FAMILIES:
        if any(f in upper for f in fragments):
            return preset, True
    major = capability[0]
    return ("h200" if major >= 10 else "h100" if major == 9 else "a100"), False
