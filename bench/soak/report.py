"""The soak's report: per process, memory after the warm-up at its start and at the end and the
growth per minute of a linear fit over the rest, flagged beyond a threshold; throughput, errors
and deaths; the memory-over-time plot."""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np
import numpy.typing as npt

from bench.soak.load import LoadConfig, LoadStats
from bench.soak.sample import CLIENT, Row, cpu_column, rss_column

F64 = npt.NDArray[np.float64]
REDIS_MEMORY = "redis:used_memory"
REDIS_KEYS = "redis:keys"


@dataclass
class Growth:
    """One series after the warm-up: mean of its first and last few samples, and the slope of
    a least-squares line (unit per minute; percent of `start` per minute)."""

    unit: str
    start: float
    end: float
    per_min: float
    pct_per_min: float
    samples: int
    late_per_min: float = math.nan  # the slope over the second half alone: a step (a plan
    # change, a cache filled once) leaves it near 0, a leak does not
    flagged: bool = False
    cpu_pct: float = math.nan  # a process's mean CPU use over the same part (100 = one core)


def series(rows: list[Row], names: list[str]) -> dict[str, tuple[str, F64]]:
    """label -> (unit, values): each process's RSS, then Redis' used_memory and key count."""
    out = {n: ("MiB", _column(rows, rss_column(n))) for n in names}
    out[REDIS_MEMORY] = ("MiB", _column(rows, "redis_used_memory_mib"))
    out[REDIS_KEYS] = ("keys", _column(rows, "redis_keys"))
    return out


def _column(rows: list[Row], name: str) -> F64:
    return np.array([r.get(name, math.nan) for r in rows], dtype=np.float64)


def growth(minutes: F64, values: F64, after_min: float, unit: str) -> Growth:
    keep = (minutes >= after_min) & np.isfinite(values)
    t, v = minutes[keep], values[keep]
    if v.size < 2:
        return Growth(unit, math.nan, math.nan, math.nan, math.nan, int(v.size))
    k = max(1, min(3, v.size // 4))  # a few samples each side: RSS moves in steps
    start, end = float(v[:k].mean()), float(v[-k:].mean())
    slope = _slope(t, v)
    pct = slope / start * 100 if start > 0 else math.nan
    half = t >= (t[0] + t[-1]) / 2
    return Growth(unit, start, end, slope, pct, int(v.size),
                  late_per_min=_slope(t[half], v[half]) if half.sum() >= 3 else math.nan)


def _slope(t: F64, v: F64) -> float:
    return float(np.polyfit(t, v, 1)[0]) if t.size >= 2 and np.ptp(t) > 0 else math.nan


def summarise(rows: list[Row], names: list[str], run_s: float, warmup: float,
              flag_pct: float, flag_mib: float) -> dict[str, Any]:
    """The memory part of the summary. A series is flagged when it grows faster than
    `flag_pct` % of its post-warm-up start per minute, or (MiB series) `flag_mib` MiB/min."""
    minutes = _column(rows, "elapsed_s") / 60
    after = warmup * run_s / 60
    out: dict[str, Growth] = {}
    for label, (unit, values) in series(rows, names).items():
        g = growth(minutes, values, after, unit)
        g.flagged = bool(g.pct_per_min > flag_pct
                         or (unit == "MiB" and g.per_min > flag_mib))
        if label in names:
            g.cpu_pct = cpu_percent(minutes, _column(rows, cpu_column(label)), after)
        out[label] = g
    backlog = growth(minutes, _column(rows, "backlog"), after, "entries")
    return {"warmup_min": after, "flag_pct_per_min": flag_pct, "flag_mib_per_min": flag_mib,
            "memory": {label: asdict(g) for label, g in out.items()},
            "backlog": asdict(backlog)}


def cpu_percent(minutes: F64, cpu_s: F64, after_min: float) -> float:
    keep = (minutes >= after_min) & np.isfinite(cpu_s)
    t, c = minutes[keep], cpu_s[keep]
    if t.size < 2 or t[-1] <= t[0]:
        return math.nan
    return float((c[-1] - c[0]) / ((t[-1] - t[0]) * 60) * 100)


def no_nan(x: Any) -> Any:
    """The summary as strict JSON: NaN becomes null."""
    if isinstance(x, float) and not math.isfinite(x):
        return None
    if isinstance(x, dict):
        return {k: no_nan(v) for k, v in x.items()}
    if isinstance(x, list | tuple):
        return [no_nan(v) for v in x]
    return x


def _num(v: float | None, signed: bool = False, digits: int = 1) -> str:
    if v is None or not math.isfinite(v):
        return "nan"
    return f"{v:+.{digits}f}" if signed else f"{v:.{digits}f}"


TABLE_HEAD = f"{'series':<20} {'unit':<5} {'start':>10} {'end':>10} {'per min':>10} " \
             f"{'% per min':>10} {'2nd half':>10} {'cpu %':>6}"


def format_summary(s: dict[str, Any]) -> str:
    """The printed report; its memory table has one whitespace-separated line per series."""
    lines = [f"\n== soak: {s['load_s'] / 60:.2f} min of load, {s['workers']} workers, "
             f"{s['load']['rate']:g} objects/s offered, {s['load']['subs']} subscriptions "
             f"({s['load']['churn']:g}/s churn), {s['load']['clients']} WebSocket clients",
             f"   {s['samples']} samples every {s['sample_s']:g} s; warm-up: the first "
             f"{s['warmup_min']:.2f} min; growth from a linear fit after it, flagged beyond "
             f"{s['flag_pct_per_min']:g} %/min or {s['flag_mib_per_min']:g} MiB/min "
             "(`2nd half`: the fit over its second half alone, per min)", "",
             TABLE_HEAD]
    for label, g in s["memory"].items():
        digits = 0 if g["unit"] == "keys" else 1
        flag = "  GROWTH" if g["flagged"] else ""
        note = "  (this benchmark)" if label == CLIENT else ""
        lines.append(f"{label:<20} {g['unit']:<5} {_num(g['start'], digits=digits):>10} "
                     f"{_num(g['end'], digits=digits):>10} "
                     f"{_num(g['per_min'], signed=True, digits=2):>10} "
                     f"{_num(g['pct_per_min'], signed=True, digits=2):>10} "
                     f"{_num(g['late_per_min'], signed=True, digits=2):>10} "
                     f"{_num(g['cpu_pct'], digits=0) if label in s['processes'] else '-':>6}"
                     f"{flag}{note}")
    t, ws, sub, b = s["throughput"], s["websockets"], s["subscriptions"], s["backlog"]
    lines += [
        "",
        f"workers' backlog (stream entries): {_num(b['start'], digits=0)} after the warm-up, "
        f"{_num(b['end'], digits=0)} at the end ({_num(b['per_min'], signed=True)}/min)"
        + ("  -- GROWING: the workers did not keep up with the rate; the growth of Redis and "
           "of the latency is that backlog, not a leak" if b["per_min"] is not None
           and b["per_min"] > 0 and b["end"] > 2 * max(b["start"], 50) else ""),
        f"throughput: {t['published_per_s']:.1f} objects/s published ({t['published']} in "
        f"{t['publish_requests']} requests; publisher behind its pace {t['lagging']} times), "
        f"{t['received_per_s']:.1f} matches/s received ({t['match_per_s']:.1f} match, "
        f"{t['knn_per_s']:.1f} knn)",
        f"latency (publish to WebSocket): p50 {_num(s['latency_s']['p50'], digits=3)} s, "
        f"p99 {_num(s['latency_s']['p99'], digits=3)} s",
        f"subscriptions: {sub['created']} created, {sub['deleted']} deleted, {sub['expired']} "
        f"expired, {sub['live_at_end']} live at the end; {sub['reads']} reads",
        "redis keys by prefix, after the warm-up -> at the end: " + ", ".join(
            f"{p} {k['after_warmup']} -> {k['end']}"
            for p, k in list(s["redis_keys_by_prefix"].items())[:8]),
        f"websockets: {ws['sessions']} sessions ({ws['aborted']} dropped without closing); "
        "messages " + ", ".join(f"{k} {v}" for k, v in sorted(ws["messages"].items())),
    ]
    if s["errors"]:
        lines.append(f"errors: {sum(s['errors'].values())}")
        for kind, n in sorted(s["errors"].items(), key=lambda kv: -kv[1]):
            lines.append(f"  {n:>7}  {kind}: {s['error_examples'].get(kind, '')[:120]}")
    else:
        lines.append("errors: none")
    if s["died"]:
        lines.append("DIED: " + ", ".join(f"{d['name']} (pid {d['pid']}, exit {d['code']}, "
                                          f"after {d['elapsed_s']:.0f} s)" for d in s["died"]))
    else:
        lines.append("processes died: none")
    flagged = [label for label, g in s["memory"].items() if g["flagged"]]
    lines.append("memory growth flagged: " + (", ".join(flagged) if flagged else "none"))
    lines.append("files: " + ", ".join(str(v) for v in s["files"].values()))
    return "\n".join(lines)


def parse_table(text: str) -> dict[str, dict[str, float | str | bool]]:
    """The memory table of `format_summary`'s text, back as numbers (for tests and scripts)."""
    out: dict[str, dict[str, float | str | bool]] = {}
    lines = text.splitlines()
    start = lines.index(TABLE_HEAD) + 1
    for line in lines[start:]:
        if not line.strip():
            break
        parts = line.split()
        out[parts[0]] = {"unit": parts[1], "start": float(parts[2]), "end": float(parts[3]),
                         "per_min": float(parts[4]), "pct_per_min": float(parts[5]),
                         "late_per_min": float(parts[6]),
                         "cpu_pct": float(parts[7]) if parts[7] != "-" else math.nan,
                         "flagged": "GROWTH" in parts[8:]}
    return out


def plot(path: Path, rows: list[Row], names: list[str], summary: dict[str, Any],
         title: str) -> None:
    """Memory over time per process and Redis' own accounting; below it, each one's change
    since the end of the warm-up with its fitted line; at the bottom, Redis keys and the
    workers' backlog. The warm-up is shaded, a death is a red line."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    minutes = _column(rows, "elapsed_s") / 60
    warmup_min = float(summary["warmup_min"])
    fig, (ax, dx, bx) = plt.subplots(3, 1, figsize=(10, 10), sharex=True,
                                     gridspec_kw={"height_ratios": [3, 3, 2]})
    after = minutes >= warmup_min
    for i, (label, (unit, values)) in enumerate(series(rows, names).items()):
        if unit != "MiB":
            continue
        color = f"C{i % 10}"
        style = "--" if label in (REDIS_MEMORY, CLIENT) else "-"
        ax.plot(minutes, values, style, color=color, lw=1.4, label=label)
        g = summary["memory"][label]
        if g["start"] is not None and math.isfinite(g["start"]):
            dx.plot(minutes[after], values[after] - g["start"], style, color=color, lw=1.2,
                    label=f"{label} {g['per_min']:+.2f} MiB/min")
            if math.isfinite(g["per_min"]):
                t = minutes[after]
                dx.plot(t, (t - t[0]) * g["per_min"], ":", color=color, lw=0.8)
    ax.set_ylabel("resident memory (MiB)")
    ax.set_ylim(0, ax.get_ylim()[1] * 1.3)  # room for the legend
    ax.set_title(title)
    dx.axhline(0, color="0.5", lw=0.6)
    dx.set_ylabel("change since the warm-up (MiB)")
    bx.plot(minutes, _column(rows, "redis_keys"), color="tab:purple", lw=1.4,
            label="Redis keys")
    bx.set_ylabel("Redis keys")
    bx.set_ylim(bottom=0)
    qx = bx.twinx()
    qx.plot(minutes, _column(rows, "backlog"), color="tab:gray", lw=1, ls=":",
            label="workers' backlog")
    qx.set_ylabel("workers' backlog (entries)")
    qx.set_ylim(bottom=0)
    for a in (ax, dx, bx):
        a.axvspan(0, warmup_min, color="0.9", zorder=0)
        for d in summary["died"]:
            a.axvline(d["elapsed_s"] / 60, color="red", lw=1)
    ax.legend(fontsize=8, ncol=4, loc="upper left")
    if dx.get_legend_handles_labels()[0]:  # none when nothing was sampled after the warm-up
        dx.legend(fontsize=7, ncol=3, loc="upper left")
    h1, l1 = bx.get_legend_handles_labels()
    h2, l2 = qx.get_legend_handles_labels()
    bx.legend(h1 + h2, l1 + l2, fontsize=8, loc="upper left")
    bx.set_xlabel("time (minutes; warm-up shaded)")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)


def build_summary(*, minutes: float, workers: int, sample_s: float, warmup: float,
                  flag_pct: float, flag_mib: float, rows: list[Row], names: list[str],
                  run_s: float, stats: LoadStats, load: LoadConfig,
                  census: dict[str, dict[str, int]], deaths: list[dict[str, Any]],
                  files: dict[str, str]) -> dict[str, Any]:
    """Everything the soak reports, as JSON-ready data (soak.json)."""
    per_s = 1 / stats.load_s if stats.load_s > 0 else math.nan
    before, after = census.get("warmup", {}), census.get("end", {})
    keys = {p: {"after_warmup": before.get(p, 0), "end": after.get(p, 0)}
            for p in sorted(set(before) | set(after),
                            key=lambda p: (before.get(p, 0) - after.get(p, 0), p))}
    return {
        "minutes": run_s / 60, "minutes_asked": minutes, "workers": workers,
        "samples": len(rows), "sample_s": sample_s, "processes": names,
        "load_s": stats.load_s,
        "load": {"rate": load.rate, "fleet": load.fleet, "subs": load.subs,
                 "churn": load.churn, "clients": load.clients},
        **summarise(rows, names, run_s, warmup, flag_pct, flag_mib),
        "throughput": {
            "published": stats.published, "publish_requests": stats.publish_requests,
            "lagging": stats.lagging, "received": stats.received,
            "published_per_s": stats.published * per_s,
            "received_per_s": stats.received * per_s,
            "match_per_s": stats.messages["match"] * per_s,
            "knn_per_s": stats.messages["knn"] * per_s},
        "latency_s": {"p50": stats.latency_s.percentile(0.5),
                      "p99": stats.latency_s.percentile(0.99)},
        "subscriptions": {"created": stats.subs_created, "deleted": stats.subs_deleted,
                          "expired": stats.subs_expired, "live_at_end": stats.live_subs,
                          "reads": stats.reads},
        "websockets": {"sessions": stats.ws_sessions, "aborted": stats.ws_aborted,
                       "messages": dict(stats.messages)},
        "redis_keys_by_prefix": keys,
        "errors": dict(stats.errors), "error_examples": stats.error_examples,
        "died": deaths, "files": files,
    }
