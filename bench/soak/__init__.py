"""Soak benchmark: a real cluster (embedded redis-server, api, workers, coordinator) under a
steady, realistic load for N minutes, with the resident memory of every process sampled every
few seconds, to find memory that keeps growing and processes that die.

The load (bench/soak/workload.py, load.py): moving objects and events around cities weighted
by population, with Zipf keywords; range (bbox, circle), keyword and kNN subscriptions deleted
and created continuously, some with a TTL; WebSocket clients that connect, listen (to all, or
to a few subscriptions, resuming from their cursors), read and leave, some without closing.
The sampler: bench/soak/sample.py; the summary and plot: bench/soak/report.py.

Writes to --out: soak.csv (one line per sample), soak.png (memory over time per process),
soak.json (the summary) and logs/ (every process's log); prints the summary: per process the
memory at the start and at the end of the post-warm-up part, and its growth per minute from a
linear fit, flagged beyond --flag-pct or --flag-mib. Exits 1 when a cluster process died.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import shutil
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from bench.soak.load import Load, LoadConfig, LoadStats
from bench.soak.report import build_summary, format_summary, growth, no_nan, parse_table, plot
from bench.soak.sample import CLIENT, Sampler, read_csv, write_csv
from bench.soak.workload import make_records, make_specs

__all__ = ["CLIENT", "Load", "LoadConfig", "LoadStats", "SoakConfig", "SoakResult",
           "build_summary", "format_summary", "growth", "main", "make_records", "make_specs",
           "parse_table", "read_csv", "run"]


@dataclass
class SoakConfig:
    minutes: float = 10.0
    out: Path = Path("bench-results")
    workers: int = 2
    sample_s: float = 5.0
    warmup: float = 0.2  # fraction of the run left out of the growth fit
    flag_pct: float = 1.0  # % of the post-warm-up memory per minute
    flag_mib: float = 4.0  # MiB per minute
    # The workers keep the events of the last GEOSWARM_WINDOW_S (default an hour): a soak
    # shorter than that would see them fill it, growth by design. One minute, so that the
    # window is full well within the warm-up of a run of several minutes.
    window_s: float = 60.0
    balance_period_s: float = 5.0
    load: LoadConfig = field(default_factory=LoadConfig)


@dataclass
class SoakResult:
    summary: dict[str, Any]
    text: str

    @property
    def died(self) -> bool:
        return bool(self.summary["died"])


def _order(name: str) -> tuple[int, str]:
    rank = {"api": 0, "coord": 2, "redis-server": 3}
    return rank.get(name, 1), name


def run(cfg: SoakConfig) -> SoakResult:
    """Start the cluster, load it for cfg.minutes while sampling, stop it, report."""
    from app.core.config import Settings
    from app.core.redis import start_embedded_redis
    from bench.cluster import start_server

    cfg.out.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix="geoswarm-soak-"))
    redis_server = start_embedded_redis(Settings(data_dir=tmp / "redis"), die_with_parent=True)
    sampler: Sampler | None = None
    load: Load | None = None
    run_s = 0.0
    try:
        server = start_server(tmp, redis_server.url, die_with_parent=True, workers=cfg.workers,
                              GEOSWARM_WINDOW_S=f"{cfg.window_s:g}",
                              GEOSWARM_BUCKET_S=f"{max(1.0, cfg.window_s / 6):g}",
                              GEOSWARM_BALANCE_PERIOD_S=f"{cfg.balance_period_s:g}")
        try:
            server.start_coordinator()
            server.wait_workers(cfg.workers)
            server.redis_pid = redis_server.process.pid
            load = Load(server.base_url, server.ws_url, server.new_key("soak"), cfg.load)
            procs = {**server.procs, "redis-server": redis_server.process}
            sampler = Sampler({n: procs[n] for n in sorted(procs, key=_order)},
                              server.redis_url, server.base_url + "/v1/admin/cluster",
                              server.admin(), load.stats.counters, cfg.sample_s,
                              census_after_s=cfg.warmup * cfg.minutes * 60)
            print(f"soak: {cfg.minutes:g} min against {', '.join(sampler.names[:-1])}; "
                  f"logs in {tmp}", flush=True)
            died = sampler.deaths
            sampler.start()
            t0 = time.monotonic()
            try:
                asyncio.run(load.run(cfg.minutes * 60, should_stop=lambda: bool(died)))
            except KeyboardInterrupt:
                print("soak: interrupted; reporting what was sampled", flush=True)
            finally:
                run_s = time.monotonic() - t0
                sampler.stop()
        finally:
            server.stop()
    finally:
        redis_server.stop()
        logs = cfg.out / "logs"
        logs.mkdir(parents=True, exist_ok=True)
        for f in [*tmp.glob("*.log"), tmp / "redis" / "redis" / "redis.log"]:
            if f.exists():
                shutil.copy(f, logs / (f.name if f.name != "redis.log" else "redis-server.log"))
        shutil.rmtree(tmp, ignore_errors=True)  # the AOF and the database: not worth keeping
    assert sampler is not None and load is not None
    files = {"csv": str(cfg.out / "soak.csv"), "png": str(cfg.out / "soak.png"),
             "json": str(cfg.out / "soak.json"), "logs": str(logs)}
    deaths = [vars(d) for d in sampler.deaths]
    summary = build_summary(minutes=cfg.minutes, workers=cfg.workers, sample_s=cfg.sample_s,
                            warmup=cfg.warmup, flag_pct=cfg.flag_pct, flag_mib=cfg.flag_mib,
                            rows=sampler.rows, names=sampler.names, run_s=run_s,
                            stats=load.stats, load=cfg.load, census=sampler.census,
                            deaths=deaths, files=files)
    write_csv(Path(files["csv"]), sampler.rows)
    plot(Path(files["png"]), sampler.rows, sampler.names, summary,
         f"soak: {run_s / 60:.1f} min, {cfg.load.rate:g} objects/s, {cfg.workers} workers")
    Path(files["json"]).write_text(json.dumps(no_nan(summary), indent=1) + "\n")
    return SoakResult(summary, format_summary(summary))


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(prog="geoswarm bench soak", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    d, dl = SoakConfig(), LoadConfig()
    ap.add_argument("--minutes", type=float, default=d.minutes, help="length of the load")
    ap.add_argument("--out", type=Path, default=d.out, help="directory for the CSV, PNG, "
                    "JSON and logs")
    ap.add_argument("--workers", type=int, default=d.workers)
    ap.add_argument("--rate", type=float, default=dl.rate, help="objects published per second "
                    "(keep it below what the cluster sustains: a growing backlog is not a leak)")
    ap.add_argument("--fleet", type=int, default=dl.fleet, help="moving objects")
    ap.add_argument("--subs", type=int, default=dl.subs, help="live subscriptions")
    ap.add_argument("--churn", type=float, default=dl.churn, help="subscriptions deleted and "
                    "created per second")
    ap.add_argument("--clients", type=int, default=dl.clients, help="WebSocket clients "
                    "connected at once")
    ap.add_argument("--sample-s", type=float, default=d.sample_s, help="seconds between "
                    "memory samples")
    ap.add_argument("--warmup", type=float, default=d.warmup, help="fraction of the run left "
                    "out of the growth fit")
    ap.add_argument("--flag-pct", type=float, default=d.flag_pct, help="flag growth beyond "
                    "this %% of the post-warm-up memory per minute")
    ap.add_argument("--flag-mib", type=float, default=d.flag_mib, help="flag growth beyond "
                    "this many MiB per minute")
    ap.add_argument("--window-s", type=float, default=d.window_s, help="GEOSWARM_WINDOW_S of "
                    "the cluster")
    ap.add_argument("--seed", type=int, default=dl.seed)
    a = ap.parse_args(argv)
    if a.minutes <= 0 or a.workers < 1 or a.rate <= 0 or a.sample_s <= 0 \
            or not 0 <= a.warmup < 1:
        ap.error("--minutes, --rate and --sample-s must be positive, --workers at least 1, "
                 "--warmup in [0, 1)")
    load = LoadConfig(rate=a.rate, fleet=a.fleet, subs=a.subs, churn=a.churn,
                      clients=a.clients, seed=a.seed)
    cfg = SoakConfig(minutes=a.minutes, out=a.out, workers=a.workers, sample_s=a.sample_s,
                     warmup=a.warmup, flag_pct=a.flag_pct, flag_mib=a.flag_mib,
                     window_s=a.window_s, load=load)
    result = run(cfg)
    print(result.text, flush=True)
    if result.died:
        raise SystemExit(1)


if __name__ == "__main__":
    main()
