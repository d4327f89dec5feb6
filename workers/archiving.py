"""A worker's flush of the buckets that left its live window to the archive, exactly once
(`app.archive.layout`): the bucket's files are committed first, then the worker's archive cut
is raised past the bucket, and its records leave memory only once the cut has passed them and
ARCHIVE_GRACE_S has gone by (queries started before the cut moved still find them).

A crash between the files and the cut writes the same files again (same names: those
committed already are kept); a crash after the cut loses nothing either: the window is read
back from the window log without the buckets at or below the cut. Records that reach a
bucket already archived (an entry processed late) are kept in the first bucket after the cut
(`RecordWindow.bucket_of`), and the bucket is logged with them, so a rebuild puts them where
they were.

The same runs for a dead worker's window held by its adopter (`workers.failover`), under the
dead worker's name: both write the same files, and the cut only rises.
"""

from __future__ import annotations

import logging
import os
import signal
import time
from pathlib import Path
from typing import Any

import redis

from app.archive.layout import NO_CUT, ArchiveStore
from app.archive.writer import write_bucket
from app.core.config import Settings
from app.geo.grid import Grid
from app.pipeline import names
from workers.records import RecordWindow

log = logging.getLogger(__name__)

ARCHIVE_GRACE_S = 30.0  # archived records stay in memory this long after their bucket left

# Raise a worker's cut to ARGV[2] unless it is higher already; returns the cut.
RAISE_CUT_SCRIPT = """
local cur = redis.call('HGET', KEYS[1], ARGV[1])
if not cur or tonumber(cur) < tonumber(ARGV[2]) then
  redis.call('HSET', KEYS[1], ARGV[1], ARGV[2])
  return tonumber(ARGV[2])
end
return tonumber(cur)
"""


# Tests crash a worker at the one point that matters (files committed, cut not raised yet) with
# a real SIGKILL: this names a file, and the first worker to reach the point while the file
# does not exist creates it and kills itself.
KILL_AFTER_WRITE_ENV = "GEOSWARM_TEST_ARCHIVE_KILL_MARKER"


def _crash_point() -> None:
    marker = os.environ.get(KILL_AFTER_WRITE_ENV)
    if not marker:
        return
    try:
        Path(marker).open("x").close()
    except FileExistsError:
        return
    os.kill(os.getpid(), signal.SIGKILL)


def read_cut(client: Any, worker: str) -> int:
    raw = client.hget(names.ARCHIVE_CUT, worker)
    return NO_CUT if raw is None else int(raw)


class Archiver:
    """The archive flush of one worker's window (`origin`: the worker that stored it)."""

    def __init__(self, client: Any, settings: Settings, grid: Grid, origin: str) -> None:
        self.redis = client
        self.settings = settings
        self.grid = grid
        self.origin = origin
        self.store = ArchiveStore(settings.archive_path)
        self.raise_cut = client.register_script(RAISE_CUT_SCRIPT)
        self.cut = read_cut(client, origin)
        # the greatest bucket whose records left memory: a query that reads the archive only
        # up to a lower cut would miss them here (it is asked to start again)
        self.dropped = NO_CUT
        self.flushed = 0  # buckets written by this process
        self.lag_s = 0.0  # how long the last bucket flushed had been out of the window

    def load(self) -> int:
        """The cut as stored (after a rebuild: the window holds only what is above it)."""
        self.cut = read_cut(self.redis, self.origin)
        self.dropped = max(self.dropped, self.cut)
        return self.cut

    def flush(self, window: RecordWindow, now: float) -> None:
        """Write every bucket held that left the window, then raise the cut past them."""
        horizon = window.horizon(now)
        if horizon - 1 <= self.cut:
            return
        wrote = False
        for bucket in sorted(b for b in window.buckets() if self.cut < b < horizon):
            for tenant, batches in sorted(window.bucket_batches(bucket).items()):
                write_bucket(self.store, tenant, bucket, self.settings.bucket_s, self.origin,
                             batches, self.grid)
                wrote = True
            self.flushed += 1
            self.lag_s = now - (bucket + 1) * self.settings.bucket_s - self.settings.window_s
        if wrote:
            _crash_point()
        self.cut = int(self.raise_cut(keys=[names.ARCHIVE_CUT], args=[self.origin, horizon - 1]))

    def through(self, window: RecordWindow, now: float) -> int:
        """The last bucket whose records may leave memory now."""
        through = min(self.cut, window.horizon(now - ARCHIVE_GRACE_S) - 1)
        self.dropped = max(self.dropped, through)
        return through

    def step(self, window: RecordWindow, now: float) -> None:
        """Flush what left the window and drop what is archived (a failed write is tried
        again at the next step; nothing leaves memory before it is archived)."""
        started = time.monotonic()
        try:
            self.flush(window, now)
        except redis.RedisError:
            raise  # the main loop's business (it retries and recovers)
        except Exception as exc:  # a store that refuses a write must not stop the worker
            log.error("archive flush of %s's window to %s failed (tried again at the next "
                      "pass; nothing leaves memory before it is archived): %s", self.origin,
                      self.store.url, exc)
        took = time.monotonic() - started
        if took > 1.0:
            log.info("archive flush of %s's window took %.1f s", self.origin, took)
        window.expire(now, self.through(window, now), settled_only=True)
