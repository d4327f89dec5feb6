"""The WebSocket hub of one api process: pushes history entries to listening clients.

Workers append matches to per-subscription history streams and publish which subscriptions
changed; the hub wakes the connections that listen to them and each connection's pump reads
its subscriptions' histories from its own positions, so a slow client only delays itself.
Delivery implements one tiny protocol (send / close), as Tile38's delivery does.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import time
from collections import deque
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol

import msgspec
import orjson
import redis.asyncio as aioredis
import redis.exceptions
from redis.asyncio.client import PubSub
from starlette.concurrency import run_in_threadpool

from app.core.metrics import HOPS, WS_CLOSED, WS_CONNECTIONS, WS_MESSAGES
from app.core.pipelines import Pipelines
from app.core.redis import db_of, pubsub_pool
from app.pipeline import names, wire
from app.services import subscriptions

if TYPE_CHECKING:
    from app.core.security import Principal
    from app.core.state import AppState

log = logging.getLogger(__name__)

_PUSHED, _RECENT, _READ = (WS_MESSAGES.labels(path) for path in ("push", "recent", "read"))

DETECT_NAMES = ("inside", "enter", "exit")
_DETECT = tuple(name.encode() for name in DETECT_NAMES)
SHUTDOWN_STEP_S = 5.0
MAX_SEQ = 18446744073709551615


class Transport(Protocol):
    async def send(self, frame: str) -> None: ...
    async def close(self, code: int, reason: str) -> None: ...


# --- cursors ------------------------------------------------------------------------------

Position = tuple[int, int, int]  # (ms, seq, index within the entry): deliver what is after


def parse_entry_id(eid: str) -> tuple[int, int]:
    ms, _, seq = eid.partition("-")
    return int(ms), int(seq or 0)


def parse_cursor(cursor: str) -> Position | None:
    """A cursor is `<history entry id>:<index>`; None when it is not one we issued."""
    try:
        eid, _, idx = cursor.partition(":")
        ms, seq = parse_entry_id(eid)
        i = int(idx)
    except ValueError:
        return None
    if ms < 0 or seq < 0 or i < 0 or "-" not in eid or not idx:
        return None
    if ms >= MAX_SEQ or seq >= MAX_SEQ:
        return None  # beyond Redis' 64-bit stream ids (and we add 1 to ms)
    return ms, seq, i


def format_cursor(eid: str, index: int) -> str:
    return f"{eid}:{index}"


WHOLE_ENTRY = 2**31  # an index past the last message of any entry: "all of that entry"
GAP_MESSAGE = "history before the cursor has been trimmed"


def position_cursor(pos: Position) -> str:
    """The cursor of a (non-start) position: resuming with it continues right after `pos`."""
    return format_cursor(f"{pos[0]}-{pos[1]}", pos[2])


def cursor_after_entry(eid: str) -> str:
    """The cursor that resumes right after history entry `eid` (which may be trimmed)."""
    return format_cursor(eid, WHOLE_ENTRY)


def gap_line(sub_id: str, cursor: str) -> bytes:
    """Matches after the client's position were trimmed before it read them; delivery goes on
    from `cursor` (a client that reconnects resumes with it)."""
    return orjson.dumps({"type": "gap", "subscription": sub_id, "cursor": cursor,
                         "message": GAP_MESSAGE})


def start_position(server_ms: int) -> Position:
    """Everything written from server time `server_ms` on (delivery starts at listen)."""
    return server_ms - 1, MAX_SEQ, MAX_SEQ


def is_start(pos: Position) -> bool:
    return pos[1] == MAX_SEQ


def entry_start(pos: Position) -> str:
    ms, seq, _ = pos
    if seq == MAX_SEQ:
        return f"{ms + 1}-0"
    return f"{ms}-{seq}"


@dataclass
class HistoryBatch:
    lines: list[bytes]
    position: Position
    full: bool
    first_unread_ms: int | None = None  # server time of the oldest entry read that was unread


Parsed = tuple[str, tuple[int, int], wire.MatchRefs, dict[bytes, bytes]]
# One read of a connection's histories takes at most this many entries and stops adding entries
# once they hold this many matches: what a slow client's catch-up holds in memory is bounded.
HISTORY_ENTRIES_PER_READ = 2048
HISTORY_LINES_PER_READ = 10_000
NO_REFS = wire.MatchRefs([], b"")  # a kNN entry references no records


async def read_history(pipelines: Pipelines, sub_id: str, pos: Position, count: int,
                       tenant: str) -> HistoryBatch:
    """Messages of `sub_id` after `pos`, at most about `count` entries."""
    return (await read_histories(pipelines, {sub_id: pos}, count, tenant))[sub_id]


def _fields(raw: Any) -> dict[bytes, bytes]:
    """A stream entry's fields: a flat list of names and values as Redis sends them, or the
    dict redis-py's pipelines make of it."""
    return raw if isinstance(raw, dict) else dict(zip(raw[0::2], raw[1::2], strict=True))


async def read_histories(pipelines: Pipelines, positions: dict[str, Position], count: int,
                         tenant: str, max_lines: int | None = None) -> dict[str, HistoryBatch]:
    """Many subscriptions' messages after their positions in two round trips: one pipeline of
    XRANGEs, one of HMGETs for the records they reference (each record stored once). With
    `max_lines`, the entries read stop once they hold that many matches (at least one entry is
    read): the records fetched and rendered stay bounded however large the entries are, and a
    subscription cut short comes back `full` (read it again)."""
    subs = list(positions)
    replies = await pipelines.execute(
        [("XRANGE", names.history_key(sub), entry_start(positions[sub]), "+", "COUNT", count)
         for sub in subs])
    parsed: dict[str, list[Parsed]] = {}
    wanted: dict[bytes, set[str]] = {}
    cut: set[str] = set()
    lines = 0
    for sub, entries in zip(subs, replies, strict=True):
        rows = parsed[sub] = []
        for eid_b, raw in entries:
            if max_lines is not None and lines >= max_lines:
                cut.add(sub)
                break
            fields = _fields(raw)
            eid = eid_b.decode()
            refs = wire.decode_refs(fields[b"m"]) if b"m" in fields else NO_REFS
            lines += max(1, len(refs.record_ids))
            rows.append((eid, parse_entry_id(eid), refs, fields))
            if b"b" in fields:
                rkey = names.records_key(tenant, int(fields[b"b"])).encode()
                wanted.setdefault(rkey, set()).update(refs.record_ids)
    records: dict[bytes, dict[str, bytes | None]] = {}
    if wanted:
        order = [(rk, list(rids)) for rk, rids in wanted.items()]
        got = await pipelines.execute([("HMGET", rk, *rids) for rk, rids in order])
        for (rk, rids), vals in zip(order, got, strict=True):
            records[rk] = dict(zip(rids, vals, strict=True))
    out = {sub: render_entries(sub, parsed[sub], records, positions[sub], count, tenant)
           for sub in subs}
    for sub in cut:
        out[sub].full = True
    return out


def render_entries(sub_id: str, parsed: list[Parsed], records: dict[bytes, dict[str, bytes | None]],
                   pos: Position, count: int, tenant: str) -> HistoryBatch:
    """The messages of the entries after `pos`; a `gap` first when the entry right after `pos`
    was trimmed (each entry names its predecessor, so a quiet subscription is never taken for
    a trimmed one)."""
    sub_json = orjson.dumps(sub_id)
    lines: list[bytes] = []
    last = pos
    first_unread_ms: int | None = None
    at = (pos[0], pos[1])
    for eid, key, refs, fields in parsed:
        if key == at:  # the entry of the cursor itself: only what follows its index
            if b"k" in fields or pos[2] >= len(refs.record_ids) - 1:
                continue
        elif first_unread_ms is None and not is_start(pos):
            prev = fields.get(b"p")
            if prev is not None and prev != b"0-0" and parse_entry_id(prev.decode()) > at:
                lines.append(gap_line(sub_id, cursor_after_entry(prev.decode())))
        if first_unread_ms is None:
            first_unread_ms = key[0]
        if b"k" in fields:  # kNN: the new ordered neighbour list
            cur = orjson.dumps(format_cursor(eid, 0))
            lines.append(b'{"type":"knn","subscription":' + sub_json + b',"cursor":' + cur
                         + b',"neighbors":' + fields[b"k"] + b"}")
            last = (key[0], key[1], 0)
            continue
        recs = records.get(names.records_key(tenant, int(fields[b"b"])).encode(), {})
        lines += render_matches(sub_json, eid, refs, recs, pos[2] if key == at else -1)
        last = (key[0], key[1], max(0, len(refs.record_ids) - 1))
    return HistoryBatch(lines=lines, position=last, full=len(parsed) >= count,
                        first_unread_ms=first_unread_ms)


def render_matches(sub_json: bytes, eid: str, refs: wire.MatchRefs,
                   recs: Mapping[str, bytes | None], after: int = -1) -> list[bytes]:
    """The match messages of one history entry, skipping indexes up to `after`."""
    rids, codes = refs.record_ids, refs.detect
    prefix = b'{"type":"match","subscription":' + sub_json + b',"cursor":"' + eid.encode()
    get = recs.get
    n = len(_INDEXES)
    # (a record that outlived its retention is left out)
    return [b"".join((prefix, _INDEXES[idx] if idx < n else _index(idx),
                      _DETECT_OBJECT[codes[idx]], rec, b"}"))
            for idx in range(after + 1, len(rids)) if (rec := get(rids[idx])) is not None]


def _index(idx: int) -> bytes:
    """The middle of a match message: the cursor's index, and the start of its `detect`."""
    return b':%d","detect":"' % idx


_INDEXES = [_index(i) for i in range(4096)]  # most entries hold fewer matches
_DETECT_OBJECT = [b'%s","object":' % name for name in _DETECT]


def caught_up(pos: Position, prev: tuple[int, int], key: tuple[int, int]) -> bool:
    """Whether a connection at `pos` has everything up to `prev`, the entry before `key`."""
    if is_start(pos):  # a start position: everything from server time pos[0] + 1 on
        return prev < (pos[0] + 1, 0) <= key
    return (pos[0], pos[1]) == prev


async def resume_positions(redis: aioredis.Redis, tenant: str, cursors: dict[str, Position],
                           max_age_s: float, now: float) -> dict[str, tuple[Position, bool]]:
    """Where each subscription resumed from a client's cursor continues, and whether entries
    after the cursor were trimmed before the client read them (then it continues after the
    last trimmed one). Two reads per subscription, pipelined: the entries at and after the
    cursor, and the id of the last entry ever written (which outlives a quiet stream)."""
    subs = list(cursors)
    pipe = redis.pipeline(transaction=False)
    for sub in subs:
        pipe.xrange(names.history_key(sub), min=entry_start(cursors[sub]), count=2)
        pipe.hget(names.history_last_key(sub), names.history_key(sub))
    replies = await pipe.execute()
    out: dict[str, tuple[Position, bool]] = {}
    for n, sub in enumerate(subs):
        pos = cursors[sub]
        at = (pos[0], pos[1])
        entries, last = replies[2 * n], replies[2 * n + 1]
        after = [(parse_entry_id(e.decode()), f) for e, f in entries
                 if parse_entry_id(e.decode()) > at]
        if after:
            prev = after[0][1].get(b"p")
            if prev is None:  # written before entries named their predecessor
                trimmed = parse_entry_id(entries[0][0].decode()) > at
                out[sub] = (pos, trimmed)
            elif prev != b"0-0" and parse_entry_id(prev.decode()) > at:
                ms, seq = parse_entry_id(prev.decode())
                out[sub] = ((ms, seq, WHOLE_ENTRY), True)
            else:
                out[sub] = (pos, False)
        elif last is not None:
            ms, seq = parse_entry_id(last.decode())
            out[sub] = ((ms, seq, WHOLE_ENTRY), True) if (ms, seq) > at else (pos, False)
        else:
            # Nothing ever written (or not since an upgrade from per-subscription markers):
            # whether the cursor's successors existed cannot be known, so a cursor older than
            # the retention is told it may have a gap.
            out[sub] = (pos, pos[0] < (now - max_age_s) * 1000)
    return out


# --- connections --------------------------------------------------------------------------

class ConnectionClosed(Exception):
    def __init__(self, code: int, reason: str) -> None:
        super().__init__(reason)
        self.code = code
        self.reason = reason


@dataclass(slots=True)
class Recent:
    """A history entry as its notification told it (`RecentEntries`)."""

    key: tuple[int, int]
    eid: str
    packed: bytes  # its wire.MatchRefs
    records: dict[str, bytes]  # the records of its notification (shared by its entries)
    stamp: tuple[float, float] | None  # for the hops `send` and `total`, as a push's


class RecentEntries:
    """The entries of recent notifications that a connection could not take when they came
    (its outbox was full, or it was behind on that subscription), with the records they
    reference. Its pump catches up from here, in order, instead of reading the history
    streams, while they are here: bounded in bytes, the oldest notifications' entries go first,
    and what is gone is read from Redis."""

    def __init__(self, max_bytes: int) -> None:
        self.max_bytes = max_bytes
        self.by_sub: dict[str, dict[tuple[int, int], Recent]] = {}  # by the previous entry
        self.notes: deque[tuple[list[tuple[str, tuple[int, int]]], int]] = deque()
        self.bytes = 0

    def add(self, kept: list[tuple[str, tuple[int, int], Recent]],
            records: dict[str, bytes]) -> None:
        """Keep the entries of one notification (`kept`: subscription, previous entry id,
        entry), then forget the oldest notifications' beyond the bound."""
        size = sum(map(len, records.values())) + sum(len(r.packed) + 200 for _, _, r in kept)
        if size > self.max_bytes:
            return
        for sub, prev, recent in kept:
            self.by_sub.setdefault(sub, {})[prev] = recent
        self.notes.append(([(sub, prev) for sub, prev, _ in kept], size))
        self.bytes += size
        while self.bytes > self.max_bytes:
            gone, size = self.notes.popleft()
            self.bytes -= size
            for sub, prev in gone:
                waiting = self.by_sub.get(sub)
                if waiting is not None:
                    waiting.pop(prev, None)
                    if not waiting:
                        del self.by_sub[sub]

    def after(self, sub: str, pos: Position) -> Recent | None:
        """The entry that follows position `pos` of `sub`, if it is here."""
        waiting = self.by_sub.get(sub)
        if not waiting:
            return None
        if is_start(pos):
            return next((r for prev, r in waiting.items() if caught_up(pos, prev, r.key)), None)
        return waiting.get((pos[0], pos[1]))


class Outbox:
    """The messages waiting in memory for one connection, and their size in bytes (both are
    bounded: ws_queue_max, ws_queue_max_bytes)."""

    __slots__ = ("lines", "bytes", "stamps")

    def __init__(self) -> None:
        self.lines: list[bytes] = []
        self.bytes = 0
        # pushed matches: (when the hub got them, when their batch was appended, how many),
        # for the hops `send` and `total` (app.pipeline.hops)
        self.stamps: list[tuple[float, float, int]] = []

    def append(self, line: bytes) -> None:
        self.lines.append(line)
        self.bytes += len(line)

    def extend(self, lines: list[bytes], size: int | None = None,
               stamp: tuple[float, float] | None = None) -> None:
        self.lines.extend(lines)
        self.bytes += sum(map(len, lines)) if size is None else size
        if stamp is not None:
            stamps = self.stamps
            if stamps and stamps[-1][:2] == stamp:  # the same notification's: one stamp
                stamps[-1] = (*stamp, stamps[-1][2] + len(lines))
            else:
                stamps.append((*stamp, len(lines)))

    def take(self) -> tuple[list[bytes], list[tuple[float, float, int]]]:
        """The lines waiting, and the stamps of the pushed matches among them."""
        lines, stamps = self.lines, self.stamps
        self.lines, self.bytes, self.stamps = [], 0, []
        return lines, stamps

    def __len__(self) -> int:
        return len(self.lines)


@dataclass(eq=False)
class Connection:
    transport: Transport
    principal: Principal
    positions: dict[str, Position] = field(default_factory=dict)
    # server time each subscription was listened to: an entry waits for this client from
    # max(its own time, this time), so a resume is not judged by the age of what it resumes
    listened_ms: dict[str, int] = field(default_factory=dict)
    listen_all_from: Position | None = None
    # unlistened while listening to all: never listened to again implicitly (only by a
    # `listen` naming them), or their next match would replay them from listen_all_from
    excluded: set[str] = field(default_factory=set)
    dirty: set[str] = field(default_factory=set)  # to deliver: from memory, or read
    must_read: set[str] = field(default_factory=set)  # of those: read from the histories
    # of the others: the newest entry a notification announced (RecentEntries has it)
    expect: dict[str, tuple[int, int]] = field(default_factory=dict)
    # positions inside an entry (a client's cursor short of the entry's last message): the
    # rest of that entry is read from the history before anything is pushed after it
    inside: set[str] = field(default_factory=set)
    wake: asyncio.Event = field(default_factory=asyncio.Event)
    outbox: Outbox = field(default_factory=Outbox)
    closed: tuple[int, str] | None = None
    slot: str | None = None  # its slot in the tenant's connection quota (services.quotas)

    def mark(self, subs: Iterable[str]) -> None:
        """Read these subscriptions' histories (what is new is not known here)."""
        subs = list(subs)
        self.dirty.update(subs)
        self.must_read.update(subs)
        self.wake.set()

    def mark_recent(self, sub: str, key: tuple[int, int]) -> None:
        """Entry `key` of `sub` could not be pushed: it and those before it are delivered
        from the hub's recent entries (or read, if they are not all there)."""
        self.dirty.add(sub)
        if key > self.expect.get(sub, (0, 0)):
            self.expect[sub] = key
        self.wake.set()

    def forget(self, sub: str) -> None:
        self.dirty.discard(sub)
        self.must_read.discard(sub)
        self.expect.pop(sub, None)
        self.inside.discard(sub)

    def close_soon(self, code: int, reason: str) -> None:
        if self.closed is None:
            self.closed = (code, reason)
        self.wake.set()


class Subscriber(PubSub):
    """The hub's pub/sub connection. The client reconnects by itself (and subscribes again)
    when Redis drops the connection, as Redis does to a subscriber whose unread notifications
    outgrow its output buffer: every (re)connection may have missed notifications, and the hub
    reads back what they would have told (`Hub.recover`)."""

    def __init__(self, hub: Hub) -> None:
        super().__init__(pubsub_pool(hub.redis, hub.state.redis_url))
        self.hub = hub

    async def on_connect(self, connection: Any) -> None:
        await super().on_connect(connection)
        self.hub.reconnected()


class Hub:
    def __init__(self, state: AppState) -> None:
        self.state = state
        self.settings = state.settings
        self.redis = state.redis
        self.db = db_of(self.redis)
        # this deployment's channel (`names.channel`) -> the name handled
        self.channels = {names.channel(n, self.db): n for n in (
            names.NOTIFY_CHANNEL, names.REVOKED_CHANNEL, names.SUBS_CHANNEL, names.PLAN_CHANNEL)}
        self.conns: set[Connection] = set()
        self.by_sub: dict[str, set[Connection]] = {}
        self.all_by_tenant: dict[str, set[Connection]] = {}
        self.recent = RecentEntries(self.settings.ws_recent_bytes)
        self._task: asyncio.Task[None] | None = None
        self._recovery: asyncio.Task[None] | None = None

    async def start(self) -> None:
        self._task = asyncio.create_task(self._listen_notifications(), name="hub-notify")

    async def stop(self) -> None:
        for conn in list(self.conns):
            conn.close_soon(1001, "server shutting down")
        if self._recovery is not None:
            self._recovery.cancel()
        if self._task is not None:
            self._task.cancel()
            # bounded: a shutdown must not hang on a pub/sub read that ignores cancellation
            with contextlib.suppress(asyncio.CancelledError, TimeoutError, Exception):
                await asyncio.wait_for(self._task, SHUTDOWN_STEP_S)

    async def _listen_notifications(self) -> None:
        while True:
            pubsub: Any = Subscriber(self)  # (redis-py's aclose is untyped)
            try:
                await pubsub.subscribe(*self.channels)
                async for msg in pubsub.listen():
                    if msg.get("type") != "message":
                        continue
                    channel = self.channels.get(msg["channel"].decode(), "")
                    try:
                        await self._on_message(channel, msg["data"])
                    except Exception:  # a failing handler loses its message, not the channel
                        log.exception("hub: handling a message on %s failed; listening on",
                                      channel)
            except asyncio.CancelledError:
                raise
            except (redis.exceptions.RedisError, OSError) as exc:
                log.warning("hub: notification channel lost (%s); reconnecting", exc)
                await asyncio.sleep(0.5)
            except Exception:  # a bug in a handler must not end delivery for this process
                log.exception("hub: notification listener failed; restarting it")
                await asyncio.sleep(0.5)
            finally:
                # its own connection, outside the client's pool: close it (bounded)
                with contextlib.suppress(Exception):
                    await asyncio.wait_for(asyncio.shield(pubsub.aclose()), SHUTDOWN_STEP_S)

    def reconnected(self) -> None:
        if self._recovery is None or self._recovery.done():
            self._recovery = asyncio.create_task(self.recover(), name="hub-recover")
        else:  # one under way may have listed the subscriptions already: again after it
            previous = self._recovery

            async def after() -> None:
                with contextlib.suppress(Exception):
                    await previous
                await self.recover()

            self._recovery = asyncio.create_task(after(), name="hub-recover")

    async def recover(self) -> None:
        """After notifications may have been lost: every connection reads its subscriptions'
        histories, and one listening to all its tenant's subscriptions also starts on those
        it never heard of (a lost notification was their first)."""
        for conn in self.conns:
            conn.mark(conn.positions)
        tenants = {conn.principal.tenant for conn in self.conns
                   if conn.listen_all_from is not None and conn.closed is None}
        for tenant in tenants:
            try:
                await self._discover(tenant)
            except Exception:  # the next reconnect tries again
                log.exception("hub: listing the subscriptions of %s after lost notifications "
                              "failed", tenant)

    async def _discover(self, tenant: str) -> None:
        def ids() -> list[str]:
            with self.state.sessions() as session:
                return subscriptions.tenant_ids(session, tenant)

        subs = await run_in_threadpool(ids)
        for i in range(0, len(subs), 1000):
            chunk = subs[i:i + 1000]
            pipe = self.redis.pipeline(transaction=False)
            for sub in chunk:  # each in its history group's hash
                pipe.hget(names.history_last_key(sub), names.history_key(sub))
            lasts = await pipe.execute()
            written = [sub for sub, last in zip(chunk, lasts, strict=True) if last is not None]
            for conn in list(self.all_by_tenant.get(tenant, ())):
                start = conn.listen_all_from
                if start is None or conn.closed is not None:
                    continue
                new = {sub: start for sub in written
                       if sub not in conn.positions and sub not in conn.excluded}
                if new:
                    self.listen(conn, new, start[0])

    async def _on_message(self, channel: str, data: bytes) -> None:
        try:
            if channel == names.NOTIFY_CHANNEL:
                note = wire.decode_notification(data)
                if isinstance(note, wire.HistoryAppended):
                    self.handle_history_appended(note)
                else:
                    self.handle_subs_changed(note)
            elif channel == names.PLAN_CHANNEL:
                # A new plan version: reload at once rather than at the next check.
                if self.state.router is not None:
                    await self.state.router.refresh()
            elif channel == names.REVOKED_CHANNEL:
                self.handle_key_revoked(wire.decode_revoked(data))
            elif channel == names.SUBS_CHANNEL:
                self.handle_subs_gone(wire.decode_gone(data))
        except msgspec.DecodeError as exc:
            log.error("hub: undecodable message on %s: %s", channel, exc)

    def handle_subs_changed(self, note: wire.SubsChanged) -> None:
        for sub in note.subs:
            for conn in self.by_sub.get(sub, ()):
                conn.mark((sub,))
        for conn in self.all_by_tenant.get(note.tenant, ()):
            conn.mark(note.subs)

    def handle_key_revoked(self, msg: wire.KeyRevoked) -> None:
        for conn in list(self.conns):
            if conn.principal.key_id == msg.key:
                conn.close_soon(1008, "API key revoked")

    def handle_subs_gone(self, msg: wire.SubsGone) -> None:
        for sub in msg.deleted:
            for conn in list(self.by_sub.get(sub, ())):
                self.unlisten(conn, [sub])
        for sub in msg.expired:
            for conn in list(self.by_sub.get(sub, ())):
                conn.outbox.append(orjson.dumps({"type": "expired", "subscription": sub}))
                self.unlisten(conn, [sub])
                conn.wake.set()

    def handle_history_appended(self, note: wire.HistoryAppended) -> None:
        """New history entries, pushed by a worker with the id of the entry before each: a
        connection whose position is exactly there gets the entry from memory; any other
        reads the history stream (its pump), so nothing is skipped or sent twice."""
        tenant = note.tenant
        records = note.records
        received = time.time()
        if note.written_at:
            HOPS.observe("notify", received - note.written_at)
        stamp = (received, note.sent_at) if note.sent_at else None
        all_conns = frozenset(self.all_by_tenant.get(tenant, ()))
        by_sub = self.by_sub
        limit = self.settings.ws_queue_max
        limit_bytes = self.settings.ws_queue_max_bytes or math.inf
        keep = self.recent.max_bytes > 0
        kept: list[tuple[str, tuple[int, int], Recent]] = []
        woken: set[Connection] = set()
        pushed = 0
        for sub, prev_id, eid, packed in note.entries:
            conns = by_sub.get(sub)
            if conns is None:
                if not all_conns:
                    continue
                targets: tuple[Connection, ...] | frozenset[Connection] = all_conns
            elif not all_conns or all_conns <= conns:
                # (a connection listening to every subscription is in both once it listens
                # to this one: it is visited once)
                targets = tuple(conns)
            else:
                targets = (*conns, *(all_conns - conns))
            ms, _, seq = eid.partition("-")
            key = (int(ms), int(seq or 0))
            prev: tuple[int, int] | None = None
            lines: list[bytes] | None = None
            size = 0
            last_index = 0
            missed = False  # a connection could not take it now
            for conn in targets:
                pos = conn.positions.get(sub)
                if pos is None:
                    if (conn.listen_all_from is None or conn.closed is not None
                            or sub in conn.excluded):
                        continue
                    pos = conn.listen_all_from
                    self.listen(conn, {sub: pos}, pos[0], read=not keep)
                if (pos[0], pos[1]) >= key:
                    continue  # already delivered by the pump
                if conn.inside and sub in conn.inside:
                    conn.mark((sub,))  # the rest of its entry first, read from the history
                    continue
                if prev is None:
                    prev = parse_entry_id(prev_id)
                if not caught_up(pos, prev, key):
                    # behind: what comes before it is still to be delivered (by the pump)
                    self._missed(conn, sub, key, keep)
                    missed = True
                    continue
                if lines is None:
                    refs = wire.decode_refs(packed)
                    lines = render_matches(orjson.dumps(sub), eid, refs, records)
                    size = sum(map(len, lines))
                    last_index = max(0, len(refs.record_ids) - 1)
                if (len(conn.outbox) + len(lines) > limit
                        or conn.outbox.bytes + size > limit_bytes):
                    # The in-memory queue is full (in messages or in bytes): the pump sends
                    # this once it has room, from the recent entries or from the history
                    # stream (and closes the connection if it falls too far behind).
                    self._missed(conn, sub, key, keep)
                    missed = True
                    continue
                conn.positions[sub] = (key[0], key[1], last_index)
                conn.outbox.extend(lines, size, stamp)
                pushed += len(lines)
                woken.add(conn)
            if missed and keep and prev is not None:  # (a miss parsed prev)
                kept.append((sub, prev, Recent(key, eid, packed, records, stamp)))
        if pushed:
            _PUSHED.inc(pushed)
        for conn in woken:
            conn.wake.set()
        if kept:
            self.recent.add(kept, records)

    @staticmethod
    def _missed(conn: Connection, sub: str, key: tuple[int, int], keep: bool) -> None:
        if keep:
            conn.mark_recent(sub, key)
        else:
            conn.mark((sub,))

    async def key_revoked(self, key_id: str) -> None:
        await self.redis.publish(names.channel(names.REVOKED_CHANNEL, self.db),
                                 wire.encode_json(wire.KeyRevoked(key_id)))

    # --- listening ----------------------------------------------------------------------
    def register(self, conn: Connection) -> None:
        self.conns.add(conn)
        WS_CONNECTIONS.set(len(self.conns))

    def unregister(self, conn: Connection) -> None:
        self.conns.discard(conn)
        WS_CONNECTIONS.set(len(self.conns))
        if conn.closed is not None and conn.closed[0] != 1000:
            WS_CLOSED.labels(str(conn.closed[0])).inc()
        self.unlisten(conn, list(conn.positions))
        if conn.listen_all_from is not None:
            self.all_by_tenant.get(conn.principal.tenant, set()).discard(conn)

    def listen(self, conn: Connection, positions: dict[str, Position], at_ms: int,
               read: bool = True, inside: Iterable[str] = ()) -> None:
        """Deliver these subscriptions from `positions` on (`read`: read their histories now;
        not when the caller delivers the entry that made it listen; `inside`: those whose
        position is a client's cursor inside an entry)."""
        for sub, pos in positions.items():
            conn.excluded.discard(sub)
            conn.expect.pop(sub, None)
            if conn.positions.get(sub) != pos:  # (listened again from where it is: as it was)
                conn.inside.discard(sub)
            conn.positions[sub] = pos
            conn.listened_ms[sub] = at_ms
            self.by_sub.setdefault(sub, set()).add(conn)
        conn.inside.update(sub for sub in inside if sub in positions)
        if read:
            conn.mark(positions)

    def listen_all(self, conn: Connection, start: Position) -> None:
        if conn.listen_all_from is None:
            conn.listen_all_from = start
            self.all_by_tenant.setdefault(conn.principal.tenant, set()).add(conn)

    def unlisten(self, conn: Connection, subs: Iterable[str]) -> None:
        for sub in subs:
            conn.positions.pop(sub, None)
            conn.listened_ms.pop(sub, None)
            conn.forget(sub)
            listeners = self.by_sub.get(sub)
            if listeners is not None:
                listeners.discard(conn)
                if not listeners:
                    del self.by_sub[sub]

    async def lagging(self, waiting_since_ms: int) -> bool:
        """A connection with an unread entry waiting since longer than ws_max_lag_s cannot
        keep up. Only unread entries count: a quiet subscription never makes a client slow."""
        return waiting_since_ms < (await self.server_ms()) - self.settings.ws_max_lag_s * 1000

    async def server_ms(self) -> int:
        sec, usec = await self.redis.time()
        return int(sec) * 1000 + int(usec) // 1000

    # --- the pump -----------------------------------------------------------------------
    async def pump(self, conn: Connection) -> None:
        """Send this connection's pending history, frames of many messages, until closed."""
        s = self.settings
        # Notifications are at-most-once; a lost pub/sub connection already marks everything on
        # reconnect, so this poll is only a rare safety net (cheap for small listeners).
        while conn.closed is None:
            try:
                await asyncio.wait_for(conn.wake.wait(), timeout=s.ws_poll_s)
            except TimeoutError:
                conn.mark(conn.positions)  # a missed notification costs ≤ poll
            conn.wake.clear()
            if conn.closed is not None:
                break
            if conn.outbox:
                await self._send_outbox(conn)
            subs = list(conn.dirty)
            conn.dirty.clear()
            if conn.listen_all_from is not None:
                for sub in subs:
                    if sub not in conn.positions and sub not in conn.excluded:
                        self.listen(conn, {sub: conn.listen_all_from}, conn.listen_all_from[0])
            subs = self.catch_up(conn, subs, s.ws_queue_max)
            if conn.outbox:
                await self._send_outbox(conn)
            await self.deliver(conn, subs, s.ws_queue_max)

    def catch_up(self, conn: Connection, subs: list[str], budget: int) -> list[str]:
        """Deliver from the recent entries, into the outbox, what the pushes missed; the
        subscriptions that must be read from their histories instead. Within the outbox's
        bounds (and at most HISTORY_LINES_PER_READ matches): what does not fit stays marked
        for the next round."""
        to_read: list[str] = []
        room = min(budget, self.settings.ws_queue_max, HISTORY_LINES_PER_READ)
        room_bytes = self.settings.ws_queue_max_bytes or math.inf
        outbox = conn.outbox
        n = 0
        for i, sub in enumerate(subs):
            pos = conn.positions.get(sub)
            want = conn.expect.pop(sub, None)
            if pos is None or sub in conn.must_read or want is None:
                conn.must_read.discard(sub)
                if pos is not None:
                    to_read.append(sub)
                continue
            sub_json = orjson.dumps(sub)
            full = False
            while (pos[0], pos[1]) < want:
                entry = self.recent.after(sub, pos)
                if entry is None:
                    break
                refs = wire.decode_refs(entry.packed)
                lines = render_matches(sub_json, entry.eid, refs, entry.records)
                size = sum(map(len, lines))
                if outbox and (len(outbox) + len(lines) > room
                               or outbox.bytes + size > room_bytes):
                    full = True  # (an entry larger than the bounds goes alone)
                    break
                outbox.extend(lines, size, entry.stamp)
                n += len(lines)
                pos = (entry.key[0], entry.key[1], max(0, len(refs.record_ids) - 1))
                conn.positions[sub] = pos
            if full:  # this one and the rest in the next round, as they were marked
                conn.mark_recent(sub, want)
                conn.dirty.update(subs[i + 1:])
                break
            if (pos[0], pos[1]) < want:
                to_read.append(sub)  # not all here (forgotten, or another's still to come)
        if n:
            _RECENT.inc(n)
        return to_read

    async def deliver(self, conn: Connection, subs: list[str], budget: int) -> None:
        tenant = conn.principal.tenant
        per_round = 512  # subscriptions read in one pipelined round trip
        for i in range(0, len(subs), per_round):
            positions = {sub: conn.positions[sub] for sub in subs[i:i + per_round]
                         if sub in conn.positions}
            if not positions:
                continue
            # Bounded memory per read, whatever the backlog: at most HISTORY_ENTRIES_PER_READ
            # entries and about HISTORY_LINES_PER_READ matches (the rest is read next time).
            count = max(1, min(256, budget, HISTORY_ENTRIES_PER_READ // len(positions)))
            batches = await read_histories(self.state.pipelines, positions, count, tenant,
                                           max_lines=HISTORY_LINES_PER_READ)
            waiting = [max(batch.first_unread_ms, conn.listened_ms.get(sub, 0))
                       for sub, batch in batches.items() if batch.first_unread_ms is not None]
            if waiting and await self.lagging(min(waiting)):
                conn.close_soon(1013, "client cannot keep up; resume with the last cursor")
                return
            lines: list[bytes] = []
            for sub, batch in batches.items():
                if conn.positions.get(sub) != positions[sub]:
                    # Unlistened, or a push advanced it while we read: what we read may hold
                    # entries after the pushed one (their notification came first and found
                    # the position short of them), so read again from the new position.
                    if sub in conn.positions:
                        conn.mark((sub,))
                    continue
                lines += batch.lines
                if batch.position != positions[sub]:  # at the end of an entry read now
                    conn.inside.discard(sub)
                conn.positions[sub] = batch.position
                if batch.full:
                    conn.mark((sub,))
            if lines:
                if conn.outbox:
                    # Pushed while the pump was busy (a send the client was slow to take):
                    # it comes before what was read, which starts where the pushes ended.
                    await self._send_outbox(conn)
                _READ.inc(len(lines))
                await self._send(conn, lines)

    async def _send_outbox(self, conn: Connection) -> None:
        lines, stamps = conn.outbox.take()
        await self._send(conn, lines)
        if stamps:
            sent = time.time()
            for received, sent_at, n in stamps:
                HOPS.observe("send", sent - received, n)
                HOPS.observe("total", sent - sent_at, n)

    async def _send(self, conn: Connection, lines: list[bytes]) -> None:
        chunk = 200
        for i in range(0, len(lines), chunk):
            frame = b"\n".join(lines[i:i + chunk]).decode()
            try:
                await asyncio.wait_for(conn.transport.send(frame),
                                       timeout=self.settings.ws_send_timeout_s)
            except TimeoutError:
                conn.close_soon(1013, "client cannot keep up; resume with the last cursor")
                raise ConnectionClosed(1013, "send timed out") from None
