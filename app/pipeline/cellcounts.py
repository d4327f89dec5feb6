"""The workers' per-cell counts as an api process holds them (CheetahGIS §IV: the routers keep
per-cell object counts, refreshed from the workers' reports), for count queries over whole
cells.

Each worker writes, per tenant and arrival bucket, its counts and their version to its hash
`names.cell_counts_key`, with the mark of the entry of its stream they count up to, in one
transaction. An api process holds what it read, per worker and tenant, and reads again only
the counts whose version changed (`READ_SCRIPT`: one round trip, which also reads the mark,
so that what it returns is one consistent state of the hash). Under a steady load that is the
current bucket's counts; the window's older buckets do not change.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from app.core.redis import run_script
from app.geo.grid import Grid
from app.pipeline import names, wire
from app.pipeline.cluster import entry_order

# Lua: call visit(bucket) for each bucket of a tenant's counts in [first, last] that a worker's
# counts hash lists (`names.cell_counts_index_field`), in order; in a hash without the lists
# (field `indexed` absent: a worker of an earlier version), for every bucket of the range.
# Visiting the buckets listed, not every bucket the range could hold: an hour of 1 s buckets
# is 3 600 of them, most empty.
EACH_BUCKET_LUA = """
local function each_bucket(key, tenant, first, last, indexed, visit)
  if redis.call('HEXISTS', key, indexed) == 0 then
    for bucket = first, last do visit(bucket) end
    return
  end
  local listed = redis.call('HGET', key, tenant .. '\\31#') or ''
  for b in string.gmatch(listed, '-?%d+') do
    local bucket = tonumber(b)
    if bucket >= first and bucket <= last then visit(bucket) end
  end
end
"""

# KEYS[1] = a worker's counts hash; ARGV = its mark field, the tenant, the first and last
# arrival buckets to read, the buckets the reader holds counts of among them with their
# versions ("bucket version" lines), the field saying the hash lists each tenant's buckets,
# the version field of the tenant's list of buckets (rewritten with any of its counts) and
# the version of it the reader holds ('' for none, or when what it holds does not cover the
# buckets asked). Returns the mark (nil if none), the version of the tenant's list ('' for
# none), and unless that is the one held (nothing of the tenant's changed), a triple (field,
# version, counts) per bucket whose version differs from the one held ('' for both when it
# is gone): of the buckets listed (`EACH_BUCKET_LUA`), then of those held but no longer
# listed.
READ_SCRIPT = EACH_BUCKET_LUA + """
local out = {redis.call('HGET', KEYS[1], ARGV[1]), redis.call('HGET', KEYS[1], ARGV[7]) or ''}
if out[2] ~= '' and out[2] == ARGV[8] then return out end
local held = {}
for bucket, version in string.gmatch(ARGV[5], '(-?%d+) ([^\\n]*)') do
  held[tonumber(bucket)] = version
end
local function visit(bucket)
  local field = ARGV[2] .. '\\31' .. string.format('%d', bucket)
  local version = redis.call('HGET', KEYS[1], field .. '\\30v') or ''
  if version ~= (held[bucket] or '') then
    out[#out + 1] = field
    out[#out + 1] = version
    out[#out + 1] = (version ~= '' and redis.call('HGET', KEYS[1], field)) or ''
  end
  held[bucket] = nil
end
each_bucket(KEYS[1], ARGV[2], tonumber(ARGV[3]), tonumber(ARGV[4]), ARGV[6], visit)
local rest = {}
for bucket in pairs(held) do rest[#rest + 1] = bucket end
table.sort(rest)
for _, bucket in ipairs(rest) do visit(bucket) end
return out
"""

# KEYS[1] = a worker's counts hash; ARGV = the tenant, the first and last arrival buckets, the
# field saying the hash lists each tenant's buckets. Returns the counts of the tenant's
# buckets in that range (`EACH_BUCKET_LUA`).
TOTALS_SCRIPT = EACH_BUCKET_LUA + """
local out = {}
local function take(bucket)
  local counts = redis.call('HGET', KEYS[1], ARGV[1] .. '\\31' .. string.format('%d', bucket))
  if counts then out[#out + 1] = counts end
end
each_bucket(KEYS[1], ARGV[1], tonumber(ARGV[2]), tonumber(ARGV[3]), ARGV[4], take)
return out
"""


def read_totals(pipe: Any, script: Any, workers: list[str], tenant: str, buckets: range
                ) -> None:
    """Queue the read of the workers' counts of the tenant's `buckets` (a range of step 1) on
    `pipe`: one reply per worker, the list of its buckets' `wire.CellCounts` (for
    `knnreg.cell_totals`); `script` is TOTALS_SCRIPT registered on the client."""
    for worker in workers:
        run_script(pipe, script, [names.cell_counts_key(worker)],
                   [tenant, buckets.start, buckets.stop - 1, names.CELL_COUNTS_INDEXED])


@dataclass(frozen=True)
class BucketCounts:
    """One bucket's counts of one tenant on one worker: cells (x, y) and their records, in the
    order of their cell ids (row after row: `cy` never decreases)."""

    version: bytes
    bucket: int
    cx: Any
    cy: Any
    counts: Any


RUN = 1 << 32  # a cell's row in `Summed.keys` (beyond any column of any grid)
# The newest buckets held are summed on their own at each count (they still change: under
# load, at every read); the older ones into one `Summed`, brought up to date by difference.
RECENT_BUCKETS = 2
Array = Any  # (a numpy array)


@dataclass(frozen=True)
class Summed:
    """Some buckets' counts summed per cell: the cells (keys `cy * RUN + cx`, ascending,
    distinct) and the running sum of their records (`below[i]`: those of the cells before
    `keys[i]`), so that the records of a run of cells are a difference of two running sums;
    `fields`: the counts summed (a `BucketCounts` is one version of a bucket's)."""

    fields: dict[str, BucketCounts]
    keys: Array
    below: Array

    @staticmethod
    def of(fields: dict[str, BucketCounts]) -> Summed:
        held = [h for h in fields.values() if h.counts.size]
        if not held:
            return Summed(dict(fields), np.empty(0, dtype=np.int64), np.zeros(1, dtype=np.int64))
        keys, counts = _summed(np.concatenate([_keys(h) for h in held]),
                               np.concatenate([h.counts for h in held]))
        return Summed(dict(fields), keys, _running(counts))

    def changed(self, fields: dict[str, BucketCounts]) -> Summed:
        """The sum of `fields`, from this one: the counts it sums that are gone or changed
        taken out, those new or changed added (a pass over its cells, not a sort of all)."""
        gone = [h for f, h in self.fields.items() if fields.get(f) is not h]
        new = [h for f, h in fields.items() if self.fields.get(f) is not h]
        if not gone and not new:
            return self
        if 2 * (len(gone) + len(new)) > len(fields):  # most of it changed: summed anew
            return Summed.of(fields)
        keys, counts = self.keys, np.diff(self.below)
        if gone:
            out_keys, out_counts = _summed(np.concatenate([_keys(h) for h in gone]),
                                           np.concatenate([h.counts for h in gone]))
            counts[np.searchsorted(keys, out_keys)] -= out_counts  # (all of them are here)
        if new:
            in_keys, in_counts = _summed(np.concatenate([_keys(h) for h in new]),
                                         np.concatenate([h.counts for h in new]))
            at: Array = np.searchsorted(keys, in_keys)
            here = at < keys.size
            here[here] = keys[at[here]] == in_keys[here]
            counts[at[here]] += in_counts[here]
            if not here.all():  # cells not held yet: inserted in order
                keys = np.insert(keys, at[~here], in_keys[~here])
                counts = np.insert(counts, at[~here], in_counts[~here])
        held = counts != 0  # (cells whose records are all gone)
        if not held.all():
            keys, counts = keys[held], counts[held]
        return Summed(dict(fields), keys, _running(counts))

    def count(self, cells: tuple[int, int, int, int]) -> int:
        """The records in the cells (x0, y0, x1, y1): the run of each row, searched."""
        return _count(self.keys, self.below, cells)


def _keys(h: BucketCounts) -> Array:
    return h.cy.astype(np.int64) * RUN + h.cx


def _summed(keys: Array, counts: Array) -> tuple[Array, Array]:
    """Counts of the same key summed, keys ascending (those whose counts sum to 0 left out):
    over the rectangle of rows and columns they span when it is not much larger than they
    are many (a bincount), else by a sort."""
    if not keys.size:
        return keys, counts
    cy, cx = keys // RUN, keys % RUN
    first = int(cy.min())
    width, height = int(cx.max()) + 1, int(cy.max()) - first + 1
    if width * height <= 8 * keys.size + (1 << 16):
        dense = np.bincount((cy - first) * width + cx, weights=counts,
                            minlength=width * height)
        at = np.flatnonzero(dense)
        return (at // width + first) * RUN + at % width, dense[at].astype(np.int64)
    keys, at = np.unique(keys, return_inverse=True)
    summed = np.bincount(at.ravel(), weights=counts, minlength=keys.size).astype(np.int64)
    held = summed != 0
    return keys[held], summed[held]


def _running(counts: Array) -> Array:
    below = np.zeros(counts.size + 1, dtype=np.int64)
    np.cumsum(counts, out=below[1:])
    return below


def _count(keys: Array, below: Array, cells: tuple[int, int, int, int]) -> int:
    x0, y0, x1, y1 = cells
    rows = np.arange(y0, y1 + 1, dtype=np.int64) * RUN
    a = np.searchsorted(keys, rows + x0)
    b = np.searchsorted(keys, rows + x1 + 1)
    return int((below[b] - below[a]).sum())


@dataclass
class HeldCounts:
    """A worker's counts of one tenant as read at one moment: the mark of the entry of its
    stream they count up to (None: not written yet) and the counts per field."""

    mark: bytes | None
    fields: dict[str, BucketCounts]
    # the buckets read (the counts are all of the tenant's there), and the version of the
    # tenant's list of buckets then (None: none written, by a worker of an earlier version)
    read: range = range(0)
    version: bytes | None = None
    # the buckets before the newest RECENT_BUCKETS summed (`count`, made on first use from
    # `prior`: the sum of the counts held before, if any)
    summed: Summed | None = None
    prior: Summed | None = None
    # the "bucket version" lines of the fields in a range (`CellCounts.read`)
    lines: tuple[range, bytes] | None = None

    def held_lines(self, buckets: range) -> bytes:
        """The "bucket version" lines of the counts held among `buckets` (the script's)."""
        if self.lines is None or self.lines[0] != buckets:
            self.lines = (buckets, b"\n".join(b"%d %s" % (h.bucket, h.version)
                                               for h in self.fields.values()
                                               if h.bucket in buckets))
        return self.lines[1]

    def count(self, cells: tuple[int, int, int, int], horizon: int) -> int:
        """The records in the cells (x0, y0, x1, y1) of the buckets from `horizon` on: those of
        the older buckets from their sum (`Summed`, kept from one state of the counts to the
        next), those of the newest RECENT_BUCKETS each on its own (a search of each row of
        cells: a box of a few degrees reads a few runs of each)."""
        fields = self.fields
        if not fields:
            return 0
        if any(h.bucket < horizon for h in fields.values()):  # (older buckets left out)
            return sum(_count(_keys(h), _running(h.counts), cells)
                       for h in fields.values() if h.bucket >= horizon)
        cut = sorted({h.bucket for h in fields.values()})[-RECENT_BUCKETS:][0]
        if self.summed is None:
            older = {f: h for f, h in fields.items() if h.bucket < cut}
            self.summed = (Summed.of(older) if self.prior is None
                           else self.prior.changed(older))
            self.prior = None
        return self.summed.count(cells) + sum(
            _count(_keys(h), _running(h.counts), cells)
            for h in fields.values() if h.bucket >= cut)


@dataclass(frozen=True)
class Reading:
    """Reads queued on a pipeline (`CellCounts.read`): of whose counts, of which buckets,
    against what was held then, and where their replies start among the pipeline's."""

    workers: list[str]
    tenant: str
    buckets: range
    bases: list[HeldCounts | None]
    first: int


class CellCounts:
    """The counts this api process has read, per (worker, tenant)."""

    def __init__(self, redis: Any) -> None:
        self.held: dict[tuple[str, str], HeldCounts] = {}
        self._read = redis.register_script(READ_SCRIPT)

    def read(self, pipe: Any, workers: list[str], tenant: str, buckets: range) -> Reading:
        """Queue the read of the workers' counts of the tenant's arrival `buckets` (a range
        of step 1) on `pipe` (give the pipeline's replies to `absorb`)."""
        first = len(pipe)
        bases = [self.held.get((w, tenant)) for w in workers]
        listed = names.cell_counts_version_field(names.cell_counts_index_field(tenant))
        for worker, base in zip(workers, bases, strict=True):
            # (the version held only says "nothing changed" if what was read covers these
            # buckets)
            version = (base.version if base is not None and base.version is not None
                       and base.read.start <= buckets.start and buckets.stop <= base.read.stop
                       else b"")
            run_script(pipe, self._read, [names.cell_counts_key(worker)],
                       [names.CELL_COUNTS_UPTO, tenant, buckets.start, buckets.stop - 1,
                        b"" if base is None else base.held_lines(buckets),
                        names.CELL_COUNTS_INDEXED, listed, version])
        return Reading(workers, tenant, buckets, bases, first)

    def absorb(self, reading: Reading, results: list[Any], grid: Grid) -> list[HeldCounts]:
        """The counts read, per worker (`results`: the replies of the pipeline `reading` was
        queued on)."""
        replies = results[reading.first:reading.first + len(reading.workers)]
        return [self._absorb(w, reading.tenant, reading.buckets, base, reply, grid)
                for w, base, reply in zip(reading.workers, reading.bases, replies, strict=True)]

    def _absorb(self, worker: str, tenant: str, buckets: range, base: HeldCounts | None,
                reply: list[Any], grid: Grid) -> HeldCounts:
        """One worker's counts read (`reply`, against `base`); held from now on unless a
        later state is held already."""
        kept = {} if base is None else {f: h for f, h in base.fields.items()
                                        if h.bucket in buckets}
        mark = None if reply[0] is None else _bytes(reply[0])
        listed = _bytes(reply[1]) or None  # (the version of the tenant's list of buckets)
        if base is not None and len(reply) == 2 and len(kept) == len(base.fields):
            # nothing changed: the same counts (and their sum), a newer mark
            now = HeldCounts(mark=mark, fields=base.fields, read=buckets, version=listed,
                             summed=base.summed, prior=base.prior, lines=base.lines)
            return self._keep(worker, tenant, now)
        for i in range(2, len(reply), 3):
            field = _text(reply[i])
            version, raw = reply[i + 1], reply[i + 2]
            if not version:
                kept.pop(field, None)
                continue
            for bucket, ids, counts in wire.decode_cell_counts(raw).buckets:
                cid = np.frombuffer(ids, dtype="<i8")
                n = np.frombuffer(counts, dtype="<i8")
                if cid.size > 1 and not (cid[1:] >= cid[:-1]).all():
                    # written unsorted (a worker of an earlier version): sorted once here
                    order = np.argsort(cid, kind="stable")
                    cid, n = cid[order], n[order]
                kept[field] = BucketCounts(version=_bytes(version), bucket=bucket,
                                           cx=cid % grid.nx, cy=cid // grid.nx, counts=n)
        prior = None if base is None else base.summed or base.prior
        return self._keep(worker, tenant, HeldCounts(mark=mark, fields=kept, read=buckets,
                                                     version=listed, prior=prior))

    def _keep(self, worker: str, tenant: str, now: HeldCounts) -> HeldCounts:
        """Hold `now` from now on unless a later state is held already."""
        mark = now.mark
        current = self.held.get((worker, tenant))
        if current is None or current.mark is None or (
                mark is not None and entry_order(mark) >= entry_order(current.mark)):
            self.held[(worker, tenant)] = now
        return now

    @staticmethod
    def caught_up(held: list[HeldCounts], tails: list[tuple[int, int]]) -> bool:
        """Whether each worker's counts include the entry of its tail."""
        return all(h.mark is not None and entry_order(h.mark) >= tail
                   for h, tail in zip(held, tails, strict=True))


def _bytes(value: Any) -> bytes:
    return value if isinstance(value, bytes) else str(value).encode()


def _text(value: Any) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)
