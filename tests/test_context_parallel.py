"""Context parallelism (a cp mesh axis) against the unsharded model on gloo ranks: loss, every
gathered gradient and 10 AdamW steps, with a plain torch optimizer over ``pm.parameters()`` and
with ``pm.optimizer``; cp alone (2, 4), with tp and sequence parallelism, with dp at ZeRO-1 and
ZeRO-3, with pp, and Hugging Face Llama (rotary positions, its own position mask, shifted labels);
with ring attention (cp_attention="ring") at cp=2 and 4 and on Llama (there also with recompute="full":
the checkpoint regions take the rotary tables cut in the middle of them).
The rank's graph holds one cp attention per layer (``context_attention``, two all-gathers over
cp, or ``ring_attention``, cp-1 block transfers), as the plan counts them; a checkpoint written on dp=2 x cp=2 (ZeRO-1) trains on at cp=4. Offline (meta device, no processes): the mesh's rank layout, the plan's record of
cp, and the errors for a sequence 2·cp does not divide and for attention cp cannot split."""
from __future__ import annotations

import dataclasses
import functools
import json

import pytest
import torch

import autopar
import pool
from parity import unsharded
from autopar import collectives as C
from autopar.errors import PlanError
from autopar.examples.gpt import GPT, GPTConfig, example_inputs
from autopar.mesh import Mesh
from autopar.passes.context_parallel import ContextParallelError, check_sequence
from autopar.plans import Plan
from parity import adamw_for, pm_curve

CFG = GPTConfig(vocab_size=96, block_size=16, n_layer=2, n_head=4, n_embd=32)
BATCH, SEQ, STEPS, LR = 4, 16, 10, 1e-3
# (mesh, model, optimizer, knobs): plain = torch.optim.AdamW(pm.parameters()), own = pm.optimizer(AdamW).
# "gpt-ignore" has ignored targets: cp alone averages over all the tokens it keeps (dp and microbatches
# average their ranks' means, as without cp, so those cases score every token)
CASES = [({"cp": 2}, "gpt-ignore", "plain", {}),
         ({"cp": 2}, "llama", "own", {}),
         ({"cp": 4}, "gpt-ignore", "own", {}),
         ({"cp": 2}, "gpt-ignore", "plain", {"cp_attention": "ring"}),
         ({"cp": 2}, "llama", "own", {"cp_attention": "ring"}),
         ({"cp": 2}, "llama", "plain", {"cp_attention": "ring", "recompute": "full"}),
         ({"cp": 4}, "gpt-ignore", "own", {"cp_attention": "ring"}),
         ({"cp": 2, "tp": 2}, "gpt-ignore", "plain", {"plan": "megatron", "sequence_parallel": True}),
         ({"dp": 2, "cp": 2}, "gpt", "own", {"zero": 1}),
         ({"dp": 2, "cp": 2}, "gpt", "plain", {"zero": 3, "keep_gathered": ()}),
         ({"cp": 2, "pp": 2}, "gpt", "own", {})]


def _world(mesh: dict) -> int:
    return Mesh.parse(mesh).world_size


def build(name: str, layers: int = 2):
    torch.manual_seed(0)
    if name.startswith("gpt"):
        return GPT(dataclasses.replace(CFG, n_layer=layers))
    import transformers
    from autopar.hf import causal_lm_loss
    cfg = transformers.LlamaConfig(vocab_size=96, hidden_size=32, intermediate_size=64, num_hidden_layers=layers,
                                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=SEQ,
                                   bos_token_id=0, eos_token_id=0, pad_token_id=0, attn_implementation="sdpa")
    return causal_lm_loss(transformers.LlamaForCausalLM(cfg))


def batch(name: str):
    if name.startswith("gpt"):
        idx, tgt = example_inputs(CFG, BATCH, SEQ)
        if name == "gpt-ignore":
            tgt[0, 3] = tgt[2, 12] = tgt[3, 0] = -1   # GPT's ignore_index: left out of the mean
        return idx, tgt
    ids = torch.randint(0, 96, (BATCH, SEQ), generator=torch.Generator().manual_seed(1))
    ids[:, ::5] = 0   # padding ids (Hugging Face shifts the labels itself)
    return ids, ids.clone()


def _one(rank, world, mesh, name, optimizer, knobs):
    inputs = batch(name)
    pm = autopar.parallelize(build(name), mesh, inputs, compile=False, device="cpu", **knobs)
    loss = pm.train_step(*inputs).item()
    grads = pm.full_grads()
    graphs = [m.graph for m in pm.graph_module.modules() if isinstance(m, torch.fx.GraphModule)]   # recompute's too
    attention = sum(1 for g in graphs for n in g.nodes if n.target is C.CP_ATTENTIONS[pm.plan.cp_attention])
    kind = "send_recv" if pm.plan.cp_attention == "ring" else "all_gather"
    planned = sum(c.count for c in pm.plan.collectives if (c.kind, c.axis, c.phase) == (kind, "cp", "fwd"))
    curve = pm_curve(pm, adamw_for(pm, optimizer, LR), inputs, STEPS)
    try:   # a batch of a sequence length 2·cp chunks do not split (other lengths are lowered again)
        pm.train_step(*(x[:, :SEQ - 1] for x in inputs))
        wrong = None
    except ValueError as e:
        wrong = str(e)
    return (loss, grads, curve, attention, planned, pm.plan.microbatches, pm.plan.sequence_parallel, wrong,
            pm.plan.cp_attention)


def _cases(rank, world, cases):
    return [_one(rank, world, *case) for case in cases]


JOBS = {w: pool.job(w, _cases, [c for c in CASES if _world(c[0]) == w], timeout=600)
        for w in sorted({_world(c[0]) for c in CASES})}


def _moved(rank, world, path):
    """Two steps on dp=2 x cp=2 at ZeRO-1, a checkpoint, then the next step there and, loaded, on cp=4."""
    from autopar.checkpoint import load_checkpoint, save_checkpoint
    inputs = batch("gpt")
    losses = []
    for mesh, knobs in (({"dp": 2, "cp": 2}, {"zero": 1}), ({"cp": 4}, {})):
        pm = autopar.parallelize(build("gpt"), mesh, inputs, compile=False, device="cpu", **knobs)
        opt = pm.optimizer(torch.optim.AdamW, lr=1e-2)
        if not losses:
            pm_curve(pm, opt, inputs, 2)
            save_checkpoint(pm, opt, path)
        else:
            load_checkpoint(pm, opt, path)
        losses.append(pm_curve(pm, opt, inputs, 2))
    return losses


MOVED = pool.job(4, _moved, workdir=True, timeout=300)


@pytest.fixture(scope="module")
def refs():
    out = {}
    for name in {c[1] for c in CASES}:
        if name == "llama":
            pytest.importorskip("transformers")
        out[name] = unsharded(functools.partial(build, name), batch(name), steps=STEPS, lr=LR)
    return out


@pytest.mark.parametrize("case", CASES, ids=lambda c: "-".join(f"{a}{n}" for a, n in c[0].items()) + f"-{c[1]}-{c[2]}"
                         + "".join(f"-{k}{v}" for k, v in c[3].items() if k != "keep_gathered"))
def test_cp_matches_one_device(case, refs):
    mesh, name, _, knobs = case
    ref_loss, ref_grads, ref_curve = refs[name]
    w = _world(mesh)
    index = [c for c in CASES if _world(c[0]) == w].index(case)
    for rank, per_rank in enumerate(JOBS[w].result()):
        loss, grads, curve, attention, planned, microbatches, sp, wrong, variant = per_rank[index]
        assert loss == pytest.approx(ref_loss, rel=1e-5), rank
        for fqn, g in ref_grads.items():
            torch.testing.assert_close(grads[fqn], g, rtol=1e-5, atol=1e-6, msg=fqn)
        assert curve == pytest.approx(ref_curve, rel=1e-4)
        # one cp attention per layer in the rank's graph, of the plan's variant; the plan counts K and V
        # gathered per microbatch, or the ring's cp-1 block transfers
        assert variant == knobs.get("cp_attention", variant)
        assert attention == 2
        steps = 2 if variant == "allgather" else mesh["cp"] - 1
        assert planned == steps * attention * microbatches
        assert sp == bool(knobs.get("sequence_parallel"))
        assert wrong is not None and f"sequence of {SEQ - 1} tokens" in wrong, wrong


# ---- offline: the mesh, the plan, bad input ---------------------------------------------------------

def test_mesh_layout():
    mesh = Mesh.parse({"dp": 2, "pp": 2, "cp": 2, "tp": 2})
    assert mesh.world_size == 16 and mesh.data == 4 and str(mesh) == "(dp=2, pp=2, cp=2, tp=2)"
    # dp, pp, cp, tp from outermost to innermost
    assert [mesh.inner_size(a) for a in ("dp", "pp", "cp", "tp")] == [8, 4, 2, 1]
    assert {a: mesh.coords(13)[a] for a in ("dp", "pp", "cp", "tp")} == {"dp": 1, "pp": 1, "cp": 0, "tp": 1}
    assert Mesh.parse((2, 1, 2)) == Mesh(2, 1, 2) and Mesh(2, 1, 2).cp == 1 and str(Mesh(2, 1, 2)) == "(dp=2, pp=1, tp=2)"
    with pytest.raises(ValueError, match="cp must be a positive integer"):
        Mesh.parse({"cp": 0})


def _meta(cfg=CFG):
    with torch.device("meta"):
        return GPT(cfg)


def test_plan_records_cp():
    plan = autopar.plan(_meta(), {"dp": 2, "cp": 2}, example_inputs(CFG, BATCH, SEQ), device="cpu")
    assert plan.cp == 2 and Mesh.of_plan(plan) == Mesh(2, 1, 1, cp=2)
    assert "pp=1 cp=2 tp=1" in plan.summary()
    assert all(p.placements["cp"] == "R" for p in plan.parameters)
    assert Plan.from_json(plan.to_json()) == plan
    old = json.loads(plan.to_json())
    del old["cp"]   # a plan file from before cp: one rank per sequence
    assert Plan.from_json(json.dumps(old)).cp == 1
    assert "cp: 2 -> 1" in plan.diff(Plan.from_json(json.dumps(old)))
    with pytest.raises(PlanError, match="cp=2"):   # a plan made for cp=2 on a mesh without cp
        autopar.plan(_meta(), {"dp": 2}, example_inputs(CFG, BATCH, SEQ), device="cpu", plan=plan)


def test_sequence_cp_does_not_divide():
    with pytest.raises(ContextParallelError, match=r"cp=4: the sequence of 12 tokens .* valid cp for this sequence: 1, 2, 3, 6"):
        autopar.plan(_meta(), {"cp": 4}, example_inputs(CFG, BATCH, 12), device="cpu")
    with pytest.raises(ContextParallelError, match="multiple of tp=8 tokens per rank.*valid cp for this sequence: 1, 3"):
        check_sequence(24, 2, tp=8, sequence_parallel=True)   # sequence parallelism shards each rank's tokens


def test_attention_cp_cannot_split():
    explicit = GPTConfig(vocab_size=96, block_size=16, n_layer=2, n_head=4, n_embd=32, attention="explicit")
    with pytest.raises(ContextParallelError, match=r"transformer\.h\.0\.attn.*scaled_dot_product_attention"):
        autopar.plan(_meta(explicit), {"cp": 2}, example_inputs(explicit, BATCH, SEQ), device="cpu")

    class Bidirectional(torch.nn.Module):   # attention over the whole sequence: no causal mask
        def __init__(self):
            super().__init__()
            self.emb = torch.nn.Embedding(96, 32)
            self.head = torch.nn.Linear(32, 96)

        def forward(self, idx, tgt):
            x = self.emb(idx).unsqueeze(1)
            x = torch.nn.functional.scaled_dot_product_attention(x, x, x)
            return torch.nn.functional.cross_entropy(self.head(x.squeeze(1)).flatten(0, 1), tgt.flatten())

    with torch.device("meta"):
        model = Bidirectional()
    with pytest.raises(ContextParallelError, match="not causal.*use cp=1"):
        autopar.plan(model, {"cp": 2}, example_inputs(CFG, BATCH, SEQ), device="cpu")


def test_checkpoint_moves_between_cp_meshes():
    for on_cp2, on_cp4 in MOVED.result():
        assert on_cp4 == pytest.approx(on_cp2, rel=1e-5)


def test_cp_pricing():
    """Each cp rank does 1/cp of the whole sequence's work and keeps 1/cp of its activations plus
    the gathered keys and values whole and its rows of each attention's mask (tests/cost_model/test_context_memory.py
    measures it), and pays the cp collectives."""
    cfg = GPTConfig(vocab_size=512, block_size=256, n_layer=2, n_head=8, n_embd=256)
    plans = {cp: autopar.plan(_meta(cfg), {"cp": cp}, example_inputs(cfg, 2, 256), device="h100") for cp in (1, 2)}
    one, two = plans[1], plans[2]
    assert two.predicted_compute_s == pytest.approx(one.predicted_compute_s / 2)
    assert one.predicted_comm_s == 0 < two.predicted_comm_s
    gathered = sum(c.bytes for c in two.collectives if (c.kind, c.axis) == ("all_gather", "cp")) / 2
    # at cp=2 each gather receives the other half: the rank keeps twice that, the whole K and V, and
    # per layer the mask's 128 query rows by 256 keys in fp32
    masks = 2 * 128 * 256 * 4
    assert two.memory[0].activations == pytest.approx(one.memory[0].activations / 2 + 2 * gathered + masks)
    # 2 layers x (K, V) per step, whole sequence at every head
    assert sum(c.count for c in two.collectives if (c.kind, c.axis) == ("all_gather", "cp")) == 4
    assert gathered == 4 * 2 * 256 * 256 * 4 / 2   # fp32 (batch, heads, sequence, head dim) each


class _MeanFree(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.linear = torch.nn.Linear(32, 32)

    def forward(self, x):   # subtracts the sequence's mean: a reduction over the sequence cp cannot split
        return x + self.linear(x - x.mean(dim=1, keepdim=True))


class _SequenceMean(torch.nn.Module):
    def __init__(self, layers: int):
        super().__init__()
        self.emb = torch.nn.Embedding(96, 32)
        self.layers = torch.nn.ModuleList(_MeanFree() for _ in range(layers))
        self.head = torch.nn.Linear(32, 96)

    def forward(self, idx, tgt):
        x = self.emb(idx)
        for layer in self.layers:
            x = layer(x)
        return torch.nn.functional.cross_entropy(self.head(x).flatten(0, 1), tgt.flatten())


@pytest.mark.parametrize("name", ["gpt", "llama", "sequence-mean"])
def test_cp_check_on_the_first_layers_agrees_with_the_whole_graph(name):
    """A capture built by repeating layers is checked for cp on the trace of its first three layers
    (``Captured.excerpt``); for every cp the verdict is the one its whole graph gives."""
    from autopar.graph.block_capture import MIN_LAYERS
    from autopar.graph.capture import capture_pass
    from autopar.planner.mesh_search import allows_context
    model = _SequenceMean(MIN_LAYERS) if name == "sequence-mean" else build(name, MIN_LAYERS)
    cap = capture_pass(model, example_inputs(CFG, BATCH, SEQ), require_loss=True)
    assert cap.excerpt is not None and len(cap.excerpt.gm.graph.nodes) < len(cap.gm.graph.nodes)
    whole = dataclasses.replace(cap.copy(), excerpt=None)
    verdicts = {cp: allows_context(cap, cp) for cp in (2, 4, 8)}
    assert verdicts == {cp: allows_context(whole, cp) for cp in (2, 4, 8)}
    refused = name == "sequence-mean"
    assert all(verdicts.values()) == refused and any(verdicts.values()) == refused
