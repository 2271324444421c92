"""The dashboard's ASGI application: pages, the JSON API and who may use them.

Who may do what (docs/security.md, "The web dashboard"):
- an action (POST: cancel, retry) needs the token in the `X-Rlfleet-Token` header (the
  pages' buttons send it from the token field): missing 401, wrong 403. A header cannot be
  set by another site's form, so a request forged cross-site has no token (CSRF);
- a read needs the token too, unless the client is on loopback and names a loopback host
  (a page of another site that rebinds its name to 127.0.0.1 names that site's host), and
  the request does not say a proxy forwarded it (`FORWARDED_HEADERS`): a proxy on this
  machine connects from loopback for clients of anywhere.
"""

from __future__ import annotations

import contextlib
import hmac
import ipaddress
from collections.abc import AsyncIterator, Awaitable, Callable
from datetime import datetime
from pathlib import Path
from typing import Any

import jinja2
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import HTMLResponse, JSONResponse, RedirectResponse, Response
from starlette.routing import Mount, Route
from starlette.staticfiles import StaticFiles

from scheduler.control import cancel_job, job_details, retry_job
from scheduler.db import Database, is_unavailable
from scheduler.errors import BadInput, NotFound, RlfleetError, error_line
from scheduler.fleet import get_vm, list_vms, vm_to_dict
from scheduler.job_logs import read_log_chunk
from scheduler.jobs import list_jobs
from scheduler.logging import get_logger
from scheduler.redact import scrub_urls
from scheduler.settings import Settings
from scheduler.states import JobStatus
from scheduler.transport import Transport
from scheduler.validate import INTEGER_RE, parse_job_id, shown
from scheduler.web import data

log = get_logger("web")

HERE = Path(__file__).resolve().parent
TOKEN_HEADER = "x-rlfleet-token"
ACTOR = "web"
MAX_LIMIT = 1000
LOOPBACK_HOSTS = frozenset({"localhost", "127.0.0.1", "[::1]", "::1"})
FORWARDED_HEADERS = ("forwarded", "x-forwarded-for", "x-real-ip")
"""Headers with which a proxy says whose request it forwards: such a request is not this
machine's, whatever address it comes from."""


class Forbidden(Exception):
    """A request without (401) or with a wrong (403) token."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status


def is_loopback(host: str | None) -> bool:
    """Whether a client address is a loopback address."""
    if not host:
        return False
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def host_is_loopback(header: str) -> bool:
    """Whether a Host header names this machine's loopback (with or without a port)."""
    host = header.strip().lower()
    if host.startswith("["):
        host = host[: host.find("]") + 1]
    elif host.count(":") == 1:
        host = host.partition(":")[0]
    return host in LOOPBACK_HOSTS or is_loopback(host.strip("[]"))


class Dashboard:
    """The application's state: the database, an SSH transport for logs and kills, the
    token, and the templates (autoescaped: nothing a user typed is rendered as HTML)."""

    def __init__(
        self,
        db: Database,
        settings: Settings,
        token: str,
        transport: Callable[[], Transport],
    ) -> None:
        if len(token) < 16:
            raise BadInput("the web token must have at least 16 characters")
        self.db = db
        self.settings = settings
        self.token = token
        self._make_transport = transport
        self._transport: Transport | None = None
        self.templates = jinja2.Environment(
            loader=jinja2.FileSystemLoader(HERE / "templates"),
            autoescape=True,
            undefined=jinja2.StrictUndefined,
        )

    @property
    def transport(self) -> Transport:
        """The SSH transport, made on first use (reading a log, killing a job)."""
        if self._transport is None:
            self._transport = self._make_transport()
        return self._transport

    async def close(self) -> None:
        """Close the transport's connections."""
        if self._transport is not None:
            await self._transport.close()

    def check(self, request: Request, *, action: bool) -> None:
        """Raise `Forbidden` unless the request may read (or, with `action`, act)."""
        given = request.headers.get(TOKEN_HEADER)
        if given is not None:
            if not hmac.compare_digest(given.encode(), self.token.encode()):
                raise Forbidden(403, "wrong token")
            return
        if action:
            raise Forbidden(401, f"this action needs the token (header {TOKEN_HEADER})")
        client = request.client.host if request.client else None
        if not (is_loopback(client) and host_is_loopback(request.headers.get("host", ""))):
            raise Forbidden(401, "reading from another machine needs the token")
        if any(name in request.headers for name in FORWARDED_HEADERS):
            raise Forbidden(401, "reading through a proxy needs the token")

    def render(self, template_name: str, **context: Any) -> HTMLResponse:
        """A page from its template; `initial` is handed to its script as JSON."""
        template = self.templates.get_template(template_name)
        return HTMLResponse(template.render(**context), headers=PAGE_HEADERS)


PAGE_HEADERS = {
    # Pages load only their own scripts and styles: an injected script would not run.
    "content-security-policy": "default-src 'self'; img-src 'self' data:; "
    "style-src 'self'; script-src 'self'; connect-src 'self'; frame-ancestors 'none'",
    "x-content-type-options": "nosniff",
    "referrer-policy": "no-referrer",
}

Handler = Callable[[Dashboard, Request], Awaitable[Response]]


def endpoint(handler: Handler, *, action: bool = False) -> Callable[[Request], Awaitable[Response]]:
    """Wrap a handler: the access check, and errors as JSON with the CLI's exit-code sense
    (bad input 400, not found 404, a service unreachable 503)."""

    async def run(request: Request) -> Response:
        dash: Dashboard = request.app.state.dashboard
        try:
            dash.check(request, action=action)
            return await handler(dash, request)
        except Forbidden as exc:
            return JSONResponse({"error": str(exc)}, status_code=exc.status)
        except NotFound as exc:
            return JSONResponse({"error": str(exc)}, status_code=404)
        except BadInput as exc:
            return JSONResponse({"error": scrub_urls(str(exc))}, status_code=400)
        except RlfleetError as exc:
            return JSONResponse({"error": scrub_urls(str(exc))}, status_code=503)
        except Exception as exc:
            if is_unavailable(exc):
                # The database is down or restarting: the pages say so at each refresh and
                # recover by themselves; no bug of the dashboard, so one line, no traceback.
                line = error_line(exc)
                log.warning("web_database_unavailable", path=request.url.path, error=line)
                message = f"the database cannot be reached: {line}"
                return JSONResponse({"error": scrub_urls(message)}, status_code=503)
            log.exception("web_request_failed", path=request.url.path)
            return JSONResponse({"error": scrub_urls(error_line(exc))}, status_code=500)

    return run


# --- parameters -------------------------------------------------------------------------


def int_param(request: Request, name: str, default: int, *, lo: int, hi: int) -> int:
    """An integer query parameter in [lo, hi]; `BadInput` otherwise."""
    raw = request.query_params.get(name)
    if raw is None or raw == "":
        return default
    if not INTEGER_RE.fullmatch(raw):  # ASCII digits: `int` also reads `٤` as 4
        raise BadInput(f"{name} must be a whole number")
    value = int(raw, 10)
    if not lo <= value <= hi:
        raise BadInput(f"{name} must be between {lo} and {hi}")
    return value


def status_param(request: Request) -> JobStatus | None:
    """The `status` filter; `BadInput` for a state that does not exist."""
    raw = request.query_params.get("status") or None
    if raw is None:
        return None
    try:
        return JobStatus(raw)
    except ValueError:
        raise BadInput(f"status must be one of {', '.join(s.value for s in JobStatus)}") from None


def name_param(request: Request) -> str | None:
    """The `name` filter (a part of the name), at most 255 characters."""
    raw = (request.query_params.get("name") or "").strip()
    if len(raw) > 255 or "\x00" in raw:
        raise BadInput("name must be at most 255 characters")
    return raw or None


def job_id_param(request: Request) -> int:
    """The job id in the path: ASCII digits only (`validate.parse_job_id`)."""
    return parse_job_id(request.path_params["job_id"])


EVENTS_SHOWN = 100
"""Events a job's page and `/api/jobs/ID` carry unless `?events=` says otherwise: the
newest; `events_older` counts the others, fetched with `?before=` the first one's id."""


def events_params(request: Request) -> dict[str, int | None]:
    """`?events=` (how many, newest first) and `?before=` (an event id) of a job's events."""
    before = request.query_params.get("before")
    return {
        "events_limit": int_param(request, "events", EVENTS_SHOWN, lo=1, hi=MAX_LIMIT),
        "events_before": int_param(request, "before", 1, lo=1, hi=2**63 - 1) if before else None,
    }


def jsonable(value: Any) -> Any:
    """Datetimes as ISO strings, recursively, as the CLI's `--json` prints them."""
    if isinstance(value, datetime):
        return value.isoformat()
    if isinstance(value, dict):
        return {k: jsonable(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [jsonable(v) for v in value]
    return value


def as_json(value: Any, status: int = 200) -> JSONResponse:
    """A JSON response of `value`."""
    return JSONResponse(jsonable(value), status_code=status)


# --- pages ------------------------------------------------------------------------------


async def queue_page(dash: Dashboard, request: Request) -> Response:
    """The queue: running, starting, pending (with reasons), the recent finished jobs."""
    status, name = status_param(request), name_param(request)
    async with dash.db.transaction() as session:
        snapshot = await data.queue_snapshot(session, status=status, name=name)
    return dash.render(
        "queue.html",
        page="queue",
        title="Queue",
        status=status.value if status else "",
        name=name or "",
        statuses=[s.value for s in JobStatus],
        initial=jsonable(snapshot),
    )


async def job_page(dash: Dashboard, request: Request) -> Response:
    """One job: placement, events, curves, log, cancel and retry."""
    job_id = job_id_param(request)
    details = await job_details(dash.db, job_id, events_limit=EVENTS_SHOWN)
    async with dash.db.transaction() as session:
        curve = await data.job_curve(session, job_id)
    diagnostics = await data.job_diagnostics(dash.db, job_id)
    return dash.render(
        "job.html",
        page="job",
        title=f"Job {job_id}",
        job=details,
        diagnostics=diagnostics,
        initial=jsonable({"job": details, "curve": curve}),
    )


async def fleet_page(dash: Dashboard, request: Request) -> Response:
    """Every VM and GPU, with utilisation and memory timelines."""
    name = name_param(request)
    page = int_param(request, "page", 1, lo=1, hi=100_000)
    hours = int_param(request, "hours", int(data.DEFAULT_HOURS), lo=1, hi=24 * 31)
    async with dash.db.transaction() as session:
        snapshot = await data.fleet_snapshot(session, name=name, page=page, hours=hours)
    return dash.render(
        "fleet.html",
        page="fleet",
        title="Fleet",
        name=name or "",
        # The filter form keeps the hours asked for; the default is left out of the URL.
        hours=hours if request.query_params.get("hours") else "",
        # The page's script draws the table from the same data as /api/fleet, first from
        # here, then from each refresh.
        initial=jsonable(snapshot),
    )


# --- the API ----------------------------------------------------------------------------


async def api_jobs(dash: Dashboard, request: Request) -> Response:
    """`job list --json`: ?status=, ?name=, ?limit= (100)."""
    status, name = status_param(request), name_param(request)
    limit = int_param(request, "limit", 100, lo=1, hi=MAX_LIMIT)
    async with dash.db.transaction() as session:
        return as_json(await list_jobs(session, status=status, limit=limit, name=name))


async def api_queue(dash: Dashboard, request: Request) -> Response:
    """The queue page's data (sections and counts)."""
    status, name = status_param(request), name_param(request)
    async with dash.db.transaction() as session:
        return as_json(await data.queue_snapshot(session, status=status, name=name))


async def api_job(dash: Dashboard, request: Request) -> Response:
    """`job show --json` with the newest 100 events (?events=N, ?before=EVENT_ID: older
    ones); ?progress=1 reads progress.json from the VM as the CLI does."""
    job_id = job_id_param(request)
    events = events_params(request)
    transport = dash.transport if request.query_params.get("progress") == "1" else None
    return as_json(await job_details(dash.db, job_id, transport, **events))


async def api_curve(dash: Dashboard, request: Request) -> Response:
    """The job's recorded steps: attempt, step, reward, loss, at."""
    job_id = job_id_param(request)
    async with dash.db.transaction() as session:
        return as_json(await data.job_curve(session, job_id))


async def api_log(dash: Dashboard, request: Request) -> Response:
    """A piece of train.log from ?offset= (bytes), as text (invalid UTF-8 replaced)."""
    job_id = job_id_param(request)
    offset = int_param(request, "offset", 0, lo=0, hi=2**53)
    attempt = request.query_params.get("attempt")
    chunk = await read_log_chunk(
        dash.db,
        dash.transport,
        job_id,
        offset=offset,
        attempt=int_param(request, "attempt", 1, lo=1, hi=2**31 - 1) if attempt else None,
    )
    return as_json(
        {
            "attempt": chunk.attempt,
            "offset": chunk.offset,
            "text": chunk.data.decode("utf-8", errors="replace"),
            "exists": chunk.exists,
            "live": chunk.live,
        }
    )


async def api_cancel(dash: Dashboard, request: Request) -> Response:
    """`job cancel ID`."""
    job_id = job_id_param(request)
    result = await cancel_job(dash.db, dash.transport, job_id, actor=ACTOR)
    log.info("web_cancel", job_id=job_id, previous=result.previous)
    return as_json({"id": job_id, "previous": result.previous, "kill": result.kill})


async def api_retry(dash: Dashboard, request: Request) -> Response:
    """`job retry ID`."""
    job_id = job_id_param(request)
    published = await retry_job(dash.db, dash.settings, job_id, actor=ACTOR)
    log.info("web_retry", job_id=job_id, published=published)
    return as_json({"id": job_id, "published": published})


async def api_vms(dash: Dashboard, request: Request) -> Response:
    """`vm list --json`; ?name= filters, ?limit= and ?offset= page."""
    name = name_param(request)
    limit = int_param(request, "limit", MAX_LIMIT, lo=1, hi=MAX_LIMIT)
    offset = int_param(request, "offset", 0, lo=0, hi=2**31 - 1)
    async with dash.db.transaction() as session:
        vms = await list_vms(session, name=name, limit=limit, offset=offset)
        return as_json([vm_to_dict(vm) for vm in vms])


async def api_vm(dash: Dashboard, request: Request) -> Response:
    """`vm show NAME --json`."""
    name = request.path_params["name"]
    if "\x00" in name or len(name) > 255:
        raise NotFound(f"no VM named {shown(name)}")  # no name can hold it: nothing to ask
    async with dash.db.transaction() as session:
        vm = await get_vm(session, name, with_gpus=True)
        return as_json(vm_to_dict(vm))


async def api_fleet(dash: Dashboard, request: Request) -> Response:
    """The fleet page's data: a page of VMs with timelines, and the GPU state counts."""
    name = name_param(request)
    page = int_param(request, "page", 1, lo=1, hi=100_000)
    hours = int_param(request, "hours", int(data.DEFAULT_HOURS), lo=1, hi=24 * 31)
    async with dash.db.transaction() as session:
        return as_json(await data.fleet_snapshot(session, name=name, page=page, hours=hours))


async def root(request: Request) -> Response:
    """/ is the queue."""
    return RedirectResponse("/queue", status_code=307)


def create_app(
    db: Database, settings: Settings, token: str, transport: Callable[[], Transport]
) -> Starlette:
    """The dashboard application on `db` (which the caller disposes of)."""
    dash = Dashboard(db, settings, token, transport)
    get, post = ["GET"], ["POST"]
    routes = [
        Route("/", root, methods=get),
        Route("/queue", endpoint(queue_page), methods=get),
        Route("/jobs/{job_id}", endpoint(job_page), methods=get),
        Route("/fleet", endpoint(fleet_page), methods=get),
        Route("/api/queue", endpoint(api_queue), methods=get),
        Route("/api/jobs", endpoint(api_jobs), methods=get),
        Route("/api/jobs/{job_id}", endpoint(api_job), methods=get),
        Route("/api/jobs/{job_id}/curve", endpoint(api_curve), methods=get),
        Route("/api/jobs/{job_id}/log", endpoint(api_log), methods=get),
        Route("/api/jobs/{job_id}/cancel", endpoint(api_cancel, action=True), methods=post),
        Route("/api/jobs/{job_id}/retry", endpoint(api_retry, action=True), methods=post),
        Route("/api/vms", endpoint(api_vms), methods=get),
        Route("/api/vms/{name}", endpoint(api_vm), methods=get),
        Route("/api/fleet", endpoint(api_fleet), methods=get),
        Mount("/static", app=StaticFiles(directory=HERE / "static"), name="static"),
    ]

    @contextlib.asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[None]:
        try:
            yield
        finally:
            await dash.close()

    app = Starlette(routes=routes, lifespan=lifespan)
    app.state.dashboard = dash
    return app
