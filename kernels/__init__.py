"""autopar.kernels: custom kernels for the lowered per-rank graphs.

Each kernel is a torch custom op (``torch.library``) with a plain-PyTorch reference
implementation that CPU runs and tests use, and Triton kernels used on CUDA where they pay
(the CPU build of torch has no Triton; Triton modules are imported lazily and tested on a GPU).

    cross_entropy      cross-entropy over (N, V) logits whose forward reads them once (one
                       exponential per logit); aten backward (op autopar::cross_entropy_rows)
    adamw              AdamW on fp32 master weights that also writes their bf16/fp16 working
                       copy, one Triton pass per tensor on CUDA (op autopar::adamw_master_)
    fused_linear_ce    the head linear + cross-entropy, chunked over the vocabulary so the
                       (N, V) logits never exist at once; also its vocabulary-parallel form
                       (ops autopar::linear_cross_entropy, linear_ce_stats, linear_ce_backward)
    linear_ce_triton   its Triton row kernels (log-sum-exp, target pick, in-place gradient)

``autopar.passes.fuse_loss.fuse_loss_pass`` puts the fused op into a captured or sharded graph,
``cross_entropy_kernel_pass`` the cross-entropy op; ``autopar.MasterAdamW`` calls the AdamW op.
"""
