"""A worker's commit through its stream's outbox (`app.pipeline.outbox`): what a Redis
Cluster needs, where the transaction may only touch keys of the stream's hash slot.

`OutboxPipe` is a transaction pipeline whose commands on the stream's slot (its XACK among
them) are queued in the transaction, and every other command (the matches in the
subscriptions' histories, the records, the kNN hashes, entries forwarded to other workers'
streams) in one entry of the stream's outbox (`names.outbox_stream`), appended in the same
transaction under the stream's fence: the entry's commands apply exactly when the XACK does.
`execute` commits, relays the entry and deletes it. Whoever takes a stream relays what its
outbox still holds before reading anything a commit could have changed (`relay_outbox`): the
worker at its start and after a failed step, an adopter before it loads the dead worker's
window. A worker relays each of its commits before the next, so its outbox is relayed in
order.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

from redis.commands.core import CoreCommands

from app.pipeline import names
from app.pipeline.outbox import (
    Group,
    Relayer,
    command_keys,
    encode_ops,
    script_op,
    slot_of,
)

log = logging.getLogger(__name__)

_EVERY_KEY = {b"DEL", b"UNLINK"}


class _Arguments(CoreCommands):
    """redis-py's command methods, returning the arguments they would send."""

    def execute_command(self, *args: Any, **options: Any) -> tuple[tuple[Any, ...], Any]:
        return args, options


_ARGS = _Arguments()  # type: ignore[abstract]


def _queued(method: str) -> Callable[..., OutboxPipe]:
    """A pipeline method of a commit: queued in the transaction or the outbox entry."""
    def queue(self: OutboxPipe, *args: Any, **kwargs: Any) -> OutboxPipe:
        return self._queue(method, *args, **kwargs)

    queue.__name__ = method
    return queue


class OutboxPipe:
    """A transaction pipeline for a commit on stream `stream` (see the module docstring):
    `execute` returns every command's reply in the order they were queued (the relayed
    scripts' replies included), as a pipeline would. The methods are those a commit uses;
    WATCH and the reads before `multi` go to the transaction's connection, as on a
    pipeline."""

    def __init__(self, client: Any, stream: str, owner: str, relayer: Relayer) -> None:
        self.client = client
        self.pipe = client.pipeline(transaction=True)
        self._encode = client.get_encoder().encode
        self.outbox = names.outbox_stream(owner)
        self.own = slot_of(stream)
        self.relayer = relayer
        # one per queued command: its position in the transaction, or -1 (in the outbox)
        self.command_stack: list[int] = []
        self._far: dict[int, Group] = {}
        self._far_ops: list[list[bytes]] = []  # the outbox entry's commands, in order
        self._queued = 0  # commands in the transaction
        # outboxes that scripts of the entry write to (`app.pipeline.knnreg`): relayed after it
        self._then: set[bytes] = set()

    # the transaction's own connection: WATCH, reads while watching, MULTI
    def watch(self, *keys: Any) -> Any:
        return self.pipe.watch(*keys)

    def get(self, key: Any) -> Any:
        return self.pipe.get(key)

    def multi(self) -> None:
        self.pipe.multi()

    def reset(self) -> None:
        self.pipe.reset()
        self.command_stack, self._far, self._far_ops, self._queued = [], {}, [], 0
        self._then = set()

    def _queue(self, method: str, *args: Any, **kwargs: Any) -> OutboxPipe:
        cmd_args, options = getattr(_ARGS, method)(*args, **kwargs)
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
            group = self._far[slot] = Group(slot)
        op = script_op(list(raw)) if raw[0].upper() == b"EVAL" else list(raw)
        self._then.update(k for k in keys if k.startswith(names.OUTBOX_PREFIX.encode()))
        group.add(op, keys, len(self.command_stack))
        self._far_ops.append(op)
        self.command_stack.append(-1)
        return self

    xadd = _queued("xadd")
    xack = _queued("xack")
    hset = _queued("hset")
    hdel = _queued("hdel")
    expire = _queued("expire")
    delete = _queued("delete")
    rpush = _queued("rpush")

    def eval(self, script: str, numkeys: int, *keys_and_args: Any) -> OutboxPipe:
        self.relayer.check(script)
        return self._queue("eval", script, numkeys, *keys_and_args)

    def execute(self) -> list[Any]:
        """Commit (the transaction's commands and the outbox entry), relay the entry, delete
        it; every command's reply in order. A relay that fails raises, and the entry is
        relayed again by `relay_outbox` (the commit stands)."""
        groups = sorted(self._far.values(), key=lambda g: g.at[0])
        if groups:
            self.pipe.xadd(self.outbox, {b"m": encode_ops(self._far_ops)})
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
        then, self._then = sorted(self._then), set()
        self._far, self._far_ops, self.command_stack, self._queued = {}, [], [], 0
        for outbox in then:
            self.relayer.relay_all(outbox.decode())
        for r in out:  # as a pipeline raises the first error (everything else applied)
            if isinstance(r, Exception):
                raise r
        return out


def relay_outbox(client: Any, owner: str, relayer: Relayer) -> int:
    """Relay and delete every entry left in `owner`'s outbox, in order (a commit whose relay
    was cut short); returns how many."""
    done = relayer.relay_all(names.outbox_stream(owner))
    if done:
        log.info("relayed %d entries left in the outbox of %s", done, owner)
    return done
