"""The autopar command line.

    python -m autopar demo [--mesh 1,1,2 --steps 20 ...]     plan and train the example GPT on CPU ranks
    python -m autopar plan gpt2 --mesh 1,1,4 --batch 8       plan offline (meta device) and print the plan
    python -m autopar calibrate --quick --out dev.json      measure this machine into a device profile
    python -m autopar flops gpt2 --mesh 1,2,4 --step-time 0.5  parameters and FLOPs per module and per rank, MFU
    python -m autopar rehearse llama3-8b --mesh 8,1,1 --zero 3   one rank of the plan run on this device

Errors autopar reports (a mesh the model cannot use, a malformed plan, a feature not built yet)
are printed as one line on stderr, and the exit status is 2.
"""
from __future__ import annotations

import argparse
import dataclasses
import sys
import time
from pathlib import Path

from autopar.examples.gpt import CONFIGS

_SP = {"on": True, "off": False, "auto": "auto"}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m autopar",
        description="autopar: automatic data x pipeline x tensor parallelism for GPT-style PyTorch models.")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)

    sub.add_parser("demo", add_help=False,
                   help="plan and train the example GPT on a CPU mesh of gloo ranks "
                        "(`python -m autopar demo --help` for its options)")

    p = sub.add_parser("plan", help="plan a named GPT config offline, on the meta device, and print the plan",
                       description="Plan a GPT from autopar.examples.gpt.CONFIGS on the meta device "
                                   "(no GPU, no process group) and print the plan summary.")
    p.add_argument("config", metavar="CONFIG_OR_MODULE",
                   help=f"a model config ({', '.join(CONFIGS)}) or path/to/file.py:factory, a function "
                        "returning a GPT-style module whose forward(idx, targets) returns the loss "
                        "(built on the meta device)")
    p.add_argument("--mesh", required=True, help="dp,pp,tp, e.g. 1,1,8; axis=size pairs, e.g. "
                                                 "dp_replicate=2,dp_shard=4,tp=1 (HSDP); or auto (with --gpus)")
    p.add_argument("--gpus", type=int, help="number of devices, for --mesh auto")
    p.add_argument("--gpus-per-node", type=int, default=8, help="devices per node (default 8)")
    p.add_argument("--schedule", default="1F1B", help="pipeline schedule: GPipe, 1F1B, Interleaved1F1B, "
                                                      "InterleavedZeroBubble (default 1F1B)")
    p.add_argument("--microbatches", type=int, help="microbatches per step (default: the cost model's choice)")
    p.add_argument("--device", default="h100",
                   help="cost model device: a preset (e.g. h100, h200, cpu) or a JSON profile path "
                        "(default h100)")
    p.add_argument("--batch", type=int, default=8, help="global batch size (default 8)")
    p.add_argument("--seq", type=int, help="sequence length (default: the config's block size)")
    p.add_argument("--sequence-parallel", default="auto", choices=list(_SP),
                   help="sequence parallelism (default auto: the planner decides)")
    p.add_argument("--zero", type=lambda s: s if s == "auto" else int(s), default=0, choices=[0, 1, 2, 3, "auto"],
                   help="shard over dp: 1 the optimizer state, 2 the gradients too, 3 the weights too, "
                        "gathered per layer unit; auto: the fastest that fits (default 0)")
    p.add_argument("--offload", default="none", type=_offload, metavar="none|optimizer|FRACTION|auto",
                   help="optimizer: the fp32 master weights and AdamW state in host memory, stepped by the CPU; "
                        "a fraction in [0, 1]: that share of the state on the host, in whole units (the last "
                        "ones first), the rest on the device; auto: only when the plan does not fit the device "
                        "without it, the split of fastest step that fits the device and the host (default none)")
    p.add_argument("--offload-delay", type=int, default=0, choices=[0, 1],
                   help="1: the host's update lands one step late, overlapping the next step (default 0)")
    p.add_argument("--plan", default="auto", choices=["auto", "megatron"],
                   help="auto: the planner decides; megatron: the hand-written plan (default auto)")
    p.add_argument("--precision", default="fp32", choices=["fp32", "bf16", "fp16"],
                   help="compute dtype; bf16 and fp16 keep fp32 master weights (default fp32)")
    p.add_argument("--recompute", default="none", choices=["none", "selective", "full", "auto"],
                   help="recompute regions per block, trading forward time for activation memory; auto: per block, "
                        "the least recompute that fits the memory budget (default none)")
    p.add_argument("--keep-gathered", default="auto", metavar="auto|none|UNITS",
                   help="zero=3: auto keeps gathered from forward to backward the units that fit the memory budget; "
                        "none reshards every unit after its forward; or comma-separated unit names (default auto)")
    p.add_argument("--cp-attention", default="auto", choices=["auto", "allgather", "ring"],
                   help="with a cp axis: allgather gathers the keys and values whole; ring passes their blocks around "
                        "the cp ranks, each transfer overlapping a block's compute; auto: the cheaper (default auto)")
    p.add_argument("--memory-budget", metavar="SIZE",
                   help="bytes per device the plan must fit, e.g. 60GiB (default: the device's memory); what "
                        "--zero, --offload and --recompute auto fit in")
    p.add_argument("--out", metavar="PLAN.json", help="also write the plan as JSON to this file")
    p.add_argument("--html", metavar="PLAN.html", help="also write the self-contained HTML plan view")
    c = sub.add_parser("compare", help="autopar's plans and hand-written PyTorch parallelism (DTensor TP, "
                                       "FSDP2) trained side by side on CPU ranks",
                       description="Train the example GPT with each contender on the same data (gloo ranks on "
                                   "this machine) and print the losses against the unsharded model's, the last "
                                   "step's collectives per kind (count / MiB of full tensors), peak tensor "
                                   "memory per rank, RSS, step time and setup time. Contenders: auto, megatron "
                                   "(autopar, ZeRO-0), zero3 (autopar plan=auto, zero=3), hand-written (TP/SP "
                                   "by hand + FSDP2), fsdp2 (FSDP2 over dp; with tp=1 without any TP plan).")
    c.add_argument("--mesh", default="1,1,2",
                   help="dp,pp,tp (pp > 1 only for autopar's contenders: the hand-written ones have no pipeline)")
    c.add_argument("--steps", type=int, default=5)
    c.add_argument("--sequence-parallel", default="on", choices=["on", "off"])
    c.add_argument("--contenders", default="auto,megatron,hand-written",
                   help="comma-separated, in table order, from auto, megatron, zero3, hand-written, fsdp2 "
                        "(default auto,megatron,hand-written)")
    d = sub.add_parser("diff", help="what differs between two plan files (exit 1 if anything does)",
                       description="Compare two plan JSON files: placements, node strategies, collectives, "
                                   "stages, memory and predicted time. With the model (--model, or the one "
                                   "`plan` recorded in A), both plans are first re-derived from their choices, "
                                   "so a hand edit shows its real shapes, collectives and times. Exit status 0 "
                                   "when they decide the same things, 1 when they differ (as diff(1)).")
    d.add_argument("a", metavar="A.json")
    d.add_argument("b", metavar="B.json")
    d.add_argument("--model", metavar="CONFIG_OR_MODULE",
                   help="re-derive both plans for this model (a config or path/to/file.py:factory, as for plan) "
                        "before comparing (default: the model A records)")
    d.add_argument("--device", help="cost model device to re-derive with (default: each plan's own)")
    d.add_argument("--as-written", action="store_true",
                   help="compare the numbers the files record, without re-deriving them")
    k = sub.add_parser("calibrate", help="measure this machine (matmuls, memory, launches, collectives) into a "
                                         "device profile for --device",
                       description="Measure matmul throughput per shape and dtype, memory bandwidth, kernel launch "
                                   "overhead and, under torchrun with several ranks, collective latency and "
                                   "bandwidth per mesh axis; write a device profile JSON that `plan --device` and "
                                   "autopar.plan(device=...) price with.")
    k.add_argument("--out", default="device.json", metavar="PROFILE.json", help="where to write it (default device.json)")
    k.add_argument("--quick", action="store_true", help="fewer shapes and repetitions: about 60 s on a GPU, 30 s on CPU")
    k.add_argument("--base", help="preset for what is not measured (data-sheet peaks, the other network tier); "
                                  "default: guessed from the GPU name, cpu without one")
    k.add_argument("--mesh", help="dp,pp,tp whose axes get collective measurements under torchrun "
                                  "(default: every rank on tp)")
    k.add_argument("--name", help="the profile's device name (default: the device's name, 'measured')")
    f = sub.add_parser("flops", help="parameters and FLOPs per module and per rank of a plan, and MFU",
                       description="Plan a model on the meta device (no GPU, no process group) and report, "
                                   "DeepSpeed flops-profiler style, its parameters and forward/backward FLOPs "
                                   "per module, what each (pp, tp) rank holds and executes, and the MFU of a "
                                   "measured step time.")
    f.add_argument("config", metavar="CONFIG_OR_MODULE",
                   help=f"a model config ({', '.join(CONFIGS)}) or path/to/file.py:factory (as for plan)")
    f.add_argument("--mesh", required=True, help="dp,pp,tp, e.g. 1,2,4")
    f.add_argument("--step-time", type=float, metavar="S", help="measured seconds per training step, for MFU")
    f.add_argument("--device", default="h100", help="device whose peak MFU is measured against: a preset "
                                                    "(e.g. h100, h200, a100) or a JSON profile (default h100)")
    f.add_argument("--batch", type=int, default=8, help="global batch size (default 8)")
    f.add_argument("--seq", type=int, help="sequence length (default: the config's block size)")
    f.add_argument("--plan", default="auto", help="auto, megatron or a plan JSON file (default auto)")
    f.add_argument("--microbatches", type=int, help="microbatches per step (default: the cost model's choice)")
    f.add_argument("--recompute", default="none", choices=["none", "selective", "full"],
                   help="recompute regions, counted in hardware FLOPs (default none)")
    f.add_argument("--precision", default="fp32", choices=["fp32", "bf16", "fp16"],
                   help="compute dtype, whose peak MFU divides by (default fp32)")
    f.add_argument("--depth", type=int, default=3, help="module tree depth to show (default 3)")
    r = sub.add_parser("rehearse", help="plan for the full mesh, then run one of its ranks alone on this device "
                                        "(collectives move no data) and compare its time, memory and collectives "
                                        "with the plan's",
                       description="Plan a model (built on the meta device) for the whole mesh, build only one rank's "
                                   "program on this machine's device (its shards alone, randomly initialised), train "
                                   "it a few steps on random tokens in a world of the mesh's size whose collectives "
                                   "move no data, and print the plan with the rehearsal: compute and update time, "
                                   "peak memory and the collectives issued, beside the plan's, and the step time "
                                   "they make with the communication the plan priced.")
    r.add_argument("config", metavar="CONFIG_OR_MODULE",
                   help=f"a model config ({', '.join(CONFIGS)}) or path/to/file.py:factory (as for plan)")
    r.add_argument("--mesh", required=True, help="dp,pp,tp, axis=size pairs, or auto (with --gpus), as for plan")
    r.add_argument("--gpus", type=int, help="number of devices, for --mesh auto")
    r.add_argument("--rank", default="worst", type=lambda s: s if s == "worst" else int(s),
                   help="the rank to run: a number, or worst: the pipeline rank predicted fullest (default worst)")
    r.add_argument("--steps", type=int, default=5, help="timed steps (default 5)")
    r.add_argument("--warmup", type=int, default=2, help="steps before timing, compiling (default 2)")
    r.add_argument("--compile", default="inductor",
                   help="inductor (as parallelize compiles), another torch.compile backend such as aot_eager, "
                        "or none (default inductor)")
    r.add_argument("--device", help="cost model device the plan is priced for (default: this machine's kind)")
    r.add_argument("--gpus-per-node", type=int, default=8, help="devices per node (default 8)")
    r.add_argument("--batch", type=int, default=8, help="global batch size (default 8)")
    r.add_argument("--seq", type=int, help="sequence length (default: the config's block size)")
    r.add_argument("--plan", default="auto", choices=["auto", "megatron"], help="as for plan (default auto)")
    r.add_argument("--zero", type=lambda s: s if s == "auto" else int(s), default=0, choices=[0, 1, 2, 3, "auto"],
                   help="as for plan (default 0)")
    r.add_argument("--microbatches", type=int, help="microbatches per step (default: the cost model's choice)")
    r.add_argument("--schedule", default="1F1B", help="pipeline schedule (default 1F1B)")
    r.add_argument("--precision", default="fp32", choices=["fp32", "bf16", "fp16"], help="compute dtype (default fp32)")
    r.add_argument("--recompute", default="none", choices=["none", "selective", "full", "auto"],
                   help="as for plan (default none)")
    r.add_argument("--offload", default="none", choices=["none", "optimizer", "auto"], help="as for plan (default none)")
    r.add_argument("--out", metavar="PLAN.json", help="also write the rehearsed plan as JSON to this file")
    r.add_argument("--html", metavar="PLAN.html", help="also write its HTML view")
    return parser


def _offload(text: str):
    """``--offload``: a name, or a fraction (its range is the planner's to check)."""
    if text in ("none", "optimizer", "auto"):
        return text
    try:
        return float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected none, optimizer, auto or a fraction in [0, 1], got {text!r}") \
            from None


def _model(spec: str):
    """A named config built on the meta device, or ``path.py:factory`` called on the meta device
    (what it builds on a real device anyway is moved there: planning needs no weights)."""
    import importlib.util

    import torch

    from autopar.examples.gpt import build

    if spec in CONFIGS:
        return build(spec, device="meta")
    path, _, factory = spec.rpartition(":")
    if not path.endswith(".py") or not factory:
        raise ValueError(f"{spec!r} is neither a config ({', '.join(CONFIGS)}) nor path/to/file.py:factory")
    if not Path(path).is_file():
        raise ValueError(f"{path}: no such file")
    module_spec = importlib.util.spec_from_file_location(Path(path).stem, path)
    module = importlib.util.module_from_spec(module_spec)
    module_spec.loader.exec_module(module)
    if not callable(getattr(module, factory, None)):
        raise ValueError(f"{path} has no function {factory!r}")
    with torch.device("meta"):
        model = getattr(module, factory)()
    if not isinstance(model, torch.nn.Module):
        raise ValueError(f"{spec} returned a {type(model).__name__}, not a torch.nn.Module")
    return _on_meta(model)


def _on_meta(model):
    """``model`` with its parameters and buffers on the meta device, weights tied as before
    (``model.to("meta")`` would give each use of a tied weight its own copy)."""
    import torch

    moved = {}
    for module in model.modules():
        for name, t in [*module.named_parameters(recurse=False), *module.named_buffers(recurse=False)]:
            if not t.is_meta:
                if id(t) not in moved:
                    meta = t.detach().to("meta")
                    moved[id(t)] = torch.nn.Parameter(meta, t.requires_grad) if isinstance(t, torch.nn.Parameter) else meta
                setattr(module, name, moved[id(t)])
    return model


def _inputs(args, model):
    """(idx, targets) on the meta device for --batch and --seq (default: the model's block size), and seq."""
    import torch

    seq = args.seq or getattr(getattr(model, "config", None), "block_size", None)
    if seq is None:
        raise ValueError(f"{args.config}: give --seq (the model has no config.block_size)")
    if args.batch < 1 or seq < 1:
        raise ValueError(f"--batch and --seq must be positive, got batch={args.batch} seq={seq}")
    block = getattr(getattr(model, "config", None), "block_size", seq)
    if seq > block:
        raise ValueError(f"--seq {seq} is longer than {args.config}'s block size {block}")
    return tuple(torch.empty(args.batch, seq, dtype=torch.long, device="meta") for _ in range(2)), seq


def _flops(args) -> int:
    from rich.console import Console

    from autopar.flops import flops_report, report_table

    t0 = time.perf_counter()
    with Console(stderr=True).status(f"capturing {args.config} on the meta device and planning mesh {args.mesh} ..."):
        model = _model(args.config)
        inputs, seq = _inputs(args, model)
        report = flops_report(model, args.mesh, inputs, plan=args.plan, step_time=args.step_time,
                              device=args.device, microbatches=args.microbatches, recompute=args.recompute,
                              precision=args.precision)
    print(report_table(report, depth=args.depth), end="")
    print(f"counted {args.config} (batch {args.batch}, seq {seq}) in {time.perf_counter() - t0:.1f} s")
    return 0


def _plan(args) -> int:
    from rich.console import Console

    t0 = time.perf_counter()
    console = Console(stderr=True)
    with console.status(f"capturing {args.config} on the meta device and solving for mesh {args.mesh} ..."):
        import autopar

        model = _model(args.config)
        inputs, seq = _inputs(args, model)
        plan = autopar.plan(model, _mesh(args.mesh), inputs, device=args.device, plan=args.plan,
                            sequence_parallel=_SP[args.sequence_parallel], zero=args.zero,
                            world_size=args.gpus, gpus_per_node=args.gpus_per_node, schedule=args.schedule,
                            microbatches=args.microbatches, precision=args.precision, recompute=args.recompute,
                            offload=args.offload, offload_delay=args.offload_delay, memory_budget=args.memory_budget,
                            keep_gathered=_keep_gathered(args.keep_gathered), cp_attention=args.cp_attention)
    plan = dataclasses.replace(plan, model=args.config)   # lets `diff` re-derive it
    print(plan.summary())
    if not _same_destination(sys.stdout, sys.stderr):   # the summary's last lines, for stdout sent to a file
        for warning in plan.warnings:
            print(f"warning: {warning}", file=sys.stderr)
    _write(plan, args)
    print(f"planned {args.config} (batch {args.batch}, seq {seq}) in {time.perf_counter() - t0:.1f} s")
    return 0


def _rehearse(args) -> int:
    import autopar

    t0 = time.perf_counter()
    model = _model(args.config)
    inputs, seq = _inputs(args, model)
    compile = {"inductor": True, "none": False}.get(args.compile, args.compile)
    plan = autopar.rehearse(model, _mesh(args.mesh), inputs, rank=args.rank, steps=args.steps, warmup=args.warmup,
                            world_size=args.gpus, device=args.device, gpus_per_node=args.gpus_per_node,
                            compile=compile, plan=args.plan, zero=args.zero, microbatches=args.microbatches,
                            schedule=args.schedule, precision=args.precision, recompute=args.recompute,
                            offload=args.offload, log=lambda line: print(line, file=sys.stderr, flush=True))
    plan = dataclasses.replace(plan, model=args.config)
    print(plan.summary())
    _write(plan, args)
    print(f"rehearsed {args.config} (batch {args.batch}, seq {seq}) in {time.perf_counter() - t0:.1f} s")
    return 0


def _write(plan, args) -> None:
    """``plan`` written where ``--out`` (JSON) and ``--html`` ask, each said on stdout."""
    if args.out:
        plan.to_json(args.out)
        print(f"plan written to {args.out}")
    if args.html:
        plan.to_html(args.html)
        print(f"plan view written to {args.html}")


def _same_destination(a, b) -> bool:
    """Whether streams ``a`` and ``b`` write to the same file, pipe or terminal (both to the
    terminal, or ``2>&1``): one of them then shows everything printed to either."""
    import os

    try:
        return os.path.samestat(os.fstat(a.fileno()), os.fstat(b.fileno()))
    except (AttributeError, OSError, ValueError):   # no file behind one of them (an io.StringIO)
        return False


def _mesh(text: str):
    """--mesh as ``autopar.plan`` takes it: "auto"; axis=size pairs ("dp_replicate=2,dp_shard=4,tp=1",
    missing axes 1, ``Mesh.from_sizes``) as a dict; or "dp,pp,tp" as it is."""
    if "=" not in text:
        return text.strip()
    sizes = {}
    for item in (i.strip() for i in text.split(",") if i.strip()):
        axis, _, size = item.partition("=")
        axis = axis.strip()
        if not axis or not size.strip().isdigit():
            raise ValueError(f"--mesh {text!r}: {item!r} is not axis=size; write e.g. dp_replicate=2,dp_shard=4,tp=1 "
                             "(or dp,pp,tp such as 8,1,1, or auto)")
        if axis in sizes:
            raise ValueError(f"--mesh {text!r}: axis {axis} is given twice")
        sizes[axis] = int(size)
    from autopar.mesh import Mesh
    Mesh.from_sizes(sizes)   # an unknown axis or a dp given whole and split fails here, naming the axes
    return sizes


def _keep_gathered(text: str):
    """--keep-gathered as ``autopar.plan`` takes it: "auto", () for none, or the unit names."""
    if text in ("auto", "none"):
        return "auto" if text == "auto" else ()
    return tuple(n.strip() for n in text.split(",") if n.strip())


def _rederived(plan, model, device):
    """``plan`` re-derived from its choices for ``model``: its local shapes, collectives, memory
    and times as the passes would make them, not as its file records them."""
    import torch

    import autopar
    from autopar.mesh import Mesh

    dp, _, _ = plan.mesh
    inputs = tuple(torch.empty(s[0] * dp * plan.microbatches, *s[1:], dtype=torch.long, device="meta")
                   for s in plan.input_shapes)
    # the whole mesh, HSDP's split of dp and cp included: a plan runs only on its own
    return autopar.plan(model, Mesh.of_plan(plan), inputs, plan=plan, device=device or plan.device)


def _diff(args) -> int:
    from autopar.plans import Plan

    a, b = Plan.from_json(args.a), Plan.from_json(args.b)
    spec = None if args.as_written else args.model or a.model
    if spec:
        model = _model(spec)
        a, b = _rederived(a, model, args.device), _rederived(b, model, args.device)
        print(f"comparing both plans as re-derived from their choices for {spec}", file=sys.stderr)
    text = a.diff(b)
    print(text)
    return 0 if text == "no differences" else 1


def _calibrate(args) -> int:
    import os

    import torch.distributed as dist

    from autopar.cost_model.calibrate import calibrate, summary, write_profile
    from autopar.examples.gpt import reference_step
    from autopar.mesh import Mesh

    mesh = Mesh.parse(args.mesh) if args.mesh else None
    if int(os.environ.get("WORLD_SIZE", "1")) > 1:   # started by torchrun: measure the collectives too
        from autopar.launch import init_distributed
        init_distributed()
    lead = not dist.is_initialized() or dist.get_rank() == 0
    spec, record = calibrate(quick=args.quick, base=args.base, name=args.name,
                             mesh=(mesh.dp, mesh.pp, mesh.tp) if mesh else None, reference=reference_step,
                             log=print if lead else (lambda line: None))
    if lead:
        write_profile(spec, record, args.out)
        print(summary(spec))
        print(f"profile written to {args.out} in {record['seconds']:.1f} s; use it with "
              f"`python -m autopar plan CONFIG --device {args.out}`")
    return 0


def main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] == "demo":   # the demo parses its own options
        from autopar.examples import demo
        return demo.main(argv[1:])
    args = build_parser().parse_args(argv)
    try:
        if args.command == "compare":
            from autopar.compare import compare, table
            from autopar.mesh import Mesh
            mesh = Mesh.parse(args.mesh)
            contenders = tuple(c.strip() for c in args.contenders.split(",") if c.strip())
            print(table(compare((mesh.dp, mesh.pp, mesh.tp), args.steps, contenders=contenders,
                                sequence_parallel=args.sequence_parallel == "on")))
            return 0
        if args.command == "calibrate":
            return _calibrate(args)
        if args.command == "diff":
            return _diff(args)
        if args.command == "flops":
            return _flops(args)
        if args.command == "rehearse":
            return _rehearse(args)
        return _plan(args)
    except (ValueError, NotImplementedError) as e:   # PlanError and PlanFormatError are ValueErrors
        print(f"error: {' '.join(str(e).split())}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
