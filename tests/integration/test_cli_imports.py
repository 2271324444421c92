"""`job list` and `job submit` against real Postgres and NATS load neither SQLAlchemy nor
SSH nor an engine: they run `scheduler.jobstore`'s statements on a plain psycopg
connection, which is what lets them start in a fraction of a second (bench/cli.py)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from scheduler.embedded import EmbeddedNats
from tests.unit.test_import_graph import ENGINES, top_level


@pytest.mark.parametrize(
    "argv",
    [
        ["job", "list", "--json"],
        ["job", "list", "--status", "queued"],
        ["job", "submit", "--model", "m", "--dataset", "d", "--reward-function", "format"],
    ],
)
def test_job_list_and_submit_load_no_sqlalchemy(
    argv: list[str], database_url: str, nats: EmbeddedNats
) -> None:
    """Given real Postgres and NATS, `job list` and `job submit` run to success (a job is
    submitted, announced and listed) without loading SQLAlchemy, SSH, structlog or an
    engine: they
    run the statements of `scheduler.jobstore` on a plain psycopg connection, which is
    what lets them start in a fraction of a second."""
    env = {**os.environ, "RLFLEET_DATABASE_URL": database_url, "RLFLEET_NATS_URL": nats.url}
    probe = (
        "import json, sys\n"
        "from scheduler.cli import main\n"
        "try:\n"
        f"    main({argv!r})\n"
        "except SystemExit as exc:\n"
        "    code = exc.code\n"
        "print(json.dumps({'code': code, 'modules': sorted(sys.modules)}))"
    )
    done = subprocess.run(
        [sys.executable, "-c", probe], env=env, capture_output=True, text=True, timeout=120
    )
    result = json.loads(done.stdout.splitlines()[-1])
    assert result["code"] == 0, done.stderr
    loaded = set(result["modules"])
    assert "scheduler.cli.job" in loaded and "psycopg" in loaded
    heavy = {"sqlalchemy", "asyncssh", "prometheus_client", "alembic", "structlog"}
    assert not top_level(loaded) & heavy
    assert not loaded & {*ENGINES, "scheduler.models", "scheduler.db", "scheduler.jobs"}
    if "submit" in argv:
        assert "nats" in top_level(loaded)
        assert done.stdout.splitlines()[0].strip().isdigit()  # the new job's id
