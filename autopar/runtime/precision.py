"""Mixed precision: 16-bit compute, fp32 reductions, dynamic loss scaling.

``precision="bf16"`` or ``"fp16"`` runs the forward and backward at 16 bits. What a rank holds
for its weights is ``autopar.runtime.zero``'s: below ZeRO-2 and without offload the parameters
themselves are 16-bit (the graph computes on them: no working copy), their gradients are summed
in an fp32 buffer and the fp32 master weights and optimizer state are a flat slice the optimizer
steps (Megatron-LM's distributed optimizer); ZeRO-2/3 gather their fp32 dp shards at 16 bits in
the graph. Where the weights a rank computes with are still fp32 (optimizer offload under ZeRO-1,
whose device parameters the host slice is copied into), they are cast per step:

- With one microbatch on one stage the weights enter the compiled graph and ``precision_pass``
  casts them there, where Inductor fuses the casts into its kernels (a cast of a 16-bit parameter
  is none). With several microbatches, or a pipeline, ``WorkingCopies`` casts each parameter
  once, when the step's first microbatch needs it, and later microbatches use that copy: a cast
  in the graph would run once per microbatch, and autograd keeps its 16-bit output for the
  matmul's backward, so every microbatch in flight would hold its own copy of the weights.

- Inside the graph (``precision_pass``, in ``autopar.passes.precision`` with the other graph
  pieces of this recipe): floating inputs and buffers are cast to the compute dtype
  where first used, except by the ops that compute tables from buffers (rotary cos/sin), which
  run at the dtype they were traced at; loss ops (cross-entropy and the like) take fp32 inputs, and the graph returns an
  fp32 loss.

- fp32 reductions. ``autopar.collectives`` sums every all-reduce and reduce-scatter of a 16-bit
  tensor in fp32, forward and backward; the cost model prices them at fp32 bytes.

- The cost model sees the compute dtype. ``retype_pass`` re-propagates the tensor metadata of a
  copy of the captured graph (the capture itself stays as traced) with 16-bit placeholders, so
  compute is priced at the device's bf16/fp16 peak, activations, all-gathers and pipeline sends
  at 2 bytes per element; what the parameters hold is ``cost_model.state``'s table.

- fp16's range is narrow, so its loss is scaled (``LossScaler``: Megatron-LM's dynamic recipe).
"""
from __future__ import annotations

import contextlib

import torch

from autopar import collectives as C
from autopar.graph.precision import cast, compute_dtype


# ---- the per-rank program -------------------------------------------------------------------

class WorkingCopies:
    """The 16-bit copies of fp32 parameters and buffers that a training step computes with.

    Inside ``step()`` each tensor is cast once, when a microbatch first asks for it, and later
    microbatches get the same copy; outside a step, or with grad disabled (a pipeline stage's
    shape inference), every call casts afresh, so a forward-only call after an optimizer step
    sees the new weights. At fp32 the tensors pass through, and so do tensors not in ``names``
    (buffers: the graph casts them where they are used, see ``precision_pass``)."""

    def __init__(self, precision: str, names=None):
        # "fp32" runs the model as it is: a model built in another dtype is not cast
        self.dtype = None if precision == "fp32" else compute_dtype(precision)
        self.names = None if names is None else set(names)
        self._copies: dict[str, torch.Tensor] | None = None

    @contextlib.contextmanager
    def step(self):
        """Share one copy of each tensor among the microbatches run inside this block."""
        self._copies = {}
        try:
            yield
        finally:
            self._copies = None   # the step's autograd graph is gone; let its copies go too

    def __call__(self, name: str, tensor: torch.Tensor) -> torch.Tensor:
        """``tensor`` (named ``name``) at the compute dtype."""
        if self.dtype is None or (self.names is not None and name not in self.names):
            return tensor
        if self._copies is None or not torch.is_grad_enabled():   # a no-grad copy must not be shared
            return cast(tensor, self.dtype)
        if name not in self._copies:
            self._copies[name] = cast(tensor, self.dtype)
        return self._copies[name]


# ---- fp16 loss scaling ---------------------------------------------------------------------

class LossScaler:
    """Dynamic loss scaling (Megatron-LM's original fp16 recipe).

    The loss is multiplied by ``scale`` before backward so small fp16 gradients do not flush to
    zero. After the gradients are synchronised, ``unscale_`` divides them by ``scale`` and looks
    for inf/nan; the finding is all-reduced over every rank, so all ranks skip an overflowed step
    together. An overflow multiplies the scale by ``backoff`` (halves it); ``growth_interval``
    clean steps in a row multiply it by ``growth`` (double it)."""

    def __init__(self, scale: float = 2.0**16, growth_interval: int = 1000, backoff: float = 0.5,
                 growth: float = 2.0, min_scale: float = 1.0):
        self.scale = float(scale)
        self.growth_interval = growth_interval
        self.backoff = backoff
        self.growth = growth
        self.min_scale = min_scale
        self.clean_steps = 0

    def unscale_(self, grads: list[torch.Tensor], group: str, device: torch.device) -> bool:
        """Divide ``grads`` by the scale in place; True (on every rank of ``group``) if any rank found inf/nan.

        Updates the scale for the next step."""
        found = torch.zeros(1, device=device)
        if grads:
            inv = torch.full((1,), 1.0 / self.scale, device=device)
            torch._amp_foreach_non_finite_check_and_unscale_(grads, found, inv)
        overflow = bool(C.all_reduce(found, group).item())
        self.update(overflow)
        return overflow

    def update(self, overflow: bool) -> None:
        """Halve the scale after an overflow; double it after ``growth_interval`` clean steps."""
        if overflow:
            self.scale = max(self.scale * self.backoff, self.min_scale)
            self.clean_steps = 0
            return
        self.clean_steps += 1
        if self.clean_steps == self.growth_interval:
            self.scale *= self.growth
            self.clean_steps = 0

    def state_dict(self) -> dict:
        """The scale and the clean-step count, for checkpoints."""
        return {"scale": self.scale, "clean_steps": self.clean_steps}

    def load_state_dict(self, state: dict) -> None:
        """Resume from ``state_dict()``'s output."""
        self.scale = float(state["scale"])
        self.clean_steps = int(state["clean_steps"])
