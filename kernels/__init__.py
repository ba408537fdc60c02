"""autopar.kernels: custom kernels for the lowered per-rank graphs.

Each kernel is a torch custom op (``torch.library``) with a plain-PyTorch reference
implementation that CPU runs and tests use, and Triton kernels used on CUDA where they pay
(the CPU build of torch has no Triton; Triton modules are imported lazily and tested on a GPU).

    fused_linear_ce    the head linear + cross-entropy, chunked over the vocabulary so the
                       (N, V) logits never exist at once; also its vocabulary-parallel form
                       (ops autopar::linear_cross_entropy, linear_ce_stats, linear_ce_backward)
    linear_ce_triton   its Triton row kernels (log-sum-exp, target pick, in-place gradient)

``autopar.passes.fuse_loss.fuse_loss_pass`` puts the fused op into a captured or sharded graph.
"""
