"""Objects: publish a validated batch (JSON or NDJSON) and read a moving object's latest record."""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Any

import orjson
from fastapi import APIRouter, Request
from fastapi.exceptions import RequestValidationError
from pydantic import TypeAdapter, ValidationError

from app.api.deps import StateDep, StrictJSONRoute, TenantDep
from app.api.openapi import BODY, REF_PREFIX, TENANT, errors
from app.core.errors import BadRequest, NotFound, PayloadTooLarge, RateLimited, Unavailable
from app.core.metrics import HOPS, OBJECTS_ACCEPTED, PUBLISH_SECONDS
from app.core.state import require_plan
from app.pipeline.records import ValidObject, records_from_objects
from app.pipeline.router import ObjectQuotaExceeded, Overloaded, PublishContention
from app.schemas import ObjectBatch, ObjectIn, ObjectOut, ObjectsAccepted
from app.schemas.batch import decode_batch, decode_lines
from app.services import quotas

router = APIRouter(prefix="/v1/objects", tags=["objects"], route_class=StrictJSONRoute)

_objects = TypeAdapter(list[ObjectIn])

# The route reads the body itself (JSON or NDJSON), so it is declared here; app/api/openapi.py
# adds the schemas referred to. NDJSON is described as the OpenAPI registry describes
# sequential JSON: the whole stream as if it were an array, one item per line.
_BODY_DOC = {
    "requestBody": {
        "required": True,
        "content": {
            "application/json": {"schema": {"$ref": REF_PREFIX + "ObjectBatch"}},
            "application/x-ndjson": {"schema": {
                "type": "array",
                "items": {"$ref": REF_PREFIX + "ObjectIn"},
                "minItems": 1,
                "description": "One OBJECT per line (blank lines are skipped); at most "
                               "max_batch (default 10 000) lines, more is a 413.",
            }},
        },
    }
}


def parse_objects(body: bytes, content_type: str, max_batch: int
                  ) -> tuple[Sequence[ValidObject], list[str | None] | None]:
    """Parse and validate the whole batch; raise before anything is accepted. A valid batch
    is decoded in one step (`app.schemas.batch`), with its props' JSON text; anything it
    refuses is validated again by the models (`ObjectIn`), whose errors the client gets (the
    props are then encoded by `records_from_objects`)."""
    ndjson = "ndjson" in content_type or "jsonlines" in content_type
    if ndjson:
        lines = [line for line in body.splitlines() if line.strip()]
        fast = decode_lines(lines) if 0 < len(lines) <= max_batch else None
    else:
        fast = decode_batch(body)
    if fast is not None and len(fast.objects) <= max_batch:
        return fast
    return _parse_objects_slowly(body, ndjson, max_batch), None


def _parse_objects_slowly(body: bytes, ndjson: bool, max_batch: int) -> list[ObjectIn]:
    """The models' validation, with errors that name each problem."""
    if ndjson:
        raw: list[Any] = []
        for n, line in enumerate(body.splitlines()):
            if not line.strip():
                continue
            try:
                raw.append(orjson.loads(line))
            except orjson.JSONDecodeError as exc:
                raise BadRequest(f"malformed JSON on NDJSON line {n + 1}: {exc}") from None
            if len(raw) > max_batch:
                break
        prefix: tuple[Any, ...] = ("body",)
    else:
        try:
            doc = orjson.loads(body)
        except orjson.JSONDecodeError as exc:
            raise BadRequest(f"malformed JSON: {exc}") from None
        if not isinstance(doc, dict) or not isinstance(doc.get("objects"), list):
            try:
                ObjectBatch.model_validate(doc)
            except ValidationError as exc:
                raise RequestValidationError(_with_prefix(exc, ("body",))) from None
        raw = doc["objects"]
        extra = set(doc) - {"objects"}
        if extra:
            raise RequestValidationError([{
                "type": "extra_forbidden", "loc": ("body", sorted(extra)[0]),
                "msg": "Extra inputs are not permitted", "input": doc[sorted(extra)[0]]}])
        prefix = ("body", "objects")
    if len(raw) > max_batch:
        raise PayloadTooLarge(f"batch of {len(raw)} objects is over max_batch ({max_batch})")
    if not raw:
        raise RequestValidationError([{
            "type": "too_short", "loc": prefix, "msg": "the batch holds no object", "input": []}])
    try:
        return _objects.validate_python(raw)
    except ValidationError as exc:
        raise RequestValidationError(_with_prefix(exc, prefix)) from None


def _with_prefix(exc: ValidationError, prefix: tuple[Any, ...]) -> list[dict[str, Any]]:
    errors = []
    for found in exc.errors(include_url=False):
        err: dict[str, Any] = dict(found)
        err["loc"] = prefix + tuple(found["loc"])
        ctx = found.get("ctx")
        if ctx:
            err["ctx"] = {k: str(v) for k, v in ctx.items()}
        errors.append(err)
    return errors


@router.post("", status_code=202, response_model=ObjectsAccepted, openapi_extra=_BODY_DOC,
             responses=errors(*BODY, *TENANT, descriptions={
                 413: "Body over max_body_bytes, or more than max_batch objects.",
                 429: "Rate limit of the key exceeded, or a tenant quota: objects published "
                      "per second (tenant_publish_per_s) or moving objects stored "
                      "(tenant_max_objects).",
                 503: "Redis or the database unavailable, no partition plan yet (no "
                      "worker has started), a worker too far behind (max_backlog), or other "
                      "publishes kept moving the same objects."}))
async def publish(request: Request, state: StateDep, principal: TenantDep) -> ObjectsAccepted:
    """Publish a batch of objects; 202 once the whole batch is durably queued."""
    started = time.perf_counter()
    body = await request.body()
    objs, props = parse_objects(body, request.headers.get("content-type", ""),
                                state.settings.max_batch)
    batch = records_from_objects(objs, principal.tenant, time.time(), props)
    validated = time.perf_counter()
    HOPS.observe("validate", validated - started, batch.size)
    await require_plan(state)
    assert state.router is not None
    await quotas.charge_publish(state, principal.tenant, batch.size)
    try:
        appending = time.perf_counter()
        await state.router.publish(batch)
        HOPS.observe("append", time.perf_counter() - appending, batch.size)
    except PublishContention as exc:
        raise Unavailable(f"{exc}; retry", headers={"Retry-After": "1"}) from exc
    except ObjectQuotaExceeded as exc:
        raise RateLimited(str(exc), headers={"Retry-After": "60"}) from exc
    except Overloaded as exc:
        raise Unavailable(f"overloaded: {exc}; retry later", headers={"Retry-After": "2"}) from exc
    OBJECTS_ACCEPTED.inc(batch.size)
    PUBLISH_SECONDS.observe(time.perf_counter() - started)
    return ObjectsAccepted(accepted=batch.size, ids=batch.ids)


@router.get("/{object_id:path}", response_model=ObjectOut, responses=errors(
    404, *TENANT, descriptions={404: "No moving object with this id in the tenant."}))
async def get_object(object_id: str, state: StateDep, principal: TenantDep) -> ObjectOut:
    """The latest record of a moving object (an id with a slash is read as it is, `%2F`
    escaped or not)."""
    rec = None if state.router is None else await state.router.latest(principal.tenant, object_id)
    if rec is None:
        raise NotFound(f"no moving object with id {object_id!r}")
    return ObjectOut(**rec)
