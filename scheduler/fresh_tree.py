"""A directory tree written from names that came from a VM or a store, which are never
trusted (docs/security.md, "What comes back from a VM or a store").

Every name is checked (`split_name`): relative, plain parts, valid UTF-8, no control
character, bounded in length and depth. Every directory and file is created by this
process, relative to directory file descriptors, with `O_NOFOLLOW` (and `O_EXCL` for
files), under a fresh directory made beside the destination; nothing is ever opened by a
path a link could redirect. No link, device or FIFO is ever made. The tree is renamed into
place only once whole (`commit`); `discard` removes it, so a failure leaves nothing."""

from __future__ import annotations

import contextlib
import errno
import os
import shutil
import stat
import tempfile
from pathlib import Path

MAX_NAME_BYTES = 4096
MAX_PART_BYTES = 255
MAX_DEPTH = 64
FREE_SPACE_RESERVE = 64 << 20
"""A write that would leave less free space than this on the destination's disk is refused."""
_DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
_FILE_FLAGS = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC
_OPEN_DIRS = 64


class TreeError(Exception):
    """The tree could not be written, or the destination is not usable (one line)."""


def shown(name: bytes | str, limit: int = 200) -> str:
    """A name as one printable line: bytes that are not UTF-8 and control characters are
    escaped (`\\xff`, `\\n`)."""
    text = name.decode("utf-8", "backslashreplace") if isinstance(name, bytes) else name
    text = text[:limit]
    return "".join(c if c.isprintable() else ascii(c)[1:-1] for c in text)


def split_name(raw: bytes) -> tuple[str, ...] | None:
    """The parts of a relative name, or None when it is refused: absolute, with an empty,
    `.` or `..` part, not UTF-8, with a control character, too long or too deep."""
    if not raw or len(raw) > MAX_NAME_BYTES or raw.startswith(b"/"):
        return None
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError:
        return None
    if any(ord(c) < 32 or ord(c) == 127 for c in text):
        return None
    parts = tuple(text.split("/"))
    if len(parts) > MAX_DEPTH:
        return None
    for part in parts:
        if part in ("", ".", "..") or len(part.encode()) > MAX_PART_BYTES:
            return None
    return parts


def free_bytes(fd_or_path: int | str | Path) -> int:
    """Bytes an unprivileged writer may still use on that file system."""
    st = os.statvfs(fd_or_path) if isinstance(fd_or_path, int) else os.statvfs(fd_or_path)
    return st.f_bavail * st.f_frsize


def check_dest(dest: Path) -> None:
    """`TreeError` unless `dest` is absent or an empty directory (not a link)."""
    try:
        st = os.lstat(dest)
    except FileNotFoundError:
        return
    except OSError as exc:
        raise TreeError(f"{dest}: {exc.strerror}") from None
    if not stat.S_ISDIR(st.st_mode) or any(os.scandir(dest)):
        raise TreeError(f"{dest}: exists and is not an empty directory")


def _umask() -> int:
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


class FreshTree:
    """A new directory beside `dest`, filled through `make_dir` / `create_file`, then
    renamed to `dest` (`commit`) or removed (`discard`)."""

    def __init__(self, dest: Path, *, prefix: str = ".rlfleet-pull-") -> None:
        check_dest(dest)
        self.dest = dest
        self._made: list[Path] = []  # the parents made here, removed again by `discard`
        missing = dest.parent
        while not missing.exists() and missing != missing.parent:
            self._made.append(missing)
            missing = missing.parent
        try:
            dest.parent.mkdir(parents=True, exist_ok=True)
            self.path = Path(tempfile.mkdtemp(prefix=prefix, dir=dest.parent))
            self._root = os.open(self.path, _DIR_FLAGS)
        except OSError as exc:
            raise TreeError(f"{dest.parent}: {exc.strerror}") from None
        self._dirs: dict[tuple[str, ...], int] = {}

    def free(self) -> int:
        """Free bytes on the tree's file system."""
        return free_bytes(self._root)

    def _open_dir(self, parts: tuple[str, ...], mode: int = 0o755) -> int:
        """The fd of directory `parts` (made, each part, when missing); `FileExistsError`
        when something that is not a directory is in the way."""
        if not parts:
            return self._root
        fd = self._dirs.get(parts)
        if fd is not None:
            return fd
        parent = self._open_dir(parts[:-1])
        with contextlib.suppress(FileExistsError):
            os.mkdir(parts[-1], mode, dir_fd=parent)
        try:
            fd = os.open(parts[-1], _DIR_FLAGS, dir_fd=parent)
        except OSError as exc:
            if exc.errno in (errno.ENOTDIR, errno.ELOOP):
                raise FileExistsError(errno.EEXIST, "not a directory") from None
            raise
        if len(self._dirs) >= _OPEN_DIRS:
            self._close_dirs()
        self._dirs[parts] = fd
        return fd

    def _close_dirs(self) -> None:
        for fd in self._dirs.values():
            os.close(fd)
        self._dirs.clear()

    def make_dir(self, parts: tuple[str, ...], mode: int) -> bool:
        """Directory `parts` with `mode` (no setuid, setgid, sticky or group/other write
        bit; the owner keeps rwx); False when a file is in its place."""
        try:
            fd = self._open_dir(parts)
        except FileExistsError:
            return False
        os.fchmod(fd, (mode & 0o755) | 0o700)
        return True

    def create_file(self, parts: tuple[str, ...], mode: int) -> int | None:
        """A new regular file `parts`, open for writing (the caller closes it); None when
        something is in its place already."""
        try:
            parent = self._open_dir(parts[:-1])
            fd = os.open(parts[-1], _FILE_FLAGS, 0o600, dir_fd=parent)
        except (FileExistsError, IsADirectoryError):
            return None
        os.fchmod(fd, (mode & 0o755) | 0o600)
        return fd

    def commit(self) -> None:
        """Rename the tree to `dest` (which may be there only as an empty directory)."""
        self._close_dirs()
        try:
            os.fchmod(self._root, 0o777 & ~_umask())
            os.close(self._root)
            self._root = -1
            os.rename(self.path, self.dest)
        except OSError as exc:
            self.discard()
            if exc.errno in (errno.ENOTEMPTY, errno.EEXIST, errno.ENOTDIR, errno.EISDIR):
                raise TreeError(f"{self.dest}: exists and is not an empty directory") from None
            raise TreeError(f"{self.dest}: {exc.strerror}") from None

    def discard(self) -> None:
        """Remove the tree (nothing of it is left)."""
        self._close_dirs()
        if self._root >= 0:
            os.close(self._root)
            self._root = -1
        shutil.rmtree(self.path, ignore_errors=True)
        for parent in self._made:
            with contextlib.suppress(OSError):
                parent.rmdir()
        self._made = []


def write_all(fd: int, data: bytes | memoryview) -> None:
    """Write every byte of `data` to `fd`."""
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view) :]
