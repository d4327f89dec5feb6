"""SWARM's executor-side ledger (§4.2): per-partition statistics N, Q, R with their collectors,
the per-cell object counts of the window that N is taken back from when objects expire
(§4.2.2) and that seed a partition created by a split, merge or move, and which subscription
was counted where, so that a deletion takes it back out.

The same class serves a real executor (its owned partitions) and the simulation of
`geoswarm bench swarm` (every partition of the cluster), so the simulation measures the code
that runs.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from app.geo.arrays import distinct
from app.geo.geometry import circle_bbox
from app.geo.grid import Grid
from app.geo.index import GlobalIndex, Partition
from app.geo.stats import PartitionStats

I32 = np.ndarray[Any, np.dtype[np.int32]]
I64 = np.ndarray[Any, np.dtype[np.int64]]
Mask = np.ndarray[Any, np.dtype[np.bool_]]
Rect = tuple[int, int, int, int]

POINTS_PENDING = 4096  # objects added and not counted yet, at most (`add_points`)


@dataclass
class WindowPiece:
    """Per-cell counts of the objects of one time bucket and round still in the window, for
    SWARM's N: expired objects decrement N (§4.2.2), and a new partition is seeded with its
    cells' objects. Counts, not objects: memory grows with the cells hit, not the rate."""

    bucket: int
    arrived: int  # the ledger's fold count when they arrived
    cx: I32
    cy: I32
    n: I32

    pending: list[tuple[I32, I32, I32]] = field(default_factory=list)
    pending_rows: int = 0

    def add(self, cx: I32, cy: I32, n: I32, nx: int) -> None:
        """More counts of the same bucket and round; merged (equal cells summed) lazily, when
        enough are pending or before anyone reads the piece (`compact`)."""
        self.pending.append((cx, cy, n))
        self.pending_rows += cx.size
        if self.pending_rows > 4 * self.cx.size + 65536:
            self.compact(nx)

    def compact(self, nx: int) -> None:
        if not self.pending:
            return
        parts = [(self.cx, self.cy, self.n), *self.pending]
        cid = np.concatenate([y.astype(np.int64) * nx + x for x, y, _ in parts])
        cells, inv = np.unique(cid, return_inverse=True)
        counts = np.bincount(inv, weights=np.concatenate([c for _, _, c in parts]))
        self.cx, self.cy = (cells % nx).astype(np.int32), (cells // nx).astype(np.int32)
        self.n = counts.astype(np.int32)
        self.pending, self.pending_rows = [], 0

    def select(self, mask: Mask) -> WindowPiece:
        """The cells where `mask` holds (of a compacted piece)."""
        return WindowPiece(self.bucket, self.arrived, self.cx[mask], self.cy[mask],
                           self.n[mask])


def cell_counts(cx: Any, cy: Any, nx: int) -> tuple[I32, I32, I32]:
    """The distinct cells of a batch of objects with how many objects each holds."""
    cells, counts = np.unique(np.asarray(cy, dtype=np.int64) * nx + cx, return_counts=True)
    return ((cells % nx).astype(np.int32), (cells // nx).astype(np.int32),
            counts.astype(np.int32))


def rects_overlapping(rects: I64, x0: int, y0: int, x1: int, y1: int) -> Mask:
    """Which rows of `rects` (x0, y0, x1, y1 cell ranges) overlap the given cell range."""
    return (rects[:, 0] <= x1) & (rects[:, 2] >= x0) & (rects[:, 1] <= y1) & (rects[:, 3] >= y0)


def rect_of(grid: Grid, spec: dict[str, Any]) -> Rect:
    """The cells a subscription covers for the statistics: its range; every cell for keyword
    subscriptions (they are evaluated against every object); the centre cell for kNN."""
    if spec["type"] == "range":
        if "bbox" in spec:
            return grid.cell_range(tuple(spec["bbox"]))
        c = spec["circle"]
        return grid.cell_range(circle_bbox(c["lon"], c["lat"], c["radius_m"]))
    if spec["type"] == "knn":
        cx, cy = grid.cells_of([spec["point"][0]], [spec["point"][1]])
        return int(cx[0]), int(cy[0]), int(cx[0]), int(cy[0])
    return 0, 0, grid.nx - 1, grid.ny - 1


# A window piece as a handoff carries it: bucket, age in folds, cells x, cells y, counts.
ExportedPiece = tuple[int, int, list[int], list[int], list[int]]


class SwarmLedger:
    """The statistics of a set of partitions (those `sync` was last given)."""

    def __init__(self, grid: Grid) -> None:
        self.grid = grid
        self.index: GlobalIndex | None = None
        self._stats: dict[str, PartitionStats] = {}
        # objects added (`add_points`) and not counted yet: (lon, lat, bucket) of each batch
        self._points: list[tuple[Sequence[float], Sequence[float], int]] = []
        self._points_rows = 0
        self.folds = 0  # rounds folded; arrival rounds are counted in this
        self.window: deque[WindowPiece] = deque()
        self.sub_rect: dict[str, Rect] = {}  # subscription -> the cells it covers
        self.sub_parts: dict[str, list[tuple[PartitionStats, int]]] = {}

    @property
    def stats(self) -> dict[str, PartitionStats]:
        """The statistics of each partition held, every object added so far counted."""
        self.count_points()
        return self._stats

    # --- subscriptions ----------------------------------------------------------------
    def add_query(self, sid: str, rect: Rect) -> None:
        """A new subscription: the collectors of every partition it overlaps."""
        self.sub_rect[sid] = rect
        for stats in self.stats.values():
            if stats.partition.overlaps(*rect):
                stats.add_query(*rect)
                self.sub_parts.setdefault(sid, []).append((stats, stats.round))

    def add_queries(self, sids: list[str], rects: I64) -> None:
        """Many new subscriptions at once (rows of `rects`: x0, y0, x1, y1)."""
        for sid, r in zip(sids, rects.tolist(), strict=True):
            self.sub_rect[sid] = (r[0], r[1], r[2], r[3])
        for stats in self.stats.values():
            p = stats.partition
            m = rects_overlapping(rects, p.x0, p.y0, p.x1, p.y1)
            if m.any():
                r = rects[m]
                stats.add_queries(r[:, 0], r[:, 1], r[:, 2], r[:, 3])
                for k in np.flatnonzero(m).tolist():
                    self.sub_parts.setdefault(sids[k], []).append((stats, stats.round))

    def remove_query(self, sid: str) -> None:
        """A deleted subscription leaves the statistics of the partitions it was counted in
        (those still held: a partition given away took its statistics along)."""
        rect = self.sub_rect.pop(sid, None)
        for stats, arrived in self.sub_parts.pop(sid, []):
            if rect is not None and self.stats.get(stats.partition.id) is stats:
                stats.remove_query(*rect, arrived_round=arrived)

    def queries_over(self, p: Partition) -> list[tuple[str, Rect]]:
        """The subscriptions counted here whose cells overlap partition p."""
        return [(sid, rect) for sid, rect in self.sub_rect.items() if p.overlaps(*rect)]

    # --- objects ----------------------------------------------------------------------
    def add_points(self, lon: Sequence[float], lat: Sequence[float], bucket: int) -> None:
        """New objects at these points, counted (`add_objects`) when anything reads the
        statistics or the window, or once POINTS_PENDING of them wait: a worker's step adds a
        few tens, and counting each step's alone cost a quarter of a millisecond of numpy
        calls, as much as counting thousands together."""
        if not self._stats or not len(lon):
            return
        self._points.append((lon, lat, bucket))
        self._points_rows += len(lon)
        if self._points_rows >= POINTS_PENDING:
            self.count_points()

    def count_points(self) -> None:
        """Count the objects `add_points` left waiting, bucket by bucket in their order."""
        if not self._points:
            return
        points, self._points, self._points_rows = self._points, [], 0
        lon = np.concatenate([np.asarray(p[0], dtype=np.float64) for p in points])
        lat = np.concatenate([np.asarray(p[1], dtype=np.float64) for p in points])
        cx, cy = self.grid.cells_of(lon, lat)
        buckets = np.repeat([p[2] for p in points], [len(p[0]) for p in points])
        for bucket in sorted(set(p[2] for p in points)):
            sel = buckets == bucket
            self.add_objects(cx[sel], cy[sel], bucket)

    def add_objects(self, cx: Any, cy: Any, bucket: int) -> None:
        """New objects (cells of each): two collectors each (§4.2.2), and their cells kept
        with the window for expiry and for seeding new partitions."""
        self.count_points()  # (in their order: those waiting came first)
        if not self._stats:
            return
        nx = self.grid.nx
        x, y, n = cell_counts(cx, cy, nx)
        last = self.window[-1] if self.window else None
        if last is not None and (last.bucket, last.arrived) == (bucket, self.folds):
            last.add(x, y, n, nx)
        else:
            self.window.append(WindowPiece(bucket, self.folds, x, y, n))
        self._apply(x, y, n, lambda st, px, py, c: st.add_objects(px, py, c))

    def expire(self, horizon: int) -> None:
        """Objects of buckets before `horizon` left the window: N is decremented (§4.2.2)."""
        self.count_points()
        while self.window and self.window[0].bucket < horizon:
            piece = self.window.popleft()
            piece.compact(self.grid.nx)
            if piece.cx.size:
                def take_back(st: PartitionStats, x: I32, y: I32, c: I32,
                              arrived: int = piece.arrived) -> None:
                    st.expire_objects(x, y, arrived_round=arrived, count=c)

                self._apply(piece.cx, piece.cy, piece.n, take_back)

    def compact(self) -> None:
        self.count_points()
        for piece in self.window:
            piece.compact(self.grid.nx)

    def _apply(self, cx: I32, cy: I32, n: I32,
               fn: Callable[[PartitionStats, I32, I32, I32], None]) -> None:
        """Call fn(stats, cx, cy, n) per partition held with the cells inside it."""
        assert self.index is not None
        part = self.index.cell_part[cy, cx]
        for pi in distinct(part).tolist():
            stats = self._stats.get(self.index.partitions[pi].id)
            if stats is not None:
                sel = part == pi
                fn(stats, cx[sel], cy[sel], n[sel])

    # --- the partitions held ----------------------------------------------------------
    def sync(self, index: GlobalIndex, held: Iterable[Partition]) -> None:
        """Statistics for exactly the partitions `held`: dropped for the others, created for
        new ones (split, merged or received) and seeded with the window's objects and the
        subscriptions that lie in them, as if the partition had always existed."""
        self.count_points()  # in the partitions of their time
        self.index, self.grid = index, index.grid
        held_by_id = {p.id: p for p in held}
        self.compact()
        for pid in [pid for pid in self.stats if pid not in held_by_id]:
            del self.stats[pid]
        for pid, p in held_by_id.items():
            if pid in self.stats:
                continue
            self.stats[pid] = self.seeded(p, register=True)

    def seeded(self, p: Partition, register: bool = False) -> PartitionStats:
        """Statistics for partition p from the window's objects (with their arrival rounds)
        and the subscriptions counted here, as if p had always existed (R counts from the
        next fold on). `register` records the subscriptions for a later deletion."""
        self.compact()
        stats = PartitionStats(p, round=self.folds)
        for piece in self.window:
            sel = p.contains_cells(piece.cx, piece.cy)
            if sel.any():
                stats.seed_objects(piece.cx[sel], piece.cy[sel], arrived_round=piece.arrived,
                                   count=piece.n[sel])
        for sid, rect in self.queries_over(p):
            arrived = stats.seed_query(*rect)
            if register:
                self.sub_parts.setdefault(sid, []).append((stats, arrived))
        return stats

    def fold(self) -> list[PartitionStats]:
        """End of a round: Algorithm 2 for every partition held (N halved first); returns
        them, in the order they were created."""
        held = list(self.stats.values())
        for stats in held:
            stats.fold()
        self.folds += 1
        return held

    # --- migration (§5.1) -------------------------------------------------------------
    def export_window(self, inside_cells: Callable[[I32, I32], Mask],
                      taken: list[Mask]) -> list[ExportedPiece]:
        """The window's counts in the cells `inside_cells` selects, as a handoff carries them;
        marks them in `taken` (one mask per piece, see `drop_window`)."""
        self.count_points()
        out: list[ExportedPiece] = []
        for k, piece in enumerate(self.window):
            sel = inside_cells(piece.cx, piece.cy)
            if sel.any():
                out.append((piece.bucket, self.folds - piece.arrived, piece.cx[sel].tolist(),
                            piece.cy[sel].tolist(), piece.n[sel].tolist()))
                taken[k] |= sel
        return out

    def empty_masks(self) -> list[Mask]:
        self.compact()
        return [np.zeros(piece.cx.size, dtype=bool) for piece in self.window]

    def drop_window(self, taken: list[Mask]) -> None:
        """Forget the counts handed over (the masks of `export_window`)."""
        self.count_points()
        pieces = list(self.window)
        self.window.clear()
        for piece, gone in zip(pieces, taken, strict=True):
            self.window.append(piece.select(~gone) if gone.any() else piece)

    def receive_window(self, pieces: Iterable[ExportedPiece]) -> None:
        self.count_points()
        for bucket, age, cx, cy, n in pieces:
            self.window.append(WindowPiece(int(bucket), self.folds - int(age),
                                           np.asarray(cx, dtype=np.int32),
                                           np.asarray(cy, dtype=np.int32),
                                           np.asarray(n, dtype=np.int32)))

    def restore(self, p: Partition, exported: dict[str, Any]) -> None:
        """Statistics that came with a partition moved whole: they already count its
        subscriptions (in Q), so those are only registered here for a later deletion."""
        stats = self.stats[p.id] = PartitionStats.restore(p, self.folds, exported)
        for sid, _rect in self.queries_over(p):
            self.sub_parts.setdefault(sid, []).append((stats, stats.round - 1))
