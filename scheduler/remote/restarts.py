"""A job group's restarts in place, as its supervisor counts them in the attempt's
`roles.json` (`scheduler.supervisor`): read by the attempt status probe in the poll's round
trip (`restart_lines`, a byte bound, only a regular file) and parsed without trusting it
(`parse_restarts`: the file is in a directory the job can write, docs/invariants.md,
invariant 9)."""

from __future__ import annotations

from dataclasses import dataclass

from scheduler.remote.output import as_int, head_bytes, load_json, output_lines

ROLES_MARK = "rlfleet-roles"
ROLES_BYTES = 4096
"""At most this much of an attempt's roles.json is read by a poll (a few hundred bytes for
the most roles a group has; a bigger one is cut, and then unreadable)."""
MAX_ROLE_RESTARTS = 100
"""Most restarts a role may ask for (`jobspec.roles.MAX_ROLE_RESTARTS`): a count above it
is not what a supervisor writes."""
MAX_ROLES = 16
"""Most roles a group has (`jobspec.roles.MAX_ROLES`): a file naming more is garbage."""
RESTART_CAUSES = ("exited", "unresponsive")
"""`supervisor.RESTART_CAUSES`."""


@dataclass(frozen=True)
class RoleRestarts:
    """How often the supervisor restarted one role in place, and why it did the last time:
    `cause` `exited` (with `exit_code`) or `unresponsive` (its readiness check failed)."""

    count: int
    cause: str | None = None
    exit_code: int | None = None

    def why(self) -> str:
        """The latest restart's cause in words, for an event."""
        if self.cause == "exited" and self.exit_code is not None:
            return f"it exited with {self.exit_code}"
        if self.cause == "unresponsive":
            return "it stopped answering its readiness check"
        return "it failed"


def restart_lines(job_id: int, attempt: int) -> list[str]:
    """Shell lines (with `$d` the attempt's directory) printing its roles.json on one line
    after `rlfleet-roles <id> <attempt> `, when there is one."""
    j, a = int(job_id), int(attempt)
    read = head_bytes(ROLES_BYTES, '"$d/roles.json"')
    return [
        f'if [ -f "$d/roles.json" ] && [ -s "$d/roles.json" ]; then'
        f' printf "%s " "{ROLES_MARK} {j} {a}";'
        f' {read} | tr -d "\\n\\r"; echo; fi',
    ]


def parse_restarts(stdout: str) -> dict[tuple[int, int], dict[str, RoleRestarts]]:
    """The restarts each attempt's roles.json counts, by (job id, attempt) and role name:
    only roles with a plausible name and a count 1..MAX_ROLE_RESTARTS; a file that is not
    such JSON counts none. Never raises."""
    out: dict[tuple[int, int], dict[str, RoleRestarts]] = {}
    for line in output_lines(stdout):
        if not line.startswith(ROLES_MARK + " "):
            continue
        parts = line.split(" ", 3)
        if len(parts) != 4:
            continue
        job_id, attempt = as_int(parts[1]), as_int(parts[2])
        data = load_json(parts[3])
        if job_id is None or attempt is None or not isinstance(data, dict):
            continue
        if len(data) > MAX_ROLES:
            continue
        roles = {name: seen for name, seen in _roles(data)}
        if roles:
            out[(job_id, attempt)] = roles
    return out


def _roles(data: dict[object, object]) -> list[tuple[str, RoleRestarts]]:
    from scheduler.jobspec.fields import NAME_RE

    found = []
    for name, entry in data.items():
        if not isinstance(name, str) or not NAME_RE.fullmatch(name) or not isinstance(entry, dict):
            continue
        count = _int(entry.get("restarts"), 1, MAX_ROLE_RESTARTS)
        if count is None:
            continue
        cause = entry.get("restart_cause")
        cause = cause if cause in RESTART_CAUSES else None
        code = _int(entry.get("restart_exit"), 0, 255) if cause == "exited" else None
        found.append((name, RoleRestarts(count, cause, code)))
    return found


def _int(value: object, lo: int, hi: int) -> int | None:
    """`value` when it is an integer (not a boolean) in lo..hi."""
    if isinstance(value, bool) or not isinstance(value, int) or not lo <= value <= hi:
        return None
    return value


def recorded_restarts(value: object, attempt: int) -> dict[str, int]:
    """The restarts of each role that `job_nodes.role_restarts` (`{"attempt": N, "roles":
    {role: restarts}}`) says the poller recorded for `attempt`: {} for a value of another
    attempt or of another shape."""
    if not isinstance(value, dict) or value.get("attempt") != attempt:
        return {}
    roles = value.get("roles")
    if not isinstance(roles, dict):
        return {}
    return {
        str(name): count
        for name, count in roles.items()
        if isinstance(count, int) and not isinstance(count, bool) and 0 <= count < 2**31
    }
