"""API.md, Subscriptions over HTTP: the four shapes and their 201 bodies, batch create, list
pagination (own tenant only), get, delete, and TTL — on SQLite and on PostgreSQL, against the
in-process api (and a real worker where matches are waited for)."""

from __future__ import annotations

import base64
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from app.core.config import Settings
from app.core.redis import start_embedded_redis
from tests.app.httpapi import Api, locs
from tests.conftest import InProcessServer, start_inprocess

SHAPES = {
    "range-bbox": {"type": "range", "bbox": [-74.02, 40.70, -73.93, 40.80],
                   "keywords": ["coffee", "tea"], "match": "any", "ttl_s": 3600},
    "range-circle": {"type": "range", "circle": {"lon": -73.985, "lat": 40.758,
                                                 "radius_m": 500}},
    "keyword": {"type": "keyword", "keywords": ["earthquake", "tokyo"], "match": "all"},
    "knn": {"type": "knn", "point": [-73.985, 40.758], "k": 5, "keywords": ["taxi"]},
}


@pytest.fixture
def api(inprocess: InProcessServer) -> Iterator[Api]:
    a = Api(inprocess)
    yield a
    a.close()


def check_created(body: dict[str, Any], given: dict[str, Any]) -> None:
    """A 201 body: `id`, the fields given (defaults may be added), created_at, expires_at."""
    assert isinstance(body["id"], str) and body["id"]
    for field, value in given.items():
        assert body[field] == value, (field, body)
    assert isinstance(body["created_at"], float)
    if "ttl_s" in given:
        assert body["expires_at"] == pytest.approx(body["created_at"] + given["ttl_s"])
    else:
        assert body["expires_at"] is None
    if "keywords" in given:
        assert body["match"] == given.get("match", "any")


@pytest.mark.parametrize("shape", list(SHAPES))
def test_create_each_shape(api: Api, shape: str) -> None:
    given = SHAPES[shape]
    r = api.post("/v1/subscriptions", given)
    assert r.status_code == 201, r.text
    body = r.json()
    check_created(body, given)
    r = api.get(f"/v1/subscriptions/{body['id']}")
    assert r.status_code == 200, r.text
    assert r.json() == body
    assert api.subscription_ids() == [body["id"]]


def test_defaults_and_normalisation(api: Api) -> None:
    body = api.subscribe({"type": "range", "bbox": [0, 0, 1, 1], "keywords": ["Coffee", "TEA"],
                          "detect": "enter"})
    assert body["keywords"] == ["coffee", "tea"]
    assert body["match"] == "any"
    assert body["detect"] == ["enter"]
    assert body["bbox"] == [0, 0, 1, 1]
    assert "circle" not in body and "ttl_s" not in body


@pytest.mark.parametrize("ttl", [60, 3600, 90.5, 30 * 24 * 3600])
def test_ttl_sets_expires_at(api: Api, ttl: float) -> None:
    body = api.subscribe({"type": "keyword", "keywords": ["a"], "ttl_s": ttl})
    assert body["ttl_s"] == ttl
    assert body["expires_at"] == pytest.approx(body["created_at"] + ttl)
    got = api.get(f"/v1/subscriptions/{body['id']}").json()
    assert got["expires_at"] == body["expires_at"]
    listed = api.subscriptions()
    assert [s["expires_at"] for s in listed] == [body["expires_at"]]


def test_batch_create(api: Api) -> None:
    given = list(SHAPES.values()) * 3
    r = api.post("/v1/subscriptions/batch", {"subscriptions": given})
    assert r.status_code == 201, r.text
    assert set(r.json()) == {"ids"}
    ids = r.json()["ids"]
    assert len(ids) == len(set(ids)) == len(given)
    for sid, spec in zip(ids, given, strict=True):
        r = api.get(f"/v1/subscriptions/{sid}")
        assert r.status_code == 200
        check_created(r.json(), spec)
    assert api.subscription_ids() == ids


def run_crud(api: Api, other: Api) -> None:
    """Pagination across pages, own tenant only, get, delete — against one server."""
    r = api.post("/v1/subscriptions/batch", {"subscriptions": [
        {"type": "keyword", "keywords": [f"k{i}"]} for i in range(23)]})
    assert r.status_code == 201, r.text
    ids = r.json()["ids"]
    other_ids = other.post("/v1/subscriptions/batch", {"subscriptions": [
        {"type": "keyword", "keywords": ["x"]}] * 5}).json()["ids"]
    # limit 5: pages of 5, 5, 5, 5, 3; the last has no next_cursor.
    seen: list[str] = []
    cursor = None
    pages = 0
    while True:
        params: dict[str, Any] = {"limit": 5}
        if cursor:
            params["cursor"] = cursor
        r = api.get("/v1/subscriptions", params=params)
        assert r.status_code == 200, r.text
        page = r.json()
        assert set(page) == {"items", "next_cursor"}
        assert 1 <= len(page["items"]) <= 5
        seen += [s["id"] for s in page["items"]]
        pages += 1
        cursor = page["next_cursor"]
        if cursor is None:
            break
        assert isinstance(cursor, str)
    assert pages == 5
    assert seen == ids  # every one, once, in creation order, none of the other tenant's
    assert not set(seen) & set(other_ids)
    # limit exactly the count: one page, no cursor.
    page = api.get("/v1/subscriptions", params={"limit": 23}).json()
    assert [s["id"] for s in page["items"]] == ids and page["next_cursor"] is None
    # A cursor is not a key to another tenant's data.
    first = api.get("/v1/subscriptions", params={"limit": 1}).json()
    r = other.get("/v1/subscriptions", params={"cursor": first["next_cursor"]})
    assert r.status_code == 200
    assert {s["id"] for s in r.json()["items"]} <= set(other_ids)
    # Bad cursors: 422 naming the cursor.
    for bad in ("not-a-cursor", "x" * 65, base64.urlsafe_b64encode(b"nope").decode(),
                base64.urlsafe_b64encode(b"s" + b"9" * 40).decode()):
        r = api.get("/v1/subscriptions", params={"cursor": bad})
        assert ["query", "cursor"] in locs(r), r.text
    # get / delete / 404.
    sid = ids[7]
    assert api.get(f"/v1/subscriptions/{sid}").json()["keywords"] == ["k7"]
    r = api.delete(f"/v1/subscriptions/{sid}")
    assert r.status_code == 204 and r.content == b""
    assert api.get(f"/v1/subscriptions/{sid}").status_code == 404
    assert api.get(f"/v1/subscriptions/{sid}/matches").status_code == 404
    assert api.delete(f"/v1/subscriptions/{sid}").status_code == 404
    assert api.subscription_ids() == ids[:7] + ids[8:]
    # A delete does not disturb pagination of the rest.
    cursor = api.get("/v1/subscriptions", params={"limit": 6}).json()["next_cursor"]
    rest = api.get("/v1/subscriptions", params={"limit": 100, "cursor": cursor}).json()
    assert [s["id"] for s in rest["items"]] == ids[6:7] + ids[8:]
    for unknown in ("s_unknown", "nope", "x" * 500, "%00", "s_" + "0" * 20):
        assert api.get(f"/v1/subscriptions/{unknown}").status_code == 404, unknown
        assert api.delete(f"/v1/subscriptions/{unknown}").status_code == 404, unknown
        assert api.get(f"/v1/subscriptions/{unknown}/matches").status_code == 404, unknown
    assert other.subscription_ids() == other_ids


def test_list_get_delete(api: Api, inprocess: InProcessServer) -> None:
    other = Api(inprocess)
    try:
        run_crud(api, other)
    finally:
        other.close()


def test_crud_on_each_database(database_url: str, tmp_path: Path) -> None:
    """The same flow on SQLite and PostgreSQL (ids with NUL, huge cursors: 404 / 422, not
    a database error)."""
    redis_server = start_embedded_redis(Settings(data_dir=tmp_path / "own"))
    try:
        with start_inprocess(tmp_path, redis_server.url, database_url) as s:
            api, other = Api(s), Api(s)
            for shape in SHAPES.values():
                check_created(api.subscribe(shape), shape)
            for sid in api.subscription_ids():
                assert api.delete(f"/v1/subscriptions/{sid}").status_code == 204
            run_crud(api, other)
            api.close()
            other.close()
    finally:
        redis_server.stop()


def test_deleted_subscription_gets_no_new_matches(api: Api,
                                                  inprocess_worker: InProcessServer) -> None:
    sub = api.subscribe({"type": "range", "bbox": [-180, -90, 180, 90]})
    keep = api.subscribe({"type": "range", "bbox": [-180, -90, 180, 90]})
    api.publish([{"id": "m-1", "lon": 10, "lat": 10}])
    api.wait_matches(sub["id"], lambda ms: len(ms) == 1)
    assert api.delete(f"/v1/subscriptions/{sub['id']}").status_code == 204
    api.publish([{"id": "m-2", "lon": 10, "lat": 10}])
    got = api.wait_matches(keep["id"], lambda ms: len(ms) == 2)
    assert [m["object"]["id"] for m in got] == ["m-1", "m-2"]
    assert api.get(f"/v1/subscriptions/{sub['id']}/matches").status_code == 404
