"""compose.yaml's Redis has a password: `requirepass` from REDIS_PASSWORD (no default), the
geoswarm services' GEOSWARM_REDIS_URL carrying the same variable, and a health check that
authenticates. Proven on a real redis-server started with the compose command's arguments (the
variable filled in, as compose would): geoswarm's client gets in with the services' URL, not
without the password, and the health check passes only with it."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import time
from pathlib import Path
from urllib.parse import urlsplit

import pytest
import redis

from app.core.config import Settings
from app.core.redis import free_port, redis_executable
from tests.test_packaging import INTERPOLATION, _argv, _env, _is_geoswarm, _services

PASSWORD = "Xq3-vN_8rT2mK9pL4wZ7yB1cD6fG0hJ5"  # URL-safe, as token_urlsafe gives


def _fill(value: str, variables: dict[str, str]) -> str:
    """Compose interpolation of `${NAME:?message}` with the variables given (all required)."""
    def one(m: re.Match[str]) -> str:
        assert m["op"] in (":?", "?"), f"{m[0]} has a default or none is required"
        return variables[m["name"]]
    return INTERPOLATION.sub(one, value)


def _password_variable(value: str) -> str:
    names = {m["name"] for m in INTERPOLATION.finditer(value)}
    assert len(names) == 1, value
    return names.pop()


def test_redis_requires_a_password_from_the_environment() -> None:
    services = _services()
    argv = _argv(services["redis"]["command"])
    assert argv[0] == "redis-server"  # the image's entrypoint drops root only for redis-server
    secret = argv[argv.index("--requirepass") + 1]
    variable = _password_variable(secret)
    m = INTERPOLATION.fullmatch(secret)
    assert m is not None and m["op"] in (":?", "?"), "the password has a default"
    for name, service in services.items():
        if not _is_geoswarm(service):
            continue
        url = _env(service)["GEOSWARM_REDIS_URL"]
        assert _password_variable(url) == variable, f"{name}: {url}"
        filled = urlsplit(_fill(url, {variable: PASSWORD}))
        assert filled.hostname == "redis" and filled.password == PASSWORD, f"{name}: {url}"
        settings = Settings.model_validate({"redis_url": _fill(url, {variable: PASSWORD})})
        assert settings.redis_url and PASSWORD in settings.redis_url


def _server(argv: list[str], port: int, tmp: Path) -> subprocess.Popen[bytes]:
    """redis-server with the compose command's options, on a free loopback port."""
    return subprocess.Popen([redis_executable(), *argv[1:], "--port", str(port), "--bind",
                             "127.0.0.1", "--dir", str(tmp), "--save", ""],
                            stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT)


def test_the_compose_redis_refuses_clients_without_the_password(tmp_path: Path) -> None:
    services = _services()
    redis_service = services["redis"]
    argv = [_fill(a, {"REDIS_PASSWORD": PASSWORD}) for a in _argv(redis_service["command"])]
    port = free_port()
    server = _server(argv, port, tmp_path)
    try:
        url = _fill(_env(services["api"])["GEOSWARM_REDIS_URL"], {"REDIS_PASSWORD": PASSWORD})
        url = url.replace("@redis:6379", f"@127.0.0.1:{port}")
        client = redis.Redis.from_url(url, socket_connect_timeout=1)
        deadline = time.monotonic() + 15
        while True:
            try:
                assert client.ping()  # geoswarm's client, with the services' URL
                break
            except redis.ConnectionError:
                assert time.monotonic() < deadline, "redis-server did not start"
                time.sleep(0.05)
        client.close()
        stranger = redis.Redis(host="127.0.0.1", port=port)
        with pytest.raises(redis.AuthenticationError):
            stranger.ping()
        stranger.close()

        # The health check, as the container runs it (its redis-cli, its environment).
        test = _argv(redis_service["healthcheck"]["test"])
        assert test[0] == "CMD-SHELL"
        cli = Path(redis_executable()).with_name("redis-cli")
        if not cli.exists():
            cli = Path(shutil.which("redis-cli") or "/nonexistent")
        if not cli.exists():
            pytest.skip("no redis-cli to run the health check with")
        command = test[1].replace("redis-cli", f"{cli} -p {port}")
        env = {k: v for k, v in os.environ.items() if k != "REDISCLI_AUTH"}
        healthy = {k: _fill(str(v), {"REDIS_PASSWORD": PASSWORD})
                   for k, v in _env(redis_service).items()}
        assert subprocess.run(["sh", "-c", command], env={**env, **healthy},
                              timeout=30).returncode == 0
        assert subprocess.run(["sh", "-c", command], env=env, timeout=30).returncode != 0
    finally:
        server.terminate()
        server.wait(10)
