"""`app.api.direct`: a publish, a snapshot query and the two polled reads (a moving object's
latest record, a query's outcome) answered without FastAPI's routing answer exactly as their
routes do. Every request below is sent twice to the in-process api (with a
worker), once with the direct endpoints and once with them taken out, and the two answers
compared: status, content type, Retry-After, and the JSON body (but for what differs from one
call to the next: query ids, the ids given to objects without one). Valid requests must have
gone through the direct endpoints (counted), invalid ones are answered as by the routes."""

from __future__ import annotations

import json
from typing import Any

import httpx
import pytest

from app.api import direct
from tests.app.httpapi import NDJSON, Api
from tests.app.test_queries_validation import BAD_QUERIES, BBOX, QUERIES
from tests.app.test_queries_validation import api as api  # the fixture: a fresh tenant
from tests.app.test_validation import BAD_OBJECT_FIELDS

PLACE = {"lon": -73.985, "lat": 40.758}
# objects inside the test queries' region, each kind of field present
OBJECTS = [
    {"id": "cab-1", **PLACE, "keywords": ["taxi", "coffee"], "text": "a cab"},
    {"lon": -73.99, "lat": 40.75, "keywords": ["earthquake", "tokyo"], "props": {"n": 1}},
    {"lon": -73.95, "lat": 40.79, "keywords": ["coffee"]},
]


@pytest.fixture
def counted(monkeypatch: pytest.MonkeyPatch) -> dict[Any, int]:
    """The direct endpoints and readers, counting the requests each answered (a reader also
    when it raised: the app's handler answers then, as for the route)."""
    calls: dict[Any, int] = dict.fromkeys([*direct.ENDPOINTS, *direct.READERS], 0)

    def counting(key: Any, endpoint: Any) -> Any:
        async def call(*args: Any) -> Any:
            response = None
            try:
                response = await endpoint(*args)
                return response
            finally:
                if response is not None or key in direct.READERS:
                    calls[key] += 1
        return call

    monkeypatch.setattr(direct, "ENDPOINTS", {
        key: counting(key, endpoint) for key, endpoint in direct.ENDPOINTS.items()})
    monkeypatch.setattr(direct, "READERS", {
        key: counting(key, reader) for key, reader in direct.READERS.items()})
    return calls


def both(monkeypatch: pytest.MonkeyPatch, send: Any) -> tuple[httpx.Response, httpx.Response]:
    """`send()` with the direct endpoints, then through the routes only."""
    direct_answer = send()
    with monkeypatch.context() as m:
        m.setattr(direct, "ENDPOINTS", {})
        m.setattr(direct, "READERS", {})
        routed = send()
    return direct_answer, routed


def comparable(r: httpx.Response) -> tuple[Any, ...]:
    body = r.json()
    if isinstance(body, dict):
        body = {k: v for k, v in body.items() if k != "id"}  # a query's id: new each time
        if "ids" in body:  # given ids stay, generated ones are new each time
            body["ids"] = [i if i == "cab-1" else "<generated>" for i in body["ids"]]
    return (r.status_code, r.headers.get("content-type"), r.headers.get("retry-after"),
            json.dumps(body, sort_keys=True))


def assert_same(monkeypatch: pytest.MonkeyPatch, send: Any) -> httpx.Response:
    direct_answer, routed = both(monkeypatch, send)
    assert comparable(direct_answer) == comparable(routed)
    return direct_answer


def test_a_valid_publish_is_answered_directly_as_by_its_route(
        api: Api, counted: dict[tuple[str, str], int], monkeypatch: pytest.MonkeyPatch) -> None:
    r = assert_same(monkeypatch, lambda: api.post("/v1/objects", {"objects": OBJECTS}))
    assert r.status_code == 202 and r.json()["accepted"] == 3
    ndjson = "\n".join(json.dumps(o) for o in OBJECTS) + "\n"
    r = assert_same(monkeypatch, lambda: api.raw("/v1/objects", ndjson, NDJSON))
    assert r.status_code == 202
    assert counted[("POST", "/v1/objects")] == 2


@pytest.mark.parametrize(("field", "value"), BAD_OBJECT_FIELDS[::3],
                         ids=[f"{f}={str(v)[:20]}" for f, v in BAD_OBJECT_FIELDS[::3]])
def test_an_invalid_publish_is_answered_as_by_its_route(
        api: Api, monkeypatch: pytest.MonkeyPatch, field: str, value: Any) -> None:
    objects = [dict(o) for o in OBJECTS]
    objects[1][field] = value
    r = assert_same(monkeypatch, lambda: api.post("/v1/objects", {"objects": objects}))
    assert r.status_code == 422


MALFORMED = [
    *(("/v1/objects", body) for body in [
        b"", b"not json", b'{"objects": []}', b'{"objects": 1}', b"[]",
        b'{"objects": [{"lon": NaN, "lat": 1}]}', b'{"objects": [{"lon": 1, "lat": 1}], "x": 1}']),
    *(("/v1/queries", body) for body in [
        b"not json", b'{"type": "count"}}', b"[1]", b'{"type": "count", "bbox": [NaN, 0, 1, 1]}']),
]


@pytest.mark.parametrize(("path", "body"), MALFORMED)
def test_a_malformed_body_is_answered_as_by_its_route(
        api: Api, monkeypatch: pytest.MonkeyPatch, path: str, body: bytes) -> None:
    r = assert_same(monkeypatch, lambda: api.raw(path, body))
    assert r.status_code in (400, 422)


def test_valid_queries_are_answered_directly_as_by_their_route(
        api: Api, counted: dict[tuple[str, str], int], monkeypatch: pytest.MonkeyPatch) -> None:
    assert api.post("/v1/objects", {"objects": OBJECTS}).status_code == 202
    # (a query sees every object accepted before it)
    count = api.post("/v1/queries", {"type": "count", "bbox": BBOX})
    assert count.json()["results"] == [{"count": 3}], count.text
    before = counted[("POST", "/v1/queries")]
    for body in [*QUERIES.values(), {"type": "range", "bbox": BBOX, "limit": 2},
                 {"type": "knn", "point": [PLACE["lon"], PLACE["lat"]], "k": 2},
                 {"type": "range", "bbox": BBOX, "latest": True, "wait_s": 0.0}]:
        r = assert_same(monkeypatch, lambda body=body: api.post("/v1/queries", body))
        assert r.status_code in (200, 202), r.text
    assert counted[("POST", "/v1/queries")] == before + 8


@pytest.mark.parametrize(("case", "body", "field"), BAD_QUERIES[::2],
                         ids=[case for case, _, _ in BAD_QUERIES[::2]])
def test_an_invalid_query_is_answered_as_by_its_route(
        api: Api, counted: dict[tuple[str, str], int], monkeypatch: pytest.MonkeyPatch,
        case: str, body: dict[str, Any], field: Any) -> None:
    r = assert_same(monkeypatch, lambda: api.post("/v1/queries", body))
    assert r.status_code == 422
    assert counted[("POST", "/v1/queries")] == 0  # the route answered


def test_errors_raised_by_a_direct_endpoint_use_the_apps_handlers(
        api: Api, monkeypatch: pytest.MonkeyPatch) -> None:
    """A time range ending before it starts is refused by the endpoint itself (422 naming
    `to`); a key that is not valid never reaches it (401)."""
    body = {"type": "count", "bbox": BBOX, "from": 2.0e9, "to": 1.0e9}
    r = assert_same(monkeypatch, lambda: api.post("/v1/queries", body))
    assert r.status_code == 422 and "to" in r.text
    bad = httpx.Headers({"authorization": "Bearer nope"})
    r = assert_same(monkeypatch, lambda: api.client.post("/v1/objects", headers=bad,
                                                         json={"objects": OBJECTS}))
    assert r.status_code == 401


def test_the_polled_reads_are_answered_directly_as_by_their_routes(
        api: Api, counted: dict[Any, int], monkeypatch: pytest.MonkeyPatch) -> None:
    """A moving object's latest record (found, unknown, an id that needs escaping, ids with a
    slash, escaped or not), a query's outcome (done, unknown, not an id), and either without
    a valid key."""
    assert api.post("/v1/objects", {"objects": [
        *OBJECTS, {"id": "cab 2", **PLACE, "props": {"seats": 4}},
        {"id": "fleet/7", **PLACE}, {"id": "depot/", **PLACE}]}).status_code == 202
    done = api.post("/v1/queries", {"type": "range", "bbox": BBOX})
    query_id = done.json()["id"]
    for path, status in [("/v1/objects/cab-1", 200), ("/v1/objects/nobody", 404),
                         ("/v1/objects/cab%202", 200), ("/v1/objects/a%2Fb", 404),
                         ("/v1/objects/fleet/7", 200), ("/v1/objects/fleet%2F7", 200),
                         ("/v1/objects/depot/", 200), ("/v1/objects/fleet/7/x", 404),
                         (f"/v1/queries/{query_id}", 200),
                         ("/v1/queries/q0", 404), ("/v1/queries/" + "x" * 300, 404)]:
        r = assert_same(monkeypatch, lambda path=path: api.get(path))
        assert r.status_code == status, (path, r.text)
    assert api.get("/v1/objects/fleet%2F7").json()["id"] == "fleet/7"
    assert api.get("/v1/objects/depot/").json()["id"] == "depot/"
    assert api.get(f"/v1/queries/{query_id}").json()["results"] == done.json()["results"]
    assert counted["/v1/objects/"] == 10 and counted["/v1/queries/"] == 4
    bad = httpx.Headers({"authorization": "Bearer nope"})
    for path in ("/v1/objects/cab-1", f"/v1/queries/{query_id}"):
        r = assert_same(monkeypatch, lambda path=path: api.client.get(path, headers=bad))
        assert r.status_code == 401
    # a path the routes do not serve, and a HEAD, are the framework's
    for method, path in [("GET", "/v1/queries/a/b"), ("GET", "/v1/objects/"),
                         ("HEAD", "/v1/objects/cab-1")]:
        direct_answer, routed = both(
            monkeypatch, lambda method=method, path=path: api.client.request(method, path))
        assert direct_answer.status_code == routed.status_code, (method, path)
