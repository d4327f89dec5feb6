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

DETECT_CODES = {"inside": 0, "enter": 1, "exit": 2}
I64 = np.ndarray[Any, np.dtype[np.int64]]


@dataclass
class SubInfo:
    id: str
    spec: dict[str, Any]
    detect: frozenset[str]
    expires_at: float | None


@dataclass
class TenantIndex:
    """A tenant's subscriptions on this worker: objects only ever meet their own tenant's."""

    index: SubscriptionIndex
    subs: dict[int, SubInfo] = field(default_factory=dict)
    key_of: dict[str, int] = field(default_factory=dict)


@dataclass
class Matches:
    """The matches decided for one batch: parallel lists."""

    sub_ids: list[str] = field(default_factory=list)
    rows: list[int] = field(default_factory=list)
    detect: list[int] = field(default_factory=list)


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
        client = redis.Redis(connection_pool=self.redis.connection_pool)
        while not self.stopping:
            try:
                self._heartbeat()
            except redis.RedisError:
                pass
            time.sleep(self.settings.worker_heartbeat_s)
        del client

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
        pipe.execute()
        if notify:
            pipe = self.redis.pipeline(transaction=False)
            for tenant, subs in notify.items():
                pipe.publish(R.NOTIFY_CHANNEL, orjson.dumps({"tn": tenant, "s": sorted(subs)}))
            pipe.execute()
        self.redis.xack(self.stream, R.GROUP, *ids)

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
            t.key_of[m["id"]] = key
            t.subs[key] = SubInfo(m["id"], spec, frozenset(spec.get("detect") or ("inside",)),
                                  m.get("expires_at"))

    def handle_subs_removed(self, ids: list[str]) -> None:
        for state in self.knn.values():
            for sid in ids:
                if state.subs.pop(sid, None) is not None:
                    self.redis.delete(f"gs:knn:{sid}")
        for t in self.tenants.values():
            for sid in ids:
                key = t.key_of.pop(sid, None)
                if key is not None:
                    t.index.remove(key)
                    del t.subs[key]

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
        if not matches.rows:
            return
        self.write_matches(tenant, cols, matches, pipe, notify)

    def decide(self, t: TenantIndex, cols: dict[str, list[Any]], at: list[float]) -> Matches:
        """inside / enter / exit for every (record, subscription) of the batch, vectorised."""
        lon = np.asarray(cols["lon"], dtype=np.float64)
        lat = np.asarray(cols["lat"], dtype=np.float64)
        kws = cols["kw"]
        o_new, k_new = t.index.match(lon, lat, kws)
        # Records with a usable previous position (moving, in order): match the previous
        # position too, with the new record's keywords, to see transitions.
        prev_rows = [i for i, (p, late) in enumerate(zip(cols["prev"], cols["late"], strict=True))
                     if p is not None and not late]
        if prev_rows:
            pr = np.asarray(prev_rows, dtype=np.int64)
            plon = np.asarray([cols["prev"][i][0] for i in prev_rows], dtype=np.float64)
            plat = np.asarray([cols["prev"][i][1] for i in prev_rows], dtype=np.float64)
            o_p, k_p = t.index.match(plon, plat, [kws[i] for i in prev_rows])
            o_prev = pr[o_p]
            k_prev = k_p
        else:
            o_prev = np.empty(0, dtype=np.int64)
            k_prev = np.empty(0, dtype=np.int64)
        code_new = (o_new.astype(np.int64) << 32) | k_new.astype(np.int64)
        code_prev = (o_prev.astype(np.int64) << 32) | k_prev.astype(np.int64)
        new_was_inside = np.isin(code_new, code_prev)
        prev_still_inside = np.isin(code_prev, code_new)

        out = Matches()
        subs = t.subs
        xo, mv, late = cols["xo"], cols["mv"], cols["late"]
        for o, k, was in zip(o_new.tolist(), k_new.tolist(), new_was_inside.tolist(),
                             strict=True):
            if xo[o]:
                continue
            info = subs.get(k)
            if info is None or (info.expires_at is not None and at[o] >= info.expires_at):
                continue
            if "inside" in info.detect:
                out.sub_ids.append(info.id)
                out.rows.append(o)
                out.detect.append(0)
            if mv[o] and not late[o] and not was and "enter" in info.detect:
                out.sub_ids.append(info.id)
                out.rows.append(o)
                out.detect.append(1)
        dx = cols["dx"]
        for o, k, still in zip(o_prev.tolist(), k_prev.tolist(), prev_still_inside.tolist(),
                               strict=True):
            if still or not dx[o]:
                continue
            info = subs.get(k)
            if info is None or "exit" not in info.detect:
                continue
            if info.expires_at is not None and at[o] >= info.expires_at:
                continue
            out.sub_ids.append(info.id)
            out.rows.append(o)
            out.detect.append(2)
        return out

    def write_matches(self, tenant: str, cols: dict[str, list[Any]], m: Matches, pipe: Any,
                      notify: dict[str, set[str]]) -> None:
        """Store each matched record once and append references to the subscriptions'
        histories: one history entry per subscription per batch (cursor = entry id + index)."""
        bucket = int(time.time() // 30)
        rkey = R.records_key(tenant, bucket)
        rows = sorted(set(m.rows))
        records = {}
        for i in rows:
            rec: dict[str, Any] = {"id": cols["id"][i], "lon": cols["lon"][i],
                                   "lat": cols["lat"][i], "ts": cols["ts"][i],
                                   "keywords": cols["kw"][i]}
            if cols["txt"][i] is not None:
                rec["text"] = cols["txt"][i]
            if cols["pr"][i] is not None:
                rec["props"] = cols["pr"][i]
            records[cols["rid"][i]] = orjson.dumps(rec)
        pipe.hset(rkey, mapping=records)
        pipe.expire(rkey, int(self.settings.history_max_age_s) + 90)
        per_sub: dict[str, list[Any]] = {}
        rid = cols["rid"]
        for sid, o, d in zip(m.sub_ids, m.rows, m.detect, strict=True):
            lst = per_sub.get(sid)
            if lst is None:
                lst = per_sub[sid] = []
            lst.append(rid[o])
            lst.append(d)
        ttl = int(self.settings.history_max_age_s) + 60
        for sid, refs in per_sub.items():
            hk = R.history_key(sid)
            pipe.xadd(hk, {b"b": str(bucket).encode(), b"t": tenant.encode(),
                           b"m": R.pack(refs)},
                      maxlen=self.settings.history_max_len, approximate=True)
            pipe.expire(hk, ttl)
        self.matched += len(m.rows)
        self.touched.update(per_sub)
        notify.setdefault(tenant, set()).update(per_sub)


def run_worker(settings: Settings, worker_id: str, redis_url: str) -> None:
    Executor(settings, worker_id, redis_url).run()
