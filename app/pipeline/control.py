"""The fenced plan change of SWARM's load balancing (§4.3, §5) and its helpers.

Commands to the workers are `wire.Command` messages in each worker's command stream (read in
the same XREADGROUP call as its object stream, so an idle worker wakes at once and a busy one
sees commands between batches, not behind its backlog); replies are JSON pushed to the list
`names.reply_key(token)`, which the sender BLPOPs. A worker's load report (JSON) goes to the
hash `names.report_key(round)` under the worker id and to `names.STATS_KEY`:
`{"worker", "round", "at", "num": Num(C(m)), "R": R(m), "partitions": [{"id", "N", "Q", "R",
"num"}]}`; C(p) = num / R(S), R(S) = the sum of the reports' R.

Admin requests (the API -> the leader coordinator) are JSON pushed to `names.REQUESTS_KEY`:
`{"id": token, "kind": "round"}`, `{"id", "kind": "move", "partition", "to"}`,
`{"id", "kind": "split", "partition", "axis", "at"}`; the coordinator answers on
`names.reply_key(token)` with `{"status": 202, "round", "action", "details"}` or
`{"status": 404|409|422|503, "error": "..."}`.

Plan changes are applied by the owner of the partitions concerned with `PLAN_CAS_SCRIPT`: it
appends the handoffs to the receivers' streams, replaces the plan, appends it to the plan
history and publishes the new version, all atomically, and only if the stored version is still
the expected one (ownership is fenced by plan version).
"""

from __future__ import annotations

from typing import Any

from app.pipeline import names

# KEYS[1] = plan, KEYS[2] = plan history, KEYS[3..2+n] = the n streams receiving a handoff,
# KEYS[3+n..] = kNN hashes whose merged list waits for a receiver (app.pipeline.knnreg).
# ARGV[1] = expected version, ARGV[2] = new plan JSON, ARGV[3] = new version, ARGV[4] = now,
# ARGV[5] = plan channel, ARGV[6] = history entry JSON, ARGV[7] = n,
# ARGV[8..7+n] = handoff payloads (packed), ARGV[8+n] = history length,
# then per kNN hash: field, value (the hold token).
# Returns 1 when applied, 0 when the stored plan is not at the expected version.
PLAN_CAS_SCRIPT = """
local raw = redis.call('GET', KEYS[1])
if not raw then return 0 end
local cur = cjson.decode(raw)
if tostring(cur['version']) ~= ARGV[1] then return 0 end
local n = tonumber(ARGV[7])
for i = 1, n do
  redis.call('XADD', KEYS[2 + i], '*', 'm', ARGV[7 + i])
end
for i = 3 + n, #KEYS do
  local a = 9 + n + 2 * (i - 3 - n)
  redis.call('HSET', KEYS[i], ARGV[a], ARGV[a + 1])
end
redis.call('SET', KEYS[1], ARGV[2])
redis.call('RPUSH', KEYS[2], ARGV[6])
redis.call('LTRIM', KEYS[2], -tonumber(ARGV[8 + n]), -1)
redis.call('PUBLISH', ARGV[5], ARGV[3])
return 1
"""


def history_entry(plan_json: str, version: int, now: float) -> str:
    """One plan-history element: the plan and when it became valid (SSTD's versioned mapping,
    SWARM §5.2's partition chains: snapshot queries find data written under older plans)."""
    return f'{{"version":{version},"valid_from":{now!r},"plan":{plan_json}}}'


def plan_cas_args(expected: int, plan_json: str, version: int, now: float, channel: str,
                  handoffs: list[tuple[str, bytes]],
                  holds: list[tuple[str, str, str]] | None = None
                  ) -> tuple[list[str], list[Any]]:
    """KEYS and ARGV for PLAN_CAS_SCRIPT. `handoffs` = [(stream, packed message)], `holds` =
    [(kNN hash, token field, value)]."""
    holds = holds or []
    keys = [names.PLAN_KEY, names.PLAN_HISTORY, *(s for s, _ in handoffs),
            *(h for h, _, _ in holds)]
    args: list[Any] = [str(expected), plan_json, str(version), repr(now), channel,
                       history_entry(plan_json, version, now), str(len(handoffs)),
                       *(m for _, m in handoffs), str(names.PLAN_HISTORY_MAX)]
    for _, f, v in holds:
        args += [f, v]
    return keys, args
