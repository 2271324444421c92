"""The command line of train_grpo.py: rlfleet's own flags (a dataclass with help on every
field), every field of TRL's GRPOConfig/ModelConfig/DatasetMixtureConfig and `trl grpo`'s
script arguments under its own name (from `training.trl_schema`), and `--config RECIPE.yaml`
in `trl grpo`'s format, all parsed by argparse.

argparse over the generated schema rather than transformers' HfArgumentParser over TRL's
classes keeps `--help` and argument errors fast (no torch import), and keeps transformers
from being imported before Unsloth, which must come first.
"""

from __future__ import annotations

import argparse
import dataclasses
import difflib
import json
import re
import sys
import urllib.parse
from dataclasses import dataclass, field
from typing import Any, NoReturn

from rewards import BUILTIN_REWARDS
from training.errors import EXIT_USAGE
from training.reward_guard import DEFAULT_MAX_UNSCORED_STEPS


@dataclass
class ScriptArguments:
    """Everything train_grpo.py can be told; field names are the flag names."""

    model: str = field(
        default="",
        metadata={
            "help": "Model to train: a hub name (Qwen/Qwen2.5-0.5B-Instruct) or a local directory "
            "(TRL's model_name_or_path)."
        },
    )
    dataset: str = field(
        default="",
        metadata={
            "help": "Training data: a local .json/.jsonl/.parquet/.csv file or a hub dataset name "
            "(TRL's dataset_name; or a mixture in `datasets`). Needs a 'prompt' or 'question' "
            "column; an 'answer' column becomes 'ground_truth'."
        },
    )
    reward_function: list[str] = field(
        default_factory=list,
        metadata={
            "help": "Reward function, repeatable (or comma-separated): a built-in name "
            f"({', '.join(BUILTIN_REWARDS)}), module:function or a dotted path importable from "
            "the working directory or PYTHONPATH, or a TRL reward (accuracy_reward, "
            "think_format_reward, ...; TRL's reward_funcs).",
            "metavar": "NAME",
        },
    )
    dataset_split: str = field(
        default="train", metadata={"help": "Dataset split to train on (TRL's dataset_train_split)."}
    )
    dataset_config: str | None = field(
        default=None,
        metadata={
            "help": "Configuration of a hub dataset with several ('main' for openai/gsm8k).",
            "metavar": "NAME",
        },
    )
    reward_weights: list[float] | None = field(
        default=None,
        metadata={
            "help": "One weight per reward function, in the same order (default: all 1.0).",
            "metavar": "WEIGHT",
        },
    )
    keywords: list[str] | None = field(
        default=None,
        metadata={
            "help": "Keywords for keyword_match (space- or comma-separated); without it "
            "keyword_match "
            "reads a 'keywords' column.",
            "metavar": "WORD",
        },
    )
    preprocess: str = field(
        default="generic",
        metadata={
            "help": "Prompt construction: 'generic' uses the question as is; 'deepseek' adds "
            "the R1 "
            "system prompt asking for <think>...</think><answer>...</answer>.",
            "choices": ("generic", "deepseek"),
        },
    )
    output_dir: str = field(
        default="grpo-output",
        metadata={"help": "Where checkpoints, progress.json and the final model are written."},
    )
    max_steps: int = field(
        default=500, metadata={"help": "Number of optimizer steps to train for."}
    )
    learning_rate: float = field(default=1e-6, metadata={"help": "Peak learning rate (AdamW)."})
    num_generations: int = field(
        default=8, metadata={"help": "Completions sampled per prompt (the GRPO group size, >= 2)."}
    )
    per_device_train_batch_size: int = field(
        default=8,
        metadata={
            "help": "Completions per device per step; times the number of devices it must be a "
            "multiple of --num_generations."
        },
    )
    gradient_accumulation_steps: int = field(
        default=1, metadata={"help": "Micro-batches accumulated into one optimizer step."}
    )
    max_completion_length: int = field(
        default=256, metadata={"help": "Maximum number of tokens generated per completion."}
    )
    temperature: float = field(
        default=1.0, metadata={"help": "Sampling temperature for generation."}
    )
    beta: float = field(
        default=0.0, metadata={"help": "KL penalty coefficient; 0 skips the reference model."}
    )
    lora_r: int = field(
        default=0, metadata={"help": "LoRA rank; 0 trains all the weights (full fine-tune)."}
    )
    lora_alpha: int = field(default=0, metadata={"help": "LoRA alpha; 0 means twice --lora_r."})
    use_unsloth: bool = field(
        default=False,
        metadata={
            "help": "Load and train the model with Unsloth (needs a CUDA GPU and unsloth "
            "installed)."
        },
    )
    use_vllm: bool = field(
        default=False, metadata={"help": "Generate completions with vLLM (passed through to TRL)."}
    )
    vllm_mode: str = field(
        default="colocate",
        metadata={
            "help": "With --use_vllm: 'colocate' runs vLLM in the training process, 'server' talks "
            "to a running `trl vllm-serve`.",
            "choices": ("colocate", "server"),
        },
    )
    vllm_server_host: str = field(
        default="0.0.0.0",
        metadata={
            "help": "With --vllm_mode server: host name or address of the `trl vllm-serve` server.",
            "metavar": "HOST",
        },
    )
    vllm_server_port: int = field(
        default=8000,
        metadata={"help": "With --vllm_mode server: the HTTP port of the vLLM server."},
    )
    vllm_group_port: int = field(
        default=51216,
        metadata={
            "help": "With --vllm_mode server: the port of the NCCL group that sends the trained "
            "weights to the vLLM server."
        },
    )
    vllm_server_base_url: str | None = field(
        default=None,
        metadata={
            "help": "With --vllm_mode server: the server's base URL (http://host:port); replaces "
            "--vllm_server_host and --vllm_server_port.",
            "metavar": "URL",
        },
    )
    vllm_server_timeout: float = field(
        default=240.0,
        metadata={"help": "With --vllm_mode server: seconds to wait for the server to be up."},
    )
    seed: int = field(
        default=42, metadata={"help": "Random seed for sampling, shuffling and init."}
    )
    logging_steps: int = field(
        default=1, metadata={"help": "Log metrics and rewrite progress.json every N steps."}
    )
    save_steps: int = field(default=100, metadata={"help": "Save a checkpoint every N steps."})
    save_total_limit: int = field(
        default=2, metadata={"help": "Keep at most this many checkpoints (0 keeps all)."}
    )
    max_unscored_steps: int = field(
        default=DEFAULT_MAX_UNSCORED_STEPS,
        metadata={
            "help": "Stop with exit 64 after this many steps in a row in which no completion got "
            "a score (every reward None or NaN); 0 never stops."
        },
    )
    resume: str | None = field(
        default=None,
        metadata={
            "help": "Resume training: 'auto' picks the newest checkpoint in --output_dir (starting "
            "fresh when there is none), or give a checkpoint directory (TRL's "
            "resume_from_checkpoint; true there means auto)."
        },
    )
    config: str | None = field(
        default=None,
        metadata={
            "help": "A recipe: a YAML file in `trl grpo --config`'s format (keys are the names of "
            "these flags and of TRL's fields; an `env` mapping sets variables). Flags given on "
            "the command line override the file.",
            "metavar": "RECIPE.yaml",
        },
    )
    trl: dict[str, Any] = field(default_factory=dict, metadata={"cli": False})
    """The TRL fields given (on the command line or in the recipe) that are not fields here."""
    given: frozenset[str] = field(default_factory=frozenset, metadata={"cli": False})
    """The names of every field given on the command line or in the recipe."""
    env: dict[str, str] = field(default_factory=dict, metadata={"cli": False})
    """The recipe's `env` mapping: variables set before anything is loaded."""

    def report_to(self) -> list[str]:
        """The trackers `report_to` names (none when it was not given)."""
        value = self.trl.get("report_to")
        names = [value] if isinstance(value, str) else list(value or [])
        return [str(name) for name in names if name not in (None, "none")]

    def trl_group(self, group: str) -> dict[str, Any]:
        """The TRL fields of class `group` ('grpo', 'model', 'mixture' or 'script', see
        `training.trl_schema.GROUPS`) given beyond rlfleet's own flags, by name."""
        from training.trl_schema import fields_by_name

        fields = fields_by_name()
        return {k: v for k, v in self.trl.items() if fields.get(k, {}).get("group") == group}


ALIASES: dict[str, str] = {
    "model_name_or_path": "model",
    "dataset_name": "dataset",
    "dataset_train_split": "dataset_split",
    "reward_funcs": "reward_function",
    "resume_from_checkpoint": "resume",
}
"""TRL's names for things rlfleet has a flag of its own for: both spellings are accepted."""

UNSUPPORTED: dict[str, str] = {
    "dataset_streaming": "streaming datasets are not supported by train-grpo",
    "reward_model_name_or_path": "use a reward function (--reward_function) or a reward server",
}
"""`trl grpo` script arguments train-grpo accepts only at their default, and why."""

OWN_FIELDS = tuple(f.name for f in dataclasses.fields(ScriptArguments) if f.metadata.get("cli", 1))


class RecipeError(ValueError):
    """A recipe (or the command line) names an unknown key, a value of the wrong type or a
    conflict; the message names it and is meant for the user as is."""


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> NoReturn:
        # The scheduler reads exit codes: bad arguments are permanent failures (64), not
        # argparse's usual 2.
        usage_error(message, self.prog)


def usage_error(message: str, prog: str = "train-grpo") -> NoReturn:
    """Print one `error:` line and exit 64."""
    print(f"{prog}: error: {' '.join(message.split())}", file=sys.stderr)
    raise SystemExit(EXIT_USAGE)


_TRUE = {"1", "true", "yes", "on", "y", "t"}
_FALSE = {"0", "false", "no", "off", "n", "f"}
_NONE = {"none", "null"}


def _str2bool(text: str) -> bool:
    lowered = text.lower()
    if lowered in _TRUE:
        return True
    if lowered in _FALSE:
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


def _kind_error(spec: dict[str, Any], value: Any) -> str:
    kinds = " or ".join("true/false" if k == "bool" else k for k in spec["kinds"])
    if spec.get("item"):
        kinds = kinds.replace("list", f"list of {spec['item']}")
    return f"expected {kinds}, got {value!r}"


def _one(kind: str, text: str) -> Any:
    """`text` (from the command line) as a value of `kind`; ValueError when it is not one."""
    if kind == "bool":
        lowered = text.lower()
        if lowered in _TRUE | _FALSE:
            return lowered in _TRUE
        raise ValueError(text)
    if kind == "int":
        return int(text)
    if kind == "float":
        return float(text)
    if kind == "dict":
        value = json.loads(text)
        if not isinstance(value, dict):
            raise ValueError(text)
        return value
    if kind == "any":
        try:
            return json.loads(text)
        except ValueError:
            return text
    return text


def convert(spec: dict[str, Any], value: Any) -> Any:
    """A value for the TRL field `spec` from the command line (a string) or a recipe (YAML):
    checked and converted to the field's type; ValueError naming what was expected."""
    kinds: list[str] = spec["kinds"]
    if value is None or (isinstance(value, str) and value.lower() in _NONE and "str" not in kinds):
        if spec["optional"] or spec["default"] is None:
            return None
        raise ValueError(_kind_error(spec, value))
    if "list" in kinds and isinstance(value, (list, tuple)):
        item = {"name": spec["name"], "kinds": [spec.get("item", "str")], "optional": False,
                "default": ""}  # fmt: skip
        return [convert(item, v) for v in value]
    if "list" in kinds and "str" not in kinds:
        return [convert({**spec, "kinds": [spec.get("item", "str")]}, value)]
    if isinstance(value, str):
        for kind in [k for k in kinds if k != "str"] + [k for k in kinds if k == "str"]:
            try:
                result = _one(kind, value)
            except ValueError:
                continue
            break
        else:
            raise ValueError(_kind_error(spec, value))
    else:
        result = _typed(spec, value)
    choices = spec.get("choices")
    if choices and result not in choices and not isinstance(result, (list, dict)):
        raise ValueError(f"{result!r} is not one of {', '.join(map(str, choices))}")
    return result


def _typed(spec: dict[str, Any], value: Any) -> Any:
    """A YAML value (not a string) checked against the field's kinds."""
    kinds = spec["kinds"]
    if isinstance(value, bool):
        if "bool" in kinds or "any" in kinds:
            return value
    elif isinstance(value, int):
        if "int" in kinds:
            return value
        if "float" in kinds:
            return float(value)
    elif isinstance(value, float):
        if "float" in kinds:
            return value
        if "int" in kinds and value.is_integer():
            return int(value)
    elif isinstance(value, dict) and "dict" in kinds:
        return value
    if "any" in kinds:
        return value
    raise ValueError(_kind_error(spec, value))


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


def trl_fields() -> dict[str, dict[str, Any]]:
    """The TRL fields that are flags of train_grpo.py (rlfleet's own names win a clash)."""
    from training.trl_schema import fields_by_name

    return {name: spec for name, spec in fields_by_name().items() if name not in OWN_FIELDS}


def build_parser() -> argparse.ArgumentParser:
    """An argparse parser: rlfleet's flags first, then TRL's, grouped by class."""
    from training.trl_schema import GROUPS

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


def _canonical(values: dict[str, Any], where: str) -> dict[str, Any]:
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
            value = "auto" if text in _TRUE else (None if text in _FALSE | _NONE else str(value))
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
        if isinstance(value, str) and value.lower() in _TRUE | _FALSE:
            return value.lower() in _TRUE
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


def check_values(data: dict[str, Any], where: str) -> dict[str, Any]:
    """Recipe values by field name, each checked against its field; RecipeError naming a bad
    key."""
    own = {f.name: f for f in dataclasses.fields(ScriptArguments) if f.metadata.get("cli", 1)}
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
    return _canonical(check_values(data, where), where)


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


def parse_args(argv: list[str] | None = None) -> ScriptArguments:
    """Parse the command line and the recipe it names; a bad flag, key or value, or a
    combination that cannot work, exits 64 with one line on stderr."""
    parser = build_parser()
    recipe: dict[str, Any] = {}
    env: dict[str, str] = {}
    try:
        cli = _canonical(vars(parser.parse_args(argv)), "command line")
        if cli.get("config"):
            raw, env = read_recipe(cli["config"])
            recipe = _canonical(raw, cli["config"])
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


# Integer flags and the least value each accepts; anything smaller is refused before any
# loading, rather than failing later inside TRL with a traceback.
_INTEGER_MINIMUMS: tuple[tuple[str, int], ...] = (
    ("max_steps", 1),
    ("num_generations", 2),
    ("per_device_train_batch_size", 1),
    ("gradient_accumulation_steps", 1),
    ("max_completion_length", 1),
    ("lora_r", 0),
    ("lora_alpha", 0),
    ("logging_steps", 1),
    ("save_steps", 1),
    ("save_total_limit", 0),
    ("max_unscored_steps", 0),
)


def check_args(args: ScriptArguments) -> str | None:
    """Return what is wrong with a combination of arguments, or None when they make sense."""
    if not args.model:
        return "the model is required: give --model (TRL's model_name_or_path)"
    if not args.dataset and not args.trl.get("datasets"):
        return "the dataset is required: give --dataset (TRL's dataset_name, or datasets)"
    if not args.reward_function:
        return "--reward_function: give at least one reward function (TRL's reward_funcs)"
    if args.reward_weights is not None and len(args.reward_weights) != len(args.reward_function):
        return (
            f"--reward_weights has {len(args.reward_weights)} values for "
            f"{len(args.reward_function)} reward functions"
        )
    for name, minimum in _INTEGER_MINIMUMS:
        value = getattr(args, name)
        if name == "max_steps" and value == -1 and "num_train_epochs" in args.given:
            continue  # TRL's way of training for num_train_epochs instead.
        if value < minimum:
            return f"--{name} must be at least {minimum}"
    if args.lora_r == 0 and "lora_r" in args.given and args.trl.get("use_peft"):
        return "use_peft needs a LoRA rank: --lora_r must be at least 1"
    return check_vllm_args(args)


# A host name or an IPv4/IPv6 address; nothing that could add a path, user or query to a URL.
# \Z, not $: `$` also matches before a final newline.
_HOST = re.compile(r"^(?:[A-Za-z0-9](?:[A-Za-z0-9-]{0,61}[A-Za-z0-9])?\.?)+\Z|^[0-9A-Fa-f:.]+\Z")


def check_vllm_args(args: ScriptArguments) -> str | None:
    """Return what is wrong with the vLLM server flags, or None."""
    for name in ("vllm_server_port", "vllm_group_port"):
        if not 1 <= getattr(args, name) <= 65535:
            return f"--{name} must be a port number (1 to 65535)"
    if not args.vllm_server_timeout > 0:
        return "--vllm_server_timeout must be more than 0"
    if len(args.vllm_server_host) > 253 or not _HOST.match(args.vllm_server_host):
        return f"--vllm_server_host: not a host name or address: {args.vllm_server_host!r}"
    url = args.vllm_server_base_url
    if url is not None:
        parts = urllib.parse.urlsplit(url)
        if parts.scheme not in ("http", "https") or not parts.hostname or parts.username:
            return f"--vllm_server_base_url: expected http://HOST:PORT, got {url!r}"
    return None
