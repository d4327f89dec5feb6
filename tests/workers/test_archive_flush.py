"""The workers' flush of expired buckets to the Parquet archive, with real processes: every
record published is in exactly one committed file below its worker's archive cut, also when a
worker is SIGKILLed between committing a bucket's files and raising its cut, and when one is
SIGKILLed at random while it flushes; the files are sorted along the Z-order curve."""

from __future__ import annotations

import random
import signal
import time
from collections import Counter
from pathlib import Path
from typing import Any

import httpx
import pyarrow.parquet as pq
import pytest
import redis

from app.archive.layout import CELLS_META, ArchiveStore, visible
from app.pipeline import names
from tests.conftest import LiveServer, auth, start_server
from workers.archiving import KILL_AFTER_WRITE_ENV

pytestmark = pytest.mark.slow

WINDOW = {"GEOSWARM_WINDOW_S": "2", "GEOSWARM_BUCKET_S": "1"}


def publish_for(server: LiveServer, key: str, seconds: float, seed: int,
                during: Any = None) -> Counter[tuple[str, float]]:
    """Publish batches of events and moving objects' records for `seconds`; the (id, ts) of
    every record accepted."""
    rng = random.Random(seed)
    sent: Counter[tuple[str, float]] = Counter()
    end = time.monotonic() + seconds
    i = 0
    with httpx.Client(base_url=server.base_url, timeout=30) as client:
        while time.monotonic() < end:
            objs = []
            for j in range(60):
                obj: dict[str, Any] = {"lon": rng.uniform(-60, 60), "lat": rng.uniform(-50, 50),
                                       "ts": 1_700_000_000 + i * 100 + j,
                                       "keywords": rng.sample(["taxi", "bus", "rain"], 1)}
                if j % 3 == 0:
                    obj["id"] = f"car-{rng.randrange(40)}"
                objs.append(obj)
            r = client.post("/v1/objects", json={"objects": objs}, headers=auth(key))
            assert r.status_code == 202, r.text
            for obj, oid in zip(objs, r.json()["ids"], strict=True):
                sent[(oid, float(obj["ts"]))] += 1
            if during is not None:
                during(i)
            i += 1
            time.sleep(0.05)
    return sent


def archived(server: LiveServer, tenant: str) -> Counter[tuple[str, float]]:
    """(id, ts) of every archived row of the tenant in the files below the workers' cuts."""
    r = redis.Redis.from_url(server.redis_url)
    cut = {k.decode(): int(v) for k, v in r.hgetall(names.ARCHIVE_CUT).items()}
    r.close()
    store = ArchiveStore(str(Path(server.env["GEOSWARM_DATA_DIR"]) / "archive"))
    got: Counter[tuple[str, float]] = Counter()
    for f in visible(store.bucket_files(tenant), cut):
        table = pq.read_table(f.path)
        assert set(table.column("bucket").to_pylist()) == {f.bucket}
        assert set(table.column("worker").to_pylist()) == {f.worker}
        z = table.column("z").to_pylist()
        assert z == sorted(z)
        assert CELLS_META in (table.schema.metadata or {})
        got.update(zip(table.column("id").to_pylist(), table.column("ts").to_pylist(),
                       strict=True))
    return got


def wait_archived(server: LiveServer, tenant: str, sent: Counter[tuple[str, float]],
                  timeout: float = 60) -> Counter[tuple[str, float]]:
    deadline = time.monotonic() + timeout
    got: Counter[tuple[str, float]] = Counter()
    while time.monotonic() < deadline:
        got = archived(server, tenant)
        if sum(got.values()) >= sum(sent.values()):
            break
        time.sleep(0.5)
    return got


def assert_once(got: Counter[tuple[str, float]], sent: Counter[tuple[str, float]]) -> None:
    missing, extra = sent - got, got - sent
    assert not missing and not extra, (
        f"{sum(missing.values())} missing e.g. {list(missing)[:3]}; "
        f"{sum(extra.values())} extra e.g. {list(extra)[:3]}")


def restart_when_dead(server: LiveServer, deadline_s: float = 60) -> str:
    """Wait for a worker to die (the crash point), start it again; its id."""
    end = time.monotonic() + deadline_s
    while time.monotonic() < end:
        for name, proc in list(server.procs.items()):
            if name.startswith("w") and proc.poll() is not None:
                assert proc.returncode == -signal.SIGKILL
                server.start_worker(name)
                return name
        time.sleep(0.1)
    raise TimeoutError("no worker reached the crash point")


def test_a_crash_between_the_files_and_the_cut_loses_and_duplicates_nothing(
        tmp_path: Path, embedded_redis: Any) -> None:
    marker = tmp_path / "killed"
    server = start_server(tmp_path, embedded_redis.url, workers=2,
                          **{**WINDOW, KILL_AFTER_WRITE_ENV: str(marker)})
    try:
        server.wait_workers(2)
        tenant = "arch-" + tmp_path.name[-6:]
        key = server.new_key(tenant)
        sent = publish_for(server, key, 4, 1)
        name = restart_when_dead(server)
        assert marker.exists()
        # the dead worker's files of the bucket it was flushing are there, its cut is not
        server.wait_workers(2)
        sent += publish_for(server, key, 2, 2)
        got = wait_archived(server, tenant, sent)
        assert_once(got, sent)
        assert "ready" in (tmp_path / f"{name}.log").read_text()
    finally:
        server.stop()


def test_workers_killed_at_random_while_flushing_archive_every_record_once(
        tmp_path: Path, embedded_redis: Any) -> None:
    server = start_server(tmp_path, embedded_redis.url, workers=2, **WINDOW)
    try:
        server.wait_workers(2)
        tenant = "arch-" + tmp_path.name[-6:]
        key = server.new_key(tenant)
        rng = random.Random(7)

        def during(i: int) -> None:
            if i % 18 == 17:
                w = rng.choice(["w0", "w1"])
                server.kill(w, signal.SIGKILL)
                server.start_worker(w)

        sent = publish_for(server, key, 8, 3, during)
        got = wait_archived(server, tenant, sent, 90)
        assert_once(got, sent)
    finally:
        server.stop()


def test_a_dead_workers_window_is_archived_by_its_adopter(tmp_path: Path,
                                                          embedded_redis: Any) -> None:
    """w1 is SIGKILLed for good while its window holds records; the coordinator fails it over
    and w0 adopts its stream: w0 flushes w1's window under w1's name, every record once."""
    server = start_server(tmp_path, embedded_redis.url, workers=2,
                          GEOSWARM_WORKER_DEAD_AFTER_S="2", GEOSWARM_WINDOW_S="4",
                          GEOSWARM_BUCKET_S="1")
    try:
        server.wait_workers(2)
        server.start_coordinator()
        tenant = "arch-" + tmp_path.name[-6:]
        key = server.new_key(tenant)
        sent = publish_for(server, key, 2, 11)
        server.kill("w1", signal.SIGKILL)  # its last buckets are still in its window
        sent += publish_for(server, key, 3, 12)
        got = wait_archived(server, tenant, sent, 90)
        assert_once(got, sent)
        r = redis.Redis.from_url(server.redis_url)
        assert r.get(names.adopter_key("w1")) == b"w0"
        r.close()
    finally:
        server.stop()
