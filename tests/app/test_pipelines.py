"""`app.core.pipelines`: the api's hot-path pipelines on raw connections give what redis-py's
pipelines give (on the embedded Redis 6.2 and on Redis 7), and never mix two calls' replies:
through a Redis restart, a cancelled blocking call, a password and a database number."""

from __future__ import annotations

import asyncio
import os
import signal
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import hiredis
import pytest
import redis
import redis.asyncio as aioredis
import uvloop
from hypothesis import given, settings
from hypothesis import strategies as st

from app.core.config import Settings
from app.core.pipelines import (
    RIDER,
    Batch,
    ClientPipelines,
    RawPipelines,
    Rider,
    eval_script,
    pack,
    pipelines_for,
)
from app.core.redis import EmbeddedRedis, run_script, start_embedded_redis

SCRIPT = "redis.call('SET', KEYS[1], ARGV[1]); return tonumber(ARGV[2]) * 2"


def run(coro: Any) -> Any:
    return uvloop.run(coro)


def mixed(prefix: str) -> list[tuple[Any, ...]]:
    """Commands of every reply type the hot path meets, an error reply among them."""
    return [("SET", f"{prefix}s", "v"), ("GET", f"{prefix}s"), ("GET", f"{prefix}none"),
            ("INCR", f"{prefix}c"), ("EXPIRE", f"{prefix}c", 2),
            ("RPUSH", f"{prefix}l", b"\x00\xff"),
            ("BLPOP", f"{prefix}l", 0.05), ("BLPOP", f"{prefix}empty", 0.01),
            ("EVAL", SCRIPT, 1, f"{prefix}e", "x", 21), ("HGET", f"{prefix}s", "f"),
            ("XADD", f"{prefix}x", "MAXLEN", "~", 10, "*", "m", b"part"),
            ("GET", f"{prefix}e")]


def normal(reply: Any) -> Any:
    """A reply as both sides give it (redis-py turns some replies into bools and tuples)."""
    if isinstance(reply, Exception):
        return (type(reply).__name__, str(reply))
    if isinstance(reply, tuple | list):
        return [normal(r) for r in reply]
    if isinstance(reply, bool) or reply == b"OK":
        return int(reply) if isinstance(reply, bool) else 1
    if isinstance(reply, bytes) and reply.count(b"-") == 1 and reply[:1].isdigit():
        return "stream-id"
    if isinstance(reply, bytes):
        return reply.replace(b"gs:test:raw:", b"P:").replace(b"gs:test:cli:", b"P:")
    return reply


def test_replies_equal_redis_py_pipelines(redis_url: str) -> None:
    async def scenario() -> tuple[list[Any], list[Any]]:
        client = aioredis.Redis.from_url(redis_url)
        raw = RawPipelines.from_url(redis_url)
        assert raw is not None
        try:
            got = await raw.execute(mixed("gs:test:raw:"), block_s=0.1, raise_on_error=False)
            want = await ClientPipelines(client).execute(mixed("gs:test:cli:"), block_s=0.1,
                                                         raise_on_error=False)
            with pytest.raises(redis.exceptions.ResponseError, match="WRONGTYPE"):
                await raw.execute([("HGET", "gs:test:raw:s", "f"), ("GET", "gs:test:raw:s")])
            return got, want
        finally:
            await raw.aclose()
            await client.delete(*[f"gs:test:{side}:{k}" for side in ("raw", "cli")
                                  for k in ("s", "c", "l", "e", "x")])
            await client.aclose()

    got, want = run(scenario())
    assert [normal(r) for r in got] == [normal(r) for r in want]
    assert got[1] == b"v" and got[2] is None and got[6] == [b"gs:test:raw:l", b"\x00\xff"]
    assert got[7] is None and got[8] == 42 and isinstance(got[9], redis.exceptions.ResponseError)


def test_batch_queues_scripts_as_on_a_pipeline(redis_url: str) -> None:
    async def scenario() -> list[Any]:
        client = aioredis.Redis.from_url(redis_url)
        raw = RawPipelines.from_url(redis_url)
        assert raw is not None
        batch = Batch()
        run_script(batch, client.register_script(SCRIPT), ["gs:test:batch"], ["y", 4])
        batch.execute_command("GET", "gs:test:batch")
        try:
            return await raw.execute(batch.command_stack)
        finally:
            await raw.aclose()
            await client.delete("gs:test:batch")
            await client.aclose()

    assert run(scenario()) == [8, b"y"]


def test_only_plain_tcp_urls_are_served_raw() -> None:
    assert RawPipelines.from_url("rediss://127.0.0.1:6380/0") is None
    assert RawPipelines.from_url("unix:///tmp/redis.sock") is None
    assert RawPipelines.from_url("redis://127.0.0.1:6379/0?socket_timeout=3") is None
    raw = RawPipelines.from_url("redis://us%40r:p%3Ass@127.0.0.1:1/3")
    assert raw is not None
    assert (raw.host, raw.port, raw.db, raw.username, raw.password) == (
        "127.0.0.1", 1, 3, "us@r", "p:ss")
    client = aioredis.Redis.from_url("rediss://127.0.0.1:6380/0")
    assert isinstance(pipelines_for("rediss://127.0.0.1:6380/0", client), ClientPipelines)
    with pytest.raises(redis.exceptions.DataError, match="NoneType"):
        pack([("GET", None)])
    with pytest.raises(redis.exceptions.DataError, match="bool"):
        pack([("SET", "k", "v"), ["GET", True]])


def resp(commands: list[list[Any]]) -> bytes:
    """RESP arrays of bulk strings, written out by hand: str as UTF-8, numbers as repr."""
    out = b""
    for command in commands:
        out += b"*%d\r\n" % len(command)
        for arg in command:
            data = arg if isinstance(arg, bytes) else (
                arg.encode() if isinstance(arg, str) else repr(arg).encode())
            out += b"$%d\r\n%s\r\n" % (len(data), data)
    return out


@settings(max_examples=300, deadline=None)
@given(st.lists(st.lists(st.one_of(
    st.text(), st.binary(), st.integers(-2**80, 2**80),
    st.floats(allow_nan=False)), min_size=1, max_size=6), max_size=5))
def test_commands_are_packed_as_resp(commands: list[list[Any]]) -> None:
    assert pack(commands) == resp(commands)
    assert pack([tuple(c) for c in commands]) == resp(commands)


@pytest.fixture
def own_redis(tmp_path: Path) -> Iterator[EmbeddedRedis]:
    server = start_embedded_redis(Settings(data_dir=tmp_path / "redis"))
    yield server
    server.stop()


def test_a_redis_restart_is_met_by_a_new_connection(tmp_path: Path,
                                                    own_redis: EmbeddedRedis) -> None:
    """The idle connections die with the server: the next call is made again on a new one."""
    url = own_redis.url
    port = own_redis.port

    async def scenario() -> None:
        raw = RawPipelines.from_url(url)
        assert raw is not None
        await raw.execute([("SET", "k", "before")])
        os.kill(own_redis.process.pid, signal.SIGKILL)
        own_redis.process.wait()
        with pytest.raises(redis.exceptions.ConnectionError):
            await raw.execute([("GET", "k")])  # every attempt refused: no server
        again = start_embedded_redis(Settings(data_dir=tmp_path / "redis"), port=port)
        try:
            await raw.execute([("SET", "k", "after")])
            assert await raw.execute([("GET", "k")]) == [b"after"]
        finally:
            await raw.aclose()
            again.stop()

    run(scenario())


def test_a_cancelled_blocking_call_leaves_no_reply_behind(redis_url: str) -> None:
    """A call cancelled while Redis still owes its reply closes its connection: the next call
    never reads that reply as its own."""
    async def scenario() -> None:
        raw = RawPipelines.from_url(redis_url)
        client = aioredis.Redis.from_url(redis_url)
        assert raw is not None
        try:
            await raw.execute([("SET", "gs:test:cancel:k", "mine")])
            waiting = asyncio.ensure_future(
                raw.execute([("BLPOP", "gs:test:cancel:l", 2)], block_s=2))
            await asyncio.sleep(0.1)
            waiting.cancel()
            with pytest.raises(asyncio.CancelledError):
                await waiting
            await client.rpush("gs:test:cancel:l", "late")
            for _ in range(20):
                assert await raw.execute([("GET", "gs:test:cancel:k")]) == [b"mine"]
            # Redis dropped the blocked client with its connection: the value is still there
            assert await client.lrange("gs:test:cancel:l", 0, -1) == [b"late"]
        finally:
            await raw.aclose()
            await client.delete("gs:test:cancel:k", "gs:test:cancel:l")
            await client.aclose()

    run(scenario())


def test_a_rider_goes_with_the_next_pipeline_of_its_context(redis_url: str) -> None:
    """The commands of a `Rider` set for a context are sent with the first pipeline sent in it
    (one write on one connection: the same client id), their replies split off; later
    pipelines carry nothing more; one that no pipeline took sends itself; a pipeline that
    fails fails its rider (the key check it carries is then made in full)."""
    async def scenario() -> None:
        raw = RawPipelines.from_url(redis_url)
        assert raw is not None and raw.rides and not ClientPipelines(None).rides
        try:
            rider = Rider([("CLIENT", "ID"), ("INCR", "gs:test:rider:n")])
            token = RIDER.set(rider)
            try:
                mine = await raw.execute([("CLIENT", "ID"), ("GET", "gs:test:rider:n")])
                assert await raw.execute([("GET", "gs:test:rider:n")]) == [b"1"]
            finally:
                RIDER.reset(token)
            ridden = await rider.replies(raw)
            assert ridden[0] == mine[0] and ridden[1] == 1  # one connection, one pipeline
            assert mine[1] == b"1"  # the rider's commands went first
            alone = Rider([("INCR", "gs:test:rider:n")])  # no pipeline took it
            assert await alone.replies(raw) == [2]
            # a task started in the context takes it (as a query's does)
            later = Rider([("INCR", "gs:test:rider:n")])
            token = RIDER.set(later)
            try:
                task = asyncio.ensure_future(raw.execute([("PING",)]))
            finally:
                RIDER.reset(token)
            assert await task == [b"PONG"]
            assert await later.replies(raw) == [3]
            broken = Rider([("GET", "gs:test:rider:n")])
            token = RIDER.set(broken)
            try:
                with pytest.raises(redis.exceptions.ResponseError):
                    await raw.execute([("NO-SUCH-COMMAND",)])  # (an error reply, not a break)
            finally:
                RIDER.reset(token)
            assert await broken.replies(raw) == [b"3"]
            dead = RawPipelines("127.0.0.1", 1)  # nothing listens on port 1
            lost = Rider([("GET", "gs:test:rider:n")])
            token = RIDER.set(lost)
            try:
                with pytest.raises(redis.exceptions.ConnectionError):
                    await dead.execute([("PING",)])
            finally:
                RIDER.reset(token)
            with pytest.raises(redis.exceptions.ConnectionError):
                await lost.replies(raw)
        finally:
            await raw.execute([("DEL", "gs:test:rider:n")])
            await raw.aclose()

    run(scenario())


def test_password_and_database(own_redis: EmbeddedRedis) -> None:
    admin = redis.Redis.from_url(own_redis.url)
    admin.config_set("requirepass", "s3cret")
    port = own_redis.port

    async def scenario() -> None:
        raw = RawPipelines.from_url(f"redis://:s3cret@127.0.0.1:{port}/5")
        wrong = RawPipelines.from_url(f"redis://:nope@127.0.0.1:{port}/5")
        assert raw is not None and wrong is not None
        try:
            await raw.execute([("SET", "k", "in five")])
            with pytest.raises(redis.exceptions.AuthenticationError):
                await wrong.execute([("GET", "k")])
        finally:
            await raw.aclose()
            await wrong.aclose()

    run(scenario())
    five = redis.Redis.from_url(f"redis://:s3cret@127.0.0.1:{port}/5")
    zero = redis.Redis.from_url(f"redis://:s3cret@127.0.0.1:{port}/0")
    assert five.get("k") == b"in five" and zero.get("k") is None


def test_a_script_redis_lost_is_sent_again_with_its_text(redis_url: str) -> None:
    """`eval_script` runs a script by its hash, and by its text once Redis lost it (a
    restart, SCRIPT FLUSH); an error the script raises is raised, both ways."""
    text = "return redis.call('INCRBY', KEYS[1], ARGV[1])"
    failing = "return redis.error_reply('ERR told to fail')"

    async def scenario() -> list[Any]:
        client = aioredis.Redis.from_url(redis_url)
        raw = RawPipelines.from_url(redis_url)
        assert raw is not None
        got = []
        try:
            for pipelines in (raw, ClientPipelines(client)):
                await client.script_flush()
                got.append(await eval_script(pipelines, text, ["gs:test:script"], [2]))
                got.append(await eval_script(pipelines, text, ["gs:test:script"], [3]))
                for _ in range(2):  # by its text, then by its hash
                    with pytest.raises(redis.exceptions.ResponseError, match="told to fail"):
                        await eval_script(pipelines, failing, [], [])
            return got
        finally:
            await raw.aclose()
            await client.delete("gs:test:script")
            await client.aclose()

    assert run(scenario()) == [2, 5, 7, 10]


def test_a_loading_redis_is_asked_again_then_refused_as_redis_py_does() -> None:
    """A Redis that is loading its data answers LOADING (a restart on a large AOF: too slow to
    make here, so a stand-in server answers it): the call is made again shortly, and while it
    lasts past the retries the error is redis-py's BusyLoadingError (the api's 503), never a
    plain ResponseError (a 500)."""
    async def scenario() -> tuple[list[Any], type[BaseException], int]:
        loading = {"left": 2}
        calls = {"n": 0}

        async def serve(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            parser = hiredis.Reader()
            while data := await reader.read(65536):
                parser.feed(data)
                while (command := parser.gets()) is not False:
                    calls["n"] += 1
                    if loading["left"]:
                        loading["left"] -= 1
                        writer.write(b"-LOADING Redis is loading the dataset in memory\r\n")
                    else:
                        writer.write(b"$%d\r\n%s\r\n" % (len(command[1]), command[1]))

        server = await asyncio.start_server(serve, "127.0.0.1", 0)
        port = server.sockets[0].getsockname()[1]
        raw = RawPipelines("127.0.0.1", port)
        try:
            got = await raw.execute([("ECHO", "hello")])
            loading["left"] = 10**6
            with pytest.raises(redis.exceptions.RedisError) as refused:
                await raw.execute([("ECHO", "again")])
            return got, refused.type, calls["n"]
        finally:
            await raw.aclose()
            server.close()

    got, refused, calls = run(scenario())
    assert got == [b"hello"]
    assert refused is redis.exceptions.BusyLoadingError
    assert calls == 3 + 4  # two refusals and an answer; then every attempt refused
