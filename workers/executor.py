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
from collections import deque
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import orjson
import redis

from app.core.config import Settings
from app.core.db import make_engine, make_sessionmaker
from app.geo import balance
from app.geo.geometry import circle_bbox
from app.geo.index import GlobalIndex, Partition, Plan
from app.geo.matcher import SubscriptionIndex, sub_from_spec
from app.geo.stats import PartitionStats
from app.pipeline import control as C
from app.pipeline import records as R
from app.pipeline.router import replicated_worker_of, targets_for_spec
from app.services.subscriptions import all_live
from workers.knn import MERGE_SCRIPT, KnnState, KnnSub, knn_sub

log = logging.getLogger(__name__)

# One call appends a batch's history entries: KEYS are (history stream, last-id marker)
# pairs, ARGV = bucket, tenant, maxlen, ttl, marker ttl, then one packed reference list per
# stream. Each entry records the id of the entry before it (`p`), so a reader can tell a
# trimmed entry from none. Returns, per stream, that previous id and the new id, so hubs can
# push the entry directly to a client whose cursor is exactly at the previous entry.
HISTORY_SCRIPT = """
local out = {}
for i = 1, #KEYS / 2 do
  local stream, marker = KEYS[2 * i - 1], KEYS[2 * i]
  local prev = redis.call('GET', marker) or '0-0'
  local id = redis.call('XADD', stream, 'MAXLEN', '~', ARGV[3], '*', 'b', ARGV[1],
                        't', ARGV[2], 'p', prev, 'm', ARGV[5 + i])
  redis.call('EXPIRE', stream, ARGV[4])
  redis.call('SET', marker, id, 'EX', ARGV[5])
  out[2 * i - 1] = prev
  out[2 * i] = id
end
return out
"""
HISTORY_CHUNK = 4096  # history entries per script call (bounds the time Redis is busy)
TOMBSTONE_S = 6 * 3600.0  # how long a deleted subscription id is remembered (late sub+ copies)
I64 = np.ndarray[Any, np.dtype[np.int64]]
I32 = np.ndarray[Any, np.dtype[np.int32]]
Rect = tuple[int, int, int, int]


class CommandRefused(Exception):
    """A balancing command that is stale (plan changed, deadline passed) or invalid."""


@dataclass
class WindowPiece:
    """Per-cell counts of the objects of one time bucket and round still in the window, for
    SWARM's N: expired objects decrement N (§4.2.2), and a new partition is seeded with its
    cells' objects. Counts, not objects: memory grows with the cells hit, not the rate."""

    bucket: int
    arrived: int  # the worker's fold count when they arrived
    cx: I32
    cy: I32
    n: I32

    pending: list[tuple[I32, I32, I32]] = field(default_factory=list)
    pending_rows: int = 0

    def add(self, cx: I32, cy: I32, n: I32, nx: int) -> None:
        """More counts of the same bucket and round; merged (equal cells summed) lazily, when
        enough are pending or before anyone reads the piece (`compact`)."""
        self.pending.append((cx, cy, n))
        self.pending_rows += cx.size
        if self.pending_rows > 4 * self.cx.size + 65536:
            self.compact(nx)

    def compact(self, nx: int) -> None:
        if not self.pending:
            return
        parts = [(self.cx, self.cy, self.n), *self.pending]
        cid = np.concatenate([y.astype(np.int64) * nx + x for x, y, _ in parts])
        cells, inv = np.unique(cid, return_inverse=True)
        counts = np.bincount(inv, weights=np.concatenate([c for _, _, c in parts]))
        self.cx, self.cy = (cells % nx).astype(np.int32), (cells // nx).astype(np.int32)
        self.n = counts.astype(np.int32)
        self.pending, self.pending_rows = [], 0

    def select(self, mask: np.ndarray[Any, np.dtype[np.bool_]]) -> WindowPiece:
        """The cells where `mask` holds (of a compacted piece)."""
        return WindowPiece(self.bucket, self.arrived, self.cx[mask], self.cy[mask],
                           self.n[mask])


def cell_counts(cx: Any, cy: Any, nx: int) -> tuple[I32, I32, I32]:
    cells, counts = np.unique(np.asarray(cy, dtype=np.int64) * nx + cx, return_counts=True)
    return ((cells % nx).astype(np.int32), (cells // nx).astype(np.int32),
            counts.astype(np.int32))


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
        # SWARM load balancing (§4.2-§5).
        self.cmd_stream = C.command_stream(worker_id)
        self.replicated = settings.partitioning == "replicated"
        self._cas = self.redis.register_script(C.PLAN_CAS_SCRIPT)
        self.stats: dict[str, PartitionStats] = {}
        self.folds = 0  # rounds folded; arrival rounds are counted in this
        self.window: deque[WindowPiece] = deque()
        self.sub_msgs: dict[str, dict[str, Any]] = {}  # sub id -> its sub+ message
        self.sub_rect: dict[str, Rect] = {}  # sub id -> cell rectangle it covers
        self.sub_parts: dict[str, list[tuple[PartitionStats, int]]] = {}
        self.tombstones: dict[str, float] = {}
        self.round_received = 0  # objects and subscriptions this round (replicated mode's R)
        self.forwarded = 0
        self.owned_ids: list[str] = []  # for the heartbeat thread (never mutated in place)
        self.sql_live: set[str] = set()  # subscription ids alive in SQL at the last rebuild
        self.replaying = False

    # --- lifecycle -----------------------------------------------------------------------
    def run(self) -> None:
        signal.signal(signal.SIGTERM, self._on_signal)
        signal.signal(signal.SIGINT, self._on_signal)
        self._ensure_group()
        self._load_plan()
        self._sync_stats()
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
        for stream in (self.stream, self.cmd_stream):
            try:
                self.redis.xgroup_create(stream, R.GROUP, id="0", mkstream=True)
            except redis.ResponseError as exc:
                if "BUSYGROUP" not in str(exc):
                    raise

    def _load_plan(self) -> None:
        while not self.stopping:
            raw = self.redis.get(R.PLAN_KEY)
            if raw is not None:
                plan = Plan.from_json(raw)
                if self.index is None or plan.version > self.index.plan.version:
                    self.index = GlobalIndex(plan)
                return
            time.sleep(0.2)

    @property
    def version(self) -> int:
        assert self.index is not None
        return self.index.plan.version

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
        # Entries replayed after a crash may add subscriptions deleted before it (the
        # tombstones died with the process): during the replay only these count as live.
        self.sql_live = {m["id"] for m in msgs}
        mine = [m for m in msgs
                if self.id in targets_for_spec(self.index, m["spec"], self.replicated)]
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
            if self.replicated:  # objects are spread by a hash of their id (router.py)
                n = len(self.index.workers)
                owner = np.asarray([replicated_worker_of(tenant, i, n) for i in ids])
            else:
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
            self._merge(keys=[f"gs:knn:{sub.id}", R.history_key(sub.id),
                              R.history_last_key(sub.id)],
                        args=[self.id, local, sub.k, self.settings.history_max_len,
                              int(self.settings.history_max_age_s) + 60, tenant,
                              R.HISTORY_LAST_TTL_S],
                        client=pipe)

    def _heartbeat(self) -> None:
        info = {
            "id": self.id, "pid": os.getpid(), "host": socket.gethostname(),
            "heartbeat": time.time(), "started": self.started, "received": self.received,
            "matched": self.matched,
            "subscriptions": sum(len(t.subs) for t in self.tenants.values()),
            "plan_version": self.index.plan.version if self.index else None,
            "partitions": self.owned_ids, "forwarded": self.forwarded, "folds": self.folds,
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
        delivered too often. Commands pending from before a crash are dropped: their sender
        has timed out and decided without this worker."""
        while True:
            reply = self.redis.xreadgroup(R.GROUP, self.id, {self.cmd_stream: "0"}, count=500)
            stale = [e[0] for e in (reply[0][1] if reply else [])]
            if not stale:
                break
            self.redis.xack(self.cmd_stream, R.GROUP, *stale)
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
        # Commands are read in the same call as objects: an idle worker wakes at once, a busy
        # one sees them after the current batch, not behind its whole backlog.
        reply = self.redis.xreadgroup(R.GROUP, self.id, {self.stream: ">", self.cmd_stream: ">"},
                                      count=256, block=1000)
        # Commands first: entries read in the same call that a move made stale are then
        # forwarded (either order is correct; this one never delays a command behind a batch).
        by_stream = {(s.decode() if isinstance(s, bytes) else s): e for s, e in reply or []}
        for eid, fields in by_stream.get(self.cmd_stream, []):
            self._command(eid, fields)
        if by_stream.get(self.stream):
            self._process(by_stream[self.stream], replay=False)
        now = time.time()
        if now - self.last_trim > 5.0:
            self.last_trim = now
            self._trim(now)
            self._expire_window(now)

    def _process(self, entries: list[tuple[bytes, dict[bytes, bytes]]], replay: bool) -> None:
        self.replaying = replay
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
                if not self.replicated and msg.get("v", 0) < self.version:
                    # routed with an older plan: forward what is no longer ours (§5.1)
                    local = self._reroute(msg, pipe)
                    if local is None:
                        continue
                    msg = local
                if group and group[0]["tn"] != msg["tn"]:
                    self._match_group(group, pipe, notify)
                    group = []
                group.append(msg)
                continue
            if group:
                self._match_group(group, pipe, notify)
                group = []
            if kind == "sub+":
                if not self.replicated and msg.get("v", 0) < self.version:
                    self._forward_subs(msg["subs"], pipe)
                self.handle_subs_added(msg["subs"], pipe)
                for m in msg["subs"]:
                    if m["spec"]["type"] == "knn":
                        notify.setdefault(m["tenant"], set()).add(m["id"])
            elif kind == "sub-":
                self.handle_subs_removed(msg["ids"])
            elif kind == "handoff":
                self._receive_handoff(msg, pipe, notify)
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
                keys = []
                for sub in sub_ids[a:a + HISTORY_CHUNK]:
                    keys += (R.history_key(sub), R.history_last_key(sub))
                self._history(keys=keys,
                              args=[bucket, tenant, self.settings.history_max_len, ttl,
                                    R.HISTORY_LAST_TTL_S, *refs[a:a + HISTORY_CHUNK]],
                              client=pipe)
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
            if m["id"] in self.tombstones or m["id"] in self.sub_msgs:
                continue  # deleted already (a late copy), or known
            if self.replaying and m["id"] not in self.sql_live:
                continue  # a pre-crash copy of a subscription deleted since
            spec = m["spec"]
            self.sub_msgs[m["id"]] = m
            rect = self._rect_of(spec)
            self.sub_rect[m["id"]] = rect
            self._count_query(m["id"], rect)
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
        now = time.time()
        for sid in ids:
            self.tombstones[sid] = now
            self.sub_msgs.pop(sid, None)
            rect = self.sub_rect.pop(sid, None)
            for stats, arrived in self.sub_parts.pop(sid, []):
                if rect is not None and self.stats.get(stats.partition.id) is stats:
                    stats.remove_query(*rect, arrived_round=arrived)
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
        self._count_objects(cols)
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

    # --- SWARM statistics (§4.2) -----------------------------------------------------------
    def _rect_of(self, spec: dict[str, Any]) -> Rect:
        """The cells a subscription covers: its range; everything for keyword subscriptions
        (they are evaluated against every object); the centre cell for kNN."""
        assert self.index is not None
        grid = self.index.grid
        if spec["type"] == "range":
            if "bbox" in spec:
                return grid.cell_range(tuple(spec["bbox"]))
            c = spec["circle"]
            return grid.cell_range(circle_bbox(c["lon"], c["lat"], c["radius_m"]))
        if spec["type"] == "knn":
            cx, cy = grid.cells_of([spec["point"][0]], [spec["point"][1]])
            return int(cx[0]), int(cy[0]), int(cx[0]), int(cy[0])
        return 0, 0, grid.nx - 1, grid.ny - 1

    def _count_query(self, sid: str, rect: Rect) -> None:
        """A new subscription: the collectors of every owned partition it overlaps."""
        self.round_received += 1
        for stats in self.stats.values():
            if stats.partition.overlaps(*rect):
                stats.add_query(*rect)
                self.sub_parts.setdefault(sid, []).append((stats, stats.round))

    def _count_objects(self, cols: dict[str, list[Any]]) -> None:
        """New objects (not exit-only copies): two collectors each (§4.2.2), and their cells
        kept with the window for expiry and for seeding new partitions."""
        xo = np.asarray(cols["xo"], dtype=bool)
        keep = np.flatnonzero(~xo)
        self.round_received += int(keep.size)
        if not keep.size or self.replicated or not self.stats:
            return
        assert self.index is not None
        lon = np.asarray(cols["lon"], dtype=np.float64)[keep]
        lat = np.asarray(cols["lat"], dtype=np.float64)[keep]
        grid = self.index.grid
        cx, cy, n = cell_counts(*grid.cells_of(lon, lat), grid.nx)
        bucket = int(time.time() // self.settings.bucket_s)
        last = self.window[-1] if self.window else None
        if last is not None and (last.bucket, last.arrived) == (bucket, self.folds):
            last.add(cx, cy, n, grid.nx)
        else:
            self.window.append(WindowPiece(bucket, self.folds, cx, cy, n))
        self._stats_apply(cx, cy, n, lambda st, x, y, c: st.add_objects(x, y, c))

    def _stats_apply(self, cx: I32, cy: I32, n: I32, fn: Any) -> None:
        """Call fn(stats, cx, cy, n) per owned partition with the cells inside it."""
        assert self.index is not None
        part = self.index.cell_part[cy, cx]
        for pi in np.unique(part).tolist():
            stats = self.stats.get(self.index.partitions[pi].id)
            if stats is not None:
                sel = part == pi
                fn(stats, cx[sel], cy[sel], n[sel])

    def _expire_window(self, now: float) -> None:
        """Objects that left the window decrement N (§4.2.2)."""
        horizon = int((now - self.settings.window_s) // self.settings.bucket_s)
        while self.window and self.window[0].bucket < horizon:
            piece = self.window.popleft()
            if self.index is not None:
                piece.compact(self.index.grid.nx)
            if piece.cx.size and self.index is not None:
                self._stats_apply(piece.cx, piece.cy, piece.n, lambda st, x, y, c, a=piece.arrived:
                                  st.expire_objects(x, y, arrived_round=a, count=c))
        cutoff = now - TOMBSTONE_S
        for sid in [s for s, t in self.tombstones.items() if t < cutoff]:
            del self.tombstones[sid]

    def _compact_window(self) -> None:
        if self.index is not None:
            for piece in self.window:
                piece.compact(self.index.grid.nx)

    def _subs_over(self, p: Partition) -> list[tuple[str, Rect]]:
        """The subscriptions held here whose cells overlap partition p."""
        return [(sid, rect) for sid, rect in self.sub_rect.items() if p.overlaps(*rect)]

    def _owned(self) -> list[Partition]:
        assert self.index is not None
        if self.replicated:
            return []
        return [p for p in self.index.partitions if p.worker == self.id]

    def _sync_stats(self) -> None:
        """Statistics for exactly the partitions this worker owns: dropped for those it gave
        away, created for new ones (split, merged or received) and seeded with the window's
        objects and the live subscriptions that lie in them."""
        owned = {p.id: p for p in self._owned()}
        self._compact_window()
        for pid in [pid for pid in self.stats if pid not in owned]:
            del self.stats[pid]
        for pid, p in owned.items():
            if pid in self.stats:
                continue
            stats = self.stats[pid] = PartitionStats(p, round=self.folds)
            for piece in self.window:
                sel = p.contains_cells(piece.cx, piece.cy)
                if sel.any():
                    stats.seed_objects(piece.cx[sel], piece.cy[sel], arrived_round=piece.arrived,
                                       count=piece.n[sel])
            for sid, rect in self._subs_over(p):
                arrived = stats.seed_query(*rect)
                self.sub_parts.setdefault(sid, []).append((stats, arrived))
        self.owned_ids = sorted(self.stats)

    def _report(self, round_no: int) -> None:
        """End of round: fold (Algorithm 2) and report Num(C(m)), R(m) and per-partition
        N, Q, R for the coordinator and the admin API."""
        parts: list[dict[str, Any]] = []
        num, received = 0.0, 0
        for pid in sorted(self.stats):
            stats = self.stats[pid]
            stats.fold()
            n, q, r = stats.totals()
            c = balance.cost_numerator(n, q, r)
            parts.append({"id": pid, "N": n, "Q": q, "R": r, "num": c})
            num += c
            received += r
        self.folds += 1
        if self.replicated:
            received = self.round_received
        report = orjson.dumps({
            "worker": self.id, "round": round_no, "at": time.time(), "plan_version": self.version,
            "num": num, "R": received, "partitions": parts,
            "received": self.round_received,
        })
        self.round_received = 0
        pipe = self.redis.pipeline(transaction=False)
        pipe.hset(C.report_key(round_no), self.id, report)
        pipe.expire(C.report_key(round_no), 3600)
        pipe.hset(C.STATS_KEY, self.id, report)
        pipe.execute()

    # --- migration (§5.1) ----------------------------------------------------------------
    def _reroute(self, msg: dict[str, Any], pipe: Any) -> dict[str, Any] | None:
        """An entry routed with an older plan: rows whose new position is owned by another
        worker now go there unprocessed, and each exit decision goes to the owner of the
        previous position, so each record is decided exactly once even across a move. Returns
        what stays here (None when nothing does)."""
        self._load_plan()  # forward with the newest plan we can see
        assert self.index is not None
        index = self.index
        me = index.workers.index(self.id) if self.id in index.workers else -1
        n = len(msg["id"])
        new_w = index.worker_of_points(np.asarray(msg["lon"], dtype=np.float64),
                                       np.asarray(msg["lat"], dtype=np.float64))
        xo = np.asarray(msg["xo"], dtype=bool)
        dx = np.asarray(msg["dx"], dtype=bool)
        prev_w = np.full(n, -1, dtype=np.int64)
        need = np.flatnonzero(xo | dx)
        if need.size:
            prev = [msg["prev"][i] for i in need.tolist()]
            prev_w[need] = index.worker_of_points(
                np.asarray([p[0] for p in prev], dtype=np.float64),
                np.asarray([p[1] for p in prev], dtype=np.float64))
        if ((new_w[~xo] == me).all() and (prev_w[xo] == me).all()
                and (prev_w[dx & ~xo] == me).all()):
            return msg
        dest: dict[int, list[tuple[int, bool, bool]]] = {}
        for i in range(n):
            if xo[i]:
                dest.setdefault(int(prev_w[i]), []).append((i, True, True))
            elif dx[i] and prev_w[i] != new_w[i]:
                dest.setdefault(int(new_w[i]), []).append((i, False, False))
                dest.setdefault(int(prev_w[i]), []).append((i, True, True))
            else:
                dest.setdefault(int(new_w[i]), []).append((i, False, bool(dx[i])))
        local = None
        for w, rows in dest.items():
            sub = {k: ([v[i] for i, _, _ in rows] if isinstance(v, list) else v)
                   for k, v in msg.items()}
            sub["xo"] = [x for _, x, _ in rows]
            sub["dx"] = [d for _, _, d in rows]
            sub["v"] = index.version
            if w == me:
                local = sub
            else:
                pipe.xadd(R.worker_stream(index.workers[w]), {b"m": R.pack(sub)})
                self.forwarded += len(rows)
        return local

    def _forward_subs(self, subs: list[dict[str, Any]], pipe: Any) -> None:
        """Subscriptions routed with an older plan: also send them to the workers that own
        their regions now (adding is idempotent; deleted ids are tombstoned)."""
        self._load_plan()
        assert self.index is not None
        fwd: dict[str, list[dict[str, Any]]] = {}
        for m in subs:
            if m["spec"]["type"] != "range" or m["id"] in self.tombstones:
                continue  # keyword and kNN subscriptions are on every worker already
            for w in targets_for_spec(self.index, m["spec"]):
                if w != self.id:
                    fwd.setdefault(w, []).append(m)
        for w, ms in fwd.items():
            pipe.xadd(R.worker_stream(w), {b"m": R.encode_subs_added(ms, self.version)})

    def _receive_handoff(self, msg: dict[str, Any], pipe: Any,
                         notify: dict[str, set[str]]) -> None:
        """mL's side of a move (§5.1): the partitions' subscriptions, window statistics and
        moving objects, read before anything routed to us under the new plan."""
        self._load_plan()
        assert self.index is not None
        if self.version < msg["v"]:
            raise RuntimeError(f"handoff for plan {msg['v']} but the stored plan is older")
        for pid in msg["parts"]:
            # seen early in a plan reload: seed it again, now with what the handoff brings
            self.stats.pop(pid, None)
        for bucket, age, cx, cy, n in msg["win"]:
            self.window.append(WindowPiece(int(bucket), self.folds - int(age),
                                           np.asarray(cx, dtype=np.int32),
                                           np.asarray(cy, dtype=np.int32),
                                           np.asarray(n, dtype=np.int32)))
        self.handle_subs_added(msg["subs"], pipe)
        # Statistics that came with a partition moved whole: they already count its live
        # subscriptions (in Q), so those are only registered here for a later deletion.
        parts = {p.id: p for p in self._owned()}
        for pid, exported in (msg.get("stats") or {}).items():
            if pid not in parts:
                continue  # moved on again meanwhile
            stats = self.stats[pid] = PartitionStats.restore(parts[pid], self.folds, exported)
            for sid, _rect in self._subs_over(stats.partition):
                self.sub_parts.setdefault(sid, []).append((stats, stats.round - 1))
        self._sync_stats()
        for tenant, objs in msg["mv"].items():
            state = self._knn_state(tenant)
            touched = []
            for oid, lon, lat, kws, ts in objs:
                state.objects.upsert_moving(oid, lon, lat, frozenset(kws), ts)
                touched.append((lon, lat, frozenset(kws)))
            changed = state.refresh(False, touched)
            if changed:
                self._merge_knn(tenant, changed, pipe)
                notify.setdefault(tenant, set()).update(s.id for s in changed)
        log.info("worker %s received %s from %s (plan %d): %d subscriptions",
                 self.id, msg["parts"], msg["from"], msg["v"], len(msg["subs"]))

    def _transfer(self, new_plan: Plan) -> dict[str, Any]:
        """Apply a plan that changes only this worker's partitions: hand the partitions given
        to other workers off through their streams and publish the plan, atomically and only
        if the stored plan is still the one this change was computed from (fencing)."""
        assert self.index is not None
        old = self.index.plan
        old_ids = {p.id for p in old.partitions}
        given = [p for p in new_plan.partitions if p.id not in old_ids and p.worker != self.id]
        by_worker: dict[str, list[Partition]] = {}
        for p in given:
            by_worker.setdefault(p.worker, []).append(p)
        handoffs: list[tuple[str, bytes]] = []
        leaving: list[tuple[str, list[str]]] = []
        old_rects = {(q.x0, q.y0, q.x1, q.y1): q.id for q in old.partitions
                     if q.worker == self.id and q.id in self.stats}
        self._compact_window()
        win_masks: list[np.ndarray[Any, np.dtype[np.bool_]]] = [
            np.zeros(piece.cx.size, dtype=bool) for piece in self.window]
        grid = new_plan.grid
        for w, parts in by_worker.items():
            def inside_cells(cx: Any, cy: Any, parts: list[Partition] = parts) -> Any:
                m = np.zeros(np.shape(cx), dtype=bool)
                for p in parts:
                    m |= p.contains_cells(cx, cy)
                return m

            def inside(lon: Any, lat: Any, f: Any = inside_cells) -> Any:
                return f(*grid.cells_of(lon, lat))

            subs = [self.sub_msgs[sid] for sid, rect in self.sub_rect.items()
                    if self.sub_msgs[sid]["spec"]["type"] == "range"
                    and any(p.overlaps(*rect) for p in parts)]
            win = []
            for k, piece in enumerate(self.window):
                sel = inside_cells(piece.cx, piece.cy)
                if sel.any():
                    win.append([piece.bucket, self.folds - piece.arrived,
                                piece.cx[sel].tolist(), piece.cy[sel].tolist(),
                                piece.n[sel].tolist()])
                    win_masks[k] |= sel
            mv: dict[str, list[Any]] = {}
            for tenant, state in self.knn.items():
                objs = state.objects.moving_in(inside)
                if objs:
                    mv[tenant] = objs
                    leaving.append((tenant, [o[0] for o in objs]))
            # A partition moved whole takes its statistics along (R of the last round
            # included); the halves of a split are seeded from the window instead.
            shipped = {p.id: self.stats[old_rects[(p.x0, p.y0, p.x1, p.y1)]].export()
                       for p in parts if (p.x0, p.y0, p.x1, p.y1) in old_rects}
            handoffs.append((R.worker_stream(w), R.pack({
                "t": "handoff", "v": new_plan.version, "from": self.id,
                "parts": [p.id for p in parts], "subs": subs, "win": win, "mv": mv,
                "stats": shipped})))
        plan_json = new_plan.to_json()
        keys, args = C.plan_cas_args(old.version, plan_json, new_plan.version, time.time(),
                                     R.PLAN_CHANNEL, handoffs)
        if not self._cas(keys=keys, args=args):
            raise CommandRefused(f"the plan is no longer version {old.version}")
        self.index = GlobalIndex(new_plan)
        if given:
            pieces = list(self.window)
            self.window.clear()
            for piece, gone in zip(pieces, win_masks, strict=True):
                self.window.append(piece.select(~gone) if gone.any() else piece)
        self._sync_stats()
        if leaving:
            pipe = self.redis.pipeline(transaction=True)
            notify: dict[str, set[str]] = {}
            for tenant, ids in leaving:
                state = self.knn[tenant]
                state.objects.drop_moving(ids)
                changed = state.refresh(True, [])
                if changed:
                    self._merge_knn(tenant, changed, pipe)
                    notify.setdefault(tenant, set()).update(s.id for s in changed)
            pipe.execute()
            self._notify([], [], notify)
        log.info("worker %s published plan %d: gave %s", self.id, new_plan.version,
                 {w: [p.id for p in ps] for w, ps in by_worker.items()})
        return {"version": new_plan.version,
                "given": {w: [p.to_dict() for p in ps] for w, ps in by_worker.items()},
                "partitions": [p.to_dict() for p in new_plan.partitions
                               if p.id not in old_ids]}

    # --- commands from the coordinator (app/pipeline/control.py) ---------------------------
    def _command(self, eid: bytes, fields: dict[bytes, bytes]) -> None:
        try:
            msg = R.unpack(fields[b"m"])
        except Exception as exc:  # noqa: BLE001 - a bad command must not stop the worker
            log.error("worker %s: undecodable command %s: %s", self.id, eid, exc)
            self.redis.xack(self.cmd_stream, R.GROUP, eid)
            return
        kind = msg.get("t")
        try:
            if kind == "round":
                self._report(int(msg["n"]))
                reply: dict[str, Any] | None = None
            else:
                reply = {"ok": True, **self._balance_command(str(kind), msg)}
        except CommandRefused as exc:
            reply = {"ok": False, "action": "none", "error": str(exc)}
        except (KeyError, ValueError, TypeError) as exc:
            log.exception("worker %s: bad command %r", self.id, msg)
            reply = {"ok": False, "action": "none", "error": f"invalid command: {exc}"}
        if reply is not None and msg.get("reply"):
            reply["worker"] = self.id
            pipe = self.redis.pipeline(transaction=False)
            pipe.rpush(C.reply_key(str(msg["reply"])), orjson.dumps(reply))
            pipe.expire(C.reply_key(str(msg["reply"])), 60)
            pipe.execute()
        self.redis.xack(self.cmd_stream, R.GROUP, eid)

    def _balance_command(self, kind: str, msg: dict[str, Any]) -> dict[str, Any]:
        if msg.get("deadline") is not None and time.time() > float(msg["deadline"]):
            raise CommandRefused("deadline passed")
        self._load_plan()
        if int(msg["version"]) != self.version:
            raise CommandRefused(f"plan version {msg['version']} is stale "
                                 f"(current {self.version})")
        if self.replicated:
            raise CommandRefused("partitioning is replicated: nothing to move")
        assert self.index is not None
        plan = self.index.plan
        mine = {p.id: p for p in self._owned()}
        ids = iter([str(i) for i in msg.get("ids", [])])
        if kind == "reduce":
            to = str(msg["to"])
            if to == self.id:
                raise CommandRefused("mL is this worker")
            stats = [self.stats[pid] for pid in sorted(mine)]
            red = balance.reduce_workload(stats, float(msg["c_ml"]), float(msg["r_s"]))
            if red is None:
                return {"action": "none", "details": {"reason": "no feasible reduction"}}
            action = "move" if isinstance(red, balance.MoveSubset) else "split"
            details = self._transfer(balance.apply_reduction(plan, red, to, ids))
            if isinstance(red, balance.SplitMove):
                details["split"] = {"partition": red.partition_id, **red.split._asdict()}
            else:
                details["moved"] = list(red.partition_ids)
            return {"action": action, "version": details["version"], "details": details}
        if kind == "move":
            pids = [str(p) for p in msg["partitions"]]
            missing = [p for p in pids if p not in mine]
            if missing:
                raise CommandRefused(f"partitions {missing} are not owned by {self.id}")
            details = self._transfer(balance.apply_move(plan, pids, str(msg["to"]), ids))
            details["moved"] = pids
            return {"action": "move", "version": details["version"], "details": details}
        if kind == "split":
            pid = str(msg["partition"])
            if pid not in mine:
                raise CommandRefused(f"partition {pid} is not owned by {self.id}")
            axis, at = msg["axis"], int(msg["at"])
            moved = msg.get("moved")
            if moved is None:
                low, high = balance.split_partition(mine[pid], axis, at, (next(ids), next(ids)))
                parts = []
                for p in plan.partitions:
                    parts.extend([low, high] if p.id == pid else [p])
                new_plan = Plan(version=plan.version + 1, grid=plan.grid, partitions=parts,
                                members=plan.members)
                new_plan.validate()
            else:
                split = balance.Split(axis, at, moved, 0.0)
                new_plan = balance.apply_split(plan, pid, split, str(msg["to"]), ids)
            details = self._transfer(new_plan)
            details["split"] = {"partition": pid, "axis": axis, "at": at, "moved": moved}
            return {"action": "split", "version": details["version"], "details": details}
        if kind == "merge":
            new_plan = balance.apply_merges(plan, ids, worker=self.id)
            if new_plan is plan:
                return {"action": "none", "details": {"reason": "nothing to merge"}}
            details = self._transfer(new_plan)
            return {"action": "merge", "version": details["version"], "details": details}
        raise CommandRefused(f"unknown command {kind!r}")


def run_worker(settings: Settings, worker_id: str, redis_url: str) -> None:
    Executor(settings, worker_id, redis_url).run()
