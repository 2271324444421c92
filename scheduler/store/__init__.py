"""A job's store: where its checkpoints and final outputs outlive the VM that wrote them
(docs/invariants.md, invariant 10).

A store is a URL: `s3://bucket/prefix` (any S3-compatible service: AWS S3, Cloudflare R2,
MinIO, Ceph, GCS interop) or `file:///abs/path` (a directory every VM mounts, NFS).
`parse_store_url` checks one (a `ValueError` with one line says what is wrong). This
module is pure and light: the CLI imports it for `job submit`; the backends (boto3, the
filesystem) are `scheduler.store.backend`, the layout and the copying `scheduler.store.sync`,
and the VM-side agent the launch wrapper runs `scheduler.store.agent`.

Layout, under `<prefix>/<installation>/<job id>/` (`job_key`):

    checkpoints/checkpoint-N/<files>     a checkpoint's files
    checkpoints/checkpoint-N.json        its manifest (files, sizes), written LAST: a
                                         checkpoint without one is never restored
    final/<files>                        the final model, tokenizer…
    final.json                           the final marker, written last
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from urllib.parse import unquote, urlsplit

STORE_ENV = "RLFLEET_STORE"
"""The default store of `job submit` where the CLI runs."""
STORE_URL_MAX = 1024
_BUCKET = re.compile(r"[a-z0-9][a-z0-9.\-]{1,61}[a-z0-9]")
_SEGMENT = re.compile(r"[A-Za-z0-9._\-+=@,]+")
"""What one segment of a prefix or path may hold: nothing a shell, a URL or a key listing
reads specially."""


@dataclass(frozen=True)
class StoreURL:
    """A checked store URL: `scheme` (`s3` or `file`), the S3 `bucket` (empty for file) and
    `path` (the S3 key prefix without slashes around it, or the absolute directory)."""

    scheme: str
    bucket: str
    path: str

    def __str__(self) -> str:
        if self.scheme == "s3":
            return f"s3://{self.bucket}/{self.path}" if self.path else f"s3://{self.bucket}"
        return f"file://{self.path}"

    def job_key(self, installation: str, job_id: int) -> str:
        """Where one job's objects are: `<prefix>/<installation>/<job id>` (S3 key
        prefix, or directory for file://)."""
        check_installation_word(installation)
        tail = f"{installation}/{int(job_id)}"
        if self.scheme == "s3":
            return f"{self.path}/{tail}" if self.path else tail
        return f"{self.path.rstrip('/')}/{tail}"


def check_installation_word(installation: str) -> str:
    """`installation` if it is a lowercase UUID (it names a directory and a key)."""
    if not re.fullmatch(r"[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}",
                        installation):  # fmt: skip
        raise ValueError(f"not an installation id: {installation!r}")
    return installation


def _segments(path: str, what: str) -> list[str]:
    parts = [p for p in path.split("/") if p]
    for part in parts:
        if part in (".", "..") or not _SEGMENT.fullmatch(part):
            raise ValueError(
                f"{what} {path!r}: each part may hold letters, digits and . _ - + = @ , only"
                " (no '..')"
            )
    return parts


def parse_store_url(text: str) -> StoreURL:
    """The store `text` names, checked; `ValueError` (one line) for anything else."""
    if not isinstance(text, str) or not text:
        raise ValueError("--store: give s3://bucket/prefix or file:///absolute/path")
    if len(text) > STORE_URL_MAX or any(ord(c) < 0x21 or ord(c) == 0x7F for c in text):
        raise ValueError(
            f"--store: a URL of at most {STORE_URL_MAX} characters without spaces or "
            "control characters"
        )
    parts = urlsplit(text)
    if parts.query or parts.fragment or "%" in text:
        raise ValueError(f"--store {text!r}: no query, fragment or %-escapes")
    if parts.scheme == "s3":
        bucket = parts.netloc
        if not _BUCKET.fullmatch(bucket) or ".." in bucket:
            raise ValueError(f"--store {text!r}: not an S3 bucket name (3-63 of a-z 0-9 . -)")
        prefix = "/".join(_segments(parts.path, "--store prefix"))
        return StoreURL("s3", bucket, prefix)
    if parts.scheme == "file":
        if parts.netloc not in ("", "localhost"):
            raise ValueError(f"--store {text!r}: a file:// store is a local path (file:///path)")
        path = unquote(parts.path)
        if not path.startswith("/"):
            raise ValueError(f"--store {text!r}: give an absolute path, file:///path")
        segments = _segments(path, "--store path")
        if not segments:
            raise ValueError(f"--store {text!r}: not the root directory")
        return StoreURL("file", "", "/" + "/".join(segments))
    raise ValueError(f"--store {text!r}: unsupported store; use s3://bucket/prefix or file:///path")
