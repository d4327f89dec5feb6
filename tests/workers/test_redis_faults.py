"""Exactly once through Redis faults, against the brute-force oracle, with real api and worker
processes: Redis SIGKILLed and restarted on its AOF while workers have a backlog, and a proxy
that cuts connections after a transaction or script is sent and before its reply comes back
(so that a client which sends the call again would apply it twice)."""

from __future__ import annotations

import asyncio
import hashlib
import os
import random
import signal
import socket
import threading
import time
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import redis

from app.core.config import Settings
from app.core.redis import EmbeddedRedis, restart_embedded_redis, start_embedded_redis
from app.pipeline.router import PUBLISH_SCRIPT
from tests.conftest import LiveServer, auth
from tests.workers.harness import replay_all, run_on_cluster
from tests.workers.oracle import Oracle, received_matches
from tests.workers.test_pipeline import assert_exact, create_subs, random_objects, random_subs

pytestmark = pytest.mark.slow


async def history_matches(client: httpx.AsyncClient, key: str, ids: list[str]
                          ) -> Counter[Any]:
    for _attempt in range(50):  # a read in an outage the test causes gets 503: read again
        try:
            items: list[dict[str, Any]] = []
            for sid in ids:
                items += await replay_all(client, sid, auth(key))
            return received_matches(items)
        except httpx.HTTPStatusError as exc:
            if exc.response.status_code != 503:
                raise
            await asyncio.sleep(0.5)
    raise AssertionError("the histories stayed unreadable")


async def wait_exact(client: httpx.AsyncClient, key: str, ids: list[str], oracle: Oracle,
                     timeout: float) -> None:
    """Poll the histories until they hold as many matches as the oracle expects, then check
    they hold exactly those (a duplicate shows up as a count above the oracle's)."""
    deadline = time.monotonic() + timeout
    got: Counter[Any] = Counter()
    while time.monotonic() < deadline:
        got = await history_matches(client, key, ids)
        if sum(got.values()) >= oracle.total():
            break
        await asyncio.sleep(0.5)
    await asyncio.sleep(1.0)  # anything extra would arrive now
    assert_exact(await history_matches(client, key, ids), oracle)


async def publish_once_accepted(client: httpx.AsyncClient, key: str, oracle: Oracle,
                                objs: Any, timeout: float = 30) -> None:
    """Publish `objs()` again until a 202 (503s while the system recovers), into the oracle."""
    deadline = time.monotonic() + timeout
    while True:
        batch = objs()
        r = await client.post("/v1/objects", json={"objects": batch}, headers=auth(key))
        if r.status_code == 202:
            oracle.publish(batch, r.json()["ids"])
            return
        assert r.status_code == 503 and time.monotonic() < deadline, r.text
        await asyncio.sleep(0.5)


# --- Redis SIGKILLed and restarted ----------------------------------------------------------

@pytest.fixture
def own_redis(tmp_path: Path) -> Iterator[tuple[Settings, list[EmbeddedRedis]]]:
    """A redis-server of this test only, to kill and restart. AOF with `appendfsync always`:
    the setting under which a SIGKILLed Redis keeps every write it acknowledged. Under
    `everysec` Redis holds the AOF in memory, for up to two seconds, while a background fsync
    is slow (a busy disk): a kill then loses acknowledged writes (a 202'd batch never matched,
    seen once in CI), which the scenarios here would rightly count as lost."""
    settings = Settings(data_dir=tmp_path / "redis-data", redis_appendfsync="always")
    servers = [start_embedded_redis(settings)]
    yield settings, servers
    servers[-1].stop()


def test_appendfsync_always_keeps_every_acknowledged_write_through_sigkill(
        own_redis: tuple[Settings, list[EmbeddedRedis]]) -> None:
    """What the fixture above rests on: writes acknowledged while another writer keeps the disk
    busy with fsyncs (the case where `everysec` holds them in memory, and a kill then loses
    them) all come back after a SIGKILL and a restart from the AOF."""
    settings, servers = own_redis
    busy = threading.Event()

    def keep_disk_busy() -> None:
        block = os.urandom(1 << 20)
        with open(settings.data_dir / "busy", "wb") as f:
            while not busy.is_set():
                for _ in range(64):
                    f.write(block)
                os.fsync(f.fileno())
                f.seek(0)

    writer = threading.Thread(target=keep_disk_busy)
    writer.start()
    client = redis.Redis.from_url(servers[-1].url)
    try:
        deadline = time.monotonic() + 2
        acknowledged = 0
        while time.monotonic() < deadline:
            acknowledged = int(client.incr("acknowledged"))
            client.xadd("entries", {"n": acknowledged})
            # the worst moment for a kill: acknowledged writes Redis has not yet written
            if acknowledged % 20 == 0 and client.info("persistence")["aof_buffer_length"]:
                break
        servers[-1].process.send_signal(signal.SIGKILL)
        servers[-1].process.wait()
    finally:
        busy.set()
        writer.join()
        client.close()
    servers.append(restart_embedded_redis(settings, servers[-1]))
    client = redis.Redis.from_url(servers[-1].url)
    try:
        assert int(client.get("acknowledged") or 0) == acknowledged
        assert client.xlen("entries") == acknowledged
    finally:
        client.close()


async def _redis_killed(server: LiveServer, settings: Settings,
                        servers: list[EmbeddedRedis]) -> None:
    rng = random.Random(7)
    key = server.new_key()
    oracle = Oracle()
    async with httpx.AsyncClient(base_url=server.base_url, timeout=30) as client:
        ids = await create_subs(client, key, random_subs(rng, 60), oracle)
        movers = [f"m{i}" for i in range(30)]
        clock = [1_700_000_000.0]
        # A backlog queued while the workers are stopped; they resume, read it (entries now
        # pending) and Redis dies under them.
        workers = [server.procs[w] for w in ("w0", "w1")]
        for proc in workers:
            proc.send_signal(signal.SIGSTOP)
        for _ in range(12):
            objs = random_objects(rng, 400, movers, clock)
            r = await client.post("/v1/objects", json={"objects": objs}, headers=auth(key))
            assert r.status_code == 202, r.text
            oracle.publish(objs, r.json()["ids"])
        for proc in workers:
            proc.send_signal(signal.SIGCONT)
        await asyncio.sleep(0.15)
        servers[-1].process.send_signal(signal.SIGKILL)
        servers[-1].process.wait()
        # While Redis is down, a publish is refused and changes nothing.
        r = await client.post("/v1/objects", headers=auth(key),
                              json={"objects": random_objects(rng, 10, movers, [clock[0]])})
        assert r.status_code == 503, r.text
        assert "retry-after" in r.headers
        await asyncio.sleep(3)
        servers.append(restart_embedded_redis(settings, servers[-1]))
        # The system recovers by itself, and what comes after is matched too.
        await publish_once_accepted(client, key, oracle,
                                    lambda: random_objects(rng, 50, movers, clock))
        for _ in range(4):
            objs = random_objects(rng, 50, movers, clock)
            r = await client.post("/v1/objects", json={"objects": objs}, headers=auth(key))
            assert r.status_code == 202, r.text
            oracle.publish(objs, r.json()["ids"])
        assert oracle.total() > 1000
        await wait_exact(client, key, ids, oracle, timeout=120)


def test_redis_sigkill_and_restart_lose_and_duplicate_nothing(
        tmp_path: Path, own_redis: tuple[Settings, list[EmbeddedRedis]]) -> None:
    settings, servers = own_redis
    run_on_cluster(tmp_path / "cluster", servers[0].url, 2,
                   lambda server: _redis_killed(server, settings, servers))


async def _killed_mid_burst(server: LiveServer, settings: Settings,
                            servers: list[EmbeddedRedis]) -> None:
    """Four publishers keep publishing while Redis is SIGKILLed and restarted: each answer is
    exact, 202 applied and 503 not (a publish whose reply was lost learns its outcome from its
    guard key once Redis is back)."""
    rng = random.Random(13)
    key = server.new_key()
    oracle = Oracle()
    outcomes: Counter[int] = Counter()
    stop = asyncio.Event()
    async with httpx.AsyncClient(base_url=server.base_url, timeout=60) as client:
        ids = await create_subs(client, key, random_subs(rng, 60), oracle)

        async def publisher(n: int) -> None:
            own = random.Random(100 + n)
            movers = [f"p{n}-m{i}" for i in range(8)]  # each its own: its order is the oracle's
            clock = [1_700_000_000.0 + n]
            while not stop.is_set():
                objs = random_objects(own, 40, movers, clock)
                r = await client.post("/v1/objects", json={"objects": objs}, headers=auth(key))
                outcomes[r.status_code] += 1
                if r.status_code == 202:
                    oracle.publish(objs, r.json()["ids"])
                else:
                    assert r.status_code == 503, r.text
                    await asyncio.sleep(0.2)

        tasks = [asyncio.create_task(publisher(n)) for n in range(4)]
        await asyncio.sleep(1.5)
        servers[-1].process.send_signal(signal.SIGKILL)
        await asyncio.to_thread(servers[-1].process.wait)
        await asyncio.sleep(3)
        servers.append(await asyncio.to_thread(restart_embedded_redis, settings, servers[-1]))
        await asyncio.sleep(3)
        stop.set()
        await asyncio.gather(*tasks)
        assert outcomes[503] >= 1 and outcomes[202] >= 20, outcomes
        await wait_exact(client, key, ids, oracle, timeout=120)


def test_redis_sigkill_mid_burst_every_answer_is_exact(
        tmp_path: Path, own_redis: tuple[Settings, list[EmbeddedRedis]]) -> None:
    settings, servers = own_redis
    run_on_cluster(tmp_path / "cluster", servers[0].url, 2,
                   lambda server: _killed_mid_burst(server, settings, servers))


# --- replies lost after the call was applied ------------------------------------------------

class CuttingProxy:
    """A TCP proxy to Redis that, for every `every`-th call sent as a transaction (EXEC) or a
    script (EVALSHA), forwards the call, lets Redis apply it, then closes the connection
    without the reply: the client sees a connection error for a call that took effect."""

    def __init__(self, target_port: int, every: int, most: int, outage_s: float = 0.0,
                 only: bytes | None = None) -> None:
        self.target_port = target_port
        self.only = only  # count only the calls that contain this (a script's sha)
        self.every = every
        self.most = most
        self.outage_s = outage_s  # after a cut, Redis stays unreachable this long
        self.down_until = 0.0
        self.open: set[socket.socket] = set()
        self.seen = 0
        self.cuts = 0
        self.lock = threading.Lock()
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.port = self.listener.getsockname()[1]
        self.stopped = False
        # cuts start when armed: with an outage, a cut during the workers' start would make
        # the scenario's own setup (its key, its subscriptions) answer 503, as it should
        self.armed = not outage_s
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while not self.stopped:
            try:
                client, _ = self.listener.accept()
            except OSError:
                return
            if time.monotonic() < self.down_until:
                client.close()  # Redis "away": the retries of the call that was cut fail too
                continue
            upstream = socket.create_connection(("127.0.0.1", self.target_port))
            with self.lock:
                self.open.update((client, upstream))
            muted = threading.Event()  # set: the replies on this connection are dropped
            threading.Thread(target=self._pump, args=(client, upstream, True, muted),
                             daemon=True).start()
            threading.Thread(target=self._pump, args=(upstream, client, False, muted),
                             daemon=True).start()

    def _cut_now(self, data: bytes) -> bool:
        if b"\r\nEXEC\r\n" not in data and b"\r\nEVALSHA\r\n" not in data.upper():
            return False
        if self.only is not None and self.only not in data:
            return False
        if not self.armed:
            return False
        with self.lock:
            self.seen += 1
            if self.cuts < self.most and self.seen % self.every == 0:
                self.cuts += 1
                return True
        return False

    def _pump(self, src: socket.socket, dst: socket.socket, from_client: bool,
              muted: threading.Event) -> None:
        try:
            while True:
                data = src.recv(65536)
                if not data:
                    break
                if not from_client:
                    if not muted.is_set():
                        dst.sendall(data)
                    continue
                cut = self._cut_now(data)
                if cut:
                    muted.set()  # before Redis can answer: the reply must never reach the client
                dst.sendall(data)
                if cut:
                    # The rest of the call (a long one spans several reads) still goes through,
                    # and Redis applies it; its reply is never passed on.
                    src.settimeout(0.05)
                    try:
                        while more := src.recv(65536):
                            dst.sendall(more)
                    except (TimeoutError, OSError):
                        pass
                    time.sleep(0.05)
                    if self.outage_s:  # and goes away: every connection breaks
                        self.down_until = time.monotonic() + self.outage_s
                        with self.lock:
                            every = list(self.open)
                        for sock in every:
                            try:
                                sock.shutdown(socket.SHUT_RDWR)
                            except OSError:
                                pass
                    break
        except OSError:
            pass
        finally:
            with self.lock:
                self.open.difference_update((src, dst))
            for s in (src, dst):
                try:
                    s.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass
                s.close()

    def close(self) -> None:
        self.stopped = True
        self.listener.close()


async def _lost_replies(server: LiveServer, proxy: CuttingProxy) -> None:
    rng = random.Random(11)
    key = server.new_key()
    oracle = Oracle()
    async with httpx.AsyncClient(base_url=server.base_url, timeout=60) as client:
        ids = await create_subs(client, key, random_subs(rng, 60), oracle)
        proxy.armed = True
        movers = [f"m{i}" for i in range(20)]
        clock = [1_700_000_000.0]
        for _ in range(40):
            objs = random_objects(rng, 60, movers, clock)
            r = await client.post("/v1/objects", json={"objects": objs}, headers=auth(key))
            if r.status_code == 202:
                oracle.publish(objs, r.json()["ids"])
            else:  # a publish the api could not complete must have changed nothing
                assert r.status_code == 503, r.text
                if proxy.only is not None:
                    await asyncio.sleep(1.0)  # Redis is away: publish again once it is back
        await wait_exact(client, key, ids, oracle, timeout=120)
    assert proxy.cuts >= (5 if not proxy.outage_s else 3), proxy.cuts  # the faults happened


@pytest.mark.parametrize("outage_s,only_publish", [(0.0, False), (1.5, False), (2.5, True)],
                         ids=["retried", "redis-away", "publish-outcome"])
def test_replies_lost_after_commit_apply_once(tmp_path: Path, embedded_redis: EmbeddedRedis,
                                              outage_s: float, only_publish: bool) -> None:
    """The call is sent again at once (and must then apply once), or Redis stays away past the
    client's retries (and the api must learn the outcome before answering: 202 only when
    applied, 503 only when not). The last variant cuts only publishes, each after it was
    applied, with Redis away longer than the api client's retries: the api can learn the
    outcome only from the publish's guard key (answering 503 would be a lie the oracle sees:
    the matches of an object the client was told was not accepted)."""
    port = int(embedded_redis.url.rsplit(":", 1)[1].split("/", 1)[0])
    only = hashlib.sha1(PUBLISH_SCRIPT.encode()).hexdigest().encode() if only_publish else None
    proxy = CuttingProxy(port, every=6 if not only_publish else 4,
                         most=25 if not outage_s else (8 if not only_publish else 3),
                         outage_s=outage_s, only=only)
    try:
        run_on_cluster(tmp_path, f"redis://127.0.0.1:{proxy.port}/0", 2,
                       lambda server: _lost_replies(server, proxy))
    finally:
        proxy.close()
