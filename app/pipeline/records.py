"""Published records after validation, as a columnar batch, their server ids, and the stream
entry (`wire.ObjectBatch`) each worker gets of them."""

from __future__ import annotations

import itertools
import os
import secrets
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Protocol, cast

import msgpack
import orjson

from app.geo.tokenize import normalize_keywords, tokenize
from app.pipeline.wire import ObjectBatch, Props

_prefix = secrets.token_hex(4)
_counter = itertools.count()
_pid = os.getpid()


def _refresh_after_fork() -> None:
    global _prefix, _counter, _pid
    _prefix, _counter, _pid = secrets.token_hex(4), itertools.count(), os.getpid()


os.register_at_fork(after_in_child=_refresh_after_fork)


def new_event_ids(n: int) -> list[str]:
    """Server ids for events: a per-process random prefix and a counter (unique, cheap)."""
    return [f"o{_prefix}{next(_counter):x}" for _ in range(n)]


def new_record_ids(n: int) -> list[str]:
    return [f"r{_prefix}{next(_counter):x}" for _ in range(n)]


@dataclass
class RecordBatch:
    """One publish request after validation, column by column."""

    tenant: str
    ids: list[str]
    moving: list[bool]
    lon: list[float]
    lat: list[float]
    ts: list[float]
    keywords: list[list[str]]
    text: list[str | None]
    props: list[str | None]  # JSON text (`wire.Props`)
    size: int
    ttl_s: list[float | None] | None = None  # moving objects' own TTLs (None: the default)


class ValidObject(Protocol):
    """An object as `schemas.ObjectIn` validated it."""

    @property
    def id(self) -> str | None: ...
    @property
    def lon(self) -> float: ...
    @property
    def lat(self) -> float: ...
    @property
    def ts(self) -> float | None: ...
    @property
    def text(self) -> str | None: ...
    @property
    def keywords(self) -> list[str] | None: ...
    @property
    def props(self) -> dict[str, Any] | None: ...
    @property
    def ttl_s(self) -> float | None: ...


def records_from_objects(objs: Sequence[ValidObject], tenant: str, now: float,
                         props: list[str | None] | None = None) -> RecordBatch:
    """Validated objects (`schemas.ObjectIn`) as records: server ids for events, keywords
    lower-cased and de-duplicated with the text's tokens, `ts` defaulting to `now`, props as
    JSON text (`props`: that of each object, when its validation encoded them already).
    Shared by `POST /v1/objects` and `geoswarm ingest`, so that both store the same
    records."""
    n = len(objs)
    event_ids = iter(new_event_ids(sum(1 for o in objs if o.id is None)))
    ids: list[str] = []
    moving: list[bool] = []
    keywords: list[list[str]] = []
    for o in objs:
        moving.append(o.id is not None)
        ids.append(o.id if o.id is not None else next(event_ids))
        kws = o.keywords
        if o.text:
            kws = normalize_keywords([*(kws or ()), *tokenize(o.text)])
        elif kws:
            kws = normalize_keywords(kws)
        keywords.append(kws or [])
    return RecordBatch(
        tenant=tenant,
        ids=ids,
        moving=moving,
        lon=[o.lon for o in objs],
        lat=[o.lat for o in objs],
        ts=[o.ts if o.ts is not None else now for o in objs],
        keywords=keywords,
        text=[o.text for o in objs],
        props=props if props is not None else [props_text(o.props) for o in objs],
        size=n,
        ttl_s=[o.ttl_s for o in objs] if any(o.ttl_s is not None for o in objs) else None,
    )


def object_batch(batch: RecordBatch, record_ids: list[str],
                 prev: list[tuple[float, float] | None], late: list[bool],
                 decide_exit: list[bool], sent_at: float, plan_version: int) -> ObjectBatch:
    """The whole batch as a stream entry, with each record's previous position (for detect)
    and whether its receiver decides `exit`; each worker gets `take(its rows)`."""
    return ObjectBatch(
        tenant=batch.tenant, sent_at=sent_at, plan_version=plan_version, ids=batch.ids,
        record_ids=record_ids, moving=batch.moving, lon=batch.lon, lat=batch.lat, ts=batch.ts,
        keywords=batch.keywords, text=batch.text, props=cast(list[Props], batch.props),
        prev=prev, late=late,
        exit_only=[False] * batch.size, decide_exit=decide_exit)


def public_record(object_id: str, lon: float, lat: float, ts: float, keywords: list[str],
                  text: str | None, props: Props) -> dict[str, Any]:
    """A record as clients see it (in matches), for orjson to encode: `text` and `props` only
    when given, props' JSON text embedded as it is."""
    out: dict[str, Any] = {"id": object_id, "lon": lon, "lat": lat, "ts": ts,
                           "keywords": keywords}
    if text is not None:
        out["text"] = text
    if props is not None:
        out["props"] = orjson.Fragment(props) if isinstance(props, str) else props
    return out


def props_text(props: Props) -> str | None:
    """Props as JSON text (encoded here only when an earlier version left the object)."""
    return props if props is None or isinstance(props, str) else orjson.dumps(props).decode()


def props_object(props: Props) -> dict[str, Any] | None:
    """Props decoded, for a response model."""
    if isinstance(props, str):
        decoded: dict[str, Any] = orjson.loads(props)
        return decoded
    return props


# A moving object's latest record in `names.positions_key(tenant)`: a msgpack array
# [ts, lon, lat, keywords, props] (the last-writer-wins script reads ts at index 1).
Position = tuple[float, float, float, list[str], Props]


def pack_position(ts: float, lon: float, lat: float, keywords: list[str],
                  props: Props) -> bytes:
    packed: bytes = msgpack.packb([ts, lon, lat, keywords, props], use_bin_type=True)
    return packed


def unpack_position(raw: bytes) -> Position:
    ts, lon, lat, keywords, props = msgpack.unpackb(raw, raw=False)
    return ts, lon, lat, keywords, props
