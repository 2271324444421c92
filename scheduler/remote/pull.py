"""What `job pull` runs on the VM of a job without a store: its output directory (or one
checkpoint of it) as a tar stream on stdout, every path quoted. Symbolic links go as links
(the reader refuses any that points outside, `scheduler.pull`)."""

from __future__ import annotations

from scheduler.remote.layout import home_path


def tar_command(output_dir: str, checkpoint: int | None) -> str:
    """`tar` of the final outputs (the output directory without its `checkpoint-N/`) or of
    `checkpoint-<checkpoint>`; exit 3 with one line when it is not there."""
    where = home_path(output_dir)
    if checkpoint is not None:
        where = f"{where}/checkpoint-{int(checkpoint)}"
    excludes = "" if checkpoint is not None else "--exclude='./checkpoint-*' "
    return (
        f'cd "$HOME" && if [ ! -d {where} ]; then echo "no such directory on this VM" >&2;'
        f" exit 3; fi && cd {where} && exec tar -cf - {excludes}."
    )
