"""`/metrics` is Prometheus text and counts what the api did (in-process: the counters are
this process's, read as differences)."""

from tests.conftest import InProcessServer, auth


def _value(text: str, name: str) -> float:
    for line in text.splitlines():
        if line.startswith(name + " ") or line.startswith(name + "{"):
            return float(line.rsplit(" ", 1)[1])
    raise AssertionError(f"{name} missing from /metrics")


def test_metrics_count_published_objects_and_subscriptions(inprocess: InProcessServer) -> None:
    with inprocess.http() as client:
        before = client.get("/metrics").text
        h = auth(inprocess.new_key())
        r = client.post("/v1/subscriptions", headers=h,
                        json={"type": "keyword", "keywords": ["m"]})
        assert r.status_code == 201
        objs = [{"lon": 1.0, "lat": 2.0}] * 3
        assert client.post("/v1/objects", headers=h, json={"objects": objs}).status_code == 202
        after = client.get("/metrics")
    assert after.headers["content-type"].startswith("text/plain")
    name = "geoswarm_objects_accepted_total"
    assert _value(after.text, name) - _value(before, name) == 3
    name = "geoswarm_subscriptions_created_total"
    assert _value(after.text, name) - _value(before, name) == 1
    assert "geoswarm_publish_seconds_bucket" in after.text
    assert "geoswarm_ws_connections" in after.text
