"""A job's workdir (`job submit --workdir DIR`, job-file key `workdir:`), packed where the
CLI runs: the directory's files, less what `.rlfleetignore` and the default ignores leave
out, as one deterministic gzip'd tar, content-addressed by its sha256.

The same tree always packs to the same bytes (entries sorted, times, owners and the gzip
header fixed, modes kept), so the same workdir is stored once and a VM that already holds
its digest is not sent it again. Refused with one line (`BadInput`, exit 2): a symlink
that leaves the directory, a symlink to a directory, a dangling symlink, anything that is
not a regular file or directory (a FIFO, a socket, a device), a name that is not UTF-8,
more than `WORKDIR_MAX_FILES` entries, and a tree over `WORKDIR_MAX_UNPACKED` bytes or
packing to more than `WORKDIR_MAX_BYTES` (the message names the largest files). A symlink
to a regular file inside the directory is packed as a copy of that file.

No SQLAlchemy here: `job submit` imports it.
"""

from __future__ import annotations

import gzip
import hashlib
import io
import os
import re
import stat
import tarfile
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

from scheduler.errors import BadInput
from scheduler.validate import WORKDIR_MAX_BYTES, WORKDIR_MAX_FILES, WORKDIR_MAX_UNPACKED

IGNORE_FILE = ".rlfleetignore"
"""The file of gitignore-style patterns, at the top of the workdir, of what not to ship."""
DEFAULT_IGNORES = (".git/", ".hg/", ".svn/", "__pycache__/", ".venv/", "*.pyc", ".DS_Store")
"""Left out of every workdir unless `.rlfleetignore` takes them back (`!pattern`)."""
LARGEST_SHOWN = 3
"""How many of the largest files a refusal for size names."""


def _mib(n: int) -> str:
    return f"{n / (1 << 20):.1f} MiB"


@dataclass(frozen=True)
class Pattern:
    """One line of an ignore file."""

    regex: re.Pattern[str]
    negate: bool
    dir_only: bool


def _translate(glob: str) -> str:
    """A gitignore glob (no leading `!`, no trailing `/`) as a regex over a relative path."""
    anchored = "/" in glob
    glob = glob.lstrip("/")
    out = []
    i = 0
    while i < len(glob):
        c = glob[i]
        if glob.startswith("**/", i):
            out.append("(?:.*/)?")
            i += 3
            continue
        if glob.startswith("/**", i) and i + 3 == len(glob):
            out.append("/.*")
            i += 3
            continue
        if glob.startswith("**", i):
            out.append(".*")
            i += 2
            continue
        if c == "*":
            out.append("[^/]*")
        elif c == "?":
            out.append("[^/]")
        elif c == "[":
            end = glob.find("]", i + 2)
            if end == -1:
                out.append(re.escape(c))
            else:
                body = glob[i + 1 : end].replace("\\", "\\\\")
                if body.startswith("!"):
                    body = "^" + body[1:]
                out.append(f"[{body}]")
                i = end
        elif c == "\\" and i + 1 < len(glob):
            i += 1
            out.append(re.escape(glob[i]))
        else:
            out.append(re.escape(c))
        i += 1
    body = "".join(out)
    return body if anchored else f"(?:.*/)?{body}"


def parse_ignore(lines: Iterable[str]) -> list[Pattern]:
    """The patterns of an ignore file's lines (gitignore syntax: `#` comments, `!` takes a
    path back, a trailing `/` matches directories only, a `/` elsewhere anchors the pattern
    at the workdir's top, `*`, `?`, `[…]` and `**`)."""
    patterns = []
    for raw in lines:
        line = raw.rstrip("\n").rstrip("\r")
        if not line.strip() or line.startswith("#"):
            continue
        if not line.endswith("\\ "):
            line = line.rstrip(" ")
        negate = line.startswith("!")
        if negate or line.startswith("\\!") or line.startswith("\\#"):
            line = line[1:]
        dir_only = line.endswith("/")
        line = line.rstrip("/")
        if not line:
            continue
        patterns.append(Pattern(re.compile(_translate(line) + r"\Z"), negate, dir_only))
    return patterns


def ignored(patterns: Iterable[Pattern], rel: str, is_dir: bool) -> bool:
    """Whether the path `rel` (relative, `/`-separated) is left out: the last pattern that
    matches it decides."""
    verdict = False
    for pattern in patterns:
        if pattern.dir_only and not is_dir:
            continue
        if pattern.regex.match(rel):
            verdict = not pattern.negate
    return verdict


@dataclass(frozen=True)
class Entry:
    """One member of the packed tree: a directory, or a regular file read from `source`."""

    name: str
    is_dir: bool
    mode: int
    size: int = 0
    source: str = ""


@dataclass(frozen=True)
class PackedWorkdir:
    """A packed workdir: its bytes, their sha256 (hex) and what it holds."""

    digest: str
    data: bytes
    files: int
    unpacked: int

    @property
    def size(self) -> int:
        """Packed bytes."""
        return len(self.data)


def _inside(root: str, path: str) -> bool:
    return path == root or path.startswith(root.rstrip(os.sep) + os.sep)


def _name(rel: str, where: str) -> str:
    try:
        rel.encode("utf-8")
    except UnicodeEncodeError:
        shown = rel.encode("utf-8", "surrogateescape").decode("utf-8", "replace")
        raise BadInput(f"{where}: {shown!r} is not a UTF-8 file name") from None
    return rel


def scan(root: str | Path, where: str | None = None) -> list[Entry]:
    """The entries of the workdir at `root`, sorted, after the ignores; `BadInput` for a
    tree that cannot be shipped (see the module's docstring)."""
    top = os.path.realpath(root)
    where = where or f"--workdir {root}"
    if not os.path.isdir(top):
        raise BadInput(f"{where}: not a directory")
    patterns = parse_ignore(DEFAULT_IGNORES)
    ignore_path = os.path.join(top, IGNORE_FILE)
    if os.path.isfile(ignore_path):
        try:
            with open(ignore_path, encoding="utf-8", errors="replace") as handle:
                patterns += parse_ignore(handle.read(1 << 20).splitlines())
        except OSError as exc:
            raise BadInput(f"{where}: cannot read {IGNORE_FILE}: {exc.strerror}") from None
    entries: list[Entry] = []
    total = 0
    stack = [""]
    while stack:
        rel_dir = stack.pop()
        path = os.path.join(top, rel_dir) if rel_dir else top
        try:
            names = sorted(os.listdir(path))
        except OSError as exc:
            raise BadInput(f"{where}: cannot list {rel_dir or '.'}: {exc.strerror}") from None
        subdirs = []
        for base in names:
            rel = _name(f"{rel_dir}/{base}" if rel_dir else base, where)
            full = os.path.join(path, base)
            try:
                st = os.lstat(full)
            except OSError as exc:
                raise BadInput(f"{where}: cannot read {rel}: {exc.strerror}") from None
            if stat.S_ISLNK(st.st_mode):
                if ignored(patterns, rel, False):
                    continue
                target = os.path.realpath(full)
                if not _inside(top, target):
                    raise BadInput(
                        f"{where}: {rel} is a symlink out of the workdir "
                        f"(-> {os.readlink(full)}); copy the file in or list it in {IGNORE_FILE}"
                    )
                try:
                    st = os.stat(full)
                except OSError:
                    raise BadInput(f"{where}: {rel} is a dangling symlink") from None
                if not stat.S_ISREG(st.st_mode):
                    raise BadInput(
                        f"{where}: {rel} is a symlink to a directory or special file; "
                        f"only symlinks to regular files are shipped (as copies)"
                    )
            is_dir = stat.S_ISDIR(st.st_mode)
            if ignored(patterns, rel, is_dir):
                continue
            if is_dir:
                entries.append(Entry(rel, True, stat.S_IMODE(st.st_mode) | 0o700))
                subdirs.append(rel)
            elif stat.S_ISREG(st.st_mode):
                entries.append(Entry(rel, False, stat.S_IMODE(st.st_mode), st.st_size, full))
                total += st.st_size
            else:
                raise BadInput(
                    f"{where}: {rel} is not a regular file or directory "
                    f"(a FIFO, socket or device); remove it or list it in {IGNORE_FILE}"
                )
            if len(entries) > WORKDIR_MAX_FILES:
                raise BadInput(
                    f"{where}: more than {WORKDIR_MAX_FILES} files and directories; "
                    f"list what training does not need in {IGNORE_FILE}"
                )
        stack.extend(reversed(subdirs))
    if total > WORKDIR_MAX_UNPACKED:
        raise BadInput(
            f"{where}: {_mib(total)} of files, over the {_mib(WORKDIR_MAX_UNPACKED)} limit; "
            f"{largest_files(entries)}"
        )
    entries.sort(key=lambda e: e.name)
    return entries


def largest_files(entries: Iterable[Entry]) -> str:
    """`largest: a (12.0 MiB), b (3.1 MiB)…`, and how to leave them out."""
    files = sorted((e for e in entries if not e.is_dir), key=lambda e: (-e.size, e.name))
    shown = ", ".join(f"{e.name} ({_mib(e.size)})" for e in files[:LARGEST_SHOWN])
    return f"largest: {shown}; list what training does not need in {IGNORE_FILE}"


class _Bounded(io.BytesIO):
    """A buffer that refuses to grow past `limit` bytes."""

    def __init__(self, limit: int) -> None:
        super().__init__()
        self.limit = limit

    def write(self, data: bytes) -> int:  # type: ignore[override]
        if self.tell() + len(data) > self.limit:
            raise _TooBig
        return super().write(data)


class _TooBig(Exception):
    pass


def _tarinfo(entry: Entry) -> tarfile.TarInfo:
    info = tarfile.TarInfo(entry.name)
    info.mtime = 0
    info.uid = info.gid = 0
    info.uname = info.gname = ""
    info.mode = entry.mode
    if entry.is_dir:
        info.type = tarfile.DIRTYPE
    else:
        info.size = entry.size
    return info


def pack_entries(
    entries: list[Entry], where: str = "--workdir", limit: int = WORKDIR_MAX_BYTES
) -> PackedWorkdir:
    """The entries as a deterministic tar.gz of at most `limit` bytes."""
    buffer = _Bounded(limit)
    try:
        with (
            gzip.GzipFile(filename="", mode="wb", fileobj=buffer, mtime=0, compresslevel=6) as gz,
            tarfile.open(fileobj=gz, mode="w", format=tarfile.PAX_FORMAT) as tar,
        ):
            for entry in entries:
                info = _tarinfo(entry)
                if entry.is_dir:
                    tar.addfile(info)
                    continue
                with open(entry.source, "rb") as handle:
                    tar.addfile(info, handle)
    except _TooBig:
        raise BadInput(
            f"{where}: packs to more than {_mib(limit)}, the limit of a workdir shipped "
            f"through the scheduler; {largest_files(entries)}"
        ) from None
    except OSError as exc:  # a file that changed or vanished while it was read
        raise BadInput(f"{where}: cannot pack it: {exc.strerror or exc}") from None
    data = buffer.getvalue()
    return PackedWorkdir(
        hashlib.sha256(data).hexdigest(),
        data,
        sum(1 for e in entries if not e.is_dir),
        sum(e.size for e in entries),
    )


def pack(root: str | Path, where: str | None = None) -> PackedWorkdir:
    """Scan and pack the workdir at `root` (`BadInput` when it cannot be shipped)."""
    where = where or f"--workdir {root}"
    return pack_entries(scan(root, where), where)
