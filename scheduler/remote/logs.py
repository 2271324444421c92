"""Reading an attempt's files for `job logs`: which files may be read
(`ATTEMPT_FILES`, a group role's `<role>.log`), the byte-exact reader, and how an earlier
attempt's directories are found (`tokens_script`).
"""

from __future__ import annotations

import re

from scheduler.remote.layout import TOKEN_RE, Attempt, home_path, job_base
from scheduler.remote.output import output_lines

NO_FILE_EXIT = 3
"""Exit status of the read snippets when the file does not exist (yet)."""
ATTEMPT_FILES = frozenset(
    {"train.log", "progress.json", "pid", "exit_code", "launch.sh", "roles.json"}
)
_ROLE_LOG = re.compile(r"[a-z][a-z0-9_]{0,31}\.log")
"""`<role>.log`: the output of one role of a job group (role names as `jobspec.NAME_RE`)."""


def role_log(role: str) -> str:
    """The attempt file holding a job group role's output; `ValueError` for a bad name."""
    name = f"{role}.log"
    if not _ROLE_LOG.fullmatch(name):
        raise ValueError(f"not a role name: {role!r}")
    return name


READ_CHUNK_BYTES = 1 << 20
"""Most bytes one `read_file_script(..., hex=True)` returns; a reader loops for more."""


def read_file_script(
    run: Attempt, name: str, *, offset: int = 0, hex: bool = False, limit: int | None = None
) -> str:
    """Print one file of the attempt directory from byte `offset` (at most `limit` bytes);
    exit 3 if it is missing. With `hex`, the bytes are printed as hex digits (`od`), so
    that a reader gets exactly the bytes written, valid UTF-8 or not (`bytes.fromhex`)."""
    if name not in ATTEMPT_FILES and not _ROLE_LOG.fullmatch(name):
        raise ValueError(f"not an attempt file: {name}")
    command = f'tail -c +{int(offset) + 1} "$f"'
    if limit is not None:
        command += f" | head -c {max(0, int(limit))}"
    if hex:
        command += " | od -An -v -tx1"
    return f'f={run.word()}/{name}; [ -f "$f" ] || exit {NO_FILE_EXIT}; {command}'


TOKENS_MARK = "rlfleet-token"


def tokens_script(installation: str, job_id: int, attempt: int) -> str:
    """Print `rlfleet-token <token>` for each directory of attempt `attempt` of the job
    under this installation (there is one unless the database was restored from a backup):
    how `job logs --attempt N` finds an earlier attempt, whose token the job row no longer
    holds. Other installations' directories are never listed."""
    base = home_path(job_base(installation, job_id))
    return (
        f"for p in {base}/{int(attempt)}-*; do "
        f'[ -d "$p" ] && echo "{TOKENS_MARK} ${{p##*-}}"; done; true'
    )


def parse_tokens(stdout: str) -> list[str]:
    """The well-formed tokens `tokens_script` printed."""
    found = []
    for line in output_lines(stdout):
        parts = line.split()
        if len(parts) == 2 and parts[0] == TOKENS_MARK and TOKEN_RE.fullmatch(parts[1]):
            found.append(parts[1])
    return found
