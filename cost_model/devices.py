"""Device and network specs the cost model prices against.

A ``DeviceSpec`` is plain, frozen data: peak dense FLOP/s per dtype, HBM bandwidth and size,
and the alpha-beta parameters of the two network tiers (NVLink inside a node, InfiniBand
between nodes). Presets live in ``DEVICES``; a measured profile (``python -m autopar
calibrate``) is a JSON file that ``get_device`` loads the same way.
"""
from __future__ import annotations

import json
import math
import os
from dataclasses import dataclass, fields
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


@dataclass(frozen=True)
class DeviceSpec:
    """One accelerator (or CPU) and the links around it, in SI units (FLOP/s, bytes/s, s).

    ``peak_flops`` holds dense (non-sparse) peaks keyed by "fp32", "tf32", "bf16", "fp16",
    "fp8" (those the device has). ``intra_node_bw`` is the per-GPU, per-direction bus
    bandwidth of the intra-node fabric; ``inter_node_bw`` the per-GPU network bandwidth
    between nodes. ``matmul_efficiency`` is the fraction of peak a large matmul reaches.
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

    def __post_init__(self) -> None:
        # A defensive copy: the spec is frozen, so a caller's dict must not be able to change it.
        object.__setattr__(self, "peak_flops", {str(k): float(v) for k, v in self.peak_flops.items()})
        _validate(self)

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

    def to_dict(self) -> dict[str, Any]:
        """The spec as a plain JSON-able dict (field name -> value)."""
        return {f.name: (dict(getattr(self, f.name)) if f.name == "peak_flops" else getattr(self, f.name))
                for f in fields(self)}

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
                 "inter_node_latency", "matmul_efficiency")
_INT_FIELDS = ("memory_bytes", "gpus_per_node")


def _is_num(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)


def _parse_fields(data: dict[str, Any], where: str) -> dict[str, Any]:
    known = {f.name for f in fields(DeviceSpec)}
    unknown = sorted(set(data) - known)
    if unknown:
        raise ValueError(f"{where}: unknown field(s) {', '.join(unknown)}; "
                         f"fields are: {', '.join(f.name for f in fields(DeviceSpec))}")
    for f in fields(DeviceSpec):
        if f.name not in data and f.name != "gpus_per_node":
            raise ValueError(f"{where}: missing field {f.name!r}")
    out = dict(data)
    if not isinstance(out["name"], str):
        raise ValueError(f"{where}: field 'name' must be a string, got {out['name']!r}")
    pf = out["peak_flops"]
    if not isinstance(pf, dict):
        raise ValueError(f"{where}: field 'peak_flops' must be an object like "
                         f'{{"bf16": 9.89e14}}, got {pf!r}')
    for k in _FLOAT_FIELDS:
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
    return out


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
    if not (_is_num(spec.matmul_efficiency) and 0 < spec.matmul_efficiency <= 1):
        raise ValueError(f"device {spec.name!r}: field 'matmul_efficiency' must be in (0, 1], "
                         f"got {spec.matmul_efficiency!r}")


# Presets. Peak numbers are dense (no 2:4 sparsity) from NVIDIA's public data sheets; latencies
# and matmul efficiencies are estimates meant to be replaced by `python -m autopar calibrate`.
DEVICES: dict[str, DeviceSpec] = {
    # H100 SXM5 data sheet: FP32 67 TF, TF32 494.7 TF, BF16/FP16 989.4 TF, FP8 1978.9 TF (dense),
    # 80 GB HBM3 at 3.35 TB/s, NVLink 4 at 900 GB/s bidirectional (450 GB/s per direction).
    # Inter-node: one 400 Gb/s NDR InfiniBand NIC per GPU (DGX H100) = 50e9 B/s.
    "h100": DeviceSpec(
        name="h100",
        peak_flops={"fp32": 67e12, "tf32": 494e12, "bf16": 989e12, "fp16": 989e12, "fp8": 1979e12},
        mem_bandwidth=3.35e12,
        memory_bytes=80 * GiB,
        intra_node_bw=450e9,
        inter_node_bw=50e9,
        intra_node_latency=3e-6,
        inter_node_latency=8e-6,
        matmul_efficiency=0.80,
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
    ),
    # A modest multi-core CPU running gloo ranks on one host: both network tiers are loopback
    # TCP, so they share one bandwidth and latency. Rough figures, not a data sheet.
    "cpu": DeviceSpec(
        name="cpu",
        peak_flops={"fp32": 1e11, "bf16": 5e10},
        mem_bandwidth=2e10,
        memory_bytes=24 * GiB,
        intra_node_bw=2e9,
        inter_node_bw=2e9,
        intra_node_latency=5e-5,
        inter_node_latency=5e-5,
        matmul_efficiency=0.7,
    ),
}


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
