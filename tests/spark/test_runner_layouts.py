"""A query that outlived the grace period of the layout it read (a compaction replaced it and
deleted its files meanwhile) runs again on the new layout; any other failure, or a file gone
while the layout is still current, fails the query. The timing that causes it (a query longer
than the grace period) cannot be made to happen on demand, so the layouts and the failure are
given here; the connect-runner test in test_archive_queries.py meets it on a slow machine."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest

from app.archive.layout import Layout
from app.pipeline import wire
from spark import runner

GONE = ("[FAILED_READ_FILE.FILE_NOT_EXIST] Encountered error while reading file "
        "file:///archive/compact/arch/v2/data/part=3/part-0.parquet. File does not exist.")


def layout(version: int) -> Layout:
    return Layout(manifest=SimpleNamespace(version=version), buckets=[])  # type: ignore[arg-type]


def archive(monkeypatch: pytest.MonkeyPatch, versions: list[int],
            fails_on: dict[int, str]) -> tuple[runner.Archive, list[int]]:
    """An Archive whose layouts are `versions` in turn, failing with `fails_on[version]`."""
    seen: list[int] = []
    layouts = iter(versions)
    monkeypatch.setattr(runner, "read_layout", lambda *_: layout(next(layouts)))
    a = runner.Archive.__new__(runner.Archive)
    a.store = None  # type: ignore[assignment]

    def answer_on(part: Any, lay: Layout) -> tuple[wire.QueryReply, None]:
        v = lay.manifest.version  # type: ignore[union-attr]
        seen.append(v)
        if v in fails_on:
            raise RuntimeError(fails_on[v])
        return wire.QueryReply(worker="archive"), None

    monkeypatch.setattr(a, "_answer_on", answer_on)
    return a, seen


PART = SimpleNamespace(tenant="t", cut={})


def test_a_query_on_a_replaced_layout_runs_again_on_the_new_one(
        monkeypatch: pytest.MonkeyPatch) -> None:
    a, seen = archive(monkeypatch, [2, 3], {2: GONE})
    reply, _ = a.answer(PART)  # type: ignore[arg-type]
    assert reply.error is None and seen == [2, 3]


# seen in a CI run: the checksum file of a data file deleted while Spark was reading it
GONE_MID_READ = (
    "SparkException: [FAILED_READ_FILE.NO_HINT] Encountered error while reading file "
    "file:///archive/compact/arch/v3/data/part=0/part-00000.snappy.parquet.  SQLSTATE: "
    "KD001 ... Caused by: java.nio.file.NoSuchFileException: /archive/compact/arch/v3/data/"
    "part=0/.part-00000.snappy.parquet.crc")


def test_a_file_deleted_while_it_was_read_runs_the_query_again_on_the_new_layout(
        monkeypatch: pytest.MonkeyPatch) -> None:
    a, seen = archive(monkeypatch, [3, 4], {3: GONE_MID_READ})
    reply, _ = a.answer(PART)  # type: ignore[arg-type]
    assert reply.error is None and seen == [3, 4]


def test_a_file_gone_from_the_current_layout_fails_the_query(
        monkeypatch: pytest.MonkeyPatch) -> None:
    a, seen = archive(monkeypatch, [2, 2], {2: GONE})
    with pytest.raises(RuntimeError, match="FILE_NOT_EXIST"):
        a.answer(PART)  # type: ignore[arg-type]
    assert seen == [2]


def test_other_failures_are_not_asked_again(monkeypatch: pytest.MonkeyPatch) -> None:
    a, seen = archive(monkeypatch, [2, 3], {2: "AnalysisException: no such column"})
    with pytest.raises(RuntimeError, match="no such column"):
        a.answer(PART)  # type: ignore[arg-type]
    assert seen == [2]


def test_layouts_replaced_again_and_again_fail_in_the_end(
        monkeypatch: pytest.MonkeyPatch) -> None:
    a, seen = archive(monkeypatch, [2, 3, 4, 5], {2: GONE, 3: GONE, 4: GONE})
    with pytest.raises(RuntimeError, match="FILE_NOT_EXIST"):
        a.answer(PART)  # type: ignore[arg-type]
    assert seen == [2, 3, 4]
