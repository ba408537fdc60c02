"""Shared helpers for parity tests: the reference run and the parallel run on gloo ranks."""
from __future__ import annotations

import dataclasses

import torch

import autopar
from autopar.compare import train_curve
from autopar.cost_model.devices import get_device
from autopar.examples.gpt import GPTConfig, GPT, example_inputs

# links nearly free, so the solver shards everything it can (on real links a tiny model stays replicated)
FREE_LINKS = dataclasses.replace(get_device("h100"), intra_node_bw=1e15, inter_node_bw=1e15,
                                 intra_node_latency=0.0, inter_node_latency=0.0, collective_fits=())
# a model this small costs a few collective launches per op on free links alone: slow compute a
# millionfold so that dividing it pays, and the run shards (and communicates) all it can
SLOW_COMPUTE = dataclasses.replace(FREE_LINKS, peak_flops={k: v * 1e-6 for k, v in FREE_LINKS.peak_flops.items()},
                                   mem_bandwidth=FREE_LINKS.mem_bandwidth * 1e-6,
                                   fused_bandwidth=FREE_LINKS.fused_bandwidth * 1e-6)

TINY = GPTConfig(vocab_size=96, block_size=16, n_layer=2, n_head=4, n_embd=32)
BATCH, SEQ = 4, 12
# The ZeRO tests that run Inductor (test_zero_memory, test_zero_overlap) compile this model at this
# batch on (2, 1, 1): one zero=3 compile serves both through Inductor's cache. Parameters are about
# 7 MB and activations about 38 MB per rank, far above a step's bookkeeping tensors.
ZERO_CFG = GPTConfig(vocab_size=512, block_size=128, n_layer=2, n_head=4, n_embd=256)
ZERO_BATCH, ZERO_SEQ = 16, 128


def make_model(cfg: GPTConfig = TINY, seed: int = 0) -> GPT:
    torch.manual_seed(seed)
    return GPT(cfg)


def unsharded(build, inputs: tuple, *, steps: int = 0, lr: float = 1e-3):
    """The unsharded reference run every parity test compares with: the loss and every gradient
    (tied weights under each of their names) of ``build()`` on ``inputs``, and with ``steps`` the
    losses of that many ``torch.optim.AdamW`` steps of a fresh ``build()`` on the same batch."""
    model = build()
    loss = model(*inputs)
    loss.backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters(remove_duplicate=False)}
    curve = train_curve(build(), *inputs, steps, lr) if steps else []
    return loss.item(), grads, curve


def reference(cfg: GPTConfig = TINY, steps: int = 0, lr: float = 1e-3, batch: int = BATCH):
    """``unsharded`` for the example GPT of ``cfg`` on ``batch`` sequences of ``SEQ`` tokens."""
    return unsharded(lambda: make_model(cfg), example_inputs(cfg, batch, SEQ), steps=steps, lr=lr)


def parallel_run(rank, world, mesh, knobs, cfg=TINY, steps=0, lr=1e-3, batch=BATCH):
    """On one rank: loss, gathered gradients and loss curve of the parallel model."""
    model = make_model(cfg)
    idx, tgt = example_inputs(cfg, batch, SEQ)
    pm = autopar.parallelize(model, mesh, (idx, tgt), **knobs)
    loss = pm.train_step(idx, tgt).item()
    grads = pm.full_grads() if not knobs.get("zero") else None
    curve = []
    if steps:   # the step above left the weights as they were: the same model trains on
        opt = pm.optimizer(torch.optim.AdamW, lr=lr)
        for _ in range(steps):
            opt.zero_grad()
            curve.append(pm.train_step(idx, tgt).item())
            opt.step()
    return loss, grads, curve, pm.plan.to_json()


def pm_curve(pm, opt, inputs, steps: int) -> list[float]:
    """The losses of ``steps`` steps of ``opt`` on the ParallelModel ``pm``, one batch."""
    curve = []
    for _ in range(steps):
        opt.zero_grad()
        curve.append(pm.train_step(*inputs).item())
        opt.step()
    return curve


def adamw_for(pm, optimizer: str, lr: float):
    """AdamW over ``pm``'s parameters as a user writes it ("plain": ``torch.optim.AdamW(pm.parameters())``)
    or through ``pm.optimizer`` (any other value)."""
    return torch.optim.AdamW(pm.parameters(), lr=lr) if optimizer == "plain" else pm.optimizer(torch.optim.AdamW, lr=lr)


def counted_gathers_step(pm, inputs, count: bool = True) -> tuple[float, tuple[int, int, int | None]]:
    """One train step of a ZeRO-2/3 ``pm``: its loss and (gather_param nodes, sharded_linear nodes in
    the rank's graphs and their regions, weight gathers the step ran, the backward's re-gathers
    included). ``count=False`` (a compiled ``pm``) leaves the last None: the counter, a Python
    side effect, would break the compiled graph and recompile it at every later step."""
    from autopar import collectives as C

    calls = [0]
    gather = C._gather_weight

    def counted(*args):
        calls[0] += 1
        return gather(*args)
    if count:
        C._gather_weight = counted
    try:
        loss = pm.train_step(*inputs).item()
    finally:
        C._gather_weight = gather
    graphs = [m.graph for m in pm.graph_module.modules() if isinstance(m, torch.fx.GraphModule)]
    return loss, (sum(1 for g in graphs for n in g.nodes if n.target is C.gather_param),
                  sum(1 for g in graphs for n in g.nodes if n.target is C.sharded_linear), calls[0] if count else None)
