"""What Spark's own SQL metrics say its Parquet scans read: the rows the scans produced (after
row-group pruning) and the size of the files they opened.

A classic session keeps them in its SQL status store (kept without the UI): `scans_since`
sums the executions since a given one. A Spark Connect client has no such store; the server
sends each action's plan metrics back with its result (`DataFrame.executionInfo`), so every
action of an archive query goes through `to_arrow`, which adds them to the `metered()` figures
of the running thread."""

from __future__ import annotations

import re
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import pyarrow as pa
from pyspark.sql import DataFrame, SparkSession

_UNITS = {"B": 1, "KiB": 1 << 10, "MiB": 1 << 20, "GiB": 1 << 30, "TiB": 1 << 40}
_SIZE = re.compile(r"^([\d.,]+)\s*([KMGT]?i?B)$")
_SCAN = "Scan parquet"
_metered = threading.local()


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
            if not str(node.name()).startswith(_SCAN):
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


def is_classic(spark: SparkSession) -> bool:
    """Whether `spark` runs its JVM here (not a Spark Connect client)."""
    return getattr(spark, "_jsparkSession", None) is not None


@contextmanager
def metered() -> Iterator[ScanFigures]:
    """The figures of the Connect actions `to_arrow` runs in this thread inside the block."""
    figures = ScanFigures()
    _metered.figures = figures
    try:
        yield figures
    finally:
        _metered.figures = None


def to_arrow(df: DataFrame) -> pa.Table:
    """`df.toArrow()`; on Spark Connect, its scans' metrics are added to the `metered()`
    figures (a classic DataFrame has no `executionInfo`: its session's store has them)."""
    table = df.toArrow()
    figures: ScanFigures | None = getattr(_metered, "figures", None)
    if figures is not None and not is_classic(df.sparkSession):
        add_plan_metrics(figures, df.executionInfo)
    return table


def add_plan_metrics(figures: ScanFigures, info: Any) -> None:
    """Add the Parquet scans of a Connect action's `ExecutionInfo` (raw numbers: rows,
    bytes, files) to `figures`."""
    collected = None if info is None else info.metrics
    if collected is None:
        return
    _root, nodes = collected.extract_graph()
    for node in nodes.values():
        if not node.name.startswith(_SCAN):
            continue
        for metric in node.metrics:
            if metric.name == "numOutputRows":
                figures.rows += int(metric.value)
            elif metric.name == "filesSize":
                figures.bytes += int(metric.value)
            elif metric.name == "numFiles":
                figures.files += int(metric.value)
