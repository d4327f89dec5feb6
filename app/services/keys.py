"""API keys and tenants in SQL; only hashes are stored."""

from __future__ import annotations

import time

from sqlalchemy import select
from sqlalchemy.orm import Session

from app.core.security import Principal, hash_key, new_id, new_key
from app.models import ApiKey, Tenant


def ensure_tenant(session: Session, name: str) -> None:
    if session.get(Tenant, name) is None:
        session.add(Tenant(name=name))
        session.flush()


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


def lookup(session: Session, key: str) -> Principal | None:
    row = session.scalar(
        select(ApiKey).where(ApiKey.key_hash == hash_key(key), ApiKey.revoked_at.is_(None))
    )
    if row is None:
        return None
    return Principal(key_id=row.id, tenant=row.tenant, admin=row.admin)
