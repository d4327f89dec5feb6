"""The spatial index of the objects one worker holds for continuous kNN: points bucketed by
cell of the global grid, each cell a small numpy array. A k-nearest search visits the occupied
cells in order of MINDIST, a lower bound of the distance from the query point to anything in
the cell (AQWA §5's MINDIST scan, CheetahGIS's cell-pruned kNN), and stops at the first cell
that cannot hold anything nearer than the k-th found: the cost follows the neighbourhood of
the point, not the number of objects held.
"""

from __future__ import annotations

import functools
import math
import operator
from bisect import bisect_right
from collections.abc import Hashable, Sequence
from itertools import accumulate
from typing import TypeVar

import numpy as np
import numpy.typing as npt

from app.geo.geometry import EARTH_RADIUS_M, haversine_m
from app.geo.grid import Grid
from workers.records import Terms, term_mask
from workers.window import NO_KEYWORDS

F64 = npt.NDArray[np.float64]
# (distance in metres rounded to the millimetre, object id, lon, lat, the point's key): the
# order of a kNN list, ties broken by id (the same rounding as the lists pushed to subscribers)
Neighbor = tuple[float, str, float, float, Hashable]
K = TypeVar("K", bound=Hashable)
# Slack of the lower bound: float rounding must never make it exceed the true distance.
_SLACK_M = 1e-3


def mindist_m(lon: float, lat: float, x0: F64, y0: F64, x1: F64, y1: F64,
              cos_min: F64 | None = None) -> F64:
    """A lower bound of the haversine distance from (lon, lat) to any point of each
    lon/lat rectangle [x0, x1] x [y0, y1]: each term of the haversine at its smallest over
    the rectangle (latitude gap; longitude gap, wrapping the antimeridian, times the smallest
    cosine of the rectangle's latitudes)."""
    dlat = np.where(lat < y0, y0 - lat, np.where(lat > y1, lat - y1, 0.0))
    inside = (lon >= x0) & (lon <= x1)
    dlon = np.where(inside, 0.0, np.minimum((x0 - lon) % 360.0, (lon - x1) % 360.0))
    dlon = np.minimum(dlon, 180.0)
    if cos_min is None:
        cos_min = np.maximum(np.minimum(np.cos(np.radians(y0)), np.cos(np.radians(y1))), 0.0)
    a = (np.sin(np.radians(dlat) * 0.5) ** 2
         + math.cos(math.radians(lat)) * cos_min * np.sin(np.radians(dlon) * 0.5) ** 2)
    d: F64 = 2.0 * EARTH_RADIUS_M * np.arcsin(np.sqrt(np.minimum(a, 1.0)))
    return np.maximum(d * (1.0 - 1e-9) - _SLACK_M, 0.0)


BLOCKS = (1, 3, 7, 15)  # half-sides (in cells) of the blocks a search tries before all cells
FIRST_CELLS = 32  # then the cells nearest to the point, before all the others
# `PointIndex.nearest_many` builds a k-d tree for at least this many queries, and one for
# every so many points held; each query takes this many candidates beyond its k from it
TREE_AT, TREE_POINTS_PER_QUERY, TREE_SPARE = 32, 400, 4


def _escape_m(g: Grid, lon: float, lat: float, xa: int, ya: int, xb: int, yb: int) -> float:
    """A lower bound of the distance from (lon, lat), inside the block of cells [xa, xb] x
    [ya, yb], to any point outside it: the latitude gap to its south and north sides, and the
    distance to the meridians of its west and east sides (sin d = cos(lat) sin(dlon), the
    nearest a point at that longitude can be). A side on the grid's edge has nothing beyond it
    (points beyond the bounds are clipped into the edge cells), except the antimeridian of a
    grid around the whole world: the bound is 0 there, and the search scans every cell. It is
    0 too for a point beyond the bounds (clipped into an edge cell): across the antimeridian,
    points clipped into the opposite edge may be next to it."""
    if not (g.bounds[0] <= lon <= g.bounds[2] and g.bounds[1] <= lat <= g.bounds[3]):
        return 0.0
    x0 = g.bounds[0] + xa * g.cell_width
    x1 = g.bounds[0] + (xb + 1) * g.cell_width
    y0 = g.bounds[1] + ya * g.cell_height
    y1 = g.bounds[1] + (yb + 1) * g.cell_height
    gaps = []
    if ya > 0:
        gaps.append(math.radians(lat - y0))
    if yb < g.ny - 1:
        gaps.append(math.radians(y1 - lat))
    around = g.bounds[2] - g.bounds[0] >= 360.0
    if around and (xa == 0 or xb == g.nx - 1):
        return 0.0
    cos_lat = math.cos(math.radians(lat))
    for dlon in ((lon - x0) if xa > 0 else math.inf, (x1 - lon) if xb < g.nx - 1 else math.inf):
        if dlon == math.inf:
            continue
        gaps.append(math.asin(min(1.0, cos_lat * math.sin(math.radians(min(dlon, 90.0))))))
    if not gaps:
        return math.inf
    return max(0.0, EARTH_RADIUS_M * min(gaps) * (1.0 - 1e-9) - _SLACK_M)


def _unit(lon: F64, lat: F64) -> F64:
    """Points as unit vectors (rows of x, y, z)."""
    lam, phi = np.radians(lon), np.radians(lat)
    cos_phi = np.cos(phi)
    return np.stack([cos_phi * np.cos(lam), cos_phi * np.sin(lam), np.sin(phi)], axis=1)


@functools.lru_cache(maxsize=1 << 16)
def signature(kws: frozenset[str]) -> int:
    """The 64-bit signature of a point's keywords: the two bits (`term_mask`) of each term's
    hash. A point holding a term has both of its bits; one without it has both only now and
    then, so a search with keywords tests its predicate on a few more points than it
    accepts, not on every point it meets."""
    bits = 0
    for term in kws:
        bits |= term_mask(hash(term))
    return bits


class Keywords:
    """The keyword predicate of a search: any of the terms, or all of them; `signatures` the
    same as a test of `signature`s (`Terms` over the terms' hashes)."""

    __slots__ = ("match_all", "signatures", "terms")

    def __init__(self, terms: frozenset[str], match_all: bool) -> None:
        if not terms:  # no predicate: a search without one (`wanted=None`)
            raise ValueError("a keyword predicate needs at least one term")
        self.terms = terms
        self.match_all = match_all
        masks = [term_mask(hash(t)) for t in terms]
        self.signatures = Terms(
            (functools.reduce(operator.or_, masks),) if match_all else tuple(masks), match_all)

    def accepts(self, kws: frozenset[str]) -> bool:
        return self.terms <= kws if self.match_all else not self.terms.isdisjoint(kws)


# A search of `PointIndex.nearest_many`: lon, lat, k, keyword predicate (None: any), within (m)
Query = tuple[float, float, int, Keywords | None, float]


def _slot_of(cells: list[_Cell], ends: list[int], j: int) -> tuple[_Cell, int]:
    """The cell and slot of position `j` of the cells' slots laid end to end (`ends`: the
    running totals of their sizes)."""
    c = bisect_right(ends, j)
    return cells[c], j - (ends[c - 1] if c else 0)


class _Cell:
    """The points of one cell: slots in growing arrays, freed slots reused (NaN while free)."""

    __slots__ = ("free", "ids", "keys", "kws", "lat", "lon", "sig", "slot")

    def __init__(self) -> None:
        self.ids: list[str] = []
        self.keys: list[Hashable] = []
        self.kws: list[frozenset[str]] = []
        self.lon: F64 = np.full(4, np.nan)
        self.lat: F64 = np.full(4, np.nan)
        self.sig: npt.NDArray[np.uint64] = np.zeros(4, dtype=np.uint64)  # `signature`s
        self.slot: dict[Hashable, int] = {}
        self.free: list[int] = []

    def __len__(self) -> int:
        return len(self.slot)

    def add(self, key: Hashable, oid: str, lon: float, lat: float, kws: frozenset[str]) -> None:
        if self.free:
            i = self.free.pop()
            self.ids[i], self.keys[i], self.kws[i] = oid, key, kws
        else:
            i = len(self.ids)
            if i == len(self.lon):
                self.lon = np.concatenate([self.lon, np.full(i, np.nan)])
                self.lat = np.concatenate([self.lat, np.full(i, np.nan)])
                self.sig = np.concatenate([self.sig, np.zeros(i, dtype=np.uint64)])
            self.ids.append(oid)
            self.keys.append(key)
            self.kws.append(kws)
        self.lon[i], self.lat[i] = lon, lat
        self.sig[i] = signature(kws)
        self.slot[key] = i

    def remove(self, key: Hashable) -> None:
        i = self.slot.pop(key)
        self.lon[i] = self.lat[i] = np.nan
        self.sig[i] = 0
        self.kws[i] = NO_KEYWORDS
        self.free.append(i)


class PointIndex:
    """Points by key (an object of a kind: a moving object and an event may share an id)."""

    def __init__(self, grid: Grid) -> None:
        self.grid = grid
        self.cells: dict[int, _Cell] = {}
        self.where: dict[Hashable, tuple[int, float, float, frozenset[str]]] = {}
        # occupied cells: ids, rectangles, the smallest cosine of each one's latitudes
        self._occupied: tuple[npt.NDArray[np.int64], F64, F64, F64, F64, F64] | None = None

    def __len__(self) -> int:
        return len(self.where)

    def get(self, key: Hashable) -> tuple[int, float, float, frozenset[str]] | None:
        return self.where.get(key)

    def _cell_of(self, lon: float, lat: float) -> int:
        g = self.grid
        cx = min(max(math.floor((lon - g.bounds[0]) / g.cell_width), 0), g.nx - 1)
        cy = min(max(math.floor((lat - g.bounds[1]) / g.cell_height), 0), g.ny - 1)
        return int(cy * g.nx + cx)

    def add(self, key: Hashable, oid: str, lon: float, lat: float, kws: frozenset[str]
            ) -> bool:
        """Insert or move the point of `key`; whether it was held before."""
        cid = self._cell_of(lon, lat)
        held = self.where.get(key)
        if held is not None:
            if held[0] == cid:  # moved within its cell (the common case): in place
                home = self.cells[cid]
                i = home.slot[key]
                home.lon[i], home.lat[i] = lon, lat
                if kws is not home.kws[i]:
                    home.sig[i] = signature(kws)
                home.ids[i], home.kws[i] = oid, kws
                self.where[key] = (cid, lon, lat, kws)
                return True
            self.remove(key)
        cell = self.cells.get(cid)
        if cell is None:
            cell = self.cells[cid] = _Cell()
            self._occupied = None
        cell.add(key, oid, lon, lat, kws)
        self.where[key] = (cid, lon, lat, kws)
        return held is not None

    def remove(self, key: Hashable) -> bool:
        held = self.where.pop(key, None)
        if held is None:
            return False
        cell = self.cells[held[0]]
        cell.remove(key)
        if not len(cell):
            del self.cells[held[0]]
            self._occupied = None
        return True

    def remove_many(self, keys: Sequence[K]) -> list[K]:
        """`remove` for many keys (a handoff's objects): a cell left empty goes whole, without
        freeing its slots one by one. Returns the keys that were held."""
        by_cell: dict[int, list[K]] = {}
        where = self.where
        for key in keys:
            held = where.pop(key, None)
            if held is not None:
                by_cell.setdefault(held[0], []).append(key)
        for cid, gone in by_cell.items():
            cell = self.cells[cid]
            if len(gone) < len(cell):
                for key in gone:
                    cell.remove(key)
            else:  # every point of the cell
                del self.cells[cid]
                self._occupied = None
        return [key for gone in by_cell.values() for key in gone]

    def _cells(self) -> tuple[npt.NDArray[np.int64], F64, F64, F64, F64, F64]:
        if self._occupied is None:
            g = self.grid
            cid = np.fromiter(self.cells, dtype=np.int64, count=len(self.cells))
            cx, cy = cid % g.nx, cid // g.nx
            x0: F64 = (g.bounds[0] + cx * g.cell_width).astype(np.float64)
            y0: F64 = (g.bounds[1] + cy * g.cell_height).astype(np.float64)
            x1, y1 = x0 + g.cell_width, y0 + g.cell_height
            # edge cells also hold the points beyond the bounds, clipped into them
            x0[cx == 0], x1[cx == g.nx - 1] = -180.0, 180.0
            y0[cy == 0], y1[cy == g.ny - 1] = -90.0, 90.0
            cos_min = np.maximum(np.minimum(np.cos(np.radians(y0)), np.cos(np.radians(y1))),
                                 0.0)
            occupied = (cid, x0, y0, x1, y1, cos_min)
            self._occupied = occupied
            return occupied
        return self._occupied

    def nearest(self, lon: float, lat: float, k: int, wanted: Keywords | None = None,
                within: float = math.inf) -> list[Neighbor]:
        """The k points nearest to (lon, lat) that `wanted` accepts (all without it) and lie
        within `within` metres, ordered by (distance rounded to the millimetre, id)."""
        if k <= 0 or not self.where:
            return []
        for half in BLOCKS:
            near = self._nearest_in_block(lon, lat, k, wanted, half, within)
            if near is not None:
                return near
        cid, x0, y0, x1, y1, cos_min = self._cells()
        bound = mindist_m(lon, lat, x0, y0, x1, y1, cos_min)
        if math.isfinite(within):  # only the cells that reach within the radius
            keep = np.flatnonzero(bound <= within + _SLACK_M)
            if not keep.size:
                return []
            cid, bound = cid[keep], bound[keep]
        best: list[Neighbor] = []
        # The nearest cells first (a partial sort); the rest only when they can matter.
        m = min(FIRST_CELLS, len(bound))
        first = np.argpartition(bound, m - 1)[:m] if m < len(bound) else np.arange(m)
        first = first[np.argsort(bound[first], kind="stable")]
        self._scan(lon, lat, k, wanted, cid, bound, first, best)
        if m < len(bound) and (len(best) < k or float(bound[first[-1]]) <= best[-1][0]
                               + _SLACK_M):
            rest = np.ones(len(bound), dtype=bool)
            rest[first] = False
            others = np.flatnonzero(rest)
            others = others[np.argsort(bound[others], kind="stable")]
            self._scan(lon, lat, k, wanted, cid, bound, others, best)
        best.sort()
        return [n for n in best if n[0] <= within] if math.isfinite(within) else best

    def nearest_many(self, queries: Sequence[Query]) -> list[list[Neighbor]]:
        """`nearest` of each query (lon, lat, k, wanted, within), the same answers. Many
        queries without keywords (a handoff's or a registration's subscriptions) are answered
        from one k-d tree over every point held (`_tree_many`): a search of the cells costs
        the points of the block around the query point, which in a city are thousands. The
        others, and those the tree's candidates cannot settle, search one by one."""
        out: list[list[Neighbor] | None] = [None] * len(queries)
        if not self.where:
            return [[] for _ in queries]
        plain = [j for j, q in enumerate(queries) if q[3] is None and q[2] > 0]
        if len(plain) >= max(TREE_AT, len(self.where) // TREE_POINTS_PER_QUERY):
            self._tree_many(plain, queries, out)
        return [o if o is not None else self.nearest(*queries[j]) for j, o in enumerate(out)]

    def _tree_many(self, js: list[int], queries: Sequence[Query],
                   out: list[list[Neighbor] | None]) -> None:
        """The queries `js` (without keywords) from a k-d tree of the points as unit vectors:
        the chord between two of them grows with their great-circle distance, so each query's
        nearest by chord, a few more than its k, are its candidates, and the last of them
        bounds everything else. A query's answer goes to `out` when that bound shows nothing
        else can enter it (a tie at the millimetre with what lies beyond: None stays)."""
        from scipy.spatial import cKDTree  # here: its import costs 0.3 s (see KnnState)

        cells = list(self.cells.values())
        sizes = [len(c.ids) for c in cells]
        lon = np.concatenate([c.lon[:n] for c, n in zip(cells, sizes, strict=True)])
        lat = np.concatenate([c.lat[:n] for c, n in zip(cells, sizes, strict=True)])
        ids = [oid for c, n in zip(cells, sizes, strict=True) for oid in c.ids[:n]]
        keys = [key for c, n in zip(cells, sizes, strict=True) for key in c.keys[:n]]
        live = np.flatnonzero(~np.isnan(lon))  # free slots are NaN
        tree = cKDTree(_unit(lon[live], lat[live]))
        by_k: dict[int, list[int]] = {}
        for j in js:
            by_k.setdefault(queries[j][2], []).append(j)
        for k, rows in by_k.items():
            spare = min(k + TREE_SPARE, live.size)
            qlon = np.asarray([queries[j][0] for j in rows], dtype=np.float64)
            qlat = np.asarray([queries[j][1] for j in rows], dtype=np.float64)
            chord, found = tree.query(_unit(qlon, qlat), k=spare)
            chord, found = chord.reshape(len(rows), spare), found.reshape(len(rows), spare)
            at = live[found]
            d = haversine_m(qlon[:, None], qlat[:, None], lon[at], lat[at]).tolist()
            if spare < live.size:  # the farthest candidate's distance bounds the others
                arc = 2.0 * EARTH_RADIUS_M * np.arcsin(np.minimum(chord[:, -1] * 0.5, 1.0))
                beyond = np.maximum(arc * (1.0 - 1e-9) - _SLACK_M, 0.0).tolist()
            else:
                beyond = [math.inf] * len(rows)
            at_all, x_all, y_all = at.tolist(), lon[at].tolist(), lat[at].tolist()
            for r, j in enumerate(rows):
                within = queries[j][4]
                best = sorted([(round(dj, 3), ids[c], x, y, keys[c]) for dj, c, x, y in zip(
                    d[r], at_all[r], x_all[r], y_all[r], strict=True)])
                head = [n for n in best if n[0] <= within][:k]
                last = head[-1][0] if len(head) >= k else within
                if last + _SLACK_M < beyond[r]:
                    out[j] = head

    def _scan(self, lon: float, lat: float, k: int, wanted: Keywords | None,
              cid: npt.NDArray[np.int64], bound: F64, order: npt.NDArray[np.intp],
              best: list[Neighbor]) -> None:
        """Visit cells in `order` (by bound), keeping the k best in `best`, until the next
        cell's bound is beyond the k-th found."""
        for j in order.tolist():
            if len(best) >= k and bound[j] > best[-1][0] + _SLACK_M:
                break
            cell = self.cells[int(cid[j])]
            n = len(cell.ids)
            d = haversine_m(lon, lat, cell.lon[:n], cell.lat[:n])
            limit = best[-1][0] + _SLACK_M if len(best) >= k else math.inf
            near = d <= limit
            if wanted is not None:
                near &= wanted.signatures.may_hold(cell.sig[:n])
            for i in np.flatnonzero(near).tolist():
                if wanted is not None and not wanted.accepts(cell.kws[i]):
                    continue
                best.append((round(float(d[i]), 3), cell.ids[i], float(cell.lon[i]),
                             float(cell.lat[i]), cell.keys[i]))
            if len(best) > k:
                best.sort()
                del best[k:]
            elif len(best) == k:
                best.sort()

    def _nearest_in_block(self, lon: float, lat: float, k: int, wanted: Keywords | None,
                          half: int, within: float) -> list[Neighbor] | None:
        """The answer from the block of (2 half + 1)² cells around the point, when nothing
        outside it can be in the answer: it holds k points nearer than anything outside the
        block can be, or the circle of radius `within` lies inside it. None otherwise."""
        g = self.grid
        cx = min(max(math.floor((lon - g.bounds[0]) / g.cell_width), 0), g.nx - 1)
        cy = min(max(math.floor((lat - g.bounds[1]) / g.cell_height), 0), g.ny - 1)
        xa, xb = max(cx - half, 0), min(cx + half, g.nx - 1)
        ya, yb = max(cy - half, 0), min(cy + half, g.ny - 1)
        escape = _escape_m(g, lon, lat, xa, ya, xb, yb)
        inside = within + _SLACK_M < escape  # the circle within the block
        cells = [c for y in range(ya, yb + 1) for x in range(xa, xb + 1)
                 if (c := self.cells.get(y * g.nx + x)) is not None]
        held = sum(len(c) for c in cells)
        if not inside and held < k:
            return None
        if not cells:
            return []
        # every slot of the block at once; free slots are NaN (no comparison takes them, and
        # a partition puts them last)
        sizes = [len(c.ids) for c in cells]
        ends = list(accumulate(sizes))
        if len(cells) == 1:
            lons, lats = cells[0].lon[:sizes[0]], cells[0].lat[:sizes[0]]
        else:
            lons = np.concatenate([c.lon[:n] for c, n in zip(cells, sizes, strict=True)])
            lats = np.concatenate([c.lat[:n] for c, n in zip(cells, sizes, strict=True)])
        # The candidates: the k nearest, and whatever is as near up to the rounding of
        # distances to the millimetre (ties are then broken by id).
        if wanted is None:
            d = haversine_m(lon, lat, lons, lats)
            if held > k:
                kth = float(np.partition(d, k - 1)[k - 1])
                taken = np.flatnonzero(d <= kth + _SLACK_M)
            else:
                taken = np.flatnonzero(d == d)
            cand: list[int] = taken.tolist()
            near: list[float] = d[taken].tolist()
        else:
            # the points whose signatures could hold the terms (free slots' cannot), by
            # distance; the predicate itself on them, until k are taken
            sigs = (cells[0].sig[:sizes[0]] if len(cells) == 1 else
                    np.concatenate([c.sig[:n] for c, n in zip(cells, sizes, strict=True)]))
            could = np.flatnonzero(wanted.signatures.may_hold(sigs))
            if could.size < k and not inside:
                return None
            dc = haversine_m(lon, lat, lons[could], lats[could])
            order = np.argsort(dc, kind="stable")
            cand, near = [], []
            bound = math.inf
            for j, dj in zip(could[order].tolist(), dc[order].tolist(), strict=True):
                if dj > bound:
                    break
                cell, i = _slot_of(cells, ends, j)
                if wanted.accepts(cell.kws[i]):
                    cand.append(j)
                    near.append(dj)
                    if len(cand) == k:
                        bound = dj + _SLACK_M
            if len(cand) < k and not inside:
                return None
        best: list[Neighbor] = []
        for j, dj in zip(cand, near, strict=True):
            cell, i = _slot_of(cells, ends, j)
            best.append((round(dj, 3), cell.ids[i], float(lons[j]), float(lats[j]),
                         cell.keys[i]))
        best.sort()
        del best[k:]
        if not inside and (len(best) < k or best[-1][0] + _SLACK_M >= escape):
            return None  # something outside the block could be nearer
        return [n for n in best if n[0] <= within] if inside else best
