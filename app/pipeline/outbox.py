"""Outboxes: how one step writes keys of several hash slots exactly once on a Redis Cluster,
where a transaction or script may only touch keys of one slot.

The step's own transaction (or script) writes its own slot's keys and appends one entry to an
outbox stream in that slot, listing every other command. The entry is then *relayed*: its
commands are grouped by the slot of their keys, and each group runs as one script call in its
slot (`RELAY_TEMPLATE`) unless a mark there (`relay_mark_key`: field = the outbox, value =
the last of its entries applied in that slot) says the entry was applied already; the call
sets the mark. Whoever relays goes through an outbox in order, from its oldest entry, so a
mark at or past an entry means that entry was applied to that slot: a relay cut short (a
crash, a lost connection) is finished by running it again, and several relayers of one
outbox apply each group once. An entry is deleted once relayed everywhere.

Groups are relayed in the order of their first command, so a command's effect is visible no
later than those of the commands queued after it in another slot (records before the history
entries that refer to them, a partition's handoff before the plan that gives it). One
connection runs its commands in order; on a Redis Cluster, whose pipeline sends each node's
commands on that node's connection, the groups go in *waves* (`waves`): each a run of
consecutive groups on one node, a wave sent once the one before it has answered; a run of
groups that only append to subscriptions' histories (scripts declared `unordered`: no history
entry refers to another) is one wave over every node.

Scripts in an entry run inside the relay script, which holds each as a Lua function
(`relay_script`): Redis cannot call a script from a script.

An entry's commands are stored as length-prefixed strings (`encode_ops`), a form a Lua script
writes as easily (`ENCODE_OPS_LUA`) as Python does.
"""

from __future__ import annotations

import hashlib
import logging
from collections.abc import Iterable
from dataclasses import dataclass, field
from functools import cache
from typing import Any

from redis.crc import key_slot
from redis.exceptions import NoScriptError

log = logging.getLogger(__name__)

SLOTS = 16384

# KEYS[1] = the group's relay mark (a hash in the group's slot), KEYS[2..] = the keys its
# commands touch (declared for the cluster's routing). ARGV[1] = the outbox, ARGV[2] = the
# outbox entry's id, then each command as its number of arguments and the arguments (a
# script call is EVAL, the script's sha1, numkeys, keys..., args...). Returns 0 when the
# entry was applied here already, else {1, one reply per command} (an error reply in place
# of a failed command, as EXEC would give it: the other commands still apply). Lua's unpack
# fails past about 8 000 values, and a command takes its arguments unpacked: a longer command
# of a key and repeated fields (a batch's records in one HSET) runs in chunks, its integer
# replies summed (`run`); tables are built without unpack.
RELAY_TEMPLATE = """
local CHUNK = 6000
local STEP = {HSET = 2, HDEL = 1, SADD = 1, SREM = 1, ZADD = 2, ZREM = 1, XDEL = 1}
local function slice(t, i, j)
  local out = {}
  for k = i, j do out[#out + 1] = t[k] end
  return out
end
local function run(op)
  local n = #op
  if n <= CHUNK then return redis.pcall(unpack(op)) end
  local step = STEP[string.upper(op[1])]
  if not step then
    return {err = 'ERR ' .. op[1] .. ' with ' .. n .. ' arguments cannot be relayed'}
  end
  local per = math.floor((CHUNK - 2) / step) * step
  local total = 0
  local i = 3
  while i <= n do
    local j = math.min(n, i + per - 1)
    local r = redis.pcall(op[1], op[2], unpack(op, i, j))
    if type(r) == 'table' and r.err then return r end
    if type(r) == 'number' then total = total + r end
    i = j + 1
  end
  return total
end
local function after(a, b)
  local am, as = string.match(a, '^(%d+)-(%d+)$')
  local bm, bs = string.match(b, '^(%d+)-(%d+)$')
  am, bm = tonumber(am), tonumber(bm)
  if am ~= bm then return am > bm end
  return tonumber(as) > tonumber(bs)
end
local mark = redis.call('HGET', KEYS[1], ARGV[1])
if mark and not after(ARGV[2], mark) then return 0 end
local SCRIPTS = {}
@SCRIPTS@
local out = {}
local a = 3
while a <= #ARGV do
  local n = tonumber(ARGV[a])
  local op = slice(ARGV, a + 1, a + n)
  a = a + n + 1
  local r
  if op[1] == 'EVAL' then
    local n = tonumber(op[3])
    local ok, res = pcall(SCRIPTS[op[2]], slice(op, 4, 3 + n), slice(op, 4 + n, #op))
    if ok then r = res
    elseif type(res) == 'table' then r = res
    else r = {err = tostring(res)} end
  else
    r = run(op)
  end
  if r == nil then r = false end
  out[#out + 1] = r
end
redis.call('HSET', KEYS[1], ARGV[1], ARGV[2])
return {1, out}
"""


def script_sha(text: str) -> str:
    return hashlib.sha1(text.encode()).hexdigest()


def relay_script(scripts: Iterable[str]) -> str:
    """The relay script, able to run each of `scripts` (Lua texts) as a queued command."""
    funcs = [f"SCRIPTS['{script_sha(t)}'] = function(KEYS, ARGV)\n{t}\nend"
             for t in sorted(set(scripts))]
    return RELAY_TEMPLATE.replace("@SCRIPTS@", "\n".join(funcs))


@cache
def slot_tags() -> tuple[str, ...]:
    """For each hash slot, a short string that hashes to it (the tag of its relay mark)."""
    tags: list[str | None] = [None] * SLOTS
    left, i = SLOTS, 0
    while left:
        s = key_slot(str(i).encode())
        if tags[s] is None:
            tags[s] = str(i)
            left -= 1
        i += 1
    return tuple(t for t in tags if t is not None)


def relay_mark_key(slot: int) -> str:
    """The hash in `slot` of the last outbox entry each outbox relayed there."""
    return f"gs:relay:{{{slot_tags()[slot]}}}"


def slot_of(key: bytes | str) -> int:
    return int(key_slot(key.encode() if isinstance(key, str) else key))


# The commands an outbox holds: those of one key (the first argument), of every argument
# (DEL), and EVAL of a script its relay knows.
_ONE_KEY = {b"XADD", b"XACK", b"HSET", b"HDEL", b"EXPIRE", b"RPUSH", b"SET", b"XDEL",
            b"HINCRBY", b"PEXPIRE", b"SADD", b"SREM", b"ZADD", b"ZREM", b"INCR", b"INCRBY"}
_EVERY_KEY = {b"DEL", b"UNLINK"}


def command_keys(args: tuple[bytes, ...]) -> list[bytes]:
    name = args[0].upper()
    if name in _ONE_KEY:
        return [args[1]]
    if name in _EVERY_KEY:
        return list(args[1:])
    if name == b"EVAL":
        return list(args[3:3 + int(args[2])])
    raise ValueError(f"{name.decode()} cannot go through an outbox")




def op(*args: str | bytes | int | float) -> list[bytes]:
    """A command's arguments as Redis receives them (numbers as redis-py writes them)."""
    return [a if isinstance(a, bytes) else a.encode() if isinstance(a, str)
            else repr(a).encode() for a in args]


def encode_ops(ops: Iterable[list[bytes]]) -> bytes:
    """Commands as one string: per command, its number of arguments and ':', then each
    argument as its length, ':' and its bytes."""
    parts: list[bytes] = []
    for op in ops:
        parts.append(b"%d:" % len(op))
        for a in op:
            parts.append(b"%d:" % len(a))
            parts.append(a)
    return b"".join(parts)


def decode_ops(raw: bytes) -> list[list[bytes]]:
    out: list[list[bytes]] = []
    i = 0
    while i < len(raw):
        j = raw.index(b":", i)
        n, i = int(raw[i:j]), j + 1
        op = []
        for _ in range(n):
            j = raw.index(b":", i)
            size, i = int(raw[i:j]), j + 1
            op.append(raw[i:i + size])
            i += size
        out.append(op)
    return out


# encode_op(args): `encode_ops` of one command, in Lua (its parts concatenated make an entry).
ENCODE_OPS_LUA = """
local function encode_op(args)
  local parts = {#args .. ':'}
  for _, a in ipairs(args) do parts[#parts + 1] = #a .. ':' .. a end
  return table.concat(parts)
end
"""


@dataclass
class Group:
    """The commands of one outbox entry for one slot, in their order (`at`: each one's
    position among the step's commands, when the step is still in memory)."""

    slot: int
    keys: list[bytes] = field(default_factory=list)
    ops: list[list[bytes]] = field(default_factory=list)
    at: list[int] = field(default_factory=list)

    def add(self, op: list[bytes], keys: list[bytes], at: int = -1) -> None:
        self.keys.extend(k for k in keys if k not in self.keys)
        self.ops.append(op)
        self.at.append(at)


def group_ops(ops: Iterable[list[bytes]]) -> list[Group]:
    """An entry's commands grouped by slot, the groups in the order of their first command."""
    groups: dict[int, Group] = {}
    for op in ops:
        keys = command_keys(tuple(op))
        slot = slot_of(keys[0])
        groups.setdefault(slot, Group(slot)).add(op, keys)
    return list(groups.values())


def script_op(raw: list[bytes]) -> list[bytes]:
    """An EVAL as an outbox holds it: the script's sha1 in place of its text."""
    return [raw[0], script_sha(raw[1].decode()).encode(), *raw[2:]]


class _Relay:
    """What the sync and async relayers share: the relay script for `scripts` and the calls."""

    client: Any

    def __init__(self, scripts: Iterable[str], unordered: Iterable[str] = ()) -> None:
        scripts = list(scripts)
        self.scripts = {script_sha(t) for t in scripts}
        # scripts whose calls in different slots may apply in any order among themselves
        # (each subscription's history appends): a run of groups of them is one wave
        self.unordered = {script_sha(t).encode() for t in unordered}
        self.text = relay_script(scripts)
        self.sha = script_sha(self.text)  # loaded at its first NOSCRIPT

    def check(self, script: str) -> None:
        if script_sha(script) not in self.scripts:
            raise ValueError("a script queued through an outbox must be given to its relay")

    def waves(self, groups: list[Group]) -> list[list[Group]]:
        """`groups` cut into runs that one pipeline may send together and still apply in
        order: all of them on one Redis; on a cluster, each run of consecutive groups on one
        node, and each run of consecutive groups that only call `unordered` scripts, on any
        nodes (they may apply in any order among themselves, not before the groups ahead
        of them)."""
        nodes = getattr(self.client, "nodes_manager", None)
        if nodes is None or len(groups) < 2:
            return [groups]
        out: list[list[Group]] = []
        last, last_free = None, False
        for g in groups:
            free = bool(g.ops) and all(op[0].upper() == b"EVAL" and op[1] in self.unordered
                                       for op in g.ops)
            try:
                node = nodes.get_node_from_slot(g.slot).name
            except Exception:  # slot map being refreshed: a wave of its own
                node = None
            # a run of unordered groups joins only its own kind; others join their node's run
            if free or last_free:
                joins = free and last_free
            else:
                joins = node is not None and node == last
            if out and joins:
                out[-1].append(g)
            else:
                out.append([g])
            last, last_free = node, free
        return out

    def _queue(self, pipe: Any, outbox: str, eid: str, groups: list[Group],
               to_node: bool = False) -> None:
        """`to_node`: name each call's node (redis-py's synchronous cluster pipeline asks a
        node `COMMAND GETKEYS` for every EVALSHA it routes by itself: a round trip each)."""
        nodes = getattr(self.client, "nodes_manager", None) if to_node else None
        for g in groups:
            args: list[bytes | int] = []
            for op in g.ops:
                args.append(len(op))
                args.extend(op)
            target = {} if nodes is None else {
                "target_nodes": nodes.get_node_from_slot(g.slot)}
            # (a cluster's pipeline refuses `evalsha`, not the command: it routes it by its keys)
            pipe.execute_command("EVALSHA", self.sha, 1 + len(g.keys), relay_mark_key(g.slot),
                                 *g.keys, outbox, eid, *args, **target)


def _eid(entry_id: bytes | str) -> str:
    return entry_id.decode() if isinstance(entry_id, bytes) else entry_id


def _replies(raw: list[Any]) -> list[list[Any] | None]:
    return [list(reply[1]) if reply else None for reply in raw]


class Relayer(_Relay):
    """Relays outbox entries with a synchronous client."""

    def __init__(self, client: Any, scripts: Iterable[str] = (),
                 unordered: Iterable[str] = ()) -> None:
        super().__init__(scripts, unordered)
        self.client = client

    def relay(self, outbox: str, entry_id: bytes | str, groups: list[Group]
              ) -> list[list[Any] | None]:
        """Apply each group unless it was applied already: its replies, or None then."""
        try:
            return _replies(self._send(outbox, _eid(entry_id), groups))
        except NoScriptError:  # Redis restarted and lost its scripts: load it, relay again
            self.client.script_load(self.text)
            return _replies(self._send(outbox, _eid(entry_id), groups))

    def _send(self, outbox: str, eid: str, groups: list[Group]) -> list[Any]:
        out: list[Any] = []
        for wave in self.waves(groups):
            pipe = self.client.pipeline(transaction=False)
            self._queue(pipe, outbox, eid, wave, to_node=True)
            out.extend(pipe.execute())
        return out

    def relay_all(self, outbox: str) -> int:
        """Relay and delete every entry `outbox` holds, in order; returns how many."""
        done = 0
        while True:
            rows = self.client.xrange(outbox, count=100)
            if not rows:
                return done
            for eid, fields in rows:
                self.relay(outbox, eid, group_ops(decode_ops(fields[b"m"])))
                self.client.xdel(outbox, eid)
                done += 1


class AsyncRelayer(_Relay):
    """Relays outbox entries with an asyncio client."""

    def __init__(self, client: Any, scripts: Iterable[str] = (),
                 unordered: Iterable[str] = ()) -> None:
        super().__init__(scripts, unordered)
        self.client = client

    async def relay(self, outbox: str, entry_id: bytes | str, groups: list[Group]
                    ) -> list[list[Any] | None]:
        try:
            return _replies(await self._send(outbox, _eid(entry_id), groups))
        except NoScriptError:
            await self.client.script_load(self.text)
            return _replies(await self._send(outbox, _eid(entry_id), groups))

    async def _send(self, outbox: str, eid: str, groups: list[Group]) -> list[Any]:
        out: list[Any] = []
        for wave in self.waves(groups):
            pipe = self.client.pipeline(transaction=False)
            self._queue(pipe, outbox, eid, wave)
            out.extend(await pipe.execute())
        return out

    async def relay_all(self, outbox: str) -> int:
        done = 0
        while True:
            rows = await self.client.xrange(outbox, count=100)
            if not rows:
                return done
            for eid, fields in rows:
                await self.relay(outbox, eid, group_ops(decode_ops(fields[b"m"])))
                await self.client.xdel(outbox, eid)
                done += 1
