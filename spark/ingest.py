"""`geoswarm ingest`: load objects from CSV, JSON lines or Parquet (local paths or any URI Spark
reads) into a running system, every row validated as `POST /v1/objects` validates it.

`main()` finds the system from the environment (its Redis: GEOSWARM_REDIS_URL, or the embedded
one a `geoswarm dev` runs under GEOSWARM_DATA_DIR), then per run: extract (Spark's readers, a
row's file kept) -> `transform_validate` (`spark.ingest_rows`) -> the rejects folder, and the
valid rows to the archive (`spark.ingest_archive`, a bulk history load) or to the live pipeline
(`spark.ingest_live`). Counts go to stderr every PROGRESS_S; the last line on stdout is
`read N, accepted A, rejected R`.

`--watch DIR` runs the same on each micro-batch of a Structured Streaming file source over DIR
(availableNow runs one after another on one checkpoint, so that SIGINT/SIGTERM stop it between
micro-batches). Beside Spark's checkpoint, the watch records per micro-batch its time, its
archive bucket (one arrival bucket after the last one it used, chosen before any file is
written) and the rows it published, so that a micro-batch Spark runs again after a crash writes
the same files, or publishes only what it had not.
"""

from __future__ import annotations

import glob
import hashlib
import math
import os
import secrets
import signal
import sys
import threading
import time
from dataclasses import dataclass, field
from functools import reduce
from pathlib import Path
from typing import Any

import orjson
import redis
from pydantic import TypeAdapter, ValidationError
from pyspark.sql import DataFrame, Row, SparkSession
from pyspark.sql import functions as F

from app.archive.layout import ArchiveStore
from app.core.config import Settings
from app.schemas import TenantName
from spark.ingest_archive import (
    RECORD_COLUMNS,
    FileTarget,
    load_files,
    raise_cut,
    transform_buckets,
    worker_name,
)
from spark.ingest_live import LIVE_BATCH, LivePublisher, NoPlan, record_batch
from spark.ingest_rows import API_COLUMNS, FILE_COLUMN, RowRules, progress_key, transform_validate

FORMATS = {".csv": "csv", ".json": "json", ".jsonl": "json", ".ndjson": "json",
           ".parquet": "parquet"}
PROGRESS_S = 3.0
WATCH_POLL_S = 1.0
WATCH_MAX_FILES = 100  # files per micro-batch
REJECTS = "original map<string,string>, reason string, file string"


class IngestError(Exception):
    """A run that cannot start or go on; the message says why, `code` is the exit code."""

    def __init__(self, message: str, code: int = 2) -> None:
        super().__init__(message)
        self.code = code


@dataclass(frozen=True)
class Options:
    paths: list[str]
    tenant: str
    to: str  # archive | live
    fmt: str | None = None
    mapping: dict[str, str] = field(default_factory=dict)  # API field -> source column
    rejects: str | None = None
    watch: str | None = None


@dataclass
class Counts:
    read: int = 0
    accepted: int = 0
    rejected: int = 0

    def __add__(self, other: Counts) -> Counts:
        return Counts(self.read + other.read, self.accepted + other.accepted,
                      self.rejected + other.rejected)

    def __str__(self) -> str:
        return f"read {self.read}, accepted {self.accepted}, rejected {self.rejected}"


def say(text: str) -> None:
    print(text, file=sys.stderr, flush=True)


# --- the command line's inputs ------------------------------------------------------------

def parse_mapping(items: list[str]) -> dict[str, str]:
    """--map API_NAME=SOURCE_COLUMN, repeated."""
    out: dict[str, str] = {}
    for item in items:
        api, sep, src = item.partition("=")
        if not sep or not src or api not in API_COLUMNS:
            raise IngestError(f"--map {item!r}: expected API_NAME=SOURCE_COLUMN, API_NAME one "
                              f"of {', '.join(API_COLUMNS)}")
        out[api] = src
    return out


def check_tenant(tenant: str) -> None:
    try:
        TypeAdapter(TenantName).validate_python(tenant)
    except ValidationError as exc:
        msg = exc.errors(include_url=False)[0]["msg"]
        raise IngestError(f"invalid tenant {tenant!r}: {msg}") from None


def local_path(path: str) -> str | None:
    """The local path of a path or file:// URI (None for other URIs)."""
    if path.startswith("file://"):
        return path[len("file://"):]
    return None if "://" in path else path


def check_exists(path: str) -> None:
    """Refuse a local path (or glob) that matches nothing; other URIs are Spark's to check."""
    local = local_path(path)
    if local is not None and not glob.glob(local):
        raise IngestError(f"no such file or directory: {path}")


def spark_path(path: str) -> str:
    local = local_path(path)
    return path if local is None else str(Path(local).resolve())


def format_of(path: str, given: str | None) -> str:
    """The format of a path: --format, else its extension (a directory's: its files')."""
    if given:
        return given
    local = local_path(path)
    candidates = [path]
    if local is not None and os.path.isdir(local):
        candidates = sorted(p for p in os.listdir(local) if not p.startswith((".", "_")))
    for p in candidates:
        fmt = FORMATS.get(os.path.splitext(p.rstrip("/"))[1].lower())
        if fmt:
            return fmt
    raise IngestError(f"cannot tell the format of {path}: give --format csv|json|parquet")


def find_system(settings: Settings) -> str:
    """The Redis of the running system this environment names: GEOSWARM_REDIS_URL, or the
    embedded server a `geoswarm dev` of GEOSWARM_DATA_DIR runs (never a new one)."""
    from app.core.redis import running_embedded_url, sync_client

    if settings.redis_url:
        client = sync_client(settings.redis_url, socket_timeout=5)
        try:
            client.ping()
        except (redis.RedisError, OSError) as exc:
            raise IngestError(f"the system's Redis (GEOSWARM_REDIS_URL) does not answer: {exc}",
                              code=1) from None
        finally:
            client.close()
        return settings.redis_url
    url = running_embedded_url(settings)
    if url is None:
        raise IngestError(
            "no running geoswarm found: GEOSWARM_REDIS_URL is unset and no embedded Redis runs "
            f"under {settings.data_dir.resolve() / 'redis'}; start `geoswarm dev`, or run ingest "
            "with the environment of the running system (GEOSWARM_DATA_DIR, or "
            "GEOSWARM_REDIS_URL)", code=1)
    return url


# --- extract and the rejects --------------------------------------------------------------

def reader_options(fmt: str) -> dict[str, str]:
    # CSV as RFC 4180 (a quote inside a quoted cell is doubled), every column text: what a cell
    # means is for the API's rules to say, not Spark's inference; files whose headers differ
    # from the first one's are refused rather than read by position
    if fmt == "csv":
        return {"header": "true", "inferSchema": "false", "escape": '"', "enforceSchema": "false"}
    return {}


def extract(spark: SparkSession, path: str, fmt: str) -> DataFrame:
    """One path's rows, each with its file: CSV columns as text, Parquet's typed, JSON lines as
    lines (`value`)."""
    reader = spark.read.options(**reader_options(fmt))
    if fmt == "csv":
        df = reader.csv(path)
    elif fmt == "parquet":
        df = reader.parquet(path)
    else:
        df = reader.text(path)
    return df.withColumn(FILE_COLUMN, F.col("_metadata.file_path"))


def source_columns(fmt: str, columns: list[str], mapping: dict[str, str]
                   ) -> tuple[dict[str, str], list[str]]:
    """The API field -> column the validating tasks read (JSON lines: the --map), and the
    columns of a CSV or Parquet source that hold no field (ignored: a table may carry more)."""
    if fmt == "json":
        return dict(mapping), []
    present = [c for c in columns if c != FILE_COLUMN]
    used = {api: mapping.get(api, api) for api in API_COLUMNS if mapping.get(api, api) in present}
    missing = [api for api in ("lon", "lat") if api not in used]
    if missing:
        raise IngestError(f"the input has no column for {', '.join(missing)} (its columns: "
                          f"{', '.join(present)}); name it with --map {missing[0]}=COLUMN")
    return used, [c for c in present if c not in used.values()]


def transform_rejects(refused: DataFrame, columns: list[str]) -> DataFrame:
    """Refused rows (REJECTS) as the rejects folder holds them: the source's columns as text,
    `reason` and `file` (a source column of either name is written as `<name>_original`)."""
    cols = [F.col("original").getItem(c).alias(c if c not in ("reason", "file")
                                                 else f"{c}_original") for c in columns]
    return refused.select(*cols, "reason", "file")


def reject_columns(first: list[str], keys: set[str]) -> list[str]:
    """The rejects' columns: those of the sources in their order (`first`), then any other
    (JSON lines' keys), sorted."""
    return [c for c in first if c in keys] + sorted(keys - set(first))


def load_rejects(refused: DataFrame, columns: list[str], path: str, overwrite: bool = False
                 ) -> None:
    """Write refused rows (REJECTS) as JSON lines."""
    (transform_rejects(refused, columns).write.mode("overwrite" if overwrite else "append")
     .json(path))


# --- a run --------------------------------------------------------------------------------

class Progress:
    """Prints the counts so far to stderr every PROGRESS_S while a run goes on: those of the
    validating tasks (a Redis hash they add to), and the rows published."""

    def __init__(self, client: Any, run: str, publisher: LivePublisher | None) -> None:
        self.client = client
        self.run = run
        self.publisher = publisher
        self.published = 0
        self.stopped = threading.Event()
        self.thread = threading.Thread(target=self._loop, daemon=True, name="ingest-progress")

    def start(self) -> None:
        self.thread.start()

    def stop(self) -> None:
        self.stopped.set()

    def line(self) -> str:
        try:
            got = self.client.hmget(progress_key(self.run), ["read", "valid", "rejected"])
        except (redis.RedisError, OSError):
            got = [None, None, None]
        read, valid, rejected = (int(v or 0) for v in got)
        text = f"ingest {self.run}: read {read}, accepted {valid}, rejected {rejected} so far"
        if self.publisher is not None:
            text += f"; published {self.published}"
            if self.publisher.waiting:
                text += f" (waiting: {self.publisher.waiting})"
        return text

    def _loop(self) -> None:
        while not self.stopped.wait(PROGRESS_S):
            say(self.line())


@dataclass
class WatchState:
    """A watch's own state beside Spark's checkpoint: its run id (its archive files' names),
    the last archive bucket it used, and per micro-batch not yet known to be committed its
    time, archive bucket and rows published."""

    path: Path
    run: str
    last_bucket: int = -1
    batches: dict[str, dict[str, Any]] = field(default_factory=dict)

    @staticmethod
    def load(path: Path) -> WatchState:
        if path.exists():
            doc = orjson.loads(path.read_bytes())
            return WatchState(path, doc["run"], doc["last_bucket"], doc["batches"])
        state = WatchState(path, secrets.token_hex(6))
        state.save()
        return state

    def save(self) -> None:
        tmp = self.path.with_suffix(".tmp")
        tmp.write_bytes(orjson.dumps({"run": self.run, "last_bucket": self.last_bucket,
                                      "batches": self.batches}))
        os.replace(tmp, self.path)

    def batch(self, batch_id: int) -> dict[str, Any]:
        # a micro-batch starts once the one before it is committed: older entries are done with
        self.batches = {k: v for k, v in self.batches.items() if int(k) >= batch_id - 1}
        return self.batches.setdefault(str(batch_id), {})

    def now(self, batch_id: int) -> float:
        """A micro-batch's time (its rows without `ts` get it; it is their arrival)."""
        entry = self.batch(batch_id)
        if "now" not in entry:
            entry["now"] = time.time()
            self.save()
        return float(entry["now"])

    def arrival(self, batch_id: int, bucket_s: float) -> tuple[int, float]:
        """A micro-batch's archive bucket, after every one this watch used (so above the cuts
        of its names), and its arrival time."""
        entry = self.batch(batch_id)
        at = self.now(batch_id)
        if "bucket" not in entry:
            entry["bucket"] = max(self.last_bucket + 1, math.floor(at / bucket_s))
            self.last_bucket = entry["bucket"]
            self.save()
        return int(entry["bucket"]), at


class Stop:
    """SIGINT / SIGTERM of a watch: the first stops it between micro-batches, a second one at
    once (that micro-batch runs again at the next start)."""

    def __init__(self) -> None:
        self.soon = threading.Event()
        self.now = False

    def __call__(self, _signum: int, _frame: Any) -> None:
        if self.soon.is_set():
            self.now = True
            say("stopping now (this micro-batch runs again at the next start)")
        else:
            say("stopping after this micro-batch (signal again to stop at once)")
        self.soon.set()


class Ingest:
    """One `geoswarm ingest` against the system of `settings` (its Redis at `redis_url`)."""

    def __init__(self, settings: Settings, options: Options, spark: SparkSession,
                 redis_url: str) -> None:
        from app.core.redis import sync_client

        self.settings = settings
        self.options = options
        self.spark = spark
        self.redis_url = redis_url
        self.client = sync_client(redis_url)
        self.run = secrets.token_hex(6)
        self.rejects = self.rejects_of(self.run)
        self.publisher: LivePublisher | None = None
        if options.to == "live":
            self.publisher = LivePublisher(settings, redis_url)
            try:
                self.publisher.check()
            except NoPlan as exc:
                self.publisher.close()
                raise IngestError(f"{exc}; start the system first", code=1) from None
        self.progress = Progress(self.client, self.run, self.publisher)
        self.first_columns: list[str] = []  # the rejects' column order
        self.warned: set[str] = set()
        self.rejected_in: set[str] = set()  # the rejects folders written, for the last word

    def rejects_of(self, run: str) -> str:
        if self.options.rejects:
            return spark_path(self.options.rejects)
        return str((self.settings.data_dir / "rejects" / run).resolve())

    def close(self) -> None:
        self.progress.stop()
        if self.publisher is not None:
            self.publisher.close()
        self.client.close()

    def validated(self, df: DataFrame, fmt: str, path: str, now: float) -> DataFrame:
        used, ignored = source_columns(fmt, df.columns, self.options.mapping)
        if ignored and path not in self.warned:
            self.warned.add(path)
            say(f"{path}: ignoring columns {', '.join(ignored)} (no API field; see --map)")
        self.first_columns += [c for c in df.columns
                               if c != FILE_COLUMN and c not in self.first_columns]
        rules = RowRules(fmt=fmt, columns=used, tenant=self.options.tenant, now=now,
                         redis_url=self.redis_url, run=self.run)
        return transform_validate(df, rules)

    def load(self, validated: DataFrame, batch_id: int | None = None,
             state: WatchState | None = None) -> Counts:
        """Count the validated rows, write the refused ones to the rejects and load the rest
        (a watch's micro-batch: `batch_id`, `state`)."""
        validated = validated.persist()  # validated once: events' ids are drawn there
        try:
            # the counts, and the columns of the refused rows (their distinct sets of columns)
            stats = {bool(r["ok"]): r for r in validated.groupBy("ok").agg(
                F.count(F.lit(1)).alias("rows"),
                F.collect_set(F.when(~F.col("ok"), F.array_sort(F.map_keys("original"))))
                .alias("columns")).collect()}
            counts = Counts(sum(int(r["rows"]) for r in stats.values()),
                            int(stats[True]["rows"]) if True in stats else 0,
                            int(stats[False]["rows"]) if False in stats else 0)
            folder = self.rejects if state is None else self.rejects_of(state.run)
            # a micro-batch's own folder: one run again after a crash writes it anew
            rejects = folder if state is None else f"{folder}/batch-{batch_id}"
            if counts.rejected:
                keys = {c for cols in stats[False]["columns"] for c in cols}
                load_rejects(validated.filter(~F.col("ok")).select("original", "reason", "file"),
                             reject_columns(self.first_columns, keys), rejects,
                             overwrite=state is not None)
                self.rejected_in.add(folder)
            good = validated.filter(F.col("ok"))
            if counts.accepted and self.options.to == "archive":
                arrival = None
                if state is not None and batch_id is not None:
                    arrival = state.arrival(batch_id, self.settings.bucket_s)
                self.load_archive(good, counts.accepted, arrival,
                                  state.run if state is not None else self.run)
            elif counts.accepted:
                refused = self.load_live(good, batch_id, state)
                if refused:
                    keys = {c for original, _, _ in refused for c in original}
                    load_rejects(self.spark.createDataFrame(refused, REJECTS),
                                 reject_columns(self.first_columns, keys), rejects)
                    self.rejected_in.add(folder)
                    counts = Counts(counts.read, counts.accepted - len(refused),
                                    counts.rejected + len(refused))
            return counts
        finally:
            validated.unpersist()

    def load_archive(self, good: DataFrame, rows: int, arrival: tuple[int, float] | None,
                     run: str) -> None:
        s = self.settings
        target = FileTarget(archive_url=s.archive_path, tenant=self.options.tenant, run=run,
                            bucket_s=s.bucket_s, bounds=s.bounds, grid=s.grid)
        bucketed = transform_buckets(good.select(*RECORD_COLUMNS), s.bucket_s, arrival)
        written = load_files(self.spark, bucketed, target, rows)
        top = raise_cut(self.client, run, written)
        say(f"archive: {len(written)} files in "
            f"{ArchiveStore(s.archive_path).tenant_dir(self.options.tenant)}, visible up to "
            f"bucket {top} (archive cut of {worker_name(run, 0)})")

    def load_live(self, good: DataFrame, batch_id: int | None, state: WatchState | None
                  ) -> list[tuple[Any, ...]]:
        """Publish the valid rows in their order, LIVE_BATCH at a time; the rows the tenant's
        quota refused (REJECTS). A watch records how far each micro-batch got, so that one run
        again after a crash goes on from there."""
        publisher = self.publisher
        assert publisher is not None
        entry = state.batch(batch_id) if state is not None and batch_id is not None else None
        skip = int(entry.get("published", 0)) if entry is not None else 0
        refused: list[tuple[Any, ...]] = []
        chunk: list[Row] = []
        done = skip

        def publish() -> None:
            nonlocal done
            try:
                reason = publisher.publish(record_batch(self.options.tenant, chunk))
            except (redis.ConnectionError, redis.TimeoutError) as exc:
                raise IngestError(f"cannot publish, Redis does not answer: {exc}",
                                  code=1) from None
            if reason is not None:
                refused.extend((r["original"], reason, r["file"]) for r in chunk)
            done += len(chunk)
            self.progress.published += len(chunk)
            if entry is not None and state is not None:
                entry["published"] = done
                state.save()
            chunk.clear()

        rows = good.select("original", "file", *RECORD_COLUMNS, "ttl_s").toLocalIterator()
        for i, row in enumerate(rows):
            if i >= skip:
                chunk.append(row)
                if len(chunk) >= LIVE_BATCH:
                    publish()
        if chunk:
            publish()
        return refused

    def ingest_paths(self) -> Counts:
        frames = []
        for path in self.options.paths:
            fmt = format_of(path, self.options.fmt)
            try:
                df = extract(self.spark, spark_path(path), fmt)
            except Exception as exc:  # Spark's AnalysisException (classic or Connect)
                if "PATH_NOT_FOUND" in str(exc):
                    raise IngestError(f"no such file or directory: {path}") from None
                raise
            frames.append(self.validated(df, fmt, path, time.time()))
        return self.load(reduce(lambda a, b: a.unionByName(b), frames))

    def watch(self, directory: str, stop: Stop) -> Counts:
        """Ingest the files that appear in `directory` until stopped, one micro-batch at a
        time; each one's counts on stdout."""
        src = spark_path(directory)
        fmt = self.options.fmt or self._wait_format(directory, stop)
        if fmt is None:
            return Counts()
        digest = hashlib.sha256(orjson.dumps([src, self.options.tenant, self.options.to, fmt,
                                              sorted(self.options.mapping.items())])).hexdigest()
        home = (self.settings.data_dir / "ingest" / f"watch-{digest[:16]}").resolve()
        home.mkdir(parents=True, exist_ok=True)
        state = WatchState.load(home / "state.json")
        say(f"watching {directory} ({fmt}); checkpoint {home}; rejects in "
            f"{self.rejects_of(state.run)}/batch-<n>")
        stream = self._stream(src, fmt, stop)
        if stream is None:
            return Counts()
        total = Counts()

        def each(batch: DataFrame, batch_id: int) -> None:
            nonlocal total
            validated = self.validated(batch, fmt, directory, state.now(int(batch_id)))
            counts = self.load(validated, int(batch_id), state)
            total += counts
            print(f"batch {batch_id}: {counts}", flush=True)

        while not stop.soon.is_set():
            query = (stream.writeStream.option("checkpointLocation", str(home / "spark"))
                     .trigger(availableNow=True).foreachBatch(each).start())
            while not query.awaitTermination(1):
                if stop.now:
                    query.stop()
            if query.exception() is not None and not stop.now:
                raise IngestError(f"the watch of {directory} failed: {query.exception()}",
                                  code=1)
            stop.soon.wait(WATCH_POLL_S)
        return total

    def _wait_format(self, directory: str, stop: Stop) -> str | None:
        while not stop.soon.is_set():
            try:
                return format_of(directory, None)
            except IngestError:
                stop.soon.wait(WATCH_POLL_S)
        return None

    def _stream(self, src: str, fmt: str, stop: Stop) -> DataFrame | None:
        """The directory's stream of files of the format; CSV and Parquet take the columns of
        its first file (waiting for one), JSON lines are lines."""
        reader = (self.spark.readStream.options(**reader_options(fmt))
                  .option("maxFilesPerTrigger", WATCH_MAX_FILES))
        if not self.options.fmt:
            exts = ",".join(f"*{e}" for e, f in FORMATS.items() if f == fmt)
            reader = reader.option("pathGlobFilter", "{" + exts + "}")
        if fmt != "json":
            schema = None
            while schema is None and not stop.soon.is_set():
                try:
                    schema = extract(self.spark, src, fmt).drop(FILE_COLUMN).schema
                except Exception:  # noqa: BLE001 - no file yet: nothing to take columns from
                    stop.soon.wait(WATCH_POLL_S)
            if schema is None:
                return None
            reader = reader.schema(schema)
        df = reader.format("text" if fmt == "json" else fmt).load(src)
        return df.withColumn(FILE_COLUMN, F.col("_metadata.file_path"))


def main(settings: Settings, options: Options, spark: SparkSession | None = None) -> Counts:
    """Run `geoswarm ingest`: the final counts (`IngestError` when it cannot start or go on).
    In `spark` when given (the caller's session, left running), else in a session of its own,
    stopped at the end."""
    check_tenant(options.tenant)
    if options.to not in ("archive", "live"):
        raise IngestError(f"--to {options.to!r}: choose archive or live")
    if options.fmt is not None and options.fmt not in FORMATS.values():
        raise IngestError(f"--format {options.fmt!r}: choose csv, json or parquet")
    if not options.paths and not options.watch:
        raise IngestError("nothing to ingest: give files, or --watch DIR")
    for path in [*options.paths, *([options.watch] if options.watch else [])]:
        check_exists(path)
    redis_url = find_system(settings)
    from spark.session import get_spark, java_available

    if spark is None and not settings.spark_remote:
        ok, detail = java_available()
        if not ok:
            raise IngestError(f"ingest needs Java 17+ for Spark: {detail}", code=1)
    own = spark is None
    session = get_spark(settings, app_name="geoswarm-ingest") if spark is None else spark
    try:
        ingest = Ingest(settings, options, session, redis_url)
        ingest.progress.start()
        try:
            total = ingest.ingest_paths() if options.paths else Counts()
            if options.watch:
                stop = Stop()
                signal.signal(signal.SIGINT, stop)
                signal.signal(signal.SIGTERM, stop)
                total += ingest.watch(options.watch, stop)
            for folder in sorted(ingest.rejected_in):
                say(f"the rejected rows, with their reason: {folder}")
            return total
        finally:
            ingest.close()
    finally:
        if own:
            session.stop()
