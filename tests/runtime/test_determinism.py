"""Deterministic mode: one seed, bit-identical losses; another seed, other losses."""
import os
import random

import numpy
import pytest
import torch

import autopar
from autopar.examples.gpt import GPT, GPTConfig
import pool
from parity import pm_curve

# Dropout on, so the training steps draw random numbers too.
CFG = GPTConfig(vocab_size=64, block_size=16, n_layer=2, n_head=2, n_embd=16, dropout=0.1)


def _losses(seed):
    autopar.set_deterministic(seed)
    model = GPT(CFG)
    tokens = torch.randint(0, CFG.vocab_size, (4, 17))
    idx, tgt = tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()
    pm = autopar.parallelize(model, (1, 1, 2), (idx, tgt), compile=False)
    return pm_curve(pm, pm.optimizer(torch.optim.AdamW, lr=1e-2), (idx, tgt), 5)


def _switches() -> tuple:
    """The global switches set_deterministic turns on (a pooled rank runs other tests' jobs after this one)."""
    import torch._inductor.config as inductor_config
    return (torch.are_deterministic_algorithms_enabled(), torch.is_deterministic_algorithms_warn_only_enabled(),
            torch.backends.cudnn.deterministic, torch.backends.cudnn.benchmark,
            inductor_config.fallback_random, inductor_config.deterministic)


def _restore(saved: tuple) -> None:
    import torch._inductor.config as inductor_config
    torch.use_deterministic_algorithms(saved[0], warn_only=saved[1])
    torch.backends.cudnn.deterministic, torch.backends.cudnn.benchmark = saved[2:4]
    inductor_config.fallback_random, inductor_config.deterministic = saved[4:]


def _three_runs(rank, world_size):
    saved = _switches()
    try:
        first = _losses(1)
        torch.rand(100)   # whatever ran in between must not matter
        return first, _losses(1), _losses(2)
    finally:
        _restore(saved)


THREE_RUNS = pool.job(2, _three_runs, timeout=300)


def test_same_seed_gives_bitwise_identical_losses():
    for first, again, other in THREE_RUNS.result():
        assert first == again
        assert first != other
        assert len(set(first)) == 5   # the model trains: five different losses


def test_set_deterministic_configures_torch_and_seeds_every_rng(monkeypatch):
    monkeypatch.delenv("CUBLAS_WORKSPACE_CONFIG", raising=False)
    import torch._inductor.config as inductor_config
    saved = _switches()
    try:
        autopar.set_deterministic(5)
        draws = (random.random(), numpy.random.rand(), torch.rand(1).item())
        autopar.set_deterministic(5)
        assert (random.random(), numpy.random.rand(), torch.rand(1).item()) == draws
        assert torch.are_deterministic_algorithms_enabled()
        assert torch.backends.cudnn.deterministic and not torch.backends.cudnn.benchmark
        assert inductor_config.fallback_random and inductor_config.deterministic
        assert os.environ["CUBLAS_WORKSPACE_CONFIG"] == ":4096:8"
    finally:
        _restore(saved)


@pytest.mark.parametrize("seed", [-1, 2**63, 1.5, True])
def test_bad_seed_is_refused(seed):
    with pytest.raises(ValueError, match="expected an int from 0 to 2"):
        autopar.set_deterministic(seed)
