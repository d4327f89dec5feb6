"""`geoswarm ingest --to archive`: valid rows written to the archive as the workers' flush writes
it (`app.archive.layout`, `app.archive.writer`), made visible in one step.

A file's `worker` is the run's name, `ingest-<run>`, or `ingest-<run>-<part>` for the parts of
a bucket over MAX_FILE_ROWS rows (a bucket's rows are cut into parts by a hash of the row, so
that the same rows land in the same part however often a task runs). Every file is committed
before one HSET sets the archive cut of each of those names to the run's greatest bucket: a run
that fails leaves nothing visible, one that finished is visible at once, and no file of a name
appears at or below its cut afterwards (which compaction relies on: it absorbs the files at or
below each name's cut).
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from functools import cache
from typing import Any

import numpy as np
import orjson
import pyarrow as pa
from pyspark.sql import DataFrame, Row, SparkSession
from pyspark.sql import functions as F
from pyspark.sql.functions import udtf

from app.archive.layout import ArchiveStore
from app.archive.writer import columns_table, write_table
from app.geo.grid import Grid
from app.pipeline import names

RUN_PREFIX = "ingest-"
MAX_FILE_ROWS = 500_000  # rows of one file (its writing task holds them all)
RECORD_COLUMNS = ("id", "moving", "lon", "lat", "ts", "keywords", "text", "props")
WRITTEN = "bucket long, part int, rows long, path string"


def worker_name(run: str, part: int) -> str:
    """The `worker` of a run's archive files: the archive cut entry that makes them visible."""
    return f"{RUN_PREFIX}{run}" if part == 0 else f"{RUN_PREFIX}{run}-{part}"


@dataclass(frozen=True)
class FileTarget:
    """Where and how a writing task writes (sent to the task as JSON)."""

    archive_url: str
    tenant: str
    run: str
    bucket_s: float
    bounds: tuple[float, float, float, float]
    grid: tuple[int, int]

    def to_json(self) -> str:
        return orjson.dumps(self.__dict__).decode()

    @staticmethod
    def from_json(raw: str) -> FileTarget:
        doc = orjson.loads(raw)
        return FileTarget(**{**doc, "bounds": tuple(doc["bounds"]), "grid": tuple(doc["grid"])})


def write_file(target: FileTarget, bucket: int, part: int, rows: dict[str, list[Any]]) -> str:
    """The archive file of one bucket and part (committed by a rename; kept if it is there
    already, from an attempt of the same task that failed after it)."""
    worker = worker_name(target.run, part)
    grid = Grid(bounds=target.bounds, nx=target.grid[0], ny=target.grid[1])
    table = columns_table(
        pa.array(rows["id"], pa.string()), np.asarray(rows["lon"], dtype=np.float64),
        np.asarray(rows["lat"], dtype=np.float64), np.asarray(rows["ts"], dtype=np.float64),
        np.asarray(rows["at"], dtype=np.float64), pa.array(rows["moving"], pa.bool_()),
        pa.array(rows["keywords"], pa.list_(pa.string())), pa.array(rows["text"], pa.string()),
        pa.array(rows["props"], pa.string()), bucket, worker, grid)
    store = ArchiveStore(target.archive_url)
    path = store.bucket_path(target.tenant, bucket, target.bucket_s, worker)
    write_table(store, path, table)
    return path


class _WriteFiles:
    """UDTF over rows partitioned by (bucket, part): one archive file per partition."""

    def __init__(self) -> None:
        self.conf = ""
        self.key: tuple[int, int] | None = None
        self.rows: dict[str, list[Any]] = {c: [] for c in (*RECORD_COLUMNS, "at")}

    def eval(self, row: Row, conf: str) -> None:
        self.conf = conf
        self.key = (int(row["bucket"]), int(row["part"]))
        for c, values in self.rows.items():
            values.append(row[c])

    def terminate(self) -> Iterator[tuple[Any, ...]]:
        if self.key is None:
            return
        bucket, part = self.key
        path = write_file(FileTarget.from_json(self.conf), bucket, part, self.rows)
        yield bucket, part, len(self.rows["id"]), path


@cache
def _write_udtf() -> Any:
    return udtf(_WriteFiles, returnType=WRITTEN, useArrow=False)


def transform_buckets(good: DataFrame, bucket_s: float,
                      arrival: tuple[int, float] | None = None) -> DataFrame:
    """Valid rows (RECORD_COLUMNS) with their archive bucket and arrival time `at`: by ts (a
    history load: as if each had arrived at its ts), or one given arrival (bucket, time)."""
    if arrival is None:
        return (good.withColumn("bucket", F.floor(F.col("ts") / F.lit(bucket_s)).cast("long"))
                .withColumn("at", F.col("ts")))
    bucket, at = arrival
    return good.withColumn("bucket", F.lit(bucket).cast("long")).withColumn("at", F.lit(at))


def transform_parts(df: DataFrame, parts: DataFrame | None) -> DataFrame:
    """Each row's part of its bucket: 0, or for the buckets of `parts` (bucket, parts) a hash of
    the row modulo their number of parts."""
    if parts is None:
        return df.withColumn("part", F.lit(0))
    # not an event's id: it is drawn anew when the rows are validated again
    spread = F.pmod(F.xxhash64("lon", "lat", "ts", "text",
                               F.when(F.col("moving"), F.col("id"))), F.col("parts")).cast("int")
    return (df.join(F.broadcast(parts), "bucket", "left")
            .withColumn("part", F.when(F.col("parts").isNull(), F.lit(0)).otherwise(spread))
            .drop("parts"))


def load_files(spark: SparkSession, bucketed: DataFrame, target: FileTarget, rows: int
               ) -> list[Row]:
    """Write the archive files of `rows` bucketed rows: one per bucket and part (WRITTEN)."""
    big = [] if rows <= MAX_FILE_ROWS else [
        (int(r["bucket"]), -(-int(r["count"]) // MAX_FILE_ROWS))
        for r in bucketed.groupBy("bucket").count()
        .filter(F.col("count") > MAX_FILE_ROWS).collect()]
    parts = spark.createDataFrame(big, "bucket long, parts int") if big else None
    table = transform_parts(bucketed, parts).asTable().partitionBy("bucket", "part")
    written: list[Row] = _write_udtf()(table, F.lit(target.to_json())).collect()
    return written


def raise_cut(client: Any, run: str, written: list[Row]) -> int:
    """Make a run's files visible: the cut of each of its names to its greatest bucket, in one
    HSET (each name's files are all at or below it)."""
    top = max(int(r["bucket"]) for r in written)
    parts = sorted({int(r["part"]) for r in written})
    client.hset(names.ARCHIVE_CUT, mapping={worker_name(run, p): top for p in parts})
    return top
