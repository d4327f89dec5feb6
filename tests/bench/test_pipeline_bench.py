"""The pipeline benchmark (bench/pipeline.py) end to end on a tiny load, through the command
line as a user runs it: every expected match delivered once, with the per-hop breakdown and
Redis's own account of its time in the report."""

from __future__ import annotations

import asyncio
import time

import httpx
import numpy as np
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


def test_keyword_workload_side_by_side_with_and_without_summaries() -> None:
    out = run_bench("pipeline", "--scenario", "keywords", "--subs", "1000", "--objects",
                    "3000", "--batch", "500", "--summaries", "both")
    lines = out.stdout.splitlines()
    assert "summaries off  |  summaries on" in lines[0]
    off, on = {}, {}
    for line in lines[1:]:
        key, rest = line.split(None, 1)
        off[key], on[key] = (v.strip() for v in rest.split("|"))
    for side in (off, on):
        assert int(side["expected_matches"]) > 10
        assert int(side["delivered"]) == int(side["expected_matches"])
        assert side["duplicates"] == side["missing"] == side["extra"] == "0"
    assert off["routed_no_match"] == off["workers_skipped"] == "0"
    # most objects hold none of the 300 tracked words: marked, and stored without matching
    assert int(on["routed_no_match"]) > 3000 // 2
    assert 0 < int(on["workers_skipped"]) <= int(on["routed_no_match"])


def test_comparison_counts_duplicates_missing_and_extra_matches() -> None:
    from bench.pipeline import compare_pairs

    want = np.array([3, 7, 12, 40], dtype=np.int64)
    got = np.array([12, 3, 12, 41, -1, 3, 7], dtype=np.int64)  # -1: an id the run never made
    assert compare_pairs(want, got) == {"expected_matches": 4, "delivered": 7,
                                        "duplicates": 2, "missing": 1, "extra": 2}
    assert compare_pairs(want, want[::-1].copy())["duplicates"] == 0


def test_tiny_run_side_by_side_with_outboxes_and_on_a_redis_cluster() -> None:
    out = run_bench("pipeline", "--scenario", "selective", "--subs", "1000", "--objects", "3000",
                    "--batch", "500", "--redis", "outbox,cluster")
    sides: list[dict[str, str]] = [{}, {}]
    for line in out.stdout.splitlines():
        key, rest = line.split(None, 1)
        for side, value in zip(sides, rest.split("|"), strict=True):
            side[key] = value.strip()
    assert [s["redis"] for s in sides] == ["outbox", "cluster"]
    report = out.stdout + out.stderr[-3000:]  # which side, and what its processes logged
    for side in sides:
        assert int(side["expected_matches"]) > 50, report
        assert int(side["delivered"]) == int(side["expected_matches"]), report
        assert side["duplicates"] == side["missing"] == side["extra"] == "0", report
    # the cluster's three nodes are counted, and their commands summed
    assert "redis-2" in sides[1]["cpu_seconds"] and "redis_evalsha" in out.stdout


def test_a_missing_match_is_told_written_or_never_written() -> None:
    """How the benchmark explains a match it did not receive: a real cluster, one range
    subscription, an object inside it (its match is in the subscription's history: written,
    so lost on the way to the WebSocket had it been missing) and one outside (never
    written)."""
    from bench.cluster import bench_cluster
    from bench.pipeline import diagnose_missing

    with bench_cluster("geoswarm-test-diagnose-", 1) as server:
        key = server.new_key("diag")
        h = {"Authorization": f"Bearer {key}"}
        r = httpx.post(server.base_url + "/v1/subscriptions", headers=h, timeout=10,
                       json={"type": "range", "bbox": [10.0, 10.0, 11.0, 11.0]})
        assert r.status_code == 201, r.text
        sid = r.json()["id"]
        r = httpx.post(server.base_url + "/v1/objects", headers=h, timeout=10, json={
            "objects": [{"lon": 10.5, "lat": 10.5}, {"lon": 20.0, "lat": 20.0}]})
        assert r.status_code == 202, r.text
        inside, outside = r.json()["ids"]
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            items = httpx.get(f"{server.base_url}/v1/subscriptions/{sid}/matches", headers=h,
                              timeout=10).json()["items"]
            if items:
                break
            time.sleep(0.1)
        assert [m["object"]["id"] for m in items] == [inside]

        async def diagnose() -> dict[str, list[str]]:
            async with httpx.AsyncClient(base_url=server.base_url, timeout=10) as client:
                # codes: subscription 0 of [sid], objects 0 and 1 of [inside, outside]
                return await diagnose_missing(client, h, np.array([0, 1]), [sid],
                                              [inside, outside], 2)

        assert asyncio.run(diagnose()) == {"written_not_delivered": [f"{sid}/{inside}"],
                                           "never_written": [f"{sid}/{outside}"]}
