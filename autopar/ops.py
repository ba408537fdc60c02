"""Local implementations of ops whose sharded form is not the op itself.

The rewrite pass calls these in place of aten.embedding and aten.cross_entropy_loss
when the vocabulary is sharded (Megatron's VocabParallelEmbedding and vocab-parallel
cross-entropy): no rank ever holds the full embedding table or the full logits.
"""
from __future__ import annotations

import torch

from autopar.collectives import all_gather, all_reduce


def vocab_parallel_embedding(weight: torch.Tensor, idx: torch.Tensor, start: int,
                             padding_idx: int = -1) -> torch.Tensor:
    """Rows ``start .. start + len(weight)`` of the table; other ids give zeros (a partial sum).
    ``padding_idx`` (a global id, -1 for none): that row gets no gradient, as in nn.Embedding."""
    outside = (idx < start) | (idx >= start + weight.shape[0])
    local_pad = padding_idx - start if start <= padding_idx < start + weight.shape[0] else -1
    out = torch.ops.aten.embedding(weight, (idx - start).masked_fill(outside, 0), local_pad)
    return out.masked_fill(outside.unsqueeze(-1), 0.0)


def vocab_parallel_cross_entropy(logits: torch.Tensor, target: torch.Tensor, group: str, size: int,
                                 rank: int, start: int, vocab: int, reduction: int = 1,
                                 ignore_index: int = -100) -> torch.Tensor:
    """Cross-entropy of (N, V) logits whose columns ``start ..`` live on this rank.

    Each rank's log-sum-exp over its columns is all-gathered (size x N numbers) and
    combined, and the target logit is all-reduced (N numbers): no rank gathers the
    N x V logits. Columns at or past ``vocab`` are padding and masked out.
    ``reduction``: 0 none, 1 mean over non-ignored targets, 2 sum (aten's encoding)."""
    n_local = logits.shape[1]
    cols = torch.arange(start, start + n_local, device=logits.device)
    logits = logits.masked_fill(cols >= vocab, float("-inf"))
    lse_local = torch.logsumexp(logits, dim=1).unsqueeze(0)                        # (1, N)
    lse = torch.logsumexp(all_gather(lse_local, 0, group, size, rank, size, False), dim=0)
    local = target - start
    mine = (local >= 0) & (local < n_local)
    picked = logits.gather(1, local.clamp(0, n_local - 1).unsqueeze(1)).squeeze(1)
    picked = all_reduce(torch.where(mine, picked, torch.zeros_like(picked)), group)
    valid = target != ignore_index
    loss = torch.where(valid, lse - picked, torch.zeros_like(picked))
    if reduction == 0:
        return loss
    if reduction == 2:
        return loss.sum()
    return loss.sum() / valid.sum()
