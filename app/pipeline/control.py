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

With outboxes (a Redis Cluster, where the receivers' streams are in other hash slots than the
plan), the same change takes two steps that apply it exactly as one: `PLAN_STAGE_SCRIPT`
checks the version, marks the change staged (`names.PLAN_PENDING`: no other change is staged
until it is active) and appends one entry to the control outbox (`names.CONTROL_OUTBOX`)
holding the handoffs, the kNN holds and, last, `PLAN_ACTIVATE_SCRIPT`; relaying the entry
(`app.pipeline.outbox`) writes the handoffs first and then replaces, records and publishes the
plan. A receiver therefore reads its handoff before anything routed to it under the new plan,
as with the single script. Whoever stages relays at once; a worker at its start and the
coordinator before a failover relay what a stager that died left.
"""

from __future__ import annotations

from typing import Any

from app.pipeline import names
from app.pipeline.outbox import encode_ops, op, script_sha

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


# KEYS[1] = plan, KEYS[2] = staged version (names.PLAN_PENDING), KEYS[3] = control outbox.
# ARGV[1] = expected version, ARGV[2] = new version, ARGV[3] = the outbox entry (encoded ops).
# Returns the entry's id, or 0 when the plan is not at the expected version or another
# change is staged.
PLAN_STAGE_SCRIPT = """
local raw = redis.call('GET', KEYS[1])
if not raw then return 0 end
if tostring(cjson.decode(raw)['version']) ~= ARGV[1] then return 0 end
if redis.call('EXISTS', KEYS[2]) == 1 then return 0 end
redis.call('SET', KEYS[2], ARGV[2])
return redis.call('XADD', KEYS[3], '*', 'm', ARGV[3])
"""

# Run by the relay of a staged change, after its handoffs. KEYS[1] = plan, KEYS[2] = plan
# history, KEYS[3] = staged version. ARGV[1] = plan JSON, ARGV[2] = its version, ARGV[3] = plan
# channel, ARGV[4] = history entry, ARGV[5] = history length.
PLAN_ACTIVATE_SCRIPT = """
redis.call('SET', KEYS[1], ARGV[1])
redis.call('RPUSH', KEYS[2], ARGV[4])
redis.call('LTRIM', KEYS[2], -tonumber(ARGV[5]), -1)
redis.call('DEL', KEYS[3])
redis.call('PUBLISH', ARGV[3], ARGV[2])
return 1
"""


def plan_stage_args(expected: int, plan_json: str, version: int, now: float, channel: str,
                    handoffs: list[tuple[str, bytes]],
                    holds: list[tuple[str, str, str]] | None = None
                    ) -> tuple[list[str], list[Any]]:
    """KEYS and ARGV for PLAN_STAGE_SCRIPT: the change `plan_cas_args` makes in one script."""
    ops = [op("XADD", stream, "*", "m", payload) for stream, payload in handoffs]
    ops += [op("HSET", key, f, v) for key, f, v in holds or []]
    ops.append(activate_op(plan_json, version, now, channel))
    return ([names.PLAN_KEY, names.PLAN_PENDING, names.CONTROL_OUTBOX],
            [str(expected), str(version), encode_ops(ops)])


def activate_op(plan_json: str, version: int, now: float,
                channel: str = names.PLAN_CHANNEL) -> list[bytes]:
    """The last command of a staged change's outbox entry: PLAN_ACTIVATE_SCRIPT."""
    return op("EVAL", script_sha(PLAN_ACTIVATE_SCRIPT), 3, names.PLAN_KEY, names.PLAN_HISTORY,
              names.PLAN_PENDING, plan_json, str(version), channel,
              history_entry(plan_json, version, now), str(names.PLAN_HISTORY_MAX))
