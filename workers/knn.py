"""Continuous kNN on the executors (CheetahGIS's kNN, SSTD's time buckets).

Each worker keeps the objects it owns — the latest position of moving objects in its
partitions and the events of the live window, bucketed by arrival time — and, for every kNN
subscription of a tenant, its local top-k. When a local top-k changes, a Redis script merges
the workers' local lists atomically into the global ordered list and appends it to the
subscription's history when its membership changed (one decision point, no lost update).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np

from app.geo.geometry import haversine_m
from app.pipeline.wire import ObjectBatch
from workers.window import LiveWindow

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


def top_k(window: LiveWindow, sub: KnnSub) -> list[tuple[float, str, float, float]]:
    """The k records of the window nearest to the subscription's point that satisfy its
    keyword predicate, as (distance, id, lon, lat), ties broken by id."""
    ids, lons, lats = [], [], []
    for source in (window.moving, window.events):
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
        self.objects = LiveWindow(window_s, bucket_s)

    def add(self, sub: KnnSub) -> KnnSub:
        sub.local = top_k(self.objects, sub)
        self.subs[sub.id] = sub
        return sub

    def apply(self, batch: ObjectBatch, at: list[float], now: float) -> list[KnnSub]:
        """Fold a batch into the owned objects; return the subscriptions whose local top-k
        changed."""
        touched: list[tuple[float, float, frozenset[str]]] = []
        removed = False
        for i, oid in enumerate(batch.ids):
            kws = frozenset(batch.keywords[i])
            if batch.exit_only[i]:
                # exit-only copy: the object moved to another worker's partition
                if not batch.late[i]:
                    removed |= self.objects.remove_moving(oid, batch.ts[i])
                continue
            if batch.moving[i]:
                if batch.late[i]:
                    continue
                self.objects.upsert_moving(oid, batch.lon[i], batch.lat[i], kws,
                                           batch.ts[i])
            else:
                self.objects.add_event(oid, batch.lon[i], batch.lat[i], kws, at[i])
            touched.append((batch.lon[i], batch.lat[i], kws))
        removed |= self.objects.expire(now)
        return self.refresh(removed, touched)

    def refresh(self, removed: bool, touched: list[tuple[float, float, frozenset[str]]]
                ) -> list[KnnSub]:
        changed = []
        for sub in self.subs.values():
            if not removed and not any(sub.accepts(kws) for _, _, kws in touched):
                continue
            new = top_k(self.objects, sub)
            if new != sub.local:
                sub.local = new
                changed.append(sub)
        return changed
