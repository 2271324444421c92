"""Job spec files (`rlfleet job submit -f job.yaml`): parse and validate the whole file
before anything is inserted.

A job is one or more named roles. Each role runs either a command (an argv list, or a
string split with `shlex.split`, never a shell) or the training entrypoint (`train:` with
the model, dataset, reward functions and train_grpo.py arguments, as `job submit`'s
flags give them). A bad file is `BadInput` with one line that names the field, e.g.
`roles.vllm.gpus: must be an integer 0..64`.

Pure: no database, no network; `scheduler.cli.job` turns a `GroupSpec` into a job row.
"""

from __future__ import annotations

import functools
import math
import re
import shlex
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from scheduler.errors import BadInput
from scheduler.validate import (
    INT4,
    MAX_NODES,
    MAX_RETRIES,
    SCHEDULER_ENV,
    TEXT_MAX,
    env_key_problem,
)

MAX_FILE_BYTES = 1 << 20
"""Largest spec file read (1 MiB): a job description is a few hundred bytes."""
MAX_ROLES = 16
MAX_PORTS = 16
MAX_ROLE_GPUS = 64
MAX_ROLE_NODES = MAX_NODES
MAX_READY_TIMEOUT_S = 3600
DEFAULT_READY_TIMEOUT_S = 120
NAME_RE = re.compile(r"[a-z][a-z0-9_]{0,31}")
"""Role and port names (the whole name: `NAME_RE.fullmatch`): they become parts of variable
names (`RLFLEET_<ROLE>_<PORT>`)."""
MAX_DEPTH = 32
"""Deepest nesting of mappings and lists in a job file (a real one nests 5 deep): refused
while the file is read, before the parser's cost grows with it."""
MAX_INT_DIGITS = 30
"""Longest integer a job file may write (Python refuses to convert beyond 4,300 digits)."""
MAX_PRIORITY = INT4[1]
# MAX_RETRIES and TEXT_MAX are `scheduler.validate`'s, the limits `job submit` checks.

TOP_KEYS = (
    "name", "priority", "max_retries", "output_dir", "vllm_server_gpus", "vllm_server_own_vm",
    "roles",
)  # fmt: skip
ROLE_KEYS = (
    "gpus", "nodes", "command", "train", "env", "ports", "ready", "depends_on", "primary",
    "same_vm_as", "own_vm",
)  # fmt: skip
TRAIN_KEYS = ("model", "dataset", "reward_functions", "args")
READY_KEYS = ("http", "tcp", "port", "timeout")


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


# -- reading ------------------------------------------------------------------------------


def load_file(path: str) -> GroupSpec:
    """Read and validate the spec file at `path`; `BadInput` (one line) if it is bad."""
    try:
        with open(path, "rb") as handle:
            raw = handle.read(MAX_FILE_BYTES + 1)
    except OSError as exc:
        raise BadInput(f"{path}: cannot read it ({exc.strerror or exc})") from None
    if len(raw) > MAX_FILE_BYTES:
        raise BadInput(f"{path}: larger than {MAX_FILE_BYTES} bytes")
    return parse_text(raw, path)


def parse_text(raw: bytes, where: str = "job file") -> GroupSpec:
    """Validate the bytes of a spec file (YAML, read with the safe loader only)."""
    import yaml

    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise BadInput(f"{where}: not valid UTF-8 (byte {exc.start})") from None
    if "\x00" in text:
        raise BadInput(f"{where}: contains a NUL character")
    loader = _job_file_loader()(text)
    try:
        data = loader.get_single_data()
    except _Refused as exc:
        line = f" line {exc.line + 1}:" if exc.line is not None else ""
        raise BadInput(f"{where}:{line} {exc.problem}") from None
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        line = f" line {mark.line + 1}:" if mark is not None else ""
        problem = getattr(exc, "problem", None) or type(exc).__name__
        raise BadInput(f"{where}:{line} not valid YAML ({problem})") from None
    except RecursionError:
        raise BadInput(f"{where}: nested too deeply") from None
    finally:
        loader.dispose()
    return parse_data(data)


_YAML12_INT = r"[-+]?[0-9]+\Z|0o[0-7]+\Z|0x[0-9a-fA-F]+\Z"
_YAML12_FLOAT = (
    r"[-+]?(?:\.[0-9]+|[0-9]+(?:\.[0-9]*)?)(?:[eE][-+]?[0-9]+)?\Z"
    r"|[-+]?\.(?:inf|Inf|INF)\Z|\.(?:nan|NaN|NAN)\Z"
)
"""The integers and floats of YAML 1.2's core schema: YAML 1.1's `1:00` (60, base 60),
`010` (8, octal) and `1_000` are text."""


class _Refused(Exception):
    """A job file refused while it is read, for what it holds rather than its syntax."""

    def __init__(self, problem: str, line: int | None) -> None:
        super().__init__(problem)
        self.problem, self.line = problem, line


@functools.cache
def _job_file_loader() -> Any:
    """PyYAML's safe loader reading plain scalars as YAML 1.2 does (`_YAML12_INT`,
    `_YAML12_FLOAT`), refusing aliases, nesting deeper than MAX_DEPTH and integers longer
    than MAX_INT_DIGITS while the file is read (each a `yaml.YAMLError` with its line)."""
    import yaml

    int_tag, float_tag = "tag:yaml.org,2002:int", "tag:yaml.org,2002:float"

    class JobFileLoader(yaml.SafeLoader):
        depth = 0

        def compose_node(self, parent: Any, index: Any) -> Any:
            # Aliases are refused before anything is built: nested aliases expand
            # exponentially when walked, and a job file has no use for them.
            if self.check_event(yaml.AliasEvent):
                raise _Refused("YAML aliases (*name) are not allowed", None)
            self.depth += 1
            try:
                if self.depth > MAX_DEPTH:
                    line = self.peek_event().start_mark.line
                    raise _Refused(f"nested deeper than {MAX_DEPTH} levels", line)
                return super().compose_node(parent, index)
            finally:
                self.depth -= 1

        def construct_yaml_int(self, node: Any) -> int:
            value = str(self.construct_scalar(node))
            digits = value.lstrip("+-")
            if len(digits) > MAX_INT_DIGITS:
                problem = f"a number longer than {MAX_INT_DIGITS} digits"
                raise _Refused(problem, node.start_mark.line)
            sign = -1 if value.startswith("-") else 1
            if digits.startswith(("0o", "0x")):
                return int(digits[2:], 8 if digits[1] == "o" else 16)
            return sign * int(digits)

    JobFileLoader.yaml_implicit_resolvers = {
        first: [(tag, regexp) for tag, regexp in resolvers if tag not in (int_tag, float_tag)]
        for first, resolvers in yaml.SafeLoader.yaml_implicit_resolvers.items()
    }
    JobFileLoader.add_implicit_resolver(int_tag, re.compile(_YAML12_INT), list("-+0123456789"))
    JobFileLoader.add_implicit_resolver(float_tag, re.compile(_YAML12_FLOAT), list("-+.0123456789"))
    JobFileLoader.add_constructor(int_tag, JobFileLoader.construct_yaml_int)
    return JobFileLoader


def parse_data(data: Any) -> GroupSpec:
    """Validate an already loaded spec (a mapping)."""
    top = _mapping(data, "job file", TOP_KEYS)
    roles_data = _mapping(top.get("roles"), "roles", None)
    if not roles_data:
        raise BadInput("roles: at least one role is needed")
    if len(roles_data) > MAX_ROLES:
        raise BadInput(f"roles: at most {MAX_ROLES} roles")
    roles = [_role(name, value) for name, value in roles_data.items()]
    vllm_gpus = top.get("vllm_server_gpus")
    own_vm = _flag(top.get("vllm_server_own_vm", False), "vllm_server_own_vm")
    if vllm_gpus is not None:
        gpus = _int(vllm_gpus, "vllm_server_gpus", 1, MAX_ROLE_GPUS)
        roles = with_vllm_server(roles, gpus, own_vm=own_vm)
    elif own_vm:
        raise BadInput("vllm_server_own_vm: only with vllm_server_gpus")
    roles = _with_primary(roles)
    _check_references(roles)
    order = _start_order(roles)
    group = GroupSpec(
        roles=tuple(roles),
        name=_opt_text(top.get("name"), "name", 255),
        priority=_int(top.get("priority", 0), "priority", -MAX_PRIORITY - 1, MAX_PRIORITY),
        max_retries=_int(top.get("max_retries", 3), "max_retries", 0, MAX_RETRIES),
        output_dir=_opt_text(top.get("output_dir"), "output_dir", TEXT_MAX),
        _order=order,
    )
    if len(group.layout()) > MAX_NODES:
        raise BadInput(
            f"roles: the group would span {len(group.layout())} VMs, at most {MAX_NODES}"
        )
    return group


# -- fields -------------------------------------------------------------------------------


def _mapping(value: Any, where: str, keys: tuple[str, ...] | None) -> dict[str, Any]:
    """`value` as a mapping with text keys, only `keys` when given."""
    if not isinstance(value, Mapping):
        raise BadInput(f"{where}: must be a mapping")
    for key in value:
        if not isinstance(key, str):
            raise BadInput(f"{where}: keys must be text, not {_shown(key)}")
        if keys is not None and key not in keys:
            raise BadInput(f"{where}.{_shown(key)}: unknown key (known: {', '.join(keys)})")
    return dict(value)


def _shown(value: Any, limit: int = 40) -> str:
    """A short printable quote of a value for an error line."""
    text = value if isinstance(value, str) else repr(value)
    text = text if len(text) <= limit else text[:limit] + "…"
    return ascii(text) if not text.isprintable() else text


def _int(value: Any, where: str, lo: int, hi: int) -> int:
    """`value` if it is an integer in lo..hi (booleans are not integers here)."""
    if isinstance(value, bool) or not isinstance(value, int) or not lo <= value <= hi:
        raise BadInput(f"{where}: must be an integer {lo}..{hi}")
    return value


def _text(value: Any, where: str, limit: int = TEXT_MAX) -> str:
    """`value` if it is non-empty, one-piece text that a database and a shell word can hold."""
    if not isinstance(value, str):
        raise BadInput(f"{where}: must be text")
    if not value.strip():
        raise BadInput(f"{where}: must not be empty")
    if "\x00" in value:
        raise BadInput(f"{where}: contains a NUL character")
    try:
        value.encode("utf-8")
    except UnicodeEncodeError:
        raise BadInput(f"{where}: is not valid UTF-8") from None
    if len(value) > limit:
        raise BadInput(f"{where}: too long ({len(value)} characters, at most {limit})")
    return value


def _opt_text(value: Any, where: str, limit: int) -> str | None:
    """`_text`, or None when absent."""
    return None if value is None else _text(value, where, limit)


def _name(value: Any, where: str) -> str:
    """A role or port name: `[a-z][a-z0-9_]*`, at most 32 characters."""
    if not isinstance(value, str) or not NAME_RE.fullmatch(value):
        raise BadInput(f"{where}: {_shown(value)} is not a name ([a-z][a-z0-9_]*, ≤ 32)")
    return value


def _words(value: Any, where: str, *, allow_empty: bool = False) -> tuple[str, ...]:
    """A list of text words; a string is one word for `reward_functions`-like fields."""
    if not isinstance(value, list):
        raise BadInput(f"{where}: must be a list")
    if not value and not allow_empty:
        raise BadInput(f"{where}: must not be empty")
    if len(value) > 1000:
        raise BadInput(f"{where}: at most 1000 items")
    words = []
    for i, word in enumerate(value):
        if isinstance(word, bool) or not isinstance(word, str | int | float):
            raise BadInput(f"{where}[{i}]: must be text")
        if isinstance(word, float) and not math.isfinite(word):
            raise BadInput(f"{where}[{i}]: must be text")
        text = word if isinstance(word, str) else str(word)
        if not text:
            raise BadInput(f"{where}[{i}]: must not be empty")
        words.append(_text(text, f"{where}[{i}]"))
    return tuple(words)


def _command(value: Any, where: str) -> tuple[str, ...]:
    """A command as argv: a list of words, or a string split like a shell would split it
    (no shell ever runs it)."""
    if isinstance(value, str):
        _text(value, where)
        try:
            value = shlex.split(value)
        except ValueError as exc:
            raise BadInput(f"{where}: cannot split it into words ({exc})") from None
    return _words(value, where)


def _train(value: Any, where: str) -> Train:
    """The training entrypoint's inputs."""
    data = _mapping(value, where, TRAIN_KEYS)
    for key in ("model", "dataset", "reward_functions"):
        if key not in data:
            raise BadInput(f"{where}.{key}: required")
    rewards_value = data["reward_functions"]
    if isinstance(rewards_value, str):
        rewards_value = [rewards_value]
    rewards = _words(rewards_value, f"{where}.reward_functions")
    for i, reward in enumerate(rewards):
        if "," in reward:
            raise BadInput(f"{where}.reward_functions[{i}]: must not contain a comma")
    args = _words(data.get("args", []), f"{where}.args", allow_empty=True)
    from scheduler.validate import extra_args_problem

    problem = extra_args_problem(args)
    if problem:
        raise BadInput(f"{where}.args: {problem.replace('after --', 'in args')}")
    return Train(
        model=_text(data["model"], f"{where}.model"),
        dataset=_text(data["dataset"], f"{where}.dataset"),
        reward_functions=rewards,
        args=args,
    )


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
        if any(c in text for c in "\n\r\x00"):
            raise BadInput(f"{where}.{key}: the value must be one line")
        if len(text) > 32768:
            raise BadInput(f"{where}.{key}: longer than 32768 characters")
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
    )


def _flag(value: Any, where: str) -> bool:
    """A true/false field."""
    if not isinstance(value, bool):
        raise BadInput(f"{where}: must be true or false")
    return value


def _with_primary(roles: list[Role]) -> list[Role]:
    """A job needs a primary role (its end is the job's end); a lone role always is one."""
    if len(roles) == 1 and not roles[0].primary:
        from dataclasses import replace

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
    return data


RENDEZVOUS_PORT = "@rendezvous"
"""The port name (in `job_ports`) of the rendezvous port of a role on several nodes, chosen
on its rank 0's VM: never a name a user can give (`NAME_RE`)."""

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
    from dataclasses import replace

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


def port_variable(role: str, port: str) -> str:
    """The variable that carries a role's port to every role: `RLFLEET_<ROLE>_<PORT>`."""
    return f"RLFLEET_{role.upper()}_{port.upper()}"


def addr_variable(role: str) -> str:
    """The variable that carries a role's internal address: `RLFLEET_<ROLE>_ADDR`."""
    return f"RLFLEET_{role.upper()}_ADDR"
