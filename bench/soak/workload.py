"""The soak's workload: a fleet of moving objects and a stream of events around cities
(weighted by population, Zipf keywords: bench.workload), and the subscriptions kept live:
range (bbox and circle), keyword and kNN, some with a TTL, some detecting enter and exit."""

from __future__ import annotations

import math
import random
import time
from typing import Any

import numpy as np
import numpy.typing as npt

from bench.workload import KM_PER_DEG_LAT, city_points, make_objects, make_subscriptions

F64 = npt.NDArray[np.float64]
DETECTS: list[str | list[str]] = ["inside", "enter", "exit", ["enter", "exit"]]


class Fleet:
    """Moving objects around cities, each with its own keywords, walking a few hundred metres
    between two positions."""

    def __init__(self, n: int, rng: np.random.Generator) -> None:
        objs = make_objects(n, rng)
        self.lon: F64 = objs["lon"]
        self.lat: F64 = objs["lat"]
        self.keywords: list[list[str]] = objs["keywords"]
        self.ids = [f"v{i}" for i in range(n)]

    def __len__(self) -> int:
        return len(self.ids)

    def move(self, idx: npt.NDArray[np.int64], rng: np.random.Generator,
             step_km: float = 0.3) -> None:
        lat = np.clip(self.lat[idx] + rng.normal(0.0, step_km, idx.size) / KM_PER_DEG_LAT,
                      -89.9, 89.9)
        coslat = np.maximum(np.cos(np.radians(lat)), 0.01)
        lon = self.lon[idx] + rng.normal(0.0, step_km, idx.size) / (KM_PER_DEG_LAT * coslat)
        self.lon[idx] = (lon + 180.0) % 360.0 - 180.0
        self.lat[idx] = lat


def make_records(fleet: Fleet, n: int, moving_fraction: float, rng: np.random.Generator,
                 ts: float) -> list[dict[str, Any]]:
    """n records: positions of distinct fleet members (moved first), and events, half of them
    with their keywords as `text`."""
    k = min(int(rng.binomial(n, moving_fraction)), len(fleet))
    idx = rng.choice(len(fleet), size=k, replace=False)
    fleet.move(idx, rng)
    out: list[dict[str, Any]] = [
        {"id": fleet.ids[i], "lon": float(fleet.lon[i]), "lat": float(fleet.lat[i]), "ts": ts,
         "keywords": fleet.keywords[i]} for i in idx.tolist()]
    if n > k:
        ev = make_objects(n - k, rng)
        for x, y, kws in zip(ev["lon"].tolist(), ev["lat"].tolist(), ev["keywords"], strict=True):
            rec: dict[str, Any] = {"lon": x, "lat": y, "ts": ts}
            if rng.random() < 0.5:
                rec["text"] = " ".join(kws)
            else:
                rec["keywords"] = kws
            out.append(rec)
    return out


def make_specs(n: int, rng: np.random.Generator, knn_fraction: float = 0.05,
               ttl_fraction: float = 0.1) -> list[dict[str, Any]]:
    """n subscriptions as the API takes them: range (bbox or circle) and keyword ones from
    bench.workload, kNN around city points for `knn_fraction`; a fifth of the range ones detect
    enter/exit, and `ttl_fraction` expire after 1 to 3 minutes."""
    specs = make_subscriptions(n, rng, keyword_fraction=0.5, keyword_only_fraction=0.1,
                               circle_fraction=0.3, all_fraction=0.2)
    knn = np.flatnonzero(rng.random(n) < knn_fraction).tolist()
    if knn:
        lon, lat = city_points(len(knn), rng, jitter_km=5.0)
        for j, i in enumerate(knn):
            spec: dict[str, Any] = {"type": "knn", "point": [float(lon[j]), float(lat[j])],
                                    "k": int(rng.integers(1, 11))}
            if "keywords" in specs[i] and rng.random() < 0.3:
                spec["keywords"] = specs[i]["keywords"]
            specs[i] = spec
    for spec in specs:
        if spec["type"] == "range" and rng.random() < 0.2:
            spec["detect"] = DETECTS[int(rng.integers(len(DETECTS)))]
        if rng.random() < ttl_fraction:
            spec["ttl_s"] = int(rng.integers(60, 181))
    return specs


class SubscriptionPool:
    """The live subscriptions as this client knows them: id -> expiry (monotonic; inf when
    without TTL)."""

    def __init__(self) -> None:
        self.live: dict[str, float] = {}

    def add(self, ids: list[str], specs: list[dict[str, Any]]) -> None:
        now = time.monotonic()
        for sid, spec in zip(ids, specs, strict=True):
            self.live[sid] = now + spec["ttl_s"] if "ttl_s" in spec else math.inf

    def expire(self, before: float) -> list[str]:
        gone = [sid for sid, exp in self.live.items() if exp < before]
        for sid in gone:
            del self.live[sid]
        return gone

    def deletable(self) -> list[str]:
        """Those without TTL: deleting one whose TTL is running out would race its expiry."""
        return [sid for sid, exp in self.live.items() if exp == math.inf]

    def sample(self, k: int, prng: random.Random) -> list[str]:
        ids = list(self.live)
        return prng.sample(ids, min(k, len(ids)))
