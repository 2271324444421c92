"""SQLAlchemy 2 models: the fleet (VMs and their GPUs), jobs and every job's history.

Postgres is the source of truth. Columns say in their docstring what NULL means.
"""

from __future__ import annotations

import uuid
from datetime import datetime

from sqlalchemy import (
    BigInteger,
    Boolean,
    CheckConstraint,
    Double,
    ForeignKey,
    Identity,
    Index,
    Integer,
    LargeBinary,
    String,
    Text,
    UniqueConstraint,
    Uuid,
    func,
    text,
)
from sqlalchemy.dialects.postgresql import ARRAY, JSONB
from sqlalchemy.orm import Mapped, mapped_column, relationship

from scheduler.model_base import Base, timestamp
from scheduler.model_samples import GpuSample as GpuSample  # re-exported, in Base.metadata
from scheduler.model_samples import JobDiagnostics as JobDiagnostics
from scheduler.model_samples import ProgressSample as ProgressSample
from scheduler.states import JobStatus, RetryDecision
from scheduler.validate import (
    DEFAULT_HANG_TIMEOUT_S,
    DEFAULT_STARTUP_TIMEOUT_S,
    JOB_NAME_MAX,
    MAX_JOB_GPUS,
    MAX_NODES,
    MAX_RETRIES,
    MAX_TIMEOUT_S,
)

# The limits (MAX_GPUS…, JOB_NAME_MAX) are `scheduler.validate`'s, where the command line
# checks values without loading SQLAlchemy; the columns and constraints are sized from them.
_JOB_STATUSES = ", ".join(f"'{s.value}'" for s in JobStatus)
_RETRY_DECISIONS = ", ".join(f"'{d.value}'" for d in RetryDecision)

DEFAULT_ENTRYPOINT = "training.train_grpo"
"""What a VM runs to train when it names nothing else: `python -m training.train_grpo`."""


TOKEN_CHECK = "launch_token ~ '^[0-9a-f]{16}$'"
"""What a launch token is (`remote.layout.new_token`): 16 lowercase hex digits."""
ATTEMPT_DIR_CHECK = "attempt_dir LIKE '/%'"
"""A recorded attempt directory is absolute."""


class Installation(Base):
    """This database's identity: one row, created with the schema (docs/invariants.md, invariant 6).

    Every attempt directory on a VM is named after it, so a recreated database or a second
    installation that shares a VM account never finds this one's files, nor this one theirs.
    """

    __tablename__ = "installation"

    id: Mapped[uuid.UUID] = mapped_column(Uuid, primary_key=True)
    singleton: Mapped[bool] = mapped_column(Boolean, default=True, server_default="true")
    """Always true, and unique: the table holds one row."""
    created_at: Mapped[datetime] = mapped_column(timestamp(), server_default=func.now())

    __table_args__ = (
        CheckConstraint("singleton", name="one_row"),
        UniqueConstraint("singleton"),
    )


class Poller(Base):
    """A running poller: the VMs it holds (`VM.poller_id`) are its to poll while its lease
    lasts, `lease_s` seconds from `renewed_at` (`scheduler.gpu_poller.shares`)."""

    __tablename__ = "pollers"

    id: Mapped[int] = mapped_column(Integer, Identity(), primary_key=True)
    name: Mapped[str] = mapped_column(String(255))
    """Host and process id, for people: `host:pid`."""
    lease_s: Mapped[float] = mapped_column(Double)
    started_at: Mapped[datetime] = mapped_column(timestamp(), server_default=func.now())
    renewed_at: Mapped[datetime] = mapped_column(timestamp(), server_default=func.now())
    """Database time of the last renewal; the lease runs out `lease_s` later, and a lease
    that ran out is never renewed (the row is deleted, its VMs freed)."""

    __table_args__ = (CheckConstraint("lease_s > 0 AND lease_s <= 3600", name="lease_range"),)


class VM(Base):
    """A machine reached over SSH (or the local machine) that can run training."""

    __tablename__ = "vms"

    id: Mapped[int] = mapped_column(Integer, Identity(), primary_key=True)
    name: Mapped[str] = mapped_column(String(128), unique=True)
    host: Mapped[str] = mapped_column(String(255))
    port: Mapped[int] = mapped_column(Integer, default=22, server_default="22")
    user: Mapped[str | None] = mapped_column(String(64))
    """SSH login; NULL means the user running the daemon."""
    ssh_key_path: Mapped[str | None] = mapped_column(Text)
    """Private key file; NULL means the SSH agent and default keys."""
    known_hosts: Mapped[str | None] = mapped_column(Text)
    """known_hosts file to verify the host key with; NULL means ~/.ssh/known_hosts."""
    verify_host_key: Mapped[bool] = mapped_column(Boolean, default=True, server_default="true")
    transport: Mapped[str] = mapped_column(String(16), default="ssh", server_default="ssh")
    """`ssh`, or `local` for the machine the daemons run on."""
    python: Mapped[str] = mapped_column(Text, default="python3", server_default="python3")
    """Interpreter of the environment with the `train` extra installed on the VM."""
    entrypoint: Mapped[str] = mapped_column(
        Text, default=DEFAULT_ENTRYPOINT, server_default=DEFAULT_ENTRYPOINT
    )
    """Module run with `python -m`, or a path to a `.py` script, that trains."""
    internal_address: Mapped[str | None] = mapped_column(String(255))
    """Address the other nodes of a multi-node job reach this VM at (training traffic);
    NULL means `host`."""
    status: Mapped[str] = mapped_column(String(16), default="unknown", server_default="unknown")
    """See `VMStatus`: unknown (never polled), healthy, unhealthy, unreachable."""
    draining: Mapped[bool] = mapped_column(Boolean, default=False, server_default="false")
    """A draining VM finishes its jobs but is given no new ones."""
    launch_error: Mapped[str | None] = mapped_column(Text)
    """Why training cannot start on this VM (an attempt exited 126/127: its python or
    entrypoint is missing or not executable); the VM stays `unhealthy` until the poller's
    check of its python and entrypoint passes. NULL: no such trouble."""
    removing: Mapped[bool] = mapped_column(Boolean, default=False, server_default="false")
    """`vm remove --force` failed its jobs: the row goes once their processes are killed."""
    process_tracking: Mapped[str | None] = mapped_column(Text)
    """How the VM tracks an attempt's processes, as its last poll found
    (`remote.cgroup.parse_tracking`): `cgroup v2 (<root>, …)` or `marker (<why>)`; NULL:
    not polled yet."""
    available_gpus: Mapped[int] = mapped_column(Integer, default=0, server_default="0")
    consecutive_failures: Mapped[int] = mapped_column(Integer, default=0, server_default="0")
    last_polled_at: Mapped[datetime | None] = mapped_column(timestamp())
    """NULL: never polled."""
    last_seen_at: Mapped[datetime | None] = mapped_column(timestamp())
    """Last successful poll; NULL: never answered."""
    unreachable_since: Mapped[datetime | None] = mapped_column(timestamp())
    """First failed poll of the current outage; NULL while the VM answers."""
    last_error: Mapped[str | None] = mapped_column(Text)
    created_at: Mapped[datetime] = mapped_column(timestamp(), server_default=func.now())
    poller_id: Mapped[int | None] = mapped_column(Integer, index=True)
    """The poller that holds this VM (polls it, alone) while that `pollers` row lives;
    NULL or an id with no row: free, the next poller with room takes it. No foreign key:
    its checks would lock poller rows from every sweep's writes (deadlocks with renewals)."""
    job_user: Mapped[str | None] = mapped_column(String(32))
    """The Unix account the VM's jobs run as (`scheduler.remote.jobuser`), started through
    sudo by `user`; NULL: they run as `user` itself (docs/security.md)."""

    gpus: Mapped[list[GPU]] = relationship(
        back_populates="vm", cascade="all, delete-orphan", order_by="GPU.index"
    )
    poller: Mapped[Poller | None] = relationship(
        primaryjoin="foreign(VM.poller_id) == Poller.id", lazy="raise", viewonly=True
    )

    __table_args__ = (
        CheckConstraint("port BETWEEN 1 AND 65535", name="port_range"),
        CheckConstraint(
            "job_user IS NULL OR (job_user ~ '^[a-z_][a-z0-9_-]{0,31}$' AND job_user <> 'root')",
            name="job_user_name",
        ),
    )


class GPU(Base):
    """One GPU of a VM as nvidia-smi last reported it, and the job it is allocated to."""

    __tablename__ = "gpus"

    id: Mapped[int] = mapped_column(Integer, Identity(), primary_key=True)
    vm_id: Mapped[int] = mapped_column(ForeignKey("vms.id", ondelete="CASCADE"))
    index: Mapped[int] = mapped_column(Integer)
    """nvidia-smi's index at the last poll: information only, a reboot or a removed card
    can renumber GPUs (docs/invariants.md, invariant 8)."""
    uuid: Mapped[str] = mapped_column(String(96))
    """The GPU's identity: rows are keyed by it, and jobs are launched on it."""
    name: Mapped[str | None] = mapped_column(String(128))
    memory_total_mb: Mapped[int | None] = mapped_column(Integer)
    """NULL when nvidia-smi could not say ([N/A], [Not Supported])."""
    memory_used_mb: Mapped[int | None] = mapped_column(Integer)
    utilization_pct: Mapped[int | None] = mapped_column(Integer)
    healthy: Mapped[bool] = mapped_column(Boolean, default=True, server_default="true")
    """False when nvidia-smi failed on the VM, or the GPU itself is unhealthy
    (`health_reason`): no job is placed on it."""
    health_reason: Mapped[str | None] = mapped_column(Text)
    """Why the GPU itself is unhealthy (`scheduler.gpu_health`: lost, a fault, rising ECC,
    a pending retirement or remapping); NULL: healthy."""
    health_clear_polls: Mapped[int] = mapped_column(Integer, default=0, server_default="0")
    """Polls in a row its condition has been clear while `health_reason` is set; healthy
    again at `gpu_health.CLEAR_POLLS`."""
    ecc_uncorrected: Mapped[int | None] = mapped_column(BigInteger)
    """The uncorrected volatile ECC count it had while healthy (a higher count is rising);
    NULL: never reported."""
    health_changed_at: Mapped[datetime | None] = mapped_column(timestamp())
    """When `health_reason` last changed; NULL: never."""
    drained: Mapped[bool] = mapped_column(Boolean, default=False, server_default="false")
    """Taken out by hand (`vm drain NAME --gpu`): a job on it finishes, no new one starts."""
    foreign_busy: Mapped[bool] = mapped_column(Boolean, default=False, server_default="false")
    """A process not started by rlfleet is using this GPU."""
    job_id: Mapped[int | None] = mapped_column(
        ForeignKey("jobs.id", ondelete="SET NULL"), index=True
    )
    """The job this GPU is allocated to; NULL means unallocated."""
    allocated_at: Mapped[datetime | None] = mapped_column(timestamp())
    updated_at: Mapped[datetime] = mapped_column(timestamp(), server_default=func.now())

    vm: Mapped[VM] = relationship(back_populates="gpus")

    __table_args__ = (UniqueConstraint("vm_id", "uuid"),)


class Workdir(Base):
    """A job's packed workdir (`scheduler.workdir`): a gzip'd tar stored once per content,
    keyed by the sha256 of its bytes, which jobs reference (`jobs.workdir_digest`)."""

    __tablename__ = "workdirs"

    digest: Mapped[str] = mapped_column(String(64), primary_key=True)
    """sha256 of `data`, 64 lowercase hex digits."""
    size: Mapped[int] = mapped_column(BigInteger)
    """Packed bytes (the length of `data`)."""
    files: Mapped[int] = mapped_column(Integer)
    """Regular files in the workdir."""
    data: Mapped[bytes] = mapped_column(LargeBinary)
    created_at: Mapped[datetime] = mapped_column(timestamp(), server_default=func.now())

    __table_args__ = (
        CheckConstraint("digest ~ '^[0-9a-f]{64}$'", name="digest_hex"),
        CheckConstraint("size = octet_length(data) AND files >= 0", name="size_sane"),
    )


class Job(Base):
    """A GRPO training job and everything the scheduler knows about its current attempt."""

    __tablename__ = "jobs"

    id: Mapped[int] = mapped_column(BigInteger, Identity(), primary_key=True)
    name: Mapped[str | None] = mapped_column(String(JOB_NAME_MAX))
    model: Mapped[str] = mapped_column(Text)
    dataset: Mapped[str] = mapped_column(Text)
    reward_function: Mapped[str] = mapped_column(Text)
    extra_args: Mapped[list[str]] = mapped_column(JSONB, default=list, server_default="[]")
    """Arguments passed to train_grpo.py verbatim, after the ones rlfleet builds."""
    env: Mapped[dict[str, str]] = mapped_column(JSONB, default=dict, server_default="{}")
    """The job's own environment variables (`job submit --env`): values are secrets to
    show nowhere; the launch writes them to a mode-0600 file in the attempt directory."""
    roles: Mapped[dict[str, object] | None] = mapped_column(JSONB)
    """A job group's roles (`job submit -f`, `--vllm-server-gpus`), in the spec file's
    shape without env values (`jobspec.GroupSpec.to_data`); NULL for a job of one training
    role, which the other columns describe whole. For a group, model/dataset/reward_function
    are shown only."""
    gpus_requested: Mapped[int] = mapped_column(Integer, default=1, server_default="1")
    """Every GPU an attempt holds, all its VMs together, for every kind of job: a training
    job has `gpus_requested / nodes` on each VM, a group what its roles' layout says (read
    through `attempts.shape.JobShape`, never divided anywhere else)."""
    nodes: Mapped[int] = mapped_column(Integer, default=1, server_default="1")
    """How many VMs the job spans (`job submit --nodes`); 1 is a single-node job. Every
    claimed attempt has one `job_nodes` row per VM (rank), a single-node job's one rank 0
    included; the job row's VM, GPU, pid and directory columns are rank 0's copy, which
    listings (`job list`) read, and name the completing attempt once the job completed."""
    priority: Mapped[int] = mapped_column(Integer, default=0, server_default="0")
    """Higher runs first."""
    status: Mapped[str] = mapped_column(String(16), default="queued", server_default="queued")
    status_reason: Mapped[str | None] = mapped_column(Text)
    """Why the job is in its state, e.g. why it is pending."""
    attempt: Mapped[int] = mapped_column(Integer, default=0, server_default="0")
    """Number of launches so far; the current attempt's directory is named after it."""
    retry_count: Mapped[int] = mapped_column(Integer, default=0, server_default="0")
    max_retries: Mapped[int] = mapped_column(Integer, default=3, server_default="3")
    failure_reason: Mapped[str | None] = mapped_column(String(32))
    """See `FailureReason`; NULL unless the last attempt failed."""
    hang_timeout_s: Mapped[int] = mapped_column(
        Integer, default=DEFAULT_HANG_TIMEOUT_S, server_default=str(DEFAULT_HANG_TIMEOUT_S)
    )
    """`job submit --hang-timeout`: a running attempt whose step has not advanced for this
    many seconds is hung (`scheduler.hang`); 0: never."""
    startup_timeout_s: Mapped[int] = mapped_column(
        Integer, default=DEFAULT_STARTUP_TIMEOUT_S, server_default=str(DEFAULT_STARTUP_TIMEOUT_S)
    )
    """`job submit --startup-timeout`: a running attempt with no first step this many
    seconds after `running_at` is stuck starting; 0: never."""
    progress_attempt: Mapped[int | None] = mapped_column(Integer)
    """The attempt `progress_step` was read from (the poller's latest reading)."""
    progress_step: Mapped[int | None] = mapped_column(Integer)
    """The training step the poller last read from the attempt's progress.json."""
    progress_changed_at: Mapped[datetime | None] = mapped_column(timestamp())
    """When the poller first read `progress_step` (the database's clock, never the VM's):
    the step has not changed since."""
    exit_code: Mapped[int | None] = mapped_column(Integer)
    vm_id: Mapped[int | None] = mapped_column(ForeignKey("vms.id", ondelete="SET NULL"))
    """VM of the current or last attempt; NULL before the first claim."""
    gpu_indices: Mapped[list[int] | None] = mapped_column(ARRAY(Integer))
    """nvidia-smi indices of the claimed GPUs when claimed (information, for display)."""
    gpu_uuids: Mapped[list[str] | None] = mapped_column(ARRAY(String(96)))
    """UUIDs of the claimed GPUs, in the order of `gpu_indices`: what the attempt is
    launched on (`CUDA_VISIBLE_DEVICES`). NULL before the first claim."""
    remote_pid: Mapped[int | None] = mapped_column(Integer)
    """Process-group leader on the VM; NULL until the launch is confirmed."""
    launch_token: Mapped[str | None] = mapped_column(String(16))
    """Random name part of the current attempt's directory, drawn at claim time; NULL
    before the first claim. See `remote.layout.Attempt`."""
    attempt_dir: Mapped[str | None] = mapped_column(Text)
    """Absolute directory of the current attempt on its VM, as its launch reported it; NULL
    until the launch is confirmed (then `$HOME/<remote.layout.Attempt.relative>` is meant)."""
    completed_attempt: Mapped[int | None] = mapped_column(Integer)
    """The attempt whose exit 0 completed the job (its VM is `vm_id`, its directory
    `attempt_dir`); NULL unless completed."""
    workdir_digest: Mapped[str | None] = mapped_column(
        String(64), ForeignKey("workdirs.digest", ondelete="RESTRICT")
    )
    """The job's workdir (`job submit --workdir`), a `workdirs` row; NULL for a job
    without one."""
    output_dir: Mapped[str | None] = mapped_column(Text)
    """NULL until the first claim, which sets the default
    ~/.rlfleet/<installation>/outputs/<job_id> unless the user named one."""
    store: Mapped[str | None] = mapped_column(Text)
    """The job's store URL (`job submit --store`, `scheduler.store`): where its checkpoints
    and final outputs go; NULL: none (they stay on the VM)."""
    store_status: Mapped[dict[str, object] | None] = mapped_column(JSONB)
    """What the store agent of the latest attempt reported (checkpoints in the store, last
    upload error), as the poller read it (`remote.probe.parse_store_status`)."""
    lease_expires_at: Mapped[datetime | None] = mapped_column(timestamp())
    """While `starting`: when the claim may be taken back if the launch never confirmed."""
    next_attempt_at: Mapped[datetime | None] = mapped_column(timestamp())
    """While `failed` with retries left: not retried before this time."""
    retry_decision: Mapped[str | None] = mapped_column(String(16))
    """While `failed`: what the requeue manager decided about this failure, `retry` (at
    `next_attempt_at`) or `give_up`; NULL: not decided yet. Every move clears it."""
    machine_faults: Mapped[int] = mapped_column(Integer, default=0, server_default="0")
    """Failures of this job that were the VM's fault (`retry.is_machine_fault`: node lost,
    VM removed, VM unable to start training), counted for the retry policy's cap."""
    uncounted_retries: Mapped[dict[str, int]] = mapped_column(
        JSONB, default=dict, server_default="{}"
    )
    """The retries of this job that did not count against `max_retries`, by the failure
    reason that caused each (`store_error`, `node_lost`…): capped in all per job
    (`RetryPolicy.uncounted_limit`)."""
    published_at: Mapped[datetime | None] = mapped_column(timestamp())
    """Last publish to jobs.new; NULL means queued but never published."""
    submitted_at: Mapped[datetime] = mapped_column(timestamp(), server_default=func.now())
    queued_at: Mapped[datetime | None] = mapped_column(timestamp())
    pending_at: Mapped[datetime | None] = mapped_column(timestamp())
    starting_at: Mapped[datetime | None] = mapped_column(timestamp())
    running_at: Mapped[datetime | None] = mapped_column(timestamp())
    finished_at: Mapped[datetime | None] = mapped_column(timestamp())
    updated_at: Mapped[datetime] = mapped_column(timestamp(), server_default=func.now())

    vm: Mapped[VM | None] = relationship()
    events: Mapped[list[JobEvent]] = relationship(
        back_populates="job", cascade="all, delete-orphan", order_by="JobEvent.id"
    )
    ranks: Mapped[list[JobNode]] = relationship(order_by="JobNode.rank", viewonly=True)
    ports: Mapped[list[JobPort]] = relationship(order_by="JobPort.port", viewonly=True)
    """The ports a job group's current attempt got (load with `selectinload`)."""
    """The `job_nodes` rows of a multi-node job, rank 0 first (load with `selectinload`)."""

    __table_args__ = (
        CheckConstraint("gpus_requested >= 1", name="gpus_positive"),
        CheckConstraint("max_retries >= 0", name="retries_nonnegative"),
        CheckConstraint(TOKEN_CHECK, name="launch_token_hex"),
        CheckConstraint(ATTEMPT_DIR_CHECK, name="attempt_dir_absolute"),
        # What the dispatcher relies on when it launches a job (a row written by hand that
        # still gets past these fails its job with config_error: rowcheck.job_row_problem).
        CheckConstraint(
            "jsonb_typeof(extra_args) = 'array' AND "
            "NOT jsonb_path_exists(extra_args, '$[*] ? (@.type() != \"string\")')",
            name="extra_args_strings",
        ),
        CheckConstraint(f"status IN ({_JOB_STATUSES})", name="status_known"),
        CheckConstraint(f"gpus_requested <= {MAX_JOB_GPUS}", name="gpus_sane"),
        CheckConstraint(f"nodes BETWEEN 1 AND {MAX_NODES}", name="nodes_range"),
        CheckConstraint(
            f"max_retries <= {MAX_RETRIES} AND retry_count >= 0 AND attempt >= 0",
            name="counts_sane",
        ),
        CheckConstraint(
            f"retry_decision IN ({_RETRY_DECISIONS}) AND machine_faults >= 0",
            name="retry_bookkeeping",
        ),
        CheckConstraint(
            "jsonb_typeof(uncounted_retries) = 'object'", name="uncounted_retries_object"
        ),
        CheckConstraint(
            "model <> '' AND dataset <> '' AND reward_function <> ''", name="spec_nonempty"
        ),
        CheckConstraint(
            f"hang_timeout_s BETWEEN 0 AND {MAX_TIMEOUT_S}"
            f" AND startup_timeout_s BETWEEN 0 AND {MAX_TIMEOUT_S}",
            name="liveness_timeouts",
        ),
        Index("ix_jobs_status_priority", "status", text("priority DESC"), "id"),
    )


class JobNode(Base):
    """One node (rank) of a job's current attempt: its VM, GPUs and process. Every claimed
    attempt has one row per VM, rank 0 and single-node jobs included (a single-node job is
    an attempt of one node); probing, finishing, abandoning and cancelling read the ranks
    here, all alike.

    Written with the claim (every rank in the claim's transaction), the pid and directory
    when the launch is recorded, the exit code when the poller sees the rank end. The job
    row keeps a copy of rank 0's columns for listings. Rows of an earlier attempt are
    replaced by the next claim."""

    __tablename__ = "job_nodes"

    job_id: Mapped[int] = mapped_column(ForeignKey("jobs.id", ondelete="CASCADE"), primary_key=True)
    rank: Mapped[int] = mapped_column(Integer, primary_key=True)
    attempt: Mapped[int] = mapped_column(Integer)
    vm_id: Mapped[int | None] = mapped_column(ForeignKey("vms.id", ondelete="SET NULL"), index=True)
    """NULL only once the VM row was removed."""
    gpu_indices: Mapped[list[int]] = mapped_column(ARRAY(Integer))
    gpu_uuids: Mapped[list[str]] = mapped_column(ARRAY(String(96)))
    remote_pid: Mapped[int | None] = mapped_column(Integer)
    """Process-group leader of this rank; NULL until its launch is recorded."""
    attempt_dir: Mapped[str | None] = mapped_column(Text)
    """Absolute attempt directory on this rank's VM; NULL until its launch is recorded."""
    exit_code: Mapped[int | None] = mapped_column(Integer)
    """Set when the poller saw this rank exit (0, or the failure that ended the attempt);
    NULL while it runs, or when it was killed for another rank's sake."""
    role_restarts: Mapped[dict[str, object]] = mapped_column(
        JSONB, default=dict, server_default="{}"
    )
    """The restarts in place of the job group roles this rank runs (`restart: on-failure`)
    that the poller has recorded as events: `{"attempt": N, "roles": {role: restarts}}`,
    what the supervisor of attempt N counted in its `roles.json` when last read (a map of
    another attempt than the row's counts as none; `scheduler.gpu_poller.restarts`). {}:
    none recorded."""

    vm: Mapped[VM | None] = relationship()

    __table_args__ = (
        CheckConstraint("rank >= 0", name="rank_nonnegative"),
        CheckConstraint(ATTEMPT_DIR_CHECK, name="attempt_dir_absolute"),
    )


class JobPort(Base):
    """A port a job group's role was given on a VM for one attempt (`RLFLEET_<ROLE>_<PORT>`).

    Chosen at launch by asking the VM for free ports; unique per VM, so two groups
    launched at once on one VM never share a port (a probe whose answer collides is asked
    again). Rows go when the job's GPUs are released (`gpus.release_in_session`) and when
    the job is claimed again."""

    __tablename__ = "job_ports"

    vm_id: Mapped[int] = mapped_column(ForeignKey("vms.id", ondelete="CASCADE"), primary_key=True)
    port: Mapped[int] = mapped_column(Integer, primary_key=True)
    job_id: Mapped[int] = mapped_column(ForeignKey("jobs.id", ondelete="CASCADE"), index=True)
    attempt: Mapped[int] = mapped_column(Integer)
    role: Mapped[str] = mapped_column(String(32))
    name: Mapped[str] = mapped_column(String(32))

    __table_args__ = (CheckConstraint("port BETWEEN 1 AND 65535", name="port_range"),)


class GpuEvent(Base):
    """A change of one GPU's health or of its hand drain: the history `vm show` prints."""

    __tablename__ = "gpu_events"

    id: Mapped[int] = mapped_column(BigInteger, Identity(), primary_key=True)
    vm_id: Mapped[int] = mapped_column(ForeignKey("vms.id", ondelete="CASCADE"))
    gpu_uuid: Mapped[str] = mapped_column(String(96))
    gpu_index: Mapped[int | None] = mapped_column(Integer)
    """nvidia-smi's index then; NULL when not known."""
    kind: Mapped[str] = mapped_column(String(16))
    """`unhealthy`, `healthy`, `drained` or `undrained`."""
    reason: Mapped[str] = mapped_column(Text)
    actor: Mapped[str] = mapped_column(String(64))
    created_at: Mapped[datetime] = mapped_column(timestamp(), server_default=func.now())

    __table_args__ = (Index("ix_gpu_events_vm_id_created_at", "vm_id", "created_at"),)


class JobEvent(Base):
    """One row per state change of a job: the audit trail `job show` prints."""

    __tablename__ = "job_events"

    id: Mapped[int] = mapped_column(BigInteger, Identity(), primary_key=True)
    job_id: Mapped[int] = mapped_column(ForeignKey("jobs.id", ondelete="CASCADE"), index=True)
    from_status: Mapped[str | None] = mapped_column(String(16))
    """NULL for the event that created the job."""
    to_status: Mapped[str] = mapped_column(String(16))
    reason: Mapped[str | None] = mapped_column(Text)
    actor: Mapped[str] = mapped_column(String(64))
    """Who made the move: `cli`, `dispatcher:<host>:<pid>`, `poller`, `requeue`…"""
    attempt: Mapped[int] = mapped_column(Integer, default=0, server_default="0")
    created_at: Mapped[datetime] = mapped_column(timestamp(), server_default=func.now())
    count: Mapped[int] = mapped_column(Integer, default=1, server_default="1")
    """How many times this move happened with this reason in a waiting spell (queued ↔
    pending, `jobs.transition`): repeats update this row instead of adding one."""
    last_at: Mapped[datetime | None] = mapped_column(timestamp())
    """When the last repeat happened; NULL while `count` is 1."""

    job: Mapped[Job] = relationship(back_populates="events")

    __table_args__ = (CheckConstraint("count >= 1", name="count_positive"),)


class Leftover(Base):
    """An attempt that may still run on its VM after its job moved on (`scheduler.leftovers`):
    it must be killed when the VM answers, and the GPUs it held are not offered until then
    (docs/invariants.md, invariant 2). Table `leftovers` (named `stale_processes` before
    migration 0014)."""

    __tablename__ = "leftovers"

    id: Mapped[int] = mapped_column(BigInteger, Identity(), primary_key=True)
    vm_id: Mapped[int] = mapped_column(ForeignKey("vms.id", ondelete="CASCADE"), index=True)
    job_id: Mapped[int] = mapped_column(ForeignKey("jobs.id", ondelete="CASCADE"))
    attempt: Mapped[int] = mapped_column(Integer)
    launch_token: Mapped[str | None] = mapped_column(String(16))
    """The attempt's launch token (`jobs.launch_token` then); NULL only for a row written
    before tokens existed (its kill then finds nothing and fences the new directory)."""
    attempt_dir: Mapped[str | None] = mapped_column(Text)
    """The attempt's absolute directory if its launch reported one; NULL: under $HOME."""
    pid: Mapped[int | None] = mapped_column(Integer)
    """Process-group leader; NULL means unknown (the kill reads the attempt's pid file)."""
    gpu_indices: Mapped[list[int] | None] = mapped_column(ARRAY(Integer))
    """GPUs of the VM the process may still hold, by index; only used when `gpu_uuids` is
    NULL. NULL means unknown (block none)."""
    gpu_uuids: Mapped[list[str] | None] = mapped_column(ARRAY(String(96)))
    """The same GPUs by UUID, which a renumbering cannot move; they are what is blocked."""
    reason: Mapped[str] = mapped_column(String(32))
    created_at: Mapped[datetime] = mapped_column(timestamp(), server_default=func.now())
    killed_at: Mapped[datetime | None] = mapped_column(timestamp())
    """When the kill succeeded; NULL means the process may still be alive."""
    attempts: Mapped[int] = mapped_column(Integer, default=0, server_default="0")
    """Kill attempts so far."""
    last_error: Mapped[str | None] = mapped_column(Text)
    rank: Mapped[int | None] = mapped_column(Integer)
    """The attempt's rank on this VM (its `job_nodes` rank), kept because a newer attempt's
    claim replaces those rows; NULL for an attempt on one VM (or a row written before)."""
    exit_code: Mapped[int | None] = mapped_column(Integer)
    """How this rank is known to have ended: copied from `job_nodes` when the attempt was
    abandoned, or found by the kill (gone, having exited); NULL: not known to have exited.
    What late success reads (`attempts.outcome`)."""

    __table_args__ = (
        UniqueConstraint("vm_id", "job_id", "attempt"),
        CheckConstraint(TOKEN_CHECK, name="launch_token_hex"),
        CheckConstraint(ATTEMPT_DIR_CHECK, name="attempt_dir_absolute"),
    )
