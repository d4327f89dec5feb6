"""Published records as a columnar batch, and the one encoder/decoder pair per stream message."""

from __future__ import annotations

import itertools
import os
import secrets
from dataclasses import dataclass
from typing import Any

import msgpack

# Stream and key names. Everything geoswarm writes to Redis starts with "gs:".
PLAN_KEY = "gs:plan"
PLAN_CHANNEL = "gs:plan:changed"
WORKERS_KEY = "gs:workers"  # hash worker id -> json {pid, host, heartbeat, ...}
NOTIFY_CHANNEL = "gs:notify"  # workers -> hubs: subscriptions that have new history entries
REVOKED_CHANNEL = "gs:revoked"  # api -> hubs: revoked key ids
SUBS_CHANNEL = "gs:subs"  # api -> hubs: deleted / expired subscriptions
GROUP = "exec"
DEAD_LETTER = "gs:dead"


def worker_stream(worker: str) -> str:
    return f"gs:w:{worker}"


def history_key(sub_id: str) -> str:
    return f"gs:h:{sub_id}"


def history_last_key(sub_id: str) -> str:
    """The id of the last history entry ever written for a subscription. It outlives the
    history stream (which expires when quiet) so that a resume can tell a quiet subscription
    from one whose unread entries were trimmed."""
    return f"gs:hl:{sub_id}"


HISTORY_LAST_TTL_S = 30 * 24 * 3600


def positions_key(tenant: str) -> str:
    return f"gs:pos:{tenant}"


def records_key(tenant: str, bucket: int) -> str:
    return f"gs:rec:{tenant}:{bucket}"


def done_key(worker: str, entry_id: str) -> str:
    return f"gs:done:{worker}:{entry_id}"


_prefix = secrets.token_hex(4)
_counter = itertools.count()
_pid = os.getpid()


def _refresh_after_fork() -> None:
    global _prefix, _counter, _pid
    _prefix, _counter, _pid = secrets.token_hex(4), itertools.count(), os.getpid()


os.register_at_fork(after_in_child=_refresh_after_fork)


def new_event_ids(n: int) -> list[str]:
    """Server ids for events: a per-process random prefix and a counter (unique, cheap)."""
    return [f"o{_prefix}{next(_counter):x}" for _ in range(n)]


def new_record_ids(n: int) -> list[str]:
    return [f"r{_prefix}{next(_counter):x}" for _ in range(n)]


@dataclass
class RecordBatch:
    """One publish request after validation, column by column."""

    tenant: str
    ids: list[str]
    moving: list[bool]
    lon: list[float]
    lat: list[float]
    ts: list[float]
    keywords: list[list[str]]
    text: list[str | None]
    props: list[dict[str, Any] | None]
    size: int

    def record(self, i: int) -> dict[str, Any]:
        out: dict[str, Any] = {"id": self.ids[i], "lon": self.lon[i], "lat": self.lat[i],
                               "ts": self.ts[i], "keywords": self.keywords[i]}
        if self.text[i] is not None:
            out["text"] = self.text[i]
        if self.props[i] is not None:
            out["props"] = self.props[i]
        return out


def pack(msg: Any) -> bytes:
    return msgpack.packb(msg, use_bin_type=True)  # type: ignore[no-any-return]


def unpack(data: bytes) -> dict[str, Any]:
    return msgpack.unpackb(data, raw=False, strict_map_key=False)  # type: ignore[no-any-return]


def encode_objects(batch: RecordBatch, rows: list[int], rids: list[str],
                   prev: list[tuple[float, float] | None], late: list[bool],
                   exit_only: list[bool], decide_exit: list[bool], sent_at: float,
                   version: int) -> bytes:
    """A stream entry for one worker: the records it must evaluate, with their previous
    positions (for detect) and whether it only decides `exit` for them. `version` is the plan
    version the router used: a worker whose plan is newer re-routes the entry (SWARM §5.1)."""
    return pack({
        "t": "obj", "tn": batch.tenant, "at": sent_at, "v": version,
        "id": [batch.ids[i] for i in rows], "rid": [rids[i] for i in rows],
        "mv": [batch.moving[i] for i in rows],
        "lon": [batch.lon[i] for i in rows], "lat": [batch.lat[i] for i in rows],
        "ts": [batch.ts[i] for i in rows], "kw": [batch.keywords[i] for i in rows],
        "txt": [batch.text[i] for i in rows], "pr": [batch.props[i] for i in rows],
        "prev": [prev[i] for i in rows], "late": [late[i] for i in rows],
        "xo": [exit_only[i] for i in rows], "dx": [decide_exit[i] for i in rows],
    })


def encode_subs_added(subs: list[dict[str, Any]], version: int) -> bytes:
    return pack({"t": "sub+", "subs": subs, "v": version})


def encode_subs_removed(ids: list[str]) -> bytes:
    return pack({"t": "sub-", "ids": ids})
