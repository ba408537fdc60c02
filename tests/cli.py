"""Subprocesses of the tests: ``python -m autopar ...`` as a user runs it, with the session's environment;
and the same command line run in this process (``main``), for tests about what a command prints.

The test pool spawns ranks from a background thread, and while a rank's process starts, this
process's environment holds that rank's RANK, WORLD_SIZE and MASTER_PORT; a subprocess must not
inherit them (it would take itself for a rank), so it gets ``autopar.launch.environment()``.
"""
from __future__ import annotations

import contextlib
import io
import subprocess
import sys
import warnings

from autopar.launch import environment


def run(cmd: list[str], *, timeout: float = 120, cwd=None, check: bool = False,
        **env) -> subprocess.CompletedProcess:
    """``cmd`` with text output captured, in the session's environment plus ``env``."""
    return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, cwd=cwd, check=check,
                          env={**environment(), **env})


def autopar(*args: str, timeout: float = 120, cwd=None, **env) -> subprocess.CompletedProcess:
    """``python -m autopar ARGS``, with FutureWarnings off and a wide terminal for its tables."""
    env = {"PYTHONWARNINGS": "ignore::FutureWarning", "COLUMNS": "200", **env}
    return run([sys.executable, "-m", "autopar", *args], timeout=timeout, cwd=cwd, **env)


def main(*args: str) -> subprocess.CompletedProcess:
    """``autopar.__main__.main(ARGS)`` in this process, with warnings off and what it prints captured:
    what ``autopar(*ARGS)`` returns, without a new interpreter's seconds of imports. For commands
    that start no processes and write no files relative to the working directory."""
    from autopar.__main__ import main as autopar_main

    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        try:
            code = autopar_main(list(args))
        except SystemExit as e:   # argparse's usage errors
            code = e.code if isinstance(e.code, int) else 1
    return subprocess.CompletedProcess(["autopar", *args], code or 0, out.getvalue(), err.getvalue())
