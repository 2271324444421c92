"""Migrations on real Postgres: upgrade head, models and schema agree, downgrade base."""

from __future__ import annotations

from alembic.autogenerate import compare_metadata
from alembic.runtime.migration import MigrationContext
from sqlalchemy import create_engine, inspect, pool

from scheduler import migrate
from scheduler.embedded import EmbeddedPostgres
from scheduler.models import Base


def test_upgrade_check_downgrade(postgres: EmbeddedPostgres) -> None:
    url = postgres.create_database("migration_roundtrip")
    assert migrate.current_revision(url) is None

    migrate.upgrade(url)
    assert migrate.current_revision(url) == migrate.head_revision(url)

    engine = create_engine(url, poolclass=pool.NullPool)
    with engine.connect() as conn:
        diff = compare_metadata(MigrationContext.configure(conn), Base.metadata)
        assert diff == [], f"models and migrations disagree: {diff}"
        assert {"vms", "gpus", "jobs", "job_events"} <= set(inspect(conn).get_table_names())

    migrate.downgrade(url, "base")
    with engine.connect() as conn:
        assert set(inspect(conn).get_table_names()) <= {"alembic_version"}
    assert migrate.current_revision(url) is None

    migrate.upgrade(url)  # and up again: downgrades leave nothing behind that blocks it
    assert migrate.current_revision(url) == migrate.head_revision(url)
    engine.dispose()
