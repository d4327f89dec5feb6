"""Query replies straight from the workers to the api process that asked, on a Unix socket of
its own, instead of through Redis (a push to a list that the api's blocking pop takes). That
was one hop of the two a reply made, and the costlier: about 170 µs from the worker's push to
the api's wake-up on this machine, against 30 µs on the socket. Only where a worker shares the
api's host (the socket lives under the data dir); elsewhere, and whenever a worker cannot
reach it, replies go through Redis as before.

A worker connects to the inbox named in a query part (`QueryPart.inbox`) and says hello with
its id; from then on the api sets `QueryPart.direct` in the parts it sends that worker (while
that connection stays open), and the worker sends its reply there instead of to the list. A
reply the worker cannot send there goes to the list all the same, where the api looks when it
waits longer (`app.pipeline.queries._Run.gather`).

Frames: a 4-byte big-endian length, then `H` and the worker id (the hello), or `R`, the part's
24-character reply token, and the encoded `QueryReply`."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import secrets
import struct
from collections import Counter
from pathlib import Path

from prometheus_client import Counter as Metric

log = logging.getLogger(__name__)

HELLO, REPLY = b"H", b"R"
TOKEN_LEN = 24  # `secrets.token_hex(12)`: a query part's reply token
MAX_FRAME = 256 * 1024 * 1024  # a reply of 10 000 records with props is a few MB
# Unix socket paths are at most 107 bytes (Linux); a longer data dir gets no inbox
MAX_PATH = 100

REPLIES = Metric("geoswarm_query_replies_total",
                 "Query replies received, by the way they came (inbox: straight from the "
                 "worker; redis: through a Redis list)", ["via"])


def frame(kind: bytes, body: bytes) -> bytes:
    return struct.pack(">I", len(body) + 1) + kind + body


class Inbox:
    """The api process's end: a Unix socket server that hands each reply to the query waiting
    for its token (`expect`), and knows which workers are connected (`reaches`)."""

    def __init__(self, directory: Path) -> None:
        self.path = str(directory / f"api-{os.getpid()}-{secrets.token_hex(4)}.sock")
        self._server: asyncio.AbstractServer | None = None
        self._waiting: dict[str, asyncio.Queue[bytes]] = {}
        self._workers: Counter[str] = Counter()  # open connections that said hello, by worker
        self._connections: dict[asyncio.StreamWriter, asyncio.Task[None] | None] = {}

    async def start(self) -> bool:
        """Listen; False (and replies go through Redis) where the socket cannot be made."""
        if len(self.path) > MAX_PATH:
            log.info("no query reply inbox: its path %s is over %d bytes", self.path, MAX_PATH)
            return False
        try:
            Path(self.path).parent.mkdir(parents=True, exist_ok=True)
            with contextlib.suppress(FileNotFoundError):
                os.unlink(self.path)
            self._server = await asyncio.start_unix_server(self._serve, self.path)
            os.chmod(self.path, 0o600)
        except OSError as exc:
            log.warning("no query reply inbox at %s (replies go through Redis): %s",
                        self.path, exc)
            self._server = None
            return False
        return True

    async def stop(self) -> None:
        """Stop listening and close the workers' connections (they reply through Redis until
        they reach another inbox)."""
        if self._server is None:
            return
        self._server.close()
        for writer in list(self._connections):
            writer.close()
        serving = [t for t in self._connections.values() if t is not None]
        if serving:
            await asyncio.wait(serving, timeout=2)
        with contextlib.suppress(Exception):
            await asyncio.wait_for(self._server.wait_closed(), 2)
        with contextlib.suppress(OSError):
            os.unlink(self.path)
        self._server = None

    @property
    def listening(self) -> bool:
        return self._server is not None

    def reaches(self, workers: list[str]) -> bool:
        """Whether every one of these workers has a connection open to the inbox."""
        return self._server is not None and all(self._workers[w] > 0 for w in workers)

    def expect(self, token: str) -> asyncio.Queue[bytes]:
        """The queue the replies of a query's round (its token) are put on."""
        queue: asyncio.Queue[bytes] = asyncio.Queue()
        self._waiting[token] = queue
        return queue

    def forget(self, token: str) -> None:
        self._waiting.pop(token, None)

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        worker: str | None = None
        self._connections[writer] = asyncio.current_task()
        try:
            while True:
                try:
                    (size,) = struct.unpack(">I", await reader.readexactly(4))
                    if not 0 < size <= MAX_FRAME:
                        log.warning("query reply inbox: a frame of %d bytes; the connection "
                                    "is closed", size)
                        return
                    body = await reader.readexactly(size)
                except (asyncio.IncompleteReadError, ConnectionError):
                    return
                kind = body[:1]
                if kind == HELLO and worker is None:
                    worker = body[1:].decode("utf-8", "replace")
                    self._workers[worker] += 1
                elif kind == REPLY:
                    queue = self._waiting.get(body[1:1 + TOKEN_LEN].decode("ascii", "replace"))
                    if queue is not None:  # (else its query is over: dropped)
                        queue.put_nowait(body[1 + TOKEN_LEN:])
        finally:
            self._connections.pop(writer, None)
            if worker is not None:
                self._workers[worker] -= 1
                if self._workers[worker] <= 0:
                    del self._workers[worker]
            writer.close()
