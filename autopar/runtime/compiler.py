"""How a rank's graphs are compiled: the ``compile`` argument of ``parallelize``, read in one place."""
from __future__ import annotations

import functools

import torch
from torch.fx._lazy_graph_module import _LazyGraphModule

from autopar.kernels.fused_linear_ce import triton_available
from autopar.mesh import default_device_type
from autopar.overlap import RegatherInBackward, regather_in_backward

# torch.compile modes (Inductor) that replay CUDA graphs
CUDA_GRAPH_MODES = ("reduce-overhead", "max-autotune")
MODES = ("default", "max-autotune-no-cudagraphs", *CUDA_GRAPH_MODES)


def lower(gm: torch.fx.GraphModule, compile, *, regather: bool = False, order=None):
    """``gm`` as a rank runs it: ``compile`` True lowers through Inductor, one of ``MODES`` through
    Inductor in that torch.compile mode, another string or a callable names a torch.compile
    backend (e.g. "aot_eager"), False runs it eagerly. ``regather`` (ZeRO-3): Inductor re-gathers
    the weights in the backward instead of saving the forward's gathered copies
    (``autopar.overlap.RegatherInBackward``; AOTAutograd would otherwise merge the two gathers).
    ``order`` (a ``compile_once.CompileOrder``): Inductor's compiles wait for the peer that
    compiles them first."""
    if not compile:
        return gm
    if isinstance(gm, _LazyGraphModule):
        # dynamo would trace the wrapper that generates the code (frames of its own), not the graph's code
        gm.real_recompile()
    if regather and compile == "aot_eager":
        return torch.compile(gm, backend=_aot_eager_regathering())
    # Inductor by any of its names takes the joint pass (a mode or "inductor" without it saved every
    # gathered weight: ZeRO-2's memory)
    named = compile is True or compile == "inductor" or compile in MODES
    options = {"joint_custom_pre_pass": RegatherInBackward()} if named and regather else None
    mode = compile if compile in MODES else None
    if named and (options or order is not None):   # torch.compile takes a mode or options, not both
        backend = torch._TorchCompileInductorWrapper(mode, options, None)
        return torch.compile(gm, backend=order.wrap(backend) if order is not None else backend)
    if named:
        return torch.compile(gm, mode=mode)
    if order is not None and uses_inductor(compile):
        return torch.compile(gm, backend=order.wrap(compile))
    return torch.compile(gm, backend=compile)


def _aot_eager_regathering():
    """torch's "aot_eager" backend (no code generated, the same partitioner) with ZeRO-3's
    re-gathers moved into the backward before the joint graph is partitioned."""
    from functorch.compile import min_cut_rematerialization_partition
    from torch._dynamo.backends.common import aot_autograd
    from torch._dynamo.backends.debugging import boxed_nop

    def partition(joint, joint_inputs, **kwargs):
        regather_in_backward(joint.graph)
        return min_cut_rematerialization_partition(joint, joint_inputs, **kwargs)
    return aot_autograd(fw_compiler=boxed_nop, bw_compiler=boxed_nop, partition_fn=partition,
                        keep_inference_input_mutations=True)


def uses_inductor(compile) -> bool:
    """Whether ``compile`` lowers through Inductor: True, a mode, "inductor", or a partial of
    Inductor's ``compile_fx`` (``autopar.overlap.overlap_backend``)."""
    if compile is True or compile in MODES or compile == "inductor":
        return True
    if not isinstance(compile, functools.partial):   # no import of Inductor (seconds) to answer False
        return False
    from torch._inductor.compile_fx import compile_fx
    return compile.func is compile_fx


def replays_cuda_graphs(compile) -> bool:
    """Whether ``compile`` is an Inductor mode that replays CUDA graphs (weights and buffers must
    then stay at the addresses the graphs recorded)."""
    return isinstance(compile, str) and compile in CUDA_GRAPH_MODES


def prefetches(compile, backend: str) -> bool:
    """Whether ZeRO-2/3's gathers are launched a unit ahead (``zero_pass(prefetch=)``) on process
    groups of ``backend``: always on NCCL; on gloo only in Inductor's code (``compile=True``, a
    mode, or a backend function such as ``autopar.overlap.overlap_backend``'s). A gather left in
    flight on gloo while the graph ran on eagerly (no compile, or the "aot_eager" backend)
    corrupted the heap there: tests/runtime/test_zero.py crashed in 3 runs of 3 with "malloc(): unaligned
    tcache chunk detected" (torch 2.13, CPU), and passed in 2 of 2 with every gather waited at its
    launch. Inductor's code, whose buffers and waits it places itself, ran its prefetched gathers
    on gloo in tests/runtime/test_zero_overlap.py and test_zero_memory.py without fault."""
    if "gloo" not in backend:
        return True
    return compile is True or compile in MODES or callable(compile)


def inductor_on_cuda(compile) -> bool:
    """Whether ``compile`` lowers through Inductor onto CUDA with Triton (where autopar's kernels pay)."""
    return ((compile is True or compile in MODES) and default_device_type() == "cuda"
            and triton_available())
