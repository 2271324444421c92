"""GPU claims: take free GPUs for jobs atomically, expire dead claims.

A batch of jobs is claimed in one short transaction (docs/invariants.md, invariant 4: no network
I/O inside): its job rows are locked (rows another transaction holds are skipped and retried),
then for each job in turn one statement picks the best-fitting VM, takes its GPU rows with
`FOR UPDATE SKIP LOCKED` and moves the job `queued → starting` with a lease; a job that
fits nowhere moves `queued → pending` in the same transaction. Two dispatchers racing for
the same GPUs can never both win a row (docs/invariants.md, invariant 1); the same job delivered
twice is claimed once, because the second delivery finds it no longer queued. The launched jobs
of a batch are then recorded `running` by one statement (`mark_running_batch`), again with
their event rows.

A batch counts the free GPUs once and plans a shortlist of VMs (`placement.shortlist`), so
that each claim looks at a few VMs' rows instead of counting the whole fleet again; a claim that
misses there falls back to the whole fleet, which alone decides pending and contended.

One module per step:
- `batch.py`: `claim_batch` / `claim_batch_in_session` / `claim_gpus`, the job rows' locks,
  and a row the launch cannot use failing its job (`_fail_unusable`);
- `single.py`: the single-node claim statement (`CLAIM_SQL`, rendered from `jobs.move_values`
  and `placement.tie_break_sql`), `claim_one`, the batch's shortlist;
- `gang.py`: the gang claim of a multi-node job or a job group over several VMs
  (`claim_gang`) and its demands;
- `rules.py`: claim-time rules, registered once, asked before every claim and by the
  pending planner (`ClaimGate`);
- `why.py`: why a job waits (`waiting_reason`, `explain`: the cause named) and `park`;
- `result.py`: `Claim`, `NodeClaim`, `NoClaim`, `job_env_pairs`;
- `records.py`: what a launch records (`mark_running_batch`, `record_ranks`,
  `record_group_ports`);
- `leases.py`: `expire_leases`, claims whose launch was never confirmed.

What a free GPU is, and giving GPUs back, is `scheduler.gpus`; attempts left behind on a
VM are `scheduler.leftovers`.
"""
