"""One plain psycopg connection for the command line: `job list` and `job submit` run the
statements of `scheduler.jobstore` on it, and so start without loading SQLAlchemy (whose
import is most of a second-long start on a busy machine)."""

from __future__ import annotations

from collections.abc import AsyncIterator, Mapping
from contextlib import asynccontextmanager
from typing import TYPE_CHECKING, Any

from scheduler.validate import bounded_json_loads, check_database_url, parse_database_url

if TYPE_CHECKING:
    import psycopg

CONNECT_TIMEOUT_S = 5
"""Seconds to wait for the server, as the daemons' engine does (`db.make_engine`)."""


def connect_kwargs(url: str) -> dict[str, Any]:
    """The keyword arguments of `psycopg.connect` for the SQLAlchemy URL `url`
    (`postgresql+psycopg://USER:PASSWORD@HOST:PORT/DB?PARAM=…`), as SQLAlchemy would pass
    them: the query parameters are libpq's own."""
    parts = parse_database_url(check_database_url(url))
    given = {
        "user": parts.user,
        "password": parts.password,
        "host": parts.host,
        "port": parts.port,
        "dbname": parts.database,
    }
    kwargs: dict[str, Any] = {k: v for k, v in given.items() if v is not None}
    kwargs["connect_timeout"] = CONNECT_TIMEOUT_S
    kwargs.update(parts.query)
    return kwargs


def is_unavailable(exc: BaseException) -> bool:
    """Whether a psycopg error says the database cannot be used right now (down, a dropped
    connection, a serialization failure or a deadlock), as `db.is_unavailable` does for
    SQLAlchemy's."""
    import psycopg

    if isinstance(exc, psycopg.OperationalError):
        return True
    if isinstance(exc, psycopg.Error):
        return exc.sqlstate in {"40001", "40P01"}
    return isinstance(exc, OSError)


class PgTx:
    """`jobstore.SqlTx` over a psycopg connection inside a transaction."""

    def __init__(self, connection: psycopg.AsyncConnection[Any]) -> None:
        self.connection = connection

    async def rows(self, sql: str, params: Mapping[str, Any] | None = None) -> list[dict[str, Any]]:
        """Run `sql` (`%(name)s` parameters); the rows it returns, as dicts."""
        from psycopg.rows import dict_row

        async with self.connection.cursor(row_factory=dict_row) as cursor:
            await cursor.execute(sql, dict(params or {}))
            return await cursor.fetchall() if cursor.description is not None else []


class PgDatabase:
    """`jobstore.SqlDatabase` on one psycopg connection, opened at the first transaction."""

    def __init__(self, url: str) -> None:
        self.url = url
        self._connection: psycopg.AsyncConnection[Any] | None = None

    async def connection(self) -> psycopg.AsyncConnection[Any]:
        """The connection, opened on first use (autocommit: each transaction is explicit)."""
        if self._connection is None:
            import psycopg
            from psycopg.types.json import set_json_loads

            self._connection = await psycopg.AsyncConnection.connect(
                autocommit=True, **connect_kwargs(self.url)
            )
            # As the daemons' engine: a JSON column too deep to decode is an
            # `UnreadableJson`, never an exception that loses the whole listing.
            set_json_loads(bounded_json_loads, self._connection)
        return self._connection

    @asynccontextmanager
    async def sql_transaction(self) -> AsyncIterator[PgTx]:
        """One short transaction: committed on success, rolled back on error."""
        connection = await self.connection()
        async with connection.transaction():
            yield PgTx(connection)

    async def dispose(self) -> None:
        """Close the connection if it was opened (as `Database.dispose`)."""
        if self._connection is not None:
            await self._connection.close()
            self._connection = None
