"""The planner's view of 16-bit compute: the dtypes a graph captured at fp32 will compute at.

``passes.precision.precision_pass`` is the runtime's rewrite: floating inputs and buffers cast to the
compute dtype where first used, except by the ops that compute tables from buffers (rotary cos/sin),
which run at the dtype they were traced at; loss ops (cross-entropy and the like) take fp32 inputs.
``retype_pass`` is the same rewrite as the cost model reads it: a copy of the captured graph whose
every computed value's ``meta["val"]`` has the dtype it will have, so compute is priced at the
device's 16-bit peak and activations and collectives at 2 bytes per element, while the
placeholders keep their stored dtype (fp32 parameters, gradients and optimizer state).
``retyped`` applies it to a ``Captured``, leaving the capture as it was.
"""
from __future__ import annotations

import torch
from torch._guards import detect_fake_mode
from torch._subclasses.fake_tensor import FakeTensor
from torch.fx import GraphModule, Node, map_arg
from torch.fx.passes.fake_tensor_prop import FakeTensorProp
from torch.utils._pytree import tree_map

from autopar import ops
from autopar.graph.capture import Captured, copy_graph, graph_cached, input_free

aten = torch.ops.aten

PRECISIONS = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}

# Ops that compute the loss: they run in fp32 whatever the compute dtype, as Megatron-LM's
# cross-entropy does, because a log-sum-exp over a vocabulary loses too much at 16 bits.
LOSS_OPS = {aten.cross_entropy_loss.default, aten.log_softmax.int, aten._log_softmax.default,
            aten.nll_loss.default, aten.mse_loss.default, aten.l1_loss.default,
            aten.smooth_l1_loss.default, aten.huber_loss.default, aten.kl_div.default,
            aten.binary_cross_entropy_with_logits.default, ops.vocab_parallel_cross_entropy}


def compute_dtype(precision: str) -> torch.dtype:
    """The dtype the forward and backward run at for ``precision`` ("fp32", "bf16" or "fp16")."""
    if precision not in PRECISIONS:
        raise ValueError(f"precision={precision!r}: expected 'fp32', 'bf16' (bf16 compute, fp32 master "
                         "weights) or 'fp16' (fp16 compute, fp32 master weights, loss scaling)")
    return PRECISIONS[precision]


def cast(x, dtype: torch.dtype):
    """``x`` at ``dtype`` when it is a floating-point tensor; anything else as it is (the graphs
    ``precision_pass`` writes call it)."""
    if isinstance(x, torch.Tensor) and x.is_floating_point() and x.dtype != dtype:
        return x.to(dtype)
    return x


def tables(graph) -> set[Node]:
    """Values the graph computes from buffers and shapes alone (rotary tables, float masks).
    They were traced at fp32, where their casts to the activations' dtype were no-ops and dropped,
    so the ops that use them get them cast to the compute dtype. The ops computing them run at the
    dtype they were traced at, on uncast buffers: the model's own upcasts there (Hugging Face's
    ``inv_freq.float() @ position_ids.float()`` under disabled autocast) were no-ops at fp32 and
    are missing from the graph, so a 16-bit buffer would meet an fp32 operand."""
    return {n for n in input_free(graph) if n.op == "call_function"}



class _Retype(FakeTensorProp):
    """Fake-tensor propagation with ``precision_pass``'s casts: loss ops see fp32 inputs, and the
    tables the graph computes from buffers and shapes reach other ops at the compute dtype.

    An op's fake output depends only on the op, its non-tensor arguments and its tensor arguments'
    metadata, and a model's repeated blocks ask the same question once per block (an 80-block
    graph, 80 times): each distinct question is propagated once (``_question``) and a repeat gets
    that answer and its snapshot (``FakeTensorProp.run_node``) as its ``meta["val"]``."""

    def __init__(self, gm, mode, dtype: torch.dtype):
        super().__init__(gm, mode)
        self.dtype = dtype
        self.tables = tables(gm.graph)
        self.answers: dict = {}

    def run_node(self, n):
        question = self._question(n)
        if question is None:
            return super().run_node(n)
        hit = self.answers.get(question)
        if hit is None:
            answer = super().run_node(n)
            self.answers[question] = answer, n.meta["val"]
            return answer
        # the twin's snapshot, shared as ``graph.block_capture`` shares a repeated layer's metadata
        answer, n.meta["val"] = hit
        return answer

    def _question(self, n):
        """What ``n``'s fake output is a function of, hashable; None where it is not only that (not
        an op, an op that mutates its inputs, an output that is not tensors, an unhashable argument)."""
        target = n.target
        if n.op != "call_function" or getattr(getattr(target, "_schema", None), "is_mutable", False):
            return None
        if not all(isinstance(v, FakeTensor) for v in _leaves(n.meta.get("val"))):
            return None   # only tensor answers are snapshotted here (``FakeTensorProp.run_node``'s extract_val)

        def describe(a):
            if isinstance(a, Node):   # its value as the op receives it: cast where ``load`` casts
                return ("node", a in self.tables or a.op == "placeholder", _metadata(self.env[a]))
            if isinstance(a, (list, tuple)):
                return (type(a).__name__, tuple(describe(x) for x in a))
            if isinstance(a, dict):
                return ("dict", tuple((k, describe(v)) for k, v in a.items()))
            return a
        question = (target, n in self.tables, describe(n.args), describe(n.kwargs))
        try:
            hash(question)
        except TypeError:
            return None
        return question

    def fetch_args_kwargs_from_env(self, n):
        def load(a):   # inputs and tables reach the ops that compute with them at 16 bits
            v = self.env[a]
            return cast(v, self.dtype) if a in self.tables or a.op == "placeholder" else v
        if n.op != "call_function" or n.target in LOSS_OPS or n in self.tables:
            return super().fetch_args_kwargs_from_env(n)
        return map_arg(n.args, load), map_arg(n.kwargs, load)

    def call_function(self, target, args, kwargs):
        if target in LOSS_OPS:
            args, kwargs = tree_map(lambda x: cast(x, torch.float32), (args, kwargs))
        return super().call_function(target, args, kwargs)


def _leaves(v) -> list:
    """The tensors and other leaves of a node's value (a tensor or a list or tuple of them)."""
    return [x for a in v for x in _leaves(a)] if isinstance(v, (list, tuple)) else [v]


def _metadata(v):
    """Everything of a fake value that an op's fake output can depend on: per tensor its shape,
    strides, offset, dtype, device and whether it requires grad."""
    if isinstance(v, torch.Tensor):
        return (tuple(v.shape), v.stride(), v.storage_offset(), v.dtype, v.device, v.requires_grad)
    if isinstance(v, (list, tuple)):
        return tuple(_metadata(x) for x in v)
    return v


def retype_pass(gm: GraphModule, *, precision: str) -> GraphModule:
    """``gm`` with every computed value's metadata at ``precision``'s compute dtype, in ``meta["compute_dtype"]``."""
    dtype = compute_dtype(precision)
    out = copy_graph(gm, lazy=True)   # the planner prices this copy; a rewrite of it copies it again
    # placeholders keep their stored dtype (fp32 master weights, gradients, optimizer state);
    # every op is re-run on fake tensors as it will run, on 16-bit copies of them
    placeholders = [n for n in out.graph.nodes if n.op == "placeholder"]
    stored = {n: n.meta["val"] for n in placeholders}
    mode = detect_fake_mode(list(stored.values()))
    _Retype(out, mode, dtype).propagate_dont_convert_inputs(*stored.values())
    for n, v in stored.items():
        n.meta["val"] = v
    out.meta["compute_dtype"] = dtype
    return out


@graph_cached
def retyped(cap: Captured, precision: str) -> Captured:
    """``cap`` as the planner prices it at ``precision``: on ``retype_pass``'s copy of its graph
    (``cap`` itself unchanged), or ``cap`` at fp32, where nothing is retyped."""
    if compute_dtype(precision) == torch.float32:
        return cap
    gm = retype_pass(cap.gm, precision=precision)
    gm.graph.lint()
    return cap.with_graph(gm)


@graph_cached
def working_copy_ratio(cap) -> float:
    """Bytes of a step's 16-bit working copy (``WorkingCopies``) per byte of stored parameter:
    0.5 for bf16 or fp16 compute on fp32 weights, 0 when the weights are used as they are.
    ``cap``: as ``retyped`` returns it (its graph's ``meta["compute_dtype"]``).
    Read once per capture: the prices of every candidate mesh and stage ask it."""
    dtype = cap.gm.meta.get("compute_dtype")
    stored = {n.meta["val"].dtype for n in cap.params.values()}
    if dtype is None or stored <= {dtype}:
        return 0.0
    return dtype.itemsize / max(d.itemsize for d in stored)
