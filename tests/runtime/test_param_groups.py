"""Parameter groups in ``pm.optimizer(cls, params, **defaults)``: weight decay on the matrices and
none on the norms and biases, as FSDP2 and torchtitan users write it, on every runtime path (the
plain optimizer under zero=0/2/3 and tp, ZeRO-1's slice, the host masters of offload="optimizer",
MasterAdamW) and through checkpoints across meshes; a pipeline rank's empty tensors in the groups
are fine, a tensor of another model or one in two groups is refused.

Every 2-rank case shares one spawn, the session's pool; the tiny GPT runs eagerly (compile=False)."""
from __future__ import annotations

from pathlib import Path

import pytest
import torch

import autopar
from autopar.checkpoint import CheckpointMismatchError, load_checkpoint, save_checkpoint
from autopar.examples.gpt import example_inputs
import pool
from parity import BATCH, SEQ, TINY, make_model

STEPS, LR, DECAY = 3, 1e-2, 0.5
# Weights after AdamW steps: an element whose gradient is rounding noise (the key bias's, zero in
# exact arithmetic) moves by up to lr per step in either run, so weights are compared to WEIGHT_TOL;
# the groups move the norms' weights by more than ten times that (test_the_reference_groups_matter)
WEIGHT_TOL = 1e-4
MEGATRON_SP = dict(plan="megatron", sequence_parallel=True)
# (name, mesh, knobs): each trains STEPS AdamW steps with the two groups, as the unsharded reference
CASES = [("zero0-dp2", (2, 1, 1), dict(zero=0)),
         ("zero1-dp2", (2, 1, 1), dict(zero=1)),
         ("zero3-dp2", (2, 1, 1), dict(zero=3)),
         ("tp2-sp", (1, 1, 2), dict(MEGATRON_SP)),
         ("pp2", (1, 2, 1), dict(schedule="1F1B")),   # the groups hold the other stage's empty tensors
         ("offload-zero0-dp2", (2, 1, 1), dict(zero=0, offload="optimizer", device="cpu")),
         ("offload-zero1-dp2", (2, 1, 1), dict(zero=1, offload="optimizer", device="cpu"))]


def _decayed(name: str) -> bool:
    """Weight decay on the matrices (embeddings included), none on the norms and biases."""
    return not (name.endswith("bias") or ".ln_" in name or name.startswith("transformer.ln_f"))


def groups(model) -> list[dict]:
    """The two parameter groups over ``model``'s (or a parallelized model's) parameters."""
    named = list(model.named_parameters())
    return [{"params": [p for n, p in named if _decayed(n)]},
            {"params": [p for n, p in named if not _decayed(n)], "weight_decay": 0.0}]


def _reference(grouped: bool = True):
    """The unsharded model's losses and final weights under AdamW with the two groups (or, for
    the sanity check, one group decaying everything)."""
    model = make_model()
    idx, tgt = example_inputs(TINY, BATCH, SEQ)
    opt = torch.optim.AdamW(groups(model) if grouped else model.parameters(), lr=LR, weight_decay=DECAY)
    curve = []
    for _ in range(STEPS):
        opt.zero_grad()
        loss = model(idx, tgt)
        loss.backward()
        opt.step()
        curve.append(loss.item())
    return curve, {n: t.detach().clone() for n, t in model.state_dict().items()}


def _train(pm, opt, steps=STEPS) -> list[float]:
    idx, tgt = example_inputs(TINY, BATCH, SEQ)
    curve = []
    for _ in range(steps):
        opt.zero_grad()
        curve.append(pm.train_step(idx, tgt).item())
        opt.step()
    return curve


def _grouped(mesh, knobs, cls=torch.optim.AdamW, grouped=True, **kw):
    """A ParallelModel and its optimizer with the two groups (from the model's own parameters)."""
    model = make_model()
    pm = autopar.parallelize(model, mesh, example_inputs(TINY, BATCH, SEQ), **{"compile": False, **knobs})
    return pm, pm.optimizer(cls, groups(model) if grouped else None, lr=LR, weight_decay=DECAY, **kw)


def _cases(rank, world):
    out = {}
    for name, mesh, knobs in CASES:
        pm, opt = _grouped(mesh, knobs)
        curve = _train(pm, opt)
        out[name] = dict(curve=curve, weights=pm.full_state_dict(),
                         options=[g["weight_decay"] for g in opt.param_groups])
    return out


def _master(rank, world):
    """MasterAdamW with the groups against the bf16 default path's AdamW with the same groups."""
    out = {}
    for cls, grouped in ((torch.optim.AdamW, True), (autopar.MasterAdamW, True), (autopar.MasterAdamW, False)):
        pm, opt = _grouped((2, 1, 1), dict(precision="bf16"), cls, grouped)
        out[(cls.__name__, grouped)] = (_train(pm, opt), pm.full_state_dict())
    return out


def _refusals(rank, world):
    """What pm.optimizer says to groups it cannot take."""
    out = {}
    model = make_model()
    before = dict(model.named_parameters())
    pm = autopar.parallelize(model, (1, 2, 1), example_inputs(TINY, BATCH, SEQ), compile=False)
    named = dict(model.named_parameters())
    attempts = {
        "foreign": lambda: [{"params": [*pm.parameters(), torch.nn.Parameter(torch.zeros(3, 3))]}],
        "twice": lambda: [{"params": list(pm.parameters())}, {"params": [named["transformer.wte.weight"]]}],
        "tied twice": lambda: [{"params": [model.transformer.wte.weight]}, {"params": [model.lm_head.weight]}],
        "replaced": lambda: [before["transformer.wte.weight"]],
        "one tensor": lambda: next(pm.parameters()),
        "no params key": lambda: [{"lr": 1.0}],
    }
    for what, params in attempts.items():
        try:
            pm.optimizer(torch.optim.AdamW, params(), lr=LR)
            out[what] = None
        except (ValueError, TypeError) as e:
            out[what] = f"{type(e).__name__}: {e}"
    return out


def _checkpoints(rank, world, root):
    """Groups saved on one mesh and loaded on another: ZeRO-1's slice -> tp (plain) -> ZeRO-1."""
    root = Path(root)
    a, opt_a = _grouped((2, 1, 1), dict(zero=1))
    curve = _train(a, opt_a, 1)
    save_checkpoint(a, opt_a, root / "a")
    b, opt_b = _grouped((1, 1, 2), dict(MEGATRON_SP))
    load_checkpoint(b, opt_b, root / "a")
    curve += _train(b, opt_b, 1)
    save_checkpoint(b, opt_b, root / "b")
    c, opt_c = _grouped((2, 1, 1), dict(zero=1))
    load_checkpoint(c, opt_c, root / "b")
    curve += _train(c, opt_c, 1)
    ungrouped, opt_u = _grouped((2, 1, 1), dict(zero=1), grouped=False)
    try:
        load_checkpoint(ungrouped, opt_u, root / "b")
        refused = None
    except CheckpointMismatchError as e:
        refused = str(e)
    return curve, c.full_state_dict(), refused


JOBS = dict(cases=pool.job(2, _cases, timeout=900), master=pool.job(2, _master, timeout=600),
            refusals=pool.job(2, _refusals, timeout=300),
            checkpoints=pool.job(2, _checkpoints, workdir=True, timeout=600))


@pytest.fixture(scope="module")
def ref():
    return _reference()


def test_the_reference_groups_matter(ref):
    """The no-decay group moves the norms' weights by far more than the tolerance: a run that ignored
    the groups would fail the parity tests."""
    _, uniform = _reference(grouped=False)
    gap = (uniform["transformer.ln_f.weight"] - ref[1]["transformer.ln_f.weight"]).abs().max().item()
    assert gap > 10 * WEIGHT_TOL


def _assert_same_weights(got: dict, want: dict, where: str) -> None:
    for name, w in want.items():
        if name in got:   # the causal mask buffer, if any, is not a parameter
            torch.testing.assert_close(got[name], w, rtol=0, atol=WEIGHT_TOL, msg=lambda m: f"{where} {name}: {m}")


@pytest.mark.parametrize("case", [c[0] for c in CASES])
def test_groups_train_as_the_unsharded_model(case, ref):
    curve, weights = ref
    for rank, out in enumerate(JOBS["cases"].result()):
        r = out[case]
        assert r["options"] == [DECAY, 0.0]
        assert r["curve"] == pytest.approx(curve, rel=1e-5), f"rank {rank}"
        _assert_same_weights(r["weights"], weights, f"rank {rank}")


def test_master_adamw_takes_the_groups():
    """MasterAdamW with the groups is bit for bit the bf16 default path's AdamW with them, and the
    groups change its result."""
    for out in JOBS["master"].result():
        plain, master, ungrouped = (out[("AdamW", True)], out[("MasterAdamW", True)], out[("MasterAdamW", False)])
        assert master[0] == plain[0]
        assert all(torch.equal(master[1][n], t) for n, t in plain[1].items())
        assert not torch.equal(master[1]["transformer.ln_f.weight"], ungrouped[1]["transformer.ln_f.weight"])


def test_bad_groups_say_what_is_wrong():
    for out in JOBS["refusals"].result():
        assert "not one of this rank's parameters" in out["foreign"] and "(3, 3)" in out["foreign"]
        assert "transformer.wte.weight is in parameter groups 0 and 1" in out["twice"]
        assert "is in parameter groups 0 and 1" in out["tied twice"] and "tied weights" in out["tied twice"]
        assert "before autopar.parallelize replaced it" in out["replaced"]
        assert out["one tensor"].startswith("TypeError") and "iterable" in out["one tensor"]
        assert "has no 'params' key" in out["no params key"]


def test_groups_survive_checkpoints_across_meshes(ref):
    """One step on each of ZeRO-1 (dp=2), tp=2 and ZeRO-1 again, resumed from the checkpoint of the
    one before, follows the uninterrupted unsharded run; an ungrouped optimizer cannot take it."""
    curve, weights = ref
    for rank, (got, state, refused) in enumerate(JOBS["checkpoints"].result()):
        assert got == pytest.approx(curve, rel=1e-5), f"rank {rank}"
        _assert_same_weights(state, weights, f"rank {rank}")
        assert refused is not None and "different options" in refused and "weight_decay=0.5 against 0.0" in refused
