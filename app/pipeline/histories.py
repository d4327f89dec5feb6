"""How a subscription's history stream is appended to, shared by the scripts that write one
(the workers' matches, `workers.executor.HISTORY_SCRIPT`; the merged kNN lists,
`app.pipeline.knnreg.MERGE_SCRIPT`): Lua prepended to each script."""

from __future__ import annotations

from app.pipeline import names

HISTORY_CHUNK = 4096  # history entries per script call (bounds the time Redis is busy)


def history_chunks(sub_ids: list[str], one_slot: bool, size: int = HISTORY_CHUNK
                   ) -> list[tuple[int, int]]:
    """The [start, end) ranges of one script call each: at most `size` subscriptions, and,
    when `one_slot` (a Redis Cluster, where a script's keys share a hash slot), of one history
    group (the subscriptions sorted by group first)."""
    out = []
    a = 0
    while a < len(sub_ids):
        b = min(len(sub_ids), a + size)
        if one_slot:
            tag = names.history_tag(sub_ids[a])
            b = next((i for i in range(a + 1, b) if names.history_tag(sub_ids[i]) != tag), b)
        out.append((a, b))
        a = b
    return out

# append_history(stream, prev, maxlen, max_age_ms, ttl, period_ms, field, value, ...): XADD
# the fields to the stream, trimmed to about `maxlen` entries, and return the new id. `prev`
# is the id of the stream's entry before it ('0-0': none). The stream's age trim (entries
# older than `max_age_ms` before the new one go) and its expiry (`ttl` seconds) are renewed at
# its first append in each period of `period_ms` (the period of the new id differs from
# prev's): entries older than the max age go at most a period late, and a stream expires no
# sooner than `ttl` less a period after its last append.
APPEND_HISTORY_LUA = """
local function append_history(stream, prev, maxlen, max_age_ms, ttl, period_ms, ...)
  local id = redis.call('XADD', stream, 'MAXLEN', '~', maxlen, '*', ...)
  local ms = tonumber(string.match(id, '^%d+'))
  local period = tonumber(period_ms)
  if math.floor(ms / period) ~= math.floor(tonumber(string.match(prev, '^%d+')) / period) then
    redis.call('XTRIM', stream, 'MINID', '~', string.format('%d', ms - tonumber(max_age_ms)))
    redis.call('EXPIRE', stream, ttl)
  end
  return id
end
"""


def history_housekeeping_ms(max_age_s: float) -> int:
    """The period in which `append_history` renews a stream's age trim and expiry: a tenth of
    the max age, at most 10 s (the 60 s by which the streams' ttl exceeds the max age cover
    it)."""
    return max(1, int(min(10.0, max_age_s / 10) * 1000))
