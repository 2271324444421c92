"""The scheduler's own vLLM server beside a trainer (`vllm_server_gpus:` in a job file,
`job submit --vllm-server-gpus`): the `vllm` role it adds and the trainer's arguments in
vLLM server mode.
"""

from __future__ import annotations

from dataclasses import replace

from scheduler.errors import BadInput
from scheduler.jobspec.model import Ready, Role, addr_variable, port_variable

VLLM_ROLE = "vllm"
VLLM_COMMAND = ("vllm-serve",)
"""The command of a role that is the scheduler's own vLLM server (`command: vllm-serve`):
the launch runs `trl vllm-serve` with the trainer's model on the role's GPUs."""
VLLM_READY_PATH = "/health"
VLLM_READY_TIMEOUT_S = 900
"""Loading a model into vLLM takes minutes; the trainer waits this long for it."""
VLLM_TRAIN_FLAGS = (
    "--use_vllm", "--vllm_mode", "--vllm_server_host", "--vllm_server_port",
    "--vllm_group_port", "--vllm_server_base_url",
)  # fmt: skip
"""train_grpo.py flags the vLLM server mode sets itself: refused in the trainer's args."""


def vllm_train_args() -> tuple[str, ...]:
    """The trainer's arguments in vLLM server mode; the supervisor puts in the values."""
    return (
        "--use_vllm", "--vllm_mode", "server",
        "--vllm_server_host", f"${addr_variable(VLLM_ROLE)}",
        "--vllm_server_port", f"${port_variable(VLLM_ROLE, 'http')}",
        "--vllm_group_port", f"${port_variable(VLLM_ROLE, 'nccl')}",
    )  # fmt: skip


def with_vllm_server(roles: list[Role], gpus: int, *, own_vm: bool = False) -> list[Role]:
    """The roles plus a `vllm` role (`trl vllm-serve` on `gpus` GPUs, ports `http` and
    `nccl`, ready on GET /health; on a VM of its own with `own_vm`, else beside the
    trainer), and the one training role switched to vLLM server mode, started once the
    server is ready. `BadInput` when that cannot be done."""
    trainers = [r for r in roles if r.train is not None]
    if len(trainers) != 1:
        raise BadInput("vllm_server_gpus: needs exactly one role with train:")
    if any(r.name == VLLM_ROLE for r in roles):
        raise BadInput(f"vllm_server_gpus: there is a role called {VLLM_ROLE} already")
    trainer = trainers[0]
    assert trainer.train is not None  # chosen for it
    for i, arg in enumerate(trainer.train.args):
        if arg.split("=", 1)[0] in VLLM_TRAIN_FLAGS:
            raise BadInput(
                f"roles.{trainer.name}.train.args[{i}]: {arg.split('=', 1)[0]} is set by the "
                "vLLM server mode"
            )
    server = Role(
        name=VLLM_ROLE,
        gpus=gpus,
        command=VLLM_COMMAND,
        ports=("http", "nccl"),
        ready=Ready(port="http", path=VLLM_READY_PATH, timeout_s=VLLM_READY_TIMEOUT_S),
        same_vm_as=None if own_vm else trainer.name,
        own_vm=own_vm,
    )
    train = replace(trainer.train, args=trainer.train.args + vllm_train_args())
    switched = replace(
        trainer, train=train, depends_on=tuple(dict.fromkeys((*trainer.depends_on, VLLM_ROLE)))
    )
    return [server] + [switched if r is trainer else r for r in roles]
