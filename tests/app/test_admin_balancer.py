"""API.md, Admin: the partitions as GeoJSON, the balancer's configuration and state, manual
rebalancing through the coordinator (app/pipeline/control.py) and the operator dashboard,
against the in-process api. The coordinator is a fake one in a thread of the test that holds
the lease and answers the admin requests per protocol; the workers' heartbeats and reports, the
balancer state and the rounds table are written by the test."""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import httpx
import pytest
import redis
from sqlalchemy import delete

from app.core.config import Settings
from app.core.db import make_engine, make_sessionmaker
from app.core.redis import EmbeddedRedis
from app.geo.balance import DecisionPointer, Stage
from app.geo.index import Plan
from app.models import BalancerRound
from app.pipeline import names
from tests.app.httpapi import Api, check, locs, names_field
from tests.conftest import InProcessServer, auth, start_inprocess

# A small grid over New York with three workers: the initial plan (SWARM §4.1.1) halves the
# 5x2 grid into p0 = x0..1, p1 = x2 (one cell wide) and p2 = x3..4, all two rows tall.
BOUNDS = (-74.3, 40.5, -73.7, 40.9)
GRID = (5, 2)
TIMEOUT_S = 1.5  # GEOSWARM_ADMIN_REBALANCE_TIMEOUT_S of this module's server
WORKERS = ["w0", "w1", "w2"]
CONTROL_KEYS = [names.LEASE_KEY, names.REQUESTS_KEY, names.BALANCER_CONFIG, names.BALANCER_STATE,
                names.STATS_KEY]

ENDPOINTS = [
    ("GET", "/v1/admin/partitions", None),
    ("GET", "/v1/admin/balancer", None),
    ("PUT", "/v1/admin/balancer", {"enabled": False}),
    ("POST", "/v1/admin/rebalance", {}),
    ("POST", "/v1/admin/rebalance", {"partition": "p0", "to": "w1"}),
    ("POST", "/v1/admin/rebalance", {"split": "p0", "axis": "y", "at": 0}),
]


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory, embedded_redis: EmbeddedRedis
           ) -> Iterator[InProcessServer]:
    """The api in-process with a plan over three workers, alive as far as the api can tell:
    their heartbeats (as the executors write them, fresh for the module's duration)."""
    with start_inprocess(tmp_path_factory.mktemp("balancer"), embedded_redis.url,
                         GEOSWARM_WORKERS=",".join(WORKERS),
                         GEOSWARM_BOUNDS=",".join(map(str, BOUNDS)),
                         GEOSWARM_GRID="x".join(map(str, GRID)),
                         GEOSWARM_ADMIN_REBALANCE_TIMEOUT_S=str(TIMEOUT_S)) as s:
        client = redis.Redis.from_url(s.redis_url)
        until = time.time() + 3600
        client.hset(names.WORKERS_KEY, mapping={
            w: json.dumps({"id": w, "pid": 1, "host": "h", "heartbeat": until}) for w in WORKERS})
        client.close()
        yield s


@pytest.fixture(scope="module")
def rdb(server: InProcessServer) -> Iterator[redis.Redis]:
    client = redis.Redis.from_url(server.redis_url)
    yield client
    client.close()


@pytest.fixture(scope="module")
def sessions(server: InProcessServer) -> Iterator[Any]:
    engine = make_engine(Settings(database_url=server.env["GEOSWARM_DATABASE_URL"]))
    yield make_sessionmaker(engine)
    engine.dispose()


@pytest.fixture(autouse=True)
def clean(rdb: redis.Redis, sessions: Any) -> Iterator[None]:
    """Each test starts without coordinator, balancer state, reports or rounds."""

    def wipe() -> None:
        rdb.delete(*CONTROL_KEYS)
        rdb.hdel(names.WORKERS_KEY, "w-dead", "w-new")
        with sessions() as session:
            session.execute(delete(BalancerRound))
            session.commit()

    wipe()
    yield
    wipe()


@pytest.fixture
def admin(server: InProcessServer) -> Iterator[Api]:
    a = Api(server, key=server.admin_key, tenant="admin")
    yield a
    a.close()


def request(server: InProcessServer, method: str, path: str, body: Any = None,
            headers: dict[str, str] | None = None) -> httpx.Response:
    with server.http() as client:
        return check(client.request(method, path, json=body, headers=headers or server.admin()))


def plan(rdb: redis.Redis) -> Plan:
    raw = rdb.get(names.PLAN_KEY)
    assert raw is not None
    return Plan.from_json(raw)


class FakeCoordinator:
    """Holds the lease and answers admin requests with `answer(request)` (None: no reply)."""

    def __init__(self, url: str, answer: Callable[[dict[str, Any]], dict[str, Any] | None]
                 ) -> None:
        self.redis = redis.Redis.from_url(url)
        self.answer = answer
        self.requests: list[dict[str, Any]] = []
        self._wake = "test:fake-coordinator:wake"  # ends the BLPOP at once on exit
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="fake-coordinator", daemon=True)

    def __enter__(self) -> FakeCoordinator:
        self.redis.set(names.LEASE_KEY, "fake-coordinator", px=60_000)
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self.redis.rpush(self._wake, b"")
        self._thread.join(5)
        self.redis.delete(names.LEASE_KEY, self._wake)
        self.redis.close()

    def _run(self) -> None:
        while not self._stop.is_set():
            got = self.redis.blpop([names.REQUESTS_KEY, self._wake], timeout=0.1)
            if got is None or got[0] == self._wake.encode():
                continue
            req = json.loads(got[1])
            self.requests.append(req)
            reply = self.answer(req)
            if reply is not None:
                self.redis.rpush(names.reply_key(req["id"]), json.dumps(reply))


def accept(req: dict[str, Any]) -> dict[str, Any]:
    """What a coordinator answers to a request it carried out."""
    action = {"round": "none", "move": "move", "split": "split"}[req["kind"]]
    details = {k: v for k, v in req.items() if k not in ("id", "kind")}
    return {"status": 202, "round": 41, "action": action, "details": details}


# --- authentication ------------------------------------------------------------------------

@pytest.mark.parametrize(("method", "path", "body"), ENDPOINTS,
                         ids=[f"{m} {p} {b}" for m, p, b in ENDPOINTS])
def test_admin_key_required(server: InProcessServer, rdb: redis.Redis, method: str, path: str,
                            body: Any) -> None:
    tenant = server.new_key()
    with FakeCoordinator(server.redis_url, accept) as coordinator:
        for headers, status in ((None, 401), (auth("gs_" + "x" * 43), 401),
                                (auth(tenant), 403)):
            with server.http() as client:
                r = check(client.request(method, path, json=body, headers=headers))
            assert r.status_code == status, (headers, r.text)
            assert isinstance(r.json()["detail"], str)
        time.sleep(0.3)
        assert coordinator.requests == []  # nothing reached the coordinator
    assert rdb.get(names.BALANCER_CONFIG) is None  # and nothing was changed


# --- GET /v1/admin/partitions ------------------------------------------------------------------

def report(worker: str, round_no: int, r: float, parts: list[dict[str, Any]]) -> bytes:
    return json.dumps({"worker": worker, "round": round_no, "at": time.time(),
                       "num": sum(p["num"] for p in parts), "R": r, "partitions": parts}).encode()


def test_partitions_geojson(server: InProcessServer, rdb: redis.Redis) -> None:
    current = plan(rdb)
    ids = [p.id for p in current.partitions]
    assert len(ids) == 3
    first, second, third = ids
    # Round 5: the first two partitions' owners report, R(S) = 30 + 10; an old report of
    # round 4 neither counts in R(S) nor hides the newer statistics of `first`.
    rdb.hset(names.STATS_KEY, mapping={
        "w0": report("w0", 5, 30.0, [{"id": first, "N": 100, "Q": 4, "R": 30, "num": 12.0}]),
        "w1": report("w1", 5, 10.0, [{"id": second, "N": 7, "Q": 2, "R": 10, "num": 3.0}]),
        "w-gone": report("w-gone", 4, 99.0, [{"id": first, "N": 1, "Q": 1, "R": 1, "num": 1.0}]),
    })
    r = request(server, "GET", "/v1/admin/partitions")
    assert r.status_code == 200, r.text
    fc = r.json()
    assert fc["type"] == "FeatureCollection"
    assert fc["plan_version"] == current.version
    assert fc["r_s"] == pytest.approx(40.0)
    assert fc["bbox"] == pytest.approx(list(BOUNDS))
    assert [f["properties"]["id"] for f in fc["features"]] == ids
    w, h = (BOUNDS[2] - BOUNDS[0]) / GRID[0], (BOUNDS[3] - BOUNDS[1]) / GRID[1]
    expected_stats = {first: (100, 4, 30, 12.0), second: (7, 2, 10, 3.0), third: (0, 0, 0, 0.0)}
    for f, p in zip(fc["features"], current.partitions, strict=True):
        assert f["type"] == "Feature"
        lon0, lat0 = BOUNDS[0] + p.x0 * w, BOUNDS[1] + p.y0 * h
        lon1, lat1 = BOUNDS[0] + (p.x1 + 1) * w, BOUNDS[1] + (p.y1 + 1) * h
        ring = f["geometry"]["coordinates"]
        assert f["geometry"]["type"] == "Polygon" and len(ring) == 1
        expected = [(lon0, lat0), (lon1, lat0), (lon1, lat1), (lon0, lat1), (lon0, lat0)]
        assert len(ring[0]) == 5  # closed, counter-clockwise
        for got, want in zip(ring[0], expected, strict=True):
            assert got == pytest.approx(list(want))
        assert f["bbox"] == pytest.approx([lon0, lat0, lon1, lat1])
        assert ring[0][0] == ring[0][-1]
        props = f["properties"]
        assert props["worker"] == p.worker and props["parent"] == p.parent
        assert props["cells"] == p.area == (p.x1 - p.x0 + 1) * (p.y1 - p.y0 + 1)
        assert (props["x0"], props["y0"], props["x1"], props["y1"]) == (p.x0, p.y0, p.x1, p.y1)
        n, q, rr, num = expected_stats[p.id]
        assert (props["N"], props["Q"], props["R"]) == (n, q, rr)
        assert props["cost"] == pytest.approx(num / 40.0)


def test_partitions_without_reports(server: InProcessServer, rdb: redis.Redis) -> None:
    r = request(server, "GET", "/v1/admin/partitions")
    assert r.status_code == 200, r.text
    fc = r.json()
    assert fc["r_s"] == 0 and len(fc["features"]) == len(plan(rdb).partitions)
    for f in fc["features"]:
        assert {k: f["properties"][k] for k in ("N", "Q", "R", "cost")} == {
            "N": 0, "Q": 0, "R": 0, "cost": 0}
    # Garbage in the reports hash is ignored, never a 500.
    rdb.hset(names.STATS_KEY, mapping={"w0": b"not json", "w1": b"[1, 2]",
                                   "w2": json.dumps({"round": 1, "R": "x", "partitions": 5})})
    r = request(server, "GET", "/v1/admin/partitions")
    assert r.status_code == 200, r.text
    assert r.json()["r_s"] == 0


# --- GET / PUT /v1/admin/balancer ---------------------------------------------------------------

def test_balancer_defaults(server: InProcessServer) -> None:
    r = request(server, "GET", "/v1/admin/balancer")
    assert r.status_code == 200, r.text
    body = r.json()
    # start_inprocess sets GEOSWARM_BALANCE_PERIOD_S=2; partitioning defaults to swarm.
    assert {k: body[k] for k in ("enabled", "period_s", "beta")} == {
        "enabled": True, "period_s": 2.0, "beta": 20}
    assert body["stage"] == "START" and body["last_decision"] is None
    assert body["leader"] is None and body["round"] is None and body["rounds"] == []


def test_balancer_state_and_rounds(server: InProcessServer, rdb: redis.Redis,
                                   sessions: Any) -> None:
    pointer = DecisionPointer(beta=20)
    pointer.step(5.0)  # R(S) went up: Start -> Good
    assert pointer.stage == Stage.GOOD
    rdb.set(names.BALANCER_STATE, json.dumps({
        "pointer": pointer.to_dict(), "round": 24, "last_decision": "rebalance", "r_s": 5.0,
        "costs": {"w0": 0.75, "w1": 0.25}, "leader": "c-1"}))
    rdb.set(names.LEASE_KEY, "c-1")
    t0 = 1_763_800_000.0
    with sessions() as session:
        for n in range(25):
            session.add(BalancerRound(
                round=n, started_at=t0 + n, kind="auto" if n % 2 else "manual", r_s=float(n),
                costs={"w0": 0.5, "w1": 0.5}, stage="GOOD", decision="rebalance",
                mh="w0" if n % 3 else None, ml="w1", action="move" if n % 2 else "none",
                details={"partitions": [f"p{n}"]}, plan_version=n + 1, duration_ms=1.5 * n))
        session.commit()
    body = request(server, "GET", "/v1/admin/balancer").json()
    assert body["stage"] == "GOOD" and body["last_decision"] == "rebalance"
    assert body["leader"] == "c-1" and body["round"] == 24
    assert [row["round"] for row in body["rounds"]] == list(range(24, 4, -1))  # newest 20
    assert body["rounds"][0] == {
        "round": 24, "time": t0 + 24, "kind": "manual", "r_s": 24.0,
        "costs": {"w0": 0.5, "w1": 0.5}, "stage": "GOOD", "decision": "rebalance", "mh": None,
        "ml": "w1", "action": "none", "details": {"partitions": ["p24"]}, "plan_version": 25,
        "duration_ms": 36.0}
    # The cluster view's costs are the coordinator's, 0 for a worker without one.
    workers = {w["id"]: w for w in request(server, "GET", "/v1/admin/cluster").json()["workers"]}
    assert (workers["w0"]["cost"], workers["w1"]["cost"], workers["w2"]["cost"]) == (
        0.75, 0.25, 0.0)


def test_put_balancer_merges(server: InProcessServer, rdb: redis.Redis) -> None:
    r = request(server, "PUT", "/v1/admin/balancer", {"enabled": False})
    assert r.status_code == 200, r.text
    assert {k: r.json()[k] for k in ("enabled", "period_s", "beta", "stage")} == {
        "enabled": False, "period_s": 2.0, "beta": 20, "stage": "START"}
    assert json.loads(rdb.get(names.BALANCER_CONFIG) or b"") == {
        "enabled": False, "period_s": 2.0, "beta": 20}
    r = request(server, "PUT", "/v1/admin/balancer", {"period_s": 5, "beta": 7})
    assert r.status_code == 200, r.text
    expected = {"enabled": False, "period_s": 5, "beta": 7}
    assert json.loads(rdb.get(names.BALANCER_CONFIG) or b"") == expected
    got = request(server, "GET", "/v1/admin/balancer").json()
    assert {k: got[k] for k in expected} == expected
    assert got == r.json()
    # An empty PUT changes nothing and answers the current state.
    r = request(server, "PUT", "/v1/admin/balancer", {})
    assert r.status_code == 200 and {k: r.json()[k] for k in expected} == expected
    r = request(server, "PUT", "/v1/admin/balancer", {"enabled": True, "period_s": 0.1,
                                                      "beta": 1000})
    assert {k: r.json()[k] for k in expected} == {"enabled": True, "period_s": 0.1, "beta": 1000}


BAD_CONFIG = [
    ({"enabled": "false"}, "enabled"), ({"enabled": 1}, "enabled"), ({"enabled": None}, "enabled"),
    ({"period_s": "5"}, "period_s"), ({"period_s": True}, "period_s"),
    ({"period_s": 0.09}, "period_s"), ({"period_s": 0}, "period_s"),
    ({"period_s": -1}, "period_s"), ({"period_s": 3600.5}, "period_s"),
    ({"period_s": None}, "period_s"), ({"period_s": [5]}, "period_s"),
    ({"beta": 0}, "beta"), ({"beta": 1001}, "beta"), ({"beta": 2.0}, "beta"),
    ({"beta": 2.5}, "beta"), ({"beta": True}, "beta"), ({"beta": "3"}, "beta"),
    ({"beta": None}, "beta"), ({"enabled": True, "betta": 3}, "betta"),
    ({"enabled": True, "beta": 0}, "beta"),
]


@pytest.mark.parametrize(("body", "field"), BAD_CONFIG, ids=[json.dumps(b) for b, _ in BAD_CONFIG])
def test_put_balancer_validation(server: InProcessServer, rdb: redis.Redis, body: dict[str, Any],
                                 field: str) -> None:
    before = json.dumps({"enabled": True, "period_s": 3.0, "beta": 9}).encode()
    rdb.set(names.BALANCER_CONFIG, before)
    r = request(server, "PUT", "/v1/admin/balancer", body)
    assert names_field(r, field), r.text
    assert rdb.get(names.BALANCER_CONFIG) == before


@pytest.mark.parametrize("raw", [b'{"period_s": NaN}', b'{"period_s": Infinity}',
                                 b'{"period_s": 1e999}', b"", b"{", b"[]", b'"enabled"'])
def test_put_balancer_malformed(admin: Api, rdb: redis.Redis, raw: bytes) -> None:
    r = admin.raw("/v1/admin/balancer", raw, method="PUT")
    assert r.status_code in (400, 422), r.text
    assert rdb.get(names.BALANCER_CONFIG) is None


# --- POST /v1/admin/rebalance -------------------------------------------------------------------

def test_rebalance_without_coordinator_is_503(server: InProcessServer, rdb: redis.Redis) -> None:
    for body in ({}, {"partition": "p0", "to": "w1"}, {"split": "p0", "axis": "y", "at": 0}):
        r = request(server, "POST", "/v1/admin/rebalance", body)
        assert r.status_code == 503, r.text
        assert int(r.headers["retry-after"]) >= 1
        assert "no coordinator is running" in r.json()["detail"]
    assert rdb.llen(names.REQUESTS_KEY) == 0  # nothing was queued for a later coordinator


SHAPE_ERRORS = [
    ({"x": 1}, "x"), ({"round": True}, "round"), ({"partition": "p0"}, "to"),
    ({"to": "w1"}, "partition"), ({"partition": 7, "to": "w1"}, "partition"),
    ({"partition": "p0", "to": ["w1"]}, "to"), ({"partition": "", "to": "w1"}, "partition"),
    ({"partition": "p0", "to": "w1", "extra": 1}, "extra"),
    ({"partition": "p0", "to": "w1", "axis": "x"}, "partition"),  # mixed shapes
    ({"split": "p0", "axis": "y", "at": 0, "to": "w1"}, "to"),
    ({"split": "p0", "axis": "z", "at": 0}, "axis"),
    ({"split": "p0", "axis": "X", "at": 0}, "axis"),
    ({"split": "p0", "axis": "y", "at": True}, "at"),
    ({"split": "p0", "axis": "y", "at": "0"}, "at"),
    ({"split": "p0", "axis": "y", "at": 0.0}, "at"),
    ({"split": "p0", "axis": "y", "at": -1}, "at"),
    ({"split": "p0", "axis": "y"}, "at"), ({"axis": "y", "at": 0}, "split"),
    ({"split": None, "axis": "y", "at": 0}, "split"),
]


@pytest.mark.parametrize(("body", "field"), SHAPE_ERRORS,
                         ids=[json.dumps(b) for b, _ in SHAPE_ERRORS])
def test_rebalance_shape_errors(server: InProcessServer, body: dict[str, Any], field: str) -> None:
    with FakeCoordinator(server.redis_url, accept) as coordinator:
        r = request(server, "POST", "/v1/admin/rebalance", body)
        assert names_field(r, field), r.text
    assert coordinator.requests == []


@pytest.mark.parametrize("body", [[], [{}], "round", 1, None, True])
def test_rebalance_not_an_object(admin: Api, body: Any) -> None:
    r = admin.raw("/v1/admin/rebalance", json.dumps(body))
    assert r.status_code == 422, r.text
    assert locs(r) == [["body"]]
    assert "{} (a round)" in r.json()["detail"][0]["msg"]


def test_rebalance_checks_the_plan(server: InProcessServer, rdb: redis.Redis) -> None:
    parts = {p.id: p for p in plan(rdb).partitions}
    one_wide = next(p for p in parts.values() if p.x0 == p.x1)
    wide = next(p for p in parts.values() if p.x1 - p.x0 >= 1)
    other = next(p.worker for p in parts.values() if p.worker != wide.worker)
    now = time.time()
    rdb.hset(names.WORKERS_KEY, "w-dead",
             json.dumps({"pid": 1, "host": "h", "heartbeat": now - 600}))
    cases: list[tuple[dict[str, Any], int, str | None]] = [
        ({"partition": "p999", "to": other}, 404, None),
        ({"partition": wide.id, "to": "w-nobody"}, 404, None),
        ({"partition": wide.id, "to": "w-dead"}, 404, None),
        ({"partition": wide.id, "to": wide.worker}, 409, None),
        ({"split": "p999", "axis": "x", "at": 0}, 404, None),
        ({"split": wide.id, "axis": "x", "at": wide.x1}, 422, "at"),
        ({"split": wide.id, "axis": "x", "at": wide.x0 - 1 if wide.x0 else wide.x1 + 1}, 422,
         "at"),
        ({"split": wide.id, "axis": "y", "at": wide.y1}, 422, "at"),
        ({"split": wide.id, "axis": "y", "at": 10_000}, 422, "at"),
        ({"split": one_wide.id, "axis": "x", "at": one_wide.x0}, 422, "axis"),
    ]
    with FakeCoordinator(server.redis_url, accept) as coordinator:
        for body, status, field in cases:
            r = request(server, "POST", "/v1/admin/rebalance", body)
            assert r.status_code == status, (body, r.text)
            if field is None:
                assert isinstance(r.json()["detail"], str), r.text
            else:
                assert names_field(r, field), (body, r.text)
    assert coordinator.requests == []
    assert rdb.llen(names.REQUESTS_KEY) == 0


def test_rebalance_passes_the_coordinators_answer(server: InProcessServer,
                                                  rdb: redis.Redis) -> None:
    parts = plan(rdb).partitions
    p = next(p for p in parts if p.x1 > p.x0)
    to = next(q.worker for q in parts if q.worker != p.worker)
    now = time.time()
    rdb.hset(names.WORKERS_KEY, "w-new", json.dumps({"pid": 1, "host": "h", "heartbeat": now + 60}))
    calls = [
        ({}, {"kind": "round"}),
        ({"partition": p.id, "to": to}, {"kind": "move", "partition": p.id, "to": to}),
        # A live worker without partitions yet is a valid target.
        ({"partition": p.id, "to": "w-new"}, {"kind": "move", "partition": p.id, "to": "w-new"}),
        ({"split": p.id, "axis": "x", "at": p.x0},
         {"kind": "split", "partition": p.id, "axis": "x", "at": p.x0}),
        ({"split": p.id, "axis": "y", "at": p.y1 - 1},
         {"kind": "split", "partition": p.id, "axis": "y", "at": p.y1 - 1}),
    ]
    with FakeCoordinator(server.redis_url, accept) as coordinator:
        for body, sent in calls:
            r = request(server, "POST", "/v1/admin/rebalance", body)
            assert r.status_code == 202, (body, r.text)
            req = coordinator.requests[-1]
            assert {k: v for k, v in req.items() if k != "id"} == sent  # exactly the protocol
            assert isinstance(req["id"], str) and len(req["id"]) >= 16
            assert r.json() == {"round": 41, "action": accept(req)["action"],
                                "details": {k: v for k, v in sent.items() if k != "kind"}}
            assert rdb.exists(names.reply_key(req["id"])) == 0  # the answer was consumed
    ids = [req["id"] for req in coordinator.requests]
    assert len(set(ids)) == len(ids) == len(calls)
    assert rdb.llen(names.REQUESTS_KEY) == 0


@pytest.mark.parametrize(("reply", "status"), [
    ({"status": 409, "error": "the plan changed meanwhile (version 7)"}, 409),
    ({"status": 404, "error": "no partition p0 any more"}, 404),
    ({"status": 422, "error": "at must split the partition"}, 422),
    ({"status": 503, "error": "the coordinator is busy with a round"}, 503),
])
def test_rebalance_passes_the_coordinators_errors(server: InProcessServer, reply: dict[str, Any],
                                                  status: int) -> None:
    with FakeCoordinator(server.redis_url, lambda _req: reply):
        r = request(server, "POST", "/v1/admin/rebalance", {})
    assert r.status_code == status, r.text
    detail = r.json()["detail"]
    if status == 422:
        assert [e["msg"] for e in detail] == [reply["error"]]
    else:
        assert detail == reply["error"]
    if status == 503:
        assert "retry-after" in r.headers


def test_rebalance_timeout_withdraws_the_request(server: InProcessServer, rdb: redis.Redis) -> None:
    """A coordinator holds the lease but never reads: 503 after the timeout, and the request
    is taken off the list so that it is not carried out later."""
    rdb.set(names.LEASE_KEY, "stuck-coordinator", px=60_000)
    rdb.rpush(names.REQUESTS_KEY, b'{"id": "someone-else", "kind": "round"}')
    start = time.monotonic()
    r = request(server, "POST", "/v1/admin/rebalance", {})
    elapsed = time.monotonic() - start
    assert r.status_code == 503, r.text
    assert "retry-after" in r.headers
    assert "did not answer" in r.json()["detail"] and "withdrawn" in r.json()["detail"]
    assert TIMEOUT_S - 0.2 <= elapsed < TIMEOUT_S + 10
    assert rdb.lrange(names.REQUESTS_KEY, 0, -1) == [b'{"id": "someone-else", "kind": "round"}']


def test_rebalance_timeout_after_the_coordinator_took_it(server: InProcessServer,
                                                         rdb: redis.Redis) -> None:
    with FakeCoordinator(server.redis_url, lambda _req: None) as coordinator:
        r = request(server, "POST", "/v1/admin/rebalance", {})
    assert r.status_code == 503, r.text
    assert "may still carry it out" in r.json()["detail"]
    assert len(coordinator.requests) == 1 and rdb.llen(names.REQUESTS_KEY) == 0


def test_concurrent_rebalances_get_their_own_answers(server: InProcessServer) -> None:
    def answer(req: dict[str, Any]) -> dict[str, Any]:
        return {"status": 202, "round": 1, "action": "none", "details": {"request": req["id"]}}

    results: list[tuple[int, Any]] = []

    def one() -> None:
        r = request(server, "POST", "/v1/admin/rebalance", {})
        results.append((r.status_code, r.json().get("details", {}).get("request")))

    with FakeCoordinator(server.redis_url, answer) as coordinator:
        threads = [threading.Thread(target=one) for _ in range(8)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(30)
    assert sorted(status for status, _ in results) == [202] * 8
    assert sorted(rnd for _, rnd in results) == sorted(req["id"] for req in coordinator.requests)


# --- the dashboard -------------------------------------------------------------------------------

def test_dashboard(server: InProcessServer) -> None:
    with server.http() as client:
        r = client.get("/admin/")  # no key: the page asks for it
        assert r.status_code == 200, r.text
        assert r.headers["content-type"].startswith("text/html")
        page = r.text
        assert "<canvas" in page and "sessionStorage" in page
        for path in ("/v1/admin/cluster", "/v1/admin/balancer", "/v1/admin/partitions",
                     "/v1/admin/rebalance"):
            assert path in page, path
        # Self-contained: nothing is loaded from elsewhere, and the CSP says so too.
        lowered = page.lower()
        assert "src=\"http" not in lowered and "href=\"http" not in lowered
        assert "<script src" not in lowered and "<link" not in lowered
        assert "default-src 'none'" in r.headers["content-security-policy"]
        # Without the trailing slash it redirects to the page.
        r = client.get("/admin", follow_redirects=True)
        assert r.status_code == 200 and r.url.path == "/admin/"


def test_openapi_documents_the_admin_endpoints(server: InProcessServer) -> None:
    with server.http() as client:
        paths = client.get("/openapi.json").json()["paths"]
    assert {"get"} <= set(paths["/v1/admin/partitions"])
    assert {"get", "put"} <= set(paths["/v1/admin/balancer"])
    assert {"post"} <= set(paths["/v1/admin/rebalance"])
    assert {"get"} <= set(paths["/admin/"])

