"""Writing one bucket of one tenant's records to the archive (the workers' flush, and the
bulk load of `geoswarm ingest --to archive`), committed by a rename (see `layout`)."""

from __future__ import annotations

import secrets
from collections.abc import Sequence
from typing import Any

import numpy as np
import orjson
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.fs as pafs
import pyarrow.parquet as pq

from app.archive.layout import CELLS_META, ROW_GROUP_ROWS, SCHEMA, ArchiveStore, z_order
from app.geo.grid import Grid
from app.pipeline.records import props_text
from app.pipeline.wire import ObjectBatch


def records_table(batches: Sequence[tuple[ObjectBatch, Any]], bucket: int, worker: str,
                  grid: Grid) -> pa.Table:
    """The rows of `batches` (each with its records' arrival times), sorted along the Z-order
    curve (then by id and ts: the same rows give the same file)."""
    ids: list[str] = []
    kws: list[list[str]] = []
    text: list[str | None] = []
    props: list[str | None] = []
    moving: list[bool] = []
    lon, lat, ts, at = [], [], [], []
    for batch, arrived in batches:
        ids += batch.ids
        kws += batch.keywords
        text += batch.text
        props += map(props_text, batch.props)
        moving += batch.moving
        lon.append(np.asarray(batch.lon, dtype=np.float64))
        lat.append(np.asarray(batch.lat, dtype=np.float64))
        ts.append(np.asarray(batch.ts, dtype=np.float64))
        at.append(np.asarray(arrived, dtype=np.float64))
    return columns_table(
        pa.array(ids, pa.string()), np.concatenate(lon) if lon else np.empty(0),
        np.concatenate(lat) if lat else np.empty(0), np.concatenate(ts) if ts else np.empty(0),
        np.concatenate(at) if at else np.empty(0), pa.array(moving, pa.bool_()),
        pa.array(kws, pa.list_(pa.string())), pa.array(text, pa.string()),
        pa.array(props, pa.string()), bucket, worker, grid)


def columns_table(ids: pa.Array, lon: Any, lat: Any, ts: Any, at: Any, moving: pa.Array,
                  keywords: pa.Array, text: pa.Array, props: pa.Array, bucket: int,
                  worker: str, grid: Grid) -> pa.Table:
    """The archive's table of records given as columns (props as JSON text), with their
    cells and Z-order keys, sorted along the curve (then by id, ts and arrival)."""
    lon_a = np.asarray(lon, dtype=np.float64)
    lat_a = np.asarray(lat, dtype=np.float64)
    cx, cy = grid.cells_of(lon_a, lat_a)
    n = lon_a.size
    table = pa.table({
        "id": ids, "lon": lon_a, "lat": lat_a, "ts": np.asarray(ts, dtype=np.float64),
        "at": np.asarray(at, dtype=np.float64), "moving": moving, "keywords": keywords,
        "text": text, "props": props,
        "cell": grid.cell_id(cx.astype(np.int64), cy.astype(np.int64)),
        "z": z_order(cx, cy),
        "bucket": np.full(n, bucket, dtype=np.int64),
        "worker": pa.array([worker] * n, pa.string()),
    }, schema=SCHEMA)
    order = pc.sort_indices(table, sort_keys=[("z", "ascending"), ("id", "ascending"),
                                              ("ts", "ascending"), ("at", "ascending")])
    return table.take(order)


def cell_counts(table: pa.Table) -> dict[int, int]:
    """The table's rows per global grid cell."""
    cells, counts = np.unique(table.column("cell").to_numpy(), return_counts=True)
    return dict(zip(cells.tolist(), counts.tolist(), strict=True))


def write_table(store: ArchiveStore, path: str, table: pa.Table) -> bool:
    """Write `table` to `path` unless a file is there already (the same bucket, committed
    before a crash): into a temporary file, then renamed into place. True if written."""
    fs = store.fs
    if fs.get_file_info(path).type == pafs.FileType.File:
        return False
    parent = path.rsplit("/", 1)[0]
    fs.create_dir(parent, recursive=True)
    tmp = f"{parent}/.tmp-{secrets.token_hex(8)}-{path.rsplit('/', 1)[1]}"
    meta = {CELLS_META: orjson.dumps({str(c): n for c, n in cell_counts(table).items()})}
    table = table.replace_schema_metadata({**(table.schema.metadata or {}), **meta})
    try:
        with fs.open_output_stream(tmp) as out:
            pq.write_table(table, out, row_group_size=ROW_GROUP_ROWS, compression="zstd",
                           write_statistics=True)
        fs.move(tmp, path)
    except BaseException:
        try:
            fs.delete_file(tmp)
        except OSError:
            pass
        raise
    return True


def write_bucket(store: ArchiveStore, tenant: str, bucket: int, bucket_s: float, worker: str,
                 batches: Sequence[tuple[ObjectBatch, Any]], grid: Grid) -> str | None:
    """Archive the records of one tenant's bucket held by `worker`; the file's path, or None
    when there were no records."""
    table = records_table(batches, bucket, worker, grid)
    if not table.num_rows:
        return None
    path = store.bucket_path(tenant, bucket, bucket_s, worker)
    write_table(store, path, table)
    return path
