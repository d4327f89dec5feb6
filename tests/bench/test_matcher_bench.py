"""`geoswarm bench matcher` on a tiny workload: the index agrees with the numpy brute force on
the sample, and the throughput reported is the best timed pass."""

from __future__ import annotations

import pytest

from bench.matcher import main, run


def test_tiny_matcher_bench_agrees_with_brute_force() -> None:
    out = run(n_subs=2_000, n_objects=4_000, batch=1_000, bf_objects=300, repeat=2)
    assert out["identical_on_sample"] is True
    assert out["sample_pairs"] > 0
    assert out["index_objects_per_s"] >= out["median_objects_per_s"] > 0


def test_the_table_prints(capsys: pytest.CaptureFixture[str]) -> None:
    main(["--subs", "1000", "--objects", "2000", "--batch", "500", "--bf-objects", "100",
          "--repeat", "1"])
    table = capsys.readouterr().out
    assert "identical on sample" in table and "True" in table
