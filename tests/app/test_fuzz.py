"""Property-based: no input, however malformed, produces a 5xx or takes the server down (API.md,
Errors). Random JSON values (huge ints, NaN / Infinity, lone surrogates, deep nesting), raw
bytes and mutations of valid bodies are POSTed to every JSON endpoint; random paths and query
strings are sent to the GETs. Bounded so that the module runs well under a minute. Against the
in-process api, with its worker running (readiness needs a live worker)."""

from __future__ import annotations

import copy
import json
import secrets
from collections.abc import Callable, Iterator
from typing import Any
from urllib.parse import quote, urlencode

import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.app.httpapi import JSON, NDJSON
from tests.conftest import InProcessServer, auth

FUZZ = settings(max_examples=150, deadline=None, database=None, derandomize=False,
                suppress_health_check=[HealthCheck.function_scoped_fixture,
                                       HealthCheck.too_slow, HealthCheck.data_too_large])

# --- strategies ----------------------------------------------------------------------------

ODD_CHARS = ["\ud800", "\udfff", "\x00", "\u2028", "\ufeff", "é", "💥", "\\", '"', "\n"]
texts = st.text(st.characters() | st.sampled_from(ODD_CHARS), max_size=20)
numbers = (
    st.integers()
    | st.integers(min_value=-(10**60), max_value=10**60)
    | st.sampled_from([2**63, -(2**63) - 1, 2**64, 10**400, 0, -0, 1, -1, 60, 1000, 1001])
    | st.floats(allow_nan=True, allow_infinity=True)
    | st.sampled_from([180.0, -180.0, 90.0, -90.0, 180.0000001, 1e-320, 5e-324, 1e308])
)
scalars = st.none() | st.booleans() | numbers | texts
json_values = st.recursive(
    scalars,
    lambda inner: st.lists(inner, max_size=6) | st.dictionaries(texts, inner, max_size=6),
    max_leaves=25,
)

OBJECT = {"id": "taxi-17", "lon": -73.985, "lat": 40.758, "ts": 1763800000.5,
          "text": "Free coffee at 5th Ave", "keywords": ["coffee"], "props": {"price": 2}}
SUBSCRIPTIONS = [
    {"type": "range", "bbox": [-74.02, 40.70, -73.93, 40.80], "keywords": ["coffee", "tea"],
     "match": "any", "ttl_s": 3600},
    {"type": "range", "circle": {"lon": -73.985, "lat": 40.758, "radius_m": 500},
     "detect": ["enter", "exit"]},
    {"type": "keyword", "keywords": ["earthquake", "tokyo"], "match": "all"},
    {"type": "knn", "point": [-73.985, 40.758], "k": 5, "keywords": ["taxi"]},
]
FIELD_NAMES = ["type", "bbox", "circle", "radius_m", "keywords", "match", "ttl_s", "k", "point",
               "detect", "lon", "lat", "id", "ts", "text", "props", "objects", "subscriptions",
               "tenant", "admin", "extra", "enabled", "period_s", "beta", "partition", "to",
               "split", "axis", "at"]


def _paths(value: Any, prefix: tuple[Any, ...] = ()) -> Iterator[tuple[Any, ...]]:
    yield prefix
    if isinstance(value, dict):
        for k, v in value.items():
            yield from _paths(v, (*prefix, k))
    elif isinstance(value, list):
        for i, v in enumerate(value):
            yield from _paths(v, (*prefix, i))


@st.composite
def mutated(draw: st.DrawFn, templates: list[Any]) -> Any:
    """A valid body with one to three random edits: a value replaced by any JSON value, a key
    deleted, a key added, a list item duplicated."""
    body = copy.deepcopy(draw(st.sampled_from(templates)))
    for _ in range(draw(st.integers(1, 3))):
        path = draw(st.sampled_from(list(_paths(body))))
        op = draw(st.sampled_from(["replace", "delete", "add", "duplicate"]))
        if not path:
            if op == "replace":
                body = draw(json_values)
            continue
        parent = body
        for p in path[:-1]:
            parent = parent[p]
        last = path[-1]
        if op == "replace":
            parent[last] = copy.deepcopy(draw(json_values | st.sampled_from(templates)))
        elif op == "delete":
            del parent[last]
        elif op == "add" and isinstance(parent, dict):
            parent[draw(st.sampled_from(FIELD_NAMES) | texts)] = draw(json_values)
        elif op == "duplicate" and isinstance(parent, list):
            parent.extend([copy.deepcopy(parent[last])] * draw(st.integers(1, 20)))
    return body


def encode(value: Any) -> bytes:
    """JSON text as a sloppy client would write it: NaN / Infinity tokens, huge integers, lone
    surrogates escaped."""
    return json.dumps(value, allow_nan=True).encode()


@st.composite
def raw_bodies(draw: st.DrawFn, values: st.SearchStrategy[Any]) -> bytes:
    """Mostly JSON text; sometimes truncated, sometimes bytes that are not JSON at all."""
    kind = draw(st.sampled_from(["json", "json", "json", "truncated", "bytes", "nested"]))
    if kind == "bytes":
        return draw(st.binary(max_size=200))
    if kind == "nested":
        depth = draw(st.integers(1, 3000))
        return b"[" * depth + b"]" * draw(st.sampled_from([depth, 0, depth - 1]))
    text = encode(draw(values))
    if kind == "truncated" and text:
        return text[: draw(st.integers(0, len(text) - 1))]
    return text


# --- fixtures and checks ---------------------------------------------------------------------

@pytest.fixture(scope="module")
def server(inprocess_worker: InProcessServer) -> InProcessServer:
    """This module's api: in-process, with its worker."""
    return inprocess_worker


@pytest.fixture(scope="module")
def client(server: InProcessServer) -> Iterator[httpx.Client]:
    """One tenant's key for the whole module (fuzzing never needs a clean tenant)."""
    with server.http(auth(server.new_key())) as c:
        yield c


@pytest.fixture(scope="module")
def admin_client(server: InProcessServer) -> Iterator[httpx.Client]:
    with server.http(server.admin()) as c:
        yield c


def no_5xx(r: httpx.Response, unavailable_ok: bool = False) -> None:
    """No 5xx; where API.md documents a 503 (a missing dependency), only that, with
    Retry-After."""
    if unavailable_ok and r.status_code == 503:
        assert "retry-after" in r.headers, r.text[:300]
    else:
        assert r.status_code < 500, (r.request.method, str(r.request.url)[:300],
                                     r.request.content[:300], r.status_code, r.text[:300])
    if r.status_code >= 400:
        assert "detail" in r.json(), r.text[:300]


def healthy(server: InProcessServer) -> None:
    """The api still serves (in-process there is no api process that could die instead)."""
    with server.http() as c:
        assert c.get("/healthz").status_code == 200
        r = c.get("/readyz")
    assert r.status_code == 200, r.text


def fuzz_post(server: InProcessServer, c: httpx.Client, path: str, bodies: st.SearchStrategy[bytes],
              content_type: str = JSON,
              on_success: Callable[[httpx.Response], None] | None = None,
              method: str = "POST", unavailable_ok: bool = False) -> None:
    @FUZZ
    @given(body=bodies)
    def run(body: bytes) -> None:
        r = c.request(method, path, content=body, headers={"content-type": content_type})
        no_5xx(r, unavailable_ok)
        if r.status_code < 300 and on_success is not None:
            on_success(r)

    run()
    healthy(server)


# --- POST bodies ---------------------------------------------------------------------------------

def object_batches() -> st.SearchStrategy[Any]:
    return mutated([{"objects": [OBJECT]}, {"objects": [OBJECT, {"lon": 0, "lat": 0}]}])


def test_fuzz_objects_json(server: InProcessServer, client: httpx.Client) -> None:
    def accepted(r: httpx.Response) -> None:
        assert r.status_code == 202
        assert r.json()["accepted"] == len(r.json()["ids"]) >= 1

    fuzz_post(server, client, "/v1/objects", raw_bodies(json_values | object_batches()),
              on_success=accepted)


def test_fuzz_objects_ndjson(server: InProcessServer, client: httpx.Client) -> None:
    lines = st.lists(json_values | mutated([OBJECT]) | st.just(OBJECT), max_size=5)
    bodies = lines.map(lambda ls: b"\n".join(encode(v) for v in ls)) | st.binary(max_size=100)
    fuzz_post(server, client, "/v1/objects", bodies, content_type=NDJSON)


def test_fuzz_subscriptions(server: InProcessServer) -> None:
    """Also: what was accepted is exactly what the tenant's list holds (a rejected request
    stores nothing)."""
    with server.http(auth(server.new_key())) as c:
        created: list[str] = []
        fuzz_post(server, c, "/v1/subscriptions", raw_bodies(json_values | mutated(SUBSCRIPTIONS)),
                  on_success=lambda r: created.append(r.json()["id"]))
        batches = mutated([{"subscriptions": SUBSCRIPTIONS}, {"subscriptions": [SUBSCRIPTIONS[2]]}])
        fuzz_post(server, c, "/v1/subscriptions/batch", raw_bodies(json_values | batches),
                  on_success=lambda r: created.extend(r.json()["ids"]))
        listed: list[str] = []
        cursor = None
        while True:
            r = c.get("/v1/subscriptions", params={"limit": 1000, **({"cursor": cursor}
                                                                    if cursor else {})})
            assert r.status_code == 200, r.text
            listed += [s["id"] for s in r.json()["items"]]
            cursor = r.json()["next_cursor"]
            if not cursor:
                break
        assert listed == created


def test_fuzz_admin_keys(server: InProcessServer, admin_client: httpx.Client) -> None:
    keys = mutated([{"tenant": "acme", "admin": False}, {"tenant": "fuzz-" + secrets.token_hex(2)}])
    fuzz_post(server, admin_client, "/v1/admin/keys", raw_bodies(json_values | keys))


BALANCER = [{"enabled": False, "period_s": 5, "beta": 20}, {"beta": 3}, {"period_s": 0.5}]
REBALANCE = [{}, {"partition": "p0", "to": "w1"}, {"split": "p0", "axis": "x", "at": 100},
             {"split": "p1", "axis": "y", "at": 999}]


def test_fuzz_admin_balancer(server: InProcessServer, admin_client: httpx.Client) -> None:
    def stored(r: httpx.Response) -> None:
        body = r.json()
        assert isinstance(body["enabled"], bool)
        assert 0.1 <= body["period_s"] <= 3600 and 1 <= body["beta"] <= 1000

    bodies = raw_bodies(json_values | mutated(BALANCER))
    fuzz_post(server, admin_client, "/v1/admin/balancer", bodies, method="PUT", on_success=stored)


def test_fuzz_admin_rebalance(server: InProcessServer, admin_client: httpx.Client) -> None:
    """No coordinator runs here: a request that passes validation is the documented 503."""
    fuzz_post(server, admin_client, "/v1/admin/rebalance",
              raw_bodies(json_values | mutated(REBALANCE)), unavailable_ok=True)


def test_fuzz_wrong_content_types(server: InProcessServer, client: httpx.Client) -> None:
    @FUZZ
    @given(path=st.sampled_from(["/v1/objects", "/v1/subscriptions", "/v1/subscriptions/batch"]),
           content_type=st.sampled_from(["text/plain", "application/xml", "", "application/json; "
                                         "charset=latin-1", "multipart/form-data; boundary=x",
                                         "application/x-www-form-urlencoded", "ndjson/json"]),
           body=raw_bodies(json_values | mutated(SUBSCRIPTIONS)))
    def run(path: str, content_type: str, body: bytes) -> None:
        no_5xx(client.post(path, content=body, headers={"content-type": content_type}))

    run()
    healthy(server)


# --- GET paths and query strings ----------------------------------------------------------------

segments = st.text(st.characters() | st.sampled_from([*ODD_CHARS, ".", "/", "%", "?", "#"]),
                   max_size=40)
query_values = (texts | numbers.map(str)
                | st.from_regex(r"\A-?[0-9]{1,18}-[0-9]{1,18}:-?[0-9]{1,25}\Z")
                | st.sampled_from(["", "-1", "0", "1001", "1e3", "s1", "czE", "null"]))
queries = st.dictionaries(st.sampled_from(["limit", "cursor", "since", "token", "x"]) | texts,
                          query_values, max_size=4)


def test_fuzz_get_paths(server: InProcessServer, client: httpx.Client) -> None:
    r = client.post("/v1/subscriptions", json={"type": "range", "bbox": [-180, -90, 180, 90]})
    sid = r.json()["id"]
    client.post("/v1/objects", json={"objects": [{"id": "fz", "lon": 1, "lat": 1}]})
    templates = [
        "/v1/objects/{}", "/v1/subscriptions/{}", "/v1/subscriptions/{}/matches",
        f"/v1/subscriptions/{sid}/matches{{}}", "/v1/subscriptions{}", "/v1/admin/{}",
        "/v1/admin/keys/{}", "/{}", "/v1/{}", "/healthz{}", "/readyz{}", "/metrics{}",
        "/v1/admin/partitions{}", "/v1/admin/balancer{}", "/v1/admin/cluster{}", "/admin/{}",
    ]

    @FUZZ
    @given(template=st.sampled_from(templates), segment=segments, query=queries,
           method=st.sampled_from(["GET", "GET", "GET", "DELETE", "HEAD", "OPTIONS"]),
           as_admin=st.booleans())
    def run(template: str, segment: str, query: dict[str, str], method: str,
            as_admin: bool) -> None:
        path = template.format(quote(segment.encode("utf-8", "surrogatepass"), safe=""))
        url = path + ("?" + urlencode(
            {k.encode("utf-8", "surrogatepass"): v.encode("utf-8", "surrogatepass")
             for k, v in query.items()}) if query else "")
        if method == "DELETE" and sid in url:
            method = "GET"  # keep the subscription the matches paths read
        headers = server.admin() if as_admin else None
        r = client.request(method, url, headers=headers)
        assert r.status_code < 500, (method, url[:300], r.status_code, r.text[:300])

    run()
    healthy(server)
    assert client.get(f"/v1/subscriptions/{sid}").status_code == 200


def test_matches_cursor_past_redis_stream_ids(server: InProcessServer,
                                              client: httpx.Client) -> None:
    r = client.post("/v1/subscriptions", json={"type": "keyword", "keywords": ["a"]})
    sid = r.json()["id"]
    for since in ("1-1:0", "999999999999999999-999999999999999999:0", "0-0:99999999999999999999"):
        r = client.get(f"/v1/subscriptions/{sid}/matches", params={"since": since})
        assert r.status_code == 200, (since, r.text)


@pytest.mark.parametrize("since", ["99999999999999999999999-0:0",
                                   "18446744073709551615-18446744073709551615:0"])
def test_matches_cursor_past_64_bits_is_422(server: InProcessServer, client: httpx.Client,
                                            since: str) -> None:
    r = client.post("/v1/subscriptions", json={"type": "keyword", "keywords": ["a"]})
    sid = r.json()["id"]
    r = client.get(f"/v1/subscriptions/{sid}/matches", params={"since": since})
    assert r.status_code == 422, r.text
