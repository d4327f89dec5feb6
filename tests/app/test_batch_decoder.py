"""The one-step decoder of publish batches (app.schemas.batch) against the models' validation
(`ObjectIn`, which words the API's errors): on generated bodies, valid and not, the decoder
accepts exactly what the models accept, with the same values, so the fast path changes no
answer of `POST /v1/objects`."""

from __future__ import annotations

import re
from typing import Any

import orjson
import pytest
from fastapi.exceptions import RequestValidationError
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from app.api.routes.objects import _parse_objects_slowly, parse_objects
from app.core.errors import BadRequest, PayloadTooLarge
from app.schemas import MAX_OBJECT_TTL_S
from app.schemas.batch import Decoded, decode_batch, decode_lines

FIELDS = ("id", "lon", "lat", "ts", "text", "keywords", "props", "ttl_s")

junk = st.one_of(st.none(), st.booleans(), st.integers(-10**20, 10**20), st.text(max_size=3),
                 st.lists(st.integers(), max_size=2), st.dictionaries(st.text(max_size=2),
                                                                      st.integers(), max_size=2))


def number(lo: float, hi: float) -> st.SearchStrategy[Any]:
    """Numbers in, on and just past the bounds, as floats and as integers."""
    edges = [lo, hi, lo - 1e-9, hi + 1e-9, lo - 1, hi + 1, 0, -0.0]
    return st.one_of(st.floats(lo, hi), st.sampled_from(edges), st.integers(int(lo) - 2,
                     int(min(hi, 10**12)) + 2), st.floats(allow_nan=True, allow_infinity=True))


def sized_text(lo: int, hi: int) -> st.SearchStrategy[str]:
    return st.one_of(st.text(min_size=lo, max_size=min(hi, 8)),
                     st.integers(max(0, lo - 1), hi + 1).map(lambda n: "é" * n))


props = st.recursive(st.one_of(st.none(), st.booleans(), st.integers(-2**70, 2**70),
                               st.floats(allow_nan=False), st.text(max_size=5)),
                     lambda inner: st.one_of(st.lists(inner, max_size=3),
                                             st.dictionaries(st.text(max_size=4), inner,
                                                             max_size=3)), max_leaves=8)

values: dict[str, st.SearchStrategy[Any]] = {
    "id": st.one_of(sized_text(0, 128), junk),
    "lon": st.one_of(number(-180.0, 180.0), junk),
    "lat": st.one_of(number(-90.0, 90.0), junk),
    "ts": st.one_of(number(0.0, 1e11), junk),
    "text": st.one_of(sized_text(0, 2000), junk),
    "keywords": st.one_of(st.lists(st.one_of(sized_text(0, 64), junk), max_size=3),
                          st.integers(63, 65).map(lambda n: ["k"] * n), junk),
    "props": st.one_of(st.dictionaries(st.text(max_size=4), props, max_size=3),
                       st.integers(4080, 4100).map(lambda n: {"p": "x" * n}), junk),
    "ttl_s": st.one_of(number(0.0, MAX_OBJECT_TTL_S), junk),
}


@st.composite
def an_object(draw: st.DrawFn) -> dict[str, Any]:
    obj: dict[str, Any] = {"lon": draw(st.floats(-180, 180)), "lat": draw(st.floats(-90, 90))}
    for name in draw(st.lists(st.sampled_from(FIELDS), max_size=4, unique=True)):
        obj[name] = draw(values[name])
    if draw(st.booleans()):
        obj.pop(draw(st.sampled_from(["lon", "lat"])))
    if draw(st.integers(0, 9)) == 0:
        obj[draw(st.sampled_from(["color", "Lon", "objects"]))] = 1
    return obj


def encode(doc: Any) -> bytes:
    try:
        return orjson.dumps(doc)
    except TypeError:  # an integer beyond 64 bits: written as the JSON text it would be
        import json

        return json.dumps(doc).encode()


def slow(body: bytes, ndjson: bool) -> list[dict[str, Any]] | str:
    try:
        objs = _parse_objects_slowly(body, ndjson, 10_000)
    except (RequestValidationError, BadRequest, PayloadTooLarge) as exc:
        return type(exc).__name__
    return [{f: getattr(o, f) for f in FIELDS} for o in objs]


def fields(objs: Any) -> list[dict[str, Any]]:
    return [{f: getattr(o, f) for f in FIELDS} for o in objs]


BIG_INT = re.compile(rb"(?<![\d.eE+-])-?\d{19,}(?![\d.eE])")


def agree(body: bytes, fast: Decoded | None, want: list[dict[str, Any]] | str) -> None:
    """What the decoder accepts, the models accept with the same values; what it refuses,
    the models refuse, except integers beyond 64 bits (which the models' JSON parser reads
    as floats): those bodies take the models' path, and so get the models' answer. The props
    text the decoder hands on is the props as the records would encode them."""
    if fast is None:
        assert isinstance(want, str) or BIG_INT.search(body), (body, want)
    else:
        assert not isinstance(want, str), (body, want)
        assert same(fields(fast.objects), want), (body, fields(fast.objects), want)
        assert fast.props == [None if o["props"] is None else orjson.dumps(o["props"]).decode()
                              for o in want], (body, fast.props)


def same(a: list[dict[str, Any]], b: list[dict[str, Any]]) -> bool:
    """Equal values, floats compared with their type left aside (2 and 2.0)."""
    return orjson.dumps(a) == orjson.dumps(b)


@settings(max_examples=600, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(an_object(), min_size=0, max_size=3),
       st.sampled_from(["batch", "other-top", "not-a-list"]))
def test_the_decoder_accepts_what_the_models_accept(objs: list[dict[str, Any]],
                                                    shape: str) -> None:
    doc: Any = {"objects": objs}
    if shape == "other-top":
        doc["extra"] = 1
    elif shape == "not-a-list":
        doc = {"objects": objs[0] if objs else None}
    body = encode(doc)
    agree(body, decode_batch(body), slow(body, ndjson=False))


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(an_object(), min_size=1, max_size=3))
def test_ndjson_lines_decode_as_the_models_validate_them(objs: list[dict[str, Any]]) -> None:
    body = b"\n".join(encode(o) for o in objs) + b"\n"
    lines = [line for line in body.splitlines() if line.strip()]
    agree(body, decode_lines(lines), slow(body, ndjson=True))


@pytest.mark.parametrize("body", [
    b'{"objects":[{"lon":1,"lon":2,"lat":1}]}',  # a repeated key: the last wins, in both
    b'{"objects":[{"lon":1,"lat":1}],"objects":[{"lon":5,"lat":1}]}',
    b'{"objects":[{"lon":1,"lat":1,"props":{"a":1,"a":2}}]}',
    b'{"objects":[{"lon":NaN,"lat":1}]}',
    b'{"objects":[{"lon":1e400,"lat":1}]}',
    b'{"objects":[{"lon":1,"lat":1,"text":"\\ud800"}]}',  # a lone surrogate
    b'{"objects":[{"lon":1,"lat":1,"props":{"n":100000000000000000000000}}]}',
    b'{"objects":[{"lon":1,"lat":1,"id":"\xff"}]}',  # not UTF-8
])
def test_edge_bodies_agree(body: bytes) -> None:
    agree(body, decode_batch(body), slow(body, ndjson=False))


def test_valid_batches_take_the_fast_path() -> None:
    """A batch as clients send it is decoded in one step (not by the models)."""
    body = orjson.dumps({"objects": [
        {"id": "car-1", "lon": 2.35, "lat": 48.85, "ts": 1_700_000_000.5, "text": "Jam here",
         "keywords": ["traffic"], "props": {"speed": 12}, "ttl_s": 60},
        {"lon": -73.98, "lat": 40.75}]})
    objs, props = parse_objects(body, "application/json", 10_000)
    assert all(type(o).__name__ == "FastObject" for o in objs)
    assert props == ['{"speed":12}', None]  # encoded once, by the size check
    lines = b'{"lon": 1, "lat": 2}\n\n{"lon": 3, "lat": 4, "id": "x"}\n'
    objs, props = parse_objects(lines, "application/x-ndjson", 10_000)
    assert [type(o).__name__ for o in objs] == ["FastObject"] * 2 and props == [None, None]
    assert [o.lon for o in objs] == [1.0, 3.0]
    with pytest.raises(PayloadTooLarge):
        parse_objects(lines, "application/x-ndjson", 1)
