"""The load-balancing protocol between the coordinator, the workers and the admin API (SWARM
§4.3, §5): Redis key names, command and report formats, and the fenced plan change.

Commands travel in a per-worker command stream `gs:cmd:<worker>` (consumer group "exec", read
in the same XREADGROUP call as the worker's object stream, so an idle worker wakes at once and a
busy one still sees commands between batches, not behind its backlog). Each is one msgpack map
in field `m` (same encoding as the object streams, `records.pack`):

- `{"t": "round", "n": 7}`: fold the statistics (Algorithm 2) and write a report (below) to the
  hash `report_key(7)` under the worker id, and to `STATS_KEY` (latest report per worker).
- `{"t": "reduce", "n", "to", "c_ml", "r_s", "ids": [2 ids], "version", "deadline", "reply"}`:
  mH's side of §4.3.2 with mL = `to`: subset-sum of whole partitions, else the best split;
  executed as a move / split (below); reply `{"action": "move"|"split"|"none", ...}`.
- `{"t": "move", "partitions": [ids], "to", "ids": [one new id per partition], "version",
  "deadline", "reply"}`.
- `{"t": "split", "partition", "axis": "x"|"y", "at": cell, "moved": "low"|"high"|None, "to",
  "ids": [low id, high id], "version", "deadline", "reply"}` (`moved` None: both halves stay).
- `{"t": "merge", "ids": [new ids, enough for every merge], "version", "deadline", "reply"}`:
  merge this worker's adjacent partitions that form rectangles.

`version` is the plan version the sender saw; a worker refuses (`{"ok": false, "error"}`) a
command whose version is no longer current or whose `deadline` (unix time) has passed, so a
worker paused through a round never executes a stale decision. Replies are JSON pushed to the
list `reply_key(token)`; the sender BLPOPs it.

Admin requests (the API → the leader coordinator): JSON pushed to `REQUESTS_KEY`:
`{"id": token, "kind": "round"}`, `{"id", "kind": "move", "partition", "to"}`,
`{"id", "kind": "split", "partition", "axis", "at"}`. The coordinator answers on
`reply_key(token)` with JSON `{"status": 202, "round", "action", "details"}` or
`{"status": 404|409|422|503, "error": "..."}`.

A worker's report (JSON): `{"worker", "round", "at", "num": Num(C(m)), "R": R(m), "partitions":
[{"id", "N", "Q", "R", "num"}]}`; C(p) = num / R(S), R(S) = sum of the reports' R.

Plan changes are applied by the owner of the partitions concerned with `PLAN_CAS_SCRIPT`: it
appends the handoffs to the receivers' streams, replaces the plan, appends it to the plan
history and publishes the new version, all atomically, and only if the stored version is still
the expected one (ownership is fenced by plan version).
"""

from __future__ import annotations

from typing import Any

GROUP = "exec"
LEASE_KEY = "gs:coord:lease"  # the active coordinator's id, with an expiry
REQUESTS_KEY = "gs:coord:requests"  # list: admin requests for the coordinator (JSON)
BALANCER_CONFIG = "gs:balancer:config"  # JSON {"enabled", "period_s", "beta"}
BALANCER_STATE = "gs:balancer:state"  # JSON: decision pointer, last round, costs
STATS_KEY = "gs:stats"  # hash worker -> its latest report (JSON)
ROUND_SEQ = "gs:balancer:round"  # counter of rounds (automatic and manual)
PART_SEQ = "gs:partition:seq"  # counter for new partition ids "p<n>"
PLAN_HISTORY = "gs:plan:history"  # list of JSON {"version", "valid_from", "plan"}
PLAN_HISTORY_MAX = 1000


def command_stream(worker: str) -> str:
    return f"gs:cmd:{worker}"


def report_key(round_no: int) -> str:
    return f"gs:report:{round_no}"


def reply_key(token: str) -> str:
    return f"gs:reply:{token}"


def partition_ids(first: int, n: int) -> list[str]:
    """The ids INCRBY PART_SEQ n returned `first + n - 1` for: p<first>.. p<first+n-1>."""
    return [f"p{i}" for i in range(first, first + n)]


# KEYS[1] = plan, KEYS[2] = plan history, KEYS[3..] = streams receiving a handoff.
# ARGV[1] = expected version, ARGV[2] = new plan JSON, ARGV[3] = new version, ARGV[4] = now,
# ARGV[5] = plan channel, ARGV[6] = history entry JSON, ARGV[7..] = handoff payloads (packed).
# Returns 1 when applied, 0 when the stored plan is not at the expected version.
PLAN_CAS_SCRIPT = """
local raw = redis.call('GET', KEYS[1])
if not raw then return 0 end
local cur = cjson.decode(raw)
if tostring(cur['version']) ~= ARGV[1] then return 0 end
for i = 3, #KEYS do
  redis.call('XADD', KEYS[i], '*', 'm', ARGV[4 + i])
end
redis.call('SET', KEYS[1], ARGV[2])
redis.call('RPUSH', KEYS[2], ARGV[6])
redis.call('LTRIM', KEYS[2], -tonumber(ARGV[7 + #KEYS - 2] or 1000), -1)
redis.call('PUBLISH', ARGV[5], ARGV[3])
return 1
"""


def history_entry(plan_json: str, version: int, now: float) -> str:
    """One plan-history element: the plan and when it became valid (SSTD's versioned mapping,
    SWARM §5.2's partition chains: snapshot queries find data written under older plans)."""
    return f'{{"version":{version},"valid_from":{now!r},"plan":{plan_json}}}'


def plan_cas_args(expected: int, plan_json: str, version: int, now: float, channel: str,
                  handoffs: list[tuple[str, bytes]]) -> tuple[list[str], list[Any]]:
    """KEYS and ARGV for PLAN_CAS_SCRIPT. `handoffs` = [(stream, packed message)]."""
    from app.pipeline.records import PLAN_KEY

    keys = [PLAN_KEY, PLAN_HISTORY, *(s for s, _ in handoffs)]
    args: list[Any] = [str(expected), plan_json, str(version), repr(now), channel,
                       history_entry(plan_json, version, now), *(m for _, m in handoffs),
                       str(PLAN_HISTORY_MAX)]
    return keys, args
