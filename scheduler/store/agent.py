"""The VM side of a job's store, run by an attempt's `launch.sh` with the VM's python
(`python -m scheduler.store.agent COMMAND …`), never inside the training process:

- `restore` (before training): exit 0 once the store's newest complete checkpoint is in
  the output directory (or the store has none), `FINAL_FOUND_EXIT` when the job's final
  marker is already there (an earlier attempt finished: nothing to train),
  `STORE_ERROR_EXIT` when the store is unreachable or refuses. Only a marker or a
  checkpoint whose manifest digest is one of the `--accept` values (what the job's own
  attempts reported, from Postgres through the launch; `scheduler.store.binding`) counts:
  anything else in the job's place is passed over, and said so in the log.
- `watch` (beside training, in the background): uploads each complete checkpoint soon
  after it stops changing (a scan every `--interval` seconds; a checkpoint is taken once
  two scans `--settle` seconds apart see the same files), then keeps the newest
  `KEEP_CHECKPOINTS`. A failed upload is retried with backoff and shown in the status
  file; it never stops training. The training process is never slowed by it beyond
  the disk and network it shares.
- `finish` (after training): uploads what `watch` had not yet, and with `--final` the
  final outputs and marker. If that fails: `STORE_ERROR_EXIT` when the store does not
  answer (an outage, not the job's doing), `FINAL_REFUSED_EXIT` when it answers (it
  refused, or a file of the job's could not be read): a failure of the job's.

Each writes the attempt's status file (`--status`, JSON, a few hundred bytes, written
whole and renamed) that the poller reads: the checkpoints in the store (step, bytes, time,
and the digest of each manifest this attempt wrote), the final marker's digest once this
attempt wrote it, and the last error. Credentials come from the VM's AWS configuration
only.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import threading
import time
from pathlib import Path
from typing import Any

from scheduler.redact import scrub_urls
from scheduler.store import parse_store_url
from scheduler.store.backend import Backend, StoreError, open_backend
from scheduler.store.binding import Accepted
from scheduler.store.sync import (
    final_digest,
    local_steps,
    manifest_steps,
    prune,
    read_manifest,
    restore_newest,
    snapshot,
    stored_checkpoints,
    upload_checkpoint,
    upload_final,
)

FINAL_FOUND_EXIT = 3
STORE_ERROR_EXIT = 74
"""Exit status of `restore`/`finish` when the store cannot be used (EX_IOERR)."""
FINAL_REFUSED_EXIT = 73
"""Exit status of `finish --final` when the final upload failed on a store that answers
(EX_CANTCREAT): the attempt fails, counted."""
STATUS_ENTRIES = 6
"""At most this many checkpoints are listed in the status file (the newest)."""


class Status:
    """The attempt's status file, rewritten whole on every change."""

    def __init__(self, path: Path | None, url: str) -> None:
        self.path = path
        self.data: dict[str, Any] = {
            "store": url,
            "checkpoints": [],
            "restored": None,
            "final": False,
            "final_digest": None,
            "last_error": None,
            "error_at": None,
        }
        if path is not None and path.is_file():
            try:
                with path.open("rb") as f:  # a file the job can grow: read a bounded prefix
                    old = json.loads(f.read(8192))
                if isinstance(old, dict):
                    self.data.update({k: old[k] for k in self.data if k in old and k != "store"})
            except (OSError, ValueError):
                pass

    def set_checkpoints(self, stored: dict[int, dict[str, Any]]) -> None:
        self.data["checkpoints"] = [
            {"step": s, "bytes": m["bytes"], "at": m["at"]} for s, m in sorted(stored.items())
        ][-STATUS_ENTRIES:]
        self.write()

    def add_checkpoint(self, step: int, size: int, digest: str | None = None) -> None:
        entries = [c for c in self.data["checkpoints"] if c.get("step") != step]
        entries.append({"step": step, "bytes": size, "at": _now(), "digest": digest})
        self.data["checkpoints"] = sorted(entries, key=lambda c: c["step"])[-STATUS_ENTRIES:]
        self.write()

    def error(self, text: str | None) -> None:
        # No credentials of a URL (scrubbed), and printable ASCII only: the whole file,
        # digests included, stays well within what a poll reads
        # (`remote.store.STORE_STATUS_BYTES`), whatever a file name held.
        if text:
            text = "".join(c if " " <= c <= "~" else "?" for c in scrub_urls(text)[:300])
        self.data["last_error"] = text or None
        self.data["error_at"] = _now() if text else None
        self.write()

    def update(self, **values: Any) -> None:
        self.data.update(values)
        self.write()

    def write(self) -> None:
        if self.path is None:
            return
        tmp = self.path.with_name(self.path.name + ".tmp")
        try:
            tmp.write_text(json.dumps(self.data, sort_keys=True))
            os.replace(tmp, self.path)
        except OSError:
            pass


def _now() -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())


def say(text: str) -> None:
    """One line into the attempt's log (the agent's stderr is train.log)."""
    # A URL in an error may carry credentials: the log is the job's to read and ship.
    print(f"rlfleet-store: {scrub_urls(text)}", file=sys.stderr, flush=True)


def restore(backend: Backend, output_dir: Path, status: Status, accepted: Accepted) -> int:
    backend.check()
    found = final_digest(backend)
    if found is not None and found in accepted.final:
        status.update(final=True, final_digest=found)
        say("the job's final outputs are already in the store: nothing to train")
        return FINAL_FOUND_EXIT
    if found is not None:
        say("a final marker in the store is not one this job's attempts reported: ignored")
    output_dir.mkdir(parents=True, exist_ok=True)
    started = time.monotonic()
    ignored = [s for s in manifest_steps(backend) if s not in accepted.checkpoints]
    if ignored:
        steps = ", ".join(map(str, ignored[-6:]))
        say(f"checkpoints in the store that no attempt of this job reported, ignored: {steps}")
    step = restore_newest(
        backend, output_dir, accepted_digests=accepted.checkpoints, on_refused=say
    )
    stored = stored_checkpoints(backend)  # shown: the job's own only
    status.set_checkpoints({s: m for s, m in stored.items() if s in accepted.checkpoints})
    if step is None:
        say("no checkpoint of this job's in the store: training starts fresh")
    else:
        status.update(restored=step)
        say(f"restored checkpoint-{step} in {time.monotonic() - started:.1f}s")
    return 0


class Watcher:
    """Uploads each complete checkpoint once its files stop changing."""

    def __init__(
        self,
        backend: Backend,
        output_dir: Path,
        status: Status,
        settle_s: float,
        accepted: Accepted | None = None,
    ):
        self.backend = backend
        self.accepted = accepted or Accepted()
        self.output_dir = output_dir
        self.status = status
        self.settle_s = settle_s
        self.uploaded: set[int] = set()
        self.seen: dict[int, tuple[Any, float]] = {}
        self.failures = 0
        self.retry_at = 0.0
        self.started = False
        """Whether the job's own checkpoints in the store are known (`bound_steps`): no
        upload (and so no pruning) before."""

    def start(self) -> None:
        try:
            self.uploaded = bound_steps(self.backend, self.accepted)
            self.started = True
        except StoreError as exc:
            self._failed(str(exc))

    def scan(self, *, settled: bool = False, stop: threading.Event | None = None) -> None:
        """Upload what is ready now; `settled`: the training has ended, nothing changes;
        `stop` set: no further upload starts."""
        if time.monotonic() < self.retry_at:
            return
        if not self.started:
            self.start()
            if not self.started:
                return
        now = time.monotonic()
        for step in local_steps(self.output_dir):
            if step in self.uploaded:
                continue
            if stop is not None and stop.is_set():
                return
            path = self.output_dir / f"checkpoint-{step}"
            snap = snapshot(path)
            previous = self.seen.get(step)
            if not settled and (previous is None or previous[0] != snap):
                self.seen[step] = (snap, now)
                continue
            if not settled and now - previous[1] < self.settle_s:  # type: ignore[index]
                continue
            try:
                digests: list[str] = []
                size = upload_checkpoint(self.backend, self.output_dir, step, digests.append)
                if size is None:
                    self.seen.pop(step, None)
                    continue
                self.uploaded.add(step)
                self.status.add_checkpoint(step, size, digests[-1] if digests else None)
                prune(self.backend, ours=self.uploaded)  # the job's own: what it uploaded
                self.failures = 0
                if self.status.data["last_error"]:
                    self.status.error(None)
            except FileNotFoundError:
                self.seen.pop(step, None)  # rotated away by save_total_limit meanwhile
            except (StoreError, OSError) as exc:
                self._failed(f"checkpoint-{step}: {exc}")
                return

    def _failed(self, text: str) -> None:
        self.failures += 1
        delay = min(30.0, 2.0 ** min(self.failures, 5))
        self.retry_at = time.monotonic() + delay
        say(f"upload failed, retrying in {delay:.0f}s: {text}")
        self.status.error(text)


def bound_steps(backend: Backend, accepted: Accepted) -> set[int]:
    """The steps in the store whose manifest is one this job's attempts reported (what
    need not be uploaded again; anything else there is overwritten by this attempt's)."""
    return {
        step
        for step in manifest_steps(backend)
        if step in accepted.checkpoints
        and read_manifest(backend, f"checkpoints/checkpoint-{step}.json",
                          accepted.checkpoints[step]) is not None
    }  # fmt: skip


def finish_final(backend: Backend, output_dir: Path, status: Status) -> int:
    """Upload the final outputs and marker (a few tries); 0, or why not by the exit
    status: `STORE_ERROR_EXIT` when the store does not answer (`Backend.check`),
    `FINAL_REFUSED_EXIT` when it does (the job's failure, counted)."""
    failure: BaseException | None = None
    for attempt in range(4):
        try:
            digests: list[str] = []
            size = upload_final(backend, output_dir, on_digest=digests.append)
            status.update(final=True, final_digest=digests[-1] if digests else None)
            status.error(None)
            say(f"final outputs in the store ({size} bytes)")
            return 0
        except (StoreError, OSError) as exc:
            failure = exc
            say(f"uploading the final outputs failed: {exc}")
            status.error(f"final outputs: {exc}")
            if attempt < 3:
                time.sleep(2.0**attempt)
    try:
        backend.check()
    except StoreError as exc:
        say(f"the store does not answer: {exc}")
        return STORE_ERROR_EXIT
    say(f"the final outputs could not be uploaded and the store answered: {failure}")
    return FINAL_REFUSED_EXIT


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m scheduler.store.agent")
    parser.add_argument("command", choices=("restore", "watch", "finish"))
    parser.add_argument("--store", required=True)
    parser.add_argument("--installation", required=True)
    parser.add_argument("--job-id", type=int, required=True)
    parser.add_argument("--output-dir", required=True)
    parser.add_argument("--status")
    parser.add_argument("--interval", type=float, default=1.0)
    parser.add_argument("--settle", type=float, default=1.0)
    parser.add_argument("--final", action="store_true")
    parser.add_argument("--accept", action="append", default=[])
    args = parser.parse_args(argv)
    os.umask(0o077)  # what it restores or writes is the VM account's alone
    try:
        url = parse_store_url(args.store)
        accepted = Accepted.parse(args.accept)
        backend = open_backend(url, args.installation, args.job_id)
    except (ValueError, StoreError) as exc:
        say(f"store unusable: {exc}")
        return STORE_ERROR_EXIT
    status = Status(Path(args.status) if args.status else None, str(url))
    output_dir = Path(args.output_dir)
    if args.command == "restore":
        try:
            return restore(backend, output_dir, status, accepted)
        except (StoreError, OSError) as exc:
            say(f"store error: {exc}")
            status.error(str(exc))
            return STORE_ERROR_EXIT
    watcher = Watcher(backend, output_dir, status, args.settle, accepted)
    if args.command == "watch":
        # TERM (training ended, or the attempt is being killed) stops it between uploads:
        # an upload under way completes, so `finish` need not send it again.
        stop = threading.Event()
        signal.signal(signal.SIGTERM, lambda *_: stop.set())
        watcher.start()
        while not stop.is_set():
            watcher.scan(stop=stop)
            stop.wait(args.interval)
        return 0
    watcher.start()
    watcher.retry_at = 0.0  # one last try now, whatever start() met
    watcher.scan(settled=True)
    if not args.final:
        return 0
    return finish_final(backend, output_dir, status)


if __name__ == "__main__":
    sys.exit(main())
