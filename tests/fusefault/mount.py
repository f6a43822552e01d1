"""Build and mount tests/fusefault/fusefault.c (FUSE passthrough with fault
injection) for the tests. See the C file's header for the rule language.

    with mount_fusefault(tmp_path) as ff:
        ff.add("flip", "*/blk0.bin", arg=100, count=1)   # one bit, first read only
        ... use files under ff.mnt (backed by ff.backing) ...
        assert ff.hits("flip") == 1

Skips (tests/ci.py unavailable: a failure under CI, which installs them) where
/dev/fuse, fusermount3, a C compiler or libfuse3 (pkg-config fuse3) are
missing, or the mount is refused.
"""
from __future__ import annotations

import contextlib
import hashlib
import os
import shutil
import subprocess
import tempfile
import time
from typing import Iterator, List, Optional

from ci import unavailable

HERE = os.path.dirname(os.path.abspath(__file__))
SOURCE = os.path.join(HERE, "fusefault.c")
CTL = ".fusefault"
STALL_OPS = ("read", "write", "getxattr", "open", "rename", "getattr")
KINDS = ("eio", "ebadmsg", "flip", "short", "getxattr", "setxattr", "eagain") + tuple(f"stall_{op}" for op in STALL_OPS)
MAX_THREADS = 64  # FUSE worker threads: stalled operations must leave some to answer .fusefault


def build() -> str:
    """Path of the fusefault binary, compiled once per source version into a
    temp dir (``cc`` + ``pkg-config fuse3``). Skips when it cannot be built."""
    if not os.path.exists("/dev/fuse"):
        unavailable("/dev/fuse is missing: FUSE not available here")
    if shutil.which("fusermount3") is None:
        unavailable("fusermount3 not installed (Debian: fuse3)")
    cc = shutil.which("cc") or shutil.which("gcc")
    if cc is None or shutil.which("pkg-config") is None:
        unavailable("no C compiler or pkg-config to build tests/fusefault")
    flags = subprocess.run(["pkg-config", "--cflags", "--libs", "fuse3"], capture_output=True, text=True)
    if flags.returncode != 0:
        unavailable(f"libfuse3 not found by pkg-config (Debian: libfuse3-dev): {flags.stderr.strip()}")
    with open(SOURCE, "rb") as f:
        tag = hashlib.sha256(f.read()).hexdigest()[:12]
    out_dir = os.path.join(tempfile.gettempdir(), f"kvtier-fusefault-{tag}")
    exe = os.path.join(out_dir, "fusefault")
    if os.path.exists(exe):
        return exe
    os.makedirs(out_dir, exist_ok=True)
    tmp = f"{exe}.{os.getpid()}.tmp"
    proc = subprocess.run(
        [cc, "-std=gnu11", "-O2", "-Wall", "-Wextra", "-Werror", "-Wno-unused-parameter", "-o", tmp, SOURCE,
         *flags.stdout.split()],
        capture_output=True, text=True,
    )
    if proc.returncode != 0:  # our own source failing to compile is a test failure, not a skip
        raise AssertionError(f"building {SOURCE} failed:\n{proc.stderr}")
    os.replace(tmp, exe)
    return exe


class FaultFS:
    """A mounted fusefault: ``mnt`` (where tests do I/O) over ``backing``."""

    def __init__(self, backing: str, mnt: str):
        self.backing = backing
        self.mnt = mnt

    def _ctl(self, text: str) -> None:
        fd = os.open(os.path.join(self.mnt, CTL), os.O_WRONLY)
        try:
            os.write(fd, text.encode())
        finally:
            os.close(fd)

    def add(self, kind: str, glob: str, arg: int = 0, count: int = -1) -> None:
        """Add a rule: ``kind`` in KINDS, ``glob`` an fnmatch pattern of the
        path from the mount root (starting with "/"), ``arg`` (flip: byte
        offset; getxattr/setxattr: errno), ``count`` firings (-1: always)."""
        assert kind in KINDS and " " not in glob
        self._ctl(f"{kind} {glob} {int(arg)} {int(count)}\n")

    def clear(self) -> None:
        """Remove every rule and release every stalled operation."""
        self._ctl("clear\n")

    def stall(self, op: str, glob: str, ms: int = 0, count: int = -1) -> None:
        """Stall operation ``op`` (STALL_OPS) on paths matching ``glob``: ``ms``
        milliseconds, or (0) until :meth:`clear`."""
        assert op in STALL_OPS
        self.add(f"stall_{op}", glob, arg=ms, count=count)

    def wait_hits(self, kind: str, n: int, timeout: float = 10.0) -> None:
        """Wait until rules of ``kind`` fired ``n`` times (a stall: ``n``
        operations are waiting); AssertionError after ``timeout`` seconds."""
        end = time.monotonic() + timeout
        while self.hits(kind) < n:
            if time.monotonic() > end:
                raise AssertionError(f"{kind}: {self.hits(kind)} hits after {timeout} s, expected {n}")
            time.sleep(0.005)

    def rules(self) -> List[dict]:
        with open(os.path.join(self.mnt, CTL)) as f:
            text = f.read()
        out = []
        for line in text.splitlines():
            kind, glob, arg, left, hits = line.split()
            out.append({"kind": kind, "glob": glob, "arg": int(arg), "left": int(left), "hits": int(hits)})
        return out

    def hits(self, kind: Optional[str] = None) -> int:
        """Total firings of the rules (of ``kind``) so far."""
        return sum(r["hits"] for r in self.rules() if kind is None or r["kind"] == kind)

    def backing_of(self, path: str) -> str:
        """The backing-dir path of a path under ``mnt``."""
        rel = os.path.relpath(path, self.mnt)
        return os.path.join(self.backing, rel)


@contextlib.contextmanager
def mount_fusefault(workdir) -> Iterator[FaultFS]:
    """Mount fusefault over a fresh ``workdir/backing`` at ``workdir/mnt`` in
    the foreground of a background process; always unmounted on exit."""
    exe = build()
    backing = os.path.join(os.fspath(workdir), "backing")
    mnt = os.path.join(os.fspath(workdir), "mnt")
    os.makedirs(backing, exist_ok=True)
    os.makedirs(mnt, exist_ok=True)
    log = open(os.path.join(os.fspath(workdir), "fusefault.log"), "w+")
    proc = subprocess.Popen([exe, backing, mnt, "-f", "-o", f"max_threads={MAX_THREADS}"],
                            stdout=log, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + 10
        while not os.path.ismount(mnt):
            if proc.poll() is not None:
                log.seek(0)
                unavailable(f"fusefault mount refused (exit {proc.returncode}): {log.read().strip()}")
            if time.monotonic() > deadline:
                raise AssertionError("fusefault did not mount within 10 s")
            time.sleep(0.02)
        ff = FaultFS(backing, mnt)
        yield ff
    finally:
        if os.path.ismount(mnt):
            try:  # stalled operations would keep the unmount busy
                ff.clear()
            except (OSError, NameError):
                pass
            if subprocess.run(["fusermount3", "-u", mnt], capture_output=True).returncode != 0:
                subprocess.run(["fusermount3", "-u", "-z", mnt], capture_output=True)
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        log.close()
