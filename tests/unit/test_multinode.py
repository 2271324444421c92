"""Multi-node pure parts: gang placement, pending plans for gangs, the rendezvous a rank
is launched with."""

from __future__ import annotations

import shlex

from scheduler.claims.park import gang_never_reason, gang_wait_reason
from scheduler.jobspec import GroupSpec, Role
from scheduler.pending import PendingJob, plan_pending
from scheduler.placement import demand_order, demands_fit, short_of, vm_order
from scheduler.remote.launch import LaunchSpec, entry_words, wrapper_script
from scheduler.remote.layout import Attempt
from scheduler.remote.rendezvous import RankRendezvous, parse_free_port

INSTALLATION = "0f0e0d0c-0b0a-4908-8706-050403020100"


def test_placement_takes_the_fullest_vms_that_fit() -> None:
    """Of VMs with 8, 2, 4, 3 and 1 free GPUs, a 2 × 2 gang goes to the VMs with 2 and 3
    free (the fullest that fit), never to the 1-GPU VM, and keeps the 8 whole."""
    free = {1: 8, 2: 2, 3: 4, 4: 3, 5: 1}
    order = vm_order(free, 2, job_id=7)
    assert order[:2] == [2, 4]
    assert order == [2, 4, 3, 1] and 5 not in order


def test_a_gang_does_not_fit_when_too_few_vms_have_room() -> None:
    """Three VMs cannot host a 4-node gang, nor two VMs with 4 free a gang of 5 GPUs each."""
    assert not demands_fit({1: 8, 2: 8, 3: 8}, [1] * 4)
    assert not demands_fit({1: 4, 2: 4}, [5, 5])
    assert not demands_fit({}, [1, 1])
    assert demands_fit({1: 1, 2: 1, 3: 1, 4: 9}, [1] * 4)


def test_placement_spreads_jobs_over_equally_full_vms() -> None:
    """Equally full VMs are ordered per job, so concurrent claimers do not all start on the
    same VM; every order still holds every fitting VM once."""
    free = {vm: 4 for vm in range(1, 11)}
    firsts = {vm_order(free, 4, job_id=j)[0] for j in range(20)}
    assert len(firsts) > 3
    assert sorted(vm_order(free, 4, job_id=3)) == list(range(1, 11))


def test_per_node_demands_fit_only_on_distinct_vms_big_enough() -> None:
    """Nodes needing 4, 2 and 2 GPUs fit VMs with 4, 2 and 3 free, not VMs with 8, 1 and 1
    (one VM cannot hold two nodes), nor 2, 2, 3 (none has 4); the missing part is named."""
    assert demands_fit({1: 4, 2: 2, 3: 3}, [4, 2, 2])
    assert not demands_fit({1: 8, 2: 1, 3: 1}, [4, 2, 2])
    assert short_of({1: 8, 2: 1, 3: 1}, [4, 2, 2]) == (3, 2, 1)
    assert short_of({1: 2, 2: 2, 3: 3}, [2, 4, 2]) == (1, 4, 0)
    assert short_of({1: 4, 2: 4}, [4, 4]) is None
    assert demands_fit({}, [])


def test_per_node_placement_puts_the_biggest_node_first_on_the_fullest_vm_that_fits() -> None:
    """The most demanding node is placed first; each node tries the fullest VMs that fit
    it, so a 4 + 1 gang on VMs with 8, 4 and 1 free takes the 4 and the 1."""
    assert demand_order([1, 4, 2, 4]) == [1, 3, 2, 0]
    free = {1: 8, 2: 4, 3: 1}
    assert vm_order(free, 4, job_id=5) == [2, 1]
    assert vm_order(free, 1, job_id=5) == [3, 2, 1]


def test_per_node_reasons_say_what_is_missing() -> None:
    """Equal nodes keep the multi-node words; unequal nodes list their GPUs and the size
    too few VMs have."""
    assert gang_wait_reason([4, 4], {1: 4, 2: 2}) == "needs 2 VMs with 4 free GPUs; 1 has them"
    assert gang_wait_reason([1, 4], {1: 2, 2: 2}) == (
        "needs 2 VMs with 4 and 1 free GPUs; 0 VM(s) have 4 free, 1 needed"
    )
    assert gang_never_reason([4, 4, 4], {0: 4, 1: 4}) == (
        "needs 3 VMs with 4 GPUs each; only 2 VM(s) have that many"
    )
    assert gang_never_reason([4, 2, 2], {0: 8, 1: 2}) == (
        "needs 3 VMs with 4, 2 and 2 GPUs; only 2 VM(s) have 2 or more, 3 needed"
    )
    assert gang_never_reason([4, 2], {0: 8, 1: 2}) is None


def test_a_groups_layout_spreads_only_roles_with_several_nodes() -> None:
    """Node r runs rank r of every role with more than r nodes; one-node roles share node
    0; each node needs its roles' GPUs, at least one."""
    spec = GroupSpec(
        roles=(
            Role("server", gpus=0, primary=False),
            Role("trainer", gpus=2, nodes=3, primary=True),
            Role("judge", gpus=1, nodes=2),
        )
    )
    layout = spec.layout()
    assert [n.gpus for n in layout] == [3, 3, 2]
    assert layout[0].roles == (("server", 0), ("trainer", 0), ("judge", 0))
    assert layout[1].roles == (("trainer", 1), ("judge", 1))
    assert layout[2].roles == (("trainer", 2),)
    alone = GroupSpec(roles=(Role("a", gpus=0, primary=True), Role("b", gpus=0)))
    assert [(n.gpus, len(n.roles)) for n in alone.layout()] == [(1, 2)]


def test_pending_plan_wakes_a_gang_only_when_enough_vms_fit() -> None:
    """A 2 × 4 job wakes when two VMs have 4 free, not when one VM has 8."""
    job = PendingJob(1, 4, 0, waited_s=10, since_pending_s=10, nodes=2)
    knobs = {"recheck_after_s": 1, "pending_timeout_s": 1000, "starvation_after_s": 1000}
    assert plan_pending([job], {1: 8, 2: 3}, **knobs).republish == []
    assert plan_pending([job], {1: 4, 2: 5}, **knobs).republish == [(1, "capacity")]


def test_a_starving_gang_holds_back_later_jobs_only_if_the_fleet_can_ever_run_it() -> None:
    """A starving 2 × 4 gang holds back a later 1-GPU job on a fleet with two 4-GPU VMs,
    but not on a fleet with one 8-GPU VM (it could never run there)."""
    gang = PendingJob(1, 4, 0, waited_s=500, since_pending_s=10, nodes=2)
    small = PendingJob(2, 1, 0, waited_s=5, since_pending_s=10)
    knobs = {"recheck_after_s": 1, "pending_timeout_s": 1000, "starvation_after_s": 100}
    held = plan_pending([gang, small], {1: 2, 2: 1}, vm_sizes=[4, 4], **knobs)
    assert held.held_for == 1 and held.held == [2]
    free = plan_pending([gang, small], {1: 2}, vm_sizes=[8], **knobs)
    assert free.held is None and free.republish == [(2, "capacity")]


def _spec(rank: int, gpus: int = 1) -> LaunchSpec:
    return LaunchSpec(
        run=Attempt(INSTALLATION, 5, 2, "0123456789abcdef"),
        python="python3",
        entrypoint="training.train_grpo",
        gpu_indices=list(range(gpus)),
        gpu_uuids=[f"GPU-{rank}-{i}" for i in range(gpus)],
        model="m",
        dataset="d",
        reward_functions=("format",),
        output_dir="~/out",
        node=RankRendezvous(rank, ("10.0.0.1", "10.0.0.2 ;rm -rf /"), 41234),
    )


def test_a_rank_starts_through_accelerate_with_the_rendezvous() -> None:
    """Rank 1 of a 2 × 2 job: accelerate's launcher with 2 machines, machine rank 1, rank
    0's address and the chosen port, 4 processes; the exports name every node in rank
    order, quoted."""
    words = entry_words("python3", "training.train_grpo", 2, _spec(1, 2).node)
    assert words[:3] == ["python3", "-m", "accelerate.commands.launch"]
    line = " ".join(words)
    assert "--num_machines 2 --machine_rank 1" in line
    assert "--main_process_ip 10.0.0.1 --main_process_port 41234 --num_processes 4" in line
    assert "--multi_gpu" in words and "--mixed_precision no --dynamo_backend no" in line
    script = wrapper_script(_spec(1, 2))
    assert "export RLFLEET_NODE_RANK=1 RLFLEET_NUM_NODES=2 RLFLEET_GPUS_PER_NODE=2" in script
    assert f"export RLFLEET_NODE_ADDRS={shlex.quote('10.0.0.1,10.0.0.2 ;rm -rf /')}" in script
    assert "export MASTER_ADDR=10.0.0.1 MASTER_PORT=41234 WORLD_SIZE=4" in script
    assert "--resume auto" in script  # attempt 2


def test_a_single_node_job_gets_no_rendezvous() -> None:
    """Without a node role, the launch is today's: no multi-node flags or exports."""
    spec = LaunchSpec(**{**_spec(0).__dict__, "node": None})
    script = wrapper_script(spec)
    assert "export RLFLEET_NODE_RANK" not in script and "--num_machines" not in script


def test_free_port_parsing() -> None:
    """Only a well-formed port line counts."""
    assert parse_free_port("noise\nrlfleet-port 40000\n") == 40000
    assert parse_free_port("rlfleet-port 0\nrlfleet-port 70000\nrlfleet-port x") is None


def test_rank_state_says_exited_running_starting_or_the_jobs_state() -> None:
    """A rank that recorded an exit has exited; a live job's rank runs once it has a pid;
    a rank of a final job with no exit of its own shares the job's fate."""
    from scheduler.jobs import rank_state

    assert rank_state("running", 0, 12) == "exited"
    assert rank_state("failed", 3, 12) == "exited"
    assert rank_state("running", None, 12) == "running"
    assert rank_state("starting", None, None) == "starting"
    assert rank_state("cancelled", None, 12) == "cancelled"


def test_ranks_of_a_single_node_job_are_its_row_and_none_before_a_claim() -> None:
    """`job show` lists one node for a single-node job (the row itself), none for a job
    never claimed, and every `job_nodes` row of a multi-node job, rank order."""
    from types import SimpleNamespace

    from scheduler.jobs import ranks_to_dicts

    vm = SimpleNamespace(name="vm0")
    single = SimpleNamespace(
        nodes=1, attempt=1, vm_id=7, vm=vm, status="running", gpu_indices=[0],
        gpu_uuids=["GPU-a"], remote_pid=42, attempt_dir="/h/d", exit_code=None, ranks=[],
    )  # fmt: skip
    assert [(r["rank"], r["vm"], r["pid"], r["state"]) for r in ranks_to_dicts(single)] == [  # type: ignore[arg-type]
        (0, "vm0", 42, "running")
    ]
    queued = SimpleNamespace(nodes=1, attempt=0, vm_id=None, ranks=[])
    assert ranks_to_dicts(queued) == []  # type: ignore[arg-type]
    node = SimpleNamespace(
        rank=1, vm=SimpleNamespace(name="vm1"), gpu_indices=[2], gpu_uuids=["GPU-b"],
        remote_pid=None, attempt=1, attempt_dir=None, exit_code=None,
    )  # fmt: skip
    multi = SimpleNamespace(nodes=2, status="starting", ranks=[node])
    assert [(r["rank"], r["vm"], r["state"]) for r in ranks_to_dicts(multi)] == [  # type: ignore[arg-type]
        (1, "vm1", "starting")
    ]
