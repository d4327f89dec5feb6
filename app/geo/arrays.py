"""Small numpy helpers for the hot paths."""

from __future__ import annotations

from typing import Any

import numpy as np
import numpy.typing as npt


def distinct(values: npt.ArrayLike) -> npt.NDArray[Any]:
    """The distinct values of an integer array, ascending (what a bare `np.unique` gives):
    a sort and a comparison of neighbours. numpy 2.3 and later answer a bare `np.unique`
    from a hash table, which measured 5 to 18 times slower on this workload's arrays (row
    numbers, positions and cells: 290 against 16 us over 5 000 values)."""
    s = np.sort(np.asarray(values).ravel())
    if s.size < 2:
        return s
    keep = np.empty(s.size, dtype=bool)
    keep[0] = True
    np.not_equal(s[1:], s[:-1], out=keep[1:])
    return s[keep]


def members(values: npt.NDArray[Any], of: npt.NDArray[Any]) -> npt.NDArray[np.bool_]:
    """Which of `values` are among `of` (integer arrays; `np.isin`): a search of each in
    `of` sorted. `np.isin` takes the distinct values of both first (`np.unique`, see
    `distinct`): 17 against 2.5 us for ten values, 575 against 320 us for 5 000."""
    s = np.sort(np.asarray(of).ravel())
    if not s.size:
        return np.zeros(np.shape(values), dtype=bool)
    at = np.minimum(np.searchsorted(s, values), s.size - 1)
    return np.asarray(s[at] == values)
