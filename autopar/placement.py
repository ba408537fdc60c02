"""Placements: how one tensor is laid out over one mesh axis (DTensor's vocabulary).

``Shard(dim)`` prints ``S(dim)``: each rank holds one contiguous slice of ``dim``.
``Shard(dim, interleave=k)`` prints ``S(dim)i<k>``: ``dim`` is read as k equal blocks
(a fused QKV weight: k=3) and each rank holds its slice of every block, so rank r
owns its heads of Q, of K and of V. ``Replicate()`` prints ``R``; ``Partial()``
prints ``P``: every rank holds a summand of the true value.

A dim that the axis size does not divide (GPT-2's 50257 vocabulary) is sharded
padded: every rank holds ceil(n/size) entries and the last ranks' tails are padding.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class Shard:
    dim: int
    interleave: int = 1

    def __str__(self) -> str:
        return f"S({self.dim})" + (f"i{self.interleave}" if self.interleave > 1 else "")


@dataclass(frozen=True)
class Replicate:
    def __str__(self) -> str:
        return "R"


@dataclass(frozen=True)
class Partial:
    def __str__(self) -> str:
        return "P"


Placement = Shard | Replicate | Partial
R = Replicate()
P = Partial()


def parse_placement(text: str) -> Placement:
    """Inverse of ``str(placement)``: "R", "P", "S(1)", "S(0)i3"."""
    t = text.strip()
    if t == "R":
        return R
    if t == "P":
        return P
    if t.startswith("S(") and ")" in t:
        dim, _, rest = t[2:].partition(")")
        if dim.lstrip("-").isdigit() and (rest == "" or (rest[0] == "i" and rest[1:].isdigit())):
            return Shard(int(dim), int(rest[1:]) if rest else 1)
    raise ValueError(f"bad placement {text!r}: expected R, P, S(dim) or S(dim)i<k>")


def padded_size(n: int, parts: int) -> int:
    """Local size of a dim of ``n`` entries sharded ``parts`` ways (padded if uneven)."""
    return -(-n // parts)


def check_dim(shape, placement: Placement) -> None:
    """Raise ValueError, in words, when ``placement`` shards a dim that ``shape`` does not have."""
    if isinstance(placement, Shard) and not -len(shape) <= placement.dim < len(shape):
        valid = f"S(0)..S({len(shape) - 1}) or R" if shape else "R (a scalar has no dim to shard)"
        raise ValueError(f"{placement} shards dim {placement.dim}, but the tensor of shape {list(shape)} "
                         f"has {len(shape)} dim(s): use {valid}")


def local_shape(shape, placement: Placement, parts: int) -> tuple[int, ...]:
    """Shape of one rank's piece of a tensor of global ``shape``."""
    check_dim(shape, placement)
    shape = list(shape)
    if isinstance(placement, Shard) and parts > 1:
        d = placement.dim
        k = placement.interleave
        shape[d] = k * padded_size(shape[d] // k, parts)
    return tuple(shape)


def take_shard(x, dim: int, parts: int, rank: int):
    """Rank ``rank``'s slice of ``dim`` (zero-padded to a multiple of ``parts``)."""
    import torch.nn.functional as F

    local = padded_size(x.shape[dim], parts)
    extra = local * parts - x.shape[dim]
    if extra:
        x = F.pad(x, [0, 0] * (x.dim() - 1 - dim) + [0, extra])
    return x.narrow(dim, rank * local, local)


def shard_tensor(x, placement: Placement, parts: int, rank: int):
    """This rank's piece of a full tensor under ``placement`` (a copy, contiguous)."""
    if not isinstance(placement, Shard) or parts == 1:
        return x.detach().clone()
    d, k = placement.dim, placement.interleave
    if k == 1:
        return take_shard(x, d, parts, rank).clone(memory_format=torch.contiguous_format)
    return take_shard(x.unflatten(d, (k, -1)), d + 1, parts, rank).flatten(d, d + 1).clone(
        memory_format=torch.contiguous_format)
