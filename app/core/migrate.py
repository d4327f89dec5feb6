"""Run Alembic migrations programmatically (`geoswarm migrate`, and api/dev on start)."""

from __future__ import annotations

from pathlib import Path

from alembic import command
from alembic.config import Config

from app.core.config import Settings

ROOT = Path(__file__).resolve().parents[2]


def alembic_config(url: str) -> Config:
    cfg = Config(str(ROOT / "alembic.ini"))
    cfg.set_main_option("script_location", str(ROOT / "migrations"))
    cfg.set_main_option("sqlalchemy.url", url.replace("%", "%%"))
    return cfg


def upgrade_head(settings: Settings) -> None:
    url = settings.sqlalchemy_url
    if url.startswith("sqlite:///"):
        Path(url.split(":///", 1)[1]).parent.mkdir(parents=True, exist_ok=True)
    command.upgrade(alembic_config(url), "head")
