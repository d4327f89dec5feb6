"""Every Redis key, stream, channel and consumer-group name geoswarm uses, defined once.

Everything geoswarm writes to Redis starts with "gs:". The messages on these streams and
channels are the typed classes of `app.pipeline.wire`.
"""

from __future__ import annotations

GROUP = "exec"  # the consumer group of every worker stream and command stream

# The partition plan (SWARM §4.1): the current one, its versions (SSTD's versioned mapping,
# SWARM §5.2's partition chains) and the channel announcing a new version.
PLAN_KEY = "gs:plan"
PLAN_CHANNEL = "gs:plan:changed"
PLAN_HISTORY = "gs:plan:history"  # list of JSON {"version", "valid_from", "plan"}
PLAN_HISTORY_MAX = 1000
PART_SEQ = "gs:partition:seq"  # counter for new partition ids "p<n>"

WORKERS_KEY = "gs:workers"  # hash worker id -> JSON heartbeat {pid, host, heartbeat, ...}
DEAD_LETTER = "gs:dead"  # stream of entries delivered too often
DEAD_LETTER_COUNT = "gs:metrics:dead_letter"
DEAD_LETTER_REPLAY_TTL_S = 24 * 3600


def dead_letter_replayed_key(dead_letter_id: str) -> str:
    """String `<stream>`, newline, `<new entry id>`: the outcome of a dead letter's replay,
    so that a replay sent again (its reply was lost) answers the same instead of 404."""
    return f"gs:dead:replayed:{dead_letter_id}"


# Channels to the api processes' hubs.
NOTIFY_CHANNEL = "gs:notify"  # wire.HistoryAppended / wire.SubsChanged from the workers
REVOKED_CHANNEL = "gs:revoked"  # wire.KeyRevoked
# A random token replaced by every key revocation: api processes hold the keys they checked in
# SQL only while it is unchanged (`security.KeyCache`).
KEYS_TOKEN = "gs:keys:token"
SUBS_CHANNEL = "gs:subs"  # wire.SubsGone: deleted / expired subscriptions

# SWARM's coordinator (§4.3.1).
LEASE_KEY = "gs:coord:lease"  # the leader coordinator's id, with an expiry
REQUESTS_KEY = "gs:coord:requests"  # list: admin requests for the coordinator (JSON)
BALANCER_CONFIG = "gs:balancer:config"  # JSON {"enabled", "period_s", "beta"}
BALANCER_STATE = "gs:balancer:state"  # JSON: decision pointer, last round, costs
STATS_KEY = "gs:stats"  # hash worker -> its latest load report (JSON)
ROUND_SEQ = "gs:balancer:round"  # counter of rounds (automatic and manual)

EXPIRY_LOCK = "gs:lock:expiry"  # one api process at a time expires subscriptions
POSITIONS_PREFIX = "gs:pos:"


def worker_stream(worker: str) -> str:
    """The stream a worker consumes: wire.WorkerEntry messages in field `m`."""
    return f"gs:w:{worker}"


def outbox_stream(worker: str) -> str:
    """The commits of a worker stream's consumer waiting to be relayed to other hash slots
    (`workers.outbox`; used on a Redis Cluster)."""
    return f"gs:out:{worker}"


def command_stream(worker: str) -> str:
    """The stream of the coordinator's wire.Command messages to one worker."""
    return f"gs:cmd:{worker}"


def query_stream(worker: str) -> str:
    """The stream of snapshot query parts sent straight to one worker (`wire.QueryPart` in
    field `m`; the worker answers once a read of its worker stream reached that stream's
    end)."""
    return f"gs:wq:{worker}"


def history_key(sub_id: str) -> str:
    """A subscription's history of matches (entries of record references, or kNN lists)."""
    return f"gs:h:{sub_id}"


def history_last_key(tenant: str) -> str:
    """A tenant's hash of the id of the last history entry ever written for each of its
    subscriptions (field: the subscription's `history_key`). It outlives the history streams
    (which expire when quiet) so that a resume can tell a quiet subscription from one whose
    unread entries were trimmed; a subscription's field goes with it."""
    return f"gs:hlast:{tenant}"


def positions_key(tenant: str) -> str:
    """Hash: moving object id -> its latest record (last writer wins, CheetahGIS)."""
    return f"{POSITIONS_PREFIX}{tenant}"


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
    return f"gs:done:{worker}:{entry_id}"


def knn_key(sub_id: str) -> str:
    """Hash: worker -> its local top k of a kNN subscription, and the merged list."""
    return f"gs:knn:{sub_id}"


def report_key(round_no: int) -> str:
    return f"gs:report:{round_no}"


def reply_key(token: str) -> str:
    return f"gs:reply:{token}"


def rate_key(key_id: str, window: int) -> str:
    return f"gs:rl:{key_id}:{window}"


def publish_guard_key(token: str) -> str:
    """Set by the first application of one publish: a repeated call is then a no-op."""
    return f"gs:pub:{token}"


def object_expiry_key(tenant: str) -> str:
    """Sorted set: moving object id -> when it leaves the latest-position store (its TTL)."""
    return f"gs:posexp:{tenant}"


OBJECT_EXPIRY_TENANTS = "gs:posexp:tenants"  # set: tenants whose moving objects can expire


def events_key(tenant: str) -> str:
    """Present while a worker may hold an event of the tenant (a record without an id, kept
    for the live window where it was stored): renewed by every publish holding one, it
    expires a window after the last. Without it, kNN registrations need no previous owner."""
    return f"gs:events:{tenant}"


def keyword_summaries_key(worker: str) -> str:
    """Hash: tenant -> the worker's `wire.KeywordSummary` of that tenant's subscriptions, read
    by the routers to mark the rows that cannot match there (Tornado §4)."""
    return f"gs:ksum:{worker}"


def window_stream(worker: str) -> str:
    """The records a worker holds in its live window (`wire.ObjectBatch` in field `m`, with
    their arrival time): what it rebuilds its window from after a restart. Trimmed by age."""
    return f"gs:win:{worker}"


def cell_counts_key(worker: str) -> str:
    """Hash: `cell_counts_field(tenant, bucket)` -> `wire.CellCounts` of the records a worker
    holds, and field `CELL_COUNTS_UPTO`: the id of its stream's entry up to which (included)
    they count every record. The api answers the whole cells of a count query from them.
    Each counts field has a version field (`cell_counts_version_field`), written with it: the
    api re-reads only the counts whose version changed."""
    return f"gs:cells:{worker}"


def cell_counts_version_field(field: str) -> str:
    """The version of a counts field: unique among all the writes of it (the worker's fence
    epoch and a sequence number), so that a reader holding it knows the counts unchanged."""
    return field + "\x1ev"


def cell_counts_field(tenant: str, bucket: int) -> str:
    """One tenant's counts of one arrival bucket (a worker rewrites only the buckets that
    changed, mostly the current one)."""
    return f"{tenant}\x1f{bucket}"


CELL_COUNTS_UPTO = "@"

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
    return f"gs:fence:{worker}"


def adopter_key(worker: str) -> str:
    """The live worker that processes a dead worker's stream until it returns."""
    return f"gs:adopt:{worker}"


def adopted_key(worker: str) -> str:
    """Set: the dead workers whose streams `worker` processes."""
    return f"gs:adopted:{worker}"
