"""`/metrics` is Prometheus text and counts what the api did."""

import httpx

from tests.conftest import LiveServer, auth


def _value(text: str, name: str) -> float:
    for line in text.splitlines():
        if line.startswith(name + " ") or line.startswith(name + "{"):
            return float(line.rsplit(" ", 1)[1])
    raise AssertionError(f"{name} missing from /metrics")


def test_metrics_count_published_objects_and_subscriptions(server: LiveServer,
                                                           tenant_key: str) -> None:
    before = httpx.get(server.base_url + "/metrics").text
    h = auth(tenant_key)
    r = httpx.post(server.base_url + "/v1/subscriptions", headers=h,
                   json={"type": "keyword", "keywords": ["m"]})
    assert r.status_code == 201
    objs = [{"lon": 1.0, "lat": 2.0}] * 3
    assert httpx.post(server.base_url + "/v1/objects", headers=h,
                      json={"objects": objs}).status_code == 202
    after = httpx.get(server.base_url + "/metrics")
    assert after.headers["content-type"].startswith("text/plain")
    name = "geoswarm_objects_accepted_total"
    assert _value(after.text, name) - _value(before, name) == 3
    name = "geoswarm_subscriptions_created_total"
    assert _value(after.text, name) - _value(before, name) == 1
    assert "geoswarm_publish_seconds_bucket" in after.text
    assert "geoswarm_ws_connections" in after.text
