"""Launching a claimed attempt: one loop over the claim's nodes, whatever the job's shape.

Every attempt is a list of nodes (one per VM, rank 0 first; a single-node job's claim is
its one VM). What differs between a job of one VM, a multi-node job, a job group on one VM
and a group over several VMs is data built per node before the loop (`NodeLaunch`) by the
module of the job's kind (`attempts.kinds`, picked from the claim's shape): the rank's
rendezvous place (`RankRendezvous`, a multi-node training job), the supervisor's
`group.json` for the roles that run there (`GroupLaunch`, a group), and the group's token;
this module never branches on the kind. The loop then starts every node with the same
function (`launch_node`), concurrently, over SSH with no transaction open, and `settle`
records each rank's pid and directory when the claim has rows for them (`job_nodes`). Any
node that does not start fails the whole attempt: its caller abandons it, and every rank
becomes a leftover to kill.
"""

from __future__ import annotations

import asyncio
import base64
import hashlib
import time
from collections.abc import Sequence

from sqlalchemy import select

from scheduler.attempts.kinds import NodeLaunch, Plan, Ports, Secret, kind_of
from scheduler.attempts.shape import JobShape
from scheduler.claims.records import PortCollision, record_group_ports, record_ranks
from scheduler.claims.result import Claim, NodeClaim
from scheduler.db import Database, is_unavailable
from scheduler.logging import get_logger
from scheduler.models import Workdir
from scheduler.remote.jobuser import JobUserProblem, checked_job_user
from scheduler.remote.launch import (
    LaunchResult,
    LaunchSpec,
    launch_input,
    launch_script,
    parse_launch,
)
from scheduler.remote.rendezvous import (
    free_port_script,
    free_ports_script,
    parse_free_port,
    parse_free_ports,
)
from scheduler.remote.workdir import has_script, parse_has, parse_ready, receive_script
from scheduler.store_records import accepted
from scheduler.transport import Transport, TransportError, VMTarget

from .consumer import TransientError, db_error

log = get_logger("dispatcher")

VM_CACHE_TTL_S = 15.0
WORKDIR_SEND_RATE = 1 << 20
"""Bytes per second a workdir's transfer may take at worst, on top of the launch timeout."""
PORT_TRIES = 5
"""Port probes a group launch makes before it fails: each collision is another attempt's
port chosen on the same VM between our probe and our record."""

__all__ = ["Launcher", "NodeLaunch", "Secret", "Targets", "claimed_nodes"]


def claimed_nodes(claim: Claim) -> tuple[NodeClaim, ...]:
    """Every node of the claimed attempt, rank 0 first: the claim's ranks, or its one VM
    when the claim lists none (a single-node attempt)."""
    if claim.nodes:
        return claim.nodes
    return (NodeClaim(0, claim.vm_id, tuple(claim.gpu_indices), tuple(claim.gpu_uuids)),)


def claim_gpus(nodes: Sequence[NodeClaim]) -> int:
    """Every GPU the claimed nodes hold."""
    return sum(len(node.gpu_indices) for node in nodes)


def last_line(text: str) -> str:
    """The launch's stderr says what went wrong last."""
    text = text.strip()
    return text.splitlines()[-1][:300] if text else ""


class Targets:
    """The VMs' connection fields, from a cache of every VM refreshed in one query."""

    def __init__(self, db: Database) -> None:
        self.db = db
        self._vms: dict[int, tuple[VMTarget, float]] = {}
        self._lock = asyncio.Lock()

    async def get(self, vm_id: int) -> VMTarget:
        """VM `vm_id`'s target; TransientError when the database is away, RuntimeError
        when the VM is gone."""
        cached = self._vms.get(vm_id)
        if cached is not None and time.monotonic() - cached[1] < VM_CACHE_TTL_S:
            return cached[0]
        async with self._lock:  # one reload for all the claims that missed at once
            cached = self._vms.get(vm_id)
            if cached is None or time.monotonic() - cached[1] >= VM_CACHE_TTL_S:
                await self._load()
        cached = self._vms.get(vm_id)
        if cached is None:
            raise RuntimeError(f"VM {vm_id} vanished under a claim")
        return cached[0]

    async def _load(self) -> None:
        try:
            async with self.db.transaction() as session:
                rows = (await session.execute(select(*VMTarget.columns()))).all()
        except Exception as exc:
            if is_unavailable(exc):
                raise TransientError(db_error(exc)) from exc
            raise
        now = time.monotonic()
        self._vms = {row.id: (VMTarget.from_row(row), now) for row in rows}


class Launcher:
    """Starts claimed attempts on their VMs (`launch`), one node at a time through
    `launch_node`."""

    def __init__(
        self,
        db: Database,
        transport: Transport,
        targets: Targets,
        *,
        launch_timeout_s: float,
        fence_after_s: float,
        fence_grace_s: float,
    ) -> None:
        self.db = db
        self.transport = transport
        self.targets = targets
        self.launch_timeout_s = launch_timeout_s
        self.fence_after_s = fence_after_s
        self.fence_grace_s = fence_grace_s

    async def launch(self, claim: Claim, target: VMTarget) -> LaunchResult | str:
        """Start the claimed attempt on every node (`target` is rank 0's VM): rank 0's pid
        and directory, or why it did not start."""
        planned = await self.plan(claim, target)
        if isinstance(planned, str):
            return planned
        nodes, secret = planned
        # One read of the workdir for every node of the attempt that lacks it.
        payload = WorkdirPayload(self, claim.workdir) if claim.workdir is not None else None
        accept = await self.store_accept(claim)
        if isinstance(accept, str):
            return accept
        outcomes = await asyncio.gather(
            *(self.launch_node(claim, n, secret, payload, accept) for n in nodes)
        )
        return await self.settle(claim, nodes, list(outcomes))

    async def plan(self, claim: Claim, target: VMTarget) -> Plan:
        """Each node's launch, built by the module of the job's kind from its shape
        (`attempts.kinds`), with the ports it needs chosen on its VM; or why the attempt
        cannot start."""
        nodes = claimed_nodes(claim)
        shape = claim.shape or JobShape.of(len(nodes), claim.roles, claim_gpus(nodes))
        if shape.nodes != len(nodes):
            return f"the job runs on {shape.nodes} VMs, the claim has {len(nodes)}"
        try:
            targets = [target] + [await self.targets.get(node.vm_id) for node in nodes[1:]]
        except (TransientError, RuntimeError) as exc:
            return str(exc)
        return await kind_of(shape).plan(self, claim, shape, nodes, targets)

    async def rendezvous_port(self, target: VMTarget) -> int | str:
        """A free port on rank 0's VM for a multi-node job's rendezvous, or why none."""
        try:
            probe = await self.transport.run(
                target, free_port_script(target.python), timeout=self.launch_timeout_s
            )
        except TransportError as exc:
            return f"rank 0 ({target.name}): {exc or type(exc).__name__}"
        port = parse_free_port(probe.stdout)
        if port is None:
            why = last_line(probe.stderr) or f"exit {probe.exit_status}"
            return f"rank 0 ({target.name}): no free port: {why}"
        return port

    async def choose_ports_on(
        self, claim: Claim, wanted: Sequence[tuple[VMTarget, list[tuple[str, str]]]]
    ) -> Ports | str:
        """Free ports for every (role, name) on the VM that runs it, probed on all the VMs
        at once (SSH, no transaction) and recorded for this attempt in one transaction; a
        probe answer that collides with another attempt's record is asked again."""
        asked = [(target, needs) for target, needs in wanted if needs]
        if not asked:
            return {}
        for _try in range(PORT_TRIES):
            probes = await asyncio.gather(*(self._probe_ports(t, n) for t, n in asked))
            errors = [p for p in probes if isinstance(p, str)]
            if errors:
                return "; ".join(errors)
            chosen = {key: port for p in probes if isinstance(p, dict) for key, port in p.items()}
            rows = [
                (target.id, role, name, chosen[(role, name)])
                for target, needs in asked
                for role, name in needs
            ]
            try:
                async with self.db.engine.begin() as conn:
                    await record_group_ports(conn, claim.job_id, claim.attempt, rows)
            except PortCollision:
                continue
            except Exception as exc:
                if not is_unavailable(exc):
                    raise
                return db_error(exc)
            return chosen
        return f"no free ports: {PORT_TRIES} probes collided with other attempts' ports"

    async def _probe_ports(self, target: VMTarget, needs: list[tuple[str, str]]) -> Ports | str:
        """Ask `target` for as many free ports as `needs` has (one probe, so they differ)."""
        try:
            probe = await self.transport.run(
                target,
                free_ports_script(target.python, len(needs)),
                timeout=self.launch_timeout_s,
            )
        except TransportError as exc:
            return f"choosing ports on {target.name}: {exc or type(exc).__name__}"
        found = parse_free_ports(probe.stdout)
        if len(found) < len(needs):
            why = last_line(probe.stderr) or f"exit {probe.exit_status}"
            return f"no free ports on {target.name}: {why}"
        return dict(zip(needs, found, strict=False))

    async def launch_node(
        self,
        claim: Claim,
        node: NodeLaunch,
        secret_env: Secret = (),
        payload: WorkdirPayload | None = None,
        store_accept: tuple[str, ...] = (),
    ) -> LaunchResult | str:
        """Start one node of the claimed attempt: its pid and directory, or why it did not
        start. `secret_env` (a group's token) goes with the job's own variables into
        job.env (mode 0600, through stdin), never on a command line. A job's workdir is
        put on the VM first (`ensure_workdir`)."""
        if claim.workdir is not None:
            problem = await self.ensure_workdir(claim, node.target, payload)
            if problem is not None:
                return problem
        job_user = checked_job_user(node.target)
        if isinstance(job_user, JobUserProblem):
            return job_user.why
        spec = LaunchSpec(
            job_user=job_user,
            run=claim.attempt_ref,
            python=node.target.python,
            entrypoint=node.target.entrypoint,
            gpu_indices=node.gpu_indices,
            gpu_uuids=node.gpu_uuids,
            model=claim.model,
            dataset=claim.dataset,
            reward_functions=claim.reward_functions,
            output_dir=claim.output_dir,
            extra_args=claim.extra_args,
            env=claim.env + secret_env,
            fence_after_s=self.fence_after_s,
            fence_grace_s=self.fence_grace_s,
            node=node.rendezvous,
            group=node.group,
            workdir=claim.workdir,
            store=claim.store if node.with_store else None,
            store_accept=store_accept,
        )
        try:
            result = await self.transport.run(
                node.target,
                launch_script(spec),
                timeout=self.launch_timeout_s,
                input=launch_input(spec),
            )
        except TransportError as exc:
            return str(exc) or type(exc).__name__
        launched = parse_launch(result.stdout, claim.attempt_ref)
        if launched is None:
            return last_line(result.stderr) or f"launch exited {result.exit_status}"
        return launched

    async def ensure_workdir(
        self, claim: Claim, target: VMTarget, payload: WorkdirPayload | None = None
    ) -> str | None:
        """Make sure `target` holds the claimed job's workdir in its cache: asked first
        (a VM that has it is sent nothing), else read from the database (a short
        transaction of its own; through `payload`, once for all the nodes of an attempt)
        and sent over SSH as base64 on the unpacking script's stdin (no transaction
        open). None once it is there, else why not."""
        digest = claim.workdir
        assert digest is not None
        payload = payload or WorkdirPayload(self, digest)
        try:
            asked = await self.transport.run(
                target,
                has_script(claim.installation, digest),
                timeout=self.launch_timeout_s,
            )
        except TransportError as exc:
            return f"workdir: {exc or type(exc).__name__}"
        except ValueError as exc:  # a digest or installation no check let through
            return f"workdir: {exc}"
        present = parse_has(asked.stdout)
        if present:
            return None
        if present is None:
            return f"workdir: {last_line(asked.stderr) or f'exit {asked.exit_status}'}"
        loaded = await payload.get()
        if isinstance(loaded, str):
            return loaded
        text, size = loaded
        try:
            sent = await self.transport.run(
                target,
                receive_script(target.python, claim.installation, digest),
                timeout=self.launch_timeout_s + size / WORKDIR_SEND_RATE,
                input=text,
            )
        except TransportError as exc:
            return f"sending the workdir: {exc or type(exc).__name__}"
        if not parse_ready(sent.stdout):
            return last_line(sent.stderr) or f"unpacking the workdir exited {sent.exit_status}"
        log.info("workdir_sent", job_id=claim.job_id, vm=target.name, digest=digest,
                 bytes=size)  # fmt: skip
        return None

    async def store_accept(self, claim: Claim) -> tuple[str, ...] | str:
        """For a job with a store: what its attempts reported writing there
        (`store_records.accepted`, a short transaction of its own), as the store agent's
        `--accept` words; or why it could not be read."""
        if claim.store is None:
            return ()
        try:
            async with self.db.transaction() as session:
                found = await accepted(session, claim.job_id)
        except Exception as exc:
            if not is_unavailable(exc):
                raise
            return db_error(exc)
        return found.words()

    async def _workdir_bytes(self, digest: str) -> bytes | str:
        """The packed workdir `digest`, checked against its digest; or why not."""
        try:
            async with self.db.engine.begin() as conn:
                data = await conn.scalar(select(Workdir.data).where(Workdir.digest == digest))
        except Exception as exc:
            if not is_unavailable(exc):
                raise
            return db_error(exc)
        if data is None:
            return f"workdir {digest[:12]} is not in the database"
        data = bytes(data)
        if hashlib.sha256(data).hexdigest() != digest:
            return f"workdir {digest[:12]}: the stored bytes do not match their digest"
        return data

    async def settle(
        self, claim: Claim, nodes: Sequence[NodeLaunch], outcomes: Sequence[LaunchResult | str]
    ) -> LaunchResult | str:
        """Every node started: record each rank's pid and directory when the claim has
        rows for its ranks (a short transaction after the SSH calls) and return rank 0's;
        else why some did not start (each rank named, for an attempt over several VMs)."""
        errors = [
            f"rank {node.rank} ({node.target.name}): {outcome}" if len(nodes) > 1 else outcome
            for node, outcome in zip(nodes, outcomes, strict=True)
            if not isinstance(outcome, LaunchResult)
        ]
        if errors:
            return "; ".join(errors)
        launched = [o for o in outcomes if isinstance(o, LaunchResult)]
        if not claim.nodes:
            return launched[0]
        try:
            async with self.db.engine.begin() as conn:
                await record_ranks(
                    conn,
                    claim.job_id,
                    claim.attempt,
                    [(n.rank, o.pid, o.path) for n, o in zip(nodes, launched, strict=True)],
                )
        except Exception as exc:
            if not is_unavailable(exc):
                raise
            return db_error(exc)
        return launched[0]


class WorkdirPayload:
    """A claimed job's packed workdir as the receiver reads it (base64 text) and its
    packed size, read from the database at most once however many nodes of the attempt
    lack it (`Launcher._workdir_bytes`), and held only while the attempt is launched."""

    def __init__(self, launcher: Launcher, digest: str) -> None:
        self._launcher = launcher
        self._digest = digest
        self._task: asyncio.Future[tuple[str, int] | str] | None = None

    async def get(self) -> tuple[str, int] | str:
        """(base64 text, packed bytes), or why the workdir cannot be sent."""
        if self._task is None:
            self._task = asyncio.ensure_future(self._load())
        return await asyncio.shield(self._task)

    async def _load(self) -> tuple[str, int] | str:
        data = await self._launcher._workdir_bytes(self._digest)
        if isinstance(data, str):
            return data
        return base64.b64encode(data).decode("ascii"), len(data)
