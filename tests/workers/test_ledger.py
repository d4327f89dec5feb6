"""The executor's bookkeeping of SWARM statistics, without processes: objects counted into
the window and the statistics, partitions created by a split seeded with exactly their share,
and expiry taking back everything the window added."""

from __future__ import annotations

import numpy as np
import pytest

from app.core.config import Settings
from app.geo import balance
from app.geo.grid import Grid
from app.geo.index import GlobalIndex, initial_plan
from workers.executor import Executor


def executor() -> Executor:
    settings = Settings(grid=(200, 100), window_s=600, bucket_s=60)
    e = Executor(settings, "w0", "redis://127.0.0.1:1/0")  # never connects in these tests
    e.index = GlobalIndex(initial_plan(Grid(settings.bounds, 200, 100), ["w0", "w1"]))
    e._sync_stats()
    return e


def fold(e: Executor) -> None:
    for st in e.stats.values():
        st.fold()
    e.folds += 1


def batch(rng: np.random.Generator, n: int) -> dict[str, list[object]]:
    return {"xo": [bool(v) for v in rng.random(n) < 0.1],
            "lon": rng.uniform(-179, -1, n).tolist(), "lat": rng.uniform(-80, 80, n).tolist()}


def total_n(e: Executor) -> float:
    return sum(st.totals().N + float(st.rows.N_new.sum()) for st in e.stats.values())


@pytest.mark.parametrize("seed", [1, 2, 3])
def test_split_seeds_children_and_expiry_takes_everything_back(seed: int) -> None:
    rng = np.random.default_rng(seed)
    e = executor()
    assert list(e.stats) == ["p0"]  # w0 owns the western half
    for r in range(4):
        for _ in range(30):  # many batches: the window piece compacts lazily
            e._count_objects(batch(rng, 500))
        if r < 3:
            fold(e)
    before = e.stats["p0"].totals().N, int(e.stats["p0"].rows.N_new.sum())
    assert e.index is not None
    plan = e.index.plan
    split = balance.Split("x", 40, "high", 0.0)
    e.index = GlobalIndex(balance.apply_split(plan, "p0", split, "w0", iter(["p7", "p8"])))
    e._sync_stats()
    assert sorted(e.stats) == ["p7", "p8"]
    after = (sum(st.totals().N for st in e.stats.values()),
             sum(int(st.rows.N_new.sum()) for st in e.stats.values()))
    assert after[0] == pytest.approx(before[0])
    assert after[1] == before[1]
    # row and column statistics of the two halves agree with each other
    for st in e.stats.values():
        assert st.rows.N[-1] == pytest.approx(st.cols.N[-1])
    e._expire_window(1e12)  # everything left the window
    assert not e.window
    for st in e.stats.values():
        assert np.allclose(st.rows.N, 0) and np.allclose(st.cols.N, 0)
        assert not st.rows.N_new.any() and not st.cols.N_new.any()
    assert total_n(e) == pytest.approx(0)
