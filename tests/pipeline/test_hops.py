"""The hop histograms (app.pipeline.hops): buckets, weights, the heartbeat's form and the
quantiles the pipeline benchmark prints."""

from __future__ import annotations

import numpy as np

from app.pipeline.hops import BUCKETS, HopTimes, cumulative, quantile, read_doc


def test_observations_fall_in_their_bucket_with_their_weight() -> None:
    hops = HopTimes()
    hops.observe("match", 0.0005)  # on a bound: that bucket (le)
    hops.observe("match", 0.00051, n=3)
    hops.observe("match", 60.0)  # above the last bound
    hops.observe("match", -1.0)  # a clock step back counts as 0
    hops.observe("write", 1.0, n=0)  # nothing measured
    doc = hops.doc()
    assert set(doc) == {"match"}
    counts, total = read_doc(doc)["match"]
    assert counts[0] == 2 and counts[1] == 3 and counts[-1] == 1 and sum(counts) == 6
    assert total == 0.0005 + 3 * 0.00051 + 60.0
    assert cumulative(counts)[-1] == ("+Inf", 6.0)
    assert [b for b, _ in cumulative(counts)[:-1]] == [str(b) for b in BUCKETS]


def test_malformed_heartbeat_hops_are_left_out() -> None:
    good = [0] * (len(BUCKETS) + 1) + [0.0]
    assert read_doc({"match": good, "write": [1, 2], "queued": "x", 3: good}) == {
        "match": ([0] * (len(BUCKETS) + 1), 0.0)}
    assert read_doc(None) == {} and read_doc([good]) == {}


def test_quantiles_lie_in_the_bucket_of_the_true_quantile() -> None:
    rng = np.random.default_rng(3)
    for _ in range(20):
        values = rng.lognormal(mean=rng.uniform(-8, 0), sigma=rng.uniform(0.2, 2), size=2000)
        hops = HopTimes()
        for v in values.tolist():
            hops.observe("x", v)
        counts, _ = read_doc(hops.doc())["x"]
        for q in (0.5, 0.9, 0.99):
            true = float(np.quantile(values, q, method="inverted_cdf"))
            got = quantile(counts, q)
            assert got is not None
            i = int(np.searchsorted(BUCKETS, true, side="left"))
            lo = BUCKETS[i - 1] if i else 0.0
            hi = BUCKETS[i] if i < len(BUCKETS) else BUCKETS[-1]
            assert lo <= got <= hi, (q, true, got)
    assert quantile([0] * (len(BUCKETS) + 1), 0.5) is None
