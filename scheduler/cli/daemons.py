"""The daemon commands (`rlfleet up`, `poller`, `dispatcher`, `requeue`).

Each daemon module defines its click command; this module collects them for the CLI.
"""

from __future__ import annotations

import click


def _collect() -> list[click.Command]:
    # Imported here, not at the top: the daemon modules import the CLI's helpers, and
    # importing them from the package's own initialisation would form a cycle.
    from scheduler import dispatcher, gpu_poller, requeue, up

    return [up.command, gpu_poller.command, dispatcher.command, requeue.command]


COMMANDS: list[click.Command] = _collect()
