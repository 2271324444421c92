"""The daemon commands (`rlfleet poller`, `dispatcher`, `requeue`, `up`).

Each daemon module defines its click command; this module collects them for the CLI.
"""

from __future__ import annotations

import click

COMMANDS: list[click.Command] = []
