"""A rank's tensors: its parameter shards made from the model, its buffers, and the model made to hold them.

``materialize`` makes the shards a program names (``Program.params``): sliced from real weights,
or for a model on the meta device initialised shard by shard (``model.init_parameter``), so a
rank never holds a full weight it does not compute with. ``adopt_shards`` then puts them into the
model, as FSDP2's ``fully_shard`` does, so the model's parameters and the rank's are the same tensors.
"""
from __future__ import annotations

import hashlib
import weakref

import torch

from autopar import collectives as C
from autopar.passes.token_mean import scale_name, token_losses
from autopar.placement import shard_tensor


def materialize(model, program) -> dict[str, torch.nn.Parameter]:
    """This rank's shards of ``program.params`` (a ``runtime.program.Program``), on its device, in
    its order: each tp shard sliced from the model's weight, or for a weight on the meta device
    made by ``model.init_parameter(fqn, tensor)`` (seeded by the FQN and the tp rank, so the dp
    replicas agree); with ZeRO-2/3 only this rank's rows of it (zero past the end)."""
    full = dict(model.named_parameters())
    out = {}
    for fqn, held in program.params.items():
        p = full[fqn]
        tp, rank = program.mesh.tp, program.coords["tp"]
        if p.is_meta:
            init = getattr(model, "init_parameter", None)
            if init is None:
                raise ValueError(f"{fqn} is on the meta device and {type(model).__name__} has no "
                                 "init_parameter(fqn, tensor) method; build the model on a real device "
                                 "or give it one")
            local = torch.empty(held.tp_shape, dtype=p.dtype, device=program.device)
            seed = int(hashlib.sha256(f"{fqn}/{rank}".encode()).hexdigest()[:8], 16)
            with torch.random.fork_rng(devices=[]):
                torch.manual_seed(seed)
                init(fqn, local)
        else:
            local = shard_tensor(p.detach().to(program.device), held.placement, tp, rank)
        if held.rows is not None:
            local = _rows(local, *held.rows, held.local_shape[0])
        out[fqn] = torch.nn.Parameter(local, requires_grad=p.requires_grad)
    return out


def _rows(x: torch.Tensor, start: int, stop: int, rows: int) -> torch.Tensor:
    """Rows [start, stop) of ``x`` in a tensor of ``rows`` rows, zero past ``stop``."""
    shard = torch.zeros((rows, *x.shape[1:]), dtype=x.dtype, device=x.device)
    shard[:stop - start] = x.detach()[start:stop]
    return shard


def rank_buffers(model, cap, device) -> tuple[dict[str, torch.Tensor], list[str]]:
    """The buffers this rank's graphs read, by FQN (the model's, torch.export's lifted constants and
    the scale of each token-mean loss, ``passes.token_mean``), and those the module's own
    ``state_dict`` holds (what checkpoints and exports carry). A buffer on the meta device raises."""
    buffers = {fqn: b for fqn, b in model.named_buffers() if fqn in cap.buffers}
    unknown = [fqn for fqn, b in buffers.items() if b.is_meta]
    if unknown:
        raise ValueError(f"the buffer(s) {', '.join(unknown)} are on the meta device, so their values are "
                         "unknown: build the model on a real device, or register them again with their values "
                         "before parallelize (module.register_buffer(name, tensor), e.g. a rotary table)")
    buffers.update(cap.constant_tensors(device))
    persistent = [fqn for fqn in model.state_dict(keep_vars=True) if fqn in buffers]
    # written before every forward (ParallelModel._prepare)
    buffers.update({scale_name(k): torch.ones((), device=device) for k in range(len(token_losses(cap.gm)))})
    return buffers, persistent


def summed_params(gm: torch.fx.GraphModule) -> set[str]:
    """The weights ``gm`` feeds to a collective (``copy_to``: their gradients are summed over tp),
    which keep an fp32 copy at 16 bits so that sum is not rounded."""
    return {n.meta.get("fqn") for n in gm.graph.nodes if n.op == "placeholder"
            and n.meta.get("kind") == "param" and any(u.target in C.COLLECTIVE_FUNCTIONS for u in n.users)}


def mark_static(tensors) -> None:
    """Keep ``tensors`` at their addresses for Inductor's CUDA graphs, which read them where they were recorded."""
    for t in tensors:
        torch._dynamo.mark_static_address(t)


def adopt_shards(model, local: dict[str, torch.nn.Parameter], fqns, device) -> dict[int, weakref.ref]:
    """Make ``model``'s parameters (canonical ``fqns``) the shards ``local``, every name of a tied
    weight the same shard, one this rank does not hold an empty tensor. Returns weak references to
    the replaced tensors by id, so that an optimizer still holding one can be recognised (the
    weak reference, unlike the id alone, cannot mistake a new tensor at a reused address)."""
    names: dict[int, list[str]] = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        names.setdefault(id(p), []).append(name)
    full = dict(model.named_parameters(remove_duplicate=False))
    replaced = {}
    for fqn in fqns:
        old = full[fqn]
        new = local.get(fqn)
        if new is None:
            new = torch.nn.Parameter(torch.empty(0, dtype=old.dtype, device=device), requires_grad=old.requires_grad)
        replaced[id(old)] = weakref.ref(old)
        for name in names[id(old)]:
            owner, _, attr = name.rpartition(".")
            setattr(model.get_submodule(owner), attr, new)
    return replaced


def refuse_unsharded_call(module, args):
    """A forward pre-hook for a module whose parameters are now a rank's shards: it raises, naming what to run."""
    raise RuntimeError(f"this {type(module).__name__} was given to autopar.parallelize: its parameters are now "
                       "this rank's shards, not its full weights, so it no longer runs on its own; run "
                       "pm.train_step(...) (or pm.eval_step(...) for the loss alone), or load "
                       "pm.full_state_dict() into a freshly built model")
