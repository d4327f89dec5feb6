"""The continuous kNN benchmark (bench/knn.py) on a tiny load, through the command line as a
user runs it: both ways are timed, and the incremental lists equal brute force."""

from __future__ import annotations

import pytest

from bench.knn import run
from tests.bench import run_bench

pytestmark = pytest.mark.slow


def test_tiny_run_is_exact_and_reports_both_ways() -> None:
    out = run_bench("knn", "--objects", "3000", "--subs", "300", "--updates", "2000", "--batch",
                    "500", timeout=240)
    rows = {line[:30].strip(): line[30:].strip() for line in out.stdout.splitlines()}
    assert rows["exact on sample"] == "True", out.stdout
    assert "full rescan: CPU us/update" in out.stdout and "speedup" in out.stdout


def test_every_list_is_checked() -> None:
    r = run(n_objects=2000, n_subs=200, n_updates=1000, batch=250, check_sample=200)
    assert r["exact_on_sample"] is True
    assert r["lists_changed_per_update"] > 0  # the updates did move lists


def test_tiny_live_run_delivers_exact_last_lists() -> None:
    """Both registrations side by side (bounded, then the broadcast baseline)."""
    out = run_bench("knn", "--live", "--objects", "2000", "--subs", "100", "--rate", "400",
                    "--seconds", "3", "--request", "40", timeout=240)
    lines = out.stdout.splitlines()
    assert lines[0].split() == ["bounded", "broadcast"], out.stdout
    rows = {line.split()[0]: line.split()[1:] for line in lines[1:]
            if line.strip() and not line.startswith("worker CPU per update,")}
    for i in (0, 1):
        assert rows["last_lists_checked"][i] == "100", out.stdout
        assert rows["last_lists_wrong"][i] == "0", out.stdout
        assert int(rows["probes_timed"][i]) > 0 and rows["probes_lost"][i] == "0", out.stdout
        assert float(rows["latency_ms_p99"][i]) > 0, out.stdout
        assert rows["hop_match_ms_p50_p99"][i].count("/") == 1, out.stdout  # the breakdown
    # the baseline holds every subscription on both workers; bounded ones fewer
    assert float(rows["workers_per_subscription"][1]) == 2.0, out.stdout
    assert float(rows["workers_per_subscription"][0]) < 2.0, out.stdout
    assert "broadcast / bounded" in lines[-1], out.stdout


def test_a_live_run_without_subscriptions_times_the_updates_alone() -> None:
    """`--registration none`: the same paced updates with no subscription (what the workers
    spend on the updates alone): nothing pushed, nothing to time or check, and the workers'
    CPU per update still measured."""
    out = run_bench("knn", "--live", "--objects", "2000", "--subs", "100", "--rate", "400",
                    "--seconds", "2", "--request", "40", "--registration", "none", timeout=240)
    lines = out.stdout.splitlines()
    assert lines[0].split() == ["none"], out.stdout
    rows = {line.split()[0]: line.split()[1:] for line in lines[1:] if line.strip()}
    assert rows["updates"] == ["800"], out.stdout
    assert rows["lists_pushed"] == ["0"] and rows["probes_timed"] == ["0"], out.stdout
    assert rows["last_lists_checked"] == ["0"], out.stdout
    assert rows["workers_per_subscription"] == ["0.0"], out.stdout
    assert float(rows["worker_cpu_us_per_update"][0]) > 0, out.stdout


def test_the_live_runs_brute_force_is_exact_everywhere() -> None:
    """The grid search that checks every last list equals a scan of every object, also at
    the poles, across the antimeridian and where objects are sparse."""
    import numpy as np

    from app.geo.geometry import haversine_m
    from bench.knn_live import nearest_ids

    rng = np.random.default_rng(5)
    lon = np.concatenate([rng.uniform(-180, 180, 3000), rng.normal(179.9, 0.05, 200) % 360
                          - 180, rng.normal(2.35, 0.01, 500)])
    lat = np.concatenate([rng.uniform(-89.9, 89.9, 3000), rng.normal(0, 0.05, 200),
                          rng.normal(48.85, 0.01, 500)])
    ids = [f"o{i}" for i in range(len(lon))]
    qlon = np.concatenate([rng.uniform(-180, 180, 100), [179.99, -179.99, 0.0, 2.35, 10.0]])
    qlat = np.concatenate([rng.uniform(-89.9, 89.9, 100), [0.0, 0.01, 89.95, 48.85, -89.95]])
    got = nearest_ids(qlon, qlat, lon, lat, ids, 10)
    for x, y, g in zip(qlon.tolist(), qlat.tolist(), got, strict=True):
        d = haversine_m(x, y, lon, lat).tolist()
        want = sorted((round(v, 3), ids[i]) for i, v in enumerate(d))[:10]
        assert g == [oid for _, oid in want], (x, y)


def test_tiny_live_run_with_moves_reports_what_they_held() -> None:
    """A partition moved back and forth during the timed part: the lists stay exact, and the
    report says how many moves were made and how long they held the workers (from /metrics,
    where the workers' heartbeats put it)."""
    out = run_bench("knn", "--live", "--objects", "2000", "--subs", "100", "--rate", "400",
                    "--seconds", "4", "--request", "40", "--registration", "bounded",
                    "--moves", "1", timeout=240)
    rows = {line.split()[0]: line.split()[1:] for line in out.stdout.splitlines()[1:]
            if line.strip()}
    assert rows["last_lists_checked"] == ["100"] and rows["last_lists_wrong"] == ["0"], (
        out.stdout)
    made = int(rows["moves_made"][0])
    assert made >= 1, out.stdout
    for side in ("give", "take"):
        n, count, mean, ms = rows[f"move_{side}_ms"]
        assert (n, mean) == ("n", "mean") and int(count) >= made and float(ms) > 0, out.stdout
