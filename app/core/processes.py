"""Helpers for processes that start other geoswarm processes (the CLI's `dev`, the benchmarks'
and tests' clusters): wait until a started server answers."""

from __future__ import annotations

import subprocess
import time
from typing import Any

import httpx


def wait_until_ok(url: str, process: subprocess.Popen[Any] | None = None,
                  timeout: float = 60.0) -> bool:
    """Poll `url` until it answers 200; False on timeout or when `process` has exited."""
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
