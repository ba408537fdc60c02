"""Deterministic mode: the same seed gives the same losses, bit for bit, run after run.

Every rank is seeded with the same seed on purpose: each rank builds the full model from the
global RNG before ``parallelize`` keeps its shards, so the ranks must draw the same weights, and
replicated activations (dropout on the tp-replicated residual stream) must draw the same masks.
"""
from __future__ import annotations

import os
import random

import numpy
import torch

# cuBLAS picks reduction splits per stream workspace; a fixed workspace layout makes its GEMMs
# reproducible (NVIDIA's documented setting; ":16:8" is the smaller, slower alternative).
_CUBLAS_WORKSPACE = ":4096:8"


def set_deterministic(seed: int = 0, *, warn_only: bool = False) -> None:
    """Seeds every RNG with ``seed`` and makes PyTorch, cuBLAS, cuDNN and Inductor deterministic.

    Call it on every rank with the same seed, before building the model and before the first
    matrix multiply on the GPU (cuBLAS reads its workspace setting when PyTorch creates its handle,
    lazily, at the first cuBLAS call; an earlier ``CUBLAS_WORKSPACE_CONFIG`` is kept). Afterwards
    ``torch.use_deterministic_algorithms(True)`` is on: an op with no deterministic
    implementation raises, or only warns with ``warn_only=True``. Inductor skips on-device
    benchmarking (which can pick different kernels from run to run) and compiles random ops to
    the eager RNG, so a compiled model draws what the eager one would.
    """
    if not isinstance(seed, int) or isinstance(seed, bool) or not 0 <= seed < 2**63:
        raise ValueError(f"seed={seed!r}: expected an int from 0 to 2**63 - 1")
    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", _CUBLAS_WORKSPACE)
    random.seed(seed)
    numpy.random.seed(seed % 2**32)   # NumPy's legacy global seed is 32-bit
    torch.manual_seed(seed)   # also seeds every CUDA device
    torch.use_deterministic_algorithms(True, warn_only=warn_only)
    torch.backends.cudnn.deterministic = True
    torch.backends.cudnn.benchmark = False

    import torch._inductor.config as inductor_config
    inductor_config.fallback_random = True
    # Not every supported torch release has Inductor's deterministic mode; where it is missing,
    # use_deterministic_algorithms above is what Inductor consults.
    if hasattr(inductor_config, "deterministic"):
        inductor_config.deterministic = True

