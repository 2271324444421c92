"""Where the ranks of a multi-node job and the roles of a job group meet: each rank's
rendezvous data (`RankRendezvous`, and the variables it is told), the group supervisor's
configuration (`GroupLaunch`), and the probes that ask a VM for free TCP ports.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from scheduler.remote.isolated import isolated_words
from scheduler.remote.output import as_int, output_lines


@dataclass(frozen=True)
class RankRendezvous:
    """Where one rank of a multi-node job stands: its rank, every node's internal address
    (rank order; rank 0's is the rendezvous host) and the rendezvous port on rank 0."""

    rank: int
    addrs: tuple[str, ...]
    master_port: int

    @property
    def num_nodes(self) -> int:
        """How many nodes the job spans."""
        return len(self.addrs)


@dataclass(frozen=True)
class GroupLaunch:
    """What the group supervisor of one VM gets (`group.json`, no secret in it): the roles
    in start order with argv and own variables, the readiness checks, the variables every
    role gets, and whether a training role needs the VM's entrypoint."""

    config: dict[str, Any]
    needs_entrypoint: bool = True

    def text(self) -> str:
        """`group.json`."""
        import json

        return json.dumps(self.config, sort_keys=True)


def rendezvous_env(node: RankRendezvous, per_node: int) -> dict[str, str]:
    """What a rank of a multi-node job (or of a group's role on several nodes) is told of
    where it stands: RLFLEET_NODE_RANK, RLFLEET_NUM_NODES, RLFLEET_GPUS_PER_NODE,
    RLFLEET_NODE_ADDRS (rank order), MASTER_ADDR (rank 0), MASTER_PORT, WORLD_SIZE (one
    process per GPU, at least one per node)."""
    return {
        "RLFLEET_NODE_RANK": str(int(node.rank)),
        "RLFLEET_NUM_NODES": str(int(node.num_nodes)),
        "RLFLEET_GPUS_PER_NODE": str(int(per_node)),
        "RLFLEET_NODE_ADDRS": ",".join(node.addrs),
        "MASTER_ADDR": node.addrs[0],
        "MASTER_PORT": str(int(node.master_port)),
        "WORLD_SIZE": str(int(node.num_nodes) * max(1, int(per_node))),
    }


FREE_PORT_MARK = "rlfleet-port"


def free_port_script(python: str) -> str:
    """Ask the VM for a TCP port free right now (bind port 0): the rendezvous port of a
    multi-node job, chosen on rank 0's VM at launch time. Prints `rlfleet-port <port>`."""
    code = (
        "import socket; s = socket.socket(); s.bind(('', 0)); "
        f"print('{FREE_PORT_MARK}', s.getsockname()[1])"
    )
    return " ".join(isolated_words(python, code))


def free_ports_script(python: str, count: int) -> str:
    """Ask the VM for `count` distinct TCP ports free right now (all bound at once, then
    released): the named ports of a job group's roles. Prints one `rlfleet-port <port>`
    line each."""
    code = (
        "import socket, sys\n"
        "socks = [socket.socket() for _ in range(int(sys.argv[1]))]\n"
        "for s in socks: s.bind(('', 0))\n"
        f"for s in socks: print('{FREE_PORT_MARK}', s.getsockname()[1])\n"
    )
    return " ".join(isolated_words(python, code, [str(int(count))]))


def parse_free_ports(stdout: str) -> list[int]:
    """Every distinct port `free_ports_script` printed, in order."""
    ports: list[int] = []
    for line in output_lines(stdout):
        word, _, value = line.partition(" ")
        port = as_int(value) if word == FREE_PORT_MARK else None
        if port is not None and 0 < port < 65536 and port not in ports:
            ports.append(port)
    return ports


def parse_free_port(stdout: str) -> int | None:
    """The port `free_port_script` printed, or None."""
    for line in output_lines(stdout):
        word, _, value = line.partition(" ")
        port = as_int(value) if word == FREE_PORT_MARK else None
        if port is not None and 0 < port < 65536:
            return port
    return None
