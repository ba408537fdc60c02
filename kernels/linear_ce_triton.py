"""Triton row kernels for the chunked linear + cross-entropy (CUDA only).

The matmuls stay with cuBLAS (``torch.mm``); these kernels replace what would otherwise be
several passes of fp32 temporaries over a (N, chunk) block of logits held in bf16/fp16:

    row_stats_  one read of each row: its log-sum-exp in fp32 (online max / sum), merged into
                a running per-row log-sum-exp, and the target logit added to a running pick
    row_grad_   dL/dx_ij = a_i exp(x_ij - lse_i) + c_i [j == y_i], written over the logits in
                place (one read, one write)

One program per row walks the row in ``BLOCK``-wide tiles. Column j of the block is
vocabulary entry ``start + j``; entries at or past ``vocab`` are padding (the tail of a padded
vocab-parallel shard): -inf in the log-sum-exp, zero gradient. This module imports triton, so
it is imported only when triton is present (``autopar.kernels.fused_linear_ce`` does so lazily).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _row_lse(row, n_real, BLOCK: tl.constexpr):
    m = float("-inf")
    d = 0.0
    for off in range(0, n_real, BLOCK):
        cols = off + tl.arange(0, BLOCK)
        x = tl.load(row + cols, mask=cols < n_real, other=float("-inf")).to(tl.float32)
        m_new = tl.maximum(m, tl.max(x, axis=0))
        # while only -inf has been seen, shift by 0 rather than compute exp(-inf - -inf)
        shift = tl.where(m_new == float("-inf"), 0.0, m_new)
        d = d * tl.exp(m - shift) + tl.sum(tl.exp(x - shift), axis=0)
        m = m_new
    return m + tl.log(d)


@triton.jit
def _stats_kernel(logits, stride, labels, lse_io, picked_io, n_real, start, BLOCK: tl.constexpr):
    r = tl.program_id(0).to(tl.int64)
    row = logits + r * stride
    lse = _row_lse(row, n_real, BLOCK)
    old = tl.load(lse_io + r)
    m = tl.maximum(old, lse)
    shift = tl.where(m == float("-inf"), 0.0, m)
    tl.store(lse_io + r, shift + tl.log(tl.exp(old - shift) + tl.exp(lse - shift)))
    local = tl.load(labels + r) - start
    mine = (local >= 0) & (local < n_real)
    picked = tl.load(row + tl.where(mine, local, 0)).to(tl.float32)
    tl.store(picked_io + r, tl.load(picked_io + r) + tl.where(mine, picked, 0.0))


@triton.jit
def _grad_kernel(logits, stride, labels, lse_in, a_in, c_in, n_cols, n_real, start, BLOCK: tl.constexpr):
    r = tl.program_id(0).to(tl.int64)
    row = logits + r * stride
    lse = tl.load(lse_in + r)
    a = tl.load(a_in + r)
    c = tl.load(c_in + r)
    local = tl.load(labels + r) - start
    for off in range(0, n_cols, BLOCK):
        cols = off + tl.arange(0, BLOCK)
        real = cols < n_real
        x = tl.load(row + cols, mask=real, other=0.0).to(tl.float32)
        g = a * tl.exp(x - lse) + tl.where(cols == local, c, 0.0)
        g = tl.where(real, g, 0.0)
        tl.store(row + cols, g.to(row.dtype.element_ty), mask=cols < n_cols)


def _launch_shape(n_cols: int) -> tuple[int, int]:
    block = min(4096, triton.next_power_of_2(max(n_cols, 16)))
    return block, 8 if block >= 2048 else 4


def _real_columns(n_cols: int, start: int, vocab: int) -> int:
    return max(0, min(n_cols, vocab - start))


def row_stats_(logits: torch.Tensor, labels: torch.Tensor, start: int, vocab: int,
               lse: torch.Tensor, picked: torch.Tensor) -> None:
    """Merge this block's per-row log-sum-exp into ``lse`` and add its target logits to ``picked``.

    ``logits`` is (N, n_cols) with unit column stride; ``lse`` and ``picked`` are fp32 (N,)
    running values (start them at -inf and 0). A label outside this block's real columns adds 0."""
    n_rows, n_cols = logits.shape
    if n_rows == 0:
        return
    block, warps = _launch_shape(n_cols)
    _stats_kernel[(n_rows,)](logits, logits.stride(0), labels, lse, picked, _real_columns(n_cols, start, vocab),
                             start, BLOCK=block, num_warps=warps)


def row_grad_(logits: torch.Tensor, labels: torch.Tensor, lse: torch.Tensor, row_scale: torch.Tensor,
              target_scale: torch.Tensor, start: int, vocab: int) -> None:
    """Overwrite ``logits`` with a_i exp(x_ij - lse_i) + c_i [start + j == label_i], zero on padding.

    a = ``row_scale``, c = ``target_scale`` and ``lse`` are fp32 (N,) tensors."""
    n_rows, n_cols = logits.shape
    if n_rows == 0:
        return
    block, warps = _launch_shape(n_cols)
    _grad_kernel[(n_rows,)](logits, logits.stride(0), labels, lse, row_scale, target_scale, n_cols,
                            _real_columns(n_cols, start, vocab), start, BLOCK=block, num_warps=warps)
