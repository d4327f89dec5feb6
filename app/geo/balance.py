"""SWARM load balancing, pure core: cost model (§3), decision pointer (§4.3.1, Figure 9), workload
reduction by subset-sum (Algorithm 3) or binary-searched split (§4.3.2), merging and plan edits.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass
from enum import IntEnum, StrEnum
from typing import Any, Literal, NamedTuple

from app.geo.index import Partition, Plan
from app.geo.stats import Axis, Counts, PartitionStats

Side = Literal["low", "high"]
"""Which side of a split moves: "low" = cells with coordinate <= at, "high" = the rest."""

# -- cost model (§3) -------------------------------------------------------------------------


def cost_numerator(n: float, q: int, r: int) -> float:
    """Num(C(p)) = N(p)·Q(p)·R(p), the part of Eqn 5 an executor computes locally."""
    return float(n) * q * r


def cost(n: float, q: int, r: int, r_s: float) -> float:
    """Eqn 5: C(p) = N(p)·Q(p)·Prob(p) with Prob(p) = R(p)/R(S) (Eqn 2).

    R(S) = 0 means nothing arrived anywhere last round: Prob is undefined and every cost is 0.
    """
    return cost_numerator(n, q, r) / r_s if r_s > 0 else 0.0


def worker_numerator(parts: Iterable[Counts]) -> float:
    """Num(C(m)) = Σ N·Q·R over the worker's partitions (Eqn 7's numerator)."""
    return sum(cost_numerator(*c) for c in parts)


def worker_received(parts: Iterable[Counts]) -> int:
    """R(m) = Σ R(p) (Eqn 3); the coordinator sums these into R(S) (Eqn 4)."""
    return sum(c.R for c in parts)


def worker_cost(parts: Iterable[Counts], r_s: float) -> float:
    """C(m) = Σ C(p) = Num(C(m)) / R(S) (Eqns 6-7)."""
    num = worker_numerator(parts)
    return num / r_s if r_s > 0 else 0.0


# -- decision pointer (§4.3.1, Figure 9) -----------------------------------------------------


class Stage(IntEnum):
    """Figure 9's five stages, left to right."""

    FLIP = -2
    BAD = -1
    START = 0
    GOOD = 1
    GREAT = 2


class Decision(StrEnum):
    NOTHING = "nothing"
    REBALANCE = "rebalance"

    def flipped(self) -> Decision:
        return Decision.REBALANCE if self is Decision.NOTHING else Decision.NOTHING


@dataclass
class DecisionPointer:
    """The Coordinator's decision mechanism of Figure 9, one `step` per round.

    Initially the pointer is at Start and the previous decision is "do nothing"; preR(S) is 0.
    Each round: if the current decision has already been taken `beta` rounds in a row the
    pointer is forced to Flip; otherwise it moves right when R(S) > preR(S) (saturating at
    Great) and left otherwise (equal counts as not enhanced). Reaching Flip flips the decision
    and resets the pointer to Start. The round's decision is then returned (and repeated in
    later rounds until the next flip).
    """

    beta: int = 20
    stage: Stage = Stage.START
    decision: Decision = Decision.NOTHING
    same: int = 0
    """Consecutive rounds (up to and including the last step) that `decision` was taken."""
    pre_r_s: float = 0
    forced: bool = False
    """Whether the last step's flip was forced by beta."""

    def __post_init__(self) -> None:
        if self.beta < 1:
            raise ValueError("beta must be >= 1")

    def step(self, r_s: float) -> Decision:
        self.forced = self.same >= self.beta
        if self.forced:
            self.stage = Stage.FLIP
        elif r_s > self.pre_r_s:
            self.stage = Stage(min(self.stage + 1, Stage.GREAT))
        else:
            self.stage = Stage(self.stage - 1)
        self.pre_r_s = r_s
        if self.stage == Stage.FLIP:
            self.decision = self.decision.flipped()
            self.stage = Stage.START
            self.same = 0
        self.same += 1
        return self.decision

    def to_dict(self) -> dict[str, Any]:
        return {
            "beta": self.beta,
            "stage": self.stage.name,
            "decision": self.decision.value,
            "same": self.same,
            "pre_r_s": self.pre_r_s,
            "forced": self.forced,
        }

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> DecisionPointer:
        return cls(
            beta=int(d["beta"]),
            stage=Stage[d["stage"]],
            decision=Decision(d["decision"]),
            same=int(d["same"]),
            pre_r_s=float(d["pre_r_s"]),
            forced=bool(d.get("forced", False)),
        )


# -- workload reduction (§4.3.2) -------------------------------------------------------------


def subset_sum_move(
    partition_costs: Sequence[tuple[str, float]], c_mh: float, c_ml: float
) -> list[str]:
    """Algorithm 3 (findSubset): ids of whole partitions of mH to move to mL.

    Greedy subset-sum under Cmax = (C(mH) - C(mL)) / 2, largest cost first (stable for equal
    costs), stopping early when the total hits Cmax exactly. Sorted greedy is within 1/2 of the
    best subset. Deviation: partitions of cost <= 0 are never taken; moving them changes no
    cost and only costs a migration (Algorithm 3 as printed would take them).
    """
    c_max = (c_mh - c_ml) / 2
    total = 0.0
    chosen: list[str] = []
    if c_max <= 0:
        return chosen
    for pid, c in sorted(partition_costs, key=lambda pc: -pc[1]):
        if c > 0 and c + total <= c_max:
            total += c
            chosen.append(pid)
            if total == c_max:
                break
    return chosen


class Split(NamedTuple):
    """A split of one partition at grid coordinate `at` along `axis`; `moved` side goes to mL."""

    axis: Axis
    at: int
    moved: Side
    cdiff: float


def split_cdiff(
    stats: PartitionStats, axis: Axis, at: int, moved: Side, c_mh: float, c_ml: float, r_s: float
) -> float:
    """§4.3.2: Cdiff = [(C(mH) - C(p)) + C(p2)] - [C(mL) + C(p1)], p1 moved, p2 kept."""
    low, high = stats.split_counts(axis, at)
    p1, p2 = (low, high) if moved == "low" else (high, low)
    c_p = cost(*stats.totals(), r_s)
    return (c_mh - c_p + cost(*p2, r_s)) - (c_ml + cost(*p1, r_s))


def _search(f: Callable[[int], float], lo: int, hi: int, sign: int) -> tuple[int, float]:
    """Index in lo..hi minimising |f| for f monotone: non-increasing (sign 1) or non-decreasing
    (sign -1). Binary search for the first index where sign·f <= 0; the optimum is there or
    just before it. Stops at once on an exact zero."""
    flo = f(lo)
    if sign * flo <= 0:
        return lo, flo
    fhi = f(hi)
    if sign * fhi > 0:
        return hi, fhi
    # invariant: sign·f(lo) > 0 >= sign·f(hi)
    while hi - lo > 1:
        mid = (lo + hi) // 2
        fm = f(mid)
        if fm == 0:
            return mid, fm
        if sign * fm > 0:
            lo, flo = mid, fm
        else:
            hi, fhi = mid, fm
    return (lo, flo) if abs(flo) <= abs(fhi) else (hi, fhi)


def best_split(
    stats: PartitionStats,
    c_mh: float,
    c_ml: float,
    r_s: float,
    *,
    require_improvement: bool = True,
) -> Split | None:
    """§4.3.2 split search: the split minimising |Cdiff|, by the paper's four binary searches.

    For each axis, moving the low side and moving the high side. Cdiff is monotone in the split
    position (C(low side) only grows with `at` and C(high side) only shrinks: N, Q, R of a
    side count objects/queries in/overlapping it, which can only grow with the side), so each
    binary search finds that search's exact minimum of |Cdiff|; the tests compare against an
    exhaustive search. Searches run y-low, y-high, x-low, x-high and the first strictly better
    result wins; an exact Cdiff = 0 ends the search.
    None when the partition is a single cell or, with `require_improvement`, when no split makes
    |Cdiff| smaller than the present imbalance |C(mH) - C(mL)| (the paper leaves this implicit:
    such a split is not a "feasible workload reduction").
    """
    best: Split | None = None
    searches: tuple[tuple[Side, int], ...] = (("low", 1), ("high", -1))
    for axis in ("y", "x"):
        if not stats.can_split(axis):
            continue
        lo = stats.offset(axis)
        hi = lo + stats.axis(axis).k - 2
        for moved, sign in searches:

            def f(at: int, axis: Axis = axis, moved: Side = moved) -> float:
                return split_cdiff(stats, axis, at, moved, c_mh, c_ml, r_s)

            at, cd = _search(f, lo, hi, sign)
            if best is None or abs(cd) < abs(best.cdiff):
                best = Split(axis, at, moved, cd)
            if cd == 0:
                break
        if best is not None and best.cdiff == 0:
            break
    if best is not None and require_improvement and abs(best.cdiff) >= abs(c_mh - c_ml):
        return None
    return best


@dataclass(frozen=True)
class MoveSubset:
    """Move these whole partitions of mH to mL."""

    partition_ids: tuple[str, ...]


@dataclass(frozen=True)
class SplitMove:
    """Split this partition of mH and move one side to mL."""

    partition_id: str
    split: Split


Reduction = MoveSubset | SplitMove


def reduce_workload(
    stats_of_mh: Sequence[PartitionStats], c_ml: float, r_s: float
) -> Reduction | None:
    """mH's side of a rebalance request (§4.3.2): a subset of whole partitions (Algorithm 3);
    else the best split of its most costly splittable partition (next one when a partition is
    one cell or no split of it improves the balance); None when neither reduces the load."""
    costs = [(s.partition.id, cost(*s.totals(), r_s)) for s in stats_of_mh]
    c_mh = sum(c for _, c in costs)
    subset = subset_sum_move(costs, c_mh, c_ml)
    if subset:
        return MoveSubset(tuple(subset))
    by_id = {s.partition.id: s for s in stats_of_mh}
    for pid, _ in sorted(costs, key=lambda pc: -pc[1]):
        split = best_split(by_id[pid], c_mh, c_ml, r_s)
        if split is not None:
            return SplitMove(pid, split)
    return None


# -- partitions: split, merge (§4.3.1 last paragraph, §5.2 parent links) ----------------------


def split_partition(
    p: Partition, axis: Axis, at: int, new_ids: tuple[str, str]
) -> tuple[Partition, Partition]:
    """(low, high) halves of p at grid coordinate `at` (low = coordinate <= at).

    Both are p's children (§5.2): parent = p.id, prev_owner = p.worker (where p's data stays
    until it expires), worker = p.worker until one of them is moved.
    """
    lo, hi = (p.y0, p.y1) if axis == "y" else (p.x0, p.x1)
    if axis not in ("x", "y") or not lo <= at < hi:
        raise ValueError(f"cannot split {p.id} along {axis!r} at {at}")
    a, b = new_ids
    if a == b:
        raise ValueError("the two halves need distinct ids")
    common = {"worker": p.worker, "parent": p.id, "prev_owner": p.worker}
    if axis == "y":
        low = Partition(a, p.x0, p.y0, p.x1, at, **common)
        high = Partition(b, p.x0, at + 1, p.x1, p.y1, **common)
    else:
        low = Partition(a, p.x0, p.y0, at, p.y1, **common)
        high = Partition(b, at + 1, p.y0, p.x1, p.y1, **common)
    return low, high


def _adjacent(p: Partition, q: Partition) -> bool:
    """p and q share a full edge, so their union is a rectangle."""
    same_rows = p.y0 == q.y0 and p.y1 == q.y1 and (p.x1 + 1 == q.x0 or q.x1 + 1 == p.x0)
    same_cols = p.x0 == q.x0 and p.x1 == q.x1 and (p.y1 + 1 == q.y0 or q.y1 + 1 == p.y0)
    return same_rows or same_cols


def mergeable(partitions: Sequence[Partition]) -> list[tuple[str, str]]:
    """Pairs (low-side id, high-side id) of same-worker partitions whose union is a rectangle.

    A partition can appear in several pairs; merge one pair at a time (see `apply_merges`).
    """
    out: list[tuple[str, str]] = []
    for i, p in enumerate(partitions):
        for q in partitions[i + 1 :]:
            if p.worker == q.worker and _adjacent(p, q):
                first, second = (p, q) if (p.x0, p.y0) < (q.x0, q.y0) else (q, p)
                out.append((first.id, second.id))
    return out


def merge(p: Partition, q: Partition, new_id: str) -> Partition:
    """The union of two adjacent partitions of one worker, under a new id.

    parent and prev_owner are None: a merged partition has two parents, both on its own worker,
    and the previous plan version still maps their cells for data written before the merge.
    """
    if p.worker != q.worker:
        raise ValueError(f"{p.id} and {q.id} belong to different workers")
    if not _adjacent(p, q):
        raise ValueError(f"{p.id} and {q.id} do not form a rectangle")
    return Partition(
        new_id, min(p.x0, q.x0), min(p.y0, q.y0), max(p.x1, q.x1), max(p.y1, q.y1), p.worker
    )


# -- plan edits: next version of the Plan for the coordinator ---------------------------------


def _next_plan(plan: Plan, parts: list[Partition]) -> Plan:
    new = Plan(version=plan.version + 1, grid=plan.grid, partitions=parts, members=plan.members)
    new.validate()
    return new


def _find(plan: Plan, pid: str) -> int:
    for i, p in enumerate(plan.partitions):
        if p.id == pid:
            return i
    raise KeyError(f"partition {pid} not in plan version {plan.version}")


def apply_move(
    plan: Plan, partition_ids: Iterable[str], to_worker: str, new_ids: Iterator[str]
) -> Plan:
    """Next plan with whole partitions moved to `to_worker`, each under a fresh id whose parent
    is the old id and prev_owner the old worker (§5.2). The input plan is not changed."""
    parts = [dataclasses.replace(p) for p in plan.partitions]
    for pid in partition_ids:
        i = _find(plan, pid)
        old = parts[i]
        parts[i] = dataclasses.replace(
            old, id=next(new_ids), worker=to_worker, parent=old.id, prev_owner=old.worker
        )
    return _next_plan(plan, parts)


def apply_split(
    plan: Plan, partition_id: str, split: Split, to_worker: str, new_ids: Iterator[str]
) -> Plan:
    """Next plan with one partition split in two (low half first) and `split.moved` side moved
    to `to_worker`; the kept side stays with the old worker."""
    i = _find(plan, partition_id)
    p = plan.partitions[i]
    low, high = split_partition(p, split.axis, split.at, (next(new_ids), next(new_ids)))
    moved = low if split.moved == "low" else high
    moved.worker = to_worker
    parts = [dataclasses.replace(q) for q in plan.partitions]
    parts[i : i + 1] = [low, high]
    return _next_plan(plan, parts)


def apply_reduction(
    plan: Plan, reduction: Reduction, to_worker: str, new_ids: Iterator[str]
) -> Plan:
    if isinstance(reduction, MoveSubset):
        return apply_move(plan, reduction.partition_ids, to_worker, new_ids)
    return apply_split(plan, reduction.partition_id, reduction.split, to_worker, new_ids)


def apply_merges(plan: Plan, new_ids: Iterator[str], worker: str | None = None) -> Plan:
    """Next plan with mergeable pairs merged one at a time until none is left (§4.3.1's periodic
    merge), only `worker`'s partitions when given. Returns `plan` itself when nothing merges."""
    parts = [dataclasses.replace(p) for p in plan.partitions]
    merged = False
    while pairs := mergeable([p for p in parts if worker is None or p.worker == worker]):
        a, b = pairs[0]
        ia = next(i for i, p in enumerate(parts) if p.id == a)
        ib = next(i for i, p in enumerate(parts) if p.id == b)
        parts[ia] = merge(parts[ia], parts[ib], next(new_ids))
        del parts[ib]
        merged = True
    return _next_plan(plan, parts) if merged else plan
