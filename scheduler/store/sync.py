"""Copying a job's checkpoints and final outputs to and from its store (the layout is in
`scheduler.store`'s docstring).

A checkpoint is uploaded only once it is complete (`trainer_state.json` parses, the file
Hugging Face's trainer writes last) and its files have stopped changing; its manifest is
written after every file, and only a checkpoint with a manifest is ever restored, each file
checked against the manifest's size. The final outputs (every file of the output
directory outside `checkpoint-N/`) are followed by the final marker the same way.

A manifest lists each file's size and sha256; its own digest (`binding.manifest_digest`)
is what the agent reports and the poller records. Given `accepted_digests` (what the
job's own attempts reported), restore and pull take only a manifest of those, and check
every file's sha256 against it (`scheduler.store.binding`).
"""

from __future__ import annotations

import json
import os
import re
import time
from collections.abc import Callable, Collection, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from scheduler.fresh_tree import (
    FREE_SPACE_RESERVE,
    FreshTree,
    TreeError,
    free_bytes,
    split_name,
    write_all,
)
from scheduler.store.backend import Backend, Progress, StoreError, check_key, remove_tree
from scheduler.store.binding import (
    NotReported,
    check_files,
    file_sha256,
    is_digest,
    manifest_digest,
)

CHECKPOINT = re.compile(r"^checkpoint-(\d{1,9})$")
_MANIFEST = re.compile(r"^checkpoints/checkpoint-(\d{1,9})\.json$")
FINAL_MARKER = "final.json"
KEEP_CHECKPOINTS = 3
"""The store keeps the newest this many complete checkpoints of a job; older ones are
deleted after each upload (a store-side keep-last-K, whatever `save_total_limit` says)."""
MANIFEST_MAX = 4 << 20
"""A manifest bigger than this is not one rlfleet wrote."""
RESTORE_TMP = ".rlfleet-restore"
_SKIPPED_TOP = re.compile(r"^(checkpoint-\d+|\.rlfleet-restore.*)$")


@dataclass(frozen=True)
class Snapshot:
    """A directory's files: relative path -> (size, mtime_ns)."""

    files: dict[str, tuple[int, int]]

    @property
    def size(self) -> int:
        return sum(size for size, _ in self.files.values())


def snapshot(root: Path, skip_top: re.Pattern[str] | None = None) -> Snapshot:
    """Every regular file under `root` (symlinks are not followed nor kept)."""
    files: dict[str, tuple[int, int]] = {}
    for dirpath, dirs, names in os.walk(root):
        here = Path(dirpath)
        if skip_top is not None and here == root:
            dirs[:] = [d for d in dirs if not skip_top.match(d)]
            names = [n for n in names if not skip_top.match(n)]
        for name in names:
            path = here / name
            try:
                st = path.lstat()
            except OSError:
                continue
            if path.is_symlink() or not path.is_file():
                continue
            rel = path.relative_to(root).as_posix()
            try:
                check_key(rel)
            except StoreError:
                continue  # a name no key may hold: not ours to carry
            files[rel] = (st.st_size, st.st_mtime_ns)
    return Snapshot(files)


def is_complete(checkpoint: Path) -> bool:
    """A checkpoint directory counts once its `trainer_state.json` parses."""
    try:
        with open(checkpoint / "trainer_state.json", "rb") as f:
            json.loads(f.read(64 << 20))
    except (OSError, ValueError):
        return False
    return True


def local_steps(output_dir: Path) -> list[int]:
    """The steps of the complete `checkpoint-N` directories in `output_dir`, ascending."""
    if not output_dir.is_dir():
        return []
    steps = []
    for entry in output_dir.iterdir():
        match = CHECKPOINT.match(entry.name)
        if match and entry.is_dir() and not entry.is_symlink() and is_complete(entry):
            steps.append(int(match.group(1)))
    return sorted(steps)


def _now() -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())


def stored_checkpoints(backend: Backend) -> dict[int, dict[str, Any]]:
    """The complete checkpoints in the store (those with a manifest): step -> manifest
    summary (`bytes`, `at`)."""
    found: dict[int, dict[str, Any]] = {}
    for key in backend.list("checkpoints/"):
        match = _MANIFEST.match(key)
        if match:
            found[int(match.group(1))] = {}
    for step in sorted(found)[-KEEP_CHECKPOINTS * 2 :]:
        manifest = read_manifest(backend, f"checkpoints/checkpoint-{step}.json")
        if manifest is not None:
            found[step] = {"bytes": manifest["bytes"], "at": manifest["at"]}
    return {s: m for s, m in found.items() if m}


def read_manifest(
    backend: Backend, key: str, accepted: Collection[str] | None = None
) -> dict[str, Any] | None:
    """A manifest from the store, checked (files with sizes under plain keys, and their
    sha256 when it lists them); None when there is none or it is not one rlfleet wrote,
    or, given `accepted`, when its digest is not one of those."""
    raw = backend.get_bytes(key, MANIFEST_MAX + 1)
    if raw is None or (accepted is not None and manifest_digest(raw) not in accepted):
        return None
    return parse_manifest(raw)


def parse_manifest(raw: bytes) -> dict[str, Any] | None:
    """`read_manifest` of bytes already read."""
    if len(raw) > MANIFEST_MAX:
        return None
    try:
        data = json.loads(raw)
        files = {check_key(str(k)): int(v) for k, v in data["files"].items()}
        at = str(data.get("at", ""))[:40]
        sums = data.get("sha256")
        sha256 = None if sums is None else {check_key(str(k)): v for k, v in sums.items()}
    except (ValueError, KeyError, TypeError, AttributeError, StoreError):
        return None
    if any(size < 0 for size in files.values()):
        return None
    if sha256 is not None and (
        set(sha256) != set(files) or not all(map(is_digest, sha256.values()))
    ):
        return None
    return {"files": files, "bytes": sum(files.values()), "at": at, "sha256": sha256}


def final_digest(backend: Backend) -> str | None:
    """The digest of the store's final marker, when there is one rlfleet could have
    written; None otherwise."""
    raw = backend.get_bytes(FINAL_MARKER, MANIFEST_MAX + 1)
    if raw is None or parse_manifest(raw) is None:
        return None
    return manifest_digest(raw)


def upload_tree(
    backend: Backend,
    root: Path,
    prefix: str,
    manifest_key: str,
    *,
    skip_top: re.Pattern[str] | None = None,
    progress: Progress | None = None,
    on_digest: Callable[[str], None] | None = None,
) -> int | None:
    """Upload every file under `root` to `prefix/…`, then the manifest at `manifest_key`
    (each file's size and sha256); the bytes uploaded, the manifest's digest to
    `on_digest`. None (no manifest written) when the files changed meanwhile."""
    before = snapshot(root, skip_top)
    sums = {}
    for rel in sorted(before.files):
        sums[rel] = file_sha256(root / rel)
        backend.put_file(root / rel, f"{prefix}/{rel}", progress)
    if snapshot(root, skip_top) != before:
        return None
    files = {rel: size for rel, (size, _) in before.files.items()}
    raw = json.dumps({"files": files, "sha256": sums, "at": _now()}, sort_keys=True).encode()
    backend.put_bytes(raw, manifest_key)
    if on_digest is not None:
        on_digest(manifest_digest(raw))
    return before.size


def upload_checkpoint(
    backend: Backend,
    output_dir: Path,
    step: int,
    on_digest: Callable[[str], None] | None = None,
) -> int | None:
    """Upload `checkpoint-<step>` and its manifest; its size, or None if it changed."""
    name = f"checkpoint-{int(step)}"
    return upload_tree(
        backend, output_dir / name, f"checkpoints/{name}", f"checkpoints/{name}.json",
        on_digest=on_digest,
    )  # fmt: skip


def prune(
    backend: Backend, keep: int = KEEP_CHECKPOINTS, ours: Collection[int] | None = None
) -> list[int]:
    """Delete every checkpoint of the store but the newest `keep` complete ones (the
    manifest first, so a reader never takes a checkpoint whose files are going); their
    steps. Given `ours` (the steps the job's attempts wrote), the newest `keep` of those
    stay and every other goes: what another job put in the place never pushes out the
    job's own."""
    listed = backend.list("checkpoints/")
    steps = sorted(int(m.group(1)) for k in listed if (m := _MANIFEST.match(k)))
    mine = steps if ours is None else [s for s in steps if s in ours]
    old = mine[:-keep] if keep > 0 else mine
    if ours is not None:
        old = sorted({*old, *(s for s in steps if s not in ours)})
    for step in old:
        backend.delete([f"checkpoints/checkpoint-{step}.json"])
        inside = f"checkpoints/checkpoint-{step}/"
        backend.delete([k for k in listed if k.startswith(inside)])
    return old


def download_tree(
    backend: Backend,
    manifest: dict[str, Any],
    prefix: str,
    dest: Path,
    progress: Progress | None = None,
    *,
    max_size: int | None = None,
    tmp_prefix: str = ".rlfleet-pull-",
    check: Callable[[Path], str | None] | None = None,
) -> None:
    """Fetch every file of a manifest from `prefix/…` into `dest` (absent, or an empty
    directory), trusting nothing of the store: the total is checked against `max_size` and
    the free space, and every object's listed size against its manifest entry, before a
    byte is copied; no more than its manifest's size + 1 bytes of any object are read.
    Files are created by `FreshTree` (no link followed, none made) in a fresh directory
    beside `dest`, renamed into place once whole. `StoreError` (and nothing left) when one
    is missing, differs, or the bounds are passed; `NotReported` (and nothing left) when
    `check`, given the whole fresh directory before the rename, says what is wrong."""
    total = sum(manifest["files"].values())
    if max_size is not None and total > max_size:
        raise StoreError(f"{prefix}: {total} bytes in the store, more than --max-size ({max_size})")
    if total > free_bytes(_existing(dest.parent)) - FREE_SPACE_RESERVE:
        raise StoreError(f"{prefix}: {total} bytes, more than the free space at {dest.parent}")
    listed = backend.list(f"{prefix}/")
    for rel, size in sorted(manifest["files"].items()):
        have = listed.get(f"{prefix}/{rel}")
        if have is None:
            raise StoreError(f"{prefix}/{rel}: missing from the store")
        if have != size:
            raise StoreError(f"{prefix}/{rel}: {have} bytes, manifest says {size}")
    try:
        tree = FreshTree(dest, prefix=tmp_prefix)
    except TreeError as exc:
        raise StoreError(str(exc)) from None
    try:
        for rel, size in sorted(manifest["files"].items()):
            _fetch(backend, tree, f"{prefix}/{rel}", rel, size, progress)
        problem = None if check is None else check(tree.path)
        if problem is not None:
            raise NotReported(f"{prefix}: {problem}")
        tree.commit()
    except TreeError as exc:
        tree.discard()
        raise StoreError(str(exc)) from None
    except OSError as exc:
        tree.discard()
        raise StoreError(f"writing into {dest}: {exc.strerror or exc}") from None
    except BaseException:
        tree.discard()
        raise


def _existing(path: Path) -> Path:
    """`path` or its nearest ancestor that exists."""
    while not path.exists() and path != path.parent:
        path = path.parent
    return path


def _fetch(
    backend: Backend, tree: FreshTree, key: str, rel: str, size: int, progress: Progress | None
) -> None:
    """One object into a new file of `tree` (exactly its manifest's size)."""
    parts = split_name(rel.encode())
    fd = tree.create_file(parts, 0o644) if parts is not None else None
    if fd is None:
        raise StoreError(f"{key}: its name is taken in the manifest or not a plain name")
    try:
        backend.read_into(key, lambda chunk: write_all(fd, chunk), size, progress)
    finally:
        os.close(fd)


def restore_newest(
    backend: Backend,
    output_dir: Path,
    progress: Progress | None = None,
    *,
    accepted_digests: Mapping[int, Collection[str]] | None = None,
    on_refused: Callable[[str], None] | None = None,
) -> int | None:
    """Put the store's newest complete checkpoint into `output_dir` (unless a complete
    one as new is already there); its step, or None when the store has none.

    It is fetched into a fresh directory beside it (`download_tree`) and renamed into
    place only once every file is in and of its manifest's size: `--resume auto` never
    sees half of it, and a link the job left in its place is removed, never followed.
    Given `accepted_digests` (step -> the manifest digests the job's attempts reported),
    only such a manifest counts, and only once every file has the sha256 it lists (checked
    before the rename): the newest checkpoint that passes is taken, any other passed over
    (said to `on_refused`)."""
    if accepted_digests is None:
        steps = sorted(stored_checkpoints(backend))[-1:]
    else:
        steps = [s for s in manifest_steps(backend) if s in accepted_digests]
    for step in reversed(steps):
        if any(s >= step for s in local_steps(output_dir)):
            return step
        accepted = None if accepted_digests is None else accepted_digests[step]
        problem = _restore(backend, output_dir, step, accepted, progress)
        if problem is None:
            return step
        if on_refused is not None:
            on_refused(f"checkpoint-{step} in the store passed over: {problem}")
    return None


def _restore(
    backend: Backend,
    output_dir: Path,
    step: int,
    accepted: Collection[str] | None,
    progress: Progress | None,
) -> str | None:
    """Fetch checkpoint `step` into place through a fresh directory: None once it is
    there, else (given `accepted`) why it was not taken."""
    manifest = read_manifest(backend, f"checkpoints/checkpoint-{step}.json", accepted)
    if manifest is None:
        if accepted is None:
            raise StoreError(f"checkpoint-{step}: its manifest went away while restoring")
        return "its manifest is not one this job's attempts reported"
    final = output_dir / f"checkpoint-{step}"
    remove_tree(final)  # an incomplete one of the same step left by a crash
    check = None if accepted is None else (lambda root: check_files(manifest, root))
    try:
        download_tree(backend, manifest, f"checkpoints/checkpoint-{step}", final, progress,
                      tmp_prefix=f"{RESTORE_TMP}-{step}-", check=check)  # fmt: skip
    except NotReported as exc:
        return str(exc)
    return None


def manifest_steps(backend: Backend) -> list[int]:
    """The steps of the checkpoint manifests in the store, ascending."""
    listed = backend.list("checkpoints/")
    return sorted(int(m.group(1)) for k in listed if (m := _MANIFEST.match(k)))


def upload_final(
    backend: Backend,
    output_dir: Path,
    progress: Progress | None = None,
    on_digest: Callable[[str], None] | None = None,
) -> int:
    """Upload the final outputs (the output directory but its `checkpoint-N/`), then the
    final marker; the bytes uploaded (the marker's digest to `on_digest`)."""
    for _ in range(3):
        size = upload_tree(
            backend, output_dir, "final", FINAL_MARKER, skip_top=_SKIPPED_TOP, progress=progress,
            on_digest=on_digest,
        )  # fmt: skip
        if size is not None:
            return size
    raise StoreError("the final outputs kept changing while they were uploaded")


def pull(
    backend: Backend,
    dest: Path,
    checkpoint: int | None = None,
    progress: Progress | None = None,
    on_size: Callable[[int], None] | None = None,
    *,
    max_size: int | None = None,
    accepted_digests: Collection[str] | None = None,
) -> str:
    """Download the final outputs (or checkpoint `checkpoint`) into `dest` (absent or an
    empty directory), at most `max_size` bytes (`download_tree`); what was fetched
    (`final` or `checkpoint-N`). `StoreError` when it is not in the store, or refused;
    given `accepted_digests` (what the job's attempts reported of it), `NotReported` when
    its manifest is none of them or a file's sha256 is not the one the manifest lists
    (nothing is left in `dest` then)."""
    if checkpoint is None:
        manifest = read_manifest(backend, FINAL_MARKER)
        if manifest is None:
            raise StoreError("the job's final outputs are not in the store (not completed yet)")
        prefix, what = "final", "final"
    else:
        manifest = read_manifest(backend, f"checkpoints/checkpoint-{int(checkpoint)}.json")
        if manifest is None:
            steps = sorted(stored_checkpoints(backend))
            have = ", ".join(map(str, steps)) or "none"
            raise StoreError(f"no complete checkpoint {checkpoint} in the store (steps: {have})")
        prefix = what = f"checkpoints/checkpoint-{int(checkpoint)}"
        what = f"checkpoint-{int(checkpoint)}"
    if accepted_digests is not None:
        key = FINAL_MARKER if checkpoint is None else f"{prefix}.json"
        manifest = read_manifest(backend, key, accepted_digests)
        if manifest is None:
            raise NotReported(f"{key} in the store is not one this job's attempts reported")
    if on_size is not None:
        on_size(manifest["bytes"])
    check = None if accepted_digests is None else (lambda root: check_files(manifest, root))
    download_tree(backend, manifest, prefix, dest, progress, max_size=max_size, check=check)
    return what
