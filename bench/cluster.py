"""Start a real geoswarm cluster in subprocesses — api and workers against one Redis and one
database — for the tests and the benchmarks."""

from __future__ import annotations

import os
import secrets
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import redis

from app.core.config import Settings
from app.core.processes import die_with_parent, stop_processes, wait_until_ok
from app.core.redis import free_port, start_embedded_redis

ROOT = Path(__file__).resolve().parents[1]
BOOTSTRAP = "bootstrap-admin-key-" + secrets.token_hex(8)


@dataclass
class LiveServer:
    """A running api (and workers) against one Redis and one database."""

    base_url: str
    ws_url: str
    redis_url: str
    env: dict[str, str]
    admin_key: str = BOOTSTRAP
    procs: dict[str, subprocess.Popen[bytes]] = field(default_factory=dict)
    log_dir: Path = Path(".")
    redis_pid: int | None = None
    redis_pids: list[int] = field(default_factory=list)  # a Redis Cluster's nodes
    # the processes get SIGTERM when the thread that started them ends (a benchmark killed,
    # by the OOM killer say, leaves no cluster behind); not for tests, which start some from
    # short-lived threads
    die_with_parent: bool = False

    def admin(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.admin_key}"}

    def new_key(self, tenant: str | None = None, admin: bool = False) -> str:
        tenant = tenant or "t" + secrets.token_hex(4)
        r = httpx.post(self.base_url + "/v1/admin/keys", json={"tenant": tenant, "admin": admin},
                       headers=self.admin(), timeout=10)
        r.raise_for_status()
        return str(r.json()["key"])

    def spawn(self, name: str, args: list[str], env: dict[str, str] | None = None
              ) -> subprocess.Popen[bytes]:
        """`geoswarm ARGS` as process `name`, with the cluster's environment (and `env`)."""
        log = open(self.log_dir / f"{name}.log", "ab")  # noqa: SIM115 - closed with the process
        proc = subprocess.Popen([sys.executable, "-m", "app.cli", *args],
                                env={**self.env, **(env or {})},
                                stdout=log, stderr=subprocess.STDOUT, cwd=ROOT,
                                preexec_fn=die_with_parent if self.die_with_parent else None)
        self.procs[name] = proc
        return proc

    def start_worker(self, wid: str) -> subprocess.Popen[bytes]:
        return self.spawn(wid, ["worker", "--id", wid])

    def start_coordinator(self, name: str = "coord") -> subprocess.Popen[bytes]:
        return self.spawn(name, ["coordinator"])

    def kill(self, name: str, sig: int = signal.SIGKILL) -> None:
        proc = self.procs[name]
        proc.send_signal(sig)
        if sig in (signal.SIGKILL, signal.SIGTERM):
            proc.wait(15)

    def wait_workers(self, n: int, timeout: float = 30) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            r = httpx.get(self.base_url + "/v1/admin/cluster", headers=self.admin(), timeout=5)
            if r.status_code == 200 and sum(w["alive"] for w in r.json()["workers"]) >= n:
                return
            time.sleep(0.1)
        raise TimeoutError(f"{n} live workers did not appear")

    def stop(self) -> None:
        stop_processes(self.procs.values())


_next_db = iter(range(10**9))


def database_slots() -> list[int]:
    """The Redis database indexes this process may take (1-15): all of them, or, in one of
    N parallel test processes (pytest-xdist's PYTEST_XDIST_WORKER=gw<k>), those equal to k
    modulo N, so that processes sharing one Redis server never flush each other's."""
    worker = os.environ.get("PYTEST_XDIST_WORKER", "")
    count = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1") or 1)
    if not worker.startswith("gw") or count <= 1:
        return list(range(1, 16))
    k = int(worker[2:]) % count
    return [d for d in range(1, 16) if d % count == k]


def own_database(redis_url: str) -> str:
    """The same Redis server, another database index, so that servers of different tests
    (which flush their database on start) never touch each other's keys."""
    base = redis_url.rsplit("/", 1)[0] if redis_url.count("/") > 2 else redis_url
    slots = database_slots()
    return f"{base}/{slots[next(_next_db) % len(slots)]}"


def cluster_env(tmp: Path, redis_url: str, database_url: str | None = None, workers: int = 2,
                **env_overrides: str) -> dict[str, str]:
    """The settings of a test or benchmark cluster: its Redis database, SQLite under `tmp`
    unless `database_url`, the bootstrap admin key, workers w0..w<n-1>, 2 s rounds."""
    return {
        "GEOSWARM_REDIS_URL": redis_url,
        "GEOSWARM_DATA_DIR": str(tmp),
        "GEOSWARM_DATABASE_URL": database_url or f"sqlite:///{tmp / 'geoswarm.db'}",
        "GEOSWARM_BOOTSTRAP_ADMIN_KEY": BOOTSTRAP,
        "GEOSWARM_ENVIRONMENT": "test",
        "GEOSWARM_WORKERS": ",".join(f"w{i}" for i in range(workers)),
        "GEOSWARM_BALANCE_PERIOD_S": "2",
        **env_overrides,
    }


def start_server(tmp: Path, redis_url: str, database_url: str | None = None, workers: int = 2,
                 api_processes: int = 1, die_with_parent: bool = False, own_db: bool = True,
                 **env_overrides: str) -> LiveServer:
    """`own_db`: in a database of its own, emptied first (False: `redis_url` as it is, such as
    a Redis Cluster's node, which has one database)."""
    if own_db:
        redis_url = own_database(redis_url)
        client = redis.Redis.from_url(redis_url)
        client.flushdb()
        client.close()
    port = free_port()
    env = {**os.environ, **cluster_env(tmp, redis_url, database_url, workers, **env_overrides)}
    server = LiveServer(base_url=f"http://127.0.0.1:{port}", ws_url=f"ws://127.0.0.1:{port}",
                        redis_url=redis_url, env=env, log_dir=tmp,
                        die_with_parent=die_with_parent)
    # the schema, migrated here: a `geoswarm migrate` process would import the app again, a
    # second of CPU for every cluster a test or benchmark starts
    from app.core.migrate import upgrade_head

    upgrade_head(Settings(database_url=env["GEOSWARM_DATABASE_URL"], data_dir=tmp))
    for i in range(workers):
        server.start_worker(f"w{i}")
    server.spawn("api", ["api", "--port", str(port), "--no-migrate",
                         "--processes", str(api_processes)])
    if not wait_until_ok(server.base_url + "/readyz", server.procs["api"]):
        server.stop()
        raise RuntimeError("api did not become ready:\n" + (tmp / "api.log").read_text())
    return server


# A benchmark measures the system, not its limits: no rate limits, quotas or backlog bound.
UNTHROTTLED = {"GEOSWARM_RATE_LIMIT_PER_S": "0", "GEOSWARM_MAX_BATCH": "10000",
               "GEOSWARM_TENANT_PUBLISH_PER_S": "0", "GEOSWARM_MAX_BACKLOG": "0",
               "GEOSWARM_TENANT_MAX_SUBSCRIPTIONS": "0"}


@contextmanager
def bench_cluster(prefix: str, workers: int, **env_overrides: str) -> Iterator[LiveServer]:
    """A cluster of `workers` on an embedded redis-server of its own, unthrottled, its
    workers up; everything stopped after."""
    tmp = Path(tempfile.mkdtemp(prefix=prefix))
    redis_server = start_embedded_redis(Settings(data_dir=tmp / "redis"), die_with_parent=True)
    try:
        server = start_server(tmp, redis_server.url, None, workers, 1, die_with_parent=True,
                              own_db=True, **{**UNTHROTTLED, **env_overrides})
        server.redis_pid = redis_server.process.pid  # its CPU is counted with the processes'
        try:
            server.wait_workers(workers)
            yield server
        finally:
            server.stop()
    finally:
        redis_server.stop()
