"""Job spec files (`rlfleet job submit -f job.yaml`): parse and validate the whole file
before anything is inserted.

A job is one or more named roles. Each role runs either a command (an argv list, or a
string split with `shlex.split`, never a shell) or the training entrypoint (`train:` with
the model, dataset, reward functions and train_grpo.py arguments, as `job submit`'s
flags give them). A bad file is `BadInput` with one line that names the field, e.g.
`roles.vllm.gpus: must be an integer 0..64`.

Pure: no database, no network; `scheduler.cli.jobfile` turns a `GroupSpec` into a job row.
The package's modules, each importing only those before it:

- `model`: the roles and the group (`Role`, `GroupSpec` with `layout()` and `to_data`);
- `fields`: the checks of one field (integers, text, names, commands), on
  `scheduler.validate`'s rules;
- `recipe`: the `train:` keys and a recipe's (`recipe_train`);
- `roles`: one role, and the checks across roles;
- `vllm`: the scheduler's own vLLM server role;
- `parse`: a whole file's data (`parse_data`);
- `reading`: the file's bytes as bounded YAML 1.2 (`load_file`, `parse_text`).
"""

from scheduler.jobspec.fields import NAME_RE
from scheduler.jobspec.model import (
    RENDEZVOUS_PORT,
    RESTART_NEVER,
    RESTART_ON_FAILURE,
    GroupNode,
    GroupSpec,
    Ready,
    Role,
    Train,
    addr_variable,
    port_variable,
)
from scheduler.jobspec.parse import parse_data
from scheduler.jobspec.reading import MAX_FILE_BYTES, load_file, parse_text
from scheduler.jobspec.recipe import RECIPE_OWNED, recipe_train
from scheduler.jobspec.vllm import VLLM_COMMAND, VLLM_ROLE, vllm_train_args, with_vllm_server

__all__ = [
    "MAX_FILE_BYTES",
    "NAME_RE",
    "RECIPE_OWNED",
    "RENDEZVOUS_PORT",
    "RESTART_NEVER",
    "RESTART_ON_FAILURE",
    "VLLM_COMMAND",
    "VLLM_ROLE",
    "GroupNode",
    "GroupSpec",
    "Ready",
    "Role",
    "Train",
    "addr_variable",
    "load_file",
    "parse_data",
    "parse_text",
    "port_variable",
    "recipe_train",
    "vllm_train_args",
    "with_vllm_server",
]
