"""One SWARM executor process (SWARM §4.1.2, Tornado §3.2): the loop that reads its own Redis
stream through a consumer group, hands each batch to the decision function (`decide`), the
statistics to the ledger (`ledger`) and plan changes to `migration`, and writes the matches
to the per-subscription history streams, acknowledging an entry only after its matches are
written (at-least-once transport, exactly-once effect).
"""

from __future__ import annotations

import logging
import math
import os
import signal
import socket
import threading
import time
from typing import Any

import numpy as np
import orjson
import redis

from app.core.collector import WORKER_YOUNG, Collector
from app.core.config import Settings
from app.core.db import make_engine, make_sessionmaker
from app.core.redis import db_of, is_cluster, run_script, worker_client
from app.geo import balance
from app.geo.arrays import distinct
from app.geo.geometry import circle_bbox
from app.geo.index import GlobalIndex, Partition
from app.pipeline import cluster, names, records, wire
from app.pipeline.control import (
    PLAN_ACTIVATE_SCRIPT,
    PLAN_CAS_SCRIPT,
    PLAN_STAGE_SCRIPT,
    plan_cas_args,
    plan_stage_args,
)
from app.pipeline.histories import (
    APPEND_HISTORY_LUA,
    history_chunks,
    history_housekeeping_ms,
)
from app.pipeline.hops import HopTimes
from app.pipeline.knnreg import DROP_WORKER_SCRIPT, MERGE_SCRIPT
from app.pipeline.outbox import Relayer
from app.pipeline.records import public_record
from app.pipeline.router import (
    grid_of,
    replicated_worker_of,
    subscription_message,
    targets_for_spec,
)
from app.services.subscriptions import all_live
from workers.archiving import Archiver
from workers.decide import Matches, decide
from workers.failover import (
    FENCE_TAKE_SCRIPT,
    Adoption,
    Fenced,
    check_fence,
    fence_lost,
    load_window,
    log_start,
    watch_fence,
)
from workers.knn import KnnState, KnnSub
from workers.knn_reg import KnnRegistry
from workers.ledger import SwarmLedger, rect_of
from workers.migration import CommandRefused, Migration
from workers.outbox import OutboxPipe, relay_outbox
from workers.records import RecordWindow, TenantRecords, records_of
from workers.replies import Inboxes
from workers.snapshot import evaluate
from workers.subs import LocalSubs
from workers.window import keyword_set

log = logging.getLogger(__name__)

# One call appends a batch's history entries for one tenant: KEYS = the m hashes of last ids
# of the streams' history groups (`names.history_last_key`), then the n history streams;
# ARGV = bucket, tenant, maxlen, ttl, max age (ms), housekeeping period (ms), m, then for each
# stream the position of its hash among the m, then one packed reference list per stream
# (`history_call` builds them). Each entry records the id of the entry before it (`p`, from
# the hashes: one HMGET and one HSET per hash and call, not a read and a write per stream), so
# a reader can tell a trimmed entry from none; `append_history` (app.pipeline.histories) trims
# and renews the streams. Returns, per stream, that previous id and the new id, so hubs can
# push the entry directly to a client whose cursor is exactly at the previous entry.
HISTORY_SCRIPT = APPEND_HISTORY_LUA + """
local m = tonumber(ARGV[7])
local n = #KEYS - m
local bucket, tenant, maxlen, ttl = ARGV[1], ARGV[2], ARGV[3], ARGV[4]
local max_age, period = ARGV[5], ARGV[6]
local of = {}  -- the streams of each hash
for j = 1, m do of[j] = {} end
for i = 1, n do
  local t = of[tonumber(ARGV[7 + i])]
  t[#t + 1] = i
end
local lasts = {}
for j = 1, m do
  local fields = {}
  for k, i in ipairs(of[j]) do fields[k] = KEYS[m + i] end
  if #fields > 0 then
    local got = redis.call('HMGET', KEYS[j], unpack(fields))
    for k, i in ipairs(of[j]) do lasts[i] = got[k] end
  end
end
local out = {}
local set = {}
for j = 1, m do set[j] = {} end
for i = 1, n do
  local stream = KEYS[m + i]
  local prev = lasts[i]
  if not prev then  -- a new subscription (or one written before the hash existed)
    local tail = redis.call('XREVRANGE', stream, '+', '-', 'COUNT', 1)
    prev = (tail[1] and tail[1][1]) or '0-0'
  end
  local id = append_history(stream, prev, maxlen, max_age, ttl, period, 'b', bucket,
                            't', tenant, 'p', prev, 'm', ARGV[7 + n + i])
  local j = tonumber(ARGV[7 + i])
  local s = set[j]
  s[#s + 1] = stream
  s[#s + 1] = id
  if #s >= 2000 then
    redis.call('HSET', KEYS[j], unpack(s))
    set[j] = {}
  end
  out[2 * i - 1] = prev
  out[2 * i] = id
end
for j = 1, m do
  if #set[j] > 0 then redis.call('HSET', KEYS[j], unpack(set[j])) end
end
return out
"""


def history_call(sub_ids: list[str], refs: list[bytes]) -> tuple[list[str], list[Any]]:
    """HISTORY_SCRIPT's keys, and its arguments from m on, for these subscriptions' entries."""
    hashes: dict[str, int] = {}
    at, streams = [], []
    for sid in sub_ids:
        stream, last = names.history_keys(sid)
        streams.append(stream)
        at.append(hashes.setdefault(last, len(hashes) + 1))
    return [*hashes, *streams], [len(hashes), *at, *refs]


def by_history_group(sub_ids: list[str], refs: list[bytes]) -> tuple[list[str], list[bytes]]:
    order = sorted(range(len(sub_ids)), key=lambda i: names.history_tag(sub_ids[i]))
    return [sub_ids[i] for i in order], [refs[i] for i in order]


# How often the per-cell counts are written when they changed. Each write is a whole bucket's
# counts (tens of kB under load): every 50 ms they were half of what Redis appended to its AOF
# in the kNN benchmark. A count query does not wait for them: the worker writes its counts
# before it answers the query's part (`_answer_straight`).
COUNTS_REPORT_S = 0.5
READ_COUNT = 256  # entries read from each stream at once, at most
# A step reads as many entries of our stream as the last steps processed in this long: a
# worker with a backlog still reads its commands (and the coordinator's round and reduce
# requests, whose deadline is a second or more) between steps of a fraction of a second.
STEP_TARGET_S = 0.25
MIN_READ_COUNT = 1
ADOPTED_BLOCK_MS = 20  # on a Redis Cluster with adopted streams: how long a read of ours blocks
MAINTENANCE_S = 5.0  # trimming, expiry and the replay of entries left pending
KEYWORDS_STEP_S = 0.005  # at most this long a step lists the keywords of new records
SUMMARY_S = 0.2  # how often the keyword summaries of changed subscriptions are written
TOMBSTONE_S = 6 * 3600.0  # how long a deleted subscription id is remembered (late sub+ copies)


class Executor:
    def __init__(self, settings: Settings, worker_id: str, redis_url: str) -> None:
        self.settings = settings
        self.id = worker_id
        # redis-py's reply types are unions of every RESP shape; treat replies as Any here.
        # No automatic retries: a MULTI/EXEC whose reply was lost may have committed, and
        # sending it again would write its matches twice. A failed call ends the step instead,
        # and the entry, still pending, is replayed against its done-marker (`_recover_pending`).
        self.redis: Any = worker_client(redis_url)
        db = db_of(self.redis)  # our database's channels (`names.channel`)
        self.plan_channel = names.channel(names.PLAN_CHANNEL, db)
        self.notify_channel = names.channel(names.NOTIFY_CHANNEL, db)
        self.stream = names.worker_stream(worker_id)
        self.index: GlobalIndex | None = None
        self.stopping = 0
        self.received = 0
        self.matched = 0
        self.unmatched = 0  # rows not matched: the router's mark by our keyword summary held
        self.summaries_at = 0.0
        self.hops = HopTimes()  # this worker's hops of the live path (app.pipeline.hops)
        # the time its step spent on partitions changing hands, nothing else processed then:
        # giving them (`give`), taking a handoff (`take`) or a dead worker's (`takeover`)
        self.moves = HopTimes()
        self.last_trim = 0.0
        self.must_recover = False  # a step failed: entries of ours may be pending
        self.started = time.time()
        self.knn: dict[str, KnnState] = {}
        self._history = self.redis.register_script(HISTORY_SCRIPT)
        # the scripts a commit may queue (see `commit_pipe`)
        self.cluster = is_cluster(redis_url)
        self.relayer = Relayer(self.redis, (HISTORY_SCRIPT, MERGE_SCRIPT, DROP_WORKER_SCRIPT,
                                            PLAN_ACTIVATE_SCRIPT, FENCE_TAKE_SCRIPT),
                               unordered=(HISTORY_SCRIPT, MERGE_SCRIPT)
                               ) if settings.redis_outbox or self.cluster else None
        self.pending_history: list[tuple[str, int, list[str], list[bytes], dict[str, bytes]]] = []
        # Snapshot queries: the window's records, those of the entries being processed (kept
        # once their transaction commits) and the queries among them, each with the number of
        # those records it comes after.
        self.window_stream = names.window_stream(worker_id)
        self.records = RecordWindow(settings.window_s, settings.bucket_s)
        # records with the bucket each is kept in (`RecordWindow.bucket_of`)
        self.pending_records: list[tuple[wire.ObjectBatch, int]] = []
        self.archiver = Archiver(self.redis, settings, grid_of(settings), worker_id)
        self.pending_queries: list[tuple[wire.QueryPart, int]] = []
        # Query parts sent straight to us (`app.pipeline.queries`), waiting until a read of
        # our stream reaches its end: (entry id, part).
        self.query_stream = names.query_stream(worker_id)
        self.inboxes = Inboxes(worker_id)  # the api processes' query reply sockets
        self.straight: list[tuple[bytes, wire.QueryPart]] = []
        # Per-cell counts of the window, reported for count queries (`_report_counts`): the
        # last entry of our stream whose records they include.
        self.processed_id: bytes | None = None
        self.read_count = READ_COUNT  # entries a step reads from a stream (`paced_count`)
        self.last_report = (0.0, 0.0)  # the last round's report: its time, the backlog then
        self.reported: tuple[bytes | None, float] = (None, 0.0)
        self.counts_seq = 0  # reports written by this process (their versions)
        # SWARM load balancing (§4.2-§5).
        self.cmd_stream = names.command_stream(worker_id)
        self.replicated = settings.partitioning == "replicated"
        self._plan_cas = self.redis.register_script(PLAN_CAS_SCRIPT)
        self._plan_stage = self.redis.register_script(PLAN_STAGE_SCRIPT)
        self.ledger = SwarmLedger(grid_of(settings))
        self.subs = LocalSubs(grid_of(settings), self.replicated)
        self.migration = Migration(self)
        self.knnreg = KnnRegistry(self)
        self.sub_msgs: dict[str, wire.SubscriptionCopy] = {}  # what the handoffs carry
        self.awaiting: set[str] = set()  # our partitions whose handoff is still in our stream
        self.tombstones: dict[str, float] = {}
        self.round_received = 0  # objects and subscriptions this round (replicated mode's R)
        self.forwarded = 0
        self.owned_ids: list[str] = []  # for the heartbeat thread (never mutated in place)
        self.sql_live: set[str] = set()  # subscription ids alive in SQL at the last rebuild
        self.replaying = False
        # Failover (workers.failover): the epoch of our stream's fence, and the streams of
        # dead workers this worker processes in their place.
        self.epoch = 0
        self.adoptions: dict[str, Adoption] = {}
        self.to_adopt: list[str] = []
        self.collector = Collector(young=WORKER_YOUNG)

    # --- lifecycle -----------------------------------------------------------------------
    def run(self) -> None:
        signal.signal(signal.SIGTERM, self._on_signal)
        signal.signal(signal.SIGINT, self._on_signal)
        self._ensure_group()
        # Our stream is ours again: an adoption of it (we were failed over) ends here.
        self.epoch = int(self.redis.incr(names.fence_key(self.id)))
        if self.relayer is not None:
            # Counted after the fence and before the plan is read: a failover of ours decided
            # before this is refused, one staged before it is active once relayed below
            # (`workers.failover`).
            self.redis.hincrby(names.WORKER_STARTS, self.id, 1)
        self.relay_outbox(self.id)  # before anything reads what a commit of ours wrote
        self.relay_control()  # a plan change staged by a process that died before its relay
        self.relay_history_outboxes()
        self.redis.delete(names.adopter_key(self.id), names.keyword_summaries_key(self.id))
        self.load_plan()
        self.sync_stats()
        # Beat before the rebuilds: a restart must not look like a death (failover).
        self._heartbeat()
        beat = threading.Thread(target=self._heartbeat_loop, daemon=True)
        beat.start()
        self.rebuild_positions()
        self.rebuild_subscriptions()
        self._rebuild_window()
        self._recover_pending(after_crash=True)
        self._processed_at_start()
        self.to_adopt = [m.decode() for m in self.redis.smembers(names.adopted_key(self.id))]
        log.info("worker %s ready (pid %d, fence epoch %d)", self.id, os.getpid(), self.epoch)
        while not self.stopping:
            try:
                if self.must_recover:
                    # A transaction whose reply was lost may have committed: the window log
                    # says which records are ours.
                    self.relay_outbox(self.id)
                    self.relay_control()
                    self._rebuild_window()
                    self._recover_pending()
                    self._processed_at_start()
                    # adoptions start again: their pending entries are replayed the same way
                    self.to_adopt.extend(self.adoptions)
                    self.adoptions.clear()
                    self.must_recover = False
                self._adopt()
                self._step()
            except Fenced as exc:
                # Declared dead and failed over while we were stopped: our partitions and
                # stream belong to others now. Exit; a restart takes the stream back cleanly.
                log.error("worker %s: %s; exiting (a restart rejoins the cluster)", self.id, exc)
                raise SystemExit(3) from exc
            except (redis.ConnectionError, redis.TimeoutError) as exc:
                log.warning("worker %s: redis unavailable (%s); retrying", self.id, exc)
                self.must_recover = True
                time.sleep(0.5)
            except redis.ResponseError as exc:
                if "NOGROUP" not in str(exc):
                    raise
                # The stream or its group vanished (FLUSHALL, a restored backup): recreate it.
                log.warning("worker %s: consumer group missing; recreating it", self.id)
                self._ensure_group()
        self.inboxes.close()
        log.info("worker %s stopped", self.id)

    def _on_signal(self, signum: int, _frame: Any) -> None:
        self.stopping += 1
        if self.stopping > 1:  # second signal: cold stop
            os._exit(1)

    def _ensure_group(self) -> None:
        for stream in (self.stream, self.cmd_stream, self.query_stream):
            try:
                self.redis.xgroup_create(stream, names.GROUP, id="0", mkstream=True)
            except redis.ResponseError as exc:
                if "BUSYGROUP" not in str(exc):
                    raise

    def load_plan(self) -> None:
        while not self.stopping:
            plan = cluster.read_plan(self.redis)
            if plan is not None:
                if self.index is None or plan.version > self.index.plan.version:
                    self.set_index(GlobalIndex(plan))
                return
            time.sleep(0.2)

    def set_index(self, index: GlobalIndex) -> None:
        """A newer plan: the subscriptions are indexed for the partitions it gives us (the
        statistics follow in `sync_stats`, where the protocol says). Partitions it moves to
        us from another worker are awaited until their handoff (or takeover) is processed:
        until then, what they hold is not here, and they must not be handed on."""
        if self.index is not None:
            known = {p.id for p in self.index.plan.partitions}
            self.awaiting |= {p.id for p in index.plan.partitions
                              if p.worker == self.id and p.id not in known
                              and p.prev_owner not in (None, self.id)}
        self.awaiting &= {p.id for p in index.plan.partitions if p.worker == self.id}
        self.index = index
        self.subs.sync(index, self.owned())

    @property
    def version(self) -> int:
        assert self.index is not None
        return self.index.plan.version

    def sql_subscriptions(self) -> list[wire.SubscriptionCopy]:
        """Every live subscription, as SQL has it."""
        engine = make_engine(self.settings)
        try:
            with make_sessionmaker(engine)() as session:
                return [subscription_message(r) for r in all_live(session, time.time())]
        finally:
            engine.dispose()

    def rebuild_subscriptions(self, parts: list[Partition] | None = None, pipe: Any = None,
                              msgs: list[wire.SubscriptionCopy] | None = None) -> None:
        """Rebuild this worker's subscriptions from SQL (stream replay covers later changes);
        with `parts`, only those over these partitions (a takeover)."""
        if msgs is None:
            msgs = self.sql_subscriptions()
        assert self.index is not None
        knn = [m for m in msgs if m.spec["type"] == "knn"]
        if parts is not None:
            mine = [m for m in msgs if m.spec["type"] == "range" and any(
                p.overlaps(*rect_of(self.index.grid, m.spec)) for p in parts)]
            self.add_subscriptions(mine, pipe)
            self._rebuild_knn(knn, parts, False, pipe)
            return
        # Entries replayed after a crash may add subscriptions deleted before it (the
        # tombstones died with the process): during the replay only these count as live.
        self.sql_live = {m.id for m in msgs}
        mine = [m for m in msgs if m.spec["type"] != "knn"
                and self.id in targets_for_spec(self.index, m.spec, self.replicated)]
        self.add_subscriptions(mine)
        n_knn = self._rebuild_knn(knn, self.owned(), True, None)
        log.info("worker %s rebuilt %d subscriptions from SQL (%d kNN)", self.id,
                 len(mine) + n_knn, n_knn)

    def _rebuild_knn(self, msgs: list[wire.SubscriptionCopy], parts: list[Partition],
                     restart: bool, pipe: Any) -> int:
        """kNN registrations as their hashes store them: after a restart those naming this
        worker or reaching its partitions (every one when unbounded), after a takeover those
        reaching the partitions taken (the unbounded ones are here already)."""
        assert self.index is not None
        grid = self.index.grid
        stored = self.knnreg.stored([m.id for m in msgs])
        mine = []
        for m in msgs:
            held = stored.get(m.id)
            if held is None:
                continue  # deleted meanwhile
            epoch, radius, named = held
            bounded = math.isfinite(radius)
            if not bounded and not restart:
                continue
            if bounded and not (restart and named):
                rect = grid.cell_range(circle_bbox(float(m.spec["point"][0]),
                                                   float(m.spec["point"][1]), radius))
                if not any(p.overlaps(*rect) for p in parts):
                    continue
            mine.append(wire.SubscriptionCopy(
                id=m.id, tenant=m.tenant, spec=m.spec, expires_at=m.expires_at,
                radius_m=radius if bounded else None, epoch=epoch))
        self.add_subscriptions(mine, pipe)
        return len(mine)

    def rebuild_positions(self, parts: list[Partition] | None = None) -> None:
        """Moving objects whose latest position lies in this worker's partitions (or in
        `parts`) into the kNN state (each local list takes them in); events of the window are
        not rebuilt after a crash."""
        assert self.index is not None
        me = self.index.workers.index(self.id) if self.id in self.index.workers else -1
        for key in self.redis.scan_iter(match=names.POSITIONS_PREFIX + "*", count=1000):
            tenant = names.tenant_of_positions_key(key.decode())
            ids, lons, lats, rest = [], [], [], []
            for oid, raw in self.redis.hscan_iter(key, count=1000):
                ts, lon, lat, kws, _props = records.unpack_position(raw)
                ids.append(oid.decode())
                lons.append(lon)
                lats.append(lat)
                rest.append((ts, kws))
            if not ids:
                continue
            if parts is not None:
                cx, cy = self.index.grid.cells_of(np.asarray(lons), np.asarray(lats))
                mine = np.zeros(len(ids), dtype=bool)
                for p in parts:
                    mine |= p.contains_cells(cx, cy)
            elif self.replicated:  # objects are spread by a hash of their id (router.py)
                n = len(self.index.workers)
                mine = np.asarray([replicated_worker_of(tenant, i, n) for i in ids]) == me
            else:
                mine = self.index.worker_of_points(np.asarray(lons), np.asarray(lats)) == me
            state = self.knn_state(tenant)
            for i in np.flatnonzero(mine).tolist():
                words = keyword_set(rest[i][1])
                state.upsert_moving(ids[i], float(lons[i]), float(lats[i]), words,
                                    float(rest[i][0]))
            state.refresh()

    def _rebuild_window(self) -> None:
        """The records of the live window from the window log (see `workers.records`)."""
        assert self.index is not None
        self.records = load_window(self.redis, self.window_stream, self.settings.window_s,
                                   self.settings.bucket_s, f"worker {self.id}",
                                   self.archiver.load(), self.index.grid)
        # counts written before are replaced by the rebuilt window's (see _report_counts)
        self.redis.delete(names.cell_counts_key(self.id))
        self.processed_id = None
        log.info("worker %s rebuilt its window: %d records", self.id, len(self.records))

    def knn_state(self, tenant: str) -> KnnState:
        state = self.knn.get(tenant)
        if state is None:
            assert self.index is not None
            state = self.knn[tenant] = KnnState(self.settings.window_s, self.settings.bucket_s,
                                                self.index.grid)
        return state

    def merge_knn(self, tenant: str, subs: list[KnnSub], pipe: Any,
                  clear: tuple[str, ...] = (), force: bool = False) -> None:
        """Report local lists to the merged ones (`workers.knn_reg`); `force`: whole, even
        those held alone whose change cannot change the merged list."""
        self.knnreg.report(tenant, subs, pipe, clear, force)

    def _heartbeat(self) -> None:
        info = {
            "id": self.id, "pid": os.getpid(), "host": socket.gethostname(),
            "heartbeat": time.time(), "started": self.started, "received": self.received,
            "matched": self.matched, "skipped_by_summary": self.unmatched,
            "subscriptions": len(self.subs) + sum(len(s.subs) for s in self.knn.values()),
            "plan_version": self.index.plan.version if self.index else None,
            "partitions": self.owned_ids, "forwarded": self.forwarded, "folds": self.ledger.folds,
            "knn_registrations": sum(len(s.subs) for s in self.knn.values()),
            "knn_resizes": dict(self.knnreg.resizes),
            "knn_reports": {"sent": self.knnreg.reports, "skipped": self.knnreg.skipped},
            "archive": {"flushed": self.archiver.flushed, "lag_s": self.archiver.lag_s,
                        "cut": self.archiver.cut},
            "hops": self.hops.doc(),
            "moves": self.moves.doc(),
        }
        self.redis.hset(names.WORKERS_KEY, self.id, orjson.dumps(info))

    def _heartbeat_loop(self) -> None:
        while not self.stopping:
            try:
                self._heartbeat()
            except redis.RedisError:
                pass  # the main loop reports Redis outages; the next beat retries
            time.sleep(self.settings.worker_heartbeat_s)

    # --- the stream ----------------------------------------------------------------------
    def _recover_pending(self, after_crash: bool = False) -> None:
        """Reclaim entries left pending (XAUTOCLAIM) and process them, skipping those whose
        matches were already written. Commands left pending are dropped: their sender has
        timed out and decided without this worker.

        After a crash (at start), an entry may be what crashed the worker: the entries are then
        taken one at a time, so that each counts its own deliveries, and only an entry
        delivered more than `max_deliveries` times goes to the dead letters, not the healthy
        entries read in the same batch. Entries left pending by a Redis failure in a running
        worker did nothing wrong: they are replayed in batches and never dead-lettered."""
        while True:
            reply = self.redis.xreadgroup(names.GROUP, self.id, {self.cmd_stream: "0"}, count=500)
            stale = [e[0] for e in (reply[0][1] if reply else [])]
            if not stale:
                break
            self.redis.xack(self.cmd_stream, names.GROUP, *stale)
        # Query parts read before and not answered: answered now if their api still waits.
        reply = self.redis.xreadgroup(names.GROUP, self.id, {self.query_stream: "0"},
                                      count=10_000)
        self.straight = []
        self._take_straight(reply[0][1] if reply else [])
        self.claim_others(self.stream)
        while not self.stopping:
            # Reading pending entries counts a delivery of each entry read.
            reply = self.redis.xreadgroup(names.GROUP, self.id, {self.stream: "0"},
                                          count=1 if after_crash else 200)
            entries = reply[0][1] if reply else []
            if not entries:
                return
            self._process(entries, replay=True, after_crash=after_crash)

    def _step(self) -> None:
        # Commands are read in the same call as objects: an idle worker wakes at once, a busy
        # one sees them after the current batch, not behind its whole backlog.
        streams = {self.stream: ">", self.cmd_stream: ">", self.query_stream: ">"}
        adopted = {a.stream: ">" for a in self.adoptions.values()}
        # A report of the counts that is due does not wait behind an idle stream.
        block = 1000 if not self.straight else 10
        if self.records.has_changes():
            wait = COUNTS_REPORT_S - (time.time() - self.reported[1])
            block = max(1, min(block, int(wait * 1000) + 1))
        count = self.read_count
        if self.cluster and adopted:
            # Our streams share our slot, an adopted one is in its dead worker's: one read
            # each (the adopted ones first, without blocking; ours then briefly).
            reply: list[Any] = []
            for stream in adopted:
                reply += self.redis.xreadgroup(names.GROUP, self.id, {stream: ">"},
                                               count=count) or []
            reply += self.redis.xreadgroup(names.GROUP, self.id, streams, count=count,
                                           block=1 if reply else min(block, ADOPTED_BLOCK_MS)
                                           ) or []
        else:
            reply = self.redis.xreadgroup(names.GROUP, self.id, {**streams, **adopted},
                                          count=count, block=block)
        # Commands first: entries read in the same call that a move made stale are then
        # forwarded (either order is correct; this one never delays a command behind a batch).
        by_stream = {(s.decode() if isinstance(s, bytes) else s): e for s, e in reply or []}
        for eid, fields in by_stream.get(self.cmd_stream, []):
            self._command(eid, fields)
        if by_stream.get(self.stream):
            started = time.perf_counter()
            self._process(by_stream[self.stream], replay=False)
            self.read_count = paced_count(self.read_count, len(by_stream[self.stream]),
                                          time.perf_counter() - started)
        for adoption in list(self.adoptions.values()):
            if by_stream.get(adoption.stream):
                self._adopted(adoption, by_stream[adoption.stream])
        self._take_straight(by_stream.get(self.query_stream, []))
        if len(by_stream.get(self.stream, [])) < count:
            # Our stream was read to its end, and what was read is processed: every entry
            # added before any part read so far was among it (see `_answer_straight`).
            self._answer_straight()
        if not self.straight:
            # the keywords of records added since, listed for keyword queries between steps
            # rather than by the next such query (a Python pass over every record's keywords)
            self.records.index_keywords(time.monotonic() + KEYWORDS_STEP_S)
            # and the chunks of older buckets brought into the queries' indexes
            self.records.index_chunks()
        self.collector.tick()
        now = time.time()
        if self.subs.changed and now - self.summaries_at >= SUMMARY_S:
            self._write_summaries(now)
        if now - self.reported[1] >= COUNTS_REPORT_S or (
                not self.records.has_changes() and self.processed_id != self.reported[0]):
            # counts at most every COUNTS_REPORT_S; a mark alone (entries without records,
            # such as query parts) at once
            self._report_counts(now)
        if now - self.last_trim > MAINTENANCE_S:
            self.last_trim = now
            # Failed over while stalled, and idle since (no transaction to find it out): the
            # stream is another's now, exit as a transaction would.
            check_fence(self.redis, self.id, self.epoch)
            # Nothing of ours is pending between steps; anything that is (a step cut short, a
            # restored Redis) is replayed now rather than when the worker restarts.
            if self._pending_count():
                self._recover_pending()
            self.relay_history_outboxes()
            self._trim(now)
            self._expire_window(now)
            for adoption in list(self.adoptions.values()):
                if adoption.still_ours():
                    adoption.archiver.step(adoption.records, now)
                else:
                    self._end_adoption(adoption, "its worker is back")

    # --- keyword summaries (Tornado §4) ----------------------------------------------------
    def _write_summaries(self, now: float) -> None:
        """The keyword summaries of the tenants whose subscriptions changed, for the routers;
        a tenant with no range or keyword subscription here has none."""
        changed, self.subs.changed = self.subs.changed, set()
        key = names.keyword_summaries_key(self.id)
        pipe = self.redis.pipeline(transaction=False)
        for tenant in sorted(changed):
            summary = self.subs.summary(tenant)
            if summary is None:
                pipe.hdel(key, tenant)
            else:
                pipe.hset(key, tenant, wire.encode_summary(summary))
        try:
            pipe.execute()
        except redis.RedisError:
            self.subs.changed |= changed  # written again once Redis answers
            raise
        self.summaries_at = now

    def _to_match(self, group: list[wire.ObjectBatch], batch: wire.ObjectBatch,
                  at: list[float]) -> tuple[wire.ObjectBatch, list[float]]:
        """The rows of the group to match: all but those the router marked as matching
        none of our subscriptions, when the summary it used still describes them."""
        token = self.subs.token(batch.tenant)
        if token is None or not any(m.no_match and m.no_match_token == token for m in group):
            return batch, at
        keep = np.ones(len(batch), dtype=bool)
        offset = 0
        for m in group:
            if m.no_match and m.no_match_token == token:
                rows = np.asarray(m.no_match, dtype=np.int64)
                keep[offset + rows[(rows >= 0) & (rows < len(m))]] = False
            offset += len(m)
        rows_kept = np.flatnonzero(keep).tolist()
        self.unmatched += len(batch) - len(rows_kept)
        return batch.take(rows_kept), [at[i] for i in rows_kept]

    # --- per-cell counts (CheetahGIS: count queries answered from metadata) ---------------
    def _processed_at_start(self) -> None:
        """After the rebuild and the replay, the window holds the records of every entry
        delivered so far: they count up to the group's last delivered entry."""
        last = self.last_delivered(self.stream)
        if last and not self._pending_count():
            self.processed_id = last if isinstance(last, bytes) else str(last).encode()

    def _report_counts(self, now: float) -> None:
        """Write the per-cell counts of the tenants whose records changed, and the entry up
        to which they count, in one transaction (never while entries wait for a replay: the
        counts would then miss records of entries before the one named)."""
        changed = self.records.changed
        if self.processed_id is None or self.must_recover or (
                not changed and self.processed_id == self.reported[0]):
            self.reported = (self.reported[0], now)
            return
        key = names.cell_counts_key(self.id)
        self.counts_seq += 1
        version = f"{self.epoch}.{self.counts_seq}"
        pipe = self.redis.pipeline(transaction=True)
        for tenant, bucket in sorted(changed):
            held = self.records.tenants.get(tenant)
            cells = held.cell_counts.get(bucket) if held is not None else None
            field = names.cell_counts_field(tenant, bucket)
            if not cells:
                pipe.hdel(key, field, names.cell_counts_version_field(field))
                continue
            pipe.hset(key, mapping={
                field: wire.encode_cell_counts(wire.CellCounts(buckets=[
                    (bucket, *cells.encoded())])),
                names.cell_counts_version_field(field): version})
        for tenant in sorted({t for t, _ in changed}):
            # the buckets listed for the readers (`names.cell_counts_key`)
            held = self.records.tenants.get(tenant)
            # (with a version of its own: a reader that holds it knows nothing of the
            # tenant's changed)
            listed = sorted(b for b, c in held.cell_counts.items() if c) if held else []
            field = names.cell_counts_index_field(tenant)
            if listed:
                pipe.hset(key, mapping={field: " ".join(map(str, listed)),
                                        names.cell_counts_version_field(field): version})
            else:
                pipe.hdel(key, field, names.cell_counts_version_field(field))
        pipe.hset(key, mapping={names.CELL_COUNTS_UPTO: self.processed_id,
                                names.CELL_COUNTS_INDEXED: 1})
        pipe.execute()
        self.records.changed = set()
        self.reported = (self.processed_id, now)

    # --- failover (workers.failover) -----------------------------------------------------
    def _adopt(self) -> None:
        """Start processing the streams of dead workers given to us (a takeover names us
        their adopter; after a restart, the set of our adoptions)."""
        while self.to_adopt:
            dead = self.to_adopt.pop()
            if dead in self.adoptions or dead == self.id:
                continue
            adopter, fence = self.redis.mget([names.adopter_key(dead), names.fence_key(dead)])
            if adopter is None or adopter.decode() != self.id:
                self.redis.srem(names.adopted_key(self.id), dead)
                continue
            adoption = Adoption(self, dead, int(fence or 0))
            self.adoptions[dead] = adoption
            try:
                adoption.start()
            except Fenced as exc:
                self._end_adoption(adoption, str(exc))

    def _adopted(self, adoption: Adoption, entries: list[tuple[bytes, dict[bytes, bytes]]]
                 ) -> None:
        try:
            adoption.process(entries)
        except Fenced as exc:
            self._end_adoption(adoption, str(exc))

    def _end_adoption(self, adoption: Adoption, why: str) -> None:
        """The dead worker is back (or another failover took its stream): what we read of it
        and left unacknowledged stays pending, and its owner claims it at its start."""
        self.adoptions.pop(adoption.dead, None)
        self.redis.srem(names.adopted_key(self.id), adoption.dead)
        log.info("worker %s stopped processing the stream of %s (%s); forwarded %d records",
                 self.id, adoption.dead, why, adoption.forwarded)

    def claim_others(self, stream: str) -> None:
        """Take over entries of `stream` pending under another consumer name (JUSTID:
        claiming counts no delivery; reading them does)."""
        summary = self.redis.xpending(stream, names.GROUP)
        for c in (summary or {}).get("consumers") or []:
            name = c["name"].decode() if isinstance(c["name"], bytes) else c["name"]
            if name == self.id or not int(c["pending"]):
                continue
            rows = self.redis.xpending_range(stream, names.GROUP, min="-", max="+",
                                             count=int(c["pending"]), consumername=name)
            ids = [r["message_id"] for r in rows]
            for a in range(0, len(ids), 500):
                self.redis.xclaim(stream, names.GROUP, self.id, min_idle_time=0,
                                  message_ids=ids[a:a + 500], justid=True)

    def commit_pipe(self, owner: str) -> Any:
        """The transaction of a commit on `owner`'s stream (ours, or an adopted one): one
        MULTI/EXEC, or with `redis_outbox` one through the stream's outbox (`workers.outbox`),
        whose `execute` also relays it."""
        if self.relayer is None:
            return self.redis.pipeline(transaction=True)
        return OutboxPipe(self.redis, names.worker_stream(owner), owner, self.relayer)

    def relay_outbox(self, owner: str) -> None:
        """Finish the relay of what `owner`'s outbox still holds (see `workers.outbox`)."""
        if self.relayer is not None:
            relay_outbox(self.redis, owner, self.relayer)

    def relay_history_outboxes(self) -> None:
        """Relay the messages kNN scripts left in their outboxes (`app.pipeline.knnreg`) when
        the process that called them died before relaying them."""
        if self.relayer is None:
            return
        pipe = self.redis.pipeline(transaction=False)
        for outbox in names.HISTORY_OUTBOXES:
            pipe.xlen(outbox)
        left = [o for o, n in zip(names.HISTORY_OUTBOXES, pipe.execute(), strict=True) if n]
        done = sum(self.relayer.relay_all(o) for o in left)
        if done:
            log.info("worker %s relayed %d kNN messages left in outboxes", self.id, done)

    def relay_control(self) -> None:
        """Finish a staged plan change (`app.pipeline.control`), with outboxes."""
        if self.relayer is not None and self.relayer.relay_all(names.CONTROL_OUTBOX):
            log.info("worker %s relayed a staged plan change", self.id)

    def change_plan(self, expected: int, plan_json: str, version: int,
                    handoffs: list[tuple[str, bytes]], holds: list[tuple[str, str, str]]
                    ) -> bool:
        """Publish plan `version` with its handoffs and kNN holds if the stored plan is still
        `expected` (`app.pipeline.control`): one script, or with outboxes staged and relayed
        at once (a change another worker left staged is relayed first, and this one
        refused: its plan is no longer the stored one)."""
        now = time.time()
        if self.relayer is None:
            keys, args = plan_cas_args(expected, plan_json, version, now,
                                       self.plan_channel, handoffs, holds)
            return bool(self._plan_cas(keys=keys, args=args))
        keys, args = plan_stage_args(expected, plan_json, version, now,
                                     self.plan_channel, handoffs, holds)
        staged = self._plan_stage(keys=keys, args=args)
        self.relayer.relay_all(names.CONTROL_OUTBOX)
        return bool(staged)

    def _pending_count(self) -> int:
        summary = self.redis.xpending(self.stream, names.GROUP)
        return int(summary["pending"]) if summary else 0

    def _process(self, entries: list[tuple[bytes, dict[bytes, bytes]]], replay: bool,
                 after_crash: bool = False) -> None:
        """Match, write and acknowledge entries read from the stream. `replay`: they were read
        before (skip those whose matches are written); `after_crash`: by an earlier process
        (dead-letter those delivered too often; see `_recover_pending`). The transaction
        commits only while our stream's fence is ours (raises Fenced otherwise)."""
        pipe = self.commit_pipe(self.id)
        try:
            watch_fence(pipe, self.id, self.epoch)
            self._process_in(pipe, entries, replay, after_crash)
        except redis.WatchError as exc:
            raise fence_lost(self.redis, self.id, self.epoch, exc) from exc
        finally:
            self.knnreg.forget(pipe)
            pipe.reset()

    def _process_in(self, pipe: Any, entries: list[tuple[bytes, dict[bytes, bytes]]],
                    replay: bool, after_crash: bool) -> None:
        self.replaying = after_crash
        self.pending_history = []  # what a step cut short queued is written by its replay
        self.pending_records, self.pending_queries = [], []
        ids = [e[0] for e in entries]
        if replay:
            # Entries are acknowledged with their effects; a done-marker is left only by a
            # version before that (which acknowledged after the commit), for 24 hours.
            done = self.redis.mget([names.done_key(self.id, i.decode()) for i in ids])
            counts = self._delivery_counts(ids) if after_crash else {}
            keep = []
            for (eid, fields), d in zip(entries, done, strict=True):
                if d is not None:
                    continue  # matches already written; only the XACK was lost
                if counts.get(eid, 0) > self.settings.max_deliveries:
                    self.dead_letter(eid, fields, "delivered too often")
                    continue
                keep.append((eid, fields))
            entries = keep
        msgs: list[wire.WorkerEntry] = []
        for eid, fields in entries:
            try:
                msgs.append(wire.decode_entry(fields[b"m"]))
            except (KeyError, ValueError) as exc:  # a poison entry must not stop the shard
                self.dead_letter(eid, fields, f"undecodable: {exc}")
        read_at = time.time()
        sent_at = read_at  # of the oldest batch: the hubs measure the hops from it
        objects = 0
        for msg in msgs:
            if isinstance(msg, wire.ObjectBatch):
                sent_at = min(sent_at, msg.sent_at)
                objects += len(msg)
                if not replay:
                    self.hops.observe("queued", read_at - msg.sent_at, len(msg))
        notify: dict[str, set[str]] = {}
        # Consecutive object entries of one tenant are matched as one batch; control
        # messages keep their place in the stream order.
        group: list[wire.ObjectBatch] = []
        for msg in msgs:
            if isinstance(msg, wire.ObjectBatch):
                if not self.replicated and msg.plan_version < self.version:
                    # routed with an older plan: forward what is no longer ours (§5.1)
                    local = self.migration.reroute(msg, pipe)
                    if local is None:
                        continue
                    msg = local
                if group and group[0].tenant != msg.tenant:
                    self._match_group(group, pipe, notify)
                    group = []
                group.append(msg)
                continue
            if group:
                self._match_group(group, pipe, notify)
                group = []
            if isinstance(msg, wire.SubsAdded):
                self.handle_subs_added(msg, pipe, notify)
            elif isinstance(msg, wire.SubsRemoved):
                self.handle_subs_removed(msg.ids)
            elif isinstance(msg, wire.ObjectsGone):
                self.handle_objects_gone(msg, pipe, notify)
            elif isinstance(msg, wire.QueryPart):
                self.pending_queries.append((msg, len(self.pending_records)))
            elif isinstance(msg, wire.KnnRetract):
                self.knnreg.retract("", msg.ids, msg.epoch)
            elif isinstance(msg, wire.KnnAsk):
                self.knnreg.on_ask(msg, pipe)
            elif isinstance(msg, wire.KnnArrived):
                self.knnreg.on_arrived(msg, pipe, notify)
            elif isinstance(msg, wire.KnnRefresh):
                self.knnreg.on_refresh(msg, pipe, notify)
            elif isinstance(msg, wire.Takeover):
                self.migration.receive_takeover(msg, pipe, notify)
                if msg.adopter == self.id:
                    self.to_adopt.append(msg.dead)
            else:
                self.migration.receive_handoff(msg, pipe, notify)
        if group:
            self._match_group(group, pipe, notify)
        if ids:  # acknowledged in the transaction that writes their effects: both or neither
            pipe.xack(self.stream, names.GROUP, *ids)
        writes, self.pending_history = self.pending_history, []
        slots = []
        ttl = int(self.settings.history_max_age_s) + 60
        max_age_ms = int(self.settings.history_max_age_s * 1000)
        housekeeping_ms = history_housekeeping_ms(self.settings.history_max_age_s)
        one_slot = self.relayer is not None
        if one_slot:
            writes = [(t, b, *by_history_group(sub_ids, refs), stored)
                      for t, b, sub_ids, refs, stored in writes]
        chunks = []
        for tenant, bucket, sub_ids, refs, _records in writes:
            chunks.append(history_chunks(sub_ids, one_slot))
            for a, b in chunks[-1]:
                slots.append(len(pipe.command_stack))
                keys, args = history_call(sub_ids[a:b], refs[a:b])
                run_script(pipe, self._history, keys,
                           [bucket, tenant, self.settings.history_max_len, ttl,
                            max_age_ms, housekeeping_ms, *args])
        if self.relayer is None:
            # the lists changed are announced by the transaction that writes them (a round
            # trip less; an outbox's commit holds no PUBLISH)
            self._announce(pipe, notify)
            notify = {}
        writing = time.perf_counter()
        results = pipe.execute()
        self.hops.observe("write", time.perf_counter() - writing, objects)
        self.knnreg.settle(pipe, results)
        self._keep_records()
        self.notify(writes, chunks, [results[i] for i in slots], notify, sent_at)
        last = max(ids, key=cluster.entry_order) if ids else None
        if last is not None and (self.processed_id is None or cluster.entry_order(last)
                                 > cluster.entry_order(self.processed_id)):
            self.processed_id = last

    def _keep_records(self) -> None:
        """After the commit: the entries' records join the window, and each query is answered
        at its place among them (it sees the records of the entries before it)."""
        records, self.pending_records = self.pending_records, []
        queries, self.pending_queries = self.pending_queries, []
        pipe = self.redis.pipeline(transaction=False)  # empty without queries: no round trip
        q = 0
        for pos in range(len(records) + 1):
            while q < len(queries) and queries[q][1] == pos:
                part = queries[q][0]
                self.answer(part, pipe, self.records.tenants.get(part.tenant), self.id)
                q += 1
            if pos < len(records):
                self.records.add(*records[pos])
        pipe.execute()

    def _take_straight(self, entries: list[tuple[bytes, dict[bytes, bytes]]]) -> None:
        """Queue the query parts sent straight to us (an undecodable one is dropped)."""
        for eid, fields in entries:
            try:
                part = wire.decode_query_part(fields)
            except ValueError as exc:
                log.error("worker %s: undecodable query part %s: %s", self.id, eid, exc)
                self.redis.xack(self.query_stream, names.GROUP, eid)
                continue
            self.straight.append((eid, part))

    def _answer_straight(self) -> None:
        """Answer the parts sent straight to us, once a read of our stream reached its end
        and what it read is processed. A part was added after every entry accepted before
        its query; it was read in that read or an earlier one, so all those entries were
        there to be read: they are processed (their records are in the window). Records of
        entries after it may be too, which `as_of` keeps out if they arrived later. A part
        its api gave up on is dropped (`answer`)."""
        if not self.straight:
            return
        ready, self.straight = self.straight, []
        mark = None
        if any(part.query.skip_cells is not None for _, part in ready):
            # a count from the per-cell counts: they are written as far as processed first
            self._report_counts(time.time())
            if self.processed_id is not None and self.reported[0] == self.processed_id:
                mark = self.processed_id.decode()
        pipe = self.redis.pipeline(transaction=False)
        for _, part in ready:
            self.answer(part, pipe, self.records.tenants.get(part.tenant), self.id,
                        mark if part.query.skip_cells is not None else None)
        pipe.xack(self.query_stream, names.GROUP, *(eid for eid, _ in ready))
        pipe.execute()

    def answer(self, part: wire.QueryPart, pipe: Any, records: TenantRecords | None,
               worker: str, mark: str | None = None) -> None:
        """Answer a query part from `records` (those `worker` holds) on `pipe`; `mark`: the
        entry our per-cell counts are written up to (`wire.QueryReply.mark`)."""
        if time.time() > part.deadline:
            return  # the api has given up on it
        try:
            reply = evaluate(records, part, worker, self.records.grid,
                             self._dropped(worker))
            reply.mark = mark
        except Exception as exc:  # a query must not take the worker down
            log.exception("worker %s: snapshot query failed", self.id)
            reply = wire.QueryReply(worker=self.id, error=f"{type(exc).__name__}: {exc}")
        encoded = wire.encode_query_reply(reply)
        if self.inboxes.send(part, encoded):  # straight to the api process that asked
            return
        key = names.query_reply_key(part.reply)
        pipe.rpush(key, encoded)
        pipe.expire(key, 120)

    def _dropped(self, worker: str) -> int:
        """The greatest bucket of `worker`'s window whose records left our memory."""
        adoption = self.adoptions.get(worker)
        return (adoption.archiver if adoption is not None else self.archiver).dropped

    def notify(self, writes: list[tuple[str, int, list[str], list[bytes], dict[str, bytes]]],
               chunks: list[list[tuple[int, int]]], replies: list[list[bytes] | None],
               notify: dict[str, set[str]], sent_at: float = 0.0) -> None:
        """Tell the hubs what was appended: the entries with their previous ids and the
        records they reference, so caught-up clients get them without a read (`sent_at`: when
        the oldest batch of the step was appended, for the hubs' hops). `chunks`: the script
        calls of each write (`history_chunks`), `replies` theirs."""
        written_at = time.time()
        pipe = self.redis.pipeline(transaction=False)
        it = iter(replies)
        for (tenant, bucket, sub_ids, refs, stored), calls in zip(writes, chunks, strict=True):
            entries = []
            for a, b in calls:
                reply = next(it)
                if reply is None:  # relayed by another (`workers.outbox`): hubs read it
                    continue
                for j, sid in enumerate(sub_ids[a:b]):
                    entries.append((sid, reply[2 * j].decode(), reply[2 * j + 1].decode(),
                                    refs[a + j]))
            # (a cluster's pipeline refuses `publish`, not the command)
            pipe.execute_command("PUBLISH", self.notify_channel, wire.encode_notification(
                wire.HistoryAppended(
                    tenant=tenant, bucket=bucket, entries=entries, records=stored,
                    sent_at=sent_at, written_at=written_at)))
        self._announce(pipe, notify)
        pipe.execute()

    def _announce(self, pipe: Any, notify: dict[str, set[str]]) -> None:
        """Tell the hubs which subscriptions of each tenant have new lists (kNN)."""
        for tenant, subs in notify.items():
            pipe.execute_command("PUBLISH", self.notify_channel, wire.encode_notification(
                wire.SubsChanged(tenant=tenant, subs=sorted(subs))))

    def _delivery_counts(self, ids: list[bytes]) -> dict[bytes, int]:
        if not ids:
            return {}
        rows = self.redis.xpending_range(self.stream, names.GROUP, min=ids[0], max=ids[-1],
                                         count=len(ids) + 10)
        out = {}
        for row in rows:
            mid = row["message_id"]
            out[mid if isinstance(mid, bytes) else mid.encode()] = int(row["times_delivered"])
        return out

    def dead_letter(self, eid: bytes, fields: dict[bytes, bytes], why: str,
                    stream: str | None = None) -> None:
        stream = stream or self.stream
        log.error("worker %s: entry %s of %s to the dead-letter stream: %s", self.id, eid,
                  stream, why)
        # Counted, dead-lettered and acknowledged in one transaction; on a Redis Cluster (the
        # keys lie in different slots) one after the other, counted first. Either way whoever
        # finds the dead letter finds it counted (the count was incremented after the entry
        # was listed, and a reader of both could see it listed and not counted).
        pipe = self.redis if self.cluster else self.redis.pipeline(transaction=True)
        pipe.incr(names.DEAD_LETTER_COUNT)
        pipe.xadd(names.DEAD_LETTER, {b"stream": stream.encode(), b"id": eid,
                                      b"why": why.encode(), **fields}, maxlen=100_000)
        pipe.xack(stream, names.GROUP, eid)
        if pipe is not self.redis:
            pipe.execute()

    def _trim(self, now: float) -> None:
        """Trim the worker stream below the oldest pending entry (never what is pending) and
        the window log by age (history streams are trimmed as they are appended to)."""
        try:
            for stream in (self.stream, *(a.stream for a in self.adoptions.values())):
                self.trim_stream(stream)
            # the window log keeps what is not archived yet
            start = log_start(self.archiver.cut, self.settings.bucket_s)
            if start != "-":
                self.redis.execute_command("XTRIM", self.window_stream, "MINID", "~", start)
        except redis.ResponseError as exc:
            log.warning("worker %s: trim failed: %s", self.id, exc)

    def last_delivered(self, stream: str) -> Any:
        """The id of the last entry of `stream` delivered to our consumer group, or None."""
        return next((g["last-delivered-id"] for g in self.redis.xinfo_groups(stream)
                     if g["name"] in (names.GROUP, names.GROUP.encode())), None)

    def trim_stream(self, stream: str) -> None:
        """Trim a stream we consume below its oldest pending entry (or its last delivered)."""
        last = self.last_delivered(stream)
        summary = self.redis.xpending(stream, names.GROUP)
        floor = summary["min"] if summary and summary.get("pending") else last
        if floor:
            self.redis.execute_command("XTRIM", stream, "MINID", floor)

    # --- subscriptions -------------------------------------------------------------------
    def handle_subs_added(self, msg: wire.SubsAdded, pipe: Any,
                          notify: dict[str, set[str]]) -> None:
        if not self.replicated and msg.plan_version < self.version:
            self.migration.forward_subs(msg.subs, pipe, since_version=msg.plan_version)
        self.add_subscriptions(msg.subs, pipe)
        for m in msg.subs:
            if m.spec["type"] == "knn":
                notify.setdefault(m.tenant, set()).add(m.id)

    def add_subscriptions(self, subs: list[wire.SubscriptionCopy], pipe: Any = None,
                          clear: tuple[str, ...] = ()) -> set[str]:
        """Take subscription copies; kNN registrations report their first lists (clearing
        the tokens `clear`). Returns the ids of the kNN registrations that reported."""
        knn: list[wire.SubscriptionCopy] = []  # registered together, after the others
        knn_ids: set[str] = set()
        for m in subs:
            if m.id in self.tombstones:
                continue  # deleted already (a late copy)
            if self.replaying and m.id not in self.sql_live:
                continue  # a pre-crash copy of a subscription deleted since
            spec = m.spec
            assert self.index is not None
            if spec["type"] == "knn":  # a registration may come again, of a newer epoch
                if m.id not in self.sub_msgs and m.id not in knn_ids:
                    self.round_received += 1
                    self.ledger.add_query(m.id, rect_of(self.index.grid, spec))
                knn.append(m)
                knn_ids.add(m.id)
                continue
            if m.id in self.sub_msgs:
                continue  # known
            self.sub_msgs[m.id] = m
            self.round_received += 1
            self.ledger.add_query(m.id, rect_of(self.index.grid, spec))
            self.subs.add(m.tenant, m.id, spec, m.expires_at)
        if knn:
            self.knnreg.register(knn, pipe if pipe is not None else self.redis, clear)
        return knn_ids

    def handle_subs_removed(self, ids: list[str]) -> None:
        """Deleted or expired subscriptions. Their history keys go too (the api deleted them
        already; this worker may have written to them since, from entries before this one)."""
        now = time.time()
        held = [sid for sid in ids if sid in self.sub_msgs]
        self._drop_pending_history(set(ids))
        for sid in ids:
            self.tombstones[sid] = now
            self.sub_msgs.pop(sid, None)
            self.ledger.remove_query(sid)
        if held:
            pipe = self.redis.pipeline(transaction=False)
            for sid in held:  # one key per command: they are in many hash slots
                pipe.delete(names.history_key(sid))
                pipe.hdel(names.history_last_key(sid), names.history_key(sid))
            pipe.execute()
        for state in self.knn.values():
            for sid in ids:
                if state.remove(sid) is not None:
                    self.redis.delete(names.knn_key(sid))
        for sid in ids:
            self.subs.remove(sid)

    def _drop_pending_history(self, gone: set[str]) -> None:
        """Entries of this step matched before the removal are not written: they would be
        written after the deletes above, in the step's transaction, and make the history of a
        deleted subscription again."""
        kept = []
        for tenant, bucket, sub_ids, refs, stored in self.pending_history:
            keep = [i for i, sid in enumerate(sub_ids) if sid not in gone]
            if len(keep) == len(sub_ids):
                kept.append((tenant, bucket, sub_ids, refs, stored))
            elif keep:
                kept.append((tenant, bucket, [sub_ids[i] for i in keep],
                             [refs[i] for i in keep], stored))
        self.pending_history = kept

    # --- objects -------------------------------------------------------------------------
    def handle_objects_gone(self, msg: wire.ObjectsGone, pipe: Any,
                            notify: dict[str, set[str]]) -> None:
        """Moving objects that outlived their TTL leave the kNN state (and so the lists)."""
        state = self.knn.get(msg.tenant)
        if state is None:
            return
        state.drop_moving(msg.ids)
        changed = state.refresh()
        if changed:
            self.merge_knn(msg.tenant, changed, pipe)
            notify.setdefault(msg.tenant, set()).update(s.id for s in changed)

    def _match_group(self, group: list[wire.ObjectBatch], pipe: Any,
                     notify: dict[str, set[str]]) -> None:
        started = time.perf_counter()
        try:
            self._match_group_in(group, pipe, notify)
        finally:
            self.hops.observe("match", time.perf_counter() - started, sum(map(len, group)))

    def _match_group_in(self, group: list[wire.ObjectBatch], pipe: Any,
                        notify: dict[str, set[str]]) -> None:
        for msg in group:
            kept = records_of(msg)
            if kept is not None:
                bucket = self.records.bucket_of(kept, self.archiver.cut)
                self.pending_records.append((kept, bucket))
                pipe.xadd(self.window_stream, {b"m": wire.encode_entry(kept),
                                               b"b": str(bucket).encode()})
        batch = wire.ObjectBatch.concat(group)
        tenant = batch.tenant
        at = [b.sent_at for b in group for _ in b.ids]
        self.received += len(batch)
        self._count_objects(batch)
        state = self.knn_state(tenant)
        changed = state.apply(batch, at, time.time())
        if changed:
            self.merge_knn(tenant, changed, pipe)
            notify.setdefault(tenant, set()).update(s.id for s in changed)
        self.knnreg.send_asks(tenant, state, pipe)
        subs = self.subs.indexed(tenant)
        if subs is None:
            return
        batch, at = self._to_match(group, batch, at)
        if not len(batch):
            return
        matches = decide(subs.table, subs, batch, at)
        if not matches.rows.size:
            return
        self.write_matches(batch, matches, pipe)

    def write_matches(self, batch: wire.ObjectBatch, m: Matches, pipe: Any) -> None:
        """Store each matched record once and queue one history entry per subscription for
        the batch (cursor = entry id + index); the entries are written by HISTORY_SCRIPT in
        `_process`, in the same transaction as the entry's done-marker."""
        tenant = batch.tenant
        bucket = int(time.time() // 30)
        records = {batch.record_ids[i]: orjson.dumps(public_record(
            batch.ids[i], batch.lon[i], batch.lat[i], batch.ts[i], batch.keywords[i],
            batch.text[i], batch.props[i])) for i in distinct(m.rows).tolist()}
        rkey = names.records_key(tenant, bucket)
        pipe.hset(rkey, mapping=records)
        pipe.expire(rkey, int(self.settings.history_max_age_s) + 90)
        keys, starts = np.unique(m.keys, return_index=True)
        ends = np.append(starts[1:], m.keys.size)
        rid_arr = np.asarray(batch.record_ids, dtype=object)[m.rows]
        sub_ids = self.subs.tables[tenant].ids[keys].tolist()
        refs = [wire.encode_refs(wire.MatchRefs(rid_arr[a:b].tolist(), m.detect[a:b].tobytes()))
                for a, b in zip(starts.tolist(), ends.tolist(), strict=True)]
        self.pending_history.append((tenant, bucket, sub_ids, refs, records))
        self.matched += int(m.rows.size)

    # --- SWARM statistics (§4.2, kept by the ledger) ------------------------------------
    def _count_objects(self, batch: wire.ObjectBatch) -> None:
        """New objects (not exit-only copies) into the ledger."""
        lon, lat = batch.lon, batch.lat
        if any(batch.exit_only):
            keep = [i for i, xo in enumerate(batch.exit_only) if not xo]
            lon, lat = [lon[i] for i in keep], [lat[i] for i in keep]
        self.round_received += len(lon)
        if not self.replicated:
            self.ledger.add_points(lon, lat, bucket=int(time.time() // self.settings.bucket_s))

    def _expire_window(self, now: float) -> None:
        """Objects that left the window decrement N (§4.2.2), and their records go to the
        archive; old tombstones are forgotten."""
        self.archiver.step(self.records, now)
        self.ledger.expire(int((now - self.settings.window_s) // self.settings.bucket_s))
        cutoff = now - TOMBSTONE_S
        for sid in [s for s, t in self.tombstones.items() if t < cutoff]:
            del self.tombstones[sid]

    def owned(self) -> list[Partition]:
        assert self.index is not None
        if self.replicated:
            return []
        return [p for p in self.index.partitions if p.worker == self.id]

    def sync_stats(self) -> None:
        """Statistics for exactly the partitions this worker owns now."""
        assert self.index is not None
        self.ledger.sync(self.index, self.owned())
        self.owned_ids = sorted(self.ledger.stats)

    def _report(self, round_no: int) -> None:
        """End of round: fold (Algorithm 2) and report Num(C(m)), R(m) and per-partition
        N, Q, R for the coordinator and the admin API."""
        parts: list[wire.PartitionLoad] = []
        num, r_m = 0.0, 0.0
        for stats in sorted(self.ledger.fold(), key=lambda st: st.partition.id):
            n, q, r = stats.totals()
            c = balance.cost_numerator(n, q, r)
            parts.append(wire.PartitionLoad(id=stats.partition.id, N=n, Q=q, R=r, num=c))
            num += c
            r_m += r
        if self.replicated:
            r_m = self.round_received
        at, behind = time.time(), self._behind_s()
        since, behind_since = self.last_report
        self.last_report = (at, behind)
        report = wire.encode_json(wire.LoadReport(
            worker=self.id, round=round_no, at=at, plan_version=self.version, num=num,
            r_m=r_m, partitions=parts, received=self.round_received, behind_s=behind,
            since=since, behind_since_s=behind_since))
        self.round_received = 0
        pipe = self.redis.pipeline(transaction=False)
        pipe.hset(names.report_key(round_no), self.id, report)
        pipe.expire(names.report_key(round_no), 3600)
        pipe.hset(names.STATS_KEY, self.id, report)
        pipe.execute()

    def _behind_s(self) -> float:
        """How far the newest entry of the stream is ahead of the last one processed, in
        seconds of their ids (0 when nothing waits, or nothing was processed yet)."""
        newest = self.redis.xrevrange(self.stream, count=1)
        if not newest or self.processed_id is None:
            return 0.0
        ahead = cluster.entry_order(newest[0][0])[0] - cluster.entry_order(self.processed_id)[0]
        return max(0.0, ahead / 1000)

    # --- commands from the coordinator (wire.Command) -------------------------------------
    def _command(self, eid: bytes, fields: dict[bytes, bytes]) -> None:
        try:
            cmd = wire.decode_command(fields[b"m"])
        except (KeyError, ValueError) as exc:  # a bad command must not stop the worker
            log.error("worker %s: undecodable command %s: %s", self.id, eid, exc)
            self.redis.xack(self.cmd_stream, names.GROUP, eid)
            return
        reply: wire.CommandReply | None = None
        try:
            if cmd.leader is not None and self.redis.get(names.LEASE_KEY) != cmd.leader.encode():
                raise CommandRefused(f"sent by coordinator {cmd.leader}, which no longer holds "
                                     "the lease")
            if isinstance(cmd, wire.RoundCommand):
                self._report(cmd.round)
            else:
                reply = self.migration.command(cmd)
        except CommandRefused as exc:
            reply = wire.CommandReply(ok=False, error=str(exc))
        except (KeyError, ValueError, TypeError) as exc:
            log.exception("worker %s: bad command %r", self.id, cmd)
            reply = wire.CommandReply(ok=False, error=f"invalid command: {exc}")
        if reply is not None and cmd.reply:
            reply.worker = self.id
            pipe = self.redis.pipeline(transaction=False)
            pipe.rpush(names.reply_key(cmd.reply), wire.encode_json(reply))
            pipe.expire(names.reply_key(cmd.reply), 60)
            pipe.execute()
        self.redis.xack(self.cmd_stream, names.GROUP, eid)


def paced_count(count: int, entries: int, took_s: float) -> int:
    """The next step's read count after one that processed `entries` in `took_s` (having
    read up to `count`): as many as take about STEP_TARGET_S at that pace, between
    MIN_READ_COUNT and READ_COUNT, growing by at most half at a time (one light step after
    heavy ones does not bring a long step back at once)."""
    if took_s <= 0 or entries <= 0:
        return count
    fits = int(entries * STEP_TARGET_S / took_s)
    return max(MIN_READ_COUNT, min(READ_COUNT, fits, count + max(1, count // 2)))


def run_worker(settings: Settings, worker_id: str, redis_url: str) -> None:
    Executor(settings, worker_id, redis_url).run()
