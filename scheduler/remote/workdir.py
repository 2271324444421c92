"""A job's workdir on a VM: a cache of unpacked workdirs by digest, the scripts that ask
whether a VM holds one and that receive one, and the per-attempt copy.

`~/.rlfleet/<installation>/workdirs/<digest>/` holds the unpacked workdir whose packed
bytes have that sha256. It appears whole or not at all: the receiver unpacks into a
directory of its own beside it, checks every member, and renames it into place only once
everything is written, so a directory by that name is a complete workdir (a VM that has
it is not sent it again). Each attempt runs in its own copy, `<attempt dir>/work/`, made
by the launch (`copy_lines`): what a job writes there alters neither the cache nor
another attempt.

The receiver (`RECEIVE_CODE`, standard library only: the VM needs nothing of rlfleet
installed; run isolated, `remote.isolated`) reads the packed bytes as base64 on stdin,
checks their sha256 against the digest it was given, and unpacks only directories and
regular files whose names are relative, without `..` or empty parts; a symlink, a hard
link, a device, a FIFO, more than `WORKDIR_MAX_FILES` entries or more than
`WORKDIR_MAX_UNPACKED` bytes refuses the whole workdir. Modes are kept (less setuid,
setgid and sticky bits). A receiver stopped by a signal removes its half-unpacked
directory; one that could not (SIGKILL, a crash of the VM) leaves it, and a later receiver
on that VM removes it once it is a day old.
"""

from __future__ import annotations

import shlex

from scheduler.remote.isolated import isolated_words
from scheduler.remote.layout import ROOT, check_installation, home_path
from scheduler.remote.output import output_lines
from scheduler.validate import DIGEST_RE, WORKDIR_MAX_FILES, WORKDIR_MAX_UNPACKED

PRESENT_MARK = "rlfleet-workdir-present"
MISSING_MARK = "rlfleet-workdir-missing"
READY_MARK = "rlfleet-workdir-ready"
WORK_DIR = "work"
"""An attempt's copy of its workdir, inside the attempt directory."""


def check_digest(digest: str) -> str:
    """`digest` if it is a workdir digest (64 lowercase hex digits); else `ValueError`."""
    if not isinstance(digest, str) or not DIGEST_RE.fullmatch(digest):
        raise ValueError(f"not a workdir digest: {digest!r}")
    return digest


def cache_dir(installation: str, digest: str) -> str:
    """The cached workdir's directory, relative to $HOME."""
    return f"{ROOT}/{check_installation(installation)}/workdirs/{check_digest(digest)}"


def has_script(installation: str, digest: str) -> str:
    """Prints `PRESENT_MARK` when the VM holds the workdir, else `MISSING_MARK`."""
    return (
        f"if [ -d {home_path(cache_dir(installation, digest))} ]; "
        f"then echo {PRESENT_MARK}; else echo {MISSING_MARK}; fi"
    )


def parse_has(stdout: str) -> bool | None:
    """Whether `has_script` said the workdir is there (None: it said neither)."""
    lines = output_lines(stdout)
    if PRESENT_MARK in lines:
        return True
    if MISSING_MARK in lines:
        return False
    return None


RECEIVE_CODE = r"""
import base64, hashlib, io, os, secrets, shutil, signal, stat, sys, tarfile, time
final, digest, max_bytes, max_files = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
def fail(why):
    sys.stderr.write("rlfleet: workdir refused: " + why + "\n")
    sys.exit(3)
def stop(signum, frame):
    sys.exit(128 + signum)
signal.signal(signal.SIGTERM, stop)
signal.signal(signal.SIGHUP, stop)
os.umask(0o077)
data = base64.b64decode(sys.stdin.buffer.read())
if hashlib.sha256(data).hexdigest() != digest:
    fail("its sha256 is not " + digest)
if os.path.isdir(final):
    print("rlfleet-workdir-ready")
    sys.exit(0)
parent = os.path.dirname(final)
os.makedirs(parent, exist_ok=True)
for old in os.listdir(parent):
    path = os.path.join(parent, old)
    try:
        if old.startswith(".tmp-") and os.lstat(path).st_mtime < time.time() - 86400:
            shutil.rmtree(path, ignore_errors=True)
    except OSError:
        pass
tmp = os.path.join(parent, ".tmp-" + digest[:16] + "-" + secrets.token_hex(4))
os.mkdir(tmp, 0o700)
try:
    total = count = 0
    modes = []
    with tarfile.open(fileobj=io.BytesIO(data), mode="r:gz") as tar:
        for m in tar:
            name = m.name
            parts = name.split("/")
            if (not name or name.startswith("/") or "\0" in name
                    or any(p in ("", ".", "..") for p in parts)):
                fail("unsafe path " + repr(name))
            count += 1
            if count > max_files:
                fail("more than %d entries" % max_files)
            path = os.path.join(tmp, *parts)
            here = os.path.dirname(path)
            mode = stat.S_IMODE(m.mode) & 0o777
            if m.isdir():
                os.makedirs(path, 0o700, exist_ok=True)
                modes.append((path, mode | 0o700))
            elif m.isreg():
                total += m.size
                if total > max_bytes:
                    fail("more than %d bytes unpacked" % max_bytes)
                os.makedirs(here, 0o700, exist_ok=True)
                source = tar.extractfile(m)
                fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL
                             | getattr(os, "O_NOFOLLOW", 0), 0o600)
                with os.fdopen(fd, "wb") as out:
                    shutil.copyfileobj(source, out, 1 << 20)
                os.chmod(path, mode)
            else:
                fail(repr(name) + " is not a regular file or directory")
    for path, mode in reversed(modes):
        os.chmod(path, mode)
    try:
        os.rename(tmp, final)
    except OSError:
        if not os.path.isdir(final):
            raise
except SystemExit:
    shutil.rmtree(tmp, ignore_errors=True)
    raise
except Exception as exc:
    shutil.rmtree(tmp, ignore_errors=True)
    fail(type(exc).__name__ + ": " + str(exc))
shutil.rmtree(tmp, ignore_errors=True)
print("rlfleet-workdir-ready")
"""
"""The VM side of `receive_script`, run by the VM's python (see the module's docstring)."""


def receive_script(python: str, installation: str, digest: str) -> str:
    """Unpack the workdir sent as base64 on stdin into the VM's cache; prints `READY_MARK`
    once the workdir is complete there. Every word quoted."""
    quoted = " ".join(isolated_words(python, RECEIVE_CODE))
    target = home_path(cache_dir(installation, digest))
    return (
        f"{quoted} {target} {shlex.quote(digest)} "
        f"{int(WORKDIR_MAX_UNPACKED)} {int(WORKDIR_MAX_FILES)}"
    )


def parse_ready(stdout: str) -> bool:
    """Whether `receive_script` said the workdir is complete in the cache."""
    return READY_MARK in output_lines(stdout)


def copy_lines(installation: str, digest: str) -> list[str]:
    """Lines of the launch (inside its lock, `$d` the attempt directory) that copy the
    cached workdir into the attempt's own `work/`, modes kept; exit 97 when it cannot."""
    source = home_path(cache_dir(installation, digest))
    return [
        f"  if [ ! -d {source} ]; then echo 'rlfleet: the workdir is not on this VM' >&2;"
        " exit 97; fi",
        f'  cp -R -p {source} "$d/{WORK_DIR}" ||'
        " { echo 'rlfleet: cannot copy the workdir into the attempt directory' >&2; exit 97; }",
    ]
