"""The soak benchmark (bench/soak): its workload is what the API accepts, its growth fit flags
what grows and only that, and a very short run against a real cluster samples every process and
writes its CSV, plot and summary."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import numpy as np
import orjson
import pytest

from app.schemas import ObjectBatch, SubscriptionBatch
from bench.soak import (
    CLIENT,
    LoadConfig,
    LoadStats,
    build_summary,
    format_summary,
    growth,
    make_records,
    make_specs,
    parse_table,
    read_csv,
)
from bench.soak.load import Reservoir
from bench.soak.workload import Fleet


def test_workload_is_valid_api_input() -> None:
    rng = np.random.default_rng(4)
    specs = make_specs(600, rng)
    SubscriptionBatch.model_validate_json(orjson.dumps({"subscriptions": specs}))
    kinds = {s["type"] for s in specs} | {"circle" for s in specs if "circle" in s}
    assert kinds == {"range", "keyword", "knn", "circle"}
    assert any("ttl_s" in s for s in specs) and any("detect" in s for s in specs)
    fleet = Fleet(50, rng)
    before = fleet.lon.copy()
    records = make_records(fleet, 80, 0.5, rng, ts=1.0)
    ObjectBatch.model_validate_json(orjson.dumps({"objects": records}))
    moving = [r["id"] for r in records if "id" in r]
    assert 0 < len(moving) <= 50 and len(set(moving)) == len(moving)
    assert len(records) == 80 and (fleet.lon != before).sum() == len(moving)


def test_growth_fit_and_flags() -> None:
    minutes = np.arange(0, 10, 0.1)
    flat = growth(minutes, 100 + np.sin(minutes * 7), 2.0, "MiB")
    assert abs(flat.per_min) < 0.2 and not math.isnan(flat.pct_per_min)
    leak = growth(minutes, np.where(minutes < 2, 50 + 20 * minutes, 90 + 3 * minutes), 2.0,
                  "MiB")
    assert leak.per_min == pytest.approx(3.0) and leak.late_per_min == pytest.approx(3.0)
    step = growth(minutes, np.where(minutes < 4, 100.0, 130.0), 2.0, "MiB")
    assert step.per_min > 3 and step.late_per_min == pytest.approx(0.0, abs=1e-9)
    # start and end: the means of the first and last three samples after the warm-up
    assert (leak.start, leak.end) == pytest.approx((96.3, 119.4))
    assert growth(minutes, np.full(minutes.size, math.nan), 2.0, "MiB").samples == 0

    rows = [{"elapsed_s": float(t * 60), "api_rss_mib": 100 + 2.0 * t, "api_cpu_s": 30.0 * t,
             "w0_rss_mib": 80.0,
             f"{CLIENT}_rss_mib": 60.0, "redis_used_memory_mib": 1.0,
             "redis_keys": 1000 + 5.0 * t} for t in minutes]
    s = build_summary(minutes=10, workers=1, sample_s=6, warmup=0.2, flag_pct=1.0,
                      flag_mib=4.0, rows=rows, names=["api", "w0", CLIENT], run_s=600,
                      stats=LoadStats(load_s=590), load=LoadConfig(),
                      census={"warmup": {"gs:done": 10}, "end": {"gs:done": 30, "gs:h": 5}},
                      deaths=[], files={})
    flagged = {k for k, g in s["memory"].items() if g["flagged"]}
    assert flagged == {"api"}  # 2 MiB/min is ~1.9 %/min of 104 MiB; the keys grow 0.5 %/min
    assert list(s["redis_keys_by_prefix"]) == ["gs:done", "gs:h"]
    table = parse_table(format_summary(s))
    assert set(table) == {"api", "w0", CLIENT, "redis:used_memory", "redis:keys"}
    assert table["api"]["per_min"] == pytest.approx(2.0, abs=0.01)
    assert table["api"]["flagged"] and not table["w0"]["flagged"]
    assert table["api"]["cpu_pct"] == 50 and math.isnan(float(table["redis:keys"]["cpu_pct"]))


def test_reservoir_stays_bounded() -> None:
    r = Reservoir(size=100)
    for i in range(10_000):
        r.add(float(i))
    assert len(r.values) == 100 and r.seen == 10_000
    assert 2000 < r.percentile(0.5) < 8000


@pytest.mark.slow  # starts a cluster: redis-server, api, workers, coordinator
def test_short_soak(tmp_path: Path) -> None:
    from bench.cluster import ROOT

    out = tmp_path / "out"
    r = subprocess.run([sys.executable, "-m", "app.cli", "bench", "soak", "--minutes", "0.3",
                        "--rate", "40", "--fleet", "100", "--subs", "60", "--churn", "2",
                        "--clients", "2", "--sample-s", "1", "--out", str(out)],
                       cwd=ROOT, capture_output=True, text=True, timeout=240)
    assert r.returncode == 0, r.stdout + r.stderr
    assert (out / "soak.png").stat().st_size > 10_000
    rows = read_csv(out / "soak.csv")
    summary = json.loads((out / "soak.json").read_text())
    processes = ["api", "w0", "w1", "coord", "redis-server", CLIENT]
    assert summary["processes"] == processes
    assert len(rows) >= 10 and summary["samples"] == len(rows)
    for name in processes:  # every process sampled, every time
        assert all(row[f"{name}_rss_mib"] > 1 for row in rows), name
    assert all(row["redis_keys"] > 0 and row["redis_used_memory_mib"] > 0 for row in rows[1:])
    table = parse_table(r.stdout)
    assert set(table) == set(summary["memory"]) == {*processes, "redis:used_memory",
                                                   "redis:keys"}
    for name, g in table.items():
        assert g["start"] == pytest.approx(summary["memory"][name]["start"], abs=0.6), name
    assert summary["died"] == [] and "processes died: none" in r.stdout
    assert summary["throughput"]["published"] > 0.3 * 18 * 40
    assert summary["subscriptions"]["created"] >= 60 and summary["websockets"]["sessions"] >= 2
    assert {"api.log", "w0.log", "coord.log", "redis-server.log"} <= {
        p.name for p in (out / "logs").iterdir()}
