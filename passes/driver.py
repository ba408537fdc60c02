"""The pass driver: runs graph passes in order, checks each one, times it and can dump the graphs.

Every graph pass of ``autopar.passes`` has one shape::

    def name_pass(gm: GraphModule, *, option=..., ...) -> GraphModule:
        \"\"\"One line saying what it rewrites.\"\"\"

It takes the graph first and everything else by keyword, and returns a new GraphModule, leaving
``gm`` as it was: captures are shared (the planner prices the same graph the runtime rewrites,
and a plan's capture is cached across mesh candidates), so a pass that edited its input would make
every later result depend on the order things ran in. A pass that edits nodes starts from
``graph.capture.copy_graph(gm)``. Passes still recompile what they return, so a test may call one directly.

``run_passes(gm, [(pass_fn, kwargs), ...])`` runs them one after the other. After each it

- refuses a pass that returned its input, or changed it (its fingerprint: every node's op, name,
  target, arguments and traced shape and dtype, before and after), naming the pass;
- lints the result and recompiles it, so the code a later pass or torch.compile sees is the graph's;
- records the seconds the pass took (returned, and logged at debug level on ``autopar.passes``);
- with ``dump`` (default: the ``AUTOPAR_DUMP`` environment variable) a directory, writes the graph
  before and after as ``DIR/<prefix>-<NN>-<name>-before.txt`` and ``-after.txt`` (``NN`` the step,
  from 01; ``name`` the pass without ``_pass``). ``prefix`` tells apart the runs of several ranks
  or models writing to one directory (``rank_prefix``); a later run with the same prefix
  overwrites an earlier one's files.

Two passes have other shapes because their inputs or outputs are not one graph, and so are not
run by the driver: ``capture_pass`` makes the first graph from a model, and ``pipeline_split_pass``
cuts one rank's rewritten graph into its stages as the last step (the pipeline runtime calls it
on the driver's result).
"""
from __future__ import annotations

import hashlib
import logging
import os
import time
from pathlib import Path
from typing import Any, Callable

import torch
from torch.fx import GraphModule
from torch.utils._pytree import tree_map

log = logging.getLogger("autopar.passes")

Step = tuple[Callable[..., GraphModule], dict[str, Any]]


def run_passes(gm: GraphModule, steps: list[Step], *, prefix: str = "",
               dump: str | os.PathLike | None = None) -> tuple[GraphModule, list[tuple[str, float]]]:
    """Run ``steps`` ((pass, keyword arguments) pairs) on ``gm`` in order; return the last graph
    and (pass name, seconds of the pass with its lint and recompile) per step. ``gm`` itself comes
    back when there are no steps."""
    dump = dump if dump is not None else os.environ.get("AUTOPAR_DUMP") or None
    if dump is not None:
        Path(dump).mkdir(parents=True, exist_ok=True)
    seconds = []
    for k, (fn, kwargs) in enumerate(steps, start=1):
        name = fn.__name__
        stem = "-".join(filter(None, (prefix, f"{k:02d}", name.removesuffix("_pass"))))
        if dump is not None:
            _write(Path(dump) / f"{stem}-before.txt", gm)
        before = fingerprint(gm)
        start = time.perf_counter()
        out = fn(gm, **kwargs)
        took = time.perf_counter() - start   # the checks below are the driver's, not the pass's, time
        if not isinstance(out, GraphModule):
            raise TypeError(f"{name} returned {type(out).__name__}, not a GraphModule")
        if out is gm or out.graph is gm.graph or fingerprint(gm) != before:
            raise RuntimeError(f"{name} changed its input graph in place; a pass must leave it as it was "
                               "and return a new GraphModule (rewrite autopar.passes.driver.copy_graph(gm))")
        start = time.perf_counter()
        out.graph.lint()
        out.recompile()
        seconds.append((name, took + time.perf_counter() - start))
        log.debug("%s: %.3f s", stem, seconds[-1][1])
        if dump is not None:
            _write(Path(dump) / f"{stem}-after.txt", out)
        gm = out
    return gm, seconds


def fingerprint(gm: GraphModule) -> str:
    """A digest of ``gm``'s graph: each node's op, name, target, arguments and the shapes and
    dtypes of its traced value (``meta["val"]``), in order; editing any of them changes it (other
    ``meta`` keys and the contents of submodules are not part of it)."""
    h = hashlib.sha256()
    for n in gm.graph.nodes:
        val = tree_map(lambda v: (tuple(v.shape), v.dtype) if isinstance(v, torch.Tensor) else v, n.meta.get("val"))
        h.update(repr((n.op, n.name, n.target, n.args, n.kwargs, val)).encode())
    return h.hexdigest()


def rank_prefix(name: str = "") -> str:
    """``name`` and this process's rank (``rank<R>``) while torch.distributed runs: a dump prefix
    that the ranks writing to one AUTOPAR_DUMP directory do not share."""
    rank = f"rank{torch.distributed.get_rank()}" if torch.distributed.is_initialized() else ""
    return "-".join(filter(None, (name, rank)))


def _write(path: Path, gm: GraphModule) -> None:
    path.write_text(gm.print_readable(print_output=False))
