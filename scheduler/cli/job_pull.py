"""`rlfleet job pull`: a job's final model (or a checkpoint) brought to this machine, with
a progress bar on a terminal (the work is `scheduler.pull`, imported when it runs)."""

from __future__ import annotations

import sys
from typing import TYPE_CHECKING, Any

import click

from scheduler.cli._common import (
    ByteSize,
    CliContext,
    ColumnInt,
    JobId,
    echo_json,
    json_flag,
    pass_cli,
)
from scheduler.validate import INT4

if TYPE_CHECKING:
    from scheduler.db import Database


@click.command("pull")
@click.argument("job_id", type=JobId())
@click.argument("dest", required=False, type=click.Path(file_okay=False))
@click.option(
    "--checkpoint",
    type=ColumnInt(lo=0, bounds=INT4),
    help="Pull checkpoint-N instead of the final model.",
)
@click.option(
    "--max-size",
    type=ByteSize(),
    default="200G",
    show_default=True,
    help="Refuse, leaving nothing, a pull of more bytes than this (500M, 10G, 2T: binary "
    "units; 500MB: decimal; or bytes).",
)
@json_flag("Print what was pulled as JSON.")
@pass_cli
def pull(
    ctx: CliContext,
    job_id: int,
    dest: str | None,
    checkpoint: int | None,
    max_size: int,
    as_json: bool,
):
    """Download a job's final model and tokenizer (or --checkpoint N) into DEST (default
    ./job-ID, or ./job-ID-checkpoint-N; it must not exist or be empty): from the job's
    store with this machine's AWS configuration, or without a store over SSH from the VM
    that ran its last attempt. A progress bar goes to stderr on a terminal. Only regular
    files and directories come: links, devices and odd names are left out and counted
    (named with --json)."""
    from pathlib import Path

    from scheduler.pull import PullProgress, check_dest, pull_job
    from scheduler.transport import make_transport

    default = f"job-{job_id}" + (f"-checkpoint-{checkpoint}" if checkpoint is not None else "")
    target = Path(dest or default)
    check_dest(target)
    bar = ProgressBar(f"job {job_id}") if sys.stderr.isatty() and not as_json else None
    progress = PullProgress(on_change=bar.show if bar else None)

    async def go(db: Database) -> dict[str, Any]:
        transport = make_transport()
        try:
            return await pull_job(
                db, transport, job_id, target, checkpoint=checkpoint, progress=progress,
                max_size=max_size,
            )  # fmt: skip
        finally:
            await transport.close()

    try:
        result = ctx.run(go)
    finally:
        if bar is not None:
            bar.close()
    if as_json:
        echo_json(result)
    else:
        click.echo(f"{result['what']} of job {job_id} from {result['from']} in {result['dest']}"
                   f" ({size_text(result['bytes'])})")  # fmt: skip
        if result.get("skipped"):
            click.echo(f"left out: {result['skipped']} entries that are not regular files or"
                       " directories with plain names (--json names them)")  # fmt: skip


def size_text(count: int) -> str:
    """`12.3 MB`."""
    value = float(count)
    for unit in ("B", "KB", "MB", "GB"):
        if value < 1000 or unit == "GB":
            return f"{value:.0f} {unit}" if unit == "B" else f"{value:.1f} {unit}"
        value /= 1000
    return f"{value:.1f} TB"  # pragma: no cover


class ProgressBar:
    """One line on stderr, redrawn at most ten times a second."""

    def __init__(self, label: str) -> None:
        self.label = label
        self.last = 0.0

    def show(self, progress: Any) -> None:
        import time

        now = time.monotonic()
        if now - self.last < 0.1:
            return
        self.last = now
        done, total = progress.done, progress.total
        if total:
            width = 30
            filled = min(width, int(width * done / total))
            text = f"{'#' * filled}{'.' * (width - filled)} {size_text(done)} / {size_text(total)}"
        else:
            text = size_text(done)
        sys.stderr.write(f"\r{self.label}: {text}\x1b[K")
        sys.stderr.flush()

    def close(self) -> None:
        sys.stderr.write("\r\x1b[K")
        sys.stderr.flush()
