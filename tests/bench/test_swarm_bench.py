"""The SWARM §6.2 benchmark's simulation (bench/swarm.py) at toy sizes: its bookkeeping is
consistent, its statistics match what the executors keep, and it writes its figure."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from app.geo.balance import Decision
from app.geo.grid import Grid
from app.geo.history import history_plan
from app.pipeline.router import read_history_sample
from bench.swarm import (
    US_BOUNDS,
    CoverCount,
    Executors,
    Hotspot,
    ModeResult,
    RealConfig,
    RealTimeline,
    SimConfig,
    Simulation,
    Workload,
    base_capacity,
    main,
    make_workload,
    report_real,
    simulate,
    weighted_percentile,
    write_history_sample,
)

TINY = {"grid": 80, "rounds": 24, "round_s": 15.0, "objects_per_round": 3000, "subs": 4000,
        "hot_subs": 600, "history_objects": 2000, "seed": 3}


def _workload(scenario: str = "fig14") -> Workload:
    return make_workload(scenario, rounds=TINY["rounds"], round_s=15.0,
                         objects_per_round=TINY["objects_per_round"], subs=TINY["subs"],
                         hot_subs=TINY["hot_subs"],
                         grid=Grid(bounds=US_BOUNDS, nx=TINY["grid"], ny=TINY["grid"]),
                         history_objects=TINY["history_objects"], seed=TINY["seed"])


def test_hotspot_shapes() -> None:
    step = Hotspot("x", 0.25, 0.75, 0.4, "step")
    normal = Hotspot("x", 0.25, 0.75, 0.4, "normal")
    assert step.intensity(0.2) == normal.intensity(0.2) == 0.0
    assert step.intensity(0.3) == step.intensity(0.7) == 0.4
    assert normal.intensity(0.5) == pytest.approx(0.4)
    assert normal.intensity(0.3) < normal.intensity(0.4) < normal.intensity(0.5)


def test_workload_phases() -> None:
    wl = _workload("fig16")
    hot = wl.hot_rounds()
    assert hot.any() and not hot.all()
    assert (wl.intensity[~hot] == 0).all() and (wl.intensity[hot] > 0).all()
    # Hotspot subscriptions are created within the hotspot and deleted at its end.
    extra = ~wl.preloaded
    assert extra.sum() == 2 * TINY["hot_subs"]
    assert (wl.sub_start[extra] < wl.sub_end[extra]).all()
    assert hot[wl.sub_start[extra]].all()
    # The history sample holds no hotspot object: it lies where the normal workload lies.
    assert wl.sample_subs.max() < TINY["subs"]


def test_cover_count_is_brute_force() -> None:
    grid = Grid(nx=30, ny=20)
    rng = np.random.default_rng(1)
    x0, y0 = rng.integers(0, 30, 50), rng.integers(0, 20, 50)
    rects = np.stack([x0, y0, np.minimum(x0 + rng.integers(0, 5, 50), 29),
                      np.minimum(y0 + rng.integers(0, 5, 50), 19)], 1)
    c = CoverCount(grid)
    c.add(rects)
    c.add(rects[:10], -1)
    want = np.zeros((20, 30), dtype=np.int64)
    for r in rects[10:]:
        want[r[1]:r[3] + 1, r[0]:r[2] + 1] += 1
    assert (c.q == want).all()


def test_executors_fifo_and_percentiles() -> None:
    exe = Executors(2, capacity=10.0)
    exe.queues[0].append([4.0, 8.0, 4.0])  # 12 units: 10 done, 2 left
    exe.queues[1].append([0.0, 0.0, 3.0])
    exe.queues[1].append([2.0, 4.0, 2.0])
    objs, useful, overhead = exe.serve()
    assert objs == pytest.approx(4 * 10 / 12 + 2)
    assert useful + overhead == pytest.approx(10 + 9)
    assert exe.backlog.tolist() == pytest.approx([2.0, 0.0])
    v = np.array([1.0, 2.0, 3.0, 4.0])
    assert weighted_percentile(v, np.array([1.0, 1, 1, 97]), 0.5) == 4.0
    assert weighted_percentile(v, np.ones(4), 0.5) == 2.0


def test_seeded_statistics_equal_the_incremental_ones() -> None:
    """A partition created by a split or move is seeded from the window and the live
    subscriptions; its N, Q and spanQ must be what it would have counted all along."""
    wl = _workload("fig14")
    cfg = SimConfig(workers=4, beta=1000)
    sim = Simulation("swarm", wl, cfg, base_capacity(wl, cfg))
    # Never rebalance: every partition is counted incrementally from the start.
    sim.pointer.step = lambda r_s: Decision.NOTHING  # type: ignore[method-assign]
    res = ModeResult("swarm")
    for r in range(10):
        sim.step(r, res)
    assert sim.plan.version == 1
    for st in sim.ledger.stats.values():
        seeded = sim.ledger.seeded(st.partition)
        for axis in ("x", "y"):
            a, b = st.axis(axis), seeded.axis(axis)
            assert np.allclose(a.N, b.N)
            assert (a.Q == b.Q).all() and (a.spanQ == b.spanQ).all()


def test_simulation_outputs_are_consistent(tmp_path: Path) -> None:
    cfg = SimConfig(workers=6)
    out = simulate("fig14", cfg=cfg, out_dir=tmp_path, quiet=True, **TINY)
    assert Path(out["png"]).stat().st_size > 10_000
    saved = json.loads((tmp_path / "swarm-sim-fig14.json").read_text())
    assert set(saved["modes"]) == {"swarm", "uniform", "history", "replicated"}
    wl = _workload("fig14")
    for mode, rounds in out["timeline"].items():
        offered = sum(r["offered"] for r in rounds)
        injected = sum(r["injected"] for r in rounds)
        processed = sum(r["processed_objects"] for r in rounds)
        assert offered == TINY["rounds"] * TINY["objects_per_round"]
        assert processed <= injected + 1e-6 <= offered + 1e-6
        assert all(r["p99_s"] >= r["p50_s"] >= 0 for r in rounds), mode
        assert all(r["max_backlog_s"] <= cfg.max_backlog_s + 1e-6 + 15.0 for r in rounds)
        # Units processed never exceed the units of the objects offered.
        cover = CoverCount(wl.grid)
        units_offered = 0.0
        for r in range(wl.rounds):
            cover.add(wl.rects[np.flatnonzero(wl.sub_end == r)], -1)
            cover.add(wl.rects[np.flatnonzero(wl.sub_start == r)])
            cx, cy = wl.cells(r)
            units_offered += float(cover.q[cy, cx].sum())
        assert sum(r["units"] for r in rounds) <= units_offered + 1e-6
    s = out["modes"]
    assert s["uniform"]["plan_changes"] == s["history"]["plan_changes"] == 0
    assert s["swarm"]["plan_changes"] > 0
    # No claim that SWARM wins at these toy sizes: on an 80 x 80 grid one city cell holds
    # most of the work, which no partitioning can spread (the full-size runs are reported).
    assert set(out["ratios"]) == {"uniform", "history", "replicated"}


def test_command_line(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    main(["--simulate", "--scenario", "fig12", "--modes", "swarm,uniform", "--workers", "4",
          "--grid", "60", "--rounds", "12", "--objects-per-round", "1000", "--subs", "1000",
          "--hot-subs", "200", "--history-objects", "500", "--out", str(tmp_path)])
    text = capsys.readouterr().out
    assert "SWARM / uniform" in text
    assert (tmp_path / "swarm-sim-fig12.png").exists()


def test_real_mode_report_and_history_sample(tmp_path: Path,
                                             capsys: pytest.CaptureFixture[str]) -> None:
    """The real mode's reporting on synthetic deliveries (no cluster here: the e2e run is
    `geoswarm bench swarm`), and the history sample file the `history` mode is started with."""
    wl = _workload("fig14")
    sample = tmp_path / "sample.ndjson"
    write_history_sample(sample, wl)
    cx, cy, rects = read_history_sample(sample, wl.grid)
    assert cx.size == TINY["history_objects"] and rects.shape[0] == wl.sample_subs.size
    history_plan(wl.grid, ["w0", "w1"], cx, cy, rects).validate()
    cfg = RealConfig(rounds=wl.rounds, round_s=wl.round_s, drain_s=10.0)
    timelines = {}
    rng = np.random.default_rng(0)
    for mode, lat in (("swarm", 0.05), ("uniform", 0.5)):
        tl = RealTimeline(mode, t0=1000.0)
        n = 2000
        tl.arrivals = (1000.0 + rng.uniform(0, wl.rounds * wl.round_s, n)).tolist()
        tl.latency = rng.exponential(lat, n).tolist()
        tl.units = rng.integers(0, 20, n).astype(float).tolist()
        tl.published = n
        tl.rounds = [{"round": 0, "status": 202, "action": "split"}]
        timelines[mode] = tl
    out = report_real(wl, cfg, timelines, tmp_path, tmp_path)
    assert Path(out["png"]).exists()
    assert out["modes"]["swarm"]["rounds"] == {"split": 1}
    assert out["ratios"]["uniform"]["latency_p99_hot"] > 3
    assert 0.8 < out["ratios"]["uniform"]["units_hot"] < 1.25
    assert "SWARM / uniform" in capsys.readouterr().out


@pytest.mark.slow  # starts `geoswarm bench` processes
def test_cli_passes_help_to_the_benchmark() -> None:
    import subprocess
    import sys

    from bench.cluster import ROOT

    def run(*args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run([sys.executable, "-m", "app.cli", "bench", *args], cwd=ROOT,
                              capture_output=True, text=True, timeout=120)

    r = run("swarm", "--help")
    assert r.returncode == 0 and "--simulate" in r.stdout, r.stdout + r.stderr
    r = run("--help")
    assert r.returncode == 0 and "matcher | pipeline | geofence | swarm" in r.stdout
    assert run("nosuch").returncode == 2
