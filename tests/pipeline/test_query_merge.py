"""The aggregator's merge of per-worker lists cut at a limit (app/pipeline/queries.py), against
the brute-force merge of everything: with records dropped after the cut (as `latest` drops
superseded ones), rounds with a growing per-worker limit end with exactly the first `limit`
kept records, and a round it calls exact is exact."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from app.pipeline import wire
from app.pipeline.queries import merge_listed, nearest_first, newest_first, top_terms


def record(i: int, ts: float, dist: float) -> wire.FoundRecord:
    return wire.FoundRecord(id=f"o{i}", lon=0.0, lat=0.0, ts=ts, keywords=[], text=None,
                            props=None, moving=True, at=1.0, distance_m=dist)


workers_st = st.lists(
    st.lists(st.tuples(st.integers(0, 50), st.integers(0, 30), st.booleans()), max_size=40),
    min_size=1, max_size=4)


@settings(max_examples=300, deadline=None)
@given(workers=workers_st, limit=st.integers(1, 12), nearest=st.booleans())
def test_rounds_end_with_the_exact_first_records(workers: list[list[tuple[int, int, bool]]],
                                                 limit: int, nearest: bool) -> None:
    key = nearest_first if nearest else newest_first
    held = []
    dropped: set[str] = set()
    n = 0
    for rows in workers:
        mine = []
        for ts, dist, drop in rows:
            r = record(n, float(ts), float(dist))
            n += 1
            mine.append(r)
            if drop:
                dropped.add(r.id)
        held.append(sorted(mine, key=key))

    def keep(r: wire.FoundRecord) -> bool:
        return r.id not in dropped

    expected = sorted((r for mine in held for r in mine if keep(r)), key=key)
    per_worker = limit
    for _ in range(20):
        replies = [wire.QueryReply(worker=f"w{i}", records=mine[:per_worker],
                                   truncated=len(mine) > per_worker)
                   for i, mine in enumerate(held)]
        got, more, exact = merge_listed(replies, key, keep, limit)
        if exact:
            assert [r.id for r in got] == [r.id for r in expected[:limit]]
            if not more:
                assert len(expected) <= limit
            if len(expected) > limit:
                assert more
            return
        per_worker *= 4
    raise AssertionError("never exact")


@settings(max_examples=300, deadline=None)
@given(terms=st.dictionaries(st.text("abcdef", min_size=1, max_size=3), st.integers(1, 6),
                             max_size=60), k=st.integers(0, 12))
def test_the_top_terms_are_the_first_k_of_every_term_sorted(terms: dict[str, int], k: int
                                                            ) -> None:
    """`top_terms` sorts only the terms as frequent as the k-th count (many ties here): the
    first k of every term sorted by count, then term."""
    assert top_terms(terms, k) == sorted(terms.items(), key=lambda t: (-t[1], t[0]))[:k]
