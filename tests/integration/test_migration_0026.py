"""Migration 0026 on real Postgres: `jobs.gpus_requested` becomes every GPU an attempt
holds for a training job too (it was GPUs on each VM), and back on downgrade."""

from __future__ import annotations

from sqlalchemy import create_engine, pool, text

from scheduler import migrate
from scheduler.attempts.shape import JobShape
from scheduler.embedded import EmbeddedPostgres

GROUP = '{"roles": {"t": {"command": ["x"], "gpus": 3, "nodes": 2, "primary": true}}}'


def _gpus(engine: object) -> dict[int, int]:
    with engine.connect() as conn:  # type: ignore[attr-defined]
        rows = conn.execute(text("SELECT id, gpus_requested FROM jobs ORDER BY id")).all()
    return {row.id: row.gpus_requested for row in rows}


def test_0026_makes_a_multi_node_rows_gpus_its_total_and_back(postgres: EmbeddedPostgres) -> None:
    # Given a database at 0025 with a training job of 4 GPUs on each of 3 VMs, one of 2
    # GPUs on one VM, a group over two VMs (6 GPUs together, already a total) and a
    # training job of the largest size the old bound allowed on each of 64 VMs
    url = postgres.create_database("migration_0026_gpus")
    migrate.upgrade(url, "0025")
    engine = create_engine(url, poolclass=pool.NullPool)
    with engine.begin() as conn:
        conn.execute(
            text(
                "INSERT INTO jobs (id, model, dataset, reward_function, gpus_requested, nodes,"
                " roles) VALUES (1, 'm', 'd', 'f', 4, 3, NULL), (2, 'm', 'd', 'f', 2, 1, NULL),"
                " (3, 'm', 'd', 'f', 6, 2, CAST(:group AS jsonb)),"
                " (4, 'm', 'd', 'f', 1024, 64, NULL)"
            ),
            {"group": GROUP},
        )
    # When the database is upgraded
    migrate.upgrade(url)
    # Then every row holds every GPU of its attempt, and its shape has the same GPUs on
    # each VM as before
    assert _gpus(engine) == {1: 12, 2: 2, 3: 6, 4: 65536}
    with engine.connect() as conn:
        rows = conn.execute(text("SELECT id, nodes, gpus_requested, roles FROM jobs")).all()
    shapes = {row.id: JobShape.of_row(row) for row in rows}
    assert shapes[1].demands == (4, 4, 4) and shapes[2].demands == (2,)
    assert shapes[3].demands == (3, 3) and shapes[4].demands == (1024,) * 64
    assert not any(s.problem for s in shapes.values())
    # And downgrading gives the old meaning back
    migrate.downgrade(url, "0025")
    assert _gpus(engine) == {1: 4, 2: 2, 3: 6, 4: 1024}
    migrate.upgrade(url)
    assert _gpus(engine) == {1: 12, 2: 2, 3: 6, 4: 65536}
    engine.dispose()
