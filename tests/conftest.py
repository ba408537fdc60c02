"""Puts tests/ on sys.path for every test directory, so that tests/passes and tests/kernels can import
the shared helpers (parity, pool) however pytest is started."""


def pytest_terminal_summary(terminalreporter):
    """The pooled rank jobs' own times (pytest's durations charge a job to whichever test first waits for its pool)."""
    import pool

    rows = pool.timings()
    if rows:
        totals = {}
        for seconds, world, _ in rows:
            totals[world] = totals.get(world, 0.0) + seconds
        terminalreporter.write_line("pooled jobs, seconds on rank 0, per world: "
                                    + ", ".join(f"{w}: {s:.0f}" for w, s in sorted(totals.items())))
        for seconds, world, name in rows[:12]:
            terminalreporter.write_line(f"  {seconds:7.1f}  world {world}  {name}")
