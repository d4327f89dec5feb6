"""/openapi.json tells the truth. Property-based (Schemathesis): requests generated from the
document, valid and invalid, go in-process to the real app — its lifespan on the embedded
redis-server and SQLite, with a real worker (so that there is a partition plan and publishing
and subscribing succeed) and a real coordinator (so that rebalancing does) — as a tenant and as
an admin. Every answer must be one the document describes: no 5xx, a documented status,
content type, headers and body; schema-valid requests accepted, schema-invalid ones refused.
Beside them: each error status triggered and checked against the document, the Allow of 405s,
and the subscription union. Bounded: the module takes about 30 s on two cores."""

from __future__ import annotations

import asyncio
import json
import os
import re
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import jsonschema_rs
import pytest
import redis
import requests
import schemathesis
from hypothesis import HealthCheck, settings
from schemathesis import BaseSchema
from schemathesis.checks import (
    content_type_conformance,
    response_headers_conformance,
    response_schema_conformance,
    status_code_conformance,
)
from schemathesis.core import NOT_SET
from schemathesis.python import asgi
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from app.core.config import Settings
from app.core.migrate import upgrade_head
from app.core.redis import EmbeddedRedis
from app.main import create_app
from app.services.subscriptions import encode_cursor
from bench.cluster import BOOTSTRAP, ROOT, cluster_env, own_database

# It starts a real worker and coordinator process beside the in-process app.
pytestmark = pytest.mark.slow

MAX_EXAMPLES = 25  # per operation, role and generation mode (valid, invalid)
CONFORMANCE = settings(max_examples=MAX_EXAMPLES, deadline=None, database=None,
                       suppress_health_check=list(HealthCheck))


class AppUnderTest:
    """The ASGI app the generated requests go to, with one lifespan from the first request to
    stop(). The document is read at import, so that pytest collects one test per operation; the
    app needs the Redis, database and processes that the `live` fixture starts, so that fixture
    sets `app`. Schemathesis's pytest plugin ends the lifespans it started after every test (an
    operation); the app's is not meant to restart forty times, so the lifespans Schemathesis
    starts and ends are answered here."""

    def __init__(self) -> None:
        self.app: ASGIApp | None = None
        self.loop: asyncio.AbstractEventLoop | None = None
        self.task: asyncio.Future[None] | None = None
        self.to_app: asyncio.Queue[Message] | None = None
        self.from_app: asyncio.Queue[Message] | None = None

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        assert self.app is not None, "the `live` fixture has not set the app"
        if scope["type"] != "lifespan":
            await self.app(scope, receive, send)
            return
        while True:
            message = await receive()
            if message["type"] == "lifespan.shutdown":
                await send({"type": "lifespan.shutdown.complete"})
                return
            try:
                await self._start()
            except Exception as exc:  # noqa: BLE001 - reported to Schemathesis as ASGI says
                await send({"type": "lifespan.startup.failed", "message": repr(exc)})
                return
            await send({"type": "lifespan.startup.complete"})

    async def _start(self) -> None:
        """The app's lifespan, once, as a task of the loop that serves the requests."""
        if self.task is not None:
            return
        assert self.app is not None
        self.loop = asyncio.get_running_loop()
        self.to_app, self.from_app = asyncio.Queue(), asyncio.Queue()
        scope = {"type": "lifespan", "asgi": {"version": "3.0"}, "state": {}}
        self.task = asyncio.ensure_future(self.app(scope, self.to_app.get, self.from_app.put))
        await self._exchange("lifespan.startup")

    async def _exchange(self, message: str) -> None:
        assert self.to_app is not None and self.from_app is not None
        await self.to_app.put({"type": message})
        reply = await self.from_app.get()
        if reply["type"] != message + ".complete":
            raise RuntimeError(f"{message} failed: {reply.get('message')}")

    async def _stop(self) -> None:
        await self._exchange("lifespan.shutdown")
        assert self.task is not None
        await self.task

    def stop(self, timeout: float = 30) -> None:
        """From the fixture's thread: end the app's lifespan on the loop that runs it."""
        if self.loop is not None and self.task is not None:
            asyncio.run_coroutine_threadsafe(self._stop(), self.loop).result(timeout)
        self.app = self.loop = self.task = None


DOCUMENT = create_app(Settings(environment="test")).openapi()
UNDER_TEST = AppUnderTest()


def load(*, coverage: bool) -> BaseSchema:
    loaded = schemathesis.openapi.from_dict(DOCUMENT, config=schemathesis.Config.from_dict({
        "phases": {"coverage": {"enabled": coverage}},
        # A batch's items are SUBSCRIPTIONs, every boundary of which the coverage of
        # POST /v1/subscriptions sends already.
        "operations": [{"include-path": "/v1/subscriptions/batch",
                        "phases": {"coverage": {"enabled": False}}}],
    }))
    loaded.app = UNDER_TEST  # as schemathesis.openapi.from_asgi() does: requests stay in-process
    return loaded.exclude(path_regex=r"^/admin/")  # the dashboard's HTML page


# The coverage phase (every boundary of every constraint, every undocumented method: ~1 000
# deterministic requests) runs once, as the admin: validation does not depend on the key. The
# tenant's run adds what does: 403 on the admin endpoints, its own subscriptions and objects.
schema = load(coverage=True)
tenant_schema = load(coverage=False)


# --- the rules the document states in words only (its info.description) ----------------------

@schemathesis.serializer("application/x-ndjson")
def ndjson(_: Any, value: Any) -> bytes:
    """The document models an NDJSON body as an array (the OpenAPI registry's reading of
    sequential JSON): its items, one per line."""
    items = value if isinstance(value, list) else [value]
    return b"\n".join(json.dumps(item).encode() for item in items)


def as_worded(case: Any) -> None:
    """The rules the document states in words only, applied to a generated case. Neither
    changes what the schema says of the request, so a valid case stays valid and an invalid one
    invalid (Schemathesis revalidates an edited case anyway). In the test rather than in
    map_* hooks, which the coverage phase does not run."""
    if case.body is not NOT_SET:
        case.body = _worded_body(case.body)
    cursor = (case.query or {}).get("cursor")
    if isinstance(cursor, str) and len(cursor) <= 64:
        # Opaque: any string of up to 64 characters fits the schema, but only a cursor this
        # server issued is accepted.
        case.query["cursor"] = encode_cursor(len(cursor))


def _worded_body(body: Any) -> Any:
    """bboxes in order (min ≤ max: lon swapped with lon, lat with lat), a snapshot query's time
    range inside the live window, whole floats spelled as integers (JSON Schema reads 5.0 as an
    integer, the server refuses it)."""
    if isinstance(body, list):
        return [_worded_body(item) for item in body]
    if isinstance(body, dict):
        body = {k: _worded_body(v) for k, v in body.items()}
        bbox = body.get("bbox")
        if (isinstance(bbox, list) and len(bbox) == 4
                and all(isinstance(c, int | float) and not isinstance(c, bool) for c in bbox)):
            body["bbox"] = [min(bbox[0], bbox[2]), min(bbox[1], bbox[3]),
                            max(bbox[0], bbox[2]), max(bbox[1], bbox[3])]
        _in_window(body)
        return body
    if isinstance(body, float) and body.is_integer():
        return int(body)
    return body


def _in_window(body: dict[str, Any]) -> None:
    """A query's `from` before the live window's start, or a `to` before `from`, is a 422 the
    schema cannot express (the window moves with the clock): moved inside, ordered."""
    number = (int, float)
    t_from, t_to = body.get("from"), body.get("to")
    if isinstance(t_from, number) and not isinstance(t_from, bool) and t_from < time.time() - 600:
        body["from"] = t_from = int(time.time()) - 60
    if (isinstance(t_from, number) and isinstance(t_to, number) and not isinstance(t_to, bool)
            and t_to < t_from):
        body["to"] = t_from


# --- the app, its Redis, database, worker and coordinator ------------------------------------

@dataclass
class Live:
    keys: dict[str, str]  # role → API key


@pytest.fixture(scope="module")
def live(tmp_path_factory: pytest.TempPathFactory, embedded_redis: EmbeddedRedis
         ) -> Iterator[Live]:
    tmp = tmp_path_factory.mktemp("openapi")
    redis_url = own_database(embedded_redis.url)
    client = redis.Redis.from_url(redis_url)
    client.flushdb()
    client.close()
    env = cluster_env(tmp, redis_url, workers=1, GEOSWARM_BALANCE_PERIOD_S="15")
    procs: list[subprocess.Popen[bytes]] = []
    with pytest.MonkeyPatch.context() as mp:
        for name, value in env.items():
            mp.setenv(name, value)
        settings_ = Settings()
        upgrade_head(settings_)
        try:
            procs.append(_spawn(tmp, "worker", "--id", "w0"))
            procs.append(_spawn(tmp, "coordinator"))
            UNDER_TEST.app = create_app(settings_)
            try:
                served = schemathesis.openapi.from_asgi("/openapi.json", UNDER_TEST)
                assert served.raw_schema == DOCUMENT
                _wait_until("/readyz", "GET", {})
                admin = {"Authorization": f"Bearer {BOOTSTRAP}"}
                _wait_until("/v1/admin/rebalance", "POST", admin, body={})  # the lease is held
                r = schema["/v1/admin/keys"]["POST"].Case(body={"tenant": "conformance"}).call(
                    headers=admin)
                assert r.status_code == 201, r.text
                yield Live(keys={"tenant": r.json()["key"], "admin": BOOTSTRAP})
            finally:
                asgi.shutdown_lifespans()
                UNDER_TEST.stop()
        finally:
            for proc in procs:
                proc.terminate()
            for proc in procs:
                proc.wait(15)


def _spawn(tmp: Path, *args: str) -> subprocess.Popen[bytes]:
    with open(tmp / f"{args[0]}.log", "ab") as log:
        return subprocess.Popen([sys.executable, "-m", "app.cli", *args], env=dict(os.environ),
                                cwd=ROOT, stdout=log, stderr=subprocess.STDOUT)


def _wait_until(path: str, method: str, headers: dict[str, str], timeout: float = 30,
                **case: Any) -> None:
    """Until the operation answers 2xx: the worker has published a plan, the coordinator holds
    the lease."""
    deadline = time.monotonic() + timeout
    while True:
        r = schema[path][method].Case(**case).call(headers=headers)
        if r.status_code < 300:
            return
        if time.monotonic() > deadline:
            raise TimeoutError(f"{method} {path} still answers {r.status_code}: {r.text}")
        time.sleep(0.1)


# --- the document itself ---------------------------------------------------------------------

def body_validator(path: str, media_type: str = "application/json"
                   ) -> jsonschema_rs.Draft202012Validator:
    content = DOCUMENT["paths"][path]["post"]["requestBody"]["content"]
    return jsonschema_rs.Draft202012Validator(
        {**content[media_type]["schema"], "components": DOCUMENT["components"]})


RANGE = {"type": "range", "bbox": [-74.02, 40.70, -73.93, 40.80], "keywords": ["coffee", "tea"],
         "match": "any", "ttl_s": 3600}
CIRCLE = {"type": "range", "circle": {"lon": -73.985, "lat": 40.758, "radius_m": 500}}


@pytest.mark.parametrize(("body", "valid"), [
    (RANGE, True), (CIRCLE, True), ({**CIRCLE, "bbox": None, "detect": "enter"}, True),
    ({"type": "keyword", "keywords": ["earthquake", "tokyo"], "match": "all"}, True),
    ({"type": "knn", "point": [-73.985, 40.758], "k": 5, "keywords": ["taxi"]}, True),
    ({"type": "range"}, False), ({**RANGE, "circle": CIRCLE["circle"]}, False),
    ({**RANGE, "bbox": [-181, 0, 0, 1]}, False), ({**RANGE, "bbox": [0, 0, 1]}, False),
    ({**CIRCLE, "circle": {"lon": 0, "lat": 0, "radius_m": 0.5}}, False),
    ({**RANGE, "detect": []}, False), ({**RANGE, "ttl_s": 59}, False),
    ({**RANGE, "window": 5}, False), ({"type": "keyword"}, False),
    ({"type": "keyword", "keywords": [f"k{i}" for i in range(17)]}, False),
    ({"type": "keyword", "keywords": ["a"], "detect": ["enter"]}, False),
    ({"type": "knn", "point": [0, 91], "k": 5}, False), ({"type": "knn", "point": [0, 0]}, False),
    ({"type": "knn", "point": [0, 0], "k": 1001}, False), ({"type": "polygon"}, False),
])
def test_subscription_schema_is_the_servers(body: dict[str, Any], valid: bool) -> None:
    """API.md's SUBSCRIPTION shapes, and what the server refuses, as the document says them."""
    assert body_validator("/v1/subscriptions").is_valid(body) == valid
    assert body_validator("/v1/subscriptions/batch").is_valid({"subscriptions": [body]}) == valid


def test_the_document() -> None:
    components = DOCUMENT["components"]["schemas"]
    refs = set(re.findall(r'"#/components/schemas/([^"]+)"', json.dumps(DOCUMENT)))
    assert refs <= set(components), refs - set(components)
    assert {"RangeBBoxSubscription", "RangeCircleSubscription", "Error",
            "ValidationErrorBody"} <= set(components)
    assert not {"HTTPValidationError", "ValidationError"} & set(components)
    objects = DOCUMENT["paths"]["/v1/objects"]["post"]["requestBody"]["content"]
    assert set(objects) == {"application/json", "application/x-ndjson"}
    ndjson = body_validator("/v1/objects", "application/x-ndjson")
    assert ndjson.is_valid([{"lon": 1, "lat": 2}]) and not ndjson.is_valid([{"lon": 1}])
    for path, item in DOCUMENT["paths"].items():
        for method, operation in item.items():
            responses = operation["responses"]
            if path.startswith("/v1/"):
                assert {"401", "429", "503"} <= set(responses), (method, path)
                assert operation["security"] == [{"bearer": []}]
                assert ("403" in responses) == path.startswith("/v1/admin/"), (method, path)
                assert ("400" in responses) == ("requestBody" in operation), (method, path)
            for status in ("429", "503"):
                if status in responses:
                    assert responses[status]["headers"]["Retry-After"]["required"]
            for status, response in responses.items():
                if status.startswith(("4", "5")) and path != "/readyz":
                    body = response["content"]["application/json"]["schema"]["$ref"]
                    assert body.endswith("/ValidationErrorBody" if status == "422" else "/Error")
    # Only what the routes can answer: a plain string path parameter never fails validation.
    assert "422" not in DOCUMENT["paths"]["/v1/subscriptions/{sub_id}"]["get"]["responses"]
    assert "422" in DOCUMENT["paths"]["/v1/subscriptions/{sub_id}/matches"]["get"]["responses"]


# --- each error, triggered -------------------------------------------------------------------

DOCUMENTED = [status_code_conformance, content_type_conformance, response_headers_conformance,
              response_schema_conformance]


def send(method: str, path: str, key: str | None, body: bytes | None = None,
         app: ASGIApp = UNDER_TEST) -> requests.Response:
    """A request as a client could send it (malformed bodies included), in-process."""
    headers = {"Content-Type": "application/json"}
    if key is not None:
        headers["Authorization"] = f"Bearer {key}"
    with asgi.get_client(app) as client:
        return client.request(method, path, data=body, headers=headers)


def assert_documented(method: str, path: str, response: requests.Response, status: int) -> None:
    """The answer has the status expected, and it is one the document describes for the
    operation: status, content type, headers (Retry-After) and body."""
    assert response.status_code == status, response.text
    schema[template_of(path)][method].Case().validate_response(response, checks=DOCUMENTED)


def template_of(path: str) -> str:
    """The document's path of a request path; as in OpenAPI, a concrete path before a template
    that also matches it."""
    given = path.split("?")[0].split("/")

    def matches(template: str) -> bool:
        parts = template.split("/")
        return len(parts) == len(given) and all(
            p == g or p.startswith("{") for p, g in zip(parts, given, strict=True))

    return min((t for t in DOCUMENT["paths"] if matches(t)), key=lambda t: t.count("{"))


def test_each_error_status_as_documented(live: Live, tmp_path: Path) -> None:
    """Each error the server gives, triggered, is documented with the body it really has."""
    tenant, admin = live.keys["tenant"], live.keys["admin"]
    cases: list[tuple[str, str, str | None, bytes | None, int]] = [
        ("POST", "/v1/subscriptions", tenant, b'{"type": "range", ', 400),
        ("POST", "/v1/objects", tenant, b"", 400),
        ("GET", "/v1/subscriptions", None, None, 401),
        ("DELETE", "/v1/subscriptions/s_1", "not-a-key", None, 401),
        ("GET", "/v1/admin/cluster", tenant, None, 403),
        ("GET", "/v1/subscriptions/s_0", tenant, None, 404),
        ("GET", "/v1/subscriptions/s_0/matches", tenant, None, 404),
        ("DELETE", "/v1/admin/keys/k_0", admin, None, 404),
        ("POST", "/v1/objects", tenant, json.dumps(
            {"objects": [{"lon": 0, "lat": 0}] * 10_001}).encode(), 413),
        ("POST", "/v1/subscriptions", tenant, b" " * (8 * 1024 * 1024 + 1), 413),
        ("POST", "/v1/subscriptions", tenant, b'{"type": "range"}', 422),
        ("GET", "/v1/subscriptions?cursor=not-issued", tenant, None, 422),
    ]
    partition = send("GET", "/v1/admin/partitions", admin).json()["features"][0]["properties"]
    move_home = {"partition": partition["id"], "to": partition["worker"]}
    cases.append(("POST", "/v1/admin/rebalance", admin, json.dumps(move_home).encode(), 409))
    for method, path, key, body, status in cases:
        assert_documented(method, path, send(method, path, key, body), status)
    r = send("POST", "/v1/subscriptions", tenant, b'{"type": "range"}')
    assert r.json()["detail"][0]["loc"] == ["body", "range"]

    # 429 and 503 from an app of their own: a rate limit of one request per second, and a
    # database it cannot open (tmp_path is a directory).
    strained = create_app(Settings(rate_limit_per_s=1, database_url=f"sqlite:///{tmp_path}"))
    try:
        assert_documented("GET", "/v1/subscriptions", send(
            "GET", "/v1/subscriptions", tenant, app=strained), 503)
        for _ in range(3):  # two requests in the same second of the clock
            r = send("GET", "/v1/admin/cluster", admin, app=strained)
            if r.status_code == 429:
                break
        assert_documented("GET", "/v1/admin/cluster", r, 429)
    finally:
        asgi.shutdown_lifespans()


@pytest.mark.parametrize(("method", "path", "allow"), [
    ("PUT", "/v1/subscriptions/s_0", "DELETE, GET"),
    ("POST", "/v1/subscriptions/s_0", "DELETE, GET"),
    ("OPTIONS", "/v1/subscriptions/batch", "POST"),
    ("DELETE", "/v1/subscriptions", "GET, POST"),
    ("POST", "/v1/admin/balancer", "GET, PUT"),
    ("PATCH", "/v1/objects/o_0", "GET"),
])
def test_405_allows_every_method_of_the_path(live: Live, method: str, path: str,
                                             allow: str) -> None:
    r = send(method, path, live.keys["admin"])
    assert r.status_code == 405, r.text
    assert r.headers["allow"] == allow
    assert r.json() == {"detail": "Method Not Allowed"}
    assert allow == ", ".join(sorted(m.upper() for m in DOCUMENT["paths"][template_of(path)]))


# --- generated requests ----------------------------------------------------------------------

def call_and_validate(case: Any, key: str) -> None:
    """Sent with the key, unless the case is one that leaves it out or spoils it on purpose
    (and expects the 401)."""
    as_worded(case)
    negated = case.operation.schema.is_security_param_negated(case)
    case.call_and_validate(headers=None if negated else {"Authorization": f"Bearer {key}"})


@tenant_schema.parametrize()
@CONFORMANCE
def test_as_tenant(case: Any, live: Live) -> None:
    call_and_validate(case, live.keys["tenant"])


@schema.parametrize()
@CONFORMANCE
def test_as_admin(case: Any, live: Live) -> None:
    call_and_validate(case, live.keys["admin"])
