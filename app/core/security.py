"""API keys: generated with enough entropy that a plain SHA-256 is a safe stored hash."""

from __future__ import annotations

import hashlib
import hmac
import secrets
from dataclasses import dataclass

BOOTSTRAP_TENANT = "admin"


@dataclass(frozen=True)
class Principal:
    key_id: str
    tenant: str
    admin: bool


def new_key() -> str:
    return "gs_" + secrets.token_urlsafe(32)


def new_id(prefix: str) -> str:
    return prefix + secrets.token_hex(10)


def hash_key(key: str) -> str:
    return hashlib.sha256(key.encode("utf-8", "surrogatepass")).hexdigest()


def bootstrap_principal(key: str, bootstrap: str | None) -> Principal | None:
    if bootstrap and hmac.compare_digest(hash_key(key), hash_key(bootstrap)):
        return Principal(key_id="bootstrap", tenant=BOOTSTRAP_TENANT, admin=True)
    return None
