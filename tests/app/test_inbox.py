"""`app.pipeline.inbox` and `workers.replies`: the api's query reply socket and a worker's end
of it, over a real Unix socket: a worker that said hello is known until its connection goes,
a reply reaches the query waiting for its token (and nothing else), a frame that cannot be
one closes the connection, and a worker whose inbox is gone replies through Redis (its send
refused) and tries the inbox again only after a while."""

from __future__ import annotations

import asyncio
import secrets
import struct
from pathlib import Path

import pytest
import uvloop

from app.pipeline import wire
from app.pipeline.inbox import HELLO, MAX_PATH, REPLY, Inbox, frame
from workers import replies
from workers.replies import Inboxes


def part(inbox: str | None, direct: bool, token: str | None = None) -> wire.QueryPart:
    return wire.QueryPart(reply=token or secrets.token_hex(12), tenant="t",
                          query=wire.SnapshotQuery(type="count", bbox=(0, 0, 1, 1)),
                          as_of=0.0, deadline=1e12, inbox=inbox, direct=direct)


def test_hello_replies_and_bad_frames(tmp_path: Path) -> None:
    async def scenario() -> None:
        inbox = Inbox(tmp_path)
        assert await inbox.start() and inbox.listening
        assert not inbox.reaches(["w0"]) and inbox.reaches([])
        reader, writer = await asyncio.open_unix_connection(inbox.path)
        writer.write(frame(HELLO, b"w0"))
        await writer.drain()
        for _ in range(100):
            if inbox.reaches(["w0"]):
                break
            await asyncio.sleep(0.01)
        assert inbox.reaches(["w0"]) and not inbox.reaches(["w0", "w1"])
        token = secrets.token_hex(12)
        queue = inbox.expect(token)
        writer.write(frame(REPLY, secrets.token_hex(12).encode() + b"not ours"))
        writer.write(frame(REPLY, token.encode() + b"ours"))
        await writer.drain()
        assert await asyncio.wait_for(queue.get(), 5) == b"ours"
        assert queue.empty()
        inbox.forget(token)
        writer.write(struct.pack(">I", 2**31))  # no frame is that long: the connection goes
        await writer.drain()
        assert await asyncio.wait_for(reader.read(), 5) == b""
        for _ in range(100):
            if not inbox.reaches(["w0"]):
                break
            await asyncio.sleep(0.01)
        assert not inbox.reaches(["w0"])
        await inbox.stop()
        assert not inbox.listening and not Path(inbox.path).exists()

    uvloop.run(scenario())


def test_a_path_too_long_for_a_socket_gets_no_inbox(tmp_path: Path) -> None:
    deep = tmp_path / ("d" * (MAX_PATH + 1))
    inbox = Inbox(deep)
    assert not uvloop.run(inbox.start()) and not inbox.listening


def test_a_worker_replies_to_the_inbox_only_when_told_and_able(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A worker connects (hello) on first sight of an inbox and sends there only the replies
    of `direct` parts; once the inbox is gone, its sends are refused (the reply goes to the
    list) and the inbox is not tried again before RETRY_S."""
    monkeypatch.setattr(replies, "RETRY_S", 0.3)

    async def scenario() -> None:
        inbox = Inbox(tmp_path)
        assert await inbox.start()
        worker = Inboxes("w7")
        assert not await asyncio.to_thread(worker.send, part(None, True), b"x")
        assert not await asyncio.to_thread(worker.send, part(inbox.path, False), b"x")
        for _ in range(100):  # (it said hello: the next parts are marked direct)
            if inbox.reaches(["w7"]):
                break
            await asyncio.sleep(0.01)
        assert inbox.reaches(["w7"])
        token = secrets.token_hex(12)
        queue = inbox.expect(token)
        assert await asyncio.to_thread(worker.send, part(inbox.path, True, token), b"answer")
        assert await asyncio.wait_for(queue.get(), 5) == b"answer"
        await inbox.stop()
        sent = await asyncio.to_thread(worker.send, part(inbox.path, True), b"x" * 300_000)
        assert not sent  # the connection is gone: to the list
        assert not await asyncio.to_thread(worker.send, part(inbox.path, True), b"x")
        again = Inbox(tmp_path)
        again.path = inbox.path  # an api process back on the same path
        assert await again.start()
        assert not await asyncio.to_thread(worker.send, part(again.path, True), b"x")
        await asyncio.sleep(0.35)  # past RETRY_S: it connects again
        token = secrets.token_hex(12)
        queue = again.expect(token)
        assert await asyncio.to_thread(worker.send, part(again.path, True, token), b"back")
        assert await asyncio.wait_for(queue.get(), 5) == b"back"
        worker.close()
        await again.stop()

    uvloop.run(scenario())


def test_a_reply_frame_names_its_query() -> None:
    body = frame(REPLY, b"t" * 24 + b"payload")
    (size,) = struct.unpack(">I", body[:4])
    assert size == len(body) - 4 and body[4:5] == REPLY and body[5:29] == b"t" * 24
