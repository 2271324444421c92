"""The daemon commands (`rlfleet poller`, `dispatcher`, `requeue`, `up`).

Each daemon module defines its click command; this module collects them for the CLI.
"""

from __future__ import annotations

import click

COMMANDS: list[click.Command] = []


def _add_up() -> None:
    # Imported here, not at the top, so that a daemon module's own import of this list
    # cannot form a cycle with scheduler.up.
    from scheduler.up import command as up_command

    COMMANDS.append(up_command)


_add_up()


def _add_poller() -> None:
    from scheduler.gpu_poller import command as poller_command

    COMMANDS.append(poller_command)


_add_poller()


def _add_dispatcher() -> None:
    from scheduler.dispatcher import command as dispatcher_command

    COMMANDS.append(dispatcher_command)


_add_dispatcher()


def _add_requeue() -> None:
    from scheduler.requeue import command as requeue_command

    COMMANDS.append(requeue_command)


_add_requeue()
