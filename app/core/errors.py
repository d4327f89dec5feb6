"""The small error hierarchy of the API, each mapped to its status code in one handler; the
dependency errors that are the client's (SQL integrity) or transient (Redis out of memory)."""

from __future__ import annotations

import re

import redis.exceptions
from sqlalchemy.exc import IntegrityError


class ApiError(Exception):
    status = 400

    def __init__(self, message: str, headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.headers = headers or {}


class BadRequest(ApiError):
    status = 400


class Unauthorized(ApiError):
    status = 401


class Forbidden(ApiError):
    status = 403


class NotFound(ApiError):
    status = 404


class Conflict(ApiError):
    status = 409


class PayloadTooLarge(ApiError):
    status = 413


class RateLimited(ApiError):
    status = 429


class Unavailable(ApiError):
    status = 503


def is_redis_oom(exc: BaseException) -> bool:
    """A write refused by a Redis at maxmemory with `noeviction` (also when it reaches us from
    inside a script or a transaction, as another ResponseError with the OOM text)."""
    return isinstance(exc, redis.exceptions.OutOfMemoryError) or (
        isinstance(exc, redis.exceptions.ResponseError)
        and "command not allowed when used memory" in str(exc))


_SQLITE_UNIQUE = re.compile(r"UNIQUE constraint failed: ([\w.]+)")
_PG_KEY = re.compile(r"Key \(([^)]*)\)=")


def integrity_problem(exc: IntegrityError) -> tuple[int, str]:
    """The status and message of an integrity error: 409 for a duplicate (a unique constraint:
    the message names the column, e.g. an id that already exists), 422 for any other broken
    constraint (a reference to a row that does not exist, a missing value)."""
    text = str(exc.orig) if exc.orig is not None else str(exc)
    low = text.lower()
    if "unique" in low or "duplicate key" in low:
        found = _SQLITE_UNIQUE.search(text) or _PG_KEY.search(text)
        column = found.group(1).rsplit(".", 1)[-1] if found else "key"
        where = f" ({found.group(1)})" if found and "." in found.group(1) else ""
        return 409, f"conflict: a row with this {column} already exists{where}"
    if "foreign key" in low:
        return 422, "the request refers to a row that does not exist"
    if "not null" in low:
        return 422, "the request lacks a required value"
    return 422, "the request breaks a database constraint"
