"""`border_runs`, the coarse cells a count's border reads (pure geometry: here once, not once
per way of reading chunks as in test_snapshot_eval)."""

from __future__ import annotations

import math
from typing import Any

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from tests.workers.test_snapshot_eval import coord_lat, coord_lon
from workers import records
from workers.snapshot import border_runs


@settings(max_examples=200, deadline=None)
@given(data=st.data())
def test_border_runs_cover_every_cell_outside_the_hole_once(data: Any) -> None:
    """The coarse cells a border count reads: none twice, and a point of the bbox in a cell
    not read lies inside the skipped rectangle."""
    lons = sorted(data.draw(st.lists(coord_lon, min_size=4, max_size=4, unique=True)))
    lats = sorted(data.draw(st.lists(coord_lat, min_size=4, max_size=4, unique=True)))
    bbox = (lons[0], lats[0], lons[3], lats[3])
    inner = (lons[1], lats[1], lons[2], lats[2])
    ys, xa, xb = border_runs(bbox, inner)
    assert (xa <= xb + 1).all()
    order = np.lexsort((xa, ys))
    ys, xa, xb = ys[order], xa[order], xb[order]
    same_row = ys[1:] == ys[:-1]
    assert (xa[1:][same_row] > xb[:-1][same_row]).all()  # no cell in two runs

    def read(cx: int, cy: int) -> bool:
        return bool(((ys == cy) & (xa <= cx) & (cx <= xb)).any())

    for _ in range(50):
        x = data.draw(st.one_of(st.floats(bbox[0], bbox[2]), st.sampled_from(
            [inner[0], inner[2], math.nextafter(inner[0], -math.inf),
             math.nextafter(inner[2], math.inf)])))
        y = data.draw(st.one_of(st.floats(bbox[1], bbox[3]), st.sampled_from(
            [inner[1], inner[3], math.nextafter(inner[1], -math.inf),
             math.nextafter(inner[3], math.inf)])))
        if not (bbox[0] <= x <= bbox[2] and bbox[1] <= y <= bbox[3]):
            continue
        cx, cy, _, _ = records.cell_range((x, y, x, y))
        if not read(cx, cy):
            assert inner[0] < x < inner[2] and inner[1] < y < inner[3], (x, y)
