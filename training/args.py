"""The command line of train_grpo.py: rlfleet's own flags (`trlspec.flags.ScriptArguments`,
with help on every field), every field of TRL's GRPOConfig/ModelConfig/DatasetMixtureConfig
and `trl grpo`'s script arguments under its own name (from `trlspec.schema`), and
`--config RECIPE.yaml` in `trl grpo`'s format (checked by `trlspec.recipe`), all parsed by
argparse; `training.arg_checks` says which combinations cannot work.

argparse over the generated schema rather than transformers' HfArgumentParser over TRL's
classes keeps `--help` and argument errors fast (no torch import), and keeps transformers
from being imported before Unsloth, which must come first.
"""

from __future__ import annotations

import argparse
import dataclasses
import re
import sys
from typing import Any, NoReturn

from training.arg_checks import check_args, check_vllm_args
from training.errors import EXIT_USAGE
from trlspec.flags import ALIASES, OWN_FIELDS, ScriptArguments
from trlspec.recipe import (
    RecipeError,
    canonical,
    check_values,
    recipe_argv,
    recipe_values,
    trl_fields,
)
from trlspec.schema import GROUPS
from trlspec.values import FALSE, TRUE, convert

__all__ = [
    "ALIASES",
    "OWN_FIELDS",
    "UNSUPPORTED",
    "RecipeError",
    "ScriptArguments",
    "build_parser",
    "check_args",
    "check_values",
    "check_vllm_args",
    "convert",
    "parse_args",
    "read_recipe",
    "recipe_argv",
    "recipe_values",
    "trl_fields",
    "usage_error",
]

UNSUPPORTED: dict[str, str] = {
    "dataset_streaming": "streaming datasets are not supported by train-grpo",
    "reward_model_name_or_path": "use a reward function (--reward_function) or a reward server",
}
"""`trl grpo` script arguments train-grpo accepts only at their default, and why."""


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> NoReturn:
        # The scheduler reads exit codes: bad arguments are permanent failures (64), not
        # argparse's usual 2.
        usage_error(message, self.prog)


def usage_error(message: str, prog: str = "train-grpo") -> NoReturn:
    """Print one `error:` line and exit 64."""
    print(f"{prog}: error: {' '.join(message.split())}", file=sys.stderr)
    raise SystemExit(EXIT_USAGE)


def _str2bool(text: str) -> bool:
    lowered = text.lower()
    if lowered in TRUE:
        return True
    if lowered in FALSE:
        return False
    raise argparse.ArgumentTypeError(f"expected true or false, got {text!r}")


def _add_argument(parser: Any, f: dataclasses.Field[Any]) -> None:
    kwargs: dict[str, Any] = {
        "help": f.metadata["help"],
        "dest": f.name,
        "default": argparse.SUPPRESS,  # Unset flags stay out: the recipe may give them.
    }
    for key in ("choices", "metavar"):
        if key in f.metadata:
            kwargs[key] = f.metadata[key]
    kind = str(f.type)
    if f.default not in (dataclasses.MISSING, None, False, ""):
        kwargs["help"] += f" (default: {f.default})"
    if kind == "bool":
        kwargs.update(nargs="?", const=True, type=_str2bool, metavar="BOOL")
    elif kind.startswith("list["):
        kwargs.update(action="extend", nargs="+", type=str)
    elif "choices" not in kwargs and f.name not in ("resume", "config") and kind.startswith("str"):
        kwargs.setdefault("metavar", f.name.split("_")[-1].upper())
    elif kind.startswith(("int", "float")):
        kwargs["type"] = int if kind.startswith("int") else float
    parser.add_argument(f"--{f.name}", **kwargs)


# --- TRL's fields, from the schema ----------------------------------------------------------


class _Convert:
    """argparse `type=` for a TRL field: `convert`, with argparse's one-line error."""

    def __init__(self, spec: dict[str, Any], item: bool = False) -> None:
        self.spec = {**spec, "kinds": [spec.get("item", "str")]} if item else spec
        self.__name__ = spec["name"]

    def __call__(self, text: str) -> Any:
        try:
            return convert(self.spec, text)
        except ValueError as exc:
            raise argparse.ArgumentTypeError(str(exc)) from None


def _help_default(value: Any) -> str:
    if isinstance(value, str) and len(value) > 40:
        return ""
    return "" if value in (None, "", [], {}) else f" (default: {value})"


def _add_trl_argument(parser: Any, spec: dict[str, Any]) -> None:
    name = spec["name"]
    flags = [f"--{name}"]
    if "_" in name:
        flags.append(f"--{name.replace('_', '-')}")
    kwargs: dict[str, Any] = {
        "dest": name,
        "default": argparse.SUPPRESS,
        "help": (spec["help"] or "(no help in TRL)").replace("%", "%%")
        + _help_default(spec["default"]).replace("%", "%%"),
    }
    kinds = spec["kinds"]
    if "list" in kinds:
        metavar = spec.get("item", "str").upper()
        kwargs.update(nargs="+", type=_Convert(spec, item=True), metavar=metavar)
    elif kinds == ["bool"]:
        kwargs.update(nargs="?", const=True, type=_Convert(spec), metavar="BOOL")
    else:
        choices = spec.get("choices")
        metavar = "{" + ",".join(map(str, choices)) + "}" if choices and len(choices) <= 8 else None
        kwargs.update(type=_Convert(spec), metavar=metavar or "/".join(kinds).upper())
    parser.add_argument(*flags, **kwargs)
    if spec["default"] is True and "bool" in kinds:
        parser.add_argument(
            f"--no_{name}", dest=name, action="store_false", default=argparse.SUPPRESS,
            help=f"Set {name} to false.",
        )  # fmt: skip


def build_parser() -> argparse.ArgumentParser:
    """An argparse parser: rlfleet's flags first, then TRL's, grouped by class."""
    parser = _Parser(
        prog="train-grpo",
        usage="%(prog)s --model MODEL --dataset DATASET --reward_function NAME [options]\n"
        "       %(prog)s --config RECIPE.yaml [options]",
        description="Train a causal LM with GRPO (TRL) on a prompt dataset and reward functions. "
        "Every field of TRL's GRPOConfig, ModelConfig and DatasetMixtureConfig is a flag too, "
        "under its own name, and a key of a --config recipe; their defaults are TRL's, except "
        "that bf16 and gradient checkpointing are on with a GPU only, report_to is none and "
        "LoRA is off unless use_peft or --lora_r asks for it.",
        epilog="Exit codes: 0 done, 64 bad arguments or input (a reward function that raises or "
        "returns no valid scores included), 75 transient failure (retry), 143 stopped by SIGTERM "
        "after saving a checkpoint of the current step (--resume auto continues from it).",
    )
    own = parser.add_argument_group("train-grpo (rlfleet)")
    for f in dataclasses.fields(ScriptArguments):
        if f.metadata.get("cli", 1):
            _add_argument(own, f)
    fields = trl_fields()
    for group, title in GROUPS:
        section = parser.add_argument_group(title)
        for spec in fields.values():
            if spec["group"] == group:
                _add_trl_argument(section, spec)
    return parser


# --- parsing ---------------------------------------------------------------------------------


def _split_commas(values: list[str] | None) -> list[str] | None:
    if values is None:
        return None
    return [part.strip() for value in values for part in str(value).split(",") if part.strip()]


def read_recipe(path: str) -> tuple[dict[str, Any], dict[str, str]]:
    """A recipe file's values by field name (checked and converted) and its `env` mapping;
    RecipeError for a file that cannot be read or holds a bad key."""
    from training.recipe_yaml import RecipeYamlError, load_recipe_yaml

    where = path
    try:
        data = load_recipe_yaml(path)  # bounded: no aliases, 1 MiB, 32 levels
    except OSError as exc:
        raise RecipeError(f"--config {path}: cannot read it: {exc.strerror or exc}") from None
    except RecipeYamlError as exc:
        raise RecipeError(f"--config {path}: {exc}") from None
    if data is None:
        data = {}
    if not isinstance(data, dict):
        raise RecipeError(f"--config {path}: expected a mapping of field names to values")
    env = data.pop("env", None) or {}
    if not isinstance(env, dict) or not all(
        isinstance(k, str) and re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*", k) for k in env
    ):
        raise RecipeError(f"{where}: key env: expected a mapping of variable names to values")
    return check_values(data, where), {k: "" if v is None else str(v) for k, v in env.items()}


def parse_args(argv: list[str] | None = None) -> ScriptArguments:
    """Parse the command line and the recipe it names; a bad flag, key or value, or a
    combination that cannot work, exits 64 with one line on stderr."""
    parser = build_parser()
    recipe: dict[str, Any] = {}
    env: dict[str, str] = {}
    try:
        cli = canonical(vars(parser.parse_args(argv)), "command line")
        if cli.get("config"):
            raw, env = read_recipe(cli["config"])
            recipe = canonical(raw, cli["config"])
    except RecipeError as exc:
        usage_error(str(exc))
    for name in ("reward_function", "keywords"):
        if name in recipe:
            recipe[name] = _split_commas(recipe[name])
        if name in cli:
            cli[name] = _split_commas(cli[name])
    merged = {**recipe, **cli}  # The command line overrides the file, as with `trl grpo`.
    weights = _split_commas(merged.get("reward_weights"))
    if weights is not None:
        try:
            merged["reward_weights"] = [float(w) for w in weights]
        except ValueError:
            parser.error(f"--reward_weights: expected numbers, got {' '.join(weights)}")
    for name, why in UNSUPPORTED.items():
        if merged.get(name):
            parser.error(f"{name}: {why}")
    own = {name: merged[name] for name in OWN_FIELDS if name in merged}
    extra = {name: value for name, value in merged.items() if name not in OWN_FIELDS}
    args = ScriptArguments(**own, trl=extra, given=frozenset(merged), env=env)
    problem = check_args(args)
    if problem:
        parser.error(problem)
    return args
