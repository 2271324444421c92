"""The models of what the poller samples and captures, kept apart from `scheduler.models`
(which imports and re-exports them, so that `from scheduler.models import GpuSample`
works and every table is in `Base.metadata` once `scheduler.models` is loaded): the
progress and GPU timelines of the dashboard (`scheduler.history`) and a stopped attempt's
diagnostics (`scheduler.hang`)."""

from __future__ import annotations

from datetime import datetime

from sqlalchemy import (
    BigInteger,
    Double,
    ForeignKey,
    Identity,
    Index,
    Integer,
    SmallInteger,
    Text,
    UniqueConstraint,
    func,
)
from sqlalchemy.orm import Mapped, mapped_column

from scheduler.model_base import Base, timestamp


class ProgressSample(Base):
    """One training step of one attempt as the poller read it from progress.json: the
    reward and loss curves of the job page. Kept for the history retention
    (`scheduler.history`), then pruned."""

    __tablename__ = "progress_samples"

    id: Mapped[int] = mapped_column(BigInteger, Identity(), primary_key=True)
    job_id: Mapped[int] = mapped_column(ForeignKey("jobs.id", ondelete="CASCADE"))
    attempt: Mapped[int] = mapped_column(Integer)
    step: Mapped[int] = mapped_column(Integer)
    reward: Mapped[float | None] = mapped_column(Double)
    """NULL: the attempt had logged no reward yet."""
    loss: Mapped[float | None] = mapped_column(Double)
    """NULL: the attempt had logged no loss yet."""
    recorded_at: Mapped[datetime] = mapped_column(timestamp(), server_default=func.now())

    __table_args__ = (
        # One row per step of an attempt (a later poll of the same step adds nothing); it
        # is also the index the job page reads the curve by.
        UniqueConstraint("job_id", "attempt", "step"),
        Index("ix_progress_samples_recorded_at", "recorded_at"),
    )


class GpuSample(Base):
    """One poll's reading of one GPU: the utilisation and memory timelines of the fleet
    page. Kept for the history retention, then pruned."""

    __tablename__ = "gpu_samples"

    id: Mapped[int] = mapped_column(BigInteger, Identity(), primary_key=True)
    gpu_id: Mapped[int] = mapped_column(ForeignKey("gpus.id", ondelete="CASCADE"))
    utilization_pct: Mapped[int | None] = mapped_column(SmallInteger)
    """NULL when nvidia-smi could not say."""
    memory_used_mb: Mapped[int | None] = mapped_column(Integer)
    memory_total_mb: Mapped[int | None] = mapped_column(Integer)
    recorded_at: Mapped[datetime] = mapped_column(timestamp(), server_default=func.now())

    __table_args__ = (
        # The fleet page reads the last hours of a page of GPUs; pruning reads by time.
        Index("ix_gpu_samples_gpu_id_recorded_at", "gpu_id", "recorded_at"),
        Index("ix_gpu_samples_recorded_at", "recorded_at"),
    )


class JobDiagnostics(Base):
    """What the poller captured of an attempt before stopping it as hung or stuck starting
    (`scheduler.hang`): each process's Python stacks (`py-spy dump`), the VM's nvidia-smi
    view and the end of train.log. The full text stays in the attempt directory on the VM
    (`diagnostics.txt`); this copy, bounded like it, is what `job logs --diagnostics` and
    the job page show, whether or not the VM still answers."""

    __tablename__ = "job_diagnostics"

    id: Mapped[int] = mapped_column(BigInteger, Identity(), primary_key=True)
    job_id: Mapped[int] = mapped_column(ForeignKey("jobs.id", ondelete="CASCADE"))
    attempt: Mapped[int] = mapped_column(Integer)
    vm_name: Mapped[str | None] = mapped_column(Text)
    """The VM the attempt ran on, by name (the row outlives a removed VM)."""
    reason: Mapped[str] = mapped_column(Text)
    """Why the attempt was stopped (the job's status reason then)."""
    content: Mapped[str] = mapped_column(Text)
    captured_at: Mapped[datetime] = mapped_column(timestamp(), server_default=func.now())

    __table_args__ = (UniqueConstraint("job_id", "attempt"),)
