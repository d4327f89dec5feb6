"""One session-scoped `local[2]` SparkSession for every Spark test, built by the real factory
(spark.session.get_spark) with the UI off; skipped, not failed, where Java 17+ is missing."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from pyspark.sql import SparkSession

from app.core.config import Settings
from spark.session import get_spark, java_available


@pytest.fixture(scope="session")
def spark_settings(tmp_path_factory: pytest.TempPathFactory) -> Settings:
    return Settings(
        environment="test", spark_master="local[2]", spark_remote=None,
        data_dir=tmp_path_factory.mktemp("spark-data"),
    )


@pytest.fixture(scope="session")
def spark(spark_settings: Settings) -> Iterator[SparkSession]:
    ok, detail = java_available()
    if not ok:
        pytest.skip(f"Java 17+ is not installed: {detail}")
    session = get_spark(spark_settings, app_name="geoswarm-tests")
    yield session
    session.stop()
