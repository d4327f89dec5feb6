"""SWARM's global index (§4.1.1): grid cell -> partition map, initial layout, Algorithm 1.

Pure data + numpy; the api (router) and workers load a `Plan` and build a `GlobalIndex` from it.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import numpy.typing as npt

from app.geo.geometry import BBox, circle_bbox
from app.geo.grid import Grid

IntArray = npt.NDArray[np.int32]


@dataclass
class Partition:
    """An inclusive rectangle of grid cells [x0..x1] x [y0..y1] owned by one worker."""

    id: str
    x0: int
    y0: int
    x1: int
    y1: int
    worker: str
    parent: str | None = None
    prev_owner: str | None = None

    @property
    def width(self) -> int:
        return self.x1 - self.x0 + 1

    @property
    def height(self) -> int:
        return self.y1 - self.y0 + 1

    @property
    def area(self) -> int:
        """Number of cells in the partition."""
        return self.width * self.height

    @property
    def cells(self) -> list[tuple[int, int]]:
        """Every (x, y) cell of the partition, row by row."""
        return [(x, y) for y in range(self.y0, self.y1 + 1) for x in range(self.x0, self.x1 + 1)]

    def contains_cell(self, x: int, y: int) -> bool:
        return self.x0 <= x <= self.x1 and self.y0 <= y <= self.y1

    def contains_cells(self, cx: npt.ArrayLike, cy: npt.ArrayLike) -> npt.NDArray[np.bool_]:
        """Vectorised `contains_cell`."""
        x, y = np.asarray(cx), np.asarray(cy)
        return (x >= self.x0) & (x <= self.x1) & (y >= self.y0) & (y <= self.y1)

    def overlaps(self, x0: int, y0: int, x1: int, y1: int) -> bool:
        """Whether the inclusive cell rectangle shares a cell with the partition."""
        return self.x0 <= x1 and x0 <= self.x1 and self.y0 <= y1 and y0 <= self.y1

    def to_dict(self) -> dict[str, Any]:
        return {
            "id": self.id,
            "x0": self.x0,
            "y0": self.y0,
            "x1": self.x1,
            "y1": self.y1,
            "worker": self.worker,
            "parent": self.parent,
            "prev_owner": self.prev_owner,
        }

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> Partition:
        return cls(
            id=str(d["id"]),
            x0=int(d["x0"]),
            y0=int(d["y0"]),
            x1=int(d["x1"]),
            y1=int(d["y1"]),
            worker=str(d["worker"]),
            parent=d.get("parent"),
            prev_owner=d.get("prev_owner"),
        )


@dataclass
class Plan:
    """A versioned partitioning of the grid: what the coordinator publishes to routers."""

    version: int
    grid: Grid
    partitions: list[Partition] = field(default_factory=list)
    members: list[str] = field(default_factory=list)
    """Every worker of the cluster, also those that own no partition right now: they still
    hold kNN and keyword subscriptions and, as parents, data of partitions they gave away."""

    def validate(self) -> None:
        """Raise ValueError unless the partitions tile the grid exactly (no gap, no overlap)."""
        ids = [p.id for p in self.partitions]
        if len(set(ids)) != len(ids):
            raise ValueError("duplicate partition ids")
        if not self.partitions:
            raise ValueError("plan has no partitions")
        cover = np.zeros((self.grid.ny, self.grid.nx), dtype=np.int32)
        for p in self.partitions:
            if not (0 <= p.x0 <= p.x1 < self.grid.nx and 0 <= p.y0 <= p.y1 < self.grid.ny):
                raise ValueError(f"partition {p.id} outside the grid or empty: {p!r}")
            if not p.worker:
                raise ValueError(f"partition {p.id} has no worker")
            cover[p.y0 : p.y1 + 1, p.x0 : p.x1 + 1] += 1
        if (cover != 1).any():
            gaps = int((cover == 0).sum())
            overlaps = int((cover > 1).sum())
            raise ValueError(f"partitions do not tile the grid: {gaps} gaps, {overlaps} overlaps")

    def ownership(self) -> str:
        """A digest of which worker owns each cell of the grid: equal for two plans that
        differ only in how each worker's cells are cut into partitions (a merge), different
        once a cell changed workers (a move, a split handed off, a failover)."""
        workers = sorted({p.worker for p in self.partitions})
        of = {w: i for i, w in enumerate(workers)}
        owner = np.zeros((self.grid.ny, self.grid.nx), dtype=np.int32)
        for p in self.partitions:
            owner[p.y0 : p.y1 + 1, p.x0 : p.x1 + 1] = of[p.worker]
        digest = hashlib.blake2b(json.dumps(workers).encode(), digest_size=16)
        digest.update(owner.tobytes())
        return digest.hexdigest()

    def to_dict(self) -> dict[str, Any]:
        return {
            "version": self.version,
            "grid": self.grid.to_dict(),
            "partitions": [p.to_dict() for p in self.partitions],
            "members": list(self.members),
        }

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), sort_keys=True, separators=(",", ":"))

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> Plan:
        return cls(
            version=int(d["version"]),
            grid=Grid.from_dict(d["grid"]),
            partitions=[Partition.from_dict(p) for p in d["partitions"]],
            members=[str(w) for w in d.get("members", [])],
        )

    @classmethod
    def from_json(cls, s: str | bytes) -> Plan:
        return cls.from_dict(json.loads(s))


def split_rect(
    x0: int, y0: int, x1: int, y1: int
) -> tuple[tuple[int, int, int, int], tuple[int, int, int, int]]:
    """Halve a cell rectangle across its longer side (columns on a tie)."""
    w, h = x1 - x0 + 1, y1 - y0 + 1
    if w >= h:
        if w < 2:
            raise ValueError("cannot split a single cell")
        m = x0 + w // 2 - 1
        return (x0, y0, m, y1), (m + 1, y0, x1, y1)
    m = y0 + h // 2 - 1
    return (x0, y0, x1, m), (x0, m + 1, x1, y1)


def check_workers(grid: Grid, workers: list[str]) -> None:
    """Raise ValueError unless `workers` can each get a partition of `grid`."""
    if not workers:
        raise ValueError("need at least one worker")
    if len(set(workers)) != len(workers):
        raise ValueError("duplicate worker names")
    if len(workers) > grid.n_cells:
        raise ValueError("more workers than grid cells")


def initial_plan(grid: Grid, workers: list[str], version: int = 1) -> Plan:
    """SWARM §4.1.1 initial layout: halve the largest partition until each worker has one."""
    check_workers(grid, workers)
    rects: list[tuple[int, int, int, int]] = [(0, 0, grid.nx - 1, grid.ny - 1)]
    while len(rects) < len(workers):
        areas = [(r[2] - r[0] + 1) * (r[3] - r[1] + 1) for r in rects]
        i = int(np.argmax(areas))  # first largest: deterministic
        a, b = split_rect(*rects[i])
        rects[i : i + 1] = [a, b]
    parts = [
        Partition(id=f"p{i}", x0=r[0], y0=r[1], x1=r[2], y1=r[3], worker=w)
        for i, (r, w) in enumerate(zip(rects, workers, strict=True))
    ]
    plan = Plan(version=version, grid=grid, partitions=parts, members=list(workers))
    plan.validate()
    return plan


class GlobalIndex:
    """Routing view of a plan: O(1) point lookup and Algorithm 1 range overlap.

    `cell_part[y, x]` is the index into `plan.partitions` of the partition owning cell (x, y)
    (shape (ny, nx), so `cell_part.ravel()[grid.cell_id(x, y)]` works too).
    """

    def __init__(self, plan: Plan) -> None:
        plan.validate()
        self.plan = plan
        self.grid = plan.grid
        self.partitions = plan.partitions
        self.cell_part: IntArray = np.full((self.grid.ny, self.grid.nx), -1, dtype=np.int32)
        for i, p in enumerate(self.partitions):
            self.cell_part[p.y0 : p.y1 + 1, p.x0 : p.x1 + 1] = i
        # Members first (stable indices), then any owner the member list lacks.
        self.workers: list[str] = list(dict.fromkeys(
            [*plan.members, *(p.worker for p in self.partitions)]))
        widx = {w: i for i, w in enumerate(self.workers)}
        self.part_worker: IntArray = np.array(
            [widx[p.worker] for p in self.partitions], dtype=np.int32
        )
        self.part_index: dict[str, int] = {p.id: i for i, p in enumerate(self.partitions)}
        # Plain lists: Algorithm 1 is scalar code, and list indexing beats numpy scalars.
        self._x1 = [p.x1 for p in self.partitions]
        self._y1 = [p.y1 for p in self.partitions]
        self._x0 = [p.x0 for p in self.partitions]
        self._rows: list[list[int]] = self.cell_part.tolist()

    @property
    def version(self) -> int:
        return self.plan.version

    def partition_of_points(self, lon: npt.ArrayLike, lat: npt.ArrayLike) -> IntArray:
        """Partition index of each point (vectorised, O(1) per point)."""
        cx, cy = self.grid.cells_of(lon, lat)
        return self.cell_part[cy, cx]

    def worker_of_points(self, lon: npt.ArrayLike, lat: npt.ArrayLike) -> IntArray:
        """Index into `self.workers` of the worker owning each point."""
        return self.part_worker[self.partition_of_points(lon, lat)]

    def worker_of_point(self, lon: float, lat: float) -> str:
        """The worker owning one point, as `worker_of_points` finds it, without arrays (one
        point's arrays cost more than the lookup: 20-50 us of a knn query's api time)."""
        cell = self.grid.cell_of_point(lon, lat)
        return self.partitions[self._rows[cell // self.grid.nx][cell % self.grid.nx]].worker

    def query_overlap(self, x0: int, y0: int, x1: int, y1: int) -> list[int]:
        """Partitions overlapping the inclusive cell rectangle (SWARM Algorithm 1).

        Walk row y0 left to right, jumping from each partition found to the cell right of its
        right border. A partition not on row y0 starts right below the bottom border of one
        already found, so later rows are only probed under found partitions' bottom borders,
        over those partitions' columns. Work grows with partitions touched, not with cells.
        The paper's stack variant drops a popped cell whose partition is already in the result
        and can then miss partitions; this formulation does not (see tests).
        """
        x0, y0 = max(x0, 0), max(y0, 0)
        x1, y1 = min(x1, self.grid.nx - 1), min(y1, self.grid.ny - 1)
        if x0 > x1 or y0 > y1:
            return []
        rows, px0, px1, py1 = self._rows, self._x0, self._x1, self._y1
        found: dict[int, None] = {}
        # Segments still to scan: (row, first column, last column).
        todo: list[tuple[int, int, int]] = [(y0, x0, x1)]
        while todo:
            y, xa, xb = todo.pop()
            row = rows[y]
            x = xa
            while x <= xb:
                p = row[x]
                if p not in found:
                    found[p] = None
                    below = py1[p] + 1
                    if below <= y1:
                        todo.append((below, max(px0[p], x0), min(px1[p], x1)))
                x = px1[p] + 1
        return list(found)

    def cell_range_of_bbox(self, bbox: BBox) -> tuple[int, int, int, int]:
        return self.grid.cell_range(bbox)

    def partitions_for_bbox(self, bbox: BBox) -> list[int]:
        return self.query_overlap(*self.grid.cell_range(bbox))

    def partitions_for_circle(self, lon: float, lat: float, radius_m: float) -> list[int]:
        return self.partitions_for_bbox(circle_bbox(lon, lat, radius_m))

    def workers_for_bbox(self, bbox: BBox) -> set[str]:
        return {self.partitions[i].worker for i in self.partitions_for_bbox(bbox)}

    def workers_for_circle(self, lon: float, lat: float, radius_m: float) -> set[str]:
        return {self.partitions[i].worker for i in self.partitions_for_circle(lon, lat, radius_m)}
