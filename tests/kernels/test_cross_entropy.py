"""The one-read cross-entropy op against F.cross_entropy, its input checks, the graph pass that
routes a model's loss through it (and parallelize's loss_kernel), and its Triton kernel (CUDA)."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import autopar
from autopar.examples.gpt import GPT, GPTConfig, example_inputs
from autopar.kernels import cross_entropy as ce
import pool
from autopar.passes.fuse_loss import cross_entropy_kernel_pass

TINY = GPTConfig(vocab_size=96, block_size=16, n_layer=2, n_head=4, n_embd=32)
BATCH, SEQ = 4, 12


def make_model():
    torch.manual_seed(0)
    return GPT(TINY)


def _inputs(n, v, dtype=torch.float32, device="cpu", ignore=-100, seed=0):
    g = torch.Generator().manual_seed(seed)
    logits = (3 * torch.randn(n, v, generator=g)).to(device, dtype)
    target = torch.randint(0, v, (n,), generator=g)
    target[::4] = ignore
    return logits, target.to(device)


def _loss_and_grad(fn, logits, target):
    x = logits.detach().clone().requires_grad_()
    loss = fn(x, target)
    loss.backward(torch.ones_like(loss) if loss.dim() else None)
    return loss.detach(), x.grad


@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_matches_f_cross_entropy(reduction, dtype):
    """Loss and gradient equal F.cross_entropy's on the fp32 logits (what the loss ops see under
    bf16 training), with ignored rows; the bf16 gradient is that gradient rounded once."""
    logits, target = _inputs(23, 37, dtype, ignore=-1)
    got = _loss_and_grad(lambda x, y: ce.cross_entropy(x, y, -1, reduction), logits, target)
    want = _loss_and_grad(lambda x, y: F.cross_entropy(x.float(), y, ignore_index=-1, reduction=reduction),
                          logits, target)
    torch.testing.assert_close(got[0], want[0], rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(got[1], want[1].to(dtype), rtol=1e-5 if dtype == torch.float32 else 0, atol=1e-7)
    assert torch.all(got[1][::4] == 0) and got[0].dtype == torch.float32


def test_rows_and_lse():
    logits, target = _inputs(9, 11)
    loss, lse = torch.ops.autopar.cross_entropy_rows(logits, target, -100)
    torch.testing.assert_close(lse, torch.logsumexp(logits, 1))
    torch.testing.assert_close(loss, F.cross_entropy(logits, target, reduction="none"))
    # a gradient through lse alone is the softmax
    x = logits.clone().requires_grad_()
    torch.ops.autopar.cross_entropy_rows(x, target, -100)[1].sum().backward()
    torch.testing.assert_close(x.grad, logits.softmax(1))


def test_opcheck():
    logits, target = _inputs(6, 10)
    torch.library.opcheck(torch.ops.autopar.cross_entropy_rows.default, (logits.requires_grad_(), target, -100))


def test_bad_input():
    logits, target = _inputs(6, 10)
    with pytest.raises(ValueError, match=r"logits must be a floating \(N, V\)"):
        ce.cross_entropy(logits[None], target)
    with pytest.raises(ValueError, match=r"target must be \(6,\) integers"):
        ce.cross_entropy(logits, target[:5])
    with pytest.raises(ValueError, match=r"target must be \(6,\) integers"):
        ce.cross_entropy(logits, target.float())
    with pytest.raises(ValueError, match="reduction='avg'"):
        ce.cross_entropy(logits, target, reduction="avg")
    with pytest.raises(ValueError, match="impl='triton' needs CUDA"):
        ce.cross_entropy(logits, target, impl="triton")


# ---- the pass and parallelize(loss_kernel=...) ----------------------------------------------

def _runs(rank, world, precisions):
    """Per precision: loss and gathered gradients of one step without and with the kernel, and
    whether the graph calls it, under torch.compile(aot_eager)."""
    idx, tgt = example_inputs(TINY, BATCH, SEQ)
    out = {}
    for precision in precisions:
        for loss_kernel in (False, True):
            pm = autopar.parallelize(make_model(), (1, 1, 1), (idx, tgt), compile="aot_eager",
                                     loss_kernel=loss_kernel, precision=precision)
            routed = any(n.target is ce.cross_entropy for n in pm.graph_module.graph.nodes)
            out.setdefault(precision, []).append((pm.train_step(idx, tgt).item(), pm.full_grads(), routed))
    return out


RUNS = pool.job(1, _runs, ("fp32", "bf16"))


def test_parallelize_loss_kernel():
    for (loss, grads, routed_off), (k_loss, k_grads, routed) in RUNS.result()[0].values():
        assert routed and not routed_off
        assert k_loss == pytest.approx(loss, rel=1e-6)
        for name, g in grads.items():
            torch.testing.assert_close(k_grads[name], g, rtol=1e-5, atol=1e-7, msg=name)


def test_pass_leaves_other_losses_alone():
    """Class weights, label smoothing and 3-D logits stay with aten."""
    def loss(x, y, w):
        return (F.cross_entropy(x.view(-1, 5), y.view(-1), label_smoothing=0.1)
                + F.cross_entropy(x.view(-1, 5), y.view(-1), weight=w)
                + F.cross_entropy(x.permute(0, 2, 1), y))

    gm = torch.fx.experimental.proxy_tensor.make_fx(loss)(torch.randn(2, 3, 5), torch.randint(0, 5, (2, 3)),
                                                          torch.rand(5))
    before = [n.target for n in gm.graph.nodes]
    after = [n.target for n in cross_entropy_kernel_pass(gm).graph.nodes]
    assert after == before

    def plain(x, y):
        return F.cross_entropy(x.view(-1, 5), y.view(-1), ignore_index=2, reduction="sum")

    x, y = torch.randn(2, 3, 5), torch.randint(0, 5, (2, 3))
    gm = cross_entropy_kernel_pass(torch.fx.experimental.proxy_tensor.make_fx(plain, pre_dispatch=True)(x, y))
    assert any(n.target is ce.cross_entropy for n in gm.graph.nodes)
    torch.testing.assert_close(gm(x, y), plain(x, y))


def test_loss_kernel_must_be_known():
    with pytest.raises(ValueError, match="loss_kernel='yes'"):
        autopar.parallelize(make_model(), (1, 1, 1), example_inputs(TINY, BATCH, SEQ), loss_kernel="yes")


# ---- the Triton kernel (CUDA) ---------------------------------------------------------------

cuda = pytest.mark.skipif("not torch.cuda.is_available() or not ce.triton_available()",
                          reason="needs a CUDA device and triton")


@cuda
@pytest.mark.parametrize("n,v", [(1, 7), (64, 2048), (37, 50304), (300, 3001)])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_triton_matches_reference(n, v, dtype):
    """Same rows (fp32 sums in another order: 1e-5 relative), ignored rows exactly 0."""
    logits, target = _inputs(n, v, dtype, "cuda")
    loss, lse = torch.ops.autopar.cross_entropy_rows(logits, target, -100, "triton")
    want_loss, want_lse = torch.ops.autopar.cross_entropy_rows(logits, target, -100, "torch")
    torch.testing.assert_close(lse, want_lse, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(loss, want_loss, rtol=1e-5, atol=1e-5)
    assert torch.all(loss[::4] == 0)


@cuda
def test_triton_under_inductor():
    """Compiled with Inductor, loss and gradient match F.cross_entropy on the fp32 logits."""
    logits, target = _inputs(512, 50304, torch.bfloat16, "cuda")
    fn = torch.compile(lambda x, y: ce.cross_entropy(x, y))
    got = _loss_and_grad(fn, logits, target)
    want = _loss_and_grad(lambda x, y: F.cross_entropy(x.float(), y), logits, target)
    torch.testing.assert_close(got[0], want[0], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(got[1].float(), want[1].float(), rtol=1.6e-2, atol=1e-7)
