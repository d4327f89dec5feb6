"""The match messages a hub renders from a history entry: valid JSON with the subscription,
the cursor of each match (entry id and index), its detect and the stored record, from the
index after `after` on, leaving out records no longer stored."""

from __future__ import annotations

import orjson

from app.pipeline import wire
from app.pipeline.hub import render_matches


def test_every_match_of_an_entry_renders_as_its_message() -> None:
    n = 5000  # beyond the table of precomputed indexes
    rids = [f"r{i}" for i in range(n)]
    codes = bytes(i % 3 for i in range(n))  # inside, enter, exit
    records = {rid: orjson.dumps({"id": f"o{i}", "lon": 1.5, "lat": -2.0})
               for i, rid in enumerate(rids) if i != 7}  # r7 outlived its retention
    refs = wire.MatchRefs(rids, codes)
    lines = render_matches(orjson.dumps("s_1"), "1763800001234-5", refs, records, after=2)
    got = [orjson.loads(line) for line in lines]
    want = [i for i in range(3, n) if i != 7]
    assert [m["cursor"] for m in got] == [f"1763800001234-5:{i}" for i in want]
    assert all(m["type"] == "match" and m["subscription"] == "s_1" for m in got)
    assert [m["detect"] for m in got] == [("inside", "enter", "exit")[i % 3] for i in want]
    assert [m["object"]["id"] for m in got] == [f"o{i}" for i in want]
    assert got[0]["object"] == {"id": "o3", "lon": 1.5, "lat": -2.0}
