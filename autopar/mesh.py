"""The (dp, pp, tp) device mesh: its shape, checks, and the torch DeviceMesh behind it."""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

AXES = ("dp", "pp", "tp")


@dataclass(frozen=True)
class Mesh:
    """Sizes of the three mesh axes; tp is innermost (contiguous ranks, one node)."""

    dp: int = 1
    pp: int = 1
    tp: int = 1

    def __post_init__(self):
        for axis in AXES:
            v = getattr(self, axis)
            if not isinstance(v, int) or v < 1:
                raise ValueError(f"mesh axis {axis} must be a positive integer, got {v!r}")

    @property
    def world_size(self) -> int:
        return self.dp * self.pp * self.tp

    def size(self, axis: str) -> int:
        return getattr(self, axis)

    def coords(self, rank: int) -> dict[str, int]:
        """This rank's index on each axis (row-major over dp, pp, tp)."""
        return {"dp": rank // (self.pp * self.tp), "pp": rank // self.tp % self.pp, "tp": rank % self.tp}

    def inner_size(self, axis: str) -> int:
        """How many ranks apart neighbours on ``axis`` are."""
        return {"dp": self.pp * self.tp, "pp": self.tp, "tp": 1}[axis]

    def __str__(self) -> str:
        return f"(dp={self.dp}, pp={self.pp}, tp={self.tp})"

    @classmethod
    def parse(cls, mesh) -> "Mesh":
        """Accept a Mesh, a (dp, pp, tp) tuple, "dp,pp,tp", or a DeviceMesh with named axes."""
        if isinstance(mesh, Mesh):
            return mesh
        if isinstance(mesh, str):
            try:
                mesh = tuple(int(x) for x in mesh.split(","))
            except ValueError:
                raise ValueError(f"mesh {mesh!r}: expected three integers 'dp,pp,tp'") from None
        if hasattr(mesh, "mesh_dim_names"):
            names = mesh.mesh_dim_names or ()
            if not set(names) <= set(AXES):
                raise ValueError(f"DeviceMesh axes must be named from {AXES}, got {names}")
            return cls(**{n: mesh.size(i) for i, n in enumerate(names)})
        if not isinstance(mesh, (tuple, list)) or len(mesh) != 3:
            raise ValueError(f"mesh must be (dp, pp, tp), got {mesh!r}")
        return cls(*mesh)


def device_mesh(mesh: Mesh, device_type: str):
    """The torch DeviceMesh with axes ("dp", "pp", "tp") over the initialised world."""
    world = dist.get_world_size()
    if world != mesh.world_size:
        raise ValueError(f"mesh {mesh} needs {mesh.world_size} ranks but the world has {world}; "
                         f"launch {mesh.world_size} processes or change the mesh")
    from torch.distributed.device_mesh import init_device_mesh
    return init_device_mesh(device_type, (mesh.dp, mesh.pp, mesh.tp), mesh_dim_names=AXES)


def group_name(dmesh, axis: str) -> str:
    """The process group name functional collectives take for one axis of ``dmesh``."""
    return dmesh.get_group(axis).group_name


def default_device_type() -> str:
    """"cuda" when the ranks talk over NCCL (or no process group exists yet) on a GPU host, else "cpu":
    gloo ranks keep their tensors on the CPU, also on a machine that has GPUs."""
    if not torch.cuda.is_available():
        return "cpu"
    if dist.is_initialized() and "nccl" not in str(dist.get_backend()):
        return "cpu"
    return "cuda"
