"""Where a published object's time goes on the live path, hop by hop.

Each process counts the seconds its own hops took in fixed buckets (`HopTimes`, weighted by
the objects or matches a measurement covers). An api process serves its hops on /metrics as
`geoswarm_hop_seconds{hop}`; a worker sends its own in its heartbeat, which the api serves as
`geoswarm_worker_hop_seconds{hop,worker}`; `geoswarm bench pipeline` prints the breakdown.

The hops, in the order an object takes them (all clocks are the hosts' wall clocks):

api        validate  the request's body read, parsed and validated, and its records built
           append    the records appended to the workers' streams (`Router.publish`)
worker     queued    from the append (`ObjectBatch.sent_at`) to the worker's read: the wait in
                     the stream
           match     matching a batch (per object)
           write     the transaction that writes the matches to the histories, per object
hub (api)  notify    from the worker's write to the hub's receipt of the notification
           send      from the hub's receipt to the WebSocket frame sent, per match pushed
           total     from the append to the frame sent, per match pushed: the path's latency
"""

from __future__ import annotations

import bisect
import threading
from typing import Any

API_HOPS = ("validate", "append")
WORKER_HOPS = ("queued", "match", "write")
HUB_HOPS = ("notify", "send", "total")

# upper bounds (seconds) of the buckets; one more bucket holds what is above the last
BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0,
           10.0)


class HopTimes:
    """Histograms of hop durations: per hop, the count in each bucket and the sum."""

    def __init__(self) -> None:
        self._counts: dict[str, list[int]] = {}
        self._sums: dict[str, float] = {}
        self._lock = threading.Lock()  # a worker's heartbeat thread reads them

    def observe(self, hop: str, seconds: float, n: int = 1) -> None:
        """`n` measurements (objects, matches) of `seconds` each."""
        if n <= 0:
            return
        seconds = max(0.0, seconds)
        with self._lock:
            counts = self._counts.get(hop)
            if counts is None:
                counts = self._counts[hop] = [0] * (len(BUCKETS) + 1)
                self._sums[hop] = 0.0
            counts[bisect.bisect_left(BUCKETS, seconds)] += n
            self._sums[hop] += seconds * n

    def doc(self) -> dict[str, list[float]]:
        """{hop: [count per bucket..., sum]}: what a heartbeat carries."""
        with self._lock:
            return {hop: [*counts, self._sums[hop]] for hop, counts in self._counts.items()}


def read_doc(doc: Any) -> dict[str, tuple[list[int], float]]:
    """A heartbeat's hops back as {hop: (count per bucket, sum)}; what is malformed is left
    out."""
    out: dict[str, tuple[list[int], float]] = {}
    if not isinstance(doc, dict):
        return out
    for hop, values in doc.items():
        if (isinstance(hop, str) and isinstance(values, list)
                and len(values) == len(BUCKETS) + 2
                and all(isinstance(v, int | float) for v in values)):
            out[hop] = ([int(v) for v in values[:-1]], float(values[-1]))
    return out


def cumulative(counts: list[int]) -> list[tuple[str, float]]:
    """Prometheus's `le` buckets of per-bucket counts (the last is +Inf)."""
    out = []
    total = 0
    for bound, n in zip([*map(str, BUCKETS), "+Inf"], counts, strict=True):
        total += n
        out.append((bound, float(total)))
    return out


def quantile(counts: list[int], q: float) -> float | None:
    """The `q` quantile of per-bucket counts, interpolated linearly inside its bucket (as
    Prometheus's histogram_quantile); the last bound for what lies above it."""
    total = sum(counts)
    if total == 0:
        return None
    rank = q * total
    seen = 0
    for i, n in enumerate(counts):
        if n and seen + n >= rank:
            if i == len(BUCKETS):
                return BUCKETS[-1]
            lo = BUCKETS[i - 1] if i else 0.0
            return lo + (BUCKETS[i] - lo) * (rank - seen) / n
        seen += n
    return BUCKETS[-1]
