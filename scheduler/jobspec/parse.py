"""A whole job file's data, validated (`parse_data`): its top-level fields (name, priority,
retries, output directory, a vLLM server) and its roles, as one `GroupSpec`. Also reads
back what `GroupSpec.to_data` stored in `jobs.roles`.
"""

from __future__ import annotations

from typing import Any

from scheduler.errors import BadInput
from scheduler.jobspec.fields import _flag, _int, _mapping, _opt_text
from scheduler.jobspec.model import GroupSpec
from scheduler.jobspec.roles import (
    MAX_ROLE_GPUS,
    MAX_ROLES,
    _check_references,
    _role,
    _start_order,
    _with_primary,
)
from scheduler.jobspec.vllm import with_vllm_server
from scheduler.validate import (
    DEFAULT_HANG_TIMEOUT_S,
    DEFAULT_STARTUP_TIMEOUT_S,
    INT4,
    JOB_NAME_MAX,
    MAX_NODES,
    MAX_RETRIES,
    TEXT_MAX,
    check_timeout,
    is_int,
)

TOP_KEYS = (
    "name", "priority", "max_retries", "output_dir", "vllm_server_gpus", "vllm_server_own_vm",
    "roles", "workdir", "hang_timeout", "startup_timeout", "store",
)  # fmt: skip


def _store(value: Any) -> str | None:
    """The job file's `store:` (`scheduler.store.parse_store_url`), or None."""
    if value is None:
        return None
    from scheduler.store import parse_store_url

    try:
        return str(parse_store_url(_opt_text(value, "store", TEXT_MAX) or ""))
    except ValueError as exc:
        raise BadInput(str(exc).replace("--store", "store", 1)) from None


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
        name=_opt_text(top.get("name"), "name", JOB_NAME_MAX),
        priority=_int(top.get("priority", 0), "priority", *INT4),
        max_retries=_int(top.get("max_retries", 3), "max_retries", 0, MAX_RETRIES),
        output_dir=_opt_text(top.get("output_dir"), "output_dir", TEXT_MAX),
        workdir=_opt_text(top.get("workdir"), "workdir", TEXT_MAX),
        hang_timeout_s=_timeout(top, "hang_timeout", DEFAULT_HANG_TIMEOUT_S),
        startup_timeout_s=_timeout(top, "startup_timeout", DEFAULT_STARTUP_TIMEOUT_S),
        store=_store(top.get("store")),
        _order=order,
    )
    if len(group.layout()) > MAX_NODES:
        raise BadInput(
            f"roles: the group would span {len(group.layout())} VMs, at most {MAX_NODES}"
        )
    return group


def _timeout(top: dict[str, Any], key: str, default: int) -> int:
    """A liveness timeout key (seconds; 0: off), `default` when absent."""
    value = top.get(key, default)
    if not is_int(value):
        raise BadInput(f"{key}: must be an integer number of seconds")
    try:
        return check_timeout(value, key)
    except BadInput as exc:
        raise BadInput(str(exc).replace(f"{key} must", f"{key}: must", 1)) from None
