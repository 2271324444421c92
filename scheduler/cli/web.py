"""`rlfleet web`: the dashboard (queue, jobs with curves and logs, the fleet's GPUs)."""

from __future__ import annotations

from pathlib import Path

import click

from scheduler.cli._common import CliContext, pass_cli, state_dir_option

# Starlette, Jinja2 and uvicorn are imported when the command runs (scheduler.web):
# `rlfleet --help` loads none of them.


@click.command("web")
@click.option("--port", type=click.IntRange(1, 65535), default=8080, show_default=True)
@click.option(
    "--host",
    default="127.0.0.1",
    show_default=True,
    help="Address to listen on. Another machine must send the token even to read.",
)
@state_dir_option(
    "Where the token is kept, web.token (default: the state directory of `rlfleet up`)."
)
@pass_cli
def web(ctx: CliContext, port: int, host: str, state_dir: Path | None) -> None:
    """Serve the web dashboard and its JSON API (/api/…, as the CLI's --json).

    Reading needs no token from this machine (127.0.0.1): every local user can read every
    job and its log. Cancel and retry, any request from another machine and any request a
    proxy forwarded (X-Forwarded-For) need the token: $RLFLEET_WEB_TOKEN, else
    STATE_DIR/web.token (generated, mode 0600). Ctrl-C stops it.
    """
    import asyncio

    from scheduler.daemon import serve
    from scheduler.logging import configure
    from scheduler.up import default_state_dir
    from scheduler.web.server import load_token, serve_web, url_host

    settings = ctx.settings
    ctx.database_url  # noqa: B018 - checked before anything starts (exit 2 when malformed)
    configure(ctx.log_level or "INFO")
    token, where = load_token((state_dir or default_state_dir()).expanduser())
    ready = asyncio.Event()

    async def main(stop: asyncio.Event) -> None:
        async def announce() -> None:
            await ready.wait()
            click.echo(
                f"rlfleet web: http://{url_host(host)}:{port}/ (actions need the token in {where})"
            )

        shout = asyncio.create_task(announce())
        try:
            await serve_web(settings, host=host, port=port, token=token, stop=stop, ready=ready)
        finally:
            shout.cancel()

    try:
        asyncio.run(serve("web", main, ready=ready, database_url=settings.database_url))
    except OSError as exc:
        from scheduler.errors import ServiceUnavailable

        raise ServiceUnavailable(f"cannot serve on {host}:{port}: {exc}") from exc
