"""The C1 x C2 uniform grid over the space that underlies SWARM's global index (§4.1.1).

Point -> cell and bbox -> cell range share one floor formula, so borders are always consistent.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import numpy as np
import numpy.typing as npt

from app.geo.geometry import WORLD, BBox

IntArray = npt.NDArray[np.int32]
FloatArray = npt.NDArray[np.float64]


@dataclass(frozen=True)
class Grid:
    """A uniform grid of nx columns (longitude) by ny rows (latitude) over `bounds`."""

    bounds: BBox = WORLD
    nx: int = 1000
    ny: int = 1000

    def __post_init__(self) -> None:
        min_lon, min_lat, max_lon, max_lat = self.bounds
        if not (max_lon > min_lon and max_lat > min_lat):
            raise ValueError(f"empty grid bounds {self.bounds!r}")
        if self.nx < 1 or self.ny < 1:
            raise ValueError(f"grid needs at least one cell, got {self.nx}x{self.ny}")
        object.__setattr__(self, "bounds", tuple(float(v) for v in self.bounds))

    @property
    def n_cells(self) -> int:
        return self.nx * self.ny

    @property
    def cell_width(self) -> float:
        return (self.bounds[2] - self.bounds[0]) / self.nx

    @property
    def cell_height(self) -> float:
        return (self.bounds[3] - self.bounds[1]) / self.ny

    def _col(self, lon: FloatArray) -> IntArray:
        c = np.floor((lon - self.bounds[0]) / self.cell_width)
        return np.clip(c, 0, self.nx - 1).astype(np.int32)

    def _row(self, lat: FloatArray) -> IntArray:
        r = np.floor((lat - self.bounds[1]) / self.cell_height)
        return np.clip(r, 0, self.ny - 1).astype(np.int32)

    def cells_of(self, lon: npt.ArrayLike, lat: npt.ArrayLike) -> tuple[IntArray, IntArray]:
        """Column x and row y (int32) of each point; points outside the bounds clip to edges."""
        return (
            self._col(np.asarray(lon, dtype=np.float64)),
            self._row(np.asarray(lat, dtype=np.float64)),
        )

    def cell_of_point(self, lon: float, lat: float) -> int:
        """The cell id of one point, as `cells_of` and `cell_id` give it, without arrays (a
        single point's arrays cost more than the arithmetic)."""
        cx = min(max(math.floor((lon - self.bounds[0]) / self.cell_width), 0), self.nx - 1)
        cy = min(max(math.floor((lat - self.bounds[1]) / self.cell_height), 0), self.ny - 1)
        return int(cy * self.nx + cx)

    def cell_id(self, cx: Any, cy: Any) -> Any:
        """Row-major cell id: cy * nx + cx (works on ints and numpy arrays)."""
        return cy * self.nx + cx

    def cell_range(self, bbox: BBox) -> tuple[int, int, int, int]:
        """Inclusive (x0, y0, x1, y1) of the cells a bbox touches (same formula as cells_of).

        Scalar Python floats are IEEE doubles like numpy's, so `(v - min) / width` rounds
        exactly as in cells_of; plain floats only avoid numpy's per-call overhead.
        """
        min_lon, min_lat = self.bounds[0], self.bounds[1]
        w, h = self.cell_width, self.cell_height
        nx1, ny1 = self.nx - 1, self.ny - 1
        return (
            min(max(math.floor((bbox[0] - min_lon) / w), 0), nx1),
            min(max(math.floor((bbox[1] - min_lat) / h), 0), ny1),
            min(max(math.floor((bbox[2] - min_lon) / w), 0), nx1),
            min(max(math.floor((bbox[3] - min_lat) / h), 0), ny1),
        )

    def cell_ranges(self, bboxes: FloatArray) -> IntArray:
        """Vectorised cell_range over an (n, 4) array of bboxes -> (n, 4) int32 (x0,y0,x1,y1)."""
        b = np.asarray(bboxes, dtype=np.float64).reshape(-1, 4)
        out = np.empty((b.shape[0], 4), dtype=np.int32)
        out[:, 0] = self._col(b[:, 0])
        out[:, 1] = self._row(b[:, 1])
        out[:, 2] = self._col(b[:, 2])
        out[:, 3] = self._row(b[:, 3])
        return out

    def cell_bbox(self, x: int, y: int) -> BBox:
        """Nominal extent of cell (x, y) in degrees."""
        w, h = self.cell_width, self.cell_height
        return (
            self.bounds[0] + x * w,
            self.bounds[1] + y * h,
            self.bounds[0] + (x + 1) * w,
            self.bounds[1] + (y + 1) * h,
        )

    def to_dict(self) -> dict[str, Any]:
        return {"bounds": list(self.bounds), "nx": self.nx, "ny": self.ny}

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> Grid:
        b = d["bounds"]
        return cls(bounds=(float(b[0]), float(b[1]), float(b[2]), float(b[3])),
                   nx=int(d["nx"]), ny=int(d["ny"]))


def run_positions(starts: npt.NDArray[np.int64], lens: npt.NDArray[np.int64]
                  ) -> npt.NDArray[np.int64]:
    """Every position starts[i] .. starts[i] + lens[i] - 1 of every run, in order, in one
    array (lens >= 0), without a loop over the runs."""
    total = int(lens.sum())
    return np.repeat(starts - (np.cumsum(lens) - lens), lens) + np.arange(total, dtype=np.int64)
