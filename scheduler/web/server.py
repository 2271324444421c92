"""Serving the dashboard: its token, and uvicorn on the address asked for, until `stop`.

Whatever arrives at the socket costs that connection only (docs/security.md, "Listening
sockets"): at most `max_connections()` connections are open at once (one more is closed as
soon as it is accepted), a request must have sent its headers within `HEADER_TIMEOUT_S`
of the connection opening (or of the previous response on a kept-alive connection), an
idle kept-alive connection is closed after `KEEP_ALIVE_S`, and an error accepting a
connection (out of file descriptors) is one log line, not a traceback. `rlfleet up` runs
this server in a process of its own (`scheduler.up.WebProcess`), so that a flood costs
the flooder and never the daemons' file descriptors.
"""

from __future__ import annotations

import asyncio
import contextlib
from pathlib import Path

from scheduler.errors import BadInput
from scheduler.logging import get_logger
from scheduler.redact import remember
from scheduler.settings import Settings, secret_from_env

log = get_logger("web")

TOKEN_ENV = "RLFLEET_WEB_TOKEN"
TOKEN_FILE = "web.token"

HEADER_TIMEOUT_S = 10.0
"""A connection that has not sent a whole request head by then is closed."""
KEEP_ALIVE_S = 5
"""An idle kept-alive connection is closed after this many seconds."""
MAX_CONNECTIONS = 512
"""At most this many connections at once (fewer under a low open-files limit)."""
MAX_HEADER_BYTES = 16 * 1024
"""A request head larger than this is refused (431)."""


def max_connections() -> int:
    """`MAX_CONNECTIONS`, or half the open-files limit when that is lower: the other half is
    left to the database pool, SSH and whatever else the process opens."""
    import resource

    soft, _hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft == resource.RLIM_INFINITY:
        return MAX_CONNECTIONS
    return min(MAX_CONNECTIONS, max(8, soft // 2))


def bounded_protocol(limit: int, header_timeout: float) -> type:
    """uvicorn's h11 protocol with a connection cap and a timeout on reading a request head:
    `limit_concurrency` alone counts requests, and a client that never finishes its
    headers never makes one."""
    from uvicorn.protocols.http.h11_impl import H11Protocol

    class BoundedH11Protocol(H11Protocol):
        _head_timer: asyncio.TimerHandle | None = None
        _waiting_after: object = None

        def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
            super().connection_made(transport)
            if len(self.connections) > limit:
                log.debug("web_connection_refused", open=len(self.connections))
                transport.abort()
                return
            self._wait_for_head()

        def _wait_for_head(self) -> None:
            """Start the clock for the next request head (unless one is being served)."""
            self._stop_clock()
            if self.cycle is not None and not self.cycle.response_complete:
                return
            self._waiting_after = self.cycle
            self._head_timer = self.loop.call_later(header_timeout, self._head_too_slow)

        def _stop_clock(self) -> None:
            if self._head_timer is not None:
                self._head_timer.cancel()
                self._head_timer = None

        def _head_too_slow(self) -> None:
            self._head_timer = None
            if self.cycle is self._waiting_after and not self.transport.is_closing():
                self.transport.abort()

        def data_received(self, data: bytes) -> None:
            super().data_received(data)
            if self._head_timer is not None and self.cycle is not self._waiting_after:
                self._stop_clock()  # a whole request head arrived

        def on_response_complete(self) -> None:
            super().on_response_complete()
            if not self.transport.is_closing():
                self._wait_for_head()

        def connection_lost(self, exc: Exception | None) -> None:
            self._stop_clock()
            super().connection_lost(exc)

    return BoundedH11Protocol


def quiet_accept_errors(loop: asyncio.AbstractEventLoop) -> None:
    """Log the loop's errors without a traceback when they are OSErrors (the listening
    socket out of file descriptors, say: asyncio retries the accept a second later), so a
    flood cannot fill the disk with tracebacks."""
    default = loop.get_exception_handler()

    def handler(loop: asyncio.AbstractEventLoop, context: dict[str, object]) -> None:
        exc = context.get("exception")
        if isinstance(exc, OSError):
            log.warning("web_socket_error", message=str(context.get("message")), error=str(exc))
            return
        if default is not None:
            default(loop, context)
        else:
            loop.default_exception_handler(context)

    loop.set_exception_handler(handler)


def load_token(state_dir: Path) -> tuple[str, str]:
    """The token actions need, and where it is (never the value): `RLFLEET_WEB_TOKEN` (or
    the file `RLFLEET_WEB_TOKEN_FILE` names), else `STATE_DIR/web.token` (mode 0600),
    generated on first use."""
    token = secret_from_env(TOKEN_ENV)
    if token:
        where = f"${TOKEN_ENV}"
    else:
        from scheduler.statedir import StateDir

        state_dir.mkdir(parents=True, exist_ok=True, mode=0o700)
        token = StateDir(state_dir).secret(TOKEN_FILE)
        where = str(state_dir / TOKEN_FILE)
    if len(token) < 16:
        raise BadInput(f"the web token ({where}) must have at least 16 characters")
    remember(token)  # scrubbed from any log line or error that would quote it
    return token, where


async def serve_web(
    settings: Settings,
    *,
    host: str,
    port: int,
    token: str,
    stop: asyncio.Event,
    ready: asyncio.Event | None = None,
) -> None:
    """Serve the dashboard on host:port until `stop` is set."""
    import uvicorn

    from scheduler.db import Database
    from scheduler.transport import make_transport
    from scheduler.web.app import create_app

    # uvicorn exits the process when it cannot bind: say why first, as one line.
    check_bindable(host, port)
    db = Database(settings.database_url, pool_size=4)
    app = create_app(db, settings, token, make_transport)
    limit = max_connections()
    config = uvicorn.Config(
        app,
        host=host,
        port=port,
        log_config=None,
        access_log=False,
        lifespan="on",
        server_header=False,
        http=bounded_protocol(limit, HEADER_TIMEOUT_S),
        # Requests being served at once, beyond which the answer is 503.
        limit_concurrency=limit + 1,
        timeout_keep_alive=KEEP_ALIVE_S,
        h11_max_incomplete_event_size=MAX_HEADER_BYTES,
        backlog=128,
    )
    quiet_accept_errors(asyncio.get_running_loop())

    class Server(uvicorn.Server):
        """uvicorn without its signal handlers: they would take SIGTERM and Ctrl-C from the
        daemon's (`daemon.serve`), whose `stop` ends this server instead."""

        def capture_signals(self) -> contextlib.AbstractContextManager[None]:  # type: ignore[override]
            return contextlib.nullcontext()

    server = Server(config)
    task = asyncio.create_task(server.serve())
    try:
        while not server.started:
            if task.done():
                await task
                raise OSError(f"cannot serve the dashboard on {host}:{port}")
            await asyncio.sleep(0.05)
        log.info("web_started", url=f"http://{url_host(host)}:{port}/")
        if ready is not None:
            ready.set()
        stopper = asyncio.create_task(stop.wait())
        await asyncio.wait({task, stopper}, return_when=asyncio.FIRST_COMPLETED)
        stopper.cancel()
    finally:
        server.should_exit = True
        with contextlib.suppress(Exception):
            await asyncio.wait_for(task, 10)
        await db.dispose()


def check_bindable(host: str, port: int) -> None:
    """Raise `OSError` (address in use, not an address of this machine) unless host:port
    can be listened on now."""
    import socket

    try:
        with socket.create_server((host.strip("[]"), port), reuse_port=False):
            pass
    except OSError as exc:
        raise OSError(f"cannot listen on {host}:{port}: {exc.strerror or exc}") from exc


def url_host(host: str) -> str:
    """`host` as written in a URL (an IPv6 address in brackets)."""
    return f"[{host}]" if ":" in host and not host.startswith("[") else host
