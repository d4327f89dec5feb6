"""The soak's memory sampler: every few seconds, in a thread of its own, the resident memory of
every cluster process, Redis' own accounting and key count, and the load counters so far."""

from __future__ import annotations

import contextlib
import csv
import logging
import math
import subprocess
import threading
import time
from collections import Counter
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import psutil
import redis

log = logging.getLogger(__name__)

MIB = 1024 * 1024
CLIENT = "bench-client"
"""This benchmark's own process: sampled so that a leak of the load generator is not taken for
one of the server's, never counted as a cluster process that died."""

Row = dict[str, float]


def rss_column(name: str) -> str:
    return f"{name}_rss_mib"


def cpu_column(name: str) -> str:
    """CPU seconds (user + system) the process has used so far."""
    return f"{name}_cpu_s"


@dataclass
class Death:
    name: str
    pid: int
    code: int | None
    elapsed_s: float


class Sampler:
    """Sample `processes` (name -> the Popen of a cluster process) every `interval_s`: RSS
    through psutil, INFO used_memory and DBSIZE of `redis_url`, the workers' summed backlog
    from GET /v1/admin/cluster, and whatever `counters()` returns (the load so far)."""

    def __init__(self, processes: Mapping[str, subprocess.Popen[Any]], redis_url: str,
                 cluster_url: str, admin_headers: dict[str, str],
                 counters: Callable[[], dict[str, float]], interval_s: float = 5.0,
                 census_after_s: float = 0.0) -> None:
        self.processes = dict(processes)
        self.handles = {name: psutil.Process(p.pid) for name, p in processes.items()}
        self.handles[CLIENT] = psutil.Process()
        self.redis = redis.Redis.from_url(redis_url, socket_timeout=5, socket_connect_timeout=2)
        self.http = httpx.Client(headers=admin_headers, timeout=5)
        self.cluster_url = cluster_url
        self.counters = counters
        self.interval_s = interval_s
        self.rows: list[Row] = []
        self.deaths: list[Death] = []
        self.census_after_s = census_after_s
        self.census: dict[str, dict[str, int]] = {}  # "warmup", "end" -> key prefix -> keys
        self.t0 = time.time()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="soak-sampler", daemon=True)

    @property
    def names(self) -> list[str]:
        """The sampled processes, cluster first, this client last."""
        return [*self.processes, CLIENT]

    def start(self) -> None:
        self.t0 = time.time()
        self._thread.start()

    def stop(self) -> None:
        """Stop the thread, then take one last sample and census (the load has stopped)."""
        self._stop.set()
        self._thread.join()
        self.sample()
        with contextlib.suppress(redis.RedisError, OSError):
            self.census["end"] = key_census(self.redis)
        self.redis.close()
        self.http.close()

    def _loop(self) -> None:
        next_at = time.monotonic()
        while not self._stop.is_set():
            try:
                self.sample()
            except Exception:  # noqa: BLE001 - a sampler that dies would end the soak silently
                log.exception("soak sample failed")
            next_at += self.interval_s
            self._stop.wait(max(0.0, next_at - time.monotonic()))

    def sample(self) -> Row:
        now = time.time()
        row: Row = {"t": round(now, 3), "elapsed_s": round(now - self.t0, 3)}
        dead = {d.name for d in self.deaths}
        for name, handle in self.handles.items():
            proc = self.processes.get(name)
            code = proc.poll() if proc is not None else None
            if proc is not None and code is not None:
                if name not in dead:
                    self.deaths.append(Death(name, proc.pid, code, row["elapsed_s"]))
                    log.error("%s (pid %d) exited with %s after %.0f s", name, proc.pid, code,
                              row["elapsed_s"])
                row[rss_column(name)] = row[cpu_column(name)] = math.nan
                continue
            try:
                row[rss_column(name)] = handle.memory_info().rss / MIB
                cpu = handle.cpu_times()
                row[cpu_column(name)] = cpu.user + cpu.system
            except psutil.Error:
                row[rss_column(name)] = row[cpu_column(name)] = math.nan
        try:
            info = self.redis.info("memory")
            row["redis_used_memory_mib"] = int(info["used_memory"]) / MIB
            row["redis_keys"] = float(self.redis.dbsize())
        except (redis.RedisError, OSError, KeyError):
            row["redis_used_memory_mib"] = row["redis_keys"] = math.nan
        try:
            r = self.http.get(self.cluster_url)
            row["backlog"] = float(sum(int(w.get("backlog") or 0) for w in r.json()["workers"])
                                   ) if r.status_code == 200 else math.nan
        except (httpx.HTTPError, ValueError, KeyError):
            row["backlog"] = math.nan
        row.update(self.counters())
        self.rows.append(row)
        if "warmup" not in self.census and row["elapsed_s"] >= self.census_after_s:
            with contextlib.suppress(redis.RedisError, OSError):
                self.census["warmup"] = key_census(self.redis)
        return row


def key_census(client: redis.Redis) -> dict[str, int]:
    """Keys by their first two `:`-separated parts (`gs:h`, `gs:pub`, ...): which kind grows."""
    counts: Counter[str] = Counter()
    for key in client.scan_iter(count=1000):
        counts[":".join(key.decode(errors="replace").split(":")[:2])] += 1
    return dict(counts)


def write_csv(path: Path, rows: list[Row]) -> None:
    """One line per sample; a value not sampled (a dead process) is an empty cell."""
    columns: list[str] = []
    for row in rows:
        columns += [c for c in row if c not in columns]
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w", newline="") as f:
        w = csv.writer(f)
        w.writerow(columns)
        for row in rows:
            w.writerow([_cell(row.get(c, math.nan)) for c in columns])


def _cell(v: float) -> str:
    if math.isnan(v):
        return ""
    return str(int(v)) if v.is_integer() else f"{v:.3f}"


def read_csv(path: Path) -> list[Row]:
    with path.open(newline="") as f:
        return [{k: float(v) if v != "" else math.nan for k, v in r.items()}
                for r in csv.DictReader(f)]
