"""The API's rules on the rows of a file (`geoswarm ingest`'s validating tasks): each row of a
CSV, JSON lines or Parquet source becomes the object `POST /v1/objects` would receive, is
validated by `schemas.ObjectIn` and turned into a record by `records.records_from_objects`, as
the api does; or it is refused with the reason the API's 422 would give.

JSON lines are exactly the API's NDJSON lines (their keys renamed by --map). A CSV or Parquet
row is read the way a table is written: an empty cell is an absent field, numbers may be text,
`keywords` a JSON array or words separated by `;`, `props` a JSON object (as text, a struct or
a map); anything else is left to the API's rules.
"""

from __future__ import annotations

import datetime as dt
from collections.abc import Iterator
from dataclasses import dataclass
from decimal import Decimal
from functools import cache
from typing import Any

import orjson
import redis
from pydantic import ValidationError
from pyspark.sql import DataFrame, Row
from pyspark.sql import functions as F
from pyspark.sql.functions import udtf

from app.core.redis import sync_client
from app.pipeline import names
from app.pipeline.records import records_from_objects
from app.schemas import ObjectIn

API_COLUMNS = ("id", "lon", "lat", "ts", "text", "keywords", "props", "ttl_s")
NUMBER_COLUMNS = ("lon", "lat", "ts", "ttl_s")
FILE_COLUMN = "_file"  # the source file of each row (Spark's `_metadata.file_path`)
CHUNK_ROWS = 1_000  # rows a validating task turns into records at once

# A validated row: `ok` with the record (props as JSON text), or a `reason`; with the source
# row's values as text (`original`) and its file, for the rejects.
VALIDATED = ("ok boolean, reason string, file string, original map<string,string>, "
             "id string, moving boolean, lon double, lat double, ts double, "
             "keywords array<string>, text string, props string, ttl_s double")


class Rejected(Exception):
    """A row the API would refuse; the message is the reason."""


progress_key = names.ingest_progress_key


@dataclass(frozen=True)
class RowRules:
    """How a validating task reads a source's rows (sent to the task as JSON)."""

    fmt: str  # csv | json | parquet
    # CSV and Parquet: API field -> the column holding it; JSON lines: the --map (field -> key)
    columns: dict[str, str]
    tenant: str
    now: float  # the `ts` of rows without one (the API's: when it accepts them)
    redis_url: str | None = None  # where the tasks count their progress (best effort)
    run: str = ""

    def to_json(self) -> str:
        return orjson.dumps(self.__dict__).decode()

    @staticmethod
    def from_json(raw: str) -> RowRules:
        return RowRules(**orjson.loads(raw))


def cell_text(v: Any) -> str:
    """A value of a source row as text (for the rejects)."""
    if isinstance(v, str):
        return v
    if isinstance(v, Row):
        v = v.asDict(recursive=True)
    if isinstance(v, dt.datetime):  # naive: local time (PySpark's), see _number
        return dt.datetime.fromtimestamp(v.timestamp(), dt.UTC).isoformat()
    if isinstance(v, dt.date):
        return v.isoformat()
    return orjson.dumps(v, default=str).decode()


def _number(v: Any) -> Any:
    if isinstance(v, str):
        try:
            return float(v.strip())
        except ValueError:
            return v  # refused by the API's rule, with its message
    if isinstance(v, Decimal):
        return float(v)
    if isinstance(v, dt.datetime):
        # a Parquet timestamp: PySpark gives it as the worker's local time, naive, which is
        # what `timestamp()` takes a naive datetime to be
        return v.timestamp()
    return v


def _keywords(v: Any) -> Any:
    if not isinstance(v, str):
        return v
    s = v.strip()
    if s.startswith("["):
        try:
            return orjson.loads(s)
        except orjson.JSONDecodeError as exc:
            raise Rejected(f"keywords: not a valid JSON array ({exc})") from None
    return [k.strip() for k in s.split(";") if k.strip()]


def _props(v: Any) -> Any:
    if isinstance(v, str):
        try:
            return orjson.loads(v)
        except orjson.JSONDecodeError as exc:
            raise Rejected(f"props: not valid JSON ({exc})") from None
    return v  # a Parquet struct or map is a dict already


def object_from_cells(values: dict[str, Any]) -> dict[str, Any]:
    """A CSV or Parquet row (values by API field) as the object the API would receive."""
    out: dict[str, Any] = {}
    for k, v in values.items():
        if v is None or (isinstance(v, str) and k != "text" and not v.strip()):
            continue
        if k in NUMBER_COLUMNS:
            v = _number(v)
        elif k == "keywords":
            v = _keywords(v)
        elif k == "props":
            v = _props(v)
        elif k == "id" and isinstance(v, int) and not isinstance(v, bool):
            v = str(v)
        out[k] = v
    return out


def parse_line(line: str) -> dict[str, Any]:
    """A JSON line's object (one per line, as the API's NDJSON)."""
    try:
        doc = orjson.loads(line)
    except orjson.JSONDecodeError as exc:
        raise Rejected(f"malformed JSON: {exc}") from None
    if not isinstance(doc, dict):
        raise Rejected("a line must hold one JSON object")
    return doc


def renamed(doc: dict[str, Any], mapping: dict[str, str]) -> dict[str, Any]:
    """A JSON line's object with its keys renamed by --map (API field -> key); a key named as
    a field that --map takes from another key is refused, as the API refuses unknown fields."""
    field_of = {src: api for api, src in mapping.items()}
    out: dict[str, Any] = {}
    for k, v in doc.items():
        if k in field_of:
            out[field_of[k]] = v
        elif k in mapping:
            raise Rejected(f"{k}: Extra inputs are not permitted (--map takes {k} from "
                           f"{mapping[k]!r})")
        else:
            out[k] = v
    return out


def reason_of(exc: ValidationError, columns: dict[str, str]) -> str:
    """The API's 422 details in one line, each naming its field (and its source column)."""
    parts = []
    for err in exc.errors(include_url=False):
        loc = [str(p) for p in err["loc"]] or ["object"]
        src = columns.get(loc[0], loc[0])
        head = loc[0] if src == loc[0] else f"{loc[0]} (column {src})"
        parts.append(f"{'.'.join([head, *loc[1:]])}: {err['msg']}")
    return "; ".join(parts)


def validate_rows(rules: RowRules, rows: list[tuple[dict[str, Any], str | None]]
                  ) -> list[tuple[Any, ...]]:
    """Rows of a source (values by source column, file) as VALIDATED tuples, in their order;
    blank JSON lines are skipped, as the API skips them."""
    checked: list[tuple[dict[str, str], str | None, Any]] = []  # ObjectIn, or a reason
    for values, file in rows:
        original: dict[str, str] = {}
        try:
            if rules.fmt == "json":
                line = values.get("value")
                if line is None or not line.strip():
                    continue
                original = {"line": line}
                doc = parse_line(line)
                original = {k: cell_text(v) for k, v in doc.items() if v is not None}
                obj = renamed(doc, rules.columns)
            else:
                original = {k: cell_text(v) for k, v in values.items() if v is not None}
                obj = object_from_cells({api: values.get(src)
                                         for api, src in rules.columns.items()})
            checked.append((original, file, ObjectIn.model_validate(obj)))
        except Rejected as exc:
            checked.append((original, file, str(exc)))
        except ValidationError as exc:
            checked.append((original, file, reason_of(exc, rules.columns)))
    good = [c for _, _, c in checked if not isinstance(c, str)]
    records = records_from_objects(good, rules.tenant, rules.now)
    out: list[tuple[Any, ...]] = []
    i = 0
    for original, file, c in checked:
        if isinstance(c, str):
            out.append((False, c, file, original, *([None] * 9)))
            continue
        props = records.props[i]
        out.append((True, None, file, original, records.ids[i], records.moving[i],
                    records.lon[i], records.lat[i], records.ts[i], records.keywords[i],
                    records.text[i], props,
                    c.ttl_s))
        i += 1
    return out


_progress_clients: dict[str, Any] = {}  # per Python worker: Redis URL -> client (None: gone)


def count_progress(rules: RowRules, rows: list[tuple[Any, ...]]) -> None:
    """Add a task's counts to the run's progress hash (best effort: a task that cannot reach
    Redis validates on; the final counts are Spark's)."""
    if not rules.redis_url or not rows:
        return
    if rules.redis_url not in _progress_clients:
        _progress_clients[rules.redis_url] = sync_client(rules.redis_url, socket_timeout=2)
    client = _progress_clients[rules.redis_url]
    if client is None:
        return
    valid = sum(1 for r in rows if r[0])
    key = progress_key(rules.run)
    try:
        pipe = client.pipeline(transaction=False)
        pipe.hincrby(key, "read", len(rows))
        pipe.hincrby(key, "valid", valid)
        pipe.hincrby(key, "rejected", len(rows) - valid)
        pipe.expire(key, 7 * 86_400)
        pipe.execute()
    except (redis.RedisError, OSError):
        _progress_clients[rules.redis_url] = None


class _ValidateRows:
    """UDTF: a source's rows (with FILE_COLUMN) in, VALIDATED rows out, CHUNK_ROWS at a time."""

    def __init__(self) -> None:
        self.rules: RowRules | None = None
        self.pending: list[tuple[dict[str, Any], str | None]] = []

    def eval(self, row: Row, conf: str) -> Iterator[tuple[Any, ...]]:
        if self.rules is None:
            self.rules = RowRules.from_json(conf)
        values = row.asDict(recursive=True)
        file = values.pop(FILE_COLUMN, None)
        self.pending.append((values, file))
        if len(self.pending) >= CHUNK_ROWS:
            yield from self._flush()

    def terminate(self) -> Iterator[tuple[Any, ...]]:
        yield from self._flush()

    def _flush(self) -> Iterator[tuple[Any, ...]]:
        if self.rules is None or not self.pending:
            return
        rows = validate_rows(self.rules, self.pending)
        self.pending = []
        count_progress(self.rules, rows)
        yield from rows


@cache
def _validate_udtf() -> Any:
    # Python in, Python out: the Arrow-optimised kind needs pandas, which geoswarm does not have
    return udtf(_ValidateRows, returnType=VALIDATED, useArrow=False)


def transform_validate(df: DataFrame, rules: RowRules) -> DataFrame:
    """Every row of a source (its columns and FILE_COLUMN) validated by the API's rules:
    VALIDATED rows, in the source's order within each partition."""
    validated: DataFrame = _validate_udtf()(df.asTable(), F.lit(rules.to_json()))
    return validated
