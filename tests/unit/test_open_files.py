"""`rlfleet up` raises its own open-files limit to what the system allows it."""

from __future__ import annotations

import json
import subprocess
import sys

PROBE = """
import json, resource
resource.setrlimit(resource.RLIMIT_NOFILE, (256, 1024))
from scheduler.up import raise_open_files_limit
now = raise_open_files_limit()
print(json.dumps([now, *resource.getrlimit(resource.RLIMIT_NOFILE)]))
"""


def test_up_raises_its_soft_open_files_limit_to_the_hard_one() -> None:
    # Given a process whose soft limit is 256 of a hard 1,024
    out = subprocess.run(
        [sys.executable, "-c", PROBE], capture_output=True, text=True, check=True, timeout=60
    ).stdout
    # When `up` raises it, then it may open 1,024 files, and the hard limit is unchanged
    assert json.loads(out.splitlines()[-1]) == [1024, 1024, 1024]
