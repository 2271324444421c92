"""Migrations on real Postgres: upgrade head, models and schema agree, downgrade base."""

from __future__ import annotations

from alembic.autogenerate import compare_metadata
from alembic.runtime.migration import MigrationContext
from sqlalchemy import create_engine, inspect, pool, text

import scheduler.store_records  # noqa: F401  (its model is in Base.metadata)
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


def test_0013_backfills_rank_0_of_a_running_single_node_job(postgres: EmbeddedPostgres) -> None:
    # Given a database at 0012 with a running single-node job (rank 0 on its job row
    # alone), a queued one and a running multi-node job whose ranks are in job_nodes
    url = postgres.create_database("migration_0013_backfill")
    migrate.upgrade(url, "0012")
    engine = create_engine(url, poolclass=pool.NullPool)
    with engine.begin() as conn:
        vm = conn.scalar(text("INSERT INTO vms (name, host) VALUES ('vm0', 'h') RETURNING id"))
        conn.execute(
            text(
                "INSERT INTO jobs (id, model, dataset, reward_function, status, attempt, vm_id,"
                " gpu_indices, gpu_uuids, remote_pid, attempt_dir, launch_token) VALUES"
                " (1, 'm', 'd', 'f', 'running', 2, :vm, '{1}', '{GPU-b}', 42, '/h/a',"
                " '0123456789abcdef'),"
                " (2, 'm', 'd', 'f', 'queued', 0, NULL, NULL, NULL, NULL, NULL, NULL),"
                " (3, 'm', 'd', 'f', 'running', 1, :vm, '{0}', '{GPU-a}', 7, '/h/b',"
                " 'fedcba9876543210')"
            ),
            {"vm": vm},
        )
        conn.execute(text("UPDATE jobs SET nodes = 2 WHERE id = 3"))
        conn.execute(
            text(
                "INSERT INTO job_nodes (job_id, rank, attempt, vm_id, gpu_indices, gpu_uuids,"
                " remote_pid, attempt_dir) VALUES (3, 0, 1, :vm, '{0}', '{GPU-a}', 7, '/h/b'),"
                " (3, 1, 1, :vm, '{2}', '{GPU-c}', 8, '/h/c')"
            ),
            {"vm": vm},
        )
    # When the database is upgraded
    migrate.upgrade(url)
    # Then the running single-node job has its rank 0 row, copied from its job row; the
    # queued job has none and the multi-node job's rows are as they were
    with engine.connect() as conn:
        rows = conn.execute(
            text(
                "SELECT job_id, rank, attempt, vm_id, gpu_indices, gpu_uuids, remote_pid,"
                " attempt_dir, exit_code FROM job_nodes ORDER BY job_id, rank"
            )
        ).all()
    assert [tuple(r) for r in rows] == [
        (1, 0, 2, vm, [1], ["GPU-b"], 42, "/h/a", None),
        (3, 0, 1, vm, [0], ["GPU-a"], 7, "/h/b", None),
        (3, 1, 1, vm, [2], ["GPU-c"], 8, "/h/c", None),
    ]
    # And downgrading (a no-op) and upgrading again keep them
    migrate.downgrade(url, "0012")
    migrate.upgrade(url)
    with engine.connect() as conn:
        assert conn.scalar(text("SELECT count(*) FROM job_nodes")) == 3
    engine.dispose()
