"""The code stays ruff-clean and mypy-strict on the core (app/geo, the coordinator, workers,
spark)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
BIN = Path(sys.executable).parent


def test_ruff_clean() -> None:
    r = subprocess.run([str(BIN / "ruff"), "check", "."], cwd=ROOT, capture_output=True,
                       text=True)
    assert r.returncode == 0, r.stdout + r.stderr


def test_mypy_strict_core() -> None:
    r = subprocess.run([sys.executable, "-m", "mypy", "app/geo", "app/coordinator.py",
                        "workers", "spark"], cwd=ROOT, capture_output=True, text=True)
    assert r.returncode == 0, r.stdout + r.stderr
