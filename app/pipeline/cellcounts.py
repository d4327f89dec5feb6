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

# KEYS[1] = a worker's counts hash; ARGV[1] = its mark field, then pairs: a counts field and
# the version the reader holds ('' for none). Returns the mark (nil if none), then a triple
# (field, version, counts) per field whose version differs ('' for both when it is gone).
READ_SCRIPT = """
local out = {redis.call('HGET', KEYS[1], ARGV[1])}
for i = 2, #ARGV, 2 do
  local version = redis.call('HGET', KEYS[1], ARGV[i] .. '\\30v') or ''
  if version ~= ARGV[i + 1] then
    out[#out + 1] = ARGV[i]
    out[#out + 1] = version
    out[#out + 1] = (version ~= '' and redis.call('HGET', KEYS[1], ARGV[i])) or ''
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

    def read(self, pipe: Any, workers: list[str], tenant: str, fields: list[str]) -> Reading:
        """Queue the read of the workers' counts of `fields` on `pipe` (give the pipeline's
        replies to `absorb`)."""
        first = len(pipe.command_stack)
        bases = [self.held.get((w, tenant)) for w in workers]
        for worker, base in zip(workers, bases, strict=True):
            args: list[Any] = [names.CELL_COUNTS_UPTO]
            for field in fields:
                held = base.fields.get(field) if base is not None else None
                args += [field, held.version if held is not None else b""]
            run_script(pipe, self._read, [names.cell_counts_key(worker)], args)
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
