"""Where the services are: from flags, else environment variables, else defaults."""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import quote, unquote

from scheduler.errors import BadInput
from scheduler.redact import redact_url, remember, remember_urls

DATABASE_URL_ENV = "RLFLEET_DATABASE_URL"
NATS_URL_ENV = "RLFLEET_NATS_URL"
NATS_CREDS_ENV = "RLFLEET_NATS_CREDS"
NATS_TOKEN_ENV = "RLFLEET_NATS_TOKEN"
NATS_USER_ENV = "RLFLEET_NATS_USER"
NATS_PASSWORD_ENV = "RLFLEET_NATS_PASSWORD"
NATS_TLS_CA_ENV = "RLFLEET_NATS_TLS_CA"
FILE_SUFFIX = "_FILE"
"""`RLFLEET_NATS_TOKEN_FILE=/path` reads the token from a file (so does _PASSWORD_FILE)."""

DEFAULT_DATABASE_URL = "postgresql+psycopg://rlfleet@localhost:5432/rlfleet"
DEFAULT_NATS_URL = "nats://127.0.0.1:4222"


@dataclass(frozen=True)
class Settings:
    """Connection settings shared by the CLI and every daemon."""

    database_url: str
    nats_url: str
    nats_creds: str | None = None
    nats_token: str | None = None
    nats_tls_ca: str | None = None
    nats_user: str | None = None
    nats_password: str | None = None

    def __post_init__(self) -> None:
        # Whatever holds a credential is known to the scrubber before it can be logged.
        remember_urls([self.database_url, self.nats_url])
        remember(self.nats_token, self.nats_password)

    @property
    def nats_servers(self) -> list[str]:
        """The NATS server list (RLFLEET_NATS_URL may name several, comma-separated)."""
        return [s.strip() for s in self.nats_url.split(",") if s.strip()]

    @classmethod
    def load(cls, database_url: str | None = None, nats_url: str | None = None) -> Settings:
        """Build settings, preferring explicit values over the environment."""
        env = os.environ
        raw_db = database_url or env.get(DATABASE_URL_ENV) or DEFAULT_DATABASE_URL
        raw_nats = nats_url or env.get(NATS_URL_ENV) or DEFAULT_NATS_URL
        remember_urls([raw_db, raw_nats])  # before anything can quote them back
        return cls(
            database_url=normalize_database_url(raw_db),
            nats_url=check_nats_url(raw_nats),
            nats_creds=env.get(NATS_CREDS_ENV) or None,
            nats_token=secret_from_env(NATS_TOKEN_ENV),
            nats_tls_ca=env.get(NATS_TLS_CA_ENV) or None,
            nats_user=env.get(NATS_USER_ENV) or None,
            nats_password=secret_from_env(NATS_PASSWORD_ENV),
        )


def secret_from_env(name: str) -> str | None:
    """The secret in `$NAME`, else the content of the file `$NAME_FILE` names (its last
    newline stripped), else None. Secrets never come from command-line flags: `ps` shows
    those to every user of the machine."""
    value = os.environ.get(name)
    if value:
        remember(value)
        return value
    path = os.environ.get(name + FILE_SUFFIX)
    if not path:
        return None
    try:
        text = Path(path).read_text(encoding="utf-8").rstrip("\r\n")
    except (OSError, UnicodeError) as exc:
        reason = exc.__class__.__name__
        raise BadInput(f"cannot read {name + FILE_SUFFIX} ({path}): {reason}") from exc
    remember(text)
    return text or None


def normalize_database_url(url: str) -> str:
    """The URL driving psycopg 3 (`postgresql://` and `postgres://` are accepted too), its
    user and password percent-encoded (a password may hold `@` or `:`); `BadInput` with
    the URL redacted when it cannot be parsed."""
    for prefix in ("postgresql://", "postgres://"):
        if url.startswith(prefix):
            url = "postgresql+psycopg://" + url[len(prefix) :]
            break
    from scheduler.validate import check_database_url

    return check_database_url(_encode_userinfo(url))


def _encode_userinfo(url: str) -> str:
    """Percent-encode the user and password of `url` (left as they are when they are
    encoded already), so that `@`, `:` or `/` in a password survive parsing."""
    scheme, sep, rest = url.partition("://")
    netloc_end = len(rest)
    for stop in ("/", "?"):
        found = rest.find(stop, rest.rfind("@") + 1)
        if found != -1:
            netloc_end = min(netloc_end, found)
    netloc, tail = rest[:netloc_end], rest[netloc_end:]
    userinfo, at, hostport = netloc.rpartition("@")
    if not sep or not at:
        return url
    user, colon, password = userinfo.partition(":")
    remember(password, unquote(password))
    encoded = quote(unquote(user), safe="")
    if colon:
        encoded += ":" + quote(unquote(password), safe="")
    return f"{scheme}://{encoded}@{hostport}{tail}"


def check_nats_url(url: str) -> str:
    """The NATS server list as given, or `BadInput` saying (without the URL, which may
    hold a token) what is malformed."""
    from scheduler.validate import check_nats_url as check

    return check(url)


__all__ = [
    "DATABASE_URL_ENV",
    "NATS_URL_ENV",
    "Settings",
    "check_nats_url",
    "normalize_database_url",
    "redact_url",
    "secret_from_env",
]
