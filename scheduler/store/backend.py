"""The two kinds of store behind one small API (`Backend`): S3-compatible object storage
through boto3, and a directory (`file://`, a mount every VM shares).

Keys are relative to one job's place in the store (`StoreURL.job_key`), `/`-separated,
checked by `check_key`. Credentials and endpoint of an S3 store come from where the AWS
CLI reads them (`~/.aws/credentials`, `~/.aws/config` with `endpoint_url` and
`s3 = addressing_style = path` for most self-hosted servers, `AWS_*` variables): this
module never takes, prints or logs one. Every failure is a `StoreError` with one line.
"""

from __future__ import annotations

import errno
import os
import re
import shutil
import stat
from collections import deque
from collections.abc import Callable, Iterable
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any, Protocol

from scheduler.redact import scrub_urls
from scheduler.store import StoreURL

_KEY_PART = re.compile(r"[A-Za-z0-9._\-+=@,]+")
Progress = Callable[[int], None]
"""Called with the bytes moved since its last call."""


class StoreError(Exception):
    """The store could not be reached, refused, or a transfer failed (one line)."""


def check_key(key: str) -> str:
    """`key` if it is a relative key of plain parts (no `..`, no empty part); else
    `StoreError`: a key read from a manifest or a listing is never trusted."""
    parts = key.split("/")
    if not key or any(p in ("", ".", "..") or not _KEY_PART.fullmatch(p) for p in parts):
        raise StoreError(f"not a key rlfleet writes: {key[:200]!r}")
    return key


class Backend(Protocol):
    """One job's place in a store."""

    def check(self) -> None:
        """Raise `StoreError` unless the store answers and lets this job list its place."""

    def list(self, prefix: str = "") -> dict[str, int]:
        """Every key under `prefix` with its size."""

    def put_file(self, path: Path, key: str, progress: Progress | None = None) -> None:
        """Copy a local file to `key` (a reader never sees it half-written)."""

    def put_bytes(self, data: bytes, key: str) -> None:
        """Write `data` to `key` (a reader never sees it half-written)."""

    def get_bytes(self, key: str, limit: int = 1 << 20) -> bytes | None:
        """The object at `key` (at most `limit` bytes), or None when there is none."""

    def get_file(self, key: str, path: Path, progress: Progress | None = None) -> None:
        """Copy `key` to a local file."""

    def read_into(
        self, key: str, write: Callable[[bytes], object], size: int,
        progress: Progress | None = None,
    ) -> None:  # fmt: skip
        """Hand the `size` bytes of `key` to `write`, reading at most `size` + 1 of it;
        `StoreError` when it is not a regular object of exactly that size."""

    def delete(self, keys: Iterable[str]) -> None:
        """Remove these keys (missing ones are fine)."""


def one_line(exc: BaseException) -> str:
    """An exception as one short line, every URL in it redacted: botocore quotes the
    endpoint URL back ("Could not connect to the endpoint URL: …"), and one set with
    `AWS_ENDPOINT_URL=https://user:secret@host` carries a password."""
    text = " ".join(str(exc).split()) or type(exc).__name__
    return scrub_urls(text)[:300]


class FileBackend:
    """A directory as a store (`file:///path`): written through a temporary name and
    renamed, so that a reader never sees a half-written file."""

    def __init__(self, root: str) -> None:
        self.root = Path(root)

    def _path(self, key: str) -> Path:
        return self.root / check_key(key)

    def check(self) -> None:
        base = self.root
        while not base.exists() and base != base.parent:
            base = base.parent
        if not base.is_dir() or not os.access(base, os.W_OK | os.X_OK):
            raise StoreError(f"store directory {self.root} is not a writable directory")

    def list(self, prefix: str = "") -> dict[str, int]:
        top = self.root / prefix if prefix else self.root
        if not top.is_dir():
            return {}
        found = {}
        for dirpath, _dirs, files in os.walk(top):
            for name in files:
                if name.startswith(".rlfleet-tmp-"):
                    continue
                full = Path(dirpath) / name
                try:
                    found[full.relative_to(self.root).as_posix()] = full.stat().st_size
                except OSError:
                    continue
        return found

    def _write(self, key: str, write: Callable[[Path], object]) -> None:
        target = self._path(key)
        try:
            target.parent.mkdir(parents=True, exist_ok=True)
            tmp = target.parent / f".rlfleet-tmp-{os.getpid()}-{target.name}"
            write(tmp)
            os.replace(tmp, target)
        except OSError as exc:
            raise StoreError(f"writing {key}: {one_line(exc)}") from exc

    def put_file(self, path: Path, key: str, progress: Progress | None = None) -> None:
        self._write(key, lambda tmp: _copy(path, tmp, progress))

    def put_bytes(self, data: bytes, key: str) -> None:
        self._write(key, lambda tmp: tmp.write_bytes(data))

    def get_bytes(self, key: str, limit: int = 1 << 20) -> bytes | None:
        try:
            with open(self._path(key), "rb") as f:
                return f.read(limit)
        except FileNotFoundError:
            return None
        except OSError as exc:
            raise StoreError(f"reading {key}: {one_line(exc)}") from exc

    def get_file(self, key: str, path: Path, progress: Progress | None = None) -> None:
        try:
            _copy(self._path(key), path, progress)
        except OSError as exc:
            raise StoreError(f"reading {key}: {one_line(exc)}") from exc

    def read_into(
        self, key: str, write: Callable[[bytes], object], size: int,
        progress: Progress | None = None,
    ) -> None:  # fmt: skip
        try:
            fd = _open_regular(self.root, check_key(key))
        except OSError as exc:
            raise StoreError(f"reading {key}: {one_line(exc)}") from exc
        with os.fdopen(fd, "rb") as f:
            have = os.fstat(fd).st_size
            if have != size:
                raise StoreError(f"{key}: {have} bytes, manifest says {size}")
            _copy_bounded(key, f.read, write, size, progress)

    def delete(self, keys: Iterable[str]) -> None:
        for key in keys:
            try:
                self._path(key).unlink(missing_ok=True)
            except OSError as exc:
                raise StoreError(f"deleting {key}: {one_line(exc)}") from exc


def _open_regular(root: Path, key: str) -> int:
    """An fd of the regular file `key` under `root`, opened without following a link at any
    part of the key and without blocking (a FIFO); `StoreError` for anything else."""
    flags = os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC
    parts = key.split("/")
    fd = os.open(root, flags | os.O_DIRECTORY)
    try:
        for part in parts[:-1]:
            try:
                inner = os.open(part, flags | os.O_DIRECTORY, dir_fd=fd)
            except NotADirectoryError:
                raise StoreError(f"{key}: not a regular file") from None
            except OSError as exc:
                if exc.errno == errno.ELOOP:
                    raise StoreError(f"{key}: not a regular file") from None
                raise
            os.close(fd)
            fd = inner
        try:
            found = os.open(parts[-1], flags | os.O_NONBLOCK, dir_fd=fd)
        except OSError as exc:
            if exc.errno == errno.ELOOP:
                raise StoreError(f"{key}: not a regular file") from None
            raise
    finally:
        os.close(fd)
    if not stat.S_ISREG(os.fstat(found).st_mode):
        os.close(found)
        raise StoreError(f"{key}: not a regular file")
    return found


def _copy_bounded(
    key: str,
    read: Callable[[int], bytes],
    write: Callable[[bytes], object],
    size: int,
    progress: Progress | None,
) -> None:
    """Copy exactly `size` bytes from `read` to `write`, reading at most `size` + 1;
    `StoreError` when the source has fewer or more."""
    left = size + 1
    while left > 0 and (chunk := read(min(left, 1 << 20))):
        left -= len(chunk)
        if left <= 0:
            raise StoreError(f"{key}: more bytes than its manifest's {size}")
        write(chunk)
        if progress is not None:
            progress(len(chunk))
    if left != 1:
        raise StoreError(f"{key}: {size + 1 - left} bytes, manifest says {size}")


def _copy(src: Path, dst: Path, progress: Progress | None) -> None:
    with open(src, "rb") as fin, open(dst, "wb") as fout:
        while chunk := fin.read(1 << 20):
            fout.write(chunk)
            if progress is not None:
                progress(len(chunk))


class S3Backend:
    """An S3-compatible bucket through boto3, configured as the AWS CLI is."""

    def __init__(self, bucket: str, base: str) -> None:
        try:
            import boto3
            from boto3.s3.transfer import TransferConfig
            from botocore.config import Config
        except ImportError as exc:  # pragma: no cover - boto3 is in the train extra
            raise StoreError("an s3:// store needs boto3 (pip install 'rlfleet[train]')") from exc
        self.bucket = bucket
        self.base = base
        config = Config(
            connect_timeout=5,
            read_timeout=60,
            retries={"max_attempts": 4, "mode": "standard"},
            # Only when the service asks: S3-compatible servers differ in the checksums
            # they understand.
            request_checksum_calculation="when_required",
            response_checksum_validation="when_required",
        )
        try:
            self.client: Any = boto3.session.Session().client("s3", config=config)
        except Exception as exc:  # botocore raises many kinds for a bad config
            raise StoreError(f"s3 client: {one_line(exc)}") from exc
        self.transfer = TransferConfig(
            multipart_threshold=64 << 20, multipart_chunksize=64 << 20, max_concurrency=8
        )

    def _key(self, key: str) -> str:
        return f"{self.base}/{check_key(key)}"

    def _call(self, what: str, fn: Callable[[], Any]) -> Any:
        from botocore.exceptions import BotoCoreError, ClientError

        try:
            return fn()
        except StoreError:
            raise
        except ClientError as exc:
            code = exc.response.get("Error", {}).get("Code", "error")
            raise StoreError(f"{what}: refused by the store ({code})") from exc
        except (BotoCoreError, OSError) as exc:
            raise StoreError(f"{what}: {one_line(exc)}") from exc
        except Exception as exc:  # s3transfer wraps failures in its own kinds
            raise StoreError(f"{what}: {one_line(exc)}") from exc

    def check(self) -> None:
        self._call(
            f"s3://{self.bucket}",
            lambda: self.client.list_objects_v2(
                Bucket=self.bucket, Prefix=self.base + "/", MaxKeys=1
            ),
        )

    def list(self, prefix: str = "") -> dict[str, int]:
        full = f"{self.base}/{prefix}" if prefix else f"{self.base}/"
        found: dict[str, int] = {}

        def walk() -> None:
            pages = self.client.get_paginator("list_objects_v2").paginate(
                Bucket=self.bucket, Prefix=full
            )
            for page in pages:
                for item in page.get("Contents", ()):
                    found[item["Key"][len(self.base) + 1 :]] = int(item["Size"])

        self._call(f"listing s3://{self.bucket}/{full}", walk)
        return found

    def put_file(self, path: Path, key: str, progress: Progress | None = None) -> None:
        self._call(
            f"uploading {key}",
            lambda: self.client.upload_file(
                str(path), self.bucket, self._key(key), Config=self.transfer, Callback=progress
            ),
        )

    def put_bytes(self, data: bytes, key: str) -> None:
        self._call(
            f"writing {key}",
            lambda: self.client.put_object(Bucket=self.bucket, Key=self._key(key), Body=data),
        )

    def get_bytes(self, key: str, limit: int = 1 << 20) -> bytes | None:
        from botocore.exceptions import ClientError

        try:
            reply = self.client.get_object(Bucket=self.bucket, Key=self._key(key))
        except ClientError as exc:
            code = exc.response.get("Error", {}).get("Code", "error")
            if code in ("NoSuchKey", "404"):
                return None
            raise StoreError(f"reading {key}: refused by the store ({code})") from exc
        except Exception as exc:
            raise StoreError(f"reading {key}: {one_line(exc)}") from exc
        return self._call(f"reading {key}", lambda: reply["Body"].read(limit))

    def get_file(self, key: str, path: Path, progress: Progress | None = None) -> None:
        self._call(
            f"downloading {key}",
            lambda: self.client.download_file(
                self.bucket, self._key(key), str(path), Config=self.transfer, Callback=progress
            ),
        )

    PART = 16 << 20
    """An object past this size comes in ranged parts of this size, `PARALLEL` at once."""
    PARALLEL = 8

    def read_into(
        self, key: str, write: Callable[[bytes], object], size: int,
        progress: Progress | None = None,
    ) -> None:  # fmt: skip
        # A larger object is refused by its listed size before (`sync.download_tree`) and,
        # if it grew since, here: a single read takes at most size + 1 bytes, a part no
        # more than its range, and every part's Content-Range must give the object's size
        # as the manifest's.
        if size <= self.PART:
            self._read_range(key, 0, size, size, write, progress)
            return
        starts = range(0, size, self.PART)
        with ThreadPoolExecutor(self.PARALLEL) as pool:
            window: deque[Future[bytes]] = deque()
            for start in starts:
                window.append(pool.submit(self._part, key, start, size))
                if len(window) >= self.PARALLEL:
                    self._hand_over(window.popleft(), write, progress)
            while window:
                self._hand_over(window.popleft(), write, progress)

    @staticmethod
    def _hand_over(part: Future[bytes], write: Callable[[bytes], object],
                   progress: Progress | None) -> None:  # fmt: skip
        data = part.result()
        write(data)
        if progress is not None:
            progress(len(data))

    def _part(self, key: str, start: int, size: int) -> bytes:
        chunks: list[bytes] = []
        self._read_range(key, start, min(self.PART, size - start), size, chunks.append, None)
        return b"".join(chunks)

    def _read_range(
        self, key: str, start: int, length: int, size: int,
        write: Callable[[bytes], object], progress: Progress | None,
    ) -> None:  # fmt: skip
        """`length` bytes of `key` from `start` (the whole object when it fits in one read:
        `length` + 1 asked, so that a larger one shows)."""
        whole = start == 0 and length == size
        end = start + length if whole else start + length - 1
        ranged = {"Range": f"bytes={start}-{end}"} if size > 0 else {}
        reply = self._call(
            f"reading {key}",
            lambda: self.client.get_object(Bucket=self.bucket, Key=self._key(key), **ranged),
        )
        body = reply["Body"]
        try:
            total = str(reply.get("ContentRange", "")).rpartition("/")[2]
            if ranged and total != str(size):
                raise StoreError(f"{key}: {total or '?'} bytes, manifest says {size}")
            self._call(f"reading {key}",
                       lambda: _copy_bounded(key, body.read, write, length, progress))  # fmt: skip
        finally:
            body.close()

    def delete(self, keys: Iterable[str]) -> None:
        batch = [{"Key": self._key(k)} for k in keys]
        for start in range(0, len(batch), 1000):
            part = batch[start : start + 1000]
            self._call(
                "deleting old checkpoints",
                lambda part=part: self.client.delete_objects(  # type: ignore[misc]
                    Bucket=self.bucket, Delete={"Objects": part, "Quiet": True}
                ),
            )


def open_backend(url: StoreURL, installation: str, job_id: int) -> Backend:
    """The backend of one job's place in the store `url`."""
    key = url.job_key(installation, job_id)
    if url.scheme == "s3":
        return S3Backend(url.bucket, key)
    return FileBackend(key)


def remove_tree(path: Path) -> None:
    """Remove a local directory if it is there (a link in its place: the link, never
    what it points to)."""
    if path.is_symlink():
        path.unlink(missing_ok=True)
        return
    shutil.rmtree(path, ignore_errors=True)
