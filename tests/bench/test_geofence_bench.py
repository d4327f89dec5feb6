"""The geofence benchmark (bench/geofence.py) end to end on a tiny load, through the command
line as a user runs it, and its brute-force oracle against a hand-checked case."""

from __future__ import annotations

import numpy as np
import pytest

from bench.geofence import make_fences, make_updates, oracle, start_positions
from tests.bench import run_bench

pytestmark = pytest.mark.slow


def test_oracle_tests_every_update_against_every_fence() -> None:
    fences = [{"type": "range", "bbox": [-74.01, 40.70, -73.99, 40.72]},
              {"type": "range", "circle": {"lon": -74.0, "lat": 40.71, "radius_m": 100}},
              {"type": "range", "bbox": [-73.0, 40.0, -72.9, 40.1]}]
    lon = np.array([-74.0, -74.005, -72.95, 10.0])
    lat = np.array([40.71, 40.705, 40.05, 10.0])
    assert oracle(fences, lon, lat) == {(0, 0): 1, (1, 0): 1, (0, 1): 1, (2, 2): 1}


def test_fences_sit_where_the_objects_move() -> None:
    rng = np.random.default_rng(3)
    x0, y0 = start_positions(2_000, 1.0, rng)
    fences = make_fences(200, x0, y0, rng)
    obj, lon, lat = make_updates(x0, y0, 6_000, rng)
    assert obj.tolist()[:3] == [0, 1, 2] and obj[2_000] == 0  # round-robin
    step_m = np.hypot((lon[2_000:4_000] - lon[:2_000]) * np.cos(np.radians(lat[:2_000])),
                      lat[2_000:4_000] - lat[:2_000]) * 111_195
    assert step_m.max() < 450  # steps of at most ~300 m on each axis
    assert sum(oracle(fences, lon, lat).values()) > 200  # fences see traffic


def test_tiny_run_delivers_every_notification_once() -> None:
    out = run_bench("geofence", "--fences", "20,200", "--objects", "400", "--updates", "2000",
                    "--batch", "100")
    lines = out.stdout.splitlines()
    assert lines[0].split()[:3] == ["fences", "updates/s", "notif/s"]
    rows = {int(line.split()[0]): line.split() for line in lines[1:3]}
    assert set(rows) == {20, 200}
    for row in rows.values():
        notifications, missing, extra = int(row[6]), int(row[7]), int(row[8])
        assert notifications > 0 and missing == 0 and extra == 0, row
    assert rows[20][5] == "-"  # no Tile38 figure for that count
