"""What Spark's own SQL metrics say its Parquet scans read: the rows the scans produced (after
row-group pruning) and the size of the files they opened, summed over the SQL executions
since a given one. Read from the session's SQL status store (kept without the UI); a Spark
Connect session has no such store here, and reports nothing."""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

from pyspark.sql import SparkSession

_UNITS = {"B": 1, "KiB": 1 << 10, "MiB": 1 << 20, "GiB": 1 << 30, "TiB": 1 << 40}
_SIZE = re.compile(r"^([\d.,]+)\s*([KMGT]?i?B)$")


@dataclass
class ScanFigures:
    """Rows and bytes read by scans, up to SQL execution `last`."""

    rows: int = 0
    bytes: int = 0
    files: int = 0
    last: int = -1


def parse_count(text: str) -> int:
    """Spark's formatted count ("20,000") as an int."""
    digits = text.replace(",", "").strip()
    return int(float(digits)) if digits else 0


def parse_size(text: str) -> int:
    """Spark's formatted size ("1100.7 KiB") in bytes."""
    m = _SIZE.match(text.strip())
    if m is None:
        return 0
    return int(float(m[1].replace(",", "")) * _UNITS.get(m[2], 1))


def _value(vals: Any, metric: Any) -> str | None:
    got = vals.get(metric.accumulatorId())
    return str(got.get()) if got is not None and got.isDefined() else None


def scans_since(spark: SparkSession, after: int) -> ScanFigures | None:
    """The figures of the Parquet scans of every SQL execution after `after` (None: not a
    classic session)."""
    jsession = getattr(spark, "_jsparkSession", None)
    if jsession is None:
        return None
    store = jsession.sharedState().statusStore()
    executions = store.executionsList()
    out = ScanFigures(last=after)
    for i in range(executions.size()):
        execution = executions.apply(i)
        eid = int(execution.executionId())
        if eid <= after:
            continue
        out.last = max(out.last, eid)
        vals = store.executionMetrics(eid)
        nodes = store.planGraph(eid).allNodes().iterator()
        while nodes.hasNext():
            node = nodes.next()
            if not str(node.name()).startswith("Scan parquet"):
                continue
            metrics = node.metrics().iterator()
            while metrics.hasNext():
                metric = metrics.next()
                name, value = str(metric.name()), _value(vals, metric)
                if value is None:
                    continue
                if name == "number of output rows":
                    out.rows += parse_count(value)
                elif name == "size of files read":
                    out.bytes += parse_size(value)
                elif name == "number of files read":
                    out.files += parse_count(value)
    return out
