"""A WebSocket client of the in-process api: it drives the app's ASGI callable on the app's own
event loop (the portal, where its hub and Redis client live), as uvicorn would, without a socket;
and a raw HTTP request whose body reads are counted."""

from __future__ import annotations

import asyncio
import time
from typing import Any

import orjson

from tests.conftest import InProcessServer


class AsgiWebSocket:
    def __init__(self, server: InProcessServer, query: str = "",
                 headers: dict[str, str] | None = None, path: str = "/v1/stream",
                 client: tuple[str, int] = ("127.0.0.1", 40000), max_frames: int = 0) -> None:
        """`max_frames`: the frames the client holds unread before the app's send blocks (as
        a socket's buffers fill when a client stops reading); 0: no limit."""
        self.server = server
        self.max_frames = max_frames
        self.client = client
        self.query = query
        self.path = path
        self.headers = [(k.lower().encode(), v.encode()) for k, v in (headers or {}).items()]
        self.close_code: int | None = None
        self.close_reason = ""
        self.accepted = False
        self._to_app: asyncio.Queue[dict[str, Any]] | None = None
        self._from_app: asyncio.Queue[dict[str, Any]] | None = None
        self._task: asyncio.Task[None] | None = None

    # --- synchronous API for the tests --------------------------------------------------------
    def connect(self) -> AsgiWebSocket:
        self.server.portal.call(self._connect)
        return self

    def send(self, message: dict[str, Any]) -> None:
        self.server.portal.call(self._send_text, orjson.dumps(message).decode())

    def receive(self, timeout: float = 10) -> list[dict[str, Any]]:
        """The messages of the next text frame (none when the server closed)."""
        return list(self.server.portal.call(self._receive, timeout))

    def wait_closed(self, timeout: float) -> int | None:
        """Read frames until the server closes; its close code (None if it did not in time)."""
        deadline = time.monotonic() + timeout
        while self.close_code is None:
            left = deadline - time.monotonic()
            if left <= 0:
                return None
            try:
                self.receive(timeout=left)
            except TimeoutError:
                return None
        return self.close_code

    def close(self) -> None:
        self.server.portal.call(self._disconnect)

    # --- on the app's loop -----------------------------------------------------------------
    async def _connect(self) -> None:
        self._to_app = asyncio.Queue()
        self._from_app = asyncio.Queue(maxsize=self.max_frames)
        scope = {
            "type": "websocket", "asgi": {"version": "3.0"}, "http_version": "1.1",
            "scheme": "ws", "path": self.path, "raw_path": self.path.encode(),
            "query_string": self.query.encode(), "root_path": "",
            "headers": [(b"host", b"testserver"), *self.headers],
            "client": self.client, "server": ("testserver", 80),
            "subprotocols": [], "state": {},
        }
        await self._to_app.put({"type": "websocket.connect"})
        self._task = asyncio.create_task(
            self.server.app(scope, self._to_app.get, self._from_app.put))  # type: ignore[arg-type]
        first = await asyncio.wait_for(self._from_app.get(), 10)
        if first["type"] == "websocket.accept":
            self.accepted = True
        else:
            self._closed(first)

    async def _send_text(self, text: str) -> None:
        assert self._to_app is not None
        await self._to_app.put({"type": "websocket.receive", "text": text})

    async def _receive(self, timeout: float) -> list[dict[str, Any]]:
        assert self._from_app is not None
        if self.close_code is not None:
            return []
        msg = await asyncio.wait_for(self._from_app.get(), timeout)
        if msg["type"] == "websocket.close":
            self._closed(msg)
            return []
        text = msg.get("text") or (msg.get("bytes") or b"").decode()
        return [orjson.loads(line) for line in text.split("\n") if line]

    def _closed(self, msg: dict[str, Any]) -> None:
        self.close_code = int(msg.get("code", 1000))
        self.close_reason = str(msg.get("reason") or "")

    async def _disconnect(self) -> None:
        if self._to_app is not None:
            await self._to_app.put({"type": "websocket.disconnect", "code": 1000})
        if self._task is not None:
            try:
                await asyncio.wait_for(self._task, 10)
            except Exception:  # noqa: BLE001 - the app's end of a closed socket
                pass


async def _raw_request(server: InProcessServer, method: str, path: str,
                       headers: dict[str, str], body_chunks: list[bytes],
                       client: tuple[str, int]) -> tuple[int, dict[str, str], bytes, int]:
    reads = 0
    chunks = list(body_chunks) or [b""]
    sent: list[dict[str, Any]] = []

    async def receive() -> dict[str, Any]:
        nonlocal reads
        reads += 1
        if chunks:
            chunk = chunks.pop(0)
            return {"type": "http.request", "body": chunk, "more_body": bool(chunks)}
        await asyncio.sleep(3600)  # a client that sends nothing more
        return {"type": "http.disconnect"}

    async def send(message: dict[str, Any]) -> None:
        sent.append(message)

    raw_path, _, query = path.partition("?")
    scope = {
        "type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1", "method": method,
        "scheme": "http", "path": raw_path, "raw_path": raw_path.encode(),
        "query_string": query.encode(), "root_path": "",
        "headers": [(b"host", b"testserver"),
                    *((k.lower().encode(), v.encode()) for k, v in headers.items())],
        "client": client, "server": ("testserver", 80), "state": {},
    }
    await asyncio.wait_for(server.app(scope, receive, send), 30)  # type: ignore[arg-type]
    start = next(m for m in sent if m["type"] == "http.response.start")
    body = b"".join(m.get("body", b"") for m in sent if m["type"] == "http.response.body")
    resp_headers = {k.decode().lower(): v.decode() for k, v in start.get("headers", [])}
    return int(start["status"]), resp_headers, body, reads


def raw_request(server: InProcessServer, method: str, path: str, headers: dict[str, str],
                body_chunks: list[bytes], client: tuple[str, int] = ("127.0.0.1", 40001)
                ) -> tuple[int, dict[str, str], bytes, int]:
    """One HTTP request straight to the app: (status, headers, body, how many times the app
    called `receive` for the request body)."""
    return server.portal.call(_raw_request, server, method, path, headers, body_chunks, client)
