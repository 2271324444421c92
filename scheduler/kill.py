"""Kill one attempt on its VM over SSH: the one way cancel, the dispatcher and the leftover
sweep (`scheduler.leftovers`) all do it, so they read the answer the same way.

`KillResult.dead` is the only thing that may free an attempt's GPUs: it is true when the
kill script reports that the attempt runs no process and never will (see
`remote.kill.kill_script`). Anything else (VM unreachable, script failed, a launch that holds
its lock but wrote no pid) leaves the attempt's fate unknown, and its GPUs stay blocked.
"""

from __future__ import annotations

from dataclasses import dataclass

from scheduler.remote.jobuser import JobUserProblem, checked_job_user
from scheduler.remote.kill import DEAD_KILL_OUTCOMES, PID_WAIT_S, kill_script, parse_kill
from scheduler.remote.layout import Attempt, parse_dir
from scheduler.remote.output import parse_exit
from scheduler.transport import Transport, TransportError, VMTarget

SSH_MARGIN_S = 15.0
"""Time allowed beyond the grace period (and the wait for a starting launch's pid)."""


@dataclass(frozen=True)
class KillResult:
    """What killing one attempt came to."""

    outcome: str | None
    """The kill script's word (`fenced`, `gone`, `terminated`, `killed`, `nopid`), or None
    when it gave none."""
    error: str | None = None
    """Why there is no outcome: the VM did not answer, or the script failed."""
    exit_code: int | None = None
    """With `gone`: the exit code the attempt had recorded (None: it recorded none)."""
    path: str | None = None
    """With `gone` after an exit: the attempt's absolute directory."""

    @property
    def dead(self) -> bool:
        """The attempt runs no process and never will: its GPUs may be used again."""
        return self.outcome in DEAD_KILL_OUTCOMES

    def describe(self) -> str:
        """One word or phrase for logs and the CLI."""
        return self.outcome or self.error or "unknown"


async def kill_attempt(
    transport: Transport,
    target: VMTarget,
    run: Attempt,
    *,
    grace_s: float,
    launched: bool = False,
) -> KillResult:
    """TERM, then KILL after `grace_s`, the attempt `run` on `target`. `launched`: its
    launch was confirmed (a pid is recorded), so a missing pid file is not fenced but
    reported as `missing` (see `remote.kill.kill_script`).

    Never raises for the VM's sake: an SSH failure is a result with `error` set."""
    job_user = checked_job_user(target)
    if isinstance(job_user, JobUserProblem):
        return KillResult(None, job_user.why)
    script = kill_script(run, grace_s, launched=launched, job_user=job_user)
    try:
        result = await transport.run(target, script, timeout=grace_s + PID_WAIT_S + SSH_MARGIN_S)
    except TransportError as exc:
        return KillResult(None, f"unreachable: {str(exc) or type(exc).__name__}")
    outcome = parse_kill(result.stdout)
    if outcome is None or not result.ok:
        error = (result.stderr or result.stdout).strip()[:200]
        return KillResult(None, error or f"kill script exited {result.exit_status}")
    if outcome != "gone":
        return KillResult(outcome)
    return KillResult(
        outcome, exit_code=parse_exit(result.stdout), path=parse_dir(result.stdout, run)
    )
