"""The daemon commands: `rlfleet up`, `poller`, `dispatcher`, `requeue`.

The engines (scheduler/gpu_poller/, dispatcher/, requeue/, up.py) know nothing of
the command line: each exposes `run(settings, stop, ready, …)`. This module parses the
flags, checks them, and runs that entry under `scheduler.daemon.run_service`. It imports
an engine only when its command runs, so `rlfleet --help` and the one-shot commands do
not load SSH, NATS or Prometheus. `python -m scheduler.<daemon>` comes here too
(`poller_main`, `dispatcher_main`, `requeue_main`).
"""

from __future__ import annotations

import asyncio
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import click

from scheduler.cli._common import (
    Decorator,
    database_url_option,
    log_level_option,
    nats_url_option,
    state_dir_option,
)
from scheduler.liveness import ENV_NAMES, UNREACHABLE_AFTER_POLLS, Liveness, SSHDeadlines
from scheduler.retry import DEFAULT_POLICY, RetryPolicy
from scheduler.settings import Settings

# The engines' defaults, repeated here so that building the commands imports no engine
# (tests/unit/test_import_graph.py checks they agree with the engines' own).
CLAIM_LEASE_S = 60.0
"""scheduler.claims.batch.DEFAULT_LEASE_S"""
LAUNCH_TIMEOUT_S = 30.0
"""GlobalJobDispatcher's launch_timeout_s"""
MAX_IN_FLIGHT = 64
"""GlobalJobDispatcher's max_in_flight"""
ENTRYPOINT = "training.train_grpo"
"""scheduler.models.DEFAULT_ENTRYPOINT"""


# --- the options of the daemon commands: one definition per shape ------------------------

PORT = click.IntRange(0, 65535)
"""A TCP port to listen on, 0 meaning none."""


def seconds_option(
    flag: str, default: float, minimum: float, help: str, *, name: str | None = None
) -> Decorator:
    """A duration in seconds, at least `minimum`, its default shown in `--help`."""
    return click.option(
        *((flag, name) if name else (flag,)),
        type=click.FloatRange(min=minimum),
        default=default,
        show_default=True,
        help=help,
    )


def liveness_option(flag: str, knob: str, minimum: float, help: str) -> Decorator:
    """A `Liveness` knob (`knob`, its field): its default is the knob's, it reads the knob's
    environment variable too, and `help` ends with that variable, so every daemon that
    takes the knob reads it alike (scheduler/liveness.py)."""
    env = ENV_NAMES[knob]
    return click.option(
        flag,
        type=click.FloatRange(min=minimum),
        envvar=env,
        default=getattr(Liveness, knob),
        show_default=True,
        help=f"{help} (env {env}).",
    )


def count_option(flag: str, default: int, help: str) -> Decorator:
    """A whole number, at least 1, its default shown in `--help`."""
    return click.option(
        flag, type=click.IntRange(min=1), default=default, show_default=True, help=help
    )


metrics_option = click.option(
    "--metrics-port",
    type=PORT,
    default=0,
    show_default=True,
    envvar="RLFLEET_METRICS_PORT",
    help="Serve Prometheus metrics on this port (0: off; env RLFLEET_METRICS_PORT).",
)
"""The `--metrics-port` flag every daemon command takes (0 or absent: no metrics)."""


def daemon_options(fn: Callable[..., Any]) -> Callable[..., Any]:
    """The connection, metrics and logging flags every daemon command takes.

    They repeat the global `rlfleet` options so `python -m scheduler.<daemon>` (with no
    `rlfleet` group around it) accepts them too; `daemon_settings` resolves them.
    """
    decorators: list[Decorator] = [
        database_url_option("Overrides the global --database-url (env RLFLEET_DATABASE_URL)."),
        nats_url_option("Overrides the global --nats-url (env RLFLEET_NATS_URL)."),
        metrics_option,
        log_level_option("Log verbosity (default: the rlfleet --log-level, else INFO)."),
    ]
    for decorate in reversed(decorators):
        fn = decorate(fn)
    return fn


def fence_options(fn: Callable[..., Any]) -> Callable[..., Any]:
    """`--fence-after` and `--fence-grace` (env RLFLEET_FENCE_AFTER / _GRACE), for the
    dispatcher (it starts the watchdogs) and the requeue manager (it checks its timeout)."""
    fn = liveness_option(
        "--fence-grace", "fence_grace_s", 0, "Seconds between a fenced attempt's TERM and its KILL"
    )(fn)
    return liveness_option(
        "--fence-after",
        "fence_after_s",
        0,
        "An attempt whose lease the poller has not renewed for this many seconds (by the VM's "
        "clock) stops itself; 0 starts no watchdog",
    )(fn)


def checked_liveness(**given: float | None) -> Liveness:
    """The knobs from flags (`given`) and the environment, for a daemon command: a usage
    error (exit 2) when a value is bad or the knobs are unsafe together."""
    try:
        knobs = Liveness.from_env(given)
        SSHDeadlines.from_env()
    except ValueError as exc:
        raise click.UsageError(str(exc)) from None
    problems = knobs.problems()
    if problems:
        raise click.UsageError("; ".join(problems))
    return knobs


def daemon_settings(
    ctx: click.Context, database_url: str | None, nats_url: str | None, log_level: str | None
) -> Settings:
    """Settings for a daemon command: its own flags, else the `rlfleet` group's, else the
    environment; configures logging on the way."""
    from scheduler.cli._common import CliContext
    from scheduler.logging import configure
    from scheduler.validate import check_database_url

    parent = ctx.find_object(CliContext)  # set when run as `rlfleet <daemon>`
    settings = Settings.load(
        database_url or (parent.settings.database_url if parent else None),
        nats_url or (parent.settings.nats_url if parent else None),
    )
    check_database_url(settings.database_url)  # malformed: exit 2, one line
    configure((log_level or (parent.log_level if parent else None) or "INFO").upper())
    return settings


Entry = Callable[[Settings, asyncio.Event, asyncio.Event], Any]


def serve_daemon(name: str, settings: Settings, metrics_port: int, entry: Entry) -> None:
    """Run an engine's `entry(settings, stop, ready)` as a service (signals, systemd)."""
    from scheduler.daemon import run_service

    async def main(stop: asyncio.Event, ready: asyncio.Event) -> None:
        await entry(settings, stop, ready)

    run_service(name, settings, metrics_port, main)


# --- rlfleet poller ---------------------------------------------------------------------


@click.command("poller")
@liveness_option("--interval", "poll_interval_s", 0.1, "Seconds between sweeps of the fleet")
@count_option(
    "--unreachable-after",
    UNREACHABLE_AFTER_POLLS,
    "Consecutive failed polls after which a VM is marked unreachable.",
)
@liveness_option(
    "--poll-timeout",
    "poll_timeout_s",
    0.1,
    "Seconds one VM's poll may take before it counts as failed",
)
@liveness_option(
    "--unreachable-timeout",
    "unreachable_timeout_s",
    0.1,
    "A VM that has not answered a poll for this many seconds is marked unreachable, "
    "however few polls failed",
)
@liveness_option(
    "--poller-lease",
    "poller_lease_s",
    0,
    "Seconds this poller holds its share of the VMs after each renewal; the VMs of a poller "
    "that stops renewing go to the others after it. 0: 0.6 x (unreachable timeout - interval)",
)
@daemon_options
@click.pass_context
def poller(
    ctx: click.Context,
    interval: float,
    unreachable_after: int,
    poll_timeout: float,
    unreachable_timeout: float,
    poller_lease: float,
    database_url: str | None,
    nats_url: str | None,
    metrics_port: int,
    log_level: str | None,
) -> None:
    """Poll the VMs' GPUs and launched jobs over SSH (the GPU poller; several share the VMs).

    Pollers on several hosts divide the VMs between them (README, "Several pollers")."""
    liveness = checked_liveness(
        poll_interval_s=interval,
        poll_timeout_s=poll_timeout,
        unreachable_timeout_s=unreachable_timeout,
        poller_lease_s=poller_lease,
    )
    settings = daemon_settings(ctx, database_url, nats_url, log_level)
    from scheduler import gpu_poller

    async def entry(settings: Settings, stop: asyncio.Event, ready: asyncio.Event) -> None:
        await gpu_poller.run(
            settings, stop, ready, liveness=liveness, unreachable_after=unreachable_after
        )

    serve_daemon("poller", settings, metrics_port, entry)


# --- rlfleet dispatcher -----------------------------------------------------------------


@click.command("dispatcher")
@count_option("--max-in-flight", MAX_IN_FLIGHT, "Messages handled at once by this dispatcher.")
@seconds_option(
    "--lease",
    CLAIM_LEASE_S,
    1,
    "Seconds a claim may stay unconfirmed before the requeue manager takes it back.",
    name="lease_s",
)
@seconds_option(
    "--launch-timeout",
    LAUNCH_TIMEOUT_S,
    1,
    "Seconds a launch over SSH may take.",
    name="launch_timeout_s",
)
@fence_options
@daemon_options
@click.pass_context
def dispatcher(
    ctx: click.Context,
    max_in_flight: int,
    lease_s: float,
    launch_timeout_s: float,
    fence_after: float,
    fence_grace: float,
    database_url: str | None,
    nats_url: str | None,
    metrics_port: int,
    log_level: str | None,
) -> None:
    """Run the dispatcher: claim GPUs for new jobs and launch them over SSH."""
    from scheduler import dispatcher as engine

    margin = engine.LEASE_MARGIN_S
    if lease_s < launch_timeout_s + margin:
        # A lease that can run out during a launch hands the job to a second claim while
        # the first may still start.
        raise click.BadParameter(
            f"must be at least --launch-timeout + {margin:g} s ({launch_timeout_s + margin:g})",
            param_hint="--lease",
        )
    checked_liveness(fence_after_s=fence_after, fence_grace_s=fence_grace)
    settings = daemon_settings(ctx, database_url, nats_url, log_level)

    async def entry(settings: Settings, stop: asyncio.Event, ready: asyncio.Event) -> None:
        await engine.run(
            settings,
            stop,
            ready,
            max_in_flight=max_in_flight,
            lease_s=lease_s,
            launch_timeout_s=launch_timeout_s,
            fence_after_s=fence_after,
            fence_grace_s=fence_grace,
        )

    serve_daemon("dispatcher", settings, metrics_port, entry)


# --- rlfleet requeue --------------------------------------------------------------------


@click.command("requeue")
@seconds_option("--interval", 2.0, 0.05, "Seconds between ticks.")
@seconds_option(
    "--pending-timeout",
    60.0,
    0,
    "Re-announce a pending job after this many seconds even if no GPUs look free.",
)
@liveness_option(
    "--node-lost-timeout",
    "node_lost_timeout_s",
    0,
    "Seconds since an unreachable VM last answered after which its jobs fail as node_lost "
    "and are retried; at least --fence-after + 2 + --fence-grace",
)
@seconds_option(
    "--republish-after",
    60.0,
    1,
    "Announce again a job still queued this many seconds after its last announcement.",
)
@seconds_option(
    "--starvation-after",
    300.0,
    0,
    "After this many seconds waiting, a job that does not fit holds back smaller ones "
    "(only a job that fits on some VM).",
)
@seconds_option(
    "--retry-base-delay",
    DEFAULT_POLICY.base_delay_s,
    0,
    "Backoff before the first retry; doubles for each further retry.",
)
@seconds_option(
    "--retry-max-delay", DEFAULT_POLICY.max_delay_s, 0, "Longest backoff between retries."
)
@seconds_option("--kill-grace", 10.0, 0, "Seconds between TERM and KILL for a leftover process.")
@fence_options
@daemon_options
@click.pass_context
def requeue(
    ctx: click.Context,
    database_url: str | None,
    nats_url: str | None,
    interval: float,
    pending_timeout: float,
    node_lost_timeout: float,
    republish_after: float,
    starvation_after: float,
    retry_base_delay: float,
    retry_max_delay: float,
    kill_grace: float,
    fence_after: float,
    fence_grace: float,
    metrics_port: int,
    log_level: str | None,
) -> None:
    """Run the requeue manager: retries, stuck jobs, lost VMs, unannounced jobs."""
    checked_liveness(
        node_lost_timeout_s=node_lost_timeout, fence_after_s=fence_after, fence_grace_s=fence_grace
    )
    settings = daemon_settings(ctx, database_url, nats_url, log_level)
    from scheduler import requeue as engine

    config = engine.RequeueConfig(
        interval_s=interval,
        pending_timeout_s=pending_timeout,
        node_lost_timeout_s=node_lost_timeout,
        republish_after_s=republish_after,
        recheck_after_s=max(1.0, 2 * interval),
        starvation_after_s=starvation_after,
        kill_grace_s=kill_grace,
        policy=RetryPolicy(base_delay_s=retry_base_delay, max_delay_s=retry_max_delay),
    )

    async def entry(settings: Settings, stop: asyncio.Event, ready: asyncio.Event) -> None:
        await engine.run(settings, stop, ready, config)

    serve_daemon("requeue", settings, metrics_port, entry)


# --- rlfleet up -------------------------------------------------------------------------


@click.command("up")
@state_dir_option(
    "Where Postgres, NATS and the remembered ports live "
    "(default: $RLFLEET_STATE_DIR, else $XDG_DATA_HOME/rlfleet or ~/.local/share/rlfleet)."
)
@click.option(
    "--local-vm",
    is_flag=True,
    help="Register this machine as a VM (local transport) that jobs can run on.",
)
@click.option(
    "--gpus",
    type=click.IntRange(min=1),
    default=None,
    help="With --local-vm and no nvidia-smi: simulate N GPUs (jobs run on the CPU).",
)
@click.option(
    "--vm-name", default="local", show_default=True, help="Name of the local VM (--local-vm)."
)
@click.option(
    "--entrypoint",
    default=ENTRYPOINT,
    show_default=True,
    help="How the local VM trains: a module (run with -m) or a .py script.",
)
@click.option(
    "--web-port",
    type=PORT,
    default=0,
    help="Also serve the web dashboard on 127.0.0.1:PORT (0, the default: no dashboard); "
    "actions need the token in STATE_DIR/web.token.",
)
@metrics_option
@click.pass_context
def up(
    ctx: click.Context,
    state_dir: Path | None,
    local_vm: bool,
    gpus: int | None,
    vm_name: str,
    entrypoint: str,
    web_port: int,
    metrics_port: int,
) -> None:
    """Run everything on this machine: embedded Postgres and NATS, the three daemons.

    Postgres and NATS ask every client for generated credentials, kept in files only you
    can read in the state directory; the other commands find a running `up` by themselves
    when no database is configured (or `source STATE_DIR/env`). Ctrl-C or SIGTERM stops
    everything; running it again reuses the data.
    """
    from scheduler.errors import BadInput
    from scheduler.logging import configure

    configure(getattr(ctx.obj, "log_level", None) or "INFO")
    if gpus is not None and not local_vm:
        raise BadInput("--gpus only makes sense with --local-vm")
    from scheduler.up import UpOptions, run_up
    from scheduler.upfind import configured_state_dir

    run_up(
        UpOptions(
            state_dir=state_dir or configured_state_dir(),
            local_vm=local_vm,
            gpus=gpus,
            vm_name=vm_name,
            entrypoint=entrypoint,
            metrics_port=metrics_port,
            web_port=web_port,
        )
    )


COMMANDS: list[click.Command] = [up, poller, dispatcher, requeue]


# --- python -m scheduler.<daemon> -------------------------------------------------------


def _main(command: click.Command, argv: list[str] | None) -> None:
    from scheduler.cli._common import run_guarded

    sys.exit(run_guarded(command, argv))


def poller_main(argv: list[str] | None = None) -> None:
    """`python -m scheduler.gpu_poller [flags]`, the same as `rlfleet poller`."""
    _main(poller, argv)


def dispatcher_main(argv: list[str] | None = None) -> None:
    """`python -m scheduler.dispatcher [flags]`, the same as `rlfleet dispatcher`."""
    _main(dispatcher, argv)


def requeue_main(argv: list[str] | None = None) -> None:
    """`python -m scheduler.requeue [flags]`, the same as `rlfleet requeue`."""
    _main(requeue, argv)
