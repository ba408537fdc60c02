"""Distributed checkpoints: save a ParallelModel and its optimizer on one mesh, load them on another.

The files are torch.distributed.checkpoint (DCP) files, one directory per checkpoint, holding every
tensor in its global, unsharded layout:

    <fqn>                         a parameter (or persistent buffer), the model's own shape and layout
    optim/<fqn>/state/<name>      optimizer state shaped like its parameter (AdamW's exp_avg, exp_avg_sq)
    optim/<fqn>/scalar/<name>     other optimizer state of that parameter (AdamW's step), pickled
    optim/<fqn>/group             the hyperparameters of the parameter's group (lr, betas, ...)
    autopar/step, autopar/extra   what save_checkpoint was given
    autopar/aliases               other names of tied weights (GPT's lm_head.weight)
    autopar/loss_scaler           fp16's dynamic loss scale and its clean-step count

Each rank describes what it holds as boxes: global offsets and a view of its own memory. A plain
tensor-parallel shard ``S(d)`` is one box. The fused QKV shard ``S(0)i3`` is not one contiguous
chunk of the global weight but three (this rank's heads of Q, of K and of V), so it is written as
three boxes: the file keeps the fused weight in the model's layout, any tp (1 included) reads it
back, and exporting needs no knowledge of the plan; a per-rank permuted layout would tie the file
to the tp that wrote it. With ZeRO-1 a rank's optimizer state is a slice of one flat vector over
all its shards; the part of that slice inside one parameter is a range of its row-major elements,
written as at most 2*ndim - 1 boxes (a partial first row, whole rows, a partial last row), so the
state lands in its parameter's global layout and loads into any dp, with or without ZeRO. Padding
of unevenly sharded dims is never written. At 16 bits (the distributed optimizer, ``runtime.zero``)
the weights written are the fp32 masters, each rank's slice of them cut into boxes the same way,
so a checkpoint loads into fp32 and 16-bit runs alike, on any mesh.
dp replicas (and HSDP's replicas of one dp_shard, whose
ZeRO shards and slices are cut over dp_shard only; and the cp ranks, which hold the same weights
and ZeRO shards as their dp rank) describe identical boxes and DCP keeps one
writer per box; a weight held by several pipeline stages (GPT's tied embedding) is written only
from its owning stage, since each stage's ZeRO slices cut it differently. On load each rank asks
for its own boxes and DCP reads the overlapping parts of the saved ones: that is the resharding.

Parameter groups need nothing more: each parameter's entries carry its own group's options, and
a ZeRO-1 slice stepped in groups (``zero.SliceOptimizer``) is written run by run, each run's state
as the part of the slice it covers; a load hands each group of the optimizer the options saved for
its parameters (refused where the checkpoint kept them in groups of different options).

A damaged checkpoint is named, not left to DCP's internals: the index (``.metadata``) must unpickle,
and every file it lists must exist and be as long as the data it places there, before anything is
read; a file that then fails to deserialize (overwritten bytes) is reported with its name, by every
rank (``CheckpointCorruptError``). Bytes changed inside a tensor's data go unnoticed: DCP keeps no
checksums.

DTensor is not used for the boxes: a rank's pieces of one tensor (three for QKV, several for a
ZeRO slice) are not the single regular chunk a DTensor placement describes, and pipeline stages
hold different subsets of the parameters. The boxes go to DCP as chunk metadata through a small
SavePlanner and LoadPlanner.
"""
from __future__ import annotations

import io
import math
import warnings
from dataclasses import dataclass, replace
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemReader, FileSystemWriter
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner, DefaultSavePlanner
from torch.distributed.checkpoint.metadata import (ChunkStorageMetadata, Metadata, MetadataIndex,
                                                   TensorProperties, TensorStorageMetadata)
from torch.distributed.checkpoint.planner import (LoadItemType, LoadPlan, ReadItem, SavePlan, TensorWriteData,
                                                  WriteItem, WriteItemType)
from torch.distributed.checkpoint.planner_helpers import create_read_items_for_chunk_list
from torch.futures import Future

from autopar.runtime.parallel_model import ParallelModel
from autopar.runtime.zero import Zero1Optimizer
from autopar.placement import Placement, Shard, padded_size, parse_placement

_OPTIM = "optim/"
_META = "autopar/"
_STEP, _EXTRA, _ALIASES, _SCALER = _META + "step", _META + "extra", _META + "aliases", _META + "loss_scaler"


class CheckpointMismatchError(ValueError):
    """A checkpoint whose tensors do not fit the model or optimizer; the message names them."""


class CheckpointCorruptError(ValueError):
    """A checkpoint with a file missing, cut short or unreadable; the message names the file."""


@dataclass
class _Boxes:
    """The pieces of one global tensor this rank holds: global offsets -> a view of local memory."""

    shape: torch.Size
    views: dict[tuple[int, ...], torch.Tensor]


# ---- geometry ------------------------------------------------------------------------------------

def _flat_boxes(shape, start: int, stop: int) -> list[tuple[tuple[int, ...], tuple[int, ...]]]:
    """Boxes (offsets, sizes) that exactly cover elements [start, stop) of a row-major ``shape``."""
    shape = tuple(shape)
    if start >= stop:
        return []
    if len(shape) <= 1:
        return [((start,), (stop - start,))] if shape else [((), ())]
    inner = math.prod(shape[1:])
    first, last = start // inner, (stop - 1) // inner

    def row(i, a, b):
        return [((i, *o), (1, *s)) for o, s in _flat_boxes(shape[1:], a, b)]

    if first == last:
        return row(first, start - first * inner, stop - first * inner)
    out = []
    lo, hi = first, last + 1
    if start % inner:
        out += row(first, start % inner, inner)
        lo += 1
    if stop % inner:
        hi -= 1
    if hi > lo:
        out.append(((lo, *[0] * (len(shape) - 1)), (hi - lo, *shape[1:])))
    if stop % inner:
        out += row(last, 0, stop - last * inner)
    return out


def _global_pieces(view: torch.Tensor, offsets, shape, placement, parts: int, rank: int):
    """(global offsets, view) pieces of a box at local ``offsets`` of one rank's shard of a tensor of
    global ``shape``; an interleaved dim splits into one piece per block, padding is dropped."""
    if not isinstance(placement, Shard) or parts == 1:
        return [(tuple(offsets), view)]
    d, k = placement.dim % len(shape), placement.interleave
    block = shape[d] // k                          # one block's global length (a Q, K or V)
    local = padded_size(block, parts)              # one block's length in the local shard
    valid = max(0, min(local, block - rank * local))
    lo, hi = offsets[d], offsets[d] + view.shape[d]
    out = []
    for j in range(k):
        a, b = max(lo, j * local), min(hi, j * local + valid)
        if a < b:
            at = list(offsets)
            at[d] = j * block + rank * local + (a - j * local)
            out.append((tuple(at), view.narrow(d, a - lo, b - a)))
    return out


@dataclass(frozen=True)
class _Layout:
    """How one parameter is split on this rank: global shape, tp placement, tp size and index, and
    under ZeRO-2/3 the rows [start, stop) of the tp shard this rank holds (``ParallelModel.dp_rows``)."""

    shape: tuple[int, ...]
    placement: Placement
    parts: int
    rank: int
    rows: tuple[int, int] | None = None

    def pieces(self, view: torch.Tensor, offsets) -> list:
        return _global_pieces(view, offsets, self.shape, self.placement, self.parts, self.rank)


def _layouts(pm: ParallelModel) -> dict[str, _Layout]:
    """FQN -> _Layout for every parameter of the plan."""
    return {q.fqn: _Layout(tuple(q.shape), parse_placement(q.placements["tp"]), pm.mesh.tp, pm.coords["tp"],
                           pm.dp_rows(q.fqn)) for q in pm.plan.parameters}


def _shard_boxes(layout: _Layout, local: torch.Tensor) -> _Boxes:
    """A whole parameter-shaped local tensor (a shard or its optimizer state) as global boxes; a
    ZeRO-2/3 dp shard is its rows of the tp shard, its padding left out."""
    offsets = (0,) * local.dim()
    if layout.rows is not None:
        start, stop = layout.rows
        local, offsets = local.narrow(0, 0, stop - start), (start,) + offsets[1:]
    return _Boxes(torch.Size(layout.shape), dict(layout.pieces(local, offsets)))


def _slice_boxes(layout: _Layout, local_shape, flat: torch.Tensor, begin: int) -> _Boxes:
    """The part of a flat slice that falls inside one parameter, as global boxes.

    ``flat`` holds elements [begin, begin + len(flat)) of the parameter's local shard flattened
    (``begin`` may be negative or past its end: then the overlap is partial or empty)."""
    n = math.prod(local_shape)
    start, stop = max(0, begin), min(n, begin + flat.numel())
    strides = [math.prod(local_shape[i + 1:]) for i in range(len(local_shape))]
    out = {}
    for offsets, sizes in _flat_boxes(local_shape, start, stop):
        at = flat.storage_offset() - begin + sum(o * s for o, s in zip(offsets, strides))
        out.update(layout.pieces(flat.as_strided(sizes, strides, at), offsets))
    return _Boxes(torch.Size(layout.shape), out)


# ---- DCP planners --------------------------------------------------------------------------------

class _SavePlanner(DefaultSavePlanner):
    """Writes each _Boxes value as chunks of its global tensor and anything else pickled."""

    def __init__(self):
        super().__init__(flatten_state_dict=False, flatten_sharded_tensors=False)

    def create_local_plan(self) -> SavePlan:
        items = []
        for key, value in self.state_dict.items():
            if not isinstance(value, _Boxes):
                items.append(WriteItem(index=MetadataIndex(key), type=WriteItemType.BYTE_IO))
                continue
            for offsets, view in value.views.items():
                chunk = ChunkStorageMetadata(offsets=torch.Size(offsets), sizes=torch.Size(view.shape))
                items.append(WriteItem(index=MetadataIndex(key, offsets), type=WriteItemType.SHARD,
                                       tensor_data=TensorWriteData(chunk=chunk,
                                                                   properties=TensorProperties(dtype=view.dtype),
                                                                   size=value.shape)))
        self.plan = SavePlan(items)
        return self.plan

    def lookup_object(self, index: MetadataIndex):
        value = self.state_dict[index.fqn]
        if isinstance(value, _Boxes):   # a compact CPU copy: a view would drag its whole storage along
            return value.views[tuple(index.offset)].detach().to("cpu", copy=True).contiguous()
        return value


class _LoadPlanner(DefaultLoadPlanner):
    """Reads the saved chunks overlapping each _Boxes value into its views; other values unpickled."""

    def __init__(self):
        super().__init__(flatten_state_dict=False, flatten_sharded_tensors=False)

    def set_up_planner(self, state_dict, metadata=None, is_coordinator: bool = False) -> None:
        self.state_dict, self.metadata, self.is_coordinator = state_dict, metadata, is_coordinator

    def create_local_plan(self) -> LoadPlan:
        items = []
        for key, value in self.state_dict.items():
            if isinstance(value, _Boxes):
                chunks = [ChunkStorageMetadata(offsets=torch.Size(o), sizes=torch.Size(v.shape))
                          for o, v in value.views.items()]
                items += create_read_items_for_chunk_list(key, self.metadata.state_dict_metadata[key], chunks)
            else:
                index, zero = MetadataIndex(key), torch.Size((0,))
                items.append(ReadItem(type=LoadItemType.BYTE_IO, dest_index=index, dest_offsets=zero,
                                      storage_index=index, storage_offsets=zero, lengths=zero))
        return LoadPlan(items)

    def load_bytes(self, read_item: ReadItem, value: io.BytesIO) -> None:
        self.state_dict[read_item.dest_index.fqn] = torch.load(value, weights_only=False)

    def lookup_tensor(self, index: MetadataIndex) -> torch.Tensor:
        return self.state_dict[index.fqn].views[tuple(index.offset)]


# ---- optimizer state -----------------------------------------------------------------------------

def _hyperparameters(group: dict) -> dict:
    return {k: v for k, v in group.items() if k != "params"}


def _is_scalar(name: str, value, param: torch.Tensor) -> bool:
    """AdamW's step, a Python number, or a 0-d tensor beside a non-scalar parameter."""
    return name == "step" or not isinstance(value, torch.Tensor) or (value.dim() == 0 and param.dim() > 0)


def _check_state_shape(fqn: str, name: str, value, param: torch.Tensor) -> None:
    if not _is_scalar(name, value, param) and value.shape != param.shape:
        raise ValueError(f"optimizer state {name!r} of {fqn} has shape {tuple(value.shape)}, neither the "
                         f"parameter's {tuple(param.shape)} nor a scalar; autopar checkpoints optimizers whose "
                         "state is shaped like the parameter (SGD, Adam, AdamW, ...)")


def _zero_parts(pm: ParallelModel, optimizer) -> list[tuple[str, torch.Tensor, int | None, int]]:
    """ZeRO-1: (FQN, local shard, index of the slice's range that holds part of it or None, where
    that range starts in the shard's flattened elements) per parameter the optimizer steps."""
    zero, sliced = optimizer.zero, optimizer.sliced
    out = []
    for (fqn, p), at in zip(pm.named_parameters(), zero.offsets):
        if fqn in sliced.group_of:
            i = sliced.piece_of(at - zero.lo, at - zero.lo + p.numel())
            out.append((fqn, p, i, zero.lo + sliced.ranges[i][1] - at if i is not None else 0))
    return out


def _optimizer_state_to_save(pm: ParallelModel, optimizer) -> dict:
    """The optimizer's state and hyperparameters as checkpoint entries (owned parameters only)."""
    sd, layouts, out = optimizer.state_dict(), _layouts(pm), {}
    if isinstance(optimizer, Zero1Optimizer):
        sliced = optimizer.sliced
        for fqn, p, i, begin in _zero_parts(pm, optimizer):
            if not pm.owns(fqn):
                continue
            out[f"{_OPTIM}{fqn}/group"] = _hyperparameters(sd["param_groups"][sliced.group_of[fqn]])
            for name, value in (sd["state"].get(i, {}) if i is not None else {}).items():
                _check_state_shape(fqn, name, value, sliced.pieces[i])
                if _is_scalar(name, value, sliced.pieces[i]):
                    out[f"{_OPTIM}{fqn}/scalar/{name}"] = value
                    continue
                boxes = _slice_boxes(layouts[fqn], tuple(p.shape), value.detach(), begin)
                if boxes.views:
                    out[f"{_OPTIM}{fqn}/state/{name}"] = boxes
        return out
    fqn_of = {id(p): fqn for fqn, p in pm.stored_weights().items()}   # offloaded: the host masters
    for group_sd, group in zip(sd["param_groups"], optimizer.param_groups):
        for index, p in zip(group_sd["params"], group["params"]):
            fqn = _fqn_of(fqn_of, p)
            if not pm.owns(fqn):
                continue
            out[f"{_OPTIM}{fqn}/group"] = _hyperparameters(group_sd)
            for name, value in sd["state"].get(index, {}).items():
                _check_state_shape(fqn, name, value, p)
                if _is_scalar(name, value, p):
                    out[f"{_OPTIM}{fqn}/scalar/{name}"] = value
                else:
                    out[f"{_OPTIM}{fqn}/state/{name}"] = _shard_boxes(layouts[fqn], value.detach())
    return out


def _fqn_of(fqn_of: dict, p) -> str:
    if id(p) not in fqn_of:
        raise ValueError("the optimizer holds a tensor that is not one of this ParallelModel's parameters; "
                         "build it over pm.parameters() or with pm.optimizer(...)")
    return fqn_of[id(p)]


def _saved_optimizer_entries(md) -> dict[str, tuple[dict, list[str]]]:
    """The checkpoint's optimizer entries per FQN: ({state name: metadata}, [scalar names])."""
    out: dict[str, tuple[dict, list[str]]] = {}
    for key, value in md.items():
        parts = key[len(_OPTIM):].rsplit("/", 2) if key.startswith(_OPTIM) else ()
        if len(parts) == 3 and parts[1] in ("state", "scalar"):
            state, scalars = out.setdefault(parts[0], ({}, []))
            if parts[1] == "state":
                state[parts[2]] = value
            else:
                scalars.append(parts[2])
    return out


def _request_optimizer_state(pm: ParallelModel, optimizer, md, want: dict, path):
    """Add the optimizer's entries to ``want`` (the load request); returns the function that, after
    the load, hands them to ``optimizer.load_state_dict``.

    Every check here looks at all of the plan's parameters, not only this rank's, so that every
    rank raises alike instead of some waiting for the others in the load."""
    fqns = [q.fqn for q in pm.plan.parameters]
    missing = [f for f in fqns if f"{_OPTIM}{f}/group" not in md]
    if missing:
        raise CheckpointMismatchError(f"checkpoint {path} has no optimizer state for {missing[0]} (it was "
                                      "saved without an optimizer?); load it with optimizer=None")
    for fqn, _ in pm.named_parameters():
        want[f"{_OPTIM}{fqn}/group"] = None
    if isinstance(optimizer, Zero1Optimizer):
        return _request_zero_state(pm, optimizer, md, want, path, fqns)
    return _request_plain_state(pm, optimizer, md, want, path)


def _request_zero_state(pm: ParallelModel, optimizer, md, want: dict, path, fqns: list[str]):
    """ZeRO-1: one flat tensor per kind of state and range of the slice (one range without
    parameter groups), each parameter's part read from its global entry."""
    saved = _saved_optimizer_entries(md)
    names = {fqn: saved.get(fqn, ({}, [])) for fqn in fqns}
    kinds = {fqn: (sorted(state), sorted(scalars)) for fqn, (state, scalars) in names.items()}
    odd = [f for f in fqns if kinds[f] != kinds[fqns[0]]]
    if odd:
        raise CheckpointMismatchError(f"checkpoint {path} holds optimizer state {kinds[odd[0]]} for {odd[0]} but "
                                      f"{kinds[fqns[0]]} for {fqns[0]}; with zero=1 every parameter needs the "
                                      "same kinds of state: load it with zero=0")
    sliced, layouts = optimizer.sliced, _layouts(pm)
    state_md, scalars = names[fqns[0]]
    flats = [{name: torch.zeros(b - a, dtype=m.properties.dtype, device=piece.device)
              for name, m in state_md.items()} for (_, a, b), piece in zip(sliced.ranges, sliced.pieces)]
    parts = _zero_parts(pm, optimizer)
    for fqn, p, i, begin in parts:
        for name, flat in (flats[i] if i is not None else {}).items():
            boxes = _slice_boxes(layouts[fqn], tuple(p.shape), flat, begin)
            if boxes.views:
                want[f"{_OPTIM}{fqn}/state/{name}"] = boxes
    # where each range reads its scalar state (AdamW's step): a parameter it holds part of, else
    # (a slice of padding only) any parameter of its group
    source = []
    for j, (g, _, _) in enumerate(sliced.ranges):
        holders = [f for f, _, i, _ in parts if i == j] or [f for f, _, _, _ in parts if sliced.group_of[f] == g]
        source.append(holders[:1])
        want.update({f"{_OPTIM}{fqn}/scalar/{name}": None for fqn in holders[:1] for name in scalars})
    current = optimizer.state_dict()["param_groups"]

    def finish():
        state = {}
        for j, holder in enumerate(source):
            s = {**flats[j], **{n: want[f"{_OPTIM}{fqn}/scalar/{n}"] for fqn in holder for n in scalars}}
            if s:
                state[j] = s
        members = [[f for f, _, _, _ in parts if sliced.group_of[f] == k] for k in range(len(current))]
        groups = [{**_checked_group(group, _saved_hyperparameters(want, held, group, path), path),
                   "params": group["params"]} for group, held in zip(current, members)]
        optimizer.load_state_dict({"state": state, "param_groups": groups})
    return finish


def _request_plain_state(pm: ParallelModel, optimizer, md, want: dict, path):
    """An optimizer over the local shards: state shaped like each shard, read from its global entry."""
    sd, layouts, saved = optimizer.state_dict(), _layouts(pm), _saved_optimizer_entries(md)
    fqn_of = {id(p): fqn for fqn, p in pm.stored_weights().items()}   # offloaded: the host masters
    members = []   # per group: [(index in the optimizer's state_dict, fqn, {name: tensor}, [scalar names])]
    for group_sd, group in zip(sd["param_groups"], optimizer.param_groups):
        members.append([])
        for index, p in zip(group_sd["params"], group["params"]):
            fqn = _fqn_of(fqn_of, p)
            state_md, scalars = saved.get(fqn, ({}, []))
            tensors = {name: torch.zeros(p.shape, dtype=m.properties.dtype, device=p.device)
                       for name, m in state_md.items()}
            for name, t in tensors.items():
                want[f"{_OPTIM}{fqn}/state/{name}"] = _shard_boxes(layouts[fqn], t)
            for name in scalars:
                want[f"{_OPTIM}{fqn}/scalar/{name}"] = None
            members[-1].append((index, fqn, tensors, scalars))

    def finish():
        state, groups = {}, []
        for group_sd, group in zip(sd["param_groups"], members):
            for index, fqn, tensors, scalars in group:
                s = {**tensors, **{n: want[f"{_OPTIM}{fqn}/scalar/{n}"] for n in scalars}}
                if s:
                    state[index] = s
            hyper = _saved_hyperparameters(want, [fqn for _, fqn, _, _ in group], group_sd, path)
            groups.append({**_checked_group(group_sd, hyper, path), "params": group_sd["params"]})
        optimizer.load_state_dict({"state": state, "param_groups": groups})
    return finish


def _saved_hyperparameters(want: dict, fqns: list[str], current: dict, path) -> dict:
    """The hyperparameters the checkpoint saved for one parameter group of the optimizer, from its
    members ``fqns`` (all saved in one group), or the current ones for a group without members here."""
    if not fqns:
        return _hyperparameters(current)
    saved = {fqn: want[f"{_OPTIM}{fqn}/group"] for fqn in fqns}
    first = fqns[0]
    other = next((f for f in fqns if _differences(saved[f], saved[first])), None)
    if other is not None:
        raise CheckpointMismatchError(
            f"checkpoint {path} holds {first} and {other} in parameter groups with different options "
            f"({_differences(saved[first], saved[other])}), but this optimizer puts them in one group; build it "
            "with the parameter groups the checkpoint was saved with")
    return saved[first]


def _differences(a: dict, b: dict) -> str:
    """The options two groups set apart, compared by their repr (a tensor, such as a capturable lr,
    by its printed value), or ""."""
    return ", ".join(f"{k}={a.get(k)!r} against {b.get(k)!r}" for k in sorted(set(a) | set(b))
                     if repr(a.get(k)) != repr(b.get(k)))


def _checked_group(current: dict, saved: dict, path) -> dict:
    """The saved hyperparameters, if they are the same kind as the current optimizer's."""
    if set(saved) != set(_hyperparameters(current)):
        raise CheckpointMismatchError(
            f"checkpoint {path} was saved with an optimizer whose hyperparameters are {sorted(saved)}, but this "
            f"one has {sorted(_hyperparameters(current))}; load it with the same optimizer class")
    return saved


# ---- model ---------------------------------------------------------------------------------------

def _model_tensors(pm: ParallelModel, *, owned_only: bool) -> dict[str, _Boxes]:
    """This rank's parameters (and persistent buffers) as global boxes over their memory; at 16 bits
    the fp32 master weights, each parameter's part of this rank's master slice."""
    layouts, out, zero = _layouts(pm), {}, pm.zero
    if zero is not None and zero.dtype is not None:
        zero.pull_changed()
        for (fqn, p), at in zip(pm.named_parameters(), zero.offsets):
            boxes = _slice_boxes(layouts[fqn], tuple(p.shape), zero.shard.detach(), zero.lo - at)
            if boxes.views and (not owned_only or pm.owns(fqn)):
                out[fqn] = boxes
    else:
        for fqn, p in pm.stored_weights().items():   # with optimizer offload, the fp32 masters on the host
            if not owned_only or pm.owns(fqn):
                out[fqn] = _shard_boxes(layouts[fqn], p.detach())
    for name, b in pm.persistent_buffers().items():
        b = b.detach()
        out[name] = _Boxes(b.shape, {(0,) * b.dim(): b})
    return out


def _read_metadata(path):
    """The checkpoint's index (``state_dict_metadata``), once every file it lists is there and long
    enough for what the index places in it."""
    p = Path(path)
    if not p.is_dir():
        raise FileNotFoundError(f"no checkpoint at {p}: the directory does not exist; pass the directory "
                                "that save_checkpoint wrote")
    if not (p / ".metadata").is_file():
        raise FileNotFoundError(f"{p} is not a complete checkpoint: it has no .metadata file (a save that "
                                "did not finish leaves none); pass the directory that save_checkpoint wrote")
    try:
        metadata = FileSystemReader(p).read_metadata()
    except OSError:
        raise
    except Exception as e:   # unpickling a damaged file raises nearly anything
        raise _damaged(p, ".metadata", f"cannot be read ({_cause(e)})") from e
    if not isinstance(metadata, Metadata) or not isinstance(metadata.storage_data, dict):
        raise _damaged(p, ".metadata", f"holds a {type(metadata).__name__}, not a checkpoint's index")
    ends: dict[str, int] = {}
    for info in metadata.storage_data.values():
        ends[info.relative_path] = max(ends.get(info.relative_path, 0), info.offset + info.length)
    for name, end in sorted(ends.items()):
        f = p / name
        if not f.is_file():
            raise _damaged(p, name, "is missing")
        if f.stat().st_size < end:
            raise _damaged(p, name, f"is cut short: it holds {f.stat().st_size} bytes and the index (.metadata) "
                                    f"places data up to byte {end}")
    return metadata.state_dict_metadata


def _damaged(path, name: str, what: str) -> CheckpointCorruptError:
    return CheckpointCorruptError(f"checkpoint {path} is incomplete or corrupt: its file {name} {what}; save it "
                                  "again, or load an earlier checkpoint")


def _cause(e: Exception) -> str:
    """``e`` in a few words: its type and the first sentence of its message."""
    text = str(e).strip().split("\n")[0].split(". ")[0]
    return f"{type(e).__name__}: {text}" if text else type(e).__name__


class _Reader(FileSystemReader):
    """DCP's file reader, one file at a time, so that a file that cannot be read is named."""

    def read_data(self, plan: LoadPlan, planner) -> Future:
        """Read ``plan``'s items file by file; one that fails raises CheckpointCorruptError naming it."""
        per_file: dict[str, list[ReadItem]] = {}
        for item in plan.items:
            per_file.setdefault(self.storage_data[item.storage_index].relative_path, []).append(item)
        for name, items in per_file.items():
            try:
                super().read_data(replace(plan, items=items), planner).wait()
            except Exception as e:
                raise _damaged(self.path, name, f"cannot be read ({_cause(e)})") from e
        done: Future = Future()
        done.set_result(None)
        return done


def _load(want: dict, path, **kwargs) -> None:
    """``dcp.load`` of ``want`` from ``path``; a damaged file (on any rank) raises its
    CheckpointCorruptError on every rank, not DCP's collected tracebacks."""
    try:
        dcp.load(want, storage_reader=_Reader(str(path)), planner=_LoadPlanner(), **kwargs)
    except CheckpointException as e:
        damaged = [exc for _, (exc, _) in sorted(e.failures.items()) if isinstance(exc, CheckpointCorruptError)]
        if damaged:
            raise damaged[0] from None
        raise


def _check_model(pm: ParallelModel, md: dict, path) -> None:
    """Every parameter and persistent buffer in the checkpoint with its shape, and nothing else."""
    expected = {q.fqn: tuple(q.shape) for q in pm.plan.parameters}
    expected.update({n: tuple(b.shape) for n, b in pm.persistent_buffers().items()})
    aliases = {a for q in pm.plan.parameters for a in q.aliases}   # a plain state_dict's second names
    problems = []
    for fqn, shape in expected.items():
        saved = md.get(fqn)
        if not isinstance(saved, TensorStorageMetadata):
            problems.append(f"{fqn} is not in the checkpoint")
        elif tuple(saved.size) != shape:
            problems.append(f"{fqn} has shape {tuple(saved.size)} in the checkpoint but {shape} in the model")
    problems += [f"{k} is in the checkpoint but not in the model" for k in md
                 if not k.startswith((_OPTIM, _META)) and k not in expected and k not in aliases]
    if problems:
        more = f" (and {len(problems) - 3} more)" if len(problems) > 3 else ""
        raise CheckpointMismatchError(f"checkpoint {path} does not fit this model: {'; '.join(problems[:3])}{more}; "
                                      "was it saved from a different model or config?")


# ---- public API ----------------------------------------------------------------------------------

def save_checkpoint(pm: ParallelModel, optimizer, path, *, step: int = 0, extra: dict | None = None) -> None:
    """Write the model's shards and the optimizer's state to directory ``path`` (all ranks call it).

    Every tensor is stored in its global layout, so ``load_checkpoint`` reads it on any mesh and
    ``export_state_dict`` turns it into an ordinary state_dict. ``optimizer`` may be None (weights
    only). ``step`` and the picklable ``extra`` (rank 0's) come back from ``load_checkpoint``."""
    state = _model_tensors(pm, owned_only=True)
    if optimizer is not None:
        state.update(_optimizer_state_to_save(pm, optimizer))
    if dist.get_rank() == 0:
        state[_STEP], state[_EXTRA] = int(step), extra
        state[_ALIASES] = {q.fqn: tuple(q.aliases) for q in pm.plan.parameters if q.aliases}
        scaler = getattr(pm, "loss_scaler", None)
        if scaler is not None:   # fp16: the dynamic loss scale resumes where it was
            state[_SCALER] = (scaler.scale, scaler.clean_steps)
    dcp.save(state, storage_writer=FileSystemWriter(str(path)), planner=_SavePlanner())


def load_checkpoint(pm: ParallelModel, optimizer, path) -> dict:
    """Load a checkpoint written by ``save_checkpoint`` on any mesh into ``pm`` and ``optimizer``, in
    place (all ranks call it); returns ``{"step": int, "extra": ...}`` as saved.

    ``optimizer`` may be None (weights only). A checkpoint that does not fit the model raises
    CheckpointMismatchError naming the parameter; a missing one raises FileNotFoundError; one with a
    file missing, cut short or unreadable, CheckpointCorruptError naming the file."""
    md = _read_metadata(path)
    _check_model(pm, md, path)
    pm.weights_loading()
    want: dict = _model_tensors(pm, owned_only=False)
    finish = _request_optimizer_state(pm, optimizer, md, want, path) if optimizer is not None else None
    want.update({k: None for k in (_STEP, _EXTRA, _SCALER) if k in md})
    with torch.no_grad():
        _load(want, path)
        pm.weights_loaded()
        if finish is not None:
            finish()
    scaler = getattr(pm, "loss_scaler", None)
    if scaler is not None and want.get(_SCALER) is not None:
        scaler.scale, scaler.clean_steps = want[_SCALER]
    return {"step": int(want.get(_STEP) or 0), "extra": want.get(_EXTRA)}


def export_state_dict(path_or_pm) -> dict[str, torch.Tensor]:
    """The full, unsharded state_dict the original module loads with ``load_state_dict(strict=True)``.

    From a checkpoint directory it needs no process group (run it anywhere, e.g. on a laptop);
    from a live ParallelModel it gathers the shards (every rank must call it)."""
    if isinstance(path_or_pm, ParallelModel):
        pm = path_or_pm
        out = pm.full_state_dict()
        out.update({n: b.detach().cpu().clone() for n, b in pm.persistent_buffers().items()})
        return out
    md = _read_metadata(path_or_pm)
    sd = {k: torch.zeros(v.size, dtype=v.properties.dtype) for k, v in md.items()
          if isinstance(v, TensorStorageMetadata) and not k.startswith((_OPTIM, _META))}
    want: dict = {k: _Boxes(t.shape, {(0,) * t.dim(): t}) for k, t in sd.items()}
    if _ALIASES in md:
        want[_ALIASES] = None
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*assuming the intent is to load in a single process")
        _load(want, path_or_pm, no_dist=True)
    for fqn, names in (want.get(_ALIASES) or {}).items():
        for name in names:
            sd[name] = sd[fqn]
    return sd
