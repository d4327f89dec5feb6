"""Benchmark of the executor's batch matcher (Tornado §3.2 index) against numpy brute force.

`python -m bench.matcher [--subs N] [--objects N] [--batch N]` prints one table.
"""

from __future__ import annotations

import argparse
import gc
import statistics
import time
import tracemalloc
from typing import Any

import numpy as np

from app.geo.grid import Grid
from app.geo.matcher import SubscriptionIndex, numpy_brute_force_match
from bench.workload import cities, make_objects, make_subscriptions, to_subs, words


def run(
    n_subs: int = 100_000,
    n_objects: int = 200_000,
    batch: int = 5_000,
    seed: int = 1,
    bf_objects: int = 1_000,
    zipf_keywords: bool = False,
    repeat: int = 3,
) -> dict[str, Any]:
    """Build the index over n_subs subscriptions, match n_objects in batches, compare."""
    rng = np.random.default_rng(seed)
    cities(), words()  # load the tables outside any timing
    t0 = time.perf_counter()
    subs = to_subs(make_subscriptions(n_subs, rng, zipf_keywords=zipf_keywords))
    objs = make_objects(n_objects, rng)
    gen_s = time.perf_counter() - t0
    lon, lat, kws = objs["lon"], objs["lat"], objs["keywords"]

    grid = Grid()
    t0 = time.perf_counter()
    index = SubscriptionIndex(grid)
    index.add_many(subs)
    build_s = time.perf_counter() - t0
    # A second build under tracemalloc, for memory only (tracing slows the build down).
    gc.collect()
    tracemalloc.start()
    before = tracemalloc.get_traced_memory()[0]
    traced_index = SubscriptionIndex(grid)
    traced_index.add_many(subs)
    gc.collect()
    traced = tracemalloc.get_traced_memory()[0] - before
    tracemalloc.stop()
    del traced_index

    index.match(lon[:batch], lat[:batch], kws[:batch])  # warm-up
    passes: list[float] = []
    for _ in range(max(1, repeat)):
        n_pairs = 0
        t0 = time.perf_counter()
        for s in range(0, n_objects, batch):
            o, _ = index.match(lon[s : s + batch], lat[s : s + batch], kws[s : s + batch])
            n_pairs += o.size
        passes.append(time.perf_counter() - t0)
    # the best pass is the code's speed; the others also measure what else ran meanwhile
    match_s = min(passes)

    nb = min(bf_objects, n_objects)
    t0 = time.perf_counter()
    bo, bk = numpy_brute_force_match(subs, lon[:nb], lat[:nb], kws[:nb])
    bf_s = time.perf_counter() - t0
    io, ik = index.match(lon[:nb], lat[:nb], kws[:nb])
    # The index lists an object's keys in no particular order: compare the sorted pairs.
    identical = bool(np.array_equal(np.sort((bo << 32) | bk), np.sort((io << 32) | ik)))

    return {
        "n_subs": n_subs,
        "n_objects": n_objects,
        "workload": "zipf" if zipf_keywords else "topical",
        "batch": batch,
        "generate_s": gen_s,
        "build_s": build_s,
        "index_objects_per_s": n_objects / match_s,
        "median_objects_per_s": n_objects / statistics.median(passes),
        "index_us_per_object": match_s / n_objects * 1e6,
        "matches_per_object": n_pairs / n_objects,
        "bruteforce_objects": nb,
        "bruteforce_objects_per_s": nb / bf_s,
        "speedup": (n_objects / match_s) / (nb / bf_s),
        "identical_on_sample": identical,
        "sample_pairs": int(bo.size),
        "memory_bytes": index.memory_bytes(),
        "memory_bytes_per_sub": index.memory_bytes() / n_subs,
        "tracemalloc_bytes_per_sub": traced / n_subs,
    }


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--subs", type=int, nargs="+", default=[100_000])
    ap.add_argument("--objects", type=int, default=200_000)
    ap.add_argument("--batch", type=int, default=5_000)
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--bf-objects", type=int, default=1_000)
    ap.add_argument("--repeat", type=int, default=3,
                    help="timed passes over the objects; objects/s is the best pass's")
    ap.add_argument(
        "--zipf", action="store_true", help="also run with Zipf-weighted subscription keywords"
    )
    args = ap.parse_args(argv)
    results = [
        run(n, args.objects, args.batch, args.seed, args.bf_objects, zipf, args.repeat)
        for zipf in ([False, True] if args.zipf else [False])
        for n in args.subs
    ]
    rows = [
        ("subscriptions", "n_subs", "{:,.0f}"),
        ("sub keywords", "workload", "{}"),
        ("objects matched", "n_objects", "{:,.0f}"),
        ("build (s)", "build_s", "{:.2f}"),
        ("index: objects/s", "index_objects_per_s", "{:,.0f}"),
        ("  median of the passes", "median_objects_per_s", "{:,.0f}"),
        ("index: us/object", "index_us_per_object", "{:.2f}"),
        ("matches/object", "matches_per_object", "{:.2f}"),
        ("brute force: objects/s", "bruteforce_objects_per_s", "{:,.0f}"),
        ("speedup", "speedup", "{:,.0f}x"),
        ("identical on sample", "identical_on_sample", "{}"),
        ("memory_bytes()/sub", "memory_bytes_per_sub", "{:,.0f}"),
        ("tracemalloc/sub", "tracemalloc_bytes_per_sub", "{:,.0f}"),
    ]
    print(f"{'':26}" + "".join(f"{'run ' + str(i + 1):>16}" for i in range(len(results))))
    for label, key, fmt in rows:
        print(f"{label:26}" + "".join(f"{fmt.format(r[key]):>16}" for r in results))


if __name__ == "__main__":
    main()
