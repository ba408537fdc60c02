"""ParallelModel: one rank's share of a parallelized model, and its training step."""
from __future__ import annotations

import dataclasses
import functools
import hashlib
import warnings
import weakref
from collections import Counter

import torch
import torch.distributed as dist
from torch.fx._lazy_graph_module import _LazyGraphModule
from torch.optim.optimizer import register_optimizer_step_pre_hook

from autopar import collectives as C
from autopar.mesh import axes_group, default_device_type, group_name, split_dp_groups
from autopar.overlap import RegatherInBackward
from autopar.passes.context_parallel import check_sequence, cp_cuts, cp_pass, local_strategies
from autopar.passes.driver import rank_prefix, run_passes
from autopar.passes.precision import precision_pass
from autopar.passes.recompute import recompute_pass
from autopar.passes.shard import shard_pass
from autopar.graph.rules import is_float
from autopar.passes.fuse_loss import cross_entropy_kernel_pass
from autopar.graph.precision import compute_dtype
from autopar.passes.device import device_pass
from autopar.graph.units import stage_of_nodes, zero_units
from autopar.passes.token_mean import scale_name, token_count_graph, token_losses, token_mean_pass
from autopar.passes.zero import gather_name, shard_rows, unit_params, zero_pass
from autopar.placement import Shard, local_shape, parse_placement, shard_tensor
from autopar.kernels.fused_linear_ce import triton_available
from autopar.runtime.compile_once import peer_order
from autopar.runtime.master_weights import MasterAdamW, WorkingWeights
from autopar.runtime.offload import HostMasters, offloaded_optimizer
from autopar.runtime.pipeline import Pipeline
from autopar.runtime.precision import LossScaler, WorkingCopies
from autopar.runtime.zero import Zero1, clip_coefficient, scale_to_norm


@dataclasses.dataclass
class _Program:
    """This rank's lowered step for one microbatch shape: its graph, how it runs, what it is fed."""

    shapes: tuple[tuple[int, ...], ...]      # the plan's microbatch input shapes it was lowered for
    graph_module: torch.fx.GraphModule       # as the passes left it (before any pipeline split)
    fn: object                               # the lowered graph (pp = 1)
    pipeline: Pipeline | None                # the stages and schedule (pp > 1)
    counts: torch.fx.GraphModule | None      # a microbatch's token counts (passes.token_mean)
    counted: list[bool]                      # per token loss: a mean (its scale counts tokens) or a sum
    pass_seconds: list                       # (pass, seconds) per pass
    slots: list                              # (kind, fqn) of each placeholder, in order
    input_names: list[str]                   # the user inputs' placeholders, in call order


class ParallelModel:
    """This rank's local parameter shards and its compiled forward; ``train_step`` runs a step.

    The model given to ``parallelize`` becomes this rank's share of it, as with FSDP2's
    ``fully_shard``: each of its parameters is replaced by the local shard (a plain tensor of
    local shape), so ``model.parameters()`` and ``parameters()`` are the same tensor objects
    (tied weights stay tied) and an optimizer over either trains the parallel model. With pp > 1
    a parameter of a stage this rank does not run becomes an empty tensor (0 elements, no
    gradient ever), which every torch optimizer skips. The module no longer runs on its own
    where its weights are not whole (tp or pp > 1: calling it raises); build a fresh model
    and load ``full_state_dict()`` for an unsharded copy.

    Gradients after ``train_step`` are averaged over dp (and cp, whose ranks see other tokens of
    the same sequences with the same weights) and complete (no partial sums) on every rank, and
    any torch optimizer over ``parameters()`` is correct, except where the gradients do not live
    on the parameters: with ``zero=1`` (they are reduce-scattered into the dp shard
    that ``optimizer(...)`` steps) and once ``optimizer(MasterAdamW)`` is built (they stay on
    the bf16 working copies). There any other optimizer stepping these parameters raises at its
    ``step()``, naming ``pm.optimizer(...)``; so does one built over the model's parameters
    before ``parallelize`` replaced them.

    With ``plan.precision`` "bf16" or "fp16" the graph computes at 16 bits, on one working copy
    of the weights per step, while parameters, gradients and optimizer state stay fp32 and
    every gradient sum runs in fp32 (``autopar.runtime.precision``). With bf16, ``optimizer(MasterAdamW)``
    keeps the fp32 weights in the optimizer and persistent bf16 copies in the graph, fusing the
    casts into the update (``autopar.runtime.master_weights``). fp16 scales the loss
    (``loss_scaler``); a step whose gradients overflow on any rank leaves every rank's
    gradients None, so the optimizer skips it, and sets ``step_skipped``.

    With ``plan.offload`` "optimizer" the fp32 master weights and the optimizer state live in
    host memory and ``optimizer(cls, ...)`` steps them on the CPU (``autopar.runtime.offload``);
    at bf16 the parameters on the device are then bf16 themselves. Any other optimizer over
    ``parameters()`` raises at its ``step()``.

    ``graph_module`` is this rank's program as the passes left it (before any pipeline split),
    ``pass_seconds`` the (pass, seconds) each of them took (``autopar.passes.driver``)."""

    def __init__(self, model, cap, strategies, plan, mesh, dmesh, *, compile=True, loss_kernel="auto",
                 recapture=None):
        """``recapture(inputs)``, given, returns the capture, strategies and plan of ``plan``'s choices for
        a global batch of other shapes (``autopar.api``): a batch or sequence length other than the
        example's is then lowered anew on the same parameters."""
        self.plan = plan
        self.mesh = mesh
        self._dmesh = dmesh
        self.coords = mesh.coords(dist.get_rank())
        self._tp_group = group_name(dmesh, "tp")
        self._dp_group = group_name(dmesh, "dp")
        # cp ranks see other tokens with the same weights: gradients and the loss are averaged over
        # dp x cp (the "data" ranks), and ZeRO treats cp as more replicas of its dp shards
        self._cp_group = group_name(dmesh, "cp") if mesh.cp > 1 else None
        self._data_group = (self._dp_group if mesh.cp == 1 else self._cp_group if mesh.dp == 1
                            else axes_group(mesh, ("dp", "cp")))
        # ZeRO splits its state over dp_shard: all of dp, unless dp is split (HSDP), where each
        # replica holds the same shards and the sharded gradients are all-reduced across dp_replicate
        self._shard_group, self._replicate_group = self._dp_group, None
        if plan.zero and mesh.split:
            self._shard_group, self._replicate_group = split_dp_groups(mesh, default_device_type())
        replicas = mesh.dp_replicate if self._replicate_group else 1
        if plan.zero and mesh.cp > 1:   # the same shards on every cp rank (and replica): reduced across them
            self._replicate_group = axes_group(mesh, ("dp_replicate", "cp")) if mesh.split else self._cp_group
            replicas *= mesh.cp
        self._across = dict(replicate=self._replicate_group, replicas=replicas)
        self._device = _comm_device()
        self._compile, self._loss_kernel, self._recapture = compile, loss_kernel, recapture
        self._fsdp = plan.zero >= 2 and mesh.dp_shard > 1
        self._placement = {p.fqn: parse_placement(p.placements["tp"]) for p in plan.parameters}
        self._aliases = {p.fqn: p.aliases for p in plan.parameters}
        self._buffers = {fqn: b for fqn, b in model.named_buffers() if fqn in cap.buffers}
        unknown = [fqn for fqn, b in self._buffers.items() if b.is_meta]
        if unknown:
            raise ValueError(f"the buffer(s) {', '.join(unknown)} are on the meta device, so their values are "
                             "unknown: build the model on a real device, or register them again with their values "
                             "before parallelize (module.register_buffer(name, tensor), e.g. a rotary table)")
        self._buffers.update(cap.constant_tensors(self._device))   # torch.export's lifted constants
        # the buffers the module's own state_dict holds: checkpoints and exports carry exactly these
        self._persistent_buffers = [fqn for fqn in model.state_dict(keep_vars=True) if fqn in self._buffers]
        # the scale each token-mean loss reads (passes.token_mean), written before every forward
        self._buffers.update({scale_name(k): torch.ones((), device=self._device)
                              for k in range(len(token_losses(cap.gm)))})
        # One microbatch on one stage: the 16-bit weight copies are cast inside the compiled graph,
        # where Inductor fuses them into its own kernels, instead of ~2 eager kernels per weight per
        # step. With several microbatches the copies are made once per step and shared (``WorkingCopies``).
        self._in_graph = mesh.pp == 1 and plan.microbatches == 1
        self._casts = WorkingCopies("fp32" if self._in_graph or self._fsdp else plan.precision, names=cap.params)
        self._master = None   # WorkingWeights, once optimizer(MasterAdamW) is asked for
        self.loss_scaler = LossScaler() if plan.precision == "fp16" else None
        self.step_skipped = False
        self._model, self._params = model, None   # the parameters, made by the first program
        self._program = self._lower(cap, strategies, plan)
        self._programs = {_shape_key(plan.input_shapes): self._program}
        self._model = None
        self._zero = (Zero1(self._params, {f for f in self._params if self._sharded(f)}, group=self._shard_group,
                            size=mesh.dp_shard, rank=self.coords["dp_shard"], norm=self._norm, **self._across)
                      if plan.zero == 1 else None)
        self._offload = None   # HostMasters with plan.offload: what pm.optimizer's optimizers step on the host
        if plan.offload != "none":
            if self._zero is not None:
                self._offload = HostMasters({"slice": self._zero.shard})
            else:   # at 16 bits the host copy is the master: the device keeps the 16-bit weights only
                self._offload = HostMasters(self._params, dtype=None if plan.precision == "fp32"
                                            else compute_dtype(plan.precision), keep_fp32=self._summed_params())
        self._cuda_graphs = compile in CUDA_GRAPH_MODES
        if self._cuda_graphs:   # replayed graphs read weights and buffers where they were recorded
            for t in [*self._params.values(), *self._buffers.values()]:
                torch._dynamo.mark_static_address(t)
        self._replaced = _adopt_shards(model, self._params, cap.params, self._device)
        self._ids = {id(p) for p in self._params.values()}
        # optimizers found able to step, with what they were checked against: the hook runs before
        # every step of every optimizer, and an unchanged optimizer needs no second look
        self._passed: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
        _guard_optimizer_steps(self)
        if mesh.pp > 1 or self._fsdp or any(self._sharded(fqn) for fqn in self._params):
            model.register_forward_pre_hook(_refuse_unsharded_call)

    def _lower(self, cap, strategies, plan) -> _Program:
        """This rank's program for the capture ``cap`` (one microbatch's shapes) and its strategies:
        the passes carrying ``plan`` out, run by the pass driver on the capture (which they leave as
        it is: the planner's graph), then lowered; with pp > 1 the pipeline splits the result into its
        stages (pipeline_split_pass, the one step that makes several graphs). The first call makes
        this rank's parameters; a later one (another batch shape) computes with the same tensors."""
        mesh, compile = self.mesh, self._compile
        steps = []
        if any(n.meta["val"].device != self._device for n in cap.gm.graph.nodes
               if n.op == "placeholder" and isinstance(n.meta.get("val"), torch.Tensor)):
            steps.append((device_pass, dict(device=self._device)))   # captured on meta or another device
        # a mean over tokens is made the mean over the whole step's tokens (padding, ignore_index)
        losses = token_losses(cap.gm) if mesh.data * plan.microbatches > 1 else []
        if losses:
            steps.append((token_mean_pass, {}))
        counts = token_count_graph(cap.gm) if losses else None
        if counts is not None and steps[0][0] is device_pass:
            counts = device_pass(counts, device=self._device)
        start, seconds, cuts = cap.gm, [], {}
        if mesh.cp > 1:
            check_sequence(plan.input_shapes[0][1], mesh.cp, mesh.tp, plan.sequence_parallel)
            steps.append((cp_pass, dict(size=mesh.cp, rank=self.coords["cp"], group=self._cp_group,
                                        seq=plan.input_shapes[0][1], attention=plan.cp_attention)))
        if steps:
            # first, in a run of their own: the tp rewrite then sees the rewritten loss and the local
            # sequence's shapes, on nodes the planner's strategies are handed to by name
            start, seconds = run_passes(cap.gm, steps, prefix=rank_prefix("cp" if mesh.cp > 1 else "pre"))
            strategies, steps, cuts = local_strategies(start, strategies), [], cp_cuts(start)
        if mesh.tp > 1:
            steps.append((shard_pass, dict(strategies=strategies, size=mesh.tp, rank=self.coords["tp"],
                                           group=self._tp_group)))
        if self._loss_kernel is True or (self._loss_kernel == "auto" and _inductor_on_cuda(compile)):
            steps.append((cross_entropy_kernel_pass, {}))
        # ZeRO-2/3: every parameter enters as its dp shard and is gathered per unit inside the graph
        units = gathers = None
        if self._fsdp:
            labels, units = zip(*((u.name, [n.name for n in u.nodes]) for u in zero_units(cap)))
            gathers = unit_params(cap.gm, units, set(cap.params))
            resharded = {k for k, label in enumerate(labels) if plan.zero == 3 and label not in plan.keep_gathered}
            # a weight several units of one stage use (a tied embedding) is gathered once for all of them
            shared = Counter(f for fqns in gathers.values() for f in fqns)
            steps.append((zero_pass, dict(units=units, rows={p.fqn: p.local_shape[0] for p in plan.parameters},
                                          group=self._shard_group, size=mesh.dp_shard, **self._across,
                                          dtype=compute_dtype(plan.precision) if plan.precision != "fp32" else None,
                                          reshard=resharded,
                                          recomputed={n for r in plan.recompute_regions for n in r},
                                          once={f for f, n in shared.items() if n > 1} if mesh.pp == 1 else set(),
                                          prefetch=_prefetches(compile))))
        if plan.precision != "fp32":
            # inputs and buffers are cast in the graph, where it can leave those computing tables alone;
            # weights too with one microbatch on one stage (else ``WorkingCopies`` shares one copy)
            # (ZeRO-2/3 gathers the weights at the compute dtype: none is cast here)
            floats = {n.name for n in cap.gm.graph.nodes if n.op == "placeholder" and is_float(n)
                      and ((self._in_graph and not self._fsdp) or n.meta.get("kind") != "param")}
            steps.append((precision_pass, dict(precision=plan.precision, floats=floats,
                                               stage_of=self._stage_of(cap, plan, units, gathers, cuts))))
        if plan.recompute_regions:
            steps.append((recompute_pass, dict(regions=[set(r) for r in plan.recompute_regions])))
        # (pass name, seconds) per pass; AUTOPAR_DUMP=DIR writes each graph before and after it
        gm, more = run_passes(start, steps, prefix=rank_prefix())
        order = peer_order(self.coords) if uses_inductor(compile) else None

        def materialize(fqns):
            if self._params is not None:
                return {f: self._params[f] for f in fqns if f in self._params}
            local = _materialize(self._model, cap, self._placement, mesh.tp, self.coords["tp"], fqns)
            if not self._fsdp:
                return local
            return {f: _dp_shard(q, mesh.dp_shard, self.coords["dp_shard"]) for f, q in local.items()}

        pipeline = fn = None
        if mesh.pp > 1:
            pipeline = Pipeline(gm, self._stage_of(cap, plan, units, gathers, cuts), plan, self._dmesh,
                                rank=self.coords["pp"], materialize=materialize,
                                buffers=self._buffers, device=self._device, prepare=self._casts,
                                loss_scale=lambda: self.loss_scale,
                                wrap=lambda g: lower(g, compile, regather=plan.zero == 3, order=order))
            if self._params is None:
                self._params = pipeline.params
        else:
            if self._params is None:
                self._params = materialize(set(cap.params))
            fn = lower(gm, compile, regather=plan.zero == 3, order=order)
        return _Program(shapes=_shape_key(plan.input_shapes), graph_module=gm, fn=fn,
                        pipeline=pipeline, counts=counts, counted=[t.counted for t in losses],
                        pass_seconds=seconds + more,
                        slots=[(n.meta.get("kind"), n.meta.get("fqn")) for n in gm.graph.nodes
                               if n.op == "placeholder"],
                        input_names=[n.name for n in cap.inputs])

    @staticmethod
    def _stage_of(cap, plan, units, gathers, cuts) -> dict[str, int] | None:
        """Global node name -> pipeline stage (None without stages), ZeRO's gathers with their units,
        cp's cuts (``cuts``: name -> the first node using it) with the node they feed."""
        if plan.mesh[1] == 1:
            return None
        where = stage_of_nodes(cap, plan)
        for k, fqns in (gathers or {}).items():
            where.update({gather_name(k, f): where.get(units[k][0], len(plan.stages) - 1) for f in fqns})
        where.update({cut: where.get(user, len(plan.stages) - 1) for cut, user in cuts.items()})
        return where

    # ---- parameters ----------------------------------------------------------------------

    def named_parameters(self):
        """(FQN, local shard) of every parameter this rank holds; the model's own, since parallelize."""
        return iter(self._params.items())

    def parameters(self):
        """This rank's local shards, the same tensors as the model's parameters (see the class docstring)."""
        return iter(self._params.values())

    def _refuse_inert(self, optimizer: torch.optim.Optimizer) -> None:
        """Raise if ``optimizer`` is about to step tensors whose gradients this model never fills
        (run before every torch optimizer's ``step``, by ``_guard_optimizer_steps``)."""
        seen = (sum(len(g["params"]) for g in optimizer.param_groups), self._zero is None, self._master is None,
                self._offload is None)
        if self._passed.get(optimizer) == seen:
            return
        held = [p for group in optimizer.param_groups for p in group["params"]]
        name = type(optimizer).__name__
        if any((r := self._replaced.get(id(p))) is not None and r() is p for p in held):
            raise RuntimeError(f"{name} holds the parameters the model had before autopar.parallelize replaced "
                               "them with this rank's shards, and those get no gradients: build the optimizer "
                               "after parallelize, over pm.parameters() (the model's parameters are now the "
                               "same tensors), or with pm.optimizer(...)")
        if ((self._zero is None and self._master is None and self._offload is None)
                or (isinstance(optimizer, MasterAdamW) and optimizer.working is self._master)
                or not any(id(p) in self._ids for p in held)):
            self._passed[optimizer] = seen
            return
        if self._offload is not None:
            raise RuntimeError(f"offload='optimizer': the fp32 master weights live in host memory and the step runs "
                               f"there, so {name} over pm.parameters() (the device's working weights) would offload "
                               f"nothing and, at 16 bits, update rounded weights; build it with "
                               f"pm.optimizer({name}, ...)")
        if self._zero is not None:
            raise RuntimeError(f"zero=1: train_step reduce-scatters the gradients into the dp shard that "
                               f"pm.optimizer(...) steps and leaves p.grad of pm.parameters() None, so {name} "
                               f"over them would never update them; build it with pm.optimizer({name}, ...)")
        raise RuntimeError(f"with pm.optimizer(autopar.MasterAdamW) the gradients stay on the bf16 working "
                           f"copies and p.grad of pm.parameters() stays None, so {name} over them would never "
                           "update them; step only the MasterAdamW that pm.optimizer built, or parallelize a "
                           "fresh model for another optimizer")

    def optimizer(self, cls=torch.optim.AdamW, params=None, **defaults):
        """``cls`` over this rank's local shards, built for how this model keeps its gradients and
        weights; with zero=1 its state is also sharded over dp. ``params`` as torch optimizers take
        it: None (every local shard), an iterable of this rank's parameters (``parameters()``, the
        parallelized model's ``parameters()``: the same tensors), or a list of group dicts, each
        ``{"params": ..., **options}`` (e.g. no weight decay on norms and biases); ``defaults``
        (``lr=...``) apply where a group sets no option of its own. A 0-element parameter (a weight
        of a pipeline stage this rank does not run) is left out of its group; a tensor that is not
        one of this rank's parameters, or one in two groups, raises ValueError.
        ``cls=autopar.MasterAdamW`` (bf16) also makes the graph compute on persistent bf16 copies
        that the optimizer writes (``autopar.runtime.master_weights``). With ``plan.offload``
        "optimizer" ``cls`` steps fp32 host copies of the shards on the CPU
        (``autopar.runtime.offload``); under zero=1 each group steps its runs of the dp slice
        (``autopar.runtime.zero.SliceOptimizer``)."""
        groups = self._param_groups(params)
        if self._offload is not None:
            if cls is MasterAdamW:
                raise ValueError("offload='optimizer' already keeps the fp32 master weights (in host memory) and "
                                 "writes the device's working weights after each step; use "
                                 "pm.optimizer(torch.optim.AdamW, ...)")
            return offloaded_optimizer(cls, self._offload, groups, defaults, zero=self._zero)
        held = (list(self.parameters()) if groups is None else
                [{**options, "params": [self._params[f] for f in fqns]} for fqns, options in groups])
        if cls is MasterAdamW:
            return MasterAdamW(held, self._working_weights(), **defaults)
        if self._zero is not None:
            return self._zero.make_optimizer(cls, groups, **defaults)
        return cls(held, **defaults)

    def _param_groups(self, params) -> list[tuple[list[str], dict]] | None:
        """``optimizer``'s ``params`` as (FQNs, options) per group, checked; None for every shard."""
        if params is None:
            return None
        if isinstance(params, (torch.Tensor, dict)):
            raise TypeError(f"pm.optimizer(cls, params): params is one {type(params).__name__}; pass an iterable "
                            "of parameters or a list of group dicts, as torch optimizers take them "
                            "(e.g. [p] or [{'params': [p], 'weight_decay': 0.0}])")
        given = list(params)
        if not given:
            raise ValueError("pm.optimizer(cls, params): params is empty; pass this rank's parameters "
                             "(pm.parameters()) or groups of them, or leave params out for all of them")
        dicts = [isinstance(g, dict) for g in given]
        if any(dicts) and not all(dicts):
            raise TypeError("pm.optimizer(cls, params): params mixes group dicts and tensors; put every "
                            "parameter in a group dict, {'params': [...], **options}")
        if not any(dicts):
            given = [{"params": given}]
        fqn_of = {id(p): fqn for fqn, p in self._params.items()}
        where: dict[str, int] = {}
        out = []
        for k, group in enumerate(given):
            if "params" not in group:
                raise ValueError(f"parameter group {k} has no 'params' key; each group is "
                                 "{'params': [...], **options}")
            members = group["params"]
            fqns = []
            for p in [members] if isinstance(members, torch.Tensor) else list(members):
                fqn = fqn_of.get(id(p))
                if fqn is None and self._foreign(p, k):
                    continue
                if fqn in where:
                    twice = (f"twice in parameter group {k}" if where[fqn] == k
                             else f"in parameter groups {where[fqn]} and {k}")
                    raise ValueError(f"{fqn} is {twice} (tied weights are one tensor under all their names): put "
                                     "each parameter in one group, once")
                where[fqn] = k
                fqns.append(fqn)
            out.append((fqns, {key: value for key, value in group.items() if key != "params"}))
        return out

    def _foreign(self, p, k: int) -> bool:
        """For a tensor of group ``k`` that is not one of this rank's shards: True (leave it out) for a
        0-element parameter, the weight of a pipeline stage this rank does not run; else raise."""
        if not isinstance(p, torch.Tensor):
            raise TypeError(f"parameter group {k} holds a {type(p).__name__}, not a tensor: pass this rank's "
                            "parameters (pm.parameters())")
        if (r := self._replaced.get(id(p))) is not None and r() is p:
            raise ValueError(f"parameter group {k} holds a parameter the model had before autopar.parallelize "
                             "replaced it with this rank's shard; build the groups after parallelize, from "
                             "pm.named_parameters() or the model's (now the same tensors)")
        if p.numel() == 0:
            return True
        raise ValueError(f"parameter group {k} holds a tensor of shape {tuple(p.shape)} that is not one of this "
                         "rank's parameters (a tensor of another model?); build the groups from "
                         "pm.named_parameters() or the parallelized model's named_parameters()")

    def _working_weights(self) -> WorkingWeights:
        why = [what for what, bad in (
            (f"precision={self.plan.precision!r} (it needs 'bf16')", self.plan.precision != "bf16"),
            (f"pp={self.mesh.pp}", self.mesh.pp > 1),
            (f"{self.plan.microbatches} microbatches (their gradients would add up in bf16)", self.plan.microbatches > 1),
            (f"zero={self.plan.zero}", self.plan.zero and self.mesh.dp > 1)) if bad]
        if why:
            raise ValueError(f"MasterAdamW needs one bf16 forward and backward per step on one stage; this plan has "
                             f"{', '.join(why)}: use pm.optimizer(torch.optim.AdamW, ...)")
        if self._master is None:
            self._master = WorkingWeights(self._params, compute_dtype(self.plan.precision), self._summed_params())
            if self._cuda_graphs:
                for t in self._master.copies.values():
                    torch._dynamo.mark_static_address(t)
        return self._master

    def _summed_params(self) -> set[str]:
        """The weights the graph feeds to a collective (``copy_to``: their gradients are summed over
        tp), which keep an fp32 copy so that sum is not rounded to 16 bits."""
        return {n.meta.get("fqn") for n in self.graph_module.graph.nodes if n.op == "placeholder"
                and n.meta.get("kind") == "param" and any(u.target in C.COLLECTIVE_FUNCTIONS for u in n.users)}

    # ---- the step ------------------------------------------------------------------------

    @property
    def loss_scale(self) -> float:
        """What backward's loss is multiplied by: the fp16 loss scale, else 1."""
        return self.loss_scaler.scale if self.loss_scaler is not None else 1.0

    @property
    def graph_module(self) -> torch.fx.GraphModule:
        """This rank's program as the passes left it (before any pipeline split), for the plan's batch shapes."""
        return self._programs[_shape_key(self.plan.input_shapes)].graph_module

    @property
    def pass_seconds(self) -> list:
        """(pass name, seconds) of each pass that built ``graph_module`` (``autopar.passes.driver``)."""
        return self._programs[_shape_key(self.plan.input_shapes)].pass_seconds

    @property
    def _pipeline(self) -> Pipeline | None:
        return self._program.pipeline

    def __call__(self, *inputs) -> torch.Tensor:
        """The loss of a batch, forward only: ``eval_step``."""
        return self.eval_step(*inputs)

    def eval_step(self, *inputs) -> torch.Tensor:
        """The loss of a batch, forward only (no gradients, no update): what ``train_step`` would
        return for it, the mean over every microbatch and dp rank. Inputs as ``train_step`` takes them."""
        program, inputs = self._prepare(inputs)
        with torch.no_grad(), self._casts.step():
            if program.pipeline is not None:
                total = program.pipeline.step(dict(zip(program.input_names, inputs)), train=False)
            else:
                m = self.plan.microbatches
                total = sum(self._forward(program, chunk) for chunk in _chunks(inputs, m)) / m
        if self.mesh.data > 1:
            total = C.all_reduce(total, self._data_group) / self.mesh.data
        return total

    def train_step(self, *inputs) -> torch.Tensor:
        """Forward and backward over all microbatches, then gradient sync over dp.

        Inputs are the global batch (each dp rank takes its slice), or this dp rank's own rows
        when their count is the plan's per-rank batch (the global batch / dp). A batch or sequence
        length other than the plan's is lowered anew once, with the plan's choices. Returns the
        full batch's loss: a mean over tokens is over the tokens of every microbatch and rank
        (``autopar.passes.token_mean``), as the unsharded model computes it."""
        m = self.plan.microbatches
        program, inputs = self._prepare(inputs)
        if self._master is not None and (self._master.reduced is not None or self._master.grads()):
            raise RuntimeError("MasterAdamW's gradients do not add up across train_step calls (they would "
                               "in bf16): call opt.zero_grad() before each train_step, or use microbatches "
                               "with torch.optim.AdamW to accumulate")
        if self._cuda_graphs:   # the last step's graph outputs are consumed: their memory may be reused
            torch.compiler.cudagraph_mark_step_begin()
        with self._casts.step():
            if program.pipeline is not None:
                total = program.pipeline.step(dict(zip(program.input_names, inputs)))
            else:
                total = 0.0
                for chunk in _chunks(inputs, m):
                    loss = self._forward(program, chunk)
                    (loss * self.loss_scale / m).backward()
                    total = total + loss.detach() / m
        if self.mesh.data > 1:   # the ranks' losses average to the batch's (passes.token_mean)
            total = C.all_reduce(total, self._data_group) / self.mesh.data
        # (ZeRO-2/3: the gathers' backward already left every shard its dp-mean gradient)
        if self._zero is not None:   # at dp=1 too: the optimizer steps the slice, which only this fills
            self._zero.reduce_scatter_grads()
        elif self.mesh.data > 1 and self._master is not None:
            grads = self._master.grads()
            self._master.use_reduced(dict(zip(grads, _all_reduce_mean(list(grads.values()), self._data_group,
                                                                       self.mesh.data))))
        elif self.mesh.data > 1 and not self._fsdp:
            grads = [p.grad for p in self.parameters() if p.grad is not None]
            for g, mean in zip(grads, _all_reduce_mean(grads, self._data_group, self.mesh.data)):
                g.copy_(mean)
        if self.loss_scaler is not None:
            self._unscale_grads()
        return total

    def _unscale_grads(self):
        """Divide the gradients by the loss scale; after an inf/nan on any rank, drop them on all."""
        holders = [self._zero.shard] if self._zero is not None else list(self.parameters())
        grads = [p.grad for p in holders if p.grad is not None]
        self.step_skipped = self.loss_scaler.unscale_(grads, dist.group.WORLD.group_name, self._device)
        if self.step_skipped:
            for p in holders:
                p.grad = None   # torch optimizers leave a parameter without a gradient untouched

    def _forward(self, program: _Program, inputs) -> torch.Tensor:
        """One microbatch's forward through ``program`` (pp = 1): this rank's share of the loss."""
        args, it = [], iter(inputs)
        if self._master is not None:
            self._master.refresh()
        params = self._master.copies if self._master is not None else self._params
        for kind, fqn in program.slots:
            args.append(self._casts(fqn, params[fqn]) if kind == "param"
                        else self._casts(fqn, self._buffers[fqn]) if kind == "buffer" else next(it))
        out = program.fn(*args)
        return out[0] if isinstance(out, (tuple, list)) else out

    def _prepare(self, inputs) -> tuple[_Program, list]:
        """This rank's rows of a batch and the program for their shapes (lowered now if new), with
        the step's token-mean scales written."""
        # token ids are cheap to copy, and a slice of a batch along the sequence is not contiguous
        inputs = [x.contiguous() if isinstance(x, torch.Tensor) else x for x in self._dp_rows(list(inputs))]
        m = self.plan.microbatches
        rows = _batch_of(inputs)
        if rows % m:
            raise ValueError(f"this rank's {rows} rows of the batch do not split into the plan's {m} microbatches: "
                             f"give each dp rank a multiple of {m} rows")
        shapes = _shape_key(tuple((rows // m, *x.shape[1:]) if x.dim() else () for x in inputs
                                  if isinstance(x, torch.Tensor)))
        program = self._programs.get(shapes)
        if program is None:
            program = self._programs[shapes] = self._relower(inputs, shapes)
        self._program = program
        self._write_token_scales(program, inputs)
        return program, inputs

    def _relower(self, inputs, shapes) -> _Program:
        """The program for microbatch inputs of ``shapes``, other than the plan's: captured again
        (``recapture``) and lowered with the plan's choices."""
        planned = [list(s) for s in self.plan.input_shapes]
        if self._recapture is None:
            raise ValueError(f"the plan was made for microbatch inputs of shapes {planned} and this batch's are "
                             f"{list(map(list, shapes))}: parallelize with an example batch of these shapes")
        if self.mesh.cp > 1 and shapes and len(shapes[0]) > 1:
            check_sequence(shapes[0][1], self.mesh.cp, self.mesh.tp, self.plan.sequence_parallel)
        warnings.warn(f"autopar: lowering the step again for microbatch inputs of shapes {list(map(list, shapes))} "
                      f"(the plan was made for {planned}); each new shape compiles once", stacklevel=3)
        dp = self.mesh.dp
        example = tuple(x.new_empty((x.shape[0] * dp, *x.shape[1:]), device="meta")
                        if isinstance(x, torch.Tensor) and x.dim() else x for x in inputs)
        try:
            cap, strategies, plan = self._recapture(example)
        except Exception as e:
            raise ValueError(f"this batch (microbatch inputs of shapes {list(map(list, shapes))}; the plan was made "
                             f"for {planned}) cannot run with the plan's choices: {type(e).__name__}: {e}") from e
        missing = sorted(set(cap.buffers) - set(self._buffers))
        if missing:
            raise ValueError(f"at microbatch inputs of shapes {list(map(list, shapes))} the model's forward uses "
                             f"tensors it did not at {planned} ({', '.join(missing)}): parallelize with an example "
                             "batch of these shapes")
        return self._lower(cap, strategies, plan)

    def _write_token_scales(self, program: _Program, inputs) -> None:
        """Write each token loss's scale (``passes.token_mean``): ``ranks / tokens`` for a mean, ``tokens``
        counted on every microbatch of this rank and summed over dp, ``ranks`` for a sum; ``ranks``
        the losses averaged (dp x cp x microbatches)."""
        if not program.counted:
            return
        m = self.plan.microbatches
        ranks = self.mesh.data * m
        if program.counts is not None:
            slots = [n.meta for n in program.counts.graph.nodes if n.op == "placeholder"]
            total = 0
            for chunk in _chunks(inputs, m):
                named = dict(zip(program.input_names, (x for x in chunk if isinstance(x, torch.Tensor))))
                total = total + program.counts(*[self._buffers[s["fqn"]] if s.get("kind") == "buffer"
                                                 else named[s["name"]] for s in slots])
            if self.mesh.dp > 1:   # the cp ranks of a dp rank count the same whole sequences
                total = C.all_reduce(total, self._dp_group)
            means = iter((ranks / total).float())
        for k, counted in enumerate(program.counted):
            scale = self._buffers[scale_name(k)]
            scale.copy_(next(means)) if counted else scale.fill_(ranks)

    def _dp_rows(self, inputs: list) -> list:
        """This dp rank's rows of ``inputs``: a batch of the plan's per-rank size is this rank's own
        rows; any other is a global batch, split over dp."""
        rows = _batch_of(inputs)
        dp = self.mesh.dp
        local = self.plan.input_shapes[0][0] * self.plan.microbatches if self.plan.input_shapes else rows
        if dp == 1 or rows == local:
            return inputs
        if rows % dp:
            raise ValueError(f"a batch of {rows} rows does not split over dp={dp}: pass a multiple of {dp} rows "
                             f"(the global batch), or this rank's own {local} rows")
        return [x.narrow(0, self.coords["dp"] * (rows // dp), rows // dp)
                if isinstance(x, torch.Tensor) and x.dim() else x for x in inputs]

    # ---- gradients -----------------------------------------------------------------------

    def _sharded(self, fqn: str) -> bool:
        return isinstance(self._placement[fqn], Shard) and self.mesh.tp > 1

    def clip_grad_norm_(self, max_norm: float) -> torch.Tensor:
        """Scale gradients so their global norm (over every shard, each counted once) is <= max_norm."""
        if self._zero is not None:
            return self._zero.clip_grad_norm_(max_norm)
        sq = torch.zeros(2)
        for fqn, p in self._params.items():
            grad = self._grad(p)
            if grad is not None and self.owns(fqn):
                sq[0 if self._sharded(fqn) else 1] += grad.detach().float().pow(2).sum().cpu()
        if self._fsdp:   # each dp_shard rank holds its own rows (zero padding past the end); replicas the same
            sq = C.all_reduce(sq.to(self._device), self._shard_group).cpu()
        norm = self._norm(sq)
        if self._master is not None:   # the update multiplies the gradients: no pass that rewrites them
            self._master.grad_scale *= min(1.0, clip_coefficient(max_norm, norm))
        else:
            scale_to_norm([p.grad for p in self.parameters() if p.grad is not None], max_norm, norm)
        return norm

    def _grad(self, p: torch.nn.Parameter) -> torch.Tensor | None:
        """``p``'s gradient: ``p.grad``, or with MasterAdamW its working copy's (times the clip scale)."""
        if self._master is None:
            return p.grad
        grad = self._master.grad_of(p)
        return grad if grad is None or self._master.grad_scale == 1.0 else grad.float() * self._master.grad_scale

    def _norm(self, sq: torch.Tensor) -> torch.Tensor:
        """sqrt(sum over tp of sharded squares + replicated squares); sq = [sharded, replicated]."""
        if self.mesh.tp > 1:
            sq[0] = C.all_reduce(sq[0:1].to(self._device), self._tp_group).cpu()[0]
        if self._pipeline is not None:
            sq = C.all_reduce(sq.to(self._device), self._pipeline.pp_group).cpu()
        return sq.sum().sqrt()

    def owns(self, fqn: str) -> bool:
        """Whether this pipeline rank counts ``fqn`` (a weight on several stages counts once: in
        norms, gathers and checkpoints)."""
        return self._pipeline is None or self._pipeline.owner[fqn] == self.coords["pp"]

    def dp_rows(self, fqn: str) -> tuple[int, int] | None:
        """With ZeRO-2/3, the rows [start, stop) of ``fqn``'s tp shard that this rank's tensor holds
        (the tensor has ``shard_rows`` rows, zero past ``stop``); None when parameters are whole over dp."""
        if not self._fsdp:
            return None
        rows = self.plan.param(fqn).local_shape[0]
        c = shard_rows(rows, self.mesh.dp_shard)
        start = min(rows, self.coords["dp_shard"] * c)
        return start, min(rows, start + c)

    def group(self, axis: str) -> str | None:
        """The process group name this rank's collectives use on mesh axis ``axis``: "dp", "tp", "cp"
        (None without cp), and ZeRO's "dp_shard" (the ranks its state is split over: all of dp unless
        dp is split) and "dp_replicate" (the ranks holding the same shards: a split dp's replicas,
        and with cp every cp rank of them; None otherwise)."""
        groups = {"dp": self._dp_group, "tp": self._tp_group, "dp_shard": self._shard_group,
                  "dp_replicate": self._replicate_group, "cp": self._cp_group}
        if axis not in groups:
            raise ValueError(f"no process group for axis {axis!r}; the axes are {', '.join(groups)}")
        return groups[axis]

    @property
    def zero(self) -> Zero1 | None:
        """The ZeRO-1 state (the flat dp slice its optimizer steps), None without ZeRO."""
        return self._zero

    def stored_weights(self) -> dict[str, torch.Tensor]:
        """Each local shard's weights at full precision, by FQN, shaped like ``named_parameters()``:
        the parameters themselves, or with optimizer offload (below ZeRO-1) their fp32 masters in host
        memory. What checkpoints save and load (and the tensors the offloaded optimizer holds)."""
        masters = self._offload.masters if self._offload is not None and self._zero is None else {}
        return {fqn: masters.get(fqn, p) for fqn, p in self._params.items()}

    def weights_loaded(self) -> None:
        """Bring every copy of the weights up to date after ``stored_weights()`` were loaded in place
        (a checkpoint): ZeRO-1's slice from the shards, the device weights from offloaded masters."""
        if self._zero is not None:
            self._zero.refresh_slice()   # and, with offload, the slice's master at the next step
        elif self._offload is not None:
            self._offload.weights_in()

    def persistent_buffers(self) -> dict[str, torch.Tensor]:
        """The buffers the module's own ``state_dict`` holds (what checkpoints and exports carry), by FQN."""
        return {fqn: self._buffers[fqn] for fqn in self._persistent_buffers}

    # ---- state ---------------------------------------------------------------------------

    def full_state_dict(self) -> dict[str, torch.Tensor]:
        """Every parameter gathered to its full shape (tied names included), on CPU; loads into the
        unsharded model with ``load_state_dict(strict=False)`` (buffers are not included); with
        optimizer offload, the fp32 masters (``stored_weights``)."""
        stored = self.stored_weights()
        return self._gathered(lambda fqn: stored[fqn].detach())

    def full_grads(self) -> dict[str, torch.Tensor]:
        """Every parameter's gradient (after ``train_step``) gathered to its full shape, on CPU,
        under the same names as ``full_state_dict``: what to compare with an unsharded model.
        With zero=1 they are the flat dp slices' gradients, all-gathered over dp first."""
        if self._zero is not None:
            z = self._zero
            if z.shard.grad is None:
                raise RuntimeError("full_grads() needs gradients: run train_step first")
            with torch.no_grad():
                flat = C.all_gather(z.shard.grad.detach(), 0, z.group, z.size, z.rank, z.total, False)
            grads = {fqn: piece.view_as(p).float() for (fqn, p), piece
                     in zip(self._params.items(), flat[:sum(z.sizes)].split(z.sizes))}
            return self._gathered(lambda fqn: grads[fqn])
        if any(self._grad(p) is None for p in self._params.values() if p.requires_grad):
            raise RuntimeError("full_grads() needs gradients: run train_step first")
        return self._gathered(lambda fqn: self._grad(self._params[fqn]).float())

    def _gathered(self, tensor_of) -> dict[str, torch.Tensor]:
        out = {}
        with torch.no_grad():
            for q in self.plan.parameters:
                fqn, full, pl = q.fqn, q.shape, self._placement[q.fqn]
                x = tensor_of(fqn) if fqn in self._params else None
                if self._fsdp and x is not None:   # the dp shards, whole again
                    x = C.all_gather(x.to(self._device), 0, self._shard_group, self.mesh.dp_shard,
                                     self.coords["dp_shard"], q.local_shape[0], False)
                if self._pipeline is not None:   # the owning stage's copy, sent to every pp rank
                    mine = x if x is not None and self.owns(fqn) else torch.zeros(self.plan.param(fqn).local_shape)
                    x = C.all_reduce(mine.to(self._device), self._pipeline.pp_group)
                if self._sharded(fqn):
                    x = C.all_gather(x.to(_comm_device()), pl.dim, self._tp_group, self.mesh.tp,
                                     self.coords["tp"], full[pl.dim] // pl.interleave, False, pl.interleave)
                for name in (fqn, *self._aliases[fqn]):
                    out[name] = x.cpu().clone()
        return out


# torch.compile modes (Inductor) that replay CUDA graphs
CUDA_GRAPH_MODES = ("reduce-overhead", "max-autotune")
MODES = ("default", "max-autotune-no-cudagraphs", *CUDA_GRAPH_MODES)


def lower(gm: torch.fx.GraphModule, compile, *, regather: bool = False, order=None):
    """``gm`` as a rank runs it: ``compile`` True lowers through Inductor, one of ``MODES`` through
    Inductor in that torch.compile mode, another string or a callable names a torch.compile
    backend (e.g. "aot_eager"), False runs it eagerly. ``regather`` (ZeRO-3): Inductor re-gathers
    the weights in the backward instead of saving the forward's gathered copies
    (``autopar.overlap.RegatherInBackward``; AOTAutograd would otherwise merge the two gathers).
    ``order`` (a ``compile_once.CompileOrder``): Inductor's compiles wait for the peer that
    compiles them first."""
    if not compile:
        return gm
    if isinstance(gm, _LazyGraphModule):
        # dynamo would trace the wrapper that generates the code (frames of its own), not the graph's code
        gm.real_recompile()
    options = {"joint_custom_pre_pass": RegatherInBackward()} if compile is True and regather else None
    if order is not None and uses_inductor(compile):
        named = compile is True or compile == "inductor" or compile in MODES
        backend = (torch._TorchCompileInductorWrapper(compile if compile in MODES else None, options, None)
                   if named else compile)
        return torch.compile(gm, backend=order.wrap(backend))
    if options:
        return torch.compile(gm, options=options)
    if compile is True or compile in MODES:
        return torch.compile(gm, mode=None if compile is True else compile)
    return torch.compile(gm, backend=compile)


def uses_inductor(compile) -> bool:
    """Whether ``compile`` lowers through Inductor: True, a mode, "inductor", or a partial of
    Inductor's ``compile_fx`` (``autopar.overlap.overlap_backend``)."""
    if compile is True or compile in MODES or compile == "inductor":
        return True
    if not isinstance(compile, functools.partial):   # no import of Inductor (seconds) to answer False
        return False
    from torch._inductor.compile_fx import compile_fx
    return compile.func is compile_fx


def _prefetches(compile) -> bool:
    """Whether ZeRO-2/3's gathers are launched a unit ahead (``zero_pass(prefetch=)``): always on NCCL;
    on gloo only in Inductor's code (``compile=True``, a mode, or a backend function such as
    ``autopar.overlap.overlap_backend``'s). A gather left in flight on gloo while the graph ran on
    eagerly (no compile, or the "aot_eager" backend) corrupted the heap there: tests/test_zero.py
    crashed in 3 runs of 3 with "malloc(): unaligned tcache chunk detected" (torch 2.13, CPU), and
    passed in 2 of 2 with every gather waited at its launch. Inductor's code, whose buffers and waits
    it places itself, ran its prefetched gathers on gloo in tests/test_zero_overlap.py and
    test_zero_memory.py without fault."""
    if "gloo" not in str(dist.get_backend()):
        return True
    return compile is True or compile in MODES or callable(compile)


def _inductor_on_cuda(compile) -> bool:
    """Whether ``compile`` lowers through Inductor onto CUDA with Triton (where autopar's kernels pay)."""
    return ((compile is True or compile in MODES) and default_device_type() == "cuda"
            and triton_available())


def _batch_of(inputs) -> int:
    """The rows of a batch: dim 0 of its tensor inputs, which must agree."""
    rows = {tuple(x.shape)[0] for x in inputs if isinstance(x, torch.Tensor) and x.dim()}
    if len(rows) != 1:
        shapes = ", ".join(str(list(x.shape)) for x in inputs if isinstance(x, torch.Tensor))
        raise ValueError(f"the inputs' shapes {shapes or '(none)'}: every tensor input must have the batch in dim 0, "
                         "with the same number of rows")
    return rows.pop()


def _chunks(inputs, m: int):
    """The ``m`` microbatches of ``inputs`` (dim 0 of every tensor)."""
    return zip(*[x.chunk(m) if isinstance(x, torch.Tensor) and x.dim() else [x] * m for x in inputs])


def _shape_key(shapes) -> tuple[tuple[int, ...], ...]:
    return tuple(tuple(int(d) for d in s) for s in shapes)


def _comm_device():
    return torch.device("cuda", torch.cuda.current_device()) if default_device_type() == "cuda" else torch.device("cpu")


def _all_reduce_mean(tensors, group: str, size: int) -> list[torch.Tensor]:
    """The mean of ``tensors`` over a group, as views of one flat buffer: one all-reduce, not
    one per tensor, and 16-bit tensors are summed in fp32 (at least)."""
    if not tensors:
        return []
    dtype = functools.reduce(torch.promote_types, (t.dtype for t in tensors), torch.float32)
    flat = torch.empty(sum(t.numel() for t in tensors), dtype=dtype, device=_comm_device())
    torch.cat([t.reshape(-1) for t in tensors], out=flat)
    C.all_reduce_mean_(flat, group, size)
    return [piece.view_as(t) for t, piece in zip(tensors, flat.split([t.numel() for t in tensors]))]


def _adopt_shards(model, local: dict[str, torch.nn.Parameter], fqns, device) -> dict[int, weakref.ref]:
    """Make ``model``'s parameters (canonical ``fqns``) the shards ``local``, every name of a tied
    weight the same shard, one this rank does not hold an empty tensor. Returns weak references to
    the replaced tensors by id, so that an optimizer still holding one can be recognised (the
    weak reference, unlike the id alone, cannot mistake a new tensor at a reused address)."""
    names: dict[int, list[str]] = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        names.setdefault(id(p), []).append(name)
    full = dict(model.named_parameters(remove_duplicate=False))
    replaced = {}
    for fqn in fqns:
        old = full[fqn]
        new = local.get(fqn)
        if new is None:
            new = torch.nn.Parameter(torch.empty(0, dtype=old.dtype, device=device), requires_grad=old.requires_grad)
        replaced[id(old)] = weakref.ref(old)
        for name in names[id(old)]:
            owner, _, attr = name.rpartition(".")
            setattr(model.get_submodule(owner), attr, new)
    return replaced


def _guard_optimizer_steps(pm: ParallelModel) -> None:
    """Run ``pm._refuse_inert`` before every torch optimizer's step, through torch.optim's global
    step pre-hook (the one way to see an optimizer that ``pm.optimizer`` did not build). The hook
    holds ``pm`` weakly and is removed when ``pm`` is collected."""
    ref = weakref.ref(pm)

    def hook(optimizer, args, kwargs):
        alive = ref()
        if alive is not None:
            alive._refuse_inert(optimizer)

    handle = register_optimizer_step_pre_hook(hook)
    weakref.finalize(pm, handle.remove)


def _refuse_unsharded_call(module, args):
    raise RuntimeError(f"this {type(module).__name__} was given to autopar.parallelize: its parameters are now "
                       "this rank's shards, not its full weights, so it no longer runs on its own; run "
                       "pm.train_step(...) (or pm.eval_step(...) for the loss alone), or load "
                       "pm.full_state_dict() into a freshly built model")


def _dp_shard(p: torch.nn.Parameter, size: int, rank: int) -> torch.nn.Parameter:
    """This dp rank's rows of ``p`` (dim 0, ``shard_rows`` of them, zero-padded past the end)."""
    rows = shard_rows(p.shape[0], size)
    start = min(p.shape[0], rank * rows)
    piece = p.detach()[start:start + rows]
    shard = torch.zeros((rows, *p.shape[1:]), dtype=p.dtype, device=p.device)
    shard[:piece.shape[0]] = piece
    return torch.nn.Parameter(shard, requires_grad=p.requires_grad)


def _materialize(model, cap, placements, size: int, rank: int, fqns) -> dict[str, torch.nn.Parameter]:
    """Local shards of ``fqns``: sliced from real weights, or for a meta model initialised shard by shard."""
    full = dict(model.named_parameters())
    dev = _comm_device()
    out = {}
    for fqn in (f for f in cap.params if f in fqns):
        p, pl = full[fqn], placements[fqn]
        if p.is_meta:
            init = getattr(model, "init_parameter", None)
            if init is None:
                raise ValueError(f"{fqn} is on the meta device and {type(model).__name__} has no "
                                 "init_parameter(fqn, tensor) method; build the model on a real device "
                                 "or give it one")
            local = torch.empty(local_shape(p.shape, pl, size), dtype=p.dtype, device=dev)
            seed = int(hashlib.sha256(f"{fqn}/{rank}".encode()).hexdigest()[:8], 16)
            with torch.random.fork_rng(devices=[]):
                torch.manual_seed(seed)
                init(fqn, local)
        else:
            local = shard_tensor(p.detach().to(dev), pl, size, rank)
        out[fqn] = torch.nn.Parameter(local, requires_grad=p.requires_grad)
    return out
