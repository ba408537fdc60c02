"""Peer ranks compile each graph once (autopar.runtime.compile_once): the order kept through a store,
bounded waits, and on two gloo ranks with a cache of their own, the leader compiles while its peer
finds every graph in Inductor's cache."""
from __future__ import annotations

import os
import threading
import time
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist

import pool
from autopar.runtime import compile_once
from autopar.runtime.compile_once import CompileOrder


def _pair(store):
    return CompileOrder("t", leader=True, store=store), CompileOrder("t", leader=False, store=store)


def test_a_follower_compiles_after_its_leader():
    store = dist.HashStore()
    leader, follower = _pair(store)
    seen = []

    def lead():
        with leader.turn():
            time.sleep(0.3)
            seen.append("leader")
    thread = threading.Thread(target=lead)
    thread.start()
    store.wait(["t/0/start"], timedelta(seconds=10))
    with follower.turn():
        seen.append("follower")
    thread.join()
    assert seen == ["leader", "follower"]
    assert store.check(["t/0/end"]) and not store.check(["t/1/start"])


def test_a_failed_compile_of_the_leader_still_releases_its_peer():
    store = dist.HashStore()
    leader, follower = _pair(store)
    with pytest.raises(RuntimeError):
        with leader.turn():
            raise RuntimeError("the compile failed")
    start = time.monotonic()
    with follower.turn():
        pass
    assert time.monotonic() - start < 1


def test_a_follower_whose_leader_never_compiles_goes_on_alone(monkeypatch):
    monkeypatch.setattr(compile_once, "START_S", 0.2)
    _, follower = _pair(dist.HashStore())
    start = time.monotonic()
    with follower.turn():
        pass
    assert 0.2 <= time.monotonic() - start < 5


def test_the_switch(monkeypatch):
    monkeypatch.setenv("AUTOPAR_COMPILE_ONCE", "0")
    assert not compile_once.enabled()
    monkeypatch.delenv("AUTOPAR_COMPILE_ONCE")
    assert compile_once.enabled()


def _compiled_dp2(rank, world, path):
    """The tiny GPT at dp=2 through Inductor, with a cache directory only this job uses: per rank,
    its loss, gradients and Inductor's FX graph cache hits and misses."""
    import autopar
    from torch._dynamo.utils import counters
    from autopar.examples.gpt import example_inputs
    from parity import BATCH, SEQ, TINY, make_model

    before = os.environ.get("TORCHINDUCTOR_CACHE_DIR")
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = str(path)
    try:
        hits, misses = counters["inductor"]["fxgraph_cache_hit"], counters["inductor"]["fxgraph_cache_miss"]
        idx, tgt = example_inputs(TINY, BATCH, SEQ)
        pm = autopar.parallelize(make_model(TINY), (2, 1, 1), (idx, tgt), compile=True)
        loss = pm.train_step(idx, tgt).item()
        return (loss, pm.full_grads(), counters["inductor"]["fxgraph_cache_hit"] - hits,
                counters["inductor"]["fxgraph_cache_miss"] - misses)
    finally:
        if before is None:
            del os.environ["TORCHINDUCTOR_CACHE_DIR"]
        else:
            os.environ["TORCHINDUCTOR_CACHE_DIR"] = before


DP2 = pool.job(2, _compiled_dp2, workdir=True, timeout=600, lane="inductor")


def test_the_peer_of_the_leader_finds_its_graphs_in_the_cache():
    """Rank 0 compiles the forward and the backward (two misses); rank 1, its peer, compiles after
    it and finds both in the cache; the losses and gradients are the unsharded model's."""
    from parity import reference
    (loss0, grads0, hit0, miss0), (loss1, grads1, hit1, miss1) = DP2.result()
    assert (hit0, miss0) == (0, 2)
    assert (hit1, miss1) == (2, 0)
    ref_loss, ref_grads, _ = reference()
    for loss, grads in ((loss0, grads0), (loss1, grads1)):
        assert loss == pytest.approx(ref_loss, rel=1e-5)
        for name, g in ref_grads.items():
            torch.testing.assert_close(grads[name], g, rtol=1e-4, atol=1e-5)


def test_only_inductor_compiles_take_turns(monkeypatch):
    """With peers, Inductor (True, a mode, an overlap backend) compiles in turn, with the options it
    has without peers; another backend ("aot_eager": no cache to share) compiles as it is."""
    from autopar.overlap import overlap_backend
    from autopar.runtime.parallel_model import lower

    seen = []
    monkeypatch.setattr(torch, "compile", lambda gm, **kw: seen.append(kw) or gm)
    gm = torch.fx.symbolic_trace(torch.nn.ReLU())
    order = CompileOrder("t", leader=True, store=dist.HashStore())
    overlap = overlap_backend("scheduler")
    for compile, regather in ((True, False), (True, True), ("max-autotune-no-cudagraphs", False),
                              (overlap, False), ("aot_eager", False), ("inductor", False)):
        lower(gm, compile, regather=regather, order=order)
    plain, regathered, mode, overlapped, eager, named = (kw["backend"] for kw in seen)
    assert isinstance(named, compile_once._Ordered) and named.backend.config == {}
    assert isinstance(plain, compile_once._Ordered) and plain.backend.config == {}
    assert set(regathered.backend.config) == {"joint_custom_pre_pass"}
    assert mode.backend.config == torch._TorchCompileInductorWrapper("max-autotune-no-cudagraphs", None, None).config
    assert isinstance(overlapped, compile_once._Ordered) and overlapped.backend is overlap
    assert eager == "aot_eager"
