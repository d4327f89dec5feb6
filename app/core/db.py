"""SQLAlchemy 2 engine and sessions; SQLite in WAL mode by default, PostgreSQL via psycopg 3."""

from __future__ import annotations

import sqlite3
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import orjson
from sqlalchemy import Engine, create_engine, event
from sqlalchemy.orm import Session, sessionmaker

from app.core.config import Settings

WAL_ATTEMPTS = 100  # 0.1 s apart: the switch to WAL waits up to 10 s for another process


def _json_text(value: Any) -> str:
    return orjson.dumps(value).decode()


# JSON columns (a subscription's spec) through orjson, not the json module: writing and reading
# them back was a fifth of the time of creating a batch of subscriptions.
JSON_CODEC: dict[str, Any] = {"json_serializer": _json_text, "json_deserializer": orjson.loads}


def make_engine(settings: Settings) -> Engine:
    url = settings.sqlalchemy_url
    if url.startswith("sqlite"):
        path = url.split(":///", 1)[1] if ":///" in url else ""
        if path and path != ":memory:":
            Path(path).parent.mkdir(parents=True, exist_ok=True)
        engine = create_engine(
            url, connect_args={"check_same_thread": False, "timeout": 30}, pool_size=20,
            max_overflow=20, **JSON_CODEC,
        )

        @event.listens_for(engine, "connect")
        def _sqlite_pragmas(dbapi_conn: Any, _record: Any) -> None:
            cur = dbapi_conn.cursor()
            # WAL persists in the file: switching needs an exclusive lock, which another
            # process starting at the same moment may hold ("database is locked", at once:
            # SQLite does not wait for a lock upgrade that could deadlock), so try again
            for attempt in range(WAL_ATTEMPTS):
                try:
                    if str(cur.execute("PRAGMA journal_mode").fetchone()[0]).lower() != "wal":
                        cur.execute("PRAGMA journal_mode=WAL")
                    break
                except sqlite3.OperationalError as exc:
                    if "locked" not in str(exc) or attempt == WAL_ATTEMPTS - 1:
                        raise
                    time.sleep(0.1)
            cur.execute("PRAGMA synchronous=NORMAL")
            cur.execute("PRAGMA foreign_keys=ON")
            cur.execute("PRAGMA busy_timeout=30000")
            cur.close()

        return engine
    return create_engine(url, pool_pre_ping=True, pool_size=10, max_overflow=20,
                         **JSON_CODEC)


def make_sessionmaker(engine: Engine) -> sessionmaker[Session]:
    return sessionmaker(engine, expire_on_commit=False)


@contextmanager
def session_scope(factory: sessionmaker[Session]) -> Iterator[Session]:
    """One unit of work: commit on success, roll back on any error."""
    session = factory()
    try:
        yield session
        session.commit()
    except BaseException:
        session.rollback()
        raise
    finally:
        session.close()
