"""A WebSocket client that collects messages (frames split on newlines), resumable by cursor."""

from __future__ import annotations

import asyncio
import contextlib
from collections import Counter
from collections.abc import Callable, Coroutine
from pathlib import Path
from typing import Any

import httpx
import orjson
import websockets

from bench.cluster import LiveServer, start_server


class Listener:
    def __init__(self, ws_url: str, key: str) -> None:
        self.url = f"{ws_url}/v1/stream?token={key}"
        self.messages: list[dict[str, Any]] = []
        self.cursors: dict[str, str] = {}
        self.ws: Any = None
        self._task: asyncio.Task[None] | None = None
        self.closed_code: int | None = None
        self._acks: asyncio.Queue[dict[str, Any]] = asyncio.Queue()

    async def connect(self) -> None:
        self.ws = await websockets.connect(self.url, max_size=None)
        self._task = asyncio.create_task(self._read())

    async def _read(self) -> None:
        try:
            async for frame in self.ws:
                for line in frame.split("\n"):
                    msg = orjson.loads(line)
                    if msg["type"] in ("listening", "error"):
                        await self._acks.put(msg)
                        if msg["type"] == "listening":
                            continue
                    self.messages.append(msg)
                    if "cursor" in msg:
                        self.cursors[msg["subscription"]] = msg["cursor"]
        except websockets.ConnectionClosed as exc:
            self.closed_code = exc.rcvd.code if exc.rcvd else None

    async def listen(self, subs: list[str] | None = None, all: bool = False,
                     since: dict[str, str] | None = None) -> dict[str, Any]:
        msg: dict[str, Any] = {"op": "listen"}
        if subs:
            msg["subscriptions"] = subs
        if all:
            msg["all"] = True
        if since:
            msg["since"] = since
        await self.ws.send(orjson.dumps(msg).decode())
        while True:
            ack = await asyncio.wait_for(self._acks.get(), 10)
            if ack["type"] == "listening":
                return ack

    async def close(self) -> None:
        if self.ws is not None:
            await self.ws.close()
        if self._task is not None:
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await self._task

    def matches(self) -> list[dict[str, Any]]:
        return [m for m in self.messages if m["type"] == "match"]

    def report(self, got: Counter[Any], want: Counter[Any]) -> str:
        """What an exact-delivery assertion on this connection says when it fails: per
        subscription the matches missing and extra, with the last cursor received, and
        whether the connection had ended (and how)."""
        by_sub: dict[str, list[Any]] = {}
        for diff, col in ((want - got, 0), (got - want, 1)):
            for match, n in diff.items():
                row = by_sub.setdefault(match[0], [0, 0, self.cursors.get(match[0])])
                row[col] += n
        ended = self._task is not None and self._task.done()
        return (f"missing, extra, last cursor by subscription: {by_sub}; connection ended: "
                f"{ended} (close code {self.closed_code})")


async def subscribe_listening(server: LiveServer, client: Any, key: str,
                              specs: list[dict[str, Any]]) -> tuple[list[str], Listener]:
    """Create `specs` in one batch and a WebSocket listening to them."""
    r = await client.post("/v1/subscriptions/batch", json={"subscriptions": specs},
                          headers={"Authorization": f"Bearer {key}"})
    assert r.status_code == 201, r.text
    ids: list[str] = r.json()["ids"]
    listener = Listener(server.ws_url, key)
    await listener.connect()
    await listener.listen(ids)
    return ids, listener


async def wait_for(predicate: Any, timeout: float = 30.0, interval: float = 0.05) -> bool:
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    while loop.time() < deadline:
        if predicate():
            return True
        await asyncio.sleep(interval)
    return bool(predicate())


async def replay_all(client: httpx.AsyncClient, sub: str, headers: dict[str, str]
                     ) -> list[dict[str, Any]]:
    items: list[dict[str, Any]] = []
    since: str | None = None
    while True:
        params: dict[str, Any] = {"limit": 500}
        if since:
            params["since"] = since
        r = await client.get(f"/v1/subscriptions/{sub}/matches", params=params, headers=headers)
        r.raise_for_status()
        body = r.json()
        if not body["items"]:
            return items
        items.extend(body["items"])
        since = body["next_cursor"]


def run_on_cluster(tmp: Path, redis_url: str, workers: int,
                   scenario: Callable[[LiveServer], Coroutine[Any, Any, None]],
                   **env: str) -> None:
    """Start an api and `workers` workers (settings `env`), run the async scenario against
    them and stop them, whatever happens."""
    server = start_server(tmp, redis_url, workers=workers, **env)
    try:
        server.wait_workers(workers)
        asyncio.run(scenario(server))
    except BaseException:
        print_logs(server)
        raise
    finally:
        server.stop()


def print_logs(server: LiveServer, lines: int = 80) -> None:
    """The end of each process's log, for a failed test's report (pytest shows what a failed
    test printed; the logs go with its temporary directory)."""
    for log in sorted(server.log_dir.glob("*.log")):
        tail = log.read_text(errors="replace").splitlines()[-lines:]
        print(f"--- {log.name} (last {len(tail)} lines)", *tail, sep="\n")
