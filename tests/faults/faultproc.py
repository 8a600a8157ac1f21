"""Subprocess helpers of the fault tests: PEs run in subprocesses that the
tests start, time and kill themselves, so a crash (SIGSEGV, SIGBUS) or a hang
shows up as a failed test, never as a dead or stuck test session."""
import os
import signal
import subprocess
import sys
import textwrap
import time
from dataclasses import dataclass

import pytest

import symheap

_PYTHONPATH = os.path.dirname(os.path.dirname(os.path.abspath(symheap.__file__)))


@dataclass
class Run:
    rc: int
    out: str
    err: str
    seconds: float

    def describe(self) -> str:
        sig = f" (signal {signal.Signals(-self.rc).name})" if self.rc < 0 else ""
        return f"exit code {self.rc}{sig} after {self.seconds:.2f} s\n{self.out}\n{self.err}"


def child_env(extra=None) -> dict:
    env = dict(os.environ)
    env["PYTHONPATH"] = _PYTHONPATH + os.pathsep + env.get("PYTHONPATH", "")
    env.setdefault("SYMHEAP_BACKEND", "cpu")
    env.update(extra or {})
    return env


def start(code: str, env=None, args=(), **kw) -> subprocess.Popen:
    """Starts `code` (dedented) in a fresh interpreter, in its own process group."""
    return subprocess.Popen([sys.executable, "-c", textwrap.dedent(code), *map(str, args)],
                            env=child_env(env),
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True, **kw)


def finish(proc: subprocess.Popen, timeout: float, t0: float | None = None) -> Run:
    """Waits for `proc` at most `timeout` s; kills its process group past that."""
    t0 = time.monotonic() if t0 is None else t0
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, err = proc.communicate()
        pytest.fail(f"subprocess still running after {timeout} s (killed)\n{out}\n{err}")
    return Run(proc.returncode, out, err, time.monotonic() - t0)


def run_py(code: str, timeout: float = 60, env=None) -> Run:
    t0 = time.monotonic()
    return finish(start(code, env), timeout, t0)
