"""Puts tests/ on sys.path for every test directory, so that tests/passes and tests/kernels can import
the shared helpers (parity, pool) however pytest is started; runs the pooled rank jobs in the
background while the tests that need no ranks run (``pool.start``), and beside them the commands test
modules registered with ``cli.background``."""
import os

import pytest

# The pooled ranks keep the cores busy while this process runs its own tests: one intra-op thread
# here (and in the subprocesses tests start) rather than threads that contend with the ranks for
# the same cores. Ranks that autopar.launch.spawn starts get their own share (its OMP_NUM_THREADS).
os.environ.setdefault("OMP_NUM_THREADS", "1")
# Inductor's C++ kernels without SIMD: a cold compile of the tiny GPT's step costs about 29 CPU s
# instead of 45 (g++ on the vectorized headers is most of it), and on a fresh machine every kernel
# is cold. The tests that run Inductor read its generated wrapper, its buffers and its cache, which
# do not depend on the kernels' instruction set.
os.environ.setdefault("TORCHINDUCTOR_VEC_ISA_OK", "0")
# Inductor compiles its kernels in this process, not in a pool of worker processes that each
# import torch (seconds of CPU per compiling process) to share two cores the ranks already fill.
os.environ.setdefault("TORCHINDUCTOR_COMPILE_THREADS", "1")


def pytest_collection_modifyitems(items):
    """The modules that register pooled jobs run last, so the background pool has their worlds ready;
    in them, the tests that read no pooled result first, then the readers, in the order the spawns
    they read end (``pool.wait_order``)."""
    import pool

    late = pool.modules()

    def key(item):
        name = getattr(getattr(item, "module", None), "__name__", "")
        if name not in late:
            return (0, 0)
        return (2, pool.wait_order(name)) if _reads_pool(item) else (1, 0)
    items.sort(key=key)


def _reads_pool(item) -> bool:
    """Whether a test reads a pooled result: its code, a fixture it uses or a function of its module
    that it calls calls ``.result()`` (read from the source; a wrong guess costs time, not a result)."""
    import inspect

    def source(fn) -> str:
        try:
            return inspect.getsource(fn)
        except (OSError, TypeError):
            return ""

    def reads(fn, depth: int = 2) -> bool:
        text = source(fn)
        if ".result()" in text:
            return True
        module = inspect.getmodule(fn)
        called = [inspect.unwrap(f) for n, f in vars(module).items() if callable(f) and f"{n}(" in text] if module else []
        return depth > 0 and any(inspect.isfunction(f) and f is not fn and reads(f, depth - 1) for f in called)

    fixtures = [d.func for defs in item._fixtureinfo.name2fixturedefs.values() for d in defs]
    return any(reads(fn) for fn in [getattr(item, "function", None), *fixtures] if fn is not None)


_CPU: dict[str, float] = {}   # test id -> CPU seconds of this process and its reaped children


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item, nextitem):
    before = sum(os.times()[:4])
    yield
    _CPU[item.nodeid] = sum(os.times()[:4]) - before


def pytest_collection_finish(session):
    import cli
    import pool

    if session.items and not session.config.option.collectonly:
        pool.start()
        cli.start_background({getattr(getattr(item, "module", None), "__name__", "") for item in session.items})


def pytest_unconfigure(config):
    import pool

    pool.stop()


def pytest_terminal_summary(terminalreporter):
    """The CPU seconds of this process's costliest tests, as many as AUTOPAR_CPU_ROWS says (none by
    default), and the pooled rank jobs' own times (pytest's durations charge a job to whichever test
    first waits for its pool): the 20 slowest, or as many as AUTOPAR_POOL_ROWS says, with the frames
    each compiled."""
    import pool

    if _CPU:
        top = sorted(_CPU.items(), key=lambda kv: -kv[1])[:int(os.environ.get("AUTOPAR_CPU_ROWS", "0"))]
        if top:
            terminalreporter.write_line(f"this process's CPU seconds (its subprocesses' included): {sum(_CPU.values()):.0f} "
                                        f"over {len(_CPU)} tests; the costliest:")
        for nodeid, used in top:
            terminalreporter.write_line(f"  {used:7.1f}  {nodeid}")
    rows = pool.timings()
    if rows:
        totals, cpu = {}, {}
        for seconds, used, world, *_ in rows:
            totals[world] = totals.get(world, 0.0) + seconds
            cpu[world] = cpu.get(world, 0.0) + used
        terminalreporter.write_line("pooled jobs, seconds on rank 0 (CPU seconds of all ranks), per world: "
                                    + ", ".join(f"{w}: {s:.0f} ({cpu[w]:.0f})" for w, s in sorted(totals.items())))
        terminalreporter.write_line(pool.timeline())
        for seconds, used, world, name, frames in rows[:int(os.environ.get("AUTOPAR_POOL_ROWS", "20"))]:
            compiled = f"  ({frames} frames compiled)" if frames else ""
            terminalreporter.write_line(f"  {seconds:7.1f} ({used:6.1f} CPU)  world {world}  {name}{compiled}")


@pytest.fixture(scope="module")
def ref(request):
    """The unsharded reference run of a parity test module: its ``REFERENCE()`` (``parity.unsharded``
    or ``parity.reference`` with the module's model, batch, steps and learning rate), run once."""
    return request.module.REFERENCE()
