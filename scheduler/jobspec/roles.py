"""One role of a job file (`roles.<name>:`) and the checks across roles: its GPUs, nodes,
command or `train:`, env, ports, readiness check and restart policy (`_role`, `_restart`);
a primary role
(`_with_primary`); references to other roles and variable names that do not collide
(`_check_references`); the order the roles start in (`_start_order`).
"""

from __future__ import annotations

from typing import Any

from scheduler.errors import BadInput
from scheduler.jobspec.fields import _command, _flag, _int, _mapping, _name, _shown, _text
from scheduler.jobspec.model import (
    RESTART_NEVER,
    RESTART_ON_FAILURE,
    Ready,
    Role,
    addr_variable,
    port_variable,
)
from scheduler.jobspec.recipe import _train
from scheduler.validate import MAX_NODES, SCHEDULER_ENV, env_key_problem, env_value_problem

MAX_ROLES = 16
MAX_PORTS = 16
MAX_ROLE_GPUS = 64
MAX_ROLE_NODES = MAX_NODES
MAX_READY_TIMEOUT_S = 3600
DEFAULT_READY_TIMEOUT_S = 120
MAX_ROLE_RESTARTS = 100
"""Most restarts in place a role may ask for (`max_restarts`), per attempt."""
DEFAULT_MAX_RESTARTS = 3
"""`max_restarts` of a `restart: on-failure` role that gives none."""
RESTART_POLICIES = (RESTART_NEVER, RESTART_ON_FAILURE)

ROLE_KEYS = (
    "gpus", "nodes", "command", "train", "env", "ports", "ready", "depends_on", "primary",
    "same_vm_as", "own_vm", "restart", "max_restarts",
)  # fmt: skip
READY_KEYS = ("http", "tcp", "port", "timeout")


def _env(value: Any, where: str) -> tuple[tuple[str, str], ...]:
    """The role's own variables: names a job may set, one-line values."""
    data = _mapping(value, where, None)
    pairs = []
    for key, raw in data.items():
        problem = env_key_problem(key)
        if problem:
            raise BadInput(f"{where}.{_shown(key)}: {problem}")
        if isinstance(raw, bool) or not isinstance(raw, str | int | float):
            raise BadInput(f"{where}.{key}: must be text")
        text = raw if isinstance(raw, str) else str(raw)
        problem = env_value_problem(text)
        if problem:
            raise BadInput(f"{where}.{key}: {problem}")
        pairs.append((key, text))
    return tuple(pairs)


def _ports(value: Any, where: str) -> tuple[str, ...]:
    """Named ports: distinct names, at most MAX_PORTS."""
    if not isinstance(value, list):
        raise BadInput(f"{where}: must be a list of port names")
    if len(value) > MAX_PORTS:
        raise BadInput(f"{where}: at most {MAX_PORTS} ports")
    names = [_name(p, f"{where}[{i}]") for i, p in enumerate(value)]
    if len(set(names)) != len(names):
        raise BadInput(f"{where}: a port name is given twice")
    return tuple(names)


def _ready(value: Any, where: str, ports: tuple[str, ...]) -> Ready:
    """`{http: /path[, port: name]}` or `{tcp: name}`, with an optional `timeout` (s)."""
    data = _mapping(value, where, READY_KEYS)
    if ("http" in data) == ("tcp" in data):
        raise BadInput(f"{where}: give exactly one of http (a path) or tcp (a port name)")
    timeout = _int(
        data.get("timeout", DEFAULT_READY_TIMEOUT_S), f"{where}.timeout", 1, MAX_READY_TIMEOUT_S
    )
    if "tcp" in data:
        if "port" in data:
            raise BadInput(f"{where}.port: only with http (tcp names its port)")
        port = _name(data["tcp"], f"{where}.tcp")
        path = None
    else:
        path = _text(data["http"], f"{where}.http", 1024)
        if not path.startswith("/") or any(c.isspace() or not c.isprintable() for c in path):
            raise BadInput(f"{where}.http: must be a path starting with / (no spaces)")
        if "port" in data:
            port = _name(data["port"], f"{where}.port")
        elif ports:
            port = ports[0]
        else:
            raise BadInput(f"{where}: the role has no ports to check")
    if port not in ports:
        raise BadInput(f"{where}: {port} is not one of the role's ports")
    return Ready(port=port, path=path, timeout_s=timeout)


def _role(name: Any, value: Any) -> Role:
    """One role, validated."""
    where = f"roles.{_shown(name)}"
    role_name = _name(name, where)
    data = _mapping(value, where, ROLE_KEYS)
    if ("command" in data) == ("train" in data):
        raise BadInput(f"{where}: give exactly one of command or train")
    train = _train(data["train"], f"{where}.train") if "train" in data else None
    command = _command(data["command"], f"{where}.command") if "command" in data else None
    lo = 1 if train is not None else 0
    gpus = _int(data.get("gpus", 1 if train else 0), f"{where}.gpus", lo, MAX_ROLE_GPUS)
    nodes = _int(data.get("nodes", 1), f"{where}.nodes", 1, MAX_ROLE_NODES)
    ports = _ports(data.get("ports", []), f"{where}.ports")
    ready = _ready(data["ready"], f"{where}.ready", ports) if "ready" in data else None
    depends = data.get("depends_on", [])
    if not isinstance(depends, list):
        raise BadInput(f"{where}.depends_on: must be a list of role names")
    depends_on = tuple(_name(d, f"{where}.depends_on[{i}]") for i, d in enumerate(depends))
    primary = _flag(data.get("primary", train is not None), f"{where}.primary")
    same_vm = data.get("same_vm_as")
    restart, max_restarts = _restart(data, where, primary=primary, nodes=nodes)
    return Role(
        name=role_name,
        gpus=gpus,
        nodes=nodes,
        command=command,
        train=train,
        env=_env(data.get("env", {}), f"{where}.env"),
        ports=ports,
        ready=ready,
        depends_on=depends_on,
        primary=primary,
        same_vm_as=None if same_vm is None else _name(same_vm, f"{where}.same_vm_as"),
        own_vm=_flag(data.get("own_vm", False), f"{where}.own_vm"),
        restart=restart,
        max_restarts=max_restarts,
    )


def _restart(data: dict[str, Any], where: str, *, primary: bool, nodes: int) -> tuple[str, int]:
    """`restart` (`never` or `on-failure`) and `max_restarts` (0..MAX_ROLE_RESTARTS, default
    DEFAULT_MAX_RESTARTS): only a one-node role that is not primary heals in place (a
    primary's end is the job's end, retried from its checkpoint as the job; a role on
    several nodes has peers that cannot go on without one of its ranks)."""
    restart = data.get("restart", RESTART_NEVER)
    if restart not in RESTART_POLICIES:
        raise BadInput(f"{where}.restart: must be one of {', '.join(RESTART_POLICIES)}")
    if restart == RESTART_NEVER:
        if "max_restarts" in data:
            raise BadInput(f"{where}.max_restarts: only with restart: {RESTART_ON_FAILURE}")
        return restart, 0
    if primary:
        raise BadInput(
            f"{where}.restart: a primary role is not restarted in place (its failure is "
            "retried as the job's, from its checkpoint)"
        )
    if nodes != 1:
        raise BadInput(f"{where}.restart: only for a one-node role")
    limit = _int(
        data.get("max_restarts", DEFAULT_MAX_RESTARTS),
        f"{where}.max_restarts",
        0,
        MAX_ROLE_RESTARTS,
    )
    return restart, limit


def _with_primary(roles: list[Role]) -> list[Role]:
    """A job needs a primary role (its end is the job's end); a lone role always is one."""
    if len(roles) == 1 and not roles[0].primary:
        from dataclasses import replace

        if roles[0].restart != RESTART_NEVER:
            raise BadInput(
                f"roles.{roles[0].name}.restart: a lone role is the primary role, which is "
                "not restarted in place"
            )

        return [replace(roles[0], primary=True)]
    if not any(r.primary for r in roles):
        raise BadInput("roles: no primary role (mark the role whose end ends the job primary)")
    return roles


def _check_references(roles: list[Role]) -> None:
    """Every `depends_on` and `same_vm_as` names another role of the job."""
    names = {r.name for r in roles}
    for role in roles:
        for i, dep in enumerate(role.depends_on):
            if dep not in names or dep == role.name:
                raise BadInput(f"roles.{role.name}.depends_on[{i}]: no other role {dep}")
        if role.same_vm_as is not None:
            if role.same_vm_as not in names or role.same_vm_as == role.name:
                raise BadInput(f"roles.{role.name}.same_vm_as: no other role {role.same_vm_as}")
            if role.nodes != 1:
                raise BadInput(f"roles.{role.name}.same_vm_as: only for a one-node role")
            if role.own_vm or any(r.own_vm for r in roles if r.name == role.same_vm_as):
                raise BadInput(
                    f"roles.{role.name}.same_vm_as: {role.same_vm_as} or {role.name} has "
                    "own_vm: true"
                )
    # A role's or port's variable must not shadow one the scheduler sets (role `node`, port
    # `rank` would be RLFLEET_NODE_RANK).
    seen = dict.fromkeys(SCHEDULER_ENV, "a variable the scheduler sets")
    for role in roles:
        variable = addr_variable(role.name)
        if variable in seen:
            raise BadInput(f"roles.{role.name}: {variable} would also name {seen[variable]}")
        seen[variable] = f"roles.{role.name}"
    for role in roles:
        for i, port in enumerate(role.ports):
            variable, where = port_variable(role.name, port), f"roles.{role.name}.ports[{i}]"
            if variable in seen:
                raise BadInput(f"{where}: {variable} would also name {seen[variable]}")
            seen[variable] = where


def _start_order(roles: list[Role]) -> tuple[str, ...]:
    """Roles in dependency order (Kahn's algorithm, file order among equals); a cycle is
    `BadInput` naming a role on it."""
    waiting = {r.name: set(r.depends_on) for r in roles}
    order: list[str] = []
    while waiting:
        ready = [name for name, deps in waiting.items() if not deps]
        if not ready:
            stuck = sorted(waiting)[0]
            raise BadInput(f"roles.{stuck}.depends_on: a dependency cycle")
        for name in ready:
            order.append(name)
            del waiting[name]
        for deps in waiting.values():
            deps.difference_update(ready)
    return tuple(order)
