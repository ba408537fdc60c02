"""The device a rank runs on, for the tensors the forward itself creates."""
from __future__ import annotations

import torch
from torch.fx import GraphModule

from autopar.graph.capture import copy_graph


def device_pass(gm: GraphModule, *, device: torch.device) -> GraphModule:
    """Make on ``device`` the tensors that factory ops (arange, zeros, full, ...) created on the capture's device.

    A model captured on the meta device (planned offline, then initialised shard by shard) or on
    another device than the rank's bakes that device into every tensor its forward creates, such as
    the position ids; left so, a meta ``arange`` feeds garbage to the embedding. Explicit moves
    (``x.to(device)``) are left alone: they say where the user wants a tensor. The nodes' traced
    values (``meta["val"]``) stay the capture's: a pass that traces the graph runs before this one."""
    out = copy_graph(gm)
    captured = {v.device for n in out.graph.nodes if n.op == "placeholder"
                and isinstance(v := n.meta.get("val"), torch.Tensor)} | {torch.device("meta")}
    moves = {torch.ops.aten.to.device, torch.ops.aten._to_copy.default, torch.ops.aten.to.dtype_layout}
    for n in out.graph.nodes:
        made_on = n.kwargs.get("device") if n.op == "call_function" else None
        if made_on is not None and n.target not in moves and torch.device(made_on) in captured \
                and torch.device(made_on) != device:
            n.kwargs = {**n.kwargs, "device": device}
    return out
