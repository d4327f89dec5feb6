"""Continuous kNN on the executors (CheetahGIS's kNN, SSTD's time buckets).

Each worker keeps the objects it owns — the latest position of moving objects in its
partitions and the events of the live window, bucketed by arrival time — and, for every kNN
subscription of a tenant, its local top-k. When a local top-k changes, a Redis script merges
the workers' local lists atomically into the global ordered list and appends it to the
subscription's history when its membership changed (one decision point, no lost update).
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from app.geo.geometry import haversine_m

# KEYS[1] = gs:knn:<sub> (hash: worker -> local list JSON, "_merged" -> ids JSON)
# KEYS[2] = history stream, KEYS[3] = its last-id marker (see HISTORY_SCRIPT);
# ARGV = worker, local list JSON, k, maxlen, ttl, tenant, marker ttl
MERGE_SCRIPT = """
redis.call('HSET', KEYS[1], ARGV[1], ARGV[2])
local k = tonumber(ARGV[3])
local all = {}
local fields = redis.call('HGETALL', KEYS[1])
for i = 1, #fields, 2 do
  if fields[i] ~= '_merged' then
    for _, n in ipairs(cjson.decode(fields[i + 1])) do all[#all + 1] = n end
  end
end
table.sort(all, function(a, b)
  if a[1] ~= b[1] then return a[1] < b[1] end
  return a[2] < b[2]
end)
local top, ids = {}, {}
for i = 1, math.min(k, #all) do
  local n = all[i]
  top[#top + 1] = {id = n[2], lon = n[3], lat = n[4], distance_m = n[1]}
  ids[#ids + 1] = n[2]
end
local key = table.concat(ids, '\\0')
if redis.call('HGET', KEYS[1], '_merged') == key then return 0 end
redis.call('HSET', KEYS[1], '_merged', key)
local payload = '[]'
if #top > 0 then payload = cjson.encode(top) end
local prev = redis.call('GET', KEYS[3]) or '0-0'
local id = redis.call('XADD', KEYS[2], 'MAXLEN', '~', ARGV[4], '*', 'k', payload, 't', ARGV[6],
                      'p', prev)
redis.call('EXPIRE', KEYS[2], ARGV[5])
redis.call('SET', KEYS[3], id, 'EX', ARGV[7])
redis.call('EXPIRE', KEYS[1], 30 * 24 * 3600)
return 1
"""


@dataclass
class KnnSub:
    id: str
    lon: float
    lat: float
    k: int
    keywords: frozenset[str]
    match_all: bool
    local: list[tuple[float, str, float, float]] = field(default_factory=list)

    def accepts(self, kws: frozenset[str]) -> bool:
        if not self.keywords:
            return True
        if self.match_all:
            return self.keywords <= kws
        return not self.keywords.isdisjoint(kws)


def knn_sub(sub_id: str, spec: dict[str, Any]) -> KnnSub:
    return KnnSub(sub_id, float(spec["point"][0]), float(spec["point"][1]), int(spec["k"]),
                  frozenset(spec.get("keywords") or ()), spec.get("match", "any") == "all")


class LocalObjects:
    """The objects one worker owns for one tenant."""

    def __init__(self, window_s: float, bucket_s: float) -> None:
        self.window_s = window_s
        self.bucket_s = bucket_s
        self.moving: dict[str, tuple[float, float, frozenset[str]]] = {}
        self.moving_ts: dict[str, float] = {}
        self.events: dict[str, tuple[float, float, frozenset[str]]] = {}
        self.buckets: deque[tuple[int, list[str]]] = deque()

    def upsert_moving(self, oid: str, lon: float, lat: float, kws: frozenset[str],
                      ts: float) -> None:
        if self.moving_ts.get(oid, -1.0) <= ts:
            self.moving[oid] = (lon, lat, kws)
            self.moving_ts[oid] = ts

    def remove_moving(self, oid: str, ts: float) -> bool:
        """The object moved to another worker's partition with record `ts`; a newer record
        that already came back here (streams of two workers are not ordered) wins."""
        if oid in self.moving and self.moving_ts[oid] <= ts:
            del self.moving[oid]
            self.moving_ts[oid] = ts
            return True
        return False

    def moving_in(self, inside: Any) -> list[tuple[str, float, float, list[str], float]]:
        """Moving objects whose latest position satisfies `inside(lon, lat)` (vectorised), as
        (id, lon, lat, keywords, ts): what a handoff carries to a partition's new owner."""
        if not self.moving:
            return []
        ids = list(self.moving)
        pos = np.asarray([self.moving[i][:2] for i in ids], dtype=np.float64)
        mask = inside(pos[:, 0], pos[:, 1])
        out = []
        for i in np.flatnonzero(mask).tolist():
            oid = ids[i]
            lon, lat, kws = self.moving[oid]
            out.append((oid, lon, lat, sorted(kws), self.moving_ts[oid]))
        return out

    def drop_moving(self, ids: list[str]) -> None:
        """Forget handed-off objects (their new owner keeps them from now on)."""
        for oid in ids:
            self.moving.pop(oid, None)
            self.moving_ts.pop(oid, None)

    def add_event(self, oid: str, lon: float, lat: float, kws: frozenset[str], at: float) -> None:
        b = int(at // self.bucket_s)
        if not self.buckets or self.buckets[-1][0] != b:
            self.buckets.append((b, []))
        self.buckets[-1][1].append(oid)
        self.events[oid] = (lon, lat, kws)

    def expire(self, now: float) -> bool:
        """Drop whole buckets older than the window; True if anything left."""
        horizon = int((now - self.window_s) // self.bucket_s)
        dropped = False
        while self.buckets and self.buckets[0][0] < horizon:
            _, ids = self.buckets.popleft()
            for oid in ids:
                self.events.pop(oid, None)
            dropped = True
        return dropped

    def top_k(self, sub: KnnSub) -> list[tuple[float, str, float, float]]:
        ids, lons, lats = [], [], []
        for source in (self.moving, self.events):
            for oid, (lon, lat, kws) in source.items():
                if sub.accepts(kws):
                    ids.append(oid)
                    lons.append(lon)
                    lats.append(lat)
        if not ids:
            return []
        d = haversine_m(sub.lon, sub.lat, np.asarray(lons), np.asarray(lats))
        order = sorted(range(len(ids)), key=lambda i: (float(d[i]), ids[i]))[: sub.k]
        return [(round(float(d[i]), 3), ids[i], lons[i], lats[i]) for i in order]


class KnnState:
    """kNN subscriptions and owned objects of one tenant on one worker."""

    def __init__(self, window_s: float, bucket_s: float) -> None:
        self.subs: dict[str, KnnSub] = {}
        self.objects = LocalObjects(window_s, bucket_s)

    def add(self, sub: KnnSub) -> KnnSub:
        sub.local = self.objects.top_k(sub)
        self.subs[sub.id] = sub
        return sub

    def apply(self, cols: dict[str, list[Any]], at: list[float], now: float) -> list[KnnSub]:
        """Fold a batch into the owned objects; return the subscriptions whose local top-k
        changed."""
        touched: list[tuple[float, float, frozenset[str]]] = []
        removed = False
        for i, oid in enumerate(cols["id"]):
            kws = frozenset(cols["kw"][i])
            if cols["xo"][i]:
                # exit-only copy: the object moved to another worker's partition
                if not cols["late"][i]:
                    removed |= self.objects.remove_moving(oid, cols["ts"][i])
                continue
            if cols["mv"][i]:
                if cols["late"][i]:
                    continue
                self.objects.upsert_moving(oid, cols["lon"][i], cols["lat"][i], kws,
                                           cols["ts"][i])
            else:
                self.objects.add_event(oid, cols["lon"][i], cols["lat"][i], kws, at[i])
            touched.append((cols["lon"][i], cols["lat"][i], kws))
        removed |= self.objects.expire(now)
        return self.refresh(removed, touched)

    def refresh(self, removed: bool, touched: list[tuple[float, float, frozenset[str]]]
                ) -> list[KnnSub]:
        changed = []
        for sub in self.subs.values():
            if not removed and not any(sub.accepts(kws) for _, _, kws in touched):
                continue
            new = self.objects.top_k(sub)
            if new != sub.local:
                sub.local = new
                changed.append(sub)
        return changed
