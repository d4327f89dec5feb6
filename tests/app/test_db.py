"""The SQL layer on SQLite and PostgreSQL: Alembic migrations against the models, the SQLite
pragmas, the key and subscription repositories, and the `migrate` / `keys create` commands."""

from __future__ import annotations

import hashlib
import os
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from alembic import command
from alembic.autogenerate import compare_metadata
from alembic.migration import MigrationContext
from alembic.script import ScriptDirectory
from sqlalchemy import Engine, inspect, select, text
from sqlalchemy.orm import Session

from app.core.config import Settings
from app.core.db import make_engine, make_sessionmaker, session_scope
from app.core.migrate import alembic_config, upgrade_head
from app.models import ApiKey, Model, Subscription, Tenant
from app.services import keys, subscriptions

ROOT = Path(__file__).resolve().parents[2]
TABLES = {"tenants", "api_keys", "subscriptions", "balancer_rounds"}


def _settings(database_url: str, tmp_path: Path) -> Settings:
    return Settings(database_url=database_url, data_dir=tmp_path, environment="test")


def _tables(engine: Engine) -> set[str]:
    return set(inspect(engine).get_table_names()) - {"alembic_version"}


def _revision(engine: Engine) -> str | None:
    with engine.connect() as conn:
        return MigrationContext.configure(conn).get_current_revision()


@pytest.fixture
def settings(database_url: str, tmp_path: Path) -> Settings:
    return _settings(database_url, tmp_path)


@pytest.fixture
def engine(settings: Settings) -> Iterator[Engine]:
    upgrade_head(settings)
    engine = make_engine(settings)
    yield engine
    engine.dispose()


@pytest.fixture
def session(engine: Engine) -> Iterator[Session]:
    with make_sessionmaker(engine)() as session:
        yield session


# --- migrations --------------------------------------------------------------------------

def test_upgrade_downgrade_upgrade(settings: Settings) -> None:
    cfg = alembic_config(settings.sqlalchemy_url)
    head = ScriptDirectory.from_config(cfg).get_current_head()
    engine = make_engine(settings)
    try:
        upgrade_head(settings)
        assert _tables(engine) == TABLES
        assert _revision(engine) == head
        command.downgrade(cfg, "base")
        assert _tables(engine) == set()
        assert _revision(engine) is None
        upgrade_head(settings)
        assert _tables(engine) == TABLES
        assert _revision(engine) == head
        upgrade_head(settings)  # at head already: a no-op, not an error
        assert _revision(engine) == head
    finally:
        engine.dispose()


def test_migrated_schema_matches_the_models(engine: Engine) -> None:
    with engine.connect() as conn:
        context = MigrationContext.configure(
            conn, opts={"compare_type": True, "compare_server_default": True}
        )
        diffs = compare_metadata(context, Model.metadata)
    assert diffs == []


BIG_SEQ = 2**31 + 10  # past a 32-bit integer


def _move_seq_past(session: Session, seq: int) -> None:
    """Make the next subscription's seq larger than `seq`: PostgreSQL's sequence is set; SQLite
    continues after the largest rowid, so a row is stored with that seq."""
    if session.get_bind().dialect.name == "postgresql":
        session.execute(text("SELECT setval(pg_get_serial_sequence('subscriptions', 'seq'), :v)"),
                        {"v": seq})
    else:
        keys.ensure_tenant(session, "acme")
        session.add(Subscription(seq=seq, id="s_big", tenant="acme", type="keyword",
                                 spec={"type": "keyword", "keywords": ["big"]}))
    session.commit()


def test_seq_above_2_31_is_stored_and_read_back(engine: Engine) -> None:
    """Subscriptions keep their 64-bit seq (BIGINT on PostgreSQL, the rowid on SQLite), and the
    listing pages over it with cursors."""
    factory = make_sessionmaker(engine)
    with factory() as session:
        _move_seq_past(session, BIG_SEQ)
        rows = subscriptions.create_many(session, "acme", [_spec(i) for i in range(3)])
        session.commit()
        seqs = [r.seq for r in rows]
    assert all(seq > BIG_SEQ for seq in seqs) and seqs == sorted(seqs)
    with factory() as session:
        stored = session.scalars(select(Subscription.seq).where(Subscription.seq > 2**31)
                                 .order_by(Subscription.seq)).all()
        assert stored[-3:] == seqs
        page, cursor = subscriptions.list_page(session, "acme", 2, seqs[0])
        assert [r.seq for r in page] == seqs[1:] and cursor is None
        page, cursor = subscriptions.list_page(session, "acme", 1, seqs[0])
        assert cursor is not None and subscriptions.decode_cursor(cursor) == seqs[1]


def test_upgrade_widens_seq_of_an_existing_database(settings: Settings) -> None:
    """A database made by the revision before 0003, with a subscription in it: upgraded, the
    subscription is intact and new ones get seqs past 2**31."""
    cfg = alembic_config(settings.sqlalchemy_url)
    command.upgrade(cfg, "0002")
    engine = make_engine(settings)
    try:
        with engine.begin() as conn:
            conn.execute(text("INSERT INTO tenants (name, created_at) VALUES ('acme', 0)"))
            conn.execute(text("INSERT INTO subscriptions (id, tenant, type, spec, created_at) "
                              "VALUES ('s_old', 'acme', 'keyword', '{}', 0)"))
        command.upgrade(cfg, "head")
        if engine.dialect.name == "postgresql":
            with engine.connect() as conn:
                types = conn.execute(text(
                    "SELECT c.data_type, s.data_type FROM information_schema.columns c, "
                    "information_schema.sequences s WHERE c.table_name = 'subscriptions' "
                    "AND c.column_name = 'seq' AND s.sequence_name = 'subscriptions_seq_seq'"
                )).one()
            assert tuple(types) == ("bigint", "bigint")
        with make_sessionmaker(engine)() as session:
            _move_seq_past(session, BIG_SEQ)
            (row,) = subscriptions.create_many(session, "acme", [_spec(0)])
            session.commit()
            assert row.seq > BIG_SEQ
            old = session.scalar(select(Subscription).where(Subscription.id == "s_old"))
            assert old is not None and old.seq == 1
            assert session.get(Subscription, row.seq) is not None
    finally:
        engine.dispose()


def test_sqlite_runs_in_wal_mode(tmp_path: Path) -> None:
    settings = Settings(data_dir=tmp_path / "nested" / "data")  # the default database URL
    engine = make_engine(settings)
    try:
        with engine.connect() as conn:
            assert conn.execute(text("PRAGMA journal_mode")).scalar() == "wal"
            assert conn.execute(text("PRAGMA foreign_keys")).scalar() == 1
        assert (tmp_path / "nested" / "data" / "geoswarm.db").exists()
    finally:
        engine.dispose()


# --- API keys ----------------------------------------------------------------------------

def _dump(session: Session) -> str:
    """Every value of every row of every table, as text."""
    rows = []
    for table in Model.metadata.sorted_tables:
        rows += [repr(tuple(r)) for r in session.execute(select(table)).all()]
    return "\n".join(rows)


def test_create_key_stores_only_its_sha256(engine: Engine, settings: Settings) -> None:
    factory = make_sessionmaker(engine)
    with session_scope(factory) as session:
        row, key = keys.create_key(session, "acme", admin=False)
        key_id = row.id
    with factory() as session:
        stored = session.get(ApiKey, key_id)
        assert stored is not None
        assert stored.key_hash == hashlib.sha256(key.encode()).hexdigest()
        assert session.get(Tenant, "acme") is not None
        dump = _dump(session)
    assert stored.key_hash in dump
    assert key not in dump
    if settings.sqlalchemy_url.startswith("sqlite"):
        # Not even in the file's free pages or the WAL.
        engine.dispose()
        path = Path(settings.sqlalchemy_url.split(":///", 1)[1])
        for f in path.parent.glob(path.name + "*"):
            assert key.encode() not in f.read_bytes(), f.name


def test_lookup_and_revoke(engine: Engine) -> None:
    factory = make_sessionmaker(engine)
    with session_scope(factory) as session:
        user_row, user_key = keys.create_key(session, "acme", admin=False)
        admin_row, admin_key = keys.create_key(session, "acme", admin=True)
        _other_row, other_key = keys.create_key(session, "globex", admin=False)
    assert len({user_key, admin_key, other_key}) == 3
    with factory() as session:
        user = keys.lookup(session, user_key)
        assert user is not None
        assert (user.key_id, user.tenant, user.admin) == (user_row.id, "acme", False)
        admin = keys.lookup(session, admin_key)
        assert admin is not None and admin.admin and admin.key_id == admin_row.id
        other = keys.lookup(session, other_key)
        assert other is not None and other.tenant == "globex"
        assert keys.lookup(session, user_key + "x") is None
        assert keys.lookup(session, "") is None
    with session_scope(factory) as session:
        assert keys.revoke_key(session, user_row.id) is True
    with session_scope(factory) as session:
        assert keys.revoke_key(session, user_row.id) is False  # already revoked
        assert keys.revoke_key(session, "k_missing") is False
    with factory() as session:
        assert keys.lookup(session, user_key) is None
        assert keys.lookup(session, admin_key) is not None  # only that key was revoked
        revoked = session.get(ApiKey, user_row.id)
        assert revoked is not None and revoked.revoked_at is not None


# --- subscriptions -----------------------------------------------------------------------

def _spec(i: int, ttl_s: float | None = None) -> dict[str, object]:
    spec: dict[str, object] = {"type": "keyword", "keywords": [f"kw{i}"], "match": "any"}
    if ttl_s is not None:
        spec["ttl_s"] = ttl_s
    return spec


def test_create_many_and_get_with_tenant_isolation(session: Session) -> None:
    before = time.time()
    rows = subscriptions.create_many(session, "acme", [_spec(0), _spec(1, ttl_s=600)])
    session.commit()
    assert [r.type for r in rows] == ["keyword", "keyword"]
    assert len({r.id for r in rows}) == 2
    assert rows[0].seq < rows[1].seq
    assert rows[0].expires_at is None
    assert rows[1].expires_at is not None
    assert before + 600 <= rows[1].expires_at <= time.time() + 600
    assert rows[0].spec == _spec(0)

    got = subscriptions.get(session, "acme", rows[0].id)
    assert got is not None and got.id == rows[0].id
    assert subscriptions.to_public(got)["keywords"] == ["kw0"]
    assert subscriptions.get(session, "globex", rows[0].id) is None  # another tenant's
    assert subscriptions.get(session, "acme", "s_missing") is None
    # get_many promises no order
    assert {r.id for r in subscriptions.get_many(session, "acme", [r.id for r in rows])} \
        == {r.id for r in rows}
    assert subscriptions.get_many(session, "globex", [r.id for r in rows]) == []


def test_a_large_batch_keeps_its_order(session: Session) -> None:
    """One INSERT ... RETURNING for the batch, sent in several pages of rows (over 1 000 on
    PostgreSQL): row i is spec i, in creation (seq) order, read back the same."""
    specs = [_spec(i, ttl_s=60 + i if i % 2 else None) for i in range(2500)]
    rows = subscriptions.create_many(session, "acme", specs)
    session.commit()
    assert [r.spec for r in rows] == specs
    assert [r.seq for r in rows] == sorted(r.seq for r in rows)
    assert [r.expires_at is None for r in rows] == [i % 2 == 0 for i in range(2500)]
    page, _ = subscriptions.list_page(session, "acme", 2500, 0)
    assert [r.id for r in page] == [r.id for r in rows]
    assert subscriptions.create_many(session, "acme", []) == []


def test_get_hides_expired(session: Session) -> None:
    (row,) = subscriptions.create_many(session, "acme", [_spec(0, ttl_s=60)])
    row.expires_at = time.time() - 1
    session.commit()
    assert subscriptions.get(session, "acme", row.id) is None
    assert subscriptions.list_page(session, "acme", 10, 0) == ([], None)


def test_list_page_walks_every_page(session: Session) -> None:
    mine = subscriptions.create_many(session, "acme", [_spec(i) for i in range(7)])
    subscriptions.create_many(session, "globex", [_spec(i) for i in range(3)])
    session.commit()
    seen: list[str] = []
    after, pages = 0, 0
    while True:
        page, cursor = subscriptions.list_page(session, "acme", 3, after)
        pages += 1
        assert len(page) <= 3
        seen += [r.id for r in page]
        if cursor is None:
            break
        decoded = subscriptions.decode_cursor(cursor)
        assert decoded == page[-1].seq
        after = decoded
    assert pages == 3
    assert seen == [r.id for r in mine]  # in creation order, each once, no other tenant's
    # An exact multiple of the page size ends without a dangling empty page.
    page, cursor = subscriptions.list_page(session, "acme", 7, 0)
    assert len(page) == 7 and cursor is None
    assert subscriptions.decode_cursor("not a cursor!") is None
    assert subscriptions.decode_cursor(subscriptions.encode_cursor(42)) == 42


def test_delete_one(session: Session) -> None:
    a, b = subscriptions.create_many(session, "acme", [_spec(0), _spec(1)])
    session.commit()
    assert subscriptions.delete_one(session, "globex", a.id) is None  # not theirs
    session.commit()
    assert subscriptions.get(session, "acme", a.id) is not None
    deleted = subscriptions.delete_one(session, "acme", a.id)
    session.commit()
    assert deleted is not None and deleted.id == a.id
    assert subscriptions.get(session, "acme", a.id) is None
    assert subscriptions.delete_one(session, "acme", a.id) is None  # already gone
    assert [r.id for r in subscriptions.list_page(session, "acme", 10, 0)[0]] == [b.id]


def test_pop_expired_and_all_live(session: Session) -> None:
    forever, short, long = subscriptions.create_many(
        session, "acme", [_spec(0), _spec(1, ttl_s=60), _spec(2, ttl_s=3600)]
    )
    (other,) = subscriptions.create_many(session, "globex", [_spec(3, ttl_s=60)])
    session.commit()
    now = time.time()
    assert subscriptions.pop_expired(session, now) == []
    assert [r.id for r in subscriptions.all_live(session, now)] \
        == [forever.id, short.id, long.id, other.id]

    later = now + 120
    live = [r.id for r in subscriptions.all_live(session, later)]
    assert live == [forever.id, long.id]  # all_live reads, it does not delete
    popped = subscriptions.pop_expired(session, later)
    session.commit()
    assert {r.id for r in popped} == {short.id, other.id}
    assert subscriptions.pop_expired(session, later) == []  # deleted, not returned twice
    remaining = session.scalars(select(Subscription.id).order_by(Subscription.seq)).all()
    assert remaining == [forever.id, long.id]


def test_pop_expired_respects_the_limit(session: Session) -> None:
    subscriptions.create_many(session, "acme", [_spec(i, ttl_s=60) for i in range(5)])
    session.commit()
    later = time.time() + 120
    assert len(subscriptions.pop_expired(session, later, limit=2)) == 2
    session.commit()
    assert len(subscriptions.pop_expired(session, later, limit=10)) == 3
    session.commit()
    assert subscriptions.all_live(session, 0) == []


def test_inputs_that_were_never_ours_are_not_found(session: Session) -> None:
    """NUL (which PostgreSQL cannot even compare) and out-of-range cursors are "not found"."""
    (row,) = subscriptions.create_many(session, "acme", [_spec(0)])
    session.commit()
    assert subscriptions.get(session, "acme", row.id + "\x00") is None
    assert subscriptions.get_many(session, "acme", ["\x00", row.id]) == [row]
    assert subscriptions.delete_one(session, "acme", "\x00") is None
    assert subscriptions.decode_cursor(subscriptions.encode_cursor(2**63)) is None
    assert subscriptions.decode_cursor(subscriptions.encode_cursor(-1)) is None
    assert keys.revoke_key(session, "k_\x00") is False
    assert keys.lookup(session, "gs_\x00") is None  # hashed before it reaches SQL


# --- the CLI (`geoswarm` processes: slow) ------------------------------------------------

def _cli(args: list[str], database_url: str, data_dir: Path) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("GEOSWARM_")}
    env.update({"GEOSWARM_DATABASE_URL": database_url, "GEOSWARM_DATA_DIR": str(data_dir)})
    return subprocess.run([sys.executable, "-m", "app.cli", *args], env=env, cwd=ROOT,
                          capture_output=True, text=True, timeout=120)


@pytest.mark.slow
def test_cli_migrate_and_keys_create(database_url: str, tmp_path: Path) -> None:
    proc = _cli(["migrate"], database_url, tmp_path)
    assert proc.returncode == 0, proc.stderr
    assert "newest schema" in proc.stdout
    settings = _settings(database_url, tmp_path)
    engine = make_engine(settings)
    try:
        assert _tables(engine) == TABLES

        user = _cli(["keys", "create", "--tenant", "acme"], database_url, tmp_path)
        assert user.returncode == 0, user.stderr
        admin = _cli(["keys", "create", "--tenant", "acme", "--admin"], database_url, tmp_path)
        assert admin.returncode == 0, admin.stderr
        user_key, admin_key = user.stdout.strip(), admin.stdout.strip()
        assert len(user_key.split()) == 1 and user_key != admin_key
        with make_sessionmaker(engine)() as session:
            principal = keys.lookup(session, user_key)
            assert principal is not None
            assert (principal.tenant, principal.admin) == ("acme", False)
            principal = keys.lookup(session, admin_key)
            assert principal is not None
            assert (principal.tenant, principal.admin) == ("acme", True)
            assert user_key not in _dump(session)
    finally:
        engine.dispose()


@pytest.mark.slow
@pytest.mark.parametrize("tenant", ["bad tenant!", "", "x" * 65])
def test_cli_keys_create_rejects_an_invalid_tenant(tenant: str, tmp_path: Path) -> None:
    url = f"sqlite:///{tmp_path / 'geoswarm.db'}"
    proc = _cli(["keys", "create", "--tenant", tenant], url, tmp_path)
    assert proc.returncode != 0
    assert "invalid tenant" in proc.stderr
    assert proc.stdout.strip() == ""  # no key printed
    assert not (tmp_path / "geoswarm.db").exists()  # rejected before touching the database
