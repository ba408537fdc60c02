"""ZeRO-3 under Inductor gathers a weight again in its backward (``runtime.compiler.lower``'s joint
pass), however Inductor is named: compile=True, "inductor" or one of its modes; so does a
sequence-parallel linear that keeps its input's shard (``gathered_linear``), also under "aot_eager".
Counted on a world whose collectives move no data (``runtime.fake_group``): the backward's all-gathers."""
from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from autopar import collectives as C
from autopar.runtime.compiler import lower
from autopar.runtime.fake_group import fake_world


@pytest.mark.parametrize("compile", [True, "inductor", "max-autotune-no-cudagraphs"])
def test_a_sharded_linear_gathers_its_weight_again_in_the_backward(compile):
    torch._dynamo.reset()
    with fake_world(2, 0) as tally:
        group = dist.distributed_c10d._get_default_group().group_name

        def step(x, shard):
            return C.sharded_linear(x, shard, group, 2, 8).sum()

        fn = lower(step, compile, regather=True)
        x, shard = torch.randn(4, 6, requires_grad=True), torch.randn(4, 6, requires_grad=True)
        fn(x, shard).backward()
        tally.clear()
        fn(x, shard).backward()
        gathers = {phase: n for (kind, _, phase), n in tally.calls.items() if kind == "all_gather"}
    # the forward's gather, and the backward's again rather than the forward's copy saved
    assert gathers == {"fwd": 1, "bwd": 1}


@pytest.mark.parametrize("compile", [True, "aot_eager"])
def test_a_sequence_parallel_linear_gathers_its_input_again_in_the_backward(compile):
    """Megatron's storage rule compiled: the linear's input (an op's output, not a graph input) is
    gathered in the forward and again in the backward, so only its shard is kept between them."""
    torch._dynamo.reset()
    with fake_world(2, 0) as tally:
        group = dist.distributed_c10d._get_default_group().group_name

        def step(x, w):
            return C.gathered_linear(torch.tanh(x), w, 0, group, 2, 0, 8).sum()

        x, w = torch.randn(4, 6, requires_grad=True), torch.randn(5, 6, requires_grad=True)
        counts = []
        for regather in (False, True):
            fn = lower(step, compile, regather=regather)
            fn(x, w).backward()
            tally.clear()
            fn(x, w).backward()
            counts.append({phase: n for (kind, _, phase), n in tally.calls.items() if kind == "all_gather"})
    # without the pass the partitioner merges the two gathers and keeps the gathered input
    assert counts == [{"fwd": 1}, {"fwd": 1, "bwd": 1}]
