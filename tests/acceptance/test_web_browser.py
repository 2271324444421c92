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
from scheduler.embedded import EmbeddedNats, free_port
from scheduler.settings import Settings
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
    """Open the fleet page until every VM's timeline is a line of several points spread
    over a good part of its chart, inside it (the page is a snapshot: reload to see more
    polls); the charts' boxes."""
    deadline = time.monotonic() + timeout
    while True:
        await browser.get(url)
        charts = await browser.call(browser.js, CHART_BOXES_JS, ".spark svg")

        def drawn(chart: dict[str, Any]) -> bool:
            return any(
                line["points"] >= 5 and line["width"] >= chart["width"] / 5 and line["inside"]
                for line in chart["lines"]
            )

        if len(charts) == vms and all(drawn(c) for c in charts):
            return charts
        assert time.monotonic() < deadline, f"no visible timeline on the fleet page: {charts}"
        await asyncio.sleep(2)


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
