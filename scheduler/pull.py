"""`rlfleet job pull`: a job's final outputs (or one checkpoint) brought to this machine,
from its store (the store's own client here, with this machine's AWS configuration) or,
for a job without one, over SSH from the VM that ran its last attempt.

From a store, only what the job's own attempts reported writing is taken
(`scheduler.store_records`): a final marker or checkpoint of another's in its place is
refused, with a line naming the job and what did not match."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from scheduler import fresh_tree
from scheduler.control import place_of
from scheduler.db import Database, installation_id
from scheduler.errors import BadInput, RlfleetError, ServiceUnavailable
from scheduler.fresh_tree import shown as one_line
from scheduler.jobs import get_job
from scheduler.remote.layout import default_output_dir
from scheduler.remote.pull import tar_command
from scheduler.store_records import accepted
from scheduler.transport import Transport, TransportError
from scheduler.untar import DEFAULT_MAX_SIZE, ExtractError, TarSink

PULL_TIMEOUT_S = 6 * 3600.0
"""A pull over SSH may take this long at most (a big model on a slow link)."""


@dataclass
class PullProgress:
    """What the progress bar shows: bytes so far, of `total` when known."""

    done: int = 0
    total: int | None = None
    skipped: int = 0
    """Entries left out (a link, a device, a name that is not plain: `scheduler.untar`)."""
    skipped_names: list[str] = field(default_factory=list)
    """The first of them, by name."""
    on_change: Callable[[PullProgress], None] | None = None

    def add(self, count: int) -> None:
        self.done += count
        if self.on_change is not None:
            self.on_change(self)

    def size(self, total: int) -> None:
        self.total = total
        if self.on_change is not None:
            self.on_change(self)


def check_dest(dest: Path) -> None:
    """A destination that exists must be an empty directory, not a link (nothing is
    overwritten; the pull is renamed into its place once whole)."""
    try:
        fresh_tree.check_dest(dest)
    except fresh_tree.TreeError as exc:
        raise BadInput(str(exc)) from None


async def pull_job(
    db: Database,
    transport: Transport,
    job_id: int,
    dest: Path,
    *,
    checkpoint: int | None = None,
    progress: PullProgress | None = None,
    max_size: int = DEFAULT_MAX_SIZE,
) -> dict[str, Any]:
    """Download the job's outputs into `dest`; what was fetched, from where. At most
    `max_size` bytes come; a pull that fails leaves nothing in `dest`'s place."""
    progress = progress or PullProgress()
    check_dest(dest)
    async with db.transaction() as session:
        job = await get_job(session, job_id)
        installation = await installation_id(session)
        place = place_of(job, installation)
        store, status = job.store, job.status
        output_dir = job.output_dir or default_output_dir(installation, job_id)
        reported = await accepted(session, job_id) if store is not None else None
    if checkpoint is None and status != "completed" and store is None:
        raise ServiceUnavailable(
            f"job {job_id} is {status}: it has no final model yet (--checkpoint N takes a "
            "checkpoint)"
        )
    if store is not None:
        assert reported is not None
        digests = reported.final if checkpoint is None else reported.checkpoints.get(checkpoint)
        source = await asyncio.to_thread(
            _from_store, store, installation, job_id, dest, checkpoint, progress, max_size,
            digests or frozenset(),
        )  # fmt: skip
        what = "final" if checkpoint is None else f"checkpoint-{int(checkpoint)}"
        return {"job": job_id, "from": source, "what": what, "dest": str(dest),
                "bytes": progress.done}  # fmt: skip
    if place.target is None:
        raise ServiceUnavailable(f"job {job_id} never ran on a VM: nothing to pull")
    await _from_vm(transport, place.target, output_dir, checkpoint, dest, progress, max_size)
    what = "final" if checkpoint is None else f"checkpoint-{int(checkpoint)}"
    return {"job": job_id, "from": f"{place.target.name}:{output_dir}", "what": what,
            "dest": str(dest), "bytes": progress.done, "skipped": progress.skipped,
            "skipped_names": progress.skipped_names}  # fmt: skip


def _from_store(
    store: str,
    installation: str,
    job_id: int,
    dest: Path,
    checkpoint: int | None,
    progress: PullProgress,
    max_size: int = DEFAULT_MAX_SIZE,
    accepted_digests: frozenset[str] = frozenset(),
) -> str:
    from scheduler.store import parse_store_url
    from scheduler.store.backend import StoreError, open_backend
    from scheduler.store.binding import NotReported
    from scheduler.store.sync import pull

    try:
        url = parse_store_url(store)
        backend = open_backend(url, installation, job_id)
        pull(backend, dest, checkpoint, progress.add, progress.size, max_size=max_size,
             accepted_digests=accepted_digests)  # fmt: skip
    except ValueError as exc:
        raise ServiceUnavailable(f"job {job_id}: stored store URL unusable: {exc}") from None
    except NotReported as exc:
        raise RlfleetError(f"job {job_id}: {exc}: not pulled") from None
    except StoreError as exc:
        raise ServiceUnavailable(f"{store}: {exc}") from None
    return str(url)


async def _from_vm(
    transport: Transport,
    target: Any,
    output_dir: str,
    checkpoint: int | None,
    dest: Path,
    progress: PullProgress,
    max_size: int = DEFAULT_MAX_SIZE,
) -> None:
    """The VM's tar stream, extracted as it comes by `scheduler.untar` (which trusts
    nothing in it: the job may have chosen what ran as `tar`)."""
    try:
        out = TarSink(dest, max_size=max_size)
    except ExtractError as exc:
        raise BadInput(str(exc)) from None

    def sink(chunk: bytes) -> None:
        out.feed(chunk)
        progress.add(len(chunk))

    try:
        try:
            rc, err = await transport.stream(  # type: ignore[attr-defined]
                target, tar_command(output_dir, checkpoint), sink, timeout=PULL_TIMEOUT_S
            )
        except TransportError as exc:
            raise ServiceUnavailable(str(exc)) from None
        if rc != 0:
            why = (err.strip().splitlines() or [f"exit {rc}"])[-1][:300]
            where = output_dir if checkpoint is None else f"{output_dir}/checkpoint-{checkpoint}"
            raise ServiceUnavailable(f"{target.name}:{where}: {one_line(why)}")
        out.finish()
    except ExtractError as exc:
        out.abort()
        raise ServiceUnavailable(f"{target.name}: {exc}") from None
    except BaseException:
        out.abort()
        raise
    progress.skipped, progress.skipped_names = out.skipped_count, out.skipped
