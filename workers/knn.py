"""Continuous kNN on the executors (CheetahGIS's kNN, SSTD's time buckets).

Each worker keeps the objects it owns — the latest position of moving objects in its
partitions and the events of the live window, bucketed by arrival time — and, for every kNN
subscription registered on it, its local top-k within the registration's radius. When a local
top-k changes, the merge script of `app.pipeline.knnreg` combines the workers' local lists
atomically into the global ordered list (one decision point, no lost update).
"""

from __future__ import annotations

import bisect
import functools
import math
from collections.abc import Hashable
from dataclasses import dataclass, field
from operator import itemgetter
from typing import Any

import numpy as np
import numpy.typing as npt

from app.geo.geometry import circle_bbox, haversine_m
from app.geo.grid import Grid
from app.pipeline.wire import ObjectBatch
from workers.knn_index import Keywords, Neighbor, PointIndex, signature
from workers.window import LiveWindow, keyword_set

_KEY = itemgetter(4)  # a Neighbor's key
MOVING, EVENT = 0, 1  # the kinds of object a worker holds (their ids may coincide)
REACH_GRID = Grid(nx=720, ny=360)  # half-degree cells: which lists an arrival can enter
MAX_REACH_CELLS = 256  # a list reaching over more cells is registered in coarser cells
# The side of a reach cell at each level, in cells of the grid: a list is registered at the
# finest level where its circle covers at most MAX_REACH_CELLS cells (a list in a sparse
# region reaches far); one covering more even at the coarsest is checked against every
# arrival.
REACH_LEVELS = (1, 8, 64)
# `Reach.pairs` of at most this many arrivals looks them up one by one. Measured over 10 000
# lists and 100 000 objects near cities: 0.06 against 0.18 ms for 20 arrivals, 1.6 against
# 2.0 ms for 1 000, 2.9 against 2.3 ms for 2 000.
FEW_ARRIVALS = 1000
# A list's keyword predicate as up to this many signature masks (`Keywords.signatures`): an
# arrival passes when its signature holds every bit of one of them. With more terms than this
# (any of them), every arrival passes, and the predicate itself decides.
REACH_MASKS = 4
# A member of a list that moved or left: its key, where the index holds it now (None: gone),
# its new distance from the subscription's point
Moved = tuple[tuple[int, str], tuple[int, float, float, frozenset[str]] | None, float]


@dataclass
class KnnSub:
    id: str
    lon: float
    lat: float
    k: int
    keywords: frozenset[str]
    match_all: bool
    local: list[Neighbor] = field(default_factory=list)  # nearest first
    # Only objects within `radius` metres enter the local list: the radius the subscription
    # is registered with (`workers.knn_reg`), infinite when it is sent to every worker.
    radius: float = math.inf
    # A full list's bound on the others: every object it accepts within its radius that is
    # not listed lies at least this far (rounded to the millimetre, as listed distances);
    # infinite when nothing else lies within the radius. A member that moves beyond the k-th
    # but stays nearer than this is still among the k nearest: no search.
    beyond: float = math.inf
    epoch: int = 0  # of the registration (a newer one replaces it)
    # The merge script's word at the last report: this worker was the only holder (then only
    # the changes `KnnRegistry` finds can change the merged list are reported), and the
    # members (kind, id) in order of the list last reported.
    sole: bool = False
    reported: tuple[Hashable, ...] | None = None
    keys: tuple[Hashable, ...] = ()  # of the members of `local`, in its order

    @functools.cached_property
    def wanted(self) -> Keywords | None:
        """Its keyword predicate as a search takes it (None without keywords)."""
        return Keywords(self.keywords, self.match_all) if self.keywords else None

    def accepts(self, kws: frozenset[str]) -> bool:
        wanted = self.wanted
        return wanted is None or wanted.accepts(kws)


def knn_sub(sub_id: str, spec: dict[str, Any], radius: float | None = None,
            epoch: int = 0) -> KnnSub:
    return KnnSub(sub_id, float(spec["point"][0]), float(spec["point"][1]), int(spec["k"]),
                  frozenset(spec.get("keywords") or ()), spec.get("match", "any") == "all",
                  radius=math.inf if radius is None else radius, epoch=epoch)


def top_k(window: LiveWindow, sub: KnnSub) -> list[tuple[float, str, float, float]]:
    """The k records of the window nearest to the subscription's point that satisfy its
    keyword predicate, within its radius, as (distance rounded to the millimetre, id, lon,
    lat), ties broken by id: the brute-force statement of `KnnState`'s lists (tests). A
    moving object and an event may share an id; at one distance they are ordered by
    position, as the lists order them."""
    ids, lons, lats = [], [], []
    for source in (window.moving, window.events):
        for oid, (lon, lat, kws) in source.items():
            if sub.accepts(kws):
                ids.append(oid)
                lons.append(lon)
                lats.append(lat)
    if not ids:
        return []
    d = [round(x, 3) for x in
         haversine_m(sub.lon, sub.lat, np.asarray(lons), np.asarray(lats)).tolist()]
    order = sorted((i for i in range(len(ids)) if d[i] <= sub.radius),
                   key=lambda i: (d[i], ids[i], lons[i], lats[i]))[:sub.k]
    return [(d[i], ids[i], lons[i], lats[i]) for i in order]


class Reach:
    """Which lists an arriving object can enter: each subscription is registered in the grid
    cells its circle (its point, its k-th distance) covers, with slack so that it moves
    rarely; one that holds fewer than k, or reaches over many cells, is checked against every
    arrival (`wide`). Arrivals are then checked only against the lists of their cell. Each
    subscription has a slot in arrays of its point and k-th distance, so that the pairs of a
    batch are checked with numpy alone."""

    def __init__(self, grid: Grid) -> None:
        self.grid = grid
        self.slot: dict[str, int] = {}
        self.subs: list[KnnSub | None] = []
        self.free: list[int] = []
        self.lon: npt.NDArray[np.float64] = np.zeros(16)
        self.lat: npt.NDArray[np.float64] = np.zeros(16)
        self.kth: npt.NDArray[np.float64] = np.zeros(16)  # inf while fewer than k
        # the keyword predicate's signature masks (`REACH_MASKS`; 0: any arrival passes)
        self.masks: npt.NDArray[np.uint64] = np.zeros((16, REACH_MASKS), dtype=np.uint64)
        # reach cells of every level, keyed by `_key` (level, cell of that level) -> slots
        self.cells: dict[int, set[int]] = {}
        self.registered: dict[int, tuple[float, list[int]]] = {}  # slot -> (radius, cells)
        self.wide: set[int] = set()
        self._arrays: dict[int, npt.NDArray[np.int64]] = {}  # cell key (-1: wide) -> slots
        self.per_level = [0] * len(REACH_LEVELS)  # lists registered at each level
        self._stride = grid.nx * grid.ny  # > every cell id of every level
        self._cols = [-(-grid.nx // f) for f in REACH_LEVELS]  # cells across, per level

    def _key(self, level: int, cx: Any, cy: Any) -> Any:
        """The key of the reach cell holding grid cell (cx, cy) at a level (arrays too)."""
        f = REACH_LEVELS[level]
        return level * self._stride + (cy // f) * self._cols[level] + cx // f

    def _slot_of(self, sub: KnnSub) -> int:
        i = self.slot.get(sub.id)
        if i is not None:
            return i
        if self.free:
            i = self.free.pop()
            self.subs[i] = sub
        else:
            i = len(self.subs)
            self.subs.append(sub)
            if i == len(self.lon):
                self.lon, self.lat, self.kth = (np.concatenate([a, np.zeros(i)])
                                                for a in (self.lon, self.lat, self.kth))
                self.masks = np.concatenate([self.masks, np.zeros_like(self.masks)])
        self.slot[sub.id] = i
        self.lon[i], self.lat[i] = sub.lon, sub.lat
        wanted = sub.wanted
        masks = wanted.signatures.masks if wanted is not None else ()
        # none (no predicate) or too many: 0, which every signature holds
        self.masks[i] = (masks * REACH_MASKS)[:REACH_MASKS] if masks else 0
        if len(masks) > REACH_MASKS:
            self.masks[i] = 0
        return i

    def update(self, sub: KnnSub) -> None:
        i = self._slot_of(sub)
        full = len(sub.local) >= sub.k
        # a list holding fewer than k takes whatever comes within its radius; a full one is
        # told of whatever comes nearer than its bound on the others (it may enter, or lower
        # the bound)
        bound = min(sub.beyond, sub.radius) if full else sub.radius
        self.kth[i] = bound
        need = bound + 0.01
        held = self.registered.get(i)
        if held is not None:
            if held[1] and held[0] / 4 <= need <= held[0]:
                return  # still covered, and not far too wide
            if not held[1] and not math.isfinite(need):
                return  # fewer than k: checked against every arrival
        self._unregister(i)
        cells: list[int] = []
        radius = min(need * 1.5, sub.radius + 0.01)
        if math.isfinite(radius):
            x0, y0, x1, y1 = self.grid.cell_range(circle_bbox(sub.lon, sub.lat, radius))
            for level, f in enumerate(REACH_LEVELS):
                if (x1 // f - x0 // f + 1) * (y1 // f - y0 // f + 1) <= MAX_REACH_CELLS:
                    cells = [int(self._key(level, x * f, y * f))
                             for y in range(y0 // f, y1 // f + 1)
                             for x in range(x0 // f, x1 // f + 1)]
                    self.per_level[level] += 1
                    break
        if not cells:
            radius = math.inf
            self.wide.add(i)
            self._arrays.pop(-1, None)
        for c in cells:
            self.cells.setdefault(c, set()).add(i)
            self._arrays.pop(c, None)
        self.registered[i] = (radius, cells)

    def _unregister(self, i: int) -> None:
        held = self.registered.pop(i, None)
        if held is None:
            return
        if i in self.wide:
            self.wide.discard(i)
            self._arrays.pop(-1, None)
        if held[1]:
            self.per_level[held[1][0] // self._stride] -= 1
        for c in held[1]:
            subs = self.cells[c]
            subs.discard(i)
            self._arrays.pop(c, None)
            if not subs:
                del self.cells[c]

    def remove(self, sub_id: str) -> None:
        i = self.slot.pop(sub_id, None)
        if i is None:
            return
        self._unregister(i)
        self.subs[i] = None
        self.kth[i] = -1.0  # matches nothing
        self.free.append(i)

    def _slots(self, cell: int) -> npt.NDArray[np.int64]:
        arr = self._arrays.get(cell)
        if arr is None:
            held = self.wide if cell == -1 else self.cells.get(cell, set())
            arr = self._arrays[cell] = np.fromiter(held, dtype=np.int64, count=len(held))
        return arr

    def pairs(self, lon: npt.NDArray[np.float64], lat: npt.NDArray[np.float64]
              ) -> tuple[npt.NDArray[np.int64], npt.NDArray[np.int64]]:
        """(slot, arrival index) of every pair to check."""
        if len(lon) <= FEW_ARRIVALS:
            return self._pairs_of_few(lon, lat)
        si: list[npt.NDArray[np.int64]] = []
        ci: list[npt.NDArray[np.int64]] = []
        cx, cy = self.grid.cells_of(lon, lat)
        cx, cy = cx.astype(np.int64), cy.astype(np.int64)
        for level in range(len(REACH_LEVELS)):
            if not self.per_level[level]:
                continue
            cid = self._key(level, cx, cy)
            order = np.argsort(cid, kind="stable")
            uniq, start, count = np.unique(cid[order], return_index=True, return_counts=True)
            hit = [j for j, c in enumerate(uniq.tolist()) if c in self.cells]
            if not hit:
                continue
            held = [self._slots(c) for c in uniq[hit].tolist()]
            # every (slot, row) of each cell hit, slot by slot (as repeat/tile per cell would
            # give them), for all the cells at once: pair t of cell g is slot t // rows,
            # row t % rows
            n_slots = np.fromiter(map(len, held), dtype=np.int64, count=len(held))
            n_rows = count[hit]
            n_pairs = n_slots * n_rows
            g = np.repeat(np.arange(len(hit)), n_pairs)
            t = np.arange(int(n_pairs.sum())) - np.repeat(np.cumsum(n_pairs) - n_pairs, n_pairs)
            rows_g = n_rows[g]
            si.append(np.concatenate(held)[(np.cumsum(n_slots) - n_slots)[g] + t // rows_g])
            ci.append(order[start[hit][g] + t % rows_g])
        if self.wide:
            slots = self._slots(-1)
            si.append(np.repeat(slots, len(lon)))
            ci.append(np.tile(np.arange(len(lon), dtype=np.int64), slots.size))
        if not si:
            empty = np.zeros(0, dtype=np.int64)
            return empty, empty
        return np.concatenate(si), np.concatenate(ci)

    def _pairs_of_few(self, lon: npt.NDArray[np.float64], lat: npt.NDArray[np.float64]
                      ) -> tuple[npt.NDArray[np.int64], npt.NDArray[np.int64]]:
        """`pairs` for a few arrivals (a step's, under a steady load): each arrival's reach
        cell of each level looked up one by one, cheaper then than the sorting and grouping
        of the arrivals by cell, whose numpy calls cost nearly as much for 20 arrivals as
        for hundreds."""
        cx, cy = self.grid.cells_of(lon, lat)
        levels = [level for level in range(len(REACH_LEVELS)) if self.per_level[level]]
        cells = self.cells
        held: list[npt.NDArray[np.int64]] = []
        rows: list[int] = []
        for j, (x, y) in enumerate(zip(cx.tolist(), cy.tolist(), strict=True)):
            for level in levels:
                c = self._key(level, x, y)
                if c in cells:
                    held.append(self._slots(c))
                    rows.append(j)
        if self.wide:
            wide = self._slots(-1)
            held += [wide] * len(lon)
            rows += range(len(lon))
        if not held:
            empty = np.zeros(0, dtype=np.int64)
            return empty, empty
        counts = np.fromiter(map(len, held), dtype=np.int64, count=len(held))
        return np.concatenate(held), np.repeat(np.asarray(rows, dtype=np.int64), counts)


class KnnState:
    """kNN subscriptions and owned objects of one tenant on one worker.

    Each subscription's local top-k is maintained incrementally: an object that arrives or
    moves is a candidate only for the subscriptions whose list it can enter (nearer than their
    k-th, computed for the whole batch at once), and only a subscription that loses one of its
    members (moved, gone, expired) searches again, in the spatial index (`PointIndex`), never
    by a scan of every object. `top_k` is the brute-force statement of the same lists.

    The spatial index exists only while the tenant has kNN subscriptions: a tenant without
    them costs the window's bookkeeping alone per object."""

    def __init__(self, window_s: float, bucket_s: float, grid: Grid | None = None) -> None:
        self.subs: dict[str, KnnSub] = {}
        self.objects = LiveWindow(window_s, bucket_s)
        self.grid = grid or Grid()
        self.points: PointIndex | None = None
        self.reach = Reach(REACH_GRID)
        # object (kind, id) -> the subscriptions whose local list holds it
        self.members: dict[Hashable, set[str]] = {}
        self._moved: set[tuple[int, str]] = set()  # left their position since the last refresh
        self._placed: set[tuple[int, str]] = set()  # took a new position since then
        # Listed objects that moved to another worker's partition stay here, where they were,
        # until that worker has them (`arrived`): a merged list never misses an object that
        # is only on its way. id -> the exit's time; `asks`: (id, time, new lon, new lat) to
        # send to their new owner, which answers once it holds them.
        self.ghosts: dict[str, float] = {}
        self.asks: list[tuple[str, float, float, float]] = []

    # --- the objects ----------------------------------------------------------------------
    def _place(self, key: tuple[int, str], lon: float, lat: float, kws: frozenset[str]) -> None:
        if self.points is None:
            return
        if self.points.add(key, key[1], lon, lat, kws):
            self._moved.add(key)
        self._placed.add(key)

    def _drop(self, key: tuple[int, str]) -> None:
        if self.points is None:
            return
        if self.points.remove(key):
            self._moved.add(key)
        self._placed.discard(key)

    def upsert_moving(self, oid: str, lon: float, lat: float, kws: frozenset[str],
                      ts: float) -> None:
        if self.objects.upsert_moving(oid, lon, lat, kws, ts):
            self.ghosts.pop(oid, None)
            self._place((MOVING, oid), lon, lat, kws)

    def remove_moving(self, oid: str, ts: float) -> None:
        if self.objects.remove_moving(oid, ts):
            self._drop((MOVING, oid))

    def drop_moving(self, ids: list[str]) -> None:
        for oid in ids:
            self.ghosts.pop(oid, None)
        dropped = [(MOVING, oid) for oid in self.objects.drop_moving(ids)]
        if self.points is not None and dropped:
            self._moved.update(self.points.remove_many(dropped))
            self._placed.difference_update(dropped)

    def exit_moving(self, oid: str, lon: float, lat: float, ts: float) -> None:
        """The object's record `ts` put it at (lon, lat) in another worker's partition: it
        leaves at once unless a local list holds it; then it stays a ghost until `arrived`.
        The position of that same record, held here (this worker owns it too, after a plan
        change), stays."""
        if self.objects.holds_record(oid, ts, (lon, lat)):
            return
        if ((MOVING, oid) in self.members and self.objects.moving_ts.get(oid, math.inf) <= ts
                and oid in self.objects.moving):
            self.ghosts[oid] = ts
            # it stays where it was, but a record older than the exit (one forwarded after a
            # plan change) must not bring it back here
            self.objects.moving_ts[oid] = ts
            self.asks.append((oid, ts, lon, lat))
            return
        self.remove_moving(oid, ts)

    def arrived(self, oid: str, ts: float) -> None:
        """The new owner holds the object's record `ts`: its ghost (if still that) leaves (a
        newer record, or that one, taken here since would have ended the ghost)."""
        if self.ghosts.get(oid) == ts:
            del self.ghosts[oid]
            if self.objects.moving.pop(oid, None) is not None:
                self._drop((MOVING, oid))

    def take_asks(self) -> list[tuple[str, float, float, float]]:
        asks, self.asks = self.asks, []
        return asks

    def add_event(self, oid: str, lon: float, lat: float, kws: frozenset[str], at: float) -> None:
        self.objects.add_event(oid, lon, lat, kws, at)
        self._place((EVENT, oid), lon, lat, kws)

    def expire(self, now: float) -> None:
        for oid in self.objects.expire(now):
            self._drop((EVENT, oid))

    # --- the subscriptions -----------------------------------------------------------------
    def add(self, sub: KnnSub) -> KnnSub:
        return self.add_many([sub])[0]

    def add_many(self, subs: list[KnnSub]) -> list[KnnSub]:
        """Subscriptions (of distinct ids) in place of any held under their ids, each with its
        first list: they search together (`PointIndex.nearest_many`)."""
        for sub in subs:
            self.remove(sub.id, keep_index=True)
        if self.points is None:
            self._build_index()
        for sub in subs:
            self.subs[sub.id] = sub
        for sub, found in zip(subs, self._search_many(subs), strict=True):
            self._set_local(sub, found)
        return subs

    def remove(self, sub_id: str, keep_index: bool = False) -> KnnSub | None:
        sub = self.subs.pop(sub_id, None)
        if sub is not None:
            self._set_local(sub, [])
            self.reach.remove(sub_id)
        if not self.subs and not keep_index:
            self.points = None
            self.members.clear()
            self._moved.clear()
            self._placed.clear()
        return sub

    def _build_index(self) -> None:
        """The spatial index of every object held (the first kNN subscription arrived)."""
        # the k-d tree of many searches at once (`PointIndex.nearest_many`) is imported here,
        # once per worker, rather than by the first partition move, which it would hold up
        import scipy.spatial  # noqa: F401

        points = self.points = PointIndex(self.grid)
        for kind, source in ((MOVING, self.objects.moving), (EVENT, self.objects.events)):
            for oid, (lon, lat, kws) in source.items():
                points.add((kind, oid), oid, lon, lat, kws)
        self._moved.clear()
        self._placed.clear()

    def _search_many(self, subs: list[KnnSub]) -> list[list[Neighbor]]:
        """Each subscription's k nearest, and its bound on the others from the next one,
        searched together."""
        assert self.points is not None
        found = self.points.nearest_many([(sub.lon, sub.lat, sub.k + 1, sub.wanted, sub.radius)
                                          for sub in subs])
        out = []
        for sub, near in zip(subs, found, strict=True):
            sub.beyond = near[sub.k][0] if len(near) > sub.k else math.inf
            out.append(near[:sub.k])
        return out

    def _set_local(self, sub: KnnSub, new: list[Neighbor]) -> None:
        members, sid = self.members, sub.id
        before = sub.keys
        after = tuple(map(_KEY, new))
        if after != before:  # a change moves one or two members: only they are touched
            for key in set(before).difference(after):
                held = members.get(key)
                if held is not None:
                    held.discard(sid)
                    if not held:
                        del members[key]
            for key in set(after).difference(before):
                members.setdefault(key, set()).add(sid)
        sub.local = new
        sub.keys = after
        if sid in self.subs:
            self.reach.update(sub)

    def apply(self, batch: ObjectBatch, at: list[float], now: float) -> list[KnnSub]:
        """Fold a batch into the owned objects; return the subscriptions whose local top-k
        changed."""
        if self.points is None and not self.ghosts:
            self._apply_unindexed(batch, at)
        else:
            for i, oid in enumerate(batch.ids):
                kws = keyword_set(batch.keywords[i])
                if batch.exit_only[i]:
                    # exit-only copy: the object moved to another worker's partition
                    if not batch.late[i]:
                        self.exit_moving(oid, batch.lon[i], batch.lat[i], batch.ts[i])
                    continue
                if batch.moving[i]:
                    if not batch.late[i]:
                        self.upsert_moving(oid, batch.lon[i], batch.lat[i], kws, batch.ts[i])
                else:
                    self.add_event(oid, batch.lon[i], batch.lat[i], kws, at[i])
        self.expire(now)
        return self.refresh()

    def _apply_unindexed(self, batch: ObjectBatch, at: list[float]) -> None:
        """`apply`'s rows while the tenant has no kNN subscription here and no ghost: no index
        to place objects in, no list to change, no listed object to keep as a ghost, so the
        window's bookkeeping alone (what `upsert_moving`, `exit_moving` and `add_event` then
        come to); a batch of events at once."""
        w = self.objects
        if not any(batch.moving) and not any(batch.exit_only):
            w.add_events(batch.ids, batch.lon, batch.lat, map(keyword_set, batch.keywords), at)
            return
        upsert = w.upsert_moving
        for oid, lon, lat, kws, ts, when, mv, late, xo in zip(
                batch.ids, batch.lon, batch.lat, batch.keywords, batch.ts, at, batch.moving,
                batch.late, batch.exit_only, strict=True):
            if xo:
                if not late and not w.holds_record(oid, ts, (lon, lat)):
                    w.remove_moving(oid, ts)
            elif not mv:
                w.add_event(oid, lon, lat, keyword_set(kws), when)
            elif not late:
                upsert(oid, lon, lat, keyword_set(kws), ts)

    def refresh(self) -> list[KnnSub]:
        """The subscriptions whose local top-k changed since the last refresh, with their new
        lists: those that lost a member, or whose member moved out to their bound on the
        others, search again; the others take the newly placed objects that are nearer than
        their k-th, and lower that bound with those nearer than it."""
        moved, placed = self._moved, self._placed
        self._moved, self._placed = set(), set()
        if self.points is None or not self.subs or not (moved or placed):
            return []
        points = self.points
        changed: dict[str, KnnSub] = {}
        again: set[str] = set()
        lost: list[KnnSub] = []
        for sub, left in self._left(moved):
            new = self._repair(sub, left)
            if new is None:
                lost.append(sub)
            elif new != sub.local:
                self._set_local(sub, new)
                changed[sub.id] = sub
        for sub, new in zip(lost, self._search_many(lost), strict=True):
            again.add(sub.id)
            if new != sub.local:
                self._set_local(sub, new)
                changed[sub.id] = sub
            else:  # the same list, with a new bound on the others
                self.reach.update(sub)
        cands = [(key, *held[1:]) for key in placed if (held := points.get(key))]
        if cands:
            for sub, entering in self._entering(again, cands):
                fresh = [n for n in entering if n[0] <= sub.radius]
                if not fresh:
                    continue
                merged = sorted(sub.local + fresh)
                if len(merged) > sub.k:  # those left out (listed before, or not) bound the rest
                    sub.beyond = min(sub.beyond, merged[sub.k][0])
                    del merged[sub.k:]
                if merged != sub.local:
                    self._set_local(sub, merged)
                    changed[sub.id] = sub
                else:  # the same list, told of what comes nearer than its new bound
                    self.reach.update(sub)
        return list(changed.values())

    def _left(self, moved: set[tuple[int, str]]) -> list[tuple[KnnSub, list[Moved]]]:
        """Each subscription that lists objects that moved or left, with those members: their
        key, where the index holds them now (None: gone) and their new distance (rounded to
        the millimetre; infinite when gone), the distances in one numpy call."""
        assert self.points is not None
        members, subs, where = self.members, self.subs, self.points.where
        left: dict[str, list[tuple[int, str]]] = {}
        for key in moved:
            for sid in members.get(key, ()):
                left.setdefault(sid, []).append(key)
        out: list[tuple[KnnSub, list[Moved]]] = []
        coords: list[float] = []  # sub lon, sub lat, member lon, member lat of each held
        for sid, keys in left.items():
            sub = subs.get(sid)
            if sub is None:
                continue
            rows: list[Moved] = []
            for key in keys:
                held = where.get(key)
                rows.append((key, held, math.inf))
                if held is not None:
                    coords += (sub.lon, sub.lat, held[1], held[2])
            out.append((sub, rows))
        if coords:
            a = np.asarray(coords, dtype=np.float64).reshape(-1, 4)
            d = iter([round(v, 3) for v in
                      haversine_m(a[:, 0], a[:, 1], a[:, 2], a[:, 3]).tolist()])
            for _, rows in out:
                for j, (key, held, _) in enumerate(rows):
                    if held is not None:
                        rows[j] = (key, held, next(d))
        return out

    def _repair(self, sub: KnnSub, left: list[Moved]) -> list[Neighbor] | None:
        """The list after some of its members moved or left, without a search when that is
        certain: every object it accepts outside the list lies at `beyond` or farther, so
        members that moved no farther than that are still the k nearest. None when a search
        is needed (a member left a full list, or moved out to `beyond` or farther)."""
        full = len(sub.local) >= sub.k
        moved: list[Neighbor] = []
        for key, held, d in left:
            if held is None or (sub.keywords and not sub.accepts(held[3])) or d > sub.radius:
                if full:
                    return None
                continue  # fewer than k: every object it accepts within reach was listed
            if full and d >= sub.beyond:
                return None
            moved.append((d, key[1], held[1], held[2], key))
        if len(left) == 1 and left[0][0] in sub.keys:
            # the common case: one member out, and back in at its place (no sort)
            out = list(sub.local)
            del out[sub.keys.index(left[0][0])]
            if moved:
                bisect.insort(out, moved[0])
            return out
        gone = {key for key, _, _ in left}
        out = [n for n in sub.local if n[4] not in gone]
        out += moved
        out.sort()
        return out

    def _entering(self, again: set[str],
                  cands: list[tuple[tuple[int, str], float, float, frozenset[str]]]
                  ) -> list[tuple[KnnSub, list[Neighbor]]]:
        """For each subscription but those searched `again`, the candidates nearer than its
        k-th (any within its radius while it holds fewer than k) that satisfy its keywords
        and that it does not list already (a member that moved; one placed before the
        subscription's search): the pairs `Reach` gives, their distances at once."""
        if len(again) >= len(self.subs):
            return []
        reach = self.reach
        lon = np.asarray([c[1] for c in cands], dtype=np.float64)
        lat = np.asarray([c[2] for c in cands], dtype=np.float64)
        si, ci = reach.pairs(lon, lat)
        if not si.size:
            return []
        if again:  # those searched again take no candidates
            wanted = np.ones(len(reach.subs), dtype=bool)
            wanted[[reach.slot[sid] for sid in again if sid in reach.slot]] = False
            keep = wanted[si]
            si, ci = si[keep], ci[keep]
        d = haversine_m(reach.lon[si], reach.lat[si], lon[ci], lat[ci])
        hit = np.flatnonzero(d <= reach.kth[si] + 0.001)
        si, ci, d = si[hit], ci[hit], d[hit]
        # Many pairs left are of lists whose keywords the candidate lacks (such a list reaches
        # far, past the many that lack them): they go here, with numpy, rather than one by one
        # below. The keyword test is of signatures: every candidate that holds the keywords
        # passes, and a few more, which the predicate itself then turns away. Most of the
        # others are of lists that hold the candidate already (a member moved), turned away
        # below by one look-up each (cheaper than pairing every list of every candidate
        # beforehand: measured 7 % of `apply`).
        sig = np.fromiter((signature(c[3]) for c in cands), dtype=np.uint64, count=len(cands))
        masks = reach.masks[si]
        keep = ((sig[ci][:, None] & masks) == masks).any(axis=1)
        found: dict[int, list[Neighbor]] = {}
        members = self.members
        for s_ix, c_ix, dj in zip(si[keep].tolist(), ci[keep].tolist(), d[keep].tolist(),
                                  strict=True):
            sub = reach.subs[s_ix]
            key, x, y, kws = cands[c_ix]
            if sub is None or (sub.keywords and not sub.accepts(kws)):
                continue
            held = members.get(key)
            if held is not None and sub.id in held:
                continue
            found.setdefault(s_ix, []).append((round(dj, 3), key[1], x, y, key))
        return [(sub, found[i]) for i in sorted(found) if (sub := reach.subs[i]) is not None]
