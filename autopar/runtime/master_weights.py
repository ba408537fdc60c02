"""fp32 master weights held by the optimizer, and persistent 16-bit copies the graph computes with.

With ``precision="bf16"`` a ParallelModel keeps fp32 parameters and, by default, casts them to
bf16 inside its compiled graph every step; their gradients come back as fp32 (a bf16 gradient
cast up) for any torch optimizer. Over a step that is a cast down (6 bytes per parameter) and a
cast up (6 more), beside the 28 bytes AdamW moves.

``pm.optimizer(MasterAdamW, ...)`` removes both. The graph then takes persistent bf16 copies of
the weights as its inputs (``WorkingWeights``), their bf16 gradients stay where autograd leaves
them, and one fused kernel per tensor (``autopar::adamw_master_``) reads the bf16 gradient and
writes the fp32 master, both moments and the next step's bf16 copy. The numbers are those of the
default path: a bf16 gradient cast to fp32 is exact, and the copy is the master rounded once.
On one H200, for the 0.5 B-parameter h=2048 GPT of bench/compile_gpu.py, the update took 3.6 ms
against torch's fused AdamW's 4.2 ms, the forward lost its weight-cast kernels, and the step
was 1.2-1.4 ms shorter at batch 32 (0.1 ms at batch 8; BENCHMARKS.md).

What changes for the caller: ``p.grad`` of ``pm.parameters()`` stays None (the gradients live on
the working copies); ``pm.clip_grad_norm_`` and ``pm.full_grads`` read them there, and a torch
utility that walks ``p.grad`` sees none. Any other torch optimizer over those parameters (the
model's own included) would therefore update nothing: once MasterAdamW is built, such an
optimizer raises at its ``step()`` (``ParallelModel``'s step guard). Supported where each step
is one forward and backward on one stage with bf16 compute: pp = 1, one microbatch, no ZeRO;
dp > 1 sums the gradients in fp32, as the default path does, and a weight whose gradient the
graph sums over tp (a replicated norm weight under sequence parallelism) keeps an fp32 copy,
small as it is, so that sum is not rounded to bf16. Gradients do not add up across ``train_step`` calls (they would in
bf16): ``opt.zero_grad()`` comes before each.

With ``offload="optimizer"`` the masters live in host memory instead (``autopar.runtime.offload``):
the device parameters are then the bf16 working weights themselves, so there is nothing for
MasterAdamW to fuse and ``pm.optimizer(MasterAdamW)`` is refused there.
"""
from __future__ import annotations

import torch

from autopar.kernels.adamw import adamw_master_


class WorkingWeights:
    """The 16-bit copies of a rank's fp32 parameters that its graph takes as inputs.

    A copy is rewritten by ``MasterAdamW`` together with its master. A master changed any other
    way (a checkpoint load, an edit under ``torch.no_grad``) bumps its version counter, and
    ``refresh`` re-rounds its copy before the next forward, so the copies never go stale."""

    def __init__(self, params: dict[str, torch.nn.Parameter], dtype: torch.dtype, fp32: set[str] = frozenset()):
        self.params = params
        self._fqn = {id(p): fqn for fqn, p in params.items()}
        with torch.no_grad():
            # a weight the graph feeds to a collective (copy_to: its gradient is summed over tp)
            # keeps an fp32 copy, so that sum is not rounded to 16 bits before the update
            self.copies = {fqn: p.detach().to(torch.float32 if fqn in fp32 else dtype, copy=True)
                           .requires_grad_(p.requires_grad) for fqn, p in params.items()}
        self._version = {fqn: p._version for fqn, p in params.items()}
        self.reduced: dict[str, torch.Tensor] | None = None   # fp32 gradients after a dp all-reduce
        self.grad_scale = 1.0                                   # set by gradient clipping

    def refresh(self) -> None:
        """Re-round the copy of every master that changed since its copy was written."""
        with torch.no_grad():
            for fqn, p in self.params.items():
                if p._version != self._version[fqn]:
                    self.copies[fqn].copy_(p)
                    self._version[fqn] = p._version

    def written(self, param: torch.nn.Parameter) -> None:
        """Record that ``param``'s copy was rewritten from it (by the optimizer's kernel)."""
        self._version[self._fqn[id(param)]] = param._version

    def grads(self) -> dict[str, torch.Tensor]:
        """Every gradient the backward left on the copies (16-bit), by parameter name."""
        return {fqn: c.grad for fqn, c in self.copies.items() if c.grad is not None}

    def use_reduced(self, grads: dict[str, torch.Tensor]) -> None:
        """Take ``grads`` (summed over dp, fp32) in place of the copies' own, which are dropped."""
        for c in self.copies.values():
            c.grad = None
        self.reduced = grads

    def grad(self, fqn: str) -> torch.Tensor | None:
        """``fqn``'s gradient as the step left it (bf16, or fp32 once summed over dp), unscaled."""
        if self.reduced is not None:
            return self.reduced.get(fqn)
        return self.copies[fqn].grad

    def grad_of(self, param: torch.nn.Parameter) -> torch.Tensor | None:
        """The gradient of a master parameter (see ``grad``)."""
        return self.grad(self._fqn[id(param)])

    def copy_of(self, param: torch.nn.Parameter) -> torch.Tensor:
        """The working copy of a master parameter."""
        return self.copies[self._fqn[id(param)]]

    def zero_grad(self) -> None:
        """Drop every gradient and the clipping scale."""
        for c in self.copies.values():
            c.grad = None
        self.reduced = None
        self.grad_scale = 1.0


class MasterAdamW(torch.optim.Optimizer):
    """AdamW on a ParallelModel's fp32 master weights that also writes their bf16 working copies.

    Build it with ``pm.optimizer(autopar.MasterAdamW, lr=..., betas=..., eps=...,
    weight_decay=...)``, or with parameter groups, ``pm.optimizer(autopar.MasterAdamW, [{"params":
    ..., "weight_decay": 0.0}, ...], lr=...)``; the maths is torch.optim.AdamW's
    (``autopar.kernels.adamw``) and the state (``step``, ``exp_avg``, ``exp_avg_sq`` per parameter)
    has its layout, so checkpoints and learning-rate schedulers treat it as AdamW. On CUDA each
    tensor is one Triton kernel."""

    def __init__(self, params, working: WorkingWeights, lr: float = 1e-3, betas=(0.9, 0.999), eps: float = 1e-8,
                 weight_decay: float = 1e-2):
        super().__init__(params, dict(lr=lr, betas=tuple(betas), eps=eps, weight_decay=weight_decay))
        self.working = working
        for k, group in enumerate(self.param_groups):
            lr, betas, eps, weight_decay = (group[key] for key in ("lr", "betas", "eps", "weight_decay"))
            if not 0.0 <= lr or not 0.0 <= eps or not all(0.0 <= b < 1.0 for b in betas) or weight_decay < 0.0:
                where = f" of parameter group {k}" if len(self.param_groups) > 1 else ""
                raise ValueError(f"MasterAdamW: invalid hyperparameters{where} lr={lr}, betas={betas}, eps={eps}, "
                                 f"weight_decay={weight_decay}")
            for p in group["params"]:
                if id(p) not in working._fqn:
                    raise ValueError("MasterAdamW updates a ParallelModel's own parameters; build it with "
                                     "pm.optimizer(autopar.MasterAdamW, ...)")

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Drop the gradients (they live on the working copies; always set to None)."""
        self.working.zero_grad()

    @torch.no_grad()
    def step(self, closure=None):
        """One update of every parameter that has a gradient, and of its working copy."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            beta1, beta2 = group["betas"]
            for p in group["params"]:
                grad = self.working.grad_of(p)
                if grad is None:
                    continue
                state = self.state[p]
                if not state:
                    # torch.optim.AdamW keeps the step count as a CPU tensor: the same layout
                    state["step"] = torch.tensor(0.0)
                    state["exp_avg"] = torch.zeros_like(p, memory_format=torch.contiguous_format)
                    state["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.contiguous_format)
                state["step"] += 1
                adamw_master_(p, grad, state["exp_avg"], state["exp_avg_sq"], self.working.copy_of(p), int(state["step"]), float(group["lr"]), beta1, beta2, group["eps"],
                              group["weight_decay"], self.working.grad_scale)
                self.working.written(p)
        return loss
