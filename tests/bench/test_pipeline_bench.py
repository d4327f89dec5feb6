"""The pipeline benchmark (bench/pipeline.py) end to end on a tiny load, through the command
line as a user runs it: every expected match delivered once, with the per-hop breakdown and
Redis's own account of its time in the report."""

from __future__ import annotations

import pytest

from tests.bench import run_bench

pytestmark = pytest.mark.slow


def test_tiny_run_delivers_every_match_once_and_reports_where_time_went() -> None:
    out = run_bench("pipeline", "--scenario", "selective", "--subs", "2000", "--objects", "6000",
                    "--batch", "500")
    report = dict(line.split(None, 1) for line in out.stdout.splitlines() if line.strip())
    expected = int(report["expected_matches"])
    assert expected > 100  # the tiny workload still matches
    assert int(report["delivered"]) == expected
    assert report["duplicates"] == report["missing"] == report["extra"] == "0"
    assert float(report["latency_ms_p50"]) > 0  # parsed from the frames after the run
    for hop in ("validate", "append", "match", "write", "send"):
        assert report[f"hop_{hop}_ms"].startswith("n "), hop
    assert "redis_evalsha" in report or "redis_eval" in report  # the scripts were counted
