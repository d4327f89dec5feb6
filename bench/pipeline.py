"""End-to-end pipeline benchmark: the real system (embedded redis-server, one api process,
executor worker processes) driven over HTTP and WebSockets with a realistic workload, checked
against the matcher's exact set of matches (no loss, no duplicate).

Scenarios: `selective` (100 000 range/keyword subscriptions, most with keywords: about one
match per object), `dense` (spatial-only subscriptions over dense cities: tens of matches per
object), `latency` (the selective workload paced at a fixed rate), `keywords` (100 000
subscriptions that all need a keyword, tracking 300 words: Tornado's textual summaries let
most objects be stored without matching).

`--summaries both` runs the workload twice, on fresh servers, without and with the keyword
summaries (GEOSWARM_KEYWORD_SUMMARIES), and prints the two reports side by side.

The report ends with the breakdown of the path per hop (`app.pipeline.hops`, read from
/metrics before and after the run): how many objects or matches each hop measured, and their
mean, p50 and p99 in milliseconds."""

from __future__ import annotations

import argparse
import asyncio
import statistics
import tempfile
import time
from collections.abc import Callable
from contextlib import ExitStack
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import orjson
import psutil
import websockets
from prometheus_client.parser import text_string_to_metric_families

from app.core.config import Settings
from app.core.redis import start_embedded_redis
from app.geo.grid import Grid
from app.geo.matcher import SubscriptionIndex
from app.pipeline.hops import API_HOPS, BUCKETS, HUB_HOPS, WORKER_HOPS, quantile
from bench.cluster import UNTHROTTLED, LiveServer, start_server
from bench.redis_cluster import node_pids, redis_cluster
from bench.workload import make_objects, make_subscriptions, to_subs

SCENARIOS: dict[str, dict[str, Any]] = {
    "selective": {"subs": {"keyword_fraction": 0.97, "keyword_only_fraction": 0.02,
                           "circle_fraction": 0.2, "all_fraction": 0.3}, "rate": None},
    # about 130 matches per object: 20 000 objects make 2.6 million matches to check
    "dense": {"subs": {"keyword_fraction": 0.0, "keyword_only_fraction": 0.0,
                       "circle_fraction": 0.2, "jitter_km": 3.0}, "rate": None,
              "objects": 20_000},
    "latency": {"subs": {"keyword_fraction": 0.97, "keyword_only_fraction": 0.02,
                         "circle_fraction": 0.2, "all_fraction": 0.3}, "rate": 10_000},
    "keywords": {"subs": {"keyword_fraction": 1.0, "keyword_only_fraction": 0.02,
                          "circle_fraction": 0.2, "all_fraction": 0.3, "topics": 300},
                 "rate": None},
}


def cpu_seconds(server: LiveServer) -> dict[str, float]:
    """CPU time used so far by each server process, Redis and this benchmark client."""
    out: dict[str, float] = {}
    procs = {name: psutil.Process(p.pid) for name, p in server.procs.items()}
    procs["bench-client"] = psutil.Process()
    if server.redis_pid:
        procs["redis"] = psutil.Process(server.redis_pid)
    for i, pid in enumerate(server.redis_pids):  # a Redis Cluster's nodes
        procs[f"redis-{i}"] = psutil.Process(pid)
    for name, proc in procs.items():
        try:
            total = 0.0
            kids = proc.children(recursive=True) if name == "api" else []  # uvicorn workers
            for q in (proc, *kids):
                t = q.cpu_times()
                total += t.user + t.system
            out[name] = total
        except psutil.Error:
            pass
    return out


HOP_ORDER = (*API_HOPS, *WORKER_HOPS, *HUB_HOPS)


def summary_rows(base_url: str) -> dict[str, float]:
    """Rows routed with and without a no-match mark, and rows the workers did not match
    (/metrics; the workers' figure is as of their last heartbeat)."""
    text = httpx.get(base_url + "/metrics", timeout=10).text
    out = {"routed_no_match": 0.0, "routed_to_match": 0.0, "workers_skipped": 0.0}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == "geoswarm_routed_rows_total":
                out["routed_" + sample.labels["mark"]] += sample.value
            elif sample.name == "geoswarm_worker_rows_skipped_total":
                out["workers_skipped"] += sample.value
    return out


HOP_FAMILIES = ("geoswarm_hop_seconds", "geoswarm_worker_hop_seconds")


def hop_counts(base_url: str, families: tuple[str, ...] = HOP_FAMILIES, label: str = "hop"
               ) -> dict[str, tuple[list[int], float]]:
    """The hops' histograms on the api's /metrics (the api's own and the workers' summed):
    {hop: (count per bucket, sum of seconds)}; of other histograms of `app.pipeline.hops`'s
    buckets with `families` and `label` (the workers' moves, say)."""
    text = httpx.get(base_url + "/metrics", timeout=10).text
    cum: dict[str, dict[str, float]] = {}
    sums: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        if family.name not in families:
            continue
        for sample in family.samples:
            hop = sample.labels[label]
            if sample.name.endswith("_bucket"):
                le = sample.labels["le"]
                cum.setdefault(hop, {})[le] = cum.get(hop, {}).get(le, 0.0) + sample.value
            elif sample.name.endswith("_sum"):
                sums[hop] = sums.get(hop, 0.0) + sample.value
    out = {}
    for hop, by_le in cum.items():
        bounds = [*map(str, BUCKETS), "+Inf"]
        totals = [by_le.get(b, 0.0) for b in bounds]
        counts = [int(t - (totals[i - 1] if i else 0.0)) for i, t in enumerate(totals)]
        out[hop] = (counts, sums.get(hop, 0.0))
    return out


def observed(before: dict[str, tuple[list[int], float]],
             after: dict[str, tuple[list[int], float]], hop: str) -> tuple[int, float]:
    """How many measurements of `hop` two readings of `hop_counts` are apart, and their
    seconds."""
    (a, a_s), (b, b_s) = after.get(hop, ([0], 0.0)), before.get(hop, ([0], 0.0))
    return sum(a) - sum(b), a_s - b_s


def hop_breakdown(before: dict[str, tuple[list[int], float]],
                  after: dict[str, tuple[list[int], float]], short: bool = False
                  ) -> dict[str, str]:
    """Per hop, over what happened between the two readings: how many objects (or matches)
    it measured, and its mean, p50 and p99 in milliseconds (`short`: p50/p99 only)."""
    out = {}
    empty = ([0] * (len(BUCKETS) + 1), 0.0)
    for hop in HOP_ORDER:
        if hop not in after:
            continue
        a, b = after[hop], before.get(hop, empty)
        counts = [x - y for x, y in zip(a[0], b[0], strict=True)]
        n = sum(counts)
        if not n:
            continue
        p50, p99 = quantile(counts, 0.5), quantile(counts, 0.99)
        assert p50 is not None and p99 is not None
        out[f"hop_{hop}_ms"] = (f"{p50 * 1000:.2f}/{p99 * 1000:.2f}" if short else
                                f"n {n}  mean {(a[1] - b[1]) / n * 1000:.2f}  "
                                f"p50 {p50 * 1000:.2f}  p99 {p99 * 1000:.2f}")
    return out


def top_commands(url: str, top: int) -> list[tuple[str, int, float]]:
    """Redis's own account of where its time went since the last `CONFIG RESETSTAT`: the
    `top` commands that used the most of it, as (name, calls, microseconds). A script's
    commands are counted both in its EVAL or EVALSHA and on their own lines."""
    import redis

    from app.core.redis import is_cluster, sync_client

    r = sync_client(url)
    try:
        if is_cluster(url):  # summed over the primaries
            per_node = r.info("commandstats", target_nodes=redis.RedisCluster.PRIMARIES)
        else:
            per_node = {url: r.info("commandstats")}
    finally:
        r.close()
    calls: dict[str, int] = {}
    usec: dict[str, float] = {}
    for stats in per_node.values():
        for name, v in stats.items():
            name = name.removeprefix("cmdstat_")
            calls[name] = calls.get(name, 0) + int(v["calls"])
            usec[name] = usec.get(name, 0.0) + float(v["usec"])
    rows = sorted(((name, calls[name], usec[name]) for name in calls), key=lambda row: -row[2])
    return rows[:top]


def redis_commands(url: str, top: int = 8) -> dict[str, str]:
    """`top_commands` as report lines, with microseconds per call."""
    return {f"redis_{name}": f"calls {calls}  total {usec / 1e6:.2f} s  "
            f"{usec / max(calls, 1):.1f} us/call" for name, calls, usec in top_commands(url, top)}


def reset_redis_stats(url: str) -> None:
    import redis

    from app.core.redis import is_cluster, sync_client

    r = sync_client(url)
    try:
        if is_cluster(url):
            r.config_resetstat(target_nodes=redis.RedisCluster.PRIMARIES)
        else:
            r.config_resetstat()
    finally:
        r.close()


TS_PLACEHOLDER = 1_500_000_000.0  # in the bodies encoded ahead, replaced at each send
TS_FIELD = b'"ts":' + orjson.dumps(TS_PLACEHOLDER)


def expected_pairs(specs: list[dict[str, Any]], objs: dict[str, Any]) -> Any:
    """The exact matches as sorted unique codes `subscription * objects + object` (int64: a
    dense run has millions; a set of tuples took gigabytes)."""
    index = SubscriptionIndex(Grid())
    index.add_many(to_subs(specs))
    o, k = index.match(objs["lon"], objs["lat"], objs["keywords"])
    return np.unique(k.astype(np.int64) * len(objs["lon"]) + o)


def compare_pairs(want: Any, got: Any) -> dict[str, int]:
    """Delivered against expected, both as pair codes (`got` in arrival order)."""
    unique = np.unique(got)
    return {"expected_matches": int(want.size), "delivered": int(got.size),
            "duplicates": int(got.size - unique.size),
            "missing": int(np.setdiff1d(want, unique, assume_unique=True).size),
            "extra": int(np.setdiff1d(unique, want, assume_unique=True).size)}


class Listener:
    """One WebSocket listening to all of a tenant's subscriptions; `handle` takes each
    message line with its arrival time."""

    def __init__(self, server: LiveServer, key: str) -> None:
        self.url = f"{server.ws_url}/v1/stream?token={key}"
        self.task: asyncio.Task[None] | None = None
        self.ready = asyncio.Event()

    def handle(self, line: str, now: float) -> None:
        raise NotImplementedError

    async def run(self) -> None:
        async with websockets.connect(self.url, max_size=None, max_queue=None) as ws:
            await ws.send(orjson.dumps({"op": "listen", "all": True}).decode())
            async for frame in ws:
                self.handle_frame(frame if isinstance(frame, str) else frame.decode(),
                                  time.time())

    def handle_frame(self, text: str, now: float) -> None:
        for line in text.split("\n"):
            if line.startswith('{"type":"listening"'):
                self.ready.set()
            else:
                self.handle(line, now)


MATCH_PREFIX = '{"type":"match"'


class Receiver(Listener):
    """The match messages received, each with its frame's arrival time. While the run is
    timed it only keeps the frames and counts their matches (so that this client, on the same
    cores as the server, takes as little from it as it can); `parse` then reads them: each
    match's (subscription, object id), and its latency from its object's `ts`."""

    def __init__(self, server: LiveServer, key: str) -> None:
        super().__init__(server, key)
        self.frames: list[tuple[float, str]] = []
        self.count = 0
        self.latency_ms: list[float] = []

    def handle_frame(self, text: str, now: float) -> None:
        if not self.ready.is_set():
            super().handle_frame(text, now)
            return
        self.frames.append((now, text))
        self.count += text.count(MATCH_PREFIX)

    def handle(self, line: str, now: float) -> None:
        if line.startswith(MATCH_PREFIX):
            self.frames.append((now, line))
            self.count += 1

    def parse(self, sub_index: dict[str, int], obj_index: dict[str, int], n: int) -> Any:
        """The matches received as pair codes (see `expected_pairs`; -1 for an id this run
        did not create), and their latencies into `latency_ms`. The frames are let go as they
        are read."""
        codes: list[int] = []
        for i, (now, text) in enumerate(self.frames):
            self.frames[i] = (now, "")
            for line in text.split("\n"):
                if line.startswith(MATCH_PREFIX):
                    m = orjson.loads(line)
                    k = sub_index.get(m["subscription"], -1)
                    o = obj_index.get(m["object"]["id"], -1)
                    codes.append(k * n + o if k >= 0 and o >= 0 else -1)
                    self.latency_ms.append((now - m["object"]["ts"]) * 1000)
        self.frames = []
        return np.asarray(codes, dtype=np.int64)


async def until_quiet(count: Callable[[], int], want: int, idle_s: float = 40.0) -> None:
    """Wait until `count()` reaches `want`, or stops growing for `idle_s` (what has not come
    by then is reported missing; a long run that keeps delivering is waited for). Longer than
    the hubs' safety re-read of every history (`GEOSWARM_WS_POLL_S`, 30 s), so that a match
    reported missing is one that re-read did not find either, not one whose notification
    was lost."""
    last, since = count(), time.monotonic()
    while last < want:
        await asyncio.sleep(0.02)
        now = count()
        if now != last:
            last, since = now, time.monotonic()
        elif time.monotonic() - since > idle_s:
            return


async def diagnose_missing(client: httpx.AsyncClient, headers: dict[str, str], missing: Any,
                           sub_ids: list[str], obj_ids: list[str | None], n: int,
                           most: int = 10, pages: int = 50) -> dict[str, list[str]]:
    """For up to `most` missing pairs (codes, see `expected_pairs`): whether the subscription's
    retained history (`GET /v1/subscriptions/{id}/matches`) holds the object, i.e. the match
    was written and did not reach the WebSocket, or does not, i.e. it was never written
    (`subscription/object` ids; a history is read up to `pages` pages)."""
    out: dict[str, list[str]] = {"written_not_delivered": [], "never_written": []}
    for code in np.asarray(missing, dtype=np.int64)[:most].tolist():
        sid, oid = sub_ids[code // n], obj_ids[code % n]
        seen: set[str] = set()
        params: dict[str, Any] = {"limit": 1000}
        for _ in range(pages):
            r = await client.get(f"/v1/subscriptions/{sid}/matches", headers=headers,
                                 params=params)
            r.raise_for_status()
            body = r.json()
            seen.update(m["object"]["id"] for m in body["items"] if m.get("type") == "match")
            if not body["items"] or not body.get("next_cursor"):
                break
            params["since"] = body["next_cursor"]
        key = "written_not_delivered" if oid in seen else "never_written"
        out[key].append(f"{sid}/{oid}")
    return out


async def subscribe(client: httpx.AsyncClient, headers: dict[str, str],
                    specs: list[dict[str, Any]], per_request: int = 10_000) -> list[str]:
    """Create the subscriptions in batches; their ids in order."""
    ids: list[str] = []
    for i in range(0, len(specs), per_request):
        r = await client.post("/v1/subscriptions/batch", headers=headers,
                              content=orjson.dumps({"subscriptions": specs[i:i + per_request]}))
        r.raise_for_status()
        ids += r.json()["ids"]
    return ids


async def drive(server: LiveServer, scenario: str, n_subs: int, n_objects: int, batch: int,
                rate: float | None, seed: int, concurrency: int) -> dict[str, Any]:
    rng = np.random.default_rng(seed)
    cfg = SCENARIOS[scenario]
    specs = make_subscriptions(n_subs, rng, **cfg["subs"])
    objs = make_objects(n_objects, rng)
    expected = expected_pairs(specs, objs)
    key = server.new_key("bench")
    h = {"Authorization": f"Bearer {key}", "Content-Type": "application/json"}
    async with httpx.AsyncClient(base_url=server.base_url, timeout=120) as client:
        t0 = time.perf_counter()
        sub_ids = await subscribe(client, h, specs)
        sub_create_s = time.perf_counter() - t0
        receiver = Receiver(server, key)
        receiver.task = asyncio.create_task(receiver.run())
        await asyncio.wait_for(receiver.ready.wait(), 30)
        await asyncio.sleep(0.5)
        lon, lat, kws = objs["lon"].tolist(), objs["lat"].tolist(), objs["keywords"]
        obj_ids: list[str | None] = [None] * n_objects
        sem = asyncio.Semaphore(concurrency)
        interval = batch / rate if rate else 0.0
        # The bodies are encoded before the clock starts; each gets its send time as `ts`.
        bodies = [orjson.dumps({"objects": [
            {"lon": lon[i], "lat": lat[i], "keywords": kws[i], "ts": TS_PLACEHOLDER}
            for i in range(start, min(start + batch, n_objects))]})
            for start in range(0, n_objects, batch)]

        async def send(start: int) -> None:
            async with sem:
                stamp = b'"ts":' + orjson.dumps(time.time())
                body = bodies[start // batch].replace(TS_FIELD, stamp)
                r = await client.post("/v1/objects", headers=h, content=body)
                r.raise_for_status()
                obj_ids[start:start + batch] = r.json()["ids"]

        cpu0 = cpu_seconds(server)
        hops0 = hop_counts(server.base_url)
        rows0 = summary_rows(server.base_url)
        reset_redis_stats(server.redis_url)
        t_pub = time.perf_counter()
        tasks = []
        for j, start in enumerate(range(0, n_objects, batch)):
            if interval:
                delay = t_pub + j * interval - time.perf_counter()
                if delay > 0:
                    await asyncio.sleep(delay)
            tasks.append(asyncio.create_task(send(start)))
        await asyncio.gather(*tasks)
        publish_s = time.perf_counter() - t_pub
        await until_quiet(lambda: receiver.count, expected.size)
        done_s = time.perf_counter() - t_pub
        cpu = {k: round(v - cpu0.get(k, 0.0), 1) for k, v in cpu_seconds(server).items()}
        commands = redis_commands(server.redis_url)
        await asyncio.sleep(1.0)  # duplicates or extras would arrive now (and heartbeats)
        hops = hop_breakdown(hops0, hop_counts(server.base_url))
        rows = {k: int(v - rows0[k]) for k, v in summary_rows(server.base_url).items()}
        receiver.task.cancel()
    got = receiver.parse({s: i for i, s in enumerate(sub_ids)},
                         {o: i for i, o in enumerate(obj_ids) if o is not None}, n_objects)
    counts = compare_pairs(expected, got)
    diagnosis: dict[str, Any] = {}
    if counts["missing"]:
        async with httpx.AsyncClient(base_url=server.base_url, timeout=60) as client:
            diagnosis = {"missing_diagnosis": await diagnose_missing(
                client, h, np.setdiff1d(expected, np.unique(got), assume_unique=True),
                sub_ids, obj_ids, n_objects)}
    lat_ms = sorted(receiver.latency_ms)

    def pct(p: float) -> float:
        return lat_ms[min(len(lat_ms) - 1, int(p * len(lat_ms)))] if lat_ms else float("nan")

    return {
        "scenario": scenario, "subscriptions": n_subs, "objects": n_objects, "batch": batch,
        "target_rate": rate, "subscribe_s": round(sub_create_s, 2),
        **counts, "matches_per_object": round(counts["expected_matches"] / n_objects, 2),
        "publish_objects_per_s": round(n_objects / publish_s),
        "end_to_end_objects_per_s": round(n_objects / done_s),
        "delivered_matches_per_s": round(got.size / done_s),
        "latency_ms_p50": round(pct(0.50), 1), "latency_ms_p95": round(pct(0.95), 1),
        "latency_ms_p99": round(pct(0.99), 1),
        "latency_ms_mean": round(statistics.fmean(lat_ms), 1) if lat_ms else None,
        "cpu_seconds": cpu, "wall_seconds": round(done_s, 1), **rows, **hops,
        **commands, **diagnosis,
    }


REDIS_MODES = ("one", "outbox", "cluster")


def run(scenario: str = "selective", subs: int = 100_000, objects: int = 500_000,
        batch: int = 2_000, rate: float | None = None, workers: int = 2, seed: int = 1,
        concurrency: int = 4, api_processes: int = 1, summaries: bool = True,
        redis_mode: str = "one") -> dict[str, Any]:
    """`redis_mode`: one embedded Redis; the same with every write that spans hash slots
    through outboxes; or a 3-primary Redis Cluster of the embedded binary (its nodes on this
    machine too)."""
    tmp = Path(tempfile.mkdtemp(prefix="geoswarm-bench-"))
    env = {**UNTHROTTLED, "GEOSWARM_WINDOW_S": "120",
           "GEOSWARM_KEYWORD_SUMMARIES": "1" if summaries else "0",
           "GEOSWARM_REDIS_OUTBOX": "1" if redis_mode == "outbox" else "0"}
    with ExitStack() as stack:
        if redis_mode == "cluster":
            url = stack.enter_context(redis_cluster(tmp / "redis"))
            pids = node_pids(url)
        else:
            embedded = start_embedded_redis(Settings(data_dir=tmp / "redis"),
                                            die_with_parent=True)
            stack.callback(embedded.stop)
            url, pids = embedded.url, [embedded.process.pid]
        server = start_server(tmp, url, die_with_parent=True, workers=workers,
                              api_processes=api_processes, own_db=redis_mode != "cluster",
                              **env)
        stack.callback(server.stop)
        server.wait_workers(workers)
        if redis_mode == "cluster":
            server.redis_pids = pids
        else:
            server.redis_pid = pids[0]
        rate = rate if rate is not None else SCENARIOS[scenario]["rate"]
        out = asyncio.run(drive(server, scenario, subs, objects, batch, rate, seed,
                                concurrency))
        return {"redis": redis_mode, **out}
    raise AssertionError("unreachable")


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(prog="geoswarm bench pipeline", description=__doc__)
    ap.add_argument("--scenario", choices=sorted(SCENARIOS), default="selective")
    ap.add_argument("--subs", type=int, default=100_000)
    ap.add_argument("--objects", type=int, default=None,
                    help="default: 500 000 (20 000 for the dense scenario)")
    ap.add_argument("--batch", type=int, default=2_000)
    ap.add_argument("--rate", type=float, default=None, help="objects/s (default: as fast as "
                    "possible; 10 000 for the latency scenario)")
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--concurrency", type=int, default=4, help="publish requests in flight")
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--api-processes", type=int, default=1)
    ap.add_argument("--summaries", choices=["on", "off", "both"], default="on",
                    help="Tornado's keyword summaries at the routers; both: a run without "
                    "them, then one with them, side by side")
    ap.add_argument("--redis", default="one",
                    help="one: one embedded Redis; outbox: the same with writes that span "
                    "hash slots through outboxes; cluster: a 3-primary Redis Cluster on this "
                    "machine; several, comma-separated, run side by side (one,cluster)")
    a = ap.parse_args(argv)
    modes = a.redis.split(",")
    if any(m not in REDIS_MODES for m in modes):
        ap.error(f"--redis: choose among {', '.join(REDIS_MODES)}")
    sides = {"on": [True], "off": [False], "both": [False, True]}[a.summaries]
    objects = a.objects or SCENARIOS[a.scenario].get("objects", 500_000)
    outs = [run(a.scenario, a.subs, objects, a.batch, a.rate, a.workers, a.seed,
                a.concurrency, a.api_processes, summaries=on, redis_mode=mode)
            for mode in modes for on in sides]
    keys = list(dict.fromkeys(k for out in outs for k in out))
    width = max(len(k) for k in keys)
    if len(sides) > 1:
        print(f"{'':<{width}}  " + "  |  ".join(
            f"summaries {'on' if on else 'off'}" for _ in modes for on in sides))
    for k in keys:
        print(f"{k:<{width}}  " + "  |  ".join(str(out.get(k)) for out in outs))


if __name__ == "__main__":
    main()
