"""The archive benchmark (bench/archive.py) end to end on a tiny archive, through the command
line as a user runs it: it writes the archive, times queries through Spark before and after
compaction, checks every range count against numpy, and draws its PNG."""

from __future__ import annotations

from pathlib import Path

import pytest

from spark.session import java_available
from tests.bench import run_bench

pytestmark = pytest.mark.slow


def test_tiny_run_reports_both_phases_exactly(tmp_path: Path) -> None:
    ok, detail = java_available()
    if not ok:
        pytest.skip(f"Java 17+ is not installed: {detail}")
    png = tmp_path / "archive.png"
    out = run_bench("archive", "--records", "30000", "--queries", "3", "--min-records", "2000",
                    "--png", str(png), "--ingest-records", "0", timeout=400)
    lines = [ln.split() for ln in out.stdout.splitlines() if ln.strip()]
    phases = {(ln[1], " ".join(ln[2:4])) for ln in lines}
    for phase in ("before", "after"):
        assert (phase, "range 0.1%") in phases and (phase, "knn k=10") in phases, out.stdout
    assert all("wrong=0" in " ".join(ln) for ln in lines if ln[1] in ("before", "after"))
    assert any(ln[1] == "compact" for ln in lines)
    assert png.stat().st_size > 10_000
