"""A rank's gradients and weights seen whole: the global gradient norm and clipping, and every
tensor gathered to its full shape (``full_state_dict``, ``full_grads``).

Each parameter counts once: a tp shard's squares are summed over tp, a replicated weight's are
not; a weight on several pipeline stages counts on its owner (``Program.owns``); under ZeRO-2/3
each dp_shard rank holds its own rows (zero padding past the end) and replicas hold the same.
"""
from __future__ import annotations

import torch

from autopar import collectives as C
from autopar.placement import Shard, parse_placement
from autopar.runtime.zero import scale_to_norm


def global_norm(sq: torch.Tensor, program) -> torch.Tensor:
    """sqrt(sum over tp of sharded squares + replicated squares), summed over the pipeline ranks;
    ``sq`` = [sharded, replicated], this rank's sums of squares (``program``: a ``runtime.program.Program``)."""
    if program.mesh.tp > 1:
        sq[0] = C.all_reduce(sq[0:1].to(program.device), program.groups.tp).cpu()[0]
    if program.mesh.pp > 1:
        sq = C.all_reduce(sq.to(program.device), program.groups.pp).cpu()
    return sq.sum().sqrt()


def clip_grad_norm(program, params: dict[str, torch.nn.Parameter], max_norm: float) -> torch.Tensor:
    """Scale the gradients of ``params`` (not a flat slice's: ``Zero1.clip_grad_norm_``) so their
    global norm is at most ``max_norm``; return the norm before."""
    sq = torch.zeros(2)
    for fqn, p in params.items():
        if p.grad is not None and program.owns(fqn):
            sq[0 if program.params[fqn].sharded else 1] += p.grad.detach().float().pow(2).sum().cpu()
    if program.fsdp:   # each dp_shard rank holds its own rows; replicas the same
        sq = C.all_reduce(sq.to(program.device), program.groups.dp_shard).cpu()
    norm = global_norm(sq, program)
    scale_to_norm([p.grad for p in params.values() if p.grad is not None], max_norm, norm)
    return norm


def zero1_grads(zero, params: dict[str, torch.nn.Parameter]) -> dict[str, torch.Tensor]:
    """The gradients per parameter of a flat slice's (``Zero1``), shaped like ``params``: the
    slices' gradients, all-gathered over the ranks the slice is split over, in fp32."""
    if zero.shard.grad is None:
        raise RuntimeError("full_grads() needs gradients: run train_step first")
    with torch.no_grad():
        flat = zero.gathered_slices(zero.shard.grad.detach())
    pieces = flat[:sum(zero.sizes)].split(zero.sizes)
    return {fqn: piece.view(p.shape).float() for (fqn, p), piece in zip(params.items(), pieces)}


def gathered(program, tensor_of) -> dict[str, torch.Tensor]:
    """Every parameter of the plan at its full shape, on CPU, under each of its names (tied ones
    included): ``tensor_of(fqn)`` gives this rank's piece of each parameter it holds. Collective
    over dp_shard (ZeRO-2/3), pp and tp."""
    out = {}
    mesh, coords, groups = program.mesh, program.coords, program.groups
    with torch.no_grad():
        for q in program.plan.parameters:
            x = tensor_of(q.fqn) if q.fqn in program.params else None
            if program.fsdp and x is not None:   # the dp shards, whole again
                x = C.all_gather(x.to(program.device), 0, groups.dp_shard, mesh.dp_shard, coords["dp_shard"],
                                 q.local_shape[0], False)
            if mesh.pp > 1:   # the owning stage's copy, sent to every pp rank
                mine = x if x is not None and program.owns(q.fqn) else torch.zeros(q.local_shape)
                x = C.all_reduce(mine.to(program.device), groups.pp)
            pl = parse_placement(q.placements["tp"])
            if isinstance(pl, Shard) and mesh.tp > 1:
                x = C.all_gather(x.to(program.device), pl.dim, groups.tp, mesh.tp, coords["tp"],
                                 q.shape[pl.dim] // pl.interleave, False, pl.interleave)
            for name in (q.fqn, *q.aliases):
                out[name] = x.cpu().clone()
    return out

