"""Settings: flags beat the environment, URLs are normalised, passwords never shown."""

from __future__ import annotations

import pytest

from scheduler.settings import Settings, normalize_database_url, redact_url


@pytest.mark.parametrize(
    ("url", "shown"),
    [
        ("postgresql+psycopg://bob:s3cret@db:5432/rl", "postgresql+psycopg://bob:***@db:5432/rl"),
        ("nats://alice:pw@n1:4222,nats://n2:4222", "nats://alice:***@n1:4222,nats://n2:4222"),
        ("postgresql+psycopg://bob@db/rl", "postgresql+psycopg://bob@db/rl"),
        ("nats://127.0.0.1:4222", "nats://127.0.0.1:4222"),
    ],
)
def test_redact_hides_passwords_only(url: str, shown: str) -> None:
    assert redact_url(url) == shown


@pytest.mark.parametrize(
    ("url", "normalized"),
    [
        ("postgresql://u@h/d", "postgresql+psycopg://u@h/d"),
        ("postgres://u@h/d", "postgresql+psycopg://u@h/d"),
        ("postgresql+psycopg://u@h/d", "postgresql+psycopg://u@h/d"),
    ],
)
def test_database_url_always_drives_psycopg3(url: str, normalized: str) -> None:
    assert normalize_database_url(url) == normalized


def test_flags_beat_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("RLFLEET_DATABASE_URL", "postgresql://env@h/d")
    monkeypatch.setenv("RLFLEET_NATS_URL", "nats://env:1, nats://env:2")
    from_env = Settings.load()
    assert from_env.database_url == "postgresql+psycopg://env@h/d"
    assert from_env.nats_servers == ["nats://env:1", "nats://env:2"]
    explicit = Settings.load("postgresql://flag@h/d", "nats://flag:3")
    assert explicit.database_url == "postgresql+psycopg://flag@h/d"
    assert explicit.nats_servers == ["nats://flag:3"]
