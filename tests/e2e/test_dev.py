"""`geoswarm dev` as a user runs it: start, wait for /readyz, create a key with the CLI, use the
API, stop with SIGTERM, and no child process survives."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import psutil
import pytest

from app.cli import wait_until_ok
from app.core.redis import free_port
from tests.conftest import ROOT, auth

pytestmark = pytest.mark.slow


def test_geoswarm_dev_end_to_end(tmp_path: Path) -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith("GEOSWARM_")}
    env["GEOSWARM_DATA_DIR"] = str(tmp_path / "data")
    port = free_port()
    dev = subprocess.Popen([sys.executable, "-m", "app.cli", "dev", "--port", str(port),
                            "--workers", "2"], env=env, cwd=ROOT, stdout=subprocess.PIPE,
                           stderr=subprocess.STDOUT, text=True)
    base = f"http://127.0.0.1:{port}"
    try:
        assert wait_until_ok(base + "/readyz", dev, timeout=90), (
            dev.stdout.read() if dev.stdout and dev.poll() is not None else "not ready in 90 s")
        key = subprocess.run([sys.executable, "-m", "app.cli", "keys", "create", "--tenant",
                              "acme"], env=env, cwd=ROOT, capture_output=True, text=True,
                             check=True).stdout.strip().splitlines()[-1]
        specs = [{"type": "range", "bbox": [-74.02, 40.70, -73.93, 40.80]},
                 {"type": "keyword", "keywords": ["earthquake", "tokyo"], "match": "all"}]
        for spec in specs:
            r = httpx.post(base + "/v1/subscriptions", json=spec, headers=auth(key))
            assert r.status_code == 201, r.text
        listed = httpx.get(base + "/v1/subscriptions", headers=auth(key)).json()
        assert [s["type"] for s in listed["items"]] == ["range", "keyword"]
        admin_key = (tmp_path / "data" / "admin.key").read_text().strip()
        cluster = httpx.get(base + "/v1/admin/cluster", headers=auth(admin_key)).json()
        assert sorted(w["id"] for w in cluster["workers"] if w["alive"]) == ["w0", "w1"]
        # a worker that dies is restarted by the supervisor within a few seconds
        old_pid = next(w["pid"] for w in cluster["workers"] if w["id"] == "w0")
        os.kill(old_pid, signal.SIGKILL)
        deadline = time.monotonic() + 20
        while True:
            workers = httpx.get(base + "/v1/admin/cluster", headers=auth(admin_key)).json()
            w0 = next(w for w in workers["workers"] if w["id"] == "w0")
            if w0["alive"] and w0["pid"] != old_pid:
                break
            assert time.monotonic() < deadline, "w0 was not restarted"
            time.sleep(0.2)
        children = psutil.Process(dev.pid).children(recursive=True)
        assert len(children) >= 4  # redis-server, api, two workers
    finally:
        dev.send_signal(signal.SIGTERM)
        out, _ = dev.communicate(timeout=60)
    assert dev.returncode == 0, out
    assert "admin key:" in out and f"{base}/docs" in out
    assert "queries over it: query runner r0" in out, out  # Java is there: a runner runs
    gone, alive = psutil.wait_procs(children, timeout=10)
    assert not alive, f"orphans: {alive}"


def test_geoswarm_dev_without_java_says_archive_queries_are_off(tmp_path: Path) -> None:
    """Without Java (JAVA_HOME naming no Java, none on PATH), dev says plainly that queries
    over the archive are off, everything else runs, and such a query answers 503 saying why."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("GEOSWARM_")}
    env["GEOSWARM_DATA_DIR"] = str(tmp_path / "data")
    env["JAVA_HOME"] = str(tmp_path / "no-java")
    port = free_port()
    dev = subprocess.Popen([sys.executable, "-m", "app.cli", "dev", "--port", str(port),
                            "--workers", "1"], env=env, cwd=ROOT, stdout=subprocess.PIPE,
                           stderr=subprocess.STDOUT, text=True)
    base = f"http://127.0.0.1:{port}"
    try:
        assert wait_until_ok(base + "/readyz", dev, timeout=90)
        key = subprocess.run([sys.executable, "-m", "app.cli", "keys", "create", "--tenant",
                              "acme"], env=env, cwd=ROOT, capture_output=True, text=True,
                             check=True).stdout.strip().splitlines()[-1]
        r = httpx.post(base + "/v1/objects", json={"objects": [{"lon": 1, "lat": 2}]},
                       headers=auth(key))
        assert r.status_code == 202, r.text
        r = httpx.post(base + "/v1/queries", json={"type": "count", "bbox": [0, 0, 3, 3],
                                                    "from": 0}, headers=auth(key), timeout=30)
        assert r.status_code == 503 and "no query runner is running" in r.json()["detail"]
        r = httpx.post(base + "/v1/queries", json={"type": "count", "bbox": [0, 0, 3, 3]},
                       headers=auth(key), timeout=30)
        assert r.status_code == 200 and r.json()["results"] == [{"count": 1}], r.text
    finally:
        dev.send_signal(signal.SIGTERM)
        out, _ = dev.communicate(timeout=60)
    assert dev.returncode == 0, out
    assert "queries reaching before the live window are OFF: no Java 17+" in out, out
