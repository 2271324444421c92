"""The tar stream `job pull` receives from a VM, written into a destination directory.

A job can change what its VM account's shell runs (its startup files), so the stream is
hostile: nothing in it is trusted."""

from __future__ import annotations

import os
import tarfile
import tempfile
from pathlib import Path

DEFAULT_MAX_SIZE = 200 << 30
"""`job pull --max-size` when none is given: 200 GiB."""


class ExtractError(Exception):
    """The stream was refused or could not be written (one line); nothing is left."""


class TarSink:
    """Fed the stream's bytes as they come (`feed`), then `finish` (or `abort`)."""

    def __init__(self, dest: Path, *, max_size: int = DEFAULT_MAX_SIZE) -> None:
        self.dest = dest
        self.max_size = max_size
        self.received = 0
        self.skipped: list[str] = []
        dest.parent.mkdir(parents=True, exist_ok=True)
        fd, name = tempfile.mkstemp(prefix=".rlfleet-pull-", suffix=".tar", dir=dest.parent)
        self._name = name
        self._out = os.fdopen(fd, "wb")

    def feed(self, chunk: bytes) -> None:
        self._out.write(chunk)
        self.received += len(chunk)

    def finish(self) -> None:
        self._out.close()
        self.dest.mkdir(parents=True, exist_ok=True)
        try:
            with tarfile.open(self._name) as tar:
                for member in tar:
                    try:
                        tar.extract(member, self.dest, filter="data")
                    except tarfile.FilterError:
                        self.skipped.append(member.name)
        except (tarfile.TarError, OSError) as exc:
            raise ExtractError(f"unreadable archive: {exc}") from None
        finally:
            Path(self._name).unlink(missing_ok=True)

    def abort(self) -> None:
        self._out.close()
        Path(self._name).unlink(missing_ok=True)
