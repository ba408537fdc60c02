"""The pipeline at run time: this rank's stage graphs on torch.distributed.pipelining.

``passes.pipeline_split`` makes the stage graphs from the plan's stages; each runs as a
``PipelineStage`` under the plan's schedule; a weight held by several stages has its gradient
summed over them. In a world whose collectives move no data (a rehearsal,
``runtime.fake_group``) nothing answers the stages' exchange of shapes, so each stage is given
its inputs' and outputs' shapes, propagated through the rank's graph (``stage_examples``).
"""
from __future__ import annotations

import torch

from autopar import collectives as C
from autopar.passes.pipeline_split import pipeline_split_pass
from autopar.runtime.fake_group import moves_no_data


class StageModule(torch.nn.Module):
    """One stage's graph with its (local) parameters and buffers registered, for a PipelineStage.

    ``prepare(fqn, tensor)`` gives what the graph computes with (the step's working copy)."""

    def __init__(self, fn, fqns: list[str], tensors: dict[str, torch.Tensor], prepare):
        super().__init__()
        self.fn = fn
        self.prepare = prepare
        self.fqns = fqns
        self.keys = [f.replace(".", "__") for f in fqns]
        for k, f in zip(self.keys, fqns):
            if isinstance(tensors[f], torch.nn.Parameter):
                self.register_parameter(k, tensors[f])
            else:
                self.register_buffer(k, tensors[f], persistent=False)

    def forward(self, *acts):
        return self.fn(*[self.prepare(f, getattr(self, k)) for f, k in zip(self.fqns, self.keys)], *acts)


def make_schedule(name: str, stages: list, microbatches: int, loss_fn):
    """A torch.distributed.pipelining schedule by name."""
    from torch.distributed.pipelining import schedules as S

    cls = {"GPipe": S.ScheduleGPipe, "1F1B": S.Schedule1F1B, "Interleaved1F1B": S.ScheduleInterleaved1F1B,
           "InterleavedZeroBubble": getattr(S, "ScheduleInterleavedZeroBubble", None)}[name]
    if cls is None:
        raise NotImplementedError(f"schedule {name!r} is not in this torch version")
    if name in ("GPipe", "1F1B"):
        return cls(stages[0], microbatches, loss_fn=loss_fn)
    return cls(stages, microbatches, loss_fn=loss_fn)


class Pipeline:
    """This rank's stages, their schedule, and the cross-stage gradient sums."""

    def __init__(self, gm, stage_of: dict[str, int], plan, *, rank: int, params: dict, buffers: dict, device, prepare,
                 loss_scale, wrap, group: str, process_group):
        """``stage_of``: each global node name's stage; ``rank``: this rank's pp coordinate; ``params``:
        this rank's parameter shards, exactly those its stages use (else RuntimeError: the program
        that made them disagrees with the split); ``buffers``: every buffer by FQN; ``prepare(fqn,
        tensor)``: what the graphs compute with (the step's working copy); ``loss_scale()``: what
        the loss is multiplied by before backward; ``wrap(graph)``: the graph as it runs (compiled
        or eager); ``group``, ``process_group``: the pp group's name and the group itself."""
        from torch.distributed.pipelining import PipelineStage

        self.plan, self.device, self.loss_scale = plan, device, loss_scale
        n = len(plan.stages)
        pp = plan.mesh[1]
        self.sg = pipeline_split_pass(gm, stage_of, n)
        if len(self.sg.label_inputs) != 1:
            raise NotImplementedError("pipeline parallelism needs exactly one label input (the targets); "
                                      f"this model's loss uses {self.sg.label_inputs or 'none'}")
        self.mine = [s for s in range(n) if s % pp == rank]
        self.last = (n - 1) % pp == rank
        holders: dict[str, set[int]] = {}
        for s in range(n):
            for f in self.sg.stage_params[s] + (self.sg.tail_params if s == n - 1 else []):
                holders.setdefault(f, set()).add(s % pp)
        self.holders = {f: tuple(sorted(r)) for f, r in holders.items() if f not in buffers}
        self.shared = [p.fqn for p in plan.parameters if len(holders.get(p.fqn, ())) > 1]
        needed = {f for f, r in holders.items() if rank in r}
        if needed - set(buffers) != set(params):
            raise RuntimeError(f"autopar's program for pipeline rank {rank} holds the parameters "
                               f"{sorted(params)}, but its stages use {sorted(needed - set(buffers))}: a bug in "
                               "autopar (runtime.program._holders and passes.pipeline_split disagree)")
        tensors = {**params, **{f: b for f, b in buffers.items() if f in needed}}
        self.pp_group = group
        examples = (stage_examples(gm, self.sg, plan, params, buffers, prepare, device)
                    if moves_no_data(process_group) else {})
        self.stages = [PipelineStage(StageModule(wrap(self.sg.stages[s]), self.sg.stage_params[s], tensors, prepare),
                                     s, n, device, group=process_group, **examples.get(s, {})) for s in self.mine]
        tail = wrap(self.sg.tail)
        tail_w = {f: tensors[f] for f in self.sg.tail_params} if self.last else {}

        def loss_fn(out, target):   # the loss backward starts from: scaled for fp16
            weights = [prepare(f, t) for f, t in tail_w.items()]
            return tail(*weights, *(out if isinstance(out, tuple) else (out,)), target) * loss_scale()

        self.schedule = make_schedule(plan.schedule, self.stages, plan.microbatches, loss_fn)
        self.params = params

    def step(self, inputs: dict[str, torch.Tensor], *, train: bool = True,
             grads: dict[str, torch.Tensor] | None = None) -> torch.Tensor:
        """One schedule step over every microbatch (forward only with ``train`` False); the loss,
        averaged, on every pp rank. ``grads``: where the gradients accumulate when not on
        ``p.grad`` (FQN -> fp32 buffer, ``runtime.zero``), divided by the microbatch count here as
        the schedule divides ``p.grad``."""
        losses: list = []
        # only the first stage's rank feeds the batch (torch 2.11's schedules refuse it elsewhere)
        first = [inputs[name] for name in self.sg.first_inputs] if 0 in self.mine else []
        if train:
            self.schedule.step(*first, target=inputs[self.sg.label_inputs[0]], losses=losses)
        else:
            # the training schedule's own forward-only step (a second schedule over the same stages would
            # leave their receive buffers set up without gradients for the next training step); it
            # still divides the gradients by the microbatch count at its end (torch 2.13), so the
            # step's gradients are put aside meanwhile
            held = {f: p.grad for f, p in self.params.items()}
            for p in self.params.values():
                p.grad = None
            try:
                self.schedule.eval(*first, target=inputs[self.sg.label_inputs[0]], losses=losses)
            finally:
                for f, p in self.params.items():
                    p.grad = held[f]
        loss = torch.stack([l.detach() for l in losses]).mean() / self.loss_scale() if self.last else torch.zeros(())
        if not train:
            return C.all_reduce(loss.to(self.device).float(), self.pp_group)
        if grads is not None:
            for f, g in grads.items():
                g.div_(self.plan.microbatches)
                # a zero-bubble schedule's weight pass also sums into p.grad, at 16 bits: the buffer
                # took each of its gradients as it was computed
                self.params[f].grad = None
        for f in self.shared:   # a weight on several stages: its gradient is the sum over them
            p = self.params.get(f)
            g = grads.get(f) if grads is not None else p.grad if p is not None else None
            total = C.all_reduce((g if g is not None else torch.zeros(self.plan.param(f).local_shape)).to(self.device),
                                 self.pp_group)
            if grads is not None and f in grads:
                grads[f].copy_(total)
            elif p is not None:
                p.grad = total
        return C.all_reduce(loss.to(self.device).float(), self.pp_group)


def stage_examples(gm, sg, plan, params: dict, buffers: dict, prepare, device) -> dict[int, dict]:
    """Per stage, ``input_args`` and ``output_args`` for its ``PipelineStage``: meta tensors of the
    shapes and dtypes its activations take, found by running the rank's whole graph ``gm`` on fake
    tensors (one microbatch of the plan's input shapes; every parameter at the shape a rank holds,
    ``Plan.held_shape``, through ``prepare`` as the stages compute with it). ``sg``: ``gm`` split
    into stages (a stage's activation input ``in_x`` is ``gm``'s node ``x``)."""
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.fx.passes.fake_tensor_prop import FakeTensorProp

    mode = FakeTensorMode(allow_non_fake_inputs=True)
    # a weight this rank does not hold is stored as those it holds are (fp32, or 16-bit)
    stored = next((p.dtype for p in params.values() if p.is_floating_point()), torch.float32)
    shapes = iter(plan.input_shapes)
    args = []
    with mode:
        for node in gm.graph.nodes:
            if node.op != "placeholder":
                continue
            kind, fqn = node.meta.get("kind"), node.meta.get("fqn")
            if kind == "param":
                held = params.get(fqn)
                dtype = held.dtype if held is not None else stored
                args.append(prepare(fqn, torch.empty(plan.held_shape(plan.param(fqn)), dtype=dtype, device=device)))
            elif kind == "buffer":
                args.append(mode.from_tensor(buffers[fqn]))
            else:
                args.append(torch.zeros(next(shapes), dtype=torch.long, device=device))
    FakeTensorProp(gm, mode).propagate(*args)
    vals = {n.name: n.meta["val"] for n in gm.graph.nodes}

    def meta(name: str) -> torch.Tensor:   # a floating activation carries a gradient back
        v = vals[name]
        return torch.empty(v.shape, dtype=v.dtype, device="meta", requires_grad=v.is_floating_point())

    out = {}
    for s, stage in enumerate(sg.stages):
        ins = [meta(n.name.removeprefix("in_")) for n in stage.graph.nodes
               if n.op == "placeholder" and n.meta.get("kind") not in ("param", "buffer")]
        result = next(n for n in stage.graph.nodes if n.op == "output").args[0]
        outs = [meta(a.name) for a in (result if isinstance(result, (tuple, list)) else (result,))]
        out[s] = dict(input_args=tuple(ins), output_args=tuple(outs))
    return out
