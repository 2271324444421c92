"""`python -m scheduler.dispatcher [flags]`: the dispatcher daemon, with the flags of
`rlfleet dispatcher`. The command line lives here, apart from the engine, which never
imports it."""

from scheduler.cli.daemons import dispatcher_main

dispatcher_main()
