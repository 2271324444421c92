"""What `job pull` runs on the VM of a job without a store: its output directory (or one
checkpoint of it) as a tar stream on stdout, every path quoted.

tar runs by absolute path (`/usr/bin/env`, then `tar` found on `/usr/bin:/bin` only) in an
empty environment (no `TAR_OPTIONS`, no `LD_PRELOAD`, no PATH the account was given). That
is all a command can do: a job that shares the scheduler's VM account can change what the
account's shell runs before any command (its startup files, e.g. `~/.bashrc`, which bash
reads for commands run over SSH), so the stream is never trusted (`scheduler.untar`:
links, devices and odd names are left out, sizes bounded; docs/security.md)."""

from __future__ import annotations

from scheduler.remote.layout import home_path

TAR_PATH = "/usr/bin:/bin"


def tar_command(output_dir: str, checkpoint: int | None) -> str:
    """`tar` of the final outputs (the output directory without its `checkpoint-N/`) or of
    `checkpoint-<checkpoint>`; exit 3 with one line when it is not there."""
    where = home_path(output_dir)
    if checkpoint is not None:
        where = f"{where}/checkpoint-{int(checkpoint)}"
    excludes = "" if checkpoint is not None else "'--exclude=./checkpoint-*' "
    return (
        f'cd "$HOME" && if [ ! -d {where} ]; then echo "no such directory on this VM" >&2;'
        f" exit 3; fi && cd {where} && exec /usr/bin/env -i PATH={TAR_PATH} LC_ALL=C"
        f" tar --format=gnu -cf - {excludes}."
    )
