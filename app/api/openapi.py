"""The OpenAPI document served at /openapi.json: FastAPI's, with the error responses of API.md
(Errors) declared route by route, the bearer key, and the schemas of bodies a route reads
itself (POST /v1/objects). Client generators read it, so it says only what the server does."""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from typing import Any, Literal

from fastapi import FastAPI
from pydantic import BaseModel
from pydantic.json_schema import models_json_schema

from app import schemas
from app.schemas import Error, ValidationErrorBody

REF_PREFIX = "#/components/schemas/"

RETRY_AFTER = {
    "description": "Seconds to wait before retrying.",
    "required": True,
    "schema": {"type": "integer", "minimum": 0},
}

# status → (what it means in API.md, the body the exception handlers of app/main.py send)
_ERRORS: dict[int, tuple[str, type[BaseModel]]] = {
    400: ("Malformed JSON or an unreadable body.", Error),
    401: ("Missing, unknown or revoked API key.", Error),
    403: ("A tenant key on an admin endpoint.", Error),
    404: ("Unknown id, or an id of another tenant.", Error),
    409: ("The request conflicts with the current state.", Error),
    413: ("Body over max_body_bytes (default 8 MiB) or batch over max_batch (default 10 000).",
          Error),
    422: ("Validation error: each entry of `detail` names the field in `loc`.",
          ValidationErrorBody),
    429: ("Rate limit of the key exceeded; retry after `Retry-After` seconds.", Error),
    503: ("Overloaded, or a dependency (Redis, the database, the live pipeline) unavailable; "
          "retry after `Retry-After` seconds.", Error),
}

# Every /v1 route looks the key up (database) and counts it against the rate limit (Redis).
TENANT = (401, 429, 503)
ADMIN = (401, 403, 429, 503)
# Every route that reads a JSON body: it may be malformed, too large or invalid.
BODY = (400, 413, 422)


def errors(*codes: int, descriptions: Mapping[int, str] | None = None
           ) -> dict[int | str, dict[str, Any]]:
    """`responses=` of a route: the error statuses it can answer, with the shared bodies."""
    out: dict[int | str, dict[str, Any]] = {}
    for code in sorted(set(codes)):
        description, model = _ERRORS[code]
        entry: dict[str, Any] = {"model": model,
                                 "description": (descriptions or {}).get(code, description)}
        if code in (429, 503):
            entry["headers"] = {"Retry-After": RETRY_AFTER}
        out[code] = entry
    return out


def install_openapi(app: FastAPI) -> None:
    """app.openapi() (and so /openapi.json) serves FastAPI's document finished by finish()."""

    def openapi() -> dict[str, Any]:
        if app.openapi_schema is None:
            doc = FastAPI.openapi(app)
            app.openapi_schema = None  # cached only once finished
            app.openapi_schema = finish(doc)
        return app.openapi_schema

    app.openapi = openapi  # type: ignore[method-assign]


def finish(doc: dict[str, Any]) -> dict[str, Any]:
    """FastAPI's document as the routes declare it: only their own 422s, the bearer scheme on
    every operation that can answer 401, every schema referred to, the range shapes named."""
    components = doc.setdefault("components", {})
    defs = components.setdefault("schemas", {})
    for operation in _operations(doc):
        responses = operation.get("responses", {})
        # FastAPI adds a 422 to every operation with a parameter, even a plain string path
        # parameter that cannot fail validation; the routes declare their own where they can
        # answer one (errors() above), so the automatic one goes.
        auto = responses.get("422", {}).get("content", {}).get("application/json", {})
        if auto.get("schema") == {"$ref": REF_PREFIX + "HTTPValidationError"}:
            del responses["422"]
        if "401" in responses:
            operation["security"] = [{"bearer": []}]
    components.setdefault("securitySchemes", {})["bearer"] = {
        "type": "http", "scheme": "bearer",
        "description": "`Authorization: Bearer <key>`: a tenant key, or an admin key for "
                       "/v1/admin/*.",
    }
    _add_missing(doc, defs)
    _hoist_variants(defs)
    for name in ("HTTPValidationError", "ValidationError"):
        if name in defs and REF_PREFIX + name not in set(_refs(doc)):
            del defs[name]
    return doc


def _operations(doc: dict[str, Any]) -> Iterator[dict[str, Any]]:
    for item in doc.get("paths", {}).values():
        for method, operation in item.items():
            if method in {"get", "put", "post", "delete", "patch", "head", "options", "trace"}:
                yield operation


def _refs(value: Any) -> Iterator[str]:
    if isinstance(value, dict):
        ref = value.get("$ref")
        if isinstance(ref, str):
            yield ref
        for v in value.values():
            yield from _refs(v)
    elif isinstance(value, list):
        for v in value:
            yield from _refs(v)


def _add_missing(doc: dict[str, Any], defs: dict[str, Any]) -> None:
    """A route that reads its body itself (openapi_extra) refers to a model of app.schemas by
    name; its schema is added here, as FastAPI adds those of the bodies it parses."""
    missing = {ref.removeprefix(REF_PREFIX) for ref in _refs(doc)
               if ref.startswith(REF_PREFIX)} - set(defs)
    models: list[tuple[type[BaseModel], Literal["validation"]]] = []
    for name in sorted(missing):
        model = getattr(schemas, name, None)
        if not (isinstance(model, type) and issubclass(model, BaseModel)):
            raise LookupError(f"the OpenAPI document refers to {name!r}, which is not a model "
                              "of app.schemas")
        models.append((model, "validation"))
    if not models:
        return
    _, generated = models_json_schema(models, ref_template=REF_PREFIX + "{model}")
    for name, schema in generated.get("$defs", {}).items():
        if defs.setdefault(name, schema) != schema:
            raise ValueError(f"two different schemas are named {name!r}")


def _hoist_variants(defs: dict[str, Any]) -> None:
    """The named shapes of a oneOf (RangeSubscription: a bbox or a circle) become components of
    their own, so that generated clients name their classes after them."""
    for schema in list(defs.values()):
        for i, branch in enumerate(schema.get("oneOf", [])):
            title = branch.get("title")
            if "$ref" not in branch and isinstance(title, str) and title not in defs:
                defs[title] = branch
                schema["oneOf"][i] = {"$ref": REF_PREFIX + title}
