"""`geoswarm dev` supervises its embedded Redis: SIGKILL the redis-server and dev starts it again
on the same port and data dir, so it reloads its AOF (with what it had written) and the
system becomes ready again by itself; a restart that fails (the port taken) is retried."""

from __future__ import annotations

import logging
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import httpx
import psutil
import pytest
import redis

from app.cli import RedisSupervisor
from app.core.config import Settings
from app.core.processes import wait_until_ok
from app.core.redis import free_port, restart_embedded_redis, start_embedded_redis
from bench.cluster import ROOT
from tests.conftest import auth

pytestmark = pytest.mark.slow


def _redis_server(dev: subprocess.Popen[str]) -> psutil.Process | None:
    """dev's redis-server child (the embedded one it started and supervises)."""
    for child in psutil.Process(dev.pid).children(recursive=False):
        try:
            if "redis-server" in child.name():
                return child
        except psutil.NoSuchProcess:
            continue
    return None


def _wait(predicate: Callable[[], bool], timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, what
        time.sleep(0.1)


def _matched(base: str, key: str, sub: str, object_id: str) -> bool:
    r = httpx.get(f"{base}/v1/subscriptions/{sub}/matches", headers=auth(key), timeout=10)
    return r.status_code == 200 and any(
        m.get("object", {}).get("id") == object_id for m in r.json()["items"])


def test_dev_restarts_a_killed_redis_with_its_data(tmp_path: Path) -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith("GEOSWARM_")}
    data = tmp_path / "data"
    env["GEOSWARM_DATA_DIR"] = str(data)
    # what was acknowledged before the kill must be back after it: under `everysec` that
    # holds only while the disk keeps up (docs/operations.md, delivery guarantees)
    env["GEOSWARM_REDIS_APPENDFSYNC"] = "always"
    port = free_port()
    dev = subprocess.Popen([sys.executable, "-m", "app.cli", "dev", "--port", str(port),
                            "--workers", "1"], env=env, cwd=ROOT, stdout=subprocess.PIPE,
                           stderr=subprocess.STDOUT, text=True)
    base = f"http://127.0.0.1:{port}"
    children: list[psutil.Process] = []
    try:
        assert wait_until_ok(base + "/readyz", dev, timeout=90), "dev not ready in 90 s"
        url = (data / "redis" / "redis.url").read_text().strip()
        admin = auth((data / "admin.key").read_text().strip())
        r = httpx.post(base + "/v1/admin/keys", json={"tenant": "acme"}, headers=admin)
        key = r.json()["key"]
        sub = httpx.post(base + "/v1/subscriptions", headers=auth(key), json={
            "type": "keyword", "keywords": ["coffee"]}).json()["id"]

        # Acknowledged before the kill: a key written straight to Redis, a moving object's
        # position (202: durably queued) and the match a worker wrote for it.
        client = redis.Redis.from_url(url)
        client.set("test:before-kill", b"kept")
        client.close()
        r = httpx.post(base + "/v1/objects", headers=auth(key), json={"objects": [
            {"id": "taxi-1", "lon": 2.35, "lat": 48.85, "keywords": ["coffee"]}]})
        assert r.status_code == 202, r.text
        _wait(lambda: _matched(base, key, sub, "taxi-1"), 30, "taxi-1 was not matched")

        old = _redis_server(dev)
        assert old is not None, "dev has no redis-server child"
        old_pid = old.pid
        old.send_signal(signal.SIGKILL)
        old.wait(10)

        # dev notices within a second or so and starts a new one on the same port
        def restarted() -> bool:
            new = _redis_server(dev)
            return new is not None and new.pid != old_pid
        _wait(restarted, 30, "redis-server was not restarted")
        assert (data / "redis" / "redis.url").read_text().strip() == url
        client = redis.Redis.from_url(url, socket_timeout=5)
        _wait(lambda: _ping(client), 30, "the restarted redis-server does not answer")
        assert client.get("test:before-kill") == b"kept"  # the AOF was loaded
        # restarted with the configured fsync policy
        assert client.config_get("appendfsync") == {"appendfsync": "always"}

        # the rest of the system finds it again by itself
        assert wait_until_ok(base + "/readyz", dev, timeout=60), "not ready after the restart"
        r = httpx.get(base + "/v1/objects/taxi-1", headers=auth(key))
        assert r.status_code == 200 and r.json()["lon"] == 2.35, r.text
        assert _matched(base, key, sub, "taxi-1")  # the retained match survived
        r = httpx.post(base + "/v1/objects", headers=auth(key), json={"objects": [
            {"id": "taxi-2", "lon": 2.36, "lat": 48.86, "keywords": ["coffee"]}]})
        assert r.status_code == 202, r.text
        _wait(lambda: _matched(base, key, sub, "taxi-2"), 60, "nothing matched after the restart")
        client.close()
        children = psutil.Process(dev.pid).children(recursive=True)
    finally:
        dev.send_signal(signal.SIGTERM)
        out, _ = dev.communicate(timeout=60)
    assert dev.returncode == 0, out
    assert f"restarting it on port {url.rsplit(':', 1)[1].split('/')[0]}" in out, out
    assert "embedded redis-server restarted" in out, out
    _gone, alive = psutil.wait_procs(children, timeout=10)
    assert not alive, f"orphans: {alive}"


def _ping(client: redis.Redis) -> bool:
    try:
        return bool(client.ping())
    except redis.RedisError:
        return False


def test_a_restart_that_fails_is_retried(tmp_path: Path, caplog: pytest.LogCaptureFixture
                                         ) -> None:
    """The supervisor of dev on its own: the port taken by another program while the server is
    down, so the restart fails (logged, retried later); once the port is free it restarts, with
    the data of its AOF."""
    settings = Settings(data_dir=tmp_path)
    server = start_embedded_redis(settings)
    supervisor = RedisSupervisor(settings, server)
    try:
        with pytest.raises(RuntimeError, match="still running"):
            restart_embedded_redis(settings, server)
        client = redis.Redis.from_url(server.url)
        client.set("kept", b"yes")
        client.close()
        supervisor.check()
        assert supervisor.server is server  # alive: nothing to do
        server.process.kill()
        server.process.wait()
        squatter = socket.socket()
        squatter.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        squatter.bind(("127.0.0.1", server.port))
        squatter.listen()
        try:
            with caplog.at_level(logging.WARNING, logger="geoswarm"):
                supervisor.check()
            assert supervisor.server is server and supervisor.failures == 1
            assert "did not restart" in caplog.text and "retrying in 1 s" in caplog.text
            supervisor.check()  # too early for the next try: nothing happens
            assert supervisor.failures == 1
        finally:
            squatter.close()
        time.sleep(1.1)
        with caplog.at_level(logging.WARNING, logger="geoswarm"):
            supervisor.check()
        assert supervisor.server is not server and supervisor.failures == 0
        assert supervisor.server.url == server.url
        assert "embedded redis-server restarted" in caplog.text
        client = redis.Redis.from_url(supervisor.server.url)
        assert client.get("kept") == b"yes"
        client.close()
    finally:
        supervisor.server.stop()
