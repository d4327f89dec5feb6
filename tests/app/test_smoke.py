import httpx

from tests.conftest import LiveServer, auth


def test_health_and_subscription_roundtrip(server: LiveServer, tenant_key: str) -> None:
    assert httpx.get(server.base_url + "/healthz").json() == {"status": "ok"}
    r = httpx.post(server.base_url + "/v1/subscriptions", headers=auth(tenant_key),
                   json={"type": "keyword", "keywords": ["Coffee"]})
    assert r.status_code == 201, r.text
    assert r.json()["keywords"] == ["coffee"]
