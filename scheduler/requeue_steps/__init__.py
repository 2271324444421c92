"""The steps of one requeue tick, one module each; `scheduler.requeue.RequeueManager.tick`
composes them (the order, the lock and the transaction are its business).

- `scheduler.claims.leases.expire_leases`: expired claims back to `queued`;
- `lost_nodes`: live jobs of VMs lost for too long fail with `node_lost`;
- `retries`: failed jobs get a retry decision, and those whose time has come are queued;
- `wake_pending`: pending jobs that fit the free GPUs (or waited long enough) are queued;
- `scheduler.leftovers.LeftoverSweep`: leftover attempts are killed over SSH;
- `announce`: queued jobs never (or long ago) announced are published on `jobs.new`.

Each database step runs inside the caller's transaction and does no network I/O
(docs/invariants.md, invariant 4).
"""

from __future__ import annotations

BATCH = 500
"""Most jobs handled per step per tick; the rest wait for the next tick."""
