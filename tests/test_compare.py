"""`python -m autopar compare`'s ZeRO-3 against hand-written FSDP2 on pure dp meshes (2,1,1) and (4,1,1):
autopar must move no more bytes per step and hold no more peak tensor memory per rank, and both must
track the unsharded model's losses. Both contenders run in one pooled job per world size, through
``compare.run_contender`` (what ``compare`` spawns per contender)."""
from __future__ import annotations

import pytest
import torch

import pool
from autopar.compare import (CollectiveCounter, StepMemory, compare, held_storages, reference_curve, row,
                             run_contender, table)
from autopar.examples.gpt import GPT, example_inputs
from parity import BATCH, SEQ, TINY

STEPS = 3
MESHES = {2: (2, 1, 1), 4: (4, 1, 1)}
PAIR = ("zero3", "fsdp2")


def _pair(rank, world, mesh):
    return {name: run_contender(rank, world, name, mesh, STEPS, TINY, BATCH, SEQ, False) for name in PAIR}


JOBS = {world: pool.job(world, _pair, mesh) for world, mesh in MESHES.items()}


@pytest.fixture(scope="module")
def reference():
    return reference_curve(TINY, BATCH, SEQ, STEPS)


def _rows(world, reference):
    per_rank = JOBS[world].result()
    return {name: row(name, [r[name] for r in per_rank], reference) for name in PAIR}


def _floats(module) -> int:
    return sum(p.numel() for p in module.parameters())


@pytest.mark.parametrize("world", sorted(MESHES))
def test_fsdp2_bytes_are_its_full_parameters(world, reference):
    """FSDP2 gathers the root's parameters once (kept to the backward) and each block's twice (resharded
    after the forward), and reduce-scatters each gradient once: the counter sees its c10d collectives
    and counts full tensors (TINY's dims divide 2 and 4, so FSDP2 pads nothing)."""
    fsdp2 = _rows(world, reference)["fsdp2"]
    model = GPT(TINY)
    blocks = sum(_floats(b) for b in model.transformer.h)
    root = _floats(model) - blocks
    assert fsdp2["bytes"]["all_gather"] == 4 * (root + 2 * blocks), table(_rows(world, reference).values())
    assert fsdp2["bytes"]["reduce_scatter"] == 4 * (root + blocks), table(_rows(world, reference).values())


@pytest.mark.parametrize("world", sorted(MESHES))
def test_zero3_moves_no_more_bytes_than_fsdp2(world, reference):
    rows = _rows(world, reference)
    zero3, fsdp2 = (sum(rows[n]["bytes"].values()) for n in PAIR)
    assert zero3 <= fsdp2, table(rows.values())


@pytest.mark.parametrize("world", sorted(MESHES))
def test_zero3_holds_no_more_tensor_memory_than_fsdp2(world, reference):
    rows = _rows(world, reference)
    assert len(rows["zero3"]["peaks"]) == world
    for rank, (zero3, fsdp2) in enumerate(zip(rows["zero3"]["peaks"], rows["fsdp2"]["peaks"])):
        assert zero3 <= fsdp2, f"rank {rank}\n" + table(rows.values())


@pytest.mark.parametrize("world", sorted(MESHES))
def test_losses_match_the_unsharded_model(world, reference):
    rows = _rows(world, reference)
    for name in PAIR:
        assert rows[name]["losses"] == pytest.approx(reference, rel=1e-4), name
    assert reference[-1] < reference[0]


def _held(*roots) -> int:
    return sum(st.nbytes() for st in held_storages(*roots).values())


def test_held_storages_counts_each_storage_once_with_grads_and_state():
    model = GPT(TINY)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    weights = 4 * _floats(model)   # the tied lm_head counted once
    assert _held(model, opt) == weights
    model(*example_inputs(TINY, BATCH, SEQ)).backward()
    opt.step()
    steps = 4 * len(opt.state)   # AdamW's per-parameter step counts
    assert _held(model, opt) == 4 * weights + steps
    assert _held(model, opt, model, [opt]) == 4 * weights + steps


def test_step_memory_sees_allocations_frees_and_resizes():
    keep = torch.zeros(1000)
    with StepMemory(keep) as mem:
        a = torch.ones(2000)          # +8000
        b = a * 2                     # +8000: 16000 at most so far
        del a, b                      # back to 0
        st = keep.untyped_storage()
        st.resize_(0)                 # -4000: FSDP2's free of a gathered parameter
        st.resize_(5000)              # +5000 over the start: 1000 above it
        c = torch.empty(3000)         # +12000: 13000 above the start, under the 16000 before
    assert (mem.held, mem.peak) == (4000, 4000 + 16000)
    del c


def _counted(rank, world):
    """Bytes the counter gives a functional all-gather, c10d reduce-scatter and all-reduce of known sizes."""
    import torch.distributed as dist
    from torch.distributed import _functional_collectives as funcol

    # torch 2.13 renames reduce_scatter_tensor (deprecated there) to reduce_scatter_single
    reduce_scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
    counter = CollectiveCounter()
    with counter:
        funcol.wait_tensor(torch.ops._c10d_functional.all_gather_into_tensor(
            torch.ones(3), world, dist.group.WORLD.group_name))
        reduce_scatter(torch.empty(5), torch.ones(5 * world))
        dist.all_reduce(torch.ones(7, dtype=torch.float64))
    return dict(counter.count), dict(counter.bytes)


COUNTED = pool.job(2, _counted)


def test_counter_counts_full_tensors_functional_and_c10d():
    count, nbytes = COUNTED.result()[0]
    assert count == {"all_gather": 1, "reduce_scatter": 1, "all_reduce": 1}
    assert nbytes == {"all_gather": 4 * 3 * 2, "reduce_scatter": 4 * 5 * 2, "all_reduce": 8 * 7}


def test_table_prints_mib_per_kind_peak_and_loss():
    r = dict(name="zero3", losses=[4.5, 4.25], max_rel_diff=1e-7, count={"all_gather": 3}, bytes={"all_gather": 2 ** 19},
             peak=3 * 2 ** 20, held=2 ** 20, rss=2 ** 28, step=0.01, setup=1.0)
    head, line, _ = table([r]).splitlines()
    assert "all_gather n / MiB" in head and "peak tensor MiB" in head
    assert line.split()[:6] == ["zero3", "4.250000", "1.0e-07", "3", "/", "0.5000"]
    assert "3.0000" in line.split()


def test_cli_takes_the_contenders_and_refuses_unknown_ones(capsys):
    from autopar.__main__ import main

    assert main(["compare", "--mesh", "2,1,1", "--contenders", "zero3,fsdp"]) == 2
    assert "unknown contender 'fsdp'; choose from auto, megatron, zero3, hand-written, fsdp2" in capsys.readouterr().err


def test_bad_arguments_say_what_to_do():
    with pytest.raises(ValueError, match="unknown contender 'fsdp'; choose from auto, megatron, zero3"):
        compare((2, 1, 1), contenders=("fsdp",))
    with pytest.raises(ValueError, match="hand-written contenders have no pipeline"):
        compare((1, 2, 1), contenders=("zero3", "fsdp2"))
