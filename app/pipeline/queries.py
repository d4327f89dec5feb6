"""Snapshot queries over the live window: the aggregator (CheetahGIS §IV) that fans a query
out to the workers holding the records it can see and merges their answers, knowing how many
answers to wait for.

Which workers: the owners of the partitions the query's region overlaps under the current
plan and under every older plan still valid within the window (SSTD's versioned mapping,
SWARM §5.2's parent partitions: a worker keeps the records it stored after their partition
moves on). A query part goes straight to each worker (`names.query_stream`), and the worker
answers it once a read of its stream, made after the part was sent, reached the stream's end
and what it read is processed: it sees every object accepted before the query, without
waiting in line behind the matching of the entries after it; `as_of` keeps later arrivals out
of every round of it. A failed-over
worker's part travels in its stream instead, behind the entries routed there before it, which
its adopter processes. A worker that does not answer fails the query (503, naming it): never
a silently partial result.

Rounds: one round answers most queries exactly. Merging per-worker lists cut at a limit is
exact up to the smallest cut-off among the cut lists; when `latest` removed records and fewer
than the limit are left below it, the round is repeated with a larger per-worker limit.
`latest` answers are checked against every worker's latest record of each moving object
(`QueryPart.latest_of`): the record kept is the latest of all, not only of one worker.
"""

from __future__ import annotations

import asyncio
import functools
import heapq
import logging
import secrets
import time
from collections import Counter
from collections.abc import Awaitable, Callable, Iterable
from dataclasses import dataclass
from typing import Any, NamedTuple

import msgspec
import orjson
import redis.asyncio as aioredis

from app.archive.layout import decode_cut
from app.core.config import Settings
from app.core.metrics import COUNT_QUERIES
from app.core.pipelines import Batch, ClientPipelines, Pipelines
from app.core.redis import run_script
from app.geo.grid import Grid
from app.geo.index import GlobalIndex
from app.pipeline import names, wire
from app.pipeline.cellcounts import CellCounts, HeldCounts
from app.pipeline.cluster import entry_order, heartbeat_fresh
from app.pipeline.inbox import REPLIES, Inbox
from app.pipeline.records import public_record
from app.pipeline.router import Router
from app.pipeline.wire import STALE_CUT

log = logging.getLogger(__name__)

QUERY_TTL_S = 3600  # how long the outcome of a query answered later (202) can be read
# An answer given at once is stored after it is sent (off its path): a `GET` of its id that
# reaches another api process first waits up to this long after the id was made for it.
STORE_GRACE_S = 2.0
COUNTS_WAIT_S = 1.0  # how long a count waits for the per-cell counts to catch up
MAX_ROUNDS = 8  # per-worker limit x4 each round: enough for any limit up to 10 000 x 4^7
QUERY_STREAM_LEN = 10_000  # parts kept in a worker's query stream (answered ones are trimmed)

# The first wait for an answer rides on the round trip that sends the parts (`_Run.first_wait`);
# longer waits are made after it. Bounded, as the parts may not have been sent.
FIRST_WAIT_S = 0.05

PLAN_ATTEMPTS = 5  # a query planned with a plan that changed before it was sent starts again

# Send a query part to one worker: straight (its query stream), or in its stream when it has
# failed over (its adopter processes that stream, not the query stream). Returns 1 if
# straight, 0 if in the stream, -1 if not sent: the newest plan of the history is not the one
# the query was planned with (its workers may miss a newer owner).
# KEYS: worker stream, query stream, adopter key, plan history; ARGV: the part, the query
# stream's length, the plan version the query was planned with ('' for any). With outboxes (a
# Redis Cluster: the plan history is in another hash slot than the worker's streams) it is
# called without the version and the history, and the history is read once every part is sent
# (`_Run.gather`): plan versions only grow, so a newest version still the one planned with
# was the newest when each part was sent.
SEND_PART_SCRIPT = """
if ARGV[3] ~= '' then
  local newest = redis.call('LINDEX', KEYS[4], -1)
  if newest and string.match(string.sub(newest, 1, 40), '^{"version":(%d+),') ~= ARGV[3] then
    return -1
  end
end
if redis.call('EXISTS', KEYS[3]) == 1 then
  redis.call('XADD', KEYS[1], '*', 'm', ARGV[1])
  return 0
end
redis.call('XADD', KEYS[2], 'MAXLEN', '~', ARGV[2], '*', 'm', ARGV[1])
return 1
"""


class QueryFailed(Exception):
    """A query that cannot be answered exactly (a worker did not answer, or failed)."""


class StalePlan(Exception):
    """The plan changed after the query chose its workers: it is planned again."""


class StaleCut(Exception):
    """A worker dropped archived records the query expected it to hold (its archive cut
    moved past the one the query read): the query reads the cut again."""


ARCHIVE = names.ARCHIVE_WORKER
ARCHIVE_JOBS_LEN = 10_000  # parts kept in the archive's job stream (answered ones are deleted)


SortKey = Callable[[wire.FoundRecord], tuple[Any, ...]]


def newest_first(r: wire.FoundRecord) -> tuple[Any, ...]:
    return (-r.ts, r.id, -r.at)


def top_terms(terms: dict[str, int], k: int) -> list[tuple[str, int]]:
    """The k most frequent terms, ties by term: those as frequent as the k-th count (found
    among the counts alone) sorted, not every term (a large region has thousands: the sort
    of all of them by a Python key cost ms)."""
    if not terms or k <= 0:
        return []
    kth = heapq.nlargest(k, terms.values())[-1]
    return sorted(((t, n) for t, n in terms.items() if n >= kth),
                  key=lambda t: (-t[1], t[0]))[:k]


def nearest_first(r: wire.FoundRecord) -> tuple[Any, ...]:
    return (r.distance_m, r.id, -r.ts, -r.at)


def merge_listed(replies: list[wire.QueryReply], key: SortKey,
                 keep: Callable[[wire.FoundRecord], bool], limit: int
                 ) -> tuple[list[wire.FoundRecord], bool, bool]:
    """Merge per-worker lists sorted by `key`, keeping the records `keep` accepts. Returns
    (the first `limit` records, whether more matched, whether the answer is exact): a list
    cut at its limit hides what lies after its last record, so only merged records up to the
    smallest such cut-off are certain; if fewer than `limit` are, the round must be repeated
    with a larger per-worker limit."""
    cutoff: tuple[Any, ...] | None = None
    for reply in replies:
        if reply.truncated and reply.records:
            last = key(reply.records[-1])
            cutoff = last if cutoff is None or last < cutoff else cutoff
    merged = sorted((r for reply in replies for r in reply.records if keep(r)), key=key)
    if cutoff is None:
        return merged[:limit], len(merged) > limit, True
    certain = [r for r in merged if key(r) <= cutoff]
    if len(certain) >= limit:
        return certain[:limit], True, True
    return certain, True, False


def plan_workers(index: GlobalIndex, query: wire.SnapshotQuery) -> set[str]:
    """The owners under a plan of the partitions the query's region overlaps (every worker
    for a query without a region)."""
    if query.bbox is not None:
        return index.workers_for_bbox(query.bbox)
    if query.circle is not None:
        return index.workers_for_circle(*query.circle)
    return set(index.workers)


class QueryService:
    """Runs snapshot queries for one api process; their state lives in Redis, so that any api
    process answers `GET /v1/queries/{id}`."""

    def __init__(self, settings: Settings, redis: aioredis.Redis, router: Router,
                 pipelines: Pipelines | None = None) -> None:
        self.settings = settings
        self.redis = redis
        # a query's rounds (parts sent, answers awaited): `redis`'s pipelines unless given
        self.pipelines = pipelines if pipelines is not None else ClientPipelines(redis)
        self.router = router
        self.counts = CellCounts(redis)
        self.send_part = redis.register_script(SEND_PART_SCRIPT)
        self._tasks: set[asyncio.Task[None]] = set()
        # replies straight from the workers on this host (`open_inbox`), else through Redis
        self.inbox: Inbox | None = None

    async def open_inbox(self) -> None:
        """Take replies straight from the workers that reach this process's socket under the
        data dir (`app.pipeline.inbox`); not with outboxes (a Redis Cluster's deployment)."""
        if self.router.outbox is not None:
            return
        inbox = Inbox(self.settings.data_dir.resolve() / "inbox")
        if await inbox.start():
            self.inbox = inbox

    # --- the public side -----------------------------------------------------------------
    async def submit(self, tenant: str, query: wire.SnapshotQuery, wait_s: float
                     ) -> tuple[dict[str, Any], Callable[[], Awaitable[None]] | None]:
        """Start a query and wait up to `wait_s` for it. The public body: `{"id", "status":
        "done", "results", "sources", "truncated"}`, `{"id", "status": "running"}` or
        `{"id", "status": "failed", "error"}`; with an outcome given now, how to keep it for
        `GET /v1/queries/{id}`, to run once the answer is sent (off the answer's path: a
        Redis round trip and an encoding of every result)."""
        started = time.time()
        query_id = new_query_id(started)
        outcome = _Outcome(asyncio.get_running_loop().create_future())
        task = asyncio.create_task(self._run(query_id, tenant, query, started, outcome),
                                   name=f"query-{query_id}")
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        try:
            body = await asyncio.wait_for(asyncio.shield(outcome.body), timeout=wait_s)
        except TimeoutError:
            if outcome.body.done():  # done as the wait ended
                body = outcome.body.result()
            else:
                # From now on `_run` stores the outcome. Only now can anyone ask for it: its
                # state is stored before the id is given out (unless the outcome was stored
                # meanwhile).
                outcome.polled = True
                await self.pipelines.execute([("SET", names.query_key(query_id), orjson.dumps(
                    {"tenant": tenant, "status": "running", "started": started,
                     "deadline": started + self.settings.query_timeout_s}),
                    "EX", QUERY_TTL_S, "NX")])
                return {"id": query_id, "status": "running"}, None
        return body, functools.partial(self._store, query_id, tenant, started, body,
                                       self.settings.query_answer_keep_s)

    async def status(self, tenant: str, query_id: str) -> dict[str, Any] | None:
        """The public body of a query of this tenant, or None (unknown, or another tenant's)."""
        if not query_id.isascii() or len(query_id) > 64:
            return None
        key = names.query_key(query_id)
        [raw] = await self.pipelines.execute([("GET", key)])
        made = query_id_time(query_id)
        # (an id's time is another process's clock, or made up: never wait past the grace)
        until = min(made, time.time()) + STORE_GRACE_S if made is not None else 0.0
        while raw is None and time.time() < until:
            # made moments ago: its answer may be on its way to Redis (`submit`)
            await asyncio.sleep(0.01)
            [raw] = await self.pipelines.execute([("GET", key)])
        if raw is None:
            return None
        doc = orjson.loads(raw)
        if doc.get("tenant") != tenant:
            return None
        if doc["status"] == "running" and time.time() > doc["deadline"] + 5:
            # the api process running it stopped before it could store the outcome
            return {"id": query_id, "status": "failed",
                    "error": "the api process running the query stopped; run it again"}
        return {"id": query_id, **{k: v for k, v in doc.items()
                                   if k not in ("tenant", "started", "deadline")}}

    async def stop(self) -> None:
        for task in list(self._tasks):
            task.cancel()
        if self.inbox is not None:
            await self.inbox.stop()

    async def _store(self, query_id: str, tenant: str, started: float, body: dict[str, Any],
                     keep_s: float = QUERY_TTL_S) -> None:
        """Keep a query's outcome for `GET /v1/queries/{id}`, `keep_s` seconds."""
        doc = {"tenant": tenant, "started": started,
               "deadline": started + self.settings.query_timeout_s,
               **{k: v for k, v in body.items() if k != "id"}}
        try:
            await self.pipelines.execute(
                [("SET", names.query_key(query_id), orjson.dumps(doc), "PX",
                  max(1, int(keep_s * 1000)))])
        except Exception as exc:
            log.warning("could not store the outcome of query %s: %s", query_id, exc)

    async def _run(self, query_id: str, tenant: str, query: wire.SnapshotQuery,
                   started: float, outcome: _Outcome) -> None:
        try:
            body = {"id": query_id, "status": "done", **await self.execute(tenant, query)}
        except QueryFailed as exc:
            body = {"id": query_id, "status": "failed", "error": str(exc)}
        except Exception as exc:  # Redis away, a bug: the query fails, the process lives
            log.exception("snapshot query %s failed", query_id)
            body = {"id": query_id, "status": "failed",
                    "error": f"the query could not run: {type(exc).__name__}: {exc}"}
        if not outcome.body.done():
            outcome.body.set_result(body)
        if outcome.polled:  # else `submit` gave the outcome, and how to keep it
            await self._store(query_id, tenant, started, body)

    # --- evaluation ----------------------------------------------------------------------
    async def execute(self, tenant: str, query: wire.SnapshotQuery) -> dict[str, Any]:
        """`{"results", "sources", "truncated"}` of a query over the live window. Its
        workers come from the plans this process knows; each part is sent only if the
        newest plan is still the one they came from (`SEND_PART_SCRIPT`), so no round trip
        reads the plan history unless it changed."""
        for _ in range(PLAN_ATTEMPTS):
            try:
                return await self._execute(tenant, query)
            except StalePlan:
                await self.router.refresh()
                index = await self.router.current_index()
                await self.router.plans_since(0.0, index)  # the new entries of the history
            except StaleCut:
                pass  # the next attempt reads the cut again
        raise QueryFailed(f"the partition plan or the archive changed {PLAN_ATTEMPTS} times "
                          "while the query ran; run it again")

    def reads_archive(self, query: wire.SnapshotQuery, as_of: float) -> bool:
        """Whether a query's time range reaches before the live window."""
        return query.t_from is not None and query.t_from < as_of - self.settings.window_s

    async def archive_cut(self) -> dict[str, int]:
        """The archive cut (`app.archive.layout`), once a query runner is there to read it."""
        pipe = self.redis.pipeline(transaction=False)
        pipe.hgetall(names.RUNNERS_KEY)
        pipe.hgetall(names.ARCHIVE_CUT)
        runners, cut = await pipe.execute()
        now = time.time()
        if not any(heartbeat_fresh(b, now, self.settings.worker_dead_after_s)
                   for b in runners.values()):
            raise QueryFailed(
                "the time range reaches before the live window (from < "
                f"{now - self.settings.window_s:.3f}, epoch seconds) and no query runner is "
                "running to read the archive: start `geoswarm query-runner` (it needs Java "
                "17+), or ask for the last window_s only")
        return decode_cut(cut)

    async def _execute(self, tenant: str, query: wire.SnapshotQuery) -> dict[str, Any]:
        as_of = time.time()
        deadline = as_of + self.settings.query_timeout_s
        index = await self.router.current_index()
        targets = await self.targets(index, query, as_of)
        # `latest` answers are checked with every worker holding part of the window
        everyone = (await self.targets(index, wire.SnapshotQuery(type="keyword"), as_of)
                    if query.latest else [])
        version = "" if self.router.replicated else str(index.version)
        cut = await self.archive_cut() if self.reads_archive(query, as_of) else None
        run = _Run(self, tenant, query, as_of, deadline, everyone, version, cut)
        if query.type == "count" and cut is None:
            counted = await self.count_from_metadata(tenant, query, index, targets, run)
            COUNT_QUERIES.labels("workers" if counted is None else "metadata").inc()
            if counted is not None:
                return _count_body(counted)
        if query.type in ("count", "topk_terms"):
            replies = await run.round(targets, 0)
            verified = await run.verified(replies)
            archived = {id(r) for reply in replies if reply.worker == ARCHIVE
                        for r in reply.records}
            sources = run.sources(
                sum(r.count for r in replies if r.worker != ARCHIVE)
                + sum(id(r) not in archived for r in verified),
                sum(r.count for r in replies if r.worker == ARCHIVE)
                + sum(id(r) in archived for r in verified))
            counted = sum(sources.values())
            if query.type == "count":
                return _count_body(counted, sources)
            terms: Counter[str] = Counter()
            for reply in replies:
                terms.update(reply.terms)
            for rec in verified:
                terms.update(rec.keywords)
            top = top_terms(terms, query.k)
            return {"results": [{"term": t, "count": c} for t, c in top],
                    "sources": sources, "truncated": len(terms) > query.k}
        if (query.type == "knn" and not query.latest and not self.router.replicated
                and len(targets) > 1 and cut is None):
            found = await self.knn_near_first(tenant, query, index, run)
            if found is not None:
                return found
        limit = query.k if query.type == "knn" else query.limit
        key = nearest_first if query.type == "knn" else newest_first
        per_worker = limit
        for _ in range(MAX_ROUNDS):
            replies = await run.round(targets, per_worker)
            keep = await run.latest_filter(replies)
            records, more, exact = merge_listed(replies, key, keep, limit)
            if exact:
                results = [_public(r, query.type == "knn") for r in records]
                archived = {id(r) for reply in replies if reply.worker == ARCHIVE
                            for r in reply.records}
                n_archive = sum(id(r) in archived for r in records)
                return {"results": results,
                        "sources": run.sources(len(results) - n_archive, n_archive),
                        "truncated": more}
            per_worker *= 4
        raise QueryFailed(f"no exact answer after {MAX_ROUNDS} rounds (too many records of "
                          "moving objects superseded by later ones); narrow the query")

    async def knn_near_first(self, tenant: str, query: wire.SnapshotQuery,
                             index: GlobalIndex, run: _Run) -> dict[str, Any] | None:
        """knn in two steps (CheetahGIS): the owner of the point's partition finds its k
        nearest; only the workers holding records within the k-th of those distances (under
        every plan of the window) are asked, and only that far. None when the owner holds
        k or fewer (every worker is asked then, as for any query: whether more than k match,
        `truncated`, is only known so when the owner holds more)."""
        assert query.point is not None
        px, py = query.point
        owner = index.worker_of_point(px, py)
        first = (await run.round([owner], query.k))[0]
        if len(first.records) < query.k or not first.truncated:
            return None
        reach = first.records[query.k - 1].distance_m
        others = [w for w in await self.targets(
            index, wire.SnapshotQuery(type="count", circle=(px, py, reach)), run.as_of)
            if w != owner]
        replies = [first]
        if others:
            near = _Run(self, tenant, msgspec.structs.replace(query, max_distance_m=reach),
                        run.as_of, run.deadline, [], run.version, run.cut)
            replies += await near.round(others, query.k)
        records, more, exact = merge_listed(replies, nearest_first, lambda r: True, query.k)
        if not exact:
            return None
        results = [_public(r, True) for r in records]
        return {"results": results, "sources": {"live": len(results)}, "truncated": True}

    async def count_from_metadata(self, tenant: str, query: wire.SnapshotQuery,
                                  index: GlobalIndex, targets: list[str], run: _Run
                                  ) -> int | None:
        """A count over a bbox with whole cells inside, answered from the workers' per-cell
        counts for those cells and by the workers for the cells the bbox cuts (CheetahGIS).
        The counts are used once each worker's include every entry its stream held when the
        query started (so they see every object accepted before it); None when they do not
        apply (a time range, keywords, `latest`, a failed-over worker) or do not catch up
        within COUNTS_WAIT_S: the workers count everything then."""
        if (query.bbox is None or query.keywords or query.latest or query.t_from is not None
                or query.t_to is not None or self.router.replicated or not targets):
            return None
        cells = whole_cells(index.grid, query.bbox)
        if cells is None:
            return None
        # One round trip: the part of the cells the box cuts, counted by the workers (first,
        # so that they start at once), failovers, and the counts that changed since this
        # process read them (with the mark of the entry they count up to: one script reads
        # both, one state of them). Each worker answers with the entry it had processed,
        # having written its counts that far: what "accepted before the query" means for the
        # counts, which are used once they include it (read after the parts were sent, they
        # may include later entries too).
        # the buckets of the window (a little past now: another api process's clock)
        buckets = range(int((run.as_of - self.settings.window_s) // self.settings.bucket_s),
                        int(run.as_of // self.settings.bucket_s) + 3)
        pipe = Batch()
        border = _Run(self, tenant, msgspec.structs.replace(query, skip_cells=cells),
                      run.as_of, run.deadline, [], run.version)
        sending = border.send(pipe, targets, 0, straight=False)
        adopters = len(pipe)
        for w in targets:
            pipe.execute_command("GET", names.adopter_key(w))
        # (read once every worker answered, having written its counts: they are then caught
        # up without a read more, unless a worker took longer than FIRST_WAIT_S)
        sending = border.first_wait(pipe, sending, len(targets))
        reading = self.counts.read(pipe, targets, tenant, buckets)
        got = await self.pipelines.execute(pipe.command_stack,
                                           block_s=FIRST_WAIT_S * len(targets))
        if any(a is not None for a in got[adopters:adopters + len(targets)]):
            # (the parts sent are answered to a list nobody reads, which expires)
            log.info("a failed-over worker among %s: the workers count", targets)
            return None
        held = self.counts.absorb(reading, got, index.grid)
        replies = await border.gather(sending, got)
        marks = {r.worker: r.mark for r in replies}
        if any(marks[w] is None for w in targets):
            log.info("per-cell counts not written as far as processed on %s: the workers "
                     "count", [w for w in targets if marks[w] is None])
            return None
        counted = await self._whole_cells(
            tenant, buckets, targets, [entry_order(str(marks[w])) for w in targets], held,
            cells, index.grid)
        if counted is None:
            return None
        return counted + sum(r.count for r in replies)

    async def _whole_cells(self, tenant: str, buckets: range, targets: list[str],
                           tails: list[tuple[int, int]], held: list[HeldCounts],
                           cells: tuple[int, int, int, int], grid: Grid) -> int | None:
        """The records in `cells` from the workers' counts of `buckets` (the window's, from
        its first), once each includes its tail."""
        give_up = time.monotonic() + COUNTS_WAIT_S
        pause = 0.0  # read again at once (the workers wrote their counts before answering)
        while not self.counts.caught_up(held, tails):
            if time.monotonic() > give_up:
                log.warning("per-cell counts behind their streams after %g s (%s at %s, "
                            "tails %s): the workers count", COUNTS_WAIT_S, targets,
                            [h.mark for h in held], tails)
                return None
            await asyncio.sleep(pause)
            pause = 0.002
            pipe = Batch()
            reading = self.counts.read(pipe, targets, tenant, buckets)
            held = self.counts.absorb(reading, await self.pipelines.execute(pipe.command_stack),
                                      grid)
        return sum(h.count(cells, buckets.start) for h in held)

    async def targets(self, index: GlobalIndex, query: wire.SnapshotQuery, now: float
                      ) -> list[str]:
        """The workers holding records the query can see: owners of the overlapped
        partitions under the current plan and every plan valid within the window."""
        if self.router.replicated:
            return sorted(index.workers)
        workers = plan_workers(index, query)
        horizon = now - self.settings.window_s - self.settings.bucket_s
        history = self.router.history
        # The plans this process knows, once they reach the current one (the history is read
        # back to a known plan, so none between is missing); the parts are sent only while
        # the current plan is the newest (see `execute`).
        plans = (history.since(horizon, index) if index.version in history.plans
                 else await self.router.plans_since(horizon, index))
        if plans is None:  # the plans of part of the window are unknown: ask everyone
            return sorted(index.workers)
        for plan in plans:
            workers |= plan_workers(plan, query)
        return sorted(workers)


HEX = frozenset("0123456789abcdef")


def new_query_id(now: float) -> str:
    """A query id: 'q', the time it was made (milliseconds, 11 hex digits), 16 random hex
    digits."""
    return f"q{int(now * 1000):011x}{secrets.token_hex(8)}"


def query_id_time(query_id: str) -> float | None:
    """When a query id of `new_query_id`'s shape was made (None for any other string)."""
    if len(query_id) != 28 or query_id[0] != "q" or not HEX.issuperset(query_id[1:]):
        return None
    return int(query_id[1:12], 16) / 1000


def whole_cells(grid: Grid, bbox: tuple[float, float, float, float]
                ) -> tuple[int, int, int, int] | None:
    """The cells (x0, y0, x1, y1) of `grid` every point of which lies inside `bbox`, by the
    same arithmetic that assigns points to cells: those strictly between the cells of the
    bbox's corners (a point in a cell after the cell of min_lon has a greater longitude, as
    division and floor are monotonic). None when there are none."""
    cx, cy = grid.cells_of([bbox[0], bbox[2]], [bbox[1], bbox[3]])
    x0, x1, y0, y1 = int(cx[0]) + 1, int(cx[1]) - 1, int(cy[0]) + 1, int(cy[1]) - 1
    if x0 > x1 or y0 > y1:
        return None
    return x0, y0, x1, y1


@dataclass
class _Outcome:
    """A query's outcome for `submit`, and whether its id was given out to be polled before
    the outcome was there (`_run` then stores it)."""

    body: asyncio.Future[dict[str, Any]]
    polled: bool = False


class _Sending(NamedTuple):
    """Parts queued on a pipeline: their reply token, workers, and first reply's position;
    whether the archive's part is among them."""

    token: str
    workers: list[str]
    first: int
    archive: bool = False
    # the positions of the first waits for answers (`first_wait`)
    waited: tuple[int, ...] = ()
    # where the answers come when every worker replies straight to this process (`Inbox`)
    inbox: asyncio.Queue[bytes] | None = None


class _Run:
    """The rounds of one query."""

    def __init__(self, service: QueryService, tenant: str, query: wire.SnapshotQuery,
                 as_of: float, deadline: float, everyone: list[str], version: str,
                 cut: dict[str, int] | None = None) -> None:
        self.service = service
        # with a cut, the archive answers too: its buckets up to the cut, the workers theirs
        # after it (`app.archive.layout`)
        self.cut = cut
        self.tenant = tenant
        self.query = query
        self.as_of = as_of
        self.deadline = deadline
        self.everyone = everyone
        self.version = version  # of the plan the workers were chosen with ('' for any)

    async def round(self, workers: Iterable[str], limit: int,
                    latest_of: list[str] | None = None) -> list[wire.QueryReply]:
        """Send one part to each worker and wait for every answer."""
        pipe = Batch()
        sending = self.first_wait(pipe, self.send(pipe, workers, limit, latest_of))
        return await self.gather(sending, await self.service.pipelines.execute(
            pipe.command_stack, block_s=FIRST_WAIT_S))

    def send(self, pipe: Batch, workers: Iterable[str], limit: int,
             latest_of: list[str] | None = None, straight: bool = True) -> _Sending:
        """Queue one part to each worker on `pipe` (whose replies `gather` then takes);
        `straight`: the answers may come to the inbox (not when the pipeline must wait for
        the first through Redis before its later commands: `count_from_metadata`)."""
        token = secrets.token_hex(12)
        settings = self.service.settings
        order = sorted(set(workers))
        inbox = self.service.inbox
        # straight replies when every worker asked reaches the inbox (the archive's runner
        # replies through Redis); a worker that does not yet, connects as it reads the part
        direct = (straight and inbox is not None and self.cut is None
                  and inbox.reaches(order))
        part = wire.encode_entry(wire.QueryPart(
            reply=token, tenant=self.tenant, query=self.query, as_of=self.as_of,
            deadline=self.deadline, limit=limit, latest_of=latest_of,
            first_bucket=(None if self.cut is not None else
                          int((self.as_of - settings.window_s) // settings.bucket_s)),
            cut=self.cut, inbox=inbox.path if inbox is not None else None, direct=direct))
        first = len(pipe)
        checked = self.service.router.outbox is None  # see SEND_PART_SCRIPT
        for w in order:
            keys = [names.worker_stream(w), names.query_stream(w), names.adopter_key(w)]
            run_script(pipe, self.service.send_part,
                       [*keys, names.PLAN_HISTORY] if checked else keys,
                       [part, QUERY_STREAM_LEN, self.version if checked else ""])
        if self.cut is not None:
            pipe.execute_command("XADD", names.ARCHIVE_JOBS, "MAXLEN", "~", ARCHIVE_JOBS_LEN,
                                 "*", "m", part)
        return _Sending(token, order, first, self.cut is not None,
                        inbox=inbox.expect(token) if direct and inbox is not None else None)

    def first_wait(self, pipe: Batch, sending: _Sending, answers: int = 1) -> _Sending:
        """Queue the first wait for an answer (or for `answers` of them) as the last commands
        of `pipe` (a blocking pop blocks the commands after it), so that sending the parts
        and waiting for the first answers are one round trip. Each waits FIRST_WAIT_S at
        most: the parts may not have been sent (a newer plan, see `gather`). Not on a Redis
        Cluster, whose pipelines are split by node. Nor when the answers come to the
        inbox."""
        if self.service.router.outbox is not None or sending.inbox is not None:
            return sending
        for _ in range(answers):
            pipe.execute_command("BLPOP", names.query_reply_key(sending.token), FIRST_WAIT_S)
        return sending._replace(waited=tuple(range(len(pipe) - answers, len(pipe))))

    async def _plan_changed(self) -> bool:
        """Whether the newest plan of the plan history is not the one the query was planned
        with (SEND_PART_SCRIPT's check, made after the parts were sent)."""
        newest = await self.service.redis.lindex(names.PLAN_HISTORY, -1)
        return newest is not None and str(orjson.loads(newest)["version"]) != self.version

    def sources(self, live: int, archive: int) -> dict[str, int]:
        """The `sources` of an answer: how many results each side gave."""
        return {"live": live, "archive": archive} if self.cut is not None else {"live": live}

    async def gather(self, sending: _Sending, results: list[Any]) -> list[wire.QueryReply]:
        """Wait for the answer of every worker a part was sent to (`results`: the replies of
        the pipeline it was sent on)."""
        svc = self.service
        redis = svc.redis
        token, order = sending.token, sending.workers
        sent = [int(s) for s in results[sending.first:sending.first + len(order)]]
        if -1 in sent or (svc.router.outbox is not None and self.version
                          and await self._plan_changed()):
            # the parts sent are answered to a list nobody reads, which expires
            self._forget(sending)
            raise StalePlan(self.version)
        waiting = set(order) | ({ARCHIVE} if sending.archive else set())
        straight = {w for w, how in zip(order, sent, strict=True) if how == 1}
        key = names.query_reply_key(token)
        replies: list[wire.QueryReply] = []
        answered = False
        early = [results[i] for i in sending.waited if results[i] is not None]
        got = None
        try:
            while waiting:
                if got is None and early:
                    got = early.pop(0)
                if got is None:
                    left = self.deadline - time.time()
                    if left <= 0:
                        raise QueryFailed(
                            f"worker{'s' if len(waiting) > 1 else ''} "
                            f"{', '.join(sorted(waiting))} did not answer within "
                            f"{svc.settings.query_timeout_s:g} s (query_timeout_s)")
                    got = await self._next_answer(sending, key, min(1.0, left))
                    if got is None:
                        await self._check_alive(waiting, straight)
                        continue
                else:
                    REPLIES.labels("redis").inc()
                raw, got = got[1], None
                reply = wire.decode_query_reply(raw if isinstance(raw, bytes) else raw.encode())
                if reply.worker not in waiting:
                    continue  # a replayed answer
                if reply.error == STALE_CUT:
                    raise StaleCut(reply.worker)
                if reply.error is not None:
                    raise QueryFailed(f"worker {reply.worker} failed the query: {reply.error}")
                waiting.discard(reply.worker)
                replies.append(reply)
            answered = True
        finally:
            self._forget(sending)
            if not answered:  # the list empties (and so goes) as the answers are taken
                await redis.delete(key)
        return replies

    def _forget(self, sending: _Sending) -> None:
        """No more answers of these parts are awaited on the inbox."""
        if sending.inbox is not None and self.service.inbox is not None:
            self.service.inbox.forget(sending.token)

    async def _next_answer(self, sending: _Sending, key: str, wait: float
                           ) -> tuple[Any, bytes] | None:
        """The next answer within `wait` seconds (as BLPOP gives it), or None: from the
        inbox, and then from the list (where a worker that could not reach the inbox pushed
        it), or from the list only."""
        svc = self.service
        if sending.inbox is not None:
            try:
                raw = await asyncio.wait_for(sending.inbox.get(), wait)
                REPLIES.labels("inbox").inc()
                return key, raw
            except TimeoutError:
                [popped] = await svc.pipelines.execute([("LPOP", key)])
        else:
            got = (await svc.pipelines.execute([("BLPOP", key, wait)], block_s=wait))[0]
            popped = got[1] if got is not None else None
        if popped is None:
            return None
        REPLIES.labels("redis").inc()
        return key, popped

    async def _check_alive(self, waiting: set[str], straight: set[str]) -> None:
        svc = self.service
        now = time.time()
        if ARCHIVE in waiting:
            # a part taken by a runner that dies is run by another (spark.runner)
            runners = await svc.redis.hgetall(names.RUNNERS_KEY)
            if not any(heartbeat_fresh(b, now, svc.settings.worker_dead_after_s)
                       for b in runners.values()):
                raise QueryFailed(
                    "no query runner is running to answer the archive's part of the query "
                    f"(no heartbeat for {svc.settings.worker_dead_after_s:g} s); retry when "
                    "one is back")
            waiting = waiting - {ARCHIVE}
            if not waiting:
                return
        raw = await svc.redis.hmget(names.WORKERS_KEY, sorted(waiting))
        dead = [w for w, beat in zip(sorted(waiting), raw, strict=True)
                if not heartbeat_fresh(beat, now, svc.settings.worker_dead_after_s)]
        # A part sent straight is answered by its worker only.
        gone = [w for w in dead if w in straight]
        dead = [w for w in dead if w not in straight]
        if dead:
            # A failed-over worker's stream, and so its part of the query, is processed by
            # its adopter (workers.failover): it is the adopter that must be alive.
            pipe = svc.redis.pipeline(transaction=False)  # (on a cluster: in their slots)
            for w in dead:
                pipe.get(names.adopter_key(w))
            adopters = await pipe.execute()
            alive = [a for a in adopters if a is not None]
            beats = await svc.redis.hmget(names.WORKERS_KEY, alive) if alive else []
            fresh = {a for a, beat in zip(alive, beats, strict=True)
                     if heartbeat_fresh(beat, now, svc.settings.worker_dead_after_s)}
            dead = [w for w, a in zip(dead, adopters, strict=True) if a not in fresh]
        dead = sorted(gone + dead)
        if dead:
            raise QueryFailed(
                f"worker{'s' if len(dead) > 1 else ''} {', '.join(dead)} holding part of the "
                f"window {'are' if len(dead) > 1 else 'is'} not running (no heartbeat for "
                f"{svc.settings.worker_dead_after_s:g} s); retry when "
                f"{'they are' if len(dead) > 1 else 'it is'} back or failed over")

    async def latest_ts(self, replies: list[wire.QueryReply]) -> dict[str, float]:
        """Every worker's latest record time (within the time range) of each moving object
        among the replies' records."""
        ids = sorted({r.id for reply in replies for r in reply.records if r.moving})
        if not self.query.latest or not ids:
            return {}
        best: dict[str, float] = {}
        for reply in await self.round(self.everyone, 0, latest_of=ids):
            for oid, ts in reply.latest.items():
                if ts > best.get(oid, -1.0):
                    best[oid] = ts
        return best

    async def latest_filter(self, replies: list[wire.QueryReply]
                            ) -> Callable[[wire.FoundRecord], bool]:
        """Which records a `latest` query keeps: events, and each moving object's record
        that is its latest of all workers (of two with that ts, the later arrival)."""
        if not self.query.latest:
            return lambda r: True
        best = await self.latest_ts(replies)
        chosen: dict[str, tuple[float, float]] = {}
        for reply in replies:
            for r in reply.records:
                if r.moving and r.ts >= best.get(r.id, r.ts):
                    chosen[r.id] = max(chosen.get(r.id, (r.ts, r.at)), (r.ts, r.at))
        return lambda r: not r.moving or chosen.get(r.id) == (r.ts, r.at)

    async def verified(self, replies: list[wire.QueryReply]) -> list[wire.FoundRecord]:
        """The listed moving records that pass `latest_filter` (count, topk_terms), each
        object once."""
        keep = await self.latest_filter(replies)
        seen: set[str] = set()
        out = []
        for reply in replies:
            for r in reply.records:
                if keep(r) and r.id not in seen:
                    seen.add(r.id)
                    out.append(r)
        return out


def _count_body(counted: int, sources: dict[str, int] | None = None) -> dict[str, Any]:
    return {"results": [{"count": counted}], "sources": sources or {"live": counted},
            "truncated": False}


def _public(r: wire.FoundRecord, with_distance: bool) -> dict[str, Any]:
    out = public_record(r.id, r.lon, r.lat, r.ts, r.keywords, r.text, r.props)
    if with_distance:
        out["distance_m"] = round(r.distance_m, 3)
    return out
