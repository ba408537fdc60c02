"""Every collective wrapper gives the same gradient compiled (aot_eager) as in eager mode.

torch 2.11's dynamo gave a zero gradient to an autograd.Function whose output was a view or a
no-op cast of a collective's result (every tp plan then trained nothing under torch.compile on
the GPU box); the wrappers now never return one. This checks each wrapper and the vocab-parallel
loss on 2 gloo ranks with the installed torch.
"""
from __future__ import annotations

import torch
import torch.distributed as dist

import pool


def _cases(rank: int, world: int):
    from autopar import collectives as C
    from autopar import ops

    g = dist.group.WORLD.group_name
    tgt = torch.tensor([0, 3, 7, 5, 2, 6])
    w = torch.randn(5, 4)
    return [
        ("vocab-parallel loss", lambda x: ops.vocab_parallel_cross_entropy(x, tgt, g, world, rank, rank * 4, 8),
         torch.randn(6, 4)),
        ("all_reduce", lambda x: C.all_reduce(x * 2, g).pow(2).sum(), torch.randn(3)),
        ("all_reduce bf16", lambda x: C.all_reduce(x.bfloat16() * 2, g).float().pow(2).sum(), torch.randn(3)),
        ("all_gather dim 0", lambda x: C.all_gather(x * 2, 0, g, world, rank, 2 * world, False).pow(2).sum(),
         torch.randn(2, 3)),
        ("all_gather dim 1 padded", lambda x: C.all_gather(x * 2, 1, g, world, rank, 3, True).pow(2).sum(),
         torch.randn(2, 2)),
        ("all_gather interleaved", lambda x: C.all_gather(x * 2, 0, g, world, rank, 2, False, 3).pow(2).sum(),
         torch.randn(3, 2)),
        ("reduce_scatter dim 0", lambda x: C.reduce_scatter(x * 2, 0, g, world).pow(2).sum(), torch.randn(4, 3)),
        ("reduce_scatter dim 1", lambda x: C.reduce_scatter(x * 2, 1, g, world).pow(2).sum(), torch.randn(3, 4)),
        ("copy_to", lambda x: C.copy_to(x * 2, g).pow(2).sum(), torch.randn(3)),
        ("split", lambda x: C.split(x * 2, 0, g, world, rank).pow(2).sum(), torch.randn(4, 3)),
        ("gathered_linear", lambda x: C.gathered_linear(x * 2, w, 0, g, world, rank, 2 * world).pow(2).sum(),
         torch.randn(2, 4)),
    ]


def _grads(rank: int, world: int):
    torch.manual_seed(0)
    out = {}
    for name, fn, a in _cases(rank, world):
        grads = []
        for compiled in (False, True):
            torch._dynamo.reset()
            x = a.clone().requires_grad_()
            (torch.compile(fn, backend="aot_eager") if compiled else fn)(x).backward()
            grads.append(x.grad)
        out[name] = grads
    return out


GRADS = pool.job(2, _grads, timeout=300, lane=pool.compiled(2))


def test_wrappers_keep_their_gradients_under_compile():
    for per_rank in GRADS.result():
        for name, (eager, compiled) in per_rank.items():
            assert eager.abs().sum() > 0, name
            torch.testing.assert_close(compiled, eager, msg=lambda m: f"{name}: {m}")
