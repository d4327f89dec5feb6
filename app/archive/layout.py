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
from dataclasses import dataclass
from typing import Any
from urllib.parse import quote, unquote

import numpy as np
import pyarrow as pa
import pyarrow.fs as pafs

RECORDS = "records"
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

    def tenants(self) -> list[str]:
        base = f"{self.root}/{RECORDS}"
        info = self.fs.get_file_info(pafs.FileSelector(base, allow_not_found=True))
        return sorted(unquote(i.base_name) for i in info if i.type == pafs.FileType.Directory)

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


def visible(files: list[BucketFile], cut: dict[str, int]) -> list[BucketFile]:
    """The files a query reads: those of buckets at or below their worker's cut."""
    return [f for f in files if f.bucket <= cut.get(f.worker, -(1 << 62))]
