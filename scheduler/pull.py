"""`rlfleet job pull`: a job's final outputs (or one checkpoint) brought to this machine,
from its store (the store's own client here, with this machine's AWS configuration) or,
for a job without one, over SSH from the VM that ran its last attempt.

From a store, only what the job's own attempts reported writing is taken
(`scheduler.store_records`): a final marker or checkpoint of another's in its place is
refused, with a line naming the job and what did not match."""

from __future__ import annotations

import asyncio
import os
import tarfile
import tempfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from scheduler.control import place_of
from scheduler.db import Database, installation_id
from scheduler.errors import BadInput, RlfleetError, ServiceUnavailable
from scheduler.jobs import get_job
from scheduler.remote.layout import default_output_dir
from scheduler.remote.pull import tar_command
from scheduler.store_records import accepted
from scheduler.transport import Transport, TransportError

PULL_TIMEOUT_S = 6 * 3600.0
"""A pull over SSH may take this long at most (a big model on a slow link)."""


@dataclass
class PullProgress:
    """What the progress bar shows: bytes so far, of `total` when known."""

    done: int = 0
    total: int | None = None
    skipped: int = 0
    """Entries left out (a link pointing outside the destination, a device)."""
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
    """A destination that exists must be an empty directory (nothing is overwritten)."""
    if dest.exists() and (not dest.is_dir() or any(dest.iterdir())):
        raise BadInput(f"{dest}: exists and is not an empty directory")


async def pull_job(
    db: Database,
    transport: Transport,
    job_id: int,
    dest: Path,
    *,
    checkpoint: int | None = None,
    progress: PullProgress | None = None,
) -> dict[str, Any]:
    """Download the job's outputs into `dest`; what was fetched, from where."""
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
            _from_store, store, installation, job_id, dest, checkpoint, progress,
            digests or frozenset(),
        )  # fmt: skip
        what = "final" if checkpoint is None else f"checkpoint-{int(checkpoint)}"
        return {"job": job_id, "from": source, "what": what, "dest": str(dest),
                "bytes": progress.done}  # fmt: skip
    if place.target is None:
        raise ServiceUnavailable(f"job {job_id} never ran on a VM: nothing to pull")
    await _from_vm(transport, place.target, output_dir, checkpoint, dest, progress)
    what = "final" if checkpoint is None else f"checkpoint-{int(checkpoint)}"
    return {"job": job_id, "from": f"{place.target.name}:{output_dir}", "what": what,
            "dest": str(dest), "bytes": progress.done, "skipped": progress.skipped}  # fmt: skip


def _from_store(
    store: str,
    installation: str,
    job_id: int,
    dest: Path,
    checkpoint: int | None,
    progress: PullProgress,
    accepted_digests: frozenset[str] = frozenset(),
) -> str:
    from scheduler.store import parse_store_url
    from scheduler.store.backend import StoreError, open_backend
    from scheduler.store.binding import NotReported
    from scheduler.store.sync import pull

    try:
        url = parse_store_url(store)
        backend = open_backend(url, installation, job_id)
        pull(backend, dest, checkpoint, progress.add, progress.size,
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
) -> None:
    dest.parent.mkdir(parents=True, exist_ok=True)
    fd, name = tempfile.mkstemp(prefix=".rlfleet-pull-", suffix=".tar", dir=dest.parent)
    try:
        with os.fdopen(fd, "wb") as out:

            def sink(chunk: bytes) -> None:
                out.write(chunk)
                progress.add(len(chunk))

            try:
                rc, err = await transport.stream(  # type: ignore[attr-defined]
                    target, tar_command(output_dir, checkpoint), sink, timeout=PULL_TIMEOUT_S
                )
            except TransportError as exc:
                raise ServiceUnavailable(str(exc)) from None
        if rc != 0:
            why = (err.strip().splitlines() or [f"exit {rc}"])[-1][:300]
            where = output_dir if checkpoint is None else f"{output_dir}/checkpoint-{checkpoint}"
            raise ServiceUnavailable(f"{target.name}:{where}: {why}")
        dest.mkdir(parents=True, exist_ok=True)
        skipped = 0
        try:
            with tarfile.open(name) as tar:
                for member in tar:
                    # The data filter refuses absolute paths, `..`, links out of dest and
                    # devices: such an entry is left out, the rest comes.
                    try:
                        tar.extract(member, dest, filter="data")
                    except tarfile.FilterError:
                        skipped += 1
        except (tarfile.TarError, OSError) as exc:
            raise ServiceUnavailable(f"{target.name}: unreadable archive: {exc}") from None
        progress.skipped = skipped
    finally:
        Path(name).unlink(missing_ok=True)
