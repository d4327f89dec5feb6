"""API.md, Errors: 413 for a body over max_body_bytes (with or without Content-Length) or a
batch over max_batch, 429 with Retry-After over the rate limit, 503 with Retry-After when Redis
or the database is unavailable (never a 500) — and a rejected request changes nothing. Against
the in-process api; the body limits also (slow) on a real uvicorn, where a refused body may
still be on its way over the socket."""

from __future__ import annotations

import secrets
import time
from collections import Counter
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
import orjson
import pytest
import redis

from app.core.config import Settings
from app.core.redis import EmbeddedRedis, start_embedded_redis
from app.pipeline import names
from tests.app.httpapi import JSON, NDJSON, WORLD, Api, check
from tests.conftest import (
    InProcessServer,
    LiveServer,
    Server,
    auth,
    http_client,
    start_inprocess,
    start_server,
)

MAX_BATCH = 10
MAX_BODY = 64 * 1024
SMALL = {"GEOSWARM_MAX_BATCH": str(MAX_BATCH), "GEOSWARM_MAX_BODY_BYTES": str(MAX_BODY)}


@pytest.fixture(scope="module")
def small(tmp_path_factory: pytest.TempPathFactory, embedded_redis: EmbeddedRedis
          ) -> Iterator[InProcessServer]:
    """The api in-process with a small max_batch and max_body_bytes, and its worker."""
    with start_inprocess(tmp_path_factory.mktemp("small"), embedded_redis.url, **SMALL) as s:
        s.start_worker()
        yield s


@pytest.fixture(scope="module")
def small_live(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LiveServer]:
    """The same limits on a real uvicorn (and its own redis-server: start_server flushes its
    Redis database)."""
    tmp = tmp_path_factory.mktemp("small-live")
    redis_server = start_embedded_redis(Settings(data_dir=tmp / "own"))
    try:
        s = start_server(tmp, redis_server.url, workers=1, **SMALL)
        try:
            yield s
        finally:
            s.stop()
    finally:
        redis_server.stop()


@pytest.fixture
def api(small: InProcessServer) -> Iterator[Api]:
    a = Api(small)
    yield a
    a.close()


def objects(n: int, prefix: str = "o") -> list[dict[str, Any]]:
    return [{"id": f"{prefix}-{i}", "lon": 10.0, "lat": 10.0} for i in range(n)]


def subs(n: int) -> list[dict[str, Any]]:
    return [{"type": "keyword", "keywords": [f"k{i}"]} for i in range(n)]


# --- 413: batch over max_batch --------------------------------------------------------------

def test_object_batch_over_max_batch_is_413_and_stores_nothing(api: Api) -> None:
    sub = api.subscribe({"type": "range", "bbox": WORLD})
    over = objects(MAX_BATCH + 1, "json")
    r = api.post("/v1/objects", {"objects": over})
    assert r.status_code == 413, r.text
    assert isinstance(r.json()["detail"], str)
    nd = objects(MAX_BATCH + 1, "nd")
    r = api.raw("/v1/objects", b"\n".join(orjson.dumps(o) for o in nd), NDJSON)
    assert r.status_code == 413, r.text
    api.assert_only_sentinels(sub["id"], rejected=[o["id"] for o in over + nd])
    # Exactly max_batch is accepted.
    assert len(api.publish(objects(MAX_BATCH, "full"))) == MAX_BATCH


def test_subscription_batch_over_max_batch_is_413_and_stores_nothing(api: Api) -> None:
    r = api.post("/v1/subscriptions/batch", {"subscriptions": subs(MAX_BATCH + 1)})
    assert r.status_code == 413, r.text
    assert api.subscription_ids() == []
    r = api.post("/v1/subscriptions/batch", {"subscriptions": subs(MAX_BATCH)})
    assert r.status_code == 201, r.text
    assert api.subscription_ids() == r.json()["ids"]


# --- 413: body over max_body_bytes ----------------------------------------------------------

def big_objects_body(size: int) -> bytes:
    """A well-formed objects body of about `size` bytes (only its size is wrong)."""
    pad = "x" * 1000
    n = size // 1000 + 1  # each object is over 1 000 bytes
    return orjson.dumps({"objects": [{"id": f"big-{i}", "lon": 10, "lat": 10, "text": pad}
                                     for i in range(n)]})


BIG_BODIES = {
    "/v1/objects": lambda: big_objects_body(MAX_BODY + 1),
    "/v1/subscriptions": lambda: orjson.dumps({"type": "keyword", "keywords": ["a"],
                                               "pad": "x" * MAX_BODY}),
    "/v1/subscriptions/batch": lambda: orjson.dumps({"subscriptions": subs(MAX_BODY // 30)}),
    "/v1/admin/keys": lambda: orjson.dumps({"tenant": "big", "pad": "x" * MAX_BODY}),
}


def chunks(body: bytes, size: int = 4096) -> Iterator[bytes]:
    for i in range(0, len(body), size):
        yield body[i:i + size]


# The body limits in-process, and (slow) under uvicorn, over real sockets.
HARNESSES = ["in-process", pytest.param("uvicorn", marks=pytest.mark.slow)]


@pytest.fixture(params=HARNESSES)
def limits(request: pytest.FixtureRequest) -> Server:
    """The api with the small limits."""
    name = "small" if request.param == "in-process" else "small_live"
    return request.getfixturevalue(name)  # type: ignore[no-any-return]


@pytest.fixture(params=HARNESSES)
def default_limits(request: pytest.FixtureRequest) -> Server:
    """The api with the default limits (`server` is the module's default live server)."""
    name = "inprocess" if request.param == "in-process" else "server"
    return request.getfixturevalue(name)  # type: ignore[no-any-return]


@pytest.fixture
def limits_api(limits: Server) -> Iterator[Api]:
    a = Api(limits)
    yield a
    a.close()


@pytest.mark.parametrize("path", list(BIG_BODIES))
@pytest.mark.parametrize("chunked", [False, True], ids=["content-length", "chunked"])
def test_body_over_max_body_bytes_is_413(limits: Server, limits_api: Api, path: str,
                                         chunked: bool) -> None:
    api = limits_api
    body = BIG_BODIES[path]()
    assert len(body) > MAX_BODY
    key = limits.admin_key if path.startswith("/v1/admin") else api.key
    headers = {**auth(key), "content-type": JSON}
    content: bytes | Iterator[bytes] = chunks(body) if chunked else body
    with http_client(limits, headers) as client:
        r = check(client.post(path, content=content))
        if chunked:
            assert "content-length" not in r.request.headers
            assert r.request.headers["transfer-encoding"] == "chunked"
        assert r.status_code == 413, r.text
        assert isinstance(r.json()["detail"], str)
        assert api.subscription_ids() == []
        for i in range(3):
            assert api.get(f"/v1/objects/big-{i}").status_code == 404
        assert client.get("/healthz").status_code == 200


def test_body_at_max_body_bytes_is_not_413(limits_api: Api) -> None:
    api = limits_api
    body = orjson.dumps({"objects": objects(1, "fits")})
    body = body[:-1] + b" " * (MAX_BODY - len(body)) + b"}"
    assert len(body) == MAX_BODY
    assert api.raw("/v1/objects", body).status_code == 202
    r = api.client.post("/v1/objects", content=chunks(body), headers={"content-type": JSON})
    assert r.status_code == 202, r.text


def test_unauthenticated_big_body_is_rejected(limits: Server) -> None:
    with http_client(limits) as client:
        r = client.post("/v1/objects", content=big_objects_body(MAX_BODY * 4),
                        headers={"content-type": JSON})
    assert r.status_code in (401, 413)


def test_default_max_body_bytes_is_8_mib(default_limits: Server) -> None:
    """The module's default server: 8 MiB + 1 byte is refused, also chunked."""
    key = default_limits.new_key()
    body = big_objects_body(8 * 1024 * 1024 + 1)
    assert len(body) > 8 * 1024 * 1024
    with http_client(default_limits, {**auth(key), "content-type": JSON}) as client:
        for content in (body, chunks(body, 64 * 1024)):
            r = check(client.post("/v1/objects", content=content, timeout=60))
            assert r.status_code == 413, r.text
        assert client.get("/v1/objects/big-0").status_code == 404


# --- 429 --------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def limited(tmp_path_factory: pytest.TempPathFactory, embedded_redis: EmbeddedRedis
            ) -> Iterator[InProcessServer]:
    with start_inprocess(tmp_path_factory.mktemp("limited"), embedded_redis.url,
                         GEOSWARM_RATE_LIMIT_PER_S="5") as s:
        yield s


def test_rate_limit_is_429_with_retry_after(limited: InProcessServer) -> None:
    key, other = limited.new_key(), limited.new_key()
    with limited.http(auth(key)) as c:
        created: list[str] = []
        refused = None
        for i in range(500):  # 5/s: a burst of requests soon crosses the limit
            r = check(c.post("/v1/subscriptions", json={"type": "keyword",
                                                        "keywords": [f"k{i}"]}))
            if r.status_code == 201:
                created.append(r.json()["id"])
                continue
            refused = r
            break
        assert refused is not None, "the rate limit never answered 429"
        assert refused.status_code == 429, refused.text
        retry = refused.headers["retry-after"]
        assert retry.isdigit() and int(retry) >= 1
        assert isinstance(refused.json()["detail"], str)
        # Another key is not limited by this one.
        with limited.http(auth(other)) as o:
            r = o.get("/v1/subscriptions")
        assert r.status_code == 200
        # The refused request stored nothing: once allowed again, the list holds exactly the
        # subscriptions that were answered 201.
        deadline = time.monotonic() + 30
        while True:
            r = check(c.get("/v1/subscriptions"))
            if r.status_code == 200:
                break
            assert r.status_code == 429
            assert time.monotonic() < deadline, "still rate limited"
            time.sleep(0.2)
        assert [s["id"] for s in r.json()["items"]] == created


# --- 503: Redis down ------------------------------------------------------------------------------

def test_redis_down_is_503_never_500(tmp_path: Path) -> None:
    redis_server = start_embedded_redis(Settings(data_dir=tmp_path / "own"))
    port = int(redis_server.url.rsplit(":", 1)[1].split("/")[0])
    restarted: EmbeddedRedis | None = None
    try:
        # Rate limiting off, so that requests reach the code that uses Redis for its own work.
        with start_inprocess(tmp_path, redis_server.url, GEOSWARM_RATE_LIMIT_PER_S="0") as s:
            api = Api(s)
            sub = api.subscribe({"type": "range", "bbox": WORLD})
            api.publish([{"id": "before", "lon": 10, "lat": 10}])
            redis_server.stop()
            for method, path, body in [
                ("POST", "/v1/objects", {"objects": [{"id": "during", "lon": 10, "lat": 10}]}),
                ("GET", "/v1/objects/before", None),
                ("POST", "/v1/subscriptions", {"type": "keyword", "keywords": ["a"]}),
                ("POST", "/v1/subscriptions/batch", {"subscriptions": subs(2)}),
                ("DELETE", f"/v1/subscriptions/{sub['id']}", None),
                ("GET", f"/v1/subscriptions/{sub['id']}/matches", None),
            ]:
                r = api.client.request(method, path, json=body)
                assert r.status_code == 503, (method, path, r.status_code, r.text)
                assert r.headers["retry-after"].isdigit(), r.headers
            with s.http() as anonymous:
                r = anonymous.get("/readyz")
                assert r.status_code == 503 and r.headers["retry-after"].isdigit()
                assert r.json()["ready"] is False
                # The database still answers: the refused creates and the refused delete
                # changed nothing there.
                assert api.subscription_ids() == [sub["id"]]
                # The api still serves (in-process there is no api process that could die).
                assert anonymous.get("/healthz").status_code == 200
                r = anonymous.get("/v1/admin/cluster", headers=s.admin())
                assert r.status_code == 503
            # Redis back (its AOF reloaded): the api serves again, without a restart.
            restarted = start_embedded_redis(Settings(data_dir=tmp_path / "own"), port=port)
            deadline = time.monotonic() + 30
            while True:
                r = api.client.post("/v1/objects",
                                    json={"objects": [{"id": "after", "lon": 10, "lat": 10}]})
                if r.status_code == 202 or time.monotonic() > deadline:
                    break
                assert r.status_code == 503, r.text
                time.sleep(0.2)
            assert r.status_code == 202, r.text
            assert api.get("/v1/objects/after").status_code == 200
            assert api.get("/v1/objects/during").status_code == 404
            assert api.get("/v1/objects/before").status_code == 200
            api.close()
    finally:
        redis_server.stop()
        if restarted is not None:
            restarted.stop()


# --- 503: database down ---------------------------------------------------------------------------

def test_database_down_is_503_never_500(tmp_path: Path, embedded_redis: EmbeddedRedis) -> None:
    """An api whose database is a closed port: readyz and every authenticated request 503."""
    # Neither migrated (there is no database) nor with a plan (there is no worker).
    with start_inprocess(tmp_path, embedded_redis.url,
                         database_url="postgresql://postgres@127.0.0.1:1/x",
                         migrate=False, plan=False) as s, s.http() as client:
        assert client.get("/healthz").status_code == 200
        r = client.get("/readyz")
        assert r.status_code == 503, r.text
        assert r.headers["retry-after"].isdigit()
        assert r.json()["checks"]["database"] != "ok"
        tenant_key = auth("gs_" + secrets.token_urlsafe(32))
        requests = [
            ("POST", "/v1/objects", {"objects": [{"lon": 1, "lat": 1}]}),
            ("GET", "/v1/objects/x", None),
            ("POST", "/v1/subscriptions", {"type": "keyword", "keywords": ["a"]}),
            ("POST", "/v1/subscriptions/batch", {"subscriptions": subs(2)}),
            ("GET", "/v1/subscriptions", None),
            ("GET", "/v1/subscriptions/s_1", None),
            ("DELETE", "/v1/subscriptions/s_1", None),
            ("GET", "/v1/subscriptions/s_1/matches", None),
            ("POST", "/v1/admin/keys", {"tenant": "acme"}),
            ("DELETE", "/v1/admin/keys/k_1", None),
        ]
        for method, path, body in requests:
            # Any key needs the database to be checked: 503, not 401.
            r = client.request(method, path, json=body, headers=tenant_key)
            assert r.status_code == 503, (method, path, r.status_code, r.text)
            assert r.headers["retry-after"].isdigit()
        # The bootstrap admin key needs no database lookup; what it asks for still does (or
        # the live pipeline, which has no plan without a worker): 503 as well.
        for method, path, body in requests:
            if path == "/v1/objects/x":
                continue  # a Redis read: answers 404 without the database
            r = client.request(method, path, json=body, headers=s.admin())
            assert r.status_code == 503, (method, path, r.status_code, r.text)
            assert r.headers["retry-after"].isdigit()
        # Validation still comes first: a bad body is a 422 / 400, not a 503.
        r = client.post("/v1/subscriptions", content=b"{",
                        headers={**s.admin(), "content-type": JSON})
        assert r.status_code == 400
        # The api still serves (in-process there is no api process that could die).
        assert client.get("/healthz").status_code == 200


def test_each_request_is_counted_once_held_or_looked_up(limited: InProcessServer) -> None:
    """A key this process holds is counted in the round trip that reads the revocation token;
    after a revocation (a new token) it is looked up in SQL again and still counted once."""
    with limited.http(limited.admin()) as a:
        r = a.post("/v1/admin/keys", json={"tenant": "counted"})
    key, key_id = r.json()["key"], r.json()["id"]
    client = redis.Redis.from_url(limited.redis_url)
    with limited.http(auth(key)) as c:
        checked = 0
        for attempt in range(5):
            # a revocation elsewhere: the first request looks the key up again, the next two
            # find it held
            client.set(names.KEYS_TOKEN, f"other-{attempt}")
            window = int(time.time())
            if time.time() - window > 0.5:  # room for three requests in this second
                time.sleep(window + 1 - time.time())
                window += 1
            counts = []
            for _ in range(3):
                assert check(c.get("/v1/subscriptions")).status_code == 200
                counts.append(int(client.get(names.rate_key(key_id, window)) or 0))
            if int(time.time()) != window:
                continue  # the second ended among them
            assert counts == [1, 2, 3], (attempt, counts)
            checked += 1
            time.sleep(window + 1 - time.time())  # a fresh second: under the limit of 5
        assert checked >= 3


# --- a query's key check riding on its first round trip -----------------------------------------

def _query(s: InProcessServer, key: str) -> httpx.Response:
    """A snapshot query (wait_s 0: the worker of the plan does not run here, so the answer is
    202), on a client of its own (the requests of a burst overlap)."""
    with s.http(auth(key)) as c:
        return c.post("/v1/queries", json={"type": "count", "bbox": [-10, -10, 10, 10],
                                             "wait_s": 0})


def test_queries_whose_key_check_rides_stop_at_the_rate_limit(limited: InProcessServer) -> None:
    """Queries of a key this process holds are sent before their key check returns (it rides
    on their first round trip, `deps.ride_key_check`): a burst of them at the start of a second
    all ride, and all but the first `rate_limit_per_s` are refused 429 once it returns, their
    answers not given."""
    key = limited.new_key()
    assert _query(limited, key).status_code == 202  # held from now on
    for _ in range(3):
        window = int(time.time())
        time.sleep(window + 1.02 - time.time())  # a fresh second: nothing counted in it yet
        with ThreadPoolExecutor(20) as pool:
            answers = list(pool.map(lambda _: _query(limited, key), range(20)))
        if int(time.time()) == window + 1:
            break  # (else the second ended during the burst: again)
    codes = Counter(r.status_code for r in answers)
    assert set(codes) <= {202, 429}, codes
    assert 1 <= codes[202] <= 5, codes  # GEOSWARM_RATE_LIMIT_PER_S=5
    refused = next(r for r in answers if r.status_code == 429)
    assert refused.headers["retry-after"].isdigit() and "rate limit" in refused.json()["detail"]


def test_a_revoked_key_is_refused_though_its_key_check_rides(limited: InProcessServer) -> None:
    """A query with a key this process holds rides its key check on its first round trip; the
    key revoked meanwhile, it is refused 401 (the answer made for it not given), and a key of
    the same tenant left valid, whose held token the revocation made stale, is checked in full
    and answered."""
    with limited.http(limited.admin()) as a:
        made = [a.post("/v1/admin/keys", json={"tenant": "riding"}).json() for _ in range(2)]
    (revoked_id, revoked), (_, kept) = ((m["id"], m["key"]) for m in made)
    for key in (revoked, kept):
        for _ in range(2):  # the second rides
            assert _query(limited, key).status_code == 202
    with limited.http(limited.admin()) as a:
        assert a.delete(f"/v1/admin/keys/{revoked_id}").status_code == 204
    r = _query(limited, revoked)
    assert r.status_code == 401, r.text
    assert "results" not in r.json() and "id" not in r.json()
    assert _query(limited, kept).status_code == 202
    assert _query(limited, revoked).status_code == 401
