"""The pieces of a step around the lowered graph: a batch cut to this rank's rows and microbatches,
the token-mean scales written before the forward, the loss and gradients averaged over the data ranks.

A step's loss is the unsharded model's: each token loss the graph computes is a sum times a scale
(``passes.token_mean``) that ``write_token_scales`` sets from the step's token count over every
microbatch and dp rank, so the mean the data ranks' losses average to is over the whole batch.
"""
from __future__ import annotations

import functools

import torch

from autopar import collectives as C
from autopar.passes.token_mean import scale_name
from autopar.runtime.program import shape_key


def batch_rows(inputs) -> int:
    """The rows of a batch: dim 0 of its tensor inputs, which must agree."""
    rows = {tuple(x.shape)[0] for x in inputs if isinstance(x, torch.Tensor) and x.dim()}
    if len(rows) != 1:
        shapes = ", ".join(str(list(x.shape)) for x in inputs if isinstance(x, torch.Tensor))
        raise ValueError(f"the inputs' shapes {shapes or '(none)'}: every tensor input must have the batch in dim 0, "
                         "with the same number of rows")
    return rows.pop()


def microbatches(inputs, m: int):
    """The ``m`` microbatches of ``inputs`` (dim 0 of every tensor)."""
    return zip(*[x.chunk(m) if isinstance(x, torch.Tensor) and x.dim() else [x] * m for x in inputs])


def local_rows(program, inputs: list) -> list:
    """This dp rank's rows of ``inputs``, contiguous: a batch of the plan's per-rank size is this
    rank's own rows; any other is a global batch, split over dp."""
    rows = batch_rows(inputs)
    plan, dp = program.plan, program.mesh.dp
    local = plan.input_shapes[0][0] * plan.microbatches if plan.input_shapes else rows
    if dp > 1 and rows != local:
        if rows % dp:
            raise ValueError(f"a batch of {rows} rows does not split over dp={dp}: pass a multiple of {dp} rows "
                             f"(the global batch), or this rank's own {local} rows")
        inputs = [x.narrow(0, program.coords["dp"] * (rows // dp), rows // dp)
                  if isinstance(x, torch.Tensor) and x.dim() else x for x in inputs]
    # token ids are cheap to copy, and a slice of a batch along the sequence is not contiguous
    return [x.contiguous() if isinstance(x, torch.Tensor) else x for x in inputs]


def microbatch_shapes(inputs, m: int) -> tuple[tuple[int, ...], ...]:
    """The shapes of one of the ``m`` microbatches of this rank's ``inputs`` (its tensor inputs')."""
    rows = batch_rows(inputs)
    if rows % m:
        raise ValueError(f"this rank's {rows} rows of the batch do not split into the plan's {m} microbatches: "
                         f"give each dp rank a multiple of {m} rows")
    return shape_key(tuple((rows // m, *x.shape[1:]) if x.dim() else () for x in inputs
                           if isinstance(x, torch.Tensor)))


def write_token_scales(program, lowered, buffers: dict[str, torch.Tensor], inputs) -> None:
    """Write each token loss's scale (``passes.token_mean``) of ``lowered`` into ``buffers``: ``ranks /
    tokens`` for a mean, ``tokens`` counted on every microbatch of this rank's ``inputs`` and summed
    over dp, ``ranks`` for a sum; ``ranks`` the losses averaged (dp x cp x microbatches)."""
    if not lowered.counted:
        return
    m = program.plan.microbatches
    ranks = program.mesh.data * m
    if lowered.counts is not None:
        slots = [n.meta for n in lowered.counts.graph.nodes if n.op == "placeholder"]
        total = 0
        for chunk in microbatches(inputs, m):
            named = dict(zip(lowered.input_names, (x for x in chunk if isinstance(x, torch.Tensor))))
            total = total + lowered.counts(*[buffers[s["fqn"]] if s.get("kind") == "buffer"
                                             else named[s["name"]] for s in slots])
        if program.mesh.dp > 1:   # the cp ranks of a dp rank count the same whole sequences
            total = C.all_reduce(total, program.groups.dp)
        means = iter((ranks / total).float())
    for k, counted in enumerate(lowered.counted):
        scale = buffers[scale_name(k)]
        scale.copy_(next(means)) if counted else scale.fill_(ranks)


def data_mean(loss: torch.Tensor, program) -> torch.Tensor:
    """The mean of this rank's ``loss`` over the data ranks (dp x cp): the batch's (``passes.token_mean``)."""
    if program.mesh.data == 1:
        return loss
    return C.all_reduce(loss, program.groups.data) / program.mesh.data


def sync_gradients(program, params: dict[str, torch.nn.Parameter], zero) -> None:
    """After the step's backward: every gradient the mean over the data ranks. A flat slice's
    ``zero`` (ZeRO-1, the 16-bit distributed optimizer: ``runtime.zero``) reduces its own into its
    slice (at dp=1 too: the optimizer steps the slice, which only this fills); ZeRO-2/3's gathers'
    backward already left every shard its mean."""
    data = program.mesh.data
    if zero is not None:
        zero.reduce_scatter_grads()
    elif data > 1 and not program.fsdp:
        grads = [p.grad for p in params.values() if p.grad is not None]
        for g, mean in zip(grads, all_reduce_mean(grads, program.groups.data, data, program.device)):
            g.copy_(mean)


def all_reduce_mean(tensors, group: str, size: int, device) -> list[torch.Tensor]:
    """The mean of ``tensors`` over a group, as views of one flat buffer on ``device``: one
    all-reduce, not one per tensor, and 16-bit tensors are summed in fp32 (at least)."""
    if not tensors:
        return []
    dtype = functools.reduce(torch.promote_types, (t.dtype for t in tensors), torch.float32)
    flat = torch.empty(sum(t.numel() for t in tensors), dtype=dtype, device=device)
    torch.cat([t.reshape(-1) for t in tensors], out=flat)
    C.all_reduce_mean_(flat, group, size)
    return [piece.view_as(t) for t, piece in zip(tensors, flat.split([t.numel() for t in tensors]))]
