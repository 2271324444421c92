"""What binds a job's store content to the attempts that made it (docs/invariants.md,
invariant 12): a store is shared (a `file://` directory every VM mounts, a bucket), so
what is in one job's place there may have been put by another job. Nothing in it counts
until this job's own attempts reported it.

- A manifest (a checkpoint's, or the final marker) is named by its **digest**: the sha256
  of its bytes as written. It lists each file's size and sha256, so the digest binds
  every byte of the files too.
- The store agent of an attempt writes the digest of each manifest it wrote itself into
  its status file (`digest` of a checkpoint entry, `final_digest`); the poller reads them
  (`reported`, every value checked) and records them in Postgres (`job_store_records`),
  out of any job's reach.
- The launch hands the digests recorded for the job to the agent of each new attempt, on
  its command line (`Accepted.words`, parsed back by `Accepted.parse`), never from the
  store: a final marker that is not one of them does not end the job (it trains), a
  checkpoint that is not one of them is not restored, and `job pull` refuses either.

Pure and light (the standard library and the store's own modules): the VM's agent
imports it.
"""

from __future__ import annotations

import hashlib
import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from scheduler.store.backend import StoreError

DIGEST = re.compile(r"^[0-9a-f]{64}$")
"""A sha256 as rlfleet writes one: 64 lowercase hex digits."""
MAX_STEP = 999_999_999
"""The largest checkpoint step a store holds (`checkpoint-N`, N of at most 9 digits)."""
KINDS = ("checkpoint", "final")
FINAL_STEP = 0
"""The step a final marker's record carries."""
REPORTED_MAX = 8
"""At most this many digests are taken from one status file (6 checkpoints and a final)."""
ACCEPTED_CHECKPOINTS = 16
"""At most this many checkpoint digests (the newest steps) are kept per job and handed to
an attempt; the store itself keeps the newest three."""
ACCEPTED_FINALS = 4
"""At most this many final-marker digests are kept per job (one per attempt that
completed its upload, normally one)."""


class NotReported(StoreError):
    """Store content that none of the job's attempts reported (or whose files differ from
    the manifest they reported)."""


def manifest_digest(raw: bytes) -> str:
    """The digest of a manifest: the sha256 of its bytes."""
    return hashlib.sha256(raw).hexdigest()


def file_sha256(path: Path) -> str:
    """The sha256 of a local file, read in blocks."""
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(1 << 20):
            digest.update(block)
    return digest.hexdigest()


def is_digest(value: object) -> bool:
    return isinstance(value, str) and DIGEST.fullmatch(value) is not None


def is_step(value: object) -> bool:
    return (
        isinstance(value, int) and not isinstance(value, bool) and 0 <= value <= MAX_STEP
    )  # fmt: skip


@dataclass(frozen=True)
class Accepted:
    """The digests this job's attempts reported: the final markers', and each checkpoint
    step's."""

    final: frozenset[str] = frozenset()
    checkpoints: Mapping[int, frozenset[str]] = field(default_factory=dict)

    @classmethod
    def of(cls, rows: Iterable[tuple[str, int, str]]) -> Accepted:
        """From records (kind, step, digest); a row that is not one is left out."""
        final: set[str] = set()
        checkpoints: dict[int, set[str]] = {}
        for kind, step, digest in rows:
            if not is_digest(digest) or not is_step(step):
                continue
            if kind == "final":
                final.add(digest)
            elif kind == "checkpoint":
                checkpoints.setdefault(step, set()).add(digest)
        return cls(frozenset(final), {s: frozenset(d) for s, d in checkpoints.items()})

    def words(self) -> tuple[str, ...]:
        """As the agent's `--accept` values: `final=<hex>`, `<step>=<hex>`."""
        out = [f"final={d}" for d in sorted(self.final)]
        for step in sorted(self.checkpoints):
            out += [f"{int(step)}={d}" for d in sorted(self.checkpoints[step])]
        return tuple(out)

    @classmethod
    def parse(cls, words: Iterable[str]) -> Accepted:
        """`words` back; `ValueError` (one line) for one that is not such a word."""
        rows = []
        for word in words:
            name, _, digest = word.partition("=")
            if not is_digest(digest) or not (name == "final" or re.fullmatch(r"\d{1,9}", name)):
                raise ValueError(f"--accept {word[:100]!r}: give final=<sha256> or <step>=<sha256>")
            rows.append(("final", FINAL_STEP, digest) if name == "final" else
                        ("checkpoint", int(name), digest))  # fmt: skip
        return cls.of(rows)


def reported(data: object) -> list[tuple[str, int, str]]:
    """The digests a store status file (`scheduler.store.agent.Status`, parsed JSON from
    a directory the job can write) reports: (kind, step, digest), each checked (hex,
    step range), at most `REPORTED_MAX`; nothing for anything else."""
    if not isinstance(data, dict):
        return []
    found: list[tuple[str, int, str]] = []
    entries = data.get("checkpoints")
    for entry in entries[-6:] if isinstance(entries, list) else []:
        if not isinstance(entry, dict):
            continue
        if is_step(entry.get("step")) and is_digest(entry.get("digest")):
            found.append(("checkpoint", entry["step"], entry["digest"]))
    if is_digest(data.get("final_digest")):
        found.append(("final", FINAL_STEP, data["final_digest"]))
    return found[-REPORTED_MAX:]


def check_files(manifest: Mapping[str, Any], root: Path) -> str | None:
    """None when every file of `manifest` under `root` has the sha256 the manifest lists;
    else what differs (a manifest without sha256 binds no file: refused)."""
    sums = manifest.get("sha256")
    if not isinstance(sums, Mapping):
        return "its manifest lists no sha256 of its files"
    for rel in sorted(manifest["files"]):
        try:
            got = file_sha256(root / rel)
        except OSError as exc:
            return f"{rel}: {exc.strerror or exc}"
        if got != sums.get(rel):
            return f"{rel}: its sha256 is not the one its manifest lists"
    return None
