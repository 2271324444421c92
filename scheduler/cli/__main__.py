"""`python -m scheduler.cli` runs the rlfleet CLI."""

from scheduler.cli import main

main()
