"""subscriptions.seq as a 64-bit integer

Revision ID: 0003
Revises: 0002
Create Date: 2026-11-24 10:00:00.000000

PostgreSQL: the column becomes BIGINT, and so does its sequence (a sequence has a type of its
own, which would still stop it at 2**31 - 1). SQLite: nothing to do, an INTEGER primary key is
the 64-bit rowid; declaring it BIGINT would even stop it being the rowid (and autoincrementing).
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0003"
down_revision = "0002"
branch_labels = None
depends_on = None

# The sequence behind the SERIAL column, whatever it was named.
_SEQUENCE_AS = ("DO $$ BEGIN EXECUTE format('ALTER SEQUENCE %s AS {type}', "
                "pg_get_serial_sequence('subscriptions', 'seq')); END $$")


def _postgresql() -> bool:
    return op.get_bind().dialect.name == "postgresql"


def upgrade() -> None:
    if not _postgresql():
        return
    op.alter_column("subscriptions", "seq", existing_type=sa.Integer(), type_=sa.BigInteger(),
                    existing_nullable=False)
    op.execute(_SEQUENCE_AS.format(type="bigint"))


def downgrade() -> None:
    # Fails, and changes nothing, once a seq above 2**31 - 1 has been handed out.
    if not _postgresql():
        return
    op.execute(_SEQUENCE_AS.format(type="integer"))
    op.alter_column("subscriptions", "seq", existing_type=sa.BigInteger(), type_=sa.Integer(),
                    existing_nullable=False)
