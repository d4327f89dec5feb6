"""Reports of the SWARM experiments: summary tables (SWARM against each baseline) and timeline
plots like the paper's figures, for the simulation and for a real cluster."""

from __future__ import annotations

import json
import math
from dataclasses import asdict
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import numpy.typing as npt

from bench.swarm.workload import Workload

if TYPE_CHECKING:
    from bench.swarm.model import ModeResult, SimConfig
    from bench.swarm.real import RealConfig, RealTimeline

F64 = npt.NDArray[np.float64]
I64 = npt.NDArray[np.int64]
I32 = npt.NDArray[np.int32]

def weighted_percentile(values: F64, weights: F64, p: float) -> float:
    if values.size == 0 or weights.sum() <= 0:
        return float("nan")
    order = np.argsort(values, kind="stable")
    cw = np.cumsum(weights[order])
    i = int(np.searchsorted(cw, p * cw[-1], side="left"))
    return float(values[order][min(i, values.size - 1)])


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
