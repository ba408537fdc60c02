"""The process groups a rank's collectives use, by mesh axis.

A ``Groups`` holds their names, as functional collectives take them. ``process_groups`` makes
them on an initialised world (collective: every rank calls it, in the same order);
``Groups.placeholders`` names them without any process group (each name says its axis), so that
a rank's program (``autopar.runtime.program``) can be built and read where no world exists.
Both take their layout from one function, ``_layout``:

    dp, tp, pp, cp   the axes of the (dp, pp, [cp,] tp) DeviceMesh (cp None when cp = 1)
    data             the ranks that see other tokens with the same weights, over which gradients
                     and the loss are averaged: dp x cp
    dp_shard         the ranks ZeRO splits its state over: all of dp, unless dp is split (HSDP)
    dp_replicate     the ranks holding the same ZeRO shards, across which the sharded gradients
                     are summed: a split dp's replicas, and with cp every cp rank of them
                     (None without ZeRO, or where no rank shares its shards)
"""
from __future__ import annotations

import dataclasses
from typing import Callable

import torch
import torch.distributed as dist

from autopar.mesh import Mesh, axes_group, default_device_type, device_mesh, group_name, split_dp_groups


@dataclasses.dataclass(frozen=True)
class Groups:
    """Process group names by axis (see the module docstring), the backend they run on, and the
    pipeline's process group object (torch.distributed.pipelining takes the group itself; None
    for placeholders)."""

    dp: str
    tp: str
    pp: str
    cp: str | None
    data: str
    dp_shard: str
    dp_replicate: str | None
    backend: str
    pp_process_group: object = dataclasses.field(default=None, compare=False, repr=False)

    def of(self, axis: str) -> str | None:
        """The group name of ``axis``: "dp", "tp", "dp_shard", "dp_replicate" or "cp" (what
        ``ParallelModel.group`` answers), and "pp" or "data"."""
        names = {"dp": self.dp, "tp": self.tp, "dp_shard": self.dp_shard, "dp_replicate": self.dp_replicate,
                 "cp": self.cp, "pp": self.pp, "data": self.data}
        if axis not in names:
            raise ValueError(f"no process group for axis {axis!r}; the axes are {', '.join(names)}")
        return names[axis]

    @classmethod
    def placeholders(cls, mesh: Mesh, zero: int, backend: str = "gloo") -> "Groups":
        """The groups of ``mesh`` under ZeRO stage ``zero``, each named after its axes ("dp",
        "dp_replicate+cp", ...), made without a process group: for building a rank's program where
        no world runs. ``backend`` is the one the program is built for (it decides whether ZeRO's
        gathers are prefetched, ``autopar.runtime.program``)."""
        return _layout(mesh, zero, axis=lambda a: a, axes=lambda axes: "+".join(axes),
                       split=lambda: ("dp_shard", "dp_replicate"), backend=backend)


def process_groups(mesh: Mesh, zero: int, device_type: str) -> Groups:
    """This rank's groups on the initialised world, made for ``mesh`` under ZeRO stage ``zero``:
    the DeviceMesh of its axes, then the groups no DeviceMesh slices. Collective: every rank calls
    it with the same arguments."""
    dmesh = device_mesh(mesh, device_type)
    return _layout(mesh, zero, axis=lambda a: group_name(dmesh, a), axes=lambda axes: axes_group(mesh, axes),
                   split=lambda: split_dp_groups(mesh, device_type), backend=str(dist.get_backend()),
                   pp_process_group=dmesh.get_group("pp"))


def _layout(mesh: Mesh, zero: int, *, axis: Callable[[str], str], axes: Callable[[tuple], str],
            split: Callable[[], tuple[str, str]], backend: str, pp_process_group=None) -> Groups:
    """The groups of ``mesh``: ``axis(a)`` names a DeviceMesh axis' group, ``axes(names)`` makes the
    group of ranks differing only on ``names``, ``split()`` makes HSDP's (dp_shard, dp_replicate).
    The calls run in one order on every rank (the real ones create groups)."""
    tp, dp = axis("tp"), axis("dp")
    cp = axis("cp") if mesh.cp > 1 else None
    data = dp if mesh.cp == 1 else cp if mesh.dp == 1 else axes(("dp", "cp"))
    shard, replicate = dp, None
    if zero and mesh.split:
        shard, replicate = split()
    if zero and mesh.cp > 1:   # the same shards on every cp rank (and replica): reduced across them
        replicate = axes(("dp_replicate", "cp")) if mesh.split else cp
    return Groups(dp=dp, tp=tp, pp=axis("pp"), cp=cp, data=data, dp_shard=shard, dp_replicate=replicate,
                  backend=backend, pp_process_group=pp_process_group)


def replicas(mesh: Mesh, zero: int) -> int:
    """How many ranks hold the same ZeRO shards (the dp_replicate group's size; 1 without ZeRO)."""
    if not zero:
        return 1
    return (mesh.dp_replicate if mesh.split else 1) * mesh.cp


def comm_device() -> torch.device:
    """The device this process's collectives run on: its current GPU under NCCL, else the CPU."""
    return torch.device("cuda", torch.cuda.current_device()) if default_device_type() == "cuda" else torch.device("cpu")
