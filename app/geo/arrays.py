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
