"""One SWARM executor process (SWARM §4.1.2, Tornado §3.2): consumes its own Redis stream
through a consumer group, keeps a spatio-textual subscription index per tenant, decides
matches (inside / enter / exit) for a whole batch at once and writes them to the
per-subscription history streams, acknowledging an entry only after its matches are written.
"""

from __future__ import annotations

import logging
import os
import signal
import socket
import threading
import time
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import orjson
import redis

from app.core.config import Settings
from app.core.db import make_engine, make_sessionmaker
from app.geo.index import GlobalIndex, Plan
from app.geo.matcher import SubscriptionIndex, sub_from_spec
from app.pipeline import records as R
from app.pipeline.router import targets_for_spec
from app.services.subscriptions import all_live
from workers.knn import MERGE_SCRIPT, KnnState, KnnSub, knn_sub

log = logging.getLogger(__name__)

# One call appends a batch's history entries: KEYS are history streams, ARGV = bucket,
# tenant, maxlen, ttl, then one packed reference list per key. Returns, per key, the id of
# the entry before the new one and the new id, so hubs can push the entry directly to a
# client whose cursor is exactly at that previous entry.
HISTORY_SCRIPT = """
local out = {}
for i = 1, #KEYS do
  local last = redis.call('XREVRANGE', KEYS[i], '+', '-', 'COUNT', 1)
  local prev = '0-0'
  if last[1] then prev = last[1][1] end
  out[2 * i - 1] = prev
  out[2 * i] = redis.call('XADD', KEYS[i], 'MAXLEN', '~', ARGV[3], '*', 'b', ARGV[1],
                          't', ARGV[2], 'm', ARGV[4 + i])
  redis.call('EXPIRE', KEYS[i], ARGV[4])
end
return out
"""
HISTORY_CHUNK = 4096  # history entries per script call (bounds the time Redis is busy)
I64 = np.ndarray[Any, np.dtype[np.int64]]


@dataclass
class SubInfo:
    id: str
    detect: frozenset[str]
    expires_at: float | None


DETECT_BITS = {"inside": 1, "enter": 2, "exit": 4}


@dataclass
class TenantIndex:
    """A tenant's subscriptions on this worker: objects only ever meet their own tenant's.
    Per-key arrays (detect bits, expiry) let the decisions be taken for a batch at once."""

    index: SubscriptionIndex
    subs: dict[int, SubInfo] = field(default_factory=dict)
    key_of: dict[str, int] = field(default_factory=dict)
    detect: np.ndarray[Any, np.dtype[np.uint8]] = field(
        default_factory=lambda: np.zeros(1024, dtype=np.uint8))
    expires: np.ndarray[Any, np.dtype[np.float64]] = field(
        default_factory=lambda: np.full(1024, np.inf))
    ids: np.ndarray[Any, np.dtype[np.object_]] = field(
        default_factory=lambda: np.empty(1024, dtype=object))

    def put(self, key: int, info: SubInfo) -> None:
        if key >= self.detect.size:
            n = max(key + 1, 2 * self.detect.size)
            self.detect = np.resize(self.detect, n)
            self.expires = np.resize(self.expires, n)
            self.ids = np.resize(self.ids, n)
        self.subs[key] = info
        self.key_of[info.id] = key
        self.detect[key] = sum(DETECT_BITS[d] for d in info.detect)
        self.expires[key] = np.inf if info.expires_at is None else info.expires_at
        self.ids[key] = info.id

    def drop(self, key: int) -> None:
        info = self.subs.pop(key)
        del self.key_of[info.id]
        self.detect[key] = 0


@dataclass
class Matches:
    """The matches decided for one batch, parallel arrays sorted by (sub key, row, detect)."""

    keys: I64
    rows: I64
    detect: np.ndarray[Any, np.dtype[np.uint8]]


class Executor:
    def __init__(self, settings: Settings, worker_id: str, redis_url: str) -> None:
        self.settings = settings
        self.id = worker_id
        # redis-py's reply types are unions of every RESP shape; treat replies as Any here.
        self.redis: Any = redis.Redis.from_url(redis_url, socket_timeout=30,
                                               socket_connect_timeout=5)
        self.stream = R.worker_stream(worker_id)
        self.tenants: dict[str, TenantIndex] = {}
        self.key_seq = 0
        self.index: GlobalIndex | None = None
        self.stopping = 0
        self.received = 0
        self.matched = 0
        self.last_trim = 0.0
        self.touched: set[str] = set()
        self.started = time.time()
        self.knn: dict[str, KnnState] = {}
        self._merge = self.redis.register_script(MERGE_SCRIPT)
        self._history = self.redis.register_script(HISTORY_SCRIPT)
        self.pending_history: list[tuple[str, int, list[str], list[bytes], dict[str, bytes]]] = []

    # --- lifecycle -----------------------------------------------------------------------
    def run(self) -> None:
        signal.signal(signal.SIGTERM, self._on_signal)
        signal.signal(signal.SIGINT, self._on_signal)
        self._ensure_group()
        self._load_plan()
        self._rebuild_positions()
        self._rebuild_subscriptions()
        self._heartbeat()
        beat = threading.Thread(target=self._heartbeat_loop, daemon=True)
        beat.start()
        self._recover_pending()
        log.info("worker %s ready (pid %d)", self.id, os.getpid())
        while not self.stopping:
            try:
                self._step()
            except redis.ConnectionError as exc:
                log.warning("worker %s: redis unavailable (%s); retrying", self.id, exc)
                time.sleep(0.5)
            except redis.ResponseError as exc:
                if "NOGROUP" not in str(exc):
                    raise
                # The stream or its group vanished (FLUSHALL, a restored backup): recreate it.
                log.warning("worker %s: consumer group missing; recreating it", self.id)
                self._ensure_group()
        log.info("worker %s stopped", self.id)

    def _on_signal(self, signum: int, _frame: Any) -> None:
        self.stopping += 1
        if self.stopping > 1:  # second signal: cold stop
            os._exit(1)

    def _ensure_group(self) -> None:
        try:
            self.redis.xgroup_create(self.stream, R.GROUP, id="0", mkstream=True)
        except redis.ResponseError as exc:
            if "BUSYGROUP" not in str(exc):
                raise

    def _load_plan(self) -> None:
        while not self.stopping:
            raw = self.redis.get(R.PLAN_KEY)
            if raw is not None:
                plan = Plan.from_json(raw)
                if self.index is None or plan.version != self.index.plan.version:
                    self.index = GlobalIndex(plan)
                return
            time.sleep(0.2)

    def _rebuild_subscriptions(self) -> None:
        """Rebuild this worker's subscriptions from SQL (stream replay covers later changes)."""
        engine = make_engine(self.settings)
        try:
            with make_sessionmaker(engine)() as session:
                rows = all_live(session, time.time())
                msgs: list[dict[str, Any]] = [{"id": r.id, "tenant": r.tenant, "spec": r.spec,
                         "expires_at": r.expires_at} for r in rows]
        finally:
            engine.dispose()
        assert self.index is not None
        mine = [m for m in msgs if self.id in targets_for_spec(self.index, m["spec"])]
        self.handle_subs_added(mine)
        log.info("worker %s rebuilt %d subscriptions from SQL", self.id, len(mine))

    def _rebuild_positions(self) -> None:
        """Moving objects whose latest position lies in this worker's partitions (kNN state);
        events of the window are not rebuilt after a crash."""
        assert self.index is not None
        me = self.index.workers.index(self.id) if self.id in self.index.workers else -1
        for key in self.redis.scan_iter(match="gs:pos:*", count=1000):
            tenant = key.decode()[len("gs:pos:"):]
            ids, lons, lats, rest = [], [], [], []
            for oid, raw in self.redis.hscan_iter(key, count=1000):
                ts, lon, lat, kws, _props = R.unpack(raw) if isinstance(raw, bytes) else raw
                ids.append(oid.decode())
                lons.append(lon)
                lats.append(lat)
                rest.append((ts, kws))
            if not ids:
                continue
            owner = self.index.worker_of_points(np.asarray(lons), np.asarray(lats))
            state = self._knn_state(tenant)
            for i in np.flatnonzero(owner == me).tolist():
                state.objects.upsert_moving(ids[i], float(lons[i]), float(lats[i]),
                                            frozenset(rest[i][1]), float(rest[i][0]))

    def _knn_state(self, tenant: str) -> KnnState:
        state = self.knn.get(tenant)
        if state is None:
            state = self.knn[tenant] = KnnState(self.settings.window_s, self.settings.bucket_s)
        return state

    def _merge_knn(self, tenant: str, subs: list[KnnSub], pipe: Any) -> None:
        for sub in subs:
            local = orjson.dumps([list(n) for n in sub.local])
            self._merge(keys=[f"gs:knn:{sub.id}", R.history_key(sub.id)],
                        args=[self.id, local, sub.k, self.settings.history_max_len,
                              int(self.settings.history_max_age_s) + 60, tenant],
                        client=pipe)

    def _heartbeat(self) -> None:
        info = {
            "id": self.id, "pid": os.getpid(), "host": socket.gethostname(),
            "heartbeat": time.time(), "started": self.started, "received": self.received,
            "matched": self.matched,
            "subscriptions": sum(len(t.subs) for t in self.tenants.values()),
            "plan_version": self.index.plan.version if self.index else None,
        }
        self.redis.hset(R.WORKERS_KEY, self.id, orjson.dumps(info))

    def _heartbeat_loop(self) -> None:
        while not self.stopping:
            try:
                self._heartbeat()
            except redis.RedisError:
                pass  # the main loop reports Redis outages; the next beat retries
            time.sleep(self.settings.worker_heartbeat_s)

    # --- the stream ----------------------------------------------------------------------
    def _recover_pending(self) -> None:
        """Reclaim entries left pending by an earlier incarnation (XAUTOCLAIM) and process
        them, skipping those whose matches were already written and dead-lettering entries
        delivered too often."""
        start = "0-0"
        while True:
            reply = self.redis.xautoclaim(self.stream, R.GROUP, self.id, min_idle_time=0,
                                          start_id=start, count=500)
            start = reply[0].decode() if isinstance(reply[0], bytes) else reply[0]
            if start in ("0-0", "0"):
                break
        while not self.stopping:
            reply = self.redis.xreadgroup(R.GROUP, self.id, {self.stream: "0"}, count=200)
            entries = reply[0][1] if reply else []
            if not entries:
                return
            self._process(entries, replay=True)

    def _step(self) -> None:
        reply = self.redis.xreadgroup(R.GROUP, self.id, {self.stream: ">"}, count=256,
                                      block=1000)
        if reply:
            self._process(reply[0][1], replay=False)
        now = time.time()
        if now - self.last_trim > 5.0:
            self.last_trim = now
            self._trim(now)

    def _process(self, entries: list[tuple[bytes, dict[bytes, bytes]]], replay: bool) -> None:
        ids = [e[0] for e in entries]
        if replay:
            done = self.redis.mget([R.done_key(self.id, i.decode()) for i in ids])
            counts = self._delivery_counts(ids)
            keep = []
            for (eid, fields), d in zip(entries, done, strict=True):
                if d is not None:
                    continue  # matches already written; only the XACK was lost
                if counts.get(eid, 0) > self.settings.max_deliveries:
                    self._dead_letter(eid, fields, "delivered too often")
                    continue
                keep.append((eid, fields))
            entries = keep
        msgs: list[tuple[bytes, dict[str, Any]]] = []
        for eid, fields in entries:
            try:
                msgs.append((eid, R.unpack(fields[b"m"])))
            except Exception as exc:  # noqa: BLE001 - a poison entry must not stop the shard
                self._dead_letter(eid, fields, f"undecodable: {exc}")
        pipe = self.redis.pipeline(transaction=True)
        notify: dict[str, set[str]] = {}
        # Consecutive object entries of one tenant are matched as one batch; control
        # messages keep their place in the stream order.
        group: list[dict[str, Any]] = []
        for _eid, msg in msgs:
            kind = msg.get("t")
            if kind == "obj":
                if group and group[0]["tn"] != msg["tn"]:
                    self._match_group(group, pipe, notify)
                    group = []
                group.append(msg)
                continue
            if group:
                self._match_group(group, pipe, notify)
                group = []
            if kind == "sub+":
                self.handle_subs_added(msg["subs"], pipe)
                for m in msg["subs"]:
                    if m["spec"]["type"] == "knn":
                        notify.setdefault(m["tenant"], set()).add(m["id"])
            elif kind == "sub-":
                self.handle_subs_removed(msg["ids"])
        if group:
            self._match_group(group, pipe, notify)
        for eid in ids:
            pipe.set(R.done_key(self.id, eid.decode()), b"1", ex=24 * 3600)
        writes, self.pending_history = self.pending_history, []
        slots = []
        ttl = int(self.settings.history_max_age_s) + 60
        for tenant, bucket, sub_ids, refs, _records in writes:
            for a in range(0, len(sub_ids), HISTORY_CHUNK):
                slots.append(len(pipe.command_stack))
                self._history(keys=[R.history_key(s) for s in sub_ids[a:a + HISTORY_CHUNK]],
                              args=[bucket, tenant, self.settings.history_max_len, ttl,
                                    *refs[a:a + HISTORY_CHUNK]], client=pipe)
        results = pipe.execute()
        self._notify(writes, [results[i] for i in slots], notify)
        self.redis.xack(self.stream, R.GROUP, *ids)

    def _notify(self, writes: list[tuple[str, int, list[str], list[bytes], dict[str, bytes]]],
                replies: list[list[bytes]], notify: dict[str, set[str]]) -> None:
        """Tell the hubs what was appended: the entries with their previous ids and the
        records they reference, so caught-up clients get them without a read."""
        pipe = self.redis.pipeline(transaction=False)
        it = iter(replies)
        for tenant, bucket, sub_ids, refs, records in writes:
            entries = []
            for a in range(0, len(sub_ids), HISTORY_CHUNK):
                reply = next(it)
                for j, sid in enumerate(sub_ids[a:a + HISTORY_CHUNK]):
                    entries.append((sid, reply[2 * j], reply[2 * j + 1], refs[a + j]))
            pipe.publish(R.NOTIFY_CHANNEL, R.pack({"tn": tenant, "b": bucket, "e": entries,
                                                   "r": records}))
        for tenant, subs in notify.items():
            pipe.publish(R.NOTIFY_CHANNEL, R.pack({"tn": tenant, "s": sorted(subs)}))
        pipe.execute()

    def _delivery_counts(self, ids: list[bytes]) -> dict[bytes, int]:
        if not ids:
            return {}
        rows = self.redis.xpending_range(self.stream, R.GROUP, min=ids[0], max=ids[-1],
                                         count=len(ids) + 10)
        out = {}
        for row in rows:
            mid = row["message_id"]
            out[mid if isinstance(mid, bytes) else mid.encode()] = int(row["times_delivered"])
        return out

    def _dead_letter(self, eid: bytes, fields: dict[bytes, bytes], why: str) -> None:
        log.error("worker %s: entry %s to the dead-letter stream: %s", self.id, eid, why)
        self.redis.xadd(R.DEAD_LETTER, {b"stream": self.stream.encode(), b"id": eid,
                                        b"why": why.encode(), **fields}, maxlen=100_000)
        self.redis.xack(self.stream, R.GROUP, eid)
        self.redis.incr("gs:metrics:dead_letter")

    def _trim(self, now: float) -> None:
        """Trim the worker stream below the oldest pending entry (never what is pending) and
        the history streams this worker wrote to by age."""
        try:
            groups = self.redis.xinfo_groups(self.stream)
            last = next((g["last-delivered-id"] for g in groups
                         if g["name"] in (R.GROUP, R.GROUP.encode())), None)
            summary = self.redis.xpending(self.stream, R.GROUP)
            floor = summary["min"] if summary and summary.get("pending") else last
            if floor:
                self.redis.execute_command("XTRIM", self.stream, "MINID", floor)
            if self.touched:
                min_id = f"{int((now - self.settings.history_max_age_s) * 1000)}-0"
                pipe = self.redis.pipeline(transaction=False)
                for sub in self.touched:
                    pipe.execute_command("XTRIM", R.history_key(sub), "MINID", "~", min_id)
                pipe.execute()
                self.touched.clear()
        except redis.ResponseError as exc:
            log.warning("worker %s: trim failed: %s", self.id, exc)

    # --- subscriptions -------------------------------------------------------------------
    def handle_subs_added(self, subs: list[dict[str, Any]], pipe: Any = None) -> None:
        for m in subs:
            spec = m["spec"]
            if spec["type"] == "knn":
                state = self._knn_state(m["tenant"])
                if m["id"] not in state.subs:
                    sub = state.add(knn_sub(m["id"], spec))
                    self._merge_knn(m["tenant"], [sub], pipe if pipe is not None else self.redis)
                continue
            t = self.tenants.get(m["tenant"])
            if t is None:
                assert self.index is not None
                t = self.tenants[m["tenant"]] = TenantIndex(SubscriptionIndex(self.index.grid))
            if m["id"] in t.key_of:
                continue
            self.key_seq += 1
            key = self.key_seq
            t.index.add(sub_from_spec(key, spec))
            t.put(key, SubInfo(m["id"], frozenset(spec.get("detect") or ("inside",)),
                               m.get("expires_at")))

    def handle_subs_removed(self, ids: list[str]) -> None:
        for state in self.knn.values():
            for sid in ids:
                if state.subs.pop(sid, None) is not None:
                    self.redis.delete(f"gs:knn:{sid}")
        for t in self.tenants.values():
            for sid in ids:
                key = t.key_of.get(sid)
                if key is not None:
                    t.index.remove(key)
                    t.drop(key)

    # --- objects -------------------------------------------------------------------------
    def _match_group(self, group: list[dict[str, Any]], pipe: Any,
                     notify: dict[str, set[str]]) -> None:
        tenant = group[0]["tn"]
        cols = {k: [v for m in group for v in m[k]] for k in
                ("id", "rid", "mv", "lon", "lat", "ts", "kw", "txt", "pr", "prev", "late",
                 "xo", "dx")}
        at = [m["at"] for m in group for _ in m["id"]]
        self.received += len(cols["id"])
        changed = self._knn_state(tenant).apply(cols, at, time.time())
        if changed:
            self._merge_knn(tenant, changed, pipe)
            notify.setdefault(tenant, set()).update(s.id for s in changed)
        t = self.tenants.get(tenant)
        if t is None or not t.subs:
            return
        matches = self.decide(t, cols, at)
        if not matches.rows.size:
            return
        self.write_matches(tenant, cols, matches, pipe, notify)

    def decide(self, t: TenantIndex, cols: dict[str, list[Any]], at: list[float]) -> Matches:
        """inside / enter / exit for every (record, subscription) of the batch, vectorised."""
        lon = np.asarray(cols["lon"], dtype=np.float64)
        lat = np.asarray(cols["lat"], dtype=np.float64)
        kws = cols["kw"]
        o_new, k_new = t.index.match(lon, lat, kws)
        xo = np.asarray(cols["xo"], dtype=bool)
        mv = np.asarray(cols["mv"], dtype=bool)
        late = np.asarray(cols["late"], dtype=bool)
        dx = np.asarray(cols["dx"], dtype=bool)
        at_a = np.asarray(at, dtype=np.float64)
        # Records with a usable previous position (moving, in order): match the previous
        # position too, with the new record's keywords, to see transitions.
        has_prev = np.fromiter((p is not None for p in cols["prev"]), dtype=bool,
                               count=len(cols["prev"])) & ~late
        pr = np.flatnonzero(has_prev)
        if pr.size:
            prev = [cols["prev"][i] for i in pr.tolist()]
            plon = np.asarray([p[0] for p in prev], dtype=np.float64)
            plat = np.asarray([p[1] for p in prev], dtype=np.float64)
            o_p, k_prev = t.index.match(plon, plat, [kws[i] for i in pr.tolist()])
            o_prev = pr[o_p]
        else:
            o_prev = k_prev = np.empty(0, dtype=np.int64)
        code_new = (o_new.astype(np.int64) << 32) | k_new.astype(np.int64)
        code_prev = (o_prev.astype(np.int64) << 32) | k_prev.astype(np.int64)
        was_inside = np.isin(code_new, code_prev)
        still_inside = np.isin(code_prev, code_new)

        det_new = t.detect[k_new]
        live_new = (at_a[o_new] < t.expires[k_new]) & ~xo[o_new]
        inside = live_new & ((det_new & 1) > 0)
        enter = live_new & ((det_new & 2) > 0) & mv[o_new] & ~late[o_new] & ~was_inside
        det_prev = t.detect[k_prev]
        exit_ = (((det_prev & 4) > 0) & ~still_inside & dx[o_prev]
                 & (at_a[o_prev] < t.expires[k_prev]))
        keys = np.concatenate([k_new[inside], k_new[enter], k_prev[exit_]]).astype(np.int64)
        rows = np.concatenate([o_new[inside], o_new[enter], o_prev[exit_]]).astype(np.int64)
        detect = np.concatenate([np.zeros(int(inside.sum()), np.uint8),
                                 np.ones(int(enter.sum()), np.uint8),
                                 np.full(int(exit_.sum()), 2, np.uint8)])
        order = np.lexsort((detect, rows, keys))
        return Matches(keys=keys[order], rows=rows[order], detect=detect[order])

    def write_matches(self, tenant: str, cols: dict[str, list[Any]], m: Matches, pipe: Any,
                      notify: dict[str, set[str]]) -> None:
        """Store each matched record once and queue one history entry per subscription for
        the batch (cursor = entry id + index); the entries are written by HISTORY_SCRIPT in
        `_process`, in the same transaction as the entry's done-marker."""
        bucket = int(time.time() // 30)
        rows = np.unique(m.rows).tolist()
        records = {}
        ids, lon, lat, ts, kw, txt, pr = (cols[k] for k in
                                          ("id", "lon", "lat", "ts", "kw", "txt", "pr"))
        rid = cols["rid"]
        for i in rows:
            rec: dict[str, Any] = {"id": ids[i], "lon": lon[i], "lat": lat[i], "ts": ts[i],
                                   "keywords": kw[i]}
            if txt[i] is not None:
                rec["text"] = txt[i]
            if pr[i] is not None:
                rec["props"] = pr[i]
            records[rid[i]] = orjson.dumps(rec)
        rkey = R.records_key(tenant, bucket)
        pipe.hset(rkey, mapping=records)
        pipe.expire(rkey, int(self.settings.history_max_age_s) + 90)
        keys, starts = np.unique(m.keys, return_index=True)
        ends = np.append(starts[1:], m.keys.size)
        rid_arr = np.asarray(rid, dtype=object)[m.rows]
        t = self.tenants[tenant]
        sub_ids = t.ids[keys].tolist()
        refs = [R.pack([rid_arr[a:b].tolist(), m.detect[a:b].tobytes()])
                for a, b in zip(starts.tolist(), ends.tolist(), strict=True)]
        self.pending_history.append((tenant, bucket, sub_ids, refs, records))
        self.matched += int(m.rows.size)
        self.touched.update(sub_ids)


def run_worker(settings: Settings, worker_id: str, redis_url: str) -> None:
    Executor(settings, worker_id, redis_url).run()
