"""Serving the dashboard: its token, and uvicorn on the address asked for, until `stop`."""

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


def load_token(state_dir: Path) -> tuple[str, str]:
    """The token actions need, and where it is (never the value): `RLFLEET_WEB_TOKEN` (or
    the file `RLFLEET_WEB_TOKEN_FILE` names), else `STATE_DIR/web.token` (mode 0600),
    generated on first use."""
    token = secret_from_env(TOKEN_ENV)
    if token:
        where = f"${TOKEN_ENV}"
    else:
        from scheduler.up import StateDir

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
    config = uvicorn.Config(
        app,
        host=host,
        port=port,
        log_config=None,
        access_log=False,
        lifespan="on",
        server_header=False,
    )

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
