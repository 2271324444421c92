"""What each attempt of a job reported of its store (`scheduler.store.binding`): the
digest of each checkpoint manifest and final marker its store agent wrote, recorded by
the poller in Postgres (a job cannot write there) and read back by the launch (what the
next attempt's agent may restore or take as the job's end) and by `job pull`
(docs/invariants.md, invariant 12).

Per job the newest `ACCEPTED_CHECKPOINTS` checkpoint records (by step) and
`ACCEPTED_FINALS` final ones are kept: a job that reports more (its own status file is
its to write) only pushes out its own older ones.
"""

from __future__ import annotations

from collections.abc import Sequence
from datetime import datetime
from typing import TYPE_CHECKING, Any

from sqlalchemy import (
    BigInteger,
    CheckConstraint,
    ForeignKey,
    Identity,
    Integer,
    String,
    UniqueConstraint,
    func,
    select,
    text,
)
from sqlalchemy.ext.asyncio import AsyncSession
from sqlalchemy.orm import Mapped, mapped_column

from scheduler.model_base import Base, timestamp
from scheduler.store.binding import (
    ACCEPTED_CHECKPOINTS,
    ACCEPTED_FINALS,
    FINAL_STEP,
    MAX_STEP,
    Accepted,
)

if TYPE_CHECKING:
    from scheduler.db import Database
    from scheduler.gpu_poller.state import Outcome

Report = tuple[int, int, str, int, str]
"""(job id, attempt, kind, step, digest)"""


class JobStoreRecord(Base):
    """One manifest an attempt's store agent reported writing: a checkpoint's (`step`) or
    the final marker (`kind` final, step 0), by the sha256 of its bytes."""

    __tablename__ = "job_store_records"

    id: Mapped[int] = mapped_column(BigInteger, Identity(), primary_key=True)
    job_id: Mapped[int] = mapped_column(ForeignKey("jobs.id", ondelete="CASCADE"))
    attempt: Mapped[int] = mapped_column(Integer)
    """The attempt that first reported it."""
    kind: Mapped[str] = mapped_column(String(16))
    step: Mapped[int] = mapped_column(Integer)
    digest: Mapped[str] = mapped_column(String(64))
    recorded_at: Mapped[datetime] = mapped_column(timestamp(), server_default=func.now())

    __table_args__ = (
        CheckConstraint("kind IN ('checkpoint', 'final')", name="kind"),
        CheckConstraint(
            f"step >= 0 AND step <= {MAX_STEP} AND (kind = 'checkpoint' OR step = {FINAL_STEP})",
            name="step_range",
        ),
        CheckConstraint("digest ~ '^[0-9a-f]{64}$'", name="digest_hex"),
        # A later poll of the same report adds nothing; also the index reads go by.
        UniqueConstraint("job_id", "kind", "step", "digest"),
    )


# Only the job's current attempt reports (a row of an older attempt's poll is not taken).
_RECORD_SQL = text(
    """
INSERT INTO job_store_records (job_id, attempt, kind, step, digest)
SELECT t.id, t.attempt, t.kind, t.step, t.digest
FROM unnest(CAST(:ids AS bigint[]), CAST(:attempts AS int[]), CAST(:kinds AS text[]),
            CAST(:steps AS int[]), CAST(:digests AS text[]))
    AS t(id, attempt, kind, step, digest)
JOIN jobs ON jobs.id = t.id AND jobs.attempt = t.attempt
ON CONFLICT (job_id, kind, step, digest) DO NOTHING
"""
)

_TRIM_SQL = text(
    f"""
DELETE FROM job_store_records r USING (
    SELECT id, kind, row_number() OVER (PARTITION BY job_id, kind ORDER BY step DESC, id DESC)
        AS n
    FROM job_store_records WHERE job_id = ANY(CAST(:ids AS bigint[]))
) o
WHERE r.id = o.id
  AND o.n > CASE WHEN o.kind = 'final' THEN {ACCEPTED_FINALS} ELSE {ACCEPTED_CHECKPOINTS} END
"""
)


def reports(outcomes: Sequence[Outcome]) -> list[Report]:
    """What these polls read of the store agents of the attempts their VMs run (a line
    for any other attempt is not this sweep's to record)."""
    rows: list[Report] = []
    for outcome in outcomes:
        if outcome.result is None:
            continue
        for job in outcome.vm.jobs:
            state = outcome.result.jobs.get((job.id, job.attempt_number))
            if state is not None:
                rows += [(job.id, job.attempt_number, *r) for r in state.store_digests]
    return rows


async def record(session: AsyncSession, rows: Sequence[Report]) -> int:
    """Record reports (job id, attempt, kind, step, digest), already checked
    (`binding.reported`); how many were new."""
    if not rows:
        return 0
    columns: dict[str, list[Any]] = {"ids": [], "attempts": [], "kinds": [], "steps": [],
                                     "digests": []}  # fmt: skip
    for job_id, attempt, kind, step, digest in rows:
        for name, value in zip(columns, (job_id, attempt, kind, step, digest), strict=True):
            columns[name].append(value)
    result = await session.execute(_RECORD_SQL, columns)
    added = int(getattr(result, "rowcount", 0) or 0)
    if added:
        await session.execute(_TRIM_SQL, {"ids": sorted(set(columns["ids"]))})
    return added


async def record_reports(db: Database, outcomes: Sequence[Outcome]) -> int:
    """`record` what these polls read, in a short transaction of its own (no SSH or NATS
    call inside); before the attempts that ended are finished, so that an attempt's last
    report (its final marker) is in by the time its job completes."""
    rows = reports(outcomes)
    if not rows:
        return 0
    async with db.transaction() as session:
        return await record(session, rows)


async def accepted(session: AsyncSession, job_id: int) -> Accepted:
    """What the job's attempts reported, as the store agent and `job pull` take it."""
    rows = await session.execute(
        select(JobStoreRecord.kind, JobStoreRecord.step, JobStoreRecord.digest).where(
            JobStoreRecord.job_id == job_id
        )
    )
    return Accepted.of((str(k), int(s), str(d)) for k, s, d in rows.all())
