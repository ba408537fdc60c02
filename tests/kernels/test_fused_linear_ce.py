"""The fused linear + cross-entropy against F.linear + F.cross_entropy, alone, vocab-parallel and in graphs."""
from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F

from autopar.kernels import fused_linear_ce as flce
from autopar.kernels.fused_linear_ce import linear_cross_entropy, vocab_parallel_linear_cross_entropy
import pool
from autopar.passes.fuse_loss import fuse_loss_pass

aten = torch.ops.aten
FP32 = {"rtol": 1e-5, "atol": 1e-6}
BF16 = 1e-2        # relative error in norm; elementwise tolerances would hide errors in small gradients


def _inputs(n, h, v, dtype=torch.float32, device="cpu", ignore=-100, seed=0):
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(n, h, generator=g).to(device, dtype)
    weight = (torch.randn(v, h, generator=g) / h ** 0.5).to(device, dtype)
    labels = torch.randint(0, v, (n,), generator=g)
    labels[::5] = ignore
    return hidden, weight, labels.to(device)


def _loss_and_grads(fn, hidden, weight, labels):
    h = hidden.detach().clone().requires_grad_()
    w = weight.detach().clone().requires_grad_()
    loss = fn(h, w, labels)
    loss.backward()
    return loss.detach(), h.grad, w.grad


def _unfused(ignore=-100, reduction="mean", upcast=False):
    def fn(h, w, y):
        logits = F.linear(h.float(), w.float()) if upcast else F.linear(h, w)
        return F.cross_entropy(logits, y, ignore_index=ignore, reduction=reduction)
    return fn


def _assert_same(got, want, dtype):
    for g, w, what in zip(got, want, ("loss", "grad_hidden", "grad_weight")):
        if dtype == torch.float32:
            torch.testing.assert_close(g, w, **FP32, msg=what)
        else:
            err = ((g.float() - w.float()).norm() / w.float().norm()).item()
            assert err < BF16, f"{what}: relative error {err:.2e}"


# ---- the tp = 1 op --------------------------------------------------------------------------

@pytest.mark.parametrize("n,v,chunk", [(64, 96, 16), (37, 29, 8), (50, 33, 64), (19, 7, 1)])
def test_matches_unfused_fp32(n, v, chunk):
    """Odd N and V, vocabulary chunks that do not divide V, one wider than V, one column wide."""
    x = _inputs(n, 24, v)
    got = _loss_and_grads(lambda h, w, y: linear_cross_entropy(h, w, y, chunk=chunk, impl="torch"), *x)
    _assert_same(got, _loss_and_grads(_unfused(), *x), torch.float32)


def test_matches_unfused_bf16():
    """bf16 inputs: logits in bf16 per chunk, log-sum-exp and grad_hidden accumulated in fp32."""
    x = _inputs(83, 32, 61, torch.bfloat16)
    got = _loss_and_grads(lambda h, w, y: linear_cross_entropy(h, w, y, chunk=20), *x)
    assert got[0].dtype == torch.bfloat16
    _assert_same(got, _loss_and_grads(_unfused(upcast=True), *x), torch.bfloat16)


@pytest.mark.parametrize("ignore,reduction", [(-1, "mean"), (3, "mean"), (-100, "sum")])
def test_ignore_index_and_sum(ignore, reduction):
    """A negative ignore_index, one that is a real class, and the summed loss."""
    x = _inputs(45, 16, 23, ignore=ignore)
    fused = _loss_and_grads(lambda h, w, y: linear_cross_entropy(h, w, y, ignore, reduction, chunk=10), *x)
    _assert_same(fused, _loss_and_grads(_unfused(ignore, reduction), *x), torch.float32)


def test_gradient_through_lse_output():
    """The op's second output (per-row log-sum-exp) is differentiable, e.g. for a z-loss."""
    def fused(h, w, y):
        loss, lse = torch.ops.autopar.linear_cross_entropy(h, w, y, -100, 1, 6, "torch")
        return loss + 0.1 * lse.pow(2).mean()

    def unfused(h, w, y):
        logits = F.linear(h, w)
        return F.cross_entropy(logits, y) + 0.1 * torch.logsumexp(logits, 1).pow(2).mean()
    x = _inputs(33, 16, 21)
    _assert_same(_loss_and_grads(fused, *x), _loss_and_grads(unfused, *x), torch.float32)


def test_leading_dims_are_flattened():
    hidden, weight, labels = _inputs(24, 8, 11)
    want = F.cross_entropy(F.linear(hidden, weight), labels)
    got = linear_cross_entropy(hidden.view(4, 6, 8), weight, labels.view(4, 6), chunk=5)
    torch.testing.assert_close(got, want)


def test_bad_input_names_the_problem():
    hidden, weight, labels = _inputs(8, 8, 5)
    with pytest.raises(ValueError, match="same H"):
        linear_cross_entropy(hidden, weight[:, :4], labels)
    with pytest.raises(ValueError, match="one per row"):
        torch.ops.autopar.linear_cross_entropy(hidden, weight, labels[:3])
    with pytest.raises(ValueError, match="share one floating dtype"):
        linear_cross_entropy(hidden, weight.double(), labels)
    with pytest.raises(ValueError, match="expected 'mean' or 'sum'"):
        linear_cross_entropy(hidden, weight, labels, reduction="none")
    if not torch.cuda.is_available():
        with pytest.raises(ValueError, match="impl='triton' needs CUDA"):
            linear_cross_entropy(hidden, weight, labels, impl="triton")


def test_opcheck():
    """Schema, fake implementations, autograd registration and AOT dispatch of all three ops."""
    hidden, weight, labels = _inputs(21, 8, 13)
    h, w = hidden.requires_grad_(), weight.requires_grad_()
    torch.library.opcheck(torch.ops.autopar.linear_cross_entropy.default, (h, w, labels, -100, 1, 8, "torch"))
    torch.library.opcheck(torch.ops.autopar.linear_ce_stats.default, (h, w, labels, 4, 15, 8, "torch"))
    lse, _ = torch.ops.autopar.linear_ce_stats(hidden.detach(), weight.detach(), labels, 4, 15, 8, "torch")
    scale = torch.rand(21)
    torch.library.opcheck(torch.ops.autopar.linear_ce_backward.default,
                          (hidden.detach(), weight.detach(), labels, lse, scale, -scale, 4, 15, 8, "torch"))


def test_torch_compile_aot_eager():
    x = _inputs(40, 16, 27)
    compiled = torch.compile(lambda h, w, y: linear_cross_entropy(h, w, y, chunk=9), backend="aot_eager",
                             fullgraph=True)
    _assert_same(_loss_and_grads(compiled, *x), _loss_and_grads(_unfused(), *x), torch.float32)


# ---- vocabulary shards ----------------------------------------------------------------------

def _shard(weight, size, rank):
    rows = -(-weight.shape[0] // size)
    padded = F.pad(weight, (0, 0, 0, rows * size - weight.shape[0]))
    return padded[rank * rows:(rank + 1) * rows], rank * rows


def test_padded_shards_combine_to_the_full_loss():
    """Stats of padded shards (one of them all padding) combine to the unsharded loss and gradients."""
    hidden, weight, labels = _inputs(30, 8, 10)
    size = 4                                     # shards of 3 rows: 0-2, 3-5, 6-8, 9 + two padding rows
    h = hidden.clone().requires_grad_()
    shards = [_shard(weight, size, r) for r in range(size)]
    ws = [s.clone().requires_grad_() for s, _ in shards]
    stats = [torch.ops.autopar.linear_ce_stats(h, w, labels, start, 10, 7, "torch")
             for w, (_, start) in zip(ws, shards)]
    lse = torch.logsumexp(torch.stack([s[0] for s in stats]), dim=0)
    picked = sum(s[1] for s in stats)
    valid = labels != -100
    loss = torch.where(valid, lse - picked, torch.zeros_like(lse)).sum() / valid.sum()
    loss.backward()
    want = _loss_and_grads(_unfused(), hidden, weight, labels)
    grad_w = torch.cat([w.grad for w in ws])
    _assert_same((loss, h.grad, grad_w[:10]), want, torch.float32)
    assert torch.all(grad_w[10:] == 0), "padding rows must get no gradient"


def _vocab_parallel_rank(rank, world, vocab):
    import torch.distributed as dist

    from autopar.collectives import copy_to

    group = dist.group.WORLD.group_name
    hidden, weight, labels = _inputs(26, 12, vocab)
    shard, start = _shard(weight, world, rank)

    def fn(h, w, y):
        return vocab_parallel_linear_cross_entropy(copy_to(h, group), w, y, group, world, rank, start, vocab,
                                                   chunk=6, impl="torch")
    eager = _loss_and_grads(fn, hidden, shard, labels)
    compiled = _loss_and_grads(torch.compile(fn, backend="aot_eager"), hidden, shard, labels)
    graphs = [_fuse_sharded_gpt(rank, world, sp) for sp in (False, True)]
    return eager, compiled, graphs


def _run_graph(fn, params, inputs, graph=None):
    """Loss and gradients of a graph module (or its compiled form, with its ``graph``) on ``params``."""
    for p in params.values():
        p.grad = None
    it = iter(inputs)
    args = [params[n.meta["fqn"]] if n.meta.get("kind") == "param" else next(it)
            for n in (graph or fn.graph).nodes if n.op == "placeholder"]
    out = fn(*args)
    loss = out[0] if isinstance(out, (tuple, list)) else out
    loss.backward()
    return loss.item(), {k: p.grad.clone() for k, p in params.items()}


def _fuse_sharded_gpt(rank, world, sequence_parallel):
    """One rank's megatron-sharded tiny GPT (padded vocabulary), unfused and fused."""
    import autopar
    from autopar.examples.gpt import build, example_inputs

    torch.manual_seed(0)
    model = build("tiny", vocab_size=97)
    inputs = example_inputs(model.config, 2, 16)
    pm = autopar.parallelize(model, (1, 1, world), inputs, plan="megatron", sequence_parallel=sequence_parallel,
                             compile=False)
    params = dict(pm.named_parameters())
    unfused = _run_graph(pm.graph_module, params, inputs)
    gm = fuse_loss_pass(torch.fx.GraphModule(pm.graph_module, copy.deepcopy(pm.graph_module.graph)), chunk=5)
    targets = {n.target for n in gm.graph.nodes if n.op == "call_function"}
    compiled = _run_graph(torch.compile(gm, backend="aot_eager"), params, inputs, gm.graph)
    return unfused, [_run_graph(gm, params, inputs), compiled], vocab_parallel_linear_cross_entropy in targets


VOCAB_PARALLEL = pool.job(2, _vocab_parallel_rank, 37, timeout=300, lane=pool.compiled(2))


@pytest.fixture(scope="module")
def vocab_parallel_results():
    return VOCAB_PARALLEL.result()


def test_vocab_parallel_matches_unsharded(vocab_parallel_results):
    """Two gloo ranks, a padded vocabulary (37 -> 2 x 19), eager and torch.compile(aot_eager)."""
    want = _loss_and_grads(_unfused(), *_inputs(26, 12, 37))
    for which in (0, 1):
        per_rank = [r[which] for r in vocab_parallel_results]
        for loss, grad_h, _ in per_rank:
            _assert_same((loss, grad_h), want[:2], torch.float32)
        grad_w = torch.cat([g for _, _, g in per_rank])
        torch.testing.assert_close(grad_w[:37], want[2], **FP32)
        assert torch.all(grad_w[37:] == 0)


def test_fuse_loss_pass_on_sharded_graph(vocab_parallel_results):
    """After the tp rewrite (with and without sequence parallelism) the fused graph, eager and
    under torch.compile(aot_eager), keeps the loss and every gradient."""
    for rank_result in vocab_parallel_results:
        for (ref_loss, ref_grads), runs, fused in rank_result[2]:
            assert fused, "the vocab-parallel loss was not fused"
            for loss, grads in runs:
                assert loss == pytest.approx(ref_loss, rel=1e-6)
                for name, g in ref_grads.items():
                    torch.testing.assert_close(grads[name], g, rtol=1e-5, atol=1e-6, msg=name)


# ---- the pass on a captured graph -----------------------------------------------------------

def test_fuse_loss_pass_on_captured_gpt():
    from autopar.examples.gpt import build, example_inputs
    from autopar.graph.capture import capture_pass

    torch.manual_seed(0)
    model = build("tiny")
    inputs = example_inputs(model.config, 3, 20)
    ref = model(*inputs)
    ref.backward()
    ref_grads = {k: p.grad.clone() for k, p in model.named_parameters()}
    gm = fuse_loss_pass(capture_pass(model, inputs).gm, chunk=7)
    targets = [n.target for n in gm.graph.nodes if n.op == "call_function"]
    assert torch.ops.autopar.linear_cross_entropy.default in targets
    assert aten.cross_entropy_loss.default not in targets
    loss, grads = _run_graph(gm, dict(model.named_parameters()), inputs)
    assert loss == pytest.approx(ref.item(), rel=1e-6)
    for name, g in ref_grads.items():
        torch.testing.assert_close(grads[name], g, rtol=1e-5, atol=1e-6, msg=name)


class _LogitsAlsoReturned(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.head = torch.nn.Linear(8, 11, bias=False)

    def forward(self, x, y):
        logits = self.head(x)
        return F.cross_entropy(logits.view(-1, 11), y.view(-1)), logits


def test_fuse_loss_pass_leaves_shared_logits_alone():
    """Logits with another user must stay materialised: the graph is unchanged."""
    from autopar.graph.capture import capture_pass

    x, y = torch.randn(2, 3, 8), torch.randint(0, 11, (2, 3))
    gm = capture_pass(_LogitsAlsoReturned(), (x, y)).gm
    before = [n.target for n in gm.graph.nodes]
    assert [n.target for n in fuse_loss_pass(gm).graph.nodes] == before


# ---- the Triton row kernels (CUDA only) -----------------------------------------------------

cuda = pytest.mark.skipif("not torch.cuda.is_available() or not flce.triton_available()",
                          reason="the Triton kernels need CUDA and triton")


@cuda
@pytest.mark.parametrize("n,v,chunk", [(1000, 5003, 256), (257, 50304, 0)])
def test_triton_matches_reference(n, v, chunk):
    """Triton row kernels vs the torch reference on CUDA (bf16), and both vs the unfused fp32 loss."""
    x = _inputs(n, 256, v, torch.bfloat16, "cuda")
    tri = _loss_and_grads(lambda h, w, y: linear_cross_entropy(h, w, y, chunk=chunk, impl="triton"), *x)
    ref = _loss_and_grads(lambda h, w, y: linear_cross_entropy(h, w, y, chunk=chunk, impl="torch"), *x)
    _assert_same(tri, ref, torch.bfloat16)
    _assert_same(tri, _loss_and_grads(_unfused(upcast=True), *x), torch.bfloat16)


@cuda
def test_triton_padded_shard_matches_reference():
    hidden, weight, labels = _inputs(300, 64, 1000, torch.bfloat16, "cuda")
    shard, start = _shard(weight, 3, 2)            # rows 668..1001: the last two are padding
    out = {}
    for impl in ("triton", "torch"):
        h, w = hidden.clone().requires_grad_(), shard.clone().requires_grad_()
        lse, picked = torch.ops.autopar.linear_ce_stats(h, w, labels, start, 1000, 128, impl)
        (lse.sin().sum() + picked.cos().sum()).backward()
        out[impl] = (lse, picked, h.grad, w.grad)
    for got, want in zip(out["triton"], out["torch"]):
        err = ((got.float() - want.float()).norm() / want.float().norm()).item()
        assert err < BF16
