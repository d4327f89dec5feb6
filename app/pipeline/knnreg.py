"""Where a continuous kNN subscription is registered, and how its workers' lists are merged.

A kNN subscription is registered with a radius R on the workers that can hold objects within
R of its point: the owners of the partitions the circle overlaps under the current plan and,
while the tenant has events in the live window, under every plan valid within it (events stay
on the worker that stored them; SWARM §5.2's partition chains; moving objects travel with
their partitions). Each of them keeps the k nearest objects *within R* it holds
(`workers.knn`), and the merge script below combines their lists in the subscription's hash
`names.knn_key` (SSTD §6.3's merger, run by Redis: one decision point). The union holds the
k nearest overall as soon as it has k objects, since everything outside R is farther; with
fewer than k it is not a true top-k, so nothing is pushed and the radius grows. A list whose
k-th is far inside R makes the radius shrink, which retracts it from the workers that no
longer need it. The first radius comes from the workers' per-cell counts (AQWA §5: cells by
their farthest point, until they hold k records).

The hash holds, besides each registered worker's local list under its id:
- `_e`: the registration's epoch (a resize makes the next one; reports of an older epoch are
  ignored) and `_r`: its radius in metres (-1: unbounded, on every worker);
- `_p:<worker>` = epoch: a worker the registration was sent to and that has not reported yet;
- `_h:<plan version>:<worker>` = epoch: a handoff in flight to `worker` carries moving objects
  some local list held; the merged list waits until the receiver took them in.
- `_l:<worker>` = epoch: the worker was the only holder at its last report (no other list,
  no token), so it reports only the changes of its list that can change the merged one (its
  members or their order, or a k-th far inside the radius): its stored distances may be old.
  A report of another worker makes it report again first (a `_p:` token and a
  `wire.KnnRefresh` on its stream), so lists are never merged with old distances.
No list is pushed while a token of the current epoch is pending. A registration that reaches
a worker after the plan changed is forwarded by it to the owners under the newer plan, each
with its token (`workers.migration`), as range subscriptions are.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable
from typing import Any, NamedTuple

import numpy as np
import numpy.typing as npt
import orjson

from app.geo.geometry import EARTH_RADIUS_M, haversine_m
from app.geo.grid import Grid
from app.geo.index import GlobalIndex, Plan
from app.pipeline import names, wire
from app.pipeline.histories import APPEND_HISTORY_LUA
from app.pipeline.outbox import ENCODE_OPS_LUA

WORLD_M = 2.1e7  # beyond half the circumference every point is within reach
UNBOUNDED = -1.0  # `_r` of a registration on every worker
MIN_RADIUS_M = 50.0  # a shrink never goes below this (k objects at one spot)
GROW = 4.0  # a registration with fewer than k grows its radius this many times
SHRINK_AT = 4.0  # ...and shrinks to 2 x the k-th once the k-th is this far inside it
PENDING, HOLD = "_p:", "_h:"

# A worker's stream in a script: `STREAM_TEMPLATE` with the worker's id in place of its '@'.
STREAM_TEMPLATE = names.worker_stream("@")
STREAM_OF_LUA = """
local function stream_of(template, worker)
  local at = string.find(template, '@', 1, true)
  return string.sub(template, 1, at - 1) .. worker .. string.sub(template, at + 1)
end
"""

# With outboxes (a Redis Cluster: the workers' streams are in other hash slots than the hash),
# the scripts below write their messages to workers as one entry of the outbox of the hash's
# history group (`names.history_outbox`, their last KEY), relayed after the call
# (`app.pipeline.outbox`; a worker relays every such outbox at its start and in its
# maintenance, in case one that wrote an entry died before relaying it); without, they XADD
# them directly. `send(stream, payload)` in Lua does either.
SEND_LUA = ENCODE_OPS_LUA + """
local SENDS = {}
local function send(outbox, stream, payload)
  if outbox then
    SENDS[#SENDS + 1] = encode_op({'XADD', stream, '*', 'm', payload})
  else
    redis.call('XADD', stream, '*', 'm', payload)
  end
end
local function flush(outbox)
  if outbox and #SENDS > 0 then
    redis.call('XADD', outbox, '*', 'm', table.concat(SENDS))
    SENDS = {}
  end
end
"""

# One report, `merge(KEYS, ARGV)` below: KEYS[1] = gs:knn:<sub>, KEYS[2] = history stream,
# KEYS[3] = the history group's hash of last ids (field: the stream; see HISTORY_SCRIPT),
# KEYS[4] = its outbox (with outboxes). ARGV[1] = worker, ARGV[2] = its epoch, ARGV[3] = its
# local list JSON [[distance, id, lon, lat, kind]] in the workers' order (`nearer`), ARGV[4] =
# k, ARGV[5] = maxlen, ARGV[6] = ttl, ARGV[7] = tenant, ARGV[8] = the history's max age (ms),
# ARGV[9] = its housekeeping period (ms; see `append_history`), ARGV[10] = `STREAM_TEMPLATE`,
# ARGV[11] = the packed `wire.KnnRefresh` of this subscription and epoch (sent to a sole
# holder that must report again); ARGV[12..15] = the list's first k as pushed
# (`sole_rendering`: the neighbours' JSON, their ids joined by NUL, how many, the k-th
# distance or ''), or four empty strings: taken as the merged list when the reporter holds
# the registration alone, so that the merge decodes, sorts and encodes nothing then (a worker
# holds most lists alone); ARGV[16..] = tokens this report clears. Numbers the merge renders
# itself have 17 significant digits (cjson's encoding keeps 14): they read back as the very
# doubles the workers' JSON gives (in its shortest form). Returns {status, kth, sole}: status
# 1 = a new list was pushed, 0 = nothing changed or waiting, -1 = the report's epoch is
# stale, 2 = fewer than k within the radius (grow), 3 = the k-th is far inside the radius
# (shrink); kth as a string; sole 1 when the reporter is now the only holder (`_l:`).
#
# MERGE_SCRIPT makes many reports of one worker in one call (`merge_call` lays out its keys
# and arguments): a worker's step reports tens of lists, and one call each sent the script's
# text, which Redis hashed, every time.
MERGE_SCRIPT = APPEND_HISTORY_LUA + STREAM_OF_LUA + SEND_LUA + """
local function before(a, b)  -- bytewise: UTF-8 in code point order, as the workers order ids
  for i = 1, math.min(#a, #b) do
    local x, y = string.byte(a, i), string.byte(b, i)
    if x ~= y then return x < y end
  end
  return #a < #b
end
local function nearer(a, b)  -- as the workers order their lists: distance, id, point, kind
  if a[1] ~= b[1] then return a[1] < b[1] end
  if a[2] ~= b[2] then return before(a[2], b[2]) end
  if a[3] ~= b[3] then return a[3] < b[3] end
  if a[4] ~= b[4] then return a[4] < b[4] end
  return (a[5] or 0) < (b[5] or 0)
end
local function merge(KEYS, ARGV)
  local e = redis.call('HGET', KEYS[1], '_e')
  if not e then return {0, '', 0} end
  for i = 16, #ARGV do redis.call('HDEL', KEYS[1], ARGV[i]) end
  if ARGV[2] ~= e then
    if tonumber(ARGV[2]) < tonumber(e) then return {-1, '', 0} end
    return {0, '', 0}
  end
  local me = ARGV[1]
  redis.call('HSET', KEYS[1], me, ARGV[3])
  redis.call('HDEL', KEYS[1], '_p:' .. me)
  redis.call('EXPIRE', KEYS[1], 30 * 24 * 3600)
  local k = tonumber(ARGV[4])
  local lists = {}
  local waiting, alone = false, true
  local fields = redis.call('HGETALL', KEYS[1])
  for i = 1, #fields, 2 do
    local f = fields[i]
    if string.sub(f, 1, 1) == '_' then
      local t = string.sub(f, 1, 3)
      if (t == '_p:' or t == '_h:') and fields[i + 1] == e then
        waiting, alone = true, false
      elseif t == '_l:' and fields[i + 1] == e and f ~= '_l:' .. me then
        -- another sole holder's distances may be old: it reports again before any merge
        local w = string.sub(f, 4)
        redis.call('HDEL', KEYS[1], f)
        redis.call('HSET', KEYS[1], '_p:' .. w, e)
        send(KEYS[4], stream_of(ARGV[10], w), ARGV[11])
        waiting, alone = true, false
      end
    else
      if f ~= me then alone = false end
      lists[#lists + 1] = fields[i + 1]
    end
  end
  flush(KEYS[4])
  local sole = 0
  if alone then
    redis.call('HSET', KEYS[1], '_l:' .. me, e)
    sole = 1
  else
    redis.call('HDEL', KEYS[1], '_l:' .. me)
  end
  if waiting then return {0, '', sole} end
  local count, kth, key, payload
  if alone and ARGV[12] ~= '' then
    count, kth, key, payload = tonumber(ARGV[14]), ARGV[15], ARGV[13], ARGV[12]
  else
    local all = {}
    for _, list in ipairs(lists) do
      for _, n in ipairs(cjson.decode(list)) do all[#all + 1] = n end
    end
    table.sort(all, nearer)
    local top, ids, seen, last = {}, {}, {}, 0
    for _, n in ipairs(all) do
      if #top >= k then break end
      local held = (n[5] or 0) .. ':' .. n[2]
      if not seen[held] then
        -- an object handed off may be listed by its sender and its receiver for a moment
        seen[held] = true
        top[#top + 1] = '{"id":' .. cjson.encode(n[2]) .. string.format(
          ',"lon":%.17g,"lat":%.17g,"distance_m":%.17g}', n[3], n[4], n[1])
        ids[#ids + 1] = n[2]
        last = n[1]
      end
    end
    count, kth = #top, ''
    if count >= k then kth = string.format('%.17g', last) end
    key, payload = table.concat(ids, '\\0'), '[' .. table.concat(top, ',') .. ']'
  end
  local r = tonumber(redis.call('HGET', KEYS[1], '_r') or '-1')
  if count < k and r >= 0 then return {2, '', sole} end
  local want = 0
  if count >= k and (r < 0 or tonumber(kth) * 4 < r) then want = 3 end
  if redis.call('HGET', KEYS[1], '_merged') == key then return {want, kth, sole} end
  redis.call('HSET', KEYS[1], '_merged', key)
  local prev = redis.call('HGET', KEYS[3], KEYS[2]) or '0-0'
  local id = append_history(KEYS[2], prev, ARGV[5], ARGV[8], ARGV[6], ARGV[9], 'k', payload,
                            't', ARGV[7], 'p', prev)
  redis.call('HSET', KEYS[3], KEYS[2], id)
  if want == 3 then return {3, kth, sole} end
  return {1, kth, sole}
end
-- the call: KEYS = each report's keys (ARGV[8] of them each); ARGV[1..7] = worker, maxlen, ttl,
-- tenant, max age, housekeeping period, STREAM_TEMPLATE; ARGV[8] = keys per report; ARGV[9] =
-- c, the tokens every report clears, ARGV[10..9+c]; then 8 per report: epoch, local list, k,
-- refresh, and the four of the rendering. Returns each report's answer, in order.
local per, nclear = tonumber(ARGV[8]), tonumber(ARGV[9])
local first = 10 + nclear
local out = {}
for s = 0, (#ARGV - first + 1) / 8 - 1 do
  local a, ka = first + s * 8, s * per
  local argv = {ARGV[1], ARGV[a], ARGV[a + 1], ARGV[a + 2], ARGV[2], ARGV[3], ARGV[4], ARGV[5],
                ARGV[6], ARGV[7], ARGV[a + 3], ARGV[a + 4], ARGV[a + 5], ARGV[a + 6],
                ARGV[a + 7]}
  for i = 1, nclear do argv[15 + i] = ARGV[9 + i] end
  local keys = {KEYS[ka + 1], KEYS[ka + 2], KEYS[ka + 3]}
  if per == 4 then keys[4] = KEYS[ka + 4] end
  out[s + 1] = merge(keys, argv)
end
return out
"""

NO_SOLE_RENDERING: tuple[bytes, str, int, str] = (b"", "", 0, "")


def sole_rendering(local: list[tuple[float, str, float, float, Any]], k: int
                   ) -> tuple[bytes, str, int, str]:
    """MERGE_SCRIPT's ARGV[12..15] for a worker's local list (sorted as the workers sort them):
    its first k as the merged list when the worker holds it alone, rendered here."""
    head = local[:k]
    return (orjson.dumps([{"id": oid, "lon": x, "lat": y, "distance_m": d}
                          for d, oid, x, y, _ in head]),
            "\0".join([n[1] for n in head]), len(head),
            repr(head[-1][0]) if len(head) >= k else "")


class Report(NamedTuple):
    """One report of a local list to MERGE_SCRIPT: the subscription, the reporter's epoch of
    it, its local list (JSON), k, its packed `wire.KnnRefresh` and its `sole_rendering` (or
    NO_SOLE_RENDERING)."""

    sub: str
    epoch: int
    local: bytes
    k: int
    refresh: bytes
    rendering: tuple[bytes, str, int, str]


def merge_call(worker: str, tenant: str, history: tuple[int, int, int, int],
               reports: list[Report], outbox: bool, clear: tuple[str, ...] = ()
               ) -> tuple[list[str], list[Any]]:
    """MERGE_SCRIPT's keys and arguments for `reports` of `worker` (of one history group, on a
    Redis Cluster: a script's keys share a hash slot), each clearing the tokens `clear`.
    `history`: the history streams' maxlen, ttl, max age (ms) and housekeeping period (ms);
    `outbox`: the messages to workers go to the history group's outbox (`names`)."""
    max_len, ttl, max_age_ms, period_ms = history
    keys: list[str] = []
    args: list[Any] = [worker, max_len, ttl, tenant, max_age_ms, period_ms, STREAM_TEMPLATE,
                       4 if outbox else 3, len(clear), *clear]
    for r in reports:
        stream, last = names.history_keys(r.sub)
        keys += [names.knn_key(r.sub), stream, last]
        if outbox:
            keys.append(names.history_outbox(r.sub))
        args += [r.epoch, r.local, r.k, r.refresh, *r.rendering]
    return keys, args


# A resize: KEYS[1] = gs:knn:<sub>, KEYS[2] = its history group's outbox (with outboxes).
# ARGV[1] = the epoch it was decided on, ARGV[2] = the new
# radius, ARGV[3] = the registration (a packed SubsAdded of the next epoch), ARGV[4] = the
# retraction (a packed KnnRetract), ARGV[5] = `STREAM_TEMPLATE`, ARGV[6..] = the
# workers of the new registration. Every worker that held the old one and is not among them
# (a list, a pending token) gets the retraction; tokens of the old epoch go. 1 when applied,
# 0 when the epoch moved on meanwhile (or the subscription is gone).
RESIZE_SCRIPT = STREAM_OF_LUA + SEND_LUA + """
local e = redis.call('HGET', KEYS[1], '_e')
if not e or e ~= ARGV[1] then return 0 end
local ne = tostring(tonumber(e) + 1)
local targets = {}
for i = 6, #ARGV do targets[ARGV[i]] = true end
local holders = {}
for _, f in ipairs(redis.call('HKEYS', KEYS[1])) do
  local t = string.sub(f, 1, 3)
  if string.sub(f, 1, 1) ~= '_' then
    holders[f] = true
    if not targets[f] then redis.call('HDEL', KEYS[1], f) end
  elseif t == '_p:' then
    holders[string.sub(f, 4)] = true
    redis.call('HDEL', KEYS[1], f)
  elseif t == '_l:' then
    redis.call('HDEL', KEYS[1], f)
  elseif t == '_h:' then
    local w = string.match(f, '^_h:[^:]*:(.*)$')
    if w then holders[w] = true end
    redis.call('HDEL', KEYS[1], f)
  end
end
redis.call('HSET', KEYS[1], '_e', ne, '_r', ARGV[2])
for i = 6, #ARGV do
  redis.call('HSET', KEYS[1], '_p:' .. ARGV[i], ne)
  send(KEYS[2], stream_of(ARGV[5], ARGV[i]), ARGV[3])
end
for w, _ in pairs(holders) do
  if not targets[w] then send(KEYS[2], stream_of(ARGV[5], w), ARGV[4]) end
end
flush(KEYS[2])
return 1
"""

# A worker leaves a registration whose circle no longer reaches its partitions (it handed them
# off with the registration; the tenant has no events): KEYS[1] = gs:knn:<sub>, ARGV[1] = the
# worker, ARGV[2] = the epoch it holds. Its list, token and sole mark go, if the registration
# is still of that epoch (the receivers of the handoff hold it, and the holds of the handoff
# make the merged list wait for them). 1 when it left, 0 otherwise.
LEAVE_SCRIPT = """
if redis.call('HGET', KEYS[1], '_e') ~= ARGV[2] then return 0 end
redis.call('HDEL', KEYS[1], ARGV[1], '_p:' .. ARGV[1], '_l:' .. ARGV[1])
return 1
"""

# A worker is gone (failover): KEYS[1] = gs:knn:<sub>, ARGV[1] = the worker. Its list and the
# tokens that wait for it (or say it holds alone) leave the hash.
DROP_WORKER_SCRIPT = """
for _, f in ipairs(redis.call('HKEYS', KEYS[1])) do
  if f == ARGV[1] or f == '_p:' .. ARGV[1] or f == '_l:' .. ARGV[1]
     or string.match(f, '^_h:[^:]*:(.*)$') == ARGV[1] then
    redis.call('HDEL', KEYS[1], f)
  end
end
return 1
"""


def hold_field(plan_version: int, worker: str) -> str:
    return f"{HOLD}{plan_version}:{worker}"


def stored_radius(radius: float) -> str:
    return repr(radius) if math.isfinite(radius) else repr(UNBOUNDED)


def read_radius(raw: bytes | str | None) -> float:
    r = float(raw) if raw is not None else UNBOUNDED
    return math.inf if r < 0 else r


def circle_workers(plans: Iterable[GlobalIndex], lon: float, lat: float, radius: float
                   ) -> set[str]:
    """The workers owning partitions within `radius` of the point under any of `plans`."""
    out: set[str] = set()
    for plan in plans:
        out |= (plan.workers_for_circle(lon, lat, radius) if math.isfinite(radius)
                else set(plan.workers))
    return out


class CountGrid:
    """The window's records per grid cell (summed over workers) for first radii: AQWA §5's
    scan of the cells by their farthest point from the query point, until they hold k."""

    def __init__(self, grid: Grid, counts: dict[int, int]) -> None:
        self.grid = grid
        cid = np.fromiter(counts, dtype=np.int64, count=len(counts))
        self.n = np.fromiter(counts.values(), dtype=np.int64, count=len(counts))
        self.x0 = (grid.bounds[0] + (cid % grid.nx) * grid.cell_width).astype(np.float64)
        self.y0 = (grid.bounds[1] + (cid // grid.nx) * grid.cell_height).astype(np.float64)
        self.total = int(self.n.sum())

    def radius(self, lon: float, lat: float, k: int) -> float:
        """A radius around (lon, lat) that holds at least k records by the counts; infinite
        when they hold fewer. Cells near the point are tried first: any cells holding k give
        a radius that surely holds k, and when it does not reach past them it is also the
        smallest such. Records may be positions of one moving object, and the counts lag:
        the merge grows the radius when it holds fewer than k after all."""
        if self.total < k:
            return math.inf
        everything = np.arange(len(self.n))
        for half in (0.5, 4.0, 30.0):
            near = np.flatnonzero((np.abs(self.x0 - lon) <= half)
                                  & (np.abs(self.y0 - lat) <= half))
            if int(self.n[near].sum()) >= k:
                break
        else:
            return self._scan(everything, lon, lat, k)
        radius = self._scan(near, lon, lat, k)
        # Any cell entirely within that radius lies within its arc of latitude: the scan
        # over that band is the scan over every cell.
        arc = math.degrees(radius / EARTH_RADIUS_M) if math.isfinite(radius) else 180.0
        h = self.grid.cell_height
        band = np.flatnonzero(np.minimum(np.abs(self.y0 - lat), np.abs(self.y0 + h - lat))
                              <= arc)
        return self._scan(band, lon, lat, k)

    def _scan(self, cells: npt.NDArray[np.int64], lon: float, lat: float, k: int) -> float:
        g = self.grid
        x0, y0, n = self.x0[cells], self.y0[cells], self.n[cells]
        far = np.zeros(len(cells))
        for dx in (0.0, 1.0):
            for dy in (0.0, 0.5, 1.0):  # corners, and the middle of the sides (large cells)
                far = np.maximum(far, haversine_m(lon, lat, x0 + dx * g.cell_width,
                                                  y0 + dy * g.cell_height))
        order = np.argsort(far, kind="stable")
        i = int(np.searchsorted(np.cumsum(n[order]), k))
        if i >= len(order):
            return math.inf
        radius = float(far[order][i]) * 1.05 + 1.0
        return radius if radius < WORLD_M else math.inf


def cell_totals(raw_fields: Iterable[bytes | None], horizon_bucket: int) -> dict[int, int]:
    """Cell id -> records, summed over workers' `wire.CellCounts` of the window's buckets."""
    out: dict[int, int] = {}
    for raw in raw_fields:
        if raw is None:
            continue
        for bucket, ids, counts in wire.decode_cell_counts(raw).buckets:
            if bucket < horizon_bucket or not ids:
                continue
            for c, n in zip(np.frombuffer(ids, dtype="<i8").tolist(),
                            np.frombuffer(counts, dtype="<i8").tolist(), strict=True):
                out[c] = out.get(c, 0) + n
    return out


class PlanHistory:
    """The plans of `names.PLAN_HISTORY` by version (an index costs milliseconds to build),
    read from the end of the list until a known version; shared by the api's snapshot
    queries and the workers' kNN registrations."""

    def __init__(self) -> None:
        self.plans: dict[int, tuple[float, GlobalIndex]] = {}

    def absorb(self, raw: list[Any]) -> bool:
        """Take entries read from the end of the list; True when they reach a known one."""
        entries = [orjson.loads(r) for r in raw]
        known = any(int(e["version"]) in self.plans for e in entries)
        for e in entries:
            version = int(e["version"])
            if version not in self.plans:
                self.plans[version] = (float(e["valid_from"]),
                                       GlobalIndex(Plan.from_dict(e["plan"])))
        if len(self.plans) > 2 * names.PLAN_HISTORY_MAX:
            for version in sorted(self.plans)[:-names.PLAN_HISTORY_MAX]:
                del self.plans[version]
        return known

    def read(self, lrange: Callable[[int], list[Any]]) -> None:
        """New entries through `lrange(n)` (the last n entries)."""
        n = 1
        while True:
            raw = lrange(n)
            if self.absorb(raw) or len(raw) < n:
                return
            n *= 4

    def since(self, horizon: float, current: GlobalIndex) -> list[GlobalIndex] | None:
        """The plans (of the current worker set) valid at some time since `horizon`, or None
        when the history does not reach back that far."""
        members = sorted(current.workers)
        out: list[GlobalIndex] = []
        for version in sorted(self.plans, reverse=True):
            if version > current.version:
                continue
            valid_from, plan = self.plans[version]
            if sorted(plan.workers) != members:
                return None  # the cluster was resized meanwhile
            out.append(plan)
            if valid_from <= horizon:
                return out
        return out if self.plans and min(self.plans) == 1 else None


def workers_within(current: GlobalIndex, plans: list[GlobalIndex] | None, lon: float,
                   lat: float, radius: float, events: bool) -> set[str]:
    """The workers a registration of `radius` goes to: owners within it under the current
    plan and, while the tenant may have events in the window (`names.events_key`), under
    the window's other `plans` (every worker when the history falls short: None). Moving
    objects travel with their partitions: without events the current owners hold
    everything."""
    if not math.isfinite(radius):
        return set(current.workers)
    if not events:
        return circle_workers([current], lon, lat, radius)
    if plans is None:
        return set(current.workers)
    return circle_workers([current, *plans], lon, lat, radius)


def registration_workers(history: PlanHistory, current: GlobalIndex, horizon: float,
                         lon: float, lat: float, radius: float, events: bool = True
                         ) -> set[str]:
    """`workers_within` with the plans of `history` valid since `horizon`."""
    plans = history.since(horizon, current) if events and math.isfinite(radius) else []
    return workers_within(current, plans, lon, lat, radius, events)


def register_fields(epoch: int, radius: float, workers: Iterable[str]) -> dict[str, str]:
    """The hash fields a new registration writes (with its messages, atomically)."""
    return {"_e": str(epoch), "_r": stored_radius(radius),
            **{PENDING + w: str(epoch) for w in workers}}
