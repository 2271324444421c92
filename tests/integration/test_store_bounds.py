"""What `job pull` and a restore take from a store is not trusted (a job can write into its
place in the store, or into another's in a shared `file://` store): an object larger than
its manifest entry is refused before a byte of it is copied, the total is bounded by
--max-size and the free space, links and special files in a directory store are refused,
and every file is created under a fresh directory renamed into place once whole, so that a
refused pull leaves nothing and a restore writes nowhere but its checkpoint. A real S3 API
on loopback (`rclone serve s3`) and a directory store, as in tests/integration/test_store.py."""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from pathlib import Path

import pytest

from scheduler.store import parse_store_url
from scheduler.store.backend import Backend, FileBackend, StoreError, open_backend
from scheduler.store.sync import pull, restore_newest, upload_checkpoint, upload_final
from tests.integration.test_store import INST, checkpoint
from tests.s3server import S3Server, aws_env

pytestmark = pytest.mark.slow  # rclone for the module

_JOB = iter(range(20_000, 30_000))


@pytest.fixture(scope="module")
def s3(tmp_path_factory: pytest.TempPathFactory) -> Iterator[S3Server]:
    server = S3Server(tmp_path_factory.mktemp("s3"))
    try:
        with aws_env(server):
            yield server
    finally:
        server.stop()


@pytest.fixture(params=["s3", "file"])
def backend(request: pytest.FixtureRequest, s3: S3Server, tmp_path: Path) -> Backend:
    job = next(_JOB)
    if request.param == "s3":
        return open_backend(parse_store_url(f"s3://{s3.bucket}/t"), INST, job)
    return open_backend(parse_store_url(f"file://{tmp_path}/store"), INST, job)


def final_outputs(backend: Backend, tmp_path: Path, size: int = 10) -> None:
    out = tmp_path / "out"
    out.mkdir()
    (out / "model.bin").write_bytes(b"w" * size)
    (out / "tokenizer.json").write_text("{}")
    upload_final(backend, out)


def assert_nothing_left(parent: Path) -> None:
    assert not parent.exists() or list(parent.iterdir()) == []


def test_an_object_larger_than_its_manifest_is_refused_before_it_is_copied(
    backend: Backend, tmp_path: Path
) -> None:
    final_outputs(backend, tmp_path)
    if isinstance(backend, FileBackend):
        os.truncate(backend.root / "final" / "model.bin", 256 << 20)  # sparse: 4 KiB on disk
    else:
        backend.put_bytes(b"\0" * (8 << 20), "final/model.bin")
    copied: list[int] = []
    with pytest.raises(StoreError, match="manifest says 10"):
        pull(backend, tmp_path / "pulls" / "dest", progress=copied.append)
    assert sum(copied) == 0
    assert_nothing_left(tmp_path / "pulls")


def test_max_size_and_free_space_are_checked_before_a_byte_is_copied(
    backend: Backend, tmp_path: Path
) -> None:
    final_outputs(backend, tmp_path, size=3000)
    copied: list[int] = []
    with pytest.raises(StoreError, match="max-size"):
        pull(backend, tmp_path / "pulls" / "dest", progress=copied.append, max_size=1000)
    manifest = {"files": {"model.bin": 1 << 50, "tokenizer.json": 2}, "at": "x"}
    backend.put_bytes(json.dumps(manifest).encode(), "final.json")
    with pytest.raises(StoreError, match="free space"):
        pull(backend, tmp_path / "pulls" / "dest", progress=copied.append, max_size=1 << 62)
    assert sum(copied) == 0
    assert_nothing_left(tmp_path / "pulls")
    # Within the bounds it comes, into a destination that may be an empty directory.
    (tmp_path / "again").mkdir()
    final_outputs(backend, tmp_path / "again", size=3000)
    (tmp_path / "pulls" / "dest").mkdir(parents=True)
    assert pull(backend, tmp_path / "pulls" / "dest", max_size=3002) == "final"
    assert sorted(p.name for p in (tmp_path / "pulls").iterdir()) == ["dest"]
    assert (tmp_path / "pulls" / "dest" / "model.bin").read_bytes() == b"w" * 3000


def test_links_and_special_files_in_a_directory_store_are_refused(tmp_path: Path) -> None:
    backend = open_backend(parse_store_url(f"file://{tmp_path}/store"), INST, next(_JOB))
    assert isinstance(backend, FileBackend)
    final_outputs(backend, tmp_path)
    secret = tmp_path / "secret"
    secret.write_bytes(b"s" * 10)  # the size its manifest says
    model = backend.root / "final" / "model.bin"
    model.unlink()
    model.symlink_to(secret)
    with pytest.raises(StoreError, match="not a regular file"):
        pull(backend, tmp_path / "pulls" / "dest")
    assert_nothing_left(tmp_path / "pulls")
    model.unlink()
    os.mkfifo(model)  # would block an open() for reading until a writer came
    with pytest.raises(StoreError, match="not a regular file|0 bytes, manifest says 10"):
        pull(backend, tmp_path / "pulls" / "dest")
    model.unlink()
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    (elsewhere / "model.bin").write_bytes(b"s" * 10)
    (elsewhere / "tokenizer.json").write_text("{}")
    (backend.root / "final").rename(tmp_path / "moved")
    (backend.root / "final").symlink_to(elsewhere)  # a directory of the key, a link
    with pytest.raises(StoreError, match="not a regular file"):
        pull(backend, tmp_path / "pulls" / "dest")
    assert_nothing_left(tmp_path / "pulls")


def test_a_restore_writes_nowhere_but_its_checkpoint_whatever_the_output_dir_holds(
    backend: Backend, tmp_path: Path
) -> None:
    out = tmp_path / "a"
    checkpoint(out, 4)
    upload_checkpoint(backend, out, 4)
    outside = tmp_path / "outside"
    outside.mkdir()
    for planted in (".rlfleet-restore-4", "checkpoint-4"):
        b = tmp_path / f"b{planted}"
        b.mkdir()
        (b / planted).symlink_to(outside)  # the job placed a link where the restore goes
        assert restore_newest(backend, b) == 4
        assert list(outside.iterdir()) == []
        restored = b / "checkpoint-4"
        assert not restored.is_symlink() and (restored / "sub" / "optimizer.pt").is_file()
        assert sorted(p.name for p in b.iterdir()) == sorted({planted, "checkpoint-4"})


def test_an_object_that_grew_after_its_listing_is_refused_by_the_read_itself(
    backend: Backend, tmp_path: Path
) -> None:
    """Between the listing and the read the job can replace an object: the read takes no
    more than the manifest's size + 1 bytes of it (S3: each ranged part's Content-Range
    must give the manifest's size), and fails. Large objects come in parallel parts, in
    order."""
    data = os.urandom((5 << 20) + 12345)
    backend.put_bytes(data, "final/model.bin")
    if not isinstance(backend, FileBackend):
        backend.PART = 1 << 20  # type: ignore[attr-defined]
    for claimed in (10, 3 << 20):
        got: list[bytes] = []
        with pytest.raises(StoreError, match=f"manifest('s)? (says )?{claimed}"):
            backend.read_into("final/model.bin", got.append, claimed)
        assert sum(map(len, got)) <= claimed
    got = []
    moved: list[int] = []
    backend.read_into("final/model.bin", got.append, len(data), moved.append)
    assert b"".join(got) == data and sum(moved) == len(data)
