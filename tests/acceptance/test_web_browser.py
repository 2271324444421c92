"""The dashboard in a real headless Chromium (Debian's `chromium` and `chromium-driver`,
driven by Selenium), against real Postgres, NATS, the three daemons and the SSH test
fleet; jobs are submitted with the real CLI.

`RLFLEET_WEB_SCREENSHOTS=docs/img pytest tests/acceptance/test_web_browser.py` also saves
the screenshots the README shows (queue.png, job.png, fleet.png), of a scene built after
the checks: jobs in every state (running on one and on two nodes, pending with its reason,
completed, failed, cancelled), a curve over several steps, GPUs allocated and free.
"""

from __future__ import annotations

import asyncio
import os
import re
import sys
import tempfile
import time
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import pytest

from scheduler.db import Database
from scheduler.embedded import EmbeddedNats, EmbeddedPostgres, free_port
from scheduler.settings import Settings
from scheduler.transport import Transport
from tests.fleet import FAKE_TRAIN
from tests.requires import require_browser
from tests.workloads.support import write_fake_python

pytestmark = pytest.mark.slow

TOKEN = "browser-test-token-0123456789"
XSS = "<script>alert(1)</script>"
SCREENSHOTS_ENV = "RLFLEET_WEB_SCREENSHOTS"
CHROMIUM_FLAGS = (
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--window-size=1280,1100",
)


class Browser:
    """A Chromium session; every call runs in a thread, so the event loop that serves the
    dashboard, the daemons and the SSH fleet goes on meanwhile."""

    def __init__(self, driver: Any) -> None:
        self.driver = driver

    async def call(self, fn: Callable[..., Any], *args: Any) -> Any:
        return await asyncio.to_thread(fn, *args)

    async def get(self, url: str) -> float:
        """Open `url`; seconds until its script has drawn the page (body[data-ready])."""
        started = time.monotonic()
        await self.call(self.driver.get, url)
        await self.until(lambda: self.js("return document.body.dataset.ready === '1'"), 10)
        return time.monotonic() - started

    def js(self, script: str, *args: Any) -> Any:
        return self.driver.execute_script(script, *args)

    async def until(self, check: Callable[[], Any], timeout: float = 60) -> Any:
        """Poll `check` (run in a thread) until it is truthy; fail after `timeout` s."""
        deadline = time.monotonic() + timeout
        while True:
            value = await self.call(check)
            if value:
                return value
            assert time.monotonic() < deadline, f"timed out waiting for {check}"
            await asyncio.sleep(0.2)

    async def screenshot(self, name: str) -> None:
        folder = os.environ.get(SCREENSHOTS_ENV)
        if folder:
            Path(folder).mkdir(parents=True, exist_ok=True)
            await self.call(self.driver.save_screenshot, str(Path(folder) / name))


@pytest.fixture
async def browser() -> AsyncIterator[Browser]:
    chromium, chromedriver = require_browser()
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    options = webdriver.ChromeOptions()
    options.binary_location = chromium
    profile = tempfile.mkdtemp(prefix="rlfleet-chromium-")
    for flag in (*CHROMIUM_FLAGS, f"--user-data-dir={profile}"):
        options.add_argument(flag)
    driver = await asyncio.to_thread(
        webdriver.Chrome, service=Service(chromedriver), options=options
    )
    try:
        yield Browser(driver)
    finally:
        await asyncio.to_thread(driver.quit)


async def cli(env: dict[str, str], *args: str) -> str:
    """Run the real `rlfleet` CLI (without blocking the loop); its stdout."""
    proc = await asyncio.create_subprocess_exec(
        sys.executable,
        "-m",
        "scheduler.cli",
        *args,
        env=env,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
    )
    out, err = await asyncio.wait_for(proc.communicate(), 60)
    assert proc.returncode == 0, err.decode()
    return out.decode().strip()


def submit_args(name: str, *flags: str, train: tuple[str, ...] = ()) -> tuple[str, ...]:
    """`job submit` of a job called `name`, with `flags` and the trainer's `train` args."""
    return (
        "job",
        "submit",
        "--model",
        "m",
        "--dataset",
        "d",
        "--reward-function",
        "format",
        "--name",
        name,
        *flags,
        "--",
        *train,
    )


# Where each chart's tick labels and lines are drawn, relative to their <svg>: a label or a
# line outside it is cut off, as the last step's number once was.
CHART_BOXES_JS = """
return [...document.querySelectorAll(arguments[0])].map((svg) => {
  const box = svg.getBoundingClientRect();
  const inside = (r) => r.left >= box.left - 0.5 && r.right <= box.right + 0.5
    && r.top >= box.top - 0.5 && r.bottom <= box.bottom + 0.5;
  return {
    width: box.width,
    ticks: [...svg.querySelectorAll("text.tick")].map((t) => t.textContent),
    ticksInside: [...svg.querySelectorAll("text")].every((t) => inside(t.getBoundingClientRect())),
    lines: [...svg.querySelectorAll("polyline")].map((l) => ({
      points: l.points.numberOfItems,
      width: l.getBoundingClientRect().width,
      inside: inside(l.getBoundingClientRect()),
    })),
  };
});
"""

NODES_JS = """
return [...document.querySelectorAll('#nodes tr')].map(
  (tr) => [...tr.querySelectorAll('td')].map((td) => td.textContent));
"""


async def fleet_lines_drawn(browser: Browser, url: str, vms: int, timeout: float = 90) -> Any:
    """Open the fleet page once and wait, as it refreshes itself without a reload, until
    every VM's timeline is a line of several points spread over a good part of its chart,
    inside it; the charts' boxes."""
    await browser.get(url)
    browser.js("window.notReloaded = true")

    def drawn(chart: dict[str, Any]) -> bool:
        return any(
            line["points"] >= 5 and line["width"] >= chart["width"] / 5 and line["inside"]
            for line in chart["lines"]
        )

    def all_drawn() -> Any:
        charts = browser.js(CHART_BOXES_JS, ".spark svg")
        return charts if len(charts) == vms and all(drawn(c) for c in charts) else None

    try:
        charts = await browser.until(all_drawn, timeout)
    except AssertionError:
        raise AssertionError(
            f"no visible timeline on the fleet page: {browser.js(CHART_BOXES_JS, '.spark svg')}"
        ) from None
    assert browser.js("return window.notReloaded === true"), "the page was reloaded"
    return charts


async def test_the_dashboard_follows_jobs_draws_curves_and_cancels(
    db: Database,
    database_url: str,
    nats: EmbeddedNats,
    sim_fleet,
    browser: Browser,
    monkeypatch: pytest.MonkeyPatch,
    tmp_path: Path,
) -> None:
    from scheduler.up import run_daemons
    from scheduler.web.server import serve_web

    # Given the daemons and the dashboard on real services, and a fleet of two SSH VMs
    monkeypatch.setenv("RLFLEET_POLL_INTERVAL", "0.5")
    fleet = await sim_fleet(2, gpus_per_vm=2)
    # The VMs' python runs `accelerate launch` of a multi-node job as the plain script.
    await fleet.register(db, entrypoint=str(FAKE_TRAIN), python=write_fake_python(tmp_path))
    settings = Settings.load(database_url, nats.url)
    stop, ready, web_ready = asyncio.Event(), asyncio.Event(), asyncio.Event()
    port = free_port()
    tasks = [
        asyncio.create_task(run_daemons(settings, stop, ready)),
        asyncio.create_task(
            serve_web(
                settings, host="127.0.0.1", port=port, token=TOKEN, stop=stop, ready=web_ready
            )
        ),
    ]
    env = {**os.environ, "RLFLEET_DATABASE_URL": database_url, "RLFLEET_NATS_URL": nats.url}
    base = f"http://127.0.0.1:{port}"
    try:
        await asyncio.wait_for(asyncio.gather(ready.wait(), web_ready.wait()), 60)
        # When a job of three steps, whose log holds HTML, is submitted with the CLI
        job = await cli(
            env,
            *submit_args(
                "curve",
                train=("--fake_seconds", "6", "--max_steps", "3", "--note", "<b>not bold</b>"),
            ),
        )
        # Then the queue page, opened once, shows it running, then completed
        usable = await browser.get(f"{base}/queue")
        print(f"\nweb: queue page usable in the browser after {usable * 1000:.0f} ms")
        browser.js("window.notReloaded = true")
        row = f'#section-{{}} tr[data-job="{job}"]'

        def shown_in(section: str) -> Callable[[], Any]:
            return lambda: browser.js(
                "return document.querySelector(arguments[0]) !== null", row.format(section)
            )

        await browser.until(shown_in("running"))
        await browser.until(shown_in("finished"))
        assert (
            browser.js(f"return document.querySelector('{row.format('finished')}').dataset.status")
            == "completed"
        )
        assert browser.js("return window.notReloaded === true"), "the page was reloaded"

        # And its page draws one point per step, and its log as text
        usable = await browser.get(f"{base}/jobs/{job}")
        print(f"web: job page usable in the browser after {usable * 1000:.0f} ms")
        points = "return document.querySelectorAll('#chart-reward circle.pt').length"
        await browser.until(lambda: browser.js(points) == 3, 20)
        # And its axes name the first and the last step, each label whole inside its chart
        for chart in await browser.call(browser.js, CHART_BOXES_JS, ".chart svg"):
            assert [t for t in chart["ticks"] if t.startswith("step")] == ["step 1", "step 3"]
            assert chart["ticksInside"], chart
            assert [line["inside"] for line in chart["lines"]] == [True], chart
        # And its one node is a row of a table: rank 0 on its VM's GPU, exited 0
        await browser.until(lambda: browser.js(NODES_JS) != [], 20)
        [node] = browser.js(NODES_JS)
        assert node[0] == "0" and node[1] in ("vm0", "vm1") and node[5:7] == ["exited", "0"]
        await browser.until(
            lambda: "step 3/3" in browser.js("return document.getElementById('log').textContent"),
            20,
        )
        assert "<b>not bold</b>" in browser.js("return document.getElementById('log').textContent")
        assert browser.js("return document.querySelectorAll('#log *').length") == 0

        # When a long job, named like a script, is cancelled from its page with the token
        other = await cli(env, *submit_args(XSS, train=("--fake_seconds", "120")))
        await browser.get(f"{base}/jobs/{other}")
        status = "return document.getElementById('job-status').textContent"
        await browser.until(lambda: browser.js(status) == "running", 60)
        assert browser.js("return document.getElementById('job-name').textContent") == XSS
        browser.js(
            "const t = document.getElementById('token'); t.value = arguments[0];"
            "t.dispatchEvent(new Event('change'));",
            TOKEN,
        )
        await browser.call(browser.driver.find_element("id", "cancel").click)
        # Then it is cancelled, without a reload
        await browser.until(lambda: browser.js(status) == "cancelled", 30)
        shown = await cli(env, "job", "show", other, "--json", "--no-progress")
        assert '"status": "cancelled"' in shown and '"actor": "web"' in shown

        # When a job runs on two nodes
        pair = await cli(
            env, *submit_args("two-nodes", "--nodes", "2", train=("--fake_seconds", "30"))
        )
        await browser.get(f"{base}/jobs/{pair}")
        # Then its page lists each node as a row: its rank, VM, GPU, pid and state
        await browser.until(
            lambda: len(browser.js(NODES_JS)) == 2 and browser.js(status) == "running", 60
        )
        nodes = browser.js(NODES_JS)
        assert [(n[0], n[5]) for n in nodes] == [("0", "running"), ("1", "running")], nodes
        assert sorted(n[1] for n in nodes) == ["vm0", "vm1"] and all(n[3].isdigit() for n in nodes)
        assert browser.js("return document.querySelector('[data-key=ranks]')") is None
        # And the queue says it holds one GPU on each of two VMs
        await browser.get(f"{base}/queue")
        row_of_pair = f"#section-running tr[data-job='{pair}']"
        gpus_vm = "return [...document.querySelectorAll(arguments[0])].map((td) => td.textContent)"
        cells = f"{row_of_pair} td.gpus, {row_of_pair} td.vm"
        await browser.until(lambda: browser.js(gpus_vm, cells) != [], 20)
        assert browser.js(gpus_vm, cells) == ["1 × 2", f"{nodes[0][1]} +1"]

        # And the fleet page shows both VMs and their four GPUs, each VM's utilisation and
        # memory drawn as lines over the polls so far
        usable = await browser.get(f"{base}/fleet")
        print(f"web: fleet page usable in the browser after {usable * 1000:.0f} ms")
        assert browser.js("return document.querySelectorAll('td.gpus .gpu').length") == 4
        assert browser.js("return document.querySelectorAll('.spark svg').length") == 2
        await fleet_lines_drawn(browser, f"{base}/fleet", vms=2)
        # And the header says the timelines begin with the first poll, not 3 hours ago
        span = browser.js("return document.getElementById('timeline-span').textContent")
        assert re.fullmatch(r"since \d\d:\d\d:\d\d", span), span
        await cli(env, "job", "cancel", pair)

        if os.environ.get(SCREENSHOTS_ENV):
            await screenshot_scene(browser, env, base)
    finally:
        stop.set()
        await asyncio.wait_for(asyncio.gather(*tasks, return_exceptions=True), 30)


async def screenshot_scene(browser: Browser, env: dict[str, str], base: str) -> None:
    """The screenshots the README shows, of what a user keeps the page open for: a job
    learning over several steps, one on two nodes, one waiting with its reason, finished
    ones of each kind, and the fleet's GPUs allocated and free with their timelines."""
    status = "return document.getElementById('job-status').textContent"

    async def wait_status(job: str, want: str) -> None:
        await browser.get(f"{base}/jobs/{job}")
        await browser.until(lambda: browser.js(status) == want, 90)

    failed = await cli(
        env, *submit_args("grpo-bad-reward", "--max-retries", "0", train=("--fake_exit", "2"))
    )
    await wait_status(failed, "failed")
    # One GPU of each VM for a job on two nodes, one more for a job that learns; then no
    # VM has two free GPUs, so a job asking for two waits, and says why.
    wide = await cli(
        env, *submit_args("grpo-2x1-ppo", "--nodes", "2", train=("--fake_seconds", "300"))
    )
    await wait_status(wide, "running")
    learning = await cli(
        env, *submit_args("grpo-qwen-gsm8k", train=("--fake_seconds", "50", "--max_steps", "5"))
    )
    await wait_status(learning, "running")
    await cli(env, *submit_args("grpo-math-2gpu", "--gpus", "2", train=("--fake_seconds", "60")))
    points = "return document.querySelectorAll('#chart-reward circle.pt').length"
    await browser.until(lambda: browser.js(points) >= 2, 90)

    await browser.get(f"{base}/queue")
    reason = "return document.querySelector('#section-pending .reason')?.textContent"
    await browser.until(lambda: browser.js(reason), 30)
    await browser.screenshot("queue.png")
    await fleet_lines_drawn(browser, f"{base}/fleet", vms=2)
    await browser.screenshot("fleet.png")
    await browser.get(f"{base}/jobs/{learning}")
    await browser.until(lambda: browser.js(points) >= 4, 90)
    await browser.screenshot("job.png")


FLEET_ROWS_JS = """
return [...document.querySelectorAll('table.fleet tbody tr')]
  .filter((tr) => tr.querySelector('td.gpus'))
  .map((tr) => [tr.cells[0].textContent.trim(),
                [...tr.querySelectorAll('td.gpus .gpu')].map((g) => g.className.split(' ')[1])]);
"""
REFRESHED_JS = """
const out = document.getElementById('refreshed');
return {state: out.dataset.state, text: out.textContent, tries: Number(out.dataset.tries || 0),
        stale: document.body.dataset.stale === '1'};
"""


class WebServer:
    """The dashboard served on one port, which can be stopped and started again there (with
    other settings: a database that is not there)."""

    def __init__(self, port: int) -> None:
        self.port = port
        self.stop = asyncio.Event()
        self.task: asyncio.Task[None] | None = None

    async def start(self, settings: Settings) -> None:
        from scheduler.web.server import serve_web

        self.stop, ready = asyncio.Event(), asyncio.Event()
        self.task = asyncio.create_task(
            serve_web(
                settings,
                host="127.0.0.1",
                port=self.port,
                token=TOKEN,
                stop=self.stop,
                ready=ready,
            )
        )
        await asyncio.wait_for(ready.wait(), 30)

    async def halt(self) -> None:
        self.stop.set()
        if self.task is not None:
            await asyncio.wait_for(self.task, 30)
            self.task = None


async def test_the_fleet_page_refreshes_in_place_and_shows_a_failed_refresh(
    db: Database,
    database_url: str,
    postgres: EmbeddedPostgres,
    sim_fleet,
    transport: Transport,
    browser: Browser,
) -> None:
    from scheduler.fleet import add_vm
    from scheduler.gpu_poller import GpuPoller

    # Given one VM of two free GPUs, polled all along as the poller daemon does, and the
    # dashboard
    fleet = await sim_fleet(1, gpus_per_vm=2)
    await fleet.register(db)
    poller = GpuPoller(db, transport)
    await poller.sweep()

    async def keep_polling() -> None:
        while True:
            await poller.sweep()
            await asyncio.sleep(0.5)

    settings = Settings.load(database_url, "nats://127.0.0.1:4222")
    server = WebServer(free_port())
    await server.start(settings)
    polling = asyncio.create_task(keep_polling())
    base = f"http://127.0.0.1:{server.port}"

    def rows() -> Any:
        return browser.js(FLEET_ROWS_JS)

    def refreshed() -> dict[str, Any]:
        return browser.js(REFRESHED_JS)  # type: ignore[no-any-return]

    def counts() -> str:
        text = browser.js("return document.getElementById('counts').textContent")
        return " ".join(text.split())

    async def until_rows(want: list[Any]) -> None:
        try:
            await browser.until(lambda: rows() == want, 60)
        except AssertionError:
            raise AssertionError(f"the page shows {rows()}, {refreshed()}") from None

    try:
        # When the fleet page, filtered on "vm", is open
        await browser.get(f"{base}/fleet?name=vm")
        browser.js("window.notReloaded = true")
        assert rows() == [["vm0", ["free", "free"]]]
        assert counts() == "1 VMs · GPUs: free 2 allocated 0 drained 0 foreign 0 unhealthy 0"
        # And meanwhile two VMs join (one that the filter leaves out) and a process rlfleet
        # did not start takes a GPU of vm0
        for name in ("vm1", "other0"):
            vm = await fleet.add_vm(name, gpus=1)
            async with db.transaction() as session:
                await add_vm(session, vm.spec())
        foreign = fleet[0].add_foreign_process(1)
        # Then the page shows it in place, its filter kept, with the whole fleet's counts
        want = [["vm0", ["free", "foreign"]], ["vm1", ["free"]]]
        await until_rows(want)
        assert counts() == "2 VMs · GPUs: free 3 allocated 0 drained 0 foreign 1 unhealthy 0"
        assert browser.js("return document.querySelectorAll('.spark svg').length") == 2
        # And says when its data arrived
        state = refreshed()
        assert state["state"] == "ok" and not state["stale"], state
        assert re.fullmatch(r"updated \d\d:\d\d:\d\d", state["text"]), state
        assert browser.js("return window.notReloaded === true"), "the page was reloaded"

        # When the tab is hidden behind another one
        browser.js("window.open(arguments[0], 'other')", f"{base}/queue")
        first = browser.driver.current_window_handle
        other = next(h for h in browser.driver.window_handles if h != first)
        await browser.call(browser.driver.switch_to.window, other)
        opener = "return window.opener.document.visibilityState"
        await browser.until(lambda: browser.js(opener) == "hidden", 20)
        tries_js = "return Number(window.opener.document.getElementById('refreshed').dataset.tries)"
        hidden_tries = browser.js(tries_js)
        # Then it asks the server nothing for more than two periods
        await asyncio.sleep(12)
        assert browser.js(tries_js) == hidden_tries
        await browser.call(browser.driver.close)
        await browser.call(browser.driver.switch_to.window, first)
        # And refreshes again once shown
        await browser.until(lambda: refreshed()["tries"] > hidden_tries, 30)

        # When the server stops
        await server.halt()
        # Then the page says its refresh failed and why, and keeps what it showed, dimmed
        await browser.until(lambda: refreshed()["state"] == "failed", 60)
        state = refreshed()
        assert "the server cannot be reached" in state["text"] and state["stale"], state
        assert rows() == want

        # When it comes back without its database
        down = Settings.load(
            database_url.replace(f":{postgres.port}/", f":{free_port()}/"), settings.nats_url
        )
        await server.start(down)
        # Then the page says so too (503), still whole
        await browser.until(lambda: "(HTTP 503)" in refreshed()["text"], 60)
        assert refreshed()["state"] == "failed" and rows() == want

        # When it comes back whole, the GPU freed meanwhile
        await server.halt()
        foreign.stop()
        await server.start(settings)
        # Then the page catches up, and says when it was updated
        await until_rows([["vm0", ["free", "free"]], ["vm1", ["free"]]])
        assert refreshed()["state"] == "ok" and not refreshed()["stale"]
        assert browser.js("return window.notReloaded === true"), "the page was reloaded"

        # When vm1's GPU requires a reset, the page shows it unhealthy, with the reason
        fleet.by_name("vm1").set_gpu_health(0, fault="[GPU requires reset]")
        await until_rows([["vm0", ["free", "free"]], ["vm1", ["unhealthy"]]])
        reason = browser.js("return document.querySelector('td.gpus .gpu.unhealthy').textContent")
        assert "requires reset: nvidia-smi prints [GPU requires reset]" in reason
        assert counts() == "2 VMs · GPUs: free 3 allocated 0 drained 0 foreign 0 unhealthy 1"
    finally:
        polling.cancel()
        await asyncio.gather(polling, return_exceptions=True)
        await server.halt()


async def test_a_jobs_page_shows_its_newest_events_counts_repeats_and_shows_more(
    db: Database, database_url: str, browser: Browser
) -> None:
    from scheduler.web.server import serve_web
    from tests.integration.test_transitions import wait_round
    from tests.workloads.support import new_job

    # Given a job that waited for 130 different reasons, woken 130 times (132 events)
    job_id = await new_job(db)
    for i in range(130):
        await wait_round(db, job_id, reason=f"reason {i:03d}")
    settings = Settings.load(database_url, "nats://127.0.0.1:4222")
    stop, ready, port = asyncio.Event(), asyncio.Event(), free_port()
    serving = asyncio.create_task(
        serve_web(settings, host="127.0.0.1", port=port, token=TOKEN, stop=stop, ready=ready)
    )
    rows = "return [...document.querySelectorAll('#events tr')].map((r) => r.textContent)"
    more = "return document.getElementById('older-events')"
    try:
        await asyncio.wait_for(ready.wait(), 30)
        # When its page is opened, then it lists the newest 100 and offers the 32 older
        await browser.get(f"http://127.0.0.1:{port}/jobs/{job_id}")
        await browser.until(lambda: len(browser.js(rows)) == 100, 20)
        assert "reason 129" in browser.js(rows)[-1]
        assert browser.js(more + ".textContent") == "32 older events: show more"
        # When the user asks for more, then all 132 are listed, oldest first, and the
        # wake-up shows how often it happened
        await browser.call(browser.driver.find_element("id", "older-events").click)
        await browser.until(lambda: len(browser.js(rows)) == 132, 20)
        listed = browser.js(rows)
        assert "submitted" in listed[0]
        assert re.search(r"looking again \(×130, last at ", listed[2]), listed[2]
        assert browser.js(more + ".hidden") is True
    finally:
        stop.set()
        await asyncio.wait_for(serving, 30)


async def test_a_jobs_page_shows_its_store_checkpoints_and_last_upload_error(
    db: Database, database_url: str, browser: Browser
) -> None:
    from sqlalchemy import update

    from scheduler.models import Job
    from scheduler.web.server import serve_web
    from tests.workloads.support import new_job

    # Given a job whose store agent reported two checkpoints and a failed upload
    job_id = await new_job(db, store="s3://bucket/runs")
    status = {
        "checkpoints": [
            {"step": 2, "bytes": 1_500_000, "at": "2026-11-25T18:00:00Z"},
            {"step": 4, "bytes": 1_500_000, "at": "2026-11-25T18:00:09Z"},
        ],
        "restored": 2,
        "final": False,
        "last_error": "checkpoint-6: <b>refused</b> by the store (AccessDenied)",
        "error_at": "2026-11-25T18:00:19Z",
    }
    async with db.transaction() as session:
        await session.execute(update(Job).where(Job.id == job_id).values(store_status=status))
    settings = Settings.load(database_url, "nats://127.0.0.1:4222")
    stop, ready, port = asyncio.Event(), asyncio.Event(), free_port()
    serving = asyncio.create_task(
        serve_web(settings, host="127.0.0.1", port=port, token=TOKEN, stop=stop, ready=ready)
    )
    rows = (
        "return [...document.querySelectorAll('#store-checkpoints tr')].map((r) => r.textContent)"
    )
    try:
        await asyncio.wait_for(ready.wait(), 30)
        # When its page is opened, then the store section lists the newest step first
        await browser.get(f"http://127.0.0.1:{port}/jobs/{job_id}")
        await browser.until(lambda: len(browser.js(rows)) == 2, 20)
        listed = browser.js(rows)
        assert listed[0].startswith("41.5 MB") and listed[1].startswith("21.5 MB"), listed
        assert browser.js("return document.getElementById('store-section').hidden") is False
        assert browser.js("return document.getElementById('store-url').textContent") == (
            "s3://bucket/runs"
        )
        # And the last upload error is shown as text, never as markup
        error = browser.js("return document.getElementById('store-error').textContent")
        assert "<b>refused</b> by the store (AccessDenied)" in error
        assert browser.js("return document.querySelectorAll('#store-error b').length") == 0
    finally:
        stop.set()
        await asyncio.wait_for(serving, 30)
