"""The checks of one field of a job file, each a `BadInput` with one line naming the field
(`roles.a.gpus: must be an integer 0..64`): mappings with known keys, integers in a
range, text, names, word lists, commands and flags. What a value may hold is
`scheduler.validate`'s rule (integers, UTF-8, text lengths); the messages are the job
file's own.
"""

from __future__ import annotations

import math
import re
import shlex
from collections.abc import Mapping
from typing import Any

from scheduler.errors import BadInput
from scheduler.validate import TEXT_MAX, is_int, utf8_problem

NAME_RE = re.compile(r"[a-z][a-z0-9_]{0,31}")
"""Role and port names (the whole name: `NAME_RE.fullmatch`): they become parts of variable
names (`RLFLEET_<ROLE>_<PORT>`)."""


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
    if not is_int(value) or not lo <= value <= hi:
        raise BadInput(f"{where}: must be an integer {lo}..{hi}")
    return value


def _text(value: Any, where: str, limit: int = TEXT_MAX) -> str:
    """`value` if it is non-empty, one-piece text that a database and a shell word can hold."""
    if not isinstance(value, str):
        raise BadInput(f"{where}: must be text")
    if not value.strip():
        raise BadInput(f"{where}: must not be empty")
    problem = utf8_problem(value)
    if problem:
        raise BadInput(f"{where}: {problem}")
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


def _flag(value: Any, where: str) -> bool:
    """A true/false field."""
    if not isinstance(value, bool):
        raise BadInput(f"{where}: must be true or false")
    return value
