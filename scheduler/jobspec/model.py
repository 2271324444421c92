"""The job group model a job file describes: its roles (`Role`, with a `Train` or a command,
ports and a `Ready` check), the whole `GroupSpec`, the VMs its roles run on (`layout()`,
`GroupNode`), its shape as stored in `jobs.roles` (`to_data`, read back by `parse_data`)
and the variables that carry a role's address and ports (`addr_variable`, `port_variable`).

Pure: built and checked by `scheduler.jobspec.parse`, never by hand from user input.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from scheduler.errors import BadInput
from scheduler.validate import DEFAULT_HANG_TIMEOUT_S, DEFAULT_STARTUP_TIMEOUT_S

RENDEZVOUS_PORT = "@rendezvous"
"""The port name (in `job_ports`) of the rendezvous port of a role on several nodes, chosen
on its rank 0's VM: never a name a user can give (`NAME_RE`)."""


RESTART_NEVER = "never"
"""A role's default: its failure ends the whole group (shared fate)."""
RESTART_ON_FAILURE = "on-failure"
"""A role restarted in place by its supervisor when it fails (docs/reward-server.md)."""


@dataclass(frozen=True)
class Ready:
    """A readiness check: an HTTP GET of `path` on `port` (2xx passes), or a TCP connect to
    `port` when `path` is None; failing for `timeout_s` seconds fails the attempt."""

    port: str
    path: str | None
    timeout_s: int


@dataclass(frozen=True)
class Train:
    """The training entrypoint's inputs, as `job submit`'s flags give them."""

    model: str
    dataset: str
    reward_functions: tuple[str, ...]
    args: tuple[str, ...] = ()


@dataclass(frozen=True)
class Role:
    """One role of a job: what it runs, on how many GPUs, its ports and its readiness."""

    name: str
    gpus: int
    nodes: int = 1
    command: tuple[str, ...] | None = None
    train: Train | None = None
    env: tuple[tuple[str, str], ...] = ()
    ports: tuple[str, ...] = ()
    ready: Ready | None = None
    depends_on: tuple[str, ...] = ()
    primary: bool = False
    same_vm_as: str | None = None
    own_vm: bool = False
    """The role runs on a VM of its own, apart from the group's other roles."""
    restart: str = RESTART_NEVER
    """`on-failure`: the supervisor restarts the role in place when it exits or stops
    answering its readiness check (`RESTART_ON_FAILURE`); `never` (the default): its
    failure fails the whole group (shared fate)."""
    max_restarts: int = 0
    """How many times per attempt the role may be restarted in place (with `on-failure`)."""


@dataclass(frozen=True)
class GroupNode:
    """One VM of a job group: the GPUs it needs and the (role, rank) pairs it runs."""

    gpus: int
    roles: tuple[tuple[str, int], ...]


@dataclass(frozen=True)
class GroupSpec:
    """A whole, validated job spec file."""

    roles: tuple[Role, ...]
    name: str | None = None
    priority: int = 0
    max_retries: int = 3
    output_dir: str | None = None
    workdir: str | None = None
    """The job's workdir as the file names it (relative to the file's directory), packed
    by `job submit`; not part of `to_data`."""
    hang_timeout_s: int = DEFAULT_HANG_TIMEOUT_S
    """`hang_timeout:` seconds; 0 turns the check off."""
    startup_timeout_s: int = DEFAULT_STARTUP_TIMEOUT_S
    """`startup_timeout:` seconds; 0 turns the check off."""
    store: str | None = None
    """The job's store URL (`store:`), checked; None: none."""
    _order: tuple[str, ...] = field(default=(), repr=False)

    def role(self, name: str) -> Role:
        """The role called `name`."""
        return next(r for r in self.roles if r.name == name)

    def start_order(self) -> tuple[str, ...]:
        """Role names so that every role comes after those it depends on."""
        return self._order

    def to_data(self) -> dict[str, Any]:
        """The roles in the spec file's own shape, without env values (they may be secrets
        and live in `jobs.env`): what `jobs.roles` stores and `parse_data` reads back."""
        return {"roles": {r.name: _role_data(r) for r in self.roles}}

    @property
    def gpus(self) -> int:
        """GPUs of every role together."""
        return sum(r.gpus for r in self.roles)

    def layout(self) -> tuple[GroupNode, ...]:
        """The VMs (nodes) the group's roles run on, node 0 first (docs/decisions.md,
        "Which VM each role of a group runs on"): node r runs rank r of every role with
        more than r `nodes`, and every other one-node role runs on node 0 (roles share a VM
        unless `nodes` spreads them, so `same_vm_as` always holds); then each `own_vm` role
        gets nodes of its own (one per rank), in file order. A node's GPUs are its roles'
        GPUs together, at least 1: a VM is claimed through its GPUs."""
        shared = [r for r in self.roles if not r.own_vm]
        count = max((r.nodes for r in shared), default=0)
        nodes = [
            GroupNode(
                gpus=max(1, sum(r.gpus for r in shared if r.nodes > node)),
                roles=tuple((r.name, node) for r in shared if r.nodes > node),
            )
            for node in range(count)
        ]
        nodes += [
            GroupNode(gpus=max(1, r.gpus), roles=((r.name, rank),))
            for r in self.roles
            if r.own_vm
            for rank in range(r.nodes)
        ]
        return tuple(nodes)

    def node_of(self) -> dict[str, int]:
        """The node (index into `layout()`) that runs each role's rank 0."""
        return {name: nodes[0] for name, nodes in self.nodes_of().items()}

    def nodes_of(self) -> dict[str, tuple[int, ...]]:
        """The nodes (indices into `layout()`) that run each role, rank 0 first."""
        out: dict[str, list[int]] = {r.name: [0] * r.nodes for r in self.roles}
        for index, node in enumerate(self.layout()):
            for name, rank in node.roles:
                out[name][rank] = index
        return {name: tuple(nodes) for name, nodes in out.items()}

    def env(self) -> tuple[tuple[str, str], ...]:
        """Every role's `env` as one job environment (`jobs.env`); a variable two roles set
        to different values is `BadInput`."""
        merged: dict[str, str] = {}
        for role in self.roles:
            for key, value in role.env:
                if merged.get(key, value) != value:
                    raise BadInput(
                        f"roles.{role.name}.env.{key}: another role sets it to another value "
                        "(the roles of a job share one environment)"
                    )
                merged[key] = value
        return tuple(merged.items())


def _role_data(role: Role) -> dict[str, Any]:
    """One role in the spec file's shape (no env values)."""
    data: dict[str, Any] = {"gpus": role.gpus, "primary": role.primary}
    if role.nodes != 1:
        data["nodes"] = role.nodes
    if role.command is not None:
        data["command"] = list(role.command)
    if role.train is not None:
        data["train"] = {
            "model": role.train.model,
            "dataset": role.train.dataset,
            "reward_functions": list(role.train.reward_functions),
            "args": list(role.train.args),
        }
    if role.ports:
        data["ports"] = list(role.ports)
    if role.ready is not None:
        ready: dict[str, Any] = {"timeout": role.ready.timeout_s}
        if role.ready.path is None:
            ready["tcp"] = role.ready.port
        else:
            ready.update(http=role.ready.path, port=role.ready.port)
        data["ready"] = ready
    if role.depends_on:
        data["depends_on"] = list(role.depends_on)
    if role.same_vm_as is not None:
        data["same_vm_as"] = role.same_vm_as
    if role.own_vm:
        data["own_vm"] = True
    if role.restart != RESTART_NEVER:
        data["restart"] = role.restart
        data["max_restarts"] = role.max_restarts
    return data


def port_variable(role: str, port: str) -> str:
    """The variable that carries a role's port to every role: `RLFLEET_<ROLE>_<PORT>`."""
    return f"RLFLEET_{role.upper()}_{port.upper()}"


def addr_variable(role: str) -> str:
    """The variable that carries a role's internal address: `RLFLEET_<ROLE>_ADDR`."""
    return f"RLFLEET_{role.upper()}_ADDR"
