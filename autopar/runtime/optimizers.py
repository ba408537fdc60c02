"""Optimizers over a rank's shards: the ones ``pm.optimizer`` builds, and the guard on all the others.

``build_optimizer`` makes ``cls`` for how the rank keeps its gradients and weights: over the
shards themselves (fp32, or ZeRO-2/3's dp shards), the flat slice of ZeRO-1 and of the 16-bit
distributed optimizer (``runtime.zero``: fp32 masters beside 16-bit parameters), or host masters
(offload). Where the gradients do not live on the parameters (that slice, offload) a torch
optimizer built over ``pm.parameters()`` would step nothing, or step rounded 16-bit weights:
``OptimizerGuard`` sees every optimizer's step (torch.optim's global step pre-hook) and refuses
those, and those that hold the parameters ``parallelize`` replaced.
"""
from __future__ import annotations

import weakref

import torch
from torch.optim.optimizer import register_optimizer_step_pre_hook

from autopar.runtime.master_weights import MasterAdamW
from autopar.runtime.offload_optimizer import offloaded_optimizer


def build_optimizer(cls, groups, defaults: dict, *, params: dict[str, torch.nn.Parameter], zero, offload,
                    kept=frozenset(), guard: OptimizerGuard | None = None):
    """``cls`` over this rank's shards ``params``: ``groups`` as ``OptimizerGuard.groups`` checked
    them (None: every shard), ``defaults`` its keyword options; ``zero`` (``Zero1``: ZeRO-1's or the
    16-bit distributed optimizer's slice) and ``offload`` (``runtime.offload.Offload``) the rank's,
    None without; ``kept``: the FQNs whose state stays on the device under offload. An optimizer
    built here over the shards themselves (offload's device side) is told to ``guard`` as its own."""
    if offload is not None:
        if cls is MasterAdamW:
            raise ValueError("offload='optimizer' keeps the fp32 master weights in host memory and steps them with "
                             "torch's CPU optimizer; use pm.optimizer(torch.optim.AdamW, ...)")
        opt = offloaded_optimizer(cls, offload, groups, defaults, params=params, zero=zero, kept=kept)
        inner = getattr(opt, "offloaded", opt).split.device
        if guard is not None and inner is not None:
            guard.built.add(inner.optimizer)
        return opt
    if zero is not None:
        return zero.make_optimizer(cls, groups, **defaults)
    held = (list(params.values()) if groups is None else
            [{**options, "params": [params[f] for f in fqns]} for fqns, options in groups])
    return cls(held, **defaults)


class OptimizerGuard:
    """What tells the optimizers that can train a rank's shards ``params`` from those that cannot;
    ``replaced``: weak references, by id, to the parameters ``parallelize`` replaced
    (``parameters.adopt_shards``)."""

    def __init__(self, params: dict[str, torch.nn.Parameter], replaced: dict[int, weakref.ref]):
        self.params, self.replaced = params, replaced
        self.ids = {id(p) for p in params.values()}
        # optimizers found able to step, with what they were checked against: the hook runs before
        # every step of every optimizer, and an unchanged optimizer needs no second look
        self.passed: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
        self.built: weakref.WeakSet = weakref.WeakSet()   # pm.optimizer's own optimizers over the shards

    def install(self, owner, state) -> None:
        """Check every torch optimizer before its step, through torch.optim's global step pre-hook
        (the one way to see an optimizer that ``pm.optimizer`` did not build), against ``state(owner)``
        (the owner's (zero, offload)). The hook holds ``owner`` weakly and is removed when
        ``owner`` is collected."""
        ref = weakref.ref(owner)

        def hook(optimizer, args, kwargs):
            alive = ref()
            if alive is not None:
                self.check(optimizer, *state(alive))

        handle = register_optimizer_step_pre_hook(hook)
        weakref.finalize(owner, handle.remove)

    def _was_replaced(self, p) -> bool:
        return (r := self.replaced.get(id(p))) is not None and r() is p

    def check(self, optimizer: torch.optim.Optimizer, zero, offload) -> None:
        """Raise if ``optimizer`` is about to step tensors whose gradients this rank never fills."""
        seen = (sum(len(g["params"]) for g in optimizer.param_groups), zero is None, offload is None)
        if self.passed.get(optimizer) == seen or optimizer in self.built:
            return
        held = [p for group in optimizer.param_groups for p in group["params"]]
        name = type(optimizer).__name__
        if any(self._was_replaced(p) for p in held):
            raise RuntimeError(f"{name} holds the parameters the model had before autopar.parallelize replaced "
                               "them with this rank's shards, and those get no gradients: build the optimizer "
                               "after parallelize, over pm.parameters() (the model's parameters are now the "
                               "same tensors), or with pm.optimizer(...)")
        if (zero is None and offload is None) or not any(id(p) in self.ids for p in held):
            self.passed[optimizer] = seen
            return
        if offload is not None:
            raise RuntimeError(f"offload='optimizer': the fp32 master weights live in host memory and the step runs "
                               f"there, so {name} over pm.parameters() (the device's working weights) would offload "
                               f"nothing and, at 16 bits, update rounded weights; build it with "
                               f"pm.optimizer({name}, ...)")
        if zero.dtype is not None:
            raise RuntimeError(f"at 16 bits the parameters are {str(zero.dtype).replace('torch.', '')} copies of fp32 "
                               f"master weights that pm.optimizer(...) steps, and their gradients go to fp32 buffers "
                               f"(p.grad stays None), so {name} over pm.parameters() would never update them; "
                               f"build it with pm.optimizer({name}, ...)")
        raise RuntimeError(f"zero=1: train_step reduce-scatters the gradients into the dp shard that "
                           f"pm.optimizer(...) steps and leaves p.grad of pm.parameters() None, so {name} "
                           f"over them would never update them; build it with pm.optimizer({name}, ...)")

    def groups(self, params) -> list[tuple[list[str], dict]] | None:
        """``pm.optimizer``'s ``params`` as (FQNs, options) per group, checked; None for every shard."""
        if params is None:
            return None
        if isinstance(params, (torch.Tensor, dict)):
            raise TypeError(f"pm.optimizer(cls, params): params is one {type(params).__name__}; pass an iterable "
                            "of parameters or a list of group dicts, as torch optimizers take them "
                            "(e.g. [p] or [{'params': [p], 'weight_decay': 0.0}])")
        given = list(params)
        if not given:
            raise ValueError("pm.optimizer(cls, params): params is empty; pass this rank's parameters "
                             "(pm.parameters()) or groups of them, or leave params out for all of them")
        dicts = [isinstance(g, dict) for g in given]
        if any(dicts) and not all(dicts):
            raise TypeError("pm.optimizer(cls, params): params mixes group dicts and tensors; put every "
                            "parameter in a group dict, {'params': [...], **options}")
        if not any(dicts):
            given = [{"params": given}]
        fqn_of = {id(p): fqn for fqn, p in self.params.items()}
        where: dict[str, int] = {}
        out = []
        for k, group in enumerate(given):
            if "params" not in group:
                raise ValueError(f"parameter group {k} has no 'params' key; each group is "
                                 "{'params': [...], **options}")
            members = group["params"]
            fqns = []
            for p in [members] if isinstance(members, torch.Tensor) else list(members):
                fqn = fqn_of.get(id(p))
                if fqn is None and self._foreign(p, k):
                    continue
                if fqn in where:
                    twice = (f"twice in parameter group {k}" if where[fqn] == k
                             else f"in parameter groups {where[fqn]} and {k}")
                    raise ValueError(f"{fqn} is {twice} (tied weights are one tensor under all their names): put "
                                     "each parameter in one group, once")
                where[fqn] = k
                fqns.append(fqn)
            out.append((fqns, {key: value for key, value in group.items() if key != "params"}))
        return out

    def _foreign(self, p, k: int) -> bool:
        """For a tensor of group ``k`` that is not one of this rank's shards: True (leave it out) for a
        0-element parameter, the weight of a pipeline stage this rank does not run; else raise."""
        if not isinstance(p, torch.Tensor):
            raise TypeError(f"parameter group {k} holds a {type(p).__name__}, not a tensor: pass this rank's "
                            "parameters (pm.parameters())")
        if self._was_replaced(p):
            raise ValueError(f"parameter group {k} holds a parameter the model had before autopar.parallelize "
                             "replaced it with this rank's shard; build the groups after parallelize, from "
                             "pm.named_parameters() or the model's (now the same tensors)")
        if p.numel() == 0:
            return True
        raise ValueError(f"parameter group {k} holds a tensor of shape {tuple(p.shape)} that is not one of this "
                         "rank's parameters (a tensor of another model?); build the groups from "
                         "pm.named_parameters() or the parallelized model's named_parameters()")
