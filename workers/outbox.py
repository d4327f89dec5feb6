"""A worker's commit through an outbox: what a Redis Cluster needs, where a transaction may
only touch keys of one hash slot.

A worker commits the effects of the stream entries it processed (their matches in the
subscriptions' histories, the records, the kNN hashes, entries forwarded to other workers'
streams) together with their XACK, all or nothing. On one Redis server that is one MULTI/EXEC.
On a Redis Cluster the keys live in many slots, so `OutboxPipe` splits the commit:

1. The transaction (under the stream's fence) holds the commands on keys of the stream's own
   slot, the XACK among them, and one entry of the stream's outbox (`names.outbox_stream`, in
   the same slot) listing every other command, grouped by the slot of its keys.
2. After EXEC, each group is *relayed*: one script call in its slot (`RELAY_SCRIPT`) runs the
   group's commands unless a mark there (`relay_mark_key`: field = the outbox, value = the last
   outbox entry applied) says this entry was applied already, and sets the mark. A relayer
   goes through an outbox in order, so a mark at or past an entry means the entry was applied
   to that slot; a relay cut short (a crash, a lost connection) is finished by running it
   again, and two relayers of one outbox (a worker and the adopter of its stream) apply each
   group once. The outbox entry is deleted once every group is relayed.
3. Whoever takes a stream relays what its outbox still holds before reading anything the
   outbox could have changed (`relay_outbox`): the worker at its start and after a failed
   step, an adopter before it loads the dead worker's window.

So every effect of an acknowledged entry is applied exactly once, as on one server; only the
moment differs (the slots are written one after the other). Groups are relayed in the order
of their first command, so records are written before the history entries that refer to
them (`workers.executor` queues the records first).

Scripts queued on the pipe are run inside the relay script, whose text holds each of them as
a Lua function (`relay_script`): Redis cannot call a script from a script.
"""

from __future__ import annotations

import hashlib
import logging
from collections.abc import Iterable
from functools import cache
from typing import Any

import msgspec
from redis.crc import key_slot
from redis.exceptions import NoScriptError

from app.pipeline import names

log = logging.getLogger(__name__)

SLOTS = 16384

# KEYS[1] = the group's relay mark (a hash in the group's slot), KEYS[2..] = the keys its
# commands touch (declared for the cluster's routing). ARGV[1] = the outbox, ARGV[2] = the
# outbox entry's id, then each command as its number of arguments and the arguments (a
# script call is EVAL, the script's sha1, numkeys, keys..., args...). Returns 0 when the
# entry was applied here already, else {1, one reply per command} (an error reply in place
# of a failed command, as EXEC would give it: the other commands still apply).
RELAY_TEMPLATE = """
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
  local op = {unpack(ARGV, a + 1, a + n)}
  a = a + n + 1
  local r
  if op[1] == 'EVAL' then
    local n = tonumber(op[3])
    local ok, res = pcall(SCRIPTS[op[2]], {unpack(op, 4, 3 + n)}, {unpack(op, 4 + n)})
    if ok then r = res
    elseif type(res) == 'table' then r = res
    else r = {err = tostring(res)} end
  else
    r = redis.pcall(unpack(op))
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


# The commands a commit queues, and where their keys are among the arguments (the command
# name first): every argument from `first` on, or just the one at `first`.
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
    raise ValueError(f"a commit cannot queue {name.decode()} through the outbox")


class Group(msgspec.Struct, array_like=True):
    """The commands of one outbox entry for one slot, in their order."""

    slot: int
    keys: list[bytes]
    ops: list[list[bytes]]
    at: list[int]  # each command's position in the commit


class OutboxEntry(msgspec.Struct, array_like=True):
    groups: list[Group]


_ENCODER = msgspec.msgpack.Encoder()
_DECODER = msgspec.msgpack.Decoder(OutboxEntry)


class OutboxPipe:
    """A transaction pipeline for a commit on stream `stream` (see the module docstring):
    commands on keys of the stream's slot are queued in the transaction, the others in its
    outbox entry; `execute` commits, relays and returns every command's reply in the order
    they were queued (the relayed scripts' replies included), as a pipeline would. The
    methods are those a commit uses; WATCH and the reads before `multi` go to the
    transaction's connection, as on a pipeline."""

    def __init__(self, client: Any, stream: str, owner: str, relayer: Relayer) -> None:
        self.client = client
        self.pipe = client.pipeline(transaction=True)
        self._scratch = client.pipeline(transaction=False)  # builds the commands' arguments
        self._encode = client.connection_pool.get_encoder().encode
        self.outbox = names.outbox_stream(owner)
        self.own = slot_of(stream)
        self.relayer = relayer
        # one per queued command: its position in the transaction, or -1 (in the outbox)
        self.command_stack: list[int] = []
        self._far: dict[int, Group] = {}
        self._queued = 0  # commands in the transaction

    # the transaction's own connection: WATCH, reads while watching, MULTI
    def watch(self, *keys: Any) -> Any:
        return self.pipe.watch(*keys)

    def get(self, key: Any) -> Any:
        return self.pipe.get(key)

    def multi(self) -> None:
        self.pipe.multi()

    def reset(self) -> None:
        self.pipe.reset()
        self._scratch.reset()
        self.command_stack, self._far, self._queued = [], {}, 0

    def _queue(self, method: str, *args: Any, **kwargs: Any) -> OutboxPipe:
        getattr(self._scratch, method)(*args, **kwargs)
        cmd_args, options = self._scratch.command_stack.pop()
        raw = tuple(self._encode(a) for a in cmd_args)
        keys = command_keys(raw)
        slots = {slot_of(k) for k in keys}
        if slots == {self.own}:
            self.pipe.execute_command(*cmd_args, **options)
            self.command_stack.append(self._queued)
            self._queued += 1
            return self
        if len(slots) != 1 and raw[0].upper() in _EVERY_KEY:  # one command per key's slot
            for k in keys:
                self._queue(method, k)
            return self
        slot = slot_of(keys[0])
        group = self._far.get(slot)
        if group is None:
            group = self._far[slot] = Group(slot=slot, keys=[], ops=[], at=[])
        group.keys.extend(k for k in keys if k not in group.keys)
        group.at.append(len(self.command_stack))
        op = list(raw)
        if raw[0].upper() == b"EVAL":
            op[1] = script_sha(raw[1].decode()).encode()
        group.ops.append(op)
        self.command_stack.append(-1)
        return self

    def xadd(self, *a: Any, **kw: Any) -> OutboxPipe:
        return self._queue("xadd", *a, **kw)

    def xack(self, *a: Any, **kw: Any) -> OutboxPipe:
        return self._queue("xack", *a, **kw)

    def hset(self, *a: Any, **kw: Any) -> OutboxPipe:
        return self._queue("hset", *a, **kw)

    def hdel(self, *a: Any, **kw: Any) -> OutboxPipe:
        return self._queue("hdel", *a, **kw)

    def expire(self, *a: Any, **kw: Any) -> OutboxPipe:
        return self._queue("expire", *a, **kw)

    def delete(self, *a: Any, **kw: Any) -> OutboxPipe:
        return self._queue("delete", *a, **kw)

    def rpush(self, *a: Any, **kw: Any) -> OutboxPipe:
        return self._queue("rpush", *a, **kw)

    def eval(self, script: str, numkeys: int, *keys_and_args: Any) -> OutboxPipe:
        self.relayer.check(script)
        return self._queue("eval", script, numkeys, *keys_and_args)

    def execute(self) -> list[Any]:
        """Commit (the transaction's commands and the outbox entry), relay the entry, delete
        it; every command's reply in order. A relay that fails raises, and the entry is
        relayed again by `relay_outbox` (the commit stands)."""
        groups = sorted(self._far.values(), key=lambda g: g.at[0])
        if groups:
            self.pipe.xadd(self.outbox, {b"m": _ENCODER.encode(OutboxEntry(groups=groups))})
        own = self.pipe.execute()
        out: list[Any] = [None] * len(self.command_stack)
        for i, at in enumerate(self.command_stack):
            if at >= 0:
                out[i] = own[at]
        if groups:
            entry_id = own[-1]
            replies = self.relayer.relay(self.outbox, entry_id, groups)
            for group, reply in zip(groups, replies, strict=True):
                for at, r in zip(group.at, reply or [], strict=False):
                    out[at] = r
            self.client.xdel(self.outbox, entry_id)
        self._far, self.command_stack, self._queued = {}, [], 0
        for r in out:  # as a pipeline raises the first error (everything else applied)
            if isinstance(r, Exception):
                raise r
        return out


class Relayer:
    """Runs outbox entries' groups in their slots (`RELAY_SCRIPT` built for the scripts a
    commit may queue)."""

    def __init__(self, client: Any, scripts: Iterable[str]) -> None:
        self.client = client
        self.scripts = {script_sha(t) for t in scripts}
        self.text = relay_script(scripts)
        self.sha = script_sha(self.text)  # loaded at its first NOSCRIPT

    def check(self, script: str) -> None:
        if script_sha(script) not in self.scripts:
            raise ValueError("a script queued on an outbox commit must be given to its relay")

    def relay(self, outbox: str, entry_id: bytes | str, groups: list[Group]
              ) -> list[list[Any] | None]:
        """Apply each group unless it was applied already: its replies, or None then."""
        eid = entry_id.decode() if isinstance(entry_id, bytes) else entry_id
        try:
            replies = self._send(outbox, eid, groups)
        except NoScriptError:  # Redis restarted and lost its scripts: load it, relay again
            self.client.script_load(self.text)
            replies = self._send(outbox, eid, groups)
        return [list(reply[1]) if reply else None for reply in replies]

    def _send(self, outbox: str, eid: str, groups: list[Group]) -> list[Any]:
        pipe = self.client.pipeline(transaction=False)
        for g in groups:
            args: list[bytes | int] = []
            for op in g.ops:
                args.append(len(op))
                args.extend(op)
            pipe.evalsha(self.sha, 1 + len(g.keys), relay_mark_key(g.slot), *g.keys, outbox,
                         eid, *args)
        return list(pipe.execute())


def relay_outbox(client: Any, owner: str, relayer: Relayer) -> int:
    """Relay and delete every entry left in `owner`'s outbox, in order (a commit whose relay
    was cut short); returns how many."""
    outbox = names.outbox_stream(owner)
    done = 0
    while True:
        rows = client.xrange(outbox, count=100)
        if not rows:
            return done
        for eid, fields in rows:
            entry = _DECODER.decode(fields[b"m"])
            relayer.relay(outbox, eid, entry.groups)
            client.xdel(outbox, eid)
            done += 1
        log.info("relayed %d entries left in the outbox of %s", done, owner)
