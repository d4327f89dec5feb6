"""What a compaction's clean-up deletes: the files the current layout replaced, once the grace
period has passed, and nothing the current layout reads. A partition that did not split keeps
its files where an older layout wrote them, and Spark's writer put a checksum file beside each
(`.<name>.crc`), which a read opens with the data file: deleting it under a running query on
the current layout failed that query (seen once in CI, FAILED_READ_FILE on a `.crc`)."""

from __future__ import annotations

import time
from pathlib import Path

from app.archive.layout import ArchiveStore, Manifest, Partition
from spark.compact import clean


def write(path: Path) -> str:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(b"x")
    return str(path)


def test_clean_keeps_the_files_the_current_layout_reads_and_their_checksums(
        tmp_path: Path) -> None:
    store = ArchiveStore(str(tmp_path))
    v1 = Path(store.version_dir("arch", 1)) / "data"
    v2 = Path(store.version_dir("arch", 2)) / "data"
    kept = write(v1 / "part=0" / "part-0.parquet")  # a partition v2 did not split
    kept_sum = write(v1 / "part=0" / ".part-0.parquet.crc")
    split = write(v1 / "part=1" / "part-0.parquet")  # one v2 split: rewritten under v2
    split_sum = write(v1 / "part=1" / ".part-0.parquet.crc")
    success = write(v1 / "_SUCCESS")
    new = write(v2 / "part=1" / "part-0.parquet")
    new_sum = write(v2 / "part=1" / ".part-0.parquet.crc")
    store.switch("arch", Manifest(version=1, created=time.time() - 100, grid=(4, 4),
                                  partitions=[Partition((0, 0, 1, 3), [kept], 1),
                                              Partition((2, 0, 3, 3), [split], 1)]))
    v2_layout = Manifest(version=2, created=time.time(), grid=(4, 4),
                         partitions=[Partition((0, 0, 1, 3), [kept], 1),
                                     Partition((2, 0, 3, 3), [new], 1)])
    store.switch("arch", v2_layout)
    assert v2_layout.kept() == {kept, kept_sum, new, new_sum}

    assert clean(store, "arch", grace_s=3600, now=time.time()) == 0  # within the grace
    assert clean(store, "arch", grace_s=0, now=time.time()) == 4  # split, its sum, the
    # old manifest, _SUCCESS
    left = {str(p) for p in tmp_path.rglob("*") if p.is_file()}
    assert {kept, kept_sum, new, new_sum} <= left
    assert not {split, split_sum, success} & left
    assert clean(store, "arch", grace_s=0, now=time.time()) == 0
