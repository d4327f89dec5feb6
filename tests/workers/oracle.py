"""The brute-force oracle: the exact multiset of (subscription, object, ts, detect) matches a
workload must produce, computed record by record with obviously-correct Python."""

from __future__ import annotations

import math
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

from app.geo.geometry import haversine_m
from app.geo.tokenize import normalize_keywords, tokenize

Match = tuple[str, str, float, str]  # (subscription id, object id, ts, detect)


def record_keywords(obj: dict[str, Any]) -> list[str]:
    kws = normalize_keywords(obj.get("keywords") or [])
    if obj.get("text"):
        kws = normalize_keywords([*kws, *tokenize(obj["text"])])
    return kws


def region_contains(spec: dict[str, Any], lon: float, lat: float) -> bool:
    if spec["type"] == "keyword":
        return True
    if "bbox" in spec:
        x0, y0, x1, y1 = spec["bbox"]
        return x0 <= lon <= x1 and y0 <= lat <= y1
    c = spec["circle"]
    return bool(haversine_m(c["lon"], c["lat"], lon, lat) <= c["radius_m"])


def keywords_hold(spec: dict[str, Any], kws: list[str]) -> bool:
    want = spec.get("keywords") or []
    if not want:
        return True
    have = set(kws)
    want = [w.lower() for w in want]
    if spec.get("match", "any") == "all":
        return all(w in have for w in want)
    return any(w in have for w in want)


def inside(spec: dict[str, Any], lon: float, lat: float, kws: list[str]) -> bool:
    return region_contains(spec, lon, lat) and keywords_hold(spec, kws)


@dataclass
class Oracle:
    subs: dict[str, dict[str, Any]] = field(default_factory=dict)  # id -> spec (live ones)
    latest: dict[str, tuple[float, float, float]] = field(default_factory=dict)  # id -> ts,lon,lat
    expected: Counter[Match] = field(default_factory=Counter)

    def publish(self, objs: list[dict[str, Any]], ids: list[str]) -> None:
        """Apply one accepted batch in order (ids as the server answered)."""
        for obj, oid in zip(objs, ids, strict=True):
            kws = record_keywords(obj)
            lon, lat, ts = obj["lon"], obj["lat"], obj["ts"]
            moving = "id" in obj
            prev = self.latest.get(oid) if moving else None
            late = prev is not None and ts < prev[0]
            if moving and not late:
                self.latest[oid] = (ts, lon, lat)
            for sid, spec in self.subs.items():
                if spec["type"] == "knn":
                    continue
                detect = set(spec.get("detect") or ["inside"])
                now_in = inside(spec, lon, lat, kws)
                if now_in and "inside" in detect:
                    self.expected[(sid, oid, ts, "inside")] += 1
                if not moving or late:
                    continue
                was_in = prev is not None and inside(spec, prev[1], prev[2], kws)
                if now_in and not was_in and "enter" in detect:
                    self.expected[(sid, oid, ts, "enter")] += 1
                if was_in and not now_in and "exit" in detect:
                    self.expected[(sid, oid, ts, "exit")] += 1

    def total(self) -> int:
        return sum(self.expected.values())


def received_matches(messages: list[dict[str, Any]]) -> Counter[Match]:
    out: Counter[Match] = Counter()
    for m in messages:
        if m.get("type") == "match":
            o = m["object"]
            out[(m["subscription"], o["id"], o["ts"], m["detect"])] += 1
    return out


def close_to_border(v: float, step: float) -> bool:
    return math.isclose(v / step, round(v / step), abs_tol=1e-9)


def knn_oracle(spec: dict[str, Any], live: dict[str, tuple[float, float, list[str]]]
               ) -> list[str]:
    """Ids of the k live objects nearest to the point that satisfy the keyword predicate,
    ties broken by id."""
    lon, lat = spec["point"]
    cands = []
    for oid, (x, y, kws) in live.items():
        if keywords_hold(spec, kws):
            cands.append((round(float(haversine_m(lon, lat, x, y)), 3), oid))
    return [oid for _, oid in sorted(cands)[: spec["k"]]]
