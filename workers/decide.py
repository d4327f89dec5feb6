"""The matching decision of an executor (Tornado §3.2, CheetahGIS's moving objects): a batch
of records and a tenant's subscription index in, the (subscription, record, inside | enter |
exit) matches out, for the whole batch at once with numpy. Pure: no Redis, no clock.

A moving object's record carries its previous position: matching both positions tells
`enter` (inside now, not before) and `exit` (inside before, not now); a late record (older
than the object's latest) changes no position and only ever matches `inside`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np

from app.geo.matcher import SubscriptionIndex
from app.pipeline.wire import ObjectBatch

I64 = np.ndarray[Any, np.dtype[np.int64]]


@dataclass
class SubInfo:
    id: str
    detect: frozenset[str]
    expires_at: float | None


DETECT_BITS = {"inside": 1, "enter": 2, "exit": 4}


@dataclass
class TenantIndex:
    """A tenant's subscriptions on this worker: objects only ever meet their own tenant's.
    Per-key arrays (detect bits, expiry) let the decisions be taken for a batch at once."""

    index: SubscriptionIndex
    subs: dict[int, SubInfo] = field(default_factory=dict)
    key_of: dict[str, int] = field(default_factory=dict)
    detect: np.ndarray[Any, np.dtype[np.uint8]] = field(
        default_factory=lambda: np.zeros(1024, dtype=np.uint8))
    expires: np.ndarray[Any, np.dtype[np.float64]] = field(
        default_factory=lambda: np.full(1024, np.inf))
    ids: np.ndarray[Any, np.dtype[np.object_]] = field(
        default_factory=lambda: np.empty(1024, dtype=object))

    def put(self, key: int, info: SubInfo) -> None:
        if key >= self.detect.size:
            n = max(key + 1, 2 * self.detect.size)
            self.detect = np.resize(self.detect, n)
            self.expires = np.resize(self.expires, n)
            self.ids = np.resize(self.ids, n)
        self.subs[key] = info
        self.key_of[info.id] = key
        self.detect[key] = sum(DETECT_BITS[d] for d in info.detect)
        self.expires[key] = np.inf if info.expires_at is None else info.expires_at
        self.ids[key] = info.id

    def drop(self, key: int) -> None:
        info = self.subs.pop(key)
        del self.key_of[info.id]
        self.detect[key] = 0


@dataclass
class Matches:
    """The matches decided for one batch, parallel arrays sorted by (sub key, row, detect)."""

    keys: I64
    rows: I64
    detect: np.ndarray[Any, np.dtype[np.uint8]]


def known(p: tuple[float, float] | None) -> tuple[float, float]:
    """A previous position the caller knows is there."""
    if p is None:
        raise ValueError("a record marked with a previous position has none")
    return p


def decide(t: TenantIndex, batch: ObjectBatch, at: list[float]) -> Matches:
    """inside / enter / exit for every (record, subscription) of the batch, vectorised."""
    lon = np.asarray(batch.lon, dtype=np.float64)
    lat = np.asarray(batch.lat, dtype=np.float64)
    kws = batch.keywords
    o_new, k_new = t.index.match(lon, lat, kws)
    xo = np.asarray(batch.exit_only, dtype=bool)
    mv = np.asarray(batch.moving, dtype=bool)
    late = np.asarray(batch.late, dtype=bool)
    dx = np.asarray(batch.decide_exit, dtype=bool)
    at_a = np.asarray(at, dtype=np.float64)
    # Records with a usable previous position (moving, in order): match the previous
    # position too, with the new record's keywords, to see transitions.
    has_prev = np.fromiter((p is not None for p in batch.prev), dtype=bool,
                           count=len(batch.prev)) & ~late
    pr = np.flatnonzero(has_prev)
    if pr.size:
        prev = [known(batch.prev[i]) for i in pr.tolist()]
        plon = np.asarray([p[0] for p in prev], dtype=np.float64)
        plat = np.asarray([p[1] for p in prev], dtype=np.float64)
        o_p, k_prev = t.index.match(plon, plat, [kws[i] for i in pr.tolist()])
        o_prev = pr[o_p]
    else:
        o_prev = k_prev = np.empty(0, dtype=np.int64)
    code_new = (o_new.astype(np.int64) << 32) | k_new.astype(np.int64)
    code_prev = (o_prev.astype(np.int64) << 32) | k_prev.astype(np.int64)
    was_inside = np.isin(code_new, code_prev)
    still_inside = np.isin(code_prev, code_new)

    det_new = t.detect[k_new]
    live_new = (at_a[o_new] < t.expires[k_new]) & ~xo[o_new]
    inside = live_new & ((det_new & 1) > 0)
    enter = live_new & ((det_new & 2) > 0) & mv[o_new] & ~late[o_new] & ~was_inside
    det_prev = t.detect[k_prev]
    exit_ = (((det_prev & 4) > 0) & ~still_inside & dx[o_prev]
             & (at_a[o_prev] < t.expires[k_prev]))
    keys = np.concatenate([k_new[inside], k_new[enter], k_prev[exit_]]).astype(np.int64)
    rows = np.concatenate([o_new[inside], o_new[enter], o_prev[exit_]]).astype(np.int64)
    detect = np.concatenate([np.zeros(int(inside.sum()), np.uint8),
                             np.ones(int(enter.sum()), np.uint8),
                             np.full(int(exit_.sum()), 2, np.uint8)])
    order = np.lexsort((detect, rows, keys))
    return Matches(keys=keys[order], rows=rows[order], detect=detect[order])
