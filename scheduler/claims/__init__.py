"""GPU claims: take free GPUs for jobs atomically, expire dead claims.

One claim path for every kind of job (`claim.claim`): a single-node job or a group on one
VM is an attempt of one rank, a multi-node job or a group over several VMs one of several,
and each rank needs the GPUs its shape says (`attempts.shape.JobShape.demands`).

A batch of jobs is claimed in one short transaction (docs/invariants.md, invariant 4: no
network I/O inside): its job rows are locked (rows another transaction holds are skipped
and retried); the free GPUs are counted once and the rows a shortlist names
(`placement.shortlist`, best fit played out on that count) are locked with
`FOR UPDATE SKIP LOCKED`; then each queued job in turn has its ranks assigned among the
locked rows (`placement.assign`, pure: distinct VMs, most demanding rank first, best fit,
ties spread per job, GPUs lowest index first) and ONE statement takes them, moves the job
`queued → starting` with a lease and its event, and writes every rank's `job_nodes` row,
replacing the earlier attempt's. A claim that finds no room there locks candidates on the
whole fleet, which alone decides `contended` (other claimers hold the rows: try again) and
`pending` (with the reason, `park.park`). Two dispatchers racing for the same GPUs can never
both win a row, and a gang takes every rank or none (docs/invariants.md, invariant 1); the
same job delivered twice is claimed once, because the second delivery finds it no longer
queued. The launched jobs of a batch are then recorded `running` by one statement
(`mark_running_batch`), again with their event rows.

One module per step:
- `batch.py`: `claim_batch` / `claim_batch_in_session` / `claim_gpus`, the job rows' locks,
  and a row the launch cannot use failing its job (`_fail_unusable`);
- `claim.py`: `claim`, the one claim path; `lock_shortlist`, the batch's locked rows;
- `statements.py`: its SQL (`LOCK_SHORTLIST_SQL`, `LOCK_SQL`, `TAKE_SQL`, rendered from
  `jobs.move_set_sql` and the placement's SQL fragments);
- `rules.py`: claim-time rules, registered once, asked before every claim and by the
  pending planner (`ClaimGate`);
- `why.py`: why a job waits (`waiting_reason`, `explain`: the cause named) and `park`
  (`queued → pending` with the reason, for every kind of job);
- `result.py`: `Claim`, `NodeClaim`, `NoClaim`, `job_env_pairs`;
- `records.py`: what a launch learns and records (`mark_running_batch`, each rank's pid and
  directory `record_ranks`, `record_group_ports`); where ranks run is the claim's alone;
- `leases.py`: `expire_leases`, claims whose launch was never confirmed.

What a free GPU is, and giving GPUs back, is `scheduler.gpus`; which GPUs and VMs are
eligible and in what order they are picked is `scheduler.placement`; attempts left behind
on a VM are `scheduler.leftovers`.
"""
