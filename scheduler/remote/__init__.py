"""Shell snippets run on a VM, one module per concern: pure functions that only BUILD
POSIX `sh` text and read back what it printed.

Every value that could come from a user (model, dataset, reward names, extra args, paths)
goes through `shlex.quote` (docs/invariants.md, invariant 5), and every file a job can
write is read with a byte bound and never trusted (invariant 9).

- `layout`: where an attempt's files are on its VM (`Attempt`, `stored_attempt`, tokens,
  output directories; invariant 6).
- `output`: reading what a VM printed and the files a job writes (`as_int`, `load_json`,
  the pid file's check).
- `env`: a job's environment (`PASSED_ENV`, `job.env`, the env-file loader); which names a
  job may set is `scheduler.validate.env_key_problem`.
- `rendezvous`: a rank's rendezvous data (`RankRendezvous`), a group supervisor's
  `GroupLaunch`, the free-port probes.
- `launch`: `LaunchSpec`, the training command, the `launch.sh` wrapper, the launch script.
- `watchdog`: the lease and the fence of an attempt the scheduler lost contact with.
- `kill`: the kill script and how an attempt's processes are found.
- `probe`: the attempt status probe the poller runs with nvidia-smi (`scheduler.poll`).
- `logs`: reading an attempt's files for `job logs`.
"""
