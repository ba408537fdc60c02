"""The AdamW master-weight op against torch.optim.AdamW, its input checks, and its Triton kernel (CUDA)."""
from __future__ import annotations

import pytest
import torch

from autopar.kernels import adamw

LR, BETAS, EPS, WEIGHT_DECAY = 3e-3, (0.8, 0.95), 1e-6, 0.1     # every hyper-parameter off its default
STEPS = 5


def _problem(shape, grad_dtype, steps=STEPS, device="cpu", seed=0):
    """Initial fp32 params and one gradient per step, drawn in ``grad_dtype``."""
    g = torch.Generator().manual_seed(seed)
    param = torch.randn(shape, generator=g).to(device)
    grads = [torch.randn(shape, generator=g).to(device, grad_dtype) for _ in range(steps)]
    return param, grads


def _run_op(param, grads, working_dtype, grad_scale=1.0, impl="auto", beta1=BETAS[0]):
    """(param, exp_avg, exp_avg_sq, working) after one op call per gradient, from zero moments."""
    param = param.clone()
    exp_avg, exp_avg_sq = torch.zeros_like(param), torch.zeros_like(param)
    working = param.to(working_dtype)
    for step, grad in enumerate(grads, 1):
        torch.ops.autopar.adamw_master_(param, grad, exp_avg, exp_avg_sq, working, step, LR, beta1, BETAS[1], EPS,
                                        WEIGHT_DECAY, grad_scale, impl)
    return param, exp_avg, exp_avg_sq, working


def _run_torch(param, grads, grad_scale=1.0, **impl):
    """(param, exp_avg, exp_avg_sq) of torch.optim.AdamW fed the fp32 gradients times ``grad_scale``."""
    p = torch.nn.Parameter(param.clone())
    opt = torch.optim.AdamW([p], lr=LR, betas=BETAS, eps=EPS, weight_decay=WEIGHT_DECAY, **impl)
    for grad in grads:
        p.grad = grad.float() * grad_scale
        opt.step()
    state = opt.state[p]
    return p.detach(), state["exp_avg"], state["exp_avg_sq"]


# ---- the reference against torch.optim.AdamW (CPU) ------------------------------------------

@pytest.mark.parametrize("impl", [{"foreach": False}, {"foreach": True, "fused": False}], ids=["single", "foreach"])
@pytest.mark.parametrize("grad_dtype,working_dtype,grad_scale", [
    (torch.bfloat16, torch.bfloat16, 1.0),
    (torch.bfloat16, torch.bfloat16, 0.37),
    (torch.float32, torch.bfloat16, 1.0),
    (torch.float32, torch.bfloat16, 0.5),
    (torch.float16, torch.float16, 1.0),
    (torch.bfloat16, torch.float16, 2.0),
    (torch.float32, torch.float32, 1.0),
])
def test_matches_torch_adamw(impl, grad_dtype, working_dtype, grad_scale):
    """Bit-identical to AdamW's single-tensor and foreach paths: on CPU both run the same in-place
    ops with the same scalars as the reference, so any difference would be a wrong formula."""
    param, grads = _problem((37, 19), grad_dtype)
    before = [g.clone() for g in grads]
    p, m, v, working = _run_op(param, grads, working_dtype, grad_scale)
    want_p, want_m, want_v = _run_torch(param, grads, grad_scale, **impl)
    for got, want, what in ((p, want_p, "param"), (m, want_m, "exp_avg"), (v, want_v, "exp_avg_sq")):
        torch.testing.assert_close(got, want, rtol=0, atol=0, msg=what)
    assert working.dtype == working_dtype
    assert torch.equal(working, p.to(working_dtype))
    assert all(torch.equal(g, b) for g, b in zip(grads, before)), "the gradients must not be modified"


@pytest.mark.parametrize("shape", [(1,), (0,), (2, 3, 5)])
def test_shapes(shape):
    """A single element, an empty tensor and a 3-d one."""
    param, grads = _problem(shape, torch.bfloat16)
    p, m, v, working = _run_op(param, grads, torch.bfloat16)
    want_p, want_m, want_v = _run_torch(param, grads, foreach=False)
    assert torch.equal(p, want_p) and torch.equal(m, want_m) and torch.equal(v, want_v)
    assert torch.equal(working, p.to(torch.bfloat16))


def test_opcheck():
    """Schema (declared mutations), fake implementation and AOT dispatch."""
    param, (grad,) = _problem((7, 5), torch.bfloat16, steps=1)
    args = (param, grad, torch.randn(7, 5) * 0.1, torch.rand(7, 5), param.to(torch.bfloat16), 3, LR, *BETAS, EPS,
            WEIGHT_DECAY)
    torch.library.opcheck(torch.ops.autopar.adamw_master_.default, args)
    torch.library.opcheck(torch.ops.autopar.adamw_master_.default, (*args, 0.5, "torch"))


def test_bad_input_names_the_problem():
    param, (grad,) = _problem((6, 4), torch.bfloat16, steps=1)
    m, v, working = torch.zeros_like(param), torch.zeros_like(param), param.to(torch.bfloat16)

    def call(*tensors, step=1, impl="auto"):
        torch.ops.autopar.adamw_master_(*tensors, step, LR, *BETAS, EPS, WEIGHT_DECAY, 1.0, impl)

    with pytest.raises(ValueError, match=r"grad has shape \(4, 6\) but param has \(6, 4\)"):
        call(param, grad.view(4, 6), m, v, working)
    with pytest.raises(ValueError, match="working has shape"):
        call(param, grad, m, v, working[:3])
    with pytest.raises(ValueError, match="param must be fp32"):
        call(param.to(torch.bfloat16), grad, m, v, working)
    with pytest.raises(ValueError, match="exp_avg must be fp32"):
        call(param, grad, m.double(), v, working)
    with pytest.raises(ValueError, match="exp_avg_sq must be fp32"):
        call(param, grad, m, v.half(), working)
    with pytest.raises(ValueError, match=r"working must be the bf16, fp16 or fp32 copy"):
        call(param, grad, m, v, param.double())
    with pytest.raises(ValueError, match="grad must be bf16, fp16 or fp32"):
        call(param, grad.double(), m, v, working)
    with pytest.raises(ValueError, match="exp_avg must be contiguous"):
        call(param, grad, torch.zeros(4, 6).t(), v, working)
    with pytest.raises(ValueError, match="the first one is 1"):
        call(param, grad, m, v, working, step=0)
    with pytest.raises(ValueError, match="impl='fast'"):
        call(param, grad, m, v, working, impl="fast")
    with pytest.raises(ValueError, match="impl='triton' needs CUDA"):
        call(param, grad, m, v, working, impl="triton")
    assert torch.equal(m, torch.zeros_like(m)), "a rejected call must not touch the state"


# ---- the Triton kernel (CUDA only) ----------------------------------------------------------

cuda = pytest.mark.skipif("not torch.cuda.is_available() or not adamw.triton_available()",
                          reason="the Triton kernel needs CUDA and triton")


def _ulps_apart(a, b):
    """Largest distance in 16-bit ulps between two bf16 or fp16 tensors whose elements agree in sign."""
    return (a.view(torch.int16).int() - b.view(torch.int16).int()).abs().max().item()


@cuda
@pytest.mark.parametrize("beta1", [0.8, 0.3], ids=["lerp-from-avg", "lerp-from-grad"])
@pytest.mark.parametrize("grad_dtype,working_dtype", [
    (torch.bfloat16, torch.bfloat16), (torch.float32, torch.bfloat16), (torch.float16, torch.float16)])
@pytest.mark.parametrize("shape", [(1,), (2048,), (3001,), (257, 129)])
def test_triton_matches_reference(shape, grad_dtype, working_dtype, beta1):
    """Triton vs the reference's torch ops on CUDA: one element, an exact multiple of BLOCK, an odd
    size and an odd 2-d shape, over both of torch.lerp's forms.

    Not bit-identical: the kernel contracts some a*b + c into one FMA where torch's separate ops
    round twice, and multiplies by 1/sqrt(bc2) where torch divides by sqrt(bc2); each costs at
    most an ulp or so per step. The working copy is
    exactly the kernel's own param rounded to nearest-even; against the reference's it may be one
    16-bit ulp away, where the fp32 params differ across a rounding midpoint."""
    param, grads = _problem(shape, grad_dtype, device="cuda")
    p, m, v, working = _run_op(param, grads, working_dtype, grad_scale=0.7, impl="triton", beta1=beta1)
    ref_p, ref_m, ref_v, ref_working = _run_op(param, grads, working_dtype, grad_scale=0.7, impl="torch",
                                               beta1=beta1)
    torch.testing.assert_close(p, ref_p, rtol=1e-6, atol=1e-7, msg="param")
    torch.testing.assert_close(m, ref_m, rtol=1e-6, atol=1e-6, msg="exp_avg")
    torch.testing.assert_close(v, ref_v, rtol=1e-6, atol=1e-6, msg="exp_avg_sq")
    assert torch.equal(working, p.to(working_dtype))
    assert _ulps_apart(working, ref_working) <= 1
    auto = _run_op(param, grads, working_dtype, grad_scale=0.7, impl="auto", beta1=beta1)
    assert all(torch.equal(a, b) for a, b in zip(auto, (p, m, v, working))), "impl='auto' must take the kernel"
