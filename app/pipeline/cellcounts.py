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

# KEYS[1] = a worker's counts hash; ARGV = its mark field, the tenant, the first and last
# arrival buckets to read, and the versions the reader holds of those buckets' counts fields,
# in bucket order, joined by newlines ('' for none): a few arguments whatever the window's
# length (one per field was 145 us of the api's command packing per count query). Returns
# the mark (nil if none), then a triple (field, version, counts) per field whose version
# differs ('' for both when it is gone).
READ_SCRIPT = """
local out = {redis.call('HGET', KEYS[1], ARGV[1])}
local held = {}
for version in string.gmatch(ARGV[5] .. '\\n', '([^\\n]*)\\n') do held[#held + 1] = version end
local i = 0
for bucket = tonumber(ARGV[3]), tonumber(ARGV[4]) do
  i = i + 1
  local field = ARGV[2] .. '\\31' .. string.format('%d', bucket)
  local version = redis.call('HGET', KEYS[1], field .. '\\30v') or ''
  if version ~= (held[i] or '') then
    out[#out + 1] = field
    out[#out + 1] = version
    out[#out + 1] = (version ~= '' and redis.call('HGET', KEYS[1], field)) or ''
  end
end
return out
"""


@dataclass(frozen=True)
class BucketCounts:
    """One bucket's counts of one tenant on one worker: cells (x, y) and their records."""

    version: bytes
    bucket: int
    cx: Any
    cy: Any
    counts: Any


@dataclass(frozen=True)
class HeldCounts:
    """A worker's counts of one tenant as read at one moment: the mark of the entry of its
    stream they count up to (None: not written yet) and the counts per field."""

    mark: bytes | None
    fields: dict[str, BucketCounts]

    def count(self, cells: tuple[int, int, int, int], horizon: int) -> int:
        """The records in the cells (x0, y0, x1, y1) of the buckets from `horizon` on."""
        x0, y0, x1, y1 = cells
        total = 0
        for held in self.fields.values():
            if held.bucket < horizon or not held.counts.size:
                continue
            inside = (held.cx >= x0) & (held.cx <= x1) & (held.cy >= y0) & (held.cy <= y1)
            total += int(held.counts[inside].sum())
        return total


@dataclass(frozen=True)
class Reading:
    """Reads queued on a pipeline (`CellCounts.read`): of whose counts, against what was
    held then, and where their replies start among the pipeline's."""

    workers: list[str]
    tenant: str
    fields: list[str]
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
        fields = [names.cell_counts_field(tenant, b) for b in buckets]
        bases = [self.held.get((w, tenant)) for w in workers]
        for worker, base in zip(workers, bases, strict=True):
            held = base.fields if base is not None else {}
            versions = b"\n".join(held[f].version if f in held else b"" for f in fields)
            run_script(pipe, self._read, [names.cell_counts_key(worker)],
                       [names.CELL_COUNTS_UPTO, tenant, buckets.start, buckets.stop - 1,
                        versions])
        return Reading(workers, tenant, fields, bases, first)

    def absorb(self, reading: Reading, results: list[Any], grid: Grid) -> list[HeldCounts]:
        """The counts read, per worker (`results`: the replies of the pipeline `reading` was
        queued on)."""
        replies = results[reading.first:reading.first + len(reading.workers)]
        return [self._absorb(w, reading.tenant, reading.fields, base, reply, grid)
                for w, base, reply in zip(reading.workers, reading.bases, replies, strict=True)]

    def _absorb(self, worker: str, tenant: str, fields: list[str], base: HeldCounts | None,
                reply: list[Any], grid: Grid) -> HeldCounts:
        """One worker's counts read (`reply`, against `base`); held from now on unless a
        later state is held already."""
        kept = {f: base.fields[f] for f in fields if base is not None and f in base.fields}
        for i in range(1, len(reply), 3):
            field = _text(reply[i])
            version, raw = reply[i + 1], reply[i + 2]
            if not version:
                kept.pop(field, None)
                continue
            for bucket, ids, counts in wire.decode_cell_counts(raw).buckets:
                cid = np.frombuffer(ids, dtype="<i8")
                kept[field] = BucketCounts(version=_bytes(version), bucket=bucket,
                                           cx=cid % grid.nx, cy=cid // grid.nx,
                                           counts=np.frombuffer(counts, dtype="<i8"))
        mark = None if reply[0] is None else _bytes(reply[0])
        now = HeldCounts(mark=mark, fields=kept)
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
