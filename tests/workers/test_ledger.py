"""The SWARM ledger (the executor's statistics), without processes: objects counted into the
window and the statistics, partitions created by a split seeded with exactly their share, and
expiry taking back everything the window added."""

from __future__ import annotations

import numpy as np
import pytest

from app.geo import balance
from app.geo.grid import Grid
from app.geo.index import GlobalIndex, initial_plan
from workers.ledger import SwarmLedger

GRID = Grid((-180, -90, 180, 90), 200, 100)


def ledger_of_w0() -> tuple[SwarmLedger, GlobalIndex]:
    index = GlobalIndex(initial_plan(GRID, ["w0", "w1"]))
    ledger = SwarmLedger(GRID)
    ledger.sync(index, [p for p in index.partitions if p.worker == "w0"])
    return ledger, index


def add_batch(ledger: SwarmLedger, rng: np.random.Generator, n: int, bucket: int) -> None:
    lon, lat = rng.uniform(-179, -1, n), rng.uniform(-80, 80, n)
    ledger.add_objects(*GRID.cells_of(lon, lat), bucket=bucket)


def total_n(ledger: SwarmLedger) -> float:
    return sum(st.totals().N + float(st.rows.N_new.sum()) for st in ledger.stats.values())


@pytest.mark.parametrize("seed", [1, 2, 3])
def test_split_seeds_children_and_expiry_takes_everything_back(seed: int) -> None:
    rng = np.random.default_rng(seed)
    e, index = ledger_of_w0()
    assert list(e.stats) == ["p0"]  # w0 owns the western half
    for r in range(4):
        for _ in range(30):  # many batches: the window piece compacts lazily
            add_batch(e, rng, 500, bucket=r)
        if r < 3:
            e.fold()
    before = e.stats["p0"].totals().N, int(e.stats["p0"].rows.N_new.sum())
    split = balance.Split("x", 40, "high", 0.0)
    index = GlobalIndex(balance.apply_split(index.plan, "p0", split, "w0", iter(["p7", "p8"])))
    e.sync(index, [p for p in index.partitions if p.worker == "w0"])
    assert sorted(e.stats) == ["p7", "p8"]
    after = (sum(st.totals().N for st in e.stats.values()),
             sum(int(st.rows.N_new.sum()) for st in e.stats.values()))
    assert after[0] == pytest.approx(before[0])
    assert after[1] == before[1]
    # row and column statistics of the two halves agree with each other
    for st in e.stats.values():
        assert st.rows.N[-1] == pytest.approx(st.cols.N[-1])
    e.expire(horizon=10**9)  # everything left the window
    assert not e.window
    for st in e.stats.values():
        assert np.allclose(st.rows.N, 0) and np.allclose(st.cols.N, 0)
        assert not st.rows.N_new.any() and not st.cols.N_new.any()
    assert total_n(e) == pytest.approx(0)


def handoff(query: bool, delete: bool) -> tuple[float, float, SwarmLedger]:
    """w0 moves p0 to w1 (as p9) after three rounds of objects: returns the sender's N for p0
    before the move, the receiver's N and Q for p9 one round after it, and the receiver."""
    rng = np.random.default_rng(7)
    sender, index = ledger_of_w0()
    rect = (10, 10, 30, 30)
    for r in range(3):
        add_batch(sender, rng, 2000, bucket=r)
        if query and r == 1:
            sender.add_query("s1", rect)
        sender.fold()
    n_before = sender.stats["p0"].totals().N
    moved = balance.apply_move(index.plan, ["p0"], "w1", iter(["p9"]))
    new_index = GlobalIndex(moved)
    part = next(p for p in moved.partitions if p.id == "p9")
    taken = sender.empty_masks()
    pieces = sender.export_window(lambda cx, cy: part.contains_cells(cx, cy), taken)
    exported = sender.stats["p0"].export()
    sender.drop_window(taken)
    sender.sync(new_index, [])
    assert not sender.stats and all(p.cx.size == 0 for p in sender.window)
    receiver = SwarmLedger(GRID)
    receiver.folds = sender.folds
    receiver.sync(new_index, [])
    if query:
        receiver.add_query("s1", rect)  # the handoff's subscriptions are added first
    receiver.receive_window(pieces)
    receiver.restore(part, exported)
    receiver.sync(new_index, [part])
    assert receiver.stats["p9"].totals().N == pytest.approx(n_before)
    if delete:
        receiver.remove_query("s1")
    receiver.fold()
    return n_before, receiver.stats["p9"].totals().Q, receiver


def test_handoff_carries_window_counts_and_queries() -> None:
    """A move hands the window's counts and the statistics to the receiver: its N is what the
    sender had, a subscription counted by the sender is counted once, and one deleted after
    the move leaves the receiver's statistics exactly."""
    _, q_none, _ = handoff(query=False, delete=False)
    _, q_kept, _ = handoff(query=True, delete=False)
    _, q_deleted, receiver = handoff(query=True, delete=True)
    assert q_kept > q_none
    assert q_deleted == pytest.approx(q_none)
    receiver.expire(horizon=10**9)
    assert total_n(receiver) == pytest.approx(0)


def test_points_counted_later_give_the_same_statistics_and_window() -> None:
    """A worker adds each step's points (`add_points`), counted only when something reads the
    ledger: the statistics, window and split children are those of counting each batch at
    once (`add_objects`), across buckets, folds, a split and an export."""
    rng = np.random.default_rng(7)
    now, later = ledger_of_w0()[0], ledger_of_w0()[0]
    for r in range(3):
        for b in range(40):
            lon, lat = rng.uniform(-179, -1, 30), rng.uniform(-80, 80, 30)
            bucket = 2 * r + (b >= 20)  # two buckets a round
            now.add_objects(*GRID.cells_of(lon, lat), bucket=bucket)
            later.add_points(lon.tolist(), lat.tolist(), bucket=bucket)
        assert later._points  # waiting
        if r < 2:
            now.fold()
            later.fold()

    def state(e: SwarmLedger) -> list[object]:
        e.compact()
        window = [(p.bucket, p.arrived, p.cx.tolist(), p.cy.tolist(), p.n.tolist())
                  for p in e.window]
        stats = [(pid, st.rows.N.tolist(), st.cols.N.tolist(), st.rows.N_new.tolist(),
                  st.rows.R.tolist()) for pid, st in sorted(e.stats.items())]
        return [window, stats]

    assert state(later) == state(now)
    lon, lat = rng.uniform(-179, -1, 50), rng.uniform(-80, 80, 50)
    now.add_objects(*GRID.cells_of(lon, lat), bucket=9)
    later.add_points(lon.tolist(), lat.tolist(), bucket=9)
    index = GlobalIndex(initial_plan(GRID, ["w0", "w1"]))
    split = balance.Split("x", 40, "high", 0.0)
    index = GlobalIndex(balance.apply_split(index.plan, "p0", split, "w0", iter(["p7", "p8"])))
    for e in (now, later):
        e.sync(index, [p for p in index.partitions if p.worker == "w0"])
    assert state(later) == state(now)
    later.add_points([-100.0], [10.0], bucket=10)  # waiting when the export reads
    now.add_objects(*GRID.cells_of([-100.0], [10.0]), bucket=10)
    exported = [e.export_window(lambda x, y: x < 50, e.empty_masks()) for e in (later, now)]
    assert exported[0] == exported[1] and exported[0][-1][0] == 10
