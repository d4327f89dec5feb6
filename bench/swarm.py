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
import itertools
import json
import math
import shutil
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
from bench.workload import city_location, city_points
from workers.ledger import SwarmLedger

F64 = npt.NDArray[np.float64]
I64 = npt.NDArray[np.int64]
I32 = npt.NDArray[np.int32]

US_BOUNDS = (-125.0, 24.0, -66.0, 50.0)
"""The contiguous US (the paper's 1 billion tweets are US tweets)."""
QUERY_SIDE = 0.0016  # §6: query side = 0.16 % of the space side
HOT_SIDE = 0.15  # §6.2: hotspot square of side 15 % of the space side
HOT_SUBS_S = 60.0  # §6.2: a hotspot's queries are all created during its first minute
MERGE_EVERY = 4  # as app.coordinator: merge every 4th round in which nothing moved
MODES = ("swarm", "uniform", "history", "replicated")
Mode = Literal["swarm", "uniform", "history", "replicated"]


@dataclass(frozen=True)
class Hotspot:
    """A region that receives `peak` of the data stream at its height (§6.2)."""

    city: str
    start: float  # fraction of the run
    end: float
    peak: float
    shape: Literal["normal", "step"]

    def intensity(self, t: float) -> float:
        """Fraction of the data stream redirected here at time t (fraction of the run)."""
        if not self.start <= t < self.end:
            return 0.0
        if self.shape == "step":
            return self.peak
        mid, sigma = (self.start + self.end) / 2, (self.end - self.start) / 6
        return self.peak * math.exp(-0.5 * ((t - mid) / sigma) ** 2)


SCENARIOS: dict[str, tuple[Hotspot, ...]] = {
    "fig12": (Hotspot("Los Angeles", 0.25, 0.75, 0.40, "normal"),),
    "fig14": (Hotspot("Los Angeles", 0.25, 0.75, 0.40, "step"),),
    "fig16": (Hotspot("Los Angeles", 0.15, 0.50, 0.20, "normal"),
              Hotspot("Boston", 0.50, 0.85, 0.20, "normal")),
}


# -- the workload ------------------------------------------------------------------------------


@dataclass
class Workload:
    """Every round's offered objects and the subscriptions' lives, shared by all modes."""

    scenario: str
    grid: Grid
    round_s: float
    hotspots: tuple[Hotspot, ...]
    squares: list[tuple[float, float, float, float]]  # each hotspot's region (degrees)
    lon: list[F64]  # offered objects of each round, in random order
    lat: list[F64]
    boxes: F64  # (n, 4) subscription bboxes, degrees
    rects: I64  # (n, 4) the same as inclusive cell rectangles
    sub_start: I64  # round each subscription is created in
    sub_end: I64  # round it is deleted in (`rounds` = never)
    preloaded: npt.NDArray[np.bool_]  # pre-loaded before the run (no insertion is charged)
    intensity: F64  # per round: fraction of the stream redirected into hotspots
    sample_lon: F64  # the history sample (pre-hotspot workload) for the `history` plan
    sample_lat: F64
    sample_subs: I64  # indices of the sample's subscriptions

    @property
    def rounds(self) -> int:
        return len(self.lon)

    def hot_rounds(self) -> npt.NDArray[np.bool_]:
        out = np.zeros(self.rounds, dtype=bool)
        for a, b in self.hotspot_rounds():
            out[a:b] = True
        return out

    def hotspot_rounds(self) -> list[tuple[int, int]]:
        return [(round(h.start * self.rounds), round(h.end * self.rounds)) for h in self.hotspots]

    def cells(self, r: int) -> tuple[I64, I64]:
        cx, cy = self.grid.cells_of(self.lon[r], self.lat[r])
        return cx.astype(np.int64), cy.astype(np.int64)

    def sample_cells(self) -> tuple[I64, I64, I64]:
        cx, cy = self.grid.cells_of(self.sample_lon, self.sample_lat)
        return cx.astype(np.int64), cy.astype(np.int64), self.rects[self.sample_subs]


def _square(center: tuple[float, float], bounds: Sequence[float]) -> tuple[
        float, float, float, float]:
    """The hotspot square: side HOT_SIDE of the space side, centred on the city, kept inside."""
    w, h = (bounds[2] - bounds[0]) * HOT_SIDE, (bounds[3] - bounds[1]) * HOT_SIDE
    x0 = min(max(center[0] - w / 2, bounds[0]), bounds[2] - w)
    y0 = min(max(center[1] - h / 2, bounds[1]), bounds[3] - h)
    return x0, y0, x0 + w, y0 + h


def _boxes(lon: F64, lat: F64, bounds: Sequence[float]) -> F64:
    hw = (bounds[2] - bounds[0]) * QUERY_SIDE / 2
    hh = (bounds[3] - bounds[1]) * QUERY_SIDE / 2
    return np.stack([np.maximum(lon - hw, bounds[0]), np.maximum(lat - hh, bounds[1]),
                     np.minimum(lon + hw, bounds[2]), np.minimum(lat + hh, bounds[3])], axis=1)


def make_workload(scenario: str, *, rounds: int, round_s: float, objects_per_round: int,
                  subs: int, hot_subs: int, grid: Grid, history_objects: int,
                  seed: int, jitter_km: float = 10.0, hot_subs_s: float = HOT_SUBS_S
                  ) -> Workload:
    """Generate a scenario: per round the offered objects; the subscriptions with the round
    they are created in and deleted in; a history sample taken before any hotspot (the paper
    partitions its history grid from 400K points and 200K queries of the normal dataset: the
    same 2:1 ratio here)."""
    rng = np.random.default_rng(seed)
    bounds = grid.bounds
    hotspots = SCENARIOS[scenario]
    squares = [_square(city_location(h.city, "US"), bounds) for h in hotspots]
    lon_r: list[F64] = []
    lat_r: list[F64] = []
    intensity = np.zeros(rounds)
    for r in range(rounds):
        t = (r + 0.5) / rounds
        lon, lat = city_points(objects_per_round, rng, "US", bounds, jitter_km)
        u = rng.random(objects_per_round)
        acc = 0.0
        for h, sq in zip(hotspots, squares, strict=True):
            f = h.intensity(t)
            sel = (u >= acc) & (u < acc + f)
            k = int(sel.sum())
            lon[sel] = rng.uniform(sq[0], sq[2], k)
            lat[sel] = rng.uniform(sq[1], sq[3], k)
            acc += f
        intensity[r] = acc
        lon_r.append(lon)
        lat_r.append(lat)
    # Subscriptions: pre-loaded (focal points where the objects are), then each hotspot's.
    flon, flat = city_points(subs, rng, "US", bounds, jitter_km)
    boxes = [_boxes(flon, flat, bounds)]
    start = [np.zeros(subs, dtype=np.int64)]
    end = [np.full(subs, rounds, dtype=np.int64)]
    pre = [np.ones(subs, dtype=bool)]
    minute = max(1, round(hot_subs_s / round_s))
    for h, sq in zip(hotspots, squares, strict=True):
        a, b = round(h.start * rounds), round(h.end * rounds)
        hl, ht = rng.uniform(sq[0], sq[2], hot_subs), rng.uniform(sq[1], sq[3], hot_subs)
        boxes.append(_boxes(hl, ht, bounds))
        start.append(np.minimum(a + rng.integers(0, minute, hot_subs), rounds - 1))
        end.append(np.full(hot_subs, b, dtype=np.int64))
        pre.append(np.zeros(hot_subs, dtype=bool))
    box = np.concatenate(boxes)
    slon, slat = city_points(history_objects, rng, "US", bounds, jitter_km)
    sample_subs = rng.choice(subs, size=min(subs, history_objects // 2), replace=False)
    return Workload(
        scenario=scenario, grid=grid, round_s=round_s, hotspots=hotspots, squares=squares,
        lon=lon_r, lat=lat_r, boxes=box, rects=grid.cell_ranges(box).astype(np.int64),
        sub_start=np.concatenate(start), sub_end=np.concatenate(end),
        preloaded=np.concatenate(pre), intensity=intensity, sample_lon=slon, sample_lat=slat,
        sample_subs=np.sort(sample_subs))


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


def _overlaps(rects: I64, x0: int, y0: int, x1: int, y1: int) -> npt.NDArray[np.bool_]:
    return (rects[:, 0] <= x1) & (rects[:, 2] >= x0) & (rects[:, 1] <= y1) & (rects[:, 3] >= y0)


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


def weighted_percentile(values: F64, weights: F64, p: float) -> float:
    if values.size == 0 or weights.sum() <= 0:
        return float("nan")
    order = np.argsort(values, kind="stable")
    cw = np.cumsum(weights[order])
    i = int(np.searchsorted(cw, p * cw[-1], side="left"))
    return float(values[order][min(i, values.size - 1)])


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
        per_part = np.array([_overlaps(live, p.x0, p.y0, p.x1, p.y1).sum()
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
                    need |= _overlaps(rects, p.x0, p.y0, p.x1, p.y1)
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
                    m = _overlaps(wl.rects[new], p.x0, p.y0, p.x1, p.y1)
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


def summarise(wl: Workload, results: dict[str, ModeResult]) -> dict[str, Any]:
    """Per mode: units/s and objects/s overall and during the hotspots, latency percentiles;
    SWARM / baseline ratios."""
    hot = wl.hot_rounds()
    out: dict[str, Any] = {"scenario": wl.scenario, "rounds": wl.rounds,
                           "round_s": wl.round_s, "hot_rounds": int(hot.sum()), "modes": {}}
    for mode, res in results.items():
        units = np.array([r.units for r in res.rounds]) / wl.round_s
        objs = np.array([r.processed_objects for r in res.rounds]) / wl.round_s
        # §6.1's Units of Work: queries in the system x tuples processed per second (the
        # same per object in every mode, unlike the candidate checks of the "partition" model)
        paper = objs * np.array([r.queries for r in res.rounds])
        vals = np.concatenate(res.lat_values)
        wts = np.concatenate(res.lat_weights)
        hv = np.concatenate([v for v, h in zip(res.lat_values, hot, strict=True) if h] or
                            [np.empty(0)])
        hw = np.concatenate([v for v, h in zip(res.lat_weights, hot, strict=True) if h] or
                            [np.empty(0)])
        offered = sum(r.offered for r in res.rounds)
        out["modes"][mode] = {
            "units_per_s": float(units.mean()),
            "units_per_s_hot": float(units[hot].mean()) if hot.any() else float("nan"),
            "units_per_s_cold": float(units[~hot].mean()) if (~hot).any() else float("nan"),
            "paper_units_per_s": float(paper.mean()),
            "paper_units_per_s_hot": float(paper[hot].mean()) if hot.any() else float("nan"),
            "objects_per_s": float(objs.mean()),
            "objects_per_s_hot": float(objs[hot].mean()) if hot.any() else float("nan"),
            "latency_p50_s": weighted_percentile(vals, wts, 0.5),
            "latency_p99_s": weighted_percentile(vals, wts, 0.99),
            "latency_p50_s_hot": weighted_percentile(hv, hw, 0.5),
            "latency_p99_s_hot": weighted_percentile(hv, hw, 0.99),
            "injected_fraction": sum(r.injected for r in res.rounds) / max(offered, 1),
            "inserts": int(sum(r.inserts for r in res.rounds)),
            "plan_changes": sum(r.action in ("move", "split", "merge") for r in res.rounds),
            "partitions": res.rounds[-1].partitions if res.rounds else 0,
            "max_share_hot": float(np.mean([r.load_max_share for r, h in
                                            zip(res.rounds, hot, strict=True) if h] or [0])),
            "sim_seconds": round(res.seconds, 2),
        }
    if "swarm" in results:
        s = out["modes"]["swarm"]
        out["ratios"] = {m: {"units_hot": s["units_per_s_hot"] / v["units_per_s_hot"],
                             "units_all": s["units_per_s"] / v["units_per_s"],
                             "paper_units_hot": s["paper_units_per_s_hot"]
                             / v["paper_units_per_s_hot"],
                             "paper_units_all": s["paper_units_per_s"] / v["paper_units_per_s"],
                             "latency_p99_hot": v["latency_p99_s_hot"] / s["latency_p99_s_hot"]
                             if s["latency_p99_s_hot"] > 0 else float("inf")}
                         for m, v in out["modes"].items() if m != "swarm" and
                         v["units_per_s_hot"] > 0}
    return out


def _fmt(v: float) -> str:
    if not math.isfinite(v):
        return str(v)
    a = abs(v)
    if a >= 1e6:
        return f"{v / 1e6:.2f}M"
    if a >= 1e4:
        return f"{v / 1e3:.1f}k"
    if a >= 100:
        return f"{v:.0f}"
    return f"{v:.3g}"


def print_report(wl: Workload, results: dict[str, ModeResult], summary: dict[str, Any],
                 every: int = 4) -> None:
    modes = list(results)
    print(f"\n== {wl.scenario}: {wl.rounds} rounds of {wl.round_s:g} s, hotspots "
          + ", ".join(f"{h.city} {h.shape} up to {h.peak:.0%} (rounds {a}-{b - 1})"
                      for h, (a, b) in zip(wl.hotspots, wl.hotspot_rounds(), strict=True)))
    head = f"{'min':>5} {'hot':>4} {'queries':>8} " + " ".join(
        f"{m + ' u/s':>14} {'p99 s':>7}" for m in modes)
    print(head)
    for a in range(0, wl.rounds, every):
        b = min(a + every, wl.rounds)
        row = f"{a * wl.round_s / 60:5.1f} {wl.intensity[a:b].mean():4.0%} " \
              f"{results[modes[0]].rounds[b - 1].queries:8d} "
        cells = []
        for m in modes:
            rr = results[m].rounds[a:b]
            u = float(np.mean([r.units for r in rr])) / wl.round_s
            p = max(r.p99_s for r in rr)
            cells.append(f"{_fmt(u):>14} {p:7.2f}")
        print(row + " ".join(cells))
    print(f"\n{'mode':<11} {'units/s':>9} {'hot u/s':>9} {'cold u/s':>9} {'obj/s':>8} "
          f"{'p50 s':>6} {'p99 s':>6} {'hot p99':>7} {'inj':>5} {'inserts':>8} "
          f"{'changes':>7} {'parts':>5} {'hot max share':>13}")
    for m, v in summary["modes"].items():
        print(f"{m:<11} {_fmt(v['units_per_s']):>9} {_fmt(v['units_per_s_hot']):>9} "
              f"{_fmt(v['units_per_s_cold']):>9} {_fmt(v['objects_per_s']):>8} "
              f"{v['latency_p50_s']:6.2f} {v['latency_p99_s']:6.2f} "
              f"{v['latency_p99_s_hot']:7.2f} {v['injected_fraction']:5.0%} "
              f"{_fmt(v['inserts']):>8} {v['plan_changes']:7d} {v['partitions']:5d} "
              f"{v['max_share_hot']:13.1%}")
    for m, r in summary.get("ratios", {}).items():
        print(f"SWARM / {m:<10}: during hotspots units/s x{r['units_hot']:.2f}, paper units "
              f"(queries x objects/s) x{r['paper_units_hot']:.2f}; over the run "
              f"x{r['units_all']:.2f}, x{r['paper_units_all']:.2f}; hotspot p99 latency / "
              f"SWARM's x{r['latency_p99_hot']:.3g}")


COLORS = {"swarm": "tab:red", "uniform": "tab:blue", "history": "tab:green",
          "replicated": "tab:purple"}


def plot_timeline(path: Path, title: str, minutes: F64, intensity: F64, queries: F64,
                  units: dict[str, F64], p50: dict[str, F64], p99: dict[str, F64],
                  ylabel: str = "units of work per second") -> None:
    """The paper's figure layout: units of work over time per approach, the hotspot's data
    intensity shaded, the number of queries dashed; below, latency percentiles."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax, bx) = plt.subplots(2, 1, figsize=(10, 7), sharex=True,
                                 gridspec_kw={"height_ratios": [3, 2]})
    top = max((float(np.nanmax(u)) for u in units.values() if u.size), default=1.0) or 1.0
    ax.fill_between(minutes, 0, intensity / max(float(intensity.max()), 1e-9) * top * 0.9,
                    color="0.85", step="mid", label="hotspot data intensity")
    for m, u in units.items():
        ax.plot(minutes, u, color=COLORS.get(m, None), label=m, lw=1.6)
    ax.set_ylabel(ylabel)
    ax.set_ylim(0, top * 1.35)
    qx = ax.twinx()
    qx.plot(minutes, queries, "k--", lw=1, label="queries")
    qx.set_ylabel("queries in the system")
    qx.set_ylim(0, max(float(np.nanmax(queries)) if queries.size else 1.0, 1.0) * 1.35)
    h1, l1 = ax.get_legend_handles_labels()
    h2, l2 = qx.get_legend_handles_labels()
    ax.legend(h1 + h2, l1 + l2, loc="upper left", fontsize=8, ncol=3)
    ax.set_title(title)
    for m in units:
        bx.plot(minutes, np.maximum(p99[m], 1e-3), color=COLORS.get(m, None), lw=1.4,
                label=f"{m} p99")
        bx.plot(minutes, np.maximum(p50[m], 1e-3), color=COLORS.get(m, None), lw=1, ls=":",
                label=f"{m} p50")
    bx.set_yscale("log")
    bx.set_ylabel("latency (s; 1 ms = none)")
    bx.set_xlabel("time (minutes)")
    bx.legend(fontsize=7, ncol=4, loc="upper left")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)


def plot_simulation(path: Path, wl: Workload, results: dict[str, ModeResult],
                    cfg: SimConfig) -> None:
    minutes = (np.arange(wl.rounds) + 0.5) * wl.round_s / 60
    first = next(iter(results.values()))
    queries = np.array([r.queries for r in first.rounds], dtype=np.float64)
    if cfg.work == "cell":
        units = {m: np.array([r.units for r in res.rounds]) / wl.round_s
                 for m, res in results.items()}
        ylabel = "units of work per second (candidate checks)"
    else:  # candidate checks per object differ by mode here: §6.1's units compare them
        units = {m: np.array([r.processed_objects for r in res.rounds]) / wl.round_s * queries
                 for m, res in results.items()}
        ylabel = "units of work per second (queries x objects/s)"
    plot_timeline(
        path,
        f"SWARM §6.2 {wl.scenario} (simulated: {cfg.workers} executors, load x{cfg.load:g}, "
        f"back-pressure at {cfg.max_backlog_s:g} s, work={cfg.work})",
        minutes, wl.intensity, queries, units,
        {m: np.array([r.p50_s for r in res.rounds]) for m, res in results.items()},
        {m: np.array([r.p99_s for r in res.rounds]) for m, res in results.items()}, ylabel)


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


# -- the real cluster --------------------------------------------------------------------------


@dataclass
class RealConfig:
    workers: int = 2
    grid: int = 1000
    rounds: int = 24
    round_s: float = 5.0
    rate: float = 4000.0  # objects offered per second (this 2-vCPU box's api tops out ~5-6k)
    subs: int = 10_000
    hot_subs: int = 2000
    history_objects: int = 20_000
    batch: int = 500  # objects per publish request
    seed: int = 1
    drain_s: float = 60.0  # after the last round: wait this long at most for the backlog


def write_history_sample(path: Path, wl: Workload) -> None:
    """The history sample as GEOSWARM_HISTORY_SAMPLE wants it (NDJSON objects and bboxes)."""
    lines = [json.dumps({"lon": float(x), "lat": float(y)})
             for x, y in zip(wl.sample_lon.tolist(), wl.sample_lat.tolist(), strict=True)]
    lines += [json.dumps({"bbox": [float(v) for v in wl.boxes[i]]})
              for i in wl.sample_subs.tolist()]
    path.write_text("\n".join(lines) + "\n")


@dataclass
class RealTimeline:
    """One mode's probe deliveries: per object (arrival time, latency, units)."""

    mode: str
    t0: float = 0.0
    arrivals: list[float] = field(default_factory=list)
    latency: list[float] = field(default_factory=list)
    units: list[float] = field(default_factory=list)
    published: int = 0
    duplicates: int = 0  # probe matches delivered twice (must stay 0)
    units_published: float = 0.0
    rounds: list[dict[str, Any]] = field(default_factory=list)  # POST /rebalance answers
    balancer: dict[str, Any] = field(default_factory=dict)
    partitions: int = 0
    errors: list[str] = field(default_factory=list)


async def _drive_real(server: Any, wl: Workload, mode: str, cfg: RealConfig) -> RealTimeline:
    """Push the workload through a running cluster: subscriptions (and a probe subscription
    over the whole space, so that every object's processing is observed once), objects paced
    at the round's rate, a balancing round through POST /v1/admin/rebalance at every round
    end; the probe's matches give each object's end-to-end latency and when it was done."""
    import asyncio

    import httpx
    import orjson
    import websockets

    out = RealTimeline(mode)
    key = server.new_key("swarmbench")
    h = {"Authorization": f"Bearer {key}", "Content-Type": "application/json"}
    admin = server.admin()
    n_subs = wl.boxes.shape[0]
    sub_ids: list[str | None] = [None] * n_subs
    units_of: dict[str, float] = {}
    cover = CoverCount(wl.grid)

    async with httpx.AsyncClient(base_url=server.base_url, timeout=120) as client:
        r = await client.put("/v1/admin/balancer", headers=admin, json={"enabled": False})
        if r.status_code != 200:
            out.errors.append(f"PUT /v1/admin/balancer: {r.status_code} {r.text[:200]}")

        async def create(idx: list[int]) -> None:
            for a in range(0, len(idx), 5000):
                chunk = idx[a:a + 5000]
                specs = [{"type": "range", "bbox": [float(v) for v in wl.boxes[i]]}
                         for i in chunk]
                rr = await client.post("/v1/subscriptions/batch", headers=h,
                                       content=orjson.dumps({"subscriptions": specs}))
                rr.raise_for_status()
                for i, sid in zip(chunk, rr.json()["ids"], strict=True):
                    sub_ids[i] = sid
            cover.add(wl.rects[idx])

        async def delete(idx: list[int]) -> None:
            sem = asyncio.Semaphore(16)

            async def one(i: int) -> None:
                async with sem:
                    await client.delete(f"/v1/subscriptions/{sub_ids[i]}", headers=h)

            cover.add(wl.rects[idx], -1)
            await asyncio.gather(*(one(i) for i in idx))

        await create(np.flatnonzero(wl.preloaded).tolist())
        rr = await client.post("/v1/subscriptions/batch", headers=h, content=orjson.dumps(
            {"subscriptions": [{"type": "range", "bbox": list(wl.grid.bounds)}]}))
        rr.raise_for_status()
        probe = rr.json()["ids"][0]

        ready = asyncio.Event()
        seen: set[str] = set()

        async def listen() -> None:
            url = f"{server.ws_url}/v1/stream?token={key}"
            async with websockets.connect(url, max_size=None, max_queue=None) as ws:
                await ws.send(orjson.dumps({"op": "listen", "subscriptions": [probe]}).decode())
                async for frame in ws:
                    now = time.time()
                    for line in str(frame).split("\n"):
                        if line.startswith('{"type":"match"'):
                            m = orjson.loads(line)
                            oid = m["object"]["id"]
                            if oid in seen:
                                out.duplicates += 1
                                continue
                            seen.add(oid)
                            out.arrivals.append(now)
                            out.latency.append(now - m["object"]["ts"])
                            out.units.append(units_of.pop(oid, 0.0))
                        elif '"listening"' in line:
                            ready.set()

        listener = asyncio.create_task(listen())
        await asyncio.wait_for(ready.wait(), 30)
        rounds_tasks: list[asyncio.Task[None]] = []

        async def balance_round(n: int) -> None:
            try:
                resp = await client.post("/v1/admin/rebalance", headers=admin, json={})
                body = resp.json() if resp.headers.get("content-type", "").startswith(
                    "application/json") else {"text": resp.text[:200]}
                out.rounds.append({"round": n, "status": resp.status_code, **body})
            except httpx.HTTPError as exc:
                out.rounds.append({"round": n, "status": None, "error": str(exc)})

        sem = asyncio.Semaphore(8)
        pubs: list[asyncio.Task[None]] = []
        churn: list[asyncio.Task[None]] = []

        async def publish(lon: list[float], lat: list[float], units: list[float]) -> None:
            async with sem:
                now = time.time()
                body = orjson.dumps({"objects": [{"lon": x, "lat": y, "ts": now}
                                                 for x, y in zip(lon, lat, strict=True)]})
                resp = await client.post("/v1/objects", headers=h, content=body)
                if resp.status_code != 202:  # refused: not accepted, so never expected
                    out.errors.append(f"publish: {resp.status_code} {resp.text[:200]}")
                    return
                out.published += len(lon)
                out.units_published += float(sum(units))
                for oid, u in zip(resp.json()["ids"], units, strict=True):
                    units_of[oid] = u

        out.t0 = time.time()
        t_start = time.perf_counter()
        for rnd in range(wl.rounds):
            gone = np.flatnonzero((wl.sub_end == rnd) & ~wl.preloaded).tolist()
            new = np.flatnonzero((wl.sub_start == rnd) & ~wl.preloaded).tolist()
            if gone:  # in the background: hundreds of DELETEs must not stall the objects
                churn.append(asyncio.create_task(delete(gone)))
            if new:
                await create(new)  # one batch request
            cx, cy = wl.cells(rnd)
            units = cover.q[cy, cx].astype(np.float64)
            lon, lat = wl.lon[rnd].tolist(), wl.lat[rnd].tolist()
            n = len(lon)
            per = max(1, cfg.batch)
            steps = list(range(0, n, per))
            for j, a in enumerate(steps):
                due = t_start + (rnd + j / len(steps)) * wl.round_s
                delay = due - time.perf_counter()
                if delay > 0:
                    await asyncio.sleep(delay)
                b = min(a + per, n)
                pubs.append(asyncio.create_task(
                    publish(lon[a:b], lat[a:b], units[a:b].tolist())))
            due = t_start + (rnd + 1) * wl.round_s
            delay = due - time.perf_counter()
            if delay > 0:
                await asyncio.sleep(delay)
            rounds_tasks.append(asyncio.create_task(balance_round(rnd)))
        await asyncio.gather(*pubs, *churn)
        deadline = time.monotonic() + cfg.drain_s
        while len(out.arrivals) < out.published and time.monotonic() < deadline:
            await asyncio.sleep(0.1)
        if len(out.arrivals) < out.published:
            out.errors.append(f"{out.published - len(out.arrivals)} objects not delivered "
                              f"{cfg.drain_s:g} s after the last round")
        listener.cancel()
        await asyncio.gather(listener, return_exceptions=True)
        await asyncio.gather(*rounds_tasks, return_exceptions=True)
        rb = await client.get("/v1/admin/balancer", headers=admin)
        out.balancer = rb.json() if rb.status_code == 200 else {"status": rb.status_code}
        rc = await client.get("/v1/admin/cluster", headers=admin)
        if rc.status_code == 200:
            out.partitions = sum(len(w.get("partitions", [])) for w in rc.json()["workers"])
    return out


def real_series(tl: RealTimeline, seconds: int, bucket_s: float
                ) -> tuple[F64, F64, F64, F64]:
    """Per time bucket (by delivery time): units/s, objects/s, latency p50 and p99 (s)."""
    nb = max(1, math.ceil(seconds / bucket_s))
    t = (np.asarray(tl.arrivals) - tl.t0) / bucket_s
    b = np.clip(t.astype(np.int64), 0, nb - 1) if t.size else np.zeros(0, dtype=np.int64)
    units = np.bincount(b, weights=np.asarray(tl.units), minlength=nb) / bucket_s
    objs = np.bincount(b, minlength=nb) / bucket_s
    lat = np.asarray(tl.latency)
    p50 = np.full(nb, np.nan)
    p99 = np.full(nb, np.nan)
    for i in range(nb):
        sel = lat[b == i]
        if sel.size:
            p50[i], p99[i] = np.percentile(sel, 50), np.percentile(sel, 99)
    return units[:nb], objs[:nb], p50, p99


def run_real(scenario: str, modes: Sequence[str], cfg: RealConfig, out_dir: Path
             ) -> dict[str, Any]:
    """The four modes one after another on one embedded Redis, each with its own api, workers
    and coordinator started with GEOSWARM_PARTITIONING set."""
    import asyncio
    import tempfile

    from app.core.config import Settings
    from app.core.redis import start_embedded_redis
    from bench.cluster import start_server

    grid = Grid(bounds=US_BOUNDS, nx=cfg.grid, ny=cfg.grid)
    wl = make_workload(scenario, rounds=cfg.rounds, round_s=cfg.round_s,
                       objects_per_round=int(cfg.rate * cfg.round_s), subs=cfg.subs,
                       hot_subs=cfg.hot_subs, grid=grid, history_objects=cfg.history_objects,
                       seed=cfg.seed, hot_subs_s=cfg.round_s)
    tmp = Path(tempfile.mkdtemp(prefix="geoswarm-swarmbench-"))
    sample = tmp / "history-sample.ndjson"
    write_history_sample(sample, wl)
    redis_server = start_embedded_redis(Settings(data_dir=tmp / "redis"))
    timelines: dict[str, RealTimeline] = {}
    try:
        for mode in modes:
            env = {"GEOSWARM_PARTITIONING": mode, "GEOSWARM_RATE_LIMIT_PER_S": "0",
                   "GEOSWARM_MAX_BATCH": "10000", "GEOSWARM_WINDOW_S": "600",
                   "GEOSWARM_BOUNDS": ",".join(str(v) for v in US_BOUNDS),
                   "GEOSWARM_GRID": f"{cfg.grid}x{cfg.grid}",
                   "GEOSWARM_BALANCE_PERIOD_S": str(cfg.round_s),
                   "GEOSWARM_HISTORY_SAMPLE": str(sample)}
            print(f"-- {mode}: starting api, {cfg.workers} workers and a coordinator", flush=True)
            server = start_server(tmp / mode, redis_server.url, workers=cfg.workers,
                                  **env)  # type: ignore[arg-type]  # GEOSWARM_* strings
            try:
                if hasattr(server, "start_coordinator"):
                    server.start_coordinator()
                else:
                    server.spawn("coord", ["coordinator"])
                server.wait_workers(cfg.workers)
                timelines[mode] = asyncio.run(_drive_real(server, wl, mode, cfg))
            finally:
                server.stop()
            tl = timelines[mode]
            print(f"   published {tl.published}, delivered {len(tl.arrivals)} "
                  f"({tl.duplicates} twice), "
                  f"{len(tl.rounds)} rounds, partitions at the end {tl.partitions}"
                  + (f", errors: {tl.errors[:3]}" if tl.errors else ""), flush=True)
    finally:
        redis_server.stop()
        shutil.rmtree(tmp / "redis", ignore_errors=True)  # keep the logs, not the AOF
    return report_real(wl, cfg, timelines, out_dir, tmp)


def report_real(wl: Workload, cfg: RealConfig, timelines: dict[str, RealTimeline],
                out_dir: Path, logs: Path) -> dict[str, Any]:
    span: float = wl.rounds * wl.round_s + cfg.drain_s
    bucket = wl.round_s
    last = max((max(tl.arrivals) - tl.t0 for tl in timelines.values() if tl.arrivals),
               default=0.0)
    span = max(wl.rounds * wl.round_s, min(span, last + bucket))
    series = {m: real_series(tl, int(math.ceil(span)), bucket) for m, tl in timelines.items()}
    nb = max(s[0].size for s in series.values()) if series else 0
    hot = np.zeros(nb, dtype=bool)
    hot[: wl.rounds] = wl.hot_rounds()[:nb]
    out: dict[str, Any] = {"scenario": wl.scenario, "config": asdict(cfg), "logs": str(logs),
                           "modes": {}}
    for m, tl in timelines.items():
        units, objs, p50, p99 = series[m]
        lat = np.asarray(tl.latency)
        arr = (np.asarray(tl.arrivals) - tl.t0) / bucket
        in_hot = hot[np.clip(arr.astype(np.int64), 0, nb - 1)] if arr.size else np.zeros(0, bool)
        actions: dict[str, int] = {}
        for rr in tl.rounds:
            a = str(rr.get("action", rr.get("status")))
            actions[a] = actions.get(a, 0) + 1
        out["modes"][m] = {
            "published": tl.published, "delivered": len(tl.arrivals),
            "duplicates": tl.duplicates,
            "units_published": tl.units_published,
            "units_per_s": float(units[: wl.rounds].mean()),
            "units_per_s_hot": float(units[hot].mean()) if hot.any() else float("nan"),
            "objects_per_s_hot": float(objs[hot].mean()) if hot.any() else float("nan"),
            "latency_p50_s": float(np.percentile(lat, 50)) if lat.size else float("nan"),
            "latency_p99_s": float(np.percentile(lat, 99)) if lat.size else float("nan"),
            "latency_p99_s_hot": float(np.percentile(lat[in_hot], 99)) if in_hot.any()
            else float("nan"),
            "rounds": actions, "partitions": tl.partitions, "errors": tl.errors[:10],
        }
    if "swarm" in out["modes"]:
        s = out["modes"]["swarm"]
        out["ratios"] = {m: {"units_hot": s["units_per_s_hot"] / v["units_per_s_hot"],
                             "latency_p99_hot": v["latency_p99_s_hot"] / s["latency_p99_s_hot"]}
                         for m, v in out["modes"].items()
                         if m != "swarm" and v["units_per_s_hot"] > 0
                         and s["latency_p99_s_hot"] > 0}
    print(f"\n== real cluster, {wl.scenario}: {cfg.workers} workers, {wl.rounds} rounds of "
          f"{wl.round_s:g} s, {cfg.rate:g} objects/s offered")
    print(f"{'mode':<11} {'units/s':>9} {'hot u/s':>9} {'hot obj/s':>9} {'p50 s':>7} "
          f"{'p99 s':>7} {'hot p99':>7} {'delivered':>12} {'parts':>5}  rounds")
    for m, v in out["modes"].items():
        print(f"{m:<11} {_fmt(v['units_per_s']):>9} {_fmt(v['units_per_s_hot']):>9} "
              f"{_fmt(v['objects_per_s_hot']):>9} {v['latency_p50_s']:7.2f} "
              f"{v['latency_p99_s']:7.2f} {v['latency_p99_s_hot']:7.2f} "
              f"{v['delivered']:>6}/{v['published']:<5} {v['partitions']:5d}  {v['rounds']}")
    for m, r in out.get("ratios", {}).items():
        print(f"SWARM / {m:<10}: units/s during hotspots x{r['units_hot']:.2f}; hotspot p99 "
              f"latency / SWARM's x{r['latency_p99_hot']:.3g}")
    minutes = (np.arange(nb) + 0.5) * bucket / 60
    intensity = np.zeros(nb)
    intensity[: wl.rounds] = wl.intensity[:nb]
    queries = np.full(nb, np.nan)  # the drain after the last round has no workload
    for i in range(min(nb, wl.rounds)):
        queries[i] = int(((wl.sub_start <= i) & (wl.sub_end > i)).sum())
    png = out_dir / f"swarm-real-{wl.scenario}.png"
    plot_timeline(png, f"SWARM §6.2 {wl.scenario} (real cluster: {cfg.workers} workers, "
                  f"{cfg.rate:g} objects/s)", minutes, intensity, queries,
                  {m: s[0] for m, s in series.items()}, {m: s[2] for m, s in series.items()},
                  {m: s[3] for m, s in series.items()})
    (out_dir / f"swarm-real-{wl.scenario}.json").write_text(json.dumps(out, indent=1))
    out["png"] = str(png)
    print(f"wrote {png} and {png.with_suffix('.json')} (server logs in {logs})")
    return out


# -- command line ------------------------------------------------------------------------------


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
