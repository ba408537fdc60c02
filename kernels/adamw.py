"""AdamW on fp32 master weights for a model that runs on 16-bit working copies.

One call updates one parameter tensor in place. The maths is torch.optim.AdamW's (decoupled
weight decay) in the order its single-tensor and foreach implementations evaluate it (its fused
CUDA kernel rounds differently: param -= lr * weight_decay * param, and exp_avg as
beta1 * exp_avg + (1 - beta1) * g rather than a lerp):

    g           = grad.float() * grad_scale
    param      *= 1 - lr * weight_decay
    exp_avg    += (1 - beta1) * (g - exp_avg)              (torch.lerp)
    exp_avg_sq  = beta2 * exp_avg_sq + (1 - beta2) * g * g
    bc1         = 1 - beta1 ** step
    bc2         = 1 - beta2 ** step
    denom       = sqrt(exp_avg_sq) / sqrt(bc2) + eps
    param      -= (lr / bc1) * exp_avg / denom
    working     = param.to(working.dtype)

``step`` is the number of this update (1 on the first). ``grad_scale`` multiplies the gradient
before anything else, so clipping by the global gradient norm needs no pass that rewrites the
gradients. The 16-bit working copy is rounded from the new master value in the same call, so
the model's weights never drift from the fp32 ones by more than one rounding.

Op (``torch.ops.autopar``), with a fake implementation for tracing:
    adamw_master_(param, grad, exp_avg, exp_avg_sq, working, step, lr, beta1, beta2, eps,
                  weight_decay, grad_scale=1.0, impl="auto") -> None
It mutates param, exp_avg, exp_avg_sq and working. param, exp_avg and exp_avg_sq are fp32;
grad is bf16, fp16 or fp32; working is bf16 or fp16 (or an fp32 copy, for a weight whose
gradient the graph must keep at fp32, e.g. one it sums over ranks); all five are contiguous and of one shape
on one device. ``impl``: "torch" (the reference, in-place torch ops, any device), "triton"
(one CUDA kernel that reads p, g, m, v and writes p, m, v, working once each), "auto" (triton
on CUDA when installed, else torch).
"""
from __future__ import annotations

import functools

import torch
from torch import Tensor

from autopar.kernels.fused_linear_ce import triton_available, use_triton

__all__ = ["adamw_master_", "triton_available"]

_IMPLS = ("auto", "torch", "triton")
_WORKING_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
_GRAD_DTYPES = (torch.bfloat16, torch.float16, torch.float32)

# The update is memory bound: 14 bytes read and 14 written per element with 16-bit gradients,
# against about 15 flops. 1024 elements over 8 warps is 4 per thread: one 16-byte access per
# fp32 tensor and an 8-byte one per 16-bit tensor, all in one register layout. At 8 per thread
# (4 warps) Triton gives the 16-bit tensors 16-byte accesses but then routes the fp32 results
# through shared memory to store them (a layout conversion), which costs more than it saves.
# Blocks this size also keep the last partial wave short on the mid-sized tensors of a model.
_BLOCK = 1024
_NUM_WARPS = 8


def _check(param: Tensor, grad: Tensor, exp_avg: Tensor, exp_avg_sq: Tensor, working: Tensor, step: int,
           impl: str) -> None:
    tensors = {"param": param, "grad": grad, "exp_avg": exp_avg, "exp_avg_sq": exp_avg_sq, "working": working}
    for name in ("param", "exp_avg", "exp_avg_sq"):
        if tensors[name].dtype != torch.float32:
            raise ValueError(f"adamw_master_: {name} must be fp32 (master weights and their moments); "
                             f"got {tensors[name].dtype}")
    if grad.dtype not in _GRAD_DTYPES:
        raise ValueError(f"adamw_master_: grad must be bf16, fp16 or fp32; got {grad.dtype}")
    if working.dtype not in _WORKING_DTYPES:
        raise ValueError(f"adamw_master_: working must be the bf16, fp16 or fp32 copy of param; "
                         f"got {working.dtype}")
    for name, t in tensors.items():
        if t.shape != param.shape:
            raise ValueError(f"adamw_master_: {name} has shape {tuple(t.shape)} but param has "
                             f"{tuple(param.shape)}; all five tensors must have one shape")
        if t.device != param.device:
            raise ValueError(f"adamw_master_: {name} is on {t.device} but param is on {param.device}")
        if not t.is_contiguous():
            raise ValueError(f"adamw_master_: {name} must be contiguous (the update walks the flat storage); "
                             "pass .contiguous() state")
    if step < 1:
        raise ValueError(f"adamw_master_: step={step}; it numbers this update, so the first one is 1")
    if impl not in _IMPLS:
        raise ValueError(f"adamw_master_: impl={impl!r}; expected one of {', '.join(_IMPLS)}")


def _adamw_torch_(param: Tensor, grad: Tensor, exp_avg: Tensor, exp_avg_sq: Tensor, working: Tensor, step: int,
                  lr: float, beta1: float, beta2: float, eps: float, weight_decay: float,
                  grad_scale: float) -> None:
    # the same in-place ops, scalars and Python-side bias corrections as torch.optim.AdamW's
    # single-tensor path, so that on CPU the results are bit-identical to it
    g = grad.float()
    if grad_scale != 1.0:
        g = g * grad_scale
    if weight_decay != 0.0:
        param.mul_(1 - lr * weight_decay)
    exp_avg.lerp_(g, 1 - beta1)
    exp_avg_sq.mul_(beta2).addcmul_(g, g, value=1 - beta2)
    bias_correction1 = 1 - beta1 ** step
    bias_correction2 = 1 - beta2 ** step
    denom = (exp_avg_sq.sqrt() / bias_correction2 ** 0.5).add_(eps)
    param.addcdiv_(exp_avg, denom, value=-(lr / bias_correction1))
    working.copy_(param)


@functools.cache
def _triton_kernel():
    # built on first use: the CPU build of torch ships without triton
    import triton
    import triton.language as tl

    @triton.jit
    def adamw_kernel(p_ptr, g_ptr, m_ptr, v_ptr, w_ptr, n, grad_scale, decay, lerp_weight, beta2,
                     one_minus_beta2, step_size, inv_sqrt_bc2, eps, BLOCK: tl.constexpr):
        offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
        mask = offs < n
        p = tl.load(p_ptr + offs, mask=mask)
        g = tl.load(g_ptr + offs, mask=mask).to(tl.float32) * grad_scale
        m = tl.load(m_ptr + offs, mask=mask)
        v = tl.load(v_ptr + offs, mask=mask)
        p = p * decay
        # torch.lerp switches form at weight 0.5 (from exp_avg below it, from the gradient at or
        # above it); following it keeps the rounding the same as the reference's
        small = lerp_weight < 0.5
        m = tl.where(small, m, g) + tl.where(small, lerp_weight, lerp_weight - 1.0) * (g - m)
        v = v * beta2 + one_minus_beta2 * g * g
        # tl.sqrt is the approximate square root and '/' may be too; torch rounds both per IEEE
        denom = tl.sqrt_rn(v) * inv_sqrt_bc2 + eps
        p = p - tl.div_rn(step_size * m, denom)
        tl.store(p_ptr + offs, p, mask=mask)
        tl.store(m_ptr + offs, m, mask=mask)
        tl.store(v_ptr + offs, v, mask=mask)
        tl.store(w_ptr + offs, p.to(w_ptr.dtype.element_ty), mask=mask)

    return adamw_kernel


def _adamw_triton_(param: Tensor, grad: Tensor, exp_avg: Tensor, exp_avg_sq: Tensor, working: Tensor, step: int,
                   lr: float, beta1: float, beta2: float, eps: float, weight_decay: float,
                   grad_scale: float) -> None:
    n = param.numel()
    if n == 0:
        return
    # scalars are formed in double as torch.optim.AdamW forms them and rounded to fp32 at launch
    bias_correction1 = 1 - beta1 ** step
    bias_correction2 = 1 - beta2 ** step
    _triton_kernel()[(-(-n // _BLOCK),)](
        param, grad, exp_avg, exp_avg_sq, working, n, grad_scale, 1 - lr * weight_decay, 1 - beta1, beta2,
        1 - beta2, lr / bias_correction1, 1 / bias_correction2 ** 0.5, eps, BLOCK=_BLOCK, num_warps=_NUM_WARPS)


@torch.library.custom_op("autopar::adamw_master_", mutates_args=("param", "exp_avg", "exp_avg_sq", "working"))
def adamw_master_(param: Tensor, grad: Tensor, exp_avg: Tensor, exp_avg_sq: Tensor, working: Tensor, step: int,
                  lr: float, beta1: float, beta2: float, eps: float, weight_decay: float, grad_scale: float = 1.0,
                  impl: str = "auto") -> None:
    """One AdamW step on the fp32 master ``param``, in place, and its 16-bit copy ``working``.

    ``grad`` is multiplied by ``grad_scale`` first; ``exp_avg`` and ``exp_avg_sq`` are the fp32
    moments (zeros before the first step) and ``step`` the number of this update, from 1. The
    maths and its order are torch.optim.AdamW's (see the module docstring); ``working`` receives
    the new ``param`` rounded to its dtype. ``impl`` picks the reference or the Triton kernel."""
    _check(param, grad, exp_avg, exp_avg_sq, working, step, impl)
    args = (param, grad, exp_avg, exp_avg_sq, working, step, lr, beta1, beta2, eps, weight_decay, grad_scale)
    if use_triton("adamw_master_", impl, param.device):
        # Triton launches on the current device, which need not be the tensors'
        with torch.cuda.device(param.device):
            _adamw_triton_(*args)
    else:
        _adamw_torch_(*args)


@adamw_master_.register_fake
def _(param, grad, exp_avg, exp_avg_sq, working, step, lr, beta1, beta2, eps, weight_decay, grad_scale=1.0,
      impl="auto"):
    _check(param, grad, exp_avg, exp_avg_sq, working, step, impl)
