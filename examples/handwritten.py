"""The hand-written baseline autopar is compared against: the example GPT parallelized BY HAND with
``torch.distributed.tensor.parallel``, the way torchtitan's ``apply_tp`` + ``apply_fsdp`` do it.

    mesh = init_device_mesh("cpu", (dp, tp), mesh_dim_names=("dp", "tp"))
    torch.manual_seed(0); model = GPT(cfg)           # same weights on every rank
    model = parallelize_by_hand(model, mesh, sequence_parallel=True)
    idx, targets = local_batch_by_hand(mesh, idx, targets)  # this rank's dp slice
    loss = train_step_by_hand(model, idx, targets)   # forward (loss_parallel) + backward
    sd = full_state_dict_by_hand(model)              # loads into the unsharded GPT

Tensor parallel plan (mesh axis "tp"), per block, Megatron-style:

    attn.c_attn   ColwiseParallel       weight S(0) *interleaved*: rows permuted first (see below)
    attn.c_proj   RowwiseParallel       output S(1) with sequence parallel, else R
    mlp.c_fc      ColwiseParallel
    mlp.c_proj    RowwiseParallel       output S(1) with sequence parallel, else R
    attn, mlp     PrepareModuleInput    S(1) -> R (all-gather), only with sequence parallel
    ln_1, ln_2    SequenceParallel      (and every Dropout), only with sequence parallel

and at the top: ``wte`` vocab-parallel (RowwiseParallel, input R, output S(1) or R: the embedding's
masked partial sum is reduce-scattered / all-reduced), ``wpe`` output R -> S(0) (the position table is
replicated; each rank keeps its positions' rows, the backward all-gathers), ``ln_f`` and ``drop``
SequenceParallel, ``lm_head`` ColwiseParallel with output S(-1) kept as a DTensor: the logits are never
gathered, the cross-entropy runs under ``loss_parallel()``.

The fused-QKV trap. ``c_attn`` is one Linear of weight [3C, C] whose rows are [Q; K; V]. ColwiseParallel
gives rank r the contiguous rows [r*3C/t, (r+1)*3C/t): for t=2, rank 0 holds all of Q and half of K, so
its "q, k, v" are wrong heads and the loss is silently wrong (no error; on the test's tiny GPT the loss
is off by 3.4e-3 at init and c_attn's gradient by 1e-2). Megatron stores its fused QKV weight grouped by
head for this reason (torchtitan sidesteps it with separate wq, wk, wv). Here the rows are permuted before
sharding to [q_0 k_0 v_0 | q_1 k_1 v_1 | ...], where q_r is rank r's C/t rows of Q (its n_head/t whole
heads). The plain contiguous S(0) of the permuted weight
is then the interleaved (strided) shard of the original: each rank holds its heads' slice of Q, of K and
of V. ``full_state_dict_by_hand`` undoes the permutation.

The attention module's forward splits by ``C`` and views with ``n_head`` heads; on the local shard the
fused output is 3C/t wide with n_head/t heads. Like torchtitan (``attention.n_heads = n_heads // tp``) the
local head count is set on the module, and its class is swapped for a subclass whose forward splits the
local fused output in three and views with ``-1`` (the original forward, written for local shapes; the
model file is untouched).

Tied embeddings. ``lm_head.weight is transformer.wte.weight`` ([V, C]). RowwiseParallel shards an
Embedding's weight S(0) and ColwiseParallel shards a Linear's weight S(0): the same placement of the same
tensor, so one DTensor parameter serves both. ``parallelize_module`` replaces each module's parameter by
a new DTensor ``Parameter``, which breaks the tie silently: two parameters, wte's gradient holding only
the embedding's share and lm_head's only the head's (measured: 0.11 and 0.058 off). So the tie is re-made
right after the TP plan (``lm_head.weight = transformer.wte.weight``), before data parallelism, so that
FSDP2 sees one shared parameter (it keeps both modules pointing at it through unshard/reshard).
torchtitan's Qwen3 re-ties the same way, ``model.output.weight = model.tok_embeddings.weight`` once its
parallelisms are applied (there after FSDP too; here before it).

Data parallelism (mesh axis "dp"): FSDP2 ``fully_shard`` over ``mesh["dp"]``, per block and at the root,
as torchtitan's ``apply_fsdp``; see the module constant ``DP_WRAPPER_NOTES`` for what was tried on
torch 2.13 CPU/gloo. ``tensor_parallel=False`` (tp = 1) skips the TP plan: the plain FSDP2 program that
``python -m autopar compare`` runs as "fsdp2" against autopar's ZeRO-3.
"""
from __future__ import annotations

import types

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    PrepareModuleInput,
    PrepareModuleOutput,
    RowwiseParallel,
    SequenceParallel,
    loss_parallel,
    parallelize_module,
)

from autopar.examples.gpt import GPT, CausalSelfAttention

__all__ = [
    "parallelize_by_hand",
    "train_step_by_hand",
    "full_state_dict_by_hand",
    "local_batch_by_hand",
    "loss_by_hand",
    "qkv_permutation",
]

DP_WRAPPER_NOTES = """\
Data-parallel wrappers over mesh["dp"] on top of this TP plan, torch 2.13 CPU, gloo, 2 and 4 ranks:
- fully_shard (FSDP2), per block then root: exact (loss, every gradient, AdamW steps). The default.
  A TP-sharded parameter becomes a 2-D DTensor with placements (_StridedShard(dim=0, sf=2), Shard(0))
  on (dp, tp); a replicated one (wpe, LayerNorms without SP) (Shard(0),) on dp. full_tensor() on the
  2-D ones logs "2 sequential all_gather operations will be performed" (a warning, the values are exact).
- torch.distributed._composable.replicate_with_fsdp.replicate (DDP semantics on FSDP2's machinery):
  exact as well ("replicate" here).
- torch.distributed._composable.replicate (the DDP-based one, still what `_composable.replicate` names
  in 2.13) with device_mesh=mesh["dp"]: NOT usable. Its TP workaround (_localize_dtensor before DDP and
  after every forward, _reconstruct_dtensor before every forward) walks named_parameters(), which drops
  the tied duplicate, so lm_head and wte end up as two parameters (one never gets a gradient), the
  modules hold non-leaf DTensors after forward, and the gradients it leaves disagree with the unsharded
  model (1.4e-2 on an MLP weight with dp=2, tp=2). Not offered here.
"""


# ---------------------------------------------------------------------------------------------------
# fused QKV: the per-rank row layout


def qkv_permutation(n_embd: int, tp: int) -> torch.Tensor:
    """Row order of the fused [Q; K; V] weight such that rank r's contiguous block is [q_r, k_r, v_r].

    ``permuted = weight[perm]``; each rank's contiguous 3C/tp rows then hold C/tp rows of Q, of K and of V
    (whole heads, since tp divides n_head). ``original[perm] = permuted`` undoes it.
    """
    if n_embd % tp:
        raise ValueError(f"tp={tp} does not divide n_embd={n_embd}")
    c = n_embd // tp
    blocks = []
    for r in range(tp):
        for which in range(3):  # q, k, v
            start = which * n_embd + r * c
            blocks.append(torch.arange(start, start + c))
    return torch.cat(blocks)


class _LocalCausalSelfAttention(CausalSelfAttention):
    """CausalSelfAttention whose forward works on the local (tensor-parallel) shard.

    ``self.n_head`` is the local head count; the fused output of ``c_attn`` is [q_r, k_r, v_r] (after the
    row permutation), split in three equal parts rather than by the global ``C``.
    """

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T = x.shape[0], x.shape[1]             # x may be a DTensor (global shape) or a local tensor
        qkv = self.c_attn(x)                      # local (B, T, 3C/tp)
        q, k, v = qkv.split(qkv.size(-1) // 3, dim=2)
        q = q.view(B, T, self.n_head, -1).transpose(1, 2)   # (B, nh/tp, T, hd)
        k = k.view(B, T, self.n_head, -1).transpose(1, 2)
        v = v.view(B, T, self.n_head, -1).transpose(1, 2)
        if self.explicit:
            att = (q @ k.transpose(-2, -1)) * (1.0 / k.size(-1) ** 0.5)
            att = att.masked_fill(~self.causal[:, :, :T, :T], float("-inf"))
            y = self.attn_dropout(F.softmax(att, dim=-1)) @ v
        else:
            p = self.dropout if self.training else 0.0
            y = F.scaled_dot_product_attention(q, k, v, dropout_p=p, is_causal=True)
        y = y.transpose(1, 2).contiguous().view(B, T, -1)   # (B, T, C/tp)
        return self.resid_dropout(self.c_proj(y))


# ---------------------------------------------------------------------------------------------------
# the plan


def _check(model: GPT, mesh) -> tuple[int, int]:
    """(dp, tp) of ``mesh``, after checking that the model can be split that way."""
    if tuple(mesh.mesh_dim_names or ()) != ("dp", "tp"):
        raise ValueError(f"mesh must have dims named ('dp', 'tp'), got {mesh.mesh_dim_names}; build it with "
                         "init_device_mesh(device, (dp, tp), mesh_dim_names=('dp', 'tp'))")
    cfg = model.config
    dp, tp = mesh["dp"].size(), mesh["tp"].size()

    def ok(t):
        return cfg.n_head % t == 0 and cfg.vocab_size % t == 0

    if not ok(tp):
        valid = ", ".join(str(t) for t in range(1, cfg.n_head + 1) if ok(t))
        raise ValueError(f"tp={tp} does not divide both {cfg.n_head} attention heads and vocab_size "
                         f"{cfg.vocab_size}; valid tp for this model: {valid}")
    return dp, tp


def _check_batch(model, idx: torch.Tensor) -> None:
    info = model._by_hand
    if info.sequence_parallel and idx.size(1) % info.tp:
        raise ValueError(f"sequence length {idx.size(1)} is not divisible by tp={info.tp}, which sequence "
                         "parallelism needs; pad the batch or parallelize with sequence_parallel=False")


def parallelize_by_hand(model: GPT, mesh, *, sequence_parallel: bool = True,
                        permute_qkv: bool = True, dp_wrapper: str = "fully_shard",
                        tensor_parallel: bool = True) -> GPT:
    """Tensor (+sequence) parallel over mesh["tp"], then data parallel over mesh["dp"]; in place.

    ``model`` must hold the same weights on every rank (build it under the same seed). ``permute_qkv=False``
    applies ColwiseParallel to the fused c_attn as is: the trap, kept only to demonstrate it.
    ``dp_wrapper``: "fully_shard" (FSDP2, the default) or "replicate" (FSDP2-based replicate, DDP semantics).
    ``tensor_parallel=False`` (a mesh whose tp axis has size 1) leaves the module's own layers as they
    are and applies only the dp wrapper: plain FSDP2, as torchtitan applies it with TP off, instead of
    every weight becoming a DTensor over a one-rank axis.
    """
    dp, tp = _check(model, mesh)
    if not tensor_parallel and tp > 1:
        raise ValueError(f"tensor_parallel=False needs a mesh whose tp axis has size 1, got tp={tp}; "
                         "pass tensor_parallel=True or build the mesh as (dp, 1)")
    if not tensor_parallel and sequence_parallel:
        raise ValueError("sequence_parallel=True shards activations over the tp axis, which "
                         "tensor_parallel=False does not use; pass sequence_parallel=False")
    if dp_wrapper not in ("fully_shard", "replicate") and (dp_wrapper != "none" or dp > 1):
        raise ValueError(f"dp_wrapper={dp_wrapper!r}: expected 'fully_shard' or 'replicate' "
                         "('none' only when the dp axis has size 1)")
    if model.lm_head.weight is not model.transformer.wte.weight:
        raise ValueError("expected the example GPT with lm_head tied to transformer.wte")
    if tensor_parallel:
        _tensor_parallel(model, mesh["tp"], tp, sequence_parallel, permute_qkv)
    _data_parallel(model, mesh["dp"], dp_wrapper)
    model._by_hand = types.SimpleNamespace(mesh=mesh, dp=dp, tp=tp, permuted=tensor_parallel and permute_qkv,
                                           sequence_parallel=sequence_parallel, n_embd=model.config.n_embd)
    return model


def _data_parallel(model: GPT, dp_mesh, dp_wrapper: str) -> None:
    """Step 6: the dp wrapper over ``dp_mesh``, per block, then at the root ("none": nothing)."""
    if dp_wrapper == "fully_shard":
        from torch.distributed.fsdp import fully_shard
        for block in model.transformer.h:
            fully_shard(block, mesh=dp_mesh)
        fully_shard(model, mesh=dp_mesh)
    elif dp_wrapper == "replicate":
        from torch.distributed._composable.replicate_with_fsdp import replicate
        for block in model.transformer.h:
            replicate(block, mesh=dp_mesh)
        replicate(model, mesh=dp_mesh)


def _tensor_parallel(model: GPT, tp_mesh, tp: int, sp: bool, permute_qkv: bool) -> None:
    """Steps 1-5 of the plan in the module docstring: the model's layers sharded over ``tp_mesh``."""
    cfg = model.config
    C = cfg.n_embd
    # 1. fused QKV: permute rows (and bias) so that each rank's contiguous block is [q_r, k_r, v_r]
    if permute_qkv:
        perm = qkv_permutation(C, tp)
        with torch.no_grad():
            for block in model.transformer.h:
                lin = block.attn.c_attn
                lin.weight.copy_(lin.weight[perm])
                if lin.bias is not None:
                    lin.bias.copy_(lin.bias[perm])

    # 2. local head count and a forward that works on the local shard
    for block in model.transformer.h:
        block.attn.__class__ = _LocalCausalSelfAttention
        block.attn.n_head = cfg.n_head // tp

    # 3. top level: embeddings, final norm, vocab-parallel head
    top = {
        "transformer.wte": RowwiseParallel(input_layouts=Replicate(),
                                           output_layouts=Shard(1) if sp else Replicate()),
        "lm_head": ColwiseParallel(input_layouts=Shard(1) if sp else Replicate(),
                                   output_layouts=Shard(-1), use_local_output=False),
    }
    if sp:
        top.update({
            # the (T, C) position rows: replicated table, keep this rank's positions (no comm forward,
            # all-gather of the gradient backward)
            "transformer.wpe": PrepareModuleOutput(output_layouts=Replicate(),
                                                   desired_output_layouts=Shard(0)),
            "transformer.drop": SequenceParallel(use_local_output=True),
            "transformer.ln_f": SequenceParallel(),
        })
    parallelize_module(model, tp_mesh, top)

    # 4. every block
    for block in model.transformer.h:
        plan = {
            "attn.c_attn": ColwiseParallel(),
            "attn.c_proj": RowwiseParallel(output_layouts=Shard(1) if sp else Replicate()),
            "mlp.c_fc": ColwiseParallel(),
            "mlp.c_proj": RowwiseParallel(output_layouts=Shard(1) if sp else Replicate()),
        }
        if sp:
            plan.update({
                "ln_1": SequenceParallel(),
                "attn": PrepareModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),)),
                "attn.resid_dropout": SequenceParallel(use_local_output=True),
                "ln_2": SequenceParallel(),
                "mlp": PrepareModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),)),
                "mlp.dropout": SequenceParallel(use_local_output=True),
            })
        parallelize_module(block, tp_mesh, plan)

    # 5. re-tie: both modules got their own DTensor Parameter; same placement S(0) on [V, C]
    wte_w, head_w = model.transformer.wte.weight, model.lm_head.weight
    assert isinstance(wte_w, DTensor) and wte_w.placements == head_w.placements == (Shard(0),)
    model.lm_head.weight = wte_w


# ---------------------------------------------------------------------------------------------------
# running and gathering


def local_batch_by_hand(mesh, idx: torch.Tensor, targets: torch.Tensor):
    """This rank's dp slice of a global batch (the tp ranks of one dp group see the same rows)."""
    dp = mesh["dp"].size()
    r = mesh["dp"].get_local_rank()
    if idx.size(0) % dp:
        raise ValueError(f"batch {idx.size(0)} is not divisible by dp={dp}")
    b = idx.size(0) // dp
    return idx[r * b:(r + 1) * b], targets[r * b:(r + 1) * b]


def loss_by_hand(model, idx, targets) -> torch.Tensor:
    """Forward only, under loss_parallel; returns the (tp-replicated) local loss as a plain tensor."""
    _check_batch(model, idx)
    with loss_parallel():
        loss = model(idx, targets)
    return loss.full_tensor() if isinstance(loss, DTensor) else loss


def train_step_by_hand(model, idx: torch.Tensor, targets: torch.Tensor) -> float:
    """Forward inside ``loss_parallel()``, backward; returns the loss averaged over dp as a float.

    ``idx``/``targets`` are this rank's dp slice (``local_batch_by_hand``). Gradients are averaged over
    dp by the data-parallel wrapper, so they equal the gradient of the global-batch mean loss.
    """
    _check_batch(model, idx)
    with loss_parallel():
        loss = model(idx, targets)
        loss.backward()
    value = (loss.full_tensor() if isinstance(loss, DTensor) else loss).detach().clone()
    info = model._by_hand
    if info.dp > 1:
        dist.all_reduce(value, group=info.mesh["dp"].get_group())
        value /= info.dp
    return value.item()


def _full(t):
    return t.full_tensor() if isinstance(t, DTensor) else t


def full_state_dict_by_hand(model, *, grads: bool = False) -> dict[str, torch.Tensor]:
    """The unsharded state dict (or, with ``grads=True``, the parameters' gradients), c_attn un-permuted.

    Keys are the unsharded GPT's (``lm_head.weight`` and ``transformer.wte.weight`` both present, the
    same tensor). Collective: every rank must call it. Loads with ``GPT(cfg).load_state_dict``.
    """
    info = model._by_hand
    if grads:
        items = [(n, p.grad) for n, p in model.named_parameters(remove_duplicate=False)]
    else:
        items = list(model.state_dict().items())
    inv = None
    if info.permuted:
        perm = qkv_permutation(info.n_embd, info.tp)
        inv = torch.empty_like(perm)
        inv[perm] = torch.arange(perm.numel())
    out = {}
    for name, t in items:
        if t is None:
            out[name] = None
            continue
        full = _full(t).detach().clone()
        if inv is not None and name.endswith(("attn.c_attn.weight", "attn.c_attn.bias")):
            full = full[inv]
        out[name] = full
    return out
