"""What the user asked the planner for: the knobs of ``autopar.plan`` and ``parallelize``, checked once.

A ``Request`` is built once per planning (``Request.of``), refusing a value the planner does not
know with the values it does, and then read by every choice; a candidate's own choices (its mesh,
microbatches, ZeRO stage, offload) are the candidate's (``planner.candidate``), never written
back here.
"""
from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

import torch

from autopar.collectives import CP_ATTENTIONS
from autopar.cost_model.devices import DeviceSpec, get_device
from autopar.cost_model.stages import SCHEDULES
from autopar.graph.capture import Captured, capture_pass
from autopar.graph.precision import compute_dtype
from autopar.mesh import Mesh
from autopar.plans import OFFLOADS, Plan

_UNITS = {"": 1, "B": 1, "KB": 1e3, "MB": 1e6, "GB": 1e9, "TB": 1e12,
          "KIB": 2**10, "MIB": 2**20, "GIB": 2**30, "TIB": 2**40}


def parse_bytes(value) -> float | None:
    """``"60GiB"``, ``"500MB"`` or a number of bytes."""
    if value is None or isinstance(value, (int, float)):
        return value
    m = re.fullmatch(r"\s*([\d.]+)\s*([A-Za-z]*)\s*", str(value))
    if not m or m.group(2).upper() not in _UNITS:
        raise ValueError(f"memory_budget {value!r}: expected a size such as '60GiB' or '500MB'")
    return float(m.group(1)) * _UNITS[m.group(2).upper()]


def check_knobs(mesh: Mesh | None, recompute, schedule, zero, sequence_parallel, offload="none", offload_delay=0):
    """Refuse a knob value the planner does not know, with the values it does (``mesh``: unread, for
    callers that check a mesh's knobs)."""
    if schedule not in SCHEDULES:
        raise ValueError(f"schedule={schedule!r}: expected one of {', '.join(SCHEDULES)}")
    if recompute not in ("none", "selective", "full", "auto"):
        raise ValueError(f"recompute={recompute!r}: expected 'none', 'selective', 'full' or 'auto'")
    if zero not in (0, 1, 2, 3, "auto"):
        raise ValueError(f"zero={zero!r}: expected 0 (nothing sharded over dp), 1 (optimizer state), "
                         "2 (and gradients), 3 (and weights, gathered per unit) or 'auto'")
    if sequence_parallel not in (True, False, "auto"):
        raise ValueError(f"sequence_parallel={sequence_parallel!r}: expected True, False or 'auto'")
    offload_knob(offload, offload_delay)


def offload_knob(offload, delay=0) -> tuple[object, int]:
    """``offload`` and ``offload_delay`` as the planner takes them: "none", "optimizer", "auto" or a
    fraction strictly between 0 and 1 (0 is "none", 1 "optimizer"), and 0 or 1; a clear
    ValueError for anything else, or for a delay with nothing offloaded."""
    offload = "none" if offload is None else offload
    if isinstance(offload, (int, float)) and not isinstance(offload, bool):
        if not 0 <= offload <= 1:   # NaN included
            raise ValueError(f"offload={offload!r}: a fraction is the share of the optimizer state, by bytes, that "
                             "goes to the host, between 0 and 1 (0.25: a quarter, the units whose gradients are final "
                             "earliest in the backward); or pass 'none', 'optimizer' or 'auto'")
        offload = "none" if offload == 0 else "optimizer" if offload == 1 else float(offload)
    elif offload not in (*OFFLOADS, "auto"):
        raise ValueError(f"offload={offload!r}: expected 'none' (everything on the device), 'optimizer' (the fp32 "
                         "master weights and AdamW state in host memory, stepped by the CPU), a fraction in [0, 1] "
                         "(that share of the state on the host, in whole units) or 'auto' (offload only when the "
                         "plan does not fit the memory budget without it, the split of fastest step that fits)")
    if isinstance(delay, bool) or delay not in (0, 1):
        raise ValueError(f"offload_delay={delay!r}: expected 0 (the host's update lands before the next step) or 1 "
                         "(it lands one step late, overlapping the next step's forward and backward)")
    if delay and offload == "none":
        raise ValueError("offload_delay=1 delays the host's update of an offloaded optimizer, but offload='none' "
                         "offloads nothing; pass offload='optimizer', a fraction or 'auto', or offload_delay=0")
    return offload, delay


def _keep_knob(keep_gathered, zero):
    """``keep_gathered`` as the planner takes it: "auto", or a tuple of unit names, which only zero=3
    (or "auto", should it choose 3) can keep: refused with another zero, as a plan file's are."""
    if isinstance(keep_gathered, str) and keep_gathered == "auto":
        return keep_gathered
    if isinstance(keep_gathered, (list, tuple)) and all(isinstance(n, str) for n in keep_gathered):
        if keep_gathered and zero not in (3, "auto"):
            raise ValueError(f"keep_gathered={list(keep_gathered)} names units to keep gathered from forward to "
                             f"backward, but only zero=3 reshards units (zero={zero!r} here); use zero=3 (or "
                             "'auto'), or leave keep_gathered='auto'")
        return tuple(keep_gathered)
    raise ValueError(f"keep_gathered={keep_gathered!r}: expected 'auto' (the planner keeps what fits the memory "
                     "budget under zero=3) or a list of unit names to keep gathered from forward to backward "
                     "(() reshards every unit)")


def _check_cp_attention(knob, mesh) -> None:
    """Refuse a ``cp_attention`` the planner does not know, or one named for a given mesh without cp
    (it could not take effect)."""
    if knob != "auto" and knob not in CP_ATTENTIONS:
        raise ValueError(f"cp_attention={knob!r}: expected 'auto' or {' or '.join(map(repr, CP_ATTENTIONS))}")
    if knob != "auto" and not (isinstance(mesh, str) and mesh == "auto") and Mesh.parse(mesh).cp == 1:
        raise ValueError(f"cp_attention={knob!r} chooses how attention runs over cp, but the mesh {Mesh.parse(mesh)} "
                         "has cp=1; give the mesh a cp axis (mesh={'cp': 2, ...}) or leave cp_attention='auto'")


def _plan_knob(plan):
    """``plan`` as the planner takes it: "auto", "megatron" or a Plan (a JSON path or text read)."""
    if isinstance(plan, Plan) or plan in ("auto", "megatron"):
        return plan
    if isinstance(plan, str) and (plan.lstrip().startswith("{") or Path(plan).exists()):
        return Plan.from_json(plan)
    raise ValueError(f"plan={plan!r}: expected 'auto', 'megatron', a Plan or a plan JSON path")


@dataclass(frozen=True)
class Request:
    """The knobs of one planning, checked (``Request.of``): what ``autopar.plan`` documents, with
    ``memory_budget`` in bytes (None: the device's memory), ``device`` the cost model's DeviceSpec,
    ``plan`` "auto", "megatron" or the given Plan, ``keep_gathered`` "auto" or unit names,
    ``offload`` "none", "optimizer", "auto" or a fraction strictly between 0 and 1 (``offload_knob``)
    and ``offload_delay`` 0 or 1."""

    plan: object = "auto"
    sequence_parallel: object = "auto"
    recompute: str = "none"
    memory_budget: float | None = None
    schedule: str = "1F1B"
    microbatches: int | None = None
    zero: object = 0
    device: DeviceSpec | None = None
    gpus_per_node: int = 8
    stages: object = None
    virtual_stages: int | None = None
    world_size: int | None = None
    precision: str = "fp32"
    offload: object = "none"
    offload_delay: int = 0
    keep_gathered: object = "auto"
    cp_attention: str = "auto"

    @classmethod
    def of(cls, mesh, *, device="h100", memory_budget=None, offload="none", offload_delay=0, plan="auto",
           **knobs) -> "Request":
        """The request of ``autopar.plan``'s keyword arguments for ``mesh`` (or "auto"), every knob
        checked here, before anything is captured or priced."""
        check_knobs(None, knobs.get("recompute", "none"), knobs.get("schedule", "1F1B"), knobs.get("zero", 0),
                    knobs.get("sequence_parallel", "auto"), offload, offload_delay)
        offload, offload_delay = offload_knob(offload, offload_delay)
        compute_dtype(knobs.get("precision", "fp32"))   # an unknown precision fails before any planning
        _check_cp_attention(knobs.get("cp_attention", "auto"), mesh)
        keep = _keep_knob(knobs.pop("keep_gathered", "auto"), knobs.get("zero", 0))
        return cls(plan=_plan_knob(plan), memory_budget=parse_bytes(memory_budget), device=get_device(device),
                   offload=offload, offload_delay=offload_delay, keep_gathered=keep, **knobs)

    @property
    def given(self) -> Plan | None:
        """The Plan the user gave to run as written, or None."""
        return self.plan if isinstance(self.plan, Plan) else None

    @property
    def limit(self) -> float:
        """The bytes a plan must fit per device: the memory budget, else the device's memory."""
        return self.device.memory_bytes if self.memory_budget is None else self.memory_budget

    @property
    def virtual(self) -> int:
        """Pipeline stages per pp rank: ``virtual_stages``, by default 2 on an interleaved schedule."""
        v = self.virtual_stages or (2 if self.schedule.startswith("Interleaved") else 1)
        if v > 1 and not self.schedule.startswith("Interleaved"):
            raise ValueError(f"virtual_stages={v} needs an interleaved schedule, not {self.schedule}")
        return v

    def searched(self) -> list[str]:
        """The knobs the planner chooses ("auto" ones; a given plan keeps its own choices)."""
        if self.given is not None:
            return []
        return [k for k in ("zero", "offload", "recompute") if getattr(self, k) == "auto"]

    def where(self) -> str:
        """The memory a plan must fit, in words, for the notes and errors."""
        if self.memory_budget is None:
            return f"one {self.device.name}'s memory ({self.limit / 2**30:.2f} GiB)"
        return f"the memory budget ({self.limit / 2**30:.2f} GiB)"


def local_inputs(example_inputs, mesh: Mesh, microbatches: int):
    """One dp rank's microbatch of the global example batch (dim 0 of every tensor)."""
    batch = example_inputs[0].shape[0]
    if batch % (mesh.dp * microbatches):
        raise ValueError(f"batch size {batch} is not divisible by dp={mesh.dp} x microbatches="
                         f"{microbatches}; use a batch that is a multiple of {mesh.dp * microbatches}")
    b = batch // (mesh.dp * microbatches)
    return tuple(x[:b] if isinstance(x, torch.Tensor) and x.dim() > 0 else x for x in example_inputs)


def microbatch_options(mesh: Mesh, batch: int, schedule: str, microbatches) -> list[int]:
    """The microbatch counts the schedule can take for this batch (one, if the user fixed it)."""
    local = batch // mesh.dp if batch % mesh.dp == 0 else batch
    if microbatches is not None:
        if mesh.pp > 1 and microbatches < mesh.pp:
            raise ValueError(f"microbatches={microbatches} is fewer than the {mesh.pp} pipeline stages; "
                             f"use at least {mesh.pp} so every stage has work")
        if schedule.startswith("Interleaved") and microbatches % mesh.pp:
            raise ValueError(f"{schedule} needs the microbatch count to be a multiple of pp={mesh.pp}; "
                             f"got {microbatches}")
        return [microbatches]
    if mesh.pp == 1:
        return [1]
    ok = [m for m in range(mesh.pp, local + 1) if local % m == 0
          and (not schedule.startswith("Interleaved") or m % mesh.pp == 0)]
    if not ok:
        raise ValueError(f"a dp-local batch of {local} cannot be split into at least pp={mesh.pp} "
                         f"microbatches for {schedule}; use a batch that is a multiple of {mesh.dp * mesh.pp}")
    return ok


class Job:
    """One planning: the model, its global example batch, the ``Request``, and the captures made so far
    (the mesh search and the plan often trace the same microbatch shapes)."""

    def __init__(self, model, example_inputs, request: Request):
        self.model, self.example_inputs, self.request = model, example_inputs, request
        self._captures: dict = {}

    def capture(self, inputs) -> Captured:
        """The model traced at ``inputs``, once per shapes and dtypes."""
        key = tuple((tuple(x.shape), x.dtype) for x in inputs)
        if key not in self._captures:
            self._captures[key] = capture_pass(self.model, inputs, require_loss=True)
        return self._captures[key]

    def capture_at(self, mesh: Mesh, microbatches: int) -> Captured:
        """The capture of one dp rank's microbatch on ``mesh`` with ``microbatches`` per step."""
        return self.capture(local_inputs(self.example_inputs, mesh, microbatches))
