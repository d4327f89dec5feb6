"""Every Redis key, stream, channel and consumer-group name geoswarm uses, defined once.

Everything geoswarm writes to Redis starts with "gs:". The messages on these streams and
channels are the typed classes of `app.pipeline.wire`.

Keys that one script or transaction touches together carry one hash tag (the part in
braces), so that on a Redis Cluster they live in one hash slot: `{gs}` for the cluster's
control (plan, coordinator), `{<worker>}` for a worker's streams and what it commits with
them, `{t:<tenant>}` for a tenant's positions and publishes, and `{h<n>}` for a group of
subscriptions' histories and kNN hashes (`history_tag`).
"""

from __future__ import annotations

import zlib

CONTROL = "{gs}"
OUTBOX_PREFIX = "gs:out:"  # every outbox stream (`app.pipeline.outbox`)
HISTORY_GROUPS = 256  # the hash slots subscriptions' histories are spread over


def worker_tag(worker: str) -> str:
    return "{" + worker + "}"


def tenant_tag(tenant: str) -> str:
    return "{t:" + tenant + "}"


def history_tag(sub_id: str) -> str:
    """The hash tag of a subscription's history, its kNN hash and its last-id field."""
    return "{h" + str(zlib.crc32(sub_id.encode()) % HISTORY_GROUPS) + "}"

GROUP = "exec"  # the consumer group of every worker stream and command stream

# The partition plan (SWARM §4.1): the current one, its versions (SSTD's versioned mapping,
# SWARM §5.2's partition chains) and the channel announcing a new version.
PLAN_KEY = "gs:plan:" + CONTROL
PLAN_CHANNEL = "gs:plan:changed"
PLAN_HISTORY = "gs:plan:history:" + CONTROL  # list of JSON {"version", "valid_from", "plan"}
PLAN_HISTORY_MAX = 1000
PART_SEQ = "gs:partition:seq:" + CONTROL  # counter for new partition ids "p<n>"
# With outboxes (`app.pipeline.outbox`), a plan change is staged, then activated: the version
# a staged change will publish (no other change is staged meanwhile), and the outbox of the
# control steps, whose entry writes the receivers' handoffs and then activates the plan.
PLAN_PENDING = "gs:plan:pending:" + CONTROL
CONTROL_OUTBOX = OUTBOX_PREFIX + CONTROL
# hash worker -> how many times it started (with outboxes: a failover staged from a decision
# made before a start of the worker is refused, `workers.failover`)
WORKER_STARTS = "gs:workers:starts:" + CONTROL

# hash worker id -> JSON heartbeat {pid, host, heartbeat, ...}
WORKERS_KEY = "gs:workers:" + CONTROL
DEAD_LETTER = "gs:dead"  # stream of entries delivered too often
DEAD_LETTER_COUNT = "gs:metrics:dead_letter"
DEAD_LETTER_REPLAY_TTL_S = 24 * 3600


def dead_letter_replayed_key(dead_letter_id: str) -> str:
    """String `<stream>`, newline, `<new entry id>`: the outcome of a dead letter's replay,
    so that a replay sent again (its reply was lost) answers the same instead of 404."""
    return f"gs:dead:replayed:{dead_letter_id}"


def dead_letter_appended_key(stream: str, dead_letter_id: str) -> str:
    """The id a dead letter's replay appended to `stream` under, in that stream's hash slot
    (its name holds the stream's tag): the replay in steps, with outboxes."""
    return f"gs:dead:appended:{stream}:{dead_letter_id}"


# Channels to the api processes' hubs. Redis delivers a PUBLISH to the subscribers of every
# database of the server: a deployment in another database than 0 uses its own (`channel`).
NOTIFY_CHANNEL = "gs:notify"  # wire.HistoryAppended / wire.SubsChanged from the workers
REVOKED_CHANNEL = "gs:revoked"  # wire.KeyRevoked
# A random token replaced by every key revocation: api processes hold the keys they checked in
# SQL only while it is unchanged (`security.KeyCache`).
KEYS_TOKEN = "gs:keys:token"
SUBS_CHANNEL = "gs:subs"  # wire.SubsGone: deleted / expired subscriptions

# SWARM's coordinator (§4.3.1).
LEASE_KEY = "gs:coord:lease:" + CONTROL  # the leader coordinator's id, with an expiry
REQUESTS_KEY = "gs:coord:requests:" + CONTROL  # list: admin requests for the coordinator (JSON)
BALANCER_CONFIG = "gs:balancer:config:" + CONTROL  # JSON {"enabled", "period_s", "beta"}
BALANCER_STATE = "gs:balancer:state:" + CONTROL  # JSON: decision pointer, last round, costs
STATS_KEY = "gs:stats:" + CONTROL  # hash worker -> its latest load report (JSON)
ROUND_SEQ = "gs:balancer:round:" + CONTROL  # counter of rounds (automatic and manual)

EXPIRY_LOCK = "gs:lock:expiry"  # one api process at a time expires subscriptions
POSITIONS_PREFIX = "gs:pos:"
WORKER_STREAM_PREFIX = "gs:w:"


def worker_stream(worker: str) -> str:
    """The stream a worker consumes: wire.WorkerEntry messages in field `m`."""
    return WORKER_STREAM_PREFIX + worker_tag(worker)


def outbox_stream(worker: str) -> str:
    """The commits of a worker stream's consumer waiting to be relayed to other hash slots
    (`workers.outbox`; used on a Redis Cluster)."""
    return OUTBOX_PREFIX + worker_tag(worker)


def command_stream(worker: str) -> str:
    """The stream of the coordinator's wire.Command messages to one worker."""
    return "gs:cmd:" + worker_tag(worker)


def query_stream(worker: str) -> str:
    """The stream of snapshot query parts sent straight to one worker (`wire.QueryPart` in
    field `m`; the worker answers once a read of its worker stream reached that stream's
    end)."""
    return "gs:wq:" + worker_tag(worker)


def history_key(sub_id: str) -> str:
    """A subscription's history of matches (entries of record references, or kNN lists)."""
    return history_keys(sub_id)[0]


def history_keys(sub_id: str) -> tuple[str, str]:
    """`history_key` and `history_last_key` of a subscription, its tag computed once."""
    tag = history_tag(sub_id)
    return "gs:h:" + tag + ":" + sub_id, "gs:hlast:" + tag


def history_last_key(sub_id: str) -> str:
    """The hash of the id of the last history entry ever written for each subscription of a
    history group (field: the subscription's `history_key`). It outlives the history streams
    (which expire when quiet) so that a resume can tell a quiet subscription from one whose
    unread entries were trimmed; a subscription's field goes with it."""
    return history_keys(sub_id)[1]


def positions_key(tenant: str) -> str:
    """Hash: moving object id -> its latest record (last writer wins, CheetahGIS)."""
    return POSITIONS_PREFIX + tenant_tag(tenant)


def tenant_of_positions_key(key: str) -> str:
    return key[len(POSITIONS_PREFIX) + len("{t:"):-1]


def ws_slots_key(tenant: str) -> str:
    """Sorted set: one member per open WebSocket of the tenant (any api process), scored by
    when it expires unless its process renews it (ms of Redis time)."""
    return f"gs:quota:ws:{tenant}"


def publish_bucket_key(tenant: str) -> str:
    """The tenant's publish-rate bucket: when its published objects will have been paid for
    at the quota's rate (ms of Redis time)."""
    return f"gs:quota:pub:{tenant}"


def records_key(tenant: str, bucket: int) -> str:
    """Hash: record id -> the public JSON of a matched record, stored once per record."""
    return f"gs:rec:{tenant}:{bucket}"


def done_key(worker: str, entry_id: str) -> str:
    """Marks a worker stream entry whose matches are written (replays skip it)."""
    return "gs:done:" + worker_tag(worker) + ":" + entry_id


def knn_key(sub_id: str) -> str:
    """Hash: worker -> its local top k of a kNN subscription, and the merged list."""
    return "gs:knn:" + history_tag(sub_id) + ":" + sub_id


def report_key(round_no: int) -> str:
    return f"gs:report:{round_no}"


def reply_key(token: str) -> str:
    return f"gs:reply:{token}"


def rate_key(key_id: str, window: int) -> str:
    return f"gs:rl:{key_id}:{window}"


def publish_guard_key(tenant: str, token: str) -> str:
    """Set by the first application of one publish: a repeated call is then a no-op."""
    return "gs:pub:" + tenant_tag(tenant) + ":" + token


def history_outbox(sub_id: str) -> str:
    """Messages to workers written by the kNN scripts on a subscription's hash, waiting to be
    relayed (with outboxes; `app.pipeline.knnreg`): one outbox per history group."""
    return OUTBOX_PREFIX + history_tag(sub_id)


HISTORY_OUTBOXES = tuple(OUTBOX_PREFIX + "{h" + str(n) + "}" for n in range(HISTORY_GROUPS))


def tenant_outbox(tenant: str) -> str:
    """The api's writes of a tenant to other hash slots (its publishes' worker entries, its
    subscriptions' messages), when they go through an outbox (`app.pipeline.outbox`)."""
    return OUTBOX_PREFIX + tenant_tag(tenant)


OUTBOX_TENANTS = "gs:out:tenants"  # set: the tenants whose outbox the expiry round relays


def object_expiry_key(tenant: str) -> str:
    """Sorted set: moving object id -> when it leaves the latest-position store (its TTL)."""
    return "gs:posexp:" + tenant_tag(tenant)


OBJECT_EXPIRY_TENANTS = "gs:posexp:tenants"  # set: tenants whose moving objects can expire


def events_key(tenant: str) -> str:
    """Present while a worker may hold an event of the tenant (a record without an id, kept
    for the live window where it was stored): renewed by every publish holding one, it
    expires a window after the last. Without it, kNN registrations need no previous owner."""
    return "gs:events:" + tenant_tag(tenant)


def keyword_summaries_key(worker: str) -> str:
    """Hash: tenant -> the worker's `wire.KeywordSummary` of that tenant's subscriptions, read
    by the routers to mark the rows that cannot match there (Tornado §4)."""
    return "gs:ksum:" + worker_tag(worker)


def window_stream(worker: str) -> str:
    """The records a worker holds in its live window (`wire.ObjectBatch` in field `m`, with
    their arrival time): what it rebuilds its window from after a restart. Trimmed by age."""
    return "gs:win:" + worker_tag(worker)


def cell_counts_key(worker: str) -> str:
    """Hash: `cell_counts_field(tenant, bucket)` -> `wire.CellCounts` of the records a worker
    holds, and field `CELL_COUNTS_UPTO`: the id of its stream's entry up to which (included)
    they count every record. The api answers the whole cells of a count query from them.
    Each counts field has a version field (`cell_counts_version_field`), written with it: the
    api re-reads only the counts whose version changed. Per tenant, field
    `cell_counts_index_field` lists the buckets it has counts of (decimal numbers, spaces
    between), once field `CELL_COUNTS_INDEXED` says the worker writes those lists: a reader
    visits the buckets held, however many the window's span could hold. A list has a version
    field too, rewritten with any of the tenant's counts: a reader that holds it knows that
    nothing of the tenant's changed without visiting any bucket."""
    return "gs:cells:" + worker_tag(worker)


def cell_counts_version_field(field: str) -> str:
    """The version of a counts field: unique among all the writes of it (the worker's fence
    epoch and a sequence number), so that a reader holding it knows the counts unchanged."""
    return field + "\x1ev"


def cell_counts_field(tenant: str, bucket: int) -> str:
    """One tenant's counts of one arrival bucket (a worker rewrites only the buckets that
    changed, mostly the current one)."""
    return f"{tenant}\x1f{bucket}"


def cell_counts_index_field(tenant: str) -> str:
    """The buckets of one tenant's counts fields, written with them (see `cell_counts_key`)."""
    return f"{tenant}\x1f#"


CELL_COUNTS_UPTO = "@"
CELL_COUNTS_INDEXED = "#"

# The archive (app.archive.layout): per worker, the last arrival bucket whose files are all
# committed (hash worker -> bucket).
ARCHIVE_CUT = "gs:archive:cut"
# Snapshot query parts for the archive (wire.QueryPart, field `m`), taken by the query runners
# (spark.runner) of consumer group RUNNER_GROUP; their heartbeats.
ARCHIVE_JOBS = "gs:archive:jobs"
RUNNER_GROUP = "runners"
RUNNERS_KEY = "gs:runners"  # hash runner id -> JSON heartbeat {pid, host, heartbeat, ...}
ARCHIVE_WORKER = "archive"  # the `worker` of the query runners' replies


def archive_query_log(tenant: str) -> str:
    """Stream of the regions (grid cells "x0,y0,x1,y1", field `r`; time, field `t`) of a
    tenant's archive queries: AQWA's query workload, read by compaction."""
    return f"gs:archive:qlog:{tenant}"


def ingest_progress_key(run: str) -> str:
    """Hash: the counts of one `geoswarm ingest` run's validating tasks so far (read, valid,
    rejected)."""
    return f"gs:ingest:{run}"


def compact_lock(tenant: str) -> str:
    """Held by the one process compacting a tenant's archive."""
    return f"gs:archive:compacting:{tenant}"


def query_reply_key(token: str) -> str:
    """List: the workers' `wire.QueryReply` to one round of a snapshot query."""
    return f"gs:qr:{token}"


def query_key(query_id: str) -> str:
    """A snapshot query's state (JSON: tenant, status, results or error), for
    `GET /v1/queries/{id}` from any api process; it expires an hour after the query ends."""
    return f"gs:query:{query_id}"


def fence_key(worker: str) -> str:
    """Integer epoch of whoever consumes a worker's stream: the worker takes it (INCR) when it
    starts, a failover takes it from a dead worker. Every transaction of a consumer WATCHes
    it, so a worker declared dead that wakes up cannot commit anything (workers.failover)."""
    return "gs:fence:" + worker_tag(worker)


def adopter_key(worker: str) -> str:
    """The live worker that processes a dead worker's stream until it returns."""
    return "gs:adopt:" + worker_tag(worker)


def adopted_key(worker: str) -> str:
    """Set: the dead workers whose streams `worker` processes."""
    return "gs:adopted:" + worker_tag(worker)


def channel(name: str, db: int) -> str:
    """Channel `name` of the deployment in Redis database `db`: pub/sub ignores databases, so
    two deployments on one server (databases 0 and 3, say) would hear each other's messages:
    every hub decoding the other's notifications, and a revocation in one closing the other's
    sockets of the same key id (a staging copy restored from production's SQL backup holds
    the same keys). Database 0 (and a Redis Cluster, which has no other) keeps the plain
    name."""
    return name if not db else f"{name}@db{db}"
