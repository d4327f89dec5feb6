"""A worker's end of the api processes' query reply inboxes (`app.pipeline.inbox`): a
connection to each inbox named in the parts it reads, opened on first sight with a hello, and
the replies of parts marked `direct` sent there. A reply that cannot be sent (the api process
gone, or not reading: its socket full for SEND_TIMEOUT_S) goes to the part's list in Redis, as
every reply did; an inbox that cannot be reached is tried again after RETRY_S."""

from __future__ import annotations

import contextlib
import logging
import socket
import time

from app.pipeline import wire
from app.pipeline.inbox import HELLO, REPLY, TOKEN_LEN, frame

log = logging.getLogger(__name__)

SEND_TIMEOUT_S = 0.2  # a reply the api does not take within this goes to the list
RETRY_S = 5.0  # an inbox that could not be reached is not tried again before this


class Inboxes:
    def __init__(self, worker_id: str) -> None:
        self.worker_id = worker_id
        self._open: dict[str, socket.socket] = {}
        self._failed: dict[str, float] = {}  # path -> when it could not be reached

    def send(self, part: wire.QueryPart, reply: bytes) -> bool:
        """Send the reply to the part's inbox if the part asks for it (connecting on first
        sight of the inbox either way); False when it must go to the list."""
        path = part.inbox
        if path is None or len(part.reply) != TOKEN_LEN:
            return False
        sock = self._connection(path)
        if sock is None or not part.direct:
            return False
        try:
            sock.sendall(frame(REPLY, part.reply.encode("ascii") + reply))
        except (OSError, UnicodeEncodeError) as exc:
            log.info("worker %s: a reply to the inbox %s went to Redis: %s", self.worker_id,
                     path, exc)
            self._drop(path)
            return False
        return True

    def close(self) -> None:
        for path in list(self._open):
            self._drop(path)

    def _connection(self, path: str) -> socket.socket | None:
        sock = self._open.get(path)
        if sock is not None:
            return sock
        failed = self._failed.get(path)
        if failed is not None and time.monotonic() - failed < RETRY_S:
            return None
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            sock.settimeout(SEND_TIMEOUT_S)
            sock.connect(path)
            sock.sendall(frame(HELLO, self.worker_id.encode()))
        except OSError:
            sock.close()
            self._failed[path] = time.monotonic()
            if len(self._failed) > 1000:  # (api processes come and go)
                self._failed.clear()
            return None
        self._failed.pop(path, None)
        self._open[path] = sock
        return sock

    def _drop(self, path: str) -> None:
        sock = self._open.pop(path, None)
        if sock is not None:
            with contextlib.suppress(OSError):
                sock.close()
