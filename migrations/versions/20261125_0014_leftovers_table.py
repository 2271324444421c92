"""leftovers: the ledger table takes the name the code and docs give the concept

Revision ID: 0014
Revises: 0013
Create Date: 2026-11-25 16:00:00

The table of attempts that may still run after their job moved on was created as
`stale_processes`; the code (`scheduler.leftovers`, ORM `Leftover`), the logs and the docs
call them leftovers. The table and its constraints and indexes are renamed (PostgreSQL
renames a constraint's index with it); the rows stay as they are.
"""

from __future__ import annotations

from collections.abc import Sequence

from alembic import op

revision: str = "0014"
down_revision: str | None = "0013"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def _rename(old: str, new: str) -> None:
    op.rename_table(old, new)
    op.execute(
        f"""
DO $$
DECLARE c record;
BEGIN
    FOR c IN SELECT conname FROM pg_constraint
             WHERE conrelid = '{new}'::regclass AND conname LIKE '%{old}%' LOOP
        EXECUTE format('ALTER TABLE {new} RENAME CONSTRAINT %I TO %I',
                       c.conname, replace(c.conname, '{old}', '{new}'));
    END LOOP;
    FOR c IN SELECT indexname FROM pg_indexes
             WHERE tablename = '{new}' AND indexname LIKE '%{old}%' LOOP
        EXECUTE format('ALTER INDEX %I RENAME TO %I',
                       c.indexname, replace(c.indexname, '{old}', '{new}'));
    END LOOP;
END $$;
"""
    )


def upgrade() -> None:
    _rename("stale_processes", "leftovers")


def downgrade() -> None:
    _rename("leftovers", "stale_processes")
