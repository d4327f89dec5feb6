"""SWARM §6.2 reproduced: how SWARM and the paper's three baselines — static uniform grid, static
grid computed from a history sample with the cost model, replicated — live through hotspots.

Scenarios (SWARM Figures 12, 14, 16; positions over the contiguous US, as the paper's tweets):
- fig12: up to 40 % of the data stream redirected into a square of 15 % of the space side
  around Los Angeles (the paper's "lower-left corner of the US"), intensity rising and falling
  as a normal curve;
- fig14: the same hotspot as a step (full intensity at once);
- fig16: two consecutive hotspots of up to 20 % each, Los Angeles then Boston ("upper-right").
Outside the hotspots objects lie around US cities weighted by population (the "normal Twitter
dataset"); range subscriptions of side 0.16 % of the space side are centred on such positions
(§6: "the focal points of the queries are determined using the locations of the real tweets")
and pre-loaded; each hotspot's own subscriptions are created during its first minute and
deleted when it ends.

Two ways to run it (`geoswarm bench swarm --help`):
- `--simulate`: the real routing (`GlobalIndex`), statistics (`PartitionStats`), cost model,
  `DecisionPointer`, `reduce_workload` / `apply_reduction` / `apply_merges` and
  `history_plan`, driving a model of N executors (default 22, as the paper) of fixed capacity
  in units of work per second. A unit is one (subscription, object) candidate check: an object
  costs the number of subscriptions whose cell range covers its cell (plus `object_cost`), a
  subscription insertion `insert_cost` on every worker that must hold it (all of them when
  replicated; mL again when SWARM moves a partition to it). Work beyond capacity queues as a
  backlog; latency = backlog / capacity. As in the paper's Storm topology the source is faster
  than the executors (`--load`) and is throttled by back-pressure when an executor's backlog
  passes `--max-backlog-s` (`inf`: no back-pressure, the backlog just grows).
- default: the same phases pushed through a real cluster (embedded Redis, api, 2 workers, a
  coordinator), one partitioning mode after another, measuring units of work per second and
  end-to-end latency through WebSocket delivery.
Both print a table and write a timeline PNG like the paper's figures.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from bench.swarm.model import (
    CoverCount,
    Executors,
    ModeResult,
    RoundStats,
    SimConfig,
    Simulation,
    base_capacity,
    simulate,
)
from bench.swarm.real import RealConfig, RealTimeline, run_real, write_history_sample
from bench.swarm.report import real_series, report_real, summarise, weighted_percentile
from bench.swarm.workload import MODES, SCENARIOS, US_BOUNDS, Hotspot, Workload, make_workload

__all__ = ["MODES", "SCENARIOS", "US_BOUNDS", "CoverCount", "Executors", "Hotspot", "ModeResult",
           "RealConfig", "RealTimeline", "RoundStats", "SimConfig", "Simulation", "Workload",
           "base_capacity", "main", "make_workload", "real_series", "report_real", "run_real",
           "simulate", "summarise", "weighted_percentile", "write_history_sample"]


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(prog="geoswarm bench swarm", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--simulate", action="store_true", help="the executor model instead of a "
                    "real cluster")
    ap.add_argument("--scenario", choices=[*SCENARIOS, "all"], default="all")
    ap.add_argument("--modes", default=",".join(MODES), help="comma-separated, of "
                    + ", ".join(MODES))
    ap.add_argument("--out", type=Path, default=Path("bench-results"),
                    help="directory for the PNG and JSON files")
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--workers", type=int, default=None, help="executors (22 simulated, 2 "
                    "real)")
    ap.add_argument("--grid", type=int, default=1000, help="C1 = C2 cells of the grid")
    ap.add_argument("--rounds", type=int, default=None, help="rounds (80 simulated, 24 real)")
    ap.add_argument("--round-s", type=float, default=None, help="balancing period (15 s "
                    "simulated as the paper, 5 s real)")
    sim = ap.add_argument_group("simulation (--simulate)")
    sim.add_argument("--objects-per-round", type=int, default=100_000)
    sim.add_argument("--subs", type=int, default=None, help="pre-loaded subscriptions "
                     "(200000 simulated, 10000 real)")
    sim.add_argument("--hot-subs", type=int, default=None, help="subscriptions of each "
                     "hotspot (20000 simulated, 2000 real)")
    sim.add_argument("--history-objects", type=int, default=None)
    sim.add_argument("--load", type=float, default=1.5, help="offered work / capacity")
    sim.add_argument("--max-backlog-s", type=float, default=2.0, help="back-pressure bound "
                     "(inf: none)")
    sim.add_argument("--object-cost", type=float, default=100.0)
    sim.add_argument("--insert-cost", type=float, default=50.0)
    sim.add_argument("--work", choices=["cell", "partition"], default="cell")
    sim.add_argument("--beta", type=int, default=20)
    real = ap.add_argument_group("real cluster (default)")
    real.add_argument("--rate", type=float, default=4000.0, help="objects per second")
    real.add_argument("--batch", type=int, default=500, help="objects per publish request")
    real.add_argument("--drain-s", type=float, default=60.0)
    a = ap.parse_args(argv)
    modes = [m.strip() for m in a.modes.split(",") if m.strip()]
    bad = [m for m in modes if m not in MODES]
    if bad:
        ap.error(f"unknown modes {bad}")
    scenarios = list(SCENARIOS) if a.scenario == "all" else [a.scenario]
    a.out.mkdir(parents=True, exist_ok=True)
    for sc in scenarios:
        if a.simulate:
            cfg = SimConfig(workers=a.workers or 22, load=a.load, max_backlog_s=a.max_backlog_s,
                            object_cost=a.object_cost, insert_cost=a.insert_cost,
                            beta=a.beta, work=a.work)
            simulate(sc, modes=modes, cfg=cfg, grid=a.grid, rounds=a.rounds or 80,
                     round_s=a.round_s or 15.0, objects_per_round=a.objects_per_round,
                     subs=a.subs or 200_000, hot_subs=a.hot_subs or 20_000,
                     history_objects=a.history_objects or 40_000, seed=a.seed, out_dir=a.out)
        else:
            rc = RealConfig(workers=a.workers or 2, grid=a.grid, rounds=a.rounds or 24,
                            round_s=a.round_s or 5.0, rate=a.rate, subs=a.subs or 10_000,
                            hot_subs=a.hot_subs or 2000,
                            history_objects=a.history_objects or 20_000, batch=a.batch,
                            seed=a.seed, drain_s=a.drain_s)
            run_real(sc, modes, rc, a.out)


if __name__ == "__main__":
    main()
