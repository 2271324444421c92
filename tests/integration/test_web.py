"""The dashboard's pages and API in-process (ASGI), against real Postgres and the SSH test
fleet: what it shows, that nothing a user wrote is rendered as HTML, and who may act."""

from __future__ import annotations

import json
import logging
import socket
import time
from collections.abc import AsyncIterator, Callable

import httpx
import pytest
from sqlalchemy import select

from scheduler.cli._common import to_jsonable
from scheduler.db import Database
from scheduler.embedded import free_port
from scheduler.fleet import list_vms, set_gpu_draining, vm_to_dict
from scheduler.gpu_poller import GpuPoller
from scheduler.jobs import list_jobs
from scheduler.models import JobEvent
from scheduler.settings import Settings
from scheduler.transport import Transport
from scheduler.web.app import create_app, host_is_loopback
from tests.integration.test_poller import launch_job, wait_for_exit_code
from tests.workloads.support import new_job, wait_status

TOKEN = "test-token-0123456789abcdef"
XSS = "<script>alert(1)</script>"

Client = Callable[..., httpx.AsyncClient]


@pytest.fixture
async def client(db: Database, database_url: str, transport: Transport) -> AsyncIterator[Client]:
    """Clients of one dashboard app; `client(host=…)` makes the request come from there."""
    settings = Settings.load(database_url, "nats://127.0.0.1:4222")
    app = create_app(db, settings, TOKEN, lambda: transport)
    made: list[httpx.AsyncClient] = []

    def make(host: str = "127.0.0.1", **kw: object) -> httpx.AsyncClient:
        c = httpx.AsyncClient(
            transport=httpx.ASGITransport(app=app, client=(host, 50000)),
            base_url="http://127.0.0.1:8080",
            **kw,  # type: ignore[arg-type]
        )
        made.append(c)
        return c

    yield make
    for c in made:
        await c.aclose()


async def test_a_job_name_with_html_is_shown_as_text_on_every_page(
    db: Database, client: Client
) -> None:
    # Given a job named like a script
    job_id = await new_job(db, name=XSS)
    web = client()
    for path in ("/queue", f"/jobs/{job_id}", f"/queue?name={XSS}"):
        # When its pages are rendered
        page = await web.get(path)
        # Then the markup never holds the name as a tag, only escaped
        assert page.status_code == 200, page.text
        assert XSS not in page.text and "<script>alert" not in page.text
        assert "\\u003cscript\\u003ealert(1)\\u003c/script\\u003e" in page.text or (
            "&lt;script&gt;alert(1)&lt;/script&gt;" in page.text
        )
        # And the page forbids inline scripts anyway
        assert "script-src 'self'" in page.headers["content-security-policy"]
    # And the data block hands the script the name as it was typed
    page = await web.get("/queue")
    block = page.text.split('id="initial">', 1)[1].split("</script>", 1)[0]
    names = [j["name"] for j in json.loads(block)["sections"]["pending"]]
    assert names == [XSS]


async def test_a_log_line_with_html_arrives_as_json_text(
    db: Database, client: Client, sim_fleet, transport: Transport
) -> None:
    # Given a job on the SSH fleet whose log holds HTML (fake_train prints its arguments)
    fleet = await sim_fleet(1, gpus_per_vm=1)
    vm_id = (await fleet.register(db))["vm0"]
    await GpuPoller(db, transport).sweep()
    job_id = await launch_job(db, transport, fleet[0], vm_id, 0, "--note", "<b>bold</b>&amp;")
    await wait_for_exit_code(db, fleet[0], job_id)
    # When the log is read through the API, from the start and then from its end
    web = client()
    first = await web.get(f"/api/jobs/{job_id}/log")
    body = first.json()
    again = (await web.get(f"/api/jobs/{job_id}/log?offset={body['offset']}")).json()
    # Then it is JSON text, byte for byte what the job wrote
    assert first.headers["content-type"].startswith("application/json")
    assert "<b>bold</b>&amp;" in body["text"] and body["exists"] and body["attempt"] == 1
    assert again["text"] == "" and again["offset"] == body["offset"]


async def test_actions_need_the_token_and_a_wrong_one_is_refused(
    db: Database, client: Client, caplog: pytest.LogCaptureFixture
) -> None:
    job_id = await new_job(db)
    web = client()
    caplog.set_level(logging.DEBUG)
    # Without a token: 401; with a wrong one (even from loopback): 403; nothing moved
    assert (await web.post(f"/api/jobs/{job_id}/cancel")).status_code == 401
    wrong = await web.post(f"/api/jobs/{job_id}/cancel", headers={"x-rlfleet-token": "x" * 26})
    assert wrong.status_code == 403
    # A token in a form field or a cookie is not a token: a forged cross-site form has none
    forged = await client(cookies={"token": TOKEN}).post(
        f"/api/jobs/{job_id}/cancel", data={"token": TOKEN}
    )
    assert forged.status_code == 401
    await wait_status(db, job_id, "queued", timeout=1)
    # With the token: cancelled, and the event says the web did it
    ok = await web.post(f"/api/jobs/{job_id}/cancel", headers={"x-rlfleet-token": TOKEN})
    assert ok.status_code == 200, ok.text
    assert ok.json()["previous"] == "queued"
    await wait_status(db, job_id, "cancelled", timeout=1)
    async with db.transaction() as session:
        actors = list(
            await session.scalars(select(JobEvent.actor).where(JobEvent.job_id == job_id))
        )
    assert actors[-1] == "web"
    # Retrying a cancelled job is bad input (400), as in the CLI (exit 2)
    again = await web.post(f"/api/jobs/{job_id}/retry", headers={"x-rlfleet-token": TOKEN})
    assert again.status_code == 400 and "only a failed job" in again.json()["error"]
    # And the token was never written to a log record
    assert TOKEN not in caplog.text


async def test_reads_without_the_token_only_from_loopback(db: Database, client: Client) -> None:
    await new_job(db)
    # From another machine: refused without the token, served with it
    remote = client(host="10.1.2.3")
    for path in ("/queue", "/fleet", "/api/jobs", "/api/vms"):
        assert (await remote.get(path)).status_code == 401, path
        ok = await remote.get(path, headers={"x-rlfleet-token": TOKEN})
        assert ok.status_code == 200, path
    # From loopback, but naming another host (a rebound DNS name): refused too
    rebound = client()
    assert (
        await rebound.get("/api/jobs", headers={"host": "evil.example:8080"})
    ).status_code == 401
    assert (await client().get("/queue")).status_code == 200
    assert host_is_loopback("[::1]:8080") and host_is_loopback("localhost")
    assert not host_is_loopback("127.0.0.1.evil.example")


async def test_the_api_mirrors_the_clis_json(db: Database, client: Client, sim_fleet) -> None:
    # Given jobs and a VM with GPUs
    fleet = await sim_fleet(1, gpus_per_vm=2)
    await fleet.register(db)
    ids = [await new_job(db, name=f"job-{i}") for i in range(3)]
    web = client()
    # Then /api/jobs and /api/vms are what `job list --json` and `vm list --json` print
    async with db.transaction() as session:
        jobs = to_jsonable(await list_jobs(session))
        vms = to_jsonable([vm_to_dict(v) for v in await list_vms(session)])
    assert (await web.get("/api/jobs")).json() == jobs
    assert (await web.get("/api/vms")).json() == vms
    # And the filters are the CLI's, plus a name filter taken literally
    assert [j["id"] for j in (await web.get("/api/jobs?name=job-1")).json()] == [ids[1]]
    assert (await web.get("/api/jobs?name=%25")).json() == []
    assert (await web.get("/api/jobs?status=running")).json() == []
    assert (await web.get("/api/jobs?status=nope")).status_code == 400
    assert (await web.get("/api/jobs/999999")).status_code == 404
    shown = (await web.get(f"/api/jobs/{ids[0]}")).json()
    assert shown["id"] == ids[0] and shown["events"][0]["to"] == "queued"


async def test_the_queue_groups_jobs_and_filters_by_state_and_name(
    db: Database, client: Client
) -> None:
    a = await new_job(db, name="alpha")
    b = await new_job(db, name="beta")
    c = await new_job(db, name="gamma")
    web = client()
    async with db.transaction() as session:
        from scheduler.jobs import transition
        from scheduler.states import JobStatus

        for job_id, to in ((b, JobStatus.CANCELLED), (c, JobStatus.FAILED)):
            await transition(
                session, job_id, expected=JobStatus.QUEUED, to=to, reason="test", actor="test"
            )
    data = (await web.get("/api/queue")).json()
    assert [j["id"] for j in data["sections"]["pending"]] == [a]
    # A failed job has finished too (it is listed somewhere, not only counted)
    assert [j["id"] for j in data["sections"]["finished"]] == [c, b]
    assert data["counts"]["queued"] == 1 and data["counts"]["cancelled"] == 1
    assert data["counts"]["failed"] == 1
    listed = [j["id"] for section in data["sections"].values() for j in section]
    assert sorted(listed) == [a, b, c]
    only = (await web.get("/api/queue?status=cancelled")).json()["sections"]
    assert only["pending"] == [] and [j["id"] for j in only["finished"]] == [b]
    failed = (await web.get("/api/queue?status=failed")).json()["sections"]
    assert [j["id"] for j in failed["finished"]] == [c]
    named = (await web.get("/api/queue?name=ALP")).json()["sections"]
    assert [j["id"] for j in named["pending"]] == [a] and named["finished"] == []


async def test_the_fleet_page_shows_each_gpus_state_and_a_timeline(
    db: Database, client: Client, sim_fleet, transport: Transport
) -> None:
    fleet = await sim_fleet(1, gpus_per_vm=3)
    vm_id = (await fleet.register(db))["vm0"]
    poller = GpuPoller(db, transport)
    await poller.sweep()
    job_id = await launch_job(db, transport, fleet[0], vm_id, 1, "--fake_seconds", "60")
    fleet[0].add_foreign_process(2)
    await poller.sweep()
    web = client()
    data = (await web.get("/api/fleet")).json()
    gpus = data["vms"][0]["gpus"]
    assert [(g["state"], g["job_id"]) for g in gpus] == [
        ("free", None),
        ("allocated", job_id),
        ("foreign", None),
    ]
    assert data["gpu_states"] == {
        "free": 1,
        "allocated": 1,
        "drained": 0,
        "foreign": 0 + 1,
        "unhealthy": 0,
    }
    assert data["vms"][0]["timeline"], "two polls recorded samples"
    # The timelines cover the time since the first sample (a minute at least), not 3 hours
    # in which two polls would be one dot at the end
    start, end = data["timeline_start"], data["timeline_end"]
    assert 60 <= end - start < 3600
    assert all(start <= p["t"] <= end for p in data["vms"][0]["timeline"])
    # And the page hands its script the same data, which it draws and then refreshes from
    # /api/fleet (the browser test checks the drawing)
    page = await web.get("/fleet")
    assert page.status_code == 200
    block = page.text.split('id="initial">', 1)[1].split("</script>", 1)[0]
    shown = json.loads(block)
    assert [(g["state"], g["job_id"]) for g in shown["vms"][0]["gpus"]] == [
        ("free", None),
        ("allocated", job_id),
        ("foreign", None),
    ]
    assert shown["gpu_states"] == data["gpu_states"] and shown["vms"][0]["timeline"]


async def test_the_fleet_page_shows_an_unhealthy_gpus_reason_and_a_drained_gpu(
    db: Database, client: Client, sim_fleet, transport: Transport
) -> None:
    # Given a VM whose GPU 0 requires a reset and whose GPU 1 an operator drained
    fleet = await sim_fleet(1, gpus_per_vm=3)
    await fleet.register(db)
    fleet[0].set_gpu_health(0, fault="[GPU requires reset]")
    poller = GpuPoller(db, transport)
    await poller.sweep()
    async with db.transaction() as session:
        await set_gpu_draining(session, "vm0", "1", True)
    # Then the fleet page's data says so, GPU by GPU, with the reason
    data = (await client().get("/api/fleet")).json()
    gpus = data["vms"][0]["gpus"]
    assert [(g["state"], g["drained"]) for g in gpus] == [
        ("unhealthy", False),
        ("drained", True),
        ("free", False),
    ]
    assert "requires reset" in gpus[0]["health_reason"]
    assert gpus[1]["health_reason"] is None
    assert data["gpu_states"] == {
        "free": 1,
        "allocated": 0,
        "drained": 1,
        "foreign": 0,
        "unhealthy": 1,
    }


class LogRecorder:
    """Stands in for a module's logger: records (method, event) of every call, whatever
    the process's logging set-up (which an earlier test may have pointed elsewhere)."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, str]] = []

    def __getattr__(self, method: str) -> Callable[..., None]:
        def record(event: str, *_args: object, **_fields: object) -> None:
            self.calls.append((method, event))

        return record


async def test_a_database_that_cannot_be_reached_is_a_503_of_one_line(
    transport: Transport, monkeypatch: pytest.MonkeyPatch
) -> None:
    import scheduler.web.app as web_app

    log = LogRecorder()
    monkeypatch.setattr(web_app, "log", log)
    # Given a dashboard whose database does not answer (nothing listens on its port)
    url = f"postgresql+psycopg://postgres@127.0.0.1:{free_port()}/gone"
    dead = Database(url)
    app = create_app(dead, Settings.load(url, "nats://127.0.0.1:4222"), TOKEN, lambda: transport)
    try:
        async with httpx.AsyncClient(
            transport=httpx.ASGITransport(app=app, client=("127.0.0.1", 50000)),
            base_url="http://127.0.0.1:8080",
        ) as web:
            for path in ("/api/fleet", "/api/queue", "/fleet"):
                # When a page or its refresh asks for data
                answer = await web.get(path)
                # Then it is told the service is unavailable and why, in one line (the
                # pages show it and try again), not an internal error with a traceback
                assert answer.status_code == 503, (path, answer.text)
                error = answer.json()["error"]
                assert error.startswith("the database cannot be reached: ") and "\n" not in error
    finally:
        await dead.dispose()
    # And its log says so once a request, as a warning, not as a failure with a traceback
    assert log.calls == [("warning", "web_database_unavailable")] * 3, log.calls


def _connect(port: int, head: bytes) -> socket.socket:
    sock = socket.create_connection(("127.0.0.1", port), timeout=5)
    sock.sendall(head)
    return sock


def _closed_within(sock: socket.socket, seconds: float, trickle: bytes = b"") -> bool:
    """Whether the server closes `sock` within `seconds`, `trickle` sent every 0.2 s."""
    deadline = time.monotonic() + seconds
    try:
        while time.monotonic() < deadline:
            if trickle:
                sock.sendall(trickle)
            sock.settimeout(0.2)
            try:
                if sock.recv(65536) == b"":
                    return True
            except TimeoutError:
                continue
        return False
    except (ConnectionResetError, BrokenPipeError):
        return True
    finally:
        sock.close()


@pytest.mark.slow
async def test_half_sent_and_trickled_requests_cost_the_dashboard_one_connection_each_for_a_while(
    database_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    import asyncio

    from scheduler.web import server

    # Given the dashboard served with room for 4 connections and 1 s to send a request head
    monkeypatch.setattr(server, "MAX_CONNECTIONS", 4, raising=False)
    monkeypatch.setattr(server, "HEADER_TIMEOUT_S", 1.0, raising=False)
    port, stop, ready = free_port(), asyncio.Event(), asyncio.Event()
    settings = Settings.load(database_url, "nats://127.0.0.1:4222")
    serving = asyncio.create_task(
        server.serve_web(settings, host="127.0.0.1", port=port, token=TOKEN, stop=stop, ready=ready)
    )
    half = b"GET /queue HTTP/1.1\r\nHost: 127.0.0.1\r\n"
    whole = b"GET / HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n"
    try:
        await asyncio.wait_for(ready.wait(), 30)

        def flood() -> None:
            # When a client keeps 4 half-sent requests open, and opens one more
            held = [_connect(port, half) for _ in range(4)]
            time.sleep(0.2)
            # Then the one more is closed at once
            assert _closed_within(_connect(port, half), 0.5)
            # And the 4 are closed once their second is up, though they keep sending
            started = time.monotonic()
            assert all(_closed_within(sock, 4.0, trickle=b"X: y\r\n") for sock in held)
            assert time.monotonic() - started < 4
            # And so is a kept-alive connection trickling its second request
            sock = _connect(port, whole)
            sock.settimeout(5)
            assert sock.recv(65536).startswith(b"HTTP/1.1 307")
            sock.sendall(b"GET /queue HTTP/1.1\r\n")
            assert _closed_within(sock, 4.0, trickle=b"X: y\r\n")
            # And a whole request is answered as ever
            sock = _connect(port, whole)
            sock.settimeout(5)
            assert sock.recv(65536).startswith(b"HTTP/1.1 307")
            sock.close()

        await asyncio.to_thread(flood)
    finally:
        stop.set()
        await asyncio.wait_for(serving, 30)


async def test_a_jobs_events_come_newest_first_by_pages(db: Database, client: Client) -> None:
    from tests.integration.test_transitions import wait_round

    # Given a job that waited for 130 different reasons: a row each, one row for its 130
    # wake-ups, and its submission, 132 events in all
    job_id = await new_job(db)
    for i in range(130):
        await wait_round(db, job_id, reason=f"reason {i:03d}")
    web = client()
    # When its page's data is fetched, then it holds the newest 100 events, oldest first,
    # and says how many older ones there are
    page = (await web.get(f"/api/jobs/{job_id}")).json()
    assert len(page["events"]) == 100 and page["events_older"] == 32
    assert page["events"][-1]["reason"] == "reason 129"
    assert page["events"][-1]["count"] == 1
    # And the older ones come by pages of the size asked, before the first one shown
    older = await web.get(f"/api/jobs/{job_id}?events=200&before={page['events'][0]['id']}")
    older = older.json()
    assert len(older["events"]) == 32 and older["events_older"] == 0
    assert older["events"][0]["reason"] == "submitted"
    assert older["events"][-1]["id"] < page["events"][0]["id"]
    # And the repeated wake-up is one row, counted
    woken = [e for e in older["events"] + page["events"] if e["from"] == "pending"]
    assert len(woken) == 1 and woken[0]["count"] == 130 and woken[0]["last_at"]
    # And the job page itself carries the newest page only
    html = (await web.get(f"/jobs/{job_id}")).text
    assert "reason 129" in html and "reason 005" not in html
    for bad in ("events=0", "events=1001", "before=x", "before=0"):
        assert (await web.get(f"/api/jobs/{job_id}?{bad}")).status_code == 400, bad


async def test_job_ids_are_ascii_digits_and_odd_names_are_not_found(
    db: Database, client: Client
) -> None:
    job_id = await new_job(db)
    web = client()
    # A superscript two or an Arabic-Indic four is no job id: bad input, not 500, not job 4
    for raw in ("%C2%B2", "%D9%A4", "1%C2%B2", "+1", "-1", "0x1", "1_0", " 1", "9" * 19):
        assert (await web.get(f"/api/jobs/{raw}")).status_code == 400, raw
        assert (await web.get(f"/jobs/{raw}")).status_code == 400, raw
    assert (await web.get(f"/api/jobs/{job_id}")).status_code == 200
    # And so are the numbers of the query strings
    for query in ("limit=%D9%A4", "limit=1_0", "limit=%C2%B2", "limit=" + "9" * 5000):
        assert (await web.get(f"/api/jobs?{query}")).status_code == 400, query
    assert (await web.get(f"/api/jobs/{job_id}/log?offset=%D9%A4")).status_code == 400
    # A VM name with a NUL byte is simply no VM
    assert (await web.get("/api/vms/%00")).status_code == 404
    assert (await web.get("/api/vms/a%00b")).status_code == 404


async def test_a_request_a_proxy_forwarded_needs_the_token_to_read(
    db: Database, client: Client
) -> None:
    await new_job(db)
    web = client()  # a proxy on this machine: the connection comes from loopback
    # When it forwards a remote client's request, saying so in any of the usual headers
    for header in ("X-Forwarded-For", "Forwarded", "X-Real-IP"):
        value = "for=203.0.113.9" if header == "Forwarded" else "203.0.113.9"
        # Then reading needs the token, as from any other machine
        assert (await web.get("/api/jobs", headers={header: value})).status_code == 401, header
        with_token = {header: value, "x-rlfleet-token": TOKEN}
        assert (await web.get("/api/jobs", headers=with_token)).status_code == 200, header
    # And a request of this machine, not forwarded, still reads without it
    assert (await web.get("/api/jobs")).status_code == 200


async def test_a_jobs_diagnostics_are_shown_as_text_on_its_page(
    db: Database, client: Client
) -> None:
    """Given a job whose attempt was stopped as hung, with a log tail holding markup, when
    its page is rendered, then the diagnostics (reason and content) are on it, escaped."""
    from scheduler.models import JobDiagnostics

    job_id = await new_job(db)
    async with db.transaction() as session:
        session.add(
            JobDiagnostics(
                job_id=job_id,
                attempt=1,
                vm_name="vm0",
                reason="hung: step 3 unchanged for 40s",
                content=f"== end of train.log\n{XSS}\n== process 7\nThread 7 (idle)\n",
            )
        )
    page = await client().get(f"/jobs/{job_id}")
    assert page.status_code == 200, page.text
    section = page.text.split('id="diagnostics-section"', 1)[1].split("</section>", 1)[0]
    assert "attempt 1 on vm0" in section and "hung: step 3 unchanged for 40s" in section
    assert "Thread 7 (idle)" in section
    assert XSS not in page.text and "&lt;script&gt;alert(1)&lt;/script&gt;" in section
    # A job without diagnostics has no such section.
    other = await client().get(f"/jobs/{await new_job(db)}")
    assert 'id="diagnostics-section"' not in other.text


async def test_the_job_page_shows_the_store_its_checkpoints_and_the_last_upload_error(
    db: Database, client: Client
) -> None:
    from sqlalchemy import update

    from scheduler.models import Job

    # Given a job with a store whose agent reported two checkpoints and an error
    job_id = await new_job(db, store="s3://bucket/runs")
    plain = await new_job(db)
    status = {
        "checkpoints": [
            {"step": 2, "bytes": 1500, "at": "2026-11-25T18:00:00Z"},
            {"step": 4, "bytes": 1500, "at": "2026-11-25T18:00:09Z"},
        ],
        "restored": None,
        "final": False,
        "last_error": f"checkpoint-6: {XSS}",
        "error_at": "2026-11-25T18:00:19Z",
    }
    async with db.transaction() as session:
        await session.execute(update(Job).where(Job.id == job_id).values(store_status=status))
    web = client()
    # Then the API hands the page the URL and the status as the CLI's JSON has them
    shown = (await web.get(f"/api/jobs/{job_id}")).json()
    assert shown["store"] == "s3://bucket/runs"
    assert [c["step"] for c in shown["store_status"]["checkpoints"]] == [2, 4]
    assert shown["store_status"]["last_error"] == f"checkpoint-6: {XSS}"
    # And the page has its store section, the error never as markup
    page = await web.get(f"/jobs/{job_id}")
    assert '<section id="store-section" >' in page.text and "s3://bucket/runs" in page.text
    assert XSS not in page.text
    other = await web.get(f"/jobs/{plain}")
    assert '<section id="store-section" hidden>' in other.text
    assert (await web.get(f"/api/jobs/{plain}")).json()["store_status"] is None
