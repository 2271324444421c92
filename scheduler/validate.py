"""Checks of values from users and from database rows against what the schema can hold.

One place for every limit, read from the column types of `scheduler.models` where there
is one: the CLI calls these before it touches a service (a bad value is `BadInput`: exit
2, one line), and the dispatcher calls `job_row_problem` on every job row it is about to
launch (a row inserted by hand fails its job, never the dispatcher).
"""

from __future__ import annotations

import dataclasses
import math
import re
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any
from urllib.parse import parse_qsl, unquote, urlsplit

from scheduler.errors import BadInput

# SQLAlchemy is imported where a check reads a column's type, never at import: the
# command line checks its arguments and `job list`/`job submit` run without loading it.

MAX_GPUS = 1024
"""Most GPUs one job may ask for on one VM (`--gpus`)."""
MAX_NODES = 64
"""Most nodes (VMs) one job may span (`ck_jobs_nodes_range`)."""
MAX_JOB_GPUS = MAX_GPUS * MAX_NODES
"""Most GPUs one attempt may hold, every VM's together (`jobs.gpus_requested`,
`ck_jobs_gpus_sane`)."""
MAX_RETRIES = 1000
"""Most retries one job may ask for (`ck_jobs_counts_sane`)."""
MAX_TIMEOUT_S = 7 * 86400
"""Longest `--hang-timeout` / `--startup-timeout` (a week); 0 turns the check off
(`ck_jobs_liveness_timeouts`)."""
MIN_TIMEOUT_S = 10
"""Shortest non-zero liveness timeout: below a few polls it would stop a healthy run."""
DEFAULT_HANG_TIMEOUT_S = 1800
"""A running attempt whose training step has not advanced for this long is hung (30 min)."""
DEFAULT_STARTUP_TIMEOUT_S = 3600
"""A running attempt that has not reported its first step this long after its launch was
confirmed is stuck starting (60 min: model download and load)."""
JOB_NAME_MAX = 255
"""Longest job name: the length of `jobs.name` (`String(JOB_NAME_MAX)` in the models)."""
INT2 = (-(2**15), 2**15 - 1)
"""What a `SmallInteger` column holds."""
INT4 = (-(2**31), 2**31 - 1)
"""What an `Integer` column holds (a job's GPUs, nodes, retries, priority, attempt)."""
INT8 = (-(2**63), 2**63 - 1)
"""What a `BigInteger` column holds (a job's id)."""

TEXT_MAX = 4096
"""Longest value taken for an unbounded text column (a model, a path, an argument): the
length of the longest Linux path, far beyond any real one."""
MAX_EXTRA_ARGS = 1000
"""Most arguments after `--` one job may pass to train_grpo.py."""

WORKDIR_MAX_BYTES = 64 << 20
"""Largest packed workdir (`job submit --workdir`, gzip'd tar) the scheduler stores and
ships itself: it travels through Postgres and the dispatcher's SSH connection."""
WORKDIR_MAX_UNPACKED = 1 << 30
"""Most bytes a workdir may hold once unpacked (a VM refuses a tar that claims more)."""
WORKDIR_MAX_FILES = 100_000
"""Most entries (files and directories) one workdir may hold."""
DIGEST_RE = re.compile(r"[0-9a-f]{64}")
"""What a workdir's digest is: the sha256 of its packed bytes, lowercase hex."""

RESERVED_TRAIN_FLAGS: dict[str, str] = {
    "--model": "use `job submit --model`",
    "--dataset": "use `job submit --dataset`",
    "--reward_function": "use `job submit --reward-function` (repeatable)",
    "--output_dir": "use `job submit --output-dir`",
    "--resume": "rlfleet passes `--resume auto` to every retry itself",
    # TRL's spellings of the same flags, which train_grpo.py accepts too.
    "--model_name_or_path": "use `job submit --model`",
    "--model-name-or-path": "use `job submit --model`",
    "--dataset_name": "use `job submit --dataset`",
    "--dataset-name": "use `job submit --dataset`",
    "--reward_funcs": "use `job submit --reward-function` (repeatable)",
    "--reward-funcs": "use `job submit --reward-function` (repeatable)",
    "--resume_from_checkpoint": "rlfleet passes `--resume auto` to every retry itself",
    "--resume-from-checkpoint": "rlfleet passes `--resume auto` to every retry itself",
    "--config": "use `job submit --config RECIPE.yaml`, which ships the recipe with the job",
}
"""train_grpo.py flags that rlfleet sets itself, and what to use instead."""


def int_range(column: Any) -> tuple[int, int]:
    """The smallest and largest value an integer column (`Job.priority`…) can store."""
    from sqlalchemy import BigInteger, Integer, SmallInteger

    ranges: list[tuple[type, tuple[int, int]]] = [
        (BigInteger, INT8),
        (SmallInteger, INT2),
        (Integer, INT4),
    ]
    for kind, bounds in ranges:
        if isinstance(column.type, kind):
            return bounds
    raise TypeError(f"{column} is not an integer column")


def max_length(column: Any) -> int:
    """The longest string a text column can take: its `String(n)` length, else TEXT_MAX."""
    from sqlalchemy import String

    length = getattr(column.type, "length", None) if isinstance(column.type, String) else None
    return int(length) if length else TEXT_MAX


def shown(value: str, limit: int = 40) -> str:
    """`value` as a short, printable, single-line quote for an error message."""
    text = value if len(value) <= limit else value[:limit] + "…"
    return ascii(text) if not text.isprintable() else repr(text)


def utf8_problem(value: str) -> str | None:
    """Why `value` cannot be stored as text (bytes that were not UTF-8, a NUL), or None."""
    try:
        value.encode("utf-8")
    except UnicodeEncodeError:
        return "is not valid UTF-8"
    if "\x00" in value:
        return "contains a NUL character"
    return None


def check_text(
    value: str,
    what: str,
    *,
    column: Any = None,
    max_len: int | None = None,
    empty_ok: bool = False,
) -> str:
    """`value` if it fits `column` (or `max_len`, else TEXT_MAX); else `BadInput`."""
    if not isinstance(value, str):
        raise BadInput(f"{what} must be text")
    problem = utf8_problem(value)
    if problem:
        raise BadInput(f"{what} {shown(value)} {problem}")
    limit = max_len or (max_length(column) if column is not None else TEXT_MAX)
    if len(value) > limit:
        raise BadInput(f"{what} is too long ({len(value)} characters, at most {limit})")
    if not empty_ok and not value.strip():
        raise BadInput(f"{what} must not be empty")
    return value


def is_int(value: Any) -> bool:
    """Whether `value` is an integer: `True` and `False` are not, here."""
    return isinstance(value, int) and not isinstance(value, bool)


def check_int(
    value: int,
    what: str,
    *,
    column: Any = None,
    lo: int | None = None,
    hi: int | None = None,
    bounds: tuple[int, int] | None = None,
) -> int:
    """`value` if it lies in [lo, hi] and fits `column`'s integer type (or `bounds`, one of
    INT2, INT4, INT8: else INT8); else `BadInput`."""
    if not is_int(value):
        raise BadInput(f"{what} must be an integer")
    low, high = int_range(column) if column is not None else (bounds or INT8)
    low = low if lo is None else max(low, lo)
    high = high if hi is None else min(high, hi)
    if not low <= value <= high:
        raise BadInput(f"{what} must be between {low} and {high}, not {value}")
    return value


def check_timeout(value: Any, what: str) -> int:
    """A liveness timeout in seconds: 0 (off) or `MIN_TIMEOUT_S`..`MAX_TIMEOUT_S`; else
    `BadInput`."""
    check_int(value, what, lo=0, hi=MAX_TIMEOUT_S)
    if 0 < value < MIN_TIMEOUT_S:
        raise BadInput(f"{what} must be 0 (off) or at least {MIN_TIMEOUT_S}, not {value}")
    return int(value)


JOB_ID_RE = re.compile(r"[0-9]{1,19}")
"""A job id as typed, sent or put in a URL: ASCII digits only (`int` would also take `٤`,
`²` breaks `str.isdigit` users, `+4` and `4_0` are no ids), a bounded number of them."""

INTEGER_RE = re.compile(r"[+-]?[0-9]{1,40}")
"""An integer as typed: ASCII digits, an optional sign, a bounded length."""


def parse_job_id(text: str) -> int:
    """The job id `text` spells (1 ≤ id < 2**63), or `BadInput`."""
    if not JOB_ID_RE.fullmatch(text) or not 0 < int(text) <= INT8[1]:
        raise BadInput(f"{shown(text)} is not a valid integer between 1 and {INT8[1]} (a job id)")
    return int(text)


def check_seconds(value: float, what: str, *, hi: float = 86400.0) -> float:
    """A duration in seconds: finite, not negative, at most `hi`."""
    if math.isnan(value) or not 0 <= value <= hi:
        raise BadInput(f"{what} must be between 0 and {hi:g} seconds, not {value}")
    return value


def check_argv(args: Iterable[str]) -> None:
    """Every command-line word must be UTF-8: Python hands undecodable bytes over as lone
    surrogates, which no database or terminal can take."""
    for position, arg in enumerate(args, 1):
        if utf8_problem(arg) == "is not valid UTF-8":
            raise BadInput(f"argument {position} ({shown(arg)}) is not valid UTF-8")


@dataclass(frozen=True)
class DatabaseUrl:
    """The parts of a database URL `dialect+driver://user:password@host:port/database?query`
    (user, password, database and query values percent-decoded)."""

    backend: str
    driver: str | None
    user: str | None = None
    password: str | None = None
    host: str | None = None
    port: int | None = None
    database: str | None = None
    query: dict[str, str] = dataclasses.field(default_factory=dict)


_DATABASE_URL = re.compile(
    r"(?P<scheme>[\w+]+)://"
    r"(?:(?P<user>[^:/]*)(?::(?P<password>[^@]*))?@)?"
    r"(?:(?:\[(?P<ipv6>[^/?]+)\]|(?P<host>[^/:?]+))?(?::(?P<port>[^/?]*))?)?"
    r"(?:/(?P<database>[^?]*))?"
    r"(?:\?(?P<query>.*))?"
)
"""The URL grammar SQLAlchemy's `make_url` reads (tests/unit/test_validate.py checks that
both read the same parts), so that the command line parses a URL without loading it."""


def parse_database_url(url: str) -> DatabaseUrl:
    """The parts of a database URL; `ValueError` when it is not one (a port that is not a
    number included)."""
    match = _DATABASE_URL.match(url)
    if match is None:
        raise ValueError("not a database URL")
    parts = match.groupdict()
    backend, _, driver = parts["scheme"].partition("+")
    port = parts["port"]
    return DatabaseUrl(
        backend=backend,
        driver=driver or None,
        user=unquote(parts["user"]) if parts["user"] is not None else None,
        password=unquote(parts["password"]) if parts["password"] is not None else None,
        host=parts["ipv6"] or parts["host"],
        port=int(port) if port is not None else None,
        database=unquote(parts["database"]) if parts["database"] else None,
        query=dict(parse_qsl(parts["query"] or "")),
    )


def check_database_url(url: str) -> str:
    """`url` if it is a well-formed PostgreSQL URL for psycopg; else `BadInput` saying what
    is wrong, without repeating the URL (it may hold a password)."""
    what = "the database URL (--database-url / RLFLEET_DATABASE_URL)"
    if utf8_problem(url):
        raise BadInput(f"{what} is not valid UTF-8")
    try:
        parsed = parse_database_url(url)
    except ValueError:
        raise BadInput(
            f"{what} is malformed: expected postgresql+psycopg://USER[:PASSWORD]@HOST[:PORT]/DB"
        ) from None
    if parsed.backend != "postgresql":
        raise BadInput(f"{what} must name a PostgreSQL database, not {parsed.backend!r}")
    if parsed.driver not in ("psycopg", "psycopg_async"):
        raise BadInput(f"{what} must use the psycopg driver (postgresql+psycopg://…)")
    return url


def check_nats_url(url: str) -> str:
    """`url` if every comma-separated server in it is a well-formed NATS URL; else
    `BadInput` (the URL is not repeated: it may hold a token)."""
    what = "the NATS URL (--nats-url / RLFLEET_NATS_URL)"
    if utf8_problem(url):
        raise BadInput(f"{what} is not valid UTF-8")
    servers = [s.strip() for s in url.split(",") if s.strip()]
    if not servers:
        raise BadInput(f"{what} is empty")
    for server in servers:
        try:
            # nats-py takes a bare host:port as nats://host:port.
            split = urlsplit(server if "://" in server else f"nats://{server}")
            split.port  # noqa: B018 - parsing the port is what may fail
        except ValueError:
            raise BadInput(f"{what} is malformed: expected nats://HOST[:PORT]") from None
        if split.scheme not in ("nats", "tls", "ws", "wss") or not split.hostname:
            raise BadInput(f"{what} is malformed: expected nats://HOST[:PORT]")
    return url


def reserved_flag(arg: str) -> str | None:
    """The train_grpo.py flag rlfleet sets itself that `arg` would set (`--output_dir`,
    `--output_dir=x`, or an abbreviation argparse would expand), or None."""
    if not arg.startswith("--") or len(arg) <= 2:
        return None
    name = arg.split("=", 1)[0]
    for flag in RESERVED_TRAIN_FLAGS:
        if flag.startswith(name):
            return flag
    return None


def extra_args_problem(args: Sequence[Any]) -> str | None:
    """Why arguments after `--` cannot be passed to train_grpo.py, or None."""
    if len(args) > MAX_EXTRA_ARGS:
        return f"too many arguments after -- ({len(args)}, at most {MAX_EXTRA_ARGS})"
    for arg in args:
        if not isinstance(arg, str):
            return f"argument {arg!r} after -- is not a string"
        problem = utf8_problem(arg)
        if problem:
            return f"argument {shown(arg)} after -- {problem}"
        if len(arg) > TEXT_MAX:
            return f"an argument after -- is too long ({len(arg)} characters, at most {TEXT_MAX})"
        flag = reserved_flag(arg)
        if flag:
            return (
                f"{arg.split('=', 1)[0]} after -- sets {flag}, which rlfleet sets: "
                + (RESERVED_TRAIN_FLAGS[flag])
            )
    return None


MAX_JSON_DEPTH = 64
"""Deepest nesting of arrays and objects read back from a JSON column (a job's roles are
about 5 levels deep): deeper values are `UnreadableJson`, never decoded."""
MAX_JSON_CHARS = 32 << 20
"""Longest JSON column value decoded (32 Mi characters: a job's 1,000 arguments of 4,096
characters are 4 Mi): longer ones are `UnreadableJson`."""
MAX_ENV_VALUE = 32768
"""Longest value of one job variable (`--env KEY=VALUE`)."""


def env_value_problem(value: str) -> str | None:
    """Why a job variable's value cannot be handed to a job (not one line, too long), or
    None."""
    if any(c in value for c in "\r\n\0"):
        return "the value must be one line"
    if len(value) > MAX_ENV_VALUE:
        return f"the value is longer than {MAX_ENV_VALUE} characters"
    return None


@dataclass(frozen=True)
class UnreadableJson:
    """What a JSON column reads back as when its value is not decoded (`bounded_json_loads`):
    nested deeper than MAX_JSON_DEPTH, longer than MAX_JSON_CHARS, or a number Python will
    not convert. Neither a dict nor a list, so every check of the column's type refuses it;
    `kind` is the JSON type of the whole value."""

    problem: str
    kind: str = "value"

    def __str__(self) -> str:
        return self.problem


_JSON_STRING = re.compile(r'"[^"\\]*(?:\\.[^"\\]*)*"', re.DOTALL)
_JSON_BRACKET = re.compile(r"[\[\]{}]")
_JSON_KINDS = {"{": "object", "[": "array", '"': "string", "t": "boolean", "f": "boolean"}


def json_depth(text: str, limit: int) -> int:
    """How deep arrays and objects nest in the JSON `text`, counted up to `limit + 1` (a
    scan of the brackets outside strings: no recursion, whatever the depth)."""
    depth = deepest = 0
    for match in _JSON_BRACKET.finditer(_JSON_STRING.sub("", text)):
        if match.group() in "[{":
            depth += 1
            if depth > deepest:
                deepest = depth
                if deepest > limit:
                    break
        else:
            depth -= 1
    return deepest


def bounded_json_loads(data: str | bytes | bytearray | memoryview) -> Any:
    """`json.loads` for values read from the database, which never raises: a value
    longer than MAX_JSON_CHARS, nested deeper than MAX_JSON_DEPTH (checked before decoding:
    Python's decoder recurses, and a row 3,000 deep would raise `RecursionError` in the
    middle of a batch) or that cannot be decoded becomes an `UnreadableJson` saying why.
    The database engine and the command line's connection decode JSON columns with it."""
    import json

    if not isinstance(data, str):
        data = bytes(data).decode("utf-8", errors="replace")
    kind = _JSON_KINDS.get(data.lstrip()[:1], "number")
    if data.lstrip()[:1] == "n":
        kind = "null"
    if len(data) > MAX_JSON_CHARS:
        return UnreadableJson(f"JSON longer than {MAX_JSON_CHARS} characters", kind)
    opening = data.count("[") + data.count("{")  # fewer: it cannot nest deeper (fast path)
    if opening > MAX_JSON_DEPTH and json_depth(data, MAX_JSON_DEPTH) > MAX_JSON_DEPTH:
        return UnreadableJson(f"JSON nested deeper than {MAX_JSON_DEPTH} levels", kind)
    try:
        return json.loads(data)
    except (ValueError, RecursionError) as exc:  # a number beyond int's digit limit
        return UnreadableJson(f"JSON that cannot be read ({last_words(exc)})", kind)


def last_words(exc: BaseException) -> str:
    """The first line of an exception's message, at most 80 characters."""
    text = (str(exc).splitlines() or [type(exc).__name__])[0]
    return text[:80]


# --- which environment variables a job may set (docs/invariants.md, invariant 7)

SCHEDULER_ENV = (
    "CUDA_VISIBLE_DEVICES", "CUDA_DEVICE_ORDER", "RLFLEET_JOB_ID", "RLFLEET_ATTEMPT",
    "RLFLEET_PROGRESS_FILE", "RLFLEET_NODE_RANK", "RLFLEET_NUM_NODES",
    "RLFLEET_GPUS_PER_NODE", "RLFLEET_NODE_ADDRS", "MASTER_ADDR", "MASTER_PORT", "WORLD_SIZE",
    "RLFLEET_WORKDIR",
)  # fmt: skip
"""Set by the scheduler for every job: no env file sets them (`--env` refuses every
`RLFLEET_*` name: that namespace is the scheduler's)."""
_ENV_KEY = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")


def env_key_problem(key: str) -> str | None:
    """Why `key` cannot be a job's environment variable, or None when it can."""
    if not _ENV_KEY.fullmatch(key):
        return f"{key!r} is not a variable name (letters, digits, _; not starting with a digit)"
    if key.upper().startswith("RLFLEET_") or key in SCHEDULER_ENV:
        return f"{key} is set by the scheduler"
    return None


def env_problem(env: Any) -> str | None:
    """Why a job row's `env` (a JSON object of one-line strings, names a job may set)
    cannot be used, or None."""
    if isinstance(env, UnreadableJson):
        return f"env: {env.problem}"
    if not isinstance(env, dict):
        return f"env must be a JSON object of strings, not a JSON {json_kind(env)}"
    for key, value in env.items():
        problem = env_key_problem(key)
        if problem:
            return f"env: {problem}"
        if not isinstance(value, str):
            return f"env {key}: the value is not a string"
        problem = env_value_problem(value)
        if problem:
            return f"env {key}: {problem}"
    return None


def json_kind(value: Any) -> str:
    """The JSON name of a decoded value's type."""
    if isinstance(value, UnreadableJson):
        return f"{value.kind} ({value.problem})"
    if isinstance(value, dict):
        return "object"
    if isinstance(value, list):
        return "array"
    if isinstance(value, str):
        return "string"
    if isinstance(value, bool):
        return "boolean"
    if isinstance(value, int | float):
        return "number"
    return "null" if value is None else type(value).__name__
