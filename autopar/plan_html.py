"""A Plan as one self-contained HTML page: ``render(plan) -> str`` (``Plan.to_html`` calls it).

The page needs nothing at view time: CSS and the few lines of JS are inline, no fonts, no
network. It shows, top to bottom:

- a header: mesh (dp, pp, tp; dp as replicate x shard under HSDP; cp when the plan splits sequences), device, schedule and microbatches, sequence parallel, ZeRO,
  recompute mode, optimizer offload (its bytes on the host and the device), predicted step time,
  and the plan's warnings (an idle axis, a peak above the device);
- the model as its layers in order, grouped into one ``<section data-stage="k">`` per pipeline
  stage and coloured by stage. A layer is the module that owns a run of graph nodes (a stage
  module such as ``transformer.h.3``; without stages, the module path up to its first layer
  index). Consecutive ``prefix.N`` layers of one stage with identical ops and collectives are
  shown once, "x L". Each layer opens to its ops (node, op, module, input and output
  placements, local implementation, recompute) and carries its collectives with their bytes and,
  under optimizer offload, where its unit's optimizer lives (``data-offload`` "host" or "device":
  the layers before the first block are the "embedding" unit's, those after the last the "head"'s);
- a stacked memory bar per stage (params, grads, optimizer, activations, backward transient);
- the parameter table, one ``<tr data-param="fqn">`` per parameter.
"""
from __future__ import annotations

import html
import math
import re
from dataclasses import dataclass, field

from autopar.mesh import Mesh

_STAGE_COLOURS = ("#4e79a7", "#f28e2b", "#59a14f", "#b07aa1", "#e15759", "#76b7b2", "#edc948", "#9c755f")
_MEMORY_PARTS = (("params", "#4e79a7"), ("grads", "#f28e2b"), ("optimizer", "#59a14f"),
                 ("activations", "#e15759"), ("transient", "#b07aa1"))
_TOP = "(top level)"

_CSS = """
body{font:14px/1.4 system-ui,-apple-system,"Segoe UI",Helvetica,Arial,sans-serif;margin:0;color:#222;background:#fafafa}
main{max-width:1300px;margin:0 auto;padding:16px 24px}
h1{font-size:22px;margin:0 0 8px}h2{font-size:18px;margin:24px 0 8px;border-bottom:1px solid #ddd}
code,td.m,.pl{font-family:ui-monospace,Menlo,Consolas,monospace;font-size:12.5px}
.facts{display:flex;flex-wrap:wrap;gap:8px;margin:8px 0}
.fact{background:#fff;border:1px solid #ddd;border-radius:6px;padding:4px 10px}
.fact b{display:block;font-size:11px;color:#666;font-weight:normal;text-transform:uppercase}
.stage{border-left:6px solid var(--c);background:color-mix(in srgb,var(--c) 7%,#fff);margin:10px 0;padding:6px 12px;border-radius:4px}
.stage h3{margin:4px 0 8px;font-size:15px}
details.layer{background:#fff;border:1px solid #ddd;border-left:4px solid var(--c);border-radius:4px;margin:4px 0}
details.layer>summary{cursor:pointer;padding:4px 8px;display:flex;flex-wrap:wrap;gap:6px;align-items:center}
details.layer>div{padding:4px 8px 8px}
.name{font-weight:600;font-family:ui-monospace,Menlo,Consolas,monospace}
.x{background:#222;color:#fff;border-radius:10px;padding:0 7px;font-size:12px}
.muted{color:#777;font-size:12px}
.warn{color:#a40000;font-weight:600}
.coll{background:#fff4d6;border:1px solid #e0b84a;border-radius:4px;padding:0 5px;font-size:12px}
.coll.dp{background:#e3f0ff;border-color:#7aa7d9}.rc{background:#eee;border-radius:4px;padding:0 5px;font-size:12px}
.off{border-radius:4px;padding:0 5px;font-size:12px}.off.host{background:#fde2e2}.off.device{background:#e2f5e2}
table{border-collapse:collapse;background:#fff;font-size:13px}
th,td{border:1px solid #e2e2e2;padding:2px 8px;text-align:left;vertical-align:top}th{background:#f0f0f0}
.pl{padding:0 4px;border-radius:3px;white-space:nowrap}.pl.R{background:#eee}.pl.P{background:#ffd9b3}
.pl.S{background:#d6e8ff}.pl.Si{background:#d9f2d9;border:1px dashed #59a14f}
.bar{display:flex;height:22px;border:1px solid #bbb;border-radius:3px;overflow:hidden;background:#fff}
.bar>span{display:block;height:100%}
.memrow{display:grid;grid-template-columns:90px 1fr 120px;gap:10px;align-items:center;margin:6px 0}
.legend span.sw{display:inline-block;width:11px;height:11px;border-radius:2px;margin:0 4px 0 12px;vertical-align:-1px}
button{font:inherit;font-size:12px;margin-right:6px}
"""

_JS = """
function setAll(open){document.querySelectorAll('details.layer').forEach(function(d){d.open=open;});}
"""


def human_bytes(n: float) -> str:
    """Bytes in binary units: 512 B, 3.00 MiB, 1.25 GiB."""
    n = float(n)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.2f} {unit}"
        n /= 1024
    return f"{n:.2f} TiB"


def human_time(s: float) -> str:
    """Seconds as ms (or µs below 0.1 ms)."""
    return f"{s * 1e6:.1f} µs" if s < 1e-4 else f"{s * 1e3:.3f} ms"


def _e(x) -> str:
    return html.escape(str(x), quote=True)


def _placement(p: str) -> str:
    """One placement as a coloured chip; an interleaved shard says so in text and tooltip."""
    m = re.fullmatch(r"S\((\d+)\)i(\d+)", p)
    if m:
        tip = (f"interleaved shard: dim {m[1]} is {m[2]} blocks (fused q, k, v); "
               f"each rank holds its slice of every block")
        return f'<span class="pl Si" title="{_e(tip)}">{_e(p)} interleaved</span>'
    cls = "S" if p.startswith("S") else ("P" if p.startswith("P") else "R")
    return f'<span class="pl {cls}">{_e(p)}</span>'


@dataclass
class _Layer:
    """A run of consecutive graph nodes owned by one module (collapsed: ``count`` equal layers)."""

    key: str
    stage: int
    nodes: list = field(default_factory=list)
    colls: list = field(default_factory=list)
    count: int = 1
    last: str = ""


def _stage_of_module(plan) -> dict[str, int]:
    return {m: s.index for s in plan.stages for m in s.modules}


def _layer_key(module: str, stage_modules: dict[str, int]) -> str:
    """The stage module owning ``module`` (longest prefix), else its path up to the first index."""
    if not module:
        return ""
    best = ""
    for m in stage_modules:
        if (module == m or module.startswith(m + ".")) and len(m) > len(best):
            best = m
    if best:
        return best
    hit = re.match(r"^(.*?\.\d+)(?=\.|$)", module)
    return hit[1] if hit else module


def _rel(path: str, key: str) -> str:
    return path[len(key) + 1:] if key and path.startswith(key + ".") else ("" if path == key else path)


def _layers(plan) -> tuple[list[_Layer], list]:
    """Group nodes into layers in graph order, attach collectives; returns (layers, unattached)."""
    stage_modules = _stage_of_module(plan)
    first_stage = plan.stages[0].index if plan.stages else 0
    layers: list[_Layer] = []
    stage = first_stage
    for n in plan.nodes:
        key = _layer_key(n.module, stage_modules)
        if key:
            stage = stage_modules.get(key, stage)
        if not layers or layers[-1].key != key or layers[-1].stage != stage:
            layers.append(_Layer(key, stage))
        layers[-1].nodes.append(n)
    by_key = {}
    for layer in layers:
        if layer.key:
            by_key.setdefault(layer.key, layer)
    unattached = []
    for c in plan.collectives:
        owner = max((k for k in by_key if c.where == k or c.where.startswith(k + ".")), key=len, default=None)
        (by_key[owner].colls if owner else unattached).append(c)
    return _collapse(layers, plan), unattached


def _signature(layer: _Layer, recomputed: set, kept: tuple, offload_kept: tuple = ()) -> tuple:
    ops = tuple((n.op, _rel(n.module, layer.key), n.inputs, n.output, n.local, n.name in recomputed)
                for n in layer.nodes)
    colls = tuple(sorted((c.kind, c.axis, c.phase, _rel(c.where, layer.key), c.count, c.bytes) for c in layer.colls))
    return layer.stage, ops, colls, layer.key in kept, layer.key in offload_kept


def _collapse(layers: list[_Layer], plan) -> list[_Layer]:
    """Merge runs of ``prefix.N, prefix.N+1, ...`` layers with identical signatures."""
    recomputed = {name for region in plan.recompute_regions for name in region}
    out: list[_Layer] = []
    for layer in layers:
        prev = out[-1] if out else None
        a = re.fullmatch(r"(.*)\.(\d+)", prev.last or prev.key) if prev else None
        b = re.fullmatch(r"(.*)\.(\d+)", layer.key)
        if (a and b and a[1] == b[1] and int(b[2]) == int(a[2]) + 1
                and _signature(prev, recomputed, plan.keep_gathered, plan.offload_kept)
                == _signature(layer, recomputed, plan.keep_gathered, plan.offload_kept)):
            prev.count += 1
            prev.last = layer.key
        else:
            out.append(layer)
    return out


def _zero_fact(plan) -> str:
    """The ZeRO stage and, under ZeRO-3, the per-unit reshard choice."""
    if plan.zero != 3 or plan.mesh[0] == 1:
        return f"stage {plan.zero}"
    if not plan.keep_gathered:
        return "stage 3, every unit resharded after its forward (re-gathered in its backward)"
    return (f"stage 3, kept gathered from forward to backward (no backward re-gather): "
            f"{', '.join(plan.keep_gathered)}; the other units reshard after their forward")


def _offload_fact(plan) -> str:
    """Where the optimizer lives: the device, or the host for all units or all but the kept ones."""
    if plan.offload == "none":
        return "none: the optimizer on the device"
    host = human_bytes(sum(m.host for m in plan.memory))
    late = "; applied one step late" if plan.offload_delay else ""
    if not plan.offload_kept:
        return f"every unit's fp32 master and optimizer state on the host ({host}){late}"
    return (f"on the host ({host}) but for {len(plan.offload_kept)} units kept on the device "
            f"({human_bytes(sum(m.optimizer for m in plan.memory))} of optimizer state there){late}")


def _layer_units(layers: list[_Layer]) -> list[str]:
    """The unit (``autopar.graph.units.zero_units``' name) of each layer: a block's path, "embedding"
    before the first block, "head" after the last, "model" for a model without blocks."""
    blocks = [i for i, layer in enumerate(layers) if re.fullmatch(r".*\.\d+", layer.key)]
    if not blocks:
        return ["model"] * len(layers)
    return [layer.key if i in blocks else "embedding" if i < blocks[0] else "head" for i, layer in enumerate(layers)]


def _mesh_fact(plan) -> tuple[str, str]:
    """The mesh as the header shows it: dp written as replicate x shard when HSDP splits it, and cp
    when the plan splits sequences."""
    dp, pp, tp = plan.mesh
    names, sizes = ["dp", "pp", "tp"], [str(dp), str(pp), str(tp)]
    if plan.dp_replicate > 1:
        names[0], sizes[0] = "dp_replicate x dp_shard", f"{plan.dp_replicate}x{plan.dp_shard}"
    if plan.cp > 1:
        names.insert(2, "cp")
        sizes.insert(2, str(plan.cp))
    text = f"({', '.join(sizes)}) = {dp * pp * plan.cp * tp} GPUs"
    if plan.dp_replicate > 1:
        text += (f", HSDP: ZeRO shards over the {plan.dp_shard} ranks of a replica and all-reduces across "
                 f"{plan.dp_replicate} replicas")
    if plan.cp > 1:
        text += f", each sequence split over cp={plan.cp} ranks"
    return f"mesh ({', '.join(names)})", text


def _header(plan) -> str:
    pp = plan.mesh[1]
    n_params = sum(math.prod(p.shape) for p in plan.parameters)
    totals: dict[tuple[str, str], int] = {}
    for c in plan.collectives:
        totals[(c.axis, c.phase)] = totals.get((c.axis, c.phase), 0) + c.bytes
    comm = ", ".join(f"{a} {ph} {human_bytes(b)}" for (a, ph), b in sorted(totals.items())) or "none"
    sched = f"{plan.schedule}, {plan.microbatches} microbatches"
    if plan.virtual_stages > 1:
        sched += f", {plan.virtual_stages} stages per rank"
    cp = [("cp attention", plan.cp_attention)] if plan.cp > 1 else []
    facts = [_mesh_fact(plan), *cp, ("device", plan.device),
             ("schedule", sched if pp > 1 else f"no pipeline, {plan.microbatches} microbatch(es)"),
             ("sequence parallel", "on" if plan.sequence_parallel else "off"), ("ZeRO", _zero_fact(plan)),
             ("recompute", f"{plan.recompute} ({len(plan.recompute_regions)} regions)"),
             ("optimizer offload", _offload_fact(plan)),
             ("predicted step time", human_time(plan.predicted_step_time)),
             ("compute / comm", f"{human_time(plan.predicted_compute_s)} / {human_time(plan.predicted_comm_s)}"),
             ("parameters", f"{n_params / 1e6:.1f} M"), ("microbatch inputs", " ".join(map(str, map(list, plan.input_shapes)))),
             ("plan source", f"{plan.source}, solved in {plan.solve_seconds:.2f} s"), ("bytes moved per step", comm)]
    cells = "".join(f'<div class="fact"><b>{_e(k)}</b>{_e(v)}</div>' for k, v in facts)
    notes = "".join(f"<li>{_e(n)}</li>" for n in plan.notes)
    warnings = "".join(f"<li>{_e(w)}</li>" for w in plan.warnings)
    return (f"<header><h1>autopar plan: {_e(_mesh_title(plan))} on {_e(plan.device)}</h1>"
            f'<div class="facts">{cells}</div>' + (f"<ul class='warn'>{warnings}</ul>" if warnings else "")
            + (f"<ul class='muted'>{notes}</ul>" if notes else "") + "</header>")


def _layer_html(layer: _Layer, colour: str, recomputed: set, kept: tuple = (), offload: str = "") -> str:
    name = layer.key or _TOP
    if layer.count > 1:
        prefix = layer.key.rsplit(".", 1)[0]
        name = f"{prefix}.{layer.key.rsplit('.', 1)[1]}–{layer.last.rsplit('.', 1)[1]}"
    badges = ([f'<span class="x">x {layer.count}</span><span class="muted">identical layers; '
               f'collectives per layer</span>'] if layer.count > 1 else [])
    ops = f"{len(layer.nodes)} op{'s' if len(layer.nodes) != 1 else ''}"
    if len(layer.nodes) <= 3:
        ops += ": " + ", ".join(n.op.split(".")[1] if n.op.startswith("aten.") else n.op for n in layer.nodes)
    badges.append(f'<span class="muted">{_e(ops)}</span>')
    for c in layer.colls:
        at = _rel(c.where, layer.key)
        badges.append(f'<span class="coll {_e(c.axis)}" title="{_e(c.where)}">{_e(at + ": " if at else "")}'
                      f'{_e(c.kind)} {_e(c.axis)} {_e(c.phase)} x{c.count} {human_bytes(c.bytes)}</span>')
    if layer.key in kept:   # ZeRO-3 without its backward re-gather
        badges.append('<span class="rc">kept gathered from forward to backward</span>')
    if offload:   # the unit's fp32 master and optimizer state: on the host, or kept on the device
        badges.append(f'<span class="off {offload}">optimizer '
                      f'{"on the host" if offload == "host" else "kept on the device"}</span>')
    n_rc = sum(n.name in recomputed for n in layer.nodes)
    if n_rc:
        badges.append(f'<span class="rc">recompute {n_rc} op{"s" if n_rc != 1 else ""}</span>')
    rows = []
    for n in layer.nodes:
        ins = " ".join(_placement(p) for p in n.inputs)
        rows.append(f'<tr><td class="m">{_e(n.name)}</td><td class="m">{_e(n.op)}</td>'
                    f'<td class="m">{_e(_rel(n.module, layer.key) or n.module or _TOP)}</td><td>{ins}</td>'
                    f"<td>{_placement(n.output)}</td><td class='m'>{_e(n.local or '')}</td>"
                    f"<td>{'yes' if n.name in recomputed else ''}</td></tr>")
    note = (f'<p class="muted">Ops of {_e(layer.key)}; {layer.count - 1} following layer(s) are identical. '
            f"Collective counts and bytes are per layer.</p>" if layer.count > 1 else "")
    table = ("<table><tr><th>node</th><th>op</th><th>module</th><th>inputs</th><th>output</th>"
             f"<th>local impl</th><th>recompute</th></tr>{''.join(rows)}</table>")
    where = f' data-offload="{offload}"' if offload else ""
    return (f'<details class="layer" style="--c:{colour}"{where}><summary><span class="name">{_e(name)}</span>'
            f"{''.join(badges)}</summary><div>{note}{table}</div></details>")


def _model(plan) -> str:
    layers, unattached = _layers(plan)
    recomputed = {name for region in plan.recompute_regions for name in region}
    offloaded = ["" if plan.offload == "none" else "device" if unit in plan.offload_kept else "host"
                 for unit in _layer_units(layers)]
    stages = {s.index: s for s in plan.stages}
    order = sorted(stages) or [0]
    parts = ['<h2>Model, by pipeline stage</h2><p><button onclick="setAll(true)">expand all</button>'
             '<button onclick="setAll(false)">collapse all</button><span class="muted">Click a layer for its ops '
             "and placements. Placements: R replicated, P partial sum, S(d) sharded on dim d, "
             "S(d)ik interleaved.</span></p>"]
    for k in order:
        colour = _STAGE_COLOURS[k % len(_STAGE_COLOURS)]
        s = stages.get(k)
        title = (f"Stage {k} on pp rank {s.rank}: {human_time(s.predicted_time_s)} per microbatch, "
                 f"{human_bytes(s.memory_bytes)}" if s else "Stage 0 (no pipeline: the whole model)")
        body = "".join(_layer_html(layer, colour, recomputed, plan.keep_gathered, where)
                       for layer, where in zip(layers, offloaded) if layer.stage == k)
        parts.append(f'<section class="stage" data-stage="{k}" style="--c:{colour}"><h3>{_e(title)}</h3>{body}</section>')
    if unattached:
        rows = "".join(f'<tr><td class="m">{_e(c.where or _TOP)}</td><td>{_e(c.kind)}</td><td>{_e(c.axis)}</td>'
                       f"<td>{_e(c.phase)}</td><td>{c.count}</td><td>{human_bytes(c.bytes)}</td></tr>"
                       for c in unattached)
        parts.append("<h3>Collectives outside any layer (loss, gradient and optimizer sync)</h3><table>"
                     "<tr><th>where</th><th>kind</th><th>axis</th><th>phase</th><th>count</th><th>bytes</th></tr>"
                     f"{rows}</table>")
    return "".join(parts)


def _memory(plan) -> str:
    if not plan.memory:
        return ""
    scale = max(max(m.peak, sum(getattr(m, p) for p, _ in _MEMORY_PARTS)) for m in plan.memory) or 1.0
    legend = "".join(f'<span class="sw" style="background:{c}"></span>{p}' for p, c in _MEMORY_PARTS)
    rows = []
    for m in plan.memory:
        segs = "".join(f'<span style="width:{100 * getattr(m, p) / scale:.3f}%;background:{c}" '
                       f'title="{p} {human_bytes(getattr(m, p))}"></span>' for p, c in _MEMORY_PARTS)
        nums = " · ".join(f"{p} {human_bytes(getattr(m, p))}" for p, _ in _MEMORY_PARTS)
        rows.append(f'<div class="memrow" data-memory-stage="{m.stage}"><b>stage {m.stage}</b>'
                    f'<div class="bar">{segs}</div><span>peak <b>{human_bytes(m.peak)}</b></span></div>'
                    f'<div class="muted" style="margin-left:100px">{_e(nums)}</div>')
    return (f"<h2>Memory per rank (recompute {_e(plan.recompute)})</h2><div class='legend muted'>{legend}</div>"
            + "".join(rows))


def _parameters(plan) -> str:
    axes = list(dict.fromkeys(a for p in plan.parameters for a in p.placements))
    stage_modules = _stage_of_module(plan)
    rows = []
    for p in plan.parameters:
        owner = _layer_key(p.fqn.rsplit(".", 1)[0], stage_modules)
        colour = _STAGE_COLOURS[stage_modules.get(owner, 0) % len(_STAGE_COLOURS)]
        cells = "".join(f"<td>{_placement(p.placements[a]) if a in p.placements else ''}</td>" for a in axes)
        tied = f"tied: {', '.join(p.aliases)}" if p.aliases else ""
        held = list(plan.held_shape(p))   # under ZeRO-2/3 this rank's dp shard of it
        rows.append(f'<tr data-param="{_e(p.fqn)}"><td class="m" style="border-left:5px solid {colour}">{_e(p.fqn)}</td>'
                    f'<td class="m">{_e(list(p.shape))}</td>{cells}<td class="m">{_e(held)}</td>'
                    f'<td class="muted">{_e(tied)}</td></tr>')
    head = "".join(f"<th>{_e(a)}</th>" for a in axes)
    sharded = plan.zero >= 2 and plan.dp_shard > 1
    held = "; local shape: this rank's ZeRO dp shard of rows of its tp shard" if sharded else ""
    return ("<h2>Parameters</h2><p class='muted'>Placement per mesh axis (dp shows ZeRO sharding" + held + "); "
            "S(d)ik interleaved: dim d is k blocks (fused q, k, v) and each rank holds its slice of each. "
            "Left edge: colour of the stage holding it.</p>"
            f"<table><tr><th>parameter</th><th>global shape</th>{head}<th>local shape</th><th></th></tr>"
            f"{''.join(rows)}</table>")


def _rehearsals(plan) -> str:
    """Each rehearsed rank (``autopar.rehearse``): measured beside predicted, and its collectives."""
    if not plan.rehearsals:
        return ""
    parts = ["<h2>Rehearsed ranks</h2><p class='muted'>One rank run alone on one device, its collectives moving "
             "no data: compute and memory measured, communication and bubble as the plan priced them.</p>"]
    for r in plan.rehearsals:
        rows = [("compute", _ms(r.compute_s), _ms(r.predicted_compute_s)),
                ("update", _ms(r.update_s), _ms(r.predicted_update_s)),
                ("peak memory", human_bytes(r.peak_bytes), human_bytes(r.predicted_peak_bytes)),
                ("parameters materialised", human_bytes(r.param_bytes), human_bytes(r.planned_param_bytes)),
                ("communication + bubble (priced)", _ms(r.comm_s + r.bubble_s), _ms(r.comm_s + r.bubble_s)),
                ("step", _ms(r.step_s), _ms(r.predicted_step_s))]
        body = "".join(f"<tr><td>{_e(k)}</td><td class='m'>{_e(a)}</td><td class='m'>{_e(b)}</td></tr>" for k, a, b in rows)
        colls = "".join(f"<tr><td>{_e(c.kind)}</td><td>{_e(c.axis)}</td><td class='m'>x{c.count} "
                        f"{_e(human_bytes(c.bytes))}</td><td class='m'>x{c.planned_count} "
                        f"{_e(human_bytes(c.planned_bytes))}</td></tr>" for c in r.collectives)
        parts.append(f"<h3 data-rehearsed-rank='{r.rank}'>Rank {r.rank} ({_e(r.coords)}; {_e(r.why)}) on "
                     f"{_e(r.device)}, priced for {_e(r.priced_on)}, {r.steps} timed steps</h3>"
                     f"<p class='muted'>peak memory: {_e(r.memory)}</p>"
                     f"<table><tr><th></th><th>rehearsed</th><th>plan</th></tr>{body}</table>"
                     + (f"<table><tr><th>collective</th><th>axis</th><th>issued per step</th><th>plan</th></tr>"
                        f"{colls}</table>" if colls else ""))
    return "".join(parts)


def _ms(seconds: float) -> str:
    return f"{seconds * 1e3:.3f} ms"


def _mesh_title(plan) -> str:
    """The mesh as the summary's first line writes it: "dp=4 (2 replicas x 2 shards) pp=1 cp=2 tp=2"."""
    mesh = Mesh.of_plan(plan)
    return f"{mesh.dp_text()} pp={mesh.pp}{mesh.cp_text()} tp={mesh.tp}"


def render(plan) -> str:
    """The plan as a complete, self-contained HTML document (no network needed to view it)."""
    return ("<!DOCTYPE html>\n<html lang='en'><head><meta charset='utf-8'>"
            f"<title>autopar plan: {_e(_mesh_title(plan))} ({_e(plan.device)})</title>"
            f"<style>{_CSS}</style><script>{_JS}</script></head><body><main>"
            f"{_header(plan)}{_model(plan)}{_memory(plan)}{_parameters(plan)}{_rehearsals(plan)}"
            "</main></body></html>\n")
