"""Continuous kNN on one worker (workers.knn): the incremental lists over the spatial index
against the previous way, side by side on the same state in one run. The previous way
recomputed the top-k of every subscription a batch could touch by a scan of every object held
(`workers.knn.top_k`); it costs seconds per batch at this size, so it is timed on a sample of
the subscriptions of each batch and scaled to all of them (its cost is linear in them).

Workload: moving objects near real cities (weighted by population), kNN subscriptions at
city points (a fifth with keywords), position updates that move random objects a few hundred
metres, in batches as a worker receives them. At the end the incremental lists are checked
against brute force on a sample.

`geoswarm bench knn [--objects N] [--subs N] [--updates N] [--batch N] [--k K]`

With `--live`, the real system end to end instead (bench/knn_live.py): updates paced at
`--rate` per second for `--seconds`, the lists received on a WebSocket, latency and CPU per
update of every process, the last lists checked against brute force.
"""

from __future__ import annotations

import argparse
import time
from typing import Any

import numpy as np

from app.geo.grid import Grid
from app.pipeline.wire import ObjectBatch
from bench.workload import city_points, words
from workers.knn import KnnState, KnnSub, top_k


def moving_batch(ids: list[str], lon: Any, lat: Any, kws: list[list[str]], ts: float
                 ) -> ObjectBatch:
    n = len(ids)
    return ObjectBatch(tenant="bench", sent_at=ts, plan_version=1, ids=ids,
                       record_ids=[f"r{i}" for i in range(n)], moving=[True] * n,
                       lon=lon.tolist(), lat=lat.tolist(), ts=[ts] * n, keywords=kws,
                       text=[None] * n, props=[None] * n, prev=[None] * n, late=[False] * n,
                       exit_only=[False] * n, decide_exit=[False] * n)


def run(n_objects: int = 100_000, n_subs: int = 10_000, n_updates: int = 50_000,
        batch: int = 1_000, k: int = 10, seed: int = 1, brute_sample: int = 20,
        check_sample: int = 200) -> dict[str, Any]:
    rng = np.random.default_rng(seed)
    vocab = words().words[:50]
    lon, lat = city_points(n_objects, rng)
    kws = [[str(w) for w in rng.choice(vocab, size=int(rng.integers(1, 3)), replace=False)]
           for _ in range(n_objects)]
    ids = [f"v{i}" for i in range(n_objects)]
    slon, slat = city_points(n_subs, rng, jitter_km=10.0)
    state = KnnState(window_s=3600.0, bucket_s=60.0, grid=Grid())

    t0 = time.process_time()
    for a in range(0, n_objects, 10_000):
        b = slice(a, a + 10_000)
        state.apply(moving_batch(ids[b], lon[b], lat[b], kws[b], 1.0), [1.0] * len(ids[b]), 1.0)
    load_s = time.process_time() - t0
    t0 = time.process_time()
    for i in range(n_subs):
        words_ = (frozenset(str(w) for w in rng.choice(vocab, size=2, replace=False))
                  if i % 5 == 0 else frozenset())
        state.add(KnnSub(f"s{i}", float(slon[i]), float(slat[i]), k, words_, False))
    subscribe_s = time.process_time() - t0

    incremental_s = 0.0
    brute_s = 0.0
    changed = 0
    done = 0
    ts = 2.0
    subs = list(state.subs.values())
    while done < n_updates:
        n = min(batch, n_updates - done)
        pick = rng.choice(n_objects, size=n, replace=False)
        step = rng.normal(0.0, 0.003, size=(2, n))  # a few hundred metres
        lon[pick] = np.clip(lon[pick] + step[0], -180, 180)
        lat[pick] = np.clip(lat[pick] + step[1], -89.9, 89.9)
        msg = moving_batch([ids[i] for i in pick], lon[pick], lat[pick],
                           [kws[i] for i in pick], ts)
        t0 = time.process_time()
        changed += len(state.apply(msg, [ts] * n, ts))
        incremental_s += time.process_time() - t0
        # The previous way: every subscription the batch can touch (one without keywords is
        # touched by any object) is recomputed by a scan of every object held.
        batch_words = set().union(*(kws[i] for i in pick))
        touched = [s for s in subs if not s.keywords or s.keywords & batch_words]
        sample = [touched[i] for i in rng.choice(len(touched), size=min(brute_sample,
                                                                     len(touched)),
                                                 replace=False)]
        t0 = time.process_time()
        for s in sample:
            top_k(state.objects, s)
        if sample:
            brute_s += (time.process_time() - t0) / len(sample) * len(touched)
        done += n
        ts += 1.0

    check = [subs[i] for i in rng.choice(len(subs), size=min(check_sample, len(subs)),
                                         replace=False)]
    exact = all([n[:4] for n in s.local] == top_k(state.objects, s) for s in check)
    return {
        "objects": n_objects, "subs": n_subs, "updates": n_updates, "batch": batch, "k": k,
        "load_s": load_s, "subscribe_s": subscribe_s,
        "incremental_us_per_update": incremental_s / n_updates * 1e6,
        "incremental_updates_per_s": n_updates / incremental_s if incremental_s else 0.0,
        "brute_us_per_update": brute_s / n_updates * 1e6,
        "speedup": brute_s / incremental_s if incremental_s else 0.0,
        "lists_changed_per_update": changed / n_updates,
        "exact_on_sample": exact,
    }


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(prog="geoswarm bench knn", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--objects", type=int, default=100_000)
    ap.add_argument("--subs", type=int, default=10_000)
    ap.add_argument("--updates", type=int, default=50_000)
    ap.add_argument("--batch", type=int, default=1_000)
    ap.add_argument("--k", type=int, default=10)
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--live", action="store_true", help="the real system end to end")
    ap.add_argument("--rate", type=float, default=5_000, help="--live: updates per second")
    ap.add_argument("--seconds", type=float, default=20.0, help="--live: paced phase")
    ap.add_argument("--workers", type=int, default=2, help="--live: worker processes")
    ap.add_argument("--request", type=int, default=100,
                    help="--live: updates per HTTP request (latency grows with it)")
    ap.add_argument("--registration", choices=["both", "all", "bounded", "broadcast", "none"],
                    default="both", help="--live: kNN registrations bounded by a radius, "
                    "the broadcast baseline, both one after the other (default), or `all`: "
                    "both and then `none`, the same updates without any subscription, to "
                    "tell what the subscriptions add to the workers' CPU per update")
    ap.add_argument("--balance", type=float, default=0.0, metavar="SECONDS",
                    help="--live: run a coordinator (SWARM balancing) and pace the load this "
                    "long, untimed, before the timed part")
    ap.add_argument("--moves", type=float, default=0.0, metavar="SECONDS",
                    help="--live: move a whole partition between two workers (and back) this "
                    "often during the timed part, through the admin API")
    args = ap.parse_args(argv)
    if args.live:
        from bench.knn_live import run as run_live

        modes = {"both": ["bounded", "broadcast"],
                 "all": ["bounded", "broadcast", "none"]}.get(args.registration,
                                                                [args.registration])
        outs = [run_live(args.objects, args.subs, args.k, args.rate, args.seconds,
                         args.request, args.workers, args.seed, broadcast=m == "broadcast",
                         balance_s=args.balance, move_every=args.moves,
                         subscribe_knn=m != "none")
                for m in modes]
        width = max(len(key) for key in outs[0])
        print(f"{'':<{width}}  " + "".join(f"{m:>24}" for m in modes))
        for key in outs[0]:
            print(f"{key:<{width}}  " + "".join(f"{str(o[key]):>24}" for o in outs))
        cpu = {m: o["worker_cpu_us_per_update"] for m, o in zip(modes, outs, strict=True)}
        if cpu.get("bounded") and "broadcast" in cpu:
            print(f"worker CPU per update, broadcast / bounded: "
                  f"{cpu['broadcast'] / cpu['bounded']:.1f}x")
        if "none" in cpu and "bounded" in cpu and "broadcast" in cpu:
            # what the subscriptions add, over the same updates without any: the part of the
            # workers' CPU that the way they are registered decides
            added = {m: cpu[m] - cpu["none"] for m in ("bounded", "broadcast")}
            print(f"worker CPU per update without subscriptions: {cpu['none']:.1f} us; "
                  f"added by them, bounded {added['bounded']:.1f} us, broadcast "
                  f"{added['broadcast']:.1f} us"
                  + (f", broadcast / bounded: {added['broadcast'] / added['bounded']:.1f}x"
                     if added["bounded"] > 0 else ""))
        if any(o["last_lists_wrong"] for o in outs):
            raise SystemExit("some last lists differ from brute force")
        return
    r = run(args.objects, args.subs, args.updates, args.batch, args.k, args.seed)
    rows = [
        ("moving objects", "objects", "{:,}"), ("kNN subscriptions", "subs", "{:,}"),
        ("k", "k", "{}"), ("position updates", "updates", "{:,}"),
        ("updates per batch", "batch", "{:,}"),
        ("load objects (CPU s)", "load_s", "{:.2f}"),
        ("subscribe (CPU s)", "subscribe_s", "{:.2f}"),
        ("incremental: CPU us/update", "incremental_us_per_update", "{:,.1f}"),
        ("incremental: updates/s", "incremental_updates_per_s", "{:,.0f}"),
        ("full rescan: CPU us/update", "brute_us_per_update", "{:,.1f}"),
        ("speedup", "speedup", "{:,.0f}x"),
        ("lists changed per update", "lists_changed_per_update", "{:.2f}"),
        ("exact on sample", "exact_on_sample", "{}"),
    ]
    for label, key, fmt in rows:
        print(f"{label:30}{fmt.format(r[key]):>16}")
    if not r["exact_on_sample"]:
        raise SystemExit("the incremental lists differ from brute force")


if __name__ == "__main__":
    main()
