"""Prometheus metrics: the gauges follow the database, the helpers feed the histograms and
counters, and it all can be scraped over HTTP from a daemon's --metrics-port."""

from __future__ import annotations

import asyncio
import http.client
import os
import re
import signal
import socket
import subprocess
import time
import urllib.request

import pytest
from prometheus_client import REGISTRY
from sqlalchemy import insert

from scheduler import metrics
from scheduler.daemon import serve
from scheduler.db import Database
from scheduler.embedded import EmbeddedNats, free_port
from scheduler.models import GPU, VM, Job
from tests.workloads.support import RLFLEET


def scrape(port: int) -> str:
    """The /metrics page, as Prometheus would fetch it."""
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as response:
        assert response.status == 200
        return response.read().decode()


def scrape_soon(port: int, within_s: float) -> str:
    """The /metrics page, asked again while the server refuses it, for `within_s` at most."""
    deadline = time.monotonic() + within_s
    while True:
        try:
            return scrape(port)
        except (OSError, http.client.HTTPException):
            if time.monotonic() > deadline:
                raise
            time.sleep(0.1)


def sample(page: str, name: str, **labels: str) -> float | None:
    """The value of one sample in an exposition page; None when absent."""
    wanted = ",".join(f'{k}="{v}"' for k, v in sorted(labels.items()))
    pattern = re.escape(name) + (r"\{" + re.escape(wanted) + r"\}" if labels else "")
    match = re.search(rf"^{pattern} ([0-9.e+-]+)$", page, re.MULTILINE)
    return float(match.group(1)) if match else None


async def seed_fleet(db: Database) -> list[int]:
    """Two VMs (one healthy and draining, one unreachable), six GPUs (one requiring a
    reset, one drained by hand), five jobs."""
    async with db.transaction() as session:
        vm_ids = (
            await session.scalars(
                insert(VM).returning(VM.id),
                [
                    {"name": "a", "host": "h1", "status": "healthy", "draining": True},
                    {"name": "b", "host": "h2", "status": "unreachable"},
                ],
            )
        ).all()
        job_ids = (
            await session.scalars(
                insert(Job).returning(Job.id),
                [
                    {"model": "m", "dataset": "d", "reward_function": "r", "status": status}
                    for status in ("queued", "queued", "running", "failed", "completed")
                ],
            )
        ).all()
        running_job = job_ids[2]
        await session.execute(
            insert(GPU),
            [
                {"vm_id": vm_ids[0], "index": 0, "uuid": "GPU-a0", "job_id": running_job},
                {"vm_id": vm_ids[0], "index": 1, "uuid": "GPU-a1"},
                {"vm_id": vm_ids[1], "index": 0, "uuid": "GPU-b0", "foreign_busy": True},
                {"vm_id": vm_ids[1], "index": 1, "uuid": "GPU-b1", "healthy": False},
                {
                    "vm_id": vm_ids[0],
                    "index": 2,
                    "uuid": "GPU-a2",
                    "healthy": False,
                    "health_reason": "requires reset: nvidia-smi prints [GPU requires reset]",
                },
                {"vm_id": vm_ids[0], "index": 3, "uuid": "GPU-a3", "drained": True},
            ],
        )
    return list(vm_ids)


async def test_gauges_follow_the_database_and_helpers_feed_the_histograms(db: Database) -> None:
    # Given a fleet and jobs in several states
    a = str((await seed_fleet(db))[0])
    port = free_port()
    before = scrape_or_none(port)
    assert before is None  # nothing serves there yet
    # Counters are process-wide and earlier tests may have raised them: compare with now
    # (None: no sample yet, as for a label never used).
    dispatches = REGISTRY.get_sample_value("rlfleet_dispatch_duration_seconds_sum")
    oom_retries = REGISTRY.get_sample_value("rlfleet_job_retries_total", {"reason": "oom"})
    node_lost = REGISTRY.get_sample_value("rlfleet_recoveries_total", {"reason": "node_lost"})
    sweeps = REGISTRY.get_sample_value("rlfleet_poll_sweep_duration_seconds_count")
    server = metrics.start_metrics_server(port, addr="127.0.0.1")
    assert server is not None
    try:
        # When the gauges are refreshed and the daemons report what they did
        await metrics.refresh_gauges(db)
        metrics.observe_dispatch(0.25, outcome="launched")
        metrics.observe_poll_sweep(0.05)
        metrics.count_retry("oom")
        metrics.count_recovery("node_lost")
        page = await asyncio.to_thread(scrape, port)
    finally:
        server.shutdown()
        server.server_close()

    # Then a scrape shows jobs by state, VMs by status, GPUs by use…
    assert sample(page, "rlfleet_jobs", status="queued") == 2
    assert sample(page, "rlfleet_jobs", status="running") == 1
    assert sample(page, "rlfleet_jobs", status="pending") == 0
    assert sample(page, "rlfleet_vms", status="healthy") == 1
    assert sample(page, "rlfleet_vms", status="unreachable") == 1
    assert sample(page, "rlfleet_vms_draining") == 1
    assert sample(page, "rlfleet_gpus", state="allocated") == 1
    assert sample(page, "rlfleet_gpus", state="free") == 1
    assert sample(page, "rlfleet_gpus", state="foreign") == 1
    assert sample(page, "rlfleet_gpus", state="unhealthy") == 2
    assert sample(page, "rlfleet_gpus", state="drained") == 1
    # …each GPU's health, and why an unhealthy one is
    assert sample(page, "rlfleet_gpu_healthy", vm_id=a, gpu="1", uuid="GPU-a1") == 1
    assert sample(page, "rlfleet_gpu_healthy", vm_id=a, gpu="2", uuid="GPU-a2") == 0
    reason = "requires reset: nvidia-smi prints [GPU requires reset]"
    assert (
        sample(page, "rlfleet_gpu_unhealthy_info", vm_id=a, gpu="2", uuid="GPU-a2", reason=reason)
        == 1
    )
    info = [line for line in page.splitlines() if line.startswith("rlfleet_gpu_unhealthy_info{")]
    assert len(info) == 2 and not any("GPU-a1" in line for line in info)
    # …and what the helpers recorded
    assert sample(page, "rlfleet_dispatch_duration_seconds_sum") == (dispatches or 0) + 0.25
    assert sample(page, "rlfleet_job_retries_total", reason="oom") == (oom_retries or 0) + 1
    assert sample(page, "rlfleet_recoveries_total", reason="node_lost") == (node_lost or 0) + 1
    assert sample(page, "rlfleet_poll_sweep_duration_seconds_count") == (sweeps or 0) + 1
    assert "rlfleet_job_queue_wait_seconds_bucket" in page
    assert "rlfleet_job_submit_to_running_seconds_bucket" in page


def scrape_or_none(port: int) -> str | None:
    """The page, or None when nothing listens on the port."""
    try:
        return scrape(port)
    except OSError:
        return None


async def test_serve_refreshes_the_gauges_and_stops_serving_when_the_daemon_stops(
    db: Database, database_url: str
) -> None:
    # Given a daemon served with a metrics port and the database
    await seed_fleet(db)
    port = free_port()
    seen: list[str] = []

    async def daemon(stop: asyncio.Event) -> None:
        # While it runs, the refresher has filled the gauges from the database
        for _ in range(100):
            page = await asyncio.to_thread(scrape, port)
            if sample(page, "rlfleet_jobs", status="failed") == 1:
                seen.append(page)
                return
            await asyncio.sleep(0.1)

    await serve("test", daemon, metrics_port=port, database_url=database_url)
    assert seen, "the jobs gauge was never refreshed"
    # Then once the daemon stopped, nothing listens on the port any more
    assert scrape_or_none(port) is None


@pytest.mark.slow
def test_a_daemon_started_with_metrics_port_serves_them(
    database_url: str, nats: EmbeddedNats
) -> None:
    # Given the poller started as systemd would, with --metrics-port
    port = free_port()
    env = {**os.environ, "RLFLEET_DATABASE_URL": database_url, "RLFLEET_NATS_URL": nats.url}
    proc = subprocess.Popen(
        [str(RLFLEET), "poller", "--interval", "0.2", "--metrics-port", str(port)],
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
    )
    try:
        # When Prometheus scrapes it
        page = None
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            page = scrape_or_none(port)
            if (
                page
                and (sample(page, "rlfleet_poll_sweep_duration_seconds_count") or 0) > 0
                and sample(page, "rlfleet_jobs", status="queued") is not None
            ):
                break
            time.sleep(0.2)
        # Then the sweeps it made and the state gauges are there
        assert page is not None, proc.stderr.read().decode() if proc.poll() is not None else ""
        assert (sample(page, "rlfleet_poll_sweep_duration_seconds_count") or 0) > 0
        assert sample(page, "rlfleet_jobs", status="queued") == 0
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(30)
    assert proc.returncode == 0


def half_sent(port: int) -> socket.socket:
    """A connection that sends the start of a request and never its end."""
    sock = socket.create_connection(("127.0.0.1", port), timeout=5)
    sock.sendall(b"GET /metrics HTTP/1.1\r\nHost: 127.0.0.1\r\n")
    return sock


def closed_within(sock: socket.socket, seconds: float) -> bool:
    """Whether the server closes `sock` within `seconds` (sending nothing first)."""
    sock.settimeout(seconds)
    try:
        return sock.recv(1) == b""
    except ConnectionResetError:
        return True
    except TimeoutError:
        return False
    finally:
        sock.close()


@pytest.mark.slow
def test_half_sent_requests_hold_the_metrics_endpoint_only_a_few_connections_for_a_while(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # Given the metrics endpoint, whose connections last 3 s at most
    if hasattr(metrics, "MetricsServer"):
        monkeypatch.setattr(metrics.MetricsServer, "deadline_s", 3.0)
    limit = getattr(metrics, "METRICS_MAX_CONNECTIONS", 32)
    port = free_port()
    server = metrics.start_metrics_server(port, addr="127.0.0.1")
    assert server is not None
    try:
        # When a client opens as many half-sent requests as it may, and one more
        held = [half_sent(port) for _ in range(limit)]
        # Then the one more is closed at once
        assert closed_within(half_sent(port), 2.0)
        # And the others are closed by the server once their time is up
        started = time.monotonic()
        assert all(closed_within(sock, 10.0) for sock in held)
        assert time.monotonic() - started < 8
        # And a scrape is answered again, once the server has counted the closed
        # connections out (it closes a socket a moment before it frees its slot)
        assert "rlfleet_jobs" in scrape_soon(port, within_s=3.0)
    finally:
        server.shutdown()
        server.server_close()
