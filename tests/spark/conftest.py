"""One session-scoped `local[2]` SparkSession for every Spark test, built by the real factory
(spark.session.get_spark) with the UI off, and a Spark Connect server for the tests of a
Connect client; skipped, not failed, where Java 17+ is missing."""

from __future__ import annotations

import os
import socket
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import pyspark
import pytest
from pyspark.sql import SparkSession

from app.core.config import Settings
from app.core.redis import free_port
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


class ConnectServer:
    """A Spark Connect server (`local[2]`) started from the pyspark package's own
    `spark-submit`, on a free loopback port."""

    def __init__(self, work: Path) -> None:
        self.work = work
        self.starts = 0
        self._start()

    def _start(self) -> None:
        home = Path(pyspark.__file__).parent
        work = self.work
        self.starts += 1
        self.port = free_port()
        self.url = f"sc://127.0.0.1:{self.port}"
        self._log = open(work / "connect.log", "wb")  # noqa: SIM115 - closed by stop()
        self.proc = subprocess.Popen(
            [str(home / "bin" / "spark-submit"),
             "--class", "org.apache.spark.sql.connect.service.SparkConnectServer",
             "--master", "local[2]",
             "--conf", f"spark.connect.grpc.binding.port={self.port}",
             "--conf", "spark.connect.grpc.binding.address=127.0.0.1",
             "--conf", "spark.ui.enabled=false",
             "--conf", "spark.sql.session.timeZone=UTC",
             "--conf", "spark.sql.shuffle.partitions=4",
             "--conf", f"spark.local.dir={work}"],
            env={**os.environ, "SPARK_HOME": str(home)}, stdout=self._log,
            stderr=subprocess.STDOUT)

    def log(self) -> str:
        return (self.work / "connect.log").read_text()[-3000:]

    def wait_ready(self, timeout: float = 120) -> str:
        """Until the server says it started on its port and accepts connections; its URL.
        The port was free when it was chosen, but another process may take it before the
        server binds it (the server then logs the failure and stays up, serving nothing, while
        the port answers for the other process): it is started again on another port."""
        deadline = time.monotonic() + timeout
        while True:
            assert self.proc.poll() is None, self.log()
            text = (self.work / "connect.log").read_text(errors="replace")
            if "Error starting Spark Connect server" in text and self.starts < 3:
                self.stop()
                self._start()
                continue
            if f"Spark Connect server started at: 127.0.0.1:{self.port}" in text:
                try:
                    socket.create_connection(("127.0.0.1", self.port), timeout=1).close()
                    return self.url
                except OSError:
                    pass
            if time.monotonic() > deadline:
                raise TimeoutError(self.log())
            time.sleep(0.3)

    def stop(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        self._log.close()


@pytest.fixture(scope="module")
def connect_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ConnectServer]:
    """A Spark Connect server for the module's tests, starting (not yet ready: `wait_ready`)."""
    ok, detail = java_available()
    if not ok:
        pytest.skip(f"Java 17+ is not installed: {detail}")
    server = ConnectServer(tmp_path_factory.mktemp("connect"))
    try:
        yield server
    finally:
        server.stop()
