"""autopar.kernels: custom kernels for the lowered per-rank graphs.

Each kernel is meant to be a Triton kernel registered as a torch custom op (``torch.library``),
with a plain-PyTorch reference implementation that CPU runs and tests use (the CPU build of
torch has no Triton; Triton kernels are tested on a GPU only).

No kernels are here yet: the compiled graphs use Inductor's own code generation throughout.
"""
