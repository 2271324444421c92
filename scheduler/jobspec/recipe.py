"""The training entrypoint's inputs in a job file (`train:`): its own keys (model, dataset,
reward functions, args) and any key of a `trl grpo --config` recipe, read as
train_grpo.py arguments (`recipe_train`, which `job submit --config` uses too).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from scheduler.errors import BadInput
from scheduler.jobspec.fields import _mapping, _text, _words
from scheduler.jobspec.model import Train
from scheduler.validate import extra_args_problem

TRAIN_KEYS = ("model", "dataset", "reward_functions", "args")


RECIPE_OWNED = {
    "output_dir": "the scheduler sets it (job submit --output-dir, or output_dir at the top of "
    "a job file)",
    "resume": "the scheduler resumes every retry from the job's newest checkpoint itself",
}
"""train_grpo.py fields a recipe may not set for a job, and why."""


def recipe_train(
    data: Mapping[str, Any], where: str
) -> tuple[dict[str, Any], tuple[str, ...], list[str]]:
    """A recipe's keys (`trl grpo --config`'s format, or the extra keys of `train:`) as the
    model, dataset and reward functions it names, the train_grpo.py arguments of the rest,
    and a note for each key the scheduler owns (`output_dir`, `resume_from_checkpoint`),
    which are left out. A bad key or value is `BadInput` naming it."""
    from trlspec.recipe import RecipeError, recipe_argv, recipe_values

    if "env" in data:
        raise BadInput(f"{where}.env: give the job's variables with --env or a role's env:")
    try:
        values = recipe_values(dict(data), where)
    except RecipeError as exc:
        raise BadInput(str(exc)) from None
    notes = []
    for key, why in RECIPE_OWNED.items():
        if key in values:
            values.pop(key)
            trl_spelling = key == "resume" and "resume_from_checkpoint" in data
            written = "resume_from_checkpoint" if trl_spelling else key
            notes.append(f"{where}: {written} is left out: {why}")
    found = {}
    for key in ("model", "dataset", "reward_function"):
        if key in values:
            found[key] = values.pop(key)
    mixture = values.get("datasets")
    if "dataset" not in found and isinstance(mixture, list) and mixture:
        first = mixture[0]
        if isinstance(first, dict) and first.get("path"):
            found["dataset"] = str(first["path"])  # listings; train_grpo.py loads the mixture
    return found, tuple(recipe_argv(values)), notes


def _train(value: Any, where: str) -> Train:
    """The training entrypoint's inputs: TRAIN_KEYS, and any key a recipe may hold."""
    data = _mapping(value, where, None)
    recipe = {k: v for k, v in data.items() if k not in TRAIN_KEYS}
    recipe_args: tuple[str, ...] = ()
    if recipe:
        found, recipe_args, notes = recipe_train(recipe, where)
        if notes:
            raise BadInput(notes[0])
        for key, own in (("model", "model"), ("dataset", "dataset"),
                         ("reward_functions", "reward_function")):  # fmt: skip
            if own in found:
                if key in data:
                    raise BadInput(f"{where}: give {key} once (it is also in {sorted(recipe)})")
                data[key] = found[own]
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
    args = recipe_args + _words(data.get("args", []), f"{where}.args", allow_empty=True)
    problem = extra_args_problem(args)
    if problem:
        raise BadInput(f"{where}.args: {problem.replace('after --', 'in args')}")
    return Train(
        model=_text(data["model"], f"{where}.model"),
        dataset=_text(data["dataset"], f"{where}.dataset"),
        reward_functions=rewards,
        args=args,
    )
