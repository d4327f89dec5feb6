"""What every process reads about the cluster from Redis, one way each: the stored plan, which
workers are alive (their heartbeats), and new partition ids that never reuse one of a plan's.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from typing import Any

import orjson
import redis
import redis.asyncio as aioredis

from app.geo.index import Plan
from app.pipeline import names

# PART_SEQ := max(PART_SEQ, ARGV[1]), then INCRBY ARGV[2]: the last of ARGV[2] new id numbers
# (ARGV[2] = 0 only raises the floor). KEYS[1] = PART_SEQ.
ALLOCATE_IDS_SCRIPT = """
local cur = tonumber(redis.call('GET', KEYS[1]) or '-1')
if cur < tonumber(ARGV[1]) then redis.call('SET', KEYS[1], ARGV[1]) end
return redis.call('INCRBY', KEYS[1], ARGV[2])
"""


def part_seq_floor(plan: Plan) -> int:
    """The least PART_SEQ for a plan: ids handed out above it are none of the plan's ids nor
    of its partitions' parents ("p<n>"), nor of the initial plan's p0..p<k-1>."""
    nums = [int(i[1:]) for p in plan.partitions for i in (p.id, p.parent or "")
            if i[:1] == "p" and i[1:].isdigit()]
    return max([len(plan.partitions), *(n + 1 for n in nums)])


def partition_ids(last: int, count: int) -> list[str]:
    """The ids of the `count` numbers ALLOCATE_IDS_SCRIPT handed out, ending at `last`."""
    return [f"p{i}" for i in range(last - count + 1, last + 1)]


def read_plan(client: redis.Redis) -> Plan | None:
    raw = client.get(names.PLAN_KEY)
    return None if raw is None else Plan.from_json(raw)


async def load_plan(client: aioredis.Redis) -> Plan | None:
    raw = await client.get(names.PLAN_KEY)
    return None if raw is None else Plan.from_json(raw)


def heartbeat_fresh(raw: bytes | str | dict[str, Any] | None, now: float,
                    dead_after_s: float) -> bool:
    """Whether a worker's heartbeat (its JSON in `names.WORKERS_KEY`) is recent enough for
    the worker to count as alive; anything unreadable is not."""
    info: Any = raw
    if isinstance(raw, bytes | str):
        try:
            info = orjson.loads(raw)
        except orjson.JSONDecodeError:
            return False
    if not isinstance(info, dict):
        return False
    beat = info.get("heartbeat")
    if isinstance(beat, bool) or not isinstance(beat, int | float) or not math.isfinite(beat):
        return False
    return now - beat <= dead_after_s


def live_workers(heartbeats: Iterable[tuple[bytes | str, bytes | str]], now: float,
                 dead_after_s: float) -> list[str]:
    """The ids of the workers whose heartbeat is fresh, sorted (from HGETALL WORKERS_KEY)."""
    return sorted((w.decode() if isinstance(w, bytes) else w) for w, raw in heartbeats
                  if heartbeat_fresh(raw, now, dead_after_s))


def entry_order(eid: bytes | str) -> tuple[int, int]:
    """A stream entry id as a comparable (milliseconds, sequence)."""
    text = eid.decode() if isinstance(eid, bytes) else eid
    ms, _, seq = text.partition("-")
    return int(ms), int(seq or 0)
