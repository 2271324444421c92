"""A value for one of TRL's fields (a field of `trlspec.schema`), from the command line (a
string) or a recipe (YAML), checked against the field's kinds and converted to its type."""

from __future__ import annotations

import json
from typing import Any

TRUE = frozenset({"1", "true", "yes", "on", "y", "t"})
"""The words read as true, in any case."""
FALSE = frozenset({"0", "false", "no", "off", "n", "f"})
"""The words read as false, in any case."""
NONE = frozenset({"none", "null"})
"""The words read as no value (for a field that is not text)."""


def _kind_error(spec: dict[str, Any], value: Any) -> str:
    kinds = " or ".join("true/false" if k == "bool" else k for k in spec["kinds"])
    if spec.get("item"):
        kinds = kinds.replace("list", f"list of {spec['item']}")
    return f"expected {kinds}, got {value!r}"


def _one(kind: str, text: str) -> Any:
    """`text` (from the command line) as a value of `kind`; ValueError when it is not one."""
    if kind == "bool":
        lowered = text.lower()
        if lowered in TRUE | FALSE:
            return lowered in TRUE
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
    if value is None or (isinstance(value, str) and value.lower() in NONE and "str" not in kinds):
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
