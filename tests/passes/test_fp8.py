"""Float8 linears (autopar.fp8) against an emulation written out here: cast to float8 and back,
matmul in fp32. ``torch._scaled_mm`` runs on this CPU build of torch; where a build lacks it, the
tests that call it are skipped and the ``emulate=True`` path is still checked."""
from __future__ import annotations

import importlib.util

import pytest
import torch
import torch.nn.functional as F

from autopar.fp8 import E4M3, E5M2, Fp8Linear, fp8_linear, swap_linears, te_linears, to_fp8
from autopar.passes.fp8 import fp8_backend
from autopar.examples.demo import make_batch
from autopar.examples.gpt import GPT, GPTConfig
from autopar.passes.fp8 import fp8_linear_pass
import pool
from parity import train_curve

CFG = GPTConfig(vocab_size=64, block_size=16, n_layer=2, n_head=4, n_embd=32)


def _has_scaled_mm() -> bool:
    a = torch.ones(16, 16).to(E4M3)
    try:
        torch._scaled_mm(a, a.t(), scale_a=torch.tensor(1.0), scale_b=torch.tensor(1.0), out_dtype=torch.float32)
    except (RuntimeError, NotImplementedError, AttributeError):
        return False
    return True


needs_scaled_mm = pytest.mark.skipif(not _has_scaled_mm(), reason="torch._scaled_mm does not run on this CPU build")


def _q(t, dtype):
    """Reference quantisation: scale the amax onto the format's largest value, cast, cast back, unscale."""
    fmax = torch.finfo(dtype).max
    s = fmax / t.abs().max().float()
    return (t.float() * s).clamp(-fmax, fmax).to(dtype).float() / s


def _reference(x, w, b, grad):
    """Forward and both gradients of the float8 recipe, spelled out in fp32."""
    x2 = x.reshape(-1, x.shape[-1])
    g2 = grad.reshape(-1, grad.shape[-1])
    y = (_q(x2, E4M3) @ _q(w, E4M3).t()).view(*x.shape[:-1], -1) + b
    gx = (_q(g2, E5M2) @ _q(w, E4M3)).view_as(x)
    gw = _q(g2, E5M2).t() @ _q(x2, E4M3)
    return y, gx, gw


def _run(x, w, b, grad, emulate):
    x, w, b = (t.detach().clone().requires_grad_() for t in (x, w, b))
    y = fp8_linear(x, w, b, emulate=emulate)
    y.backward(grad)
    return y.detach(), x.grad, w.grad, b.grad


@pytest.fixture
def case():
    torch.manual_seed(0)
    return torch.randn(4, 8, 32) * 3, torch.randn(48, 32) * 0.05, torch.randn(48), torch.randn(4, 8, 48) * 1e-3


def test_to_fp8_puts_amax_on_the_format_maximum():
    t = torch.tensor([0.5, -2.0, 1e-3])
    for dtype in (E4M3, E5M2):
        q, inv = to_fp8(t, dtype)
        assert q.dtype == dtype
        assert q.float().abs().max().item() == torch.finfo(dtype).max
        torch.testing.assert_close(q.float() * inv, t, rtol=2 ** -3 if dtype is E4M3 else 2 ** -2, atol=0)
    q, inv = to_fp8(torch.zeros(3), E4M3)
    assert torch.isfinite(inv) and (q.float() == 0).all()


@pytest.mark.parametrize("emulate", [pytest.param(False, marks=needs_scaled_mm), True],
                         ids=["scaled_mm", "emulate"])
def test_forward_and_gradients_match_the_emulation(case, emulate):
    x, w, b, grad = case
    y, gx, gw, gb = _run(x, w, b, grad, emulate)
    ry, rgx, rgw = _reference(x, w, b, grad)
    torch.testing.assert_close(y, ry, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(gx, rgx, rtol=1e-5, atol=1e-9)
    torch.testing.assert_close(gw, rgw, rtol=1e-5, atol=1e-9)
    torch.testing.assert_close(gb, grad.sum((0, 1)))


def test_fp8_is_close_to_but_not_the_exact_linear(case):
    x, w, b, grad = case
    y = _run(x, w, b, grad, True)[0]
    exact = F.linear(x, w, b)
    rel = ((y - exact).norm() / exact.norm()).item()
    assert 1e-4 < rel < 0.1, rel


def test_shapes_off_the_16_grid_run_in_their_own_precision():
    torch.manual_seed(0)
    x, w = torch.randn(3, 20), torch.randn(24, 20)
    assert torch.equal(fp8_linear(x, w), F.linear(x, w))


def test_swap_linears_keeps_the_head_and_the_tie():
    torch.manual_seed(0)
    model = GPT(CFG)
    names = swap_linears(model, emulate=True)
    assert names == [f"transformer.h.{i}.{m}" for i in range(2)
                     for m in ("attn.c_attn", "attn.c_proj", "mlp.c_fc", "mlp.c_proj")]
    assert type(model.lm_head) is torch.nn.Linear
    assert model.lm_head.weight is model.transformer.wte.weight
    assert isinstance(model.transformer.h[0].mlp.c_fc, Fp8Linear)
    with pytest.raises(ValueError, match="no nn.Linear"):
        swap_linears(torch.nn.Sequential(torch.nn.ReLU()))


def _curve(model, steps=30, lr=3e-3):
    return train_curve(model, *make_batch(CFG.vocab_size, 8, CFG.block_size), steps, lr)


@needs_scaled_mm
def test_training_in_fp8_tracks_fp32():
    torch.manual_seed(0)
    ref = _curve(GPT(CFG))
    torch.manual_seed(0)
    model = GPT(CFG)
    swap_linears(model)
    fp8 = _curve(model)
    assert fp8[-1] < 0.8 * fp8[0]
    gaps = [abs(a - b) / b for a, b in zip(fp8, ref)]
    assert max(gaps) < 0.05, gaps
    assert max(gaps) > 0, "the float8 run is bit-identical to fp32: nothing was cast"


def test_graph_pass_under_inductor_matches_the_swapped_module():
    """fp8_backend rewrites the traced linears (head kept) and Inductor compiles the casts and matmuls
    (``_scaled_mm`` itself where this torch runs it on CPU)."""
    emulate = not _has_scaled_mm()
    idx, tgt = make_batch(CFG.vocab_size, 4, CFG.block_size)
    torch.manual_seed(0)
    swapped = GPT(CFG)
    swap_linears(swapped, emulate=emulate)
    ref = swapped(idx, tgt)
    ref.backward()
    seen = []

    def backend(gm, example_inputs):
        compiled = fp8_backend("inductor", emulate=emulate)(gm, example_inputs)
        seen.append(gm.meta["fp8_linears"])
        return compiled

    torch.manual_seed(0)
    model = GPT(CFG)
    loss = torch.compile(model, backend=backend)(idx, tgt)
    loss.backward()
    assert seen == [{"converted": 8, "kept": 1}]
    torch.testing.assert_close(loss, ref, rtol=1e-5, atol=1e-6)
    grads = dict(swapped.named_parameters())
    for name, p in model.named_parameters():
        torch.testing.assert_close(p.grad, grads[name].grad, rtol=1e-4, atol=1e-6, msg=name)


def test_pass_rewrites_aten_linear_and_keeps_bias():
    class Two(torch.nn.Module):
        def forward(self, x, w1, b1, w2):
            return torch.ops.aten.linear.default(torch.ops.aten.linear.default(x, w1, b1), w2)

    gm = torch.fx.symbolic_trace(Two())
    gm = fp8_linear_pass(gm, keep_head=False, emulate=True)
    assert [n.target for n in gm.graph.nodes if n.op == "call_function"] == [fp8_linear, fp8_linear]
    torch.manual_seed(0)
    x, w1, b1, w2 = torch.randn(16, 32), torch.randn(16, 32), torch.randn(16), torch.randn(32, 16)
    h = (_q(x, E4M3) @ _q(w1, E4M3).t()) + b1
    torch.testing.assert_close(gm(x, w1, b1, w2), _q(h, E4M3) @ _q(w2, E4M3).t(), rtol=1e-5, atol=1e-5)


def _autopar_fp8(rank, world):
    import autopar

    torch.manual_seed(0)
    model = GPT(CFG)
    idx, tgt = make_batch(CFG.vocab_size, 8, CFG.block_size)
    pm = autopar.parallelize(model, (1, 1, world), (idx, tgt), plan="megatron", sequence_parallel=False,
                             compile=fp8_backend("aot_eager", emulate=True))
    opt = pm.optimizer(torch.optim.AdamW, lr=3e-3)
    out = []
    for _ in range(10):
        opt.zero_grad()
        out.append(float(pm.train_step(idx, tgt)))
        opt.step()
    return out


AUTOPAR_FP8 = pool.job(2, _autopar_fp8, lane=pool.compiled(2))


def test_autopar_tp2_graph_trains_in_fp8():
    """On autopar's sharded graph (tp=2) the pass finds the linears; the loss tracks the fp32 model's."""
    torch.manual_seed(0)
    ref = _curve(GPT(CFG), steps=10)
    curves = AUTOPAR_FP8.result()
    assert curves[0] == curves[1]
    gaps = [abs(a - b) / b for a, b in zip(curves[0], ref)]
    assert 0 < max(gaps) < 0.05, gaps


def test_transformer_engine_absent_says_what_to_install():
    if importlib.util.find_spec("transformer_engine") is not None:
        pytest.skip("Transformer Engine is installed here; its backend is not exercised by these tests")
    with pytest.raises(ImportError, match="transformer-engine"):
        te_linears(GPT(CFG))
