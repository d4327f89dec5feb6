"""Per-tenant quotas (app/services/quotas.py): live subscriptions (429, all or nothing, exact
under concurrent creates, on SQLite and PostgreSQL), WebSocket connections over every api
process (close 1008; slots renewed while open, freed on close and, for a crashed process, by
expiry) and the publish rate (429 with Retry-After; refused batches cost nothing; batches
larger than a second's worth). Against the in-process api with small quotas."""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest
import redis
from sqlalchemy import update

from app.core.db import session_scope
from app.core.errors import RateLimited
from app.core.redis import EmbeddedRedis
from app.core.state import AppState
from app.models import Subscription
from app.pipeline import names
from app.services import quotas
from tests.app.asgiws import AsgiWebSocket
from tests.app.httpapi import Api, check
from tests.conftest import InProcessServer, auth, start_inprocess

MAX_SUBS = 5
MAX_CONNS = 2
PUBLISH_PER_S = 20
SLOT_TTL_S = 1.5
QUOTAS = {"GEOSWARM_TENANT_MAX_SUBSCRIPTIONS": str(MAX_SUBS),
          "GEOSWARM_TENANT_MAX_CONNECTIONS": str(MAX_CONNS),
          "GEOSWARM_TENANT_PUBLISH_PER_S": str(PUBLISH_PER_S),
          "GEOSWARM_WS_SLOT_TTL_S": str(SLOT_TTL_S)}


@pytest.fixture(scope="module")
def quota_app(tmp_path_factory: pytest.TempPathFactory, embedded_redis: EmbeddedRedis
              ) -> Iterator[InProcessServer]:
    with start_inprocess(tmp_path_factory.mktemp("quotas"), embedded_redis.url, **QUOTAS) as s:
        yield s


@pytest.fixture
def quota_app_on(database_url: str, tmp_path: Path, embedded_redis: EmbeddedRedis
                 ) -> Iterator[InProcessServer]:
    """The same on SQLite, and on PostgreSQL when it is reachable."""
    with start_inprocess(tmp_path, embedded_redis.url, database_url=database_url,
                         **QUOTAS) as s:
        yield s


def keyword(i: int, ttl_s: float | None = None) -> dict[str, Any]:
    spec: dict[str, Any] = {"type": "keyword", "keywords": [f"k{i}"]}
    if ttl_s is not None:
        spec["ttl_s"] = ttl_s
    return spec


# --- live subscriptions ---------------------------------------------------------------------

def test_subscription_quota_is_429_all_or_nothing(quota_app: InProcessServer) -> None:
    api, other = Api(quota_app), Api(quota_app)
    try:
        r = api.post("/v1/subscriptions/batch", {"subscriptions": [keyword(i) for i in range(3)]})
        assert r.status_code == 201, r.text
        api.subscribe(keyword(3))
        # a batch that would go over stores none of its subscriptions
        r = api.post("/v1/subscriptions/batch", {"subscriptions": [keyword(4), keyword(5)]})
        assert r.status_code == 429, r.text
        assert r.json()["detail"] == (f"tenant quota of {MAX_SUBS} subscriptions reached "
                                      "(4 live, 2 more asked for)")
        # nothing expires: a retry is pointless before a subscription is deleted
        assert r.headers["retry-after"] == str(quotas.SUBSCRIPTIONS_RETRY_S)
        assert len(api.subscription_ids()) == 4
        last = api.subscribe(keyword(4))
        r = api.post("/v1/subscriptions", keyword(5))
        assert r.status_code == 429, r.text
        assert r.json()["detail"].startswith(f"tenant quota of {MAX_SUBS} subscriptions reached")
        assert len(api.subscription_ids()) == MAX_SUBS
        # another tenant has a quota of its own
        assert other.post("/v1/subscriptions", keyword(0)).status_code == 201
        # a deleted subscription frees its place
        assert api.delete(f"/v1/subscriptions/{last['id']}").status_code == 204
        assert api.post("/v1/subscriptions", keyword(6)).status_code == 201
        assert api.post("/v1/subscriptions", keyword(7)).status_code == 429
    finally:
        api.close()
        other.close()


def test_expiring_subscriptions_set_retry_after_and_expired_ones_do_not_count(
        quota_app: InProcessServer) -> None:
    api = Api(quota_app)
    try:
        subs = [api.subscribe(keyword(i, ttl_s=600 if i == 0 else None))
                for i in range(MAX_SUBS)]
        r = api.post("/v1/subscriptions", keyword(9))
        assert r.status_code == 429, r.text
        # the first subscription with a TTL frees a place when it expires
        assert 590 <= int(r.headers["retry-after"]) <= 600
        # expired (and not yet deleted by the expiry loop): no longer counted
        state: AppState = quota_app.app.state.gs
        with session_scope(state.sessions) as session:
            session.execute(update(Subscription).where(Subscription.id == subs[0]["id"])
                            .values(expires_at=time.time() - 1))
        assert api.post("/v1/subscriptions", keyword(9)).status_code == 201
    finally:
        api.close()


def test_concurrent_creates_never_overshoot(quota_app_on: InProcessServer) -> None:
    """Twenty creates of one tenant at once, singles and batches, on either database: exactly
    the quota is created, every other request is refused with 429."""
    s = quota_app_on
    key = s.new_key()

    def create(i: int) -> int:
        with s.http(auth(key)) as c:
            if i % 4 == 0:
                r = c.post("/v1/subscriptions/batch",
                           json={"subscriptions": [keyword(i), keyword(i + 100)]})
            else:
                r = c.post("/v1/subscriptions", json=keyword(i))
        check(r)
        assert r.status_code in (201, 429), r.text
        if r.status_code == 429:
            return 0
        return 2 if i % 4 == 0 else 1

    with ThreadPoolExecutor(max_workers=20) as pool:
        created = sum(pool.map(create, range(20)))
    api = Api(s, key=key)
    try:
        stored = len(api.subscription_ids())
    finally:
        api.close()
    assert stored == created
    assert MAX_SUBS - 1 <= created <= MAX_SUBS  # a batch of 2 may not fit the last place


def test_subscription_quota_off(tmp_path: Path, embedded_redis: EmbeddedRedis) -> None:
    with start_inprocess(tmp_path, embedded_redis.url,
                         GEOSWARM_TENANT_MAX_SUBSCRIPTIONS="0") as s:
        api = Api(s)
        try:
            r = api.post("/v1/subscriptions/batch",
                         {"subscriptions": [keyword(i) for i in range(50)]})
            assert r.status_code == 201, r.text
        finally:
            api.close()


# --- WebSocket connections ------------------------------------------------------------------

def connect(s: InProcessServer, key: str) -> AsgiWebSocket:
    ws = AsgiWebSocket(s, query=f"token={key}").connect()
    assert ws.accepted
    return ws


def listening(ws: AsgiWebSocket) -> bool:
    """The socket is open and serves: a `listen` is acknowledged."""
    if ws.close_code is not None:
        return False
    ws.send({"op": "listen", "subscriptions": []})
    msgs = ws.receive()
    return bool(msgs) and msgs[0]["type"] == "listening"


def refused(ws: AsgiWebSocket) -> bool:
    code = ws.close_code if ws.close_code is not None else ws.wait_closed(5)
    return code == 1008 and ws.close_reason == (
        f"tenant quota of {MAX_CONNS} WebSocket connections reached")


def slots(s: InProcessServer, tenant: str) -> int:
    client = redis.Redis.from_url(s.redis_url)
    try:
        return int(client.zcard(names.ws_slots_key(tenant)))
    finally:
        client.close()


def test_connection_quota_refuses_with_1008_and_frees_slots(quota_app: InProcessServer
                                                             ) -> None:
    s = quota_app
    tenant = "conns-a"
    key, other_key = s.new_key(tenant), s.new_key("conns-b")
    first, second = connect(s, key), connect(s, key)
    other = connect(s, other_key)
    try:
        assert listening(first) and listening(second) and listening(other)
        assert slots(s, tenant) == MAX_CONNS
        third = connect(s, key)
        assert refused(third)
        third.close()
        # open for two slot lifetimes: renewed, still counted
        time.sleep(2 * SLOT_TTL_S)
        assert slots(s, tenant) == MAX_CONNS
        again = connect(s, key)
        assert refused(again)
        again.close()
        assert listening(first) and listening(second)
        # a closed connection gives its slot back at once
        second.close()
        assert slots(s, tenant) == MAX_CONNS - 1
        replacement = connect(s, key)
        assert listening(replacement)
        replacement.close()
    finally:
        for ws in (first, second, other):
            ws.close()
    assert slots(s, tenant) == 0


def test_slots_of_a_crashed_process_expire(quota_app: InProcessServer) -> None:
    """Another api process took every slot of the tenant and died without giving them back
    (nothing renews them): refused until they expire, then accepted."""
    s = quota_app
    tenant = "conns-crashed"
    key = s.new_key(tenant)
    client = redis.Redis.from_url(s.redis_url)
    try:
        sec, usec = client.time()
        expires = sec * 1000 + usec // 1000 + int(SLOT_TTL_S * 1000)
        client.zadd(names.ws_slots_key(tenant), {"dead-1": expires, "dead-2": expires})
    finally:
        client.close()
    ws = connect(s, key)
    assert refused(ws)
    ws.close()
    time.sleep(SLOT_TTL_S + 0.2)
    ws = connect(s, key)
    try:
        assert listening(ws)
        assert slots(s, tenant) == 1
    finally:
        ws.close()


def test_a_lost_slot_of_an_open_connection_is_taken_again(quota_app: InProcessServer) -> None:
    """Slots that expired while their process could not renew them (Redis unreachable for a
    TTL) come back with the next renewal: open connections always count."""
    s = quota_app
    tenant = "conns-lost"
    key = s.new_key(tenant)
    ws = connect(s, key)
    try:
        assert listening(ws) and slots(s, tenant) == 1
        client = redis.Redis.from_url(s.redis_url)
        try:
            client.delete(names.ws_slots_key(tenant))
        finally:
            client.close()
        # (the app's own renewal round may already have taken it again: that is the point)
        assert s.portal.call(quotas.renew_connections, s.app.state.gs) >= 1
        assert slots(s, tenant) == 1
    finally:
        ws.close()
    assert slots(s, tenant) == 0


# --- publish rate ---------------------------------------------------------------------------

def charge(s: InProcessServer, tenant: str, n: int, state: AppState | None = None
           ) -> RateLimited | None:
    """Charge `n` objects; the refusal, or None when admitted."""
    try:
        s.portal.call(quotas.charge_publish, state or s.app.state.gs, tenant, n)
    except RateLimited as exc:
        return exc
    return None


def test_publish_rate_is_429_with_retry_after(quota_app: InProcessServer) -> None:
    s = quota_app
    assert charge(s, "pub-a", PUBLISH_PER_S) is None  # one second's worth at once
    refusal = charge(s, "pub-a", PUBLISH_PER_S // 2)
    assert refusal is not None and refusal.status == 429
    assert refusal.message.startswith(
        f"tenant quota of {PUBLISH_PER_S} published objects per second reached")
    assert refusal.headers["Retry-After"] == "1"
    # another tenant has a rate of its own
    assert charge(s, "pub-b", PUBLISH_PER_S) is None
    # refused batches cost nothing: a second later a full second's worth passes again
    for _ in range(10):
        assert charge(s, "pub-a", PUBLISH_PER_S * 3 // 4) is not None
    time.sleep(1.05)
    assert charge(s, "pub-a", PUBLISH_PER_S) is None


def test_a_batch_larger_than_a_second_passes_and_is_paid_for(quota_app: InProcessServer
                                                             ) -> None:
    s = quota_app
    big = 3 * PUBLISH_PER_S
    assert charge(s, "pub-big", big) is None  # nothing owed: admitted whole
    refusal = charge(s, "pub-big", 1)  # then 3 s are owed, one of them is the burst
    assert refusal is not None
    assert refusal.headers["Retry-After"] in ("2", "3")  # about 2.05 s, rounded up
    assert charge(s, "pub-big2", PUBLISH_PER_S // 2) is None
    refusal = charge(s, "pub-big2", big)  # a batch this large waits for a full bucket
    assert refusal is not None and refusal.headers["Retry-After"] == "1"


def test_publish_rate_holds_over_time(quota_app: InProcessServer) -> None:
    """Whatever the batch sizes, over a stretch of time no more than the rate plus one second's
    worth is admitted."""
    s = quota_app
    admitted = 0
    start = time.monotonic()
    sizes = [1, 7, 3, 12, 5]
    i = 0
    while time.monotonic() - start < 2.0:
        n = sizes[i % len(sizes)]
        i += 1
        if charge(s, "pub-steady", n) is None:
            admitted += n
        time.sleep(0.01)
    elapsed = time.monotonic() - start
    assert admitted <= PUBLISH_PER_S * (elapsed + 1)
    assert admitted >= PUBLISH_PER_S * elapsed * 0.75  # the rate is used, not wasted


def test_publish_rate_off(quota_app: InProcessServer) -> None:
    state: AppState = quota_app.app.state.gs
    unlimited = dataclasses.replace(
        state, settings=state.settings.model_copy(update={"tenant_publish_per_s": 0}))
    for _ in range(3):
        assert charge(quota_app, "pub-off", 10_000, unlimited) is None
