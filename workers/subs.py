"""The subscriptions an executor holds, indexed per partition (SWARM §4.1.2, §5: a partition
is the unit that moves, with the queries that overlap it).

A range subscription is indexed in every partition of this worker that its cells overlap; a
subscription without a region (keyword, and every subscription in replicated mode, where no
partition is owned) in one index for the whole worker. A point is matched against the index
of the partition that holds it; a point outside this worker's partitions (the previous
position of an object that crossed in, the new position of an exit-only copy) against all of
them, so every subscription held here that contains the point is found, as with one index
per worker. The decision tables (`SubTable`) stay per tenant: a subscription has one key on
this worker whatever the number of partitions it is indexed in.
"""

from __future__ import annotations

import secrets
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from app.geo.arrays import distinct
from app.geo.grid import Grid
from app.geo.index import GlobalIndex, Partition
from app.geo.matcher import MatchResult, Sub, SubscriptionIndex, sub_from_spec
from app.pipeline.wire import KeywordSummary
from workers.ledger import Rect, rect_of

SMALL_INDEX = 32
"""Initial slots of a partition's index per tenant (most tenants have few subscriptions in a
partition; the index grows by doubling)."""

DETECT_BITS = {"inside": 1, "enter": 2, "exit": 4}

SUMMARY_MAX_WORDS = 20_000
"""A partition whose subscriptions use more words than this is summarised as open (any object
may match): past it, the summary costs the routers more than it saves the matcher."""


@dataclass
class SubInfo:
    id: str
    detect: frozenset[str]
    expires_at: float | None


@dataclass
class SubTable:
    """A tenant's subscriptions on this worker by key: per-key arrays (detect bits, expiry,
    id) let the decisions be taken for a batch at once. Keys are dense per tenant."""

    subs: dict[int, SubInfo] = field(default_factory=dict)
    key_of: dict[str, int] = field(default_factory=dict)
    next_key: int = 0
    detect: np.ndarray[Any, np.dtype[np.uint8]] = field(
        default_factory=lambda: np.zeros(SMALL_INDEX, dtype=np.uint8))
    expires: np.ndarray[Any, np.dtype[np.float64]] = field(
        default_factory=lambda: np.full(SMALL_INDEX, np.inf))
    ids: np.ndarray[Any, np.dtype[np.object_]] = field(
        default_factory=lambda: np.empty(SMALL_INDEX, dtype=object))

    def put(self, info: SubInfo) -> int:
        """A new subscription; returns its key."""
        key = self.next_key
        self.next_key += 1
        if key >= self.detect.size:
            n = 2 * self.detect.size
            self.detect = np.resize(self.detect, n)
            self.expires = np.resize(self.expires, n)
            self.ids = np.resize(self.ids, n)
        self.subs[key] = info
        self.key_of[info.id] = key
        self.detect[key] = sum(DETECT_BITS[d] for d in info.detect)
        self.expires[key] = np.inf if info.expires_at is None else info.expires_at
        self.ids[key] = info.id
        return key

    def drop(self, key: int) -> None:
        info = self.subs.pop(key)
        del self.key_of[info.id]
        self.detect[key] = 0
        self.ids[key] = None


@dataclass
class Held:
    """What is kept of one subscription to index it in partitions created later."""

    tenant: str
    key: int
    sub: Sub
    rect: Rect | None  # None: no region, indexed worker-wide


@dataclass
class PartitionSubs:
    """The subscriptions overlapping one partition of this worker, per tenant."""

    partition: Partition
    by_tenant: dict[str, SubscriptionIndex] = field(default_factory=dict)

    def add(self, grid: Grid, tenant: str, sub: Sub) -> None:
        index = self.by_tenant.get(tenant)
        if index is None:
            index = self.by_tenant[tenant] = SubscriptionIndex(grid, capacity=SMALL_INDEX)
        index.add(sub)

    def remove(self, tenant: str, key: int) -> None:
        index = self.by_tenant.get(tenant)
        if index is not None and index.remove(key) and not len(index):
            del self.by_tenant[tenant]


class LocalSubs:
    """The range and keyword subscriptions of one executor (kNN ones live in `workers.knn`).

    `sync` is given the partitions this worker owns whenever the plan changes; a partition
    that is new here is filled with the subscriptions already held that overlap it (the rest
    arrive with its handoff), one given away is dropped with its index.

    Each tenant's subscriptions here have a token (`token`), a random number drawn when its
    keyword summary is made (`summary`) and forgotten at the next change of its subscriptions
    or of the partitions: a router's mark that a row matches nothing (`wire.ObjectBatch`'s
    `no_match`) holds only while the token it names is still the current one.
    """

    def __init__(self, grid: Grid, replicated: bool = False) -> None:
        self.grid = grid
        self.replicated = replicated
        self.tables: dict[str, SubTable] = {}
        self.held: dict[str, Held] = {}
        self.parts: dict[str, PartitionSubs] = {}
        self.everywhere: dict[str, SubscriptionIndex] = {}
        self.index: GlobalIndex | None = None
        # index into self.index.partitions -> the PartitionSubs held, None for others'
        self.slot: list[PartitionSubs | None] = []
        self.tokens: dict[str, int] = {}  # tenant -> the token of its current summary
        self.changed: set[str] = set()  # tenants whose summary is to be made again

    def _changed(self, tenant: str) -> None:
        self.tokens.pop(tenant, None)
        self.changed.add(tenant)

    def token(self, tenant: str) -> int | None:
        """The token of the tenant's current summary; None when none describes them now."""
        return self.tokens.get(tenant)

    def summary(self, tenant: str) -> KeywordSummary | None:
        """The tenant's keyword summary per owned partition, under a new token (None when it
        holds no range or keyword subscription here, or in replicated mode, where no
        partition is owned)."""
        if self.replicated or self.index is None or tenant not in self.tables:
            self.tokens.pop(tenant, None)
            return None
        ev = self.everywhere.get(tenant)
        base: frozenset[str] | None = frozenset() if ev is None else ev.keyword_summary()
        parts: dict[str, list[str] | None] = {}
        for pid, part in self.parts.items():
            index = part.by_tenant.get(tenant)
            words = base
            if index is not None and base is not None:  # this partition's own, and base
                own = index.keyword_summary()
                words = None if own is None else own | base
            parts[pid] = (None if words is None or len(words) > SUMMARY_MAX_WORDS
                          else sorted(words))
        token = self.tokens[tenant] = secrets.randbits(62) + 1
        return KeywordSummary(token=token, plan_version=self.index.version, parts=parts)

    def __len__(self) -> int:
        return len(self.held)

    def __contains__(self, sid: str) -> bool:
        return sid in self.held

    # --- the partitions ---------------------------------------------------------------
    def sync(self, index: GlobalIndex, owned: Sequence[Partition]) -> None:
        self.index, self.grid = index, index.grid
        self.tokens.clear()
        self.changed.update(self.tables)
        keep = {p.id: p for p in owned}
        for pid in [pid for pid in self.parts if pid not in keep]:
            del self.parts[pid]
        for pid, p in keep.items():
            if pid in self.parts:
                continue
            part = self.parts[pid] = PartitionSubs(p)
            for h in self.held.values():
                if h.rect is not None and p.overlaps(*h.rect):
                    part.add(self.grid, h.tenant, h.sub)
        self.slot = [self.parts.get(p.id) for p in index.partitions]

    # --- subscriptions ----------------------------------------------------------------
    def add(self, tenant: str, sid: str, spec: dict[str, Any],
            expires_at: float | None) -> bool:
        """Index a range or keyword subscription; False if it is held already."""
        if sid in self.held:
            return False
        self._changed(tenant)
        table = self.tables.get(tenant)
        if table is None:
            table = self.tables[tenant] = SubTable()
        key = table.put(SubInfo(sid, frozenset(spec.get("detect") or ("inside",)),
                                expires_at))
        sub = sub_from_spec(key, spec)
        regionless = self.replicated or spec["type"] != "range"
        rect = None if regionless else rect_of(self.grid, spec)
        self.held[sid] = Held(tenant, key, sub, rect)
        if rect is None:
            ev = self.everywhere.get(tenant)
            if ev is None:
                ev = self.everywhere[tenant] = SubscriptionIndex(self.grid, capacity=SMALL_INDEX)
            ev.add(sub)
        else:
            for part in self.parts.values():
                if part.partition.overlaps(*rect):
                    part.add(self.grid, tenant, sub)
        return True

    def remove(self, sid: str) -> bool:
        h = self.held.pop(sid, None)
        if h is None:
            return False
        self._changed(h.tenant)
        if h.rect is None:
            ev = self.everywhere.get(h.tenant)
            if ev is not None and ev.remove(h.key) and not len(ev):
                del self.everywhere[h.tenant]
        else:
            for part in self.parts.values():
                part.remove(h.tenant, h.key)
        table = self.tables[h.tenant]
        table.drop(h.key)
        if not table.subs:
            del self.tables[h.tenant]
        return True

    def indexed(self, tenant: str) -> TenantSubs | None:
        """A tenant's table and matcher; None when it holds no subscription here."""
        table = self.tables.get(tenant)
        return None if table is None else TenantSubs(self, tenant, table)


@dataclass
class TenantSubs:
    """One tenant's view: the decision table and `match` across the partitions."""

    local: LocalSubs
    tenant: str
    table: SubTable

    def match(self, lon: Any, lat: Any, keywords: Sequence[Sequence[str]]) -> MatchResult:
        """(object index, sub key) pairs, each once, of every subscription held here that
        contains each point (see the module docstring)."""
        lon = np.asarray(lon, dtype=np.float64)
        lat = np.asarray(lat, dtype=np.float64)
        local, tenant = self.local, self.tenant
        found: list[MatchResult] = []
        # Subscriptions held everywhere are in no partition's index, and each point is asked
        # of the partition holding it: pairs repeat only where a point outside our partitions
        # asks several of them.
        repeats = False
        ev = local.everywhere.get(tenant)
        if ev is not None:
            found.append(ev.match(lon, lat, keywords))
        here = [p.by_tenant[tenant] for p in local.parts.values() if tenant in p.by_tenant]
        if here and lon.size:
            assert local.index is not None
            slots = local.slot
            part = local.index.partition_of_points(lon, lat)
            for pi in distinct(part).tolist():
                rows = np.flatnonzero(part == pi)
                held = slots[pi]
                if held is not None:
                    targets = [held.by_tenant[tenant]] if tenant in held.by_tenant else []
                else:
                    targets = here  # a point outside our partitions: ask them all
                if not targets:
                    continue
                repeats = repeats or len(targets) > 1
                whole = rows.size == lon.size
                plon, plat = (lon, lat) if whole else (lon[rows], lat[rows])
                kws = keywords if whole else [keywords[i] for i in rows.tolist()]
                for index in targets:
                    o, k = index.match(plon, plat, kws)
                    found.append((o if whole else rows[o], k))
        if not found:
            empty = np.empty(0, dtype=np.int64)
            return empty, empty
        if len(found) == 1:
            return found[0]
        if not repeats:
            return (np.concatenate([o for o, _ in found]).astype(np.int64, copy=False),
                    np.concatenate([k for _, k in found]).astype(np.int64, copy=False))
        code = distinct(np.concatenate([(o.astype(np.int64) << 32) | k.astype(np.int64)
                                         for o, k in found]))
        return code >> 32, code & 0xFFFFFFFF
