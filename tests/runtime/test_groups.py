"""Process groups are made once per world: a second parallelize of the same mesh in one process
reuses the first one's groups (every gloo group keeps threads that wake on their own, so a rank
that made new ones per call, case after case, spent its cores on idle groups)."""
from __future__ import annotations

import os

import autopar
import pool
from parity import BATCH, SEQ, TINY, make_model
from autopar.examples.gpt import example_inputs
from autopar.mesh import Mesh
from autopar.runtime.groups import process_groups


def _threads() -> int:
    return len(os.listdir("/proc/self/task"))


def _twice(rank, world):
    """Threads of this rank before, after one and after a second parallelize (dp=2 and tp=2
    plans each), and the group names of both (dp, cp, data) layouts."""
    idx, tgt = example_inputs(TINY, BATCH, SEQ)
    counts, names = [_threads()], []
    for _ in range(2):
        for mesh in ((2, 1, 1), (1, 1, 2)):
            autopar.parallelize(make_model(), mesh, (idx, tgt), device="cpu", compile=False)
        groups = process_groups(Mesh(cp=2), 3, "cpu")
        names.append((groups.dp, groups.cp, groups.data, groups.dp_replicate))
        counts.append(_threads())
    return counts, names


TWICE = pool.job(2, _twice, timeout=300)


def test_a_second_parallelize_makes_no_process_group():
    for counts, names in TWICE.result():
        before, first, second = counts
        assert first > before, "the first parallelize made no group: this test counts nothing"
        assert second == first, f"the second parallelize made threads: {counts}"
        assert names[0] == names[1]
