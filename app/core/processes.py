"""Helpers for processes that start other geoswarm processes (the CLI's `dev`, the benchmarks'
and tests' clusters): stop them, wait until a started server answers, and have them die with
their parent."""

from __future__ import annotations

import ctypes
import signal
import subprocess
import time
from collections.abc import Iterable
from typing import Any


def die_with_parent() -> None:
    """A `preexec_fn`: the child gets SIGTERM when the thread that started it ends, even by
    SIGKILL or the OOM killer (Linux; elsewhere nothing). Only for children started from a
    thread that lives as long as they should (a main thread)."""
    try:
        libc = ctypes.CDLL("libc.so.6", use_errno=True)
        libc.prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
    except OSError:
        pass


def stop_processes(procs: Iterable[subprocess.Popen[Any]], grace_s: float = 10.0) -> None:
    """SIGTERM to each (a warm stop), then SIGKILL to any still running after `grace_s`."""
    procs = list(procs)
    for proc in procs:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
    for proc in procs:
        try:
            proc.wait(grace_s)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def wait_until_ok(url: str, process: subprocess.Popen[Any] | None = None,
                  timeout: float = 60.0) -> bool:
    """Poll `url` until it answers 200; False on timeout or when `process` has exited."""
    import httpx  # here: a worker imports this module, and has no other use for httpx

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            if httpx.get(url, timeout=2).status_code == 200:
                return True
        except httpx.HTTPError:
            pass
        if process is not None and process.poll() is not None:
            return False
        time.sleep(0.1)
    return False
