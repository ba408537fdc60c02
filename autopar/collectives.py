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

Ring attention (``ring_attention``) passes key/value blocks between neighbouring cp ranks with
``all_to_all_single`` (one non-empty split each way), launched before the block's compute and
waited after it.

Version note: the raw ``_c10d_functional`` op names used here (all_reduce,
all_gather_into_tensor, reduce_scatter_tensor, all_to_all_single, wait_tensor) are the same in
torch 2.11-2.14; the Python-level wrappers in ``_functional_collectives`` were renamed
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


# ---- ring attention over cp: key/value blocks passed around the ring, one per step ------------------

def _ring_launch(x: torch.Tensor, group: str, size: int, rank: int) -> torch.Tensor:
    """Send ``x`` (flattened) to the next cp rank and receive the previous rank's, launched and not
    waited: an all-to-all whose only non-empty splits are those two (torch's own context parallel
    shifts blocks so too), a functional collective that compiles and runs on gloo and NCCL alike."""
    n = x.numel()
    send = [n if i == (rank + 1) % size else 0 for i in range(size)]
    recv = [n if i == (rank - 1) % size else 0 for i in range(size)]
    return _ops.all_to_all_single(x.reshape(-1).contiguous(), recv, send, group)


def _expand_heads(x: torch.Tensor, heads: int) -> torch.Tensor:
    """(..., kv_heads, s, d) -> (..., heads, s, d): each key/value head repeated for its group of
    consecutive query heads (GQA, as sdpa's ``enable_gqa``); ``x`` itself when the counts agree."""
    kv = x.shape[-3]
    if kv == heads:
        return x
    return x.unsqueeze(-3).expand(*x.shape[:-2], heads // kv, *x.shape[-2:]).flatten(-4, -3)


def _sum_heads(x: torch.Tensor, kv_heads: int) -> torch.Tensor:
    """``_expand_heads``' gradient: each group's query heads' shares summed into its key/value head."""
    if x.shape[-3] == kv_heads:
        return x
    return x.unflatten(-3, (kv_heads, x.shape[-3] // kv_heads)).sum(-3)


def _cut(x: torch.Tensor, dim: int, start: int, length: int) -> torch.Tensor:
    """``x.narrow`` unless ``dim`` is broadcast (size 1)."""
    return x if x.shape[dim] == 1 else x.narrow(dim, start, length)


def _finite(m: torch.Tensor) -> torch.Tensor:
    """A log-sum-exp with -inf (every key masked so far) read as 0, so that exp(s - m) is 0, not nan."""
    return torch.where(torch.isinf(m), torch.zeros_like(m), m)


def fused_blocks(q: torch.Tensor, masked: bool) -> bool:
    """Whether ring attention's blocks run as fused (flash) attention, which returns the log-sum-exp
    the ring merges by and keeps no scores: unmasked blocks on the CPU (any float dtype), and on
    CUDA in 16 bits with a head dim flash attention takes (a multiple of 8, at most 256). Else each
    block is computed in fp32 (fp64 for fp64) with its scores in full: masked blocks, CUDA in fp32."""
    if masked:
        return False
    if q.device.type == "cpu":
        return True
    return (q.device.type == "cuda" and q.dtype in (torch.float16, torch.bfloat16)
            and q.shape[-1] % 8 == 0 and q.shape[-1] <= 256)


def _block_forward(q, k, v, causal: bool, scale: float, mask, fused: bool):
    """(out, log-sum-exp over the keys, the flash kernel's random-state tensors or ()) of one block:
    queries (..., h, c, d) against keys and values (..., h, c, d), causal on the diagonal, under
    ``mask`` (the block's rows and columns, boolean or additive, or None)."""
    if fused and q.device.type == "cuda":
        out, lse, _, _, _, _, seed, offset, _ = torch.ops.aten._scaled_dot_product_flash_attention(
            q, k, v, 0.0, causal, False, scale=scale)
        return out, lse, (seed, offset)
    if fused:
        out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(q, k, v, 0.0, causal, scale=scale)
        return out, lse, ()
    s = _scores(q, k, causal, scale, mask)
    lse = torch.logsumexp(s, -1)
    return torch.exp(s - _finite(lse)[..., None]) @ v, lse, ()


def _block_backward(g, q, k, v, out, lse, causal: bool, scale: float, mask, fused: bool, state):
    """(dq, dk, dv) of one block given the merged output and log-sum-exp of its query rows (``out``,
    ``lse``): with those, each block's softmax backward is exact on its own (flash attention's)."""
    if fused and q.device.type == "cuda":
        return torch.ops.aten._scaled_dot_product_flash_attention_backward(
            g, q, k, v, out, lse, None, None, q.shape[-2], k.shape[-2], 0.0, causal, *state, scale=scale)
    if fused:
        return torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(
            g, q, k, v, out, lse, 0.0, causal, scale=scale)
    p = torch.exp(_scores(q, k, causal, scale, mask) - _finite(lse)[..., None])
    rowsum = (g * out).sum(-1, keepdim=True)   # rowsum(dO * O): the softmax backward's correction
    ds = p * (g @ v.transpose(-1, -2) - rowsum) * scale
    return ds @ k, ds.transpose(-1, -2) @ q, p.transpose(-1, -2) @ g


def _scores(q, k, causal: bool, scale: float, mask) -> torch.Tensor:
    """Scaled scores q k^T of one block, -inf where the diagonal's causality or ``mask`` hides a key."""
    s = (q @ k.transpose(-1, -2)) * scale
    if causal:
        keep = torch.ones(s.shape[-2:], dtype=torch.bool, device=s.device).tril()
        s = s.masked_fill(~keep, float("-inf"))
    if mask is not None:
        s = s.masked_fill(~mask, float("-inf")) if mask.dtype == torch.bool else s + mask
    return s


def _merge(acc, lse, out, block_lse):
    """The online softmax: running (output, log-sum-exp) of some keys and a block's of others -> theirs together."""
    if acc is None:
        return out.to(block_lse.dtype), block_lse
    both = torch.logaddexp(lse, block_lse)
    shift = _finite(both)
    return (acc * torch.exp(lse - shift)[..., None] + out * torch.exp(block_lse - shift)[..., None]), both


class _Ring:
    """What a ring-attention step needs: the chunk layout and the pairs of chunks that interact.

    The rank's queries are its chunks (rank, 2·size-1-rank) of the sequence; at step t it holds the
    key/value block of cp rank src = rank - t (mod size), that rank's chunks in the same order.
    A query chunk of global index a against a key chunk b is: full (b < a), causal on its diagonal
    (b == a), or skipped (b > a); with a mask instead of is_causal every pair is computed under the
    mask (its rows are the rank's queries, its columns the whole sequence in order)."""

    def __init__(self, q, k, v, masked: bool, scale, group, size, rank):
        self.heads = q.shape[-3]
        self.masked, self.group, self.size, self.rank = masked, group, size, rank
        self.c = q.shape[-2] // 2   # tokens per chunk
        self.scale = q.shape[-1] ** -0.5 if scale is None else scale
        self.k_shape, self.v_shape = k.shape, v.shape

    def chunks(self, owner: int) -> tuple[int, int]:
        return owner, 2 * self.size - 1 - owner

    def pairs(self, t: int):
        """(query chunk, key chunk, global key chunk, causal diagonal) computed at step ``t``."""
        src = (self.rank - t) % self.size
        for i, a in enumerate(self.chunks(self.rank)):
            for j, b in enumerate(self.chunks(src)):
                if self.masked:
                    yield i, j, b, False
                elif b <= a:
                    yield i, j, b, b == a

    def pack(self, k, v) -> torch.Tensor:
        return torch.cat([k.reshape(-1), v.reshape(-1)])

    def unpack(self, block: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """A packed block's keys and values, each head repeated for its query heads (``_expand_heads``)."""
        nk = self.k_shape.numel()
        k = block[:nk].view(self.k_shape)
        v = block[nk:].view(self.v_shape)
        return _expand_heads(k, self.heads), _expand_heads(v, self.heads)

    def part(self, x: torch.Tensor, i: int) -> torch.Tensor:
        return x.narrow(-2, i * self.c, self.c)

    def rows(self, x: torch.Tensor, i: int) -> torch.Tensor:
        """Query chunk ``i``'s rows of a log-sum-exp (..., heads, queries)."""
        return x.narrow(-1, i * self.c, self.c)

    def mask(self, mask, i: int, b: int):
        """Query chunk ``i``'s rows of ``mask`` (None too) at global key chunk ``b``'s columns."""
        return None if mask is None else _cut(_cut(mask, -2, i * self.c, self.c), -1, b * self.c, self.c)


def _strides_like(x: torch.Tensor, shape: torch.Size) -> tuple[int, ...]:
    """Dense strides for ``shape`` whose dims lie in memory in the order of ``x``'s (as sdpa lays out
    its output after its query's: a model's ``out.transpose(1, 2).view(...)`` relies on it)."""
    order = sorted(range(x.dim()), key=lambda i: -x.stride(i))   # outermost first
    strides, step = [0] * x.dim(), 1
    for i in reversed(order):
        strides[i] = step
        step *= shape[i]
    return tuple(strides)


class _RingAttention(torch.autograd.Function):
    """Causal attention of the rank's queries over every rank's keys and values, passed around the cp ring.

    Forward: cp steps; at each the block for the next step is launched before this block's pairs of
    chunks are computed, so the transfer overlaps them; each pair's output merges with the running
    one by their log-sum-exp (the online softmax), in fp32 (fp64 for fp64). Backward: the blocks go
    around again, and the gradient of each block's keys and values (fp32) travels with it, one step
    behind, each rank adding its queries' share, until a last step hands it back to the block's
    owner. Each pair runs as fused attention where ``fused_blocks`` allows (flash attention on the
    GPU, whose backward takes the merged output and log-sum-exp), else in fp32 math. Only the rank's
    q, k, v, the output and the log-sum-exp are kept (flash attention's saved set)."""

    @staticmethod
    def forward(ctx, q, k, v, mask, scale, group, size, rank):
        ring = _Ring(q, k, v, mask is not None, scale, group, size, rank)
        fused = fused_blocks(q, mask is not None)
        work = torch.promote_types(q.dtype, torch.float32)
        qw = q if fused else q.to(work)
        block = ring.pack(k, v)
        acc, lse, state = [None, None], [None, None], ()
        for t in range(size):
            pending = _ring_launch(block, group, size, rank) if t < size - 1 else None
            kb, vb = ring.unpack(block)
            kb, vb = (kb, vb) if fused else (kb.to(work), vb.to(work))
            for i, j, b, diagonal in ring.pairs(t):
                out, block_lse, state = _block_forward(ring.part(qw, i), ring.part(kb, j), ring.part(vb, j), diagonal,
                                                       ring.scale, ring.mask(mask, i, b), fused)
                acc[i], lse[i] = _merge(acc[i], lse[i], out, block_lse.to(work))
            if pending is not None:
                block = _ops.wait_tensor(pending)
        # in the queries' layout and dtype, as sdpa's; a tensor of its own, not a view (see _own)
        merged = torch.cat(acc, -2)
        out = torch.empty_strided(merged.shape, _strides_like(q, merged.shape), dtype=q.dtype, device=q.device)
        out.copy_(merged)
        ctx.ring, ctx.fused = ring, fused
        ctx.save_for_backward(q, k, v, out, torch.cat(lse, -1), mask, *state)
        return out

    @staticmethod
    def backward(ctx, g):
        q, k, v, out, lse, mask, *state = ctx.saved_tensors
        ring, fused = ctx.ring, ctx.fused
        group, size, rank = ring.group, ring.size, ring.rank
        work = lse.dtype
        qw, go, ow = (q, g, out) if fused else (q.to(work), g.to(work), out.to(work))
        dq = torch.zeros(q.shape, dtype=work, device=q.device)
        block = ring.pack(k, v)
        passed = None   # the previous step's key/value gradients, on their way to the next rank
        for t in range(size):
            pending = _ring_launch(block, group, size, rank) if t < size - 1 else None
            kb, vb = ring.unpack(block)
            kb, vb = (kb, vb) if fused else (kb.to(work), vb.to(work))
            dk, dv = torch.zeros(kb.shape, dtype=work, device=q.device), torch.zeros(vb.shape, dtype=work, device=q.device)
            for i, j, b, diagonal in ring.pairs(t):
                gq, gk, gv = _block_backward(
                    ring.part(go, i).contiguous(), ring.part(qw, i), ring.part(kb, j), ring.part(vb, j),
                    ring.part(ow, i).contiguous(), ring.rows(lse, i).contiguous(), diagonal, ring.scale,
                    ring.mask(mask, i, b), fused, state)
                ring.part(dq, i).add_(gq)
                ring.part(dk, j).add_(gk)
                ring.part(dv, j).add_(gv)
            grads = ring.pack(_sum_heads(dk, k.shape[-3]), _sum_heads(dv, v.shape[-3]))
            if passed is not None:
                grads = grads + _ops.wait_tensor(passed)
            passed = _ring_launch(grads, group, size, rank)
            if pending is not None:
                block = _ops.wait_tensor(pending)
        nk = k.numel()   # every rank's share of this rank's own block
        whole = _ops.wait_tensor(passed)
        dk, dv = whole[:nk].view(k.shape), whole[nk:].view(v.shape)
        return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype), None, None, None, None, None


def ring_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None,
                   dropout_p: float, scale: float | None, enable_gqa: bool, group: str, size: int,
                   rank: int) -> torch.Tensor:
    """``context_attention``'s result by ring attention: this cp rank's queries (its two chunks, dim -2)
    against every rank's key/value block, passed around the cp ring (``_RingAttention``), the next
    block's transfer overlapping this block's compute; no rank holds the whole sequence's keys.
    ``mask`` None: causal, the pairs of chunks above the diagonal skipped; else the rank's query rows
    of a boolean or additive mask over every key in order. GQA: fewer key/value heads than query
    heads (``enable_gqa``), each serving a group of consecutive query heads, as sdpa's."""
    if q.dim() < 3:
        raise ValueError(f"ring attention needs (..., heads, sequence, head dim) queries, got {list(q.shape)}")
    if dropout_p:
        raise ValueError(f"ring attention has no dropout (dropout_p={dropout_p}); use the all-gather variant "
                         "(cp_attention='allgather') or attention dropout 0")
    if k.shape[-3] != q.shape[-3] and (not enable_gqa or q.shape[-3] % k.shape[-3]):
        raise ValueError(f"ring attention: {q.shape[-3]} query heads and {k.shape[-3]} key/value heads; they must "
                         "be equal, or a multiple with enable_gqa=True")
    return _RingAttention.apply(q, k, v, mask, scale, group, size, rank)


# the ways a context-parallel attention can run, by the name a Plan gives them (``Plan.cp_attention``)
CP_ATTENTIONS = {"allgather": context_attention, "ring": ring_attention}
