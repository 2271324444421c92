"""The dashboard in a real headless Chromium (Debian's `chromium` and `chromium-driver`,
driven by Selenium), against real Postgres, NATS, the three daemons and the SSH test
fleet; jobs are submitted with the real CLI.

`RLFLEET_WEB_SCREENSHOTS=docs/img pytest tests/acceptance/test_web_browser.py` also saves
the screenshots the README shows (queue.png, job.png, fleet.png).
"""

from __future__ import annotations

import asyncio
import os
import sys
import tempfile
import time
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import pytest

from scheduler.db import Database
from scheduler.embedded import EmbeddedNats, free_port
from scheduler.settings import Settings
from tests.requires import require_browser

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


async def test_the_dashboard_follows_jobs_draws_curves_and_cancels(
    db: Database,
    database_url: str,
    nats: EmbeddedNats,
    sim_fleet,
    browser: Browser,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from scheduler.up import run_daemons
    from scheduler.web.server import serve_web

    # Given the daemons and the dashboard on real services, and a fleet of two SSH VMs
    monkeypatch.setenv("RLFLEET_POLL_INTERVAL", "0.5")
    fleet = await sim_fleet(2, gpus_per_vm=2)
    await fleet.register(db)
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
            "job",
            "submit",
            "--model",
            "m",
            "--dataset",
            "d",
            "--reward-function",
            "format",
            "--name",
            "curve",
            "--",
            "--fake_seconds",
            "6",
            "--max_steps",
            "3",
            "--note",
            "<b>not bold</b>",
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
        await browser.screenshot("queue.png")
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
        await browser.until(
            lambda: "step 3/3" in browser.js("return document.getElementById('log').textContent"),
            20,
        )
        assert "<b>not bold</b>" in browser.js("return document.getElementById('log').textContent")
        assert browser.js("return document.querySelectorAll('#log *').length") == 0
        await browser.screenshot("job.png")

        # When a long job, named like a script, is cancelled from its page with the token
        other = await cli(
            env,
            "job",
            "submit",
            "--model",
            "m",
            "--dataset",
            "d",
            "--reward-function",
            "format",
            "--name",
            XSS,
            "--",
            "--fake_seconds",
            "120",
        )
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

        # And the fleet page shows both VMs and their four GPUs
        usable = await browser.get(f"{base}/fleet")
        print(f"web: fleet page usable in the browser after {usable * 1000:.0f} ms")
        assert browser.js("return document.querySelectorAll('td.gpus .gpu').length") == 4
        assert browser.js("return document.querySelectorAll('.spark svg').length") == 2
        await browser.screenshot("fleet.png")
    finally:
        stop.set()
        await asyncio.wait_for(asyncio.gather(*tasks, return_exceptions=True), 30)
