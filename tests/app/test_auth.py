"""API.md, Authentication and tenants: 401 for a missing, garbage, unknown or revoked key (at
once after DELETE /v1/admin/keys/{id}), 403 for a tenant key on admin endpoints, the bootstrap
admin key, and tenant isolation (another tenant's ids answer 404) — against the in-process api
(and a real worker where matches are waited for)."""

from __future__ import annotations

import secrets
from collections.abc import Iterator

import httpx
import pytest

from tests.app.httpapi import WORLD, Api, check
from tests.conftest import InProcessServer, auth, http_client

# Every /v1 endpoint of the api (the WebSocket has its own tests).
V1 = [
    ("POST", "/v1/objects", {"objects": [{"lon": 1, "lat": 1}]}),
    ("GET", "/v1/objects/taxi-17", None),
    ("POST", "/v1/subscriptions", {"type": "keyword", "keywords": ["a"]}),
    ("POST", "/v1/subscriptions/batch", {"subscriptions": [{"type": "keyword",
                                                            "keywords": ["a"]}]}),
    ("GET", "/v1/subscriptions", None),
    ("GET", "/v1/subscriptions/s_0", None),
    ("DELETE", "/v1/subscriptions/s_0", None),
    ("GET", "/v1/subscriptions/s_0/matches", None),
    ("POST", "/v1/admin/keys", {"tenant": "acme"}),
    ("DELETE", "/v1/admin/keys/k_0", None),
    ("GET", "/v1/admin/cluster", None),
    ("GET", "/v1/admin/partitions", None),
    ("GET", "/v1/admin/balancer", None),
    ("PUT", "/v1/admin/balancer", {"enabled": True}),
    ("POST", "/v1/admin/rebalance", {}),
]
ADMIN = [v for v in V1 if v[1].startswith("/v1/admin")]


def call(inprocess: InProcessServer, method: str, path: str, body: object,
         headers: dict[str, str] | dict[str, str | bytes] | None = None) -> httpx.Response:
    with inprocess.http() as client:
        return check(client.request(method, path, json=body, headers=headers))


@pytest.fixture
def api(inprocess: InProcessServer) -> Iterator[Api]:
    a = Api(inprocess)
    yield a
    a.close()


def create_key(inprocess: InProcessServer, tenant: str, admin: bool = False) -> dict[str, object]:
    r = call(inprocess, "POST", "/v1/admin/keys", {"tenant": tenant, "admin": admin},
             inprocess.admin())
    assert r.status_code == 201, r.text
    return dict(r.json())


GARBAGE = [
    pytest.param(None, id="missing"),
    pytest.param({"Authorization": ""}, id="empty"),
    pytest.param({"Authorization": "Bearer"}, id="bearer-only"),
    pytest.param({"Authorization": "Bearer    gs_a b"}, id="bearer-spaces"),
    pytest.param({"Authorization": "Basic dXNlcjpwYXNz"}, id="basic"),
    pytest.param({"Authorization": "Token gs_abc"}, id="other-scheme"),
    pytest.param({"Authorization": "gs_" + "a" * 43}, id="no-scheme"),
    pytest.param({"Authorization": "Bearer gs_" + "a" * 43}, id="unknown"),
    pytest.param({"Authorization": "Bearer " + "k" * 5000}, id="very-long"),
    pytest.param({"Authorization": "Bearer \u00e9\u00e8\u00ff".encode("latin-1")}, id="latin-1"),
    pytest.param({"Authorization": "Bearer gs_\u2603".encode()}, id="utf-8"),
    pytest.param({"X-Api-Key": "whatever"}, id="other-header"),
]


@pytest.mark.parametrize("headers", GARBAGE)
@pytest.mark.parametrize(("method", "path", "body"), V1, ids=[f"{m} {p}" for m, p, _ in V1])
def test_missing_or_garbage_key_is_401(inprocess: InProcessServer, method: str, path: str,
                                       body: object, headers: dict[str, str | bytes] | None
                                       ) -> None:
    r = call(inprocess, method, path, body, headers)
    assert r.status_code == 401, r.text
    assert isinstance(r.json()["detail"], str)


def test_key_in_query_string_is_not_accepted_over_http(api: Api) -> None:
    """`?token=` is for WebSocket clients only."""
    with http_client(api.server) as client:
        r = client.get("/v1/subscriptions", params={"token": api.key})
    assert r.status_code == 401


def test_rejected_unauthenticated_writes_change_nothing(inprocess_worker: InProcessServer,
                                                       api: Api) -> None:
    sub = api.subscribe({"type": "range", "bbox": WORLD})
    for headers in (None, {"Authorization": "Bearer nope"}):
        r = call(inprocess_worker, "POST", "/v1/objects",
                 {"objects": [{"id": "anon-1", "lon": 10, "lat": 10}]}, headers)
        assert r.status_code == 401
        r = call(inprocess_worker, "DELETE", f"/v1/subscriptions/{sub['id']}", None, headers)
        assert r.status_code == 401
    assert api.subscription_ids() == [sub["id"]]
    api.assert_only_sentinels(sub["id"], rejected=["anon-1"])


def test_scheme_is_case_insensitive(api: Api) -> None:
    with http_client(api.server) as client:
        r = client.get("/v1/subscriptions", headers={"Authorization": f"bearer {api.key}"})
    assert r.status_code == 200, r.text


# --- admin ---------------------------------------------------------------------------------------

def test_bootstrap_admin_key_works(inprocess: InProcessServer) -> None:
    created = create_key(inprocess, "boot-" + secrets.token_hex(3))
    assert set(created) == {"id", "key", "tenant", "admin"}
    assert created["admin"] is False
    r = call(inprocess, "GET", "/v1/admin/cluster", None, inprocess.admin())
    assert r.status_code == 200, r.text
    assert {"plan_version", "partitioning", "workers"} <= set(r.json())
    # The key it created works, for its own tenant.
    r = call(inprocess, "GET", "/v1/subscriptions", None, auth(str(created["key"])))
    assert r.status_code == 200 and r.json()["items"] == []


@pytest.mark.parametrize(("method", "path", "body"), ADMIN, ids=[f"{m} {p}" for m, p, _ in ADMIN])
def test_tenant_key_on_admin_endpoint_is_403(inprocess: InProcessServer, api: Api, method: str,
                                             path: str, body: object) -> None:
    r = call(inprocess, method, path, body, auth(api.key))
    assert r.status_code == 403, r.text
    assert isinstance(r.json()["detail"], str)


def test_403_changes_nothing(inprocess: InProcessServer, api: Api) -> None:
    victim = create_key(inprocess, "victim-" + secrets.token_hex(3))
    r = call(inprocess, "DELETE", f"/v1/admin/keys/{victim['id']}", None, auth(api.key))
    assert r.status_code == 403
    r = call(inprocess, "GET", "/v1/subscriptions", None, auth(str(victim["key"])))
    assert r.status_code == 200  # still valid
    r = call(inprocess, "POST", "/v1/admin/keys", {"tenant": "x", "admin": True}, auth(api.key))
    assert r.status_code == 403


def test_created_admin_key_is_an_admin(inprocess: InProcessServer) -> None:
    tenant = "ops-" + secrets.token_hex(3)
    admin = create_key(inprocess, tenant, admin=True)
    assert admin["admin"] is True and admin["tenant"] == tenant
    r = call(inprocess, "POST", "/v1/admin/keys", {"tenant": "t-" + tenant},
             auth(str(admin["key"])))
    assert r.status_code == 201, r.text
    assert call(inprocess, "GET", "/v1/admin/cluster", None,
                auth(str(admin["key"]))).status_code == 200


def test_keys_are_unique_and_shown_once(inprocess: InProcessServer) -> None:
    tenant = "u-" + secrets.token_hex(3)
    a, b = create_key(inprocess, tenant), create_key(inprocess, tenant)
    assert a["id"] != b["id"] and a["key"] != b["key"]
    assert a["tenant"] == b["tenant"] == tenant


# --- revocation ----------------------------------------------------------------------------------

def test_revoked_key_is_401_at_once(inprocess: InProcessServer) -> None:
    tenant = "rev-" + secrets.token_hex(3)
    doomed, other = create_key(inprocess, tenant), create_key(inprocess, tenant)
    headers = auth(str(doomed["key"]))
    r = call(inprocess, "POST", "/v1/subscriptions", {"type": "keyword", "keywords": ["a"]},
             headers)
    assert r.status_code == 201
    sid = r.json()["id"]
    r = call(inprocess, "DELETE", f"/v1/admin/keys/{doomed['id']}", None, inprocess.admin())
    assert r.status_code == 204 and r.content == b""
    # The very next request with the key is refused, on every endpoint.
    for method, path, body in V1:
        path = path.replace("s_0", sid)
        r = call(inprocess, method, path, body, headers)
        assert r.status_code == 401, (method, path, r.text)
    # Revoking one key leaves the tenant and its other keys alone.
    r = call(inprocess, "GET", f"/v1/subscriptions/{sid}", None, auth(str(other["key"])))
    assert r.status_code == 200, r.text
    # Revoking again, or an unknown id: 404.
    r = call(inprocess, "DELETE", f"/v1/admin/keys/{doomed['id']}", None, inprocess.admin())
    assert r.status_code == 404
    for bad in ("k_unknown", "x" * 300, "%00", "..%2F..%2Fetc"):
        r = call(inprocess, "DELETE", f"/v1/admin/keys/{bad}", None, inprocess.admin())
        assert r.status_code == 404, (bad, r.text)


def test_revoked_admin_key_is_401(inprocess: InProcessServer) -> None:
    admin = create_key(inprocess, "adm-" + secrets.token_hex(3), admin=True)
    r = call(inprocess, "DELETE", f"/v1/admin/keys/{admin['id']}", None, auth(str(admin["key"])))
    assert r.status_code == 204  # an admin key may revoke itself
    r = call(inprocess, "GET", "/v1/admin/cluster", None, auth(str(admin["key"])))
    assert r.status_code == 401


# --- tenant isolation ----------------------------------------------------------------------------

def test_another_tenants_ids_answer_404(inprocess_worker: InProcessServer) -> None:
    alice, bob = Api(inprocess_worker), Api(inprocess_worker)
    try:
        sub = alice.subscribe({"type": "range", "bbox": WORLD})
        alice.publish([{"id": "alice-car", "lon": 10, "lat": 10}])
        alice.wait_matches(sub["id"], lambda ms: len(ms) == 1)
        sid = sub["id"]
        assert bob.get(f"/v1/subscriptions/{sid}").status_code == 404
        assert bob.get(f"/v1/subscriptions/{sid}/matches").status_code == 404
        assert bob.delete(f"/v1/subscriptions/{sid}").status_code == 404
        assert bob.get("/v1/objects/alice-car").status_code == 404
        assert bob.subscription_ids() == []
        # Bob publishing an object with the same id neither moves Alice's object nor
        # reaches her subscription.
        bob_sub = bob.subscribe({"type": "range", "bbox": WORLD})
        bob.publish([{"id": "alice-car", "lon": 20, "lat": 20}])
        bob.wait_matches(bob_sub["id"], lambda ms: len(ms) == 1)
        assert alice.get("/v1/objects/alice-car").json()["lon"] == 10
        assert bob.get("/v1/objects/alice-car").json()["lon"] == 20
        # Alice's subscription is untouched by Bob's DELETE and sees only her object.
        assert alice.get(f"/v1/subscriptions/{sid}").status_code == 200
        assert alice.subscription_ids() == [sid]
        got = alice.matches(sid)
        assert [(m["object"]["id"], m["object"]["lon"]) for m in got] == [("alice-car", 10)]
        # Alice cannot delete or read Bob's either.
        assert alice.delete(f"/v1/subscriptions/{bob_sub['id']}").status_code == 404
        assert bob.get(f"/v1/subscriptions/{bob_sub['id']}").status_code == 200
    finally:
        alice.close()
        bob.close()
