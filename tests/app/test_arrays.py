"""`app.geo.arrays.distinct` against Python's set."""

from __future__ import annotations

import numpy as np
from hypothesis import given
from hypothesis import strategies as st

from app.geo.arrays import distinct


@given(values=st.lists(st.integers(-2**40, 2**40) | st.integers(0, 3), max_size=300),
       dtype=st.sampled_from([np.int64, np.int32]))
def test_distinct_is_the_sorted_set(values: list[int], dtype: type) -> None:
    """The distinct values ascending, of the array's own dtype, for empty arrays, one value
    and many repeats too."""
    a = np.asarray(values, dtype=np.int64)
    if dtype is np.int32:
        a = (a % 2**31).astype(np.int32)
    got = distinct(a)
    assert got.dtype == a.dtype
    assert got.tolist() == sorted(set(a.tolist()))
