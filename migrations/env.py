"""Alembic environment: runs migrations synchronously over psycopg 3."""

from __future__ import annotations

import os

from alembic import context
from sqlalchemy import create_engine, pool

import scheduler.store_records  # noqa: F401  (its model is in Base.metadata)
from scheduler.models import Base
from scheduler.settings import DATABASE_URL_ENV, DEFAULT_DATABASE_URL, normalize_database_url

config = context.config
target_metadata = Base.metadata


def _url() -> str:
    explicit = context.get_x_argument(as_dictionary=True).get("url")
    configured = config.attributes.get("database_url")
    return normalize_database_url(
        explicit or configured or os.environ.get(DATABASE_URL_ENV) or DEFAULT_DATABASE_URL
    )


def run_migrations_offline() -> None:
    context.configure(url=_url(), target_metadata=target_metadata, literal_binds=True)
    with context.begin_transaction():
        context.run_migrations()


def run_migrations_online() -> None:
    engine = create_engine(_url(), poolclass=pool.NullPool)
    with engine.connect() as connection:
        context.configure(connection=connection, target_metadata=target_metadata)
        with context.begin_transaction():
            context.run_migrations()
    engine.dispose()


if context.is_offline_mode():
    run_migrations_offline()
else:
    run_migrations_online()
