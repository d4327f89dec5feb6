"""DELETE /v1/subscriptions/{id} is all or nothing (API.md: a rejected request changes nothing):
when the SQL commit fails, or when the workers cannot be told, the answer is 503 and the
subscription is whole — listed, and still matching on the real worker — and a later DELETE
deletes it for good. Only the fault is injected (the commit, or the removal, raising)."""

from __future__ import annotations

import inspect
import secrets
from collections.abc import Iterator
from typing import Any

import pytest
import redis
import redis.exceptions
from sqlalchemy.exc import OperationalError
from sqlalchemy.orm import Session

from app.pipeline import names
from app.pipeline.router import Router
from tests.app.httpapi import Api
from tests.conftest import InProcessServer

BBOX = [20.0, 20.0, 21.0, 21.0]
INSIDE = {"lon": 20.5, "lat": 20.5}


@pytest.fixture
def api(inprocess_worker: InProcessServer) -> Iterator[Api]:
    a = Api(inprocess_worker)
    yield a
    a.close()


def publish_and_wait(api: Api, sub_id: str) -> str:
    """Publish a moving object inside the subscription and wait for its match."""
    oid = "obj-" + secrets.token_hex(4)
    api.publish([{"id": oid, **INSIDE}])
    api.wait_matches(sub_id, lambda ms: any(m["object"]["id"] == oid for m in ms))
    return oid


def assert_whole(api: Api, sub: dict[str, Any]) -> None:
    """Listed, readable, and still matching new objects."""
    assert api.subscription_ids() == [sub["id"]]
    assert api.get(f"/v1/subscriptions/{sub['id']}").json() == sub
    publish_and_wait(api, sub["id"])


def assert_deleted_for_good(api: Api, sub_id: str) -> None:
    r = api.delete(f"/v1/subscriptions/{sub_id}")
    assert r.status_code == 204, r.text
    assert sub_id not in api.subscription_ids()
    assert api.get(f"/v1/subscriptions/{sub_id}").status_code == 404
    assert api.delete(f"/v1/subscriptions/{sub_id}").status_code == 404


def fail_once(monkeypatch: pytest.MonkeyPatch, owner: Any, name: str, error: Exception,
              calls: list[str]) -> None:
    """Make `owner.name` raise `error` on its next call only."""
    real = getattr(owner, name)

    def failing(*args: Any, **kwargs: Any) -> Any:
        calls.append(name)
        monkeypatch.setattr(owner, name, real)
        raise error

    async def failing_async(*args: Any, **kwargs: Any) -> Any:
        failing()

    monkeypatch.setattr(owner, name,
                        failing_async if inspect.iscoroutinefunction(real) else failing)


def test_failed_commit_leaves_the_subscription_whole(api: Api,
                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    sub = api.subscribe({"type": "range", "bbox": BBOX})
    publish_and_wait(api, sub["id"])
    calls: list[str] = []
    fail_once(monkeypatch, Session, "commit",
              OperationalError("COMMIT", {}, Exception("disk I/O error")), calls)
    r = api.delete(f"/v1/subscriptions/{sub['id']}")
    assert calls == ["commit"]  # the fault was hit
    assert r.status_code == 503, r.text
    assert "retry-after" in r.headers
    assert_whole(api, sub)
    assert_deleted_for_good(api, sub["id"])


def test_removal_the_workers_never_got_is_undone(api: Api,
                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    """The commit succeeded but no attempt to tell the workers did: the row is restored (same
    id, same place in the listing) and the subscription goes on matching."""
    first = api.subscribe({"type": "keyword", "keywords": ["first"]})
    sub = api.subscribe({"type": "range", "bbox": BBOX})
    last = api.subscribe({"type": "keyword", "keywords": ["last"]})
    real = Router.remove_subscriptions
    calls: list[int] = []

    async def unreachable(self: Router, rows: list[Any], reason: str = "deleted") -> None:
        calls.append(len(rows))
        raise redis.exceptions.ConnectionError("Redis went away")

    monkeypatch.setattr(Router, "remove_subscriptions", unreachable)
    r = api.delete(f"/v1/subscriptions/{sub['id']}")
    monkeypatch.setattr(Router, "remove_subscriptions", real)
    assert len(calls) > 1  # retried before giving up
    assert r.status_code == 503, r.text
    assert api.subscription_ids() == [first["id"], sub["id"], last["id"]]
    assert api.get(f"/v1/subscriptions/{sub['id']}").json() == sub
    publish_and_wait(api, sub["id"])
    assert_deleted_for_good(api, sub["id"])
    assert api.subscription_ids() == [first["id"], last["id"]]


def test_a_lost_reply_is_retried_not_undone(api: Api, monkeypatch: pytest.MonkeyPatch) -> None:
    """The workers' removal fails once (as when a reply is lost): the retry completes it, the
    answer is 204 and nothing of the subscription is left."""
    sub = api.subscribe({"type": "range", "bbox": BBOX})
    calls: list[str] = []
    fail_once(monkeypatch, Router, "remove_subscriptions",
              redis.exceptions.TimeoutError("Timeout reading from socket"), calls)
    r = api.delete(f"/v1/subscriptions/{sub['id']}")
    assert calls == ["remove_subscriptions"]
    assert r.status_code == 204, r.text
    assert api.subscription_ids() == []
    # The worker no longer matches it: a sentinel subscription gets an object the deleted one
    # would have matched (on the same worker, after the removal), and the deleted one's
    # history stays empty.
    sentinel = api.subscribe({"type": "range", "bbox": BBOX})
    publish_and_wait(api, sentinel["id"])
    assert api.get(f"/v1/subscriptions/{sub['id']}/matches").status_code == 404
    client = redis.Redis.from_url(api.server.redis_url)
    try:
        assert client.xlen(names.history_key(sub["id"])) == 0
    finally:
        client.close()
