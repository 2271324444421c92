"""What a job's workdir costs (`job submit --workdir`): packing it where the CLI runs,
sending it to a VM that lacks it, and asking a VM that has it.

A VM of the SSH test fleet on loopback. Each workdir is a reward module and a dataset:
`jsonl` a JSONL dataset of `--jsonl-mib` MiB (compresses well, as real datasets do) and
`random` a file of `--random-mib` MiB of random bytes (the worst case: incompressible).
For each, in the same run, over the same SSH connection:

- `pack_s`: `scheduler.workdir.pack`, against `tar -czf` of the same directory;
- `send_s`: the dispatcher's transfer (base64 on stdin of the VM's receiver, which checks
  the digest and every member, and renames the directory into place) against the plain
  `base64 -d | tar -xzf -` of the same bytes;
- `hit_s`: asking a VM that has it (`has_script`, one round trip), which is what every
  later attempt on that VM pays.

    .venv/bin/python bench/workdir.py [--jsonl-mib 100] [--random-mib 32]

prints one line per workdir:
`workdir jsonl: files_mib=… packed_mib=… pack_s=… tar_s=… send_s=… plain_send_s=… hit_s=…`.
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import os
import shlex
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from scheduler.remote.workdir import (  # noqa: E402
    has_script,
    parse_has,
    parse_ready,
    receive_script,
)
from scheduler.transport import make_transport  # noqa: E402
from scheduler.workdir import pack  # noqa: E402
from tests.fleet import SimFleet  # noqa: E402

INSTALLATION = "0b8f1c2e-1111-4222-8333-944455556666"
LINE = b'{"question": "What is 98 + 54?", "answer": "98 + 54 = 152\\n#### 152"}\n'


def make(root: Path, mib: int, random: bool) -> Path:
    """A workdir: `my_rewards.py` and `data/train.jsonl` of `mib` MiB."""
    (root / "data").mkdir(parents=True)
    (root / "my_rewards.py").write_text("def fn(prompts, completions, **kw):\n    return []\n")
    with open(root / "data" / "train.jsonl", "wb") as out:
        if random:
            out.write(os.urandom(mib << 20))
        else:
            for i in range((mib << 20) // len(LINE)):
                out.write(LINE.replace(b"98", str(i % 1000).encode()))
    return root


async def measure(label: str, root: Path, mib: int, random: bool) -> str:
    source = make(root / label, mib, random)
    start = time.perf_counter()
    packed = pack(source)
    pack_s = time.perf_counter() - start
    start = time.perf_counter()
    subprocess.run(["tar", "-czf", str(root / f"{label}.tgz"), "-C", str(source), "."], check=True)
    tar_s = time.perf_counter() - start
    fleet = SimFleet(root / f"fleet-{label}")
    vm = await fleet.add_vm()
    target = vm.target()
    transport = make_transport()
    text = base64.b64encode(packed.data).decode("ascii")
    try:
        await transport.run(target, "true", timeout=30)  # the connection, opened once
        start = time.perf_counter()
        sent = await transport.run(
            target,
            receive_script(sys.executable, INSTALLATION, packed.digest),
            timeout=600,
            input=text,
        )
        send_s = time.perf_counter() - start
        assert parse_ready(sent.stdout), sent.stderr
        plain = shlex.quote(str(vm.home / "plain"))
        start = time.perf_counter()
        untarred = await transport.run(
            target,
            f"mkdir -p {plain} && base64 -d | tar -xzf - -C {plain}",
            timeout=600,
            input=text,
        )
        plain_s = time.perf_counter() - start
        assert untarred.ok, untarred.stderr
        start = time.perf_counter()
        asked = await transport.run(target, has_script(INSTALLATION, packed.digest), timeout=30)
        hit_s = time.perf_counter() - start
        assert parse_has(asked.stdout) is True
    finally:
        await transport.close()
        await fleet.close()
    return (
        f"workdir {label}: files_mib={packed.unpacked / 2**20:.1f} "
        f"packed_mib={packed.size / 2**20:.2f} pack_s={pack_s:.2f} tar_s={tar_s:.2f} "
        f"send_s={send_s:.2f} plain_send_s={plain_s:.2f} hit_s={hit_s:.3f}"
    )


async def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--jsonl-mib", type=int, default=100)
    parser.add_argument("--random-mib", type=int, default=32)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="rlfleet-bench-workdir-") as tmp:
        root = Path(tmp)
        print(await measure("jsonl", root, args.jsonl_mib, False), flush=True)
        print(await measure("random", root, args.random_mib, True), flush=True)


if __name__ == "__main__":
    asyncio.run(main())
