"""Every collective autopar issues, as autograd-aware functional collectives.

The forward of each wrapper is a ``torch.ops._c10d_functional`` op followed by
``wait_tensor``; its backward is the dual collective (Megatron's f/g pairs):

    copy_to        identity        <->  all-reduce        (f: entering a TP region)
    all_reduce     all-reduce      <->  identity          (g: leaving a row-parallel op)
    all_gather     all-gather      <->  reduce-scatter or slice
    reduce_scatter reduce-scatter  <->  all-gather
    split          slice           <->  all-gather

Because they are functional ops, torch.compile keeps them in the graph it
re-traces, AOTAutograd derives the backward collectives, and Inductor may reorder
them. Arguments are plain strings and ints (group name, group size, rank in group)
so the rewritten FX graph prints and pickles. Uneven dims are padded to a multiple
of the group size on the way in and narrowed back to ``full`` on the way out.

Sums run in fp32: an all-reduce or reduce-scatter of a bf16 or fp16 tensor (forward, or a
backward's gradient) upcasts it first and casts the sum back, so partial sums do not
each lose the bits a 16-bit mantissa cannot hold. Gathers move the tensor as it is.

Version note: the raw ``_c10d_functional`` op names used here (all_reduce,
all_gather_into_tensor, reduce_scatter_tensor, wait_tensor) are the same in torch
2.11-2.14; the Python-level wrappers in ``_functional_collectives`` were renamed
(``*_tensor`` -> ``*_single``), which is why they are not used.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from autopar.placement import take_shard

_ops = torch.ops._c10d_functional


_SUM_IN_FP32 = (torch.bfloat16, torch.float16)


def _own(y: torch.Tensor, dim: int, full: int, dtype: torch.dtype) -> torch.Tensor:
    """A collective's result ``y`` (collected along dim 0) with that dim moved to ``dim``, cut to
    ``full`` and cast to ``dtype``: ``y`` itself when nothing changes, else a tensor of its own.

    Never a view or a no-op cast of ``y``: torch 2.11's dynamo gives an autograd.Function whose
    output is one a zero gradient (seen on CPU and GPU; 2.13 is not affected)."""
    if dim == 0 and y.shape[0] == full and y.dtype == dtype:
        return y
    y = y.movedim(0, dim).narrow(dim, 0, full)
    if y.dtype != dtype:
        return y.to(dtype, memory_format=torch.contiguous_format)
    return y.clone(memory_format=torch.contiguous_format)


def _ar(x: torch.Tensor, group: str) -> torch.Tensor:
    y = x.float() if x.dtype in _SUM_IN_FP32 else x
    y = _ops.wait_tensor(_ops.all_reduce(y.contiguous(), "sum", group))
    return y if y.dtype == x.dtype else y.to(x.dtype)   # never a no-op cast: see _own


def _pad_to(x: torch.Tensor, dim: int, n: int) -> torch.Tensor:
    extra = n - x.shape[dim]
    if extra == 0:
        return x
    pad = [0, 0] * (x.dim() - 1 - dim) + [0, extra]
    return F.pad(x, pad)


def _ag(x: torch.Tensor, dim: int, group: str, size: int, full: int) -> torch.Tensor:
    y = x.movedim(dim, 0).contiguous()
    return _own(_ops.wait_tensor(_ops.all_gather_into_tensor(y, size, group)), dim, full, x.dtype)


def _rs(x: torch.Tensor, dim: int, group: str, size: int) -> torch.Tensor:
    local = -(-x.shape[dim] // size)
    y = x.float() if x.dtype in _SUM_IN_FP32 else x
    y = _pad_to(y, dim, local * size).movedim(dim, 0).contiguous()
    y = _ops.wait_tensor(_ops.reduce_scatter_tensor(y, "sum", size, group))
    return _own(y, dim, local, x.dtype)


class _CopyTo(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return x.view_as(x)

    @staticmethod
    def backward(ctx, g):
        return _ar(g, ctx.group), None


class _AllReduce(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        return _ar(x, group)

    @staticmethod
    def backward(ctx, g):
        return g, None


class _AllGather(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, dim, group, size, rank, full, reduce_grad):
        ctx.args = (dim, group, size, rank, reduce_grad)
        return _ag(x, dim, group, size, full)

    @staticmethod
    def backward(ctx, g):
        dim, group, size, rank, reduce_grad = ctx.args
        g = _rs(g, dim, group, size) if reduce_grad else take_shard(g, dim, size, rank).contiguous()
        return g, None, None, None, None, None, None


class _ReduceScatter(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, dim, group, size):
        ctx.args = (dim, group, size, x.shape[dim])
        return _rs(x, dim, group, size)

    @staticmethod
    def backward(ctx, g):
        dim, group, size, full = ctx.args
        return _ag(g, dim, group, size, full), None, None, None


class _Split(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, dim, group, size, rank):
        ctx.args = (dim, group, size, x.shape[dim])
        return take_shard(x, dim, size, rank).clone(memory_format=torch.contiguous_format)   # not a view: see _own

    @staticmethod
    def backward(ctx, g):
        dim, group, size, full = ctx.args
        return _ag(g, dim, group, size, full), None, None, None, None


def _launch_gather(shard: torch.Tensor, group: str, size: int, dtype) -> torch.Tensor:
    """The all-gather of a weight's dp shards (dim 0) at ``dtype`` (None: the shard's own), launched and
    not waited: every rank's rows, padding included, once ``wait_tensor`` has run on it."""
    shard = shard.detach()   # the gradient reaches the shard through gather_param / sharded_linear
    if dtype is not None and shard.dtype != dtype:
        shard = shard.to(dtype)
    return _ops.all_gather_into_tensor(shard.contiguous(), size, group)


def _gather_weight(shard: torch.Tensor, group: str, size: int, full: int, dtype,
                   pending: torch.Tensor | None = None) -> torch.Tensor:
    """A weight from its dp shards (dim 0), at ``dtype`` (None: the shard's own): the all-gather
    ``pending`` launched earlier (``prefetch_gather``) waited on, else one launched and waited now."""
    if pending is None:
        pending = _launch_gather(shard, group, size, dtype)
    return _own(_ops.wait_tensor(pending), 0, full, pending.dtype)


def _scatter_grad(g: torch.Tensor, group: str, size: int, dtype, replicate: str | None = None,
                  replicas: int = 1) -> torch.Tensor:
    """A weight's gradient reduce-scattered to this rank's rows at the shard's ``dtype``, averaged over dp;
    with ``replicate`` (HSDP: the group of the ``replicas`` holding the same shard) the rows are then
    all-reduced across the replicas, and averaged over all ``size * replicas`` dp ranks."""
    rows = _rs(g if g.dtype == dtype else g.to(dtype), 0, group, size)
    if replicate is not None:
        rows = _ar(rows, replicate)
    return rows / (size * replicas)


class _GatherParam(torch.autograd.Function):
    @staticmethod
    def forward(ctx, shard, group, size, full, dtype, pending, replicate, replicas):
        ctx.args = (group, size, shard.dtype, replicate, replicas)
        return _gather_weight(shard, group, size, full, dtype, pending)

    @staticmethod
    def backward(ctx, g):
        group, size, dtype, replicate, replicas = ctx.args
        return _scatter_grad(g, group, size, dtype, replicate, replicas), None, None, None, None, None, None, None


class _ShardedLinear(torch.autograd.Function):
    """x @ w.T with w gathered from its dp shards in forward and again in backward: only the
    shard is kept for backward (ZeRO-3's reshard after forward)."""

    @staticmethod
    def forward(ctx, x, shard, group, size, full, dtype, pending, replicate, replicas):
        ctx.args = (group, size, full, dtype, shard.dtype, replicate, replicas)
        ctx.save_for_backward(x, shard)
        return F.linear(x, _gather_weight(shard, group, size, full, dtype, pending))

    @staticmethod
    def backward(ctx, g):
        group, size, full, dtype, stored, replicate, replicas = ctx.args
        x, shard = ctx.saved_tensors
        w = _gather_weight(shard, group, size, full, dtype)
        gx = g @ w
        gw = g.reshape(-1, g.shape[-1]).t() @ x.reshape(-1, x.shape[-1])
        return (gx, _scatter_grad(gw, group, size, stored, replicate, replicas), None, None, None, None, None, None,
                None)


def _interleaved(fn, x: torch.Tensor, dim: int, interleave: int, *args):
    """Apply a per-dim collective to each of ``interleave`` equal blocks of ``dim``."""
    if interleave == 1:
        return fn(x, dim, *args)
    y = fn(x.unflatten(dim, (interleave, -1)), dim + 1, *args)
    return y.flatten(dim, dim + 1)


def copy_to(x: torch.Tensor, group: str) -> torch.Tensor:
    """Identity forward, all-reduce of the gradient backward (Megatron's f)."""
    return _CopyTo.apply(x, group)


def all_reduce_mean_(x: torch.Tensor, group: str, size: int) -> torch.Tensor:
    """``x`` replaced by its mean over the group, in place (no autograd: the runtime's gradient sync,
    where a new buffer per step would be one more gradient-sized tensor at the step's peak)."""
    _ops.wait_tensor(_ops.all_reduce_(x, "sum", group))
    return x.div_(size)


def all_reduce(x: torch.Tensor, group: str) -> torch.Tensor:
    """Sum of a partial tensor over the group; identity backward (Megatron's g)."""
    return _AllReduce.apply(x, group)


def all_gather(x: torch.Tensor, dim: int, group: str, size: int, rank: int, full: int,
               reduce_grad: bool, interleave: int = 1) -> torch.Tensor:
    """Gather the shards of ``dim`` (global length ``full``, per block if interleaved).

    Backward reduce-scatters the gradient when the consumers' gradients are partial
    (``reduce_grad``), else keeps this rank's slice of it."""
    return _interleaved(lambda t, d: _AllGather.apply(t, d, group, size, rank, full, reduce_grad),
                        x, dim, interleave)


def reduce_scatter(x: torch.Tensor, dim: int, group: str, size: int, interleave: int = 1) -> torch.Tensor:
    """Sum a partial tensor and keep this rank's shard of ``dim``; all-gather backward."""
    return _interleaved(lambda t, d: _ReduceScatter.apply(t, d, group, size), x, dim, interleave)


def split(x: torch.Tensor, dim: int, group: str, size: int, rank: int, interleave: int = 1) -> torch.Tensor:
    """Keep this rank's shard of a replicated tensor; all-gather of the gradient backward."""
    return _interleaved(lambda t, d: _Split.apply(t, d, group, size, rank), x, dim, interleave)


def prefetch_gather(shard: torch.Tensor, group: str, size: int, dtype: torch.dtype | None = None) -> torch.Tensor:
    """Launch the all-gather of a parameter's dp shards (at ``dtype``) and return it in flight, not
    waited: handed as ``pending`` to the ``gather_param`` or ``sharded_linear`` that needs the weight,
    which waits on it there (FSDP's forward prefetch). It carries no gradient; theirs reaches the shard."""
    return _launch_gather(shard, group, size, dtype)


def gather_param(shard: torch.Tensor, group: str, size: int, full: int,
                 dtype: torch.dtype | None = None, pending: torch.Tensor | None = None,
                 replicate: str | None = None, replicas: int = 1) -> torch.Tensor:
    """A parameter from its dp shards (dim 0, ``full`` rows in all), at ``dtype`` (the compute dtype;
    None: the shard's own): FSDP's unshard, waiting on ``pending`` (``prefetch_gather`` of this
    shard) when given, else gathering now. Backward reduce-scatters the gradient at the shard's
    dtype (fp32 for fp32 master weights) and averages it over the group: the shard's dp-mean gradient.
    HSDP: ``group`` is dp_shard's and ``replicate`` dp_replicate's (``replicas`` ranks), across
    which the reduce-scattered gradient is all-reduced before the mean over all of dp."""
    return _GatherParam.apply(shard, group, size, full, dtype, pending, replicate, replicas)


def sharded_linear(x: torch.Tensor, shard: torch.Tensor, group: str, size: int, full: int,
                   dtype: torch.dtype | None = None, pending: torch.Tensor | None = None,
                   replicate: str | None = None, replicas: int = 1) -> torch.Tensor:
    """``F.linear(x, w)`` for a weight ``w`` held as dp shards: gathered for the forward (waiting on
    ``pending``, as ``gather_param``), gathered again for the backward instead of kept (FSDP's
    reshard after forward), its gradient reduce-scattered (and across ``replicate``) and averaged
    as ``gather_param``'s."""
    return _ShardedLinear.apply(x, shard, group, size, full, dtype, pending, replicate, replicas)


COLLECTIVE_FUNCTIONS = (copy_to, all_reduce, all_gather, reduce_scatter, split, prefetch_gather, gather_param,
                        sharded_linear)



class _GatheredLinear(torch.autograd.Function):
    """y = all_gather(x) @ w.T, keeping only this rank's shard of x for backward.

    Megatron's sequence-parallel linear: the backward gathers x again (one more all-gather)
    instead of holding the gathered copy from forward to backward."""

    @staticmethod
    def forward(ctx, x, w, dim, group, size, rank, full):
        ctx.args = (dim, group, size, rank, full)
        ctx.save_for_backward(x, w)
        return F.linear(_ag(x, dim, group, size, full), w)

    @staticmethod
    def backward(ctx, g):
        x, w = ctx.saved_tensors
        dim, group, size, rank, full = ctx.args
        x_full = _ag(x, dim, group, size, full)
        grad_w = g.reshape(-1, g.shape[-1]).t() @ x_full.reshape(-1, x_full.shape[-1])
        grad_x = _rs(g @ w, dim, group, size)
        return grad_x, grad_w, None, None, None, None, None


def gathered_linear(x: torch.Tensor, w: torch.Tensor, dim: int, group: str, size: int, rank: int,
                    full: int) -> torch.Tensor:
    """Linear of the all-gathered ``x`` that keeps only the shard for backward (re-gathered there)."""
    return _GatheredLinear.apply(x, w, dim, group, size, rank, full)


# ---- context parallelism (cp): each rank holds chunks r and 2c-1-r of every sequence -----------

def rank_chunks(x: torch.Tensor, dim: int, size: int, rank: int) -> torch.Tensor:
    """This cp rank's share of a whole sequence dim ``dim``: of its ``2 * size`` equal chunks, chunk
    ``rank`` followed by chunk ``2 * size - 1 - rank`` (a head and a tail chunk, so every rank has the
    same causal work: Megatron's and torchtitan's load balance). Slicing only: the gradient of the
    rank's positions flows back to them and the rest get zeros."""
    c = x.shape[dim] // (2 * size)
    return torch.cat([x.narrow(dim, rank * c, c), x.narrow(dim, (2 * size - 1 - rank) * c, c)], dim)


def _natural_order(size: int, device) -> torch.Tensor:
    """Where each sequence chunk, in order 0 .. 2·size-1, lies in a cp all-gather's result (rank r
    contributes blocks 2r and 2r+1: its chunks r and 2·size-1-r)."""
    order = [2 * j if j < size else 2 * (2 * size - 1 - j) + 1 for j in range(2 * size)]
    return torch.tensor(order, device=device)


def _gather_sequence(x: torch.Tensor, dim: int, group: str, size: int) -> torch.Tensor:
    g = _ag(x, dim, group, size, size * x.shape[dim])
    blocks = g.unflatten(dim, (2 * size, x.shape[dim] // 2))
    return blocks.index_select(dim, _natural_order(size, x.device)).flatten(dim, dim + 1)


class _GatherSequence(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, dim, group, size):
        ctx.args = (dim, group, size)
        return _gather_sequence(x, dim, group, size)

    @staticmethod
    def backward(ctx, g):
        dim, group, size = ctx.args
        blocks = g.unflatten(dim, (2 * size, g.shape[dim] // (2 * size)))
        # back to the gather's order (its inverse permutation), then each rank's chunks summed over cp
        inverse = torch.argsort(_natural_order(size, g.device))
        g = blocks.index_select(dim, inverse).flatten(dim, dim + 1)
        return _rs(g, dim, group, size), None, None, None


def gather_sequence(x: torch.Tensor, dim: int, group: str, size: int) -> torch.Tensor:
    """The whole sequence, in order, from every cp rank's two chunks of ``dim`` (``rank_chunks``):
    an all-gather over cp; backward reduce-scatters the gradient (every rank's queries contributed
    to every key and value), so each rank gets its chunks' summed gradient."""
    return _GatherSequence.apply(x, dim, group, size)


def context_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None,
                      dropout_p: float, scale: float | None, enable_gqa: bool, group: str, size: int,
                      rank: int) -> torch.Tensor:
    """Causal sdpa of this cp rank's queries (its two chunks, dim -2) over the whole sequence's keys
    and values, all-gathered over cp (the all-gather-KV variant, Llama 3's). ``mask`` None: the
    causal mask of the rank's query positions against every key position; else a boolean or
    additive mask already cut to the rank's query rows, over every key in order."""
    seq = q.dim() - 2
    k_all, v_all = gather_sequence(k, seq, group, size), gather_sequence(v, seq, group, size)
    if mask is None:
        whole = k_all.shape[seq]
        positions = rank_chunks(torch.arange(whole, device=q.device), 0, size, rank)
        mask = positions[:, None] >= torch.arange(whole, device=q.device)[None, :]
    return F.scaled_dot_product_attention(q, k_all, v_all, attn_mask=mask, dropout_p=dropout_p, scale=scale,
                                          enable_gqa=enable_gqa)


def context_loss_scale(target: torch.Tensor, ignore_index: int, mean: bool, group: str, size: int) -> torch.Tensor:
    """What this cp rank's summed token loss is multiplied by so that the mean over cp (as over dp)
    of the ranks' losses is the loss of the whole sequences: ``size / tokens`` for a mean over the
    tokens not ``ignore_index`` on all cp ranks (counted by an all-reduce), ``size`` for a sum."""
    if not mean:
        return torch.tensor(float(size), device=target.device)
    counted = (target != ignore_index).sum().to(torch.float64)
    return size / _ar(counted.detach(), group).to(torch.float32)
