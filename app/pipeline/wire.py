"""The messages between geoswarm's processes: one typed class per message, one encoder and one
decoder per stream or channel (msgpack through msgspec, which decodes and validates in one
step). Field names say what they are; the short keys on the wire stay short through renaming.

- a worker's stream (`names.worker_stream`): `WorkerEntry` = ObjectBatch | SubsAdded |
  SubsRemoved | ObjectsGone | Handoff | QueryPart | Takeover | KnnRetract | KnnAsk |
  KnnArrived | KnnRefresh, in field `m`;
- a worker's window log (`names.window_stream`): the ObjectBatch of records it stored;
- a snapshot query's reply list (`names.query_reply_key`): QueryReply;
- a worker's command stream (`names.command_stream`): `Command` = RoundCommand |
  ReduceCommand | MoveCommand | SplitCommand | MergeCommand (SWARM §4.3, §5);
- `names.NOTIFY_CHANNEL`: `Notification` = HistoryAppended | SubsChanged (workers -> hubs);
- `names.REVOKED_CHANNEL`: KeyRevoked; `names.SUBS_CHANNEL`: SubsGone (api -> hubs);
- a subscription's history stream: `MatchRefs` in field `m` of each entry.
"""

from __future__ import annotations

from itertools import chain
from typing import Any, Literal, TypeVar

import msgspec

# --- a worker's stream ----------------------------------------------------------------------

Point = tuple[float, float]


class SubscriptionCopy(msgspec.Struct, frozen=True):
    """A subscription as the workers hold it (the spec is API-validated JSON)."""

    id: str
    tenant: str
    spec: dict[str, Any]
    expires_at: float | None = None
    # kNN: the registration (`app.pipeline.knnreg`): objects within `radius_m` metres of the
    # point enter the worker's local list (None: any); a higher `epoch` replaces a lower one.
    radius_m: float | None = None
    epoch: int = 0


# A record's props on the internal wire, in the positions and in query replies: the compact
# JSON text the api encoded once, when it validated them (`app.schemas.batch`), and that clients
# get as it is (`records.public_record`). Entries and positions an earlier version wrote hold
# the decoded object instead.
Props = str | dict[str, Any] | None


class ObjectBatch(msgspec.Struct, tag="obj", tag_field="t", omit_defaults=True, rename={
        "tenant": "tn", "sent_at": "at", "plan_version": "v", "ids": "id",
        "record_ids": "rid", "moving": "mv", "keywords": "kw", "text": "txt", "props": "pr",
        "exit_only": "xo", "decide_exit": "dx", "no_match": "nm",
        "no_match_token": "nmt"}):
    """Records one worker must evaluate, column by column, with each record's previous position
    (moving objects: for enter/exit) and whether this worker only decides its `exit`.
    `plan_version` is the plan the router used: a worker whose plan is newer re-routes the
    entry (SWARM §5.1).

    `no_match`: rows that the router found, by the worker's keyword summary (`KeywordSummary`)
    of token `no_match_token`, to match none of the worker's subscriptions. The worker skips
    matching them only while its subscriptions are still those of that token (Tornado §4);
    they are stored in its window all the same. Not a column: `take` and `concat` drop it."""

    tenant: str
    sent_at: float
    plan_version: int
    ids: list[str]
    record_ids: list[str]
    moving: list[bool]
    lon: list[float]
    lat: list[float]
    ts: list[float]
    keywords: list[list[str]]
    text: list[str | None]
    props: list[Props]
    prev: list[Point | None]
    late: list[bool]  # older than the object's latest record: no position change
    exit_only: list[bool]
    decide_exit: list[bool]
    no_match: list[int] = []
    no_match_token: int = 0

    def __len__(self) -> int:
        return len(self.ids)

    def take(self, rows: list[int]) -> ObjectBatch:
        """The batch of the given rows, in that order."""
        cols: dict[str, Any] = {name: list(map(getattr(self, name).__getitem__, rows))
                                for name in COLUMNS}
        return ObjectBatch(tenant=self.tenant, sent_at=self.sent_at,
                           plan_version=self.plan_version, **cols)

    @staticmethod
    def concat(batches: list[ObjectBatch]) -> ObjectBatch:
        """One batch of several of one tenant (matched together); `sent_at` of the first."""
        if len(batches) == 1:
            return batches[0]
        first = batches[0]
        cols: dict[str, Any] = {
            name: list(chain.from_iterable(getattr(b, name) for b in batches))
            for name in COLUMNS}
        return ObjectBatch(tenant=first.tenant, sent_at=first.sent_at,
                           plan_version=first.plan_version, **cols)


COLUMNS = ("ids", "record_ids", "moving", "lon", "lat", "ts", "keywords", "text", "props",
           "prev", "late", "exit_only", "decide_exit")


class SubsAdded(msgspec.Struct, tag="sub+", tag_field="t", rename={"plan_version": "v"}):
    subs: list[SubscriptionCopy]
    plan_version: int = 0


class SubsRemoved(msgspec.Struct, tag="sub-", tag_field="t"):
    ids: list[str]


class KnnAsk(msgspec.Struct, tag="knn?", tag_field="t", rename={"tenant": "tn"}):
    """Old owner -> new owner of moving objects a kNN list holds (`KnnState.ghosts`): answer
    with KnnArrived once you hold these records (forward it if their position is no longer
    yours). Rows: id, the record's time, its position."""

    tenant: str
    ids: list[str]
    ts: list[float]
    lon: list[float]
    lat: list[float]
    reply_to: str


class KnnArrived(msgspec.Struct, tag="knn!", tag_field="t", rename={"tenant": "tn"}):
    """The answer to KnnAsk: the ghosts of these records may go."""

    tenant: str
    ids: list[str]
    ts: list[float]


class KnnRetract(msgspec.Struct, tag="knn-", tag_field="t"):
    """A kNN subscription's registration of epoch `epoch` leaves this worker out (its radius
    shrank or its partitions moved): a registration older than that is dropped here, without
    tombstoning the subscription (a later registration may bring it back)."""

    ids: list[str]
    epoch: int


class KnnRefresh(msgspec.Struct, tag="knn=", tag_field="t", rename={"tenant": "tn"}):
    """Report your local lists of these subscriptions again, whole (written by the kNN merge
    script, `app.pipeline.knnreg`): you were their only holder and reported only the changes
    that could change the merged list; another worker now holds them too."""

    tenant: str
    ids: list[str]
    epoch: int


class ObjectsGone(msgspec.Struct, tag="gone", tag_field="t", rename={"tenant": "tn"}):
    """Moving objects that outlived their TTL and left the latest-position store: workers
    drop them from their kNN state. Written by `app.pipeline.expiry`'s Lua script (a msgpack
    map {t, tn, ids}), so the field names here are its keys."""

    tenant: str
    ids: list[str]


# A window piece as a handoff carries it (workers.ledger): bucket, age in rounds, cells x,
# cells y, objects per cell.
WindowCounts = tuple[int, int, list[int], list[int], list[int]]
# A moving object a handoff carries: id, lon, lat, keywords, ts.
MovingObject = tuple[str, float, float, list[str], float]


class Handoff(msgspec.Struct, tag="handoff", tag_field="t", rename={
        "plan_version": "v", "sender": "from", "partitions": "parts", "window": "win",
        "moving": "mv"}):
    """mH -> mL with a move (SWARM §5.1): the partitions' subscriptions, the window's counts,
    the moving objects whose latest position lies in them, and the statistics of the
    partitions moved whole."""

    plan_version: int
    sender: str
    partitions: list[str]
    subs: list[SubscriptionCopy]
    window: list[WindowCounts]
    moving: dict[str, list[MovingObject]]
    stats: dict[str, Any] = {}
    # kNN subscriptions whose merged list waits for the receiver (`holds` in knnreg): their
    # lists held some of the moving objects handed off
    holds: list[str] = []


class Takeover(msgspec.Struct, tag="take", tag_field="t", rename={
        "plan_version": "v", "partitions": "parts"}):
    """Coordinator -> the workers that receive a dead worker's partitions (failover): what a
    handoff would carry is rebuilt from SQL and the latest-position store, and the dead
    worker's local kNN lists leave the merged ones. `adopter` processes the dead worker's
    stream until it returns (workers.failover)."""

    plan_version: int
    dead: str
    adopter: str
    partitions: list[str]


# --- snapshot queries (SSTD §4's snapshot versions, CheetahGIS §IV's aggregator) -----------

QueryType = Literal["range", "knn", "keyword", "topk_terms", "count"]


class SnapshotQuery(msgspec.Struct, kw_only=True, omit_defaults=True):
    """A validated snapshot query (API.md QUERY) as the api hands it to the workers. Region:
    `bbox`, or `circle` = (lon, lat, radius_m), or none (keyword; knn has `point`). Time:
    records with `t_from` <= ts <= `t_to` (None: unbounded on that side). `latest`: only the
    latest record of each moving object within the time range. `limit` caps range and keyword
    results (newest first), `k` is knn's k and topk_terms' number of terms."""

    type: QueryType
    bbox: tuple[float, float, float, float] | None = None
    circle: tuple[float, float, float] | None = None
    point: tuple[float, float] | None = None
    k: int = 0
    keywords: list[str] = []
    match_all: bool = False
    t_from: float | None = None
    t_to: float | None = None
    latest: bool = False
    limit: int = 1000
    # count: leave out the records in these cells of the global grid (x0, y0, x1, y1),
    # counted from the per-cell counts instead
    skip_cells: tuple[int, int, int, int] | None = None
    # knn: only records within this distance (the second round of a knn, `QueryService`)
    max_distance_m: float | None = None


class QueryPart(msgspec.Struct, tag="q", tag_field="t", kw_only=True):
    """One worker's share of a snapshot query, answered once the worker has processed the
    entries routed to it before (so a query sees every object accepted before it). `reply`
    names the list the worker pushes its `QueryReply` to; `as_of` (the api's clock when the
    query started) excludes records that arrived later, so that every round of one query
    sees the same records. `limit` is the per-worker cap of this round (the aggregator raises
    it when a round could not be exact).
    `latest_of`: instead of evaluating the query, report this worker's latest record time
    (<= query.t_to) of each of these moving objects (the check of `latest` answers).
    Which arrival buckets it reads: with `cut` (a query that reads the archive too: worker ->
    the last bucket the archive answers for), those after its worker's cut; else those from
    `first_bucket` (the live window's first).
    `inbox`: the asking api process's socket for replies (`app.pipeline.inbox`), which the
    worker connects to; with `direct`, the reply goes there instead of to the list (and to
    the list if it cannot)."""

    reply: str
    tenant: str
    query: SnapshotQuery
    as_of: float
    deadline: float
    limit: int = 0
    latest_of: list[str] | None = None
    first_bucket: int | None = None
    cut: dict[str, int] | None = None
    inbox: str | None = None
    direct: bool = False


# `QueryReply.error` of a part whose archive cut lies below records its worker dropped from
# memory (they left after the query read the cut): the query reads the cut again.
STALE_CUT = "stale archive cut"


class FoundRecord(msgspec.Struct, array_like=True):
    """A record in a query reply: the public fields, whether it is a moving object's record
    (`moving`), when it arrived (`at`) and its distance to a knn query's point."""

    id: str
    lon: float
    lat: float
    ts: float
    keywords: list[str]
    text: str | None
    props: Props
    moving: bool
    at: float
    distance_m: float = 0.0


class QueryReply(msgspec.Struct, kw_only=True, omit_defaults=True):
    """A worker's answer to a `QueryPart`. `records`: range/keyword (newest first) and knn
    (nearest first) answers, at most the part's limit, `truncated` when more matched; with
    `latest`, count and topk_terms also list the moving objects' candidate records here (the
    aggregator checks them), and `count` / `terms` cover the rest. `latest`: the reply to
    `latest_of` (object id -> latest ts). `error`: why the worker could not answer. `mark`
    (a count that skips cells): the last entry of its stream the worker had processed, with
    its per-cell counts written that far."""

    worker: str
    records: list[FoundRecord] = []
    truncated: bool = False
    count: int = 0
    terms: dict[str, int] = {}
    latest: dict[str, float] = {}
    error: str | None = None
    mark: str | None = None


class CellCounts(msgspec.Struct, array_like=True):
    """A worker's number of records of one tenant per arrival bucket and global grid cell
    (CheetahGIS's per-cell counts, in `names.cell_counts_key`): per bucket, its cell ids and
    their counts, each the bytes of a little-endian int64 array (read with numpy at once)."""

    buckets: list[tuple[int, bytes, bytes]]


_counts_decoder = msgspec.msgpack.Decoder(CellCounts)


def encode_cell_counts(counts: CellCounts) -> bytes:
    return _entry_encoder.encode(counts)


def decode_cell_counts(data: bytes) -> CellCounts:
    return _counts_decoder.decode(data)


_reply_decoder = msgspec.msgpack.Decoder(QueryReply)


def encode_query_reply(reply: QueryReply) -> bytes:
    return _entry_encoder.encode(reply)


def decode_query_reply(data: bytes) -> QueryReply:
    return _reply_decoder.decode(data)


WorkerEntry = (ObjectBatch | SubsAdded | SubsRemoved | ObjectsGone | Handoff | QueryPart
               | Takeover | KnnRetract | KnnAsk | KnnArrived | KnnRefresh)

_entry_encoder = msgspec.msgpack.Encoder()
_entry_decoder = msgspec.msgpack.Decoder(WorkerEntry)


def encode_entry(msg: WorkerEntry) -> bytes:
    return _entry_encoder.encode(msg)


def decode_entry(data: bytes) -> WorkerEntry:
    """Raises msgspec.DecodeError (a ValueError) on anything that is not a valid entry."""
    entry: WorkerEntry = _entry_decoder.decode(data)
    return entry


def decode_query_part(fields: dict[bytes, bytes]) -> QueryPart:
    """The query part of a stream entry's fields; ValueError if it is not one."""
    try:
        part = decode_entry(fields[b"m"])
    except KeyError:
        raise ValueError("no field m") from None
    if not isinstance(part, QueryPart):
        raise ValueError(f"a {type(part).__name__}, not a query part")
    return part


class KeywordSummary(msgspec.Struct, array_like=True):
    """Tornado §4's textual summary of one tenant's subscriptions on one worker, per partition
    it owns (`names.keyword_summaries_key`): the words an object in that partition must hold one
    of to match any of them (`SubscriptionIndex.keyword_summary`), or None when any object there
    may match. `token` names the state of the worker's subscriptions it describes (a new one at
    every change, `workers.subs.LocalSubs`); `plan_version` is the worker's plan then."""

    token: int
    plan_version: int
    parts: dict[str, list[str] | None]


_summary_decoder = msgspec.msgpack.Decoder(KeywordSummary)


def encode_summary(summary: KeywordSummary) -> bytes:
    return _entry_encoder.encode(summary)


def decode_summary(data: bytes) -> KeywordSummary:
    return _summary_decoder.decode(data)


# --- a worker's command stream (SWARM §4.3.1, §5) -------------------------------------------

class CommandBase(msgspec.Struct, tag_field="t", kw_only=True):
    """`plan_version` is the plan the sender saw and `deadline` (unix time) when it stops
    waiting: a worker refuses a command whose version is no longer current or whose deadline
    has passed, so a worker paused through a round never executes a stale decision. The reply
    (JSON) goes to the list `names.reply_key(reply)`. `leader`: the coordinator that sent it;
    a worker refuses a command whose sender no longer holds the lease (on a Redis Cluster,
    where the command stream and the lease are in different hash slots, the send itself
    cannot be fenced by the lease)."""

    plan_version: int | None = msgspec.field(default=None, name="version")
    deadline: float | None = None
    reply: str | None = None
    leader: str | None = None


class RoundCommand(CommandBase, tag="round", kw_only=True):
    """Fold the statistics (Algorithm 2) and write a load report for round `round`."""

    round: int = msgspec.field(name="n")


class ReduceCommand(CommandBase, tag="reduce", kw_only=True):
    """mH's side of §4.3.2 with mL = `to`: subset-sum of whole partitions, else a split."""

    round: int = msgspec.field(name="n")
    to: str
    cost_ml: float = msgspec.field(name="c_ml")
    r_s: float
    ids: list[str]  # new partition ids the change may use


class MoveCommand(CommandBase, tag="move", kw_only=True):
    partitions: list[str]
    to: str
    ids: list[str]


class SplitCommand(CommandBase, tag="split", kw_only=True):
    """Split `partition` at cell `at` along `axis`; `moved` (low | high) goes to `to`, or
    both halves stay (None)."""

    partition: str
    axis: Literal["x", "y"]
    at: int
    moved: Literal["low", "high"] | None = None
    to: str
    ids: list[str]


class MergeCommand(CommandBase, tag="merge", kw_only=True):
    """Merge this worker's adjacent partitions that form rectangles."""

    ids: list[str]


Command = RoundCommand | ReduceCommand | MoveCommand | SplitCommand | MergeCommand

_command_decoder = msgspec.msgpack.Decoder(Command)


def encode_command(cmd: Command) -> bytes:
    return _entry_encoder.encode(cmd)


def decode_command(data: bytes) -> Command:
    cmd: Command = _command_decoder.decode(data)
    return cmd


# --- workers -> hubs -----------------------------------------------------------------------

# A history entry appended for a subscription: (subscription id, id of the entry before it,
# the new entry's id, its packed MatchRefs).
AppendedEntry = tuple[str, str, str, bytes]


class HistoryAppended(msgspec.Struct, tag="h", tag_field="t", rename={
        "tenant": "tn", "bucket": "b", "entries": "e", "records": "r", "sent_at": "sa",
        "written_at": "wa"}):
    """New history entries with the records they reference, so that a hub can push them to
    caught-up clients without reading the history streams. `sent_at`: when the oldest batch
    of the worker's step was appended to its stream; `written_at`: when the entries were
    written (the hops of `app.pipeline.hops`; 0: not known)."""

    tenant: str
    bucket: int
    entries: list[AppendedEntry]
    records: dict[str, bytes]
    sent_at: float = 0.0
    written_at: float = 0.0


class SubsChanged(msgspec.Struct, tag="s", tag_field="t", rename={
        "tenant": "tn", "subs": "s"}):
    """Subscriptions whose history changed (kNN lists): listeners read them."""

    tenant: str
    subs: list[str]


Notification = HistoryAppended | SubsChanged

_notification_decoder = msgspec.msgpack.Decoder(Notification)


def encode_notification(msg: Notification) -> bytes:
    return _entry_encoder.encode(msg)


def decode_notification(data: bytes) -> Notification:
    note: Notification = _notification_decoder.decode(data)
    return note


class MatchRefs(msgspec.Struct, array_like=True):
    """One history entry of a subscription: the matched records (ids into the records hash of
    the entry's bucket) and each one's detect code (0 inside, 1 enter, 2 exit)."""

    record_ids: list[str]
    detect: bytes


_refs_decoder = msgspec.msgpack.Decoder(MatchRefs)


def encode_refs(refs: MatchRefs) -> bytes:
    return _entry_encoder.encode(refs)


def decode_refs(data: bytes) -> MatchRefs:
    return _refs_decoder.decode(data)


# --- workers -> coordinator and admin API (JSON) --------------------------------------------

class PartitionLoad(msgspec.Struct):
    """One partition's SWARM statistics at the end of a round (§4.2) and its cost numerator
    N·Q·R (§3)."""

    id: str
    N: float
    Q: float
    R: float
    num: float


class LoadReport(msgspec.Struct):
    """A worker's report of round `round` (JSON, in `names.report_key(round)` and
    `names.STATS_KEY`): Num(C(m)) and R(m), SWARM §4.3.1; C(m) = num / R(S)."""

    worker: str
    round: int
    at: float
    num: float
    r_m: float = msgspec.field(name="R")
    plan_version: int | None = None
    partitions: list[PartitionLoad] = []
    received: int = 0  # objects and subscriptions this round (R of replicated mode)
    # How far the newest entry of its stream was ahead of the last one it had processed, in
    # seconds of their ids: a backlog. One that shrank over a round inflated the round's R.
    behind_s: float = 0.0
    # The round's counts began at the worker's previous report: its time (0: none before)
    # and the backlog then.
    since: float = 0.0
    behind_since_s: float = 0.0


_report_decoder = msgspec.json.Decoder(LoadReport)


def decode_report(data: bytes | str) -> LoadReport | None:
    """A worker's report, or None when it is not one (a stale format, a foreign writer)."""
    try:
        report: LoadReport = _report_decoder.decode(data)
    except msgspec.DecodeError:
        return None
    return report


# --- replies and admin requests on Redis lists (JSON) --------------------------------------

class CommandReply(msgspec.Struct):
    """A worker's answer to a balancing command that asked for one (`CommandBase.reply`),
    pushed to `names.reply_key(token)`: what it did (`action`: none, move, split or merge),
    the plan `version` it published and the change in `details`; or why it refused."""

    ok: bool
    worker: str = ""
    action: str = "none"
    version: int | None = None
    details: dict[str, Any] = {}
    error: str | None = None


class AdminRequest(msgspec.Struct, omit_defaults=True):
    """`POST /v1/admin/rebalance` as the api hands it to the leader coordinator (on
    `names.REQUESTS_KEY`): a round now, a move of `partition` to worker `to`, or a split of
    `partition` along `axis` after cell `at`. `id` is the token of the reply list."""

    id: str
    kind: str  # round | move | split (checked by the coordinator: it answers 422 otherwise)
    partition: str | None = None
    to: str | None = None
    axis: Literal["x", "y"] | None = None
    at: int | None = None


class AdminReply(msgspec.Struct, omit_defaults=True):
    """The coordinator's answer to an `AdminRequest`: the HTTP status for the api, with the
    round's result (202) or the error."""

    status: int
    round: int | None = None
    action: str | None = None
    details: dict[str, Any] | None = None
    error: str | None = None


ListMessage = CommandReply | AdminRequest | AdminReply
ListMessageT = TypeVar("ListMessageT", CommandReply, AdminRequest, AdminReply)


def decode_list_message(data: bytes | str, kind: type[ListMessageT]) -> ListMessageT | None:
    """A reply or request read from a Redis list, or None when it is not one."""
    try:
        return msgspec.json.decode(data, type=kind)
    except msgspec.DecodeError:
        return None


# --- api -> hubs ---------------------------------------------------------------------------

class KeyRevoked(msgspec.Struct):
    key: str


class SubsGone(msgspec.Struct, omit_defaults=True):
    deleted: list[str] = []
    expired: list[str] = []


_json_encoder = msgspec.json.Encoder()
_revoked_decoder = msgspec.json.Decoder(KeyRevoked)
_gone_decoder = msgspec.json.Decoder(SubsGone)


def encode_json(msg: KeyRevoked | SubsGone | LoadReport | ListMessage) -> bytes:
    return _json_encoder.encode(msg)


def decode_revoked(data: bytes) -> KeyRevoked:
    return _revoked_decoder.decode(data)


def decode_gone(data: bytes) -> SubsGone:
    return _gone_decoder.decode(data)
