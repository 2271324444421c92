"""Programs a few tests need from the machine (OpenSSH's sshd, systemd-analyze).

Where one is missing its tests are skipped on a developer's machine, but fail under CI:
there a skipped test would hide that the checks against the real programs never ran.
"""

from __future__ import annotations

import os
import shutil

import pytest


def in_ci() -> bool:
    """True where a CI system runs the tests: GitHub Actions, GitLab CI and others set CI=true."""
    return os.environ.get("CI", "").strip().lower() in ("true", "1", "yes")


def find_program(name: str, *elsewhere: str) -> str | None:
    """The program's path on PATH, else the first of `elsewhere` that exists (sbin dirs are
    often not on a user's PATH), else None."""
    return shutil.which(name) or next((p for p in elsewhere if os.access(p, os.X_OK)), None)


def require_program(path: str | None, name: str, package: str) -> str:
    """`path` when the program is installed; otherwise skip the calling test, or fail it
    under CI."""
    if path is not None:
        return path
    message = f"{name} is not installed (apt-get install {package}, as `make test` does)"
    if in_ci():
        pytest.fail(f"{message}; under CI=true its tests fail instead of skipping", pytrace=False)
    pytest.skip(message)


CHROMIUM_PATHS = ("/usr/bin/chromium", "/usr/bin/chromium-browser")
CHROMEDRIVER_PATHS = ("/usr/bin/chromedriver", "/usr/lib/chromium/chromedriver")


def require_browser() -> tuple[str, str]:
    """Debian's headless browser for the dashboard's tests: (chromium, chromedriver);
    skipped where missing, failed under CI."""
    chromium = require_program(find_program("chromium", *CHROMIUM_PATHS), "chromium", "chromium")
    driver = require_program(
        find_program("chromedriver", *CHROMEDRIVER_PATHS), "chromedriver", "chromium-driver"
    )
    return chromium, driver
