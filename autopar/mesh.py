"""The device mesh: its axes and their sizes, checks, and the torch DeviceMeshes behind it.

A mesh is named axis sizes, outermost first: dp, pp, cp, tp (tp innermost: contiguous ranks, one
node). cp (context parallelism) splits every sequence into 2·cp chunks, rank r of cp holding chunks
r and 2·cp-1-r (``passes.context_parallel``); parameters are replicated over it, so gradients are
averaged over dp x cp, as if cp were more data parallelism.
The data-parallel axis may be split in two (HSDP, FSDP2's ``fully_shard`` on a 2-D mesh):
dp = dp_replicate x dp_shard, replicas outermost, so a dp rank's index is
``replica * dp_shard + shard`` and the dp_shard ranks of one replica are neighbours (one node).
ZeRO then shards over dp_shard only and all-reduces the sharded gradients across dp_replicate.
An unsplit dp is one replica of dp shards: ZeRO shards over all of it.

``AXIS_ORDER`` is the one list of axes a mesh dict may name; ``Mesh.dims`` derives the DeviceMesh's
dims, ``Mesh.coords`` and ``Mesh.inner_size`` the rank layout, from it. A mesh with cp=1 has the
rank layout and DeviceMesh it had before cp existed (dp, pp, tp).
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.distributed as dist

AXES = ("dp", "pp", "tp")   # the axes of the (dp, pp, tp) DeviceMesh and of a plan's placements
# every axis a mesh dict may name, outermost first; dp_replicate x dp_shard is dp split for HSDP
AXIS_ORDER = ("dp", "dp_replicate", "dp_shard", "pp", "cp", "tp")
DP_SPLIT = ("dp_replicate", "dp_shard")


@dataclass(frozen=True)
class Mesh:
    """Sizes of the mesh axes; tp is innermost (contiguous ranks, one node). ``dp_replicate``
    divides dp: the replicas of a split dp (HSDP), ``dp_shard = dp / dp_replicate`` ranks each.
    ``cp``: the context-parallel ranks each sequence is split over (between pp and tp)."""

    dp: int = 1
    pp: int = 1
    tp: int = 1
    dp_replicate: int = 1
    cp: int = 1

    def __post_init__(self):
        for axis in ("dp", "pp", "tp", "dp_replicate", "cp"):
            v = getattr(self, axis)
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ValueError(f"mesh axis {axis} must be a positive integer, got {v!r}")
        if self.dp % self.dp_replicate:
            raise ValueError(f"dp_replicate={self.dp_replicate} does not divide dp={self.dp}: dp is "
                             "dp_replicate x dp_shard; give the two sizes, e.g. {'dp_replicate': 2, 'dp_shard': 4}")

    @property
    def dp_shard(self) -> int:
        """Ranks ZeRO shards over: each replica's share of dp (all of dp when it is not split)."""
        return self.dp // self.dp_replicate

    @property
    def split(self) -> bool:
        """Whether dp is split into several replicas (HSDP)."""
        return self.dp_replicate > 1

    @property
    def world_size(self) -> int:
        return self.dp * self.pp * self.cp * self.tp

    @property
    def data(self) -> int:
        """Ranks that see different tokens with the same weights: dp x cp (gradients are averaged over them)."""
        return self.dp * self.cp

    def size(self, axis: str) -> int:
        """The size of ``axis`` (any name of ``AXIS_ORDER``)."""
        if axis not in AXIS_ORDER:
            raise ValueError(f"unknown mesh axis {axis!r}; the axes are {', '.join(AXIS_ORDER)}")
        return getattr(self, axis)

    def dims(self) -> tuple[tuple[str, int], ...]:
        """(name, size) of each dim of this mesh's rank layout, outermost first: dp, or its
        split into dp_replicate and dp_shard, then pp, cp (only when cp > 1) and tp."""
        dp = (("dp_replicate", self.dp_replicate), ("dp_shard", self.dp_shard)) if self.split else (("dp", self.dp),)
        return dp + tuple((a, self.size(a)) for a in AXIS_ORDER
                          if a not in ("dp", *DP_SPLIT) and (a != "cp" or self.cp > 1))

    def coords(self, rank: int) -> dict[str, int]:
        """This rank's index on each axis (row-major over ``dims``): dp, pp, cp, tp, and dp's split
        (dp = dp_replicate * dp_shard + dp_shard index; an unsplit dp is replica 0)."""
        out, rest = {"cp": 0}, rank
        for name, n in reversed(self.dims()):
            out[name], rest = rest % n, rest // n
        if self.split:
            out["dp"] = out["dp_replicate"] * self.dp_shard + out["dp_shard"]
        else:
            out["dp_replicate"], out["dp_shard"] = 0, out["dp"]
        return {a: out[a] for a in AXIS_ORDER}

    def inner_size(self, axis: str) -> int:
        """How many ranks apart neighbours on ``axis`` are: the product of the axes inside it
        (dp's are its dp_shard's: an unsplit dp is one replica)."""
        self.size(axis)
        layout = [a for a in AXIS_ORDER if a != "dp"]
        inside = layout[layout.index("dp_shard" if axis == "dp" else axis) + 1:]
        return math.prod(self.size(a) for a in inside)

    def check_world(self, world: int) -> None:
        """Raise unless this mesh covers a world of ``world`` ranks exactly."""
        if world != self.world_size:
            raise ValueError(f"mesh {self} needs {self.world_size} ranks but the world has {world}; "
                             f"launch {self.world_size} processes or change the mesh")

    def cp_text(self) -> str:
        """" cp=2" when the mesh splits sequences, else "" (what plan summaries add after pp)."""
        return f" cp={self.cp}" if self.cp > 1 else ""

    def dp_text(self) -> str:
        """dp as a plan prints it: "dp=4", or "dp=4 (2 replicas x 2 shards)" when it is split."""
        split = f" ({self.dp_replicate} replicas x {self.dp_shard} shards)" if self.split else ""
        return f"dp={self.dp}{split}"

    def __str__(self) -> str:
        return "(" + ", ".join(f"{name}={n}" for name, n in self.dims()) + ")"

    @classmethod
    def of_plan(cls, plan) -> "Mesh":
        """The mesh a plan was made for: its (dp, pp, tp), its split of dp (``plan.dp_replicate``) and cp."""
        return cls(*plan.mesh, dp_replicate=getattr(plan, "dp_replicate", 1), cp=getattr(plan, "cp", 1))

    @classmethod
    def from_sizes(cls, sizes: dict) -> "Mesh":
        """A mesh from a dict of axis sizes, e.g. {"dp_replicate": 2, "dp_shard": 4, "cp": 2, "tp": 8}:
        missing axes are 1; dp is given whole ("dp") or split (dp_replicate, dp_shard), not both."""
        unknown = [a for a in sizes if a not in AXIS_ORDER]
        if unknown:
            raise ValueError(f"unknown mesh axis {', '.join(map(repr, unknown))}; the known axes are "
                             f"{', '.join(AXIS_ORDER)} (dp_replicate x dp_shard splits dp for HSDP)")
        for axis, n in sizes.items():
            if isinstance(n, bool) or not isinstance(n, int) or n < 1:
                raise ValueError(f"mesh axis {axis} must be a positive integer, got {n!r}")
        given = [a for a in DP_SPLIT if a in sizes]
        if "dp" in sizes and given:
            raise ValueError(f"the mesh names dp={sizes['dp']} and {', '.join(f'{a}={sizes[a]}' for a in given)}: "
                             "give dp whole, or split as dp_replicate x dp_shard, not both")
        r, s = sizes.get("dp_replicate", 1), sizes.get("dp_shard", 1)
        return cls(sizes.get("dp", r * s), sizes.get("pp", 1), sizes.get("tp", 1), dp_replicate=r, cp=sizes.get("cp", 1))

    @classmethod
    def parse(cls, mesh) -> "Mesh":
        """Accept a Mesh, a (dp, pp, tp) tuple, "dp,pp,tp", a dict of axis sizes ({"dp_replicate",
        "dp_shard", "dp", "pp", "cp", "tp"}, ``from_sizes``), or a DeviceMesh with axes of those names."""
        if isinstance(mesh, Mesh):
            return mesh
        if isinstance(mesh, dict):
            return cls.from_sizes(mesh)
        if isinstance(mesh, str):
            try:
                mesh = tuple(int(x) for x in mesh.split(","))
            except ValueError:
                raise ValueError(f"mesh {mesh!r}: expected three integers 'dp,pp,tp'") from None
        if hasattr(mesh, "mesh_dim_names"):
            names = tuple(mesh.mesh_dim_names or ())
            if not set(names) <= set(AXIS_ORDER) or list(names) != sorted(names, key=AXIS_ORDER.index):
                raise ValueError(f"DeviceMesh axes must be named from {AXIS_ORDER}, in that order (outermost "
                                 f"first), got {names}")
            return cls.from_sizes({n: mesh.size(i) for i, n in enumerate(names)})
        if not isinstance(mesh, (tuple, list)) or len(mesh) != 3:
            raise ValueError(f"mesh must be (dp, pp, tp) or a dict of axis sizes such as "
                             f"{{'dp_replicate': 2, 'dp_shard': 4, 'tp': 2}}, got {mesh!r}")
        return cls(*mesh)


def device_mesh(mesh: Mesh, device_type: str):
    """The torch DeviceMesh with axes ("dp", "pp", "tp") over the initialised world; ("dp", "pp",
    "cp", "tp") when the mesh has cp > 1."""
    mesh.check_world(dist.get_world_size())
    if mesh.cp > 1:
        return made_device_mesh(device_type, (mesh.dp, mesh.pp, mesh.cp, mesh.tp), ("dp", "pp", "cp", "tp"))
    return made_device_mesh(device_type, (mesh.dp, mesh.pp, mesh.tp), AXES)


# The DeviceMeshes and process groups made on the current world, by what they were made of: one
# process may build the same mesh many times (parallelize called again, compare's contenders, a
# test rank running case after case), and every gloo group keeps three threads that wake on their
# own (150 idle groups cost a rank about 13% of a core), so each is made once per world. All ranks
# make the same calls in the same order, so all find or make the same groups: still collective.
_MADE: dict = {}


def _made(key: tuple, make):
    """``make()``'s result for ``key`` on the current world, made on first use."""
    if _MADE.get("world") is not dist.group.WORLD:   # a new world: the old groups are gone with it
        _MADE.clear()
        _MADE["world"] = dist.group.WORLD
    if key not in _MADE:
        _MADE[key] = make()
    return _MADE[key]


def made_device_mesh(device_type: str, shape: tuple[int, ...], names: tuple[str, ...]):
    """``init_device_mesh(device_type, shape, mesh_dim_names=names)`` over the initialised world,
    made once per world (collective on first use: every rank calls it with the same arguments)."""
    from torch.distributed.device_mesh import init_device_mesh
    return _made(("mesh", device_type, tuple(shape), tuple(names)),
                 lambda: init_device_mesh(device_type, tuple(shape), mesh_dim_names=tuple(names)))


def axes_group(mesh: Mesh, axes: tuple[str, ...]) -> str:
    """The process group name of this rank's ranks that differ only on ``axes`` (e.g. ("dp", "cp"):
    the ranks a gradient is averaged over), which a DeviceMesh cannot slice when the axes are not
    neighbours (pp lies between dp and cp). Every rank must call it with the same ``axes``: it
    creates one group per combination of the other axes' coordinates, in the same order everywhere."""
    mesh.check_world(dist.get_world_size())
    spread = {a for axis in axes for a in (DP_SPLIT if axis == "dp" else (axis,))}
    fixed = [a for a in ("dp_replicate", "dp_shard", "pp", "cp", "tp") if a not in spread]
    members: dict[tuple, list[int]] = {}
    for r in range(mesh.world_size):
        c = mesh.coords(r)
        members.setdefault(tuple(c[a] for a in fixed), []).append(r)
    mine, me = None, dist.get_rank()
    for key in sorted(members):
        group = _made(("group", tuple(members[key])), lambda: dist.new_group(members[key]))
        if me in members[key]:
            mine = group
    return mine.group_name


def split_dp_groups(mesh: Mesh, device_type: str) -> tuple[str, str]:
    """The (dp_shard, dp_replicate) process group names of a split dp (HSDP), from a DeviceMesh
    over ``mesh.dims()``; every rank must call it (it creates the groups)."""
    if not mesh.split:
        raise ValueError(f"mesh {mesh} does not split dp into replicas")
    mesh.check_world(dist.get_world_size())
    names, sizes = zip(*mesh.dims())
    split = made_device_mesh(device_type, sizes, names)
    return group_name(split, "dp_shard"), group_name(split, "dp_replicate")


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
