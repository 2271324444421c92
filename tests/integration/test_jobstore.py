"""`job submit` and `job list` run the statements of `scheduler.jobstore` on a plain psycopg
connection (`pgconn.PgDatabase`), everything else on a SQLAlchemy session (`Database`):
both paths write the same rows and read the same jobs, and the ORM's `job_to_dict` shows a
job as the listing does."""

from __future__ import annotations

from collections.abc import AsyncIterator
from datetime import datetime
from typing import Any

import pytest
from sqlalchemy import text

from scheduler.db import Database
from scheduler.embedded import EmbeddedNats
from scheduler.jobs import get_job, insert_job, job_to_dict, list_jobs
from scheduler.jobstore import JobSpec
from scheduler.jobstore import insert_job as insert_job_sql
from scheduler.jobstore import list_jobs as list_jobs_sql
from scheduler.pgconn import PgDatabase
from scheduler.settings import Settings
from scheduler.states import JobStatus
from scheduler.submit import submit_job

SPEC = JobSpec(
    model="Qwen/Qwen2.5-0.5B-Instruct",
    dataset="openai/gsm8k",
    reward_functions=("correctness", "format"),
    gpus=2,
    max_retries=5,
    priority=-3,
    name="100%_sure",
    extra_args=("--max_steps", "5"),
    output_dir="~/out",
    env=(("HF_TOKEN", "secret"), ("A_B", "x")),
)


@pytest.fixture
async def pg(database_url: str) -> AsyncIterator[PgDatabase]:
    """The command line's connection to the test's database."""
    database = PgDatabase(database_url)
    yield database
    await database.dispose()


async def stored(db: Database, job_id: int) -> tuple[dict[str, Any], list[tuple[Any, ...]]]:
    """The job's row without its id, each timestamp as whether it is set, and its events."""
    async with db.transaction() as session:
        row = await session.execute(text("SELECT * FROM jobs WHERE id = :id"), {"id": job_id})
        job = dict(row.one()._mapping)
        events = await session.execute(
            text(
                "SELECT from_status, to_status, reason, actor, attempt, "
                "created_at = (SELECT submitted_at FROM jobs WHERE id = :id) "
                "FROM job_events WHERE job_id = :id ORDER BY id"
            ),
            {"id": job_id},
        )
        event_rows = [tuple(e) for e in events]
    assert job["queued_at"] == job["submitted_at"]
    job.pop("id")
    return {
        k: (v is not None) if isinstance(v, datetime) else v for k, v in job.items()
    }, event_rows


async def test_both_paths_insert_the_same_rows(db: Database, pg: PgDatabase) -> None:
    async with pg.sql_transaction() as tx:
        from_cli = await insert_job_sql(tx, SPEC, actor="cli")
    async with db.transaction() as session:
        from_daemon = await insert_job(session, SPEC, actor="cli")
    assert from_cli.id != from_daemon.id
    assert from_cli.attempt == from_daemon.attempt == 0
    cli_rows, daemon_rows = await stored(db, from_cli.id), await stored(db, from_daemon.id)
    assert cli_rows == daemon_rows
    job, events = cli_rows
    assert job["status"] == "queued" and job["env"] == {"HF_TOKEN": "secret", "A_B": "x"}
    assert (
        job["extra_args"] == ["--max_steps", "5"] and job["reward_function"] == "correctness,format"
    )
    assert events == [(None, "queued", "submitted", "cli", 0, True)]


async def test_both_paths_list_the_same_jobs(db: Database, pg: PgDatabase) -> None:
    """Every filter of the listing, on both connections, and each job as `job_to_dict`
    shows it from the ORM."""
    async with db.transaction() as session:
        for name in ("100%_sure", "100x sure", None):
            await insert_job(session, JobSpec("m", "d", ("r",), name=name), actor="t")
        on_vm = await insert_job(session, SPEC, actor="t")
        for statement in (
            "UPDATE jobs SET status = 'pending', status_reason = 'why' WHERE name = '100x sure'",
            "INSERT INTO vms (name, host) VALUES ('vm-a', 'h')",
            "UPDATE jobs SET status = 'running', vm_id = (SELECT id FROM vms), attempt = 1, "
            "gpu_indices = '{1,0}', gpu_uuids = '{GPU-b,GPU-a}', remote_pid = 42, "
            f"running_at = now() WHERE id = {on_vm.id}",
        ):
            await session.execute(text(statement))
    filters: list[dict[str, Any]] = [
        {},
        {"limit": 2},
        {"status": JobStatus.PENDING},
        {"status": [JobStatus.QUEUED, JobStatus.RUNNING]},
        {"status": []},
        {"name": "%_"},
        {"name": "100X"},
        {"name": "sure", "status": JobStatus.QUEUED},
        {"status": JobStatus.RUNNING},
    ]
    for wanted in filters:
        async with pg.sql_transaction() as tx:
            from_cli = await list_jobs_sql(tx, **wanted)
        async with db.transaction() as session:
            from_daemon = await list_jobs(session, **wanted)
            from_orm = [job_to_dict(await get_job(session, j["id"])) for j in from_daemon]
        assert from_cli == from_daemon == from_orm, wanted
    async with pg.sql_transaction() as tx:
        literal = await list_jobs_sql(tx, name="%_")  # not a wildcard: "100x sure" is not
        assert [j["name"] for j in literal] == ["100%_sure", "100%_sure"]
        pending = await list_jobs_sql(tx, status=JobStatus.PENDING)
        (running,) = await list_jobs_sql(tx, status=JobStatus.RUNNING)
    assert [(j["name"], j["status_reason"]) for j in pending] == [("100x sure", "why")]
    assert list(pending[0]) == list(job_to_dict(await _orm_job(db, pending[0]["id"])))
    assert (running["vm"], running["gpu_indices"], running["gpu_uuids"]) == (
        "vm-a",
        [1, 0],
        ["GPU-b", "GPU-a"],
    )
    assert running["env_keys"] == ["A_B", "HF_TOKEN"] and "secret" not in repr(running)


async def test_a_job_group_is_listed_as_one_on_both_paths(db: Database, pg: PgDatabase) -> None:
    """`group` says a job's `gpus` is every VM's GPUs together (a job group), not each
    node's (a multi-node job): the dashboard shows `gpus × nodes` only for the latter. A
    row whose roles hold a JSON null (written by hand) is no group."""
    roles = {"roles": [{"name": "srv", "command": ["x"]}]}
    async with db.transaction() as session:
        group = await insert_job(session, JobSpec("m", "d", ("r",), roles=roles), actor="t")
        gang = await insert_job(session, JobSpec("m", "d", ("r",), nodes=2), actor="t")
        odd = await insert_job(session, JobSpec("m", "d", ("r",)), actor="t")
        await session.execute(text(f"UPDATE jobs SET roles = 'null' WHERE id = {odd.id}"))
    async with pg.sql_transaction() as tx:
        from_cli = {j["id"]: j["group"] for j in await list_jobs_sql(tx)}
    async with db.transaction() as session:
        from_orm = {j: job_to_dict(await get_job(session, j))["group"] for j in from_cli}
    assert from_cli == from_orm == {group.id: True, gang.id: False, odd.id: False}


async def test_gpus_are_every_gpu_of_an_attempt_and_each_ranks_on_both_paths(
    db: Database, pg: PgDatabase
) -> None:
    """`--gpus 4 --nodes 2` is stored as the 8 GPUs an attempt holds (`gpus_requested`
    has one meaning for every kind); `job list --json` and the ORM path show `gpus` 8 and
    `gpus_per_node` [4, 4]; a group over two VMs its layout's, a job of one VM its one
    count; the table shows `4×2`, `2+1` and `3`."""
    from scheduler.jobspec import GroupSpec, Role
    from scheduler.jobstore import gpus_text

    spread = GroupSpec(
        roles=(
            Role("t", 2, command=("x",), primary=True),
            Role("s", 1, command=("y",), own_vm=True),
        )
    ).to_data()
    async with db.transaction() as session:
        gang = await insert_job(session, JobSpec("m", "d", ("r",), gpus=4, nodes=2), actor="t")
        group = await insert_job(
            session, JobSpec("m", "d", ("r",), gpus=3, nodes=2, roles=spread), actor="t"
        )
        one = await insert_job(session, JobSpec("m", "d", ("r",), gpus=3), actor="t")
        stored_gpus = dict(
            (await session.execute(text("SELECT id, gpus_requested FROM jobs"))).all()
        )
    assert stored_gpus == {gang.id: 8, group.id: 3, one.id: 3}
    async with pg.sql_transaction() as tx:
        from_cli = {j["id"]: j for j in await list_jobs_sql(tx)}
    async with db.transaction() as session:
        from_orm = {j: job_to_dict(await get_job(session, j)) for j in from_cli}
    for jobs in (from_cli, from_orm):
        shown = {j: (d["gpus"], d["gpus_per_node"], gpus_text(d)) for j, d in jobs.items()}
        assert shown == {
            gang.id: (8, [4, 4], "4×2"),
            group.id: (3, [2, 1], "2+1"),
            one.id: (3, [3], "3"),
        }


async def _orm_job(db: Database, job_id: int) -> Any:
    async with db.transaction() as session:
        return await get_job(session, job_id)


async def test_both_paths_submit_and_announce_alike(
    db: Database, pg: PgDatabase, database_url: str, nats: EmbeddedNats
) -> None:
    """`submit_job` (insert committed, then publish, then mark published) over either
    connection: the same rows, both announced."""
    settings = Settings.load(database_url, nats.url)
    from_cli = await submit_job(pg, settings, SPEC, actor="cli")
    from_daemon = await submit_job(db, settings, SPEC, actor="cli")
    assert from_cli.publish_error is None and from_daemon.publish_error is None
    assert from_cli.warning == from_daemon.warning is not None  # no VM registered yet
    cli_rows, daemon_rows = await stored(db, from_cli.job_id), await stored(db, from_daemon.job_id)
    assert cli_rows == daemon_rows
    assert cli_rows[0]["published_at"] is True
