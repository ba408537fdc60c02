"""ParallelModel: one rank's share of a parallelized model, and its training step.

It holds what the rank's program (``runtime.program``) made: the shards (``runtime.parameters``),
the lowered graphs per microbatch shape (``runtime.lowering``), and the runtime pieces the plan
asks for (ZeRO-1, offload, working copies, master weights, loss scaling); the step's batch
handling is ``runtime.step``, the norm and the gathered tensors ``runtime.gradients``, the
optimizers ``runtime.optimizers``.
"""
from __future__ import annotations

import warnings

import torch
import torch.distributed as dist

from autopar.passes.context_parallel import check_sequence
from autopar.runtime import gradients, step
from autopar.runtime.compiler import lower   # also importable from here, where it lived
from autopar.runtime.lowering import Lowered, lower_program
from autopar.runtime.offload import HostMasters, Offload, backward_listening
from autopar.runtime.offload_optimizer import slice_masters
from autopar.runtime.optimizers import OptimizerGuard, build_optimizer
from autopar.runtime.parameters import (adopt_shards, mark_static, materialize, rank_buffers,
                                        refuse_unsharded_call, summed_params)
from autopar.runtime.precision import LossScaler, WorkingCopies
from autopar.runtime.program import Program, program_for
from autopar.runtime.zero import Zero1, zero1_layout

__all__ = ["ParallelModel", "lower"]


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
    that ``optimizer(...)`` steps) and at 16 bits (they go to fp32 buffers, for the fp32 masters
    that ``optimizer(...)`` steps). There any other optimizer stepping these parameters raises at
    its ``step()``, naming ``pm.optimizer(...)``; so does one built over the model's parameters
    before ``parallelize`` replaced them.

    With ``plan.precision`` "bf16" or "fp16" the graph computes at 16 bits and every gradient sum
    runs in fp32 (``autopar.runtime.precision``). Below ZeRO-2 and without offload the rank keeps
    Megatron-LM's distributed-optimizer layout (``autopar.runtime.zero``): the parameters are
    16-bit, their gradients accumulate in an fp32 buffer, and the fp32 master weights and
    optimizer state are a flat slice, split over dp x cp with zero=1 (each ``train_step``'s
    gradients replace the last's); ZeRO-2/3 keep fp32 dp shards, gathered at 16 bits. fp16
    scales the loss (``loss_scaler``); a step whose gradients overflow on any rank leaves every
    rank's gradients None, so the optimizer skips it, and sets ``step_skipped``.

    With ``plan.offload`` "optimizer" the fp32 master weights and the optimizer state live in
    host memory and ``optimizer(cls, ...)`` steps them on the CPU (``autopar.runtime.offload``);
    at bf16 the parameters on the device are then bf16 themselves. The units ``plan.offload_kept``
    names keep theirs on the device, stepped there beside the host (``runtime.offload_optimizer``).
    Where a unit's gradients are final inside the backward, ``train_step`` starts its host update
    there (``offload_overlap``); ``plan.offload_delay`` = 1 lands each host update one step late.
    Any other optimizer over ``parameters()`` raises at its ``step()``.

    ``program`` is this rank's share of the plan as data (``autopar.runtime.program``), from which
    it was built; ``graph_module`` the program's graph as the passes left it (before any pipeline
    split), ``pass_seconds`` the (pass, seconds) each of them took (``autopar.passes.driver``)."""

    def __init__(self, model, program: Program, cap, *, recapture=None):
        """``model``'s share that ``program`` (``program_for``'s, for this rank) names, lowered on the
        plan's capture ``cap``; ``model`` becomes it (see the class docstring). ``recapture(inputs)``,
        given, returns the capture, strategies and plan of the plan's choices for a global batch of
        other shapes (``autopar.api``): a batch or sequence length other than the example's is then
        lowered anew on the same parameters."""
        self.program, self.plan, self.mesh, self.coords = program, program.plan, program.mesh, program.coords
        self._device, self._recapture = program.device, recapture
        self._buffers, self._persistent_buffers = rank_buffers(model, cap, program.device)
        # One microbatch on one stage: the 16-bit weight copies are cast inside the compiled graph,
        # where Inductor fuses them into its own kernels, instead of ~2 eager kernels per weight per
        # step. With several microbatches the copies are made once per step and shared (``WorkingCopies``).
        self._casts = WorkingCopies(program.casts, names=cap.params)
        self.loss_scaler = LossScaler() if program.loss_scaling else None
        self.step_skipped = False
        self._params = materialize(model, program)
        # ZeRO-1's slice, or at 16 bits the distributed optimizer's (which narrows the parameters
        # before anything is lowered on them)
        self._zero = (Zero1(self._params, {f for f, s in program.params.items() if s.sharded},
                            norm=lambda sq: gradients.global_norm(sq, program), **zero1_layout(program),
                            owned={f for f in program.params if program.owns(f)})
                      if program.zero1 or program.main_grads else None)
        self._program = self._lower(program, cap)
        self._programs = {program.shapes: self._program}
        self._offload = None   # runtime.offload.Offload with plan.offload: the host masters and their updates
        if program.offload:   # at 16 bits below ZeRO-1 the host copy is the master: the device keeps 16-bit weights
            kept = program.offload_kept
            host = (slice_masters(self._zero, kept) if self._zero is not None else
                    HostMasters({f: p for f, p in self._params.items() if f not in kept}, dtype=program.host_dtype,
                                keep_fp32=summed_params(self.graph_module)))
            self._offload = Offload(host, delay=self.plan.offload_delay, units=program.offload_units or None)
        if program.cuda_graphs:   # replayed graphs read weights and buffers where they were recorded
            mark_static([*self._params.values(), *self._buffers.values()])
        self._guard = OptimizerGuard(self._params, adopt_shards(model, self._params, cap.params, program.device))
        self._guard.install(self, lambda pm: (pm._zero, pm._offload))
        if not program.runs_whole:
            model.register_forward_pre_hook(refuse_unsharded_call)

    def _lower(self, program: Program, cap) -> Lowered:
        """``program`` lowered on ``cap``, computing with this rank's parameters."""
        return lower_program(program, cap, self._params, self._buffers, prepare=self._casts,
                             loss_scale=lambda: self.loss_scale)

    # ---- parameters ----------------------------------------------------------------------

    def named_parameters(self):
        """(FQN, local shard) of every parameter this rank holds; the model's own, since parallelize."""
        return iter(self._params.items())

    def parameters(self):
        """This rank's local shards, the same tensors as the model's parameters (see the class docstring)."""
        return iter(self._params.values())

    def optimizer(self, cls=torch.optim.AdamW, params=None, **defaults):
        """``cls`` over this rank's local shards, built for how this model keeps its gradients and
        weights; with zero=1 its state is also sharded over dp. ``params`` as torch optimizers take
        it: None (every local shard), an iterable of this rank's parameters (``parameters()``, the
        parallelized model's ``parameters()``: the same tensors), or a list of group dicts, each
        ``{"params": ..., **options}`` (e.g. no weight decay on norms and biases); ``defaults``
        (``lr=...``) apply where a group sets no option of its own. A 0-element parameter (a weight
        of a pipeline stage this rank does not run) is left out of its group; a tensor that is not
        one of this rank's parameters, or one in two groups, raises ValueError.
        ``cls=autopar.MasterAdamW`` runs AdamW's update as one fused kernel per tensor
        (``autopar.runtime.master_weights``). At 16 bits (below ZeRO-2, without offload) ``cls``
        steps the fp32 master weights, a flat slice split over dp x cp with zero=1, and the
        parameters are rebuilt from them after each step (``autopar.runtime.zero``). With
        ``plan.offload`` "optimizer" ``cls`` steps fp32 host copies of the shards on the CPU
        (``autopar.runtime.offload``); on a slice each group steps its runs of it
        (``autopar.runtime.zero.SliceOptimizer``)."""
        return build_optimizer(cls, self._guard.groups(params), defaults, params=self._params, zero=self._zero,
                               offload=self._offload, kept=self.program.offload_kept, guard=self._guard)

    @property
    def offload_overlap(self) -> bool:
        """With offload where the gradients are final inside the backward (``runtime.offload``):
        whether ``train_step``'s backward starts each unit's host update as its gradients arrive
        (the default there). Set it False to update after the backward, e.g. to clip the gradients
        first; False wherever the layout updates after the backward anyway."""
        return self._offload is not None and self._offload.units is not None and self._offload.overlap

    @offload_overlap.setter
    def offload_overlap(self, on: bool) -> None:
        if on and not (self._offload is not None and self._offload.units is not None):
            raise ValueError("offload_overlap: this model's host updates cannot start in the backward (no "
                             "offload, a delayed update, pp > 1, ZeRO-1, or a dp or cp sum after the backward: "
                             "autopar.runtime.offload)")
        if self._offload is not None:
            self._offload.settle()
            self._offload.overlap = bool(on)

    # ---- the step ------------------------------------------------------------------------

    @property
    def loss_scale(self) -> float:
        """What backward's loss is multiplied by: the fp16 loss scale, else 1."""
        return self.loss_scaler.scale if self.loss_scaler is not None else 1.0

    @property
    def graph_module(self) -> torch.fx.GraphModule:
        """This rank's program as the passes left it (before any pipeline split), for the plan's batch shapes."""
        return self._programs[self.program.shapes].graph_module

    @property
    def pass_seconds(self) -> list:
        """(pass name, seconds) of each pass that built ``graph_module`` (``autopar.passes.driver``)."""
        return self._programs[self.program.shapes].pass_seconds

    def __call__(self, *inputs) -> torch.Tensor:
        """The loss of a batch, forward only: ``eval_step``."""
        return self.eval_step(*inputs)

    def eval_step(self, *inputs) -> torch.Tensor:
        """The loss of a batch, forward only (no gradients, no update): what ``train_step`` would
        return for it, the mean over every microbatch and dp rank. Inputs as ``train_step`` takes them."""
        program, inputs = self._prepare(inputs)
        self._settle()
        with torch.no_grad(), self._casts.step():
            if program.pipeline is not None:
                total = program.pipeline.step(dict(zip(program.input_names, inputs)), train=False)
            else:
                m = self.plan.microbatches
                total = sum(self._forward(program, chunk) for chunk in step.microbatches(inputs, m)) / m
        return step.data_mean(total, self.program)

    def train_step(self, *inputs) -> torch.Tensor:
        """Forward and backward over all microbatches, then gradient sync over dp.

        Inputs are the global batch (each dp rank takes its slice), or this dp rank's own rows
        when their count is the plan's per-rank batch (the global batch / dp). A batch or sequence
        length other than the plan's is lowered anew once, with the plan's choices. Returns the
        full batch's loss: a mean over tokens is over the tokens of every microbatch and rank
        (``autopar.passes.token_mean``), as the unsharded model computes it."""
        m = self.plan.microbatches
        program, inputs = self._prepare(inputs)
        if self._zero is not None:
            self._zero.begin_step()
        self._settle()
        if self.program.cuda_graphs:   # the last step's graph outputs are consumed: their memory may be reused
            torch.compiler.cudagraph_mark_step_begin()
        with self._casts.step():
            if program.pipeline is not None:
                grads = self._zero.main_grads if self._zero is not None and self._zero.main is not None else None
                total = program.pipeline.step(dict(zip(program.input_names, inputs)), grads=grads)
            else:
                total = 0.0
                for k, chunk in enumerate(step.microbatches(inputs, m)):
                    loss = self._forward(program, chunk)
                    with backward_listening(self._offload, last=k == m - 1):
                        (loss * self.loss_scale / m).backward()
                    total = total + loss.detach() / m
        total = step.data_mean(total, self.program)   # the ranks' losses average to the batch's
        step.sync_gradients(self.program, self._params, self._zero)
        if self.loss_scaler is not None:
            self._unscale_grads()
        return total

    def _settle(self) -> None:
        """Before a forward: the weights of a host update the last backward started are in."""
        if self._offload is not None and self._offload.stepped:
            self._offload.settle()

    def _unscale_grads(self):
        """Divide the gradients by the loss scale; after an inf/nan on any rank, drop them on all."""
        holders = [self._zero.shard] if self._zero is not None else list(self.parameters())
        grads = [p.grad for p in holders if p.grad is not None]
        self.step_skipped = self.loss_scaler.unscale_(grads, dist.group.WORLD.group_name, self._device)
        if self.step_skipped:
            for p in holders:
                p.grad = None   # torch optimizers leave a parameter without a gradient untouched

    def _forward(self, program: Lowered, inputs) -> torch.Tensor:
        """One microbatch's forward through ``program`` (pp = 1): this rank's share of the loss."""
        args, it = [], iter(inputs)
        params = self._params
        for kind, fqn in program.slots:
            args.append(self._casts(fqn, params[fqn]) if kind == "param"
                        else self._casts(fqn, self._buffers[fqn]) if kind == "buffer" else next(it))
        out = program.fn(*args)
        return out[0] if isinstance(out, (tuple, list)) else out

    def _prepare(self, inputs) -> tuple[Lowered, list]:
        """This rank's rows of a batch and the program for their shapes (lowered now if new), with
        the step's token-mean scales written."""
        inputs = step.local_rows(self.program, list(inputs))
        shapes = step.microbatch_shapes(inputs, self.plan.microbatches)
        program = self._programs.get(shapes)
        if program is None:
            program = self._programs[shapes] = self._relower(inputs, shapes)
        self._program = program
        step.write_token_scales(self.program, program, self._buffers, inputs)
        return program, inputs

    def _relower(self, inputs, shapes) -> Lowered:
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
        p = self.program
        return self._lower(program_for(plan, p.rank, cap, strategies, groups=p.groups, device=p.device,
                                       compile=p.compile, loss_kernel=p.loss_kernel), cap)

    # ---- gradients and state ---------------------------------------------------------------

    def clip_grad_norm_(self, max_norm: float) -> torch.Tensor:
        """Scale gradients so their global norm (over every shard, each counted once) is <= max_norm."""
        if self._offload is not None and self._offload.stepped:
            raise RuntimeError("clip_grad_norm_: the host already updated the offloaded units with these gradients "
                               "during train_step's backward (each unit as its gradients arrived); to clip, set "
                               "pm.offload_overlap = False before train_step, so the host updates after the backward")
        if self._zero is not None:
            return self._zero.clip_grad_norm_(max_norm)
        return gradients.clip_grad_norm(self.program, self._params, max_norm)

    def owns(self, fqn: str) -> bool:
        """Whether this pipeline rank counts ``fqn`` (a weight on several stages counts once: in
        norms, gathers and checkpoints)."""
        return self.program.owns(fqn)

    def dp_rows(self, fqn: str) -> tuple[int, int] | None:
        """With ZeRO-2/3, the rows [start, stop) of ``fqn``'s tp shard that this rank's tensor holds
        (the tensor has ``shard_rows`` rows, zero past ``stop``); None when parameters are whole over dp."""
        return self.program.dp_rows(fqn)

    def group(self, axis: str) -> str | None:
        """The process group name this rank's collectives use on mesh axis ``axis``: "dp", "tp", "cp"
        (None without cp), and ZeRO's "dp_shard" (the ranks its state is split over: all of dp unless
        dp is split) and "dp_replicate" (the ranks holding the same shards: a split dp's replicas,
        and with cp every cp rank of them; None otherwise)."""
        axes = ("dp", "tp", "dp_shard", "dp_replicate", "cp")
        if axis not in axes:
            raise ValueError(f"no process group for axis {axis!r}; the axes are {', '.join(axes)}")
        return self.program.groups.of(axis)

    @property
    def zero(self) -> Zero1 | None:
        """The flat slice its optimizer steps (``runtime.zero.Zero1``): ZeRO-1's, or at 16 bits the
        distributed optimizer's (fp32 masters and gradient buffers); None without either."""
        return self._zero

    def stored_weights(self) -> dict[str, torch.Tensor]:
        """Each local shard's weights at full precision, by FQN, shaped like ``named_parameters()``:
        the parameters themselves; at 16 bits their fp32 masters (gathered from the slices:
        collective, ``Zero1.master_weights``); with optimizer offload the fp32 masters in host
        memory of the offloaded units (every update the host made, one not yet on the device
        included: ``runtime.offload``)."""
        off = self._offload
        if off is not None:
            off.worker.drain()
        if self._zero is not None:
            if off is not None and off.pending:   # the slice with the host's runs as they are now (collective)
                flat = self._zero.shard.detach().clone()
                for name, master in off.host.masters.items():
                    at = int(name.split(":")[1])
                    flat[at:at + master.numel()].copy_(master)
                return dict(zip(self._params, self._zero.weights_from(flat)))
            return dict(zip(self._params, self._zero.master_weights()))
        masters = off.host.masters if off is not None else {}
        return {fqn: masters.get(fqn, p) for fqn, p in self._params.items()}

    def weights_loading(self) -> None:
        """Before a checkpoint is loaded in place: a delayed host update still to come in is
        applied now (the load then writes over both copies), so ``stored_weights`` are the tensors
        the load fills."""
        off = self._offload
        if off is not None:
            off.settle()
            if off.pending:
                off.host.weights_in()
                off.pending = False
                if self._zero is not None:
                    self._zero.all_gather_params()

    def weights_loaded(self) -> None:
        """Bring every copy of the weights up to date after a checkpoint was loaded in place: the
        parameters from the 16-bit path's master slice, ZeRO-1's fp32 slice from the shards, the
        device weights from offloaded masters (``autopar.checkpoint``)."""
        if self._offload is not None:
            self._offload.discard()
        if self._zero is not None:
            self._zero.loaded()   # and, with offload, the slice's host runs at the next step
        elif self._offload is not None:
            self._offload.host.weights_in()

    def persistent_buffers(self) -> dict[str, torch.Tensor]:
        """The buffers the module's own ``state_dict`` holds (what checkpoints and exports carry), by FQN."""
        return {fqn: self._buffers[fqn] for fqn in self._persistent_buffers}

    def full_state_dict(self) -> dict[str, torch.Tensor]:
        """Every parameter gathered to its full shape (tied names included), on CPU; loads into the
        unsharded model with ``load_state_dict(strict=False)`` (buffers are not included); with
        optimizer offload, the fp32 masters (``stored_weights``)."""
        stored = self.stored_weights()
        return gradients.gathered(self.program, lambda fqn: stored[fqn].detach())

    def full_grads(self) -> dict[str, torch.Tensor]:
        """Every parameter's gradient (after ``train_step``) gathered to its full shape, on CPU,
        under the same names as ``full_state_dict``: what to compare with an unsharded model.
        With zero=1 they are the flat dp slices' gradients, all-gathered over dp first."""
        if self._zero is not None:
            grads = gradients.zero1_grads(self._zero, self._params)
            return gradients.gathered(self.program, grads.__getitem__)
        if any(p.grad is None for p in self._params.values() if p.requires_grad):
            raise RuntimeError("full_grads() needs gradients: run train_step first")
        return gradients.gathered(self.program, lambda fqn: self._params[fqn].grad.float())
