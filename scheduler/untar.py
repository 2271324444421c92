"""The tar stream `job pull` receives from a VM, written into a destination directory.

A job can change what its VM account's shell runs (its startup files: docs/security.md),
so the stream is hostile and no library's extraction filter is relied on. This reader
parses the headers itself, as the bytes come (no temporary archive), and accepts only
regular files and directories with plain relative names (`fresh_tree.split_name`); a
symbolic or hard link, a device, a FIFO or an entry of any other kind is left out, counted
and named (`skipped`). Every file is created by `fresh_tree.FreshTree` under a fresh
directory beside DEST, renamed into place once the archive ended whole; the bytes received
are bounded by `--max-size` (a file whose declared size would pass it is refused at its
header) and a file that would fill the disk is refused before it is written. Any refusal
or error is one line (`ExtractError`) and leaves nothing behind."""

from __future__ import annotations

import os
from pathlib import Path

from scheduler.fresh_tree import (
    FREE_SPACE_RESERVE,
    FreshTree,
    TreeError,
    shown,
    split_name,
    write_all,
)

DEFAULT_MAX_SIZE = 200 << 30
"""`job pull --max-size` when none is given: 200 GiB."""
BLOCK = 512
META_MAX = 64 << 10
"""A GNU long name or a pax header bigger than this is not one tar writes."""
MAX_ENTRIES = 1_000_000
SKIPPED_NAMES = 1000
"""At most this many skipped entries are named (all are counted)."""
_REGULAR = (b"0", b"\0", b"7")
_NO_DATA = (b"1", b"2", b"3", b"4", b"5", b"6")
_META = (b"L", b"K", b"x", b"g")


class ExtractError(Exception):
    """The stream was refused or could not be written (one line); nothing is left."""


def _number(field: bytes) -> int:
    """A header's numeric field: octal, or GNU's base-256 (positive only)."""
    if field[:1] == b"\x80":
        return int.from_bytes(field[1:], "big")
    if field[:1] == b"\xff":
        raise ExtractError("corrupt archive (a negative number in a header)")
    text = field.split(b"\0", 1)[0].strip(b" ")
    try:
        return int(text, 8) if text else 0
    except ValueError:
        raise ExtractError("corrupt archive (a header field is not a number)") from None


def _checksum_ok(block: bytes) -> bool:
    stored = _number(block[148:156])
    head = block[:148] + b" " * 8 + block[156:]
    return stored in (sum(head), sum(b - 256 if b > 127 else b for b in head))


def _pax(data: bytes) -> dict[bytes, bytes]:
    """The records of a pax header (`LEN key=value\\n`); `ExtractError` when malformed."""
    records, pos = {}, 0
    while pos < len(data):
        space = data.find(b" ", pos, pos + 21)
        try:
            length = int(data[pos:space]) if space > pos else 0
        except ValueError:
            length = 0
        record = data[space + 1 : pos + length]
        if not 0 < length <= len(data) - pos or not record.endswith(b"\n") or b"=" not in record:
            raise ExtractError("corrupt archive (a pax header)")
        key, value = record[:-1].split(b"=", 1)
        records[key] = value
        pos += length
    return records


class TarSink:
    """Fed the stream's bytes as they come (`feed`), then `finish` (or `abort`)."""

    def __init__(self, dest: Path, *, max_size: int = DEFAULT_MAX_SIZE) -> None:
        self.dest = dest
        self.max_size = max_size
        self.received = 0
        self.skipped: list[str] = []
        self.skipped_count = 0
        try:
            self._tree = FreshTree(dest)
        except TreeError as exc:
            raise ExtractError(str(exc)) from None
        self._head = bytearray()
        self._left = 0  # data bytes of the current entry still to come
        self._pad = 0
        self._fd: int | None = None
        self._mtime = 0
        self._meta: bytearray | None = None  # the data of a long name or pax header
        self._meta_kind = b""
        self._next_name: bytes | None = None
        self._next_size: int | None = None
        self._declared = 0
        self._entries = 0
        self._ended = False

    def feed(self, chunk: bytes) -> None:
        """Take the next bytes of the stream; `ExtractError` when it is refused."""
        self.received += len(chunk)
        if self.received > self.max_size:
            raise ExtractError(f"the stream passed --max-size ({self.max_size} bytes)")
        view, pos = memoryview(chunk), 0
        try:
            while pos < len(view) and not self._ended:
                if self._left:
                    pos = self._data(view, pos)
                elif self._pad:
                    step = min(self._pad, len(view) - pos)
                    self._pad -= step
                    pos += step
                else:
                    step = min(BLOCK - len(self._head), len(view) - pos)
                    self._head += view[pos : pos + step]
                    pos += step
                    if len(self._head) == BLOCK:
                        block = bytes(self._head)
                        self._head.clear()
                        self._header(block)
        except OSError as exc:
            raise ExtractError(f"writing into {self.dest}: {exc.strerror}") from None

    def _data(self, view: memoryview, pos: int) -> int:
        step = min(self._left, len(view) - pos)
        piece = view[pos : pos + step]
        if self._fd is not None:
            write_all(self._fd, piece)
        elif self._meta is not None:
            self._meta += piece
        self._left -= step
        if not self._left:
            self._end_entry()
        return pos + step

    def _header(self, block: bytes) -> None:
        if block == bytes(BLOCK):
            self._ended = True  # the end of the archive (tar pads it with more zeros)
            return
        if not _checksum_ok(block):
            raise ExtractError("corrupt archive (a header's checksum does not match)")
        self._entries += 1
        if self._entries > MAX_ENTRIES:
            raise ExtractError(f"more than {MAX_ENTRIES} entries in the archive")
        kind = block[156:157]
        size = _number(block[124:136])
        name = block[:100].split(b"\0", 1)[0]
        if block[257:263] == b"ustar\0" and block[345] != 0:
            name = block[345:500].split(b"\0", 1)[0] + b"/" + name
        if self._next_name is not None:
            name, self._next_name = self._next_name, None
        if self._next_size is not None:
            size, self._next_size = self._next_size, None
        mode, self._mtime = _number(block[100:108]), _number(block[136:148])
        if kind in _META:
            self._start_meta(kind, size)
        elif kind in _NO_DATA:
            if kind != b"5" or not self._directory(name, mode):
                self._skip(name)
        elif kind in _REGULAR:
            self._file(name, size, mode)
        else:
            self._skip(name)
            self._expect(size)

    def _start_meta(self, kind: bytes, size: int) -> None:
        if size > META_MAX:
            raise ExtractError("corrupt archive (a long name or pax header too big)")
        self._meta, self._meta_kind = bytearray(), kind
        self._expect(size)
        if not size:
            self._end_entry()

    def _expect(self, size: int) -> None:
        """`size` bytes of data (and their padding) follow the header."""
        self._declared += size
        if self._declared > self.max_size:
            raise ExtractError(f"the archive passes --max-size ({self.max_size} bytes)")
        self._left, self._pad = size, -size % BLOCK

    def _directory(self, raw: bytes, mode: int) -> bool:
        name = raw.removeprefix(b"./") if raw != b"./" else b""
        while name.startswith(b"./"):
            name = name[2:]
        if name in (b"", b"."):
            return True  # the archive's own top directory: DEST itself
        parts = split_name(name.removesuffix(b"/"))
        return parts is not None and self._tree.make_dir(parts, mode)

    def _file(self, raw: bytes, size: int, mode: int) -> None:
        name = raw
        while name.startswith(b"./"):
            name = name[2:]
        parts = split_name(name)
        self._expect(size)
        if parts is None:
            self._skip(raw)
        elif size and size > self._tree.free() - FREE_SPACE_RESERVE:
            raise ExtractError(f"not enough free space for {shown(name)} ({size} bytes)")
        else:
            self._fd = self._tree.create_file(parts, mode)
            if self._fd is None:
                self._skip(raw)  # a second entry of the same name
        if not size:
            self._end_entry()

    def _end_entry(self) -> None:
        if self._fd is not None:
            if 0 <= self._mtime < 1 << 34:
                os.utime(self._fd, (self._mtime, self._mtime))
            os.close(self._fd)
            self._fd = None
        if self._meta is not None:
            data, self._meta = bytes(self._meta), None
            if self._meta_kind == b"L":
                self._next_name = data.split(b"\0", 1)[0]
            elif self._meta_kind == b"x":
                records = _pax(data)
                if b"path" in records:
                    self._next_name = records[b"path"]
                if b"size" in records:
                    if not records[b"size"].isdigit() or len(records[b"size"]) > 20:
                        raise ExtractError("corrupt archive (a pax size)")
                    self._next_size = int(records[b"size"])

    def _skip(self, raw: bytes) -> None:
        self.skipped_count += 1
        if len(self.skipped) < SKIPPED_NAMES:
            self.skipped.append(shown(raw.removeprefix(b"./")))

    def finish(self) -> None:
        """The stream ended: rename the tree into place, or `ExtractError` when the
        archive was not whole."""
        if not self._ended or self._left or self._meta is not None:
            raise ExtractError("the archive ended early (incomplete stream)")
        try:
            self._tree.commit()
        except TreeError as exc:
            raise ExtractError(str(exc)) from None

    def abort(self) -> None:
        """Drop everything written so far."""
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None
        self._tree.discard()
