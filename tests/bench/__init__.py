"""The benchmarks' tests, and how they run a benchmark: as a user does, through the command
line from the repository."""

from __future__ import annotations

import subprocess
import sys

from bench.cluster import ROOT


def run_bench(*args: str, timeout: float = 300) -> subprocess.CompletedProcess[str]:
    """`geoswarm bench ARGS`; fails the test with the end of its output unless it exits 0."""
    out = subprocess.run([sys.executable, "-m", "app.cli", "bench", *args], cwd=ROOT,
                         capture_output=True, text=True, timeout=timeout)
    assert out.returncode == 0, out.stderr[-3000:] + out.stdout[-2000:]
    return out
