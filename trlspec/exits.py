"""Exit codes of train_grpo.py: the scheduler reads them to decide whether a failed attempt
is worth retrying (`scheduler.verdicts`); `training.errors` maps failures onto them."""

from __future__ import annotations

import signal

EXIT_OK = 0
EXIT_USAGE = 64  # EX_USAGE: bad arguments or input, a broken reward function; never retried.
EXIT_TRANSIENT = 75  # EX_TEMPFAIL: out of GPU memory, a hub download timed out; retried.
ERROR_PREFIX = "train-grpo: error: "
"""How train_grpo.py's one error line starts (on stderr, so in the attempt's log)."""
DOWNLOAD_FAILED_PREFIX = ERROR_PREFIX + "downloading "
"""An exit-75 error line starting so says a hub download failed (`downloading model X
failed: …`): the scheduler's `download_failed`, an outage of the hub, not the job's fault."""
# Stopped by SIGTERM after saving a checkpoint: the shell's code for a TERM kill, so whoever
# sent it still sees the process killed by it.
EXIT_TERMINATED = 128 + signal.SIGTERM
