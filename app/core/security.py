"""API keys: generated with enough entropy that a plain SHA-256 is a safe stored hash; the
throttle of failed key checks per client address; keys kept out of the access logs."""

from __future__ import annotations

import hashlib
import hmac
import logging
import math
import re
import secrets
import time
from dataclasses import dataclass

BOOTSTRAP_TENANT = "admin"
BOOTSTRAP_KEY_ID = "bootstrap"


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
        return Principal(key_id=BOOTSTRAP_KEY_ID, tenant=BOOTSTRAP_TENANT, admin=True)
    return None


class AuthFailures:
    """Failed key checks per client address in fixed windows, in this process's memory: an
    address with `limit` failures in the current window is refused before its key is looked up
    (so unknown keys cannot make an unbounded number of SQL lookups). Memory is bounded: past
    `max_addresses` tracked addresses, finished windows are forgotten, then the oldest."""

    def __init__(self, limit: int, window_s: float, max_addresses: int = 100_000) -> None:
        self.limit = limit
        self.window_s = window_s
        self.max_addresses = max_addresses
        self._windows: dict[str, tuple[float, int]] = {}  # address -> (window start, failures)

    def retry_after(self, address: str, now: float | None = None) -> int | None:
        """Seconds until `address` may try again, or None when it may now."""
        if self.limit <= 0:
            return None
        entry = self._windows.get(address)
        if entry is None:
            return None
        now = time.monotonic() if now is None else now
        start, count = entry
        if now - start >= self.window_s:
            del self._windows[address]
            return None
        if count < self.limit:
            return None
        return max(1, math.ceil(start + self.window_s - now))

    def failed(self, address: str, now: float | None = None) -> None:
        if self.limit <= 0:
            return
        now = time.monotonic() if now is None else now
        start, count = self._windows.get(address, (now, 0))
        if now - start >= self.window_s:
            start, count = now, 0
        self._windows[address] = (start, count + 1)
        if len(self._windows) > self.max_addresses:
            self._prune(now)

    def _prune(self, now: float) -> None:
        live = {a: e for a, e in self._windows.items() if now - e[0] < self.window_s}
        if len(live) > self.max_addresses // 2:
            newest = sorted(live.items(), key=lambda item: item[1][0])[-(self.max_addresses // 2):]
            live = dict(newest)
        self._windows = live


class KeyCache:
    """Keys this process found valid in SQL, so that a request needs no SQL lookup: each is
    held with the revocation token (`names.KEYS_TOKEN`) read before its lookup, and used only
    while that token is unchanged. A revocation sets a new token after its SQL commit, so
    every api process looks the key up again from then on (a key revoked stops working at
    once). An entry also expires after `max_age_s`: the bound when the new token could not be
    written (Redis failing at that moment). Memory is bounded: past `size` keys, all go."""

    def __init__(self, max_age_s: float, size: int = 10_000) -> None:
        self.max_age_s = max_age_s
        self.size = size
        self._held: dict[str, tuple[Principal, bytes, float]] = {}
        self._counts: dict[str, tuple[int, int]] = {}  # key id -> (window, count): `counted`

    def get(self, key: str, token: bytes) -> Principal | None:
        held = self._held.get(hash_key(key))
        if held is None or held[1] != token or time.monotonic() - held[2] > self.max_age_s:
            return None
        return held[0]

    def held(self, key: str) -> Principal | None:
        """The principal `key` is held with, whatever the token (for its id: not a check)."""
        held = self._held.get(hash_key(key))
        return held[0] if held is not None else None

    def put(self, key: str, principal: Principal, token: bytes) -> None:
        if len(self._held) >= self.size:
            self._held.clear()
        self._held[hash_key(key)] = (principal, token, time.monotonic())

    def fresh(self, key: str) -> Principal | None:
        """The principal `key` is held with if its entry has not expired (valid if the token
        is still the one it was held with: `get` tells)."""
        held = self._held.get(hash_key(key))
        if held is None or time.monotonic() - held[2] > self.max_age_s:
            return None
        return held[0]

    def counted(self, key_id: str, window: int, count: int) -> None:
        """Note a key's requests in the second `window` so far (as a rate counter told)."""
        if len(self._counts) >= self.size:
            self._counts.clear()
        self._counts[key_id] = (window, count)

    def count(self, key_id: str, window: int) -> int:
        """The key's requests in the second `window` as last noted (0 if none were)."""
        noted = self._counts.get(key_id)
        return noted[1] if noted is not None and noted[0] == window else 0


_TOKEN_IN_QUERY = re.compile(r"([?&]token=)[^&\s\"]*")
REDACTED = "[redacted]"


def redact_tokens(text: str) -> str:
    """`?token=<key>` (WebSocket authentication) as `?token=[redacted]`."""
    return _TOKEN_IN_QUERY.sub(r"\g<1>" + REDACTED, text)


class RedactTokens(logging.Filter):
    """Rewrites `token=...` in a record's message and arguments: uvicorn logs each request's
    path with its query string (`uvicorn.access`, and `uvicorn.error` for WebSocket
    handshakes), which would put WebSocket clients' keys in the logs."""

    def filter(self, record: logging.LogRecord) -> bool:
        if isinstance(record.msg, str) and "token=" in record.msg:
            record.msg = redact_tokens(record.msg)
        args = record.args
        if isinstance(args, tuple) and any(isinstance(a, str) and "token=" in a for a in args):
            record.args = tuple(redact_tokens(a) if isinstance(a, str) else a for a in args)
        return True


REDACTED_LOGGERS = ("uvicorn.access", "uvicorn.error")


def install_log_redaction() -> None:
    """Add RedactTokens to uvicorn's loggers (once). Filters on a logger survive uvicorn's
    logging dictConfig, which replaces handlers only."""
    for name in REDACTED_LOGGERS:
        logger = logging.getLogger(name)
        if not any(isinstance(f, RedactTokens) for f in logger.filters):
            logger.addFilter(RedactTokens())
