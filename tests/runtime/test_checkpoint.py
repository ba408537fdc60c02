"""Checkpoints across meshes: a run trained on (4,1,1) with ZeRO-3 (the weights as dp shards), resumed
on (2,1,2) with ZeRO-1, then on (1,2,2) (pipeline), then on one rank without ZeRO, must follow the
uninterrupted single-device AdamW loss curve; resuming on the same mesh (the ZeRO-3 one) must be
bitwise; the exported state_dict must load into the unsharded GPT.

The three 4-rank meshes share one spawn, the session's pool (process start-up dominates); the 1-rank
mesh reads their checkpoints in a spawn of its own."""
from __future__ import annotations

import dataclasses
import shutil
from pathlib import Path

import pytest
import torch

import autopar
from autopar.checkpoint import (CheckpointCorruptError, CheckpointMismatchError, _flat_boxes, _global_pieces, _Layout,
                                _slice_boxes, export_state_dict, load_checkpoint, save_checkpoint)
from autopar.examples.gpt import GPT, example_inputs
from autopar.launch import spawn
from autopar.placement import R, Shard, shard_tensor
import pool
from parity import BATCH, SEQ, TINY, make_model, train_curve

LR = 1e-3
ZERO_DP = ((4, 1, 1), dict(plan="auto", zero=3))   # the weights, gradients and optimizer state as dp shards
ZERO_TP = ((2, 1, 2), dict(plan="megatron", sequence_parallel=True, zero=1))
PIPELINE = ((1, 2, 2), dict(plan="megatron", sequence_parallel=False))
SINGLE = ((1, 1, 1), dict(plan="auto"))   # zero=0
STEPS = (3, 3, 2, 2)   # on ZERO_DP, ZERO_TP, PIPELINE, SINGLE in turn


def _build(mesh, knobs, cfg=TINY):
    idx, tgt = example_inputs(cfg, BATCH, SEQ)
    pm = autopar.parallelize(make_model(cfg), mesh, (idx, tgt), compile=False, **knobs)
    return pm, pm.optimizer(torch.optim.AdamW, lr=LR)


def _train(pm, opt, steps):
    idx, tgt = example_inputs(TINY, BATCH, SEQ)
    losses = []
    for _ in range(steps):
        opt.zero_grad()
        losses.append(pm.train_step(idx, tgt).item())
        opt.step()
    return losses


def _four_ranks(rank, world, root):
    out = {}
    pm, opt = _build(*ZERO_DP)
    out["a"] = _train(pm, opt, STEPS[0])
    save_checkpoint(pm, opt, root / "a", step=STEPS[0], extra={"mesh": ZERO_DP[0]})
    out["uninterrupted"] = _train(pm, opt, STEPS[1])
    out["uninterrupted_state"] = export_state_dict(pm)

    pm, opt = _build(*ZERO_DP)
    out["info_a"] = load_checkpoint(pm, opt, root / "a")
    out["resumed"] = _train(pm, opt, STEPS[1])
    out["resumed_state"] = export_state_dict(pm)

    pm, opt = _build(*ZERO_TP)
    out["placements"] = {q.fqn: q.placements["tp"] for q in pm.plan.parameters}
    load_checkpoint(pm, opt, root / "a")
    out["b"] = _train(pm, opt, STEPS[1])
    save_checkpoint(pm, opt, root / "b", step=sum(STEPS[:2]))

    pm, opt = _build(*PIPELINE)
    load_checkpoint(pm, opt, root / "b")
    out["c"] = _train(pm, opt, STEPS[2])
    save_checkpoint(pm, opt, root / "c", step=sum(STEPS[:3]))
    return out


def _error(fn):
    with pytest.raises((FileNotFoundError, CheckpointMismatchError)) as e:
        fn()
    return str(e.value)


def _one_rank(rank, world, root):
    out = {}
    pm, opt = _build(*SINGLE)
    out["info_c"] = load_checkpoint(pm, opt, root / "c")
    out["loaded_state"] = export_state_dict(pm)
    out["d"] = _train(pm, opt, STEPS[3])

    out["missing"] = _error(lambda: load_checkpoint(pm, opt, root / "nowhere"))
    save_checkpoint(pm, None, root / "weights")
    out["no_optimizer"] = _error(lambda: load_checkpoint(pm, opt, root / "weights"))
    load_checkpoint(pm, None, root / "weights")
    other, other_opt = _build(*SINGLE, cfg=dataclasses.replace(TINY, n_layer=3, vocab_size=128))
    out["mismatch"] = _error(lambda: load_checkpoint(other, other_opt, root / "c"))
    return out


def _four_in(rank, world, workdir):
    return _four_ranks(rank, world, Path(workdir))


FOUR = pool.job(4, _four_in, workdir=True)


@pytest.fixture(scope="module")
def runs():
    four = FOUR.result()
    root = Path(FOUR.path)   # what the four ranks saved, for the one rank to read
    one = spawn(_one_rank, 1, root, timeout=300, start_method="forkserver")[0]
    return root, four, one


@pytest.fixture(scope="module")
def ref_curve():
    return train_curve(make_model(), *example_inputs(TINY, BATCH, SEQ), sum(STEPS), LR)


def _loss_of(state):
    model = GPT(TINY)
    model.load_state_dict(state, strict=True)
    return model(*example_inputs(TINY, BATCH, SEQ)).item()


def test_qkv_is_interleaved_shard(runs):
    """The (2,1,2) run must hold the fused QKV as S(0)i3, or the three-box path goes untested."""
    placements = runs[1][0]["placements"]
    assert placements["transformer.h.0.attn.c_attn.weight"] == "S(0)i3"


def test_resume_across_meshes_follows_single_device(runs, ref_curve):
    _, four, one = runs
    for rank, r in enumerate(four):
        got = r["a"] + r["b"] + r["c"] + one["d"]
        assert got == pytest.approx(ref_curve, rel=1e-4), f"rank {rank}"
    assert ref_curve[-1] < ref_curve[0]


def test_resume_on_same_mesh_is_bitwise(runs):
    for rank, r in enumerate(runs[1]):
        assert r["resumed"] == r["uninterrupted"], f"rank {rank}"
        assert r["resumed_state"].keys() == r["uninterrupted_state"].keys()
        for name, t in r["uninterrupted_state"].items():
            assert torch.equal(r["resumed_state"][name], t), f"rank {rank} {name}"


def test_step_and_extra_come_back(runs):
    _, four, one = runs
    assert four[0]["info_a"] == {"step": 3, "extra": {"mesh": (4, 1, 1)}}
    assert one["info_c"] == {"step": 8, "extra": None}


def test_export_loads_into_the_unsharded_model(runs, ref_curve):
    root, _, one = runs
    offline = export_state_dict(root / "c")
    assert offline.keys() == GPT(TINY).state_dict().keys()
    for name, t in one["loaded_state"].items():
        assert torch.equal(offline[name], t), name
    assert _loss_of(offline) == pytest.approx(one["d"][0], rel=1e-6)
    assert _loss_of(offline) == pytest.approx(ref_curve[sum(STEPS[:3])], rel=1e-4)
    assert _loss_of(export_state_dict(root / "a")) == pytest.approx(ref_curve[STEPS[0]], rel=1e-5)


def test_bad_checkpoints_say_what_is_wrong(runs, tmp_path):
    _, _, one = runs
    assert "no checkpoint at" in one["missing"] and "nowhere" in one["missing"]
    assert "no optimizer state" in one["no_optimizer"] and "optimizer=None" in one["no_optimizer"]
    assert "transformer.wte.weight has shape (96, 32) in the checkpoint but (128, 32)" in one["mismatch"]
    assert "transformer.h.2.ln_1.weight is not in the checkpoint" in one["mismatch"]
    with pytest.raises(FileNotFoundError, match="no .metadata file"):
        export_state_dict(tmp_path)


@pytest.mark.parametrize("shape", [(5,), (3, 4), (2, 3, 4), (4, 1, 3)])
def test_flat_ranges_become_exact_boxes(shape):
    """Every range of a row-major tensor is covered once by its boxes, and nothing outside it."""
    n = torch.Size(shape).numel()
    x = torch.arange(n).reshape(shape)
    for a in range(n + 1):
        for b in range(a, n + 1):
            seen = torch.zeros(n, dtype=torch.long)
            for offsets, sizes in _flat_boxes(shape, a, b):
                seen[x[tuple(slice(o, o + s) for o, s in zip(offsets, sizes))].reshape(-1)] += 1
            assert seen.tolist() == [int(a <= i < b) for i in range(n)], (a, b)


@pytest.mark.parametrize("shape,placement,parts", [((12, 4), Shard(0, 3), 2), ((12, 5), Shard(0, 3), 4),
                                                   ((7, 3), Shard(0), 2), ((3, 7), Shard(1), 4), ((6,), R, 2)])
def test_shards_map_to_their_global_positions(shape, placement, parts):
    """Each rank's pieces (interleaved QKV and padded shards included) tile the full tensor exactly."""
    full = torch.arange(torch.Size(shape).numel()).reshape(shape).float() + 1
    rebuilt, hits = torch.zeros(shape), torch.zeros(shape)
    for rank in range(parts):
        local = shard_tensor(full, placement, parts, rank)
        for offsets, view in _global_pieces(local, (0,) * local.dim(), shape, placement, parts, rank):
            where = tuple(slice(o, o + s) for o, s in zip(offsets, view.shape))
            rebuilt[where] = view
            hits[where] += 1
    assert torch.equal(rebuilt, full)
    assert torch.equal(hits, torch.full(shape, parts if placement == R else 1.0))


def test_zero_slices_map_to_their_parameters():
    """ZeRO-1 slices of each tp rank's flat shards, over every dp rank, rebuild each parameter once."""
    params = {"qkv": ((12, 4), Shard(0, 3)), "vocab": ((7, 3), Shard(0)), "ln": ((5,), R)}
    tp, dp = 2, 3
    full = {f: torch.randn(shape) for f, (shape, _) in params.items()}
    rebuilt = {f: torch.zeros(shape) for f, (shape, _) in params.items()}
    hits = {f: torch.zeros(shape) for f, (shape, _) in params.items()}
    for rank in range(tp):
        local = {f: shard_tensor(full[f], pl, tp, rank) for f, (_, pl) in params.items()}
        flat = torch.cat([t.reshape(-1) for t in local.values()])
        chunk = -(-flat.numel() // dp)
        flat = torch.nn.functional.pad(flat, (0, chunk * dp - flat.numel()))
        for d in range(dp):
            at = 0
            for f, (shape, pl) in params.items():
                boxes = _slice_boxes(_Layout(shape, pl, tp, rank), tuple(local[f].shape),
                                     flat[d * chunk:(d + 1) * chunk], d * chunk - at)
                for offsets, view in boxes.views.items():
                    where = tuple(slice(o, o + s) for o, s in zip(offsets, view.shape))
                    rebuilt[f][where] = view
                    hits[f][where] += 1
                at += local[f].numel()
    for f, (shape, pl) in params.items():
        assert torch.equal(rebuilt[f], full[f]), f
        assert torch.equal(hits[f], torch.full(shape, tp if pl == R else 1.0)), f


# ---- damaged checkpoints -------------------------------------------------------------------------

FILES = (".metadata", "__0_0.distcp", "__1_0.distcp")   # what a save on two ranks writes
DAMAGES = {
    "cut short": lambda data: data[:len(data) // 3],
    # the same length, so that only reading it can tell
    "garbage": lambda data: torch.randint(0, 256, (len(data),), dtype=torch.uint8,
                                          generator=torch.Generator().manual_seed(0)).numpy().tobytes(),
    "missing": None,
}


# (file, damage) for each damaged copy: a missing .metadata is no checkpoint at all (FileNotFoundError, above)
DAMAGED_FILES = [(name, damage) for name in FILES for damage in DAMAGES if (name, damage) != (".metadata", "missing")]


def _copy_name(name: str, damage: str) -> str:
    return f"{name.strip('.')}-{damage.replace(' ', '-')}"


def _load_damaged(rank, world, workdir):
    """A ZeRO-1 checkpoint saved on two ranks, each of its files damaged in turn (rank 0 makes a copy
    per damage) and loaded on both ranks; what each load raised."""
    root = Path(workdir)
    pm, opt = _build((2, 1, 1), dict(zero=1))
    _train(pm, opt, 1)
    save_checkpoint(pm, opt, root / "whole")
    if rank == 0:
        for name, damage in DAMAGED_FILES:
            path = root / _copy_name(name, damage)
            shutil.copytree(root / "whole", path)
            how = DAMAGES[damage]
            if how is None:
                (path / name).unlink()
            else:
                (path / name).write_bytes(how((path / name).read_bytes()))
    torch.distributed.barrier()
    out = {}
    for name, damage in DAMAGED_FILES:
        try:
            load_checkpoint(pm, opt, root / _copy_name(name, damage))
            out[name, damage] = None
        except CheckpointCorruptError as e:
            out[name, damage] = str(e)
    return out


DAMAGED = pool.job(2, _load_damaged, workdir=True, timeout=300)


@pytest.mark.parametrize("name,damage", DAMAGED_FILES)
def test_damaged_files_are_named_with_what_to_do(name, damage):
    """Loading (on every rank) and exporting a checkpoint with one file cut short, overwritten or
    deleted names the checkpoint and the file and says to save it again or load an earlier one."""
    loaded = [out[name, damage] for out in DAMAGED.result()]   # the copies exist once the job has run
    path = Path(DAMAGED.path) / _copy_name(name, damage)
    with pytest.raises(CheckpointCorruptError) as exported:
        export_state_dict(path)
    what = "cannot be read" if name == ".metadata" else {"cut short": "is cut short", "garbage": "cannot be read",
                                                          "missing": "is missing"}[damage]
    assert len(set(loaded)) == 1   # every rank raises the same error
    for message in [str(exported.value)] + loaded:
        assert message.startswith(f"checkpoint {path} is incomplete or corrupt: its file {name} {what}")
        assert message.endswith("; save it again, or load an earlier checkpoint")
