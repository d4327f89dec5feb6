"""API.md, Errors and the validation rules of Objects and Subscriptions, over HTTP against the
in-process api and a real worker: 400 for malformed JSON, 422 naming the field (and the index in
a batch) for invalid input, never a 500, and a rejected request changes nothing."""

from __future__ import annotations

import base64
import json
from collections.abc import Iterator
from typing import Any

import orjson
import pytest

from tests.app.httpapi import NDJSON, WORLD, Api, locs, names_field
from tests.conftest import InProcessServer


@pytest.fixture
def api(inprocess_worker: InProcessServer) -> Iterator[Api]:
    """A fresh tenant; the worker matches the sentinels of `assert_only_sentinels`."""
    a = Api(inprocess_worker)
    yield a
    a.close()


@pytest.fixture
def admin(inprocess: InProcessServer) -> Iterator[Api]:
    a = Api(inprocess, key=inprocess.admin_key, tenant="admin")
    yield a
    a.close()


def obj(**kw: Any) -> dict[str, Any]:
    return {"lon": 10.0, "lat": 10.0, **kw}


# --- 400: malformed JSON --------------------------------------------------------------------

MALFORMED = [
    pytest.param(b'{"objects": [', id="truncated"),
    pytest.param(b"not json", id="garbage"),
    pytest.param(b'{"a": 1}}', id="trailing"),
    pytest.param(b"", id="empty"),
    pytest.param(b"{'single': 'quotes'}", id="single-quotes"),
    pytest.param(b'{"a": "\xff\xfe"}', id="not-utf8"),
    pytest.param(b'{"a": "\\ud800"}', id="lone-surrogate"),
    pytest.param(b'{"lon": NaN, "lat": 1}', id="NaN"),
    pytest.param(b'{"lon": Infinity, "lat": 1}', id="Infinity"),
    pytest.param(b'{"lon": -Infinity, "lat": 1}', id="-Infinity"),
    pytest.param(b'{"lon": 1e999, "lat": 1}', id="1e999"),
    pytest.param(b"[" * 5000 + b"]" * 5000, id="deep-nesting"),
]

# For each endpoint with a JSON body: how a malformed fragment is placed in an otherwise
# well-formed body, so that the only problem is the fragment.
NAN_BODIES = {
    "/v1/objects": b'{"objects": [{"lon": %s, "lat": 1}]}',
    "/v1/subscriptions": b'{"type": "knn", "point": [%s, 1], "k": 1}',
    "/v1/subscriptions/batch": b'{"subscriptions": [{"type": "knn", "point": [%s, 1], "k": 1}]}',
    "/v1/admin/keys": b'{"tenant": "acme", "admin": %s}',
}
NON_FINITE = [b"NaN", b"Infinity", b"-Infinity", b"1e999", b"-1e999", b"1E400"]


@pytest.mark.parametrize("path", list(NAN_BODIES))
@pytest.mark.parametrize("body", MALFORMED)
def test_malformed_json_is_400(api: Api, admin: Api, path: str, body: bytes) -> None:
    client = admin if path.startswith("/v1/admin") else api
    r = client.raw(path, body)
    assert r.status_code == 400, r.text
    assert isinstance(r.json()["detail"], str)
    assert api.subscription_ids() == []


@pytest.mark.parametrize("path", list(NAN_BODIES))
@pytest.mark.parametrize("token", NON_FINITE)
def test_non_finite_numbers_are_rejected_not_500(api: Api, admin: Api, path: str,
                                                 token: bytes) -> None:
    client = admin if path.startswith("/v1/admin") else api
    r = client.raw(path, NAN_BODIES[path] % token)
    # NaN / Infinity are not JSON; 1e999 overflows a double: both are malformed JSON.
    assert r.status_code == 400, r.text
    assert api.subscription_ids() == []


@pytest.mark.parametrize("body", [
    pytest.param(b'{"lon": 1, "lat": 2}\n{"lon": 1, "lat": ', id="truncated-line"),
    pytest.param(b'{"lon": 1, "lat": 2}\nnot json\n', id="garbage-line"),
    pytest.param(b'{"lon": NaN, "lat": 2}\n', id="NaN"),
    pytest.param(b'{"lon": 1e999, "lat": 2}\n', id="1e999"),
    pytest.param(b'{"lon": 1, "lat": 2}\n\xff\n', id="not-utf8"),
])
def test_malformed_ndjson_is_400_and_stores_nothing(api: Api, body: bytes) -> None:
    sub = api.subscribe({"type": "range", "bbox": WORLD})
    bad = body.replace(b'{"lon": 1, "lat": 2}', b'{"id": "nd-1", "lon": 10, "lat": 10}')
    r = api.raw("/v1/objects", bad, NDJSON)
    assert r.status_code == 400, r.text
    api.assert_only_sentinels(sub["id"], rejected=["nd-1"])


def test_json_body_that_is_not_an_object_is_422(api: Api, admin: Api) -> None:
    for path in NAN_BODIES:
        client = admin if path.startswith("/v1/admin") else api
        for body in (b"[]", b"null", b"1", b'"x"', b"true"):
            r = client.raw(path, body)
            assert r.status_code == 422, (path, body, r.text)
            assert locs(r)


# --- objects: types, ranges, sizes ----------------------------------------------------------

BAD_OBJECT_FIELDS = [
    ("lon", "10"), ("lon", None), ("lon", True), ("lon", [10]), ("lon", {"v": 1}),
    ("lat", "10"), ("lat", False), ("lat", None),
    ("lon", 180.000001), ("lon", -180.5), ("lon", 1e300), ("lon", 10**40),
    ("lat", 90.0001), ("lat", -91), ("lat", -(10**30)),
    ("ts", "now"), ("ts", True), ("ts", -1), ("ts", 10**40), ("ts", [1.0]),
    ("id", 17), ("id", ""), ("id", "x" * 129), ("id", ["a"]), ("id", True),
    ("text", 5), ("text", ["a"]), ("text", "x" * 2001),
    ("keywords", "coffee"), ("keywords", [1]), ("keywords", [None]), ("keywords", [""]),
    ("keywords", ["k"] * 65), ("keywords", ["x" * 65]), ("keywords", {"a": 1}),
    ("props", []), ("props", "x"), ("props", 5), ("props", {"p": "x" * 4096}),
    ("ttl_s", 0), ("ttl_s", -1), ("ttl_s", "60"), ("ttl_s", True), ("ttl_s", 10**9),
    ("unknown_field", 1), ("type", "range"),
]


@pytest.mark.parametrize(("field", "value"), BAD_OBJECT_FIELDS,
                         ids=[f"{f}={str(v)[:20]}" for f, v in BAD_OBJECT_FIELDS])
def test_invalid_object_is_422_naming_index_and_field(api: Api, field: str, value: Any) -> None:
    sub = api.subscribe({"type": "range", "bbox": WORLD})
    objects = [obj(id=f"ok-{i}") for i in range(5)]
    objects[3][field] = value
    r = api.post("/v1/objects", {"objects": objects})
    assert r.status_code == 422, r.text
    first = locs(r)[0]
    assert first[:4] == ["body", "objects", 3, field], first
    # The whole batch is rejected: the four valid objects were not accepted either.
    api.assert_only_sentinels(sub["id"], rejected=[f"ok-{i}" for i in range(5)])


def test_loc_names_index_3_lat(api: Api) -> None:
    objects = [obj() for _ in range(6)]
    objects[3]["lat"] = 123.0
    r = api.post("/v1/objects", {"objects": objects})
    assert locs(r) == [["body", "objects", 3, "lat"]]


def test_ndjson_loc_names_the_line_index(api: Api) -> None:
    lines = [obj(id=f"l{i}") for i in range(4)]
    lines[2]["lon"] = "east"
    body = b"\n".join(orjson.dumps(o) for o in lines)
    r = api.raw("/v1/objects", body, NDJSON)
    assert locs(r)[0][:3] == ["body", 2, "lon"]
    for i in range(4):
        assert api.get(f"/v1/objects/l{i}").status_code == 404


@pytest.mark.parametrize("body", [
    {"objects": []}, {"objects": None}, {}, {"objects": {}}, {"objects": "x"},
])
def test_empty_or_missing_batch_is_422(api: Api, body: Any) -> None:
    r = api.post("/v1/objects", body)
    assert r.status_code == 422, r.text
    assert locs(r)[0][:2] == ["body", "objects"] or locs(r)[0] == ["body"]


@pytest.mark.parametrize("body", [b"", b"\n\n  \n"])
def test_empty_ndjson_batch_is_422(api: Api, body: bytes) -> None:
    r = api.raw("/v1/objects", body, NDJSON)
    assert r.status_code == 422, r.text


def test_unknown_top_level_field_is_422_naming_it(api: Api) -> None:
    r = api.post("/v1/objects", {"objects": [obj(id="top-1")], "priority": 1})
    assert names_field(r, "priority")
    assert api.get("/v1/objects/top-1").status_code == 404


def test_unknown_object_field_is_422_naming_it(api: Api) -> None:
    r = api.post("/v1/objects", {"objects": [obj(id="u-1", colour="red")]})
    assert locs(r) == [["body", "objects", 0, "colour"]]
    r = api.raw("/v1/objects", orjson.dumps(obj(colour="red")), NDJSON)
    assert locs(r) == [["body", 0, "colour"]]


def _props_of_size(n: int) -> dict[str, str]:
    props = {"p": ""}
    props["p"] = "x" * (n - len(orjson.dumps(props)))
    assert len(orjson.dumps(props)) == n
    return props


def test_object_limits_at_the_boundary_are_accepted(api: Api) -> None:
    """Exactly at each limit is valid: ±180 / ±90, 64 keywords of 64 chars, 2 000 chars of
    text, 4 KiB of props; one more is a 422 (above)."""
    at_limit = [
        obj(id="b-1", lon=180, lat=90), obj(id="b-2", lon=-180, lat=-90),
        obj(id="b-3", keywords=[f"{i:064d}" for i in range(64)]),
        obj(id="b-4", text="a" * 2000),
        obj(id="b-5", props=_props_of_size(4096)),
        obj(id="b-6", ts=0),
    ]
    ids = api.publish(at_limit)
    assert ids == [o["id"] for o in at_limit]
    r = api.post("/v1/objects", {"objects": [obj(props=_props_of_size(4097))]})
    assert locs(r) == [["body", "objects", 0, "props"]]
    got = api.get("/v1/objects/b-5")
    assert got.status_code == 200 and got.json()["props"] == _props_of_size(4096)
    got = api.get("/v1/objects/b-1").json()
    assert (got["lon"], got["lat"]) == (180, 90)


def test_valid_object_roundtrip(api: Api) -> None:
    """The rules' positive side: keywords lower-cased, text tokenised, props as given."""
    props = {"price": 2, "tags": ["a", {"b": None}], "ok": True, "f": 1.5}
    api.publish([obj(id="taxi-17", lon=-73.985, lat=40.758, ts=1763800000.5,
                     text="Free COFFEE at 5th Ave", keywords=["Coffee", "TEA"], props=props)])
    r = api.get("/v1/objects/taxi-17")
    assert r.status_code == 200, r.text
    got = r.json()
    assert set(got) == {"id", "lon", "lat", "ts", "keywords", "props"}
    assert (got["id"], got["lon"], got["lat"], got["ts"]) == ("taxi-17", -73.985, 40.758,
                                                                1763800000.5)
    assert {"coffee", "tea", "free", "at", "5th", "ave"} <= set(got["keywords"])
    assert all(k == k.lower() for k in got["keywords"])
    assert got["props"] == props
    assert api.get("/v1/objects/never-published").status_code == 404


# --- subscriptions ----------------------------------------------------------------------------

RANGE = {"type": "range", "bbox": [-74.02, 40.70, -73.93, 40.80]}
CIRCLE = {"type": "range", "circle": {"lon": -73.985, "lat": 40.758, "radius_m": 500}}
KEYWORD = {"type": "keyword", "keywords": ["earthquake", "tokyo"], "match": "all"}
KNN = {"type": "knn", "point": [-73.985, 40.758], "k": 5, "keywords": ["taxi"]}


def with_(base: dict[str, Any], **kw: Any) -> dict[str, Any]:
    out = json.loads(json.dumps(base))
    out.update(kw)
    return out


def without(base: dict[str, Any], key: str) -> dict[str, Any]:
    out = json.loads(json.dumps(base))
    del out[key]
    return out


BAD_SUBSCRIPTIONS: list[tuple[str, dict[str, Any], str]] = [
    # (case, body, the field the 422 must name)
    ("inverted-bbox-lon", with_(RANGE, bbox=[-73.93, 40.70, -74.02, 40.80]), "bbox"),
    ("inverted-bbox-lat", with_(RANGE, bbox=[-74.02, 40.80, -73.93, 40.70]), "bbox"),
    ("bbox-3", with_(RANGE, bbox=[1, 2, 3]), "bbox"),
    ("bbox-5", with_(RANGE, bbox=[1, 2, 3, 4, 5]), "bbox"),
    ("bbox-lon-181", with_(RANGE, bbox=[-181, 0, 0, 1]), "bbox"),
    ("bbox-lat-91", with_(RANGE, bbox=[0, 0, 1, 91]), "bbox"),
    ("bbox-string", with_(RANGE, bbox=[0, 0, 1, "2"]), "bbox"),
    ("bbox-bool", with_(RANGE, bbox=[0, 0, 1, True]), "bbox"),
    ("bbox-null", with_(RANGE, bbox=[0, 0, None, 1]), "bbox"),
    ("bbox-object", with_(RANGE, bbox={"min_lon": 0}), "bbox"),
    ("bbox-huge-int", with_(RANGE, bbox=[0, 0, 1, 10**40]), "bbox"),
    ("radius-0.99", with_(CIRCLE, circle={"lon": 0, "lat": 0, "radius_m": 0.99}), "radius_m"),
    ("radius-0", with_(CIRCLE, circle={"lon": 0, "lat": 0, "radius_m": 0}), "radius_m"),
    ("radius-neg", with_(CIRCLE, circle={"lon": 0, "lat": 0, "radius_m": -5}), "radius_m"),
    ("radius-1000km+", with_(CIRCLE, circle={"lon": 0, "lat": 0, "radius_m": 1_000_000.5}),
     "radius_m"),
    ("radius-string", with_(CIRCLE, circle={"lon": 0, "lat": 0, "radius_m": "500"}), "radius_m"),
    ("circle-lon", with_(CIRCLE, circle={"lon": 200, "lat": 0, "radius_m": 5}), "lon"),
    ("circle-lat", with_(CIRCLE, circle={"lon": 0, "lat": -90.5, "radius_m": 5}), "lat"),
    ("circle-missing-radius", with_(CIRCLE, circle={"lon": 0, "lat": 0}), "radius_m"),
    ("circle-extra", with_(CIRCLE, circle={"lon": 0, "lat": 0, "radius_m": 5, "r": 1}), "r"),
    ("bbox-and-circle", with_(RANGE, circle=CIRCLE["circle"]), "range"),
    ("neither", {"type": "range", "keywords": ["a"]}, "range"),
    ("17-keywords", with_(KEYWORD, keywords=[f"k{i}" for i in range(17)]), "keywords"),
    ("17-keywords-range", with_(RANGE, keywords=[f"k{i}" for i in range(17)]), "keywords"),
    ("17-keywords-knn", with_(KNN, keywords=[f"k{i}" for i in range(17)]), "keywords"),
    ("keyword-65", with_(KEYWORD, keywords=["x" * 65]), 0),
    ("keyword-empty-string", with_(KEYWORD, keywords=[""]), 0),
    ("keyword-int", with_(KEYWORD, keywords=[5]), 0),
    ("keywords-string", with_(KEYWORD, keywords="tokyo"), "keywords"),
    ("keywords-empty", with_(KEYWORD, keywords=[]), "keywords"),
    ("keyword-missing", without(KEYWORD, "keywords"), "keywords"),
    ("match-some", with_(KEYWORD, match="some"), "match"),
    ("unknown-type", with_(KEYWORD, type="polygon"), "body"),
    ("type-missing", without(KEYWORD, "type"), "body"),
    ("type-int", with_(KEYWORD, type=1), "body"),
    ("unknown-field", with_(KEYWORD, colour="red"), "colour"),
    ("unknown-field-range", with_(RANGE, window=5), "window"),
    ("unknown-field-knn", with_(KNN, radius_m=5), "radius_m"),
    ("detect-keyword", with_(KEYWORD, detect=["enter"]), "detect"),
    ("detect-bad", with_(RANGE, detect=["around"]), 0),
    ("detect-empty", with_(RANGE, detect=[]), "detect"),
    ("k-0", with_(KNN, k=0), "k"),
    ("k-1001", with_(KNN, k=1001), "k"),
    ("k-negative", with_(KNN, k=-3), "k"),
    ("k-float", with_(KNN, k=5.5), "k"),
    ("k-string", with_(KNN, k="5"), "k"),
    ("k-bool", with_(KNN, k=True), "k"),
    ("k-huge", with_(KNN, k=10**30), "k"),
    ("k-missing", without(KNN, "k"), "k"),
    ("point-missing", without(KNN, "point"), "point"),
    ("point-3", with_(KNN, point=[1, 2, 3]), "point"),
    ("point-lat-91", with_(KNN, point=[0, 91]), "point"),
    ("point-lon-181", with_(KNN, point=[-181, 0]), "point"),
    ("point-string", with_(KNN, point=["1", 2]), 0),
    ("point-bool", with_(KNN, point=[True, 2]), 0),
    ("point-null", with_(KNN, point=[None, 2]), 0),
    ("ttl-59", with_(KEYWORD, ttl_s=59), "ttl_s"),
    ("ttl-0", with_(KEYWORD, ttl_s=0), "ttl_s"),
    ("ttl-negative", with_(KEYWORD, ttl_s=-3600), "ttl_s"),
    ("ttl-30d+1", with_(KEYWORD, ttl_s=30 * 24 * 3600 + 1), "ttl_s"),
    ("ttl-huge", with_(KEYWORD, ttl_s=10**40), "ttl_s"),
    ("ttl-string", with_(KEYWORD, ttl_s="3600"), "ttl_s"),
    ("ttl-bool", with_(KEYWORD, ttl_s=True), "ttl_s"),
]


@pytest.mark.parametrize(("body", "field"), [(b, f) for _, b, f in BAD_SUBSCRIPTIONS],
                         ids=[c for c, _, _ in BAD_SUBSCRIPTIONS])
def test_invalid_subscription_is_422_naming_the_field(api: Api, body: dict[str, Any],
                                                      field: Any) -> None:
    r = api.post("/v1/subscriptions", body)
    assert r.status_code == 422, r.text
    assert any(field in loc for loc in locs(r)), (field, locs(r))
    assert all(loc[0] == "body" for loc in locs(r))
    # The same subscription inside a batch, at index 2: 422 naming the index; none stored.
    batch = [KEYWORD, RANGE, body, KNN]
    r = api.post("/v1/subscriptions/batch", {"subscriptions": batch})
    assert r.status_code == 422, r.text
    assert all(loc[:3] == ["body", "subscriptions", 2] for loc in locs(r)), locs(r)
    assert any(field in loc for loc in locs(r)) or field in ("body", "range"), locs(r)
    assert api.subscription_ids() == []


GOOD_EDGES = [
    with_(CIRCLE, circle={"lon": 0, "lat": 0, "radius_m": 1}),
    with_(CIRCLE, circle={"lon": 180, "lat": -90, "radius_m": 1_000_000}),
    with_(RANGE, bbox=[-180, -90, 180, 90]),
    with_(RANGE, bbox=[5, 5, 5, 5]),
    with_(KEYWORD, keywords=[f"k{i}" for i in range(16)]),
    with_(KEYWORD, keywords=["x" * 64]),
    with_(KNN, k=1), with_(KNN, k=1000), with_(KNN, point=[180, -90]),
    with_(KEYWORD, ttl_s=60), with_(KEYWORD, ttl_s=30 * 24 * 3600), with_(KEYWORD, ttl_s=90.5),
    with_(RANGE, detect=["inside", "enter", "exit"]),
]


def test_subscription_limits_at_the_boundary_are_accepted(api: Api) -> None:
    ids = [api.subscribe(body)["id"] for body in GOOD_EDGES]
    assert api.subscription_ids() == ids
    r = api.post("/v1/subscriptions/batch", {"subscriptions": GOOD_EDGES})
    assert r.status_code == 201, r.text
    assert len(api.subscription_ids()) == 2 * len(GOOD_EDGES)


@pytest.mark.parametrize("body", [{"subscriptions": []}, {}, {"subscriptions": None},
                                  {"subscriptions": [KEYWORD], "extra": 1}])
def test_bad_subscription_batch_is_422(api: Api, body: dict[str, Any]) -> None:
    r = api.post("/v1/subscriptions/batch", body)
    assert r.status_code == 422, r.text
    assert locs(r)[0][0] == "body"
    assert api.subscription_ids() == []


# --- keys --------------------------------------------------------------------------------------

@pytest.mark.parametrize(("body", "field"), [
    ({"tenant": ""}, "tenant"), ({"tenant": "a b"}, "tenant"), ({"tenant": "x" * 65}, "tenant"),
    ({"tenant": 5}, "tenant"), ({"tenant": None}, "tenant"), ({"tenant": "a/b"}, "tenant"),
    ({"tenant": "a\u0000b"}, "tenant"), ({}, "tenant"), ({"tenant": "acme", "admin": 1}, "admin"),
    ({"tenant": "acme", "admin": "yes"}, "admin"), ({"tenant": "acme", "role": "x"}, "role"),
])
def test_invalid_key_request_is_422(admin: Api, body: dict[str, Any], field: str) -> None:
    r = admin.post("/v1/admin/keys", body)
    assert names_field(r, field), r.text


# --- query parameters ----------------------------------------------------------------------------

@pytest.mark.parametrize("params", [
    {"limit": 0}, {"limit": 1001}, {"limit": -1}, {"limit": "ten"}, {"limit": 1.5},
    {"limit": 10**30}, {"cursor": "garbage!"}, {"cursor": "x" * 65},
    {"cursor": base64.urlsafe_b64encode(b"s" + b"9" * 30).decode()},  # past a SQL BIGINT
    {"cursor": base64.urlsafe_b64encode(b"s-5").decode()}, {"cursor": "\u0000"},
])
def test_bad_list_parameters_are_422(api: Api, params: dict[str, Any]) -> None:
    r = api.get("/v1/subscriptions", params=params)
    assert names_field(r, "query", next(iter(params))), r.text


@pytest.mark.parametrize("params", [{"limit": 0}, {"limit": "x"}, {"since": "garbage"},
                                    {"since": "1-0:-1"}, {"since": "x" * 81}])
def test_bad_matches_parameters_are_422(api: Api, params: dict[str, Any]) -> None:
    sid = api.subscribe(KEYWORD)["id"]
    r = api.get(f"/v1/subscriptions/{sid}/matches", params=params)
    assert names_field(r, "query", next(iter(params))), r.text


# --- the OpenAPI document --------------------------------------------------------------------

def test_openapi_lists_every_implemented_path(inprocess: InProcessServer) -> None:
    with inprocess.http() as client:
        r = client.get("/openapi.json")
    assert r.status_code == 200
    paths = r.json()["paths"]
    expected = {
        "/v1/objects": {"post"},
        "/v1/objects/{object_id}": {"get"},
        "/v1/subscriptions": {"post", "get"},
        "/v1/subscriptions/batch": {"post"},
        "/v1/subscriptions/{sub_id}": {"get", "delete"},
        "/v1/subscriptions/{sub_id}/matches": {"get"},
        "/v1/admin/keys": {"post"},
        "/v1/admin/keys/{key_id}": {"delete"},
        "/v1/admin/cluster": {"get"},
        "/v1/admin/partitions": {"get"},
        "/v1/admin/balancer": {"get", "put"},
        "/v1/admin/rebalance": {"post"},
        "/admin/": {"get"},
        "/healthz": {"get"},
        "/readyz": {"get"},
        "/metrics": {"get"},
    }
    for path, methods in expected.items():
        assert path in paths, path
        assert methods <= set(paths[path]), (path, set(paths[path]))
    body = paths["/v1/objects"]["post"]["requestBody"]["content"]
    assert {"application/json", "application/x-ndjson"} <= set(body)
    assert "422" in paths["/v1/subscriptions"]["post"]["responses"]
