"""API.md, Snapshot queries and Errors: what `POST /v1/queries` and `GET /v1/queries/{id}` refuse
before a query runs, over HTTP against the in-process api: 400 for malformed JSON, 401 without a
key, 413, 422 naming the field for every invalid QUERY (and for a `from` before the live window,
naming its start, or a `to` before `from`), 404 for an unknown id; never a 500. Beside them: the
models' conversion to the wire's SnapshotQuery and the OpenAPI document's QUERY shapes. What a
query answers (200, 202 then polling, 503 naming a worker) is tests/workers/test_snapshot.py's,
against real workers."""

from __future__ import annotations

import re
import time
from collections.abc import Iterator
from typing import Any

import jsonschema_rs
import pytest
from pydantic import TypeAdapter, ValidationError

from app.core.config import Settings
from app.main import create_app
from app.pipeline import wire
from app.schemas.queries import QueryIn, snapshot_query
from tests.app.httpapi import Api, locs
from tests.app.test_validation import with_, without
from tests.conftest import InProcessServer, auth, http_client

BBOX = [-74.02, 40.70, -73.93, 40.80]
BBOX_TUPLE = (-74.02, 40.70, -73.93, 40.80)
CIRCLE = {"lon": -73.985, "lat": 40.758, "radius_m": 500}
RANGE = {"type": "range", "bbox": BBOX}
RANGE_CIRCLE = {"type": "range", "circle": CIRCLE, "keywords": ["coffee"], "limit": 10}
KNN = {"type": "knn", "point": [-73.985, 40.758], "k": 5, "keywords": ["taxi"]}
KEYWORD = {"type": "keyword", "keywords": ["earthquake", "tokyo"], "match": "all"}
TOPK = {"type": "topk_terms", "bbox": BBOX, "k": 10}
COUNT = {"type": "count", "circle": CIRCLE}
QUERIES = {"range": RANGE, "knn": KNN, "keyword": KEYWORD, "topk_terms": TOPK, "count": COUNT}

_query = TypeAdapter(QueryIn)


@pytest.fixture
def api(inprocess_worker: InProcessServer) -> Iterator[Api]:
    a = Api(inprocess_worker)
    yield a
    a.close()


def aliased(base: dict[str, Any], **kw: Any) -> dict[str, Any]:
    """`with_` for the fields whose names are Python keywords: from_=…, to=…."""
    return with_(base, **{k.rstrip("_"): v for k, v in kw.items()})


# --- 422: every invalid QUERY names its field ------------------------------------------------

BAD_QUERIES: list[tuple[str, dict[str, Any], Any]] = [
    # (case, body, the field the 422 must name)
    # missing fields
    ("type-missing", without(RANGE, "type"), "body"),
    ("range-neither", {"type": "range"}, "range"),
    ("topk-neither", {"type": "topk_terms", "k": 3}, "topk_terms"),
    ("count-neither", {"type": "count", "keywords": ["a"]}, "count"),
    ("knn-point-missing", without(KNN, "point"), "point"),
    ("knn-k-missing", without(KNN, "k"), "k"),
    ("keyword-keywords-missing", without(KEYWORD, "keywords"), "keywords"),
    ("circle-missing-radius", with_(COUNT, circle={"lon": 0, "lat": 0}), "radius_m"),
    # extra fields
    ("extra-range", with_(RANGE, colour="red"), "colour"),
    ("extra-knn", with_(KNN, radius_m=5), "radius_m"),
    ("extra-keyword", with_(KEYWORD, bbox=BBOX), "bbox"),
    ("extra-topk", with_(TOPK, limit=5), "limit"),
    ("extra-count", with_(COUNT, k=5), "k"),
    ("extra-knn-limit", with_(KNN, limit=5), "limit"),
    ("extra-range-k", with_(RANGE, k=5), "k"),
    ("extra-ttl", with_(RANGE, ttl_s=3600), "ttl_s"),
    ("extra-detect", with_(RANGE, detect=["enter"]), "detect"),
    ("python-name-t_from", with_(RANGE, t_from=1.0), "t_from"),
    ("python-name-t_to", with_(COUNT, t_to=1.0), "t_to"),
    ("circle-extra", with_(COUNT, circle={**CIRCLE, "r": 1}), "r"),
    # both regions
    ("range-bbox-and-circle", with_(RANGE, circle=CIRCLE), "range"),
    ("topk-bbox-and-circle", with_(TOPK, circle=CIRCLE), "topk_terms"),
    ("count-bbox-and-circle", with_(COUNT, bbox=BBOX), "count"),
    # wrong types
    ("type-int", with_(RANGE, type=1), "body"),
    ("type-unknown", with_(RANGE, type="polygon"), "body"),
    ("type-subscription-only", with_(RANGE, type="topk"), "body"),
    ("bbox-string", with_(RANGE, bbox=[0, 0, 1, "2"]), "bbox"),
    ("bbox-bool", with_(TOPK, bbox=[0, 0, 1, True]), "bbox"),
    ("bbox-null-item", with_(COUNT, bbox=[0, 0, None, 1], circle=None), "bbox"),
    ("bbox-object", with_(RANGE, bbox={"min_lon": 0}), "bbox"),
    ("bbox-3", with_(RANGE, bbox=[1, 2, 3]), "bbox"),
    ("bbox-5", with_(RANGE, bbox=[1, 2, 3, 4, 5]), "bbox"),
    ("circle-list", with_(COUNT, circle=[0, 0, 5]), "circle"),
    ("radius-string", with_(COUNT, circle={**CIRCLE, "radius_m": "500"}), "radius_m"),
    ("point-string", with_(KNN, point=["1", 2]), 0),
    ("point-bool", with_(KNN, point=[True, 2]), 0),
    ("point-null", with_(KNN, point=[None, 2]), 0),
    ("point-3", with_(KNN, point=[1, 2, 3]), "point"),
    ("k-float", with_(KNN, k=5.5), "k"),
    ("k-whole-float", with_(KNN, k=5.0), "k"),
    ("k-string", with_(KNN, k="5"), "k"),
    ("k-bool", with_(KNN, k=True), "k"),
    ("limit-float", with_(RANGE, limit=1.5), "limit"),
    ("limit-string", with_(KEYWORD, limit="10"), "limit"),
    ("latest-string", with_(RANGE, latest="yes"), "latest"),
    ("latest-int", with_(KNN, latest=1), "latest"),
    ("wait-string", with_(COUNT, wait_s="5"), "wait_s"),
    ("wait-bool", with_(COUNT, wait_s=True), "wait_s"),
    ("wait-null", with_(COUNT, wait_s=None), "wait_s"),
    ("from-string", aliased(RANGE, from_="now"), "from"),
    ("from-bool", aliased(RANGE, from_=True), "from"),
    ("to-list", aliased(KEYWORD, to=[1.0]), "to"),
    ("match-some", with_(KEYWORD, match="some"), "match"),
    ("keywords-string", with_(KEYWORD, keywords="tokyo"), "keywords"),
    ("keywords-int", with_(RANGE, keywords=[5]), 0),
    # out of range
    ("bbox-lon-181", with_(RANGE, bbox=[-181, 0, 0, 1]), "bbox"),
    ("bbox-lat-91", with_(COUNT, bbox=[0, 0, 1, 91], circle=None), "bbox"),
    ("bbox-huge-int", with_(RANGE, bbox=[0, 0, 1, 10**40]), "bbox"),
    ("bbox-inverted-lon", with_(RANGE, bbox=[-73.93, 40.70, -74.02, 40.80]), "bbox"),
    ("bbox-inverted-lat", with_(TOPK, bbox=[-74.02, 40.80, -73.93, 40.70]), "bbox"),
    ("circle-lon-200", with_(COUNT, circle={**CIRCLE, "lon": 200}), "lon"),
    ("circle-lat--90.5", with_(COUNT, circle={**CIRCLE, "lat": -90.5}), "lat"),
    ("radius-0.99", with_(COUNT, circle={**CIRCLE, "radius_m": 0.99}), "radius_m"),
    ("radius-1000km+", with_(RANGE_CIRCLE, circle={**CIRCLE, "radius_m": 1_000_000.5}),
     "radius_m"),
    ("point-lat-91", with_(KNN, point=[0, 91]), "point"),
    ("point-lon--181", with_(KNN, point=[-181, 0]), "point"),
    ("point-huge", with_(KNN, point=[0, 10**40]), "point"),
    ("knn-k-0", with_(KNN, k=0), "k"),
    ("knn-k-1001", with_(KNN, k=1001), "k"),
    ("knn-k-negative", with_(KNN, k=-3), "k"),
    ("knn-k-huge", with_(KNN, k=10**30), "k"),
    ("topk-k-0", with_(TOPK, k=0), "k"),
    ("topk-k-1001", with_(TOPK, k=1001), "k"),
    ("range-limit-0", with_(RANGE, limit=0), "limit"),
    ("range-limit-10001", with_(RANGE_CIRCLE, limit=10_001), "limit"),
    ("keyword-limit-negative", with_(KEYWORD, limit=-5), "limit"),
    ("keyword-limit-huge", with_(KEYWORD, limit=10**30), "limit"),
    ("wait-negative", with_(RANGE, wait_s=-0.1), "wait_s"),
    ("wait-60.5", with_(KNN, wait_s=60.5), "wait_s"),
    ("wait-huge", with_(KEYWORD, wait_s=10**40), "wait_s"),
    ("from-negative", aliased(RANGE, from_=-1), "from"),
    ("from-huge", aliased(COUNT, from_=1e12), "from"),
    ("to-negative", aliased(TOPK, to=-1), "to"),
    ("keywords-empty", with_(KEYWORD, keywords=[]), "keywords"),
    ("keywords-17", with_(RANGE, keywords=[f"k{i}" for i in range(17)]), "keywords"),
    ("keywords-17-topk", with_(TOPK, keywords=[f"k{i}" for i in range(17)]), "keywords"),
    ("keyword-empty-string", with_(KEYWORD, keywords=[""]), 0),
    ("keyword-65", with_(COUNT, keywords=["x" * 65]), 0),
]


@pytest.mark.parametrize(("body", "field"), [(b, f) for _, b, f in BAD_QUERIES],
                         ids=[c for c, _, _ in BAD_QUERIES])
def test_invalid_query_is_422_naming_the_field(api: Api, body: dict[str, Any], field: Any
                                               ) -> None:
    r = api.post("/v1/queries", body)
    assert r.status_code == 422, r.text
    assert any(field in loc for loc in locs(r)), (field, locs(r))
    assert all(loc[0] == "body" for loc in locs(r))
    assert all(err["msg"] for err in r.json()["detail"])


def test_422_names_the_query_type_after_body(api: Api) -> None:
    r = api.post("/v1/queries", with_(KNN, k=0))
    assert locs(r) == [["body", "knn", "k"]]
    r = api.post("/v1/queries", {"type": "count"})
    assert locs(r) == [["body", "count"]]
    assert "exactly one of bbox or circle" in r.json()["detail"][0]["msg"]


@pytest.mark.parametrize("body", [b"[]", b"null", b"1", b'"range"', b"true", b"{}"])
def test_body_that_is_not_a_query_object_is_422(api: Api, body: bytes) -> None:
    r = api.raw("/v1/queries", body)
    assert r.status_code == 422, r.text
    assert locs(r)[0][0] == "body"


# --- the time range against the live window -------------------------------------------------

@pytest.mark.parametrize("name", list(QUERIES))
def test_from_before_the_live_window_without_a_query_runner_is_503_saying_so(
        api: Api, name: str) -> None:
    """Records older than the window are in the archive, read by a query runner: with none
    running, the query cannot be answered whole and says why (never a live-only answer)."""
    window_s = api.server.settings.window_s
    r = api.post("/v1/queries", {**aliased(QUERIES[name], from_=time.time() - window_s - 60),
                                 "wait_s": 5})
    assert r.status_code == 503, r.text
    msg = r.json()["detail"]
    assert "no query runner is running" in msg and "geoswarm query-runner" in msg, msg
    assert re.search(r"\d{10}\.\d{3}", msg), msg  # the window's start, epoch seconds
    assert r.headers["Retry-After"] == "1"


def test_to_before_from_is_422_naming_to(api: Api) -> None:
    now = time.time()
    r = api.post("/v1/queries", aliased(RANGE, from_=now - 10, to=now - 20))
    assert locs(r) == [["body", "to"]], r.text
    msg = r.json()["detail"][0]["msg"]
    assert "to" in msg and "before from" in msg, msg


def test_schema_errors_come_before_the_time_range(api: Api) -> None:
    r = api.post("/v1/queries", aliased(KNN, k=0, from_=1.0))
    assert locs(r) == [["body", "knn", "k"]], r.text


# --- 400, 401, 413 ----------------------------------------------------------------------------

MALFORMED = [
    pytest.param(b'{"type": "range", ', id="truncated"),
    pytest.param(b"not json", id="garbage"),
    pytest.param(b'{"type": "count"}}', id="trailing"),
    pytest.param(b"", id="empty"),
    pytest.param(b"{'type': 'count'}", id="single-quotes"),
    pytest.param(b'{"type": "keyword", "keywords": ["\xff\xfe"]}', id="not-utf8"),
    pytest.param(b'{"type": "keyword", "keywords": ["\\ud800"]}', id="lone-surrogate"),
    pytest.param(b"[" * 5000 + b"]" * 5000, id="deep-nesting"),
    *(pytest.param(b'{"type": "knn", "point": [%s, 1], "k": 1}' % t, id=f"point-{t.decode()}")
      for t in (b"NaN", b"Infinity", b"-Infinity", b"1e999")),
    *(pytest.param(b'{"type": "range", "bbox": [0, 0, %s, 1]}' % t, id=f"bbox-{t.decode()}")
      for t in (b"NaN", b"Infinity")),
    pytest.param(b'{"type": "count", "bbox": [0, 0, 1, 1], "from": NaN}', id="from-NaN"),
    pytest.param(b'{"type": "count", "bbox": [0, 0, 1, 1], "wait_s": Infinity}', id="wait-inf"),
    pytest.param(b'{"type": "count", "circle": {"lon": 0, "lat": 0, "radius_m": 1e999}}',
                 id="radius-1e999"),
]


@pytest.mark.parametrize("body", MALFORMED)
def test_malformed_json_is_400(api: Api, body: bytes) -> None:
    r = api.raw("/v1/queries", body)
    assert r.status_code == 400, r.text
    assert isinstance(r.json()["detail"], str) and r.json()["detail"].startswith("malformed JSON")


def test_without_a_valid_key_is_401(inprocess_worker: InProcessServer) -> None:
    for headers in (None, auth("not-a-key"), {"Authorization": "Basic abc"}):
        with http_client(inprocess_worker, headers) as client:
            for r in (client.post("/v1/queries", json=COUNT),
                      client.post("/v1/queries", content=b"not json",
                                  headers={"content-type": "application/json"}),
                      client.get("/v1/queries/q_0")):
                assert r.status_code == 401, (headers, r.text)
                assert isinstance(r.json()["detail"], str)


def test_body_over_max_body_bytes_is_413(api: Api) -> None:
    r = api.raw("/v1/queries", b" " * (api.server.settings.max_body_bytes + 1))
    assert r.status_code == 413, r.text


def test_only_post_and_get_are_served(api: Api) -> None:
    r = api.raw("/v1/queries", b"", method="DELETE")
    assert r.status_code == 405 and r.headers["allow"] == "POST"
    r = api.raw("/v1/queries/q_0", b"", method="POST")
    assert r.status_code == 405 and r.headers["allow"] == "GET"


# --- 404 ---------------------------------------------------------------------------------------

@pytest.mark.parametrize("query_id", ["q_0", "never-issued", "x" * 300, "é💥"])
def test_unknown_query_id_is_404(api: Api, query_id: str) -> None:
    r = api.get(f"/v1/queries/{query_id}")
    assert r.status_code == 404, r.text
    assert repr(query_id) in r.json()["detail"], r.text


# --- the models (no server) --------------------------------------------------------------------

def test_snapshot_query_conversion() -> None:
    q = snapshot_query(_query.validate_python(with_(
        RANGE_CIRCLE, keywords=["Coffee", "TEA", "coffee"], match="all", latest=True,
        **{"from": 10, "to": 20.5})))
    assert q == wire.SnapshotQuery(type="range", circle=(-73.985, 40.758, 500.0),
                                   keywords=["coffee", "tea"], match_all=True, t_from=10.0,
                                   t_to=20.5, latest=True, limit=10)
    assert snapshot_query(_query.validate_python(RANGE)) == wire.SnapshotQuery(
        type="range", bbox=BBOX_TUPLE)
    assert snapshot_query(_query.validate_python(KNN)) == wire.SnapshotQuery(
        type="knn", point=(-73.985, 40.758), k=5, keywords=["taxi"])
    assert snapshot_query(_query.validate_python(KEYWORD)) == wire.SnapshotQuery(
        type="keyword", keywords=["earthquake", "tokyo"], match_all=True, limit=1000)
    assert snapshot_query(_query.validate_python({"type": "topk_terms", "bbox": BBOX})) == (
        wire.SnapshotQuery(type="topk_terms", bbox=BBOX_TUPLE, k=10))
    assert snapshot_query(_query.validate_python(COUNT)) == wire.SnapshotQuery(
        type="count", circle=(-73.985, 40.758, 500.0))
    # The wire form round-trips through msgpack, as the workers receive it.
    part = wire.QueryPart(reply="r", tenant="t", query=snapshot_query(_query.validate_python(
        KNN)), as_of=1.0, deadline=2.0)
    assert wire.decode_entry(wire.encode_entry(part)) == part


def test_defaults_and_boundaries_are_valid() -> None:
    for body in [
        with_(RANGE, bbox=[-180, -90, 180, 90], limit=1), with_(RANGE, bbox=[5, 5, 5, 5]),
        with_(RANGE_CIRCLE, circle={"lon": 180, "lat": -90, "radius_m": 1_000_000},
              limit=10_000),
        with_(COUNT, circle={"lon": 0, "lat": 0, "radius_m": 1}),
        with_(KNN, k=1, point=[180, -90]), with_(KNN, k=1000),
        with_(TOPK, k=1), with_(TOPK, k=1000),
        with_(KEYWORD, keywords=[f"k{i}" for i in range(16)]),
        with_(COUNT, wait_s=0), with_(COUNT, wait_s=60), with_(COUNT, wait_s=0.5),
        aliased(COUNT, from_=0, to=0), with_(COUNT, latest=True), with_(COUNT, bbox=None),
        with_(RANGE, keywords=None),
    ]:
        _query.validate_python(body)
    q = _query.validate_python(KNN)
    assert (q.wait_s, q.latest, q.t_from, q.t_to, q.match) == (10.0, False, None, None, "any")
    with pytest.raises(ValidationError):
        _query.validate_python({**COUNT, "t_from": 1.0})  # the alias only


# --- the OpenAPI document ----------------------------------------------------------------------

@pytest.fixture(scope="module")
def document() -> dict[str, Any]:
    return create_app(Settings()).openapi()


def test_openapi_lists_the_query_operations(document: dict[str, Any]) -> None:
    post = document["paths"]["/v1/queries"]["post"]
    get = document["paths"]["/v1/queries/{query_id}"]["get"]
    assert {"200", "202", "400", "401", "413", "422", "429", "503"} <= set(post["responses"])
    assert {"200", "401", "404", "429", "503"} <= set(get["responses"])
    assert "422" not in get["responses"] and "400" not in get["responses"]
    components = document["components"]["schemas"]
    assert {"RangeBBoxQuery", "RangeCircleQuery", "TopkTermsBBoxQuery", "TopkTermsCircleQuery",
            "CountBBoxQuery", "CountCircleQuery", "QueryResultBody"} <= set(components)
    shape = components["RangeBBoxQuery"]["properties"]
    assert {"from", "to", "latest", "wait_s"} <= set(shape)
    assert not {"t_from", "t_to"} & set(shape)


@pytest.mark.parametrize(("body", "valid"), [
    (RANGE, True), (RANGE_CIRCLE, True), (KNN, True), (KEYWORD, True), (TOPK, True),
    (COUNT, True), ({**COUNT, "bbox": None, "from": 5, "to": 6, "latest": True}, True),
    ({"type": "range"}, False), ({**RANGE, "circle": CIRCLE}, False),
    ({**TOPK, "circle": CIRCLE}, False), ({"type": "count"}, False),
    ({**RANGE, "bbox": [-181, 0, 0, 1]}, False), ({**RANGE, "t_from": 1}, False),
    ({**KNN, "k": 1001}, False), ({**TOPK, "k": 0}, False), ({**RANGE, "limit": 10_001}, False),
    ({**COUNT, "wait_s": 61}, False), ({**COUNT, "from": -1}, False),
    ({**KNN, "limit": 5}, False), ({"type": "keyword"}, False), ({"type": "polygon"}, False),
])
def test_query_schema_is_the_servers(document: dict[str, Any], body: dict[str, Any],
                                     valid: bool) -> None:
    """The document's QUERY accepts what the models accept (but the time range against the
    live window, which no schema can state)."""
    schema = document["paths"]["/v1/queries"]["post"]["requestBody"]["content"]["application/json"]
    validator = jsonschema_rs.Draft202012Validator(
        {**schema["schema"], "components": document["components"]})
    assert validator.is_valid(body) == valid
    try:
        _query.validate_python(body)
        accepted = True
    except ValidationError:
        accepted = False
    assert accepted == valid
