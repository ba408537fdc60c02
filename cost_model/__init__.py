"""Cost model: prices every candidate the planner considers, in seconds and bytes.

- Devices (``DeviceSpec``, ``DEVICES``, ``get_device``): peak dense FLOP/s per dtype, HBM
  bandwidth and size, and two network tiers (NVLink inside a node, InfiniBand between nodes),
  from data-sheet presets or a calibrated JSON profile; ``preset_for_gpu`` names the preset for
  a GPU by its name.
- Communication (``collective_time``): alpha-beta model of ring collectives. For n ranks and a
  full tensor of B bytes, all-reduce moves 2(n-1)/n * B per rank in 2(n-1) steps; all-gather,
  reduce-scatter and all-to-all move (n-1)/n * B in n-1 steps; time = bytes / bw + steps * alpha.
  An axis whose ranks span nodes (``axis_is_inter_node``) is priced at the inter-node tier.
- Compute (``op_flops``, ``node_flops``, ``node_bytes``, ``compute_time``): FLOPs from PyTorch's
  flop counter on meta tensors, bytes from the FX node's tensor metadata, and a roofline time
  max(FLOPs / rate, bytes / HBM bandwidth), the rate measured by ``calibrate`` (matmuls, and
  fused attention separately) where a profile has it, else peak * matmul_efficiency.
- ``strategy``: an op's time under a sharding strategy, its parameter bytes, the tp collectives
  a set of strategies makes the rewrite emit; ``stages``: pipeline units' time and bytes, the
  microbatches a schedule keeps in flight, the pipeline's makespan; ``step``: the one step-time
  sum (``step_time``), the dp gradient sync and the optimizer update; ``memory``: activations
  kept under torch.compile and the per-rank memory of a stage.
- ``calibrate`` measures a device profile; ``symbolic`` gives a plan's costs as sympy
  expressions in batch and sequence length.
"""
from .comm import axis_is_inter_node, collective_bytes_on_wire, collective_time, summed_bytes
from .compute import attention_kind, compute_time, node_bytes, node_flops, op_flops
from .devices import DEVICES, DeviceSpec, get_device, preset_for_gpu

__all__ = [
    "DeviceSpec", "DEVICES", "get_device", "preset_for_gpu",
    "collective_time", "collective_bytes_on_wire", "axis_is_inter_node", "summed_bytes",
    "op_flops", "node_flops", "node_bytes", "compute_time", "attention_kind",
]
