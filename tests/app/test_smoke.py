"""The shortest path through the api: liveness, and one subscription created and read back."""

from tests.conftest import InProcessServer, auth


def test_health_and_subscription_roundtrip(inprocess: InProcessServer) -> None:
    with inprocess.http() as client:
        assert client.get("/healthz").json() == {"status": "ok"}
        r = client.post("/v1/subscriptions", headers=auth(inprocess.new_key()),
                        json={"type": "keyword", "keywords": ["Coffee"]})
    assert r.status_code == 201, r.text
    assert r.json()["keywords"] == ["coffee"]
