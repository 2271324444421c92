"""A job group: its roles laid out on VMs (`GroupSpec.layout`, one claimed node per VM).
Each VM gets a supervisor for its own roles, which knows every role's address and ports;
the ports of the roles whose rank 0 runs on a VM (named ports, and the rendezvous port of
a role on several nodes) are chosen there; one token per attempt, the same on every VM."""

from __future__ import annotations

from collections.abc import Sequence

from scheduler.attempts.kinds.base import NodeLaunch, Plan, Probes
from scheduler.attempts.shape import JobShape
from scheduler.claims.result import Claim, NodeClaim
from scheduler.groups import TOKEN_ENV, GroupPlace, group_launch, group_token, node_port_needs
from scheduler.transport_types import VMTarget


async def plan(
    probes: Probes,
    claim: Claim,
    shape: JobShape,
    nodes: Sequence[NodeClaim],
    targets: Sequence[VMTarget],
) -> Plan:
    """Each VM's supervisor config, with the ports its roles need chosen there (a group
    on one VM: every role, its services on loopback)."""
    group = shape.spec
    if group is None:  # the claim fails such a row first (rowcheck.job_row_problem)
        return shape.problem or "the group's roles do not read back"
    ports = await probes.choose_ports_on(
        claim, list(zip(targets, node_port_needs(group), strict=True))
    )
    if isinstance(ports, str):
        return ports
    addresses = [target.training_address for target in targets]
    launches = []
    for index, (node, target) in enumerate(zip(nodes, targets, strict=True)):
        place = _place(claim, target, node.gpu_indices, node.gpu_uuids)
        config = (
            group_launch(group, place, ports, node=index, node_addresses=addresses)
            if shape.multi_node
            else group_launch(group, place, ports)
        )
        launches.append(
            NodeLaunch(
                node.rank, target, node.gpu_indices, node.gpu_uuids, group=config, with_store=False
            )
        )
    return launches, ((TOKEN_ENV, group_token()),)


def _place(
    claim: Claim, target: VMTarget, gpu_indices: Sequence[int], gpu_uuids: Sequence[str]
) -> GroupPlace:
    """Where a group's attempt runs on `target`, with the GPUs claimed there (UUIDs, else
    indices for a claim made before UUIDs were recorded)."""
    return GroupPlace(
        python=target.python,
        entrypoint=target.entrypoint,
        address=target.training_address,
        gpus=list(gpu_uuids) or [str(i) for i in gpu_indices],
        output_dir=claim.output_dir,
        attempt=claim.attempt,
    )
