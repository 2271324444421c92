"""`python -m scheduler.gpu_poller [flags]`: the poller daemon, with the flags of `rlfleet
poller`. The command line lives here, apart from the engine, which never imports it."""

from scheduler.cli.daemons import poller_main

poller_main()
