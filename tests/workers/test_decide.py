"""The matching decision without processes: subscriptions indexed per partition find exactly
what one index of all of them finds, for points inside and outside this worker's
partitions, before and after the plan gives partitions away or brings new ones; and
`decide` agrees with a brute-force statement of inside / enter / exit."""

from __future__ import annotations

from typing import Any

import numpy as np
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from app.geo.grid import Grid
from app.geo.index import GlobalIndex, Partition, Plan, initial_plan
from app.geo.matcher import Sub, SubscriptionIndex, brute_force_match, sub_from_spec
from app.pipeline.router import RoutedSummary, no_match_rows
from app.pipeline.wire import ObjectBatch
from workers.decide import decide
from workers.ledger import rect_of
from workers.subs import LocalSubs, SubInfo, SubTable

GRID = Grid((-10.0, -10.0, 10.0, 10.0), 8, 8)
WORKERS = ["w0", "w1", "w2"]
WORDS = ["a", "b", "c"]

coord = st.floats(-10.0, 10.0, allow_nan=False)
# Cell borders are 2.5 degrees apart: points and boxes on them test the inclusive edges.
edge = st.sampled_from([-10.0, -7.5, -5.0, -2.5, 0.0, 2.5, 5.0, 7.5, 10.0])
point = st.tuples(st.one_of(coord, edge), st.one_of(coord, edge))
words = st.lists(st.sampled_from(WORDS), max_size=2, unique=True)


@st.composite
def specs(draw: st.DrawFn) -> dict[str, Any]:
    kind = draw(st.sampled_from(["bbox", "circle", "keyword"]))
    detect = draw(st.lists(st.sampled_from(["inside", "enter", "exit"]), min_size=1,
                           max_size=3, unique=True))
    kws = draw(words)
    spec: dict[str, Any] = {"type": "range", "detect": detect}
    if kind == "keyword":
        return {"type": "keyword", "keywords": kws or ["a"],
                "match": draw(st.sampled_from(["any", "all"])), "detect": detect}
    if kind == "bbox":
        x0, x1 = sorted(draw(st.tuples(st.one_of(coord, edge), st.one_of(coord, edge))))
        y0, y1 = sorted(draw(st.tuples(st.one_of(coord, edge), st.one_of(coord, edge))))
        spec["bbox"] = [x0, y0, x1, y1]
    else:
        lon, lat = draw(point)
        spec["circle"] = {"lon": lon, "lat": lat,
                          "radius_m": draw(st.floats(0, 600_000, allow_nan=False))}
    if kws:
        spec["keywords"] = kws
        spec["match"] = draw(st.sampled_from(["any", "all"]))
    return spec


@st.composite
def plans(draw: st.DrawFn) -> Plan:
    """The initial layout of 6 partitions, each given to a random worker."""
    base = initial_plan(GRID, [f"x{i}" for i in range(6)])
    owners = draw(st.lists(st.sampled_from(WORKERS), min_size=6, max_size=6))
    parts = [Partition(p.id, p.x0, p.y0, p.x1, p.y1, w) for p, w in zip(base.partitions, owners,
                                                                          strict=True)]
    return Plan(version=1, grid=GRID, partitions=parts, members=WORKERS)


def owned(index: GlobalIndex, worker: str) -> list[Partition]:
    return [p for p in index.partitions if p.worker == worker]


def held_here(index: GlobalIndex, spec: dict[str, Any]) -> bool:
    """Whether the router sends the subscription to w0 (regionless ones go everywhere)."""
    if spec["type"] != "range":
        return True
    return any(p.overlaps(*rect_of(GRID, spec)) for p in owned(index, "w0"))


def held_by_w0(index: GlobalIndex, specs: list[dict[str, Any]]) -> LocalSubs:
    """Worker w0's subscriptions of tenant "t" (`s<i>` for specs[i]) under the plan: those the
    router sends it."""
    local = LocalSubs(GRID)
    local.sync(index, owned(index, "w0"))
    for i, spec in enumerate(specs):
        if held_here(index, spec):
            local.add("t", f"s{i}", spec, None)
    return local


def one_index(local: LocalSubs, tenant: str) -> SubscriptionIndex:
    """Every subscription of the tenant held by `local`, in one index (the per-worker index
    this replaced)."""
    index = SubscriptionIndex(GRID)
    index.add_many(h.sub for h in local.held.values() if h.tenant == tenant)
    return index


def pairs(result: tuple[Any, Any]) -> list[tuple[int, int]]:
    o, k = result
    return sorted(zip(np.asarray(o).tolist(), np.asarray(k).tolist(), strict=True))


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(plan=plans(), later=plans(), sub_specs=st.lists(specs(), min_size=1, max_size=25),
       pts=st.lists(st.tuples(point, words), min_size=1, max_size=40))
def test_partitioned_index_finds_what_one_index_finds(
        plan: Plan, later: Plan, sub_specs: list[dict[str, Any]],
        pts: list[tuple[tuple[float, float], list[str]]]) -> None:
    index = GlobalIndex(plan)
    local = held_by_w0(index, sub_specs)
    local.add("other", "x", {"type": "range", "bbox": [-10, -10, 10, 10]}, None)
    lon = [p[0][0] for p in pts]
    lat = [p[0][1] for p in pts]
    kws = [p[1] for p in pts]
    view = local.indexed("t")
    if view is None:
        return
    assert pairs(view.match(lon, lat, kws)) == pairs(one_index(local, "t").match(lon, lat, kws))
    subs = [h.sub for h in local.held.values() if h.tenant == "t"]
    assert pairs(view.match(lon, lat, kws)) == pairs(brute_force_match(subs, lon, lat, kws))
    # The plan changes: partitions leave, others arrive (filled from what is held). For
    # points in the partitions owned now, the index still finds every subscription held.
    moved = GlobalIndex(Plan(version=2, grid=GRID, partitions=later.partitions,
                             members=WORKERS))
    local.sync(moved, owned(moved, "w0"))
    mine = np.isin(moved.partition_of_points(lon, lat),
                   [moved.part_index[p.id] for p in owned(moved, "w0")])
    keep = np.flatnonzero(mine).tolist()
    sel = ([lon[i] for i in keep], [lat[i] for i in keep], [kws[i] for i in keep])
    assert pairs(view.match(*sel)) == pairs(brute_force_match(subs, *sel))


def test_removal_leaves_every_partition() -> None:
    index = GlobalIndex(initial_plan(GRID, ["w0", "w1"]))
    local = LocalSubs(GRID)
    local.sync(index, index.partitions)  # both partitions here
    spans = {"type": "range", "bbox": [-9, -9, 9, 9]}
    local.add("t", "s1", spans, None)
    local.add("t", "s2", {"type": "keyword", "keywords": ["a"]}, None)
    assert sum(len(p.by_tenant["t"]) for p in local.parts.values()) == 2  # s1 in both
    assert local.remove("s1") and local.remove("s2") and not local.remove("s1")
    assert not local.tables and not local.everywhere
    assert all(not p.by_tenant for p in local.parts.values())


# --- decide ------------------------------------------------------------------------------

@st.composite
def records(draw: st.DrawFn) -> dict[str, Any]:
    moving = draw(st.booleans())
    prev = draw(st.one_of(st.none(), point)) if moving else None
    late = moving and draw(st.booleans())
    exit_only = prev is not None and draw(st.booleans())
    return {"pos": draw(point), "kws": draw(words), "moving": moving, "prev": prev,
            "late": late, "exit_only": exit_only,
            "decide_exit": prev is not None and (exit_only or draw(st.booleans())),
            "at": draw(st.sampled_from([100.0, 200.0]))}


def batch_of(recs: list[dict[str, Any]]) -> ObjectBatch:
    n = len(recs)
    return ObjectBatch(
        tenant="t", ids=[f"o{i}" for i in range(n)], record_ids=[f"r{i}" for i in range(n)],
        lon=[r["pos"][0] for r in recs], lat=[r["pos"][1] for r in recs],
        ts=[0.0] * n, keywords=[r["kws"] for r in recs], text=[None] * n, props=[None] * n,
        moving=[r["moving"] for r in recs], prev=[r["prev"] for r in recs],
        late=[r["late"] for r in recs], exit_only=[r["exit_only"] for r in recs],
        decide_exit=[r["decide_exit"] for r in recs], sent_at=0.0, plan_version=1)


def contains(sub: Sub, p: tuple[float, float] | None, kws: list[str]) -> bool:
    return p is not None and bool(brute_force_match([sub], [p[0]], [p[1]], [kws])[0].size)


@settings(max_examples=150, deadline=None)
@given(sub_specs=st.lists(specs(), min_size=1, max_size=12),
       expiry=st.lists(st.sampled_from([None, 150.0]), min_size=12, max_size=12),
       recs=st.lists(records(), min_size=1, max_size=25))
def test_decide_agrees_with_brute_force(sub_specs: list[dict[str, Any]],
                                        expiry: list[float | None],
                                        recs: list[dict[str, Any]]) -> None:
    table = SubTable()
    index = SubscriptionIndex(GRID)
    subs = []
    for i, spec in enumerate(sub_specs):
        key = table.put(SubInfo(f"s{i}", frozenset(spec["detect"]), expiry[i]))
        subs.append((key, sub_from_spec(key, spec), set(spec["detect"]), expiry[i]))
        index.add(subs[-1][1])
    got = decide(table, index, batch_of(recs), [r["at"] for r in recs])
    found = sorted(zip(got.keys.tolist(), got.rows.tolist(), got.detect.tolist(), strict=True))
    want = []
    for row, r in enumerate(recs):
        prev = None if r["late"] else r["prev"]
        for key, sub, detect, expires in subs:
            live = expires is None or r["at"] < expires
            now_in = contains(sub, r["pos"], r["kws"])
            was_in = contains(sub, prev, r["kws"])
            if not live:
                continue
            if now_in and not r["exit_only"] and "inside" in detect:
                want.append((key, row, 0))
            if (now_in and not was_in and not r["exit_only"] and r["moving"] and not r["late"]
                    and "enter" in detect):
                want.append((key, row, 1))
            if was_in and not now_in and r["decide_exit"] and "exit" in detect:
                want.append((key, row, 2))
    assert found == sorted(want)


# --- keyword summaries (Tornado §4) -------------------------------------------------------

@settings(max_examples=120, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(plan=plans(), sub_specs=st.lists(specs(), min_size=0, max_size=25),
       recs=st.lists(records(), min_size=1, max_size=30))
def test_rows_marked_by_the_summary_match_nothing(
        plan: Plan, sub_specs: list[dict[str, Any]], recs: list[dict[str, Any]]) -> None:
    """The router's marks from a worker's summary (`no_match_rows`) never fall on a row that
    `decide` matches there: the rows of the worker's partitions, as the router sends them."""
    index = GlobalIndex(plan)
    local = held_by_w0(index, sub_specs)
    mine = {index.part_index[p.id] for p in owned(index, "w0")}
    part = index.partition_of_points([r["pos"][0] for r in recs], [r["pos"][1] for r in recs])
    rows = [i for i, p in enumerate(part.tolist()) if p in mine and not recs[i]["exit_only"]]
    summary = local.summary("t")
    view = local.indexed("t")
    if summary is None or view is None or not rows:
        assert summary is None or not rows
        return
    assert summary.plan_version == plan.version and local.token("t") == summary.token
    assert set(summary.parts) == {p.id for p in owned(index, "w0")}
    entry = batch_of(recs).take(rows)
    marked = no_match_rows(RoutedSummary(summary).by_partition(index), part[rows].tolist(),
                           entry.keywords, entry.prev, entry.late)
    matched = decide(view.table, view, entry, [recs[i]["at"] for i in rows]).rows
    assert not set(marked) & set(matched.tolist())


def test_a_summary_token_lasts_until_the_subscriptions_or_partitions_change() -> None:
    index = GlobalIndex(initial_plan(GRID, ["w0", "w1"]))
    local = LocalSubs(GRID)
    local.sync(index, owned(index, "w0"))
    assert local.summary("t") is None and local.token("t") is None  # nothing held
    local.add("t", "s1", {"type": "range", "bbox": [-9, -9, 9, 9], "keywords": ["a"]}, None)
    local.add("u", "s2", {"type": "keyword", "keywords": ["b", "c"], "match": "all"}, None)
    assert local.changed == {"t", "u"}
    first = local.summary("t")
    assert first is not None and local.token("t") == first.token
    assert list(first.parts.values()) == [["a"]]
    u = local.summary("u")
    assert u is not None and list(u.parts.values()) == [["b"]]  # the longest, then first
    local.add("u", "s3", {"type": "range", "bbox": [-9, -9, 9, 9]}, None)  # no keyword
    assert local.token("u") is None and local.token("t") == first.token  # per tenant
    u = local.summary("u")
    assert u is not None and list(u.parts.values()) == [None]
    second = local.summary("t")
    assert second is not None and second.token != first.token  # a summary: a new token
    local.sync(GlobalIndex(Plan(version=2, grid=GRID, partitions=index.partitions,
                                members=["w0", "w1"])), owned(index, "w0"))
    assert local.token("t") is None and local.token("u") is None
    assert local.changed >= {"t", "u"}
    assert local.remove("s1") and local.token("t") is None
    assert local.summary("t") is None  # no subscription of t left here
