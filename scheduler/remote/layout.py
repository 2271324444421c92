"""Where an attempt's files are on its VM (docs/invariants.md, invariant 6).

`~/.rlfleet/<installation>/jobs/<job_id>/<attempt>-<token>/` holds `train.log`, `pid`,
`exit_code`, `progress.json` and `launch.sh` of one attempt; `<installation>` is the
database's UUID and `<token>` is drawn when the attempt is claimed, so nothing another
installation, an earlier database or another attempt left on the VM is ever read as this
attempt's. Outputs default to `~/.rlfleet/<installation>/outputs/<job_id>`.
"""

from __future__ import annotations

import re
import secrets
import shlex
from dataclasses import dataclass

from scheduler.remote.output import output_lines

DIR_MARK = "rlfleet-dir"
"""Starts the line on which the launch and kill scripts print the attempt's absolute directory."""
ROOT = ".rlfleet"
"""rlfleet's directory on a VM, relative to $HOME."""
_UUID = re.compile(r"[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}")
TOKEN_RE = re.compile(r"[0-9a-f]{16}")
"""What a launch token is (`new_token`)."""


def new_token() -> str:
    """A fresh launch token: 16 random lowercase hex digits (64 bits)."""
    return secrets.token_hex(8)


def check_installation(installation: str) -> str:
    """`installation` if it is a lowercase UUID; else `ValueError`."""
    if not _UUID.fullmatch(installation):
        raise ValueError(f"not an installation id: {installation!r}")
    return installation


@dataclass(frozen=True)
class Attempt:
    """One attempt of a job and where its files are on its VM (docs/invariants.md, invariant 6).

    `path` is the absolute directory the launch reported (None until it did); then every
    script uses it, whatever $HOME the caller's shell has. Without it the directory is
    `$HOME/<relative>`. Every field is checked: the names go into shell text.
    """

    installation: str
    job_id: int
    attempt: int
    token: str
    path: str | None = None

    def __post_init__(self) -> None:
        check_installation(self.installation)
        if not TOKEN_RE.fullmatch(self.token):
            raise ValueError(f"not a launch token: {self.token!r}")
        if self.job_id < 1 or self.attempt < 1:
            raise ValueError(f"no attempt {self.attempt} of job {self.job_id}")
        if self.path is not None and not (
            self.path.startswith("/")
            and self.path.endswith("/" + self.relative)
            and "\n" not in self.path
            and "\0" not in self.path
        ):
            raise ValueError(f"not the directory of {self.relative}: {self.path!r}")

    @property
    def relative(self) -> str:
        """The directory relative to $HOME: `.rlfleet/<installation>/jobs/<id>/<n>-<token>`."""
        return f"{job_base(self.installation, self.job_id)}/{int(self.attempt)}-{self.token}"

    def word(self) -> str:
        """The directory as one quoted shell word."""
        return shlex.quote(self.path) if self.path is not None else home_path(self.relative)

    def located(self, path: str | None) -> Attempt:
        """The same attempt with its recorded directory (None or invalid: unchanged)."""
        try:
            return Attempt(self.installation, self.job_id, self.attempt, self.token, path)
        except ValueError:
            return self


def stored_attempt(
    installation: str,
    job_id: int,
    attempt: int,
    token: str | None,
    attempt_dir: str | None = None,
) -> Attempt | None:
    """The `Attempt` a job or leftover row names, or None when the row has no (valid)
    token: such an attempt has no directory anyone may look at."""
    if token is None or attempt < 1:
        return None
    try:
        run = Attempt(installation, job_id, attempt, token)
    except ValueError:
        return None
    return run.located(attempt_dir)


def job_base(installation: str, job_id: int) -> str:
    """The directory of every attempt of a job, relative to $HOME."""
    return f"{ROOT}/{check_installation(installation)}/jobs/{int(job_id)}"


def default_output_dir(installation: str, job_id: int) -> str:
    """Where a job's outputs go when it names no `output_dir` (`~` is the VM's $HOME):
    per installation and per job, shared by its attempts so that `--resume auto` works."""
    return f"~/{ROOT}/{check_installation(installation)}/outputs/{int(job_id)}"


PRIVATE_TREE = f'umask 077; chmod go-rwx "$HOME/{ROOT}" 2>/dev/null'
"""The shell line every script that creates part of the VM tree runs first: what it
creates (attempt directories, logs, launch scripts, output directories, what the training
and the store agent write under them) is the account's alone, and `~/.rlfleet` an older
rlfleet left open (0755) is closed, which keeps another account on the VM out of every
existing directory below it (docs/security.md)."""


def home_path(path: str) -> str:
    """A shell word for `path`: `~/x` and relative paths are under $HOME, all quoted."""
    if path == "~":
        return '"$HOME"'
    if path.startswith("~/"):
        path = path[2:]
    if path.startswith("/"):
        return shlex.quote(path)
    return '"$HOME"/' + shlex.quote(path)


def parse_dir(stdout: str, run: Attempt) -> str | None:
    """The `rlfleet-dir` a script printed, if it is `run`'s directory."""
    for line in output_lines(stdout):
        if line.startswith(DIR_MARK + " "):
            return run.located(line[len(DIR_MARK) + 1 :]).path
    return None
