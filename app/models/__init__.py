"""SQLAlchemy models: tenants, API keys (hashes only), subscriptions."""

from __future__ import annotations

import time

from sqlalchemy import (
    JSON,
    BigInteger,
    Boolean,
    Float,
    ForeignKey,
    Index,
    Integer,
    MetaData,
    String,
)
from sqlalchemy.orm import DeclarativeBase, Mapped, mapped_column

NAMING = {
    "ix": "ix_%(column_0_label)s",
    "uq": "uq_%(table_name)s_%(column_0_name)s",
    "ck": "ck_%(table_name)s_%(constraint_name)s",
    "fk": "fk_%(table_name)s_%(column_0_name)s_%(referred_table_name)s",
    "pk": "pk_%(table_name)s",
}


class Model(DeclarativeBase):
    metadata = MetaData(naming_convention=NAMING)


class CreatedAtMixin:
    created_at: Mapped[float] = mapped_column(Float, default=time.time, nullable=False)


class Tenant(CreatedAtMixin, Model):
    __tablename__ = "tenants"

    name: Mapped[str] = mapped_column(String(64), primary_key=True)


class ApiKey(CreatedAtMixin, Model):
    __tablename__ = "api_keys"

    id: Mapped[str] = mapped_column(String(40), primary_key=True)
    tenant: Mapped[str] = mapped_column(ForeignKey("tenants.name"), nullable=False, index=True)
    admin: Mapped[bool] = mapped_column(Boolean, default=False, nullable=False)
    key_hash: Mapped[str] = mapped_column(String(64), unique=True, nullable=False)
    revoked_at: Mapped[float | None] = mapped_column(Float, nullable=True)


class Subscription(CreatedAtMixin, Model):
    __tablename__ = "subscriptions"
    __table_args__ = (
        Index("ix_subscriptions_tenant_seq", "tenant", "seq"),
        Index("ix_subscriptions_expires_at", "expires_at"),
    )

    # seq orders the cursor pagination; id is the opaque public id. 64-bit: on SQLite an
    # INTEGER primary key is the (64-bit) rowid already, and must stay INTEGER to remain it.
    seq: Mapped[int] = mapped_column(BigInteger().with_variant(Integer, "sqlite"),
                                     primary_key=True, autoincrement=True)
    id: Mapped[str] = mapped_column(String(40), unique=True, nullable=False)
    tenant: Mapped[str] = mapped_column(ForeignKey("tenants.name"), nullable=False)
    type: Mapped[str] = mapped_column(String(16), nullable=False)
    spec: Mapped[dict[str, object]] = mapped_column(JSON, nullable=False)
    expires_at: Mapped[float | None] = mapped_column(Float, nullable=True)


class BalancerRound(Model):
    """One SWARM load-balancing round (§4.3.1) or manual rebalance, as the coordinator ran it."""

    __tablename__ = "balancer_rounds"
    __table_args__ = (Index("ix_balancer_rounds_started_at", "started_at"),)

    seq: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=True)
    round: Mapped[int] = mapped_column(Integer, nullable=False)
    started_at: Mapped[float] = mapped_column(Float, nullable=False)
    kind: Mapped[str] = mapped_column(String(16), nullable=False)  # auto | manual | failover
    r_s: Mapped[float] = mapped_column(Float, nullable=False)  # R(S)
    costs: Mapped[dict[str, object]] = mapped_column(JSON, nullable=False)  # worker -> C(m)
    stage: Mapped[str] = mapped_column(String(16), nullable=False)
    decision: Mapped[str] = mapped_column(String(16), nullable=False)  # nothing | rebalance
    mh: Mapped[str | None] = mapped_column(String(64), nullable=True)
    ml: Mapped[str | None] = mapped_column(String(64), nullable=True)
    action: Mapped[str] = mapped_column(String(16), nullable=False)  # none|move|split|merge
    details: Mapped[dict[str, object]] = mapped_column(JSON, nullable=False)
    plan_version: Mapped[int | None] = mapped_column(Integer, nullable=True)
    duration_ms: Mapped[float] = mapped_column(Float, nullable=False)
