"""Alpha-beta costs of ring collectives on one mesh axis.

For ``n`` ranks on a ring, each rank sends ``(n-1)/n`` of the full tensor in ``n-1`` steps for
all-gather, reduce-scatter and all-to-all, and twice that (a reduce-scatter then an all-gather)
for all-reduce. Time = bytes_on_wire / bw + steps * alpha, with (bw, alpha) the intra-node
(NVLink) or inter-node (InfiniBand) tier. A ring is as fast as its slowest link, so an axis that
spans nodes is priced entirely at the inter-node tier: the profile's ``inter_node_bw`` is one GPU's
NIC, and a group with k of its ranks on each node crosses between nodes on k NICs at once (NCCL
runs one ring per NIC, each carrying 1/k of the bytes), so its bandwidth is k NICs', no more than
the node's own fabric carries (``axis_links``: k = 1 for a dp whose ranks are a node apart, 8 for
a dp of whole nodes).

Sums run in fp32 (``autopar.collectives``): ``summed_bytes`` gives the bytes a reduction of a
16-bit tensor really moves.
"""
from __future__ import annotations

import torch

from .devices import COLLECTIVES, DeviceSpec


# How many ring passes each collective makes: it scales both the (n-1)/n bytes and the n-1 steps.
_RING = {
    "all_reduce": 2,
    "all_gather": 1,
    "reduce_scatter": 1,
    "all_to_all": 1,
}


def _check(kind: str, n: int) -> int:
    if kind not in _RING:
        raise ValueError(f"unknown collective {kind!r}; known: {', '.join(COLLECTIVES)}")
    if int(n) != n or n < 1:
        raise ValueError(f"collective group size must be a positive integer, got {n!r}")
    return _RING[kind]


def collective_bytes_on_wire(kind: str, nbytes: float, n: int) -> float:
    """Bytes each rank sends for a ring ``kind`` over ``n`` ranks of a FULL tensor of ``nbytes``.

    ``nbytes`` is the all-reduce input, the all-gather output, the reduce-scatter input, the
    all-to-all input: 2(n-1)/n * nbytes for all-reduce, (n-1)/n * nbytes for the others."""
    mult = _check(kind, n)
    if n == 1:
        return 0.0
    return mult * (n - 1) / n * nbytes


def send_recv_time(nbytes: float, dev: DeviceSpec, inter_node: bool = False) -> float:
    """Seconds for every rank of a ring to send ``nbytes`` to its next rank while receiving as many
    from its previous one: one step of a ring all-gather, priced with the all-gather's (latency,
    bandwidth) on that tier (ring attention's block transfer)."""
    alpha, bw = dev.collective_params("all_gather", inter_node)
    return nbytes / bw + alpha


def summed_bytes(kind: str, nbytes: float, dtype: torch.dtype | None) -> float:
    """Bytes a ``kind`` collective moves for a tensor of ``nbytes`` at ``dtype``: an all-reduce or
    reduce-scatter of a bf16/fp16 tensor is upcast and summed in fp32, so it moves twice ``nbytes``;
    other collectives, and other dtypes, move the tensor as it is."""
    if kind in ("all_reduce", "reduce_scatter") and dtype in (torch.bfloat16, torch.float16):
        return 2.0 * nbytes
    return float(nbytes)


def collective_time(kind: str, nbytes: float, n: int, dev: DeviceSpec,
                    inter_node: bool | int = False) -> float:
    """Seconds for a ring ``kind`` ("all_reduce", "all_gather", "reduce_scatter",
    "all_to_all") of a FULL tensor of ``nbytes`` over ``n`` ranks on ``dev``'s network.

    ``inter_node``: false within a node; across nodes, the group's ranks on each node (``axis_links``;
    True: one), whose NICs the ring's crossings share (``link_bandwidth``). The profile's fit for
    ``kind`` on the tier is used when it has one (``DeviceSpec.collective_params``). ``nbytes`` may
    be a sympy expression. A group of one rank costs nothing."""
    mult = _check(kind, n)
    if n == 1:
        return 0.0
    alpha, bw = dev.collective_params(kind, bool(inter_node))
    if inter_node:
        bw = link_bandwidth(bw, int(inter_node), dev.collective_params(kind, False)[1])
    return collective_bytes_on_wire(kind, nbytes, n) / bw + mult * (n - 1) * alpha


def link_bandwidth(nic: float, links: int, fabric: float) -> float:
    """Bytes/s of a ring crossing between nodes on ``links`` NICs per node (one per rank of the group
    on that node), each of ``nic`` bytes/s: one ring per NIC, each with 1/links of the bytes; never
    above the node's own ``fabric``, which every ring also crosses inside the node."""
    return min(nic * links, max(fabric, nic))


def axis_links(axis_size: int, inner_size: int, gpus_per_node: int) -> int:
    """0 when a mesh axis of ``axis_size`` ranks, ``inner_size`` apart, stays in one node (as
    ``axis_is_inter_node``); else how many of one group's ranks share a node, each with its own NIC:
    gpus_per_node / inner_size when the axes inside it fill less than a node, else 1."""
    if not axis_is_inter_node(axis_size, inner_size, gpus_per_node):
        return 0
    return max(1, gpus_per_node // inner_size)


def axis_is_inter_node(axis_size: int, inner_size: int, gpus_per_node: int) -> bool:
    """Whether a mesh axis of ``axis_size`` ranks, ``inner_size`` apart, spans several nodes.

    ``inner_size`` is the product of the sizes of the axes inside this one (1 for tp, the
    innermost axis; tp for pp; pp*tp for dp). Ranks are numbered node by node, so the axis'
    members fit in one node iff ``axis_size * inner_size <= gpus_per_node``. An axis of size 1
    never communicates and is reported as intra-node."""
    if axis_size < 1 or inner_size < 1 or gpus_per_node < 1:
        raise ValueError(f"axis_size, inner_size and gpus_per_node must be >= 1, got "
                         f"{axis_size}, {inner_size}, {gpus_per_node}")
    if axis_size == 1:
        return False
    return axis_size * inner_size > gpus_per_node
