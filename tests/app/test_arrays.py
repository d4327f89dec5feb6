"""`app.geo.arrays` against Python's sets."""

from __future__ import annotations

import numpy as np
from hypothesis import given
from hypothesis import strategies as st

from app.geo.arrays import distinct, members


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


@given(values=st.lists(st.integers(-50, 50) | st.integers(-2**62, 2**62), max_size=60),
       of=st.lists(st.integers(-50, 50) | st.integers(-2**62, 2**62), max_size=60))
def test_members_are_those_in_the_other_array(values: list[int], of: list[int]) -> None:
    """`members` is `np.isin`: repeats on either side, an empty side, values past both ends."""
    a, b = np.asarray(values, dtype=np.int64), np.asarray(of, dtype=np.int64)
    got = members(a, b)
    assert got.dtype == np.bool_ and got.shape == a.shape
    assert got.tolist() == [v in set(of) for v in values]
