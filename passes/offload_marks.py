"""Per-unit gradient markers for optimizer offload: the backward reports each unit's final gradients.

A compiled backward is one autograd node, so hooks on the parameters fire only at its end. This
pass routes every parameter of an offloaded unit through ``unit_mark`` (an identity autograd
Function over all of that unit's parameters, placed right after the placeholders): autograd calls
its backward once the gradients of all its outputs are summed, i.e. once every use of those
parameters in the backward (a tied weight's uses in later units included) has added to them.
That backward calls ``autopar::offload_unit_ready``, a custom op registered as an ordered effect,
so AOTAutograd keeps it in the compiled backward (it returns nothing) and keeps the markers in
backward order; eagerly it is an ordinary call. Its implementation hands the unit's gradients to
whatever ``set_listener`` installed (``runtime.offload``), or does nothing without one.

Where the gradients are final at that point: without a dp or cp sum after the backward (data = 1)
or with ZeRO-2/3, whose gathers reduce-scatter inside the backward (``runtime.program``).
"""
from __future__ import annotations

import operator
from typing import Optional

import torch
from torch.fx import GraphModule
from torch.library import custom_op

from autopar.graph.capture import copy_graph

from torch._higher_order_ops.effects import _EffectType, _register_effectful_op

_LISTENER: list = [None]


def set_listener(fn) -> None:
    """``fn(unit, grads)`` is called by every unit marker's backward from now on (None: nobody)."""
    _LISTENER[0] = fn


@custom_op("autopar::offload_unit_ready", mutates_args=())
def offload_unit_ready(grads: list[Optional[torch.Tensor]], unit: int) -> None:
    """The gradients of unit ``unit``'s offloaded parameters are final, in the marker's order (None:
    a parameter the step did not use); a side effect only."""
    fn = _LISTENER[0]
    if fn is not None:
        fn(unit, grads)


@offload_unit_ready.register_fake
def _(grads, unit):
    return None


if hasattr(offload_unit_ready, "register_effect"):
    offload_unit_ready.register_effect(_EffectType.ORDERED)
else:   # torch before CustomOpDef.register_effect (2.11): the registry takes the overload
    _register_effectful_op(torch.ops.autopar.offload_unit_ready.default, _EffectType.ORDERED)


class _UnitMark(torch.autograd.Function):
    @staticmethod
    def forward(ctx, unit, *params):
        ctx.unit = unit
        ctx.set_materialize_grads(False)   # a parameter the step did not use has no gradient, as unmarked
        return tuple(p.view_as(p) for p in params)

    @staticmethod
    def backward(ctx, *grads):
        torch.ops.autopar.offload_unit_ready(list(grads), ctx.unit)
        return (None, *grads)


def unit_mark(unit: int, *params: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """``params`` unchanged; their summed gradients are reported as unit ``unit``'s (see the module docstring)."""
    return _UnitMark.apply(unit, *params)


def offload_marks_pass(gm: GraphModule, *, units: dict[int, tuple[str, ...]]) -> GraphModule:
    """Every parameter placeholder of ``units`` (unit index -> FQNs) read through its unit's marker."""
    out = copy_graph(gm)
    g = out.graph
    by_fqn = {n.meta.get("fqn"): n for n in g.nodes if n.op == "placeholder" and n.meta.get("kind") == "param"}
    last = [n for n in g.nodes if n.op == "placeholder"][-1]
    at = last
    for k, fqns in sorted(units.items()):
        missing = [f for f in fqns if f not in by_fqn]
        if missing:
            raise ValueError(f"offload_marks_pass: unit {k}'s parameters {', '.join(missing)} are not inputs of "
                             "this graph")
        phs = [by_fqn[f] for f in fqns]   # all of them, in order: the runtime reads the gradients by position
        users = {ph: list(ph.users) for ph in phs}
        with g.inserting_after(at):
            mark = g.call_function(unit_mark, (k, *phs))
        mark.meta["origin"] = f"offload_mark.{k}"
        at = mark
        for i, ph in enumerate(phs):
            with g.inserting_after(at):
                item = g.call_function(operator.getitem, (mark, i))
            item.meta.update({key: v for key, v in ph.meta.items() if key in ("val",)})
            item.meta["origin"] = mark.meta["origin"]
            at = item
            for user in users[ph]:
                user.replace_input_with(ph, item)
    g.lint()
    out.recompile()
    return out

