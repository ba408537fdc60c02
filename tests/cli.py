"""Subprocesses of the tests: ``python -m autopar ...`` as a user runs it, with the session's environment;
and the same command line run in this process (``main``), for tests about what a command prints.

``background`` registers a command at a test module's import; it starts with the session's tests
(conftest calls ``start_background``) and runs beside them, so the tests that read it do not hold
the test process up while it starts Python and imports torch. That matters most for `torchrun`:
it starts its workers in sessions of their own, and Linux's autogroup scheduling gives a new
session a few percent of a core while the ranks of the test pool, in the session of the tests, keep
both cores busy (measured: a busy loop got 1-9% of a core in a new session, 18-71% in the tests'
one at nice 0). Its two workers took 100-230 s to import torch and autopar during a suite run,
against 3 s on an idle machine.

The test pool spawns ranks from a background thread, and while a rank's process starts, this
process's environment holds that rank's RANK, WORLD_SIZE and MASTER_PORT; a subprocess must not
inherit them (it would take itself for a rank), so it gets ``autopar.launch.environment()``.
"""
from __future__ import annotations

import atexit
import contextlib
import io
import shutil
import subprocess
import sys
import tempfile
import threading
import time
import warnings
from pathlib import Path

import pool
from autopar.launch import environment


def run(cmd: list[str], *, timeout: float = 120, cwd=None, check: bool = False,
        **env) -> subprocess.CompletedProcess:
    """``cmd`` with text output captured, in the session's environment plus ``env``."""
    return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, cwd=cwd, check=check,
                          env={**environment(), **env})


# FutureWarnings off and a wide terminal for the tables of ``python -m autopar``
_AUTOPAR_ENV = {"PYTHONWARNINGS": "ignore::FutureWarning", "COLUMNS": "200"}


def autopar(*args: str, timeout: float = 120, cwd=None, **env) -> subprocess.CompletedProcess:
    """``python -m autopar ARGS``, as a user runs it."""
    return run([sys.executable, "-m", "autopar", *args], timeout=timeout, cwd=cwd, **{**_AUTOPAR_ENV, **env})


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




class Background:
    """A command of a test module that runs beside the session's tests (see ``background``)."""

    def __init__(self, cmd, files: dict[str, str], timeout: float, env: dict[str, str], module: str):
        self.cmd, self.files, self.timeout, self.env, self.module = cmd, files, timeout, env, module
        self.dir: Path | None = None
        self._done = threading.Event()
        self._outcome: tuple[subprocess.CompletedProcess, float] | None = None
        self._error: BaseException | None = None

    def start(self) -> None:
        """Writes the files to a fresh directory and starts the command there, in a thread that waits for it."""
        self.dir = Path(tempfile.mkdtemp(prefix="autopar-background-"))
        atexit.register(shutil.rmtree, self.dir, ignore_errors=True)
        for name, text in self.files.items():
            (self.dir / name).write_text(text)
        threading.Thread(target=self._run, name=f"autopar-background-{self.module}", daemon=True).start()

    def _run(self) -> None:
        try:
            cmd = self.cmd() if callable(self.cmd) else self.cmd
            # below this process's priority, with the test pool's named lanes (above its default lane)
            done = run(["nice", "-n", str(pool.NICE[1]), *cmd], timeout=self.timeout, cwd=self.dir, **self.env)
            self._outcome = (done, time.time())
        except BaseException as e:   # handed to the test that reads it
            self._error = e
        finally:
            self._done.set()

    def result(self) -> tuple[subprocess.CompletedProcess, float, Path]:
        """The finished process, the time (``time.time()``) it ended and its working directory; a
        command not started yet (the session did not start it) starts now."""
        if self.dir is None:
            self.start()
        self._done.wait()
        if self._error is not None:
            raise AssertionError(f"background command failed: {self._error!r}") from self._error
        return (*self._outcome, self.dir)


_BACKGROUND: list[Background] = []


def background(cmd, *, files: dict[str, str] | None = None, timeout: float = 600, **env) -> Background:
    """Registers ``cmd`` (a list, or a callable that returns one when the command starts, e.g. to pick
    a free port then) to run in a fresh directory holding ``files`` (name: text), with the session's
    environment plus ``env``; ``start_background`` starts it."""
    return _register(cmd, files or {}, timeout, env, sys._getframe(1).f_globals.get("__name__", ""))


def _register(cmd, files: dict[str, str], timeout: float, env: dict[str, str], module: str) -> Background:
    entry = Background(cmd, files, timeout, env, module)
    _BACKGROUND.append(entry)
    return entry


def background_autopar(*args: str, timeout: float = 600) -> Background:
    """``python -m autopar ARGS`` as ``autopar`` runs it, registered with ``background``; files it writes
    to relative paths land in its directory."""
    return _register([sys.executable, "-m", "autopar", *args], {}, timeout, _AUTOPAR_ENV,
                     sys._getframe(1).f_globals.get("__name__", ""))


def start_background(modules: set[str]) -> None:
    """Starts the registered commands of the test modules in ``modules`` (those with tests to run) at
    a lower priority than this process, whose tests are the session's longest chain of work."""
    for entry in _BACKGROUND:
        if entry.module in modules and entry.dir is None:
            entry.start()
