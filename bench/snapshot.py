"""Snapshot query benchmark: geoswarm's `POST /v1/queries` (range, range with keywords, knn,
knn with keywords, count) over N live records on a real cluster (embedded redis-server, one
api process, worker processes), side by side in one run with Redis's own GEOSEARCH on the
same points in a geo set (the peer a user would otherwise pick: `GEOSEARCH ... BYBOX|BYRADIUS
... ASC COUNT k`).

Queries are sent one at a time, alternating the two systems, so that both see the same
machine load; each geoswarm range answer is checked against a brute-force count over the
published points. Beside them, geoswarm alone: the 10 newest records of a large box and of
a keyword anywhere, and the 10 most frequent terms of a large box (what GEOSEARCH cannot ask),
checked against brute force too; and the k nearest records that have a keyword
(`knn_keywords`: a record's own first keyword, so the nearest others that have it are often
far away), checked against brute force.

The timed requests go through a plain keep-alive HTTP/1.1 connection (`Lean`), as GEOSEARCH
goes through redis-py: httpx's own work per request was 0.3-0.4 ms of a 2 ms query (side by
side on one server), and its tail more.

A third side: the same GEOSEARCH calls behind HTTP (`bench.geosearch_http`: the smallest web
service in front of Redis, Starlette on uvicorn as geoswarm's api runs), what a user comparing
HTTP APIs would compare against. Beside them: an authenticated request that reads one key
(`http_floor`) and a publish of one moving object (`publish_one`, a vehicle's position update,
in open ocean away from every query)."""

from __future__ import annotations

import argparse
import http.client
import math
import statistics
import subprocess
import sys
import threading
import time
from collections import Counter
from typing import Any

import httpx
import numpy as np
import orjson
import redis

from app.core.processes import die_with_parent, stop_processes, wait_until_ok
from app.core.redis import free_port
from app.geo.geometry import haversine_m
from bench.cluster import ROOT, LiveServer, bench_cluster
from bench.workload import make_objects

GEO_KEY = "bench:geo"


class Lean:
    """One keep-alive HTTP/1.1 connection with the headers of a key: the least a client does
    per request (encode, send, read, decode)."""

    def __init__(self, base_url: str, headers: dict[str, str], timeout: float) -> None:
        host, _, port = base_url.split("//", 1)[1].partition(":")
        self.conn = http.client.HTTPConnection(host, int(port), timeout=timeout)
        self.headers = {**headers, "Content-Type": "application/json"}

    def request(self, method: str, path: str, body: Any = None) -> Any:
        self.conn.request(method, path, None if body is None else orjson.dumps(body),
                          self.headers)
        r = self.conn.getresponse()
        data = r.read()
        if r.status >= 400 and r.status != 404:
            raise RuntimeError(f"{method} {path}: {r.status} {data[:300]!r}")
        return orjson.loads(data) if data else None

    def close(self) -> None:
        self.conn.close()


def publish(server: LiveServer, key: str, objs: dict[str, Any], batch: int) -> list[str]:
    h = {"Authorization": f"Bearer {key}", "Content-Type": "application/json"}
    lon, lat, kws = objs["lon"].tolist(), objs["lat"].tolist(), objs["keywords"]
    ts = objs["ts"].tolist()
    ids: list[str] = []
    with httpx.Client(base_url=server.base_url, timeout=120) as client:
        for a in range(0, len(lon), batch):
            body = orjson.dumps({"objects": [
                {"lon": lon[i], "lat": lat[i], "keywords": kws[i], "ts": ts[i]}
                for i in range(a, min(a + batch, len(lon)))]})
            for _ in range(100):
                r = client.post("/v1/objects", headers=h, content=body)
                if r.status_code != 503:
                    break
                time.sleep(float(r.headers.get("retry-after", "1")))
            r.raise_for_status()
            ids += r.json()["ids"]
    return ids


# Where the background publisher puts its records: open ocean in the South Pacific, over a
# thousand kilometres from any city, so that every query's answer (near cities) stays the
# published points' while the workers keep storing new records.
BACKGROUND_BOX = (-150.0, -60.0, -140.0, -50.0)
# their keyword, a word of no published record (a query for a published record's word, such
# as "sea", would find the newest background records first: not the brute force's answer)
BACKGROUND_KEYWORD = "background-ingest"


class Background(threading.Thread):
    """Publishes `rate` records/s in batches of `batch` while the queries run (a live window
    under steady ingest: new chunks arrive between the queries)."""

    def __init__(self, server: LiveServer, key: str, rate: float, batch: int, seed: int
                 ) -> None:
        super().__init__(daemon=True)
        self.url, self.rate, self.batch = server.base_url, rate, batch
        self.headers = {"Authorization": f"Bearer {key}", "Content-Type": "application/json"}
        self.rng = np.random.default_rng(seed)
        self.stopping = threading.Event()
        self.sent = 0
        self.elapsed = 0.0

    def run(self) -> None:
        x0, y0, x1, y1 = BACKGROUND_BOX
        started = time.perf_counter()
        with httpx.Client(base_url=self.url, timeout=120) as client:
            while not self.stopping.is_set():
                lon = self.rng.uniform(x0, x1, self.batch).tolist()
                lat = self.rng.uniform(y0, y1, self.batch).tolist()
                now = time.time()
                body = orjson.dumps({"objects": [
                    {"lon": lon[i], "lat": lat[i], "keywords": [BACKGROUND_KEYWORD], "ts": now}
                    for i in range(self.batch)]})
                r = client.post("/v1/objects", headers=self.headers, content=body)
                r.raise_for_status()  # (a benchmark's cluster is unthrottled)
                self.sent += self.batch
                # paced: the next batch when the rate says so
                ahead = started + self.sent / self.rate - time.perf_counter()
                if ahead > 0:
                    self.stopping.wait(ahead)
        self.elapsed = time.perf_counter() - started


def load_geo_set(client: redis.Redis, ids: list[str], objs: dict[str, Any]) -> None:
    """GEOADD every point (Redis clamps latitudes to ±85.05; the workload has none beyond)."""
    lon, lat = objs["lon"].tolist(), objs["lat"].tolist()
    pipe: Any = client.pipeline(transaction=False)
    for a in range(0, len(ids), 10_000):
        flat: list[Any] = []
        for i in range(a, min(a + 10_000, len(ids))):
            flat += [lon[i], lat[i], ids[i]]
        pipe.execute_command("GEOADD", GEO_KEY, *flat)
    pipe.execute()


def pct(values: list[float], p: float) -> float:
    s = sorted(values)
    return round(s[min(len(s) - 1, int(p * len(s)))], 2) if s else float("nan")


def summary(ms: list[float]) -> dict[str, float]:
    return {"p50_ms": pct(ms, 0.5), "p99_ms": pct(ms, 0.99),
            "mean_ms": round(statistics.fmean(ms), 2) if ms else float("nan")}


def _agrees(objs: dict[str, Any], kind: str, where: Any, got: Any, k: int,
            ids: list[str]) -> bool:
    """A range answer's size, a knn answer's k-th distance, the 10 newest records' ids or the
    10 most frequent terms, against brute force."""
    if kind in ("range", "newest_box", "topk_terms"):
        inside = ((objs["lon"] >= where[0]) & (objs["lon"] <= where[2])
                  & (objs["lat"] >= where[1]) & (objs["lat"] <= where[3]))
        if kind == "range":
            return bool(got == int(min(inside.sum(), 10_000)))
        rows = np.flatnonzero(inside).tolist()
        if kind == "newest_box":
            return bool(got == newest(objs, ids, rows))
        terms = Counter(t for i in rows for t in objs["keywords"][i])
        return bool(got == sorted(terms.items(), key=lambda tc: (-tc[1], tc[0]))[:10])
    if kind == "newest_keyword":
        return bool(got == objs["newest_ids"][where])
    if kind == "knn_keywords":
        rows = objs["having"][where[2]]
        d = np.sort(haversine_m(where[0], where[1], objs["lon"][rows], objs["lat"][rows]))[:k]
        return len(got) == d.size and bool(np.all(np.abs(np.asarray(got) - d) <= 0.01))
    d = haversine_m(where[0], where[1], objs["lon"], objs["lat"])
    return bool(abs(float(np.partition(d, k - 1)[k - 1]) - got) <= 0.01)


def newest(objs: dict[str, Any], ids: list[str], rows: list[int]) -> list[str]:
    """The ids of the 10 newest of these records (newest first, then by id)."""
    ts = objs["ts"]
    return [ids[r] for r in sorted(rows, key=lambda r: (-ts[r], ids[r]))[:10]]


def world_box(x0: float, y0: float, x1: float, y1: float) -> list[float]:
    """A query box around a record, cut at the edges of the world (the api refuses a box
    past them: a centre near the antimeridian or a pole would fail the run)."""
    return [max(-180.0, x0), max(-90.0, y0), min(180.0, x1), min(90.0, y1)]


def run(records: int = 1_000_000, queries: int = 200, workers: int = 2, batch: int = 5_000,
        box_km: float = 5.0, k: int = 10, seed: int = 1, bucket_s: float | None = None,
        publish_rate: float = 0.0, publish_batch: int = 200) -> dict[str, Any]:
    # `bucket_s`: the window's buckets that narrow (GEOSWARM_BUCKET_S), so that the records of
    # a run of seconds lie in as many buckets as an hour's window holds (60 by default)
    extra = {} if bucket_s is None else {"GEOSWARM_BUCKET_S": str(bucket_s)}
    with bench_cluster("geoswarm-bench-snapshot-", workers,
                       GEOSWARM_QUERY_TIMEOUT_S="120", **extra) as server:
        rng = np.random.default_rng(seed)
        objs = make_objects(records, rng)
        # each record's own time within the last 50 minutes (a sensor's, a post's)
        objs["ts"] = time.time() - rng.uniform(0, 3000, records)
        key = server.new_key("bench")
        t0, wall0 = time.perf_counter(), time.time()
        ids = publish(server, key, objs, batch)
        publish_s = time.perf_counter() - t0
        geo: Any = redis.Redis.from_url(server.redis_url)  # (execute_command is untyped)
        load_geo_set(geo, ids, objs)
        h = {"Authorization": f"Bearer {key}"}
        out: dict[str, Any] = {"records": records, "workers": workers,
                               "publish_records_per_s": round(records / publish_s)}
        if bucket_s is not None:
            out["bucket_s"] = bucket_s
            out["buckets"] = int(time.time() // bucket_s) - int(wall0 // bucket_s) + 1
        peer_port = free_port()
        peer_proc = subprocess.Popen(
            [sys.executable, "-m", "bench.geosearch_http", str(peer_port), server.redis_url,
             GEO_KEY], cwd=ROOT, preexec_fn=die_with_parent)
        if not wait_until_ok(f"http://127.0.0.1:{peer_port}/", peer_proc, timeout=30):
            stop_processes([peer_proc])
            raise RuntimeError("the GEOSEARCH web service did not start")
        peer = Lean(f"http://127.0.0.1:{peer_port}", {}, timeout=60)
        client = Lean(server.base_url, h, timeout=300)
        try:
            # the first query waits behind the workers' backlog: it tells when all is stored
            t0 = time.perf_counter()
            r = client.request("POST", "/v1/queries",
                               {"type": "count", "bbox": [-180, -90, 180, 90], "wait_s": 60})
            out["stored_after_s"] = round(time.perf_counter() - t0 + publish_s, 1)
            out["count_all"] = r["results"][0]["count"]
            times: dict[str, list[float]] = {n: [] for n in (
                "range", "geosearch_box", "geosearch_box_http", "range_keywords", "knn",
                "geosearch_knn", "geosearch_knn_http", "knn_keywords", "count_large_box",
                "newest_large_box", "newest_keyword", "topk_terms_large_box", "http_floor",
                "publish_one")}
            # answers are checked after the timed loop: the brute force over every point
            # would leave the machine's caches cold for the next query
            checks: list[tuple[str, Any, Any]] = []
            background = None
            if publish_rate > 0:
                background = Background(server, key, publish_rate, publish_batch, seed + 1)
                background.start()
                time.sleep(2.0)  # under way before the first query
            centres = rng.choice(records, size=queries, replace=False)
            half_lon = box_km / 2 / 111.32
            for c in centres.tolist():
                lon, lat = float(objs["lon"][c]), float(objs["lat"][c])
                dlon = half_lon / max(0.05, math.cos(math.radians(lat)))
                dlat = box_km / 2 / 110.57
                bbox = world_box(lon - dlon, lat - dlat, lon + dlon, lat + dlat)
                t = time.perf_counter()
                r = client.request("POST", "/v1/queries", {
                    "type": "range", "bbox": bbox, "limit": 10_000})
                times["range"].append((time.perf_counter() - t) * 1000)
                checks.append(("range", bbox, len(r["results"])))
                t = time.perf_counter()
                geo.execute_command("GEOSEARCH", GEO_KEY, "FROMLONLAT", lon, lat, "BYBOX",
                                    box_km, box_km, "km",
                                    "WITHCOORD", "COUNT", 10_000)
                times["geosearch_box"].append((time.perf_counter() - t) * 1000)
                t = time.perf_counter()
                peer.request("POST", "/box", {"lon": lon, "lat": lat, "km": box_km})
                times["geosearch_box_http"].append((time.perf_counter() - t) * 1000)
                word = objs["keywords"][c][0]
                t = time.perf_counter()
                client.request("POST", "/v1/queries", {
                    "type": "range", "bbox": bbox, "keywords": [word], "limit": 10_000})
                times["range_keywords"].append((time.perf_counter() - t) * 1000)
                t = time.perf_counter()
                r = client.request("POST", "/v1/queries", {
                    "type": "knn", "point": [lon, lat], "k": k})
                times["knn"].append((time.perf_counter() - t) * 1000)
                far = r["results"][-1]["distance_m"]
                t = time.perf_counter()
                geo.execute_command("GEOSEARCH", GEO_KEY, "FROMLONLAT", lon, lat, "BYRADIUS",
                                    max(1.0, far * 1.01), "m", "WITHCOORD", "WITHDIST", "ASC",
                                    "COUNT", k)
                times["geosearch_knn"].append((time.perf_counter() - t) * 1000)
                t = time.perf_counter()
                peer.request("POST", "/knn", {"lon": lon, "lat": lat, "k": k,
                                              "m": max(1.0, far * 1.01)})
                times["geosearch_knn_http"].append((time.perf_counter() - t) * 1000)
                checks.append(("knn", [lon, lat], far))
                # the k nearest that have a keyword (its own first: near ones are few, the
                # search often reaches far)
                t = time.perf_counter()
                r = client.request("POST", "/v1/queries", {
                    "type": "knn", "point": [lon, lat], "k": k, "keywords": [word]})
                times["knn_keywords"].append((time.perf_counter() - t) * 1000)
                checks.append(("knn_keywords", (lon, lat, word),
                               [x["distance_m"] for x in r["results"]]))
                large = world_box(lon - 10, lat - 5, lon + 10, lat + 5)
                t = time.perf_counter()
                client.request("POST", "/v1/queries", {"type": "count", "bbox": large})
                times["count_large_box"].append((time.perf_counter() - t) * 1000)
                # the 10 newest records of a large region, and of a keyword anywhere
                t = time.perf_counter()
                r = client.request("POST", "/v1/queries", {
                    "type": "range", "bbox": large, "limit": 10})
                times["newest_large_box"].append((time.perf_counter() - t) * 1000)
                checks.append(("newest_box", large, [x["id"] for x in r["results"]]))
                t = time.perf_counter()
                r = client.request("POST", "/v1/queries", {
                    "type": "topk_terms", "bbox": large, "k": 10})
                times["topk_terms_large_box"].append((time.perf_counter() - t) * 1000)
                checks.append(("topk_terms", large, [(x["term"], x["count"])
                                                     for x in r["results"]]))
                t = time.perf_counter()
                r = client.request("POST", "/v1/queries", {
                    "type": "keyword", "keywords": [word], "limit": 10})
                times["newest_keyword"].append((time.perf_counter() - t) * 1000)
                checks.append(("newest_keyword", word, [x["id"] for x in r["results"]]))
                # what any authenticated request costs (HTTP, the key check, a Redis read)
                t = time.perf_counter()
                client.request("GET", "/v1/queries/q0")
                times["http_floor"].append((time.perf_counter() - t) * 1000)
            # A vehicle's position update: one moving object per request (in open ocean, away
            # from every query, like the background publisher's). After the queries: a change
            # of the counts before each count would make it wait for their writing (see
            # --publish-rate for queries under ingest).
            for i in range(queries):
                bx = rng.uniform(BACKGROUND_BOX[0], BACKGROUND_BOX[2])
                by = rng.uniform(BACKGROUND_BOX[1], BACKGROUND_BOX[3])
                t = time.perf_counter()
                client.request("POST", "/v1/objects", {"objects": [
                    {"id": f"buoy-{i % 100}", "lon": bx, "lat": by}]})
                times["publish_one"].append((time.perf_counter() - t) * 1000)
            if background is not None:
                background.stopping.set()
                background.join()
                out["background_records"] = background.sent
                out["background_records_per_s"] = round(background.sent / background.elapsed)
        finally:
            client.close()
            peer.close()
            stop_processes([peer_proc])
        # each keyword asked: the ids of the 10 newest records that have it
        asked: set[str] = {where for kind, where, _ in checks if kind == "newest_keyword"} | {
            where[2] for kind, where, _ in checks if kind == "knn_keywords"}
        having: dict[str, list[int]] = {w: [] for w in asked}
        for row, kws in enumerate(objs["keywords"]):
            for w in asked.intersection(kws):
                having[w].append(row)
        objs["newest_ids"] = {w: newest(objs, ids, rows) for w, rows in having.items()}
        objs["having"] = {w: np.asarray(rows, dtype=np.int64) for w, rows in having.items()}
        out["answers_differing_from_brute_force"] = sum(
            not _agrees(objs, kind, where, got, k, ids) for kind, where, got in checks)
        for name, ms in times.items():
            out[name] = summary(ms)
        out["range_vs_geosearch_p50"] = round(
            out["range"]["p50_ms"] / out["geosearch_box"]["p50_ms"], 1)
        out["knn_vs_geosearch_p50"] = round(
            out["knn"]["p50_ms"] / out["geosearch_knn"]["p50_ms"], 1)
        out["range_vs_geosearch_http_p50"] = round(
            out["range"]["p50_ms"] / out["geosearch_box_http"]["p50_ms"], 1)
        out["knn_vs_geosearch_http_p50"] = round(
            out["knn"]["p50_ms"] / out["geosearch_knn_http"]["p50_ms"], 1)
        return out


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(prog="geoswarm bench snapshot", description=__doc__)
    ap.add_argument("--records", type=int, default=1_000_000)
    ap.add_argument("--queries", type=int, default=200, help="of each kind")
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--batch", type=int, default=5_000, help="records per publish request")
    ap.add_argument("--box-km", type=float, default=5.0, help="side of the range queries' box")
    ap.add_argument("--k", type=int, default=10)
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--bucket-s", type=float, default=None,
                    help="the window's bucket width (GEOSWARM_BUCKET_S, default 60): a narrow "
                         "one spreads the records of the run over as many buckets as an "
                         "hour's window holds, as steady publishing does")
    ap.add_argument("--publish-rate", type=float, default=0.0,
                    help="records/s published while the queries run, in open ocean away from "
                         "every query (a window under steady ingest); 0: none")
    ap.add_argument("--publish-batch", type=int, default=200,
                    help="records per request of that publishing")
    a = ap.parse_args(argv)
    out = run(a.records, a.queries, a.workers, a.batch, a.box_km, a.k, a.seed, a.bucket_s,
              a.publish_rate, a.publish_batch)
    width = max(len(k) for k in out)
    for k, v in out.items():
        print(f"{k:<{width}}  {v}")


if __name__ == "__main__":
    main()
