"""Request and response models of snapshot queries (API.md, Snapshot queries: QUERY), and their
conversion to the `wire.SnapshotQuery` the workers evaluate (SSTD §4's snapshot versions of the
range-keyword, kNN-keyword and top-k frequent-term queries, CheetahGIS's range count)."""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, Field, GetJsonSchemaHandler, field_validator, model_validator
from pydantic.json_schema import JsonSchemaValue
from pydantic_core import CoreSchema

from app.geo.tokenize import normalize_keywords
from app.pipeline import wire
from app.schemas import (
    BBox,
    Circle,
    Point,
    RangeSubscription,
    Strict,
    SubKeywords,
    Ts,
    check_point,
)

MAX_WAIT_S = 60.0

WaitS = Annotated[float, Field(
    ge=0.0, le=MAX_WAIT_S, allow_inf_nan=False, strict=True,
    description="Seconds the POST waits for the answer (0 … 60); if it is not ready by then, "
    "the answer is 202 with the query's id, to poll with GET /v1/queries/{id}.")]
Limit = Annotated[int, Field(
    ge=1, le=10_000, strict=True,
    description="The most records returned (1 … 10 000); `truncated` says whether more matched.")]
K = Annotated[int, Field(ge=1, le=1000, strict=True)]


class _Query(Strict):
    """What every type takes: the time range, `latest`, `wait_s`, and the keyword predicate."""

    t_from: Ts | None = Field(
        None, alias="from",
        description="Records with ts ≥ from (epoch seconds); not before the live window's start "
        "(now − window_s). Absent: no lower bound within the live window.")
    t_to: Ts | None = Field(
        None, alias="to", description="Records with ts ≤ to (epoch seconds), to ≥ from. Absent: "
        "no upper bound.")
    latest: Annotated[bool, Field(
        strict=True, description="Consider only the latest record (greatest ts) of each moving "
        "object within [from, to], then apply the other predicates; each event is its own "
        "latest record.")] = False
    wait_s: WaitS = 10.0
    keywords: Annotated[SubKeywords | None, Field(
        description="Lower-cased and de-duplicated; without them there is no keyword "
        "predicate.")] = None
    match: Literal["any", "all"] = "any"

    @field_validator("keywords")
    @classmethod
    def _lower(cls, v: list[str] | None) -> list[str] | None:
        return None if v is None else normalize_keywords(v)


class _RegionQuery(_Query):
    """A query over a region: exactly one of bbox / circle, validated and documented as a range
    subscription's."""

    bbox: BBox | None = None
    circle: Circle | None = None

    @classmethod
    def __get_pydantic_json_schema__(cls, core_schema: CoreSchema,
                                     handler: GetJsonSchemaHandler) -> JsonSchemaValue:
        """RangeSubscription's two shapes (bbox given, or circle given); its hook reads only the
        schema handed to it. The shapes are renamed after this model (RangeBBoxQuery, …): they
        become components of their own (app/api/openapi.py)."""
        ref = RangeSubscription.__get_pydantic_json_schema__(core_schema, handler)
        schema = handler.resolve_ref_schema(ref)
        for shape, region in zip(schema["oneOf"], ("BBox", "Circle"), strict=True):
            shape["title"] = cls.__name__.removesuffix("Query") + region + "Query"
        return ref

    @model_validator(mode="after")
    def _one_region(self) -> _RegionQuery:
        if (self.bbox is None) == (self.circle is None):
            kind = getattr(self, "type", "region")
            raise ValueError(f"a {kind} query needs exactly one of bbox or circle")
        return self


class RangeQuery(_RegionQuery):
    """The records inside a bounding box or a circle, newest first."""

    type: Literal["range"]
    limit: Limit = 1000


class KnnQuery(_Query):
    """The k records nearest to a point, nearest first."""

    type: Literal["knn"]
    point: Point
    k: K

    @field_validator("point")
    @classmethod
    def _point(cls, v: list[float]) -> list[float]:
        return check_point(v)


class KeywordQuery(_Query):
    """The records sharing any (or all) of the keywords, anywhere, newest first."""

    type: Literal["keyword"]
    keywords: SubKeywords
    limit: Limit = 1000


class TopkTermsQuery(_RegionQuery):
    """The k most frequent keywords of the records inside a region."""

    type: Literal["topk_terms"]
    k: Annotated[K, Field(description="The number of terms (1 … 1 000).")] = 10


class CountQuery(_RegionQuery):
    """The number of records inside a region."""

    type: Literal["count"]


QueryIn = Annotated[
    RangeQuery | KnnQuery | KeywordQuery | TopkTermsQuery | CountQuery,
    Field(discriminator="type"),
]
AnyQuery = RangeQuery | KnnQuery | KeywordQuery | TopkTermsQuery | CountQuery


def snapshot_query(query: AnyQuery) -> wire.SnapshotQuery:
    """The query as the workers evaluate it: regions as tuples, `match` as `match_all`."""
    fields: dict[str, Any] = {
        "type": query.type, "keywords": list(query.keywords or ()),
        "match_all": query.match == "all", "t_from": query.t_from, "t_to": query.t_to,
        "latest": query.latest,
    }
    if isinstance(query, _RegionQuery):
        if query.bbox is not None:
            min_lon, min_lat, max_lon, max_lat = query.bbox
            fields["bbox"] = (min_lon, min_lat, max_lon, max_lat)
        elif query.circle is not None:
            c = query.circle
            fields["circle"] = (c.lon, c.lat, c.radius_m)
    if isinstance(query, KnnQuery):
        fields["point"] = (query.point[0], query.point[1])
    if isinstance(query, KnnQuery | TopkTermsQuery):
        fields["k"] = query.k
    if isinstance(query, RangeQuery | KeywordQuery):
        fields["limit"] = query.limit
    return wire.SnapshotQuery(**fields)


# --- answers (the route returns QueryService's dicts; these models document them) -------------

class QueryRecord(BaseModel):
    """A record in the results of range and keyword queries."""

    id: str = Field(description="The object's id; an event's is the id the server gave it.")
    lon: float = Field(description="Longitude, degrees.")
    lat: float = Field(description="Latitude, degrees.")
    ts: float = Field(description="The record's time, epoch seconds.")
    keywords: list[str] = Field(description="Its keywords: those given and the words of its "
                                "text, lower-cased.")
    text: str | None = Field(None, description="Only when the record had a text.")
    props: dict[str, Any] | None = Field(None, description="Only when the record had props.")


class QueryNeighbor(QueryRecord):
    """A record in the results of a knn query."""

    distance_m: float = Field(description="Metres from the query's point (haversine).")


class TermCount(BaseModel):
    """One of the terms of a topk_terms query: a keyword and how many records carry it."""

    term: str = Field(description="A keyword.")
    count: int = Field(description="The records carrying it.")


class RecordCount(BaseModel):
    """The one result of a count query."""

    count: int = Field(description="The records that satisfy the query.")


class QueryResultBody(BaseModel):
    """A snapshot query: running, done (with its results) or failed (with the reason)."""

    id: str = Field(description="The query's id, for GET /v1/queries/{id}.")
    status: Literal["running", "done", "failed"] = Field(
        description="`running` (poll again), `done` (with `results`) or `failed` (with `error`).")
    results: list[QueryNeighbor | QueryRecord | TermCount | RecordCount] | None = Field(
        None, description="When done: range and keyword records newest first (ties by id), "
        "knn records nearest first (ties by id), topk_terms terms by count then term, or one "
        "`{\"count\"}`.")
    sources: dict[str, int] | None = Field(
        None, description="When done: the records of each source the answer is made of (for "
        "count and topk_terms, the records counted); `live` is the workers' live window.")
    truncated: bool | None = Field(
        None, description="When done: more matched than `results` holds (records beyond "
        "`limit` or knn's `k`, terms beyond topk_terms' `k`).")
    error: str | None = Field(None, description="When failed: why, e.g. the worker that did "
                              "not answer.")
