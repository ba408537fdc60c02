"""Linear + cross-entropy fused so that the (N, V) logits never exist at once.

With x = h W^T (N x V) and lse_i = log sum_j exp x_ij, the loss of row i is lse_i - x_i,y_i.
Both passes walk the vocabulary in chunks of ``chunk`` columns, one (N, chunk) logits buffer
in the input dtype filled by cuBLAS (``torch.mm``):

    forward    per chunk, each row's log-sum-exp (fp32) is merged into a running one and the
               target logit picked where it falls; lse (N fp32 numbers) is kept for backward
    backward   per chunk, the logits are recomputed and overwritten with
                   dL/dx_ij = a_i exp(x_ij - lse_i) + c_i [j == y_i]
               then grad_weight[chunk] = dx^T h (one GEMM over all N rows: no accumulation
               across chunks, the same rounding as the unfused product) and
               grad_hidden += dx W[chunk] (accumulated in fp32)

Extra memory is O(N * chunk) instead of the unfused O(N * V) logits (and their fp32 copies);
the price is one more matmul, the recomputed logits.

Vocabulary-parallel form: ``weight`` is this rank's rows ``start ..`` of a vocabulary of
``vocab`` entries, zero-padded to the shard size (rows at or past ``vocab`` are padding, as in
``autopar.ops.vocab_parallel_cross_entropy``). ``autopar::linear_ce_stats`` returns each row's
local log-sum-exp and target logit (0 where the target lives on another rank); the ranks
combine them with functional collectives (lse all-gathered, target logit all-reduced), so
torch.compile keeps the communication in its graph and AOTAutograd derives its backward. The
stats op's own gradient needs no communication: d lse_local_i / d x_ij = exp(x_ij - lse_local_i),
so a_i = dL/d lse_local_i and c_i = dL/d picked_i.

Ops (``torch.ops.autopar``), each with a fake implementation for tracing:
    linear_cross_entropy(hidden, weight, labels, ignore_index, reduction, chunk, impl) -> (loss, lse)
    linear_ce_stats(hidden, weight, labels, start, vocab, chunk, impl) -> (lse, picked)
    linear_ce_backward(hidden, weight, labels, lse, row_scale, target_scale, start, vocab,
                       chunk, impl) -> (grad_hidden, grad_weight)
``impl``: "torch" (the reference, any device), "triton" (the CUDA row kernels of
``linear_ce_triton``), "auto" (triton on CUDA when installed, else torch). ``chunk``: vocabulary
columns per chunk, 0 for ``default_chunk``.
"""
from __future__ import annotations

import importlib.util

import torch
from torch import Tensor

from autopar.collectives import all_gather, all_reduce

_IMPLS = ("auto", "torch", "triton")
_REDUCTIONS = {"mean": 1, "sum": 2}
_CHUNK_ELEMENTS = 2 ** 26          # default logits chunk: 128 MiB in bf16


def _check(hidden: Tensor, weight: Tensor, labels: Tensor, impl: str) -> None:
    if hidden.dim() != 2 or weight.dim() != 2 or hidden.shape[1] != weight.shape[1]:
        raise ValueError(f"linear_cross_entropy: hidden must be (N, H) and weight (V, H) with the same H; "
                         f"got hidden {tuple(hidden.shape)} and weight {tuple(weight.shape)}")
    if labels.shape != hidden.shape[:1]:
        raise ValueError(f"linear_cross_entropy: labels must be ({hidden.shape[0]},), one per row of hidden; "
                         f"got {tuple(labels.shape)}")
    if hidden.dtype != weight.dtype or not hidden.dtype.is_floating_point:
        raise ValueError(f"linear_cross_entropy: hidden and weight must share one floating dtype; got "
                         f"{hidden.dtype} and {weight.dtype} (cast one of them)")
    if labels.dtype not in (torch.int64, torch.int32):
        raise ValueError(f"linear_cross_entropy: labels must be integer class indices, got {labels.dtype}")
    if impl not in _IMPLS:
        raise ValueError(f"linear_cross_entropy: impl={impl!r}; expected one of {', '.join(_IMPLS)}")


def _check_reduction(reduction: int) -> None:
    if reduction not in (1, 2):
        raise ValueError(f"linear_cross_entropy: reduction={reduction}; expected 1 (mean) or 2 (sum); "
                         "for per-token losses use vocab_parallel_linear_cross_entropy(..., reduction=0)")


def triton_available() -> bool:
    """Whether the Triton row kernels can be used (the triton package is installed)."""
    return importlib.util.find_spec("triton") is not None


def use_triton(op: str, impl: str, device: torch.device) -> bool:
    """Whether kernel ``op`` runs its Triton path for ``impl`` ("torch", "triton" or "auto") on
    ``device``: "triton" insists (CUDA tensors and the triton package, else ValueError), "auto"
    takes it on CUDA when triton is installed. Every autopar kernel chooses this way."""
    if impl == "triton":
        if device.type != "cuda" or not triton_available():
            raise ValueError(f"{op}: impl='triton' needs CUDA tensors and the triton package; "
                             "use impl='torch' (or 'auto') on this device")
        return True
    return impl == "auto" and device.type == "cuda" and triton_available()


def default_chunk(n_rows: int, n_cols: int) -> int:
    """Vocabulary columns per chunk when none is given: about 2**26 logits, at least 256 columns."""
    cols = -(-_CHUNK_ELEMENTS // max(n_rows, 1) // 256) * 256
    return max(1, min(n_cols, max(256, cols)))


def _real_mask(n_cols: int, start: int, vocab: int, device) -> Tensor:
    return torch.arange(start, start + n_cols, device=device) < vocab


def _target_mask(labels: Tensor, n_cols: int, start: int, vocab: int) -> tuple[Tensor, Tensor]:
    """(column of each row's label in this block, clamped into range; whether it is a real column here)."""
    local = labels - start
    mine = (local >= 0) & (local < n_cols) & (labels < vocab)
    return local.clamp(0, n_cols - 1).unsqueeze(1), mine


def _stats_torch_(logits: Tensor, labels: Tensor, start: int, vocab: int, lse: Tensor, picked: Tensor) -> None:
    n_cols = logits.shape[1]
    x = logits.float().masked_fill(~_real_mask(n_cols, start, vocab, logits.device), float("-inf"))
    torch.logaddexp(lse, torch.logsumexp(x, dim=1), out=lse)
    col, mine = _target_mask(labels, n_cols, start, vocab)
    picked += torch.where(mine, x.gather(1, col).squeeze(1), 0.0)


def _grad_torch_(logits: Tensor, labels: Tensor, lse: Tensor, row_scale: Tensor, target_scale: Tensor,
                 start: int, vocab: int) -> None:
    n_cols = logits.shape[1]
    real = _real_mask(n_cols, start, vocab, logits.device)
    g = torch.exp(logits.float() - lse.unsqueeze(1)) * row_scale.unsqueeze(1)
    col, mine = _target_mask(labels, n_cols, start, vocab)
    g.scatter_add_(1, col, torch.where(mine, target_scale, 0.0).unsqueeze(1))
    logits.copy_(g.masked_fill(~real, 0.0))


def _row_ops(impl: str, device: torch.device):
    if use_triton("linear_cross_entropy", impl, device):
        from autopar.kernels import linear_ce_triton
        return linear_ce_triton.row_stats_, linear_ce_triton.row_grad_
    return _stats_torch_, _grad_torch_


def _chunks(hidden: Tensor, weight: Tensor, chunk: int):
    """(first column, last column + 1, contiguous logits of those columns), reusing one buffer."""
    n, vocab = hidden.shape[0], weight.shape[0]
    step = chunk if chunk > 0 else default_chunk(n, vocab)
    buf = hidden.new_empty(n * min(step, vocab))
    for v0 in range(0, vocab, step):
        v1 = min(v0 + step, vocab)
        yield v0, v1, torch.mm(hidden, weight[v0:v1].t(), out=buf[: n * (v1 - v0)].view(n, v1 - v0))


def _stats(hidden, weight, labels, start, vocab, chunk, impl):
    stats_, _ = _row_ops(impl, hidden.device)
    n = hidden.shape[0]
    lse = torch.full((n,), float("-inf"), dtype=torch.float32, device=hidden.device)
    picked = torch.zeros(n, dtype=torch.float32, device=hidden.device)
    labels = labels.long().contiguous()
    for v0, _, logits in _chunks(hidden, weight, chunk):
        stats_(logits, labels, start + v0, vocab, lse, picked)
    return lse, picked


def _backward(hidden, weight, labels, lse, row_scale, target_scale, start, vocab, chunk, impl):
    _, grad_ = _row_ops(impl, hidden.device)
    labels = labels.long().contiguous()
    lse, row_scale, target_scale = (t.float().contiguous() for t in (lse, row_scale, target_scale))
    grad_hidden = torch.zeros(hidden.shape, dtype=torch.float32, device=hidden.device)
    grad_weight = torch.empty(weight.shape, dtype=weight.dtype, device=weight.device)
    for v0, v1, logits in _chunks(hidden, weight, chunk):
        grad_(logits, labels, lse, row_scale, target_scale, start + v0, vocab)
        torch.mm(logits.t(), hidden, out=grad_weight[v0:v1])
        if logits.dtype == torch.float32:
            grad_hidden.addmm_(logits, weight[v0:v1])
        else:
            grad_hidden += logits @ weight[v0:v1]
    return grad_hidden.to(hidden.dtype), grad_weight


# ---- autopar::linear_ce_backward ------------------------------------------------------------

@torch.library.custom_op("autopar::linear_ce_backward", mutates_args=())
def _backward_op(hidden: Tensor, weight: Tensor, labels: Tensor, lse: Tensor, row_scale: Tensor,
                 target_scale: Tensor, start: int, vocab: int, chunk: int = 0,
                 impl: str = "auto") -> tuple[Tensor, Tensor]:
    _check(hidden, weight, labels, impl)
    return _backward(hidden, weight, labels, lse, row_scale, target_scale, start, vocab, chunk, impl)


@_backward_op.register_fake
def _(hidden, weight, labels, lse, row_scale, target_scale, start, vocab, chunk=0, impl="auto"):
    _check(hidden, weight, labels, impl)
    return hidden.new_empty(hidden.shape), weight.new_empty(weight.shape)


# ---- autopar::linear_ce_stats ---------------------------------------------------------------

@torch.library.custom_op("autopar::linear_ce_stats", mutates_args=())
def _stats_op(hidden: Tensor, weight: Tensor, labels: Tensor, start: int, vocab: int, chunk: int = 0,
              impl: str = "auto") -> tuple[Tensor, Tensor]:
    _check(hidden, weight, labels, impl)
    return _stats(hidden, weight, labels, start, vocab, chunk, impl)


@_stats_op.register_fake
def _(hidden, weight, labels, start, vocab, chunk=0, impl="auto"):
    _check(hidden, weight, labels, impl)
    n = hidden.shape[0]
    return hidden.new_empty(n, dtype=torch.float32), hidden.new_empty(n, dtype=torch.float32)


def _stats_setup(ctx, inputs, output):
    hidden, weight, labels, start, vocab, chunk, impl = inputs
    ctx.save_for_backward(hidden, weight, labels, output[0])
    ctx.args = (start, vocab, chunk, impl)


def _stats_grad(ctx, grad_lse, grad_picked):
    hidden, weight, labels, lse = ctx.saved_tensors
    start, vocab, chunk, impl = ctx.args
    grad_lse = torch.zeros_like(lse) if grad_lse is None else grad_lse
    grad_picked = torch.zeros_like(lse) if grad_picked is None else grad_picked
    gh, gw = _backward_op(hidden, weight, labels, lse, grad_lse, grad_picked, start, vocab, chunk, impl)
    return gh, gw, None, None, None, None, None


_stats_op.register_autograd(_stats_grad, setup_context=_stats_setup)


# ---- autopar::linear_cross_entropy ----------------------------------------------------------

@torch.library.custom_op("autopar::linear_cross_entropy", mutates_args=())
def _linear_ce_op(hidden: Tensor, weight: Tensor, labels: Tensor, ignore_index: int = -100, reduction: int = 1,
                  chunk: int = 0, impl: str = "auto") -> tuple[Tensor, Tensor]:
    _check(hidden, weight, labels, impl)
    _check_reduction(reduction)
    lse, picked = _stats(hidden, weight, labels, 0, weight.shape[0], chunk, impl)
    return _loss(lse, picked, labels, ignore_index, reduction).to(hidden.dtype), lse


@_linear_ce_op.register_fake
def _(hidden, weight, labels, ignore_index=-100, reduction=1, chunk=0, impl="auto"):
    _check(hidden, weight, labels, impl)
    _check_reduction(reduction)
    return hidden.new_empty(()), hidden.new_empty(hidden.shape[0], dtype=torch.float32)


def _linear_ce_setup(ctx, inputs, output):
    hidden, weight, labels, ignore_index, reduction, chunk, impl = inputs
    ctx.save_for_backward(hidden, weight, labels, output[1])
    ctx.args = (ignore_index, reduction, chunk, impl)


def _linear_ce_grad(ctx, grad_loss, grad_lse):
    hidden, weight, labels, lse = ctx.saved_tensors
    ignore_index, reduction, chunk, impl = ctx.args
    valid = labels != ignore_index
    scale = grad_loss.float() / valid.sum() if reduction == 1 else grad_loss.float()
    target_scale = -(valid.float() * scale)
    row_scale = -target_scale if grad_lse is None else grad_lse - target_scale
    gh, gw = _backward_op(hidden, weight, labels, lse, row_scale, target_scale, 0, weight.shape[0], chunk, impl)
    return gh, gw, None, None, None, None, None


_linear_ce_op.register_autograd(_linear_ce_grad, setup_context=_linear_ce_setup)


# ---- public functions -----------------------------------------------------------------------

def linear_cross_entropy(hidden: Tensor, weight: Tensor, labels: Tensor, ignore_index: int = -100,
                         reduction: str = "mean", chunk: int = 0, impl: str = "auto") -> Tensor:
    """``F.cross_entropy(F.linear(hidden, weight), labels)`` without materialising the logits.

    ``hidden`` is (..., H) and ``labels`` the matching (...) class indices; ``weight`` is
    (V, H). ``reduction``: "mean" over labels other than ``ignore_index``, or "sum". The loss
    has hidden's dtype; the log-sum-exp is accumulated in fp32. Labels must be class indices
    or ``ignore_index`` (out-of-range labels are not checked on the device)."""
    if reduction not in _REDUCTIONS:
        raise ValueError(f"linear_cross_entropy: reduction={reduction!r}; expected 'mean' or 'sum'")
    loss, _ = _linear_ce_op(hidden.reshape(-1, hidden.shape[-1]), weight, labels.reshape(-1), ignore_index,
                            _REDUCTIONS[reduction], chunk, impl)
    return loss


def vocab_parallel_linear_cross_entropy(hidden: Tensor, weight: Tensor, labels: Tensor, group: str, size: int,
                                        rank: int, start: int, vocab: int, reduction: int = 1,
                                        ignore_index: int = -100, chunk: int = 0, impl: str = "auto") -> Tensor:
    """Cross-entropy of ``hidden @ weight.T`` where ``weight`` holds vocabulary rows ``start ..``.

    The arguments follow ``autopar.ops.vocab_parallel_cross_entropy``, with the (N, H) hidden
    states (replicated over the group) and this rank's (ceil(vocab/size), H) weight shard in
    place of the logits: ``group`` is the tp process group's name, rows at or past ``vocab``
    are padding, ``reduction`` is aten's encoding (0 none, 1 mean over non-ignored, 2 sum).
    The loss has hidden's dtype. The gradient reaching ``hidden`` is this rank's partial sum,
    as for any vocab-parallel head (the copy_to in front of the head all-reduces it)."""
    lse_local, picked = _stats_op(hidden, weight, labels, start, vocab, chunk, impl)
    lse = torch.logsumexp(all_gather(lse_local.unsqueeze(0), 0, group, size, rank, size, False), dim=0)
    picked = all_reduce(picked, group)
    return _loss(lse, picked, labels, ignore_index, reduction).to(hidden.dtype)


def _loss(lse: Tensor, picked: Tensor, labels: Tensor, ignore_index: int, reduction: int) -> Tensor:
    """Cross-entropy from each row's log-sum-exp and target logit; ``reduction`` as aten encodes it
    (0 none, 1 mean over the rows not ignored, 2 sum)."""
    valid = labels != ignore_index
    loss = torch.where(valid, lse - picked, 0.0)
    if reduction == 1:
        return loss.sum() / valid.sum()
    return loss.sum() if reduction == 2 else loss
