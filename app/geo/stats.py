"""SWARM executor-side statistics (§4.2): per row and column N, Q, R, spanQ, preSpanQ′ with the
collectors N′, Q′, spanQ′, folded by Algorithm 2 at the end of a round; split counts of §4.2.3.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal, NamedTuple

import numpy as np
import numpy.typing as npt

from app.geo.index import Partition

Axis = Literal["x", "y"]
"""Split axis: "y" cuts between rows (p1 = rows y0..at), "x" between columns (p1 = x0..at)."""

I64 = npt.NDArray[np.int64]
F64 = npt.NDArray[np.float64]


class Counts(NamedTuple):
    """N, Q, R of a partition or of one side of a split (the inputs of the cost model, §3)."""

    N: float
    Q: int
    R: int


@dataclass
class AxisStats:
    """The paper's eight per-row (or per-column) arrays; index 0 is the paper's "first" row.

    Index i is row y0 + i (column x0 + i): the paper's top-to-bottom order is our increasing y
    (south to north) and its left-to-right order our increasing x. "Top-left corner" of a query
    therefore means its first row and first column inside the partition.
    Statistics (as of the last fold): N (faded, float), Q, R cumulative over indices <= i;
    spanQ(i) / preSpanQ(i) = queries (of all rounds / of the last round) that span from i - 1
    into i. Collectors of the current round: N_new = N′, Q_new = Q′, spanQ_new = spanQ′.
    """

    k: int
    N: F64 = field(init=False)
    Q: I64 = field(init=False)
    R: I64 = field(init=False)
    spanQ: I64 = field(init=False)
    preSpanQ: I64 = field(init=False)
    N_new: I64 = field(init=False)
    Q_new: I64 = field(init=False)
    spanQ_new: I64 = field(init=False)

    def __post_init__(self) -> None:
        self.N = np.zeros(self.k, dtype=np.float64)
        for name in ("Q", "R", "spanQ", "preSpanQ", "N_new", "Q_new", "spanQ_new"):
            setattr(self, name, np.zeros(self.k, dtype=np.int64))

    def fold(self) -> None:
        """Algorithm 2 (updateStat) for one axis, as prefix sums; N is halved first (fading)."""
        sum_n = np.cumsum(self.N_new)
        sum_q = np.cumsum(self.Q_new)
        self.N *= 0.5
        self.N += sum_n
        self.Q += sum_q
        self.R = sum_n + sum_q
        self.preSpanQ = self.spanQ_new.copy()
        self.spanQ += self.spanQ_new
        self.N_new[:] = 0
        self.Q_new[:] = 0
        self.spanQ_new[:] = 0

    def split(self, sp: int) -> tuple[Counts, Counts]:
        """§4.2.3 / §4.3.2: counts of p1 = indices <= sp and p2 = indices > sp (0 <= sp < k-1)."""
        if not 0 <= sp < self.k - 1:
            raise ValueError(f"split index {sp} outside 0..{self.k - 2}")
        n, q, r = self.N, self.Q, self.R
        low = Counts(float(n[sp]), int(q[sp]), int(r[sp]))
        high = Counts(
            float(n[-1] - n[sp]),
            int(self.spanQ[sp + 1] + q[-1] - q[sp]),
            int(self.preSpanQ[sp + 1] + r[-1] - r[sp]),
        )
        return low, high

    def split_all(self) -> tuple[F64, I64, I64, F64, I64, I64]:
        """The same counts for every split index at once: (N1, Q1, R1, N2, Q2, R2), length k-1."""
        n, q, r = self.N, self.Q, self.R
        return (
            n[:-1].copy(),
            q[:-1].copy(),
            r[:-1].copy(),
            n[-1] - n[:-1],
            self.spanQ[1:] + q[-1] - q[:-1],
            self.preSpanQ[1:] + r[-1] - r[:-1],
        )


def _as_i64(a: npt.ArrayLike) -> I64:
    return np.atleast_1d(np.asarray(a, dtype=np.int64))


class PartitionStats:
    """SWARM statistics of one partition (§4.2.1), updated per object/query (§4.2.2).

    What is counted, exactly (this is what `totals` and `split_counts` return, and what the
    tests check against brute force after every fold):
    - N: objects added to the partition and not expired, each weighted 2**-h where h is the
      number of folds since the fold that first counted it (fading: N halves every round).
    - Q: live queries whose (cell) range overlaps the partition, or the side of a split: every
      query added with `add_query` and not removed, of any round up to the last fold.
    - R: objects and queries received during the last round (the one the last fold closed) that
      lie in / overlap the partition or side. Removing or expiring them later does not change R
      (they were received); removing them before the fold cancels them as if never received.
    Objects and queries of the current round count only after the next `fold` (§4.2.1: "the
    statistics are only updated at the end of a load-balancing round").
    `round` counts folds; callers record it at arrival (`arrived_round`) so that expiry and
    removal can undo exactly what the arrival added.
    """

    def __init__(self, partition: Partition, round: int = 0) -> None:
        self.partition = partition
        self.rows = AxisStats(partition.height)
        self.cols = AxisStats(partition.width)
        self.round = round

    def axis(self, axis: Axis) -> AxisStats:
        """Row statistics for a "y" split, column statistics for an "x" split."""
        if axis == "y":
            return self.rows
        if axis == "x":
            return self.cols
        raise ValueError(f"axis must be 'x' or 'y', got {axis!r}")

    def offset(self, axis: Axis) -> int:
        """Grid coordinate of index 0 along `axis`."""
        return self.partition.y0 if axis == "y" else self.partition.x0

    # -- arrivals (the collectors, §4.2.2) ---------------------------------------------------

    def _local_cells(self, cx: npt.ArrayLike, cy: npt.ArrayLike) -> tuple[I64, I64]:
        p = self.partition
        x, y = _as_i64(cx) - p.x0, _as_i64(cy) - p.y0
        if x.shape != y.shape:
            raise ValueError("cx and cy differ in length")
        if ((x < 0) | (x >= p.width) | (y < 0) | (y >= p.height)).any():
            raise ValueError(f"cells outside partition {p.id}")
        return x, y

    def add_objects(
        self, cx: npt.ArrayLike, cy: npt.ArrayLike, count: npt.ArrayLike | None = None
    ) -> None:
        """New objects in cells (cx, cy): N′ of each object's row and of its column, +1 each
        (+`count` each when one entry stands for several objects of one cell)."""
        self._shift_objects(cx, cy, self.round, count, 1)

    def expire_objects(
        self,
        cx: npt.ArrayLike,
        cy: npt.ArrayLike,
        *,
        arrived_round: npt.ArrayLike,
        count: npt.ArrayLike | None = None,
    ) -> None:
        """Objects that left the window (§4.2.2 last paragraph): take back what they add now.

        An object added in the current round is still only in N′, which is decremented. Else
        it is in N with weight 2**-(round - arrived_round - 1) (it was folded in at fold
        arrived_round + 1 and has been halved since), removed from the cumulative N of its
        row and every later row (column likewise). R is left alone: the object was received.
        `count` (default 1 each) lets one entry stand for several objects of one cell.
        """
        self._shift_objects(cx, cy, arrived_round, count, -1)

    def _shift_objects(
        self,
        cx: npt.ArrayLike,
        cy: npt.ArrayLike,
        arrived_round: npt.ArrayLike,
        count: npt.ArrayLike | None,
        sign: int,
    ) -> None:
        x, y = self._local_cells(cx, cy)
        arrived = np.broadcast_to(_as_i64(arrived_round), x.shape)
        n = np.ones(x.shape, dtype=np.int64) if count is None else np.broadcast_to(
            _as_i64(count), x.shape)
        if (arrived > self.round).any():
            raise ValueError(f"arrived_round after the current round {self.round}")
        cur = arrived == self.round
        if cur.any():
            for a, idx in ((self.rows, y), (self.cols, x)):
                a.N_new += sign * np.bincount(idx[cur], weights=n[cur], minlength=a.k).astype(
                    np.int64)
        old = ~cur
        if old.any():
            w = n[old] * np.exp2(-(self.round - arrived[old] - 1).astype(np.float64))
            for a, idx in ((self.rows, y), (self.cols, x)):
                a.N += sign * np.cumsum(np.bincount(idx[old], weights=w, minlength=a.k))

    def _clip(self, x0: int, y0: int, x1: int, y1: int) -> tuple[int, int, int, int]:
        """Query cell rectangle clipped to the partition, in local indices."""
        p = self.partition
        lx0, ly0 = max(x0, p.x0) - p.x0, max(y0, p.y0) - p.y0
        lx1, ly1 = min(x1, p.x1) - p.x0, min(y1, p.y1) - p.y0
        if lx0 > lx1 or ly0 > ly1:
            raise ValueError(f"query ({x0}, {y0}, {x1}, {y1}) misses partition {p.id}")
        return lx0, ly0, lx1, ly1

    def add_query(self, x0: int, y0: int, x1: int, y1: int) -> None:
        """New query over the inclusive cell rectangle, clipped to the partition.

        Q′ of its first row and first column inside the partition (the paper's top-left corner)
        +1; spanQ′ of every other row and column it covers +1.
        """
        lx0, ly0, lx1, ly1 = self._clip(x0, y0, x1, y1)
        for a, first, last in ((self.rows, ly0, ly1), (self.cols, lx0, lx1)):
            a.Q_new[first] += 1
            a.spanQ_new[first + 1 : last + 1] += 1

    def add_queries(
        self, x0: npt.ArrayLike, y0: npt.ArrayLike, x1: npt.ArrayLike, y1: npt.ArrayLike
    ) -> None:
        """`add_query` for many cell rectangles at once (vectorised, the same increments).

        Every rectangle must overlap the partition; each is clipped to it.
        """
        p = self.partition
        a0, b0, a1, b1 = (_as_i64(v) for v in (x0, y0, x1, y1))
        if not a0.shape == b0.shape == a1.shape == b1.shape:
            raise ValueError("rectangle coordinates differ in length")
        lx0, ly0 = np.maximum(a0, p.x0) - p.x0, np.maximum(b0, p.y0) - p.y0
        lx1, ly1 = np.minimum(a1, p.x1) - p.x0, np.minimum(b1, p.y1) - p.y0
        if ((lx0 > lx1) | (ly0 > ly1)).any():
            raise ValueError(f"a query misses partition {p.id}")
        for a, first, last in ((self.rows, ly0, ly1), (self.cols, lx0, lx1)):
            a.Q_new += np.bincount(first, minlength=a.k)
            # +1 on first+1 .. last: a difference array, then a prefix sum.
            d = np.bincount(first + 1, minlength=a.k + 1) - np.bincount(last + 1, minlength=a.k + 1)
            a.spanQ_new += np.cumsum(d)[: a.k]

    def remove_query(self, x0: int, y0: int, x1: int, y1: int, *, arrived_round: int) -> None:
        """A deleted (or expired) subscription: the inverse of `add_query`.

        Added in the current round: its collector increments are taken back, so it never
        counts (not in Q, not in R). Added earlier: it is taken out of the cumulative Q (its
        first row and every later one) and out of spanQ, so Q stays "live queries overlapping";
        R and preSpanQ′ keep it, because they count what was received in the last round.
        """
        if arrived_round > self.round:
            raise ValueError(f"arrived_round {arrived_round} after the current round {self.round}")
        lx0, ly0, lx1, ly1 = self._clip(x0, y0, x1, y1)
        for a, first, last in ((self.rows, ly0, ly1), (self.cols, lx0, lx1)):
            if arrived_round == self.round:
                a.Q_new[first] -= 1
                a.spanQ_new[first + 1 : last + 1] -= 1
            else:
                a.Q[first:] -= 1
                a.spanQ[first + 1 : last + 1] -= 1

    # -- seeding (a partition created by a split, merge or move, §5.1) ----------------------

    def seed_objects(
        self,
        cx: npt.ArrayLike,
        cy: npt.ArrayLike,
        *,
        arrived_round: npt.ArrayLike,
        count: npt.ArrayLike | None = None,
    ) -> None:
        """Objects of the window that arrived before this partition existed (they lived in its
        parent): counted as if this partition had seen them arrive, so N is continuous across a
        split or move and `expire_objects` later takes back exactly what this adds.
        `arrived_round` may be negative (older than this worker's first fold)."""
        self._shift_objects(cx, cy, arrived_round, count, 1)

    def seed_query(self, x0: int, y0: int, x1: int, y1: int) -> int:
        """A live query that predates this partition: in Q and spanQ as if folded in a past
        round (not in R, which counts last round's arrivals). Returns the `arrived_round` to
        pass to `remove_query` when it is deleted."""
        lx0, ly0, lx1, ly1 = self._clip(x0, y0, x1, y1)
        for a, first, last in ((self.rows, ly0, ly1), (self.cols, lx0, lx1)):
            a.Q[first:] += 1
            a.spanQ[first + 1 : last + 1] += 1
        return self.round - 1

    # -- moving a partition whole to another worker (§5.1: its metadata travels) ------------

    FIELDS = ("N", "Q", "R", "spanQ", "preSpanQ", "N_new", "Q_new", "spanQ_new")

    def export(self) -> dict[str, dict[str, list[float] | list[int]]]:
        """Every row and column array, as plain lists (for a handoff message)."""
        return {name: {f: getattr(a, f).tolist() for f in self.FIELDS}
                for name, a in (("rows", self.rows), ("cols", self.cols))}

    @classmethod
    def restore(
        cls, partition: Partition, round: int, data: dict[str, dict[str, list[float] | list[int]]]
    ) -> PartitionStats:
        """The statistics `export` wrote, for the same cell rectangle on another worker whose
        fold count is `round`."""
        out = cls(partition, round=round)
        for name, a in (("rows", out.rows), ("cols", out.cols)):
            for f in cls.FIELDS:
                arr = np.asarray(data[name][f], dtype=np.float64 if f == "N" else np.int64)
                if arr.shape != (a.k,):
                    raise ValueError(f"{name}.{f} has {arr.size} values, expected {a.k}")
                setattr(a, f, arr)
        return out

    # -- end of round ----------------------------------------------------------------------

    def fold(self) -> None:
        """End of a load-balancing round: Algorithm 2 over rows and columns."""
        self.rows.fold()
        self.cols.fold()
        self.round += 1

    # -- reading ---------------------------------------------------------------------------

    def totals(self) -> Counts:
        """N(p), Q(p), R(p): the last row's cumulative values (§4.2.1)."""
        a = self.rows
        return Counts(float(a.N[-1]), int(a.Q[-1]), int(a.R[-1]))

    def can_split(self, axis: Axis) -> bool:
        return self.axis(axis).k > 1

    def split_counts(self, axis: Axis, at: int) -> tuple[Counts, Counts]:
        """Counts of p1 = cells with coordinate <= `at` along `axis` and of p2 = the rest.

        `at` is a grid coordinate (a row y for "y", a column x for "x"), p.y0 <= at < p.y1.
        Q(p1) = Q(sp), Q(p2) = spanQ(sp+1) + Q(k) - Q(sp), R(p2) = preSpanQ′(sp+1) + R(k) - R(sp),
        N(p2) = N(k) - N(sp), with sp = at - offset (§4.2.3, §4.3.2).
        """
        return self.axis(axis).split(at - self.offset(axis))
