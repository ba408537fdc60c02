"""Process groups are made once per world: a second parallelize of the same mesh in one process
reuses the first one's groups (every gloo group keeps threads that wake on their own, so a rank
that made new ones per call, case after case, spent its cores on idle groups)."""
from __future__ import annotations

import os

import torch.distributed as dist

import autopar
import pool
from parity import BATCH, SEQ, TINY, make_model
from autopar.examples.gpt import example_inputs
from autopar.mesh import Mesh
from autopar.runtime.groups import process_groups


def _threads() -> int:
    return len(os.listdir("/proc/self/task"))


def _twice(rank, world):
    """Threads this rank gained from one new gloo group (what the count sees of a group), then its
    threads after each of two rounds of parallelize (dp=2 and tp=2 plans) and process groups of a
    cp=2 layout, and the group names of each round's layout. Earlier jobs of this rank may have
    made the first round's groups already: the second round must make none either way."""
    idx, tgt = example_inputs(TINY, BATCH, SEQ)
    before = _threads()
    dist.new_group([0, 1])
    one_group = _threads() - before
    counts, names = [], []
    for _ in range(2):
        for mesh in ((2, 1, 1), (1, 1, 2)):
            autopar.parallelize(make_model(), mesh, (idx, tgt), device="cpu", compile=False)
        groups = process_groups(Mesh(cp=2), 3, "cpu")
        names.append((groups.dp, groups.cp, groups.data, groups.dp_replicate))
        counts.append(_threads())
    return one_group, counts, names


TWICE = pool.job(2, _twice, timeout=300)


def test_a_second_parallelize_makes_no_process_group():
    for one_group, (first, second), names in TWICE.result():
        assert one_group > 0, "a new process group made no thread: this test counts nothing"
        assert second == first, f"the second round made {second - first} threads"
        assert names[0] == names[1]
