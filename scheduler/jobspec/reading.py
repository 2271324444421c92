"""Reading a job file: its bytes (at most MAX_FILE_BYTES, UTF-8, no NUL) as YAML 1.2 with
PyYAML's safe loader, refusing aliases, nesting deeper than MAX_DEPTH and integers longer
than MAX_INT_DIGITS while it is read; then `parse_data` checks what it holds.
"""

from __future__ import annotations

import functools
import re
from typing import Any

from scheduler.errors import BadInput
from scheduler.jobspec.model import GroupSpec
from scheduler.jobspec.parse import parse_data

MAX_FILE_BYTES = 1 << 20
"""Largest spec file read (1 MiB): a job description is a few hundred bytes."""
MAX_DEPTH = 32
"""Deepest nesting of mappings and lists in a job file (a real one nests 5 deep): refused
while the file is read, before the parser's cost grows with it."""
MAX_INT_DIGITS = 30
"""Longest integer a job file may write (Python refuses to convert beyond 4,300 digits)."""


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
    return parse_data(load_yaml(raw, where))


def load_yaml(raw: bytes, where: str) -> Any:
    """The YAML document in `raw` (at most MAX_FILE_BYTES, checked by the caller), read
    with the bounded loader of job files: no aliases, MAX_DEPTH, MAX_INT_DIGITS; `BadInput`
    (one line, naming `where`) for anything else. Recipes (`job submit --config`) are read
    with it too."""
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
    return data


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
