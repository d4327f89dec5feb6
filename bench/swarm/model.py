"""The simulation of `geoswarm bench swarm --simulate`: N executors of fixed capacity driven
round by round by the real routing, the executors' SWARM ledger, the decision pointer and the
reduction/merge code, with a fluid queue for backlog and latency."""

from __future__ import annotations

import itertools
import json
import math
import time
from collections import deque
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Literal

import numpy as np
import numpy.typing as npt

from app.geo import balance
from app.geo.balance import Decision, DecisionPointer
from app.geo.grid import Grid
from app.geo.history import history_plan
from app.geo.index import GlobalIndex, Plan, initial_plan
from bench.swarm.report import plot_simulation, print_report, summarise, weighted_percentile
from bench.swarm.workload import MERGE_EVERY, MODES, US_BOUNDS, Mode, Workload, make_workload
from workers.ledger import SwarmLedger, rects_overlapping

F64 = npt.NDArray[np.float64]
I64 = npt.NDArray[np.int64]
I32 = npt.NDArray[np.int32]


class CoverCount:
    """How many live subscriptions' cell ranges cover each cell: a 2-D difference array."""

    def __init__(self, grid: Grid) -> None:
        self.diff = np.zeros((grid.ny + 1, grid.nx + 1), dtype=np.int64)
        self._q: I64 | None = None

    def add(self, rects: I64, sign: int = 1) -> None:
        if not rects.size:
            return
        x0, y0, x1, y1 = rects[:, 0], rects[:, 1], rects[:, 2] + 1, rects[:, 3] + 1
        for ys, xs, s in ((y0, x0, 1), (y0, x1, -1), (y1, x0, -1), (y1, x1, 1)):
            np.add.at(self.diff, (ys, xs), sign * s)
        self._q = None

    @property
    def q(self) -> I64:
        if self._q is None:
            self._q = self.diff.cumsum(0).cumsum(1)[:-1, :-1]
        return self._q


# -- the executor model ------------------------------------------------------------------------


@dataclass
class SimConfig:
    workers: int = 22
    load: float = 1.5
    """Offered work / aggregate capacity, for the pre-hotspot workload perfectly balanced."""
    max_backlog_s: float = 2.0
    object_cost: float = 100.0
    insert_cost: float = 50.0
    beta: int = 20
    latency_points: int = 8
    work: Literal["cell", "partition"] = "cell"
    """What an object costs: "cell" = the subscriptions whose range covers its cell (a local
    grid index, as geoswarm's matcher); "partition" = every subscription its executor holds
    for its partition (all of them when replicated), the work the cost model N·Q·R assumes."""


@dataclass
class RoundStats:
    offered: int = 0
    injected: int = 0
    processed_objects: float = 0.0
    units: float = 0.0  # useful units (candidate checks) processed
    overhead: float = 0.0  # object and insertion units processed
    inserts: int = 0  # subscription copies inserted (new subscriptions and migration)
    p50_s: float = 0.0
    p99_s: float = 0.0
    max_backlog_s: float = 0.0
    queries: int = 0
    partitions: int = 0
    r_s: float = 0.0
    decision: str = ""
    action: str = ""
    load_max_share: float = 0.0  # share of this round's work on the most loaded worker


@dataclass
class ModeResult:
    mode: str
    rounds: list[RoundStats] = field(default_factory=list)
    lat_values: list[F64] = field(default_factory=list)  # per round, latency samples (s)
    lat_weights: list[F64] = field(default_factory=list)
    seconds: float = 0.0
    final_plan: Plan | None = None


class Executors:
    """N executors: FIFO queues of work chunks [objects, useful units, overhead units] served
    at `capacity` units per round."""

    def __init__(self, n: int, capacity: float) -> None:
        self.capacity = capacity
        self.queues: list[deque[list[float]]] = [deque() for _ in range(n)]
        self.backlog = np.zeros(n)

    def serve(self) -> tuple[float, float, float]:
        """One round of service on every executor: (objects, useful, overhead) processed."""
        done = [0.0, 0.0, 0.0]
        for w, q in enumerate(self.queues):
            left = self.capacity
            while q and left > 1e-9:
                ch = q[0]
                tot = ch[1] + ch[2]
                if tot <= left:
                    left -= tot
                    for i in range(3):
                        done[i] += ch[i]
                    q.popleft()
                else:
                    frac = left / tot
                    for i in range(3):
                        done[i] += ch[i] * frac
                        ch[i] *= 1 - frac
                    left = 0.0
            self.backlog[w] = sum(c[1] + c[2] for c in q)
        return done[0], done[1], done[2]


class Simulation:
    """One partitioning mode through a workload, round by round (a round = one SWARM
    load-balancing period, §4.3.1's 15 s)."""

    def __init__(self, mode: Mode, wl: Workload, cfg: SimConfig, capacity: float) -> None:
        self.mode, self.wl, self.cfg = mode, wl, cfg
        self.workers = [f"w{i}" for i in range(cfg.workers)]
        self.widx = {w: i for i, w in enumerate(self.workers)}
        if mode == "history":
            cx, cy, rects = wl.sample_cells()
            plan = history_plan(wl.grid, self.workers, cx, cy, rects)
        else:
            plan = initial_plan(wl.grid, self.workers)
        self.plan = plan
        self.index = GlobalIndex(plan)
        self.exe = Executors(cfg.workers, capacity)
        self.cover = CoverCount(wl.grid)
        n_subs = wl.rects.shape[0]
        self.live = np.zeros(n_subs, dtype=bool)
        self.held = np.zeros((n_subs, cfg.workers), dtype=bool)
        self.pending = np.zeros(cfg.workers)  # insertion work queued at the next round start
        self.pending_inserts = 0
        self.rr = 0  # replicated: round-robin position
        # SWARM's executor side (the executors' own ledger, for every partition) and
        # coordinator side.
        self.ledger = SwarmLedger(wl.grid)
        self.pointer = DecisionPointer(beta=cfg.beta)
        self.ids = (f"p{i}" for i in itertools.count(cfg.workers))
        self.quiet = 0
        if mode == "swarm":
            self._sync_stats()

    # --- routing ---------------------------------------------------------------------------
    def _workers_of_cells(self, cx: I64, cy: I64) -> I64:
        return self.index.part_worker[self.index.cell_part[cy, cx]].astype(np.int64)

    def _units(self, cx: I64, cy: I64) -> F64:
        """Candidate checks of each object (see `SimConfig.work`)."""
        if self.cfg.work == "cell":
            return self.cover.q[cy, cx].astype(np.float64)
        if self.mode == "replicated":
            return np.full(cx.size, float(self.live.sum()))
        live = self.wl.rects[self.live]
        per_part = np.array([rects_overlapping(live, p.x0, p.y0, p.x1, p.y1).sum()
                             for p in self.plan.partitions], dtype=np.float64)
        return per_part[self.index.cell_part[cy, cx]]

    # --- SWARM statistics (as the executor: §4.2) ------------------------------------------
    def _sync_stats(self) -> None:
        """Stats for exactly the plan's partitions; new ones seeded with the window's objects
        and the live subscriptions, as the executors do."""
        self.ledger.sync(self.index, self.plan.partitions)

    def _stats_subs_added(self, sids: I64) -> None:
        self.ledger.add_queries([str(s) for s in sids.tolist()], self.wl.rects[sids])

    def _stats_subs_removed(self, sids: I64) -> None:
        for sid in sids.tolist():
            self.ledger.remove_query(str(sid))

    def _stats_objects(self, cx: I64, cy: I64) -> None:
        self.ledger.add_objects(cx, cy, bucket=self.ledger.folds)

    # --- SWARM's round (coordinator + executors, §4.3) -------------------------------------
    def _balance_round(self, rs: RoundStats) -> None:
        nums = dict.fromkeys(self.workers, 0.0)
        recv = dict.fromkeys(self.workers, 0)
        for st in self.ledger.fold():
            n, q, r = st.totals()
            nums[st.partition.worker] += balance.cost_numerator(n, q, r)
            recv[st.partition.worker] += r
        r_s = float(sum(recv.values()))
        decision = self.pointer.step(r_s)
        rs.r_s, rs.decision, rs.action = r_s, decision.value, "none"
        costs = {w: nums[w] / r_s if r_s > 0 else 0.0 for w in self.workers}
        old = self.plan
        if decision is Decision.REBALANCE and len(self.workers) > 1:
            ml = min(costs, key=lambda w: (costs[w], w))
            for mh in sorted((w for w in costs if w != ml), key=lambda w: (-costs[w], w)):
                if costs[mh] <= costs[ml]:
                    break
                mine = [st for st in self.ledger.stats.values() if st.partition.worker == mh]
                if not mine:
                    continue
                red = balance.reduce_workload(mine, costs[ml], r_s)
                if red is not None:
                    self.plan = balance.apply_reduction(self.plan, red, ml, self.ids)
                    rs.action = "move" if isinstance(red, balance.MoveSubset) else "split"
                    self._migrate(old, mh, ml)
                    break
        if rs.action == "none":
            self.quiet += 1
            if self.quiet % MERGE_EVERY == 0:
                merged = balance.apply_merges(self.plan, self.ids)
                if merged is not self.plan:
                    self.plan = merged
                    rs.action = "merge"
        if self.plan is not old:
            self.index = GlobalIndex(self.plan)
            self._sync_stats()

    def _migrate(self, old: Plan, mh: str, ml: str) -> None:
        """§5.1: mL receives the moved partitions' subscriptions it does not hold yet (each an
        insertion on mL, at the start of the next round); mH keeps only what it still needs."""
        rects = self.wl.rects
        for w in (mh, ml):
            wi = self.widx[w]
            need = np.zeros(self.live.size, dtype=bool)
            for p in self.plan.partitions:
                if p.worker == w:
                    need |= rects_overlapping(rects, p.x0, p.y0, p.x1, p.y1)
            need &= self.live
            if w == ml:
                new = int((need & ~self.held[:, wi]).sum())
                self.pending[wi] += new * self.cfg.insert_cost
                self.pending_inserts += new
            self.held[:, wi] = need

    # --- one round --------------------------------------------------------------------------
    def step(self, r: int, res: ModeResult) -> None:
        wl, cfg, exe = self.wl, self.cfg, self.exe
        n_w = cfg.workers
        rs = RoundStats()
        overhead = self.pending.copy()
        rs.inserts = self.pending_inserts
        self.pending[:] = 0
        self.pending_inserts = 0
        # Subscriptions deleted and created this round.
        gone = np.flatnonzero(self.live & (wl.sub_end == r))
        new = np.flatnonzero(wl.sub_start == r)
        if gone.size:
            self.live[gone] = False
            self.held[gone] = False
            self.cover.add(wl.rects[gone], -1)
            if self.mode == "swarm":
                self._stats_subs_removed(gone)
        if new.size:
            self.live[new] = True
            self.cover.add(wl.rects[new])
            charged = ~wl.preloaded[new]
            if self.mode == "replicated":
                hold = np.ones((new.size, n_w), dtype=bool)
            else:  # the workers whose partitions each one overlaps (as targets_for_spec)
                hold = np.zeros((new.size, n_w), dtype=bool)
                for p in self.plan.partitions:
                    m = rects_overlapping(wl.rects[new], p.x0, p.y0, p.x1, p.y1)
                    hold[m, self.widx[p.worker]] = True
            self.held[new] |= hold
            copies = hold[charged].sum(axis=0)
            overhead += copies * cfg.insert_cost
            rs.inserts += int(copies.sum())
            if self.mode == "swarm":
                self._stats_subs_added(new)
        # Objects: route, cost, throttle (back-pressure), queue.
        cx, cy = wl.cells(r)
        n = cx.size
        useful = self._units(cx, cy)
        if self.mode == "replicated":
            who = (self.rr + np.arange(n, dtype=np.int64)) % n_w
        else:
            who = self._workers_of_cells(cx, cy)
        work = np.bincount(who, weights=useful + cfg.object_cost, minlength=n_w)
        q0 = exe.backlog + overhead
        cap = exe.capacity
        bound = cap * (1 + cfg.max_backlog_s / wl.round_s)
        with np.errstate(divide="ignore", invalid="ignore"):
            room = np.where(work > 0, (bound - q0) / work, np.inf)
        frac = float(np.clip(room.min(), 0.0, 1.0)) if math.isfinite(cfg.max_backlog_s) else 1.0
        k = int(round(frac * n))
        cx, cy, useful, who = cx[:k], cy[:k], useful[:k], who[:k]
        if self.mode == "replicated":
            self.rr += k
        objs = np.bincount(who, minlength=n_w).astype(np.float64)
        use_w = np.bincount(who, weights=useful, minlength=n_w)
        arr = use_w + objs * cfg.object_cost
        # Latency (fluid queue, constant rates within the round): an object arriving at time
        # t of the round waits for the backlog then in front of it.
        pts = cfg.latency_points
        ts = (np.arange(pts) + 0.5) / pts
        wait = np.maximum(q0[:, None] + (arr - cap)[:, None] * ts[None, :], 0.0) / cap
        res.lat_values.append((wait * wl.round_s).ravel())
        # Weighted by the objects that arrived; a round that admitted none reports what one
        # would have waited on each executor.
        res.lat_weights.append(np.repeat(objs / pts if k else np.ones(n_w), pts))
        for w in range(n_w):
            if overhead[w] > 0:
                exe.queues[w].append([0.0, 0.0, float(overhead[w])])
            if objs[w] > 0:
                exe.queues[w].append([float(objs[w]), float(use_w[w]),
                                      float(objs[w] * cfg.object_cost)])
        done_o, done_u, done_x = exe.serve()
        total = arr + overhead
        rs.offered, rs.injected = n, k
        rs.processed_objects, rs.units, rs.overhead = done_o, done_u, done_x
        rs.p50_s = weighted_percentile(res.lat_values[-1], res.lat_weights[-1], 0.50)
        rs.p99_s = weighted_percentile(res.lat_values[-1], res.lat_weights[-1], 0.99)
        rs.max_backlog_s = float(exe.backlog.max() / cap * wl.round_s)
        rs.queries = int(self.live.sum())
        rs.load_max_share = float(total.max() / total.sum()) if total.sum() > 0 else 0.0
        if self.mode == "swarm":
            self._stats_objects(cx, cy)
            self._balance_round(rs)
        rs.partitions = len(self.plan.partitions)
        res.rounds.append(rs)

    def run(self) -> ModeResult:
        res = ModeResult(self.mode)
        t0 = time.perf_counter()
        for r in range(self.wl.rounds):
            self.step(r, res)
        res.seconds = time.perf_counter() - t0
        res.final_plan = self.plan
        return res


def base_capacity(wl: Workload, cfg: SimConfig) -> float:
    """Units per round per executor: the pre-hotspot workload's work (routed by the uniform
    initial plan: it only matters for the "partition" work model), perfectly balanced over the
    executors, is `cfg.load` times their capacity (the source is faster than the system)."""
    probe = Simulation("uniform", wl, cfg, 1.0)
    probe.live[wl.preloaded] = True
    probe.cover.add(wl.rects[wl.preloaded])
    cold = np.flatnonzero(wl.intensity == 0)
    rounds = cold if cold.size else np.arange(wl.rounds)
    works = []
    for r in rounds.tolist():
        cx, cy = wl.cells(r)
        works.append(float(probe._units(cx, cy).sum()) + cx.size * cfg.object_cost)
    return float(np.mean(works)) / cfg.workers / cfg.load


# -- reporting ---------------------------------------------------------------------------------


def simulate(scenario: str, *, modes: Sequence[str] = MODES, cfg: SimConfig | None = None,
             grid: int = 200, rounds: int = 80, round_s: float = 15.0,
             objects_per_round: int = 100_000, subs: int = 200_000, hot_subs: int = 20_000,
             history_objects: int = 40_000, seed: int = 1, out_dir: Path | None = None,
             quiet: bool = False) -> dict[str, Any]:
    """Run every mode through one scenario; returns the summary (and writes PNG + JSON)."""
    cfg = cfg or SimConfig()
    wl = make_workload(scenario, rounds=rounds, round_s=round_s,
                       objects_per_round=objects_per_round, subs=subs, hot_subs=hot_subs,
                       grid=Grid(bounds=US_BOUNDS, nx=grid, ny=grid),
                       history_objects=history_objects, seed=seed)
    cap = base_capacity(wl, cfg)
    results = {m: Simulation(m, wl, cfg, cap).run() for m in modes}  # type: ignore[arg-type]
    summary = summarise(wl, results)
    summary["config"] = {**asdict(cfg), "grid": grid, "rounds": rounds, "round_s": round_s,
                         "objects_per_round": objects_per_round, "subs": subs,
                         "hot_subs": hot_subs, "history_objects": history_objects,
                         "seed": seed, "capacity_units_per_s": cap / round_s}
    summary["timeline"] = {m: [asdict(r) for r in res.rounds] for m, res in results.items()}
    if not quiet:
        print_report(wl, results, summary)
    if out_dir is not None:
        png = out_dir / f"swarm-sim-{scenario}.png"
        plot_simulation(png, wl, results, cfg)
        (out_dir / f"swarm-sim-{scenario}.json").write_text(json.dumps(summary, indent=1))
        summary["png"] = str(png)
        if not quiet:
            print(f"wrote {png} and {png.with_suffix('.json')}")
    return summary
