"""Where the services are: from flags, else environment variables, else defaults."""

from __future__ import annotations

import os
from dataclasses import dataclass
from urllib.parse import urlsplit, urlunsplit

DATABASE_URL_ENV = "RLFLEET_DATABASE_URL"
NATS_URL_ENV = "RLFLEET_NATS_URL"
NATS_CREDS_ENV = "RLFLEET_NATS_CREDS"
NATS_TOKEN_ENV = "RLFLEET_NATS_TOKEN"
NATS_TLS_CA_ENV = "RLFLEET_NATS_TLS_CA"

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

    @property
    def nats_servers(self) -> list[str]:
        """The NATS server list (RLFLEET_NATS_URL may name several, comma-separated)."""
        return [s.strip() for s in self.nats_url.split(",") if s.strip()]

    @classmethod
    def load(cls, database_url: str | None = None, nats_url: str | None = None) -> Settings:
        """Build settings, preferring explicit values over the environment."""
        env = os.environ
        return cls(
            database_url=normalize_database_url(
                database_url or env.get(DATABASE_URL_ENV) or DEFAULT_DATABASE_URL
            ),
            nats_url=nats_url or env.get(NATS_URL_ENV) or DEFAULT_NATS_URL,
            nats_creds=env.get(NATS_CREDS_ENV) or None,
            nats_token=env.get(NATS_TOKEN_ENV) or None,
            nats_tls_ca=env.get(NATS_TLS_CA_ENV) or None,
        )


def normalize_database_url(url: str) -> str:
    """Accept `postgresql://` and `postgres://` too, always driving psycopg 3."""
    for prefix in ("postgresql://", "postgres://"):
        if url.startswith(prefix):
            return "postgresql+psycopg://" + url[len(prefix) :]
    return url


def redact_url(url: str) -> str:
    """The URL with any password replaced by `***`, safe to log or print."""
    parts = []
    for one in url.split(","):
        split = urlsplit(one.strip())
        if split.password is None:
            parts.append(one.strip())
            continue
        host = split.hostname or ""
        if split.port:
            host = f"{host}:{split.port}"
        user = split.username or ""
        parts.append(urlunsplit(split._replace(netloc=f"{user}:***@{host}")))
    return ",".join(parts)
