"""Authentication at the edges: the key is checked before any of the body is read; failed key
checks are throttled per client address (429 with Retry-After, without a lookup); `?token=` is
redacted from uvicorn's logs (a real uvicorn serving the app); production refuses guessable
secrets at start."""

from __future__ import annotations

import logging
import os
import secrets
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import uvicorn
import websockets.sync.client
from pydantic import ValidationError
from sqlalchemy import event

from app.core.config import Settings, get_settings
from app.core.migrate import upgrade_head
from app.core.redis import EmbeddedRedis, free_port
from bench.cluster import ROOT, cluster_env, own_database
from tests.app.asgiws import AsgiWebSocket, raw_request
from tests.conftest import InProcessServer, auth, start_inprocess

ONE_OBJECT = b'{"lon": 1, "lat": 1, "props": {"pad": "' + b"x" * 180 + b'"}}'
ONE_MIB = b'{"objects": [' + b",".join([ONE_OBJECT] * 5000) + b"]}"  # about a megabyte


# --- the key before the body -------------------------------------------------------------------

@pytest.mark.parametrize("headers", [{}, {"authorization": "Bearer gs_unknown"}],
                         ids=["missing", "unknown"])
@pytest.mark.parametrize("framing", ["content-length", "chunked"])
def test_key_is_checked_before_the_body_is_read(inprocess: InProcessServer,
                                                headers: dict[str, str], framing: str) -> None:
    length = ({"content-length": str(len(ONE_MIB))} if framing == "content-length"
              else {"transfer-encoding": "chunked"})
    chunks = [ONE_MIB[i:i + 65536] for i in range(0, len(ONE_MIB), 65536)]
    status, resp_headers, body, reads = raw_request(
        inprocess, "POST", "/v1/objects",
        {"content-type": "application/json", **length, **headers}, chunks,
        client=("10.9.0.1", 5000))
    assert status == 401, body
    assert reads == 0  # not one chunk of the megabyte was read
    assert b"API key" in body
    # The same request with a valid key reads the body and is accepted.
    key = inprocess.new_key()
    status, _, body, reads = raw_request(
        inprocess, "POST", "/v1/objects",
        {"content-type": "application/json", **length, "authorization": f"Bearer {key}"},
        chunks)
    assert status == 202, body
    assert reads == len(chunks)


def test_routes_without_a_body_and_unknown_paths_are_unchanged(inprocess: InProcessServer
                                                               ) -> None:
    """No early check where no body comes, or where no route is: 404 / 405 as before."""
    status, _, _, _ = raw_request(inprocess, "POST", "/v1/nothing-here",
                                  {"content-length": "2"}, [b"{}"])
    assert status == 404
    status, headers, _, _ = raw_request(inprocess, "PATCH", "/v1/subscriptions",
                                        {"content-length": "2"}, [b"{}"])
    assert status == 405 and "GET" in headers["allow"]


# --- throttled failures --------------------------------------------------------------------

LIMIT = 3
WINDOW_S = 2.0


@pytest.fixture
def throttled(tmp_path: Path, embedded_redis: EmbeddedRedis) -> Iterator[InProcessServer]:
    with start_inprocess(tmp_path, embedded_redis.url, GEOSWARM_AUTH_FAIL_LIMIT=str(LIMIT),
                         GEOSWARM_AUTH_FAIL_WINDOW_S=str(WINDOW_S)) as s:
        yield s


def get(s: InProcessServer, key: str, address: str) -> tuple[int, dict[str, str], bytes]:
    status, headers, body, _ = raw_request(s, "GET", "/v1/subscriptions",
                                           {"authorization": f"Bearer {key}"}, [],
                                           client=(address, 40000))
    return status, headers, body


def test_failed_key_checks_are_throttled_per_address(throttled: InProcessServer) -> None:
    s = throttled
    good = s.new_key()
    lookups: list[str] = []

    def count(_conn: Any, _cursor: Any, statement: str, *_: Any) -> None:
        if "api_keys.key_hash =" in statement:  # a key lookup (not the re-check of sockets)
            lookups.append(statement)

    engine = s.app.state.gs.engine
    event.listen(engine, "before_cursor_execute", count)
    try:
        for _ in range(LIMIT):
            assert get(s, "gs_guess" + secrets.token_hex(8), "10.1.1.1")[0] == 401
        assert len(lookups) == LIMIT
        status, headers, body = get(s, "gs_guess", "10.1.1.1")
        assert status == 429, body
        assert 1 <= int(headers["retry-after"]) <= WINDOW_S
        assert b"too many failed authentications" in body
        # Refused before any lookup, whatever the key, also a valid one and on the WebSocket.
        assert get(s, good, "10.1.1.1")[0] == 429
        ws = AsgiWebSocket(s, query=f"token={good}", client=("10.1.1.1", 40000))
        ws.connect()
        assert ws.wait_closed(5) == 1008
        ws.close()
        assert len(lookups) == LIMIT
        # Other addresses are not affected.
        assert get(s, good, "10.1.1.2")[0] == 200
        assert get(s, "gs_guess", "10.1.1.2")[0] == 401
        # The window ends: the address may try again.
        time.sleep(WINDOW_S + 0.1)
        assert get(s, good, "10.1.1.1")[0] == 200
    finally:
        event.remove(engine, "before_cursor_execute", count)


def test_websocket_from_a_throttled_address_is_closed_with_the_reason(
        throttled: InProcessServer) -> None:
    s = throttled
    for _ in range(LIMIT):
        ws = AsgiWebSocket(s, query="token=gs_guess", client=("10.2.2.2", 40000))
        ws.connect()
        assert ws.wait_closed(5) == 1008 and "unknown" in ws.close_reason
        ws.close()
    ws = AsgiWebSocket(s, query=f"token={s.new_key()}", client=("10.2.2.2", 40001))
    ws.connect()
    assert ws.wait_closed(5) == 1008
    assert "too many failed authentications" in ws.close_reason
    ws.close()


# --- ?token= in the logs ---------------------------------------------------------------------

class Collect(logging.Handler):
    def __init__(self) -> None:
        super().__init__()
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(record.getMessage())


@pytest.fixture
def uvicorn_app(tmp_path: Path, embedded_redis: EmbeddedRedis, monkeypatch: pytest.MonkeyPatch
                ) -> Iterator[tuple[str, Collect]]:
    """The api under a real uvicorn (in a thread) logging at info, as `uvicorn
    app.main:create_app --factory` does; the lines of its access and error loggers."""
    env = cluster_env(tmp_path, own_database(embedded_redis.url), workers=1)
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    get_settings.cache_clear()
    upgrade_head(get_settings())
    port = free_port()
    config = uvicorn.Config("app.main:create_app", factory=True, host="127.0.0.1", port=port,
                            log_level="info", access_log=True)
    collect = Collect()
    loggers = [logging.getLogger(n) for n in ("uvicorn.access", "uvicorn.error")]
    for logger in loggers:  # after uvicorn's logging config, which replaces handlers
        logger.addHandler(collect)
    server = uvicorn.Server(config)
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    try:
        deadline = time.monotonic() + 30
        while not server.started:
            assert thread.is_alive() and time.monotonic() < deadline, "uvicorn did not start"
            time.sleep(0.05)
        yield f"127.0.0.1:{port}", collect
    finally:
        server.should_exit = True
        thread.join(30)
        for logger in loggers:
            logger.removeHandler(collect)
        get_settings.cache_clear()


def test_token_is_redacted_from_uvicorn_logs(uvicorn_app: tuple[str, Collect]) -> None:
    address, collect = uvicorn_app
    base = f"http://{address}"
    admin = {"Authorization": f"Bearer {os.environ['GEOSWARM_BOOTSTRAP_ADMIN_KEY']}"}
    key = httpx.post(f"{base}/v1/admin/keys", json={"tenant": "logs"}, headers=admin).json()["key"]
    guess = "gs_" + secrets.token_hex(20)
    assert httpx.get(f"{base}/v1/subscriptions", params={"token": guess}).status_code == 401
    assert httpx.get(f"{base}/v1/subscriptions?a=1&token={guess}&b=2",
                     headers=auth(key)).status_code == 200
    with websockets.sync.client.connect(f"ws://{address}/v1/stream?token={key}") as ws:
        ws.send('{"op": "listen", "all": true}')
        assert "listening" in str(ws.recv(timeout=10))
    deadline = time.monotonic() + 5
    while sum("token=" in line for line in collect.lines) < 3 and time.monotonic() < deadline:
        time.sleep(0.05)
    logged = "\n".join(collect.lines)
    assert key not in logged and guess not in logged, logged
    assert logged.count("token=[redacted]") >= 3, logged
    assert "a=1&token=[redacted]&b=2" in logged
    assert any("WebSocket /v1/stream?token=[redacted]" in line for line in collect.lines), logged


# --- production secrets ----------------------------------------------------------------------

WEAK_KEYS = {
    "placeholder": "changeme",
    "placeholder-upper": "ChangeMe",
    "admin": "admin",
    "short-random": secrets.token_urlsafe(12),
    "31-chars": secrets.token_hex(16)[:31],
    "repeated": "a" * 40,
    "repeated-placeholder": "changeme" * 5,
}


@pytest.mark.parametrize("key", WEAK_KEYS.values(), ids=WEAK_KEYS.keys())
def test_production_refuses_a_weak_bootstrap_key(key: str) -> None:
    with pytest.raises(ValidationError) as info:
        Settings(environment="production", bootstrap_admin_key=key)
    message = str(info.value)
    assert "GEOSWARM_BOOTSTRAP_ADMIN_KEY" in message and "production" in message
    assert key not in message or key.lower() in ("changeme", "admin")  # not echoed back


def test_production_accepts_a_strong_key_and_no_key() -> None:
    Settings(environment="production", bootstrap_admin_key=secrets.token_urlsafe(32))
    Settings(environment="production", bootstrap_admin_key=None)
    Settings(environment="development", bootstrap_admin_key="changeme")  # only production


@pytest.mark.parametrize("field", ["database_url", "redis_url"])
def test_production_refuses_a_well_known_password(field: str) -> None:
    url = ("postgresql://geoswarm:postgres@db:5432/geoswarm" if field == "database_url"
           else "redis://:password@redis:6379/0")
    with pytest.raises(ValidationError, match="well-known"):
        Settings.model_validate({"environment": "production", field: url})
    strong = url.replace("postgres@" if field == "database_url" else "password@",
                         secrets.token_urlsafe(24) + "@")
    Settings.model_validate({"environment": "production", field: strong})


def test_api_refuses_to_start_in_production_with_a_placeholder_key(tmp_path: Path) -> None:
    env = {**os.environ, "GEOSWARM_ENVIRONMENT": "production",
           "GEOSWARM_BOOTSTRAP_ADMIN_KEY": "changeme", "GEOSWARM_DATA_DIR": str(tmp_path)}
    proc = subprocess.run([sys.executable, "-m", "app.cli", "api", "--no-migrate", "--port",
                           str(free_port())], env=env, cwd=ROOT, capture_output=True,
                          text=True, timeout=60)
    assert proc.returncode != 0
    assert "GEOSWARM_BOOTSTRAP_ADMIN_KEY" in proc.stderr
    assert "well-known placeholder" in proc.stderr
