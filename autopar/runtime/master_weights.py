"""MasterAdamW: torch.optim.AdamW's update on fp32 master weights, one fused kernel per tensor.

With ``precision="bf16"`` or ``"fp16"`` a ParallelModel already keeps Megatron-LM's layout
(``autopar.runtime.zero``): 16-bit parameters, fp32 gradient buffers, and the fp32 master
weights in a flat slice that the optimizer ``pm.optimizer`` builds steps, split over the
data-parallel ranks with zero=1. ``pm.optimizer(autopar.MasterAdamW, ...)`` steps that slice (or,
at fp32, the shards) with ``autopar::adamw_master_`` (``autopar.kernels.adamw``): on CUDA one
Triton kernel per tensor reads the gradient, the master and both moments once and writes them
once; elsewhere torch's in-place ops in torch.optim.AdamW's single-tensor order, so on CPU its
steps are bit for bit torch.optim.AdamW's. Its state (``step``, ``exp_avg``, ``exp_avg_sq``
per tensor) has AdamW's layout, so checkpoints and learning-rate schedulers treat it as AdamW.

It takes parameter groups as any torch optimizer does, and like any of them it updates only
tensors whose gradients something fills: over ``pm.parameters()`` at 16 bits (whose gradients go
to the fp32 buffers) its step raises, naming ``pm.optimizer`` (``ParallelModel``'s step guard).
With ``offload="optimizer"`` the masters live in host memory and are stepped by torch's CPU
optimizer (``autopar.runtime.offload``): ``pm.optimizer(MasterAdamW)`` is refused there.
"""
from __future__ import annotations

import torch

from autopar.kernels.adamw import adamw_master_


class MasterAdamW(torch.optim.Optimizer):
    """AdamW (decoupled weight decay) on fp32 tensors, each tensor's update one ``adamw_master_`` call.

    Build it with ``pm.optimizer(autopar.MasterAdamW, lr=..., betas=..., eps=..., weight_decay=...)``,
    or with parameter groups, ``pm.optimizer(autopar.MasterAdamW, [{"params": ..., "weight_decay":
    0.0}, ...], lr=...)``; the maths is torch.optim.AdamW's (``autopar.kernels.adamw``)."""

    def __init__(self, params, lr: float = 1e-3, betas=(0.9, 0.999), eps: float = 1e-8, weight_decay: float = 1e-2):
        super().__init__(params, dict(lr=lr, betas=tuple(betas), eps=eps, weight_decay=weight_decay))
        for k, group in enumerate(self.param_groups):
            lr, betas, eps, weight_decay = (group[key] for key in ("lr", "betas", "eps", "weight_decay"))
            if not 0.0 <= lr or not 0.0 <= eps or not all(0.0 <= b < 1.0 for b in betas) or weight_decay < 0.0:
                where = f" of parameter group {k}" if len(self.param_groups) > 1 else ""
                raise ValueError(f"MasterAdamW: invalid hyperparameters{where} lr={lr}, betas={betas}, eps={eps}, "
                                 f"weight_decay={weight_decay}")
            for p in group["params"]:
                if p.dtype != torch.float32:
                    raise ValueError(f"MasterAdamW updates fp32 master weights and got a {p.dtype} tensor of shape "
                                     f"{tuple(p.shape)}; build it with pm.optimizer(autopar.MasterAdamW, ...), which "
                                     "steps a ParallelModel's fp32 masters")

    @torch.no_grad()
    def step(self, closure=None):
        """One update of every tensor that has a gradient."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            beta1, beta2 = group["betas"]
            for p in group["params"]:
                if p.grad is None:
                    continue
                state = self.state[p]
                if not state:
                    # torch.optim.AdamW keeps the step count as a CPU tensor: the same layout
                    state["step"] = torch.tensor(0.0)
                    state["exp_avg"] = torch.zeros_like(p, memory_format=torch.contiguous_format)
                    state["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.contiguous_format)
                state["step"] += 1
                # the master is its own fp32 "working copy": the parameters are rebuilt from it after the step
                adamw_master_(p, p.grad.contiguous(), state["exp_avg"], state["exp_avg_sq"], p, int(state["step"]),
                              float(group["lr"]), beta1, beta2, group["eps"], group["weight_decay"])
        return loss
