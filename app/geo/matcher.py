"""Executor-side spatio-textual subscription index with a vectorised batch match (Tornado §3.2).

Per fine cell an inverted list of subscription keywords (plus a spatial-only list), stored as CSR.
"""

from __future__ import annotations

import math
import sys
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from itertools import chain, repeat
from typing import Any, Literal

import numpy as np
import numpy.typing as npt

from app.geo.arrays import distinct
from app.geo.geometry import EARTH_RADIUS_M, BBox, bbox_contains, circle_bbox, haversine_m
from app.geo.grid import Grid

I64 = npt.NDArray[np.int64]
I32 = npt.NDArray[np.int32]
F64 = npt.NDArray[np.float64]
Bool = npt.NDArray[np.bool_]

SubKind = Literal["bbox", "circle", "keyword"]
MatchResult = tuple[I64, I64]

MAX_KEY = 2**31 - 1
"""Subscription keys are dense non-negative ints below 2**31 (they are packed with the object
index into one int64 for the final sort)."""

_NO_KW = 0
"""Keyword id of the "no keyword" inverted list that holds spatial-only subscriptions."""

_LOW32 = np.int64(0xFFFFFFFF)


@dataclass
class Sub:
    """One continuous query as the matcher sees it.

    `key` is a dense int handle chosen by the caller. Keywords must already be normalised
    (`app.geo.tokenize.normalize_keywords`), as must the objects' keywords; duplicates are
    dropped here. Range subs with no keywords are spatial-only.
    """

    key: int
    kind: SubKind
    bbox: BBox | None = None
    circle: tuple[float, float, float] | None = None
    keywords: tuple[str, ...] = ()
    match_all: bool = False

    def __post_init__(self) -> None:
        if not 0 <= self.key <= MAX_KEY:
            raise ValueError(f"sub key must be in [0, 2**31), got {self.key}")
        self.keywords = tuple(dict.fromkeys(self.keywords))
        if self.kind == "bbox":
            if self.bbox is None:
                raise ValueError("bbox sub needs a bbox")
            b = tuple(float(v) for v in self.bbox)
            if len(b) != 4 or not all(math.isfinite(v) for v in b):
                raise ValueError(f"bad bbox {self.bbox!r}")
            if b[0] > b[2] or b[1] > b[3]:
                raise ValueError(f"bbox must be (min_lon, min_lat, max_lon, max_lat): {b!r}")
            self.bbox = (b[0], b[1], b[2], b[3])
        elif self.kind == "circle":
            if self.circle is None:
                raise ValueError("circle sub needs (lon, lat, radius_m)")
            c = tuple(float(v) for v in self.circle)
            if len(c) != 3 or not all(math.isfinite(v) for v in c) or c[2] < 0:
                raise ValueError(f"bad circle {self.circle!r}")
            self.circle = (c[0], c[1], c[2])
        elif self.kind == "keyword":
            if not self.keywords:
                raise ValueError("keyword sub needs at least one keyword")
        else:
            raise ValueError(f"unknown sub kind {self.kind!r}")

    def search_bbox(self) -> BBox | None:
        """The bbox to index the sub under (conservative for circles); None for keyword subs."""
        if self.kind == "bbox":
            return self.bbox
        if self.kind == "circle":
            assert self.circle is not None
            return circle_bbox(*self.circle)
        return None


def sub_from_spec(key: int, spec: dict[str, Any]) -> Sub:
    """The matcher's view of an API subscription (range with bbox or circle, or keyword)."""
    kws = tuple(spec.get("keywords") or ())
    match_all = spec.get("match", "any") == "all"
    if spec["type"] == "keyword":
        return Sub(key=key, kind="keyword", keywords=kws, match_all=match_all)
    if spec["type"] != "range":
        raise ValueError(f"the matcher handles range and keyword subs, not {spec['type']!r}")
    if spec.get("circle") is not None:
        c = spec["circle"]
        return Sub(key=key, kind="circle",
                   circle=(float(c["lon"]), float(c["lat"]), float(c["radius_m"])),
                   keywords=kws, match_all=match_all)
    b = spec["bbox"]
    return Sub(key=key, kind="bbox", bbox=(float(b[0]), float(b[1]), float(b[2]), float(b[3])),
               keywords=kws, match_all=match_all)


# --------------------------------------------------------------------------------------------
# Oracles
# --------------------------------------------------------------------------------------------


def _sub_matches_point(sub: Sub, lon: float, lat: float, kws: set[str]) -> bool:
    if sub.kind == "bbox":
        assert sub.bbox is not None
        if not bbox_contains(sub.bbox, lon, lat):
            return False
    elif sub.kind == "circle":
        assert sub.circle is not None
        clon, clat, r = sub.circle
        if not haversine_m(clon, clat, lon, lat) <= r:
            return False
    if not sub.keywords:
        return True
    if sub.match_all:
        return all(k in kws for k in sub.keywords)
    return any(k in kws for k in sub.keywords)


def brute_force_match(
    subs: Iterable[Sub],
    lon: Sequence[float] | F64,
    lat: Sequence[float] | F64,
    keywords: Sequence[Sequence[str]],
) -> MatchResult:
    """Slow, obviously-correct matcher: every object against every sub (the test oracle)."""
    sub_list = list(subs)
    objs: list[int] = []
    keys: list[int] = []
    for i in range(len(keywords)):
        kws = set(keywords[i])
        x, y = float(lon[i]), float(lat[i])
        for k in sorted(s.key for s in sub_list if _sub_matches_point(s, x, y, kws)):
            objs.append(i)
            keys.append(k)
    return np.array(objs, dtype=np.int64), np.array(keys, dtype=np.int64)


def numpy_brute_force_match(
    subs: Iterable[Sub], lon: F64, lat: F64, keywords: Sequence[Sequence[str]]
) -> MatchResult:
    """Index-free baseline: for each sub, one vectorised test over the whole batch."""
    lon = np.asarray(lon, dtype=np.float64)
    lat = np.asarray(lat, dtype=np.float64)
    n = lon.shape[0]
    has: dict[str, Bool] = {}
    for i, kws in enumerate(keywords):
        for w in kws:
            a = has.get(w)
            if a is None:
                a = has[w] = np.zeros(n, dtype=np.bool_)
            a[i] = True
    none = np.zeros(n, dtype=np.bool_)
    out_o: list[I64] = []
    out_k: list[I64] = []
    for s in subs:
        if s.kind == "bbox":
            assert s.bbox is not None
            m = bbox_contains(s.bbox, lon, lat)
        elif s.kind == "circle":
            assert s.circle is not None
            m = haversine_m(s.circle[0], s.circle[1], lon, lat) <= s.circle[2]
        else:
            m = np.ones(n, dtype=np.bool_)
        if s.keywords:
            km = has.get(s.keywords[0], none)
            for w in s.keywords[1:]:
                km = (km & has.get(w, none)) if s.match_all else (km | has.get(w, none))
            m = m & km
        idx = np.flatnonzero(m)
        if idx.size:
            out_o.append(idx.astype(np.int64))
            out_k.append(np.full(idx.size, s.key, dtype=np.int64))
    if not out_o:
        return np.empty(0, dtype=np.int64), np.empty(0, dtype=np.int64)
    code = np.sort((np.concatenate(out_o) << 32) | np.concatenate(out_k))
    return code >> 32, code & _LOW32


# --------------------------------------------------------------------------------------------
# The index
# --------------------------------------------------------------------------------------------


def _simd_sort() -> bool:
    """Whether numpy sorts int64 with vector instructions on this CPU (numpy 2: x86-simd-sort
    with AVX2 or AVX-512, Highway on Arm)."""
    try:
        from numpy._core._multiarray_umath import __cpu_features__ as features
    except ImportError:
        return False
    return any(features.get(f) for f in ("AVX2", "AVX512_SKX", "ASIMD"))


# How the textual pairs' codes are sorted. With a vector sort, numpy's default took 0.43 ms for
# 100 000 codes in 8 sorted runs against 1.0 ms for the stable sort's merge of the runs (the
# matcher: +20 % objects/s); without one, the merge is the faster.
_CODE_SORT: Literal["quicksort", "stable"] = "quicksort" if _simd_sort() else "stable"


def _run_starts(sorted_values: I64) -> I64:
    """Where each run of equal values of a sorted, non-empty array begins (0 first)."""
    new = np.empty(sorted_values.size, dtype=np.bool_)
    new[0] = True
    np.not_equal(sorted_values[1:], sorted_values[:-1], out=new[1:])
    return np.flatnonzero(new)


_BLOOM_MIN_KEYS = 65_536
"""A CSR with at least this many keys gets a Bloom filter in front of its binary search."""

_HASH_MUL = np.uint64(0x9E3779B97F4A7C15)
"""Fibonacci hashing multiplier (2**64 / golden ratio, odd)."""


class _Csr:
    """Frozen inverted lists: sorted unique int64 keys (cell << 32 | kw), offsets, sub slots.

    A large CSR also keeps a one-hash Bloom filter of its keys (16 bits per key, about 6 %
    false positives): most keyword probes name a (cell, keyword) no sub has, and the filter
    drops them before the binary search, whose cache misses over megabytes of keys dominate
    the lookup otherwise.
    """

    __slots__ = ("ukeys", "off", "vals", "bloom", "bloom_shift")

    def __init__(self, keys: I64, vals: I32) -> None:
        self.bloom: npt.NDArray[np.uint8] | None = None
        self.bloom_shift = np.uint64(0)
        if keys.size == 0:
            self.ukeys: I64 = np.empty(0, dtype=np.int64)
            self.off: I64 = np.zeros(1, dtype=np.int64)
            self.vals: I32 = np.empty(0, dtype=np.int32)
            return
        order = np.argsort(keys)
        sk = keys[order]
        self.vals = vals[order]
        starts = _run_starts(sk)
        self.ukeys = sk[starts]
        self.off = np.append(starts, sk.size).astype(np.int64)
        if self.ukeys.size >= _BLOOM_MIN_KEYS:
            bits = int(self.ukeys.size * 16 - 1).bit_length()
            self.bloom_shift = np.uint64(64 - bits)
            self.bloom = np.zeros(1 << (bits - 3), dtype=np.uint8)
            h = self._hash(self.ukeys)
            np.bitwise_or.at(self.bloom, h >> 3, np.left_shift(1, h & 7).astype(np.uint8))

    def _hash(self, keys: I64) -> I64:
        return ((keys.view(np.uint64) * _HASH_MUL) >> self.bloom_shift).astype(np.int64)

    @property
    def nbytes(self) -> int:
        extra = 0 if self.bloom is None else self.bloom.nbytes
        return int(self.ukeys.nbytes + self.off.nbytes + self.vals.nbytes + extra)

    def lookup(self, probes: I64, probe_obj: I64) -> tuple[I64, I32]:
        """All (object, slot) pairs whose probe key has an inverted list."""
        if self.ukeys.size == 0 or probes.size == 0:
            return np.empty(0, dtype=np.int64), np.empty(0, dtype=np.int32)
        if self.bloom is not None:
            h = self._hash(probes)
            maybe = np.flatnonzero((self.bloom[h >> 3] >> (h & 7).astype(np.uint8)) & 1)
            probes, probe_obj = probes[maybe], probe_obj[maybe]
        if self.ukeys.size > 4096 and probes.size > 256:
            # Sorted needles make the binary searches walk nearby memory (~3x faster), and
            # each distinct needle (objects share cells and keywords) is searched once.
            order = np.argsort(probes)
            probes, probe_obj = probes[order], probe_obj[order]
            starts = _run_starts(probes)
            idx = np.repeat(np.searchsorted(self.ukeys, probes[starts]),
                            np.diff(starts, append=probes.size))
        else:
            idx = np.searchsorted(self.ukeys, probes)
        np.minimum(idx, self.ukeys.size - 1, out=idx)
        hit = self.ukeys[idx] == probes
        idx = idx[hit]
        st = self.off[idx]
        cnt = self.off[idx + 1] - st
        total = int(cnt.sum())
        if total == 0:
            return np.empty(0, dtype=np.int64), np.empty(0, dtype=np.int32)
        objs = np.repeat(probe_obj[hit], cnt)
        # Position of every candidate: start of its list + rank inside the list.
        shift = st - (np.cumsum(cnt) - cnt)
        pos = np.repeat(shift, cnt) + np.arange(total, dtype=np.int64)
        return objs, self.vals[pos]


# Subs live in buckets, each a separate CSR (smaller arrays make searchsorted cheaper):
# bucket = 2 * level + (1 if the sub has keywords else 0), with level 0 = fine cells,
# 1 = coarse cells (_COARSE x _COARSE fine cells), 2 = one pseudo-cell for range subs too
# large for level 1, 3 = one pseudo-cell for keyword subs (no spatial test at all). A range
# sub goes to the finest level where it covers at most _MAX_CELLS cells, so huge circles or
# bboxes cannot explode the index (Tornado puts every query in every fine cell it overlaps).
_COARSE = 16
_MAX_CELLS = 256
_N_LEVELS = 4
_KEYWORD_LEVEL = 3
_N_BUCKETS = 2 * _N_LEVELS


def _empty_pairs() -> tuple[I64, I32]:
    return np.empty(0, dtype=np.int64), np.empty(0, dtype=np.int32)


def unit_vectors(lon: F64, lat: F64) -> F64:
    """(n, 3) points on the unit sphere: a circle test becomes a chord length, no trigonometry."""
    lon_r = np.radians(lon)
    lat_r = np.radians(lat)
    cos_lat = np.cos(lat_r)
    return np.stack((cos_lat * np.cos(lon_r), cos_lat * np.sin(lon_r), np.sin(lat_r)), axis=1)


class _Batch:
    """Per-batch object columns, derived lazily (only circle verification needs the vectors)."""

    def __init__(self, lon: F64, lat: F64) -> None:
        self.lon = lon
        self.lat = lat
        self._xyz: F64 | None = None

    @property
    def xyz(self) -> F64:
        if self._xyz is None:
            self._xyz = unit_vectors(self.lon, self.lat)
        return self._xyz


class SubscriptionIndex:
    """Spatio-textual index of subscriptions for one executor partition (Tornado §3.2).

    Frozen CSRs of inverted lists + small delta CSRs for recent adds + a removed mask; the
    frozen CSRs are rebuilt (amortised) when the delta or the dead slots pass a threshold.
    """

    # Per-slot columns (a slot is a dense internal index; slots are compacted on rebuild).
    s_key: I64
    s_bbox: F64  # (cap, 4): search bbox (circle bbox for circles; infinite for keyword subs)
    s_circle: Bool
    s_clon: F64
    s_clat: F64
    s_rad: F64
    s_cxyz: F64  # (cap, 3): circle centre on the unit sphere
    s_hlo: F64  # below this haversine term (chord^2 / 4) a point is surely inside the circle
    s_hhi: F64  # above this one surely outside; in between haversine_m decides
    s_need: I32
    s_alive: Bool
    s_kwstart: I64
    s_kwlen: I32
    s_bucket: npt.NDArray[np.int8]
    s_x0: I32
    s_y0: I32
    s_x1: I32
    s_y1: I32

    _SLOT_ARRAYS: tuple[tuple[str, Any], ...] = (
        ("s_key", np.int64),
        ("s_bbox", (np.float64, (4,))),
        ("s_circle", np.bool_),
        ("s_clon", np.float64),
        ("s_clat", np.float64),
        ("s_rad", np.float64),
        ("s_cxyz", (np.float64, (3,))),
        ("s_hlo", np.float64),
        ("s_hhi", np.float64),
        ("s_need", np.int32),
        ("s_alive", np.bool_),
        ("s_kwstart", np.int64),
        ("s_kwlen", np.int32),
        ("s_bucket", np.int8),
        ("s_x0", np.int32),
        ("s_y0", np.int32),
        ("s_x1", np.int32),
        ("s_y1", np.int32),
    )

    def __init__(
        self, grid: Grid, *, rebuild_min: int = 2048, rebuild_fraction: float = 0.05,
        capacity: int = 1024,
    ) -> None:
        self.grid = grid
        self.rebuild_min = rebuild_min
        self.rebuild_fraction = rebuild_fraction
        self._cnx = (grid.nx + _COARSE - 1) // _COARSE
        self._vocab: dict[str, int] = {}
        self._words: list[str] = [""]  # keyword id -> word (0 is _NO_KW)
        self._cap = 0
        self._n = 0  # slots used (live or dead)
        self._alloc(max(capacity, 1))  # slots; grown by doubling
        self._kw_pool = np.empty(max(capacity, 1), dtype=np.int32)
        self._kw_used = 0
        self._key_to_slot = np.full(max(capacity, 1), -1, dtype=np.int32)
        self._live = 0
        empty = np.empty(0, dtype=np.int64)
        self._main = [_Csr(empty, empty.astype(np.int32)) for _ in range(_N_BUCKETS)]
        self._main_slots = 0  # slots [0, _main_slots) are in the frozen CSRs
        self._main_dead = 0
        self._delta: list[_Csr] | None = None
        self._bucket_live = [0] * _N_BUCKETS  # to skip probing empty buckets
        self._n_all = 0  # live subs that need more than one keyword hit (CONTAINS)
        self.rebuilds = 0

    # ---- slot storage ---------------------------------------------------------------------

    def _alloc(self, cap: int) -> None:
        for name, dt in self._SLOT_ARRAYS:
            new = np.zeros(cap, dtype=np.dtype(dt))
            old = getattr(self, name, None)
            if old is not None:
                new[: self._n] = old[: self._n]
            setattr(self, name, new)
        self._cap = cap

    def _intern(self, w: str) -> int:
        i = self._vocab.get(w)
        if i is None:
            i = self._vocab[w] = len(self._vocab) + 1  # 0 is _NO_KW
            self._words.append(w)
        return i

    # ---- public API ------------------------------------------------------------------------

    def __len__(self) -> int:
        return self._live

    def __contains__(self, key: int) -> bool:
        return 0 <= key < self._key_to_slot.size and self._key_to_slot[key] >= 0

    def add(self, sub: Sub) -> None:
        """Index a subscription; a live sub with the same key is replaced."""
        if sub.key in self:
            self.remove(sub.key)
        if self._n == self._cap:
            self._alloc(self._cap * 2)
        s = self._n
        self._n += 1
        kws = [self._intern(w) for w in sub.keywords]
        if self._kw_used + len(kws) > self._kw_pool.size:
            pool = np.empty(max(self._kw_pool.size * 2, self._kw_used + len(kws)), np.int32)
            pool[: self._kw_used] = self._kw_pool[: self._kw_used]
            self._kw_pool = pool
        self._kw_pool[self._kw_used : self._kw_used + len(kws)] = kws
        self.s_kwstart[s] = self._kw_used
        self.s_kwlen[s] = len(kws)
        self._kw_used += len(kws)
        self.s_key[s] = sub.key
        self.s_need[s] = len(kws) if (sub.match_all and kws) else 1
        self.s_alive[s] = True
        bbox = sub.search_bbox()
        if bbox is None:
            self.s_bbox[s] = (-np.inf, -np.inf, np.inf, np.inf)
            level, x0, y0, x1, y1 = _KEYWORD_LEVEL, 0, 0, 0, 0
        else:
            self.s_bbox[s] = bbox
            level, x0, y0, x1, y1 = self._place(bbox)
        self.s_circle[s] = sub.kind == "circle"
        if sub.circle is not None and sub.kind == "circle":
            self.s_clon[s], self.s_clat[s], self.s_rad[s] = sub.circle
            self.s_cxyz[s] = unit_vectors(np.array([sub.circle[0]]), np.array([sub.circle[1]]))[0]
            h = math.sin(min(sub.circle[2] / (2 * EARTH_RADIUS_M), math.pi / 2)) ** 2
            # The chord's rounding moves chord^2/4 by at most ~1e-15 * sqrt(h) near the border;
            # the relative band covers haversine_m's own rounding.
            tol = 1e-6 * h + 4e-15 * math.sqrt(h) + 1e-24
            self.s_hlo[s], self.s_hhi[s] = h - tol, h + tol
        self.s_bucket[s] = 2 * level + (1 if kws else 0)
        self.s_x0[s], self.s_y0[s], self.s_x1[s], self.s_y1[s] = x0, y0, x1, y1
        if sub.key >= self._key_to_slot.size:
            k2s = np.full(max(self._key_to_slot.size * 2, sub.key + 1), -1, dtype=np.int32)
            k2s[: self._key_to_slot.size] = self._key_to_slot
            self._key_to_slot = k2s
        self._key_to_slot[sub.key] = s
        self._count(s, +1)
        self._live += 1
        self._delta = None
        if self._n - self._main_slots > self._threshold():
            self.rebuild()

    def add_many(self, subs: Iterable[Sub]) -> None:
        """Bulk load: index every sub, then rebuild the frozen CSRs once."""
        rmin = self.rebuild_min
        self.rebuild_min = sys.maxsize  # no intermediate rebuilds
        try:
            for sub in subs:
                self.add(sub)
        finally:
            self.rebuild_min = rmin
        self.rebuild()

    def remove(self, key: int) -> bool:
        """Drop a subscription; returns False if the key was not indexed."""
        if key not in self:
            return False
        s = int(self._key_to_slot[key])
        self._key_to_slot[key] = -1
        self.s_alive[s] = False
        self._count(s, -1)
        self._live -= 1
        if s < self._main_slots:
            self._main_dead += 1
            if self._main_dead > self._threshold():
                self.rebuild()
        else:
            self._delta = None
        return True

    def rebuild(self) -> None:
        """Compact live slots and rebuild the frozen CSRs from all of them."""
        live = np.flatnonzero(self.s_alive[: self._n])
        kwlen = self.s_kwlen[live].astype(np.int64)
        kwst = self.s_kwstart[live]
        tot = int(kwlen.sum())
        rank = np.arange(tot, dtype=np.int64) - np.repeat(np.cumsum(kwlen) - kwlen, kwlen)
        new_pool = self._kw_pool[np.repeat(kwst, kwlen) + rank]
        for name, _ in self._SLOT_ARRAYS:
            arr = getattr(self, name)
            new = np.zeros_like(arr)
            new[: live.size] = arr[live]
            setattr(self, name, new)
        self._n = int(live.size)
        self.s_kwstart[: self._n] = np.cumsum(kwlen) - kwlen
        self._kw_pool = np.empty(max(1024, tot + tot // 4), dtype=np.int32)
        self._kw_pool[:tot] = new_pool
        self._kw_used = tot
        self._key_to_slot[:] = -1
        self._key_to_slot[self.s_key[: self._n]] = np.arange(self._n, dtype=np.int32)
        self._main = self._build(np.arange(self._n, dtype=np.int64))
        self._main_slots = self._n
        self._main_dead = 0
        self._delta = None
        self.rebuilds += 1

    def keyword_summary(self) -> frozenset[str] | None:
        """Tornado §4's textual summary of the live subscriptions: a set of words such that an
        object holding none of them matches none of the subscriptions, whatever its position;
        None when some subscription needs no keyword (any object may match it). A "match any"
        subscription gives all its words; a "match all" one only its longest (an object without
        that word cannot hold them all; longer words tend to be rarer, so fewer objects pass)."""
        live = np.flatnonzero(self.s_alive[: self._n])
        kwlen = self.s_kwlen[live].astype(np.int64)
        if (kwlen == 0).any():
            return None
        need_all = self.s_need[live] > 1
        starts = self.s_kwstart[live]
        # every (slot, word) of the live slots, then one word kept per match-all slot
        owner = np.repeat(np.arange(live.size, dtype=np.int64), kwlen)
        rank = np.arange(owner.size, dtype=np.int64) - np.repeat(np.cumsum(kwlen) - kwlen, kwlen)
        ids = self._kw_pool[np.repeat(starts, kwlen) + rank].astype(np.int64)
        if need_all.any():
            word_len = np.fromiter(map(len, self._words), dtype=np.int64, count=len(self._words))
            longest_first = np.lexsort((-word_len[ids], owner))
            keep = np.zeros(owner.size, dtype=bool)
            keep[longest_first[_run_starts(owner[longest_first])]] = True
            keep |= ~need_all[owner]
            ids = ids[keep]
        words = self._words
        return frozenset(words[i] for i in distinct(ids).tolist())

    def memory_bytes(self) -> int:
        """Estimated bytes held by the index (numpy arrays + vocabulary)."""
        total = self._kw_pool.nbytes + self._key_to_slot.nbytes
        total += sum(c.nbytes for c in self._main)
        if self._delta is not None:
            total += sum(c.nbytes for c in self._delta)
        for name, _ in self._SLOT_ARRAYS:
            total += int(getattr(self, name).nbytes)
        total += sys.getsizeof(self._vocab)
        total += sum(sys.getsizeof(w) + 28 for w in self._vocab)
        return total

    def match(
        self,
        lon: F64 | Sequence[float],
        lat: F64 | Sequence[float],
        keywords: Sequence[Sequence[str]],
    ) -> MatchResult:
        """Match a batch of objects: (object index, sub key) pairs, each once, in no particular
        order."""
        lon = np.asarray(lon, dtype=np.float64)
        lat = np.asarray(lat, dtype=np.float64)
        n = lon.shape[0]
        if len(keywords) != n:
            raise ValueError("keywords must have one entry per object")
        empty = (np.empty(0, dtype=np.int64), np.empty(0, dtype=np.int64))
        if n == 0 or self._live == 0:
            return empty
        has_delta = self._n > self._main_slots
        if has_delta and self._delta is None:
            self._delta = self._build(np.arange(self._main_slots, self._n, dtype=np.int64))
        kobj, kw = self._object_keywords(keywords) if any(self._bucket_live[1::2]) else (
            np.empty(0, dtype=np.int64), np.empty(0, dtype=np.int64))
        batch = _Batch(lon, lat)
        cells: dict[int, I64] = {}
        # Spatial-only buckets give each pair once (a sub sits in one bucket, an object probes
        # one cell per level); keyword buckets can give a pair once per shared keyword.
        parts: tuple[list[I64], list[I64]] = ([], [])
        for b in range(_N_BUCKETS):
            if not self._bucket_live[b]:
                continue
            level = b >> 1
            cell = cells.get(level)
            if cell is None:
                cell = cells[level] = self._cells(level, lon, lat)
            if b & 1:
                if kobj.size == 0:
                    continue
                probes, pobj = (cell[kobj] << 32) | kw, kobj
            else:
                probes, pobj = cell << 32, np.arange(n, dtype=np.int64)
            o, s = self._main[b].lookup(probes, pobj)
            if self._main_dead:
                keep = self.s_alive[s]
                o, s = o[keep], s[keep]
            if self._delta is not None:
                o2, s2 = self._delta[b].lookup(probes, pobj)
                if o2.size:
                    o, s = np.concatenate((o, o2)), np.concatenate((s, s2))
            if level != _KEYWORD_LEVEL and o.size:
                o, s = self._verify(batch, o, s)
            if o.size:
                parts[b & 1].append((o << 32) | s)
        spatial, textual = parts
        if textual:
            # Sorted (object, slot) codes: the pairs an object hits through several of its
            # keywords are adjacent.
            code = np.concatenate(textual) if len(textual) > 1 else textual[0]
            # a few runs sorted by object already (one per bucket); equal codes are equal
            # pairs, so any sort gives the same array (`_CODE_SORT`)
            code.sort(kind=_CODE_SORT)
            starts = _run_starts(code)
            if self._n_all:
                # CONTAINS: a pair matches when every keyword of the sub hit (object keywords
                # are deduplicated in _object_keywords, sub keywords in Sub: hits == shared
                # keywords).
                counts = np.diff(starts, append=code.size)
                code = code[starts]
                spatial.append(code[counts >= self.s_need[code & _LOW32]])
            else:
                spatial.append(code[starts])
        if not spatial:
            return empty
        ucode = np.concatenate(spatial) if len(spatial) > 1 else spatial[0]
        return ucode >> 32, self.s_key[ucode & _LOW32]

    # ---- internals -------------------------------------------------------------------------

    def _threshold(self) -> int:
        if self.rebuild_min == sys.maxsize:
            return sys.maxsize
        return max(self.rebuild_min, int(self.rebuild_fraction * self._live))

    def _place(self, bbox: BBox) -> tuple[int, int, int, int, int]:
        x0, y0, x1, y1 = self.grid.cell_range(bbox)
        if (x1 - x0 + 1) * (y1 - y0 + 1) <= _MAX_CELLS:
            return 0, x0, y0, x1, y1
        # Coarse cells from fine cell coordinates: the same floor formula, so consistent.
        x0, y0, x1, y1 = x0 // _COARSE, y0 // _COARSE, x1 // _COARSE, y1 // _COARSE
        if (x1 - x0 + 1) * (y1 - y0 + 1) <= _MAX_CELLS:
            return 1, x0, y0, x1, y1
        return 2, 0, 0, 0, 0

    def _count(self, s: int, d: int) -> None:
        self._bucket_live[int(self.s_bucket[s])] += d
        if self.s_need[s] > 1:
            self._n_all += d

    def _cells(self, level: int, lon: F64, lat: F64) -> I64:
        if level >= 2:
            return np.zeros(lon.shape[0], dtype=np.int64)
        cx, cy = self.grid.cells_of(lon, lat)
        if level == 0:
            return cy.astype(np.int64) * self.grid.nx + cx
        return (cy.astype(np.int64) // _COARSE) * self._cnx + cx // _COARSE

    def _object_keywords(self, keywords: Sequence[Sequence[str]]) -> tuple[I64, I64]:
        """Deduplicated (object, keyword id) pairs; words no sub uses are dropped."""
        n = len(keywords)
        lens = np.fromiter(map(len, keywords), dtype=np.int64, count=n)
        ids = np.fromiter(map(self._vocab.get, chain.from_iterable(keywords), repeat(-1)),
                          dtype=np.int64, count=int(lens.sum()))
        kobj = np.repeat(np.arange(n, dtype=np.int64), lens)
        known = ids > 0
        kcode = (kobj[known] << 32) | ids[known]
        kcode.sort(kind="stable")  # sorted by object already: timsort sorts each one's few
        if kcode.size > 1:
            kcode = kcode[_run_starts(kcode)]
        return kcode >> 32, kcode & _LOW32

    def _build(self, slots: I64) -> list[_Csr]:
        """One CSR per bucket over the given (live) slots."""
        slots = slots[self.s_alive[slots]]
        bucket = self.s_bucket[slots]
        out: list[_Csr] = []
        for b in range(_N_BUCKETS):
            keys, vals = self._entries(slots[bucket == b], b >> 1)
            out.append(_Csr(keys, vals))
        return out

    def _entries(self, slots: I64, level: int) -> tuple[I64, I32]:
        """(cell << 32 | kw, slot) for every cell x keyword of each slot, vectorised."""
        if slots.size == 0:
            return _empty_pairs()
        x0 = self.s_x0[slots].astype(np.int64)
        y0 = self.s_y0[slots].astype(np.int64)
        w = self.s_x1[slots].astype(np.int64) - x0 + 1
        h = self.s_y1[slots].astype(np.int64) - y0 + 1
        ncell = w * h
        # One row per (slot, cell).
        tot = int(ncell.sum())
        rep = np.repeat(np.arange(slots.size), ncell)
        j = np.arange(tot, dtype=np.int64) - np.repeat(np.cumsum(ncell) - ncell, ncell)
        wr = w[rep]
        row_nx = (self.grid.nx, self._cnx, 1, 1)[level]
        cell = (y0[rep] + j // wr) * row_nx + x0[rep] + j % wr
        # One entry per (slot, cell, keyword); spatial-only subs use keyword _NO_KW.
        kwlen = self.s_kwlen[slots].astype(np.int64)
        nk = np.maximum(kwlen, 1)[rep]
        tot2 = int(nk.sum())
        rep2 = np.repeat(np.arange(tot, dtype=np.int64), nk)
        k = np.arange(tot2, dtype=np.int64) - np.repeat(np.cumsum(nk) - nk, nk)
        srep = rep[rep2]
        has_kw = kwlen[srep] > 0
        kwpos = self.s_kwstart[slots][srep] + k
        kw = np.where(has_kw, self._kw_pool[np.where(has_kw, kwpos, 0)], _NO_KW)
        keys = (cell[rep2] << 32) | kw.astype(np.int64)
        return keys, slots[srep].astype(np.int32)

    def _verify(self, batch: _Batch, objs: I64, slots: I32) -> tuple[I64, I32]:
        """Keep candidate pairs whose object lies in the sub's bbox / circle."""
        x = batch.lon.take(objs)
        y = batch.lat.take(objs)
        b = np.take(self.s_bbox, slots, axis=0)  # one row gather beats four column gathers
        i = np.flatnonzero((b[:, 0] <= x) & (b[:, 2] >= x) & (b[:, 1] <= y) & (b[:, 3] >= y))
        objs, slots = objs.take(i), slots.take(i)
        ci = np.flatnonzero(self.s_circle.take(slots))
        if ci.size:
            out = ci[~self._in_circles(batch, objs.take(ci), slots.take(ci))]
            if out.size:
                keep = np.ones(objs.size, dtype=np.bool_)
                keep[out] = False
                objs, slots = objs[keep], slots[keep]
        return objs, slots

    def _in_circles(self, batch: _Batch, objs: I64, slots: I32) -> Bool:
        """haversine_m(centre, object) <= radius, decided exactly as the oracle decides it.

        The haversine term is chord^2 / 4 between the unit vectors of centre and object (no
        trigonometry per pair); pairs in the band around the radius where rounding could
        disagree with haversine_m are re-checked with haversine_m itself.
        """
        d = np.take(batch.xyz, objs, axis=0)
        d -= np.take(self.s_cxyz, slots, axis=0)
        a: F64 = np.einsum("ij,ij->i", d, d)
        a *= 0.25
        inside: Bool = a < self.s_hlo.take(slots)
        unsure = ~inside & (a <= self.s_hhi.take(slots))
        if unsure.any():
            u = np.flatnonzero(unsure)
            su, ou = slots.take(u), objs.take(u)
            dist = haversine_m(self.s_clon.take(su), self.s_clat.take(su),
                               batch.lon.take(ou), batch.lat.take(ou))
            inside[u] = dist <= self.s_rad.take(su)
        return inside
