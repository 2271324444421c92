"""Benchmark: a burst of 1-, 2- and 4-node jobs through the real dispatcher, publish → running,
against a burst of as many single-node jobs in the same process (the baseline).

The fleet, the dispatchers and the stand-in transport are those of bench/dispatch.py (250
VMs × 8 GPUs as polled rows, dispatcher processes answering each launch after
`--launch-ms`): a multi-node job costs one gang claim (K × N GPU rows locked on K VMs in
the claim transaction), a port probe on rank 0's VM, K concurrent launches and one more
short transaction recording the ranks. The mix (default 500 jobs): 60% 1 × 1 GPU, 25%
2 nodes × 2 GPUs, 15% 4 nodes × 2 GPUs, shuffled with a fixed seed: about 70% of the
fleet's GPUs, so every job fits at once and none waits in `pending`.

    .venv/bin/python bench/multinode.py [--jobs 500] [--vms 250] [--launch-ms 10] [--dispatchers 2]

Claim latency is `starting_at − publish time` (the gang claim committed), latency
`running_at − publish time`. The last line, from the database after the run, is
`multinode: jobs=… jobs_per_s=… claim_p99_ms=… p99_ms=… partial_claims=0 double_booked=0`
(scheduler/gpus.py, `PARTIAL_CLAIMS_SQL` and `DOUBLE_BOOKED_SQL`).
"""

from __future__ import annotations

import argparse
import asyncio
import random
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from dispatch import measure  # noqa: E402

from scheduler.embedded import EmbeddedNats, EmbeddedPostgres  # noqa: E402

MIX = ((1, 1, 0.60), (2, 2, 0.25), (4, 2, 0.15))
"""(nodes, GPUs per node, share of the jobs)."""


def mixed_shapes(n_jobs: int, seed: int = 11) -> list[tuple[int, int]]:
    """`n_jobs` shapes in the proportions of `MIX`, shuffled (the same for a seed)."""
    shapes: list[tuple[int, int]] = []
    for nodes, gpus, share in MIX:
        shapes += [(nodes, gpus)] * round(n_jobs * share)
    shapes = (shapes + [(1, 1)] * n_jobs)[:n_jobs]
    random.Random(seed).shuffle(shapes)
    return shapes


def line(label: str, jobs: int, r: dict[str, float]) -> str:
    """The figures of one run, in the format scripts parse."""
    return (
        f"{label}: jobs={jobs} jobs_per_s={r['jobs_per_s']:.0f} gpus_per_s={r['gpus_per_s']:.0f} "
        f"claim_p99_ms={r['claim_p99_ms']:.0f} p50_ms={r['p50_ms']:.0f} "
        f"p99_ms={r['p99_ms']:.0f} partial_claims={int(r['partial_claims'])} "
        f"double_booked={int(r['double_booked'])}"
    )


async def main() -> None:
    """The single-node baseline, then the mix; print both and the ratio."""
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--jobs", type=int, default=500)
    parser.add_argument("--vms", type=int, default=250)
    parser.add_argument("--launch-ms", type=float, default=10.0)
    parser.add_argument("--dispatchers", type=int, default=2)
    parser.add_argument("--no-durable", action="store_true", help="fsync off in Postgres")
    args = parser.parse_args()
    shapes = mixed_shapes(args.jobs)
    counts = {k: sum(1 for n, _g in shapes if n == k) for k in (1, 2, 4)}
    gpus = sum(n * g for n, g in shapes)
    print(f"mix: {counts} nodes→jobs, {gpus} GPUs of {args.vms * 8}", flush=True)
    if gpus > args.vms * 8 * 0.8:
        # The bench waits for every job to run: a mix that does not fit would only time out.
        raise SystemExit(
            f"the mix needs {gpus} GPUs: too many for {args.vms} VMs; use fewer --jobs"
        )
    with tempfile.TemporaryDirectory(prefix="rlfleet-bench-") as tmp:
        pg = EmbeddedPostgres(Path(tmp) / "pg", durable=not args.no_durable)
        pg.start()
        nats_server = EmbeddedNats(Path(tmp) / "nats").start()
        try:
            single = await measure(pg, nats_server.url, args, args.dispatchers, 1)
            print(line("single-node", args.jobs, single), flush=True)
            mixed = await measure(pg, nats_server.url, args, args.dispatchers, 2, shapes=shapes)
            print(
                f"ratio: mix / single-node = {mixed['jobs_per_s'] / single['jobs_per_s']:.2f}x "
                f"jobs/s, {mixed['claim_p99_ms'] / single['claim_p99_ms']:.2f}x claim p99",
                flush=True,
            )
            print(line("multinode", args.jobs, mixed), flush=True)
        finally:
            nats_server.stop()
            pg.stop()
    if mixed["partial_claims"] or mixed["double_booked"]:
        raise SystemExit(1)


if __name__ == "__main__":
    asyncio.run(main())
