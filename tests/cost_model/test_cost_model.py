"""Tests of autopar.cost_model v1: device specs, ring collective costs, op FLOPs and bytes."""
from __future__ import annotations

import json
import operator
import time

import pytest
import torch

from autopar.cost_model.comm import axis_is_inter_node, collective_time
from autopar.cost_model.compute import compute_time, node_bytes, node_flops, op_flops
from autopar.cost_model.devices import DEVICES, DeviceSpec, get_device
from autopar.cost_model.comm import collective_bytes_on_wire

aten = torch.ops.aten


@pytest.fixture(scope="module")
def tiny_graph():
    from autopar.examples.gpt import build, example_inputs

    m = build("tiny")
    idx, tgt = example_inputs(m.config, 2, 16)
    ep = torch.export.export(m, (idx, tgt))
    return m.config, list(ep.graph_module.graph.nodes)


# ----------------------------------------------------------------------------- devices

def test_presets_and_dtype_mapping():
    h100 = DEVICES["h100"]
    assert h100.flops(torch.bfloat16) == 989e12
    # fp32 stays fp32: TF32 tensor cores are opt-in.
    assert h100.flops(torch.float32) == 67e12
    assert h100.flops("tf32") == 494e12
    assert h100.flops("fp8") == 1979e12
    assert DEVICES["h200"].memory_bytes == 141 * 10**9
    assert DEVICES["h200"].mem_bandwidth == 4.8e12
    assert DEVICES["a100"].flops("bf16") == 312e12
    with pytest.raises(ValueError, match="fp8"):
        DEVICES["a100"].flops("fp8")
    assert get_device("H200") is DEVICES["h200"]
    assert get_device(DEVICES["cpu"]) is DEVICES["cpu"]
    assert hash(DEVICES["h100"]) == hash(DeviceSpec.from_json(DEVICES["h100"].to_json()))


def test_devicespec_json_round_trip(tmp_path):
    for spec in DEVICES.values():
        assert DeviceSpec.from_json(spec.to_json()) == spec
    path = tmp_path / "dev.json"
    DEVICES["h200"].to_json(path)
    assert DeviceSpec.from_json(str(path)) == DEVICES["h200"]
    assert get_device(str(path)) == DEVICES["h200"]


def test_malformed_profile_names_field(tmp_path):
    good = DEVICES["h100"].to_dict()
    missing = dict(good)
    del missing["mem_bandwidth"]
    with pytest.raises(ValueError, match="mem_bandwidth"):
        DeviceSpec.from_json(json.dumps(missing))
    bad = dict(good, inter_node_bw="fast")
    with pytest.raises(ValueError, match="inter_node_bw"):
        DeviceSpec.from_json(json.dumps(bad))
    typo = dict(good, peak_flop={"bf16": 1.0})
    with pytest.raises(ValueError, match="peak_flop"):
        DeviceSpec.from_json(json.dumps(typo))
    bad_key = dict(good, peak_flops={"bfloat": 1e12})
    with pytest.raises(ValueError, match="bfloat"):
        DeviceSpec.from_json(json.dumps(bad_key))
    path = tmp_path / "broken.json"
    path.write_text("{not json")
    with pytest.raises(ValueError, match="not valid JSON"):
        DeviceSpec.from_json(str(path))


def test_get_device_unknown_lists_presets():
    with pytest.raises(ValueError) as ei:
        get_device("tpu-v9")
    msg = str(ei.value)
    for name in ("h100", "h200", "a100", "cpu"):
        assert name in msg


# ----------------------------------------------------------------------------- comm

def test_ring_factors():
    dev = DEVICES["h100"]
    nbytes = 64e6
    bw, alpha = dev.intra_node_bw, dev.intra_node_latency
    assert collective_time("all_reduce", nbytes, 4, dev) == pytest.approx(
        2 * 3 / 4 * nbytes / bw + 6 * alpha)
    for kind in ("all_gather", "reduce_scatter", "all_to_all"):
        assert collective_time(kind, nbytes, 4, dev) == pytest.approx(3 / 4 * nbytes / bw + 3 * alpha)
        assert collective_bytes_on_wire(kind, nbytes, 4) == pytest.approx(0.75 * nbytes)
    assert collective_bytes_on_wire("all_reduce", nbytes, 4) == pytest.approx(1.5 * nbytes)
    for kind in ("all_reduce", "all_gather", "reduce_scatter", "all_to_all"):
        assert collective_time(kind, nbytes, 1, dev) == 0
    inter = collective_time("all_reduce", nbytes, 4, dev, inter_node=True)
    assert inter == pytest.approx(1.5 * nbytes / dev.inter_node_bw + 6 * dev.inter_node_latency)
    # all-reduce = reduce-scatter + all-gather under the ring model.
    assert collective_time("all_reduce", nbytes, 8, dev) == pytest.approx(
        collective_time("reduce_scatter", nbytes, 8, dev) + collective_time("all_gather", nbytes, 8, dev))
    with pytest.raises(ValueError, match="all_reduce"):
        collective_time("allreduce", nbytes, 4, dev)


def test_axis_is_inter_node():
    # tp=8 is innermost and fills a node exactly.
    assert not axis_is_inter_node(8, 1, 8)
    assert axis_is_inter_node(16, 1, 8)
    # dp outside tp=8: every dp peer is on another node.
    assert axis_is_inter_node(2, 8, 8)
    # mesh (dp=4, pp=2, tp=4) on 8-GPU nodes: pp (inner 4) stays inside, dp (inner 8) crosses.
    assert not axis_is_inter_node(2, 4, 8)
    assert axis_is_inter_node(4, 8, 8)
    assert not axis_is_inter_node(1, 64, 8)


# ----------------------------------------------------------------------------- compute

def test_linear_flops():
    M, K, N = 48, 64, 96
    x = torch.randn(M, K)
    w = torch.randn(N, K)
    b = torch.randn(N)
    fwd, bwd = op_flops(aten.linear.default, (x, w, b), {})
    assert fwd == 2 * M * N * K
    assert bwd == 4 * M * N * K  # input grad + weight grad
    # batched input and devices other than cpu behave the same
    x3 = torch.empty(2, M // 2, K, device="meta")
    w16 = torch.empty(N, K, device="meta", dtype=torch.bfloat16)
    assert op_flops(aten.linear.default, (x3.bfloat16(), w16), {}) == (2 * M * N * K, 4 * M * N * K)
    # no floating input requires grad -> no backward
    idx = torch.zeros(4, 8, dtype=torch.long)
    assert op_flops(aten.embedding.default, (torch.randn(16, 8), idx), {})[0] == 0


def test_sdpa_and_misc_ops():
    q = torch.empty(2, 4, 64, 16, device="meta")
    fwd, bwd = op_flops(aten.scaled_dot_product_attention.default, (q, q, q), {"is_causal": True})
    assert fwd > 0
    assert 2.0 * fwd <= bwd <= 2.5 * fwd
    x = torch.empty(8, 32)
    assert op_flops(aten.gelu.default, (x,), {"approximate": "tanh"}) == (0.0, 0.0)
    assert op_flops(aten.layer_norm.default, (x, [32], torch.ones(32), torch.zeros(32), 1e-5, True), {}) \
        == (0.0, 0.0)
    assert op_flops(aten.view.default, (x, [4, 64]), {}) == (0.0, 0.0)
    tgt = torch.zeros(8, dtype=torch.long)
    assert op_flops(aten.cross_entropy_loss.default, (x, tgt), {}) == (0.0, 0.0)
    assert op_flops(operator.getitem, ([x, x], 0), {}) == (0.0, 0.0)
    # in-place ops run on non-leaf copies; their forward is counted via the functional op
    c, a, b = torch.empty(4, 16), torch.empty(4, 8), torch.empty(8, 16)
    assert op_flops(aten.addmm_.default, (c, a, b), {}) == (2 * 4 * 8 * 16, 4 * 4 * 8 * 16)


def test_node_flops_dynamic_batch():
    from autopar.examples.gpt import build, example_inputs

    m = build("tiny", n_layer=1)
    idx, tgt = example_inputs(m.config, 2, 16)
    b = torch.export.Dim("b", min=2, max=64)
    ep = torch.export.export(m, (idx, tgt), dynamic_shapes=({0: b}, {0: b}))
    C = m.config.n_embd
    first = next(n for n in ep.graph_module.graph.nodes if n.target is aten.linear.default)
    # symbolic sizes are priced at their example value (batch 2)
    assert node_flops(first) == (2 * 2 * 16 * C * 3 * C, 4 * 2 * 16 * C * 3 * C)
    assert node_bytes(first) > 0


def test_node_flops_on_exported_gpt(tiny_graph):
    cfg, nodes = tiny_graph
    B, T, C = 2, 16, cfg.n_embd
    linears = [n for n in nodes if n.target is aten.linear.default]
    first = linears[0]  # the fused QKV projection of block 0
    assert node_flops(first) == (2 * B * T * C * 3 * C, 4 * B * T * C * 3 * C)
    lm_head = linears[-1]
    assert node_flops(lm_head)[0] == 2 * B * T * C * cfg.vocab_size
    # bytes: x (B,T,C) + W (3C,C) + b (3C) read, (B,T,3C) written, fp32
    assert node_bytes(first) == 4 * (B * T * C + 3 * C * C + 3 * C + B * T * 3 * C)
    views = [n for n in nodes if n.target in (aten.view.default, aten.transpose.int, operator.getitem)]
    assert views and all(node_bytes(n) == 0 for n in views)
    assert all(node_flops(n) == (0.0, 0.0) for n in nodes if n.op != "call_function")
    sdpa = [n for n in nodes if n.target is aten.scaled_dot_product_attention.default]
    assert len(sdpa) == cfg.n_layer and node_flops(sdpa[0])[0] > 0

    # Total forward matmul FLOPs: 2 * tokens * (12 C^2 per layer + V C) plus attention.
    fwd = sum(node_flops(n)[0] for n in nodes)
    tokens = B * T
    expected = 2 * tokens * (12 * C * C * cfg.n_layer + C * cfg.vocab_size) \
        + cfg.n_layer * 4 * B * T * T * C
    assert fwd == expected

    from autopar.cost_model import compute

    compute._CACHE.clear()
    t0 = time.perf_counter()
    for n in nodes:
        node_flops(n)
    uncached = time.perf_counter() - t0
    assert uncached < 2.0, f"pricing the tiny GPT took {uncached:.2f}s"


def test_compute_time_roofline():
    dev = DEVICES["h200"]
    # big matmul: compute bound
    flops = 2 * 8192**3
    t = compute_time(flops, 3 * 8192 * 8192 * 2, dev, torch.bfloat16)
    assert t == pytest.approx(flops / (989e12 * 0.82))
    # elementwise: memory bound, dtype irrelevant when there are no FLOPs
    assert compute_time(0, 4.8e9, dev, None) == pytest.approx(1e-3)
    assert compute_time(1e6, 4.8e9, dev, torch.float32) == pytest.approx(1e-3)
