"""Prometheus metrics of an api process (each api process serves its own /metrics)."""

from __future__ import annotations

from prometheus_client import Counter, Gauge, Histogram

OBJECTS_ACCEPTED = Counter("geoswarm_objects_accepted_total", "Objects accepted (202)")
PUBLISH_SECONDS = Histogram("geoswarm_publish_seconds", "Time to validate and queue a batch",
                            buckets=(0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 1))
SUBSCRIPTIONS_CREATED = Counter("geoswarm_subscriptions_created_total", "Subscriptions created")
SUBSCRIPTIONS_DELETED = Counter("geoswarm_subscriptions_deleted_total",
                                "Subscriptions deleted or expired", ["reason"])
WS_CONNECTIONS = Gauge("geoswarm_ws_connections", "Open WebSocket connections")
WS_MESSAGES = Counter("geoswarm_ws_messages_total", "Messages sent to WebSocket clients",
                      ["path"])
WS_CLOSED = Counter("geoswarm_ws_closed_total", "WebSockets closed by the server", ["code"])
