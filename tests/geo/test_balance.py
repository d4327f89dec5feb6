"""SWARM load balancing: cost (§3), decision pointer (Figure 9), Algorithm 3, split search (§4.3.2),
merging and plan edits."""

from __future__ import annotations

import itertools
import math
import random

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from app.geo.balance import (
    Decision,
    DecisionPointer,
    MoveSubset,
    Side,
    Split,
    SplitMove,
    Stage,
    _search,
    apply_merges,
    apply_move,
    apply_reduction,
    apply_split,
    best_split,
    cost,
    merge,
    mergeable,
    reduce_workload,
    split_cdiff,
    split_partition,
    subset_sum_move,
    worker_cost,
    worker_numerator,
    worker_received,
)
from app.geo.grid import Grid
from app.geo.index import GlobalIndex, Partition, Plan, initial_plan
from app.geo.stats import Axis, Counts, PartitionStats

# -- cost model ------------------------------------------------------------------------------


def test_cost_is_n_q_r_over_r_s() -> None:
    assert cost(4.0, 3, 2, 8) == 3.0  # N·Q·Prob with Prob = R/R(S) = 1/4
    assert cost(4.0, 3, 2, 0) == 0.0  # nothing received anywhere: no predicted load
    parts = [Counts(4.0, 3, 2), Counts(1.5, 2, 4), Counts(7.0, 0, 9)]
    assert worker_numerator(parts) == 24.0 + 12.0
    assert worker_received(parts) == 15
    assert worker_cost(parts, 30) == pytest.approx(sum(cost(*c, 30) for c in parts))


# -- decision pointer (Figure 9) ---------------------------------------------------------------


def run(dp: DecisionPointer, rs: list[float]) -> list[tuple[Stage, Decision]]:
    out = []
    for r in rs:
        dp.step(r)
        out.append((dp.stage, dp.decision))
    return out


def test_pointer_starts_at_start_doing_nothing_and_moves_right_on_gains() -> None:
    dp = DecisionPointer()
    assert (dp.stage, dp.decision) == (Stage.START, Decision.NOTHING)
    N = Decision.NOTHING
    assert run(dp, [1, 2, 3, 4]) == [
        (Stage.GOOD, N), (Stage.GREAT, N), (Stage.GREAT, N), (Stage.GREAT, N)
    ]


def test_left_end_flips_and_resets_to_start() -> None:
    dp = DecisionPointer()
    N, Y = Decision.NOTHING, Decision.REBALANCE
    # Equal throughput is no enhancement: left. Start -> Bad -> Flip (= rebalance, Start).
    assert run(dp, [0, 0]) == [(Stage.BAD, N), (Stage.START, Y)]
    assert not dp.forced
    # "Otherwise, the decision will be flipped again to do nothing after two rounds."
    assert run(dp, [0, 0]) == [(Stage.BAD, Y), (Stage.START, N)]


def test_from_great_it_takes_four_bad_rounds_to_flip() -> None:
    dp = DecisionPointer()
    run(dp, [1, 2])
    assert dp.stage == Stage.GREAT
    N, Y = Decision.NOTHING, Decision.REBALANCE
    assert run(dp, [1, 1, 1, 1]) == [
        (Stage.GOOD, N), (Stage.START, N), (Stage.BAD, N), (Stage.START, Y)
    ]
    # A gain after a flip keeps the new decision: it "has proven correct".
    assert run(dp, [5, 6]) == [(Stage.GOOD, Y), (Stage.GREAT, Y)]


def test_beta_forces_a_flip_when_throughput_oscillates() -> None:
    """The paper's example: throughput up one round, down the next, forever: the pointer swings
    Good/Start and never reaches Flip, so only beta makes SWARM try rebalancing."""
    dp = DecisionPointer(beta=20)
    rs = [10 if i % 2 == 0 else 5 for i in range(20)]
    assert [dp.step(r) for r in rs] == [Decision.NOTHING] * 20
    assert dp.same == 20 and dp.stage == Stage.START
    assert dp.step(10) == Decision.REBALANCE  # round beta + 1: forced to Flip
    assert dp.forced and dp.stage == Stage.START and dp.same == 1
    assert dp.step(5) == Decision.REBALANCE and not dp.forced
    # beta applies to "rebalance" as well
    dp = DecisionPointer(beta=3, decision=Decision.REBALANCE)
    assert [dp.step(r) for r in (1, 2, 3, 4)] == [Decision.REBALANCE] * 3 + [Decision.NOTHING]


def test_pointer_state_round_trips() -> None:
    dp = DecisionPointer(beta=5)
    run(dp, [3, 1, 0])
    again = DecisionPointer.from_dict(dp.to_dict())
    assert again == dp
    assert [again.step(r) for r in (0, 1, 0)] == [dp.step(r) for r in (0, 1, 0)]
    with pytest.raises(ValueError):
        DecisionPointer(beta=0)


# -- Algorithm 3 -------------------------------------------------------------------------------


def test_subset_sum_move_example() -> None:
    costs = [("a", 5.0), ("b", 4.0), ("c", 3.0), ("d", 1.0), ("z", 0.0)]
    # Cmax = (13 - 1) / 2 = 6: take 5, skip 4 and 3, take 1 -> exactly Cmax, stop.
    assert subset_sum_move(costs, 13.0, 1.0) == ["a", "d"]
    assert subset_sum_move(costs, 13.0, 13.0) == []  # balanced: Cmax = 0
    assert subset_sum_move(costs, 13.0, 20.0) == []  # Cmax < 0
    assert subset_sum_move([("b", 2.0), ("a", 2.0)], 8.0, 0.0) == ["b", "a"]  # ties: stable


@settings(max_examples=300, deadline=None)
@given(
    st.lists(st.integers(0, 40), max_size=8),
    st.integers(0, 100),
    st.integers(0, 100),
)
def test_subset_sum_move_against_exhaustive(costs_i: list[int], extra: int, pct: int) -> None:
    costs = [(f"p{i}", float(c)) for i, c in enumerate(costs_i)]
    c_mh = sum(c for _, c in costs) + extra
    c_ml = c_mh * pct / 100
    c_max = (c_mh - c_ml) / 2
    chosen = subset_sum_move(costs, c_mh, c_ml)
    by_id = dict(costs)
    picked = [by_id[i] for i in chosen]
    total = sum(picked)
    assert len(set(chosen)) == len(chosen)
    assert total <= c_max  # never overloads mL
    assert all(c > 0 for c in picked)
    assert picked == sorted(picked, reverse=True)  # largest first
    if total < c_max:  # greedy stopped only because nothing else fits
        assert all(c == 0 or c + total > c_max for i, c in costs if i not in chosen)
    best = max(
        (
            sum(s)
            for k in range(len(costs) + 1)
            for s in itertools.combinations([c for _, c in costs], k)
            if sum(s) <= c_max
        ),
        default=0.0,
    )
    assert 2 * total >= best  # the sorted greedy's 1/2 guarantee ([34] in the paper)


# -- split search -------------------------------------------------------------------------------


def random_stats(seed: int, w: int, h: int, rounds: int = 2) -> PartitionStats:
    rng = np.random.default_rng(seed)
    p = Partition("p", 3, 1, 3 + w - 1, 1 + h - 1, "mH")
    s = PartitionStats(p)
    # Skewed: a random hotspot cell attracts most objects and queries.
    hx, hy = int(rng.integers(p.x0, p.x1 + 1)), int(rng.integers(p.y0, p.y1 + 1))
    for _ in range(rounds):
        n = int(rng.integers(0, 60))
        hot = rng.random(n) < 0.6
        cx = np.where(hot, hx, rng.integers(p.x0, p.x1 + 1, n))
        cy = np.where(hot, hy, rng.integers(p.y0, p.y1 + 1, n))
        s.add_objects(cx, cy)
        for _ in range(int(rng.integers(0, 12))):
            x, y = (hx, hy) if rng.random() < 0.5 else (
                int(rng.integers(p.x0, p.x1 + 1)), int(rng.integers(p.y0, p.y1 + 1))
            )
            a, b, c, d = (int(v) for v in rng.integers(0, 4, 4))
            s.add_query(x - a, y - b, x + c, y + d)
        s.fold()
    return s


def all_cdiffs(
    s: PartitionStats, c_mh: float, c_ml: float, r_s: float
) -> list[tuple[Axis, int, Side, float]]:
    out: list[tuple[Axis, int, Side, float]] = []
    p = s.partition
    axis: Axis
    moved: Side
    for axis in ("y", "x"):
        lo, hi = (p.y0, p.y1) if axis == "y" else (p.x0, p.x1)
        for at in range(lo, hi):
            for moved in ("low", "high"):
                out.append((axis, at, moved, split_cdiff(s, axis, at, moved, c_mh, c_ml, r_s)))
    return out


@settings(max_examples=200, deadline=None)
@given(
    st.integers(0, 2**32 - 1),
    st.integers(1, 12),
    st.integers(1, 12),
    st.floats(0, 3),
    st.floats(0, 1),
    st.integers(0, 50),
)
def test_best_split_equals_exhaustive_search(
    seed: int, w: int, h: int, extra_h: float, frac_l: float, extra_r: int
) -> None:
    s = random_stats(seed, w, h)
    r_s = s.totals().R + extra_r
    c_p = cost(*s.totals(), r_s)
    c_mh = c_p * (1 + extra_h)  # mH may hold other partitions too
    c_ml = c_mh * frac_l
    cds = all_cdiffs(s, c_mh, c_ml, r_s)
    got = best_split(s, c_mh, c_ml, r_s, require_improvement=False)
    if not cds:
        assert got is None and w == h == 1
        return
    assert got is not None
    best = min(abs(c[3]) for c in cds)
    assert abs(got.cdiff) == best  # ties with other positions are fine
    assert got.cdiff == split_cdiff(s, got.axis, got.at, got.moved, c_mh, c_ml, r_s)
    # The reason binary search is exact here: Cdiff is monotone in the split position
    # (non-increasing when the low side moves, non-decreasing when the high side moves).
    for axis in ("y", "x"):
        for moved, sign in (("low", 1), ("high", -1)):
            seq = [c[3] for c in cds if c[0] == axis and c[2] == moved]
            assert all(sign * (b - a) <= 0 for a, b in itertools.pairwise(seq))
    with_check = best_split(s, c_mh, c_ml, r_s)
    if best < abs(c_mh - c_ml):
        assert with_check == got
    else:
        assert with_check is None


def test_best_split_moves_about_half_the_hotspot() -> None:
    """One column of 8 rows, load evenly in rows 0-3, mH holds only this partition, mL idle."""
    p = Partition("p", 0, 0, 0, 7, "mH")
    s = PartitionStats(p)
    for y in range(4):
        s.add_objects([0] * 10, [y] * 10)
        s.add_query(0, y, 0, y)
    s.fold()
    r_s = s.totals().R
    c_mh = cost(*s.totals(), r_s)
    got = best_split(s, c_mh, 0.0, r_s)
    assert got is not None
    # Two rows each side of the cut gives C(p1) = C(p2) and Cdiff = 0: the search stops there.
    assert got.axis == "y" and got.at == 1 and got.cdiff == 0
    assert best_split(PartitionStats(Partition("c", 2, 2, 2, 2, "m")), 1.0, 0.0, 1) is None


def test_binary_search_probes_logarithmically() -> None:
    calls: list[int] = []

    def f(i: int) -> float:
        calls.append(i)
        return 613.5 - i  # non-increasing, zero crossing between 613 and 614

    assert _search(f, 0, 999, 1) in ((613, 0.5), (614, -0.5))
    assert len(calls) <= 2 + math.ceil(math.log2(1000))
    calls.clear()
    assert _search(lambda i: -f(i), 0, 999, -1)[0] in (613, 614)
    assert _search(lambda i: 5.0 - i, 10, 20, 1) == (10, -5.0)
    assert _search(lambda i: 50.0 - i, 10, 20, 1) == (20, 30.0)


# -- mH's procedure and plan edits --------------------------------------------------------------


def loaded_stats(p: Partition, n: int, q: int) -> PartitionStats:
    s = PartitionStats(p)
    s.add_objects([p.x0] * n, [p.y0] * n)
    for _ in range(q):
        s.add_query(p.x0, p.y0, p.x0, p.y0)
    s.fold()
    return s


def test_reduce_workload_prefers_a_subset_then_a_split() -> None:
    parts = [Partition(f"p{i}", i, 0, i, 3, "mH") for i in range(3)]
    # Num(C(p)) = N·Q·R: 10·2·12 = 240, 12·2·14 = 336, 1·1·2 = 2; Cmax = 578 / 2 = 289:
    # 336 does not fit, 240 does, then 2 does.
    stats = [loaded_stats(parts[0], 10, 2), loaded_stats(parts[1], 12, 2),
             loaded_stats(parts[2], 1, 1)]
    r_s = sum(s.totals().R for s in stats)
    red = reduce_workload(stats, 0.0, r_s)
    assert red == MoveSubset(("p0", "p2"))
    # A single partition can only be split; its load sits in one cell, rows are all equal.
    one = PartitionStats(Partition("q", 0, 0, 3, 0, "mH"))
    one.add_objects([0, 1, 2, 3] * 5, [0] * 20)
    for x in range(4):
        one.add_query(x, 0, x, 0)
    one.fold()
    red = reduce_workload([one], 0.0, one.totals().R)
    assert isinstance(red, SplitMove) and red.partition_id == "q"
    assert red.split.axis == "x" and red.split.at == 1
    # Load in one cell cannot be divided: no feasible reduction.
    assert reduce_workload([loaded_stats(Partition("c", 0, 0, 0, 0, "mH"), 5, 5)], 0.0, 10) is None


def test_split_partition_and_parent_links() -> None:
    p = Partition("p7", 2, 3, 9, 5, "w1", parent="p1", prev_owner="w0")
    low, high = split_partition(p, "x", 4, ("p8", "p9"))
    assert (low.x0, low.y0, low.x1, low.y1) == (2, 3, 4, 5)
    assert (high.x0, high.y0, high.x1, high.y1) == (5, 3, 9, 5)
    assert {low.parent, high.parent} == {"p7"} and {low.prev_owner, high.worker} == {"w1"}
    low, high = split_partition(p, "y", 3, ("a", "b"))
    assert (low.y0, low.y1, high.y0, high.y1) == (3, 3, 4, 5)
    for axis, at in (("x", 9), ("x", 1), ("y", 5)):
        with pytest.raises(ValueError):
            split_partition(p, axis, at, ("a", "b"))  # type: ignore[arg-type]
    with pytest.raises(ValueError):
        split_partition(p, "x", 4, ("a", "a"))


def test_mergeable_and_merge() -> None:
    a = Partition("a", 0, 0, 1, 1, "w")
    b = Partition("b", 2, 0, 4, 1, "w")  # right of a, same rows
    c = Partition("c", 0, 2, 1, 3, "w")  # above a, same columns
    d = Partition("d", 2, 2, 3, 2, "w")  # above b but narrower: union with b is no rectangle
    e = Partition("e", 0, 4, 1, 5, "v")  # above c, other worker
    assert sorted(mergeable([b, a, c, d, e])) == [("a", "b"), ("a", "c")]
    m = merge(b, a, "ab")
    assert (m.id, m.x0, m.y0, m.x1, m.y1, m.worker, m.parent) == ("ab", 0, 0, 4, 1, "w", None)
    with pytest.raises(ValueError):
        merge(b, d, "x")
    with pytest.raises(ValueError):
        merge(c, e, "x")


def test_plan_edits_make_valid_next_versions() -> None:
    plan = initial_plan(Grid(nx=8, ny=8), ["w0", "w1"])
    before = plan.to_json()
    ids = (f"p{i}" for i in itertools.count(10))
    p0 = plan.partitions[0]
    s1 = apply_split(plan, p0.id, Split("y", 3, "high", 0.0), "w1", ids)
    assert plan.to_json() == before  # input untouched
    assert s1.version == plan.version + 1
    by_id = {p.id: p for p in s1.partitions}
    assert (by_id["p10"].worker, by_id["p11"].worker) == ("w0", "w1")
    assert by_id["p11"].prev_owner == "w0" and by_id["p11"].parent == p0.id
    s2 = apply_move(s1, ["p10"], "w1", ids)
    moved = next(p for p in s2.partitions if p.id == "p12")
    assert (moved.worker, moved.parent, moved.prev_owner) == ("w1", "p10", "w0")
    # Everything is on w1 now: the three pieces merge back into the whole grid.
    s3 = apply_merges(s2, ids)
    assert [(p.x0, p.y0, p.x1, p.y1, p.worker) for p in s3.partitions] == [(0, 0, 7, 7, "w1")]
    assert s3.version == s2.version + 1
    assert apply_merges(s3, ids) is s3
    with pytest.raises(KeyError):
        apply_move(s3, ["nope"], "w0", ids)


@settings(max_examples=60, deadline=None)
@given(st.integers(0, 2**32 - 1))
def test_random_splits_moves_and_merges_keep_plans_valid(seed: int) -> None:
    rnd = random.Random(seed)
    workers = ["w0", "w1", "w2"]
    plan = initial_plan(Grid(nx=10, ny=7), workers)
    ids = (f"n{i}" for i in itertools.count())
    for _ in range(12):
        p = rnd.choice(plan.partitions)
        to = rnd.choice(workers)
        axes: list[Axis] = [a for a in ("x", "y") if (p.width if a == "x" else p.height) > 1]
        if axes and rnd.random() < 0.7:
            axis = rnd.choice(axes)
            lo, hi = (p.x0, p.x1) if axis == "x" else (p.y0, p.y1)
            side: Side = rnd.choice(["low", "high"])
            split = Split(axis, rnd.randrange(lo, hi), side, 0.0)
            plan = apply_reduction(plan, SplitMove(p.id, split), to, ids)
        else:
            plan = apply_reduction(plan, MoveSubset((p.id,)), to, ids)
        GlobalIndex(plan)  # validates
    merged = apply_merges(plan, ids)
    merged.validate()
    assert not mergeable(merged.partitions)
    assert len(merged.partitions) <= len(plan.partitions)


def test_one_rebalance_round_end_to_end() -> None:
    """Hotspot on w0: the pointer says rebalance, mH = w0 splits, and Cdiff predicted from the
    statistics equals C(mH) - C(mL) recomputed from scratch on the new plan."""
    plan = initial_plan(Grid(nx=8, ny=8), ["w0", "w1"])
    rng = np.random.default_rng(3)
    # w0 owns columns 0-3: 300 objects there, 20 on w1's side.
    objs = np.concatenate([rng.integers(0, 4, (300, 2)), rng.integers(4, 8, (20, 2))])
    qs = [(int(x), int(y), int(x) + 1, int(y) + 1) for x, y in rng.integers(0, 7, (30, 2))]

    def build(p: Plan) -> dict[str, PartitionStats]:
        gi = GlobalIndex(p)
        out = {q.id: PartitionStats(q) for q in p.partitions}
        where = gi.cell_part[objs[:, 1], objs[:, 0]]
        for i, q in enumerate(p.partitions):
            sel = objs[where == i]
            out[q.id].add_objects(sel[:, 0], sel[:, 1])
        for rect in qs:
            for i in gi.query_overlap(*rect):
                out[p.partitions[i].id].add_query(*rect)
        for s in out.values():
            s.fold()
        return out

    def worker_costs(p: Plan, stats: dict[str, PartitionStats], r_s: float) -> dict[str, float]:
        return {
            w: worker_cost([stats[q.id].totals() for q in p.partitions if q.worker == w], r_s)
            for w in ("w0", "w1")
        }

    stats = build(plan)
    r_s = sum(s.totals().R for s in stats.values())
    dp = DecisionPointer()
    # Throughput flat: Good, Start, Bad, Flip -> rebalance in the fourth round.
    assert [dp.step(r_s) for _ in range(4)] == [Decision.NOTHING] * 3 + [Decision.REBALANCE]
    c = worker_costs(plan, stats, r_s)
    assert c["w0"] > c["w1"]
    mine = [stats[q.id] for q in plan.partitions if q.worker == "w0"]
    red = reduce_workload(mine, c["w1"], r_s)
    assert isinstance(red, SplitMove)  # w0 has one partition: nothing to move whole
    new = apply_reduction(plan, red, "w1", iter(["p2", "p3"]))
    # Same R(S) as the prediction (a query over the cut is received by both halves next time).
    after = worker_costs(new, build(new), r_s)
    assert after["w0"] - after["w1"] == pytest.approx(red.split.cdiff)
    assert abs(red.split.cdiff) < c["w0"] - c["w1"]
