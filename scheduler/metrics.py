"""Prometheus metrics of the daemons: every metric object lives here, with the helpers
the daemons call (`observe_dispatch`, `observe_poll_sweep`, `count_retry`…).

A daemon started with `--metrics-port N` (N > 0) serves them on http://0.0.0.0:N/metrics,
in a thread of its own with at most `METRICS_MAX_CONNECTIONS` connections at once, each
closed after `METRICS_CONNECTION_S` seconds whatever it sends (a client that never finishes
its request costs one connection for that long, never the daemon's file descriptors).
The gauges (jobs by state, VMs by status, GPUs free/allocated) are refreshed from the
database by `refresh_gauges`, one short read-only transaction per tick, so they are right
whichever daemon moved the job.
"""

from __future__ import annotations

import asyncio
import contextlib
import socket
import threading
import time
from datetime import datetime
from socketserver import ThreadingMixIn
from typing import Any
from wsgiref.simple_server import WSGIRequestHandler, WSGIServer, make_server

from prometheus_client import Counter, Gauge, Histogram, make_wsgi_app
from sqlalchemy import case, func, select

from scheduler.aio import sleep_or_stop
from scheduler.db import Database
from scheduler.errors import ServiceUnavailable, error_line
from scheduler.logging import get_logger
from scheduler.models import GPU, VM, Job
from scheduler.states import JobStatus, VMStatus

log = get_logger("metrics")


# Waits run from seconds (a free GPU) to hours (a busy fleet).
_WAIT_BUCKETS = (0.1, 0.5, 1, 2, 5, 10, 30, 60, 120, 300, 600, 1800, 3600, 4 * 3600, 24 * 3600)
# Dispatching and polling are round trips over SSH: milliseconds to tens of seconds.
_STEP_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60)

JOBS = Gauge("rlfleet_jobs", "Jobs in each state.", ["status"])
VMS = Gauge(
    "rlfleet_vms", "VMs by poller status (draining VMs also counted in status).", ["status"]
)
VMS_DRAINING = Gauge("rlfleet_vms_draining", "VMs that take no new jobs.")
GPUS = Gauge(
    "rlfleet_gpus",
    "GPUs by use: free (healthy, unallocated, not drained, not foreign), allocated, drained "
    "(by hand), foreign, unhealthy.",
    ["state"],
)
# Per GPU, labelled by the VM's id (`vm list --json` has it), not its name: the endpoint is
# unauthenticated and serves no names (docs/security.md). The reasons are the poller's own
# text (`scheduler.gpu_health`), nothing a VM or user wrote.
GPU_HEALTHY = Gauge(
    "rlfleet_gpu_healthy",
    "Per GPU: 1 healthy, 0 unhealthy (no job is placed on it).",
    ["vm_id", "gpu", "uuid"],
)
GPU_UNHEALTHY_REASON = Gauge(
    "rlfleet_gpu_unhealthy_info",
    "1 for each unhealthy GPU, with why (the reason `vm show` prints).",
    ["vm_id", "gpu", "uuid", "reason"],
)
QUEUE_WAIT = Histogram(
    "rlfleet_job_queue_wait_seconds",
    "From the job entering queued (or being requeued) to the dispatcher claiming its GPUs.",
    buckets=_WAIT_BUCKETS,
)
SUBMIT_TO_RUNNING = Histogram(
    "rlfleet_job_submit_to_running_seconds",
    "From submission to the job's first running state of an attempt.",
    buckets=_WAIT_BUCKETS,
)
DISPATCH_DURATION = Histogram(
    "rlfleet_dispatch_duration_seconds",
    "Handling one jobs.new message: load, claim, launch over SSH, record.",
    buckets=_STEP_BUCKETS,
)
POLL_SWEEP_DURATION = Histogram(
    "rlfleet_poll_sweep_duration_seconds",
    "One poller sweep over every VM.",
    buckets=_STEP_BUCKETS,
)
# A poller's own share and sweeps (each poller serves its own metrics: no label needed,
# and no host name is exposed).
POLL_VMS_HELD = Gauge("rlfleet_poll_vms_held", "VMs this poller holds (polls, alone).")
POLL_SWEEP_SECONDS = Gauge("rlfleet_poll_sweep_seconds", "Wall time of this poller's last sweep.")
POLL_SWEEP_CPU_SECONDS = Gauge(
    "rlfleet_poll_sweep_cpu_seconds", "CPU time of this poller's last sweep."
)
POLL_POLLERS = Gauge("rlfleet_poll_pollers", "Live pollers sharing the VMs, as last renewed.")
POLL_TAKEOVERS = Counter(
    "rlfleet_poll_takeovers_total", "Pollers whose lease ran out and whose VMs this one freed."
)
DISPATCHES = Counter("rlfleet_dispatches_total", "Dispatch outcomes.", ["outcome"])
RETRIES = Counter(
    "rlfleet_job_retries_total", "Failed jobs put back in the queue, by failure reason.", ["reason"]
)
RECOVERIES = Counter(
    "rlfleet_recoveries_total",
    "Jobs the requeue manager recovered (stuck, lost node, never published…), by reason.",
    ["reason"],
)
FAILURES = Counter("rlfleet_job_failures_total", "Jobs that failed, by failure reason.", ["reason"])

DEFAULT_REFRESH_S = 5.0
METRICS_MAX_CONNECTIONS = 32
"""Connections the metrics endpoint serves at once; one more is closed at once."""
METRICS_CONNECTION_S = 10.0
"""A connection to the metrics endpoint is closed this long after it was accepted."""


class _QuietHandler(WSGIRequestHandler):
    """One request per connection, each read waiting at most `timeout` seconds; no log."""

    timeout = 5.0

    def log_message(self, format: str, *args: Any) -> None:  # noqa: A002
        """Log nothing per request."""


class MetricsServer(ThreadingMixIn, WSGIServer):
    """The metrics endpoint: a thread per connection, at most `max_connections` of them,
    each cut off `deadline_s` after it was accepted (checked between two accepts, twice a
    second), errors as one log line."""

    daemon_threads = True
    request_queue_size = 64
    max_connections = METRICS_MAX_CONNECTIONS
    deadline_s = METRICS_CONNECTION_S

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        self._open: dict[socket.socket, float] = {}
        self._open_lock = threading.Lock()
        super().__init__(*args, **kwargs)

    def verify_request(self, request: Any, client_address: Any) -> bool:
        with self._open_lock:
            if len(self._open) >= self.max_connections:
                return False  # closed by the caller, at once
            self._open[request] = time.monotonic()
        return True

    def shutdown_request(self, request: Any) -> None:
        with self._open_lock:
            self._open.pop(request, None)
        super().shutdown_request(request)

    def service_actions(self) -> None:
        now = time.monotonic()
        with self._open_lock:
            late = [sock for sock, at in self._open.items() if now - at > self.deadline_s]
        for sock in late:
            with contextlib.suppress(OSError):
                sock.shutdown(socket.SHUT_RDWR)  # its thread's read ends; it closes it

    def handle_error(self, request: Any, client_address: Any) -> None:
        import sys

        log.debug("metrics_request_failed", error=str(sys.exc_info()[1]))


def start_metrics_server(port: int | None, addr: str = "0.0.0.0") -> WSGIServer | None:
    """Serve /metrics on `port` in a background thread; None (and nothing) for 0 or None.
    Call `.shutdown()` on the returned server to stop it."""
    if not port:
        return None

    class Server(MetricsServer):
        address_family = socket.AF_INET6 if ":" in addr else socket.AF_INET

    try:
        server = make_server(addr, port, make_wsgi_app(), Server, handler_class=_QuietHandler)
    except OSError as exc:
        raise ServiceUnavailable(f"cannot serve metrics on port {port}: {exc.strerror}") from exc
    threading.Thread(target=server.serve_forever, name="metrics", daemon=True).start()
    log.info("metrics_serving", port=port, addr=addr)
    return server


def _seconds_since(start: datetime | None, end: datetime | None) -> float | None:
    if start is None or end is None:
        return None
    return max(0.0, (end - start).total_seconds())


def observe_dispatch(seconds: float, outcome: str = "launched") -> None:
    """Record how long one dispatch took and how it ended (launched, pending, lost_race…)."""
    DISPATCH_DURATION.observe(seconds)
    DISPATCHES.labels(outcome=outcome).inc()


def observe_poll_sweep(seconds: float) -> None:
    """Record the duration of one poller sweep over the fleet."""
    POLL_SWEEP_DURATION.observe(seconds)


def set_poller_held(held: int, pollers: int | None = None) -> None:
    """This poller's share: the VMs it holds (and the live pollers it shares with)."""
    POLL_VMS_HELD.set(held)
    if pollers is not None:
        POLL_POLLERS.set(pollers)


def observe_poller_sweep(seconds: float, cpu_seconds: float) -> None:
    """Wall and CPU time of this poller's last full sweep."""
    POLL_SWEEP_SECONDS.set(seconds)
    POLL_SWEEP_CPU_SECONDS.set(cpu_seconds)


def count_takeovers(n: int) -> None:
    """Count the pollers whose lease ran out and whose VMs this poller freed."""
    if n:
        POLL_TAKEOVERS.inc(n)


def observe_queue_wait(queued_at: datetime | None, claimed_at: datetime | None) -> None:
    """Record the wait from (re)queueing to the GPUs being claimed; no-op when unknown."""
    seconds = _seconds_since(queued_at, claimed_at)
    if seconds is not None:
        QUEUE_WAIT.observe(seconds)


def observe_running(submitted_at: datetime | None, running_at: datetime | None) -> None:
    """Record submit→running latency for a job that just became running."""
    seconds = _seconds_since(submitted_at, running_at)
    if seconds is not None:
        SUBMIT_TO_RUNNING.observe(seconds)


def count_retry(reason: str | None) -> None:
    """One failed job was requeued for another attempt."""
    RETRIES.labels(reason=reason or "unknown").inc()


def count_recovery(reason: str) -> None:
    """The requeue manager recovered one job (stuck_pending, stuck_starting, node_lost…)."""
    RECOVERIES.labels(reason=reason).inc()


def count_failure(reason: str | None) -> None:
    """One job moved to failed."""
    FAILURES.labels(reason=reason or "unknown").inc()


async def refresh_gauges(db: Database) -> None:
    """Set the state gauges from COUNT(*) … GROUP BY queries in one short transaction."""
    async with db.transaction() as session:
        job_counts = dict(
            (await session.execute(select(Job.status, func.count()).group_by(Job.status))).all()
        )
        vm_counts = dict(
            (await session.execute(select(VM.status, func.count()).group_by(VM.status))).all()
        )
        draining = await session.scalar(
            select(func.count()).select_from(VM).where(VM.draining.is_(True))
        )
        gpu_state = case(
            (GPU.job_id.is_not(None), "allocated"),
            (GPU.healthy.is_(False), "unhealthy"),
            (GPU.drained.is_(True), "drained"),
            (GPU.foreign_busy.is_(True), "foreign"),
            else_="free",
        )
        gpu_counts: dict[str, int] = dict(
            (await session.execute(select(gpu_state, func.count()).group_by(gpu_state))).all()  # type: ignore[arg-type]
        )
        per_gpu = (
            await session.execute(
                select(GPU.vm_id, GPU.index, GPU.uuid, GPU.healthy, GPU.health_reason)
            )
        ).all()
    for status in JobStatus:
        JOBS.labels(status=status.value).set(job_counts.get(status.value, 0))
    for vm_status in VMStatus:
        VMS.labels(status=vm_status.value).set(vm_counts.get(vm_status.value, 0))
    VMS_DRAINING.set(int(draining or 0))
    for state in ("free", "allocated", "drained", "foreign", "unhealthy"):
        GPUS.labels(state=state).set(gpu_counts.get(state, 0))
    # Rebuilt each time: a removed GPU or a cleared reason leaves no series behind.
    GPU_HEALTHY.clear()
    GPU_UNHEALTHY_REASON.clear()
    for vm_id, index, uuid, healthy, reason in per_gpu:
        labels = {"vm_id": str(vm_id), "gpu": str(index), "uuid": uuid}
        GPU_HEALTHY.labels(**labels).set(1 if healthy else 0)
        if not healthy:
            why = reason or "its VM cannot be trusted (see the VM's last_error)"
            GPU_UNHEALTHY_REASON.labels(**labels, reason=why[:200]).set(1)


async def refresh_forever(
    db: Database, stop: asyncio.Event, interval: float = DEFAULT_REFRESH_S
) -> None:
    """Refresh the gauges every `interval` seconds until `stop`; database errors are logged
    and retried at the next tick (metrics must never take a daemon down)."""
    while not stop.is_set():
        try:
            await refresh_gauges(db)
        except Exception as exc:  # noqa: BLE001
            log.warning("metrics_refresh_failed", error=error_line(exc, 200))
        await sleep_or_stop(stop, interval)
