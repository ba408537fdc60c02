"""autopar.plan and autopar.parallelize: the two entry points."""
from __future__ import annotations

import copy
import os
import pickle
import warnings

import torch
import torch.distributed as dist

from autopar.cost_model.devices import preset_for_gpu
from autopar.mesh import Mesh, default_device_type
from autopar.planner.decide import check_knobs, decide, rebuild, rebuild_at_shapes
from autopar.plans import Plan


def plan(model, mesh, example_inputs, *, device="h100", gpus_per_node=8, world_size=None, **knobs) -> Plan:
    """Plan offline: no process group, no GPU; ``model`` may live on the meta device.

    ``mesh`` is (dp, pp, tp), a dict of axis sizes ({"dp", "pp", "tp"}, "cp" to split every
    sequence over cp ranks (``autopar.passes.context_parallel``), or dp split as
    {"dp_replicate", "dp_shard"} for HSDP: ZeRO shards over dp_shard and all-reduces across the
    replicas; ``autopar.Mesh.parse``) or "auto" (then ``world_size`` devices are ranked; the ranking
    is in the plan's notes). ``knobs`` are parallelize's: plan, sequence_parallel, recompute,
    memory_budget, schedule, microbatches, zero, offload, offload_delay, stages, virtual_stages, precision,
    keep_gathered, cp_attention."""
    return decide(model, mesh, example_inputs, device=device, gpus_per_node=gpus_per_node, world_size=world_size,
                  **knobs)[2]


def cost_expr(plan: Plan, model, example_inputs=None, *, device=None, gpus_per_node: int = 8):
    """``plan``'s step time and peak memory as sympy expressions in the global batch B and sequence
    length S, for its strategies, stages and recompute (``autopar.cost_model.symbolic``):
    ``e = autopar.cost_expr(plan, model); e.step_time; e.at(B, S)``. ``model`` is the model planned
    (on the meta device is fine); ``device`` is needed when the plan was priced on a profile."""
    from autopar.cost_model.symbolic import cost_expr as symbolic   # sympy: loaded only when asked for
    from autopar.planner.stage_cut import plan_layout
    return symbolic(model, plan, plan_layout, example_inputs, device=device, gpus_per_node=gpus_per_node)


def default_device() -> str:
    """The cost-model preset for this machine: its GPU's kind (A100, H100, H200; another GPU gets
    the nearest preset, with a warning), or "cpu"."""
    if not torch.cuda.is_available():
        return "cpu"
    name = torch.cuda.get_device_name()
    preset, exact = preset_for_gpu(name, torch.cuda.get_device_capability())
    if not exact:
        warnings.warn(f"autopar: no cost-model preset for the GPU {name!r}; pricing it as {preset!r}, the "
                      f"nearest by compute capability. Pass device= a preset or a profile measured by "
                      f"`python -m autopar calibrate --out dev.json`", stacklevel=3)
    return preset


def default_gpus_per_node() -> int:
    """Ranks that share this node's fast links: torchrun's LOCAL_WORLD_SIZE, else the visible GPUs, else 8."""
    local = os.environ.get("LOCAL_WORLD_SIZE")
    if local and local.isdigit():
        return int(local)
    return torch.cuda.device_count() if torch.cuda.is_available() else 8


def parallelize(model, mesh, example_inputs, *, plan="auto", sequence_parallel="auto", recompute="none",
                memory_budget=None, schedule="1F1B", microbatches=None, zero=0, offload="none", offload_delay=0,
                compile=True, device=None, gpus_per_node=None, stages=None, virtual_stages=None, precision="fp32",
                loss_kernel="auto", keep_gathered="auto", cp_attention="auto"):
    """Plan ``model`` for ``mesh`` and build this rank's parallel program.

    Call it on every rank of an initialised process group (``torchrun``, or
    ``autopar.launch.spawn`` for CPU ranks). ``example_inputs`` is one global batch.
    Rank 0 plans and broadcasts the plan, so every rank runs the same decisions.
    ``mesh``: as ``plan`` takes it (a tuple, a dict of axis sizes such as
    {"dp_replicate": 2, "dp_shard": 4} for HSDP, a DeviceMesh, or "auto").
    ``compile``: True lowers through torch.compile (Inductor); "reduce-overhead" (Inductor
    replaying CUDA graphs: no launch gaps; weights and buffers are marked as static addresses),
    "max-autotune" or "max-autotune-no-cudagraphs" through Inductor in that mode; another string
    or a callable names a torch.compile backend (e.g. "aot_eager"); False runs the rewritten
    graph eagerly.
    ``offload``: "none"; "optimizer" (ZeRO-Offload: the fp32 master weights and the optimizer
    state live in host memory and the CPU steps them; the device keeps the working weights and
    their gradients; build the optimizer with ``pm.optimizer(cls, ...)``,
    ``autopar.runtime.offload``); a fraction in [0, 1] (that share of the optimizer state, by
    bytes, on the host, in whole units: those whose gradients are final earliest in the backward;
    the other units' state stays on the device, ``plan.offload_kept``); "auto" (nothing offloaded
    where the plan fits ``memory_budget``, by default the device's memory, without it; else the
    split of fastest predicted step that fits the device and the host, chosen with recompute).
    ``offload_delay``: 1 lands the host's update one step late (ZeRO-Offload's delayed update: it
    overlaps the next step); 0, the default, keeps the update exact.
    ``device``: the cost model's device preset or profile (default: this machine's kind,
    ``default_device``). ``gpus_per_node``: ranks sharing a node's fast links, for pricing
    axes that span nodes (default: ``default_gpus_per_node``).
    ``stages``: with pp > 1, module FQNs per stage to override the cost model's cut.
    ``virtual_stages``: stages per pipeline rank (interleaved schedules; default 2 there).
    ``precision``: "fp32"; "bf16" (bf16 compute on fp32 master weights, every gradient and
    partial-sum reduction in fp32, fp32 loss); "fp16" (the same at fp16, with dynamic loss
    scaling). A given plan runs at its own precision (``autopar.runtime.precision``).
    ``keep_gathered`` (zero=3): "auto" keeps gathered from forward to backward the units that fit
    the memory budget; a list of unit names keeps those; () reshards every unit (``decide``).
    ``cp_attention`` (cp > 1): how attention runs over cp: "allgather" (keys and values gathered
    whole), "ring" (ring attention: key/value blocks passed around the cp ranks, each transfer
    overlapping a block's compute) or "auto", the one the cost model finds cheaper (``decide``).
    ``loss_kernel``: route a cross-entropy over 2-D logits (tp = 1) through autopar's one-read
    kernel (``autopar.kernels.cross_entropy``); "auto" does where it pays, when compiling with
    Inductor on CUDA with Triton; True always (its torch reference off CUDA); False never."""
    from autopar.launch import init_distributed
    from autopar.runtime.groups import process_groups
    from autopar.runtime.parallel_model import ParallelModel
    from autopar.runtime.program import program_for

    if loss_kernel not in (True, False, "auto"):
        raise ValueError(f"loss_kernel={loss_kernel!r}: expected True, False or 'auto'")
    offload = "none" if offload is None else offload
    if not dist.is_initialized():
        init_distributed()
    world = dist.get_world_size()
    auto = isinstance(mesh, str) and mesh == "auto"
    mesh_ = None if auto else Mesh.parse(mesh)
    if mesh_ is not None:
        check_knobs(mesh_, recompute, schedule, zero, sequence_parallel, offload, offload_delay)
        mesh_.check_world(world)
    knobs = dict(sequence_parallel=sequence_parallel, recompute=recompute, memory_budget=memory_budget,
                 schedule=schedule, microbatches=microbatches, zero=zero, offload=offload, offload_delay=offload_delay,
                 device=device or default_device(),
                 gpus_per_node=gpus_per_node or default_gpus_per_node(),
                 stages=stages, virtual_stages=virtual_stages, precision=precision, keep_gathered=keep_gathered,
                 cp_attention=cp_attention)
    # rank 0 plans once; the others capture the same graph and take its strategies from the plan,
    # pricing nothing (they would only repeat rank 0's figures and its capture warnings)
    box, decided, failure = [None], None, None
    if dist.get_rank() == 0:
        try:
            decided = decide(model, mesh, example_inputs, plan=plan, world_size=world, **knobs)
            box[0] = decided[2].to_json()
        except Exception as e:   # every rank must learn of the failure, not hang in the broadcast
            failure, box[0] = e, _picklable(e)
    dist.broadcast_object_list(box, src=0)
    if failure is not None:
        raise failure
    if isinstance(box[0], Exception):
        raise box[0]
    the_plan = Plan.from_json(box[0])
    if decided is not None:
        cap, strategies = decided[0], decided[1]
    else:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            cap, strategies = rebuild(model, the_plan, example_inputs, sequence_parallel=sequence_parallel)
    groups = process_groups(Mesh.of_plan(the_plan), the_plan.zero, default_device_type())
    program = program_for(the_plan, dist.get_rank(), cap, strategies, groups=groups, compile=compile,
                          loss_kernel=loss_kernel)
    twin = _meta_twin(model)

    def recapture(example):   # a batch of other shapes: the plan's choices on a capture of those shapes
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            return rebuild_at_shapes(twin, the_plan, example, sequence_parallel=sequence_parallel)

    return ParallelModel(model, program, cap, recapture=None if twin is None else recapture)


def _meta_twin(model):
    """A copy of ``model`` whose parameters and buffers are on the meta device, at their full shapes:
    what captures it again at other batch shapes once ``parallelize`` made its weights this rank's
    shards. None where the module cannot be copied."""
    memo = {}
    for t in [*model.parameters(), *model.buffers()]:
        if id(t) not in memo:
            meta = torch.empty_like(t, device="meta")
            memo[id(t)] = torch.nn.Parameter(meta, t.requires_grad) if isinstance(t, torch.nn.Parameter) else meta
    try:
        return copy.deepcopy(model, memo)
    except Exception:
        return None


def _picklable(e: Exception) -> Exception:
    """``e``, or where it cannot be pickled (it holds a C++ object) a RuntimeError with its message,
    for the broadcast that tells the other ranks (rank 0 raises ``e`` itself)."""
    try:
        pickle.dumps(e)
        return e
    except Exception:
        return RuntimeError(f"planning failed on rank 0: {type(e).__name__}: {e}")
