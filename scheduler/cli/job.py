"""`rlfleet job …`: submit training jobs and follow them (what `job submit` reads from a
job file, a recipe or its options is `scheduler.cli.jobfile`)."""

from __future__ import annotations

import sys
from typing import TYPE_CHECKING, Any

import click

from scheduler.cli._common import (
    CliContext,
    ColumnInt,
    ColumnText,
    JobId,
    Seconds,
    echo_json,
    echo_table,
    fmt_time,
    json_flag,
    json_option,
    pass_cli,
    printable,
    warn,
)
from scheduler.cli.job_pull import pull
from scheduler.cli.job_view import event_reason, progress_line, restarts_cell, store_lines
from scheduler.errors import BadInput, ServiceUnavailable
from scheduler.jobstore import gpus_text, list_jobs
from scheduler.states import JobStatus
from scheduler.validate import (
    DEFAULT_HANG_TIMEOUT_S,
    DEFAULT_STARTUP_TIMEOUT_S,
    INT4,
    INT8,
    JOB_NAME_MAX,
    MAX_GPUS,
    MAX_NODES,
    MAX_RETRIES,
    MAX_TIMEOUT_S,
    MIN_TIMEOUT_S,
    WORKDIR_MAX_BYTES,
)

if TYPE_CHECKING:
    from scheduler.db import Database
    from scheduler.pgconn import PgDatabase

# SSH (scheduler.transport, scheduler.control) and NATS (scheduler.submit) are imported by
# the commands that use them. `job list` and `job submit` run the statements of
# `scheduler.jobstore` on a plain psycopg connection (`CliContext.run_sql`): they load
# neither SSH nor SQLAlchemy (tests/integration/test_cli_imports.py).

CANCEL_GRACE_S = 10.0
"""scheduler.control.DEFAULT_GRACE_S (tests/unit/test_import_graph.py checks they agree)."""

job_id_argument = click.argument("job_id", type=JobId())
"""The JOB_ID argument of the commands about one job (`jobs.id` is a BigInteger)."""


@click.group("job")
def group() -> None:
    """Submit, list, inspect, follow, cancel and retry jobs."""


@group.command(
    "submit",
    context_settings={"ignore_unknown_options": False},
    epilog="Example: rlfleet job submit --model Qwen/Qwen2.5-0.5B-Instruct "
    "--dataset openai/gsm8k --reward-function correctness --gpus 2 -- --max_steps 500",
)
@click.option(
    "-f",
    "--file",
    "spec_file",
    type=click.Path(dir_okay=False),
    help='A job spec file (YAML, see the README\'s "Job groups"): the whole job is read from '
    "it, validated before anything is submitted; --model, --dataset, --reward-function, "
    "--gpus, --nodes, --output-dir and train arguments then come from the file.",
)
@click.option(
    "--config",
    "recipe",
    type=click.Path(dir_okay=False),
    metavar="RECIPE.yaml",
    help="A training recipe in `trl grpo --config`'s format, read here and shipped with the "
    "job: its model_name_or_path, dataset_name and reward_funcs stand for --model, --dataset "
    "and --reward-function (flags given override them), every other key becomes a "
    "train_grpo.py argument (arguments after -- override those). output_dir and "
    "resume_from_checkpoint are left out: the scheduler sets them.",
)
@click.option("--model", help="Model name on the hub, or a path on the VM (required without -f).")
@click.option(
    "--dataset", help="Dataset name on the hub, or a file on the VM (required without -f)."
)
@click.option(
    "--reward-function",
    "reward_functions",
    multiple=True,
    help="Built-in reward name or module:function (repeatable; required without -f).",
)
@click.option(
    "--gpus",
    default=1,
    show_default=True,
    type=ColumnInt(hi=MAX_GPUS, bounds=INT4),
    help=f"GPUs on one VM (1-{MAX_GPUS}); refused when no polled VM has that many.",
)
@click.option(
    "--nodes",
    default=1,
    show_default=True,
    type=ColumnInt(lo=1, hi=MAX_NODES, bounds=INT4),
    help=f"VMs to run on (1-{MAX_NODES}), --gpus on each; every node gets its rank and the "
    "rendezvous in RLFLEET_NODE_RANK, RLFLEET_NUM_NODES, RLFLEET_NODE_ADDRS, MASTER_ADDR, "
    "MASTER_PORT, WORLD_SIZE. Refused when the polled fleet has fewer VMs that big.",
)
@click.option(
    "--max-retries",
    default=3,
    show_default=True,
    type=ColumnInt(hi=MAX_RETRIES, bounds=INT4),
    help=f"Retries after a retryable failure (0-{MAX_RETRIES}).",
)
@click.option(
    "--hang-timeout",
    "hang_timeout",
    default=DEFAULT_HANG_TIMEOUT_S,
    show_default=True,
    type=ColumnInt(lo=0, hi=MAX_TIMEOUT_S),
    metavar="S",
    help="Seconds a running attempt's training step may stay unchanged (while its GPUs idle "
    "or run at low power; twice as long otherwise) before it is hung: its stacks, GPU view "
    "and log tail are kept (job logs --diagnostics), it is stopped and retried from its "
    f"newest checkpoint, counting as a retry. 0: never; else {MIN_TIMEOUT_S}-{MAX_TIMEOUT_S}.",
)
@click.option(
    "--startup-timeout",
    "startup_timeout",
    default=DEFAULT_STARTUP_TIMEOUT_S,
    show_default=True,
    type=ColumnInt(lo=0, hi=MAX_TIMEOUT_S),
    metavar="S",
    help="Seconds a running attempt may take to report its first progress (model download "
    "and load) before it is stopped like a hung one. 0: never.",
)
@click.option(
    "--priority",
    default=0,
    show_default=True,
    type=ColumnInt(bounds=INT4),
    help="Higher runs first (a 32-bit integer).",
)
@click.option("--name", type=ColumnText(max_len=JOB_NAME_MAX), help="A label for listings.")
@click.option(
    "--vllm-server-gpus",
    type=click.IntRange(1, MAX_GPUS),
    help="vLLM server mode: run `trl vllm-serve` with the model on this many more GPUs of "
    "the same VM (rank 0's with --nodes; a `vllm` role, ready on GET /health) and start "
    "training once it answers, with --use_vllm --vllm_mode server and its address and ports.",
)
@click.option(
    "--vllm-server-own-vm",
    is_flag=True,
    help="With --vllm-server-gpus: run the `vllm` role on a VM of its own, apart from the "
    "trainer (the job then spans one VM more than --nodes).",
)
@click.option(
    "--output-dir",
    type=ColumnText(),
    help="Where training writes on the VM; relative paths and ~/ are under the VM user's "
    "home (default: ~/.rlfleet/INSTALLATION/outputs/JOB_ID, shown by job show).",
)
@click.option(
    "--env",
    "env",
    multiple=True,
    metavar="KEY[=VALUE]",
    help="Set a variable in the job's environment (repeatable); KEY alone takes the value "
    "from this shell, keeping it off the command line. Listings show the names only.",
)
@click.option(
    "--workdir",
    metavar="DIR",
    help="Send this directory with the job (reward modules, a local dataset, configs): "
    "each attempt runs in its own copy of it, first on PYTHONPATH, on whichever VM it "
    "lands. .rlfleetignore (gitignore-style) leaves files out; packed size at most "
    f"{WORKDIR_MAX_BYTES >> 20} MiB.",
)
@click.option(
    "--store",
    metavar="URL",
    help="Where the job's checkpoints and final model go, so that a retry on any VM "
    "resumes from the newest complete checkpoint and `job pull` brings the model back: "
    "s3://bucket/prefix (S3-compatible; each VM uses its own AWS configuration) or "
    "file:///path (a directory every VM mounts). Default: $RLFLEET_STORE; a job file's "
    "store: key wins over both.",
)
@json_flag("Print the new job as JSON.")
@click.argument("extra_args", nargs=-1, type=click.UNPROCESSED, metavar="[-- TRAIN_GRPO_ARGS…]")
@pass_cli
def submit(
    ctx: CliContext,
    spec_file: str | None,
    recipe: str | None,
    model: str | None,
    dataset: str | None,
    reward_functions: tuple[str, ...],
    gpus: int,
    nodes: int,
    max_retries: int,
    hang_timeout: int,
    startup_timeout: int,
    priority: int,
    name: str | None,
    vllm_server_gpus: int | None,
    vllm_server_own_vm: bool,
    output_dir: str | None,
    env: tuple[str, ...],
    workdir: str | None,
    store: str | None,
    as_json: bool,
    extra_args: tuple[str, ...],
) -> None:
    """Queue a GRPO training job and print its id.

    Everything after `--` is passed to train_grpo.py verbatim, except the flags rlfleet
    sets itself (--model, --dataset, --reward_function, --output_dir, --resume): those are
    refused with the option to use instead. A job starts with a clean environment (PATH,
    HOME, USER, LANG…, its RLFLEET_* variables, CUDA_VISIBLE_DEVICES), plus the VM's
    ~/.rlfleet/env and its own --env values.
    """
    from scheduler.cli.jobfile import (
        parse_env_options,
        spec_from_file,
        spec_from_flags,
        with_workdir,
    )

    if spec_file is not None and recipe is not None:
        raise BadInput("--config: give the recipe's keys under train: in the job file, not both")
    if spec_file is not None:
        spec = spec_from_file(spec_file, parse_env_options(env))
    else:
        spec = spec_from_flags(
            recipe,
            env,
            vllm_server_gpus,
            vllm_server_own_vm,
            model=model,
            dataset=dataset,
            reward_functions=reward_functions,
            gpus=gpus,
            nodes=nodes,
            max_retries=max_retries,
            hang_timeout_s=hang_timeout,
            startup_timeout_s=startup_timeout,
            priority=priority,
            name=name,
            extra_args=extra_args,
            output_dir=output_dir,
        )
        if workdir is not None:
            spec.validate()  # a bad flag is named before the workdir is read
            spec = with_workdir(spec, workdir, "--workdir")
    spec = _with_store(spec, store)
    spec.validate()
    from scheduler.submit import submit_job

    result = ctx.run_sql(lambda db: submit_job(db, ctx.settings, spec, actor="cli"), nats=True)
    if result.warning:
        warn(result.warning)
    if as_json:
        echo_json({"id": result.job_id, "published": result.publish_error is None})
    else:
        click.echo(result.job_id)
    if result.publish_error:
        raise ServiceUnavailable(
            f"job {result.job_id} is queued but not announced ({result.publish_error}); "
            "the requeue manager will publish it"
        )


def _with_store(spec: Any, flag: str | None) -> Any:
    """The job with its store: the job file's `store:`, else `--store`, else
    $RLFLEET_STORE (an empty one is none), each checked (exit 2, one line)."""
    import dataclasses
    import os

    from scheduler.store import STORE_ENV, parse_store_url

    chosen = spec.store or flag
    if chosen is None and spec.roles is None:  # a job group has no store: no default
        chosen = os.environ.get(STORE_ENV) or None
    if chosen is None:
        return spec
    try:
        url = str(parse_store_url(chosen))
    except ValueError as exc:
        where = "" if (spec.store or flag) else f" (from ${STORE_ENV})"
        raise BadInput(f"{exc}{where}") from None
    return dataclasses.replace(spec, store=url)


@group.command("list")
@click.option(
    "--status",
    type=click.Choice([s.value for s in JobStatus]),
    help="Only jobs in this state.",
)
@click.option(
    "--limit",
    default=100,
    show_default=True,
    type=ColumnInt(lo=1, bounds=INT8),
    help="Show at most this many jobs.",
)
@json_option
@pass_cli
def list_(ctx: CliContext, status: str | None, limit: int, as_json: bool) -> None:
    """List jobs, newest first."""

    async def go(db: PgDatabase) -> list[dict[str, Any]]:
        async with db.sql_transaction() as tx:
            wanted = JobStatus(status) if status else None
            return await list_jobs(tx, status=wanted, limit=limit)

    jobs = ctx.run_sql(go)
    if as_json:
        echo_json(jobs)
        return
    rows = [
        (
            j["id"],
            j["name"] or "",
            j["status"],
            gpus_text(j),
            j["vm"] or "",
            ",".join(map(str, j["gpu_indices"] or [])),
            f"{j['retry_count']}/{j['max_retries']}",
            fmt_time(j["submitted_at"]),
            j["failure_reason"] or j["status_reason"] or "",
        )
        for j in jobs
    ]
    echo_table(["ID", "NAME", "STATUS", "GPUS", "VM", "ON", "RETRIES", "SUBMITTED", "REASON"], rows)


@group.command("show")
@job_id_argument
@click.option("--no-progress", is_flag=True, help="Do not ask the VM for the training progress.")
@json_option
@pass_cli
def show(ctx: CliContext, job_id: int, no_progress: bool, as_json: bool) -> None:
    """Show a job: where it runs, why it is in its state, its training progress (read from
    the VM, a few seconds at most) and its event history."""
    from scheduler.control import job_details
    from scheduler.transport import make_transport

    async def go(db: Database) -> dict[str, Any]:
        if no_progress:
            return await job_details(db, job_id)
        transport = make_transport()
        try:
            return await job_details(db, job_id, transport)
        finally:
            await transport.close()

    job = ctx.run(go)
    if as_json:
        echo_json(job)
        return
    for key, value in job.items():
        if key not in ("events", "events_older", "progress", "progress_error", "ranks", "roles",
                       "store_status"):  # fmt: skip
            click.echo(f"{key + ':':18}{'-' if value in (None, []) else printable(value)}")
    for key, line in store_lines(job):
        click.echo(f"{key + ':':18}{printable(line)}")
    progress = job["progress"]
    if isinstance(progress, dict):
        click.echo(f"{'progress:':18}{printable(progress_line(progress))}")
    elif job["progress_error"] and job["progress_error"] != "not started":
        click.echo(f"{'progress:':18}unavailable ({printable(job['progress_error'])})")
    if job["nodes"] > 1:
        click.echo("\nnodes:")
        echo_table(
            ["RANK", "VM", "GPUS", "UUIDS", "PID", "STATE", "EXIT"],
            [
                (
                    r["rank"],
                    r["vm"] or "-",
                    ",".join(str(i) for i in r["gpu_indices"] or ()) or "-",
                    ",".join(r["gpu_uuids"] or ()) or "-",
                    "-" if r["pid"] is None else r["pid"],
                    r["state"],
                    "-" if r["exit_code"] is None else r["exit_code"],
                )
                for r in job["ranks"]
            ],
        )
    if job.get("roles"):
        click.echo("\nroles:")
        echo_table(
            ["ROLE", "RANK", "PRIMARY", "VM", "GPUS", "PORTS", "PID", "STATE", "EXIT", "RESTARTS"],
            [
                (
                    r["name"],
                    r.get("rank", 0),
                    "yes" if r["primary"] else "no",
                    r["vm"] or "-",
                    ",".join(str(i) for i in r["gpu_indices"]) or "-",
                    ",".join(f"{k}={v if v is not None else '-'}" for k, v in r["ports"].items())
                    or "-",
                    r["pid"] or "-",
                    r["state"],
                    "-" if r["exit_code"] is None else r["exit_code"],
                    restarts_cell(r),
                )
                for r in job["roles"]
            ],
        )
    click.echo("\nevents:")
    echo_table(
        ["AT", "FROM", "TO", "ATTEMPT", "ACTOR", "REASON"],
        [
            (fmt_time(e["at"]), e["from"] or "", e["to"], e["attempt"], e["actor"], event_reason(e))
            for e in job["events"]
        ],
    )


@group.command("cancel")
@job_id_argument
@click.option(
    "--grace",
    default=CANCEL_GRACE_S,
    show_default=True,
    type=Seconds(),
    help="Seconds between TERM and KILL for a running job.",
)
@pass_cli
def cancel(ctx: CliContext, job_id: int, grace: float) -> None:
    """Cancel a job; a running one is killed on its VM (TERM, then KILL) and its GPUs freed."""
    from scheduler.control import CancelResult, cancel_job
    from scheduler.transport import make_transport

    async def go(db: Database) -> object:
        transport = make_transport()
        try:
            return await cancel_job(db, transport, job_id, grace_s=grace)
        finally:
            await transport.close()

    result = ctx.run(go)
    assert isinstance(result, CancelResult)
    if result.kill is None:
        click.echo(f"job {job_id} cancelled")
    elif result.dead:
        click.echo(f"job {job_id} cancelled ({_KILL_WORDS.get(result.kill, result.kill)})")
    else:
        click.echo(f"job {job_id} cancelled")
        warn(
            f"could not make sure it stopped on its VM ({result.kill}); its GPUs stay blocked "
            "until the requeue manager has killed it"
        )


_KILL_WORDS = {
    "terminated": "process terminated",
    "killed": "process killed",
    "gone": "process had already ended",
    "fenced": "stopped before it started",
}
# Any other outcome (`nopid`, `missing`, `unreachable: …`) leaves the attempt's fate unknown.


@group.command("retry")
@job_id_argument
@pass_cli
def retry(ctx: CliContext, job_id: int) -> None:
    """Queue a failed job again now (a manual retry)."""
    from scheduler.control import retry_job

    published = ctx.run(lambda db: retry_job(db, ctx.settings, job_id), nats=True)
    click.echo(f"job {job_id} queued")
    if not published:
        raise ServiceUnavailable(
            f"job {job_id} is queued but not announced (NATS unreachable); "
            "the requeue manager will publish it"
        )


@group.command("logs")
@job_id_argument
@click.option("--follow", "-f", is_flag=True, help="Keep printing until the job ends.")
@click.option(
    "--attempt",
    type=ColumnInt(lo=1, bounds=INT4),
    help="Which attempt's log (default: the latest).",
)
@click.option(
    "--node",
    default=0,
    show_default=True,
    type=ColumnInt(lo=0, hi=MAX_NODES - 1, bounds=INT4),
    help="Which rank of a multi-node job (with --role: of that role): its log is read on "
    "its own VM.",
)
@click.option(
    "--role",
    help="Which role of a job group: its own <role>.log (default: the group's train.log, "
    "where its supervisor says what each role did).",
)
@click.option(
    "--diagnostics",
    is_flag=True,
    help="Print what was captured of an attempt stopped as hung or stuck starting (each "
    "process's Python stacks, nvidia-smi, the end of its log): the newest such attempt's, "
    "or --attempt N's.",
)
@pass_cli
def logs(
    ctx: CliContext,
    job_id: int,
    follow: bool,
    attempt: int | None,
    node: int,
    role: str | None,
    diagnostics: bool,
) -> None:
    """Print a job's train.log from its VM (every attempt's log is kept); for a multi-node
    job, rank 0's unless --node says another; for a job group, one role's with --role;
    with --diagnostics, what was captured of an attempt stopped as hung."""
    from scheduler.job_logs import stream_log
    from scheduler.transport import make_transport

    if diagnostics:
        if follow or role is not None or node:
            raise BadInput("--diagnostics: only with --attempt (not --follow, --role, --node)")

        async def show(db: Database) -> None:
            from scheduler.job_logs import read_diagnostics

            found = await read_diagnostics(db, job_id, attempt)
            click.echo(printable(found.header()))
            click.echo(found.content.rstrip("\n"))

        ctx.run(show)
        return

    def write(data: bytes) -> None:
        # The bytes as the job wrote them: a log is not always valid UTF-8.
        sys.stdout.buffer.write(data)
        sys.stdout.buffer.flush()

    async def go(db: Database) -> None:
        transport = make_transport()
        try:
            await stream_log(
                db, transport, job_id, write, attempt=attempt, follow=follow, node=node, role=role
            )
        finally:
            await transport.close()

    ctx.run(go)


# `job pull` lives in a module of its own (its progress bar, its sizes).
group.add_command(pull)
