"""Helpers of the HTTP API tests: a small client bound to one key of a fresh tenant (of the
in-process api or of a live server), raw bodies, and waiting for a subscription's retained
matches (a wait, never a timed assertion)."""

from __future__ import annotations

import secrets
import time
from collections.abc import Callable, Iterable
from typing import Any

import httpx

from tests.conftest import Server, auth, http_client

JSON = "application/json"
NDJSON = "application/x-ndjson"
WORLD = [-180, -90, 180, 90]


class Api:
    """One key (of a fresh tenant unless given) on an api."""

    def __init__(self, server: Server, key: str | None = None, tenant: str | None = None
                 ) -> None:
        self.server = server
        self.tenant = tenant or "t" + secrets.token_hex(6)
        self.key = key or server.new_key(self.tenant)
        self.client = http_client(server, auth(self.key))

    def close(self) -> None:
        self.client.close()

    def get(self, path: str, **kw: Any) -> httpx.Response:
        return check(self.client.get(path, **kw))

    def post(self, path: str, body: Any = None, **kw: Any) -> httpx.Response:
        return check(self.client.post(path, json=body, **kw))

    def delete(self, path: str, **kw: Any) -> httpx.Response:
        return check(self.client.delete(path, **kw))

    def raw(self, path: str, body: bytes | str, content_type: str = JSON,
            method: str = "POST") -> httpx.Response:
        data = body.encode("utf-8", "surrogatepass") if isinstance(body, str) else body
        return check(self.client.request(method, path, content=data,
                                         headers={"content-type": content_type}))

    # --- the state the tests read back ------------------------------------------------------
    def subscriptions(self) -> list[dict[str, Any]]:
        """Every subscription of this tenant, through the paginated list."""
        items: list[dict[str, Any]] = []
        cursor: str | None = None
        while True:
            params: dict[str, Any] = {"limit": 1000}
            if cursor:
                params["cursor"] = cursor
            r = self.get("/v1/subscriptions", params=params)
            assert r.status_code == 200, r.text
            page = r.json()
            items += page["items"]
            cursor = page["next_cursor"]
            if not cursor:
                return items

    def subscription_ids(self) -> list[str]:
        return [s["id"] for s in self.subscriptions()]

    def subscribe(self, body: dict[str, Any]) -> dict[str, Any]:
        r = self.post("/v1/subscriptions", body)
        assert r.status_code == 201, r.text
        return dict(r.json())

    def publish(self, objects: list[dict[str, Any]]) -> list[str]:
        r = self.post("/v1/objects", {"objects": objects})
        assert r.status_code == 202, r.text
        assert r.json()["accepted"] == len(objects)
        return list(r.json()["ids"])

    def matches(self, sub_id: str) -> list[dict[str, Any]]:
        """Every retained match message of a subscription (all pages)."""
        out: list[dict[str, Any]] = []
        since: str | None = None
        while True:
            params = {"since": since} if since else {}
            r = self.get(f"/v1/subscriptions/{sub_id}/matches", params=params)
            assert r.status_code == 200, r.text
            page = r.json()
            items = [m for m in page["items"] if m["type"] == "match"]
            if not items:
                return out
            out += items
            since = page["next_cursor"]

    def wait_matches(self, sub_id: str, until: Callable[[list[dict[str, Any]]], bool],
                     timeout: float = 30) -> list[dict[str, Any]]:
        """Poll the retained matches until `until` holds (waiting, not asserting on time)."""
        deadline = time.monotonic() + timeout
        while True:
            got = self.matches(sub_id)
            if until(got):
                return got
            if time.monotonic() > deadline:
                raise AssertionError(f"matches of {sub_id} never satisfied the wait: {got}")
            time.sleep(0.05)

    def assert_only_sentinels(self, sub_id: str, rejected: Iterable[str] = (),
                              lon: float = 10.0, lat: float = 10.0) -> None:
        """A rejected request stored nothing: publish a sentinel at the rejected objects' place
        (the same partition, so the same worker stream, after them), wait for its match, and
        check it is the only match and no rejected moving object has a latest record."""
        sentinel = "sentinel-" + secrets.token_hex(4)
        self.publish([{"id": sentinel, "lon": lon, "lat": lat}])
        got = self.wait_matches(sub_id, lambda ms: any(m["object"]["id"] == sentinel
                                                       for m in ms))
        assert [m["object"]["id"] for m in got] == [sentinel], got
        for oid in rejected:
            r = self.get(f"/v1/objects/{oid}")
            assert r.status_code == 404, (oid, r.text)


def check(r: httpx.Response) -> httpx.Response:
    """No response of the API is ever a 5xx other than 503 (with Retry-After)."""
    if r.status_code >= 500:
        assert r.status_code == 503, f"{r.request.method} {r.request.url} -> {r.status_code}"
        assert "retry-after" in r.headers
    return r


def locs(r: httpx.Response) -> list[list[Any]]:
    """The `loc` of every error of a 422 (FastAPI's `{"detail": [...]}` shape)."""
    assert r.status_code == 422, (r.status_code, r.text)
    detail = r.json()["detail"]
    assert isinstance(detail, list) and detail, detail
    for err in detail:
        assert {"loc", "msg", "type"} <= set(err), err
    return [list(err["loc"]) for err in detail]


def names_field(r: httpx.Response, *path: Any) -> bool:
    """The 422 names the field: some error's loc ends with `path` (the tagged-union tag a
    subscription's loc carries after "body" is allowed)."""
    n = len(path)
    return any(loc[-n:] == list(path) for loc in locs(r))
