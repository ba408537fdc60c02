"""Subprocesses of the tests: ``python -m autopar ...`` as a user runs it, with the session's environment.

The test pool spawns ranks from a background thread, and while a rank's process starts, this
process's environment holds that rank's RANK, WORLD_SIZE and MASTER_PORT; a subprocess must not
inherit them (it would take itself for a rank), so it gets ``autopar.launch.environment()``.
"""
from __future__ import annotations

import subprocess
import sys

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
