"""The classification of train_grpo.py's failures into its exit codes (`trlspec.exits`,
which the scheduler reads to decide whether a failed attempt is worth retrying).
"""

from __future__ import annotations

import os

from trlspec.exits import EXIT_OK, EXIT_TERMINATED, EXIT_TRANSIENT, EXIT_USAGE

__all__ = [
    "EXIT_OK",
    "EXIT_TERMINATED",
    "EXIT_TRANSIENT",
    "EXIT_USAGE",
    "TransientError",
    "UsageError",
    "exit_code_for",
    "is_network_timeout",
    "is_out_of_memory",
    "one_line",
]

# Exception class names (anywhere in the cause chain) that mean the network let us down,
# from requests, urllib3, httpx and huggingface_hub; matched by name to avoid importing them.
_TRANSIENT_NETWORK_ERRORS = frozenset(
    {
        "Timeout",
        "ReadTimeout",
        "ConnectTimeout",
        "ReadTimeoutError",
        "ConnectTimeoutError",
        "TimeoutException",
        "PoolTimeout",
        "ConnectError",
        "RemoteProtocolError",
    }
)


class UsageError(Exception):
    """Bad arguments or input; the message is one line meant for the user."""


class TransientError(Exception):
    """A failure that another attempt may not meet (network, memory pressure)."""


def is_out_of_memory(exc: BaseException) -> bool:
    """True for torch's OutOfMemoryError and the RuntimeError older CUDA paths raise instead."""
    return type(exc).__name__ == "OutOfMemoryError" or "CUDA out of memory" in str(exc)


def is_network_timeout(exc: BaseException, *, hub: bool = True) -> bool:
    """True when `exc` or anything in its cause chain is a timeout or failed connection.

    With `hub` (loading models and datasets), a refused connection while HF_HUB_OFFLINE or
    HF_DATASETS_OFFLINE is set is not transient: offline by choice, retrying cannot help.
    """
    seen: set[int] = set()
    current: BaseException | None = exc
    while current is not None and id(current) not in seen:
        seen.add(id(current))
        name = type(current).__name__
        if isinstance(current, TimeoutError) or name in _TRANSIENT_NETWORK_ERRORS:
            return True
        # Refused/reset connections are transient too, unless we are offline on purpose: then
        # the hub is unreachable by design and retrying cannot help.
        if isinstance(current, ConnectionError) and not (hub and _offline_by_choice(current)):
            return True
        current = current.__cause__ or current.__context__
    return False


def _offline_by_choice(exc: BaseException) -> bool:
    if type(exc).__name__ == "OfflineModeIsEnabled" or "OfflineModeIsEnabled" in str(exc):
        return True
    flags = (os.environ.get(name, "").lower() for name in ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE"))
    return any(flag in {"1", "true", "yes", "on"} for flag in flags)


def exit_code_for(exc: BaseException) -> int | None:
    """Return 64 or 75 for the failures the scheduler must tell apart, None for anything else."""
    if isinstance(exc, UsageError):
        return EXIT_USAGE
    if isinstance(exc, TransientError) or is_out_of_memory(exc) or is_network_timeout(exc):
        return EXIT_TRANSIENT
    return None


def one_line(exc: BaseException) -> str:
    """The exception's message squeezed onto one line (first non-empty line, else the type name)."""
    for line in str(exc).splitlines():
        if line.strip():
            return line.strip()
    return type(exc).__name__
