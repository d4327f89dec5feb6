"""Request and response models of the public API (API.md); validation rules live here."""

from __future__ import annotations

import math
from typing import Annotated, Any, Literal

import orjson
from pydantic import (
    AfterValidator,
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Discriminator,
    Field,
    GetJsonSchemaHandler,
    StringConstraints,
    Tag,
    WithJsonSchema,
    field_validator,
    model_validator,
)
from pydantic.json_schema import JsonSchemaValue
from pydantic_core import CoreSchema

from app.geo.tokenize import normalize_keywords

Lon = Annotated[float, Field(ge=-180.0, le=180.0, allow_inf_nan=False, strict=True)]
Lat = Annotated[float, Field(ge=-90.0, le=90.0, allow_inf_nan=False, strict=True)]
Ts = Annotated[float, Field(ge=0.0, le=1e11, allow_inf_nan=False, strict=True)]
Keyword = Annotated[str, StringConstraints(min_length=1, max_length=64, strict=True)]
ObjectId = Annotated[str, StringConstraints(min_length=1, max_length=128, strict=True)]
MAX_PROPS_BYTES = 4096
MAX_OBJECT_TTL_S = 365 * 86_400.0
TTL_MIN_S, TTL_MAX_S = 60, 30 * 24 * 3600


class Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


class ObjectIn(Strict):
    id: ObjectId | None = None
    lon: Lon
    lat: Lat
    ts: Ts | None = None
    text: Annotated[str, StringConstraints(max_length=2000, strict=True)] | None = None
    keywords: Annotated[list[Keyword], Field(max_length=64)] | None = None
    props: Annotated[dict[str, Any] | None, Field(
        description=f"Any JSON object of at most {MAX_PROPS_BYTES} bytes encoded, returned "
        "as given.")] = None
    ttl_s: Annotated[float | None, Field(
        gt=0, le=MAX_OBJECT_TTL_S, allow_inf_nan=False, strict=True,
        description="Moving objects (with an `id`): seconds after this record that the object "
        "leaves the latest-position store and kNN results unless updated again (default: the "
        "server's object_ttl_s). Ignored for events (no `id`): they leave with the live "
        "window.")] = None
    # Keywords are lower-cased and de-duplicated with the text's tokens in one pass when the
    # batch becomes records (pipeline/records.py): a per-object validator here cost half of
    # the publish path's time.

    @field_validator("props")
    @classmethod
    def _props_size(cls, v: dict[str, Any] | None) -> dict[str, Any] | None:
        if v is not None:
            try:
                size = len(orjson.dumps(v))
            except (TypeError, orjson.JSONEncodeError) as exc:
                raise ValueError(f"props must be JSON-serialisable: {exc}") from None
            if size > MAX_PROPS_BYTES:
                raise ValueError(f"props is {size} bytes encoded; at most {MAX_PROPS_BYTES}")
        return v


class ObjectBatch(Strict):
    objects: Annotated[list[ObjectIn], Field(
        min_length=1, description="At most max_batch (default 10 000) objects; more is a 413.")]


class ObjectsAccepted(BaseModel):
    accepted: int
    ids: list[str]


class ObjectOut(BaseModel):
    id: str
    lon: float
    lat: float
    ts: float
    keywords: list[str]
    props: dict[str, Any] | None = None


# --- subscriptions --------------------------------------------------------------------------

class Circle(Strict):
    lon: Lon
    lat: Lat
    radius_m: Annotated[float, Field(ge=1.0, le=1_000_000.0, allow_inf_nan=False, strict=True)]


SubKeywords = Annotated[list[Keyword], Field(min_length=1, max_length=16)]
Ttl = Annotated[float, Field(ge=TTL_MIN_S, le=TTL_MAX_S, allow_inf_nan=False, strict=True)]
Detect = Literal["inside", "enter", "exit"]


def _check_bbox(v: list[float] | None) -> list[float] | None:
    if v is not None:
        min_lon, min_lat, max_lon, max_lat = v
        if min_lon > max_lon or min_lat > max_lat:
            raise ValueError("bbox must be [min_lon, min_lat, max_lon, max_lat] with min ≤ max")
    return v


def bbox_items(v: Any) -> Any:
    """A bbox's four items, before type coercion: numbers, finite, within the world (a
    message naming the item)."""
    if isinstance(v, list) and len(v) == 4:
        for i, c in enumerate(v):
            if isinstance(c, bool) or not isinstance(c, int | float):
                raise ValueError(f"bbox[{i}] must be a number")
            if not math.isfinite(c):
                raise ValueError(f"bbox[{i}] must be finite")
        lim = (180, 90, 180, 90)
        for i, c in enumerate(v):
            if abs(c) > lim[i]:
                raise ValueError(f"bbox[{i}] = {c} is outside ±{lim[i]}")
    return v


def check_point(v: list[float]) -> list[float]:
    """A [lon, lat] point: finite and within the world."""
    lon, lat = v
    if not (math.isfinite(lon) and math.isfinite(lat)):
        raise ValueError("point must be finite [lon, lat]")
    if not (-180 <= lon <= 180 and -90 <= lat <= 90):
        raise ValueError("point must be [lon, lat] with -180 ≤ lon ≤ 180, -90 ≤ lat ≤ 90")
    return v


# JSON Schema cannot say min ≤ max across items: the descriptions do, and the validators check.
_LON_DOC = {"type": "number", "minimum": -180, "maximum": 180}
_LAT_DOC = {"type": "number", "minimum": -90, "maximum": 90}
# Validated where it is declared: every model with a bbox checks it the same way.
BBox = Annotated[list[float], BeforeValidator(bbox_items), Field(
    min_length=4, max_length=4,
    description="[min_lon, min_lat, max_lon, max_lat] with min_lon ≤ max_lon and "
    "min_lat ≤ max_lat; boundaries inclusive.",
    json_schema_extra={"prefixItems": [_LON_DOC, _LAT_DOC, _LON_DOC, _LAT_DOC]}),
    AfterValidator(_check_bbox)]
Point = Annotated[list[Annotated[float, Field(strict=True)]], Field(
    min_length=2, max_length=2, description="[lon, lat]",
    json_schema_extra={"prefixItems": [_LON_DOC, _LAT_DOC]})]
_DETECT_VALUES = ["inside", "enter", "exit"]
# One value or a non-empty list of them (the validators below).
DetectDoc = WithJsonSchema({
    "anyOf": [{"type": "string", "enum": _DETECT_VALUES},
              {"type": "array", "items": {"type": "string", "enum": _DETECT_VALUES},
               "minItems": 1},
              {"type": "null"}],
    "description": "For moving objects: report records inside (default), entering or exiting.",
})


class _KeywordPredicate(Strict):
    keywords: SubKeywords | None = None
    match: Literal["any", "all"] = "any"
    ttl_s: Ttl | None = None

    @field_validator("keywords")
    @classmethod
    def _lower(cls, v: list[str] | None) -> list[str] | None:
        return None if v is None else normalize_keywords(v)


class RangeSubscription(_KeywordPredicate):
    """Objects inside a bounding box or a circle (exactly one of the two)."""

    type: Literal["range"]
    bbox: BBox | None = None
    circle: Circle | None = None
    detect: Annotated[list[Detect] | None, DetectDoc] = None

    @classmethod
    def __get_pydantic_json_schema__(cls, core_schema: CoreSchema,
                                     handler: GetJsonSchemaHandler) -> JsonSchemaValue:
        """Documented as the two shapes it accepts (the model validator `_one_region`): a
        schema of optional bbox and circle would admit neither and both."""
        ref = handler(core_schema)
        schema = handler.resolve_ref_schema(ref)
        props = schema.pop("properties")
        for key in ("required", "type", "additionalProperties"):
            schema.pop(key, None)

        def shape(title: str, region: str, other: str) -> dict[str, Any]:
            given = next(s for s in props[region]["anyOf"] if s.get("type") != "null")
            return {
                "title": title,
                "type": "object",
                "properties": {**props, region: given,
                               other: {"type": "null", "description": "Absent or null."}},
                "required": ["type", region],
                "additionalProperties": False,
            }

        schema["oneOf"] = [shape("RangeBBoxSubscription", "bbox", "circle"),
                           shape("RangeCircleSubscription", "circle", "bbox")]
        return ref

    @field_validator("detect", mode="before")
    @classmethod
    def _detect_one(cls, v: Any) -> Any:
        return [v] if isinstance(v, str) else v

    @field_validator("detect")
    @classmethod
    def _detect_unique(cls, v: list[str] | None) -> list[str] | None:
        if v is not None:
            if not v:
                raise ValueError("detect must name at least one of inside, enter, exit")
            v = list(dict.fromkeys(v))
        return v

    @model_validator(mode="after")
    def _one_region(self) -> RangeSubscription:
        if (self.bbox is None) == (self.circle is None):
            raise ValueError("a range subscription needs exactly one of bbox or circle")
        return self


class KeywordSubscription(_KeywordPredicate):
    """Objects sharing any (or all) of the keywords, anywhere."""

    type: Literal["keyword"]
    keywords: SubKeywords


class KnnSubscription(_KeywordPredicate):
    """The k objects nearest to a point."""

    type: Literal["knn"]
    point: Point
    k: Annotated[int, Field(ge=1, le=1000, strict=True)]

    @field_validator("point")
    @classmethod
    def _point(cls, v: list[float]) -> list[float]:
        return check_point(v)


SubscriptionIn = Annotated[
    RangeSubscription | KeywordSubscription | KnnSubscription, Field(discriminator="type")
]


class SubscriptionBatch(Strict):
    subscriptions: Annotated[list[SubscriptionIn], Field(min_length=1)]


class SubscriptionOut(BaseModel):
    """A stored subscription: its id, the fields given (keywords lower-cased, `match` filled in,
    `detect` as a list), created_at and expires_at (null without ttl_s)."""

    model_config = ConfigDict(extra="allow")

    id: str
    type: Literal["range", "keyword", "knn"]
    bbox: list[float] | None = None
    circle: Circle | None = None
    point: list[float] | None = None
    k: int | None = None
    keywords: list[str] | None = None
    match: Literal["any", "all"] | None = None
    detect: list[Detect] | None = None
    ttl_s: float | None = None
    created_at: float
    expires_at: float | None


class SubscriptionIds(BaseModel):
    ids: list[str]


class SubscriptionPage(BaseModel):
    items: list[SubscriptionOut]
    next_cursor: str | None


# --- errors and health --------------------------------------------------------------------

class Error(BaseModel):
    """The body of every error but 422 (app/main.py's exception handlers)."""

    detail: str


class ValidationIssue(BaseModel):
    """One finding of validation: the field (`loc`, e.g. ["body", "objects", 3, "lat"]), the
    kind (`type`), a message, and the input found there."""

    type: str
    loc: list[str | int]
    msg: str
    input: Any = None
    ctx: dict[str, Any] | None = None


class ValidationErrorBody(BaseModel):
    """The body of a 422 (FastAPI's shape): every finding, each naming its field."""

    detail: list[ValidationIssue]


class Readiness(BaseModel):
    ready: bool
    checks: dict[str, str]


# --- keys ---------------------------------------------------------------------------------

TenantName = Annotated[
    str, StringConstraints(min_length=1, max_length=64, pattern=r"^[A-Za-z0-9_.\-]+$", strict=True)
]


class KeyCreate(Strict):
    tenant: TenantName
    admin: Annotated[bool, Field(strict=True)] = False


class KeyCreated(BaseModel):
    id: str
    key: str
    tenant: str
    admin: bool


# --- load balancing (admin) ------------------------------------------------------------------

PeriodS = Annotated[float, Field(ge=0.1, le=3600.0, allow_inf_nan=False, strict=True)]


def _absent_not_null(schema: dict[str, Any]) -> None:
    """Documents optional fields that refuse null: without the null branch and the null
    default that `X | None = None` puts in the JSON schema."""
    for prop in schema.get("properties", {}).values():
        branches = [b for b in prop.pop("anyOf", []) if b.get("type") != "null"]
        if len(branches) == 1:
            prop.update(branches[0])
        elif branches:
            prop["anyOf"] = branches
        prop.pop("default", None)


class BalancerConfigIn(Strict):
    """PUT /v1/admin/balancer: any subset; an absent field keeps its value, null is refused."""

    model_config = ConfigDict(json_schema_extra=_absent_not_null)

    enabled: Annotated[bool, Field(strict=True)] | None = None
    period_s: PeriodS | None = None
    beta: Annotated[int, Field(ge=1, le=1000, strict=True)] | None = None

    @field_validator("enabled", "period_s", "beta", mode="before")
    @classmethod
    def _not_null(cls, v: Any) -> Any:
        # Only explicit values reach here (defaults are not validated): null is not "unchanged".
        if v is None:
            raise ValueError("may not be null; leave the field out to keep its value")
        return v


Name = Annotated[str, StringConstraints(min_length=1, max_length=64, strict=True)]
Cell = Annotated[int, Field(ge=0, le=10_000, strict=True)]


class RebalanceRound(Strict):
    """`{}`: run one balancing round now."""


class RebalanceMove(Strict):
    """Move one partition to another worker."""

    partition: Name
    to: Name


class RebalanceSplit(Strict):
    """Split one partition at a cell column (axis x) or row (axis y): the low half keeps the
    cells up to and including `at`."""

    split: Name
    axis: Literal["x", "y"]
    at: Cell


_MOVE_FIELDS = frozenset({"partition", "to"})
_SPLIT_FIELDS = frozenset({"split", "axis", "at"})


def _rebalance_kind(v: Any) -> str | None:
    """The shape a body claims by its fields; a split field wins, so a mixed body is reported
    as a split with the move fields named as not permitted."""
    if isinstance(v, dict):
        if v.keys() & _SPLIT_FIELDS:
            return "split"
        if v.keys() & _MOVE_FIELDS:
            return "move"
        return "round"
    kinds: dict[type, str] = {RebalanceRound: "round", RebalanceMove: "move",
                              RebalanceSplit: "split"}
    return kinds.get(type(v))


RebalanceIn = Annotated[
    Annotated[RebalanceRound, Tag("round")]
    | Annotated[RebalanceMove, Tag("move")]
    | Annotated[RebalanceSplit, Tag("split")],
    Discriminator(_rebalance_kind, custom_error_type="rebalance_shape",
                  custom_error_message="the body must be an object: {} (a round), "
                  "{partition, to} (a move) or {split, axis, at} (a split)"),
]


def subscription_spec(
    sub: RangeSubscription | KeywordSubscription | KnnSubscription,
) -> dict[str, Any]:
    """The stored form of a subscription: the given fields, defaults applied, ttl excluded."""
    spec = sub.model_dump(exclude_none=True, exclude={"ttl_s"})
    if sub.ttl_s is not None:
        spec["ttl_s"] = sub.ttl_s
    return spec
