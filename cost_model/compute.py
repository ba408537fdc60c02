"""FLOPs, bytes and roofline time of single aten ops and of torch.export FX nodes.

FLOPs come from ``torch.utils.flop_counter.FlopCounterMode`` run on meta tensors, so the
counting formulas are PyTorch's own (matmuls, attention, convolutions) and no memory is touched.
Ops without a formula (layer_norm, gelu, views, ...) count 0 FLOPs and are priced by the bytes
they move instead. Results are cached by (op, shapes, dtypes, other args): a GPT's blocks repeat
the same ~40 signatures, so a whole model costs only a few dozen meta executions.
"""
from __future__ import annotations

import math
import operator
import sys
import warnings
from typing import Any

import torch
import torch.fx
from torch.fx.node import map_arg
from torch.utils._pytree import tree_flatten, tree_map
from torch.utils.flop_counter import FlopCounterMode

from .devices import DeviceSpec

_OPS = (torch._ops.OpOverload, torch._ops.OpOverloadPacket)
_CACHE: dict[Any, tuple[float, float]] = {}
_CACHE_MAX = 8192


def _hint(x: Any) -> Any:
    """A concrete Python number for a symbolic one (its size hint), else ``x`` unchanged."""
    if isinstance(x, (torch.SymInt, torch.SymFloat, torch.SymBool)):
        hint = x.node.hint
        if hint is None:
            # Unbacked symbols have no hint; the shape env may still know a value.
            hint = x.node.shape_env.size_hint(x.node.expr, allow_none=True)
        if hint is None:
            raise ValueError(f"cannot price a symbolic size with no hint: {x}")
        if isinstance(x, torch.SymInt):
            return int(hint)
        return float(hint) if isinstance(x, torch.SymFloat) else bool(hint)
    return x


def _shape(t: torch.Tensor) -> tuple[int, ...]:
    return tuple(int(_hint(s)) for s in t.shape)


def _is_float(dtype: torch.dtype) -> bool:
    return dtype.is_floating_point or dtype.is_complex


def _to_meta(x: Any) -> Any:
    if isinstance(x, torch.Tensor):
        return torch.empty(_shape(x), dtype=x.dtype, device="meta", requires_grad=_is_float(x.dtype))
    if isinstance(x, torch.device):
        # Factory ops (arange, zeros) carry the capture device; keep everything on meta.
        return torch.device("meta")
    return _hint(x)


def _key_leaf(x: Any) -> Any:
    if isinstance(x, torch.Tensor):
        return ("T", _shape(x), x.dtype)
    return _hint(x)


def _signature(target: Any, args: Any, kwargs: Any) -> Any:
    leaves, spec = tree_flatten((args, kwargs))
    key = (target, str(spec), tuple(_key_leaf(x) for x in leaves))
    try:
        hash(key)
    except TypeError:
        return None
    return key


def _is_mutating(target: Any) -> bool:
    schema = getattr(target, "_schema", None)
    return bool(schema is not None and schema.is_mutable)


def op_flops(target: Any, args: tuple = (), kwargs: dict | None = None) -> tuple[float, float]:
    """Forward and backward FLOPs of one aten op call ``target(*args, **kwargs)``.

    Tensors in ``args``/``kwargs`` (real, meta or fake, any device) are replaced by fresh meta
    tensors of the same shape and dtype, floating ones requiring grad, so the backward counts
    both input and weight gradients. The backward is that of the sum of the floating outputs.
    Targets that are not aten ops (``operator.getitem``, grad-mode switches, higher-order ops)
    count (0, 0); an op that cannot run on meta tensors warns and counts (0, 0)."""
    kwargs = kwargs or {}
    if not isinstance(target, _OPS):
        return (0.0, 0.0)
    key = _signature(target, args, kwargs)
    if key is not None and key in _CACHE:
        return _CACHE[key]
    result = _count(target, args, kwargs)
    if key is not None:
        if len(_CACHE) >= _CACHE_MAX:
            _CACHE.clear()
        _CACHE[key] = result
    return result


def _functional_variant(target: Any) -> Any:
    """``aten.addmm_.default`` -> ``aten.addmm.default``; ``target`` itself when there is none."""
    packet = target.overloadpacket if isinstance(target, torch._ops.OpOverload) else target
    name = packet.__name__
    if not name.endswith("_") or name.startswith("_"):
        return target
    functional = getattr(torch.ops.aten, name[:-1], None)
    if functional is None:
        return target
    if isinstance(target, torch._ops.OpOverload):
        return getattr(functional, target._overloadname, target)
    return functional


def _count(target: Any, args: tuple, kwargs: dict, backward: bool = True) -> tuple[float, float]:
    with torch.set_grad_enabled(backward):
        margs, mkwargs = tree_map(_to_meta, (tuple(args), dict(kwargs)))
        if _is_mutating(target):
            # Autograd refuses in-place ops on leaves that require grad; non-leaf copies are fine.
            margs, mkwargs = tree_map(
                lambda t: t.clone() if isinstance(t, torch.Tensor) and t.requires_grad else t,
                (margs, mkwargs))
        try:
            with FlopCounterMode(display=False) as fwd_counter:
                out = target(*margs, **mkwargs)
        except Exception as e:  # noqa: BLE001 - any failure here only loses a cost estimate
            warnings.warn(f"op_flops: {target} does not run on meta tensors ({type(e).__name__}: "
                          f"{e}); counting 0 FLOPs", stacklevel=3)
            return (0.0, 0.0)
        fwd = float(fwd_counter.get_total_flops())
        if fwd == 0 and _is_mutating(target) and _functional_variant(target) is not target:
            # The counter has formulas for addmm, not addmm_: count the forward functionally.
            fwd = _count(_functional_variant(target), args, kwargs, backward=False)[0]

        outs = [t for t in tree_flatten(out)[0]
                if isinstance(t, torch.Tensor) and _is_float(t.dtype) and t.requires_grad]
        if not outs:
            return (fwd, 0.0)
        # backward needs a real scalar: a complex output (interleaved RoPE) contributes its real part
        sums = [t.sum().real if t.is_complex() else t.sum() for t in outs]
        loss = sums[0]
        for t in sums[1:]:
            loss = loss + t
        try:
            with FlopCounterMode(display=False) as bwd_counter:
                loss.backward()
        except Exception as e:  # noqa: BLE001 - e.g. an op with no derivative formula
            warnings.warn(f"op_flops: backward of {target} failed on meta tensors "
                          f"({type(e).__name__}: {e}); counting 0 backward FLOPs", stacklevel=3)
            return (fwd, 0.0)
        return (fwd, float(bwd_counter.get_total_flops()))


def _val(n: torch.fx.Node) -> Any:
    if "val" not in n.meta:
        raise ValueError(f"node {n.name!r} ({n.op} {n.target}) has no meta['val']; "
                         f"price graphs from torch.export, or run FakeTensorProp first")
    return n.meta["val"]


def node_flops(node: torch.fx.Node) -> tuple[float, float]:
    """Forward and backward FLOPs of an FX node of a torch.export graph.

    Input nodes are replaced by their ``meta["val"]`` (FakeTensors, possibly in lists) and
    priced with ``op_flops``. Placeholders, outputs and non-aten targets count (0, 0)."""
    if node.op != "call_function":
        return (0.0, 0.0)
    if not isinstance(node.target, _OPS):
        return (0.0, 0.0)
    # Shapes never change under a node (``symbolic`` re-sizes graphs and drops this), and planning asks often.
    if "flops" not in node.meta:
        node.meta["flops"] = op_flops(node.target, map_arg(node.args, _val), map_arg(node.kwargs, _val))
    return node.meta["flops"]


def _tensor_bytes(x: Any) -> float:
    total = 0.0
    for t in tree_flatten(x)[0]:
        if isinstance(t, torch.Tensor):
            total += math.prod(_shape(t)) * t.dtype.itemsize
    return total


def _is_view(target: Any) -> bool:
    if target is operator.getitem:
        return True
    schema = getattr(target, "_schema", None)
    if schema is None or not schema.returns:
        return False
    # A view's outputs alias an input without writing it; in-place ops alias *and* write.
    return all(r.alias_info is not None and not r.alias_info.is_write for r in schema.returns)


def node_bytes(node: torch.fx.Node) -> float:
    """Bytes a call_function node reads plus writes: its distinct tensor inputs' sizes plus its
    outputs' sizes, from ``meta["val"]`` and element sizes.

    Views (ops whose outputs alias an input without writing it, e.g. view, transpose, split,
    and ``getitem``) move no memory and count 0, as do placeholders, outputs and get_attr.
    An embedding counts the rows it gathers, not its whole table."""
    if node.op != "call_function" or _is_view(node.target):
        return 0.0
    written = _tensor_bytes(_val(node))
    if node.target is torch.ops.aten.embedding.default:
        # A lookup reads only the gathered rows (as many bytes as it writes), not the whole
        # table: charging a 50k x 12k vocabulary in full would dwarf the real traffic.
        return float(_tensor_bytes(_val(node.args[1])) + 2 * written)
    read = sum(_tensor_bytes(_val(n)) for n in node.all_input_nodes)
    return float(read + written)


ATTENTION_OPS = {torch.ops.aten.scaled_dot_product_attention.default,
                 torch.ops.aten._scaled_dot_product_flash_attention.default,
                 torch.ops.aten._scaled_dot_product_efficient_attention.default,
                 torch.ops.aten._scaled_dot_product_cudnn_attention.default}


def attention_kind(node: torch.fx.Node) -> bool | None:
    """For a fused attention node, whether it is causal; None for any other node."""
    if node.op != "call_function" or node.target not in ATTENTION_OPS:
        return None
    schema = node.target._schema
    names = [a.name for a in schema.arguments]
    k = names.index("is_causal")
    value = node.args[k] if len(node.args) > k else node.kwargs.get("is_causal", schema.arguments[k].default_value)
    return bool(value)


def compute_time(flops, nbytes, dev: DeviceSpec, dtype: torch.dtype | str | None, causal: bool | None = None):
    """Roofline seconds: max(flops / rate(flops), nbytes / bandwidth, launch overhead).

    The bandwidth is the profile's ``op_bandwidth``: what Inductor's memory-bound kernels reach
    when it was measured, else the HBM copy bandwidth.

    The rate is the profile's measured matmul FLOP/s at this size when it has samples of
    ``dtype`` (``matmul_rate``), else ``peak(dtype) * matmul_efficiency``; for fused attention
    (``causal`` True or False, see ``attention_kind``) the measured attention rate when the
    profile has samples of that dtype and causality. ``flops`` and
    ``nbytes`` may be numbers or sympy expressions (``cost_model.symbolic``); the result is of
    the same kind. With ``flops == 0`` the dtype is not consulted (integer ops and ``None`` are fine)."""
    terms = [nbytes / dev.op_bandwidth]
    if not _is_zero(flops):
        curve = dev.attention_curve(dtype, causal) if causal is not None else None
        terms.append(flops / (curve_rate(flops, curve) if curve else matmul_rate(flops, dev, dtype)))
    if dev.launch_overhead > 0:
        terms.append(dev.launch_overhead)
    if any(_symbolic(t) for t in terms):
        import sympy
        return sympy.Max(*terms)
    return float(max(terms))


# AdamW reads the fp32 parameter, gradient and both moments and writes back all but the gradient.
ADAMW_TRAFFIC = 7.0
# A 16-bit working copy: forward reads the fp32 weight and writes 16 bits, backward reads the
# 16-bit gradient and writes fp32 (per fp32 parameter byte: 1.5 + 1.5).
WORKING_COPY_TRAFFIC = 3.0


def update_time(param_bytes: float, dev: DeviceSpec, *, working_copy: bool, optimizer_shards: int = 1,
                offload: bool = False) -> float:
    """Seconds a rank spends per step on its weights outside the forward and backward ops: the
    AdamW update of its ``param_bytes`` of fp32 parameters (of 1/``optimizer_shards`` of them
    under ZeRO-1), at ``optimizer_bandwidth``, and with ``working_copy`` the casts to and from a
    16-bit copy, at ``op_bandwidth`` (they run inside the compiled graph).

    With ``offload`` the update runs on the host (``offload_update_time``, priced apart): the casts
    stay (on the device: a 16-bit gradient up to fp32 for the copy out, the fp32 weight down to
    the 16-bit parameter after the copy in), the device's AdamW does not."""
    casts = WORKING_COPY_TRAFFIC * param_bytes / dev.op_bandwidth if working_copy else 0.0
    if offload:
        return casts
    optimizer = ADAMW_TRAFFIC * param_bytes / optimizer_shards / (dev.optimizer_bandwidth or dev.mem_bandwidth)
    return optimizer + casts


# Gradient elements an offloaded step stages on the host at once (1 GiB of fp32): large enough that
# a chunk's copies and its optimizer call dwarf their fixed costs, small beside the 12 bytes per
# parameter of the masters and AdamW's moments. The runtime's chunk (runtime/offload.py, checked equal
# by tests/runtime/test_offload.py: the cost model does not import the runtime).
OFFLOAD_CHUNK = 2**28


# Host memory bytes torch's fused CPU AdamW moves per fp32 parameter: it reads the weight, the
# gradient and the two moments and writes the weight and the moments back (7 x 4 bytes).
HOST_ADAMW_BYTES = 28.0


def check_host_figures(dev: DeviceSpec) -> None:
    """Refuse to price optimizer offload on a profile that does not say how fast its host is."""
    if not dev.host_bandwidth or not dev.host_adam_rate:
        raise ValueError(f"device {dev.name!r} has no host_bandwidth / host_adam_rate, which optimizer offload "
                         "is priced with: measure them with `python -m autopar calibrate --out dev.json`, or add "
                         "them to the profile (bytes/s of pinned copies each way; fp32 parameters/s of CPU AdamW)")


def offload_update_time(params: float, dev: DeviceSpec, *, chunk: int = OFFLOAD_CHUNK) -> float:
    """Seconds of an offloaded AdamW step over ``params`` fp32 parameters (ZeRO-Offload's), run in
    chunks of ``chunk`` parameters: chunk i's gradients copied out (4 bytes each, at
    ``host_bandwidth``), the CPU's AdamW over its masters (at ``host_adam_rate``), its weights
    copied back in. The copies of one chunk run while the host updates the chunk before or after
    (the copy streams run both ways at once, and each chunk's gradients have their own staging
    buffer), but they pass through the same host memory as the update, which is memory-bound: the
    update of chunk i then also moves the neighbours' copies, at the update's own memory rate
    (``HOST_ADAMW_BYTES`` per parameter at ``host_adam_rate``). With n chunks of p_i parameters,
    copy_i = 4 p_i / host_bandwidth and host_i = p_i / host_adam_rate:

        copy_1 + sum_i max(host_i + 4 (p_{i-1} + p_{i+1}) / (HOST_ADAMW_BYTES host_adam_rate),
                           copy_{i+1}, copy_{i-1}) + copy_n

    (a missing neighbour counts 0). Nothing overlaps the backward: the runtime copies a gradient out
    once the step's backward (one compiled autograd node, whose gradients all land at its end) and
    its dp sum are done. Without a GPU the copies are plain host copies, in turn (priced the same).
    Raises ValueError when the device profile does not say how fast its host is."""
    check_host_figures(dev)
    if params <= 0:
        return 0.0
    full, rest = divmod(params, chunk)
    sizes = [float(chunk)] * int(full) + ([rest] if rest else [])
    n = len(sizes)

    def near(i):   # the parameters of chunk i's neighbours, whose copies run during its update
        return (sizes[i - 1] if i else 0.0) + (sizes[i + 1] if i + 1 < n else 0.0)

    copy = [4.0 * p / dev.host_bandwidth for p in sizes] + [0.0]   # copy[-1] == copy[n]: no chunk
    middle = sum(max(sizes[i] / dev.host_adam_rate + 4.0 * near(i) / (HOST_ADAMW_BYTES * dev.host_adam_rate),
                     copy[i + 1], copy[i - 1] if i else 0.0) for i in range(n))
    return copy[0] + middle + copy[n - 1]


def matmul_rate(flops, dev: DeviceSpec, dtype: torch.dtype | str):
    """FLOP/s a matmul of ``flops`` FLOPs reaches on ``dev``: the measured curve (``curve_rate``)
    or ``peak * matmul_efficiency``."""
    curve = dev.matmul_curve(dtype)
    if curve is None:
        return dev.flops(dtype) * dev.matmul_efficiency
    return curve_rate(flops, curve)


def curve_rate(flops, curve: tuple[tuple[float, ...], tuple[float, ...]]):
    """The rate a measured (FLOPs, FLOP/s) curve gives at ``flops``: linear in log FLOPs between
    samples, constant beyond them; a sympy ``Piecewise`` for a sympy ``flops``."""
    xs, ys = curve
    # (rate as a function of flops, the largest flops it applies to), in order
    pieces = [(lambda x: ys[0], xs[0])]
    for i in range(len(xs) - 1):
        slope = (ys[i + 1] - ys[i]) / (math.log(xs[i + 1]) - math.log(xs[i]))
        pieces.append((lambda x, i=i, slope=slope: ys[i] + slope * (_log(x) - math.log(xs[i])), xs[i + 1]))
    if _symbolic(flops):
        import sympy
        return sympy.Piecewise(*[(f(flops), flops <= bound) for f, bound in pieces], (ys[-1], True))
    for f, bound in pieces:
        if flops <= bound:
            return f(flops)
    return ys[-1]


def _log(x):
    return sys.modules["sympy"].log(x) if _symbolic(x) else math.log(x)


def _is_zero(x) -> bool:
    # A sympy polynomial is zero only when it is the zero expression; numbers keep the old `<= 0`.
    return x == 0 if _symbolic(x) else x <= 0


def _symbolic(x) -> bool:
    """Whether ``x`` is a sympy expression. Only ``cost_model.symbolic`` builds them, after importing
    sympy; this module does not import it, which would cost every spawned rank 0.4 s."""
    if isinstance(x, (int, float)):   # the planner's case, without touching sympy's lazily loaded names
        return False
    sympy = sys.modules.get("sympy")
    return sympy is not None and isinstance(x, sympy.Basic)
