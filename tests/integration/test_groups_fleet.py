"""Job groups on the SSH test fleet with every real piece (poller, dispatcher, NATS,
Postgres, requeue manager): a reward server role (examples/reward_server.py, ready on HTTP
/health) and a trainer role that calls it (tests/workloads/group_client.py). The trainer
starts only after readiness, a completed trainer stops the server, killing the server kills
the trainer and retries the group, two groups on one VM never share a port, and a server
never ready fails the attempt with the reason. Only the GPUs are simulated."""

from __future__ import annotations

import asyncio
import json
import os
import re
import signal
import sys
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import pytest
from sqlalchemy import select, text, update

from scheduler.control import job_details
from scheduler.db import Database
from scheduler.embedded import EmbeddedNats
from scheduler.gpu_poller import GpuPoller
from scheduler.gpus import DOUBLE_BOOKED_SQL, PARTIAL_CLAIMS_SQL
from scheduler.job_logs import stream_log
from scheduler.jobspec import parse_data
from scheduler.models import GPU, VM, JobEvent, JobPort, Leftover
from scheduler.requeue import RequeueConfig, RequeueManager
from scheduler.retry import RetryPolicy
from scheduler.transport import Transport
from tests.backdate import age_outages
from tests.fleet import SimFleet
from tests.workloads.support import (
    alive,
    job_nodes,
    job_row,
    new_job,
    scheduling,
    sweep_until,
    wait_file,
)

pytestmark = pytest.mark.slow

FleetFactory = Callable[..., Awaitable[SimFleet]]
ROOT = Path(__file__).resolve().parents[2]
SERVER = str(ROOT / "examples" / "reward_server.py")
CLIENT = str(ROOT / "tests" / "workloads" / "group_client.py")
CONFIG = RequeueConfig(
    interval_s=0.2,
    node_lost_timeout_s=5.0,
    recheck_after_s=0.5,
    kill_grace_s=2.0,
    policy=RetryPolicy(base_delay_s=0.2, jitter=0.0),
)


def group_roles(
    *, first_s: float = 1, later_s: float = 1, server: list[str] | None = None, timeout: int = 60
) -> dict[str, Any]:
    """A reward server and a one-GPU trainer role depending on it, as `jobs.roles` stores it."""
    return parse_data(
        {
            "roles": {
                "reward": {
                    "command": server or [sys.executable, SERVER, "--host", "127.0.0.1"],
                    "ports": ["http"],
                    "ready": {"http": "/health", "timeout": timeout},
                },
                "trainer": {
                    "command": [sys.executable, CLIENT, str(first_s), str(later_s)],
                    "gpus": 1,
                    "primary": True,
                    "depends_on": ["reward"],
                },
            }
        }
    ).to_data()


async def new_group(db: Database, roles: dict[str, Any], **fields: Any) -> int:
    """Insert a queued job group (one GPU), as `job submit -f` does."""
    return await new_job(
        db, 1, roles=roles, model="-", dataset="-", reward_functions=("-",), **fields
    )


async def until(
    db: Database,
    poller: GpuPoller,
    requeue: RequeueManager,
    check: Callable[[], Awaitable[bool]],
    what: str,
    timeout: float = 90,
) -> None:
    """Sweep and tick until `check()` holds (a generous deadline, never a fixed wait)."""
    deadline = time.monotonic() + timeout
    while not await check():
        assert time.monotonic() < deadline, f"never: {what}"
        await poller.sweep()
        await requeue.tick()
        await asyncio.sleep(0.1)


def status_is(db: Database, job_id: int, *statuses: str) -> Callable[[], Awaitable[bool]]:
    async def check() -> bool:
        return (await job_row(db, job_id)).status in statuses

    return check


def client_report(log: str) -> dict[str, Any]:
    """The JSON line group_client printed."""
    line = next(x for x in log.splitlines() if x.startswith("group_client: {"))
    return dict(json.loads(line.split(": ", 1)[1]))


def role_pid(train_log: str, role: str) -> int:
    """The pid the supervisor reported for a role."""
    match = re.search(rf"rlfleet-group: role {role} started, pid (\d+)", train_log)
    assert match, train_log
    return int(match.group(1))


async def nothing_left(fleet: SimFleet) -> None:
    """Every process a job started on the fleet's VMs ends (a generous deadline); the
    scheduler's own SSH shells stay."""
    deadline = time.monotonic() + 30
    while left := [_cmdline(pid) for vm in fleet for pid in vm.processes() if _of_a_job(pid)]:
        assert time.monotonic() < deadline, f"left running: {left}"
        await asyncio.sleep(0.1)


def _of_a_job(pid: int) -> bool:
    """Whether the process runs for a job (the launch gives every job RLFLEET_JOB_ID)."""
    try:
        return b"RLFLEET_JOB_ID=" in Path(f"/proc/{pid}/environ").read_bytes()
    except OSError:
        return False


def _cmdline(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()
    except OSError:
        return str(pid)


async def polled_vm(
    sim_fleet: FleetFactory, db: Database, transport: Transport, *, gpus: int
) -> tuple[SimFleet, GpuPoller]:
    """One registered VM with `gpus` GPUs, and a poller that has swept it once."""
    fleet = await sim_fleet(1, gpus_per_vm=gpus)
    await fleet.register(db)
    poller = GpuPoller(db, transport, unreachable_after=1)
    await poller.sweep()
    return fleet, poller


async def no_gpu_or_port_held(db: Database) -> None:
    async with db.transaction() as session:
        held = await session.scalar(select(GPU.id).where(GPU.job_id.is_not(None)).limit(1))
        ports = (await session.execute(select(JobPort.port))).all()
    assert held is None and ports == []


async def test_the_trainer_starts_after_readiness_and_its_end_stops_the_server(
    sim_fleet: FleetFactory, db: Database, nats: EmbeddedNats, transport: Transport
) -> None:
    fleet, poller = await polled_vm(sim_fleet, db, transport, gpus=1)
    job_id = await new_group(db, group_roles(first_s=4))
    async with scheduling(db, nats.url, transport, CONFIG) as requeue:
        await until(db, poller, requeue, status_is(db, job_id, "running"), "running")
        folder = Path((await job_row(db, job_id)).attempt_dir or "")
        await wait_file(folder / "trainer.log", needle="{")
        shown = await job_details(db, job_id, transport)
        await until(db, poller, requeue, status_is(db, job_id, "completed"), "completed")
    job = await job_row(db, job_id)
    assert job.attempt_dir is not None
    folder = Path(job.attempt_dir)
    report = client_report((folder / "trainer.log").read_text())
    # It asked once and the server answered at once: it started after readiness.
    assert report["health"] == "ok" and report["scores"] == [1.0]
    assert report["addr"] == "127.0.0.1" and report["role"] == "trainer"
    assert report["gpus"] == fleet[0].gpu_uuids[0]
    train_log = (folder / "train.log").read_text()
    lines = train_log.splitlines()
    assert lines.index("rlfleet-group: role reward ready") < next(
        i for i, x in enumerate(lines) if x.startswith("rlfleet-group: role trainer started")
    )
    assert "rlfleet-group: role reward stopped" in lines
    assert not alive(role_pid(train_log, "reward"))
    roles = {r["name"]: r for r in shown["roles"]}
    assert roles["reward"]["ports"] == {"http": report["port"]} and not roles["reward"]["primary"]
    assert roles["trainer"]["gpu_uuids"] == [fleet[0].gpu_uuids[0]]
    assert roles["reward"]["gpu_uuids"] == [] and roles["trainer"]["supervisor_pid"]
    # Each role's own pid and state, as its supervisor wrote them on the VM.
    assert (roles["trainer"]["pid"], roles["trainer"]["state"]) == (report["pid"], "running")
    assert roles["reward"]["pid"] == role_pid(train_log, "reward")
    assert roles["reward"]["state"] == "running"
    await nothing_left(fleet)
    await no_gpu_or_port_held(db)


async def test_a_group_on_one_vm_talks_on_loopback_with_its_token_past_a_proxy(
    sim_fleet: FleetFactory, db: Database, nats: EmbeddedNats, transport: Transport
) -> None:
    """Given a job whose environment names a proxy that answers nothing (`http_proxy`, as a
    VM's ~/.rlfleet/env may for downloads) and a reward server started without --host: the
    server listens on loopback (its role's address in a group on one VM), the readiness
    check and both of the trainer's calls reach it directly with the attempt's token, a
    request without the token is refused (401), and the token is in no file of the
    attempt but job.env (mode 0600), nor in the database."""
    fleet, poller = await polled_vm(sim_fleet, db, transport, gpus=1)
    async with db.transaction() as session:  # a network address, as a real VM has
        await session.execute(update(VM).values(internal_address="10.255.255.1"))
    dead = "http://127.0.0.1:9"
    proxies = (("http_proxy", dead), ("HTTP_PROXY", dead), ("all_proxy", dead))
    roles = group_roles(first_s=0.5, server=[sys.executable, SERVER])
    job_id = await new_group(db, roles, env=proxies)
    async with scheduling(db, nats.url, transport, CONFIG) as requeue:
        await until(db, poller, requeue, status_is(db, job_id, "completed"), "completed")
    folder = Path((await job_row(db, job_id)).attempt_dir or "")
    report = client_report((folder / "trainer.log").read_text())
    assert report["health"] == "ok" and report["scores"] == [1.0], report
    assert report["without_token"] == 401 and report["has_token"], report
    assert report["addr"] == "127.0.0.1"
    assert "listening on 127.0.0.1:" in (folder / "reward.log").read_text()
    token = next(
        line.split("=", 1)[1].strip('"')
        for line in (folder / "job.env").read_text().splitlines()
        if line.startswith("RLFLEET_GROUP_TOKEN=")
    )
    assert len(token) == 32 and (folder / "job.env").stat().st_mode & 0o077 == 0
    for path in folder.iterdir():
        if path.is_file() and path.name != "job.env":
            assert token not in path.read_text(errors="replace"), path.name
    async with db.transaction() as session:
        dump = await session.execute(text("SELECT CAST(j AS text) FROM jobs j"))
        events = await session.execute(text("SELECT CAST(e AS text) FROM job_events e"))
        assert not any(token in row[0] for row in [*dump.all(), *events.all()])
    await nothing_left(fleet)


async def test_killing_the_server_kills_the_trainer_and_retries_the_group(
    sim_fleet: FleetFactory, db: Database, nats: EmbeddedNats, transport: Transport
) -> None:
    fleet, poller = await polled_vm(sim_fleet, db, transport, gpus=1)
    job_id = await new_group(db, group_roles(first_s=300, later_s=1), max_retries=1)
    async with scheduling(db, nats.url, transport, CONFIG) as requeue:
        await until(db, poller, requeue, status_is(db, job_id, "running"), "running")
        first = await job_row(db, job_id)
        assert first.attempt_dir is not None
        folder = Path(first.attempt_dir)
        trainer = client_report(await wait_file(folder / "trainer.log", needle="{"))["pid"]
        server = role_pid((folder / "train.log").read_text(), "reward")
        os.kill(server, signal.SIGKILL)
        await until(
            db,
            poller,
            requeue,
            lambda: _attempt_done(db, job_id),
            "the second attempt completed",
        )
    assert not alive(trainer)
    async with db.transaction() as session:
        events = (
            await session.execute(
                select(JobEvent.to_status, JobEvent.reason).where(JobEvent.job_id == job_id)
            )
        ).all()
    failed = [reason for to, reason in events if to == "failed"]
    assert len(failed) == 1 and "role reward failed (exit 137)" in (failed[0] or ""), events
    assert (await job_row(db, job_id)).attempt == 2
    # Without `restart: on-failure` a role is never restarted in place (shared fate).
    assert not any("restarted in place" in (reason or "") for _to, reason in events)
    await nothing_left(fleet)
    await no_gpu_or_port_held(db)


def healing(roles: dict[str, Any], max_restarts: int) -> dict[str, Any]:
    """`roles` with the reward role restarting in place at most `max_restarts` times."""
    reward = {**roles["roles"]["reward"], "restart": "on-failure", "max_restarts": max_restarts}
    return parse_data({"roles": {**roles["roles"], "reward": reward}}).to_data()


async def restart_events(db: Database, job_id: int) -> list[tuple[str, str, int]]:
    """(to, reason, attempt) of the job's events that record a restart in place."""
    async with db.transaction() as session:
        rows = await session.execute(
            select(JobEvent.to_status, JobEvent.reason, JobEvent.attempt)
            .where(JobEvent.job_id == job_id, JobEvent.reason.like("role % restarted in place%"))
            .order_by(JobEvent.id)
        )
        return [(to, reason or "", attempt) for to, reason, attempt in rows]


def health(port: int, token: str) -> dict[str, Any]:
    """The reward server's /health at `port`, asked with the attempt's token."""
    import urllib.request

    opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))
    request = urllib.request.Request(
        f"http://127.0.0.1:{port}/health", headers={"Authorization": f"Bearer {token}"}
    )
    with opener.open(request, timeout=5) as answer:
        return dict(json.loads(answer.read()))


def group_token(folder: Path) -> str:
    """The attempt's token, from its job.env (mode 0600)."""
    return next(
        line.split("=", 1)[1].strip('"')
        for line in (folder / "job.env").read_text().splitlines()
        if line.startswith("RLFLEET_GROUP_TOKEN=")
    )


async def test_a_killed_server_that_restarts_on_failure_heals_in_place_and_the_trainer_runs_on(
    sim_fleet: FleetFactory,
    db: Database,
    nats: EmbeddedNats,
    transport: Transport,
    tmp_path: Path,
) -> None:
    """`restart: on-failure`: the reward server killed mid-run is started again by the
    supervisor at the same address and port while the trainer runs on (same process, same
    attempt, no retry used); the poller records the restart as an event once, `job show`
    lists it for the role, and the trainer's next score is answered by the new server."""
    fleet, poller = await polled_vm(sim_fleet, db, transport, gpus=1)
    go = tmp_path / "go"
    roles = healing(group_roles(first_s=120), 2)
    job_id = await new_group(db, roles, max_retries=0, env=(("GROUP_CLIENT_UNTIL", str(go)),))
    async with scheduling(db, nats.url, transport, CONFIG) as requeue:
        await until(db, poller, requeue, status_is(db, job_id, "running"), "running")
        folder = Path((await job_row(db, job_id)).attempt_dir or "")
        report = client_report(await wait_file(folder / "trainer.log", needle="{"))
        server = role_pid((folder / "train.log").read_text(), "reward")
        assert server > 1
        os.kill(server, signal.SIGKILL)

        async def recorded() -> bool:
            return len(await restart_events(db, job_id)) == 1

        await until(db, poller, requeue, recorded, "the restart recorded")
        # The poller sees the same restart again on later sweeps: it is recorded once.
        for _ in range(3):
            await poller.sweep()
        line = "rlfleet-group: role reward restarted, pid "
        again = re.search(
            r"role reward restarted, pid (\d+) \(restart 1 of 2\)",
            await wait_file(folder / "train.log", needle=line),
        )
        assert again is not None and alive(int(again.group(1)))
        shown = await job_details(db, job_id, transport)
        # The same port, a new server (it has served nothing yet).
        assert health(report["port"], group_token(folder))["requests"] == 0
        go.write_text("")
        await until(db, poller, requeue, status_is(db, job_id, "completed"), "completed")
    job = await job_row(db, job_id)
    assert (job.attempt, job.retry_count) == (1, 0)
    trainer_log = (folder / "trainer.log").read_text()
    assert 'group_client: again {"scores": [1.0]}' in trainer_log, trainer_log
    assert trainer_log.count("group_client: {") == 1  # the trainer itself never restarted
    assert await restart_events(db, job_id) == [
        ("running", "role reward restarted in place (1 of 2): it exited with 137", 1)
    ]
    roles_shown = {r["name"]: r for r in shown["roles"]}
    assert roles_shown["reward"]["restarts"] == 1 and roles_shown["trainer"]["restarts"] == 0
    assert roles_shown["trainer"]["pid"] == report["pid"]
    assert roles_shown["reward"]["pid"] == int(again.group(1))
    # Once the VM's answer is gone, the recorded count is what `job show` lists.
    listed = {r["name"]: r for r in (await job_details(db, job_id))["roles"]}
    assert listed["reward"]["restarts"] == 1
    assert not alive(int(again.group(1)))
    await nothing_left(fleet)
    await no_gpu_or_port_held(db)


async def test_a_role_failing_past_its_max_restarts_fails_the_group(
    sim_fleet: FleetFactory, db: Database, nats: EmbeddedNats, transport: Transport
) -> None:
    """A service that keeps dying is restarted `max_restarts` times, then the group fails
    as it does without restarts (shared fate), the reason saying so; each restart is an
    event of the attempt."""
    fleet, poller = await polled_vm(sim_fleet, db, transport, gpus=1)
    dying = [sys.executable, "-c", "import time; time.sleep(0.3); raise SystemExit(3)"]
    waiting = [sys.executable, "-c", "import time; time.sleep(300)"]
    roles = parse_data(
        {
            "roles": {
                "reward": {"command": dying, "restart": "on-failure", "max_restarts": 2},
                "trainer": {"command": waiting, "gpus": 1, "primary": True},
            }
        }
    ).to_data()
    job_id = await new_group(db, roles, max_retries=0)
    async with scheduling(db, nats.url, transport, CONFIG) as requeue:
        await until(db, poller, requeue, status_is(db, job_id, "failed"), "failed")
    job = await job_row(db, job_id)
    assert job.exit_code == 3 and job.failure_reason == "exit_nonzero"
    assert "role reward failed (exit 3) after 2 restarts" in (job.status_reason or ""), (
        job.status_reason
    )
    reasons = [reason for _to, reason, _attempt in await restart_events(db, job_id)]
    assert reasons[-1] == "role reward restarted in place (2 of 2): it exited with 3", reasons
    assert reasons[0].startswith("role reward restarted in place (1 of 2)") and len(reasons) == 2
    await nothing_left(fleet)
    await no_gpu_or_port_held(db)


async def test_a_hung_server_that_restarts_on_failure_is_restarted_by_its_liveness_check(
    sim_fleet: FleetFactory,
    db: Database,
    nats: EmbeddedNats,
    transport: Transport,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A reward server that is alive but answers nothing (SIGSTOP) fails its readiness
    check, which goes on while the group runs: after the liveness window (shortened here
    from 30 s to 2 s) it is stopped and started again in place, the trainer running on;
    the event says why."""
    from scheduler import groups

    monkeypatch.setattr(groups, "LIVENESS_FAIL_S", 2.0)
    monkeypatch.setattr(groups, "LIVENESS_EVERY_S", 0.5)
    fleet, poller = await polled_vm(sim_fleet, db, transport, gpus=1)
    go = tmp_path / "go"
    roles = healing(group_roles(first_s=120), 1)
    job_id = await new_group(db, roles, max_retries=0, env=(("GROUP_CLIENT_UNTIL", str(go)),))
    server = 0
    try:
        async with scheduling(db, nats.url, transport, CONFIG) as requeue:
            await until(db, poller, requeue, status_is(db, job_id, "running"), "running")
            folder = Path((await job_row(db, job_id)).attempt_dir or "")
            await wait_file(folder / "trainer.log", needle="{")
            server = role_pid((folder / "train.log").read_text(), "reward")
            assert server > 1
            os.kill(server, signal.SIGSTOP)

            async def recorded() -> bool:
                return len(await restart_events(db, job_id)) == 1

            await until(db, poller, requeue, recorded, "the restart recorded")
            await wait_file(folder / "train.log", needle="role reward restarted, pid ")
            go.write_text("")
            await until(db, poller, requeue, status_is(db, job_id, "completed"), "completed")
    finally:
        if server > 1 and alive(server):
            os.kill(server, signal.SIGKILL)
    train_log = (folder / "train.log").read_text()
    assert "role reward stopped answering its readiness check for 2s; stopping it" in train_log
    assert 'group_client: again {"scores": [1.0]}' in (folder / "trainer.log").read_text()
    assert await restart_events(db, job_id) == [
        (
            "running",
            "role reward restarted in place (1 of 1): it stopped answering its readiness check",
            1,
        )
    ]
    assert (await job_row(db, job_id)).retry_count == 0
    await nothing_left(fleet)
    await no_gpu_or_port_held(db)


async def test_restarts_a_job_writes_into_roles_json_itself_are_not_recorded(
    sim_fleet: FleetFactory, db: Database, nats: EmbeddedNats, transport: Transport
) -> None:
    """roles.json is in a directory the job can write: restarts it claims for a role that
    may not restart, for one past its max_restarts, for no role of the job, or a file too
    big to be read, become no event and cost the job nothing (invariant 9); a count the
    role's limits allow is recorded, in the poller's words, not the file's."""
    fleet, poller = await polled_vm(sim_fleet, db, transport, gpus=1)
    job_id = await new_group(db, healing(group_roles(first_s=300), 2), max_retries=0)
    async with scheduling(db, nats.url, transport, CONFIG) as requeue:
        await until(db, poller, requeue, status_is(db, job_id, "running"), "running")
        folder = Path((await job_row(db, job_id)).attempt_dir or "")
        await wait_file(folder / "trainer.log", needle="{")
        hostile = [
            {"trainer": {"state": "running", "restarts": 5}},  # may not restart
            {"reward": {"state": "running", "restarts": 3}},  # past its max_restarts (2)
            {"ghost": {"state": "running", "restarts": 1}},  # no such role
            {"reward": {"state": "running", "restarts": 1, "pad": "x" * 8000}},  # too big
        ]
        for data in hostile:
            (folder / "roles.json").write_text(json.dumps(data))
            for _ in range(2):
                await poller.sweep()
        assert await restart_events(db, job_id) == []
        cause = "it exited with 9; DROP TABLE jobs"
        claimed = {"state": "running", "restarts": 1, "restart_cause": cause}
        (folder / "roles.json").write_text(json.dumps({"reward": claimed}))
        await poller.sweep()
        assert await restart_events(db, job_id) == [
            ("running", "role reward restarted in place (1 of 2): it failed", 1)
        ]
        assert (await job_row(db, job_id)).status == "running"
        from scheduler.control import cancel_job

        await cancel_job(db, transport, job_id, grace_s=2)
    await nothing_left(fleet)


async def _attempt_done(db: Database, job_id: int) -> bool:
    job = await job_row(db, job_id)
    return job.status == "completed" and job.attempt == 2


async def test_two_groups_on_one_vm_never_share_a_port(
    sim_fleet: FleetFactory, db: Database, nats: EmbeddedNats, transport: Transport
) -> None:
    fleet, poller = await polled_vm(sim_fleet, db, transport, gpus=2)
    ids = [await new_group(db, group_roles(first_s=4)) for _ in range(2)]

    async def both(status: str) -> bool:
        statuses = [(await job_row(db, i)).status for i in ids]
        return all(s == status for s in statuses)

    async with scheduling(db, nats.url, transport, CONFIG) as requeue:
        await until(db, poller, requeue, lambda: both("running"), "both running")
        async with db.transaction() as session:
            rows = (await session.execute(select(JobPort.job_id, JobPort.port))).all()
        reports = []
        for job_id in ids:
            folder = Path((await job_row(db, job_id)).attempt_dir or "")
            reports.append(client_report(await wait_file(folder / "trainer.log", needle="{")))
        await until(db, poller, requeue, lambda: both("completed"), "both completed")
    assert sorted(job for job, _port in rows) == sorted(ids)
    assert len({port for _job, port in rows}) == 2
    assert {r["port"] for r in reports} == {port for _job, port in rows}
    assert {r["gpus"] for r in reports} == set(fleet[0].gpu_uuids)
    await nothing_left(fleet)
    await no_gpu_or_port_held(db)


async def test_a_server_never_ready_fails_the_attempt_with_the_reason(
    sim_fleet: FleetFactory, db: Database, nats: EmbeddedNats, transport: Transport
) -> None:
    fleet, poller = await polled_vm(sim_fleet, db, transport, gpus=1)
    silent = [sys.executable, "-c", "import time; time.sleep(300)"]
    job_id = await new_group(db, group_roles(server=silent, timeout=2), max_retries=0)
    async with scheduling(db, nats.url, transport, CONFIG) as requeue:
        await until(db, poller, requeue, status_is(db, job_id, "failed"), "failed")
    job = await job_row(db, job_id)
    assert job.status_reason is not None
    assert "role reward not ready after 2s" in job.status_reason, job.status_reason
    assert job.exit_code == 94
    assert not (Path(job.attempt_dir or "") / "trainer.log").exists()  # never started
    await nothing_left(fleet)
    await no_gpu_or_port_held(db)


def write_vllm_python(folder: Path) -> str:
    """A VM interpreter on which `-m trl.cli.main …` runs the vLLM stand-in
    (tests/workloads/fake_vllm.py, which is not vLLM); anything else runs unchanged."""
    fake = ROOT / "tests" / "workloads" / "fake_vllm.py"
    path = folder / "vllm-python"
    path.write_text(
        "#!/bin/sh\n"
        'if [ "$1" = "-m" ] && [ "$2" = "trl.cli.main" ]; then shift 2;'
        f' exec {sys.executable} {fake} "$@"; fi\n'
        f'exec {sys.executable} "$@"\n'
    )
    path.chmod(0o755)
    return str(path)


async def test_vllm_server_mode_starts_the_server_then_the_trainer_with_its_address(
    sim_fleet: FleetFactory,
    db: Database,
    nats: EmbeddedNats,
    transport: Transport,
    tmp_path: Path,
) -> None:
    """`--vllm-server-gpus 1` beside a one-GPU trainer on a two-GPU VM: the `vllm` role
    (a stand-in answering /health, not vLLM) gets `trl vllm-serve` with the model, the
    VM's address, its port and one GPU; the trainer starts after it answers, on the other
    GPU, in server mode with the same address and ports; the job completes and the server
    is stopped."""
    from scheduler.cli.jobfile import with_vllm_server
    from scheduler.jobs import JobSpec

    fleet = await sim_fleet(1, gpus_per_vm=2)
    await fleet.register(db, python=write_vllm_python(tmp_path))
    poller = GpuPoller(db, transport, unreachable_after=1)
    await poller.sweep()
    spec = with_vllm_server(
        JobSpec(model="Qwen/Qwen2.5-0.5B", dataset="d.jsonl", reward_functions=("format",)), 1
    )
    job_id = await new_job(
        db,
        spec.gpus,
        roles=spec.roles,
        model=spec.model,
        dataset=spec.dataset,
        reward_functions=spec.reward_functions,
    )
    async with scheduling(db, nats.url, transport, CONFIG) as requeue:
        await until(db, poller, requeue, status_is(db, job_id, "completed"), "completed")
    folder = Path((await job_row(db, job_id)).attempt_dir or "")
    line = next(
        x for x in (folder / "vllm.log").read_text().splitlines() if x.startswith("fake_vllm: ")
    )
    server = json.loads(line.split(": ", 1)[1])
    port = server["argv"][server["argv"].index("--port") + 1]
    assert server["argv"] == [
        "vllm-serve", "--model", "Qwen/Qwen2.5-0.5B", "--host", "127.0.0.1", "--port", port,
        "--tensor_parallel_size", "1",
    ]  # fmt: skip
    assert server["role"] == "vllm" and server["gpus"] == fleet[0].gpu_uuids[0]
    trainer = (folder / "trainer.log").read_text()
    args = trainer.split("fake_train: args=", 1)[1].splitlines()[0]
    expected = [
        "--use_vllm", "--vllm_mode", "server", "--vllm_server_host", "127.0.0.1",
        "--vllm_server_port", port, "--vllm_group_port", server["nccl"],
    ]  # fmt: skip
    assert args.endswith(repr(expected)[1:]), args
    assert f"CUDA_VISIBLE_DEVICES={fleet[0].gpu_uuids[1]}" in trainer
    train_log = (folder / "train.log").read_text()
    lines = train_log.splitlines()
    assert lines.index("rlfleet-group: role vllm ready") < next(
        i for i, x in enumerate(lines) if x.startswith("rlfleet-group: role trainer started")
    )
    assert not alive(role_pid(train_log, "vllm"))
    await nothing_left(fleet)
    await no_gpu_or_port_held(db)


async def test_cancelling_a_group_stops_every_role(
    sim_fleet: FleetFactory, db: Database, nats: EmbeddedNats, transport: Transport
) -> None:
    """`job cancel` of a running group: the kill reaches the supervisor, which stops the
    server and the trainer (each with its process group) before the kill's grace is over."""
    from scheduler.control import cancel_job

    fleet, poller = await polled_vm(sim_fleet, db, transport, gpus=1)
    job_id = await new_group(db, group_roles(first_s=300))
    async with scheduling(db, nats.url, transport, CONFIG) as requeue:
        await until(db, poller, requeue, status_is(db, job_id, "running"), "running")
        folder = Path((await job_row(db, job_id)).attempt_dir or "")
        trainer = client_report(await wait_file(folder / "trainer.log", needle="{"))["pid"]
        server = role_pid((folder / "train.log").read_text(), "reward")
        result = await cancel_job(db, transport, job_id, grace_s=10.0)
    assert result.kill == "terminated", result  # the supervisor ended within the grace
    assert not alive(trainer) and not alive(server)
    assert (await job_row(db, job_id)).status == "cancelled"
    await nothing_left(fleet)
    await no_gpu_or_port_held(db)


# -- a group over several VMs -------------------------------------------------------------


def spread_roles(*, first_s: float, later_s: float = 1) -> dict[str, Any]:
    """The reward server on a VM of its own (`own_vm`), listening at its VM's address, and
    the trainer on another VM, as `jobs.roles` stores them."""
    return parse_data(
        {
            "roles": {
                "reward": {
                    "command": [sys.executable, SERVER, "--host", "$RLFLEET_REWARD_ADDR"],
                    "ports": ["http"],
                    "ready": {"http": "/health", "timeout": 60},
                    "own_vm": True,
                },
                "trainer": {
                    "command": [sys.executable, CLIENT, str(first_s), str(later_s)],
                    "gpus": 1,
                    "primary": True,
                    "depends_on": ["reward"],
                },
            }
        }
    ).to_data()


async def spread_fleet(
    sim_fleet: FleetFactory, db: Database, transport: Transport, count: int
) -> tuple[SimFleet, dict[int, str], GpuPoller]:
    """`count` one-GPU VMs, each with an internal address of its own (127.0.0.10, .11, …)
    that the roles' traffic goes to; returns the fleet, each VM's address by id, and a
    poller that has swept once."""
    fleet = await sim_fleet(count, gpus_per_vm=1)
    ids = await fleet.register(db)
    addresses = {vm_id: f"127.0.0.{10 + i}" for i, vm_id in enumerate(sorted(ids.values()))}
    async with db.transaction() as session:
        for vm_id, address in addresses.items():
            await session.execute(update(VM).where(VM.id == vm_id).values(internal_address=address))
    poller = GpuPoller(db, transport, unreachable_after=1)
    await poller.sweep()
    return fleet, addresses, poller


async def spread_group_job(
    sim_fleet: FleetFactory,
    db: Database,
    transport: Transport,
    *,
    max_retries: int,
    first_s: float,
    later_s: float,
) -> tuple[SimFleet, GpuPoller, dict[str, Any], dict[int, str], int]:
    """Three one-GPU VMs and a queued group over two of them (`spread_roles`): the fleet,
    a poller that swept once, the VMs by name, the VM names by id, and the job's id."""
    fleet, _addresses, poller = await spread_fleet(sim_fleet, db, transport, 3)
    async with db.transaction() as session:
        names = dict((await session.execute(select(VM.id, VM.name))).all())
    job_id = await new_job(
        db,
        2,
        nodes=2,
        max_retries=max_retries,
        roles=spread_roles(first_s=first_s, later_s=later_s),
        model="-",
        dataset="-",
        reward_functions=("-",),
    )
    return fleet, poller, {vm.name: vm for vm in fleet}, names, job_id


async def test_a_server_on_its_own_vm_serves_the_trainer_across_vms_and_stops_with_it(
    sim_fleet: FleetFactory, db: Database, nats: EmbeddedNats, transport: Transport
) -> None:
    """`own_vm: true` puts the reward server on a VM of its own: the trainer starts on the
    other VM only once the server answers at its VM's address, which the trainer gets as
    RLFLEET_REWARD_ADDR; when the trainer exits 0 the job completes and the server on the
    other VM is killed; nothing is left running, no GPU or port held."""
    fleet, addresses, poller = await spread_fleet(sim_fleet, db, transport, 2)
    job_id = await new_job(
        db,
        2,
        nodes=2,
        roles=spread_roles(first_s=4),
        model="-",
        dataset="-",
        reward_functions=("-",),
    )
    async with scheduling(db, nats.url, transport, CONFIG) as requeue:
        await until(db, poller, requeue, status_is(db, job_id, "running"), "running")
        nodes = await job_nodes(db, job_id)
        assert [n.rank for n in nodes] == [0, 1] and nodes[0].vm_id != nodes[1].vm_id
        trainer_dir, server_dir = (Path(n.attempt_dir or "") for n in nodes)
        await wait_file(trainer_dir / "trainer.log", needle="{")
        server_log = await wait_file(server_dir / "train.log", needle="role reward started")
        server = role_pid(server_log, "reward")
        shown = await job_details(db, job_id, transport)
        chunks: list[bytes] = []
        await stream_log(db, transport, job_id, chunks.append, role="reward")
        async with db.transaction() as session:  # the audits count the group whole
            partial = await session.scalar(PARTIAL_CLAIMS_SQL)
            double = await session.scalar(DOUBLE_BOOKED_SQL)
        assert (partial, double) == (0, 0)
        await until(db, poller, requeue, status_is(db, job_id, "completed"), "completed")
        await until(db, poller, requeue, lambda: _dead(server), "the server stopped")
    assert nodes[1].vm_id is not None
    report = client_report((trainer_dir / "trainer.log").read_text())
    assert report["health"] == "ok" and report["scores"] == [1.0]
    assert report["addr"] == addresses[nodes[1].vm_id]  # the server's VM, not its own
    train_log = (trainer_dir / "train.log").read_text().splitlines()
    assert train_log.index("rlfleet-group: role reward ready") < next(
        i for i, x in enumerate(train_log) if x.startswith("rlfleet-group: role trainer started")
    )
    assert "role trainer" not in server_log  # each VM's supervisor runs its own roles only
    assert not (server_dir / "trainer.log").exists()
    assert (await job_row(db, job_id)).exit_code == 0
    # `job show` puts each role on its own VM, with the pid its VM's supervisor wrote;
    # `job logs --role reward` reads the server's VM.
    async with db.transaction() as session:
        names = dict((await session.execute(select(VM.id, VM.name))).all())
    roles = {r["name"]: r for r in shown["roles"]}
    assert roles["reward"]["vm"] == names[nodes[1].vm_id]
    assert nodes[0].vm_id is not None
    assert roles["trainer"]["vm"] == names[nodes[0].vm_id]
    assert (roles["reward"]["pid"], roles["reward"]["state"]) == (server, "running")
    assert roles["trainer"]["gpu_uuids"] == list(nodes[0].gpu_uuids)
    assert roles["reward"]["gpu_uuids"] == [] and roles["reward"]["ports"]["http"]
    listening = f"reward server listening on {addresses[nodes[1].vm_id]}:"
    assert listening in b"".join(chunks).decode()
    await nothing_left(fleet)
    await no_gpu_or_port_held(db)


async def _dead(pid: int) -> bool:
    return not alive(pid)


@pytest.mark.parametrize("how", ["server_vm_crashes", "server_killed"])
async def test_a_dead_server_vm_or_server_kills_the_trainer_and_retries_the_group_whole(
    sim_fleet: FleetFactory,
    db: Database,
    nats: EmbeddedNats,
    transport: Transport,
    how: str,
) -> None:
    """The server of a running group over two VMs dies: either its VM crashes (its
    processes die, it stops answering) for longer than the node-lost timeout, or the
    server process is killed on a VM that answers. The trainer on the other VM is killed,
    not left running alone, and the group runs again as a whole and completes; nothing is
    left running, no GPU or port held."""
    fleet, poller, by_name, names, job_id = await spread_group_job(
        sim_fleet, db, transport, max_retries=1, first_s=300, later_s=1
    )
    async with scheduling(db, nats.url, transport, CONFIG) as requeue:
        await until(db, poller, requeue, status_is(db, job_id, "running"), "running")
        first = await job_nodes(db, job_id)
        trainer_dir, server_dir = (Path(n.attempt_dir or "") for n in first)
        trainer = client_report(await wait_file(trainer_dir / "trainer.log", needle="{"))
        lost = first[1].vm_id
        assert lost is not None
        if how == "server_killed":
            log = await wait_file(server_dir / "train.log", needle="role reward started")
            os.kill(role_pid(log, "reward"), signal.SIGKILL)
        else:
            await by_name[names[lost]].stop(kill_processes=True)
            await sweep_until(poller, db, lost, "unreachable")
            await age_outages(db, CONFIG.node_lost_timeout_s + 1)
        await until(db, poller, requeue, lambda: _dead(trainer["pid"]), "trainer killed")
        await until(db, poller, requeue, lambda: _attempt_done(db, job_id), "attempt 2 done")
        second = await job_nodes(db, job_id)
    assert {n.attempt for n in second} == {2}
    if how == "server_vm_crashes":
        assert lost not in {n.vm_id for n in second}
    async with db.transaction() as session:
        events = (
            await session.execute(
                select(JobEvent.to_status, JobEvent.reason).where(JobEvent.job_id == job_id)
            )
        ).all()
    failed = [reason for to, reason in events if to == "failed"]
    assert len(failed) == 1, events
    if how == "server_killed":
        assert "rank 1" in (failed[0] or "") and "role reward failed (exit 137)" in (
            failed[0] or ""
        ), failed
    await nothing_left(fleet)
    await no_gpu_or_port_held(db)


async def test_the_late_success_of_a_group_over_two_vms_completes_it_once(
    sim_fleet: FleetFactory, db: Database, nats: EmbeddedNats, transport: Transport
) -> None:
    """Given a group over two VMs whose trainer's VM went silent (its processes live on),
    its attempt given up for lost (`node_lost`: the server on the other VM killed) and
    retried elsewhere, when the silent VM answers again and its trainer turns out to have
    exited 0, then the job is completed once, from the first attempt: one outcome rule (every
    VM running a primary role exited 0) holds for late success as for a live attempt, though
    the server's rank was killed, not exiting 0. The retry is stopped; nothing is left
    running, no GPU or port held."""
    fleet, poller, by_name, names, job_id = await spread_group_job(
        sim_fleet, db, transport, max_retries=0, first_s=6, later_s=300
    )
    async with scheduling(db, nats.url, transport, CONFIG) as requeue:
        await until(db, poller, requeue, status_is(db, job_id, "running"), "running")
        first = await job_nodes(db, job_id)
        trainer_dir = Path(first[0].attempt_dir or "")
        await wait_file(trainer_dir / "trainer.log", needle="{")
        lost = first[0].vm_id
        assert lost is not None
        silent = by_name[names[lost]]
        await silent.stop()  # silent; the trainer lives on
        await sweep_until(poller, db, lost, "unreachable")
        await age_outages(db, CONFIG.node_lost_timeout_s + 1)
        await until(db, poller, requeue, _attempt_running(db, job_id, 2), "attempt 2 running")
        # Meanwhile the partitioned trainer finishes its work.
        assert (await wait_file(trainer_dir / "exit_code", timeout=30)).strip() == "0"
        await silent.start()
        await until(db, poller, requeue, status_is(db, job_id, "completed"), "completed")
        job = await job_row(db, job_id)
        await until(db, poller, requeue, _no_open_leftover(db), "every leftover killed")
    assert (job.exit_code, job.failure_reason, job.completed_attempt) == (0, None, 1)
    assert (job.attempt, job.vm_id) == (2, lost)
    async with db.transaction() as session:
        completed = (
            (
                await session.execute(
                    select(JobEvent.reason).where(
                        JobEvent.job_id == job_id, JobEvent.to_status == "completed"
                    )
                )
            )
            .scalars()
            .all()
        )
    assert len(completed) == 1, completed
    assert f"attempt 1 on {names[lost]}" in (completed[0] or "")
    assert "attempt 2 stopped" in (completed[0] or "")
    await nothing_left(fleet)
    await no_gpu_or_port_held(db)


def _attempt_running(db: Database, job_id: int, attempt: int) -> Callable[[], Awaitable[bool]]:
    async def check() -> bool:
        job = await job_row(db, job_id)
        return job.status == "running" and job.attempt == attempt

    return check


def _no_open_leftover(db: Database) -> Callable[[], Awaitable[bool]]:
    async def check() -> bool:
        async with db.transaction() as session:
            left = await session.scalar(
                select(Leftover.job_id).where(Leftover.killed_at.is_(None)).limit(1)
            )
        return left is None

    return check
