"""The tar stream `job pull` takes from a VM is hostile (a job can choose what its VM
account's shell runs): crafted streams, fed as the SSH channel hands them over, never write
outside DEST, never leave a link in it, never exceed --max-size, and a refused stream leaves
nothing behind (`scheduler/untar.py`)."""

from __future__ import annotations

import io
import os
import stat
import subprocess
import tarfile
from pathlib import Path

import pytest

from scheduler.untar import ExtractError, TarSink

SECRET = b"the operator's file\n"


@pytest.fixture
def base(tmp_path: Path) -> Path:
    """`base/outside` (one file the stream must not touch) beside where DEST goes."""
    (tmp_path / "outside").mkdir()
    (tmp_path / "outside" / "keep").write_bytes(SECRET)
    return tmp_path


def extract(stream: bytes, dest: Path, *, chunk: int = 4096, **options: int) -> TarSink:
    """Feed `stream` in `chunk`-byte pieces, as the transport does, then finish."""
    sink = TarSink(dest, **options)
    try:
        for start in range(0, len(stream), chunk):
            sink.feed(stream[start : start + chunk])
        sink.finish()
    except BaseException:
        sink.abort()
        raise
    return sink


def tar_of(*members: tuple[tarfile.TarInfo, bytes | None]) -> bytes:
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w", format=tarfile.GNU_FORMAT,
                      errors="surrogateescape") as tar:  # fmt: skip
        for info, data in members:
            if data is not None:
                info.size = len(data)
            tar.addfile(info, io.BytesIO(data) if data is not None else None)
    return buf.getvalue()


def entry(name: str, kind: bytes = tarfile.REGTYPE, *, data: bytes | None = None,
          link: str = "", mode: int = 0o644) -> tuple[tarfile.TarInfo, bytes | None]:  # fmt: skip
    info = tarfile.TarInfo(name)
    info.type, info.linkname, info.mode = kind, link, mode
    if kind == tarfile.REGTYPE and data is None:
        data = b""
    return info, data


def raw_header(name: bytes, kind: bytes = b"0", size: int = 0, mode: int = 0o644) -> bytes:
    """One ustar header block, written by hand (any bytes in the name)."""
    block = bytearray(512)
    block[0 : len(name)] = name
    block[100:108] = b"%07o\0" % mode
    block[108:116] = block[116:124] = b"0000000\0"
    # GNU's base-256 for a size past the 11 octal digits (8 GiB).
    block[124:136] = b"%011o\0" % size if size < 8**11 else b"\x80" + size.to_bytes(11, "big")
    block[136:148] = b"00000000000\0"
    block[156:157] = kind
    block[257:265] = b"ustar\x0000"
    block[148:156] = b" " * 8
    block[148:156] = b"%06o\0 " % sum(block)
    return bytes(block)


def body(*members: tuple[tarfile.TarInfo, bytes | None]) -> bytes:
    """The members without the end-of-archive blocks (the last one's data not ending in
    zeros), for hand-made entries to follow."""
    return padded(tar_of(*members).rstrip(b"\0"))


def padded(data: bytes) -> bytes:
    return data + b"\0" * (-len(data) % 512)


END = b"\0" * 1024


def assert_contained(base: Path, dest: Path) -> None:
    """Nothing outside DEST changed, nothing else appeared beside it, no link in it."""
    assert sorted(p.name for p in base.iterdir()) == sorted(["outside", dest.name])
    assert [p.name for p in (base / "outside").iterdir()] == ["keep"]
    assert (base / "outside" / "keep").read_bytes() == SECRET
    for dirpath, dirs, files in os.walk(dest):
        for name in dirs + files:
            st = os.lstat(os.path.join(dirpath, name))
            assert stat.S_ISDIR(st.st_mode) or stat.S_ISREG(st.st_mode), (dirpath, name)
            assert stat.S_ISDIR(st.st_mode) or st.st_nlink == 1, (dirpath, name)
            assert not st.st_mode & (stat.S_ISUID | stat.S_ISGID | stat.S_ISVTX), name


def assert_nothing_left(base: Path) -> None:
    assert [p.name for p in base.iterdir()] == ["outside"]
    assert [p.name for p in (base / "outside").iterdir()] == ["keep"]


def cve_2025_4517_stream(
    escape_to: str = "../outside", file_name: str = "written", data: bytes = b"pwned\n"
) -> bytes:
    """Google's CVE-2025-4517 shape: a chain of links whose resolved path passes PATH_MAX
    (where os.path.realpath of Python < 3.11.13 stops resolving), a link through them to
    `escape_to` (relative to DEST), then a file written through that link."""
    comp, steps, path = "d" * 247, "abcdefghijklmnop", ""
    members = []
    for step in steps:
        members.append(entry(os.path.join(path, comp), tarfile.DIRTYPE))
        members.append(entry(os.path.join(path, step), tarfile.SYMTYPE, link=comp))
        path = os.path.join(path, comp)
    chain = os.path.join("/".join(steps), "l" * 254)
    members.append(entry(chain, tarfile.SYMTYPE, link="../" * len(steps)))
    members.append(entry("escape", tarfile.SYMTYPE, link=f"{chain}/{escape_to}"))
    members.append(entry(f"escape/{file_name}", data=data))
    return tar_of(*members)


def test_the_cve_2025_4517_chain_writes_nothing_outside(base: Path) -> None:
    dest = base / "dest"
    sink = extract(cve_2025_4517_stream(), dest)
    assert_contained(base, dest)
    assert "escape" in sink.skipped and "a" in sink.skipped
    # The file itself is the job's own output: it lands inside, under a real directory.
    assert (dest / "escape" / "written").read_bytes() == b"pwned\n"


def test_a_link_extracted_before_the_chain_it_goes_through_is_left_out(base: Path) -> None:
    """`l -> sub/up/..` passes a check made while `sub/up` is not there yet; once
    `sub/up -> ..` comes, `l` points at DEST's parent. And a file through a link that
    points inside is written into a real directory, never through the link."""
    dest = base / "dest"
    sink = extract(tar_of(
        entry("l", tarfile.SYMTYPE, link="sub/up/.."),
        entry("sub", tarfile.DIRTYPE, mode=0o755),
        entry("sub/up", tarfile.SYMTYPE, link=".."),
        entry("in", tarfile.SYMTYPE, link="sub"),
        entry("in/f", data=b"x"),
    ), dest)  # fmt: skip
    assert_contained(base, dest)
    assert sorted(sink.skipped) == ["in", "l", "sub/up"]
    assert (dest / "in" / "f").read_bytes() == b"x" and not (dest / "sub" / "f").exists()


def test_hard_links_devices_fifos_and_unknown_kinds_are_left_out_and_named(base: Path) -> None:
    dest = base / "dest"
    sink = extract(tar_of(
        entry("model.bin", data=b"weights"),
        entry("same", tarfile.LNKTYPE, link="model.bin"),
        entry("out", tarfile.LNKTYPE, link="../outside/keep"),
        entry("abs", tarfile.LNKTYPE, link=str(base / "outside" / "keep")),
        entry("null", tarfile.CHRTYPE),
        entry("disk", tarfile.BLKTYPE),
        entry("fifo", tarfile.FIFOTYPE),
        entry("odd", b"Z", data=b"a file of a kind no tar writes"),
        entry("suid", data=b"#!/bin/sh\n", mode=0o6755),
        entry("sticky", tarfile.DIRTYPE, mode=0o1777),
    ), dest)  # fmt: skip
    assert_contained(base, dest)
    assert sorted(sink.skipped) == ["abs", "disk", "fifo", "null", "odd", "out", "same"]
    assert sorted(p.name for p in dest.iterdir()) == ["model.bin", "sticky", "suid"]
    assert stat.S_IMODE((dest / "suid").stat().st_mode) == 0o755
    assert stat.S_IMODE((dest / "sticky").stat().st_mode) == 0o755


def test_absolute_dotdot_empty_odd_and_invalid_utf8_names_are_refused(base: Path) -> None:
    dest = base / "dest"
    stream = b"".join([
        body(
            entry(str(base / "outside" / "abs"), data=b"x"),
            entry("../outside/dotdot", data=b"x"),
            entry("a/../../outside/mid", data=b"x"),
            entry("a//b", data=b"x"),
            entry("a/./c", data=b"x"),
            entry("line\nbreak", data=b"x"),
            entry("deep/" * 100 + "f", data=b"x"),
            entry("n" * 300, data=b"x"),
            entry("ok/file", data=b"fine"),
        ),
        raw_header(b"bad-\xff\xfe-name", size=1), padded(b"x"),
        END,
    ])  # fmt: skip
    sink = extract(stream, dest)
    assert_contained(base, dest)
    files = sorted(p.relative_to(dest).as_posix() for p in dest.rglob("*"))
    assert files == ["ok", "ok/file"]
    assert len(sink.skipped) == 9
    assert "bad-\\xff\\xfe-name" in sink.skipped and "line\\nbreak" in sink.skipped


def test_a_size_past_max_size_is_refused_at_its_header_and_leaves_nothing(base: Path) -> None:
    dest = base / "dest"
    huge = raw_header(b"huge", size=(1 << 40))  # claims 1 TiB, sends nothing
    with pytest.raises(ExtractError, match="max-size"):
        extract(huge + END, dest, max_size=1 << 20)
    assert_nothing_left(base)


def test_a_sparse_file_stream_is_cut_once_it_passes_max_size(base: Path) -> None:
    """A sparse file of 4 KiB on disk comes as its full length of zeros: refused at its
    header once its size would pass --max-size; and zeros that keep coming (after the
    archive's end, or anywhere) cut the stream once the bytes received pass it. Nothing is
    left either way."""
    dest = base / "dest"
    sink = TarSink(dest, max_size=1 << 20)
    with pytest.raises(ExtractError, match="max-size"):
        sink.feed(body(entry("small", data=b"x" * 1000)))
        sink.feed(raw_header(b"sparse", size=4 << 20))
    sink.abort()
    assert sink.received < 4096
    assert_nothing_left(base)
    sink, fed = TarSink(dest, max_size=1 << 20), 0
    with pytest.raises(ExtractError, match="max-size"):
        sink.feed(body(entry("small", data=b"x" * 1000)))
        while fed < (4 << 20):
            sink.feed(b"\0" * 65536)
            fed += 65536
    sink.abort()
    assert fed <= (1 << 20)
    assert_nothing_left(base)


def test_a_truncated_or_corrupt_stream_leaves_nothing(base: Path) -> None:
    dest = base / "new" / "parents" / "dest"  # the parents it made go too
    whole = tar_of(entry("a", data=b"y" * 5000), entry("b", data=b"z" * 5000))
    with pytest.raises(ExtractError):
        extract(whole[:3000], dest)
    assert_nothing_left(base)
    corrupt = bytearray(whole)
    corrupt[512 * 11] ^= 0xFF  # the second header's checksum no longer matches
    with pytest.raises(ExtractError):
        extract(bytes(corrupt), dest)
    assert_nothing_left(base)
    for pax in (b"garbage", b"99 path=x\n", b"5 a\n", b"30 size=-1\n" + b" " * 19):
        bad = raw_header(b"pax", b"x", len(pax)) + padded(pax) + whole
        with pytest.raises(ExtractError, match="pax"):
            extract(bad, dest)
        assert_nothing_left(base)
    too_big = raw_header(b"long", b"L", 1 << 20)
    with pytest.raises(ExtractError, match="too big"):
        extract(too_big + END, dest)
    assert_nothing_left(base)


def test_a_good_stream_lands_whole_in_dest_an_empty_directory_or_a_new_one(base: Path) -> None:
    stream = tar_of(
        entry("./", tarfile.DIRTYPE, mode=0o755),
        entry("./adapter/", tarfile.DIRTYPE, mode=0o700),
        entry("./adapter/config.json", data=b"{}", mode=0o600),
        entry("./model.safetensors", data=os.urandom(70_000)),
        entry("./" + "é" * 20, data=b"utf-8 is fine"),
        entry("./implicit/parent/file", data=b"its directories come with it"),
    )
    for dest, chunk in ((base / "new", 1), (base / "empty", 65536)):
        if dest.name == "empty":
            dest.mkdir()
        sink = extract(stream, dest, chunk=chunk)
        assert sink.skipped == []
        assert sink.received == len(stream)
        assert sorted(p.relative_to(dest).as_posix() for p in dest.rglob("*")) == [
            "adapter", "adapter/config.json", "implicit", "implicit/parent",
            "implicit/parent/file", "model.safetensors", "é" * 20,
        ]  # fmt: skip
        assert (dest / "model.safetensors").stat().st_size == 70_000
        assert stat.S_IMODE((dest / "adapter").stat().st_mode) == 0o700
        assert stat.S_IMODE((dest / "adapter" / "config.json").stat().st_mode) == 0o600
    assert sorted(p.name for p in base.iterdir()) == ["empty", "new", "outside"]


def test_a_file_larger_than_the_free_space_is_refused_before_it_is_written(base: Path) -> None:
    """Within --max-size, a file whose declared size would fill DEST's disk is refused at
    its header, before a byte of it is written."""
    dest = base / "dest"
    sink = TarSink(dest, max_size=1 << 62)
    with pytest.raises(ExtractError, match="free space"):
        sink.feed(body(entry("model.bin", data=b"w" * 10)))
        sink.feed(raw_header(b"huge", size=1 << 50))
    sink.abort()
    assert_nothing_left(base)


def test_dest_must_be_absent_or_an_empty_directory_never_a_link(base: Path) -> None:
    (base / "link").symlink_to(base / "outside")
    (base / "file").write_bytes(b"")
    (base / "full").mkdir()
    (base / "full" / "x").write_bytes(b"")
    for name in ("link", "file", "full"):
        with pytest.raises(ExtractError, match="exists and is not an empty directory"):
            TarSink(base / name)
    assert sorted(p.name for p in base.iterdir()) == ["file", "full", "link", "outside"]


def test_long_names_come_through_gnu_and_pax_headers_and_the_system_tar(base: Path) -> None:
    """Names past the header's 100 bytes: GNU long-name entries, pax `path` records, and
    what the system's tar writes for a real directory (the VM side runs it)."""
    long = "/".join(["directory-" + "x" * 40] * 4) + "/model.safetensors"
    for fmt in (tarfile.GNU_FORMAT, tarfile.PAX_FORMAT):
        buf = io.BytesIO()
        with tarfile.open(fileobj=buf, mode="w", format=fmt) as tar:
            info = tarfile.TarInfo(long)
            info.size = 5
            tar.addfile(info, io.BytesIO(b"12345"))
        dest = base / f"fmt{fmt}"
        assert extract(buf.getvalue(), dest).skipped == []
        assert (dest / long).read_bytes() == b"12345"
    src = base / "src"
    (src / long).parent.mkdir(parents=True)
    (src / long).write_bytes(b"weights")
    (src / "link").symlink_to("directory-" + "x" * 40)
    made = subprocess.run(["tar", "-cf", "-", "-C", str(src), "."], capture_output=True)
    dest = base / "system"
    assert extract(made.stdout, dest, chunk=1000).skipped == ["link"]
    assert (dest / long).read_bytes() == b"weights"
