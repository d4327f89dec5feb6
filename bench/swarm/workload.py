"""The hotspot workloads of SWARM §6.2 (Figures 12, 14, 16): positions over the contiguous US
around cities weighted by population, range subscriptions centred on such positions, hotspots
that redirect part of the stream into a square and bring their own subscriptions."""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

import numpy as np
import numpy.typing as npt

from app.geo.grid import Grid
from bench.workload import city_location, city_points

F64 = npt.NDArray[np.float64]
I64 = npt.NDArray[np.int64]
I32 = npt.NDArray[np.int32]


US_BOUNDS = (-125.0, 24.0, -66.0, 50.0)
"""The contiguous US (the paper's 1 billion tweets are US tweets)."""
QUERY_SIDE = 0.0016  # §6: query side = 0.16 % of the space side
HOT_SIDE = 0.15  # §6.2: hotspot square of side 15 % of the space side
HOT_SUBS_S = 60.0  # §6.2: a hotspot's queries are all created during its first minute
MERGE_EVERY = 4  # as workers.coordinator with GEOSWARM_BALANCE_MERGE_S=0: every 4th quiet round
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
