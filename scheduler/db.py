"""Engines and sessions. Keep transactions short: load, then do I/O, then apply."""

from __future__ import annotations

from collections.abc import AsyncIterator, Mapping
from contextlib import asynccontextmanager
from typing import Any

from sqlalchemy import select
from sqlalchemy.exc import DBAPIError, OperationalError
from sqlalchemy.ext.asyncio import (
    AsyncConnection,
    AsyncEngine,
    AsyncSession,
    async_sessionmaker,
    create_async_engine,
)

from scheduler.models import Installation
from scheduler.settings import normalize_database_url
from scheduler.validate import bounded_json_loads


def is_unavailable(exc: BaseException) -> bool:
    """Whether `exc` says the database cannot be used right now (down, restarting, a
    dropped connection, a serialization failure or deadlock): worth trying again later,
    not a bug."""
    if isinstance(exc, OperationalError):
        return True
    if isinstance(exc, DBAPIError):
        # 40001 serialization failure, 40P01 deadlock: simply try again.
        return exc.connection_invalidated or getattr(exc.orig, "sqlstate", None) in {
            "40001",
            "40P01",
        }
    return isinstance(exc, OSError)


def make_engine(url: str, *, pool_size: int = 5, echo: bool = False) -> AsyncEngine:
    """An async engine on psycopg 3 with connections checked before use."""
    return create_async_engine(
        normalize_database_url(url),
        pool_size=pool_size,
        max_overflow=pool_size,
        pool_pre_ping=True,
        echo=echo,
        connect_args={"connect_timeout": 5},
        # A JSON column too deep or too long to decode reads as an `UnreadableJson`,
        # which its row's checks refuse: never an exception in the middle of a batch.
        json_deserializer=bounded_json_loads,
    )


def make_sessionmaker(engine: AsyncEngine) -> async_sessionmaker[AsyncSession]:
    """Sessions that keep loaded objects usable after commit."""
    return async_sessionmaker(engine, expire_on_commit=False)


class Database:
    """An engine and its session factory, created once per process."""

    def __init__(self, url: str, *, pool_size: int = 5) -> None:
        self.url = normalize_database_url(url)
        self.engine = make_engine(self.url, pool_size=pool_size)
        self.sessionmaker = make_sessionmaker(self.engine)

    @asynccontextmanager
    async def transaction(self) -> AsyncIterator[AsyncSession]:
        """One short transaction: commits on success, rolls back on error.

        Never await SSH or NATS inside it (docs/invariants.md, invariant 4).
        """
        async with self.sessionmaker() as session, session.begin():
            yield session

    @asynccontextmanager
    async def sql_transaction(self) -> AsyncIterator[SessionSql]:
        """`transaction()` for the statements of `scheduler.jobstore` (`SqlDatabase`)."""
        async with self.transaction() as session:
            yield SessionSql(session)

    async def dispose(self) -> None:
        """Close every pooled connection."""
        await self.engine.dispose()


class SessionSql:
    """`jobstore.SqlTx` over a session: the SQL text goes to psycopg as it is, in the
    session's transaction, so the daemons run the very statements the command line runs."""

    def __init__(self, session: AsyncSession) -> None:
        self.session = session

    async def rows(self, sql: str, params: Mapping[str, Any] | None = None) -> list[dict[str, Any]]:
        """Run `sql` (`%(name)s` parameters); the rows it returns, as dicts."""
        await self.session.flush()  # what the session holds unwritten is seen by `sql`
        connection = await self.session.connection()
        result = await connection.exec_driver_sql(sql, dict(params or {}))
        return [dict(row) for row in result.mappings()] if result.returns_rows else []


async def installation_id(session: AsyncSession | AsyncConnection) -> str:
    """This database's installation UUID (`models.Installation`), as text."""
    value = await session.scalar(select(Installation.id))
    if value is None:
        raise RuntimeError("the database has no installation row: run `rlfleet db upgrade`")
    return str(value)
