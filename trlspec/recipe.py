"""A recipe's values (`trl grpo --config`'s format: keys are field names) checked against
train_grpo.py's flags: its own (`trlspec.flags`) and TRL's (`trlspec.schema`), each value
converted to its field's type, a bad key or value a `RecipeError` naming it; and the
train_grpo.py command line that gives the same values (`recipe_argv`).

train_grpo.py checks its `--config` with `check_values` on the VM, against the TRL
installed there; the scheduler checks a job's recipe with `recipe_values` at submit time,
against the TRL installed where it runs, or the shipped schema where there is none.
"""

from __future__ import annotations

import dataclasses
import difflib
import json
from typing import Any

from trlspec.flags import ALIASES, OWN_FIELDS, own_fields
from trlspec.schema import fields_by_name
from trlspec.values import FALSE, NONE, TRUE, convert


class RecipeError(ValueError):
    """A recipe (or the command line) names an unknown key, a value of the wrong type or a
    conflict; the message names it and is meant for the user as is."""


def trl_fields() -> dict[str, dict[str, Any]]:
    """The TRL fields that are flags of train_grpo.py (rlfleet's own names win a clash)."""
    return {name: spec for name, spec in fields_by_name().items() if name not in OWN_FIELDS}


def canonical(values: dict[str, Any], where: str) -> dict[str, Any]:
    """`values` with TRL's names for rlfleet's own flags renamed; both at once is an error."""
    out = dict(values)
    for trl_name, own in ALIASES.items():
        if trl_name not in out:
            continue
        if own in out:
            raise RecipeError(f"{where}: give --{own} or {trl_name}, not both")
        value = out.pop(trl_name)
        if own == "resume":
            text = str(value).lower()
            value = "auto" if text in TRUE else (None if text in FALSE | NONE else str(value))
        elif own == "reward_function" and isinstance(value, str):
            value = [value]
        out[own] = value
    return out


def _own_value(f: dataclasses.Field[Any], value: Any, where: str) -> Any:
    """A recipe's value for one of rlfleet's own fields, checked like its flag."""
    kind = str(f.type)

    def wrong(expected: str) -> str:
        return f"{where}: key {f.name}: expected {expected}, got {value!r}"

    if kind.startswith("list["):
        items = value if isinstance(value, list) else [value]
        if not all(isinstance(v, (str, int, float)) and not isinstance(v, bool) for v in items):
            raise RecipeError(wrong("a list of values"))
        return [str(v) for v in items]
    if kind == "bool":
        if isinstance(value, str) and value.lower() in TRUE | FALSE:
            return value.lower() in TRUE
        if not isinstance(value, bool):
            raise RecipeError(wrong("true or false"))
        return value
    if kind.startswith(("int", "float")):
        number = int if kind.startswith("int") else float
        try:
            if isinstance(value, bool) or (number is int and isinstance(value, float)):
                raise ValueError
            return number(value)
        except (TypeError, ValueError):
            raise RecipeError(wrong("an integer" if number is int else "a number")) from None
    if isinstance(value, (dict, list, bool)):
        raise RecipeError(wrong("a string"))
    text = str(value)
    choices = f.metadata.get("choices")
    if choices and text not in choices:
        raise RecipeError(f"{where}: key {f.name}: {text!r} is not one of {', '.join(choices)}")
    return text


def check_values(data: dict[str, Any], where: str) -> dict[str, Any]:
    """Recipe values by field name, each checked against its field; RecipeError naming a bad
    key."""
    own = own_fields()
    trl = trl_fields()
    values: dict[str, Any] = {}
    for key, value in data.items():
        name = str(key)
        if name == "config":
            raise RecipeError(f"{where}: key config: a recipe cannot name another recipe")
        if name in own:
            if value is not None:  # null: rlfleet's default, as for TRL's fields.
                values[name] = _own_value(own[name], value, where)
        elif name == "resume_from_checkpoint" and isinstance(value, bool):
            values[name] = value  # TRL's "the newest checkpoint" (--resume auto)
        elif name in trl:
            try:
                values[name] = convert(trl[name], value)
            except ValueError as exc:
                raise RecipeError(f"{where}: key {name}: {exc}") from None
        else:
            close = difflib.get_close_matches(name, [*own, *trl], n=1)
            hint = f" (did you mean {close[0]}?)" if close else ""
            raise RecipeError(f"{where}: unknown key {name!r}{hint}")
    return values


def recipe_values(data: dict[str, Any], where: str) -> dict[str, Any]:
    """A recipe's values (without `env`), checked and under rlfleet's names for the fields it
    has flags for; RecipeError naming a bad key."""
    return canonical(check_values(data, where), where)


def recipe_argv(values: dict[str, Any]) -> list[str]:
    """train_grpo.py's command line for recipe values (as `recipe_values` gives them)."""
    words: list[str] = []
    for name, value in values.items():
        if value is None:
            continue
        items = value if isinstance(value, list) else [value]
        if not items:
            continue
        words.append(f"--{name}")
        for item in items:
            if isinstance(item, bool):
                words.append("true" if item else "false")
            elif isinstance(item, (dict, list)):
                words.append(json.dumps(item))
            else:
                words.append(str(item))
    return words
