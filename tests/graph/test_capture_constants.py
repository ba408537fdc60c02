"""Constant tensors made inside a forward, end to end: capture, plan, shard, split, precision, run.

torch.export lifts a ``torch.tensor(...)`` in a forward, and the empty tensors a Hugging Face KV
cache starts from, as constant inputs. A GPT whose blocks, embedding and loss do arithmetic with
such constants (a scalar and a vector of the hidden size) must match the unsharded model on the
loss and every gradient on 1 and 2 gloo ranks (tp=2 by the megatron and the automatic plan, pp=2,
bf16); a Hugging Face Llama called the natural way, without ``use_cache=False``, must train as
the unsharded model does and say once that ``use_cache=False`` is the better call.
"""
from __future__ import annotations

import json
import warnings

import pytest
import torch
import torch.nn.functional as F

import autopar
from autopar.examples.gpt import GPT, Block
import pool
from parity import unsharded
from parity import BATCH, SEQ, TINY, example_inputs

transformers = pytest.importorskip("transformers")

VOCAB = 96


class ConstBlock(Block):
    """A GPT block that scales its output and shifts it by a per-channel vector, both made from data."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shift = torch.tensor([0.01 * (k % 7) for k in range(x.shape[-1])])
        return super().forward(x) * torch.tensor(0.9) + shift


class ConstGPT(GPT):
    """The example GPT with constants in its blocks, after its embedding and on its loss."""

    def __init__(self, cfg):
        super().__init__(cfg)
        self.transformer.h = torch.nn.ModuleList([ConstBlock(cfg) for _ in range(cfg.n_layer)])
        self.apply(self._init_weights)

    def forward(self, idx: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        pos = torch.arange(idx.shape[1], device=idx.device)
        x = self.transformer.wte(idx) * torch.tensor(1.5) + self.transformer.wpe(pos)
        for block in self.transformer.h:
            x = block(x)
        logits = self.lm_head(self.transformer.ln_f(x))
        return F.cross_entropy(logits.view(-1, logits.size(-1)), targets.view(-1)) * torch.tensor(2.0)


class NaturalLM(torch.nn.Module):
    """A Hugging Face causal LM wrapped as users first write it: no ``use_cache=False``."""

    def __init__(self, lm):
        super().__init__()
        self.lm = lm

    def forward(self, input_ids, labels):
        return self.lm(input_ids=input_ids, labels=labels).loss


def _toy():
    torch.manual_seed(0)
    return ConstGPT(TINY)


def _llama():
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=16,
                                   bos_token_id=0, eos_token_id=0, attn_implementation="sdpa")
    return NaturalLM(transformers.LlamaForCausalLM(cfg))


BUILD = {"toy": _toy, "llama": _llama}


def _batch(name):
    if name == "toy":
        return example_inputs(TINY, BATCH, SEQ)
    ids = torch.randint(0, VOCAB, (BATCH, SEQ), generator=torch.Generator().manual_seed(1))
    return ids, ids.clone()


def _reference(name):
    return unsharded(BUILD[name], _batch(name))[:2]


# the automatic plan prices on an h100 with a tight memory budget, so it shards what it can
AUTO = dict(plan="auto", device="h100", memory_budget=400_000)
# Under torch.compile (aot_eager, as a user's compile=True would trace them) on one rank and with the
# megatron plan; the other sharded runs eagerly (a compile of each costs seconds and reads the same
# lifted constants).
CASES = {
    1: [("toy", (1, 1, 1), dict(plan="auto")),
        ("llama", (1, 1, 1), dict(plan="auto"))],
    2: [("toy", (1, 1, 2), dict(plan="megatron")),
        ("toy", (1, 1, 2), dict(AUTO, compile=False)),
        ("toy", (1, 2, 1), dict(plan="auto", microbatches=2, compile=False)),
        ("toy", (1, 1, 2), dict(plan="megatron", precision="bf16", compile=False)),
        ("llama", (1, 1, 2), dict(plan="megatron"))],
}
IDS = [f"{name}-{mesh}-" + "-".join(f"{k}={v}" for k, v in knobs.items())
       for cases in CASES.values() for name, mesh, knobs in cases]


def _rank_all(rank, world, cases):
    out = []
    for name, mesh, knobs in cases:
        inputs = _batch(name)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("default")   # as a user sees them: each once
            pm = autopar.parallelize(BUILD[name](), mesh, inputs, **{"compile": "aot_eager", **knobs})
        loss = pm.train_step(*inputs).item()
        out.append((loss, pm.full_grads(), pm.plan.to_json(), [str(w.message) for w in caught]))
    return out


JOBS = {w: pool.job(w, _rank_all, cases, lane=pool.compiled(w)) for w, cases in CASES.items()}


@pytest.fixture(scope="module")
def results():
    return {w: j.result() for w, j in JOBS.items()}


@pytest.fixture(scope="module")
def refs():
    return {name: _reference(name) for name in BUILD}


@pytest.mark.parametrize("world,case", [(w, i) for w, cases in CASES.items() for i in range(len(cases))], ids=IDS)
def test_constants_match_the_unsharded_model(results, refs, world, case):
    name, mesh, knobs = CASES[world][case]
    ref_loss, ref_grads = refs[name]
    bf16 = knobs.get("precision") == "bf16"
    rtol, atol = (1e-2, 1e-2) if bf16 else (1e-5, 1e-6)
    for rank, per_case in enumerate(results[world]):
        loss, grads, _, _ = per_case[case]
        assert loss == pytest.approx(ref_loss, rel=rtol), f"rank {rank} loss"
        if bf16:
            continue
        assert set(grads) == set(ref_grads)
        for fqn, g in ref_grads.items():
            torch.testing.assert_close(grads[fqn], g, rtol=rtol, atol=atol, msg=f"rank {rank} grad {fqn}")


def test_tp_cases_really_shard(results):
    for world, cases in CASES.items():
        for i, (name, mesh, knobs) in enumerate(cases):
            if mesh[2] > 1:
                plan = json.loads(results[world][0][i][2])
                assert any(p["placements"]["tp"] != "R" for p in plan["parameters"]), f"{IDS[i]}: nothing sharded"


def test_hugging_face_cache_is_named_once(results):
    """The natural wrapper trains correctly but is told that use_cache=False is what it wants."""
    for world, cases in CASES.items():
        for i, (name, _, _) in enumerate(cases):
            said = [m for m in results[world][0][i][3] if "use_cache=False" in m]
            if name == "llama":
                assert len(said) == 1 and "autopar.hf.causal_lm_loss" in said[0], said
            else:
                assert not said
            for rank, per_case in enumerate(results[world][1:], start=1):   # rank 0 planned; the others are quiet
                assert not [m for m in per_case[i][3] if "use_cache=False" in m], (rank, IDS[i])
