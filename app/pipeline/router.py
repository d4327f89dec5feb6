"""SWARM's routing layer in every api process (SWARM §4.1): the global index, the plan kept in
Redis by version, and the routing of objects and subscription changes to worker streams."""

from __future__ import annotations

import asyncio
import logging
import math
import secrets
import time
import zlib
from pathlib import Path
from typing import Any

import numpy as np
import orjson
import redis.asyncio as aioredis
import redis.exceptions
from redis.asyncio.cluster import RedisCluster as AsyncRedisCluster

from app.core.config import Settings
from app.core.metrics import ROUTED_ROWS
from app.core.pipelines import ClientPipelines, Pipelines, eval_script
from app.core.redis import db_of
from app.geo.arrays import distinct
from app.geo.grid import Grid
from app.geo.history import history_plan, sample_cells
from app.geo.index import GlobalIndex, IntArray, Plan, initial_plan
from app.models import Subscription
from app.pipeline import knnreg, names, records, wire
from app.pipeline.cellcounts import TOTALS_SCRIPT, read_totals
from app.pipeline.cluster import ALLOCATE_IDS_SCRIPT, live_workers, load_plan, part_seq_floor
from app.pipeline.control import history_entry
from app.pipeline.outbox import AsyncRelayer, encode_ops, op

log = logging.getLogger(__name__)

# One publish, all or nothing: the latest positions of its moving objects (last writer wins
# by ts, CheetahGIS's Transformer) are written together with their expiry and the stream
# entries routed from them, and only if no other publish changed those positions since
# `Router.publish` read them (else nothing is written and it reads again). The guard key makes
# a call the client library sends again after a lost reply a no-op, so a publish is applied
# once. A publish that would take the tenant over its quota of stored moving objects writes
# nothing. A publish holding events (records without an id: they stay for the live window on
# the worker that stored them) renews the tenant's events mark (`names.events_key`) for a
# window: while it is absent, no worker holds an event of the tenant, and kNN registrations
# need the owners under the current plan alone (`app.pipeline.knnreg`).
# KEYS: guard, positions hash, expiry zset, events mark, then either the set of tenants with
# expiries and the worker streams, or (with outboxes, `app.pipeline.outbox`) the tenant's
# outbox.
# ARGV: guard ttl, n, quota (0: none), tenant, the events mark's ttl (0: no event), 'o' when
# the entries go through the outbox, then n quadruples (object id, its packed position as read
# or '' for none, the packed position to store or '' to keep it, its expiry time), then one
# stream entry per stream, or the outbox entry (`encode_ops` of the XADDs).
# Returns 1 when applied (now or before), 0 when a position changed meanwhile, 2 when over
# the quota.
PUBLISH_SCRIPT = """
if not redis.call('SET', KEYS[1], '1', 'NX', 'EX', ARGV[1]) then return 1 end
local n, quota = tonumber(ARGV[2]), tonumber(ARGV[3])
-- one HMGET, HSET and ZADD per chunk of objects, not one call per object (unpack's stack)
local CHUNK = 1000
local new_ids, pos, exp = 0, {}, {}
for s = 0, n - 1, CHUNK do
  local last = math.min(n, s + CHUNK) - 1
  local ids = {}
  for i = s, last do ids[#ids + 1] = ARGV[7 + 4 * i] end
  local held = redis.call('HMGET', KEYS[2], unpack(ids))
  for i = s, last do
    local read = ARGV[8 + 4 * i]
    if (held[i - s + 1] or '') ~= read then
      redis.call('DEL', KEYS[1])
      return 0
    end
    local new = ARGV[9 + 4 * i]
    if new ~= '' then
      if read == '' then new_ids = new_ids + 1 end
      pos[#pos + 1] = ARGV[7 + 4 * i]
      pos[#pos + 1] = new
      exp[#exp + 1] = ARGV[10 + 4 * i]
      exp[#exp + 1] = ARGV[7 + 4 * i]
    end
  end
end
if quota > 0 and new_ids > 0 and redis.call('HLEN', KEYS[2]) + new_ids > quota then
  redis.call('DEL', KEYS[1])
  return 2
end
for s = 1, #pos, 2 * CHUNK do
  local last = math.min(#pos, s + 2 * CHUNK - 1)
  redis.call('HSET', KEYS[2], unpack(pos, s, last))
  redis.call('ZADD', KEYS[3], unpack(exp, s, last))
end
if ARGV[5] ~= '0' then redis.call('SET', KEYS[4], '1', 'EX', ARGV[5]) end
local base = 7 + 4 * n
if ARGV[6] == 'o' then
  redis.call('XADD', KEYS[5], '*', 'm', ARGV[base])
  return 1
end
if #pos > 0 then redis.call('SADD', KEYS[5], ARGV[4]) end
for s = 6, #KEYS do
  redis.call('XADD', KEYS[s], '*', 'm', ARGV[base + s - 6])
end
return 1
"""
PUBLISH_ATTEMPTS = 20  # publishes of the same objects racing: each attempt reads again
PUBLISH_GUARD_TTL_S = 300
PUBLISH_SETTLE_S = 10.0  # how long a publish whose reply was lost waits to learn its outcome


BACKLOG_CHECK_S = 0.25  # how old the streams' lengths a publish is checked against may be


class RoutedSummary:
    """One worker's keyword summary of one tenant as a router uses it: the words per
    partition (None: open) and the token and plan it was made for; `open` when no partition
    has words (no row can be marked)."""

    __slots__ = ("_aligned", "open", "parts", "plan_version", "token")

    def __init__(self, summary: wire.KeywordSummary) -> None:
        self.token = summary.token
        self.plan_version = summary.plan_version
        self.parts: dict[str, frozenset[str] | None] = {
            pid: None if words is None else frozenset(words)
            for pid, words in summary.parts.items()}
        self.open = all(words is None for words in self.parts.values())
        self._aligned: list[frozenset[str] | None] | None = None

    def by_partition(self, index: GlobalIndex) -> list[frozenset[str] | None]:
        """The words of each partition of the plan, by its index there (None for the open
        ones and for those the worker does not own); only for the plan of the summary."""
        if self._aligned is None:
            self._aligned = [self.parts.get(p.id) for p in index.plan.partitions]
        return self._aligned


def no_match_rows(words_by_part: list[frozenset[str] | None], parts: list[int],
                  keywords: list[list[str]], prev: list[Any], late: list[bool]) -> list[int]:
    """The rows (positions in the worker's entry) that no subscription of the summary can
    match: holding none of the words of their partition (`RoutedSummary.by_partition`), and
    with no previous position to decide enter or exit from (none, or late)."""
    out = []
    for j, p in enumerate(parts):
        words = words_by_part[p]
        if words is not None and words.isdisjoint(keywords[j]) and (
                prev[j] is None or late[j]):
            out.append(j)
    return out


class PublishContention(Exception):
    """Other publishes kept changing the positions this one routes by."""


class ObjectQuotaExceeded(Exception):
    """The publish would take the tenant over `tenant_max_objects` stored moving objects."""


class Overloaded(Exception):
    """A worker's stream holds more than `max_backlog` entries: it does not keep up."""


def last_writer_wins(batch: records.RecordBatch, moving_rows: list[int],
                     stored: dict[str, bytes | None]
                     ) -> tuple[list[tuple[float, float] | None], list[bool],
                                list[tuple[str, bytes, bytes, int]]]:
    """The rows in order against the stored latest positions (`stored`, by object id): each
    moving record's previous position, whether it is late (older than the latest: no position
    change), and per object (id, position read, position to store or b'' to keep it, the
    row that wrote it or -1)."""
    n = batch.size
    prev: list[tuple[float, float] | None] = [None] * n
    late = [False] * n
    current = dict(stored)
    writer: dict[str, int] = {}
    for i in moving_rows:
        oid = batch.ids[i]
        old = current[oid]
        if old is not None:
            old_ts, plon, plat, _kws, _props = records.unpack_position(old)
            prev[i] = (plon, plat)
            if batch.ts[i] < old_ts:
                late[i] = True
                continue
        current[oid] = records.pack_position(batch.ts[i], batch.lon[i], batch.lat[i],
                                             batch.keywords[i], batch.props[i])
        writer[oid] = i
    checks = []
    for oid, read in stored.items():
        new = current[oid]
        changed = new is not None and new != read
        checks.append((oid, read or b"", new if changed and new is not None else b"",
                       writer.get(oid, -1) if changed else -1))
    return prev, late, checks


def subscription_message(row: Subscription) -> wire.SubscriptionCopy:
    return wire.SubscriptionCopy(id=row.id, tenant=row.tenant, spec=row.spec,
                                 expires_at=row.expires_at)


def grid_of(settings: Settings) -> Grid:
    return Grid(bounds=settings.bounds, nx=settings.grid[0], ny=settings.grid[1])


def targets_for_spec(index: GlobalIndex, spec: dict[str, Any],
                     replicated: bool = False) -> set[str]:
    """Workers that must hold a subscription: those whose partitions its region overlaps;
    every worker for subscriptions without a region (keyword) and for kNN, and for every
    subscription in replicated mode (SWARM §6's Replicated baseline)."""
    if replicated:
        return set(index.workers)
    if spec["type"] == "range":
        if "bbox" in spec:
            return index.workers_for_bbox(tuple(spec["bbox"]))
        c = spec["circle"]
        return {index.plan.partitions[p].worker
                for p in index.partitions_for_circle(c["lon"], c["lat"], c["radius_m"])}
    return set(index.workers)


def replicated_worker_of(tenant: str, object_id: str, n_workers: int) -> int:
    """Replicated mode: the worker (index into `GlobalIndex.workers`) of a moving object, a
    stable hash of (tenant, id), the same in every api process, so that one object always
    lands on one worker (which then sees every position and decides enter/exit alone)."""
    return zlib.crc32(f"{tenant}\x00{object_id}".encode()) % n_workers


def replicated_targets(tenant: str, ids: list[str], moving: list[bool], n_workers: int,
                       start: int) -> list[int]:
    """Replicated mode: the worker index of every row of a batch. Moving objects by
    `replicated_worker_of`; events round-robin from `start` (the router's counter), the j-th
    event of the batch to (start + j) mod n (SWARM §6: "a new data point is sent to only one
    executor machine in round-robin fashion")."""
    out: list[int] = []
    j = start
    for oid, mv in zip(ids, moving, strict=True):
        if mv:
            out.append(replicated_worker_of(tenant, oid, n_workers))
        else:
            out.append(j % n_workers)
            j += 1
    return out


class Router:
    def __init__(self, settings: Settings, redis: aioredis.Redis,
                 pipelines: Pipelines | None = None) -> None:
        self.settings = settings
        self.redis = redis
        # a publish's reads and writes (its hot path): `redis`'s pipelines unless given
        self.pipelines = pipelines if pipelines is not None else ClientPipelines(redis)
        self.index: GlobalIndex | None = None
        # Writes to other hash slots go through the tenants' outboxes (a Redis Cluster).
        clustered = isinstance(redis, AsyncRedisCluster)
        self.outbox = AsyncRelayer(redis) if settings.redis_outbox or clustered else None
        self._outbox_tenants: set[str] = set()
        self._expiry_tenants: set[str] = set()
        self._backlog: dict[str, int] = {}  # worker stream -> its length, read at _backlog_at
        self._backlog_at = 0.0
        self._plan_checked = 0.0
        self._lock = asyncio.Lock()
        self.replicated = settings.partitioning == "replicated"
        self._rr = 0  # replicated mode: round-robin position of the next event
        self.history = knnreg.PlanHistory()
        # the events mark outlives the last event stored by a window (and a bucket, and a
        # minute for the clocks)
        self.events_ttl_s = int(settings.window_s + settings.bucket_s) + 60
        # tenant -> (when read, cell -> records in the window): the first radius of kNN
        # registrations (one read serves the subscriptions created in the same second)
        self._cell_totals: dict[str, tuple[float, knnreg.CountGrid]] = {}
        self._totals = redis.register_script(TOTALS_SCRIPT)
        # tenant -> (when read, worker -> its keyword summary of the tenant)
        self._summaries: dict[str, tuple[float, dict[str, RoutedSummary]]] = {}
        self.summaries = settings.keyword_summaries and not self.replicated
        self._marked = ROUTED_ROWS.labels("no_match")
        self._unmarked = ROUTED_ROWS.labels("to_match")

    # --- the plan ------------------------------------------------------------------------
    async def current_index(self) -> GlobalIndex:
        now = time.monotonic()
        if self.index is None or now - self._plan_checked > 1.0:
            await self.refresh()
        if self.index is None:
            raise RuntimeError("no partition plan")
        return self.index

    async def refresh(self) -> None:
        async with self._lock:
            plan = await load_plan(self.redis)
            self._plan_checked = time.monotonic()
            if plan is None:
                return
            if self.index is None or plan.version != self.index.plan.version:
                self.index = GlobalIndex(plan)
                log.info("router loaded plan version %d (%d partitions)", plan.version,
                         len(plan.partitions))

    async def plans_since(self, horizon: float, current: GlobalIndex
                          ) -> list[GlobalIndex] | None:
        """The plans valid at some time since `horizon` (`knnreg.PlanHistory.since`)."""
        n = 1
        while True:  # as PlanHistory.read, with the async client
            raw = await self.redis.lrange(names.PLAN_HISTORY, -n, -1)
            if self.history.absorb(raw) or len(raw) < n:
                break
            n *= 4
        return self.history.since(horizon, current)

    async def live_workers(self, now: float) -> list[str]:
        raw = await self.redis.hgetall(names.WORKERS_KEY)
        return live_workers(raw.items(), now, self.settings.worker_dead_after_s)

    # --- objects -------------------------------------------------------------------------
    async def publish(self, batch: records.RecordBatch) -> None:
        n = batch.size
        rids = records.new_record_ids(n)
        moving_rows = [i for i in range(n) if batch.moving[i]]
        moving_ids = list(dict.fromkeys(batch.ids[i] for i in moving_rows))
        pos_key = names.positions_key(batch.tenant)
        guard = names.publish_guard_key(batch.tenant, secrets.token_hex(12))
        for _attempt in range(PUBLISH_ATTEMPTS):
            index = await self.current_index()
            stored: dict[str, bytes | None] = {}
            if moving_ids:
                [raw] = await self.pipelines.execute([("HMGET", pos_key, *moving_ids)])
                stored = {oid: v if v is None or isinstance(v, bytes) else v.encode()
                          for oid, v in zip(moving_ids, raw, strict=True)}
            prev, late, checks = last_writer_wins(batch, moving_rows, stored)
            summaries = (await self.keyword_summaries(batch.tenant, index)
                         if self.summaries else {})
            streams, entries = self._route(index, batch, rids, prev, late, moving_rows,
                                           summaries)
            await self._check_backlog(streams)
            args: list[Any] = [PUBLISH_GUARD_TTL_S, len(checks),
                               self.settings.tenant_max_objects, batch.tenant,
                               self.events_ttl_s if len(moving_rows) < n else 0,
                               "o" if self.outbox else ""]
            for oid, read, new, row in checks:
                args += [oid, read, new, self._expiry(batch, row) if row >= 0 else 0]
            keys = [guard, pos_key, names.object_expiry_key(batch.tenant),
                    names.events_key(batch.tenant)]
            if self.outbox is None:
                keys += [names.OBJECT_EXPIRY_TENANTS, *streams]
                args += entries
            else:
                keys.append(names.tenant_outbox(batch.tenant))
                args.append(encode_ops(op("XADD", s, "*", "m", e)
                                       for s, e in zip(streams, entries, strict=True)))
                await self._outbox_tenant(batch.tenant, bool(checks))
            try:
                done = await eval_script(self.pipelines, PUBLISH_SCRIPT, keys, args)
            except (redis.exceptions.ConnectionError, redis.exceptions.TimeoutError):
                # The call may have been applied before Redis went away: its guard key tells,
                # once Redis answers again, so that a 503 always means "nothing was written".
                if await self._applied(guard):
                    await self.relay_tenant(batch.tenant)
                    return
                raise
            if done == 1:
                await self.relay_tenant(batch.tenant)
            if done == 2:
                raise ObjectQuotaExceeded(
                    f"tenant quota of {self.settings.tenant_max_objects} moving objects "
                    "reached (tenant_max_objects); objects leave when their ttl_s passes")
            if done:
                return
        raise PublishContention(f"the positions of {len(moving_ids)} objects kept changing "
                                f"under {PUBLISH_ATTEMPTS} attempts to publish them")

    async def _outbox_tenant(self, tenant: str, moving: bool) -> None:
        """Before a tenant's first write through its outbox (by this process): the tenant
        joins the set whose outboxes the expiry round relays; with moving objects, the set
        whose objects it expires (on one Redis the publish script adds it there itself). Both
        sets only grow (a tenant that left one would race with a publish adding it)."""
        if tenant not in self._outbox_tenants:
            await self.redis.sadd(names.OUTBOX_TENANTS, tenant)
            self._outbox_tenants.add(tenant)
        if moving and tenant not in self._expiry_tenants:
            await self.redis.sadd(names.OBJECT_EXPIRY_TENANTS, tenant)
            self._expiry_tenants.add(tenant)

    async def relay_tenant(self, tenant: str) -> None:
        """Relay what the tenant's outbox holds (ours, and any left by a process that died
        before relaying it). A failure leaves it to the next publish or the expiry round: the
        entry is queued either way."""
        if self.outbox is None:
            return
        try:
            await self.outbox.relay_all(names.tenant_outbox(tenant))
        except (redis.exceptions.ConnectionError, redis.exceptions.TimeoutError) as exc:
            log.warning("the outbox of tenant %s is left to relay later: %s", tenant, exc)

    async def via_outbox(self, tenant: str, ops: list[list[bytes]]) -> None:
        """Write `ops` (of any slots) as one entry of the tenant's outbox, then relay it."""
        await self._outbox_tenant(tenant, False)
        await self.redis.xadd(names.tenant_outbox(tenant), {b"m": encode_ops(ops)})
        await self.relay_tenant(tenant)

    async def _applied(self, guard: str) -> bool:
        """Whether the publish of `guard`, whose reply was lost, took effect; waits up to
        PUBLISH_SETTLE_S for Redis to answer (a restart on its AOF), else raises."""
        deadline = time.monotonic() + PUBLISH_SETTLE_S
        while True:
            try:
                return bool(await self.redis.exists(guard))
            except (redis.exceptions.ConnectionError, redis.exceptions.TimeoutError):
                if time.monotonic() > deadline:
                    log.error("a publish's outcome is unknown: Redis did not answer within "
                              "%g s (guard %s)", PUBLISH_SETTLE_S, guard)
                    raise
                await asyncio.sleep(0.25)

    def _expiry(self, batch: records.RecordBatch, row: int) -> float:
        """When the moving object of `row` leaves the store: its own TTL or the default,
        counted from now (a record's ts may be any time; the TTL is about being updated)."""
        ttl = batch.ttl_s[row] if batch.ttl_s is not None else None
        return time.time() + (ttl if ttl is not None else self.settings.object_ttl_s)

    async def _check_backlog(self, streams: list[str]) -> None:
        """Refuse a publish to a worker whose stream is longer than `max_backlog` (lengths
        read at most BACKLOG_CHECK_S ago, for all worker streams at once)."""
        bound = self.settings.max_backlog
        if not bound:
            return
        now = time.monotonic()
        if now - self._backlog_at > BACKLOG_CHECK_S or any(s not in self._backlog
                                                             for s in streams):
            index = await self.current_index()
            known = [names.worker_stream(w) for w in index.workers]
            pipe = self.redis.pipeline(transaction=False)
            for stream in known:
                pipe.xlen(stream)
            self._backlog = dict(zip(known, await pipe.execute(), strict=True))
            self._backlog_at = now
        behind = sorted({s for s in streams if self._backlog.get(s, 0) > bound})
        if behind:
            raise Overloaded(f"workers are behind: {', '.join(behind)} hold more than "
                             f"{bound} entries (max_backlog)")

    async def keyword_summaries(self, tenant: str, index: GlobalIndex
                                ) -> dict[str, RoutedSummary]:
        """The workers' keyword summaries of a tenant, read at most
        `keyword_summaries_max_age_s` ago (an older one only marks fewer rows: a worker
        whose subscriptions changed since ignores its marks)."""
        now = time.monotonic()
        held = self._summaries.get(tenant)
        if held is not None and now - held[0] < self.settings.keyword_summaries_max_age_s:
            return held[1]
        workers = index.workers
        pipe = self.redis.pipeline(transaction=False)
        for w in workers:
            pipe.hget(names.keyword_summaries_key(w), tenant)
        out: dict[str, RoutedSummary] = {}
        for w, raw in zip(workers, await pipe.execute(), strict=True):
            if raw is None:
                continue
            try:
                out[w] = RoutedSummary(wire.decode_summary(
                    raw if isinstance(raw, bytes) else raw.encode()))
            except ValueError:
                log.warning("worker %s's keyword summary of %s is unreadable; ignored", w, tenant)
        if len(self._summaries) > 1000:
            self._summaries.clear()
        self._summaries[tenant] = (now, out)
        return out

    def _route(self, index: GlobalIndex, batch: records.RecordBatch, rids: list[str],
               prev: list[tuple[float, float] | None], late: list[bool],
               moving_rows: list[int], summaries: dict[str, RoutedSummary] | None = None
               ) -> tuple[list[str], list[bytes]]:
        """The worker streams of a batch and the entry for each; with the workers' keyword
        summaries, each entry marks the rows its worker need not match."""
        n = batch.size
        rows_by_worker: dict[int, list[int]] = {}
        decide_exit = [False] * n
        extra: list[tuple[int, int]] = []  # (worker, row) exit-only copies
        if self.replicated:
            # Every worker holds every subscription: one worker per record, which decides
            # inside / enter / exit alone (a moving object always goes to the same worker).
            targets = replicated_targets(batch.tenant, batch.ids, batch.moving,
                                         len(index.workers), self._rr)
            self._rr += n - len(moving_rows)
            for i, w in enumerate(targets):
                rows_by_worker.setdefault(w, []).append(i)
            decide_exit = [p is not None for p in prev]
            part = None
        else:
            part = self._route_by_partition(index, batch, prev, late, moving_rows,
                                            rows_by_worker, decide_exit, extra)
        whole = records.object_batch(batch, rids, prev, late, decide_exit, time.time(),
                                     index.version)
        streams: list[str] = []
        entries: list[bytes] = []
        for w, rows in rows_by_worker.items():
            worker = index.workers[w]
            entry = whole.take(rows)
            summary = summaries.get(worker) if summaries else None
            marked = 0
            if (summary is not None and part is not None and not summary.open
                    and summary.plan_version == index.version):
                entry.no_match = no_match_rows(summary.by_partition(index), part[rows].tolist(),
                                               entry.keywords, entry.prev, entry.late)
                if entry.no_match:
                    entry.no_match_token = summary.token
                    marked = len(entry.no_match)
            self._marked.inc(marked)
            self._unmarked.inc(len(rows) - marked)
            streams.append(names.worker_stream(worker))
            entries.append(wire.encode_entry(entry))
        by_w: dict[int, list[int]] = {}
        for w, i in extra:
            by_w.setdefault(w, []).append(i)
        for w, rows in by_w.items():  # exit-only copies: the receiver only decides `exit`
            entry = whole.take(rows)
            entry.exit_only = entry.decide_exit = [True] * len(rows)
            streams.append(names.worker_stream(index.workers[w]))
            entries.append(wire.encode_entry(entry))
        return streams, entries

    @staticmethod
    def _route_by_partition(index: GlobalIndex, batch: records.RecordBatch,
                            prev: list[tuple[float, float] | None], late: list[bool],
                            moving_rows: list[int], rows_by_worker: dict[int, list[int]],
                            decide_exit: list[bool], extra: list[tuple[int, int]]
                            ) -> IntArray:
        """Each record to the owner of its cell; a moving object that left another worker's
        partition also to the owner of its previous position, which alone decides `exit`.
        Returns each row's partition (an index into the plan's partitions)."""
        lon = np.asarray(batch.lon, dtype=np.float64)
        lat = np.asarray(batch.lat, dtype=np.float64)
        part = index.partition_of_points(lon, lat)
        owner = index.part_worker[part]
        for w in distinct(owner):
            rows_by_worker[int(w)] = np.flatnonzero(owner == w).tolist()
        if moving_rows:
            pl = [i for i in moving_rows if prev[i] is not None and not late[i]]
            if pl:
                p_prev = index.partition_of_points(
                    np.asarray([prev[i][0] for i in pl]),  # type: ignore[index]
                    np.asarray([prev[i][1] for i in pl]))  # type: ignore[index]
                for i, pp in zip(pl, p_prev.tolist(), strict=True):
                    w_prev = int(index.part_worker[pp])
                    if w_prev != owner[i]:
                        extra.append((w_prev, i))
                    else:
                        decide_exit[i] = True
        return part

    async def latest(self, tenant: str, object_id: str) -> dict[str, Any] | None:
        raw = await self.redis.hget(names.positions_key(tenant), object_id)
        if raw is None:
            return None
        packed = raw if isinstance(raw, bytes) else raw.encode()
        ts, lon, lat, kws, props = records.unpack_position(packed)
        # GET /v1/objects/{id} always carries `props` (null when none was given)
        return {**records.public_record(object_id, lon, lat, ts, kws, None, None),
                "props": records.props_object(props)}

    # --- subscriptions -------------------------------------------------------------------
    async def add_subscriptions(self, rows: list[Subscription]) -> None:
        """Send new subscriptions to the workers that own their regions (kNN ones with their
        first registration), all or nothing."""
        if self.outbox is not None:  # one step per tenant, each through its outbox
            for tenant, of_tenant in _by_tenant(rows).items():
                pipe: Any = OpsPipe()
                await self._add_subscriptions(of_tenant, pipe)
                await self.via_outbox(tenant, pipe.ops)
            return
        pipe = self.redis.pipeline(transaction=True)
        await self._add_subscriptions(rows, pipe)
        await pipe.execute()

    async def _add_subscriptions(self, rows: list[Subscription], pipe: Any) -> None:
        index = await self.current_index()
        per_worker: dict[str, list[wire.SubscriptionCopy]] = {}
        knn = [r for r in rows if r.spec["type"] == "knn"]
        regs = await self.knn_registrations(index, knn) if knn else {}
        for row in rows:
            msg = subscription_message(row)
            reg = regs.get(row.id)
            if reg is None:
                targets = targets_for_spec(index, row.spec, replicated=self.replicated)
            else:
                radius, targets = reg
                msg = wire.SubscriptionCopy(
                    id=row.id, tenant=row.tenant, spec=row.spec, expires_at=row.expires_at,
                    radius_m=radius if math.isfinite(radius) else None, epoch=1)
                key = names.knn_key(row.id)
                fields: dict[Any, Any] = knnreg.register_fields(1, radius, targets)
                pipe.hset(key, mapping=fields)
                pipe.expire(key, 30 * 24 * 3600)
            for w in targets:
                per_worker.setdefault(w, []).append(msg)
        for w, subs in per_worker.items():
            pipe.xadd(names.worker_stream(w), {b"m": wire.encode_entry(
                wire.SubsAdded(subs=subs, plan_version=index.version))})

    async def knn_registrations(self, index: GlobalIndex, rows: list[Subscription]
                                ) -> dict[str, tuple[float, set[str]]]:
        """Each kNN subscription's first radius and workers (`app.pipeline.knnreg`): every
        worker, unbounded, in the baseline modes (replicated, broadcast)."""
        if self.replicated or self.settings.knn_broadcast:
            return {r.id: (math.inf, set(index.workers)) for r in rows}
        now = time.time()
        plans = await self.plans_since(now - self.settings.window_s - self.settings.bucket_s,
                                       index)
        tenants = sorted({r.tenant for r in rows})
        pipe = self.redis.pipeline(transaction=False)
        for t in tenants:
            pipe.exists(names.events_key(t))
        events = dict(zip(tenants, map(bool, await pipe.execute()), strict=True))
        out: dict[str, tuple[float, set[str]]] = {}
        for row in rows:
            totals = await self._tenant_cell_totals(row.tenant, index, now)
            spec: dict[str, Any] = row.spec
            lon, lat = float(spec["point"][0]), float(spec["point"][1])
            radius = totals.radius(lon, lat, int(spec["k"]))
            out[row.id] = (radius, knnreg.workers_within(index, plans, lon, lat, radius,
                                                         events[row.tenant]))
        return out

    async def _tenant_cell_totals(self, tenant: str, index: GlobalIndex, now: float
                                  ) -> knnreg.CountGrid:
        held = self._cell_totals.get(tenant)
        if held is not None and now - held[0] < 1.0:
            return held[1]
        s = self.settings
        horizon = int((now - s.window_s) // s.bucket_s)
        pipe = self.redis.pipeline(transaction=False)
        # the window's buckets (a little past now: another process's clock), those listed
        read_totals(pipe, self._totals, list(index.workers), tenant,
                    range(horizon, int(now // s.bucket_s) + 3))
        got = await pipe.execute()
        totals = knnreg.CountGrid(index.grid,
                                  knnreg.cell_totals((r for per in got for r in per), horizon))
        self._cell_totals[tenant] = (now, totals)
        if len(self._cell_totals) > 1000:
            self._cell_totals.clear()
        return totals

    async def remove_subscriptions(self, rows: list[Subscription],
                                   reason: str = "deleted") -> None:
        index = await self.current_index()
        if self.outbox is not None:
            for tenant, of_tenant in _by_tenant(rows).items():
                ops: Any = OpsPipe()
                _remove_subscriptions(index, of_tenant, ops)
                await self.via_outbox(tenant, ops.ops)
        else:
            pipe = self.redis.pipeline(transaction=True)
            _remove_subscriptions(index, rows, pipe)
            await pipe.execute()
        ids = [r.id for r in rows]
        gone = wire.SubsGone(expired=ids) if reason == "expired" else wire.SubsGone(deleted=ids)
        try:  # best effort: the removal is done; a client listening is then just not told
            await self.redis.publish(names.channel(names.SUBS_CHANNEL, db_of(self.redis)),
                                     wire.encode_json(gone))
        except redis.exceptions.RedisError as exc:
            log.warning("could not announce the end of subscriptions %s: %s", ids[:5], exc)


def _remove_subscriptions(index: GlobalIndex, rows: list[Subscription], pipe: Any) -> None:
    msg = wire.encode_entry(wire.SubsRemoved(ids=[r.id for r in rows]))
    for w in index.workers:
        pipe.xadd(names.worker_stream(w), {b"m": msg})
    # A subscription that is gone cannot be read or resumed: its history and the id of its
    # last entry go too.
    for r in rows:
        pipe.delete(names.history_key(r.id))
        pipe.delete(names.knn_key(r.id))
        pipe.hdel(names.history_last_key(r.id), names.history_key(r.id))


def _by_tenant(rows: list[Subscription]) -> dict[str, list[Subscription]]:
    out: dict[str, list[Subscription]] = {}
    for r in rows:
        out.setdefault(r.tenant, []).append(r)
    return out


class OpsPipe:
    """Collects the writes of a step as commands for an outbox entry (the pipeline methods
    the subscription steps use)."""

    def __init__(self) -> None:
        self.ops: list[list[bytes]] = []

    def xadd(self, key: str, fields: dict[bytes, bytes]) -> None:
        self.ops.append(op("XADD", key, "*", *(x for kv in fields.items() for x in kv)))

    def hset(self, key: str, mapping: dict[Any, Any]) -> None:
        self.ops.append(op("HSET", key, *(x for kv in mapping.items() for x in kv)))

    def expire(self, key: str, seconds: int) -> None:
        self.ops.append(op("EXPIRE", key, seconds))

    def delete(self, key: str) -> None:
        self.ops.append(op("DEL", key))

    def hdel(self, key: str, *fields: str) -> None:
        self.ops.append(op("HDEL", key, *fields))


def read_history_sample(path: Path, grid: Grid) -> tuple[Any, Any, Any]:
    """The NDJSON sample of `GEOSWARM_HISTORY_SAMPLE` as cells for `history_plan`."""
    with path.open("rb") as f:
        records = (orjson.loads(line) for line in f if line.strip())
        return sample_cells(grid, records)


def make_plan(settings: Settings, workers: list[str], version: int) -> Plan:
    """The first plan of a worker set for the partitioning mode: SWARM §4.1.1's equal areas
    (swarm, uniform, replicated — the latter routes by no partition but keeps a valid plan),
    or the static grid cut by the cost model over a history sample (history)."""
    grid = grid_of(settings)
    if settings.partitioning == "history":
        path = settings.history_sample
        if path is None or not path.is_file():
            log.warning("partitioning=history but GEOSWARM_HISTORY_SAMPLE is %s; using the "
                        "uniform initial plan", "unset" if path is None else f"missing ({path})")
        else:
            cx, cy, rects = read_history_sample(path, grid)
            log.info("history plan from %s: %d objects, %d regions", path, cx.size,
                     rects.shape[0])
            return history_plan(grid, workers, cx, cy, rects, version=version)
    return initial_plan(grid, workers, version=version)


async def ensure_plan(redis: aioredis.Redis, settings: Settings, workers: list[str]) -> Plan:
    """Create the first plan (see `make_plan`) unless one for the same worker set exists, and
    make sure the partition id counter is past the plan's ids."""
    plan = await load_plan(redis)
    if plan is None or sorted(GlobalIndex(plan).workers) != sorted(workers):
        version = 1 if plan is None else plan.version + 1
        plan = make_plan(settings, workers, version)
        plan_json = plan.to_json()
        pipe = redis.pipeline(transaction=True)
        pipe.set(names.PLAN_KEY, plan_json)
        # the first plan of a worker set starts the history snapshot queries read
        pipe.rpush(names.PLAN_HISTORY, history_entry(plan_json, plan.version, time.time()))
        pipe.ltrim(names.PLAN_HISTORY, -names.PLAN_HISTORY_MAX, -1)
        await pipe.execute()
        # (not in the transaction: a cluster's transaction takes only commands on keys)
        await redis.publish(names.channel(names.PLAN_CHANNEL, db_of(redis)), str(plan.version))
    await redis.eval(ALLOCATE_IDS_SCRIPT, 1, names.PART_SEQ, part_seq_floor(plan), 0)
    return plan
