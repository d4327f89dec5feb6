"""Where the archive keeps what, and the columns of its Parquet files.

`archive_url` (a local path by default, or any URI pyarrow's filesystems open: `file://`,
`s3://`, `gs://`, `hdfs://`) holds one file per tenant, arrival bucket and worker that stored
the records:

    <root>/records/<tenant>/<YYYY-MM-DD>/b<bucket>-<worker>.parquet

laid out by tenant and time; within a file the rows are sorted along a Z-order curve over the
global grid's cells, so that Parquet's row-group statistics (min/max of lon, lat and `z`)
prune by space as well as by time. Each file carries its records' number per global grid cell
in its key-value metadata (`geoswarm.cells`): the archive's count grid (AQWA §4.2) is the sum
of its files' without reading a row.

`geoswarm archive compact` (AQWA, `spark.compact`) rewrites a tenant's records into
query-aware k-d partitions of the global grid's cells:

    <root>/compact/<tenant>/v<N>/...parquet      the partitions' files
    <root>/compact/<tenant>/v<N>/_manifest.json  the layout (`Manifest`)
    <root>/compact/<tenant>/CURRENT              "v<N>": the layout queries read

A manifest lists each partition's cell rectangle and files, and `absorbed`: per worker, the
last bucket whose files it holds. Queries read the current manifest's partitions that overlap
their region and the bucket files it has not absorbed; replacing CURRENT (a rename) switches
every later query to the new layout at once, and the files of the old one stay for a grace
period for the queries that started before.

A file's name is a function of (tenant, bucket, worker): writing a bucket again after a crash
writes the same file, and a file is written under a temporary name and renamed into place,
so a reader sees it whole or not at all. Which buckets a query may read is the archive cut
(`names.ARCHIVE_CUT`): per worker, the last bucket whose files are all committed. A worker
raises its cut only after the files, and drops the records from memory only after its cut
passed them: a record is in memory, or in a committed file below the cut, or both for a
while, and a query reading both sides takes each bucket from one side only (the cut it read).
"""

from __future__ import annotations

import datetime as dt
import secrets
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import quote, unquote

import numpy as np
import orjson
import pyarrow as pa
import pyarrow.fs as pafs

NO_CUT = -(1 << 62)  # the cut of a worker that archived nothing yet
RECORDS = "records"
COMPACT = "compact"
CURRENT = "CURRENT"
MANIFEST = "_manifest.json"
CELLS_META = b"geoswarm.cells"
ROW_GROUP_ROWS = 16_384  # small row groups: their min/max prune finely

SCHEMA = pa.schema([
    pa.field("id", pa.string(), nullable=False),
    pa.field("lon", pa.float64(), nullable=False),
    pa.field("lat", pa.float64(), nullable=False),
    pa.field("ts", pa.float64(), nullable=False),
    pa.field("at", pa.float64(), nullable=False),  # when the api accepted it
    pa.field("moving", pa.bool_(), nullable=False),
    pa.field("keywords", pa.list_(pa.string()), nullable=False),
    pa.field("text", pa.string()),
    pa.field("props", pa.string()),  # JSON
    pa.field("cell", pa.int64(), nullable=False),  # global grid cell id
    pa.field("z", pa.int64(), nullable=False),  # Z-order of the cell
    pa.field("bucket", pa.int64(), nullable=False),  # arrival bucket
    pa.field("worker", pa.string(), nullable=False),  # the worker that stored it
])


def _spread(v: Any) -> Any:
    """The bits of 16-bit integers spread to the even positions (for Z-order)."""
    v = v.astype(np.uint64) & np.uint64(0xFFFF)
    v = (v | (v << np.uint64(8))) & np.uint64(0x00FF00FF)
    v = (v | (v << np.uint64(4))) & np.uint64(0x0F0F0F0F)
    v = (v | (v << np.uint64(2))) & np.uint64(0x33333333)
    return (v | (v << np.uint64(1))) & np.uint64(0x55555555)


def z_order(cx: Any, cy: Any) -> Any:
    """The Z-order (Morton) key of grid cells (x, y), x in the even bits: a curve through
    the grid that keeps nearby cells near in the order."""
    return (_spread(np.asarray(cx)) | (_spread(np.asarray(cy)) << np.uint64(1))).astype(np.int64)


@dataclass(frozen=True)
class BucketFile:
    """A committed file of records of one tenant, arrival bucket and worker."""

    path: str
    tenant: str
    bucket: int
    worker: str
    size: int


@dataclass
class Partition:
    """A k-d partition of a compacted layout: its cells (x0, y0, x1, y1, inclusive), files,
    records, bytes, and the (faded) number of logged queries overlapping it when it was laid
    out (AQWA's Oq(p))."""

    rect: tuple[int, int, int, int]
    files: list[str]
    records: int
    bytes: int = 0
    queries: float = 0.0

    def overlaps(self, cells: tuple[int, int, int, int] | None) -> bool:
        if cells is None:
            return True
        x0, y0, x1, y1 = self.rect
        return not (cells[2] < x0 or cells[0] > x1 or cells[3] < y0 or cells[1] > y1)


@dataclass
class Manifest:
    """A compacted layout of one tenant's archive (see the module docstring)."""

    version: int
    created: float
    grid: tuple[int, int]  # the global grid's nx, ny the rectangles are cells of
    partitions: list[Partition]
    absorbed: dict[str, int] = field(default_factory=dict)
    cells: str | None = None  # the count grid (.npy of (ny, nx) int64), path in the store

    def to_json(self) -> bytes:
        return orjson.dumps({
            "version": self.version, "created": self.created, "grid": list(self.grid),
            "absorbed": self.absorbed, "cells": self.cells,
            "partitions": [{"rect": list(p.rect), "files": p.files, "records": p.records,
                            "bytes": p.bytes, "queries": p.queries}
                           for p in self.partitions]})

    @staticmethod
    def from_json(raw: bytes) -> Manifest:
        doc = orjson.loads(raw)
        return Manifest(
            version=int(doc["version"]), created=float(doc["created"]),
            grid=(int(doc["grid"][0]), int(doc["grid"][1])),
            partitions=[Partition(rect=(int(p["rect"][0]), int(p["rect"][1]),
                                        int(p["rect"][2]), int(p["rect"][3])),
                                  files=list(p["files"]), records=int(p["records"]),
                                  bytes=int(p.get("bytes", 0)),
                                  queries=float(p.get("queries", 0.0)))
                        for p in doc["partitions"]],
            absorbed={str(k): int(v) for k, v in doc.get("absorbed", {}).items()},
            cells=doc.get("cells"))

    def covers(self, f: BucketFile) -> bool:
        return f.bucket <= self.absorbed.get(f.worker, NO_CUT)

    def kept(self) -> set[str]:
        """The files this layout reads, wherever an older layout wrote them, with the checksum
        file Hadoop's local filesystem writes beside each (`.<name>.crc`) and opens with it:
        deleting that under a running query fails the query's read."""
        out: set[str] = set()
        for p in self.partitions:
            for path in p.files:
                parent, _, name = path.rpartition("/")
                out.update((path, f"{parent}/.{name}.crc"))
        return out


class ArchiveStore:
    """The archive's filesystem and its paths (a local directory or any pyarrow URI)."""

    def __init__(self, url: str) -> None:
        self.url = url
        if "://" in url:
            self.fs, self.root = pafs.FileSystem.from_uri(url)
        else:
            self.fs, self.root = pafs.LocalFileSystem(), url
        self.root = self.root.rstrip("/")

    def uri(self, path: str) -> str:
        """A path of this store as Spark reads it."""
        if isinstance(self.fs, pafs.LocalFileSystem):
            return "file://" + path
        scheme = self.url.split("://", 1)[0]
        return f"{scheme}://{path}"

    def tenant_dir(self, tenant: str) -> str:
        return f"{self.root}/{RECORDS}/{quote(tenant, safe='')}"

    def bucket_path(self, tenant: str, bucket: int, bucket_s: float, worker: str) -> str:
        day = dt.datetime.fromtimestamp(bucket * bucket_s, dt.UTC).strftime("%Y-%m-%d")
        return f"{self.tenant_dir(tenant)}/{day}/b{bucket}-{quote(worker, safe='')}.parquet"

    def compact_dir(self, tenant: str) -> str:
        return f"{self.root}/{COMPACT}/{quote(tenant, safe='')}"

    def version_dir(self, tenant: str, version: int) -> str:
        return f"{self.compact_dir(tenant)}/v{version}"

    def read_bytes(self, path: str) -> bytes | None:
        try:
            with self.fs.open_input_stream(path) as f:
                return bytes(f.read())
        except FileNotFoundError:
            return None

    def write_bytes(self, path: str, data: bytes) -> None:
        """Write a small file whole: a temporary file renamed into place."""
        parent = path.rsplit("/", 1)[0]
        self.fs.create_dir(parent, recursive=True)
        tmp = f"{parent}/.tmp-{secrets.token_hex(8)}"
        with self.fs.open_output_stream(tmp) as out:
            out.write(data)
        self.fs.move(tmp, path)

    def current_version(self, tenant: str) -> int | None:
        raw = self.read_bytes(f"{self.compact_dir(tenant)}/{CURRENT}")
        if raw is None:
            return None
        text = raw.decode().strip()
        return int(text[1:]) if text.startswith("v") and text[1:].isdigit() else None

    def manifest(self, tenant: str, version: int | None = None) -> Manifest | None:
        """The tenant's current compacted layout (or a given version), or None."""
        if version is None:
            version = self.current_version(tenant)
            if version is None:
                return None
        raw = self.read_bytes(f"{self.version_dir(tenant, version)}/{MANIFEST}")
        return None if raw is None else Manifest.from_json(raw)

    def switch(self, tenant: str, manifest: Manifest) -> None:
        """Write a layout's manifest and make it the current one (the rename of CURRENT is the
        moment every later query reads it)."""
        self.write_bytes(f"{self.version_dir(tenant, manifest.version)}/{MANIFEST}",
                         manifest.to_json())
        self.write_bytes(f"{self.compact_dir(tenant)}/{CURRENT}", f"v{manifest.version}".encode())

    def tenants(self) -> list[str]:
        """Tenants with bucket files or a compacted layout."""
        found: set[str] = set()
        for kind in (RECORDS, COMPACT):
            sel = pafs.FileSelector(f"{self.root}/{kind}", allow_not_found=True)
            found |= {unquote(i.base_name) for i in self.fs.get_file_info(sel)
                      if i.type == pafs.FileType.Directory}
        return sorted(found)

    def bucket_files(self, tenant: str) -> list[BucketFile]:
        """The committed bucket files of a tenant (temporary files are not listed)."""
        sel = pafs.FileSelector(self.tenant_dir(tenant), recursive=True, allow_not_found=True)
        out = []
        for info in self.fs.get_file_info(sel):
            name = info.base_name
            if info.type != pafs.FileType.File or not name.endswith(".parquet") or \
                    not name.startswith("b"):
                continue
            bucket, _, worker = name[1:-len(".parquet")].partition("-")
            if not bucket.lstrip("-").isdigit() or not worker:
                continue
            out.append(BucketFile(info.path, tenant, int(bucket), unquote(worker),
                                  info.size or 0))
        return sorted(out, key=lambda f: (f.bucket, f.worker))


def decode_cut(raw: dict[Any, Any]) -> dict[str, int]:
    """The archive cut as read from its Redis hash (worker -> last archived bucket)."""
    return {(k.decode() if isinstance(k, bytes) else str(k)): int(v) for k, v in raw.items()}


def visible(files: list[BucketFile], cut: dict[str, int]) -> list[BucketFile]:
    """The bucket files a query may read: those of buckets at or below their worker's cut."""
    return [f for f in files if f.bucket <= cut.get(f.worker, NO_CUT)]


@dataclass
class Layout:
    """What one query reads of a tenant's archive: the current compacted layout (if any) and
    the visible bucket files it has not absorbed."""

    manifest: Manifest | None
    buckets: list[BucketFile]

    def paths(self, cells: tuple[int, int, int, int] | None = None) -> list[str]:
        """The files holding the records in these cells (all with None)."""
        out = [f.path for f in self.buckets]
        if self.manifest is not None:
            out += [path for p in self.manifest.partitions if p.overlaps(cells)
                    for path in p.files]
        return out


def read_layout(store: ArchiveStore, tenant: str, cut: dict[str, int]) -> Layout:
    """The layout a query reads: the manifest first, then the bucket files (so that a switch
    in between leaves this query on the old layout, whose files stay for a grace period)."""
    manifest = store.manifest(tenant)
    files = visible(store.bucket_files(tenant), cut)
    if manifest is not None:
        files = [f for f in files if not manifest.covers(f)]
    return Layout(manifest, files)
