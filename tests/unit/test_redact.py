"""No credential is ever shown: URLs are redacted, remembered secrets are scrubbed from any
text, and a malformed database URL is one line that quotes no password (docs/invariants.md,
invariant 7)."""

from __future__ import annotations

import logging

import pytest

from scheduler.errors import BadInput
from scheduler.redact import redact_url, remember, scrub, scrub_urls, url_secrets
from scheduler.settings import Settings, normalize_database_url


@pytest.mark.parametrize(
    ("url", "shown"),
    [
        ("postgresql+psycopg://bob:s3cret@db:5432/rl", "postgresql+psycopg://bob:***@db:5432/rl"),
        ("postgresql+psycopg://bob@db/rl", "postgresql+psycopg://bob@db/rl"),
        ("postgresql+psycopg://bob:pw@[::1]:5432/rl", "postgresql+psycopg://bob:***@[::1]:5432/rl"),
        ("postgresql+psycopg://bob@[::1]:5432/rl", "postgresql+psycopg://bob@[::1]:5432/rl"),
        (
            "postgresql+psycopg://bob@db/rl?password=s3cret&sslmode=require",
            "postgresql+psycopg://bob@db/rl?password=***&sslmode=require",
        ),
        ("postgresql+psycopg://bob:p@ss:w@db/rl", "postgresql+psycopg://bob:***@db/rl"),
        ("postgresql+psycopg://bob:pw@[::1:5432/rl", "postgresql+psycopg://bob:***@[::1:5432/rl"),
        ("nats://alice:pw@n1:4222,nats://n2:4222", "nats://alice:***@n1:4222,nats://n2:4222"),
        ("nats://s3cr3tt0ken@n1:4222", "nats://***@n1:4222"),
        ("tls://tok@[::1]:4222", "tls://***@[::1]:4222"),
        ("nats://127.0.0.1:4222", "nats://127.0.0.1:4222"),
        ("nats://[::1]:4222", "nats://[::1]:4222"),
        ("just-a-password", "***"),
    ],
)
def test_redact_url_hides_every_credential_and_keeps_the_host(url: str, shown: str) -> None:
    assert redact_url(url) == shown


@pytest.mark.parametrize(
    ("url", "secrets"),
    [
        ("postgresql://u:a%40b@h/d", ["a%40b", "a@b"]),
        ("postgresql://u@h/d?password=x1y2", ["x1y2"]),
        ("nats://tok3n@h:4222,nats://u:pw12@h2", ["tok3n", "tok3n", "pw12", "pw12"]),
        ("postgresql://u@h/d", []),
    ],
)
def test_url_secrets_finds_passwords_tokens_and_query_passwords(
    url: str, secrets: list[str]
) -> None:
    assert url_secrets(url) == secrets


def test_scrub_hides_remembered_secrets_in_any_text_also_url_encoded() -> None:
    remember("Zq9@:secret")
    text = "failed for Zq9@:secret and Zq9%40%3Asecret (ab)"
    assert scrub(text) == "failed for *** and *** (ab)"


def test_scrub_urls_redacts_urls_inside_prose() -> None:
    line = "cannot reach postgresql://u@h:5/d?password=hunter22: refused, nats://tk99@h:1."
    assert (
        scrub_urls(line)
        == "cannot reach postgresql://u@h:5/d?password=***: refused, nats://***@h:1."
    )


@pytest.mark.parametrize(
    "url",
    [
        "postgresql://bob:pw9x@[::1:5432/rl",
        "postgresql://bob:pw9x@h:notaport/rl",
        "not a url pw9x",
        "mysql://bob:pw9x@h/rl",
    ],
)
def test_malformed_database_url_is_bad_input_without_the_password(url: str) -> None:
    with pytest.raises(BadInput) as caught:
        normalize_database_url(url)
    message = str(caught.value)
    assert "pw9x" not in message
    assert "\n" not in message


def test_password_with_at_and_colon_is_encoded_not_a_traceback() -> None:
    url = normalize_database_url("postgresql://bob:p@ss:w0rd@db:5432/rl")
    assert url == "postgresql+psycopg://bob:p%40ss%3Aw0rd@db:5432/rl"
    from sqlalchemy.engine import make_url

    assert make_url(url).password == "p@ss:w0rd"


def test_settings_remember_nats_secrets_from_env_and_files(
    monkeypatch: pytest.MonkeyPatch, tmp_path: object, caplog: pytest.LogCaptureFixture
) -> None:
    from pathlib import Path

    token_file = Path(str(tmp_path)) / "token"
    token_file.write_text("file-token-123\n")
    monkeypatch.setenv("RLFLEET_NATS_TOKEN_FILE", str(token_file))
    monkeypatch.setenv("RLFLEET_NATS_USER", "alice")
    monkeypatch.setenv("RLFLEET_NATS_PASSWORD", "env-password-456")
    settings = Settings.load("postgresql://u@h/d", "nats://h:4222")
    assert settings.nats_token == "file-token-123"
    assert (settings.nats_user, settings.nats_password) == ("alice", "env-password-456")
    assert scrub("file-token-123 env-password-456") == "*** ***"


def test_stdlib_log_records_are_scrubbed() -> None:
    from scheduler.logging import _ScrubFilter

    remember("hunter2-secret")
    record = logging.LogRecord(
        "x", logging.WARNING, "f", 1, "connect %s", ("hunter2-secret",), None
    )
    _ScrubFilter().filter(record)
    assert record.getMessage() == "connect ***"
