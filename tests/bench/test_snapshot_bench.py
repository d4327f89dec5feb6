"""The snapshot benchmark (bench/snapshot.py) end to end on a tiny load, through the command
line as a user runs it: it loads the same points into geoswarm and a Redis geo set, and every
geoswarm range and knn answer (with keywords too) it times agrees with its brute-force check."""

from __future__ import annotations

import pytest

from tests.bench import run_bench

pytestmark = pytest.mark.slow


def test_tiny_run_is_exact_and_reports_both_systems() -> None:
    """With narrow buckets (the records of the run in several) and records published in the
    background while the queries run (away from every query: the answers stay exact)."""
    out = run_bench("snapshot", "--records", "3000", "--queries", "5", "--batch", "1000",
                    "--bucket-s", "0.3", "--publish-rate", "400", "--publish-batch", "50",
                    timeout=240)
    table = dict(line.split(None, 1) for line in out.stdout.splitlines() if line.strip())
    assert table["count_all"] == "3000"
    assert table["answers_differing_from_brute_force"] == "0"
    assert int(table["buckets"]) >= 1 and int(table["background_records"]) >= 50
    for name in ("range", "geosearch_box", "geosearch_box_http", "range_keywords", "knn",
                 "geosearch_knn", "geosearch_knn_http", "knn_keywords", "count_large_box",
                 "http_floor",
                 "publish_one"):
        assert "p99_ms" in table[name]


def test_query_boxes_stop_at_the_edges_of_the_world() -> None:
    """A box around a record near the antimeridian or a pole is cut there, as the api
    accepts it (a box past ±180 made a run with more queries fail with 422)."""
    from bench.snapshot import world_box

    assert world_box(170.0, 80.0, 190.0, 95.0) == [170.0, 80.0, 180.0, 90.0]
    assert world_box(-185.0, -92.0, -175.0, -85.0) == [-180.0, -90.0, -175.0, -85.0]
    assert world_box(1.0, 2.0, 3.0, 4.0) == [1.0, 2.0, 3.0, 4.0]
