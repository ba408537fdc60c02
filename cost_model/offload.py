"""Optimizer offload, whole or partial: what a step's update costs on the device and on the host.

With offload="optimizer" a plan's ``offload_kept`` names the units (``autopar.graph.units.zero_units``)
whose fp32 master and optimizer state stay on the device, each parameter with its owner unit
(``owner_units``); the host holds the rest (``autopar.runtime.offload``; the bytes per parameter on
either side are ``cost_model.state``'s). A rank's update is then two optimizers' work:

    update   the device's AdamW over the kept state (ADAMW_TRAFFIC bytes per fp32 byte at the
             device's ``optimizer_bandwidth``) and the 16-bit casts of every weight
             (``compute.update_time``)
    offload  what the host's part leaves exposed: gradients copied out (4 bytes per parameter at
             ``host_bandwidth``), the CPU's AdamW (``host_adam_rate``, slowed by the copies that
             stream through the same host memory: 4 bytes per copied parameter beside AdamW's
             ``HOST_ADAMW_BYTES``), weights copied back in

When the host runs (``offload_timing``, the runtime's rule, ``runtime.program._updates_in_backward``):

- "backward": one stage (pp = 1), no dp or cp sum after the backward (dp x cp = 1, or ZeRO-2/3,
  which reduce-scatter inside it), not ZeRO-1, the update not delayed. Each offloaded unit's
  gradients are final once its backward is done, and the host updates the units in that order,
  one job each, as they come: with u_1 .. u_n the offloaded units in backward order, r_j the
  seconds into the backward at which unit j's gradients are final (the backward seconds of the
  units before it and its own, ``backward_units``), J_j its job (its gradients out and its AdamW
  in chunks, ``host_job_time``) and I_j its weights' copy in, which waits until no op of the
  backward reads them (the next offloaded unit's r, or the backward's end B):

      e_j = max(r_j, e_{j-1}) + J_j          the host's jobs run one after another
      w_j = max(e_j, r_{j+1}, w_{j-1}) + I_j   the weights come in on one stream (r_{n+1} = B)
      offload = max(0, w_n - B)

  ``opt.step()`` waits for the host, then steps the kept units: update and offload add up. The
  units whose gradients are final earliest in the backward (the last blocks) give the host the
  most backward to run beside, which is why a split offloads them first (``planner.choices``).
- "after" (every other exact update): ``opt.step()`` launches the device's update of the kept
  units, then runs the host's chunked pipeline over all offloaded state (``compute.offload_update_time``)
  beside it: offload = max(0, H - A), A the device's AdamW seconds.
- "delayed" (``offload_delay=1``): ``opt.step()`` of step t copies in the host's update of step
  t-1 (I, beside the device's AdamW A), steps the kept units and hands the host step t's
  gradients, whose job J (copies out and AdamW) runs beside step t+1's forward and backward, the
  step's other terms W: offload = max(0, J - W) + max(0, I - A).

Every term is seconds spent, never negative; an overlap is credited only against the work it
runs beside (the backward, the device's AdamW, the next step), never against another term.
"""
from __future__ import annotations

from autopar.graph.precision import compute_dtype
from autopar.graph.units import owner_units, zero_units
from autopar.mesh import Mesh

from .compute import HOST_ADAMW_BYTES, OFFLOAD_CHUNK, check_host_figures, offload_update_time, update_time
from .state import kept_params, kept_state_bytes, local_param_bytes, state_bytes, state_shards
from .step import BACKWARD_SHARE, recompute_seconds
from .strategy import OP_OVERHEAD, strategy_time

OFFLOAD_TIMINGS = ("backward", "after", "delayed")


def offload_timing(mesh, zero: int, delay: int, *, inductor: bool = True) -> str:
    """When the host's update runs under offload (module docstring): "delayed" with ``delay``,
    "backward" where each unit's gradients are final inside the backward (one stage, no dp or cp
    sum after it, not ZeRO-1) and the step is not lowered through Inductor, else "after". Plans
    are priced for ``parallelize``'s default, Inductor (``inductor``): on one H200 the host's jobs
    started from the markers of an Inductor backward ended as late as if they had started at its
    end (1.396 s per step against 1.268 s updating after it, ``docs/design.md``), so the runtime
    updates after the backward there (``runtime.program._updates_in_backward``)."""
    if delay:
        return "delayed"
    fsdp = zero >= 2 and mesh.dp_shard > 1
    if mesh.pp == 1 and zero != 1 and (mesh.data == 1 or fsdp) and not inductor:
        return "backward"
    return "after"


def _chunk_sizes(params: float, chunk: int) -> list[float]:
    full, rest = divmod(params, chunk)
    return [float(chunk)] * int(full) + ([rest] if rest else [])


def host_job_time(params: float, dev, *, chunk: int = OFFLOAD_CHUNK, alongside: float = 0.0) -> float:
    """Seconds of one host job over ``params`` fp32 parameters, without its weights' copy in: chunk
    by chunk, the chunk's gradients copied out (4 bytes each at ``host_bandwidth``), then the CPU's
    AdamW over it while the next chunk's gradients copy out, each AdamW slowed by the copies
    through host memory beside it (the next chunk's, and ``alongside`` parameters' weights coming
    in meanwhile: 4 bytes each beside AdamW's ``HOST_ADAMW_BYTES``). With chunks of p_i:

        4 p_1 / bw + sum_i max((p_i + 4 (p_{i+1} + a_i) / HOST_ADAMW_BYTES) / rate, 4 p_{i+1} / bw)

    (a_1 = ``alongside``, the other a_i 0; p_{n+1} = 0)."""
    check_host_figures(dev)
    sizes = _chunk_sizes(params, chunk)
    if not sizes:
        return 0.0
    copy = [4.0 * p / dev.host_bandwidth for p in sizes] + [0.0]
    nxt = sizes[1:] + [0.0]
    total = copy[0]
    for i, p in enumerate(sizes):
        shared = nxt[i] + (alongside if i == 0 else 0.0)
        total += max((p + 4.0 * shared / HOST_ADAMW_BYTES) / dev.host_adam_rate, copy[i + 1])
    return total


def copy_in_time(params: float, dev) -> float:
    """Seconds of ``params`` fp32 weights copied from host memory to the device (4 bytes each)."""
    check_host_figures(dev)
    return 4.0 * params / dev.host_bandwidth


def backward_exposed(units, backward: float, dev, *, chunk: int = OFFLOAD_CHUNK) -> float:
    """Seconds the host's per-unit updates run past the end of a backward of ``backward`` seconds
    (the module docstring's "backward" recurrence): ``units``, (fp32 parameters the host steps,
    seconds into the backward at which the unit's gradients are final) of each offloaded unit in
    backward order."""
    units = [(p, r) for p, r in units if p > 0]
    done = landed = previous = 0.0
    for j, (params, ready) in enumerate(units):
        done = max(ready, done) + host_job_time(params, dev, chunk=chunk, alongside=previous)
        release = units[j + 1][1] if j + 1 < len(units) else backward
        landed = max(done, release, landed) + copy_in_time(params, dev)
        previous = params
    return max(0.0, landed - backward)


def backward_floor(units, backward: float, dev, *, chunk: int = OFFLOAD_CHUNK) -> float:
    """A lower bound of ``backward_exposed`` for ``units`` and for every longer list that starts with
    them: the host's last job of ``units`` ends at e_n, and the jobs of units after them only end
    later (each waits for the one before), so max(0, e_n - B). (The exposure itself may fall as
    units are added: the last unit's weights come in after the backward, and a smaller last unit
    copies in sooner.) A longer backward (more recomputed) only lowers it: every unit after the
    longer one, and B, move later by as much, e_n by at most that."""
    done = previous = 0.0
    for params, ready in ((p, r) for p, r in units if p > 0):
        done = max(ready, done) + host_job_time(params, dev, chunk=chunk, alongside=previous)
        previous = params
    return max(0.0, done - backward)


def update_split(kept: float, host: float, dev, *, shards: int, working_copy: bool, timing: str, units=(),
                 backward: float = 0.0, window: float = 0.0) -> tuple[float, float]:
    """(update, offload) seconds of a rank whose device steps the optimizer of ``kept`` local fp32
    parameter bytes and whose host steps ``host`` (both before ZeRO's sharding over ``shards``
    ranks), at ``timing`` (module docstring). ``units``, ``backward``: the "backward" timing's
    (``backward_units``); ``window``: the "delayed" timing's, the seconds of the step's other terms
    that the host's job runs beside."""
    adam = update_time(kept, dev, working_copy=False, optimizer_shards=shards)
    casts = update_time(kept + host, dev, working_copy=True, offload=True) if working_copy else 0.0
    if not host:
        return adam + casts, 0.0
    params = host / 4.0 / shards
    if timing == "after":
        exposed = max(0.0, offload_update_time(params, dev) - adam)
    elif timing == "delayed":
        exposed = max(0.0, host_job_time(params, dev) - window) + max(0.0, copy_in_time(params, dev) - adam)
    elif timing == "backward":
        exposed = backward_exposed(units, backward, dev)
    else:
        raise ValueError(f"offload timing {timing!r}: expected one of {', '.join(OFFLOAD_TIMINGS)}")
    return adam + casts, exposed


def plan_update_terms(memory, mesh, zero: int, precision: str, dev, *, offload: bool = False, timing: str = "after",
                      units=(), backward: float = 0.0, window: float = 0.0) -> tuple[float, float]:
    """(update, offload) of the pipeline rank whose update takes longest, read off its stages'
    ``memory`` (a plan's MemoryPlans): the kept state's bytes (``optimizer``) and the offloaded
    (``host``), each over what the memory model holds of them per local fp32 parameter byte
    (``cost_model.state``: ``kept_state_bytes``' optimizer and ``state_bytes``' host under
    offload, else ``state_bytes``' optimizer), priced by ``update_split`` at ``timing`` (with
    ``units``, ``backward`` and ``window`` as there). ``mesh``: a Mesh, or a plan's (dp, pp, tp)."""
    mesh = Mesh.parse(mesh)
    working_copy = 0.0 if precision == "fp32" else compute_dtype(precision).itemsize / 4   # per stored fp32 byte
    shards = state_shards(mesh, zero, working_copy, offload)
    if offload:
        device_rate = kept_state_bytes(zero, shards, working_copy).optimizer
        host_rate = state_bytes(zero, shards, working_copy, offload=True).host
    else:
        device_rate, host_rate = state_bytes(zero, shards, working_copy).optimizer, 0.0
    best = (0.0, 0.0)
    for r in range(mesh.pp):
        mine = [m for m in memory if m.stage % mesh.pp == r]
        kept = sum(m.optimizer for m in mine) / device_rate if device_rate else 0.0
        host = sum(m.host for m in mine) / host_rate if host_rate else 0.0
        terms = update_split(kept, host, dev, shards=shards if zero else 1, working_copy=precision != "fp32",
                             timing=timing if offload else "after", units=units, backward=backward, window=window)
        if sum(terms) > sum(best):
            best = terms
    return best


def backward_units(cap, strategies, mesh, dev, *, zero: int, offload_kept, regions, tp_inter: bool):
    """The "backward" timing's figures for one microbatch on one rank (``backward_exposed``): per
    offloaded unit of ``zero_units(cap)``, in backward order, (fp32 parameters its host steps on
    this rank, seconds into the backward at which its gradients are final), and the backward's
    seconds. A unit's backward is ``BACKWARD_SHARE`` of its ops' forward and backward
    (``strategy_time`` and launch overhead, as the compute term prices them) plus the forward of its
    ``regions`` recomputed (``step.recompute_seconds``), over cp; its parameters are those it owns
    (``owner_units``: a weight shared by several units is final after the first's backward, the
    last to add to it) but for the units in ``offload_kept``, over the ranks ZeRO shards them."""
    units = zero_units(cap)
    owners = owner_units(cap)
    local = local_param_bytes(cap, strategies, tuple(cap.params), mesh.tp)
    shards = state_shards(mesh, zero, 0.0, True) if zero else 1
    owned: dict[str, float] = {}
    for fqn, nbytes in local.items():
        owned[owners[fqn]] = owned.get(owners[fqn], 0.0) + nbytes / 4.0 / shards
    recomputed = {n for region in regions for n in region}
    out, clock = [], 0.0
    for u in reversed(units):
        ops = [n for n in u.nodes if n.op == "call_function"]
        seconds = BACKWARD_SHARE * (sum(strategy_time(n, strategies[n], mesh.tp, dev, tp_inter, False) for n in ops)
                                    + OP_OVERHEAD * len(ops))
        seconds += recompute_seconds(strategies, [n for n in ops if n in recomputed], mesh.tp, dev, tp_inter)
        clock += seconds / mesh.cp
        if u.name not in offload_kept and owned.get(u.name):
            out.append((owned[u.name], clock))
    return out, clock


def update_floor(cap, strategies, mesh, dev, *, zero: int, precision: str, offload_kept, timing: str, regions,
                 window: float, tp_inter: bool) -> float:
    """A lower bound of update + offload (``plan_update_terms``) on one stage (pp = 1) for every split
    that keeps at most the units ``offload_kept`` on the device, whatever it recomputes: the 16-bit
    casts (which no split removes: the device's AdamW only shrinks as units leave) and the host's
    exposed seconds with ``offload_kept`` kept, priced beside the longest backward any recompute
    choice gives (``regions``: the most that may be recomputed) and the longest ``window`` of the
    step's other terms: beside the backward ``backward_floor`` (the host's jobs end no sooner as
    units leave the device, each queued after the others, its gradients final later); after it or
    one step late the exposure itself, which grows as units leave (more host work, a smaller device
    update to hide behind); both shrink as the backward or the window lengthens, so no such split
    exposes less (``planner.offload_split``'s floor)."""
    working_copy = 0.0 if precision == "fp32" else compute_dtype(precision).itemsize / 4
    shards = state_shards(mesh, zero, working_copy, True) if zero else 1
    local = local_param_bytes(cap, strategies, tuple(cap.params), mesh.tp)
    on_device = kept_params(cap, offload_kept)
    kept = sum(b for f, b in local.items() if f in on_device)
    host = sum(local.values()) - kept
    casts = update_time(kept + host, dev, working_copy=True, offload=True) if precision != "fp32" else 0.0
    if timing == "backward":
        units, backward = backward_units(cap, strategies, mesh, dev, zero=zero, offload_kept=offload_kept,
                                         regions=regions, tp_inter=tp_inter)
        return casts + backward_floor(units, backward, dev)
    return casts + update_split(kept, host, dev, shards=shards, working_copy=False, timing=timing,
                                window=window)[1]


# host bytes per offloaded fp32 parameter: its master and AdamW's two moments (``state.state_bytes``' host)
HOST_STATE_BYTES = 12.0


def staging_bytes(params: float, *, chunk: int = OFFLOAD_CHUNK) -> float:
    """Host bytes of the pinned buffers the runtime stages ``params`` offloaded parameters' fp32
    gradients in (``autopar.runtime.offload.HostMasters``): one chunk of at most ``chunk``, two
    taking turns where there is more than one chunk."""
    if params <= 0:
        return 0.0
    return 4.0 * min(params, chunk) * (2 if params > chunk else 1)


def host_need(memory, pp: int) -> float:
    """Host bytes the busiest pipeline rank's offloaded optimizer needs, from its stages' ``memory``
    (MemoryPlans): their state (``host``) and the gradients' staging buffers."""
    need = 0.0
    for r in range(pp):
        state = sum(m.host for m in memory if m.stage % pp == r)
        need = max(need, state + staging_bytes(state / HOST_STATE_BYTES))
    return need


def host_needs(order, mesh, zero: int) -> list[float]:
    """Per k from 0 to len(``order``), ``host_need`` of one rank with the first k of ``order`` ((unit,
    local fp32 bytes of the parameters it owns), ``planner.offload_split.offload_order``) offloaded:
    exact on one stage; with pp > 1, 1/pp of it (a rank holds about 1/pp of the units, the cut not
    yet known)."""
    per_byte = state_bytes(zero, state_shards(mesh, zero, 0.0, True), 0.0, offload=True).host / mesh.pp
    out, state = [0.0], 0.0
    for _, nbytes in order:
        state += nbytes * per_byte
        out.append(state + staging_bytes(state / HOST_STATE_BYTES))
    return out
