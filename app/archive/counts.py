"""The archive's count grid (AQWA §4.2.1): records per global grid cell, from a compacted
layout's saved grid and the per-cell counts each bucket file carries in its metadata."""

from __future__ import annotations

import numpy as np
import orjson
import pyarrow.parquet as pq

from app.archive.layout import CELLS_META, ArchiveStore, Manifest
from app.geo.aqwa import CountGrid
from app.geo.grid import Grid


def file_cells(store: ArchiveStore, path: str) -> dict[int, int]:
    """A bucket file's records per cell, read from its footer (no row is read)."""
    meta = pq.read_schema(path, filesystem=store.fs).metadata or {}
    return {int(c): int(n) for c, n in orjson.loads(meta.get(CELLS_META, b"{}")).items()}


def add_cells(counts: CountGrid, cells: dict[int, int]) -> None:
    if cells:
        counts.add(np.fromiter(cells.keys(), dtype=np.int64, count=len(cells)),
                   np.fromiter(cells.values(), dtype=np.int64, count=len(cells)))


def layout_counts(store: ArchiveStore, manifest: Manifest | None, grid: Grid) -> CountGrid:
    """The count grid of a compacted layout (empty without one)."""
    if manifest is None or manifest.cells is None:
        return CountGrid(grid.nx, grid.ny)
    with store.fs.open_input_file(manifest.cells) as f:
        return CountGrid.from_array(np.load(f))
