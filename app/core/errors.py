"""The small error hierarchy of the API, each mapped to its status code in one handler."""

from __future__ import annotations


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
