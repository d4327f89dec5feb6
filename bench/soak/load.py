"""The soak's steady load on a running cluster (its workload: bench/soak/workload.py): objects
published at a steady rate, subscriptions deleted and created continuously, and WebSocket
clients that connect, listen, read and leave, some resuming from their cursors and some
dropping the connection without closing it."""

from __future__ import annotations

import asyncio
import contextlib
import math
import random
import time
from collections import Counter
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

import httpx
import numpy as np
import orjson
import websockets
from websockets.asyncio.client import ClientConnection
from websockets.exceptions import ConnectionClosed, WebSocketException

from bench.soak.workload import Fleet, SubscriptionPool, make_records, make_specs


@dataclass
class LoadConfig:
    # Objects offered per second, and subscriptions replaced per second: what 2 workers on a
    # shared 2-vCPU machine sustain with this mix (about half a core each). A backlog that
    # grows is not the steady state a soak wants; 200/s with 10/s churn was one there.
    rate: float = 100.0
    fleet: int = 5000  # moving objects (ids v0, v1, ...); the rest of the stream are events
    moving_fraction: float = 0.8
    subs: int = 2000  # live subscriptions kept
    churn: float = 2.0  # subscriptions deleted (and as many created) per second
    clients: int = 8  # WebSocket clients connected at once
    session_s: tuple[float, float] = (5.0, 30.0)  # a client's stay, uniform
    abort_fraction: float = 0.1  # clients that leave without a closing handshake
    tick_s: float = 0.25  # one publish request per tick
    concurrency: int = 4  # publish requests in flight
    seed: int = 1


class Reservoir:
    """A uniform sample of at most `size` values (latencies of a long soak would not fit)."""

    def __init__(self, size: int = 20_000, seed: int = 0) -> None:
        self.size = size
        self.seen = 0
        self.values: list[float] = []
        self._rng = random.Random(seed)

    def add(self, v: float) -> None:
        self.seen += 1
        if len(self.values) < self.size:
            self.values.append(v)
        else:
            j = self._rng.randrange(self.seen)
            if j < self.size:
                self.values[j] = v

    def percentile(self, p: float) -> float:
        if not self.values:
            return math.nan
        return float(np.percentile(np.asarray(self.values), p * 100))


@dataclass
class LoadStats:
    published: int = 0  # objects accepted (202)
    publish_requests: int = 0
    lagging: int = 0  # times the publisher fell more than a second behind its pace
    subs_created: int = 0
    subs_deleted: int = 0
    subs_expired: int = 0  # TTLs that ran out (seen by the pool's clock)
    reads: int = 0  # list, replay and object GETs answered
    ws_sessions: int = 0
    ws_open: int = 0
    ws_aborted: int = 0
    messages: Counter[str] = field(default_factory=Counter)  # received, by type
    errors: Counter[str] = field(default_factory=Counter)
    error_examples: dict[str, str] = field(default_factory=dict)
    latency_s: Reservoir = field(default_factory=Reservoir)  # match: now - object ts
    live_subs: int = 0
    load_s: float = 0.0  # from the first publish to the end (throughputs are over this)

    def error(self, kind: str, detail: str) -> None:
        self.errors[kind] += 1
        self.error_examples.setdefault(kind, detail[:300])

    @property
    def received(self) -> int:
        """Matches received: `match` and `knn` messages."""
        return self.messages["match"] + self.messages["knn"]

    def counters(self) -> dict[str, float]:
        """What the sampler records beside memory."""
        return {"published_total": float(self.published), "received_total": float(self.received),
                "subscriptions_live": float(self.live_subs), "ws_open": float(self.ws_open),
                "errors_total": float(sum(self.errors.values()))}


@dataclass
class Load:
    """One soak's load on the api at `base_url` with a tenant key."""

    base_url: str
    ws_url: str
    key: str
    cfg: LoadConfig
    stats: LoadStats = field(default_factory=LoadStats)
    pool: SubscriptionPool = field(default_factory=SubscriptionPool)
    cursors: dict[str, str] = field(default_factory=dict)  # subscription -> last cursor

    def __post_init__(self) -> None:
        self.rng = np.random.default_rng(self.cfg.seed)
        self.prng = random.Random(self.cfg.seed)
        self.headers = {"Authorization": f"Bearer {self.key}"}
        self.stop = asyncio.Event()

    async def run(self, seconds: float, should_stop: Callable[[], bool] | None = None
                  ) -> LoadStats:
        """The load for `seconds`, or until `should_stop()` (a process died)."""
        fleet = Fleet(self.cfg.fleet, self.rng)
        # Idle connections are dropped before uvicorn's 5 s keep-alive ends: with httpx's own 5 s
        # a request now and then met a connection the server was closing (ReadError).
        limits = httpx.Limits(max_connections=32, max_keepalive_connections=32,
                              keepalive_expiry=2.0)
        async with httpx.AsyncClient(base_url=self.base_url, headers=self.headers, timeout=30,
                                     limits=limits) as client:
            deadline = time.monotonic() + seconds
            for a in range(0, self.cfg.subs, 1000):
                await self._create(client, make_specs(min(1000, self.cfg.subs - a), self.rng))
            t0 = time.monotonic()
            tasks = [asyncio.create_task(self._supervised("publisher",
                                                          lambda: self._publish(client, fleet))),
                     asyncio.create_task(self._supervised("churn",
                                                          lambda: self._churn(client, fleet))),
                     *(asyncio.create_task(self._supervised("ws client", self._client_slot))
                       for _ in range(self.cfg.clients))]
            while time.monotonic() < deadline and not (should_stop and should_stop()):
                await asyncio.sleep(min(0.5, max(0.0, deadline - time.monotonic())))
            self.stop.set()
            self.stats.load_s = time.monotonic() - t0
            _done, pending = await asyncio.wait(tasks, timeout=30)
            for t in pending:
                t.cancel()
            await asyncio.gather(*pending, return_exceptions=True)
        return self.stats

    async def _supervised(self, name: str, loop: Callable[[], Awaitable[None]]) -> None:
        """Run `loop` until the end, restarting it after an unexpected exception (counted as an
        error): one bug in the load must not quietly remove a third of it."""
        while not self.stop.is_set():
            try:
                await loop()
            except Exception as exc:  # noqa: BLE001
                self.stats.error(f"{name} {type(exc).__name__}", repr(exc))
                await self._pause(1.0)

    async def _pause(self, seconds: float) -> None:
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self.stop.wait(), max(0.0, seconds))

    async def _request(self, client: httpx.AsyncClient, op: str, method: str, url: str,
                       ok: tuple[int, ...], **kw: Any) -> httpx.Response | None:
        try:
            r = await client.request(method, url, **kw)
        except httpx.HTTPError as exc:
            self.stats.error(f"{op} {type(exc).__name__}", str(exc))
            return None
        if r.status_code not in ok:
            self.stats.error(f"{op} {r.status_code}", r.text)
            return None
        return r

    # publishing

    async def _publish(self, client: httpx.AsyncClient, fleet: Fleet) -> None:
        """One request per tick at the configured rate, at most `concurrency` in flight; when
        the api is slower than the pace the publisher waits (and counts it), never piles up."""
        sem = asyncio.Semaphore(self.cfg.concurrency)
        in_flight: set[asyncio.Task[None]] = set()
        carry = 0.0
        next_at = time.perf_counter()
        j = 0
        while not self.stop.is_set():
            next_at += self.cfg.tick_s
            delay = next_at - time.perf_counter()
            if delay > 0:
                await self._pause(delay)
            elif delay < -1.0:
                self.stats.lagging += 1
                next_at = time.perf_counter()
            carry += self.cfg.rate * self.cfg.tick_s
            n = int(carry)
            carry -= n
            if n == 0 or self.stop.is_set():
                continue
            records = make_records(fleet, n, self.cfg.moving_fraction, self.rng, time.time())
            await sem.acquire()
            task = asyncio.create_task(self._post_objects(client, records, ndjson=j % 5 == 4))
            j += 1
            in_flight.add(task)

            def done(t: asyncio.Task[None]) -> None:
                in_flight.discard(t)
                sem.release()

            task.add_done_callback(done)
        await asyncio.gather(*in_flight, return_exceptions=True)

    async def _post_objects(self, client: httpx.AsyncClient, records: list[dict[str, Any]],
                            ndjson: bool) -> None:
        if ndjson:  # the NDJSON path of the same endpoint, one request in five
            body = b"\n".join(orjson.dumps(r) for r in records)
            headers = {"Content-Type": "application/x-ndjson"}
        else:
            body = orjson.dumps({"objects": records})
            headers = {"Content-Type": "application/json"}
        r = await self._request(client, "publish", "POST", "/v1/objects", (202,), content=body,
                                headers=headers)
        self.stats.publish_requests += 1
        if r is not None:
            self.stats.published += int(r.json()["accepted"])

    # subscriptions

    async def _create(self, client: httpx.AsyncClient, specs: list[dict[str, Any]]) -> None:
        """The first one through POST /v1/subscriptions, the others in one batch."""
        if not specs:
            return
        r = await self._request(client, "subscribe", "POST", "/v1/subscriptions", (201,),
                                json=specs[0])
        if r is not None:
            self.pool.add([r.json()["id"]], specs[:1])
            self.stats.subs_created += 1
        if len(specs) > 1:
            r = await self._request(client, "subscribe batch", "POST", "/v1/subscriptions/batch",
                                    (201,), json={"subscriptions": specs[1:]})
            if r is not None:
                self.pool.add(r.json()["ids"], specs[1:])
                self.stats.subs_created += len(specs) - 1
        self.stats.live_subs = len(self.pool.live)

    async def _delete(self, client: httpx.AsyncClient, sid: str) -> None:
        self.pool.live.pop(sid, None)
        self.cursors.pop(sid, None)
        if await self._request(client, "unsubscribe", "DELETE", f"/v1/subscriptions/{sid}",
                               (204,)) is not None:
            self.stats.subs_deleted += 1

    async def _churn(self, client: httpx.AsyncClient, fleet: Fleet) -> None:
        """Each second: forget the expired, delete about `churn` subscriptions, create enough
        to keep `subs`, and read a little (a page of subscriptions, a replay, a position)."""
        while not self.stop.is_set():
            t = time.monotonic()
            for sid in self.pool.expire(t - 2.0):  # a little after the server's expiry
                self.cursors.pop(sid, None)
                self.stats.subs_expired += 1
            deletable = self.pool.deletable()
            n = min(int(self.rng.poisson(self.cfg.churn)), len(deletable))
            await asyncio.gather(*(self._delete(client, sid)
                                   for sid in self.prng.sample(deletable, n)))
            if (missing := self.cfg.subs - len(self.pool.live)) > 0:
                await self._create(client, make_specs(missing, self.rng))
            reads: list[tuple[str, tuple[int, ...]]] = [("/v1/subscriptions?limit=50", (200,))]
            if d := self.pool.deletable():
                reads.append((f"/v1/subscriptions/{self.prng.choice(d)}/matches?limit=100",
                              (200,)))
            if len(fleet):  # 404 until that one is first published
                reads.append((f"/v1/objects/{self.prng.choice(fleet.ids)}", (200, 404)))
            for url, ok in reads:
                if await self._request(client, "read", "GET", url, ok) is not None:
                    self.stats.reads += 1
            self.stats.live_subs = len(self.pool.live)
            await self._pause(1.0 - (time.monotonic() - t))

    # WebSocket clients

    async def _client_slot(self) -> None:
        while not self.stop.is_set():
            await self._session()
            await self._pause(self.prng.uniform(0.0, 1.0))

    def _listen_op(self) -> tuple[dict[str, Any], set[str], set[str]]:
        """A quarter of the clients listen to all; the others to a few subscriptions, resuming
        half of those they have a cursor for. Returns (op, listened, resumed)."""
        if self.prng.random() < 0.25:
            return {"op": "listen", "all": True}, set(), set()
        subs = self.pool.sample(self.prng.randint(1, 50), self.prng)
        since = {s: self.cursors[s] for s in subs
                 if s in self.cursors and self.prng.random() < 0.5}
        op: dict[str, Any] = {"op": "listen", "subscriptions": [s for s in subs if s not in since]}
        if since:
            op["since"] = since
        return op, set(subs), set(since)

    def _change_op(self, listening: set[str]) -> dict[str, Any]:
        if listening and self.prng.random() < 0.5:
            drop = self.prng.sample(sorted(listening), self.prng.randint(1, len(listening)))
            listening.difference_update(drop)
            return {"op": "unlisten", "subscriptions": drop}
        more = self.pool.sample(self.prng.randint(1, 10), self.prng)
        listening.update(more)
        return {"op": "listen", "subscriptions": more}

    async def _session(self) -> None:
        url = f"{self.ws_url}/v1/stream?token={self.key}"
        try:
            ws = await websockets.connect(url, max_size=None, open_timeout=10, close_timeout=5)
        except (OSError, TimeoutError, WebSocketException) as exc:
            self.stats.error(f"ws connect {type(exc).__name__}", str(exc))
            await self._pause(1.0)
            return
        self.stats.ws_sessions += 1
        self.stats.ws_open += 1
        try:
            op, listening, resumed = self._listen_op()
            everything = op.get("all", False)
            await ws.send(orjson.dumps(op).decode())
            end = time.monotonic() + self.prng.uniform(*self.cfg.session_s)
            # a client that listens to all changes nothing until it leaves
            next_op = math.inf if everything else time.monotonic() + self.prng.uniform(2.0, 8.0)
            while not self.stop.is_set():
                now = time.monotonic()
                if now >= end:
                    break
                if now >= next_op:
                    await ws.send(orjson.dumps(self._change_op(listening)).decode())
                    next_op = now + self.prng.uniform(2.0, 8.0)
                    continue
                try:  # at most a second, to see the end of the soak
                    frame = await asyncio.wait_for(ws.recv(), min(end, next_op, now + 1.0) - now)
                except TimeoutError:  # recv is cancellation-safe: nothing is lost
                    continue
                self._read(frame, resumed)
            await self._leave(ws)
        except ConnectionClosed as exc:
            code = exc.rcvd.code if exc.rcvd is not None else None
            self.stats.error(f"ws closed by the server {code}",
                             exc.rcvd.reason if exc.rcvd is not None else str(exc))
        finally:
            self.stats.ws_open -= 1

    async def _leave(self, ws: ClientConnection) -> None:
        if not self.stop.is_set() and self.prng.random() < self.cfg.abort_fraction:
            ws.transport.abort()  # gone without a closing handshake, as a phone in a tunnel
            self.stats.ws_aborted += 1
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(ws.wait_closed(), 5)
        else:
            await ws.close()

    def _read(self, frame: str | bytes, resumed: set[str]) -> None:
        """Count a frame's messages and keep the cursors. The latency of a match is measured
        only when it is live: not read back for a subscription resumed from a cursor."""
        now = time.time()
        text = frame.decode() if isinstance(frame, bytes) else frame
        for line in text.split("\n"):
            if not line:
                continue
            m = orjson.loads(line)
            kind = str(m.get("type"))
            self.stats.messages[kind] += 1
            sub = m.get("subscription")
            if kind == "match" and sub not in resumed:
                self.stats.latency_s.add(now - float(m["object"]["ts"]))
            if kind in ("match", "knn", "gap") and sub in self.pool.live:
                self.cursors[sub] = m["cursor"]
            elif kind == "expired":
                self.cursors.pop(sub, None)
            elif kind == "error" and m.get("code") != "not_found":
                # not_found is the churn racing a listen: a subscription just deleted
                self.stats.error(f"ws error {m.get('code')}", str(m.get("message")))
