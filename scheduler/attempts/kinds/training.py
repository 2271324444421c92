"""A training job: one `train` role on each of its VMs. A job over several VMs gets one
rendezvous port, chosen on rank 0's VM, and each rank its place in it."""

from __future__ import annotations

from collections.abc import Sequence

from scheduler.attempts.kinds.base import NodeLaunch, Plan, Probes
from scheduler.attempts.shape import JobShape
from scheduler.claims.result import Claim, NodeClaim
from scheduler.remote.rendezvous import RankRendezvous
from scheduler.transport_types import VMTarget


async def plan(
    probes: Probes,
    claim: Claim,
    shape: JobShape,
    nodes: Sequence[NodeClaim],
    targets: Sequence[VMTarget],
) -> Plan:
    """Each rank's launch: the training command, and with several VMs its rendezvous
    place (every rank's address, rank 0's port)."""
    port = await probes.rendezvous_port(targets[0]) if shape.multi_node else None
    if isinstance(port, str):
        return port
    addrs = tuple(t.training_address for t in targets)
    return [
        NodeLaunch(
            node.rank,
            target,
            node.gpu_indices,
            node.gpu_uuids,
            rendezvous=None if port is None else RankRendezvous(node.rank, addrs, port),
        )
        for node, target in zip(nodes, targets, strict=True)
    ], ()
