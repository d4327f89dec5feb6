"""Failover of a dead worker: its partitions go to live workers, its stream to an adopter.

A worker whose heartbeat is older than `worker_dead_after_s` and that still owns partitions
is failed over by the leader coordinator with one script (`FAILOVER_SCRIPT`): the next plan
gives each of its partitions, under a fresh id, to a live worker (fewest partitions first),
appends a `wire.Takeover` to each receiver's stream before anything routed under that plan,
takes the dead worker's fence epoch (`names.fence_key`) and names an adopter. All of it only
if the plan, the coordinator's lease and the fence are still what the decision was made on:
a worker that restarted meanwhile has taken its fence, and keeps its partitions. With outboxes
(a Redis Cluster) the same failover is staged and relayed (`FAILOVER_STAGE_SCRIPT`).

- The receivers rebuild what a handoff would have carried (SWARM §5.1) from the sources of
  truth: the partitions' range subscriptions from SQL, their moving objects from the
  latest-position store; the dead worker's local kNN lists leave the merged lists.
- The adopter (`Adoption`) processes the dead worker's stream in its place: entries it left
  pending are claimed, every object row is forwarded unprocessed to the owner of its
  position under the new plan (exactly as after a move), range subscriptions routed with the
  old plan are forwarded, and snapshot queries are answered from the dead worker's window,
  read back from its window log. Each entry is marked done under the dead worker's name, so
  the worker itself skips it when it returns.
- Fencing: every transaction of a stream's consumer WATCHes its fence key and checks the
  epoch it holds, so a worker declared dead that wakes up (SIGSTOP, a stalled VM) commits
  nothing: it exits (`Fenced`) and its supervisor restarts it. A worker that starts takes its
  fence back (INCR), which ends the adoption; it owns no partitions then, and balancing gives
  it some as the cheapest worker (SWARM §4.3).
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

import redis

from app.archive.layout import NO_CUT
from app.geo.grid import Grid
from app.geo.index import Partition, Plan
from app.pipeline import names, wire
from app.pipeline.control import activate_op, history_entry
from app.pipeline.outbox import encode_ops, op, script_sha
from app.pipeline.router import grid_of
from workers.archiving import Archiver
from workers.records import RecordWindow

if TYPE_CHECKING:
    from workers.executor import Executor

log = logging.getLogger(__name__)

# KEYS[1] = coordinator lease, KEYS[2] = plan, KEYS[3] = plan history, KEYS[4] = the dead
# worker's fence, KEYS[5] = its adopter key, KEYS[6] = the adopter's adopted set,
# KEYS[7] = the staged plan version (names.PLAN_PENDING: a change staged and not yet relayed
# stops the failover, whose plan would be replaced by it), KEYS[8..] = receivers' streams.
# ARGV[1] = lease holder, ARGV[2] = expected plan version, ARGV[3] = expected fence epoch
# (as read, '' for none), ARGV[4] = new plan JSON, ARGV[5] = new version, ARGV[6] = plan
# channel, ARGV[7] = history entry, ARGV[8] = history length, ARGV[9] = dead worker,
# ARGV[10] = adopter, ARGV[11..] = takeover payloads (one per receiver stream).
# Returns the new fence epoch, or 0 when anything changed since the decision.
FAILOVER_SCRIPT = """
if redis.call('GET', KEYS[1]) ~= ARGV[1] then return 0 end
local raw = redis.call('GET', KEYS[2])
if not raw then return 0 end
if tostring(cjson.decode(raw)['version']) ~= ARGV[2] then return 0 end
if (redis.call('GET', KEYS[4]) or '') ~= ARGV[3] then return 0 end
if redis.call('EXISTS', KEYS[7]) == 1 then return 0 end
for i = 8, #KEYS do
  redis.call('XADD', KEYS[i], '*', 'm', ARGV[3 + i])
end
redis.call('SET', KEYS[2], ARGV[4])
redis.call('RPUSH', KEYS[3], ARGV[7])
redis.call('LTRIM', KEYS[3], -tonumber(ARGV[8]), -1)
local epoch = redis.call('INCR', KEYS[4])
redis.call('SET', KEYS[5], ARGV[10])
redis.call('SADD', KEYS[6], ARGV[9])
redis.call('PUBLISH', ARGV[6], ARGV[5])
return epoch
"""


# With outboxes (a Redis Cluster: the fence is in the dead worker's slot, the adopted set in
# the adopter's, the streams in the receivers', the plan in the control slot) the failover is
# staged in the control slot, then relayed (`app.pipeline.control`): the fence is taken first,
# then the adoption is recorded and the takeovers appended, and last the plan activated.
# KEYS[1] = lease, KEYS[2] = plan, KEYS[3] = staged version, KEYS[4] = starts of the workers,
# KEYS[5] = control outbox. ARGV[1] = lease holder, ARGV[2] = expected plan version,
# ARGV[3] = dead worker, ARGV[4] = its starts as read ('' for none), ARGV[5] = new version,
# ARGV[6] = the outbox entry. A worker starting counts its start before it relays the control
# outbox, takes its fence and reads the plan: a failover decided before a start of the worker
# is refused here, and one staged before it is active when the worker reads the plan.
# Returns the entry's id, or 0 when anything changed since the decision.
FAILOVER_STAGE_SCRIPT = """
if redis.call('GET', KEYS[1]) ~= ARGV[1] then return 0 end
local raw = redis.call('GET', KEYS[2])
if not raw then return 0 end
if tostring(cjson.decode(raw)['version']) ~= ARGV[2] then return 0 end
if redis.call('EXISTS', KEYS[3]) == 1 then return 0 end
if (redis.call('HGET', KEYS[4], ARGV[3]) or '') ~= ARGV[4] then return 0 end
redis.call('SET', KEYS[3], ARGV[5])
return redis.call('XADD', KEYS[5], '*', 'm', ARGV[6])
"""

# The first command of a staged failover, in the dead worker's slot. KEYS[1] = its fence,
# KEYS[2] = its adopter key. ARGV[1] = the fence as read ('' for none), ARGV[2] = adopter.
FENCE_TAKE_SCRIPT = """
if (redis.call('GET', KEYS[1]) or '') ~= ARGV[1] then return 0 end
redis.call('SET', KEYS[2], ARGV[2])
return redis.call('INCR', KEYS[1])
"""


def failover_stage_args(lease_key: str, holder: str, plan: Plan, new: Plan,
                        fence: bytes | None, starts: bytes | None, dead: str,
                        given: dict[str, list[str]], now: float, db: int = 0
                        ) -> tuple[list[str], list[Any]]:
    """KEYS and ARGV of FAILOVER_STAGE_SCRIPT: the change FAILOVER_SCRIPT makes in one step
    (`db` as for `failover_args`)."""
    adopter = next(iter(given))
    plan_json = new.to_json()
    ops = [op("EVAL", script_sha(FENCE_TAKE_SCRIPT), 2, names.fence_key(dead),
              names.adopter_key(dead), (fence or b"").decode(), adopter),
           op("SADD", names.adopted_key(adopter), dead)]
    ops += [op("XADD", names.worker_stream(w), "*", "m", _takeover(new, dead, adopter, pids))
            for w, pids in given.items()]
    ops.append(activate_op(plan_json, new.version, now, names.channel(names.PLAN_CHANNEL, db)))
    keys = [lease_key, names.PLAN_KEY, names.PLAN_PENDING, names.WORKER_STARTS,
            names.CONTROL_OUTBOX]
    return keys, [holder, str(plan.version), dead, (starts or b"").decode(), str(new.version),
                  encode_ops(ops)]


def _takeover(new: Plan, dead: str, adopter: str, pids: list[str]) -> bytes:
    return wire.encode_entry(wire.Takeover(plan_version=new.version, dead=dead,
                                           adopter=adopter, partitions=pids))


class Fenced(Exception):
    """Another consumer took the fence of the stream being processed: stop processing it."""


def failover_plan(plan: Plan, dead: str, live: list[str], ids: Iterator[str]
                  ) -> tuple[Plan, dict[str, list[str]]]:
    """The next plan with every partition of `dead` given, under a fresh id (parent: the old
    id, prev_owner: `dead`, as a move, SWARM §5.2), to the live worker owning the fewest
    partitions at that point (ties by id); and the new partition ids per receiver, in the
    order the receivers were first chosen (the first is the adopter)."""
    owned = {w: 0 for w in live}
    for p in plan.partitions:
        if p.worker in owned:
            owned[p.worker] += 1
    parts: list[Partition] = []
    given: dict[str, list[str]] = {}
    for p in plan.partitions:
        if p.worker != dead:
            parts.append(dataclasses.replace(p))
            continue
        to = min(owned, key=lambda w: (owned[w], w))
        owned[to] += 1
        q = dataclasses.replace(p, id=next(ids), worker=to, parent=p.id, prev_owner=dead)
        parts.append(q)
        given.setdefault(to, []).append(q.id)
    new = Plan(version=plan.version + 1, grid=plan.grid, partitions=parts,
               members=list(plan.members))
    new.validate()
    return new, given


def failover_args(lease_key: str, holder: str, plan: Plan, new: Plan, fence: bytes | None,
                  dead: str, given: dict[str, list[str]], now: float, db: int = 0
                  ) -> tuple[list[str], list[Any]]:
    """KEYS and ARGV of FAILOVER_SCRIPT (`given` from `failover_plan`; `db`: the Redis
    database, whose plan channel announces the new plan, `names.channel`)."""
    adopter = next(iter(given))
    plan_json = new.to_json()
    keys = [lease_key, names.PLAN_KEY, names.PLAN_HISTORY, names.fence_key(dead),
            names.adopter_key(dead), names.adopted_key(adopter), names.PLAN_PENDING,
            *(names.worker_stream(w) for w in given)]
    args: list[Any] = [holder, str(plan.version), (fence or b"").decode(), plan_json,
                       str(new.version), names.channel(names.PLAN_CHANNEL, db),
                       history_entry(plan_json, new.version, now), str(names.PLAN_HISTORY_MAX),
                       dead, adopter, *(_takeover(new, dead, adopter, pids)
                                        for pids in given.values())]
    return keys, args


def watch_fence(pipe: Any, worker: str, epoch: int) -> None:
    """Start a transaction that commits only while `epoch` is still the fence of `worker`'s
    stream: WATCH the key, then check it (a change before the WATCH is seen by the check, one
    after it fails the EXEC). Raises Fenced when it is no longer ours."""
    current = int(_watch_and_get(pipe, names.fence_key(worker)) or 0)
    if current != epoch:
        pipe.reset()
        raise _fenced(worker, current, epoch)
    pipe.multi()


def _watch_and_get(pipe: Any, key: str) -> Any:
    """WATCH `key` on the transaction's connection and read it: both written at once on a
    plain pipeline (one round trip of a worker's step less: a blocking wait and a wake-up,
    about as costly on a busy machine as a tenth of the step's own work), one after the
    other on the others (a Redis Cluster's, an outbox's)."""
    if type(pipe) is not redis.client.Pipeline:
        pipe.watch(key)
        return pipe.get(key)
    plain: Any = pipe  # (redis-py's connection methods are untyped)
    conn: Any = plain.connection
    if conn is None:
        conn = plain.connection = plain.connection_pool.get_connection()
    try:
        conn.send_packed_command(conn.pack_commands([("WATCH", key), ("GET", key)]))
        plain.parse_response(conn, "WATCH")  # the pipeline is watching from here
        return plain.parse_response(conn, "GET")
    except (redis.ConnectionError, redis.TimeoutError):
        conn.disconnect()
        raise


def check_fence(client: Any, worker: str, epoch: int) -> None:
    """Raise Fenced when `epoch` is no longer the fence of `worker`'s stream (a worker that
    makes no transaction learns it so)."""
    current = int(client.get(names.fence_key(worker)) or 0)
    if current != epoch:
        raise _fenced(worker, current, epoch)


def _fenced(worker: str, current: int, epoch: int) -> Fenced:
    return Fenced(f"the stream of {worker} is fenced (epoch {current}, ours {epoch})")


def fence_lost(client: Any, worker: str, epoch: int, exc: redis.WatchError) -> Fenced:
    """After a WatchError: the fence moved (the Fenced to raise), or, since redis-py reports a
    connection that failed while watching as a WatchError too, Redis went away: raise that
    as a ConnectionError (the step is retried). Reading the fence fails the same way then."""
    current = int(client.get(names.fence_key(worker)) or 0)
    if current == epoch:
        raise redis.ConnectionError(f"connection lost in a transaction: {exc}") from exc
    return _fenced(worker, current, epoch)


# The window log is kept from this long before the first bucket after the archive cut: a
# record kept in a bucket was logged (by Redis's clock) after that bucket began (by the api's).
LOG_MARGIN_S = 300.0


def log_start(cut: int, bucket_s: float) -> str:
    """The first window log entry that may hold records above the archive cut."""
    if cut == NO_CUT:
        return "-"
    return f"{max(0, int(((cut + 1) * bucket_s - LOG_MARGIN_S) * 1000))}-0"


def load_window(client: Any, stream: str, window_s: float, bucket_s: float, who: str,
                cut: int, grid: Grid | None = None) -> RecordWindow:
    """The records not archived yet (above `cut`) read back from a worker's window log, each
    in the bucket logged with it (counted per cell of `grid` when given)."""
    window = RecordWindow(window_s, bucket_s, grid)
    start = log_start(cut, bucket_s)
    while True:
        rows = client.xrange(stream, min=start, count=1000)
        for eid, fields in rows:
            try:
                entry = wire.decode_entry(fields[b"m"])
            except (KeyError, ValueError) as exc:
                log.error("%s: unreadable window log entry %s of %s: %s", who, eid, stream, exc)
                continue
            if isinstance(entry, wire.ObjectBatch):
                raw = fields.get(b"b")
                bucket = window.bucket_of(entry, cut) if raw is None else int(raw)
                if bucket > cut:
                    window.add(entry, bucket)
        if len(rows) < 1000:
            return window
        start = "(" + rows[-1][0].decode()


class Adoption:
    """A live worker's processing of a dead worker's stream (see the module docstring)."""

    def __init__(self, ex: Executor, dead: str, epoch: int) -> None:
        self.ex = ex
        self.dead = dead
        self.epoch = epoch
        self.stream = names.worker_stream(dead)
        s = ex.settings
        self.archiver = Archiver(ex.redis, s, grid_of(s), dead)
        ex.relay_outbox(dead)  # its last commits, before its window is read back
        self.records = load_window(ex.redis, names.window_stream(dead), s.window_s, s.bucket_s,
                                   f"worker {ex.id} (adopting {dead})", self.archiver.load())
        self.forwarded = 0

    def start(self) -> None:
        """Claim what the dead worker left pending and process it (skipping what it had
        written), then everything left pending under our own name (an earlier adoption)."""
        ex = self.ex
        log.info("worker %s adopts the stream of %s (epoch %d): %d records in its window",
                 ex.id, self.dead, self.epoch, len(self.records))
        ex.claim_others(self.stream)
        while not ex.stopping:
            reply = ex.redis.xreadgroup(names.GROUP, ex.id, {self.stream: "0"}, count=200)
            entries = reply[0][1] if reply else []
            if not entries:
                return
            self.process(entries)

    def process(self, entries: list[tuple[bytes, dict[bytes, bytes]]]) -> None:
        """Forward, answer and acknowledge entries of the dead worker's stream; raises Fenced
        when the worker has come back (or another failover took the stream)."""
        ex = self.ex
        pipe = ex.commit_pipe(self.dead)
        try:
            watch_fence(pipe, self.dead, self.epoch)
            ids = [e[0] for e in entries]
            done = ex.redis.mget([names.done_key(self.dead, i.decode()) for i in ids])
            queries: list[wire.QueryPart] = []
            for (eid, fields), d in zip(entries, done, strict=True):
                if d is not None:  # only a version that acknowledged after its commit
                    continue  # written before it died (or by an earlier adoption)
                try:
                    msg = wire.decode_entry(fields[b"m"])
                except (KeyError, ValueError) as exc:
                    ex.dead_letter(eid, fields, f"undecodable: {exc}", self.stream)
                    continue
                if isinstance(msg, wire.ObjectBatch):
                    local = ex.migration.reroute(msg, pipe, owner=self.dead)
                    if local is not None:
                        raise RuntimeError(f"{self.dead} still owns rows of entry {eid!r}")
                    self.forwarded += len(msg)
                elif isinstance(msg, wire.SubsAdded):
                    if msg.plan_version < ex.version:
                        ex.migration.forward_subs(msg.subs, pipe, owner=self.dead,
                                                  since_version=msg.plan_version)
                    else:  # kNN registrations naming the dead worker stop waiting for it
                        for m in msg.subs:
                            if m.spec["type"] == "knn":
                                ex.knnreg.forward(m, msg.plan_version, self.dead, pipe)
                elif isinstance(msg, wire.KnnAsk):
                    ex.knnreg.on_ask(msg, pipe, owner=self.dead)
                elif isinstance(msg, wire.QueryPart):
                    queries.append(msg)
                # Removals, gone objects, retractions and keyword subscriptions went to every
                # worker that holds them; a handoff or takeover to the dead worker is
                # superseded by the failover plan, whose receivers rebuild from SQL.
            pipe.xack(self.stream, names.GROUP, *ids)  # with the forwards: both or neither
            pipe.execute()
        except redis.WatchError as exc:
            raise fence_lost(ex.redis, self.dead, self.epoch, exc) from exc
        finally:
            pipe.reset()
        if queries:
            out = ex.redis.pipeline(transaction=False)
            for part in queries:
                ex.answer(part, out, self.records.tenants.get(part.tenant), self.dead)
            out.execute()

    def still_ours(self) -> bool:
        raw = self.ex.redis.get(names.adopter_key(self.dead))
        fence = self.ex.redis.get(names.fence_key(self.dead))
        return raw is not None and raw.decode() == self.ex.id and int(fence or 0) == self.epoch
