"""The live window of one tenant on one executor (SSTD §3.2, CheetahGIS's moving objects):
the latest position of every moving object whose position lies in the worker's partitions,
and the events that arrived within the last `window_s`, bucketed by arrival time so that
whole buckets expire at once.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Collection, Iterable
from typing import Any

import numpy as np

NO_KEYWORDS: frozenset[str] = frozenset()


def keyword_set(words: Collection[str]) -> frozenset[str]:
    """A record's keywords as the window holds them. Records without keywords (most moving
    objects' positions) share one empty set: CPython makes a new one for each `frozenset()`
    (216 bytes and a collector-tracked object per record held)."""
    return frozenset(words) if words else NO_KEYWORDS


class LiveWindow:
    """The records one worker holds for one tenant."""

    def __init__(self, window_s: float, bucket_s: float) -> None:
        self.window_s = window_s
        self.bucket_s = bucket_s
        self.moving: dict[str, tuple[float, float, frozenset[str]]] = {}
        self.moving_ts: dict[str, float] = {}
        self.events: dict[str, tuple[float, float, frozenset[str]]] = {}
        self.buckets: deque[tuple[int, list[str]]] = deque()

    def upsert_moving(self, oid: str, lon: float, lat: float, kws: frozenset[str],
                      ts: float) -> bool:
        """The object's latest record, unless a later one is held; True if it was taken."""
        if self.moving_ts.get(oid, -1.0) <= ts:
            self.moving[oid] = (lon, lat, kws)
            self.moving_ts[oid] = ts
            return True
        return False

    def remove_moving(self, oid: str, ts: float) -> bool:
        """The object moved to another worker's partition with record `ts`; a newer record
        that already came back here (streams of two workers are not ordered) wins."""
        if self.moving_ts.get(oid, -1.0) <= ts:
            # kept even when the object is not here (yet): a handoff still in our stream may
            # bring an older record of it, which must not come back
            self.moving_ts[oid] = ts
            return self.moving.pop(oid, None) is not None
        return False

    def holds_record(self, oid: str, ts: float, at: tuple[float, float]) -> bool:
        """Whether the position held is that of record `ts`, which put the object at `at`
        (after a plan change a worker can own both an object's previous position and the
        new one: the exit of a record then reaches the worker that holds that record)."""
        pos = self.moving.get(oid)
        return pos is not None and self.moving_ts.get(oid) == ts and pos[:2] == at

    def moving_in(self, inside: Any) -> list[tuple[str, float, float, list[str], float]]:
        """Moving objects whose latest position satisfies `inside(lon, lat)` (vectorised), as
        (id, lon, lat, keywords, ts): what a handoff carries to a partition's new owner."""
        if not self.moving:
            return []
        ids = list(self.moving)
        n = len(ids)
        xs = np.fromiter((v[0] for v in self.moving.values()), dtype=np.float64, count=n)
        ys = np.fromiter((v[1] for v in self.moving.values()), dtype=np.float64, count=n)
        out = []
        for i in np.flatnonzero(inside(xs, ys)).tolist():
            oid = ids[i]
            lon, lat, kws = self.moving[oid]
            out.append((oid, lon, lat, sorted(kws), self.moving_ts[oid]))
        return out

    def drop_moving(self, ids: list[str]) -> list[str]:
        """Forget handed-off objects (their new owner keeps them from now on); returns those
        that were held."""
        dropped = []
        for oid in ids:
            if self.moving.pop(oid, None) is not None:
                dropped.append(oid)
            self.moving_ts.pop(oid, None)
        return dropped

    def add_event(self, oid: str, lon: float, lat: float, kws: frozenset[str], at: float) -> None:
        b = int(at // self.bucket_s)
        if not self.buckets or self.buckets[-1][0] != b:
            self.buckets.append((b, []))
        self.buckets[-1][1].append(oid)
        self.events[oid] = (lon, lat, kws)

    def add_events(self, ids: list[str], lon: Iterable[float], lat: Iterable[float],
                   kws: Iterable[frozenset[str]], at: list[float]) -> None:
        """`add_event` for each, in order."""
        if not ids:
            return
        b = int(min(at) // self.bucket_s)
        if int(max(at) // self.bucket_s) != b:  # across a bucket's end: one at a time
            for oid, x, y, k, a in zip(ids, lon, lat, kws, at, strict=True):
                self.add_event(oid, x, y, k, a)
            return
        if not self.buckets or self.buckets[-1][0] != b:
            self.buckets.append((b, []))
        self.buckets[-1][1].extend(ids)
        self.events.update(zip(ids, zip(lon, lat, kws, strict=True), strict=True))

    def expire(self, now: float) -> list[str]:
        """Drop whole buckets older than the window; returns the events that left."""
        horizon = int((now - self.window_s) // self.bucket_s)
        dropped: list[str] = []
        while self.buckets and self.buckets[0][0] < horizon:
            _, ids = self.buckets.popleft()
            for oid in ids:
                if self.events.pop(oid, None) is not None:
                    dropped.append(oid)
        return dropped
