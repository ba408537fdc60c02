"""The optimizer ``pm.optimizer(cls, ...)`` builds under optimizer offload, whole or partial.

Its parameters are split in two (``runtime.offload``): the host masters of the offloaded units and
the device tensors of the units ``plan.offload_kept`` keeps. Each side has a torch optimizer of
``cls`` in the same parameter groups (a group may be empty on one side): the host's over the
masters (fused on the CPU where torch has the kernel, else foreach), the device's over the kept
shards (fused on the device where it has the kernel). Under ZeRO-1 the pieces are runs of the
flat slice (``zero.Zero1.slice_runs``), cut at group and at kept/offloaded boundaries: a kept
run is a view of the device slice, an offloaded one a view of its host master.

To everything outside it is one torch optimizer: ``param_groups`` lists each group's pieces in
order (host masters and device tensors), a learning-rate scheduler writes its options there and
a step hands them to both sides; ``state_dict`` numbers the pieces as one optimizer would, so a
checkpoint (``autopar.checkpoint``) finds each parameter's state under its name whichever side
holds it, and ``load_state_dict`` gives each side its pieces' state (torch moves each tensor to
its piece's device). A side keeps its own kernel options (``fused``, ``foreach``, ...) across a load.
"""
from __future__ import annotations

import functools

import torch

from autopar.runtime.offload import HostMasters, Offload, device_optimizer, host_optimizer
from autopar.runtime.zero import SliceOptimizer, Zero1, Zero1Optimizer

# options that say how a side computes, not what: each side keeps its own
_IMPL = ("fused", "foreach", "capturable", "differentiable")


class Side:
    """One side's torch optimizer, and the views it steps whose gradients are views of another
    tensor's: (piece, source, start, stop), the piece's gradient ``source.grad[start:stop]``."""

    def __init__(self, optimizer: torch.optim.Optimizer, views=()):
        self.optimizer, self.views = optimizer, list(views)
        self.param_groups = optimizer.param_groups

    def step(self):
        """The optimizer's step, each view's gradient taken from its source first."""
        for piece, source, a, b in self.views:
            piece.grad = None if source.grad is None else source.grad.view(-1)[a:b]
        try:
            return self.optimizer.step()
        finally:
            for piece, *_ in self.views:
                piece.grad = None


class SplitOptimizer:
    """``pieces``: per parameter group, (tensor, on the host) of each piece in order; ``options``:
    each group's own options; ``make(device, param_groups)`` builds a side's torch optimizer;
    ``views``: (piece, source, start, stop) of the pieces whose gradients are views (ZeRO-1)."""

    def __init__(self, pieces: list[list[tuple[torch.Tensor, bool]]], options: list[dict], make, views=()):
        views = {id(v[0]): v for v in views}
        self.host = self.device = None
        self._where: list[list[tuple[int, int]]] = []   # per group: (side: 0 device 1 host, index in its state_dict)
        counts = [0, 0]
        for group in pieces:
            self._where.append([])
            for t, on_host in group:
                self._where[-1].append((int(on_host), counts[int(on_host)]))
                counts[int(on_host)] += 1
        for side in (0, 1):
            if counts[side]:
                groups = [{**opts, "params": [t for t, h in g if int(h) == side]} for g, opts in zip(pieces, options)]
                held = [views[id(t)] for g in pieces for t, h in g if int(h) == side and id(t) in views]
                made = Side(make(side == 0, groups), held)
                if side:
                    self.host = made
                else:
                    self.device = made
        first = self.host or self.device
        self.param_groups = [{**_options(g), "params": [t for t, _ in group]}
                             for g, group in zip(first.param_groups, pieces)]

    @property
    def sides(self) -> list[Side]:
        return [s for s in (self.device, self.host) if s is not None]

    def sync_groups(self) -> None:
        """Hand each group's options (a scheduler's learning rate) to both sides."""
        for k, group in enumerate(self.param_groups):
            for side in self.sides:
                side.param_groups[k].update({key: v for key, v in _options(group).items() if key not in _IMPL})

    def state_dict(self) -> dict:
        """One torch optimizer's state dict over every piece, numbered group by group."""
        sds = [s.optimizer.state_dict() if s is not None else None for s in (self.device, self.host)]
        state, groups, at = {}, [], 0
        for group, where in zip(self.param_groups, self._where):
            indices = []
            for side, i in where:
                if i in sds[side]["state"]:
                    state[at] = sds[side]["state"][i]
                indices.append(at)
                at += 1
            groups.append({**_options(group), "params": indices})
        return {"state": state, "param_groups": groups}

    def load_state_dict(self, sd: dict) -> None:
        """Each side's pieces' state and every group's options from ``sd`` (a ``state_dict`` of this layout)."""
        if len(sd["param_groups"]) != len(self.param_groups):
            raise ValueError(f"the state dict has {len(sd['param_groups'])} parameter groups and this optimizer "
                             f"{len(self.param_groups)}")
        for k, (saved, where) in enumerate(zip(sd["param_groups"], self._where)):
            if len(saved["params"]) != len(where):
                raise ValueError(f"parameter group {k} of the state dict holds {len(saved['params'])} tensors and "
                                 f"this optimizer's {len(where)}")
        for side_index, side in ((0, self.device), (1, self.host)):
            if side is None:
                continue
            state, groups = {}, []
            for saved, where, mine in zip(sd["param_groups"], self._where, side.param_groups):
                indices = []
                for ci, (s, i) in zip(saved["params"], where):
                    if s == side_index:
                        if ci in sd["state"]:
                            state[i] = sd["state"][ci]
                        indices.append(i)
                groups.append({**_options(saved), **{k: mine[k] for k in _IMPL if k in mine}, "params": indices})
            side.optimizer.load_state_dict({"state": state, "param_groups": groups})
        for group, saved in zip(self.param_groups, sd["param_groups"]):
            group.update({k: v for k, v in _options(saved).items() if k not in _IMPL})


class OffloadOptimizer:
    """What ``pm.optimizer`` returns under offload: a ``SplitOptimizer`` stepped as ``offload``
    (an ``runtime.offload.Offload``) says, then with ``zero`` (ZeRO-1) the slice's all-gather.
    ``param_groups``, ``state_dict`` and ``load_state_dict`` are the split's (one torch optimizer's)."""

    def __init__(self, offload: Offload, split: SplitOptimizer, zero: Zero1 | None = None):
        self.offload, self.split, self.zero = offload, split, zero
        self.param_groups = split.param_groups

    @property
    def host_inner(self) -> Side | None:
        """The host's side (what the host's updates step)."""
        return self.split.host

    def sync_groups(self) -> None:
        self.split.sync_groups()

    @torch.no_grad()
    def step(self, closure=None):
        """The device's update of the kept pieces launched, the host's of the offloaded ones run
        beside it (in the backward already, or one step late: ``runtime.offload``), the weights in."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        off, host, split = self.offload, self.offload.host, self.split
        if off.stepped:   # the host updated in the backward
            off.settle()
            off.stepped = hosted = False
        else:
            off.worker.drain()
            host.pull_changed()
            if off.pending:   # the last step's delayed update comes in now
                host.weights_in(wait=False)
                off.pending = False
            hosted = split.host is not None
        split.sync_groups()
        if hosted:
            host.start()   # the copies out wait for the backward, not for the device's update
        if split.device is not None:
            split.device.step()
        if hosted and off.delay:
            grads = host.gradients()
            off.worker.submit(lambda: host.update(split.host, grads, weights=False))
            off.pending = True
        elif hosted:
            host.update(split.host, host.gradients())
        host.landed()
        host.note_versions()
        if self.zero is not None:
            self.zero.all_gather_params()
        return loss

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Drop every gradient (always set to None)."""
        self.offload.host.zero_grad()
        if self.split.device is not None:
            for group in self.split.device.param_groups:
                for p in group["params"]:
                    p.grad = None
        if self.zero is not None:
            self.zero.shard.grad = None
            for p in self.zero.params:
                p.grad = None

    def state_dict(self):
        """Both sides' state as one optimizer's (after any host update under way)."""
        self.offload.worker.drain()
        return self.split.state_dict()

    def load_state_dict(self, state) -> None:
        """Load one optimizer's state into both sides."""
        self.offload.worker.drain()
        self.split.load_state_dict(state)


class Zero1OffloadOptimizer(Zero1Optimizer):
    """ZeRO-1 with the offloaded runs of its flat dp slice on the host: to checkpoints a
    ``Zero1Optimizer`` (``sliced``: the slice's ranges, each piece a device view or a host master's)."""

    def __init__(self, zero: Zero1, sliced: SliceOptimizer, offloaded: OffloadOptimizer):
        super().__init__(zero, sliced)
        self.offloaded = offloaded

    def step(self, closure=None):
        """The split step over the slice, then the all-gather that rebuilds every local shard."""
        return self.offloaded.step(closure)

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.offloaded.zero_grad()

    def state_dict(self):
        return self.offloaded.state_dict()

    def load_state_dict(self, state):
        self.offloaded.load_state_dict(state)


def offloaded_optimizer(cls, offload: Offload, groups, defaults: dict, *, params: dict[str, torch.Tensor],
                        zero: Zero1 | None = None, kept=frozenset()):
    """``cls`` over ``offload``'s host masters and the device tensors of ``kept`` (FQNs), as
    ``pm.optimizer`` builds it: ``groups`` None (every parameter) or [(FQNs, options)] per
    parameter group; ``params`` the rank's shards by FQN; with ``zero``, over ZeRO-1's slice,
    whose offloaded runs ``offload``'s masters hold (``slice_masters``)."""
    host = offload.host
    make = functools.partial(_make, cls, defaults)
    if zero is not None:
        return _zero1_optimizer(offload, groups, make, zero, kept)
    if groups is None:
        groups = [(list(params), {})]
    pieces = []
    for fqns, _ in groups:
        # a parameter with no elements (another stage's) is never stepped: left out of its group
        pieces.append([(host.masters[f], True) if f in host.masters else (params[f], False)
                       for f in fqns if f in host.masters or (f in kept and params[f].numel())])
    split = SplitOptimizer(pieces, [options for _, options in groups], make)
    opt = OffloadOptimizer(offload, split)
    offload.armed = opt
    return opt


def _zero1_optimizer(offload: Offload, groups, make, zero: Zero1, kept) -> Zero1OffloadOptimizer:
    """ZeRO-1's split: the slice's runs by group and side, each a device view or a view of its host run."""
    host = offload.host
    if groups is None:
        groups = [(list(zero.fqns), {})]
    group_of = {fqn: k for k, (fqns, _) in enumerate(groups) for fqn in fqns}
    runs = sorted(zero.slice_runs(lambda f: (group_of[f], f not in kept) if f in group_of else None))
    hosted = [(int(name.split(":")[1]), master) for name, master in host.masters.items()]
    flat = zero.shard.detach()
    ranges, pieces, views = [], [[] for _ in groups], []
    for (k, on_host), a, b in runs:
        if on_host:
            start, master = next((s, m) for s, m in hosted if s <= a < s + m.numel())
            piece = master[a - start:b - start]
            views.append((piece, master, a - start, b - start))
        else:
            piece = flat[a:b]
            views.append((piece, zero.shard, a, b))
        ranges.append((k, a, b))
        pieces[k].append((piece, on_host))
    split = SplitOptimizer(pieces, [options for _, options in groups], make, views)
    offloaded = OffloadOptimizer(offload, split, zero)
    sliced = SliceOptimizer(zero.shard, ranges, [options for _, options in groups], group_of,
                            lambda _: split, pieces=[p for group in pieces for p, _ in group])
    offload.armed = offloaded
    return Zero1OffloadOptimizer(zero, sliced, offloaded)


def slice_masters(zero: Zero1, kept) -> HostMasters:
    """The host masters of ZeRO-1's slice under offload: one per maximal run of offloaded
    parameters, named "slice:<start>", its gradient the same run of the slice's."""
    runs = zero.slice_runs(lambda f: True if f not in kept else None)
    flat = zero.shard.detach()
    spans = {f"slice:{a}": (a, b) for _, a, b in runs}

    def grad(name):
        a, b = spans[name]
        return None if zero.shard.grad is None else zero.shard.grad[a:b]
    return HostMasters({name: flat[a:b] for name, (a, b) in spans.items()}, grads=grad)


def _make(cls, defaults: dict, on_device: bool, groups):
    return (device_optimizer if on_device else host_optimizer)(cls, groups, **defaults)


def _options(group: dict) -> dict:
    return {k: v for k, v in group.items() if k != "params"}
