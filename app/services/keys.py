"""API keys and tenants in SQL; only hashes are stored."""

from __future__ import annotations

import time
from collections.abc import Collection

from sqlalchemy import select
from sqlalchemy.exc import IntegrityError
from sqlalchemy.orm import Session

from app.core.security import Principal, hash_key, new_id, new_key
from app.models import ApiKey, Tenant


def ensure_tenant(session: Session, name: str) -> None:
    """Create the tenant unless it exists. Two first requests of a tenant may both find it
    missing: the insert does nothing when the other one's insert won the race, rather than
    failing with a conflict the client did not cause."""
    if session.get(Tenant, name) is not None:
        return
    dialect = session.get_bind().dialect.name
    if dialect in ("sqlite", "postgresql"):
        # the dialect's own insert, imported here: every process that imports this module
        # (api, workers) would otherwise load both dialects, every driver of PostgreSQL's
        # included, at start (0.1 s)
        if dialect == "sqlite":
            from sqlalchemy.dialects.sqlite import insert as sqlite_insert
            stmt = sqlite_insert(Tenant).values(name=name, created_at=time.time())
            session.execute(stmt.on_conflict_do_nothing(index_elements=[Tenant.name]))
        else:
            from sqlalchemy.dialects.postgresql import insert as pg_insert
            pg = pg_insert(Tenant).values(name=name, created_at=time.time())
            session.execute(pg.on_conflict_do_nothing(index_elements=[Tenant.name]))
        return
    try:
        with session.begin_nested():  # elsewhere: the insert in a savepoint
            session.add(Tenant(name=name))
    except IntegrityError:
        if session.get(Tenant, name) is None:
            raise


def create_key(session: Session, tenant: str, admin: bool) -> tuple[ApiKey, str]:
    ensure_tenant(session, tenant)
    key = new_key()
    row = ApiKey(id=new_id("k_"), tenant=tenant, admin=admin, key_hash=hash_key(key))
    session.add(row)
    session.flush()
    return row, key


def revoke_key(session: Session, key_id: str) -> bool:
    if "\x00" in key_id:  # never one of our ids; PostgreSQL rejects NUL in text
        return False
    row = session.get(ApiKey, key_id)
    if row is None or row.revoked_at is not None:
        return False
    row.revoked_at = time.time()
    return True


def revoked_among(session: Session, key_ids: Collection[str]) -> set[str]:
    """The ids of `key_ids` that no longer authenticate: revoked, or gone from SQL."""
    ids = [k for k in key_ids if "\x00" not in k]
    live: set[str] = set()
    for i in range(0, len(ids), 500):  # bounded IN lists (SQLite limits bound parameters)
        live.update(session.scalars(
            select(ApiKey.id).where(ApiKey.id.in_(ids[i:i + 500]), ApiKey.revoked_at.is_(None))
        ).all())
    return set(key_ids) - live


def lookup(session: Session, key: str) -> Principal | None:
    row = session.scalar(
        select(ApiKey).where(ApiKey.key_hash == hash_key(key), ApiKey.revoked_at.is_(None))
    )
    if row is None:
        return None
    return Principal(key_id=row.id, tenant=row.tenant, admin=row.admin)
