"""The fields of TRL's configuration classes, as train_grpo.py's flags and recipe keys.

Every field of the installed TRL's `GRPOConfig`, `ModelConfig`, `DatasetMixtureConfig` and
the `trl grpo` script's own arguments becomes a flag under its own name, with TRL's help
text and type. The fields are read from TRL's dataclasses (`live_schema`), not listed here.

Importing trl imports transformers and torch (seconds), too slow for `--help` and for
refusing a bad flag; so the fields are also kept, as generated, in `trl_schema.json` beside
this module, stamped with the trl and transformers versions they came from. `load_schema`
uses that file when the installed versions match it (the usual case: a version check, no
import), else a copy cached for the installed versions under ~/.cache/rlfleet, else it
introspects the installed TRL and caches the result. `python -m trlspec.schema --write`
(or `make trl-schema`) regenerates the shipped file; tests/training/test_trl_args.py fails
when it no longer matches the installed TRL. The scheduler reads the same file to check a
recipe at submit time: where TRL is not installed, the shipped fields are used as they are.
"""

from __future__ import annotations

import dataclasses
import enum
import json
import os
import sys
import types
import typing
from importlib import metadata
from pathlib import Path
from typing import Any

SHIPPED = Path(__file__).resolve().parent / "trl_schema.json"
FORMAT = 1

GROUPS = (
    ("script", "trl grpo script arguments"),
    ("grpo", "TRL GRPOConfig"),
    ("model", "TRL ModelConfig"),
    ("mixture", "TRL DatasetMixtureConfig"),
)
"""The classes read, in the order their flags are listed, with the titles `--help` shows."""

Schema = dict[str, Any]


def installed_versions() -> dict[str, str]:
    """The trl and transformers versions installed: what a schema must have been built from."""
    versions = {}
    for name in ("trl", "transformers"):
        try:
            versions[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            versions[name] = ""
    return versions


def _classes() -> dict[str, type]:
    from trl import DatasetMixtureConfig, GRPOConfig, ModelConfig
    from trl.scripts.grpo import GRPOScriptArguments

    return {
        "script": GRPOScriptArguments,
        "grpo": GRPOConfig,
        "model": ModelConfig,
        "mixture": DatasetMixtureConfig,
    }


_BASIC = {bool: "bool", int: "int", float: "float", str: "str", dict: "dict"}


def _kinds(hint: Any) -> tuple[list[str], bool, list[Any] | None, str | None]:
    """(accepted kinds, whether None is accepted, choices, list item kind) of a type hint."""
    origin = typing.get_origin(hint)
    members = (
        list(typing.get_args(hint))
        if origin is typing.Union or isinstance(hint, types.UnionType)
        else [hint]
    )
    kinds: list[str] = []
    optional = False
    choices: list[Any] | None = None
    item: str | None = None
    for member in members:
        member_origin = typing.get_origin(member) or member
        if member is type(None):
            optional = True
        elif member_origin is typing.Literal:
            values = [v for v in typing.get_args(member) if v is not None and v is not False]
            optional = optional or None in typing.get_args(member)
            if not values:  # Literal[False]: a flag that is off or names something.
                kinds.append("bool")
                continue
            choices = values
            kinds.append("str" if all(isinstance(v, str) for v in values) else "any")
        elif isinstance(member_origin, type) and issubclass(member_origin, enum.Enum):
            choices = [m.value for m in member_origin]
            kinds.append("str")
        elif member_origin is list:
            args = typing.get_args(member)
            inner = typing.get_origin(args[0]) or args[0] if args else str
            item = _BASIC.get(inner, "dict" if dataclasses.is_dataclass(inner) else "str")
            kinds.append("list")
        elif member_origin in _BASIC:
            kinds.append(_BASIC[member_origin])
        else:
            kinds.append("any")
    return list(dict.fromkeys(kinds)), optional, choices, item


def _plain(value: Any) -> Any:
    """A default as JSON can hold it (an enum as its value; anything odd as its repr)."""
    if isinstance(value, enum.Enum):
        return value.value
    try:
        json.dumps(value)
    except (TypeError, ValueError):
        return repr(value)
    return value


def live_schema() -> Schema:
    """The fields of the installed TRL's classes (imports trl: seconds)."""
    fields: list[dict[str, Any]] = []
    seen: set[str] = set()
    for group, cls in _classes().items():
        hints = typing.get_type_hints(cls)
        for f in dataclasses.fields(cls):
            if not f.init or f.name in seen:
                continue
            seen.add(f.name)
            kinds, optional, choices, item = _kinds(hints[f.name])
            if f.default is not dataclasses.MISSING:
                default = _plain(f.default)
            elif f.default_factory is not dataclasses.MISSING:
                default = _plain(f.default_factory())
            else:
                default = None
            if "choices" in f.metadata:
                choices = list(f.metadata["choices"])
            entry: dict[str, Any] = {
                "name": f.name,
                "group": group,
                "kinds": kinds,
                "optional": optional,
                "default": default,
                "help": " ".join(str(f.metadata.get("help", "")).split()),
            }
            if choices is not None:
                entry["choices"] = [_plain(c) for c in choices]
            if item is not None:
                entry["item"] = item
            fields.append(entry)
    return {"format": FORMAT, "versions": installed_versions(), "fields": fields}


def _cache_path(versions: dict[str, str]) -> Path:
    base = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache")
    stamp = f"trl-{versions['trl']}-transformers-{versions['transformers']}"
    return base / "rlfleet" / f"trl-schema-{stamp}.json"


def _read(path: Path, versions: dict[str, str]) -> Schema | None:
    try:
        schema = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    if not isinstance(schema, dict) or schema.get("format") != FORMAT:
        return None
    return schema if schema.get("versions") == versions else None


_loaded: Schema | None = None


def load_schema() -> Schema:
    """The schema for the installed TRL: shipped, cached, or introspected and then cached."""
    global _loaded
    if _loaded is not None:
        return _loaded
    versions = installed_versions()
    if not versions["trl"]:
        # No TRL here (a machine that only submits jobs): the shipped fields are the best
        # guess; the VM's train_grpo.py checks the job's arguments against its own TRL.
        schema = _read(SHIPPED, json.loads(SHIPPED.read_text())["versions"])
        if schema is None:
            raise RuntimeError(f"{SHIPPED} is unreadable: reinstall rlfleet")
        _loaded = schema
        return schema
    schema = _read(SHIPPED, versions) or _read(_cache_path(versions), versions)
    if schema is None:
        schema = live_schema()
        path = _cache_path(versions)
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            tmp = path.with_suffix(f".{os.getpid()}.tmp")
            tmp.write_text(json.dumps(schema))
            tmp.replace(path)
        except OSError:
            pass  # A read-only home only costs the next run the same introspection.
    _loaded = schema
    return schema


def fields_by_name(schema: Schema | None = None) -> dict[str, dict[str, Any]]:
    """The schema's fields by name."""
    return {f["name"]: f for f in (schema or load_schema())["fields"]}


def main(argv: list[str] | None = None) -> int:
    """`python -m trlspec.schema [--write]`: print (or write) the installed TRL's schema."""
    argv = sys.argv[1:] if argv is None else argv
    text = json.dumps(live_schema(), indent=1, sort_keys=True) + "\n"
    if argv == ["--write"]:
        SHIPPED.write_text(text)
        print(f"wrote {SHIPPED}")
    elif argv:
        print("usage: python -m trlspec.schema [--write]", file=sys.stderr)
        return 64
    else:
        sys.stdout.write(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
