"""A rank's program run on its capture and compiled: ``lower_program``.

The program's passes (``runtime.program``) run on the capture through the pass driver, which
leaves the capture as it is (the planner's graph); the result is compiled (``compiler.lower``),
or with pp > 1 split into this rank's stages under the plan's schedule (``runtime.pipeline``).
A ``ParallelModel`` lowers its program once per microbatch shape, on the same parameters.
"""
from __future__ import annotations

import dataclasses

import torch

from autopar.passes.device import device_pass
from autopar.passes.driver import rank_prefix, run_passes
from autopar.passes.token_mean import token_count_graph
from autopar.runtime.compile_once import peer_order
from autopar.runtime.compiler import lower, uses_inductor
from autopar.runtime.pipeline import Pipeline
from autopar.runtime.program import FromPre


@dataclasses.dataclass
class Lowered:
    """A rank's program lowered for one microbatch shape: its graph, how it runs, what it is fed."""

    shapes: tuple[tuple[int, ...], ...]      # the plan's microbatch input shapes it was lowered for
    graph_module: torch.fx.GraphModule       # as the passes left it (before any pipeline split)
    fn: object                               # the lowered graph (pp = 1)
    pipeline: Pipeline | None                # the stages and schedule (pp > 1)
    counts: torch.fx.GraphModule | None      # a microbatch's token counts (passes.token_mean)
    counted: tuple[bool, ...]                # per token loss: a mean (its scale counts tokens) or a sum
    pass_seconds: list                       # (pass, seconds) per pass
    slots: list                              # (kind, fqn) of each placeholder, in order
    input_names: list[str]                   # the user inputs' placeholders, in call order


def rewritten(program, cap) -> tuple[torch.fx.GraphModule, torch.fx.GraphModule, list[tuple[str, float]]]:
    """``program``'s passes run on its capture ``cap``, which they leave as it is: the rank's graph,
    the graph the first run (``program.pre``) left, and (pass name, seconds) per pass. Needs no
    process group (collectives are named, not run)."""
    start, seconds = cap.gm, []
    if program.pre:
        # AUTOPAR_DUMP=DIR writes each graph before and after its pass
        start, seconds = run_passes(cap.gm, [s.resolved(cap.gm) for s in program.pre],
                                    prefix=rank_prefix("cp" if program.mesh.cp > 1 else "pre"))
    gm, more = run_passes(start, [s.resolved(start) for s in program.passes], prefix=rank_prefix())
    return gm, start, seconds + more


def node_stages(program, start: torch.fx.GraphModule) -> dict[str, int] | None:
    """Global node name -> pipeline stage of ``program`` (None without pp), its cp cuts read from
    ``start``, the graph its first run of passes left (``rewritten``)."""
    return program.stage_of(start) if isinstance(program.stage_of, FromPre) else program.stage_of


def lower_program(program, cap, params: dict[str, torch.nn.Parameter], buffers: dict[str, torch.Tensor], *,
                  prepare, loss_scale) -> Lowered:
    """``program`` (a ``runtime.program.Program``) run on its capture ``cap`` and lowered, computing
    with ``params`` (this rank's shards, ``program.params``) and ``buffers`` (by FQN); ``prepare(fqn,
    tensor)``: what a pipeline stage computes with (the step's working copy); ``loss_scale()``: what
    a pipeline's loss is multiplied by before backward. Collective where Inductor compiles
    (``compile_once.peer_order``) or a pipeline is built."""
    gm, start, seconds = rewritten(program, cap)
    counts = token_count_graph(cap.gm) if program.counted else None
    if counts is not None and any(s.fn is device_pass for s in program.pre):
        counts = device_pass(counts, device=program.device)
    order = peer_order(program.coords) if uses_inductor(program.compile) else None

    def wrap(graph):
        return lower(graph, program.compile, regather=program.regather, order=order)

    pipeline = fn = None
    if program.mesh.pp > 1:
        pipeline = Pipeline(gm, node_stages(program, start), program.plan, rank=program.coords["pp"], params=params, buffers=buffers,
                            device=program.device, prepare=prepare, loss_scale=loss_scale, wrap=wrap,
                            group=program.groups.pp, process_group=program.groups.pp_process_group)
        if pipeline.holders != program.holders:
            differ = sorted(f for f in {*pipeline.holders, *program.holders}
                            if pipeline.holders.get(f) != program.holders.get(f))
            raise RuntimeError(f"autopar's program and its pipeline split put {', '.join(differ)} on other pipeline "
                               "ranks: a bug in autopar (runtime.program._holders and passes.pipeline_split disagree)")
    else:
        fn = wrap(gm)
    return Lowered(shapes=program.shapes, graph_module=gm, fn=fn, pipeline=pipeline, counts=counts,
                   counted=program.counted, pass_seconds=seconds,
                   slots=[(n.meta.get("kind"), n.meta.get("fqn")) for n in gm.graph.nodes if n.op == "placeholder"],
                   input_names=[n.name for n in cap.inputs])
