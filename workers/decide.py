"""The matching decision of an executor (Tornado §3.2, CheetahGIS's moving objects): a batch
of records and a tenant's subscriptions (their table and an index) in, the (subscription,
record, inside | enter | exit) matches out, for the whole batch at once with numpy. Pure: no
Redis, no clock.

A moving object's record carries its previous position: matching both positions tells
`enter` (inside now, not before) and `exit` (inside before, not now); a late record (older
than the object's latest) changes no position and only ever matches `inside`.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import numpy as np

from app.geo.arrays import members
from app.geo.matcher import MatchResult
from app.pipeline.wire import ObjectBatch
from workers.subs import SubTable

I64 = np.ndarray[Any, np.dtype[np.int64]]


class Matcher(Protocol):
    """What `decide` asks of a subscription index: every (object index, sub key) pair of
    a subscription that contains the point, each once (`SubscriptionIndex`,
    `workers.subs.TenantSubs`)."""

    def match(self, lon: Any, lat: Any, keywords: Sequence[Sequence[str]]) -> MatchResult: ...


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


def decide(t: SubTable, index: Matcher, batch: ObjectBatch, at: list[float]) -> Matches:
    """inside / enter / exit for every (record, subscription) of the batch, vectorised: `t`
    holds the subscriptions' detect bits and expiry by key, `index` finds them."""
    lon = np.asarray(batch.lon, dtype=np.float64)
    lat = np.asarray(batch.lat, dtype=np.float64)
    kws = batch.keywords
    o_new, k_new = index.match(lon, lat, kws)
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
        o_p, k_prev = index.match(plon, plat, [kws[i] for i in pr.tolist()])
        o_prev = pr[o_p]
    else:
        o_prev = k_prev = np.empty(0, dtype=np.int64)
    code_new = (o_new.astype(np.int64) << 32) | k_new.astype(np.int64)
    code_prev = (o_prev.astype(np.int64) << 32) | k_prev.astype(np.int64)
    if code_prev.size:
        was_inside = members(code_new, code_prev)
        still_inside = members(code_prev, code_new)
    else:  # no previous positions (events, first records): no search at all
        was_inside = np.zeros(code_new.size, dtype=bool)
        still_inside = np.zeros(0, dtype=bool)

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
