"""What `rlfleet job submit` queues from its options: a job spec file (`-f`), a recipe
(`--config`), a vLLM server beside the trainer (`--vllm-server-gpus`) and `--env` values,
each turned into the `JobSpec` of one job row.

Imported by `job submit` alone; the job file itself is read by `scheduler.jobspec`.
"""

from __future__ import annotations

import re
from typing import TYPE_CHECKING, Any

import click

from scheduler.cli._common import warn
from scheduler.errors import BadInput
from scheduler.jobstore import JobSpec

if TYPE_CHECKING:
    from scheduler.jobspec import GroupSpec


def spec_from_flags(
    recipe: str | None,
    env: tuple[str, ...],
    vllm_server_gpus: int | None,
    vllm_server_own_vm: bool,
    *,
    model: str | None,
    dataset: str | None,
    reward_functions: tuple[str, ...],
    extra_args: tuple[str, ...],
    **job: Any,
) -> JobSpec:
    """The job `job submit`'s flags describe (without `-f`): a recipe's fields under the
    flags given, `--env` values over the recipe's, and a vLLM server beside the trainer
    with `--vllm-server-gpus`. `job` holds the other `JobSpec` fields (gpus, nodes, …)."""
    recipe_env: tuple[tuple[str, str], ...] = ()
    if recipe is not None:
        model, dataset, reward_functions, extra_args, recipe_env = from_recipe(
            recipe, model, dataset, reward_functions, extra_args
        )
    for flag, value in (("--model", model), ("--dataset", dataset)):
        if value is None:
            raise BadInput(f"missing option {flag} (or give a job spec file with -f)")
    if not reward_functions:
        raise BadInput("missing option --reward-function (or give a job spec file with -f)")
    spec = JobSpec(
        model=str(model),
        dataset=str(dataset),
        reward_functions=reward_functions,
        extra_args=extra_args,
        env=recipe_env + parse_env_options(env),
        **job,
    )
    if vllm_server_gpus is not None:
        spec = with_vllm_server(spec, vllm_server_gpus, own_vm=vllm_server_own_vm)
    elif vllm_server_own_vm:
        raise BadInput("--vllm-server-own-vm: only with --vllm-server-gpus")
    return spec


def from_recipe(
    path: str,
    model: str | None,
    dataset: str | None,
    reward_functions: tuple[str, ...],
    extra_args: tuple[str, ...],
) -> tuple[str | None, str | None, tuple[str, ...], tuple[str, ...], tuple[tuple[str, str], ...]]:
    """`job submit --config`: the model, dataset, reward functions and train_grpo.py arguments
    of the recipe at `path` under the flags given (which win), and its `env` as job
    variables (--env values win), with a warning for each key the scheduler owns."""
    from scheduler.jobspec import MAX_FILE_BYTES, recipe_train

    try:
        with open(path, "rb") as stream:
            raw = stream.read(MAX_FILE_BYTES + 1)
    except OSError as exc:
        raise BadInput(f"--config {path}: cannot read it: {exc.strerror or exc}") from None
    if len(raw) > MAX_FILE_BYTES:
        raise BadInput(f"--config {path}: larger than {MAX_FILE_BYTES} bytes")
    from scheduler.jobspec.reading import load_yaml

    data = load_yaml(raw, f"--config {path}")  # the bounded loader of `-f`: no aliases
    if data is None:
        data = {}
    if not isinstance(data, dict):
        raise BadInput(f"--config {path}: expected a mapping of field names to values")
    env = data.pop("env", None) or {}
    if not isinstance(env, dict):
        raise BadInput(f"--config {path}: env: expected a mapping of variable names to values")
    pairs = tuple((str(k), "" if v is None else str(v)) for k, v in env.items())
    found, args, notes = recipe_train(data, f"--config {path}")
    for note in notes:
        warn(note)
    if not reward_functions and found.get("reward_function"):
        reward_functions = tuple(found["reward_function"])
    return (
        model or found.get("model"),
        dataset or found.get("dataset"),
        reward_functions,
        args + extra_args,
        pairs,
    )


FILE_CONFLICTS = (
    "model", "dataset", "reward_functions", "gpus", "nodes", "max_retries", "priority", "name",
    "output_dir", "extra_args", "vllm_server_gpus", "vllm_server_own_vm", "workdir",
    "hang_timeout", "startup_timeout",
)  # fmt: skip
"""`job submit` parameters a spec file gives: refused beside `-f`, never silently mixed."""


def spec_from_file(path: str, env: tuple[tuple[str, str], ...]) -> JobSpec:
    """The job a spec file describes, validated whole (`BadInput` naming the field); `--env`
    values are added to the role's own."""
    from click.core import ParameterSource

    from scheduler.jobspec import load_file

    click_ctx = click.get_current_context()
    for param in FILE_CONFLICTS:
        if click_ctx.get_parameter_source(param) not in (None, ParameterSource.DEFAULT):
            flag = "train arguments after --" if param == "extra_args" else param
            raise BadInput(f"-f {path}: give {flag.replace('_', '-')} in the file, not as well")
    group = load_file(path)
    spec = _file_job_spec(group, env)
    if group.workdir is None:
        return spec
    return with_workdir(spec, file_workdir(path, group.workdir), f"-f {path}: workdir")


def file_workdir(path: str, workdir: str) -> str:
    """A job file's `workdir:`, relative to the file's own directory (`~` expanded)."""
    import os

    workdir = os.path.expanduser(workdir)
    return os.path.join(os.path.dirname(os.path.abspath(path)), workdir)


def with_workdir(spec: JobSpec, directory: str, where: str) -> JobSpec:
    """`spec` with the workdir at `directory` packed (`scheduler.workdir.pack`)."""
    from dataclasses import replace

    from scheduler.workdir import pack

    return replace(spec, workdir=pack(directory, f"{where} {directory}"))


def _file_job_spec(group: GroupSpec, env: tuple[tuple[str, str], ...]) -> JobSpec:
    """The job row a loaded spec file describes, its workdir not packed yet."""
    if len(group.roles) != 1 or group.roles[0].train is None:
        return group_job_spec(group, env)
    role = group.roles[0]
    train = role.train
    assert train is not None  # checked above
    return JobSpec(
        model=train.model,
        dataset=train.dataset,
        reward_functions=train.reward_functions,
        gpus=role.gpus,
        nodes=role.nodes,
        max_retries=group.max_retries,
        priority=group.priority,
        name=group.name,
        extra_args=train.args,
        output_dir=group.output_dir,
        env=role.env + env,
        hang_timeout_s=group.hang_timeout_s,
        startup_timeout_s=group.startup_timeout_s,
        store=group.store,
    )


def group_job_spec(group: GroupSpec, env: tuple[tuple[str, str], ...]) -> JobSpec:
    """The job row of a job group: its roles (without env values, which go to the job's
    environment), the VMs of its layout (one unless roles have `own_vm` or `nodes`) and
    every node's GPUs together, and the first training role's model, dataset and rewards
    for listings (`-` for a group without one)."""
    layout = group.layout()
    if len(layout) == 1 and group.gpus < 1:
        raise BadInput("roles: a job needs at least one GPU (give a role gpus: 1 or more)")
    train = next((r.train for r in group.roles if r.train is not None), None)
    return JobSpec(
        model=train.model if train else "-",
        dataset=train.dataset if train else "-",
        reward_functions=train.reward_functions if train else ("-",),
        gpus=group.gpus if len(layout) == 1 else sum(n.gpus for n in layout),
        nodes=len(layout),
        max_retries=group.max_retries,
        priority=group.priority,
        name=group.name,
        output_dir=group.output_dir,
        env=group.env() + env,
        roles=group.to_data(),
        hang_timeout_s=group.hang_timeout_s,
        startup_timeout_s=group.startup_timeout_s,
        store=group.store,
    )


def with_vllm_server(spec: JobSpec, gpus: int, *, own_vm: bool = False) -> JobSpec:
    """`--vllm-server-gpus`: the flags' one training role as a group with a `vllm` role
    (on a VM of its own with `--vllm-server-own-vm`)."""
    from scheduler.jobspec import parse_data

    spec.validate()  # errors name the flags, not the group's fields
    data = {
        "vllm_server_gpus": gpus,
        "vllm_server_own_vm": own_vm,
        "roles": {
            "trainer": {
                "gpus": spec.gpus,
                "nodes": spec.nodes,
                "train": {
                    "model": spec.model,
                    "dataset": spec.dataset,
                    "reward_functions": list(spec.reward_functions),
                    "args": list(spec.extra_args),
                },
            }
        },
    }
    try:
        group = parse_data(data)
    except BadInput as exc:
        # The group's field names mean nothing to someone who typed flags.
        text = re.sub(
            r"^roles\.trainer\.train\.args\[(\d+)\]",
            lambda m: f"argument {int(m.group(1)) + 1} after --",
            str(exc),
        )
        raise BadInput(text) from None
    group = replace_top(group, spec)
    return group_job_spec(group, spec.env)


def replace_top(group: GroupSpec, spec: JobSpec) -> GroupSpec:
    """The group with the job-wide fields of `spec` (name, priority, retries, output)."""
    from dataclasses import replace

    return replace(
        group,
        name=spec.name,
        priority=spec.priority,
        max_retries=spec.max_retries,
        output_dir=spec.output_dir,
        hang_timeout_s=spec.hang_timeout_s,
        startup_timeout_s=spec.startup_timeout_s,
    )


def parse_env_options(values: tuple[str, ...]) -> tuple[tuple[str, str], ...]:
    """`--env KEY=VALUE` and `--env KEY` (value from this process's environment) as pairs;
    `BadInput` for a KEY alone that is not set here."""
    import os

    pairs = []
    for item in values:
        key, eq, value = item.partition("=")
        if not eq:
            if key not in os.environ:
                raise BadInput(f"--env {key}: not set in this shell (give KEY=VALUE)")
            value = os.environ[key]
        pairs.append((key, value))
    return tuple(pairs)
