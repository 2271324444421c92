"""`python -m scheduler.requeue [flags]`: the requeue manager daemon, with the flags of
`rlfleet requeue`. The command line lives here, apart from the engine, which never imports
it."""

from scheduler.cli.daemons import requeue_main

requeue_main()
