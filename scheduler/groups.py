"""Job groups at launch: what each role of a group runs, on which GPUs, with which ports.

Pure: builds the supervisor's `group.json` (`remote.rendezvous.GroupLaunch`) from a validated
`jobspec.GroupSpec`, the claimed GPUs, the VM and the ports chosen for this attempt. No
shell ever runs these commands: argv lists go to the supervisor as they are, with
`$RLFLEET_*` variables put in by the supervisor itself.

A group runs on the one VM the attempt claimed, or, when roles have a VM of their own
(`own_vm`) or run on several nodes, on the VMs of its layout (`GroupSpec.layout`,
docs/decisions.md, "Where a job group runs"): each VM's supervisor gets only the roles of
that VM, with their GPUs as consecutive slices of that VM's claimed GPUs in the file's role
order, and every role's address and ports, wherever it runs. A role on several nodes runs
one rank per VM, told where it stands as a rank of a multi-node job is (`MASTER_ADDR`,
`MASTER_PORT` on its rank 0's VM, `RLFLEET_NODE_RANK`…); a training role's ranks start
through accelerate's multi-machine launcher.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from scheduler.jobspec import (
    RENDEZVOUS_PORT,
    RESTART_ON_FAILURE,
    VLLM_COMMAND,
    GroupSpec,
    Role,
    addr_variable,
    port_variable,
)
from scheduler.remote.launch import launcher_argv
from scheduler.remote.rendezvous import GroupLaunch, RankRendezvous, rendezvous_env

GROUP_GRACE_S = 5.0
"""Once every primary role exited 0, the others get TERM, and KILL after this long."""
ROLE_STOP_GRACE_S = 3.0
"""TERM → KILL of the roles when the supervisor stops them; shorter than the watchdog's and
the kill script's grace, so the roles are gone before the supervisor is."""
VLLM_MODULE = ("-m", "trl.cli.main", "vllm-serve")
"""`trl vllm-serve`, run by the VM's python (no PATH lookup)."""
LOOPBACK = "127.0.0.1"
"""Every role's address in a group on one VM: its services are never on the network."""
RESTART_BACKOFF_S = 1.0
"""A role restarted in place starts again after this long, doubled for each restart of the
same attempt (1 s, 2 s, 4 s…), at most `RESTART_BACKOFF_MAX_S`."""
RESTART_BACKOFF_MAX_S = 30.0
LIVENESS_EVERY_S = 5.0
"""Once a role with a readiness check has passed it, its supervisor keeps asking it this
often while the group runs (a liveness check)."""
LIVENESS_FAIL_S = 30.0
"""A role that passed its readiness check and then fails it for this long has stopped
answering: it is restarted in place (`restart: on-failure`) or the group stops."""
TOKEN_ENV = "RLFLEET_GROUP_TOKEN"
"""The attempt's token (`group_token`): in the environment of every role of the attempt,
through the launch's job.env (mode 0600), never in `group.json`, the database or a log."""


def group_token() -> str:
    """A new token for one attempt of a job group (128 random bits, hex)."""
    import secrets

    return secrets.token_hex(16)


@dataclass(frozen=True)
class GroupPlace:
    """Where a group's attempt runs: the VM's python and entrypoint, its address for the
    roles' traffic, the claimed GPUs (UUIDs, else indices), the output directory and the
    attempt number."""

    python: str
    entrypoint: str
    address: str
    gpus: Sequence[str]
    output_dir: str
    attempt: int


def node_port_needs(group: GroupSpec) -> list[list[tuple[str, str]]]:
    """For each node of the layout (the one VM of a group on one), the (role, port name)
    pairs chosen on its VM, in file order: the named ports of the roles whose rank 0 runs
    there, and the rendezvous port
    (`RENDEZVOUS_PORT`) of each role on several nodes whose rank 0 runs there."""
    needs: list[list[tuple[str, str]]] = [[] for _ in group.layout()]
    for role in group.roles:
        at = group.node_of()[role.name]
        needs[at] += [(role.name, port) for port in role.ports]
        if role.nodes > 1:
            needs[at].append((role.name, RENDEZVOUS_PORT))
    return needs


def gpu_slices(
    group: GroupSpec, gpus: Sequence[str], names: Collection[str] | None = None
) -> dict[str, list[str]]:
    """Each role's GPUs: consecutive slices of the claimed ones, in the file's role order;
    with `names`, only those roles (one VM of a group over several), on that VM's GPUs (a
    VM whose roles need none still has the one GPU it was claimed through)."""
    roles = [r for r in group.roles if names is None or r.name in names]
    need = sum(r.gpus for r in roles)
    if len(gpus) != need and (names is None or len(gpus) < need):
        raise ValueError(f"the group needs {need} GPUs, the claim has {len(gpus)}")
    out: dict[str, list[str]] = {}
    start = 0
    for role in roles:
        out[role.name] = [str(g) for g in gpus[start : start + role.gpus]]
        start += role.gpus
    return out


def shared_env(
    group: GroupSpec, address: Mapping[str, str], ports: Mapping[tuple[str, str], int]
) -> dict[str, str]:
    """What every role gets: `RLFLEET_<ROLE>_ADDR` (`address[role]`, the address of the VM
    running the role's rank 0) and `RLFLEET_<ROLE>_<PORT>` of each role."""
    env: dict[str, str] = {}
    for role in group.roles:
        env[addr_variable(role.name)] = address[role.name]
        for port in role.ports:
            env[port_variable(role.name, port)] = str(int(ports[(role.name, port)]))
    return env


def role_argv(
    group: GroupSpec, role: Role, place: GroupPlace, node: RankRendezvous | None = None
) -> list[str]:
    """What one role runs, as argv: its command (the `vllm-serve` shorthand expanded), or
    the training entrypoint with the job's arguments (contract 5, without a shell); `node`
    is where this rank of a role on several nodes stands."""
    if role.command is not None:
        if role.command == VLLM_COMMAND:
            return vllm_argv(group, role, place.python)
        return list(role.command)
    train = role.train
    assert train is not None  # a role has a command or train (jobspec)
    words = launcher_argv(place.python, place.entrypoint, role.gpus, node)
    words += ["--model", train.model, "--dataset", train.dataset]
    for reward in train.reward_functions:
        words += ["--reward_function", reward]
    words += ["--output_dir", role_output_dir(group, role, place.output_dir)]
    words += list(train.args)
    if place.attempt > 1:
        words += ["--resume", "auto"]
    return words


def vllm_argv(group: GroupSpec, role: Role, python: str) -> list[str]:
    """`trl vllm-serve` with the training role's model on the role's GPUs (tensor
    parallel), at the role's address and its `http` port (else its first)."""
    trainers = [r.train for r in group.roles if r.train is not None]
    if len(trainers) != 1:
        return list(role.command or VLLM_COMMAND)  # no model to serve: the literal command
    port = "http" if "http" in role.ports else (role.ports[0] if role.ports else None)
    words = [python, *VLLM_MODULE, "--model", trainers[0].model]
    words += ["--host", f"${addr_variable(role.name)}"]
    if port is not None:
        words += ["--port", f"${port_variable(role.name, port)}"]
    return words + ["--tensor_parallel_size", str(max(1, role.gpus))]


def role_output_dir(group: GroupSpec, role: Role, output_dir: str) -> str:
    """A training role's `--output_dir`, relative to $HOME (the roles' working directory)
    when it starts with `~`: the job's, or `<job's>/<role>` when the group has several
    training roles."""
    path = output_dir
    if path == "~":
        path = "."
    elif path.startswith("~/"):
        path = path[2:]
    if sum(1 for r in group.roles if r.train is not None) > 1:
        path = f"{path.rstrip('/')}/{role.name}"
    return path


def group_launch(
    group: GroupSpec,
    place: GroupPlace,
    ports: Mapping[tuple[str, str], int],
    *,
    node: int | None = None,
    node_addresses: Sequence[str] | None = None,
    grace_s: float = GROUP_GRACE_S,
    stop_grace_s: float = ROLE_STOP_GRACE_S,
) -> GroupLaunch:
    """The supervisor's `group.json` for this attempt on one VM: every role, or, for a
    group over several VMs, only the roles (ranks) of layout node `node`, whose VMs'
    internal addresses are `node_addresses` (layout order). A role's address is its rank
    0's VM's, where its readiness check is made; a rank of a role on several nodes gets
    its place (`remote.rendezvous.rendezvous_env`) with its rank 0's rendezvous port. A group on one
    VM (`node` None) has every client of its services beside them: each role's address is
    loopback, so that a service that listens at its address is on no network."""
    layout = group.layout()
    if node is None:
        members = {r.name: 0 for r in group.roles}
        addresses: Sequence[str] = [LOOPBACK] * len(layout)
    else:
        members = dict(layout[node].roles)
        addresses = node_addresses or [place.address] * len(layout)
    nodes_of = group.nodes_of()
    addr = {r.name: addresses[nodes_of[r.name][0]] for r in group.roles}
    here = [n for n in group.start_order() if n in members]
    slices = gpu_slices(group, place.gpus, None if node is None else members)
    first_train = next((r.name for r in group.roles if r.train is not None), None)
    local_train = next((n for n in here if group.role(n).train is not None), None)
    roles: list[dict[str, Any]] = []
    for name in here:
        role = group.role(name)
        env = {"CUDA_VISIBLE_DEVICES": ",".join(slices[name]), "RLFLEET_ROLE": name}
        if role.train is not None and name not in (first_train, local_train):
            env["RLFLEET_PROGRESS_FILE"] = f"{name}.progress.json"  # only one progress.json
        rank = None
        if role.nodes > 1:
            rank = RankRendezvous(
                members[name],
                tuple(addresses[i] for i in nodes_of[name]),
                int(ports[(name, RENDEZVOUS_PORT)]),
            )
            env.update(rendezvous_env(rank, role.gpus))
        entry: dict[str, Any] = {
            "name": name,
            "argv": role_argv(group, role, place, rank),
            "env": env,
            "primary": role.primary,
            "depends_on": list(role.depends_on),
            # The supervisor that runs a role's rank 0 (where its check is made) keeps
            # checking it while the group runs.
            "live": role.ready is not None and members[name] == 0,
        }
        if role.restart == RESTART_ON_FAILURE:
            entry["restart"] = {"max": role.max_restarts}
        roles.append(entry)
    checks = {
        role.name: {
            "host": addr[role.name],
            "port": int(ports[(role.name, role.ready.port)]),
            "path": role.ready.path,
            "timeout_s": role.ready.timeout_s,
        }
        for role in group.roles
        if role.ready is not None
    }
    config = {
        "roles": roles,
        "checks": checks,
        "env": shared_env(group, addr, ports),
        "grace_s": grace_s,
        "stop_grace_s": stop_grace_s,
        "restart_backoff_s": RESTART_BACKOFF_S,
        "restart_backoff_max_s": RESTART_BACKOFF_MAX_S,
        "live_every_s": LIVENESS_EVERY_S,
        "live_fail_s": LIVENESS_FAIL_S,
    }
    return GroupLaunch(config, needs_entrypoint=local_train is not None)
