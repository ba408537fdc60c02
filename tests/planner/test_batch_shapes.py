"""Batches of other shapes than the example's, and the mistakes made with them.

The last batch of an epoch and an evaluation at another sequence length are lowered again with the
plan's choices and train as the unsharded model does on them (dp, tp with sequence parallelism, pp,
cp); ``pm(idx, targets)`` with the global batch is ``eval_step``. What cannot run gets a sentence
naming the cause and the fix: a batch that dp does not divide, targets of other shapes than the
tokens', a sequence that cp does not split, and the original module called after ZeRO-3 made its
parameters shards.
"""
from __future__ import annotations

import pytest
import torch

import autopar
import pool
from parity import unsharded
from autopar.examples.gpt import GPT, GPTConfig, example_inputs

CFG = GPTConfig(vocab_size=96, block_size=32, n_layer=2, n_head=4, n_embd=32)
# (name, mesh, knobs): the example batch is 8 x 16; each case then runs 4 x 8 and 8 x 24
CASES = [("dp2", (2, 1, 1), {}),
         ("tp2-sp", (1, 1, 2), dict(plan="megatron", sequence_parallel=True)),
         ("pp2", (1, 2, 1), dict(microbatches=2)),
         ("cp2", {"cp": 2}, {})]
SHAPES = ((4, 8), (8, 24))


def build():
    torch.manual_seed(0)
    return GPT(CFG)


def inputs(batch, seq, seed=1):
    torch.manual_seed(seed)
    return example_inputs(CFG, batch, seq)


def _run(rank, world, mesh, knobs):
    import warnings

    pm = autopar.parallelize(build(), mesh, inputs(8, 16), device="cpu", compile=False, **knobs)
    out = []
    for b, s in SHAPES:
        with warnings.catch_warnings(record=True) as seen:
            warnings.simplefilter("always")
            loss = pm.train_step(*inputs(b, s)).item()
        out.append((loss, pm.full_grads(), [str(w.message) for w in seen if "lowering the step again" in
                                            str(w.message)]))
        for p in pm.parameters():
            p.grad = None
    called = pm(*inputs(4, 8)).item()
    shards = sum(p.numel() for p in pm.parameters()) < sum(p.numel() for p in build().parameters())
    return out, called, (pm.plan.sequence_parallel, shards)


def _all(rank, world, cases):
    return [_run(rank, world, mesh, knobs) for mesh, knobs in cases]


JOB = pool.job(2, _all, [(m, k) for _, m, k in CASES], timeout=600)


def _reference(b, s):
    return unsharded(build, inputs(b, s))[:2]


@pytest.mark.parametrize("k", range(len(CASES)), ids=[c[0] for c in CASES])
def test_other_batch_shapes_train_as_the_unsharded_model(k):
    refs = [_reference(b, s) for b, s in SHAPES]
    for rank, per_rank in enumerate(JOB.result()):
        out, called, (sequence_parallel, shards) = per_rank[k]
        if CASES[k][0].startswith(("tp", "pp")):
            assert shards and sequence_parallel == ("sp" in CASES[k][0]), "the case shards what it names"
        for (b, s), (loss, grads, said), (ref_loss, ref_grads) in zip(SHAPES, out, refs):
            assert len(said) == 1, f"rank {rank}: one line says the step is lowered again for {b} x {s}"
            assert loss == pytest.approx(ref_loss, rel=1e-5), f"rank {rank} {b} x {s}"
            for fqn, g in ref_grads.items():
                torch.testing.assert_close(grads[fqn], g, rtol=1e-5, atol=1e-6, msg=f"rank {rank} {b}x{s} {fqn}")
        assert called == pytest.approx(refs[0][0], rel=1e-5), f"rank {rank}: pm(idx, targets) is eval_step"


def _mistakes(rank, world):
    found = {}
    pm = autopar.parallelize(build(), (2, 1, 1), inputs(8, 16), device="cpu", compile=False)
    idx, tgt = inputs(5, 16)
    for name, call in (("odd batch", lambda: pm.train_step(idx, tgt)),
                       ("short targets", lambda: pm.train_step(inputs(8, 16)[0], inputs(8, 12)[1])),
                       ("rows differ", lambda: pm.train_step(inputs(8, 16)[0], inputs(6, 16)[1]))):
        try:
            call()
            found[name] = None
        except Exception as e:
            found[name] = f"{type(e).__name__}: {e}"
    cp = autopar.parallelize(build(), {"cp": 2}, inputs(4, 16), device="cpu", compile=False)
    try:
        cp.train_step(*inputs(4, 10))
        found["cp"] = None
    except Exception as e:
        found["cp"] = f"{type(e).__name__}: {e}"
    model = build()
    autopar.parallelize(model, (2, 1, 1), inputs(8, 16), device="cpu", compile=False, zero=3)
    try:
        model(*inputs(2, 16))
        found["zero3 module"] = None
    except Exception as e:
        found["zero3 module"] = f"{type(e).__name__}: {e}"
    return found


MISTAKES = pool.job(2, _mistakes, timeout=600)


@pytest.mark.parametrize("name, words", [
    ("odd batch", ["5 rows", "dp=2", "multiple of 2"]),
    ("short targets", ["[4, 16]", "[4, 12]", "cannot run"]),
    ("rows differ", ["[8, 16]", "[6, 16]", "same number of rows"]),
    ("cp", ["cp=2", "10 tokens", "valid"]),
    ("zero3 module", ["no longer runs on its own", "full_state_dict"]),
])
def test_mistakes_name_the_cause(name, words):
    for rank, found in enumerate(MISTAKES.result()):
        said = found[name]
        assert said is not None, f"rank {rank}: {name} ran"
        assert "TorchRuntimeError" not in said and "IndexError" not in said, said
        for w in words:
            assert w in said, f"rank {rank} {name}: {w!r} not in {said!r}"
