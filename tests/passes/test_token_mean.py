"""A loss that is a mean over tokens trains as the unsharded model does when the ranks' counts differ.

Targets padded with ``ignore_index`` on some of one dp rank's rows (all of them: the rank's own mean
would be 0/0) and padding spread unevenly over microbatches: under dp, ZeRO, microbatches, cp and pp
the loss, every gathered gradient and a few AdamW steps (plain ``torch.optim.AdamW`` over
``pm.parameters()`` and ``pm.optimizer``) match the unsharded model. So do a masked mean written out
(``(loss * mask).sum() / mask.sum()``), a Hugging Face-style label shift (padded with -100 and
sliced) and a cross-entropy with reduction "sum". ``eval_step`` gives the same loss without touching
the gradients; a batch of other shapes is lowered again with the plan's choices.
"""
from __future__ import annotations

import functools
import pytest
import torch
import torch.nn.functional as F

import autopar
import pool
from parity import unsharded
from autopar.examples.gpt import GPT, GPTConfig, example_inputs
from autopar.graph.capture import capture_pass
from autopar.passes.token_mean import token_count_graph, token_losses, token_mean_pass

CFG = GPTConfig(vocab_size=96, block_size=16, n_layer=2, n_head=4, n_embd=32)
BATCH, SEQ, STEPS, LR = 8, 12, 3, 1e-2


class ShiftedGPT(GPT):
    """The example GPT with a loss written two other ways: Hugging Face's shifted labels (the last
    position padded with -100) or a masked mean over tokens (``kind``)."""

    def __init__(self, cfg, kind: str):
        super().__init__(cfg)
        self.kind = kind

    def forward(self, idx, targets):
        x = self.transformer.wte(idx) + self.transformer.wpe(torch.arange(idx.shape[1], device=idx.device))
        for block in self.transformer.h:
            x = block(x)
        logits = self.lm_head(self.transformer.ln_f(x))
        if self.kind == "hf":
            labels = F.pad(targets, (0, 1), value=-100)[:, 1:]
            return F.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), labels.reshape(-1))
        if self.kind == "sum":
            return F.cross_entropy(logits.view(-1, logits.shape[-1]), targets.view(-1), ignore_index=-1,
                                   reduction="sum")
        mask = (targets >= 0).float()
        per_token = F.cross_entropy(logits.view(-1, logits.shape[-1]), targets.clamp(min=0).view(-1),
                                    reduction="none").view_as(mask)
        return (per_token * mask).sum() / mask.sum()


def build(kind: str = "gpt"):
    torch.manual_seed(0)
    return GPT(CFG) if kind == "gpt" else ShiftedGPT(CFG, kind)


def batch(padding: str):
    """The global batch: ``rows`` pads every target of the first quarter of the rows (all of dp rank 0's
    at dp=4, half at dp=2), ``uneven`` a scatter of single tokens and half rows elsewhere."""
    torch.manual_seed(1)
    idx, tgt = example_inputs(CFG, BATCH, SEQ)
    tgt = tgt.clone()
    if padding in ("rows", "both"):
        tgt[:BATCH // 4] = -1 if padding == "rows" else -100
    if padding in ("uneven", "both"):
        tgt[BATCH // 2, SEQ // 2:] = -1 if padding == "uneven" else -100
        tgt[BATCH - 1, ::3] = -1 if padding == "uneven" else -100
    return idx, tgt


# (name, mesh, knobs, model kind, padding)
CASES = [
    ("dp2", (2, 1, 1), {}, "gpt", "rows"),
    ("dp2-microbatches", (2, 1, 1), dict(microbatches=2), "gpt", "uneven"),
    ("dp2-zero1-microbatches", (2, 1, 1), dict(zero=1, microbatches=2), "gpt", "rows"),
    ("dp2-zero3", (2, 1, 1), dict(zero=3), "gpt", "uneven"),
    ("cp2", {"cp": 2}, {}, "gpt", "uneven"),
    ("pp2", (1, 2, 1), dict(microbatches=4), "gpt", "rows"),
    ("dp2-masked-mean", (2, 1, 1), dict(microbatches=2), "masked", "uneven"),
    ("dp2-hf-shift", (2, 1, 1), {}, "hf", "both"),
    ("dp2-sum", (2, 1, 1), dict(microbatches=2), "sum", "uneven"),
    ("dp4", (4, 1, 1), {}, "gpt", "rows"),
    ("dp2-cp2", {"dp": 2, "cp": 2}, {}, "gpt", "rows"),
    ("dp2-pp2-interleaved", (2, 2, 1), dict(microbatches=2, schedule="Interleaved1F1B"), "gpt", "rows"),
]


def _world(mesh) -> int:
    sizes = mesh.values() if isinstance(mesh, dict) else mesh
    out = 1
    for s in sizes:
        out *= s
    return out


def _run(name, mesh, knobs, kind, padding):
    inputs = batch(padding)
    pm = autopar.parallelize(build(kind), mesh, inputs, device="cpu", compile=False, **knobs)
    loss = pm.train_step(*inputs).item()
    grads = pm.full_grads()
    before = {k: v.clone() for k, v in grads.items()}
    evaluated = pm.eval_step(*inputs).item()
    unchanged = all(torch.equal(before[k], v) for k, v in pm.full_grads().items())
    opt = torch.optim.AdamW(pm.parameters(), lr=LR) if not knobs.get("zero") == 1 else pm.optimizer(
        torch.optim.AdamW, lr=LR)
    curve = []
    for _ in range(STEPS):
        opt.zero_grad()
        curve.append(pm.train_step(*inputs).item())
        opt.step()
    return loss, grads, evaluated, unchanged, curve


def _all(rank, world, cases):
    return [_run(*case) for case in cases]


JOBS = {w: pool.job(w, _all, [c for c in CASES if _world(c[1]) == w], timeout=600) for w in (2, 4)}


def _reference(kind, padding):
    return unsharded(functools.partial(build, kind), batch(padding), steps=STEPS, lr=LR)


@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_token_mean_matches_the_unsharded_model(case):
    name, mesh, knobs, kind, padding = case
    ref_loss, ref_grads, ref_curve = _reference(kind, padding)
    assert ref_loss == ref_loss, "the reference itself is nan"
    job = JOBS[_world(mesh)]
    position = [c for c in CASES if _world(c[1]) == _world(mesh)].index(case)
    for rank, per_rank in enumerate(job.result()):
        loss, grads, evaluated, unchanged, curve = per_rank[position]
        assert loss == pytest.approx(ref_loss, rel=1e-5), f"rank {rank}"
        assert evaluated == pytest.approx(ref_loss, rel=1e-5), f"rank {rank}: eval_step"
        assert unchanged, f"rank {rank}: eval_step changed the gradients"
        for fqn, g in ref_grads.items():
            torch.testing.assert_close(grads[fqn], g, rtol=1e-5, atol=1e-6, msg=f"rank {rank} {fqn}")
        assert curve == pytest.approx(ref_curve, rel=1e-4), f"rank {rank}"


def test_each_loss_form_is_found_and_counted():
    """The analysis finds each form's mean, and the count graph counts what aten divides by."""
    for kind, padding, want in (("gpt", "uneven", "loss"), ("hf", "both", "loss"), ("masked", "uneven", "ratio")):
        idx, tgt = batch(padding)
        cap = capture_pass(build(kind), (idx, tgt), require_loss=True)
        [found] = token_losses(cap.gm)
        assert (found.kind, found.counted) == (want, True), kind
        counts = token_count_graph(cap.gm)
        named = {"idx": idx, "targets": tgt}
        got = counts(*[named[n.name] for n in counts.graph.nodes if n.op == "placeholder"])
        shifted = F.pad(tgt, (0, 1), value=-100)[:, 1:] if kind == "hf" else tgt
        assert got.tolist() == [float((shifted >= 0).sum())], kind
    cap = capture_pass(build("sum"), batch("uneven"), require_loss=True)
    assert [t.counted for t in token_losses(cap.gm)] == [False] and token_count_graph(cap.gm) is None


def test_the_pass_makes_a_token_sum_times_the_fed_scale():
    idx, tgt = batch("rows")
    cap = capture_pass(build("gpt"), (idx, tgt), require_loss=True)
    gm = token_mean_pass(cap.gm)
    scales = [n for n in gm.graph.nodes if n.op == "placeholder" and n.meta.get("kind") == "buffer"]
    assert [n.meta["fqn"] for n in scales] == ["autopar_token_scale_0"]
    [ce] = [n for n in gm.graph.nodes if n.target is torch.ops.aten.cross_entropy_loss.default]
    assert ce.args[3] == 2, "reduction sum"
    model = build("gpt")
    params = dict(model.named_parameters())
    feed = {n.name: params[n.meta["fqn"]] if n.meta.get("kind") == "param" else
            {"idx": idx, "targets": tgt}.get(n.name, torch.tensor(0.5)) for n in gm.graph.nodes if n.op == "placeholder"}
    out = gm(*feed.values())
    out = out[0] if isinstance(out, (tuple, list)) else out
    kept = int((tgt >= 0).sum())
    assert out.item() == pytest.approx(model(idx, tgt).item() * kept * 0.5, rel=1e-5)
