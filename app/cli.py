"""The `geoswarm` command: dev, api, worker, coordinator, migrate, keys, ingest, bench."""

from __future__ import annotations

import logging
import os
import signal
import socket
import subprocess
import sys
import time
from typing import TYPE_CHECKING, Annotated

import typer

from app.core.config import Settings, get_settings
from app.core.processes import die_with_parent, wait_until_ok

if TYPE_CHECKING:
    from app.core.redis import EmbeddedRedis

app = typer.Typer(help="geoswarm: real-time location publish/subscribe", no_args_is_help=True)
keys_app = typer.Typer(help="API keys", no_args_is_help=True)
app.add_typer(keys_app, name="keys")
archive_app = typer.Typer(help="the Parquet archive of records that left the live window",
                          no_args_is_help=True)
app.add_typer(archive_app, name="archive")

log = logging.getLogger("geoswarm")


def _logging(level: str = "INFO") -> None:
    logging.basicConfig(level=level, format="%(asctime)s %(levelname)s %(name)s: %(message)s")


def _redis(settings: Settings) -> tuple[str, EmbeddedRedis | None]:
    from app.core.redis import resolve_redis_url

    return resolve_redis_url(settings)


@app.command()
def migrate() -> None:
    """Upgrade the SQL database to the newest schema (alembic upgrade head)."""
    from app.core.migrate import upgrade_head

    _logging()
    upgrade_head(get_settings())
    typer.echo("database is at the newest schema")


@keys_app.command("create")
def keys_create(
    tenant: Annotated[str, typer.Option(help="tenant the key belongs to")],
    admin: Annotated[bool, typer.Option("--admin", help="an admin key")] = False,
) -> None:
    """Create an API key and print it (only its hash is stored)."""
    from pydantic import ValidationError

    from app.core.db import make_engine, make_sessionmaker, session_scope
    from app.core.migrate import upgrade_head
    from app.schemas import KeyCreate
    from app.services.keys import create_key

    try:
        KeyCreate(tenant=tenant, admin=admin)
    except ValidationError as exc:
        typer.echo(f"invalid tenant: {exc.errors()[0]['msg']}", err=True)
        raise typer.Exit(2) from None
    settings = get_settings()
    upgrade_head(settings)
    engine = make_engine(settings)
    with session_scope(make_sessionmaker(engine)) as session:
        _row, key = create_key(session, tenant, admin)
    engine.dispose()
    typer.echo(key)


@app.command()
def api(
    host: Annotated[str | None, typer.Option(help="bind address")] = None,
    port: Annotated[int | None, typer.Option(help="port")] = None,
    migrate_db: Annotated[bool, typer.Option("--migrate/--no-migrate")] = True,
    processes: Annotated[int, typer.Option(help="api processes sharing the port")] = 1,
) -> None:
    """Run the api (FastAPI under uvicorn): router, WebSocket hub, HTTP API. With
    --processes N, N processes share the listening socket (each with its own hub)."""
    import uvicorn

    _logging()
    settings = get_settings()
    if migrate_db:  # Alembic is imported only then (0.4 s of CPU)
        from app.core.migrate import upgrade_head

        upgrade_head(settings)
    uvicorn.run(
        "app.main:create_served_app", factory=True, workers=processes if processes > 1 else None,
        host=host or settings.host, port=port or settings.port,
        log_level="warning", ws_max_size=settings.ws_max_message_bytes,
        ws_ping_interval=settings.ws_ping_s, ws_ping_timeout=settings.ws_ping_s,
        ws_per_message_deflate=settings.ws_compression, timeout_graceful_shutdown=5,
    )


@app.command()
def worker(
    id: Annotated[str, typer.Option("--id", help="worker id, e.g. w0")] = "w0",
    check: Annotated[bool, typer.Option("--check", help="exit 0 iff the heartbeat is fresh")]
    = False,
) -> None:
    """Run one SWARM executor process."""
    import asyncio

    from app.core.redis import async_client, sync_client
    from app.pipeline import names
    from app.pipeline.cluster import heartbeat_fresh
    from app.pipeline.router import ensure_plan
    from workers.executor import run_worker

    _logging()
    settings = get_settings()
    url, server = _redis(settings)
    if check:
        raw = sync_client(url).hget(names.WORKERS_KEY, id)
        fresh = heartbeat_fresh(raw, time.time(), settings.worker_dead_after_s)
        raise typer.Exit(0 if fresh else 1)

    async def plan() -> None:
        client = async_client(url)
        try:
            if await client.get(names.PLAN_KEY) is None:
                await ensure_plan(client, settings, settings.workers)
        finally:
            await client.aclose()

    asyncio.run(plan())
    try:
        run_worker(settings, id, url)
    finally:
        if server is not None:
            server.stop()


@app.command()
def coordinator() -> None:
    """Run SWARM's Coordinator: load-balancing rounds and the admin API's rebalance requests.
    Run any number; one leads (a Redis lease), the others stand by and take over."""
    from workers.coordinator import run_coordinator

    _logging()
    settings = get_settings()
    url, server = _redis(settings)
    try:
        run_coordinator(settings, url)
    finally:
        if server is not None:
            server.stop()


def _require_spark(settings: Settings, what: str) -> None:
    """Exit 1 with a plain message when Spark cannot start here (no Java 17+, no Connect)."""
    from spark.session import java_available

    if not settings.spark_remote:
        ok, detail = java_available()
        if not ok:
            typer.echo(f"{what} needs Java 17+ for Spark: {detail}", err=True)
            raise typer.Exit(1)


@app.command("query-runner")
def query_runner(
    id: Annotated[str, typer.Option("--id", help="runner id (unique among runners)")] = "",
) -> None:
    """Run a query runner: one long-lived SparkSession answering snapshot queries over the
    archive (GEOSWARM_SPARK_MASTER, default local[*]; GEOSWARM_SPARK_REMOTE for Spark
    Connect). Run any number: each query's archive part is taken by one."""
    from spark.runner import run_query_runner

    _logging()
    settings = get_settings()
    _require_spark(settings, "the query runner")
    url, server = _redis(settings)
    try:
        run_query_runner(settings, id or f"r-{socket.gethostname()}-{os.getpid()}", url)
    finally:
        if server is not None:
            server.stop()


@archive_app.command("compact")
def archive_compact(
    tenant: Annotated[list[str] | None, typer.Option(
        help="compact this tenant's archive (repeatable; default: every tenant)")] = None,
    min_records: Annotated[int | None, typer.Option(
        help="no partition file under this many records (default "
             "GEOSWARM_ARCHIVE_MIN_FILE_RECORDS)")] = None,
) -> None:
    """Rewrite the archive into AQWA's query-aware k-d partitions (a Spark job). Queries keep
    running meanwhile; each sees the old layout or the new one."""
    from app.core.redis import sync_client
    from spark.compact import compact_all
    from spark.session import get_spark

    _logging()
    settings = get_settings()
    _require_spark(settings, "compaction")
    url, server = _redis(settings)
    spark = get_spark(settings, app_name="geoswarm-archive-compact")
    try:
        done = compact_all(spark, settings, sync_client(url), tenant or None, min_records)
    finally:
        spark.stop()
        if server is not None:
            server.stop()
    for d in done:
        typer.echo(f"{d.tenant}: layout v{d.version}, {d.partitions} partitions ({d.split} "
                   f"split), {d.records} records, {d.moved} written, query cost "
                   f"{d.cost_before:.4g} -> {d.cost_after:.4g}, {d.seconds:.1f} s")
    if not done:
        typer.echo("nothing to compact")


@app.command()
def ingest(
    tenant: Annotated[str, typer.Option(help="the tenant the objects belong to")],
    to: Annotated[str, typer.Option(help="archive (a history load) or live (published to the "
                                    "workers)")],
    paths: Annotated[list[str] | None, typer.Argument(
        help="CSV, JSON lines or Parquet files, directories or globs (local paths or any URI "
             "Spark reads)", show_default=False)] = None,
    fmt: Annotated[str | None, typer.Option(
        "--format", help="csv | json | parquet (default: from the file names)")] = None,
    mapping: Annotated[list[str] | None, typer.Option(
        "--map", help="API_NAME=SOURCE_COLUMN: read a field from another column "
                      "(repeatable)")] = None,
    rejects: Annotated[str | None, typer.Option(
        help="where the rejected rows go, with their reason (default "
             "<data dir>/rejects/<run>)")] = None,
    watch: Annotated[str | None, typer.Option(
        help="then keep ingesting the files that appear in this directory until SIGINT or "
             "SIGTERM")] = None,
) -> None:
    """Load objects from files into the running system (a Spark job), every row validated as
    POST /v1/objects validates it; bad rows go to the rejects folder. Run with the running
    system's environment (GEOSWARM_DATA_DIR, or GEOSWARM_REDIS_URL)."""
    from spark.ingest import IngestError, Options, main, parse_mapping

    _logging("WARNING")
    settings = get_settings()
    try:
        options = Options(paths=list(paths or []), tenant=tenant, to=to, fmt=fmt,
                          mapping=parse_mapping(mapping or []), rejects=rejects, watch=watch)
        counts = main(settings, options)
    except IngestError as exc:
        typer.echo(f"ingest: {exc}", err=True)
        raise typer.Exit(exc.code) from None
    except KeyboardInterrupt:
        typer.echo("ingest: interrupted (nothing of this run reaches the archive; rows "
                   "already published live stay)", err=True)
        raise typer.Exit(130) from None
    typer.echo(str(counts))


# --- dev: the whole system in one command ------------------------------------------------

class Pool:
    """Spawn, reap and respawn child processes each second (rq's WorkerPool loop)."""

    def __init__(self, env: dict[str, str]) -> None:
        self.env = env
        self.children: dict[str, tuple[list[str], subprocess.Popen[bytes]]] = {}
        self.stopping = False

    def spawn(self, name: str, args: list[str]) -> None:
        proc = subprocess.Popen(args, env=self.env, preexec_fn=die_with_parent)
        self.children[name] = (args, proc)

    def reap(self) -> None:
        for name, (args, proc) in list(self.children.items()):
            code = proc.poll()
            if code is not None and not self.stopping:
                log.warning("%s exited with %s; restarting it", name, code)
                self.spawn(name, args)

    def stop(self, timeout: float = 15.0) -> None:
        self.stopping = True
        for _args, proc in self.children.values():
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + timeout
        for _args, proc in self.children.values():
            try:
                proc.wait(max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()


class RedisSupervisor:
    """Restart `dev`'s embedded redis-server when it dies, as the Pool restarts the others: on
    the same port, so that every process's URL stays right, and on the same data dir, so that
    it reloads its AOF. Until it is back the api answers 503 and the workers retry."""

    RETRY_S = (1.0, 2.0, 5.0, 10.0)  # between failed restarts (the port may be taken)

    def __init__(self, settings: Settings, server: EmbeddedRedis) -> None:
        self.settings = settings
        self.server = server
        self.failures = 0
        self.next_try = 0.0

    def check(self) -> None:
        from app.core.redis import restart_embedded_redis

        code = self.server.process.poll()
        if code is None or time.monotonic() < self.next_try:
            return
        if self.failures == 0:
            log.warning("embedded redis-server (pid %d) exited with %s; restarting it on port "
                        "%d with its AOF", self.server.process.pid, code, self.server.port)
        try:
            self.server = restart_embedded_redis(self.settings, self.server)
        except (RuntimeError, OSError) as exc:
            delay = self.RETRY_S[min(self.failures, len(self.RETRY_S) - 1)]
            self.failures += 1
            self.next_try = time.monotonic() + delay
            log.error("embedded redis-server did not restart (%s); retrying in %g s", exc, delay)
            return
        self.failures = 0
        log.warning("embedded redis-server restarted on port %d (pid %d)", self.server.port,
                    self.server.process.pid)


def _dev_admin_key(settings: Settings) -> str:
    """The bootstrap key, else the admin key this data dir's dev created (kept in a file)."""
    from app.core.db import make_engine, make_sessionmaker, session_scope
    from app.services.keys import create_key, lookup

    if settings.bootstrap_admin_key:
        return settings.bootstrap_admin_key
    path = settings.data_dir / "admin.key"
    engine = make_engine(settings)
    try:
        factory = make_sessionmaker(engine)
        if path.exists():
            key = path.read_text().strip()
            with factory() as session:
                if lookup(session, key) is not None:
                    return key
        with session_scope(factory) as session:
            _row, key = create_key(session, "admin", True)
        path.write_text(key + "\n")
        path.chmod(0o600)
        return key
    finally:
        engine.dispose()


@app.command()
def dev(
    host: Annotated[str, typer.Option(help="bind address")] = "127.0.0.1",
    port: Annotated[int, typer.Option(help="HTTP port")] = 8000,
    workers: Annotated[int, typer.Option(help="executor worker processes")] = 2,
    api_processes: Annotated[int | None, typer.Option(
        help="api processes sharing the port [default: one per core]")] = None,
) -> None:
    """The whole system on embedded defaults: Redis, SQLite, api, workers, coordinator."""
    import asyncio

    from app.core.migrate import upgrade_head
    from app.core.redis import async_client, env_with_redis
    from app.pipeline.router import ensure_plan
    from spark.session import java_available

    _logging()
    if workers < 1:
        typer.echo("--workers must be at least 1", err=True)
        raise typer.Exit(2)
    if api_processes is None:
        api_processes = os.cpu_count() or 1
    if api_processes < 1:
        typer.echo("--api-processes must be at least 1", err=True)
        raise typer.Exit(2)
    settings = get_settings()
    settings.data_dir.mkdir(parents=True, exist_ok=True)
    url, server = _redis(settings)
    # Only a server this dev started is its to restart (not one another process runs).
    supervisor = RedisSupervisor(settings, server) if server is not None else None
    pool: Pool | None = None
    stop = {"signal": 0}

    def on_signal(signum: int, _frame: object) -> None:
        stop["signal"] = signum

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    try:
        upgrade_head(settings)
        key = _dev_admin_key(settings)
        names = [f"w{i}" for i in range(workers)]

        async def plan() -> None:
            client = async_client(url)
            try:
                await ensure_plan(client, settings, names)
            finally:
                await client.aclose()

        asyncio.run(plan())
        env = env_with_redis(url)
        env["GEOSWARM_DATA_DIR"] = str(settings.data_dir.resolve())
        env["GEOSWARM_WORKERS"] = ",".join(names)
        exe = [sys.executable, "-m", "app.cli"]
        pool = Pool(env)
        for name in names:
            pool.spawn(name, [*exe, "worker", "--id", name])
        pool.spawn("coordinator", [*exe, "coordinator"])
        java, detail = java_available()
        if java or settings.spark_remote:
            pool.spawn("query-runner", [*exe, "query-runner", "--id", "r0"])
            archive = f"  archive:   {settings.archive_path} (queries over it: query runner r0)\n"
        else:
            archive = (f"  archive:   {settings.archive_path}; queries reaching before the live "
                       f"window are OFF: no Java 17+ for Spark ({detail}). Everything else "
                       "works.\n")
            typer.echo(archive, err=True)
        pool.spawn("api", [*exe, "api", "--host", host, "--port", str(port), "--no-migrate",
                           "--processes", str(api_processes)])
        base = f"http://{host}:{port}"
        if wait_until_ok(base + "/readyz"):
            where = f" (embedded, AOF in {settings.data_dir / 'redis'})" if server else ""
            typer.echo(f"\ngeoswarm is running at {base}\n  API docs:  {base}/docs\n"
                       f"  admin key: {key}\n  redis:     {url}{where}\n"
                       f"  processes: {api_processes} api, {workers} workers, a coordinator\n"
                       f"{archive}"
                       "Stop with Ctrl-C.\n")
        else:
            typer.echo(f"geoswarm did not become ready at {base}/readyz", err=True)
        while not stop["signal"]:
            if supervisor is not None:
                supervisor.check()
            pool.reap()
            time.sleep(0.5)
    finally:
        if pool is not None:
            pool.stop()
        if supervisor is not None:
            supervisor.server.stop()
    typer.echo("geoswarm stopped")


@app.command(context_settings={"allow_extra_args": True, "ignore_unknown_options": True,
                                "help_option_names": []})
def bench(
    ctx: typer.Context,
    name: Annotated[str, typer.Argument(
        help="matcher | pipeline | geofence | swarm | soak | snapshot | knn | archive")] = "--help",
) -> None:
    """Benchmarks (bench/): `matcher` (the evaluator index against brute force), `pipeline`
    (the whole system over HTTP and WebSockets), `geofence` (moving objects and fences around
    US cities, end to end, beside Tile38's figures on that workload), `swarm` (SWARM §6.2:
    SWARM against its baselines through hotspots), `soak` (every process's memory under a
    steady load for N minutes), `snapshot` (snapshot queries against Redis GEOSEARCH on the
    same points), `knn` (a worker's continuous kNN lists: incremental against a full rescan)
    or `archive` (queries over the Parquet archive through Spark, before and after AQWA's
    compaction).
    `geoswarm bench NAME --help` lists options."""
    if name == "matcher":
        from bench.matcher import main as bench_main
    elif name == "pipeline":
        from bench.pipeline import main as bench_main
    elif name == "geofence":
        from bench.geofence import main as bench_main
    elif name == "swarm":
        from bench.swarm import main as bench_main
    elif name == "soak":
        from bench.soak import main as bench_main
    elif name == "snapshot":
        from bench.snapshot import main as bench_main
    elif name == "knn":
        from bench.knn import main as bench_main
    elif name == "archive":
        from bench.archive import main as bench_main
    elif name in ("--help", "-h"):
        # --help is left to the benchmarks (`bench NAME --help`), so answer it here
        typer.echo(ctx.get_help())
        return
    else:
        typer.echo(f"unknown benchmark {name!r}: choose matcher, pipeline, geofence, swarm, soak, "
                   "snapshot, knn or archive", err=True)
        raise typer.Exit(2)
    bench_main(list(ctx.args))


def main() -> None:
    app()


if __name__ == "__main__":
    main()
