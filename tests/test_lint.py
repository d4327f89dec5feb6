"""The code stays ruff-clean, mypy-strict on the core (app/geo, the coordinator, workers,
spark) and clean under mypy's default checks everywhere else (the rest of app, bench)."""

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


def test_mypy() -> None:
    """One run over every package: pyproject.toml makes the core's modules strict."""
    r = subprocess.run([sys.executable, "-m", "mypy", "app", "workers", "spark", "bench"],
                       cwd=ROOT, capture_output=True, text=True)
    assert r.returncode == 0, r.stdout + r.stderr


def test_import_contracts() -> None:
    """The layers point one way (contracts in .importlinter): app.geo is pure, nothing below the
    web layer imports app.api, spark has no web code, nothing imports the CLI back."""
    r = subprocess.run([str(BIN / "lint-imports")], cwd=ROOT, capture_output=True, text=True)
    assert r.returncode == 0, r.stdout + r.stderr
