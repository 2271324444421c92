"""How the scheduler's own Python runs on a VM: isolated from every job (docs/invariants.md,
invariant 12; docs/security.md, "A job's workdir").

Every helper the scheduler runs with the VM's python (the wrapper's check of python and
entrypoint, the poll's, the store agent in each of its modes, the group supervisor, the
workdir receiver, the free-port probes) runs as `python -I`: isolated mode puts neither
the working directory nor a script's directory on `sys.path`, skips the user site and
ignores every `PYTHON*` variable. So nothing a job left in its workdir, its attempt
directory or `$HOME` (`training/`, `scheduler/`, `json.py`, `site.py`…) is imported in
their place, whatever their working directory (the launch still runs them from the
attempt directory, never from the job's `work/`). `-I` exists since Python 3.4 (`-P`,
only since 3.11, is not needed: `-I` implies it).

A VM whose scheduler installation is found through `PYTHONPATH` (set in its `~/.rlfleet/env`,
the VM's file, never a job's `job.env`) keeps working: that value is passed to the helper
as its first argument and put in front of `sys.path` explicitly (`BOOT`), its absolute
entries only (an empty or relative one would name the working directory again).
"""

from __future__ import annotations

import json
import shlex
from collections.abc import Sequence

VM_PATH_WORD = '"${PYTHONPATH:-}"'
"""The helper's first argument: the VM-level PYTHONPATH of the shell that runs it (the
wrapper and the poll load `~/.rlfleet/env` into that shell and nothing of the job's)."""

BOOT = 'import sys; sys.path[:0] = [p for p in sys.argv.pop(1).split(":") if p[:1] == "/"]; '
"""The first statement of every helper given `VM_PATH_WORD`: its absolute entries go in
front of `sys.path`, where PYTHONPATH would have put them."""


def isolated_words(
    python: str, code: str, args: Sequence[str] = (), *, vm_path: bool = False
) -> list[str]:
    """`python -I -c CODE [VM PYTHONPATH] ARGS…` as shell words; `code`, `python` quoted
    here, `args` already shell words (quoted by the caller). With `vm_path`, `code` must
    start with `BOOT` (which takes the VM-level PYTHONPATH argument off `sys.argv`)."""
    if vm_path and not code.startswith(BOOT):
        raise ValueError("a helper given the VM's PYTHONPATH starts with BOOT")
    words = [shlex.quote(python), "-I", "-c", shlex.quote(code)]
    return [*words, *([VM_PATH_WORD] if vm_path else []), *args]


def module_words(python: str, module: str, args: Sequence[str] = ()) -> list[str]:
    """Run `module` (the scheduler's, e.g. `scheduler.store.agent`) as `python -m` would,
    isolated, with the VM-level PYTHONPATH: `args` (shell words) become its `sys.argv[1:]`."""
    run = f'runpy.run_module({json.dumps(module)}, run_name="__main__", alter_sys=True)'
    return isolated_words(python, BOOT + "import runpy; " + run, args, vm_path=True)


ENTRY_CHECK_CODE = BOOT + (
    "import os\n"
    "entry, work = sys.argv[1], sys.argv[2]\n"
    'if entry.endswith(".py"):\n'
    "    if work and not os.path.isabs(entry):\n"
    "        sys.exit(0)\n"
    '    open(os.path.join(os.path.expanduser("~"), entry)).close()\n'
    "    sys.exit(0)\n"
    'top = entry.partition(".")[0]\n'
    "if work and top:\n"
    "    from importlib.machinery import PathFinder\n"
    "    if PathFinder.find_spec(top, [work]) is not None:\n"
    "        sys.exit(0)\n"
    "import importlib.util\n"
    'sys.exit(0 if importlib.util.find_spec(entry) else "No module named " + entry)\n'
)
"""The check that the VM can start training (`entry_check_words`): run isolated with the
VM-level PYTHONPATH, it exits 0 when the VM's python runs and finds the entrypoint in the
VM's own installation (a readable `.py` file, relative to $HOME; an importable module),
else its last line says why. The job's workdir (`work`, empty for a job without one) is
looked at without running anything of it: a relative `.py` entrypoint is then resolved
inside it, and a module whose top-level package or module the workdir ships (a
`PathFinder` look-up, which runs no code) is the job's own: either is the job's business,
whose failure is its own exit code, counted, never the VM's fault."""
