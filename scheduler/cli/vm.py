"""`rlfleet vm …`: register and manage the machines jobs run on."""

from __future__ import annotations

from typing import Any

import click

from scheduler import fleet
from scheduler.cli._common import (
    CliContext,
    ColumnInt,
    ColumnText,
    echo_json,
    echo_table,
    fmt_time,
    json_option,
    pass_cli,
    printable,
    warn,
)
from scheduler.db import Database
from scheduler.errors import BadInput
from scheduler.models import DEFAULT_ENTRYPOINT, GPU, VM

vm_name_argument = click.argument("name", type=ColumnText(VM.name))
"""The NAME argument of the commands about one VM."""
job_user_option = click.option(
    "--job-user",
    help="Run this VM's jobs as this Unix account, started through sudo by the SSH login "
    "(deploy/bootstrap-vm.sh --job-user sets it up; docs/security.md).",
)
"""`--job-user` of `vm add` and `vm set`: checked by `fleet.check_job_user_input`."""


@click.group("vm")
def group() -> None:
    """Register, inspect, drain and remove VMs."""


@group.command("add")
@vm_name_argument
@click.option(
    "--host",
    required=True,
    type=ColumnText(VM.host, empty_ok=True),
    help="Hostname or IP address to SSH to.",
)
@click.option(
    "--port",
    default=22,
    show_default=True,
    type=ColumnInt(VM.port, lo=1, hi=65535),
    help="SSH port.",
)
@click.option(
    "--user", type=ColumnText(VM.user), help="SSH login (default: the user running the daemons)."
)
@click.option(
    "--ssh-key",
    type=click.Path(exists=True, dir_okay=False, resolve_path=True),
    help="Private key file to log in with.",
)
@click.option(
    "--known-hosts",
    type=click.Path(exists=True, dir_okay=False, resolve_path=True),
    help="known_hosts file to verify the host key with (default ~/.ssh/known_hosts).",
)
@click.option(
    "--insecure-no-host-key-check",
    is_flag=True,
    help="DANGEROUS: accept any host key for this VM (man-in-the-middle risk).",
)
@click.option(
    "--transport",
    type=click.Choice(["ssh", "local"]),
    default="ssh",
    show_default=True,
    help="`local` runs commands on this machine without SSH.",
)
@click.option(
    "--python",
    default="python3",
    show_default=True,
    type=ColumnText(VM.python),
    help="Python of the environment with rlfleet[train] on the VM.",
)
@click.option(
    "--entrypoint",
    default=DEFAULT_ENTRYPOINT,
    show_default=True,
    type=ColumnText(VM.entrypoint),
    help="Module (run with -m) or .py script that trains.",
)
@click.option(
    "--internal-address",
    type=ColumnText(VM.internal_address),
    help="Address the other nodes of a multi-node job reach this VM at (training traffic), "
    "when it differs from --host (default: --host).",
)
@job_user_option
@json_option
@pass_cli
def add(
    ctx: CliContext,
    name: str,
    host: str,
    port: int,
    user: str | None,
    ssh_key: str | None,
    known_hosts: str | None,
    insecure_no_host_key_check: bool,
    transport: str,
    python: str,
    entrypoint: str,
    internal_address: str | None,
    job_user: str | None,
    as_json: bool,
) -> None:
    """Register VM NAME, reachable at --host. The poller finds its GPUs."""
    spec = fleet.VMSpec(
        name=name,
        host=host,
        port=port,
        user=user,
        ssh_key_path=ssh_key,
        known_hosts=known_hosts,
        verify_host_key=not insecure_no_host_key_check,
        transport=transport,
        python=python,
        entrypoint=entrypoint,
        internal_address=internal_address,
        job_user=job_user,
    )
    spec.validate()
    if insecure_no_host_key_check:
        warn(f"host key checking is OFF for VM {name!r}: anyone on the path can impersonate it")

    async def go(db: Database) -> dict[str, Any]:
        async with db.transaction() as session:
            vm = await fleet.add_vm(session, spec)
            return fleet.vm_to_dict(vm, gpus=False)

    data = ctx.run(go)
    if as_json:
        echo_json(data)
    else:
        click.echo(f"added VM {name} ({host}:{port}); the poller will discover its GPUs")


@group.command("set")
@vm_name_argument
@job_user_option
@click.option(
    "--no-job-user",
    is_flag=True,
    help="Run the VM's jobs as its SSH login again (one trust domain with the scheduler).",
)
@json_option
@pass_cli
def set_(
    ctx: CliContext, name: str, job_user: str | None, no_job_user: bool, as_json: bool
) -> None:
    """Change VM NAME without removing it. Its job user changes only while no job runs
    there: drain it first."""
    if job_user is not None and no_job_user:
        raise BadInput("give --job-user NAME or --no-job-user, not both")
    if job_user is None and not no_job_user:
        raise BadInput("nothing to change: give --job-user NAME or --no-job-user")
    if job_user is not None:
        fleet.check_job_user_input(job_user)

    async def go(db: Database) -> dict[str, Any]:
        async with db.transaction() as session:
            vm = await fleet.set_job_user(session, name, job_user)
            return fleet.vm_to_dict(vm, gpus=False)

    data = ctx.run(go)
    if as_json:
        echo_json(data)
    else:
        click.echo(f"VM {name}: jobs run as {job_user or 'its SSH login'}")


@group.command("list")
@json_option
@pass_cli
def list_(ctx: CliContext, as_json: bool) -> None:
    """List VMs with their state and free GPUs."""

    async def go(db: Database) -> list[dict[str, Any]]:
        async with db.transaction() as session:
            return [fleet.vm_to_dict(vm) for vm in await fleet.list_vms(session)]

    vms = ctx.run(go)
    if as_json:
        echo_json(vms)
        return
    rows = [
        (
            vm["name"],
            f"{vm['host']}:{vm['port']}",
            vm["status"]
            + ("+removing" if vm["removing"] else "+draining" if vm["draining"] else ""),
            f"{vm['available_gpus']}/{len(vm['gpus'])}",
            fmt_time(vm["last_polled_at"]),
            vm["last_error"] or "",
        )
        for vm in vms
    ]
    echo_table(["NAME", "ADDRESS", "STATUS", "FREE/GPUS", "LAST POLL", "LAST ERROR"], rows)


@group.command("show")
@vm_name_argument
@json_option
@pass_cli
def show(ctx: CliContext, name: str, as_json: bool) -> None:
    """Show one VM (its state, and `process_tracking`: how it stops all an attempt
    started, a cgroup v2 per attempt or the environment marker) and each of its GPUs."""

    async def go(db: Database) -> dict[str, Any]:
        async with db.transaction() as session:
            row = await fleet.get_vm(session, name, with_gpus=True)
            data = fleet.vm_to_dict(row)
            data["gpu_events"] = await fleet.gpu_events(session, row.id)
            return data

    vm = ctx.run(go)
    if as_json:
        echo_json(vm)
        return
    for key, value in vm.items():
        if key not in ("gpus", "gpu_events"):
            click.echo(f"{key + ':':22}{'-' if value is None else printable(value)}")
    rows = [
        (
            g["index"],
            g["name"],
            f"{g['memory_used_mb']}/{g['memory_total_mb']} MiB",
            g["utilization_pct"],
            "yes" if g["healthy"] else "NO",
            _gpu_use(g),
            printable(g["health_reason"] or ""),
        )
        for g in vm["gpus"]
    ]
    if rows:
        click.echo("")
        echo_table(["GPU", "NAME", "MEMORY", "UTIL%", "HEALTHY", "USE", "HEALTH REASON"], rows)
    events = [
        (fmt_time(e["at"]), e["gpu_index"], e["kind"], printable(e["reason"]), e["actor"])
        for e in vm["gpu_events"]
    ]
    if events:
        click.echo("")
        echo_table(["GPU EVENT AT", "GPU", "KIND", "REASON", "BY"], events)


def _gpu_use(gpu: dict[str, Any]) -> str:
    """What the GPU is used for, for `vm show`."""
    use = (
        "foreign" if gpu["foreign_busy"] else (f"job {gpu['job_id']}" if gpu["job_id"] else "free")
    )
    return use + ("+drained" if gpu["drained"] else "")


@group.command("remove")
@vm_name_argument
@click.option(
    "--force",
    is_flag=True,
    help="Remove even while jobs run there: they fail as vm_removed (retried elsewhere) "
    "and their processes are killed when the VM answers.",
)
@pass_cli
def remove(ctx: CliContext, name: str, force: bool) -> None:
    """Forget VM NAME.

    Refused while jobs run there or processes of earlier attempts are still to be killed,
    unless --force: then its jobs fail as vm_removed and are retried elsewhere without
    using up a retry, and the VM is deleted once their processes are killed (the requeue
    manager does it when the VM answers). --force on a VM already being removed deletes
    it at once, giving up on those processes."""

    async def go(db: Database) -> fleet.Removal:
        async with db.transaction() as session:
            return await fleet.remove_vm(session, name, force=force)

    done = ctx.run(go)
    if done.outcome == "removed":
        gave_up = f" (gave up on killing {done.leftovers} process(es) there)"
        click.echo(f"removed VM {name}" + (gave_up if done.leftovers else ""))
        return
    jobs = ", ".join(map(str, done.failed_jobs)) or "none"
    click.echo(
        f"removing VM {name}: failed job(s) {jobs} as vm_removed (retried elsewhere); "
        f"it is deleted once their processes are killed "
        f"(`rlfleet vm remove {name} --force` again deletes it now)"
    )


def _set_draining(ctx: CliContext, name: str, draining: bool) -> None:
    async def go(db: Database) -> None:
        async with db.transaction() as session:
            await fleet.set_draining(session, name, draining)

    ctx.run(go)


def _set_gpu_draining(ctx: CliContext, name: str, which: str, draining: bool) -> str:
    async def go(db: Database) -> str:
        async with db.transaction() as session:
            gpu = await fleet.set_gpu_draining(session, name, which, draining)
            return f"GPU {gpu.index} ({gpu.uuid})"

    return ctx.run(go)


gpu_option = click.option(
    "--gpu",
    "gpu",
    metavar="UUID|INDEX",
    type=ColumnText(GPU.uuid),
    help="Only this GPU of the VM: its UUID (or a prefix of 8 characters or more) or "
    "nvidia-smi's index.",
)


@group.command("drain")
@vm_name_argument
@gpu_option
@pass_cli
def drain(ctx: CliContext, name: str, gpu: str | None) -> None:
    """Let VM NAME (or one of its GPUs) finish its jobs but give it no new ones."""
    if gpu is not None:
        what = _set_gpu_draining(ctx, name, gpu, True)
        click.echo(f"{what} of VM {name} is drained: a job on it continues, no new job starts")
        return
    _set_draining(ctx, name, True)
    click.echo(f"VM {name} is draining: running jobs continue, no new jobs start there")


@group.command("undrain")
@vm_name_argument
@gpu_option
@pass_cli
def undrain(ctx: CliContext, name: str, gpu: str | None) -> None:
    """Let VM NAME (or one of its GPUs) take new jobs again."""
    if gpu is not None:
        what = _set_gpu_draining(ctx, name, gpu, False)
        click.echo(f"{what} of VM {name} takes new jobs again (when healthy)")
        return
    _set_draining(ctx, name, False)
    click.echo(f"VM {name} takes new jobs again")
