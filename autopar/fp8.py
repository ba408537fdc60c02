"""Float8 linear layers: dynamic per-tensor scaling, e4m3 in the forward, e5m2 for gradients.

The recipe is the published float8 training recipe (Micikevicius et al. 2022, "FP8 Formats for
Deep Learning"), with the current-scaling variant: every matmul input is scaled by its own amax at
the moment it is used, no history. For ``y = x @ w.T``:

    forward     y      = mm(e4m3(x), e4m3(w).T)
    backward    grad_x = mm(e5m2(grad_y), e4m3(w))
                grad_w = mm(e5m2(grad_y).T, e4m3(x))

where ``e4m3(t)`` is ``t * s`` cast to float8 with ``s = fp8_max / amax(t)`` (448 for e4m3, 57344
for e5m2), and the matmul, ``torch._scaled_mm``, multiplies the result back by ``1 / (s_a s_b)``,
accumulating in fp32 and writing the caller's dtype (the forward GEMM with Hopper's fast
accumulation, the two gradient GEMMs without, as torchao's float8 recipe does). e4m3 keeps more
mantissa for weights and activations; gradients need e5m2's range. The float8 copies (not the 16-bit inputs) are what the
forward saves for backward, so a linear's saved activations take half the bytes.

On Hopper ``_scaled_mm`` wants the first operand row-major, the second column-major and every
dimension a multiple of 16; the transposes below give it that, and a linear whose shapes are not
multiples of 16 runs in its own precision. The casts are plain torch ops inside an
``autograd.Function``, so torch.compile traces them and Inductor fuses amax, scale and cast into
the surrounding kernels.

Two ways in:

- ``swap_linears(model)`` turns the model's ``nn.Linear`` modules into ``Fp8Linear`` in place (for a
  plain model, under torch.compile or eager). The output projection (``lm_head``) is kept in its
  own precision by default, as the published recipes do: its logits feed the softmax directly.
- ``autopar.passes.fp8.fp8_backend()`` is a torch.compile backend that rewrites every ``aten.linear``
  of the graph it is given into the float8 linear (``fp8_linear_pass``) and hands it to Inductor;
  this is how a graph autopar has already sharded gets float8 matmuls:
  ``autopar.parallelize(..., compile=fp8_backend())``. There the head is recognised as the linear
  with no other linear after it. With sequence parallelism the
  column-parallel linears are ``collectives.gathered_linear`` (an autograd Function that re-gathers
  its input in backward), which the pass does not enter: they stay in the compute dtype, so for
  float8 on every linear use ``sequence_parallel=False``.

A ``Fp8Linear`` ignores ``torch.autocast``: its output has its input's dtype, so give it a model
already in the compute dtype (a bf16 model, or autopar's ``precision="bf16"``).

``emulate=True`` replaces ``_scaled_mm`` by its definition, an fp32 matmul of the float8 values cast
back, for machines whose torch has no ``_scaled_mm`` (it is not faster, only the same numerics).

NVIDIA Transformer Engine, when it is installed, is a second backend: ``te_linears(model)`` replaces
the linears with ``transformer_engine.pytorch.Linear``, which run in float8 inside
``transformer_engine.pytorch.fp8_autocast()``. It is not exercised by this project's tests or
benchmarks (Transformer Engine is not installed on the machines they run on).
"""
from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

E4M3 = torch.float8_e4m3fn
E5M2 = torch.float8_e5m2
# smallest amax a scale is computed from: an all-zero tensor must not give an infinite scale
_AMAX_EPS = 1e-12
# cuBLASLt's float8 GEMM needs every dimension to be a multiple of this
_ALIGN = 16


def to_fp8(t: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """``t`` scaled so its amax lands on ``dtype``'s largest value, cast; and the inverse scale (fp32, 0-dim)."""
    fmax = torch.finfo(dtype).max
    amax = t.detach().abs().amax().float().clamp(min=_AMAX_EPS)
    scale = fmax / amax
    return (t.float() * scale).clamp(-fmax, fmax).to(dtype), scale.reciprocal()


def _col_major(t: torch.Tensor) -> torch.Tensor:
    return t.t().contiguous().t()


def scaled_mm(a: torch.Tensor, a_inv: torch.Tensor, b: torch.Tensor, b_inv: torch.Tensor,
              out_dtype: torch.dtype, emulate: bool = False, fast_accum: bool = False) -> torch.Tensor:
    """``(a * a_inv) @ (b * b_inv)`` of two float8 matrices, accumulated in fp32, as ``out_dtype``.

    ``fast_accum`` lets Hopper's tensor cores accumulate at reduced precision between their
    periodic fp32 promotions (faster; the emulation always accumulates in fp32)."""
    if emulate:
        return ((a.float() * a_inv) @ (b.float() * b_inv)).to(out_dtype)
    return torch._scaled_mm(a.contiguous(), _col_major(b), scale_a=a_inv, scale_b=b_inv, out_dtype=out_dtype,
                            use_fast_accum=fast_accum)


class _Fp8Matmul(torch.autograd.Function):
    """x [M, K] @ w[N, K].T with float8 inputs; saves the float8 copies for backward."""

    @staticmethod
    def forward(ctx, x, w, emulate):
        xq, x_inv = to_fp8(x, E4M3)
        wq, w_inv = to_fp8(w, E4M3)
        ctx.save_for_backward(xq, x_inv, wq, w_inv)
        ctx.emulate = emulate
        ctx.dtypes = (x.dtype, w.dtype)
        return scaled_mm(xq, x_inv, wq.t(), w_inv, x.dtype, emulate, fast_accum=True)

    @staticmethod
    def backward(ctx, grad):
        xq, x_inv, wq, w_inv = ctx.saved_tensors
        gq, g_inv = to_fp8(grad, E5M2)
        x_dtype, w_dtype = ctx.dtypes
        grad_x = scaled_mm(gq, g_inv, wq, w_inv, x_dtype, ctx.emulate)
        grad_w = scaled_mm(gq.t(), g_inv, xq, x_inv, w_dtype, ctx.emulate)
        return grad_x, grad_w, None


def fits_fp8(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether a linear of input ``x`` and ``weight`` [out, in] meets the float8 GEMM's shape rules."""
    rows = x.numel() // x.shape[-1] if x.shape[-1] else 0
    return (weight.dim() == 2 and x.shape[-1] == weight.shape[1] and rows > 0
            and all(d % _ALIGN == 0 for d in (rows, weight.shape[0], weight.shape[1])))


def fp8_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
               emulate: bool = False) -> torch.Tensor:
    """``F.linear`` with float8 matmuls (forward and both gradients); shapes that do not fit run as ``F.linear``."""
    if not fits_fp8(x, weight):
        return F.linear(x, weight, bias)
    y = _Fp8Matmul.apply(x.reshape(-1, x.shape[-1]), weight, emulate).view(*x.shape[:-1], weight.shape[0])
    return y if bias is None else y + bias


class Fp8Linear(nn.Linear):
    """An ``nn.Linear`` whose matmuls run in float8 (``fp8_linear``); same parameters, same state dict."""

    emulate: bool = False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return fp8_linear(x, self.weight, self.bias, self.emulate)


def swap_linears(model: nn.Module, *, skip: tuple[str, ...] = ("lm_head",), emulate: bool = False) -> list[str]:
    """Make every ``nn.Linear`` of ``model`` (but those named in ``skip``) an ``Fp8Linear``, in place.

    The parameters are untouched (tied weights stay tied). Returns the FQNs it converted."""
    check_fp8_dtypes()
    done = []
    for name, module in model.named_modules():
        if type(module) is nn.Linear and name not in skip and name.rsplit(".", 1)[-1] not in skip:
            module.__class__ = Fp8Linear
            module.emulate = emulate
            done.append(name)
    if not done:
        raise ValueError(f"{type(model).__name__} has no nn.Linear outside {skip}: nothing to run in float8")
    return done


def check_fp8_dtypes():
    """Raise unless this torch has the float8 dtypes."""
    if not hasattr(torch, "float8_e4m3fn") or not hasattr(torch, "float8_e5m2"):
        raise RuntimeError(f"torch {torch.__version__} has no float8_e4m3fn/float8_e5m2 dtypes; "
                           "float8 training needs torch 2.1 or newer")


# ---- Transformer Engine (optional, not exercised) -----------------------------------------------

def te_linears(model: nn.Module, *, skip: tuple[str, ...] = ("lm_head",)) -> list[str]:
    """Replace ``nn.Linear`` modules with ``transformer_engine.pytorch.Linear`` (weights copied), in place.

    Run the forward inside ``transformer_engine.pytorch.fp8_autocast(enabled=True)`` for float8.
    A replaced weight is a new parameter: ties to other modules are not carried over, so the
    tied GPT head is skipped by default. Returns the FQNs it replaced."""
    try:
        import transformer_engine.pytorch as te
    except ImportError:
        raise ImportError("te_linears needs NVIDIA Transformer Engine (pip install transformer-engine[pytorch]); "
                          "without it use swap_linears, which runs float8 through torch._scaled_mm") from None
    done = []
    for name, module in list(model.named_modules()):
        for child_name, child in list(module.named_children()):
            fqn = f"{name}.{child_name}" if name else child_name
            if type(child) is not nn.Linear or fqn in skip or child_name in skip:
                continue
            new = te.Linear(child.in_features, child.out_features, bias=child.bias is not None,
                            params_dtype=child.weight.dtype, device=child.weight.device)
            with torch.no_grad():
                new.weight.copy_(child.weight)
                if child.bias is not None:
                    new.bias.copy_(child.bias)
            setattr(module, child_name, new)
            done.append(fqn)
    return done
