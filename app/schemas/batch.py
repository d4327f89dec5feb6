"""The publish batch decoded and validated in one step (msgspec, straight from the body's
bytes): the hot path of `POST /v1/objects`.

The rules are those of `ObjectIn` (the pydantic model, which documents the contract in the
OpenAPI schema and words the errors): a batch that this decoder refuses is validated again by
the pydantic path, so that a client gets the same 422 (or 400) either way; a batch that it
accepts, pydantic accepts too with the same values (tests/app/test_batch_decoder.py checks it
on generated input).
"""

from __future__ import annotations

from typing import Annotated, Any, NamedTuple

import msgspec
import orjson

from app.schemas import MAX_OBJECT_TTL_S, MAX_PROPS_BYTES

Lon = Annotated[float, msgspec.Meta(ge=-180.0, le=180.0)]
Lat = Annotated[float, msgspec.Meta(ge=-90.0, le=90.0)]
Ts = Annotated[float, msgspec.Meta(ge=0.0, le=1e11)]
Keyword = Annotated[str, msgspec.Meta(min_length=1, max_length=64)]
ObjectId = Annotated[str, msgspec.Meta(min_length=1, max_length=128)]
Text = Annotated[str, msgspec.Meta(max_length=2000)]
TtlS = Annotated[float, msgspec.Meta(gt=0.0, le=MAX_OBJECT_TTL_S)]


class FastObject(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    lon: Lon
    lat: Lat
    id: ObjectId | None = None
    ts: Ts | None = None
    text: Text | None = None
    keywords: Annotated[list[Keyword], msgspec.Meta(max_length=64)] | None = None
    props: dict[str, Any] | None = None
    ttl_s: TtlS | None = None


class FastBatch(msgspec.Struct, forbid_unknown_fields=True):
    objects: Annotated[list[FastObject], msgspec.Meta(min_length=1)]


_batch = msgspec.json.Decoder(FastBatch)
_object = msgspec.json.Decoder(FastObject)


class Decoded(NamedTuple):
    """A batch the decoder accepted: its objects, and each one's `props` as the compact JSON
    text its size check encoded (None without props). The records carry that text on
    (`records.records_from_objects`), so props are encoded once, here."""

    objects: list[FastObject]
    props: list[str | None]


def _with_props(objs: list[FastObject]) -> Decoded | None:
    """The objects with their props' JSON text, or None unless every `props` is within
    MAX_PROPS_BYTES encoded (and encodable: an integer beyond 64 bits is not)."""
    texts: list[str | None] = []
    for o in objs:
        if o.props is None:
            texts.append(None)
            continue
        try:
            encoded = orjson.dumps(o.props)
        except (TypeError, orjson.JSONEncodeError):
            return None
        if len(encoded) > MAX_PROPS_BYTES:
            return None
        texts.append(encoded.decode())
    return Decoded(objs, texts)


def decode_batch(body: bytes) -> Decoded | None:
    """The objects of a JSON batch (`{"objects": [...]}`), or None when anything is wrong
    with it (the caller then validates with pydantic for the error)."""
    try:
        objs = _batch.decode(body).objects
    except (msgspec.MsgspecError, UnicodeDecodeError):  # UTF-8 broken inside a string
        return None
    return _with_props(objs)


def decode_lines(lines: list[bytes]) -> Decoded | None:
    """The objects of NDJSON lines (blank ones already left out), or None as above."""
    try:
        objs = [_object.decode(line) for line in lines]
    except (msgspec.MsgspecError, UnicodeDecodeError):  # UTF-8 broken inside a string
        return None
    return _with_props(objs)
