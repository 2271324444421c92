"""How `rlfleet job show` words a job's parts: its roles' restarts, its store, its events'
reasons and its training progress (pure formatting of what `scheduler.control` read)."""

from __future__ import annotations

from typing import Any

from scheduler.cli._common import fmt_time
from scheduler.cli.job_pull import size_text


def restarts_cell(role: dict[str, Any]) -> str:
    """A role's restarts in place, `N of MAX` (`-`: it never restarts in place)."""
    if role.get("restart") != "on-failure":
        return "-"
    return f"{role.get('restarts', 0)} of {role.get('max_restarts', 0)}"


def store_lines(job: dict[str, Any]) -> list[tuple[str, str]]:
    """`job show`'s lines about the store: where the outputs are, the checkpoints in the
    store (step, size, time) and the last upload error, as the VM's agent reported them."""
    if not job.get("store"):
        return []
    status = job.get("store_status") or {}
    lines = []
    if status.get("final"):
        lines.append(("outputs", "in the store (rlfleet job pull " + str(job["id"]) + ")"))
    checkpoints = status.get("checkpoints") or []
    shown = [
        f"{c['step']} ({size_text(c['bytes'] or 0)}, {c.get('at') or '-'})"
        for c in reversed(checkpoints)
    ]
    lines.append(("stored steps", ", ".join(shown) if shown else "none yet"))
    if status.get("restored") is not None:
        lines.append(("restored from", f"checkpoint-{status['restored']}"))
    if status.get("last_error"):
        lines.append(("upload error", f"{status['last_error']} (at {status.get('error_at')})"))
    return lines


def event_reason(event: dict[str, Any]) -> str:
    """An event's reason, with how often a waiting move repeated: `… (×40, last at T)`."""
    reason = event["reason"] or ""
    if event.get("count", 1) > 1:
        reason += f" (×{event['count']}, last at {fmt_time(event['last_at'])})"
    return reason


def progress_line(progress: dict[str, Any]) -> str:
    """`step 40/500 (8%), reward 0.61, loss 0.02, eta 13m` from progress.json."""
    parts = []
    step, total = progress.get("step"), progress.get("max_steps")
    if isinstance(step, int) and isinstance(total, int) and total > 0:
        parts.append(f"step {step}/{total} ({100 * step // total}%)")
    for key in ("reward", "loss"):
        value = progress.get(key)
        if isinstance(value, int | float):
            parts.append(f"{key} {value:.4g}")
    eta = progress.get("eta_s")
    if isinstance(eta, int | float):
        parts.append(f"eta {int(eta) // 60}m{int(eta) % 60:02d}s")
    if progress.get("status"):
        parts.append(str(progress["status"]))
    return ", ".join(parts) or "-"
