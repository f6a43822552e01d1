"""The C core's I/O engine paths (csrc/block/engine.c, csrc/block/uring.c): io_uring
and plain pread/pwrite, each forced by KVTIER_IO_URING and seen really used in
kvtier._C.io_engine_status(); a kernel that refuses io_uring (a seccomp filter
making io_uring_setup ENOSYS, tests/c/no_io_uring.c) falls back to the plain
path with the same results.

Each case runs a fresh interpreter (the mode is fixed at the first I/O) that
stores and loads O_DIRECT blocks of several sizes (one piece, several pieces,
pieces of a size that is not a power of two), with checksums on and off and
under a job state, and checks bytes, xattr and the engine counters."""
from __future__ import annotations

import errno
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from ci import unavailable

ROOT = Path(__file__).resolve().parent.parent
_C = pytest.importorskip("kvtier._C", reason="the I/O engine is the C core's")

SCRIPT = r"""
import json, mmap, os, sys
import numpy as np
from kvtier import io, _C
d = sys.argv[1]
assert io.backend == "c"
if not io.probe_o_direct(d):
    print("RESULT " + json.dumps({"no_direct": True}))
    sys.exit(0)
sizes = [256 << 10, 3 << 20, (5 << 20) + 4096, 16 << 20]
bad = []
for k, bs in enumerate(sizes):
    src = mmap.mmap(-1, bs)
    v = np.frombuffer(src, dtype=np.uint8)
    v[:] = np.random.default_rng(k).integers(0, 256, bs, dtype=np.uint8)
    for ck in (True, False):
        p = os.path.join(d, f"b{k}_{int(ck)}.bin")
        io.batch_store_block([p], v, [0], bs, use_o_direct=True, checksum=ck, job_state=bytearray(8))
        with open(p, "rb") as f:
            if f.read() != v.tobytes():
                bad.append(["stored", bs, ck])
        if ck and os.getxattr(p, "user.vllm.kv_crc32c") != _C.crc32c(v).to_bytes(4, "big"):
            bad.append(["xattr", bs])
        for js in (bytearray(8), None):
            dst = mmap.mmap(-1, bs + 8192)
            out = np.frombuffer(dst, dtype=np.uint8)
            out[:] = 0xA5
            io.batch_load_block([p], out, [4096], bs, use_o_direct=True, checksum=ck, job_state=js)
            if not np.array_equal(out[4096:4096 + bs], v) or (out[:4096] != 0xA5).any() or (out[4096 + bs:] != 0xA5).any():
                bad.append(["loaded", bs, ck, js is not None])
# a block cut short / grown on disk: EIO, removed, on every path
p = os.path.join(d, "b1_1.bin")
os.truncate(p, (3 << 20) - 4096)
try:
    io.batch_load_block([p], np.zeros(3 << 20, np.uint8), [0], 3 << 20, use_o_direct=True, checksum=True,
                        job_state=bytearray(8))
    bad.append(["short loaded"])
except OSError as e:
    if e.errno != 5 or os.path.exists(p):
        bad.append(["short", e.errno, os.path.exists(p)])
p = os.path.join(d, "b2_0.bin")
with open(p, "ab") as f:
    f.write(b"x" * 8192)
try:
    io.batch_load_block([p], np.zeros((5 << 20) + 4096, np.uint8), [0], (5 << 20) + 4096, use_o_direct=True,
                        checksum=False, job_state=bytearray(8))
    bad.append(["long loaded"])
except OSError as e:
    if e.errno != 5 or os.path.exists(p):
        bad.append(["long", e.errno, os.path.exists(p)])
print("RESULT " + json.dumps({"bad": bad, "engine": _C.io_engine_status()}))
"""


def _run(tmp_path, env, prefix=()):
    d = tmp_path / "blocks"
    d.mkdir()
    e = {k: v for k, v in os.environ.items() if not k.startswith("KVTIER_")}
    e.update(KVTIER_IO_BACKEND="c", **env)
    r = subprocess.run([*prefix, sys.executable, "-c", SCRIPT, str(d)], capture_output=True, text=True, env=e,
                       cwd=str(ROOT), timeout=300)
    assert r.returncode == 0, r.stdout + r.stderr
    line = [ln for ln in r.stdout.splitlines() if ln.startswith("RESULT ")][-1]
    res = json.loads(line[len("RESULT "):])
    if res.get("no_direct"):
        pytest.skip(f"{d} does not accept O_DIRECT")
    assert res["bad"] == []
    return res["engine"]


def _need_liburing():
    if os.environ.get("KVTIER_NO_LIBURING") == "1" and not _C.io_engine_status()["liburing"]:
        pytest.skip("built without liburing on purpose (scripts/test-no-isal)")
    if not _C.io_engine_status()["liburing"]:
        unavailable("kvtier._C built without liburing (scripts/bootstrap installs liburing-dev)")


def test_io_uring_path_forced(tmp_path):
    _need_liburing()
    eng = _run(tmp_path, {"KVTIER_IO_URING": "1"})
    if eng["engine"] != "io_uring":
        unavailable(f"the kernel refuses io_uring here ({os.strerror(eng['setup_errno'])})")
    assert eng["setting"] == "1" and eng["setup_errno"] == 0
    # 9 engine loads of more than one piece (3 sizes > 256 KiB; checksum on: 2, off: 1
    # under a job state) of >= 4 pieces each (halving down to <= 256 KiB); stores are one
    # pwrite each, never on the ring
    assert eng["uring_ops"] >= 9 * 4 and eng["plain_blocks"] == 0


def test_plain_path_forced(tmp_path):
    eng = _run(tmp_path, {"KVTIER_IO_URING": "0"})
    assert (eng["engine"], eng["setting"], eng["uring_ops"]) == ("plain", "0", 0)
    assert eng["plain_blocks"] >= 9  # every engine load > 256 KiB


@pytest.fixture(scope="module")
def no_io_uring(tmp_path_factory):
    cc = shutil.which("cc") or shutil.which("gcc")
    if cc is None:
        unavailable("no C compiler for tests/c/no_io_uring.c")
    out = tmp_path_factory.mktemp("no_io_uring") / "no_io_uring"
    subprocess.run([cc, "-O1", "-Wall", "-Werror", "-o", str(out), str(ROOT / "tests/c/no_io_uring.c")], check=True)
    r = subprocess.run([str(out), "true"], capture_output=True, text=True)
    if r.returncode != 0:
        unavailable(f"cannot install a seccomp filter here: {r.stderr.strip()}")
    return str(out)


@pytest.mark.parametrize("setting", ["", "1"])
def test_kernel_without_io_uring_falls_back(tmp_path, no_io_uring, setting):
    """io_uring_setup fails with ENOSYS: unset or KVTIER_IO_URING=1, the
    engine says plain with the kernel's reason, and every block round-trips
    on the plain path (the same checks as above)."""
    eng = _run(tmp_path, {"KVTIER_IO_URING": setting}, prefix=(no_io_uring,))
    assert eng["engine"] == "plain" and eng["uring_ops"] == 0
    assert eng["plain_blocks"] >= 3 + 9
    if eng["liburing"]:
        assert eng["setup_errno"] == errno.ENOSYS


RECORDS_SCRIPT = r"""
import json, mmap, os, sys
import numpy as np
from kvtier import io, _C
d, f = sys.argv[1], sys.argv[2]  # faults only under f (KVT_FAULT_DIR)
if not io.probe_o_direct(d):
    print("RESULT " + json.dumps({"no_direct": True}))
    sys.exit(0)
bs = 3 << 20
v = np.frombuffer(mmap.mmap(-1, bs), dtype=np.uint8)
v[:] = np.random.default_rng(7).integers(0, 256, bs, dtype=np.uint8)
crc = _C.crc32c(v).to_bytes(4, "big")
res = {}

def stored(p):
    with open(p, "rb") as fh:
        return fh.read() == v.tobytes() and os.getxattr(p, "user.vllm.kv_crc32c") == crc and \
            os.getxattr(p, "user.kvtier.id")[8:] == crc

p = os.path.join(f, "a.bin")
try:
    io.batch_store_block([p], v, [0], bs, use_o_direct=True, checksum=True, job_state=bytearray(8))
    res["first"] = "ok" if stored(p) else "wrong"
except OSError as e:
    res["first"] = [e.errno, e.operation, os.path.exists(p)]
q = os.path.join(d, "b.bin")  # outside f: no fault
io.batch_store_block([q], v, [0], bs, use_o_direct=True, checksum=True, job_state=bytearray(8))
res["second"] = stored(q)
res["temps"] = [n for n in os.listdir(f) + os.listdir(d) if n.endswith(".tmp")]
res["engine"] = _C.io_engine_status()
print("RESULT " + json.dumps(res))
"""


@pytest.fixture(scope="module")
def io_fault(tmp_path_factory):
    from test_block_io import build_preload
    return build_preload(tmp_path_factory, "io_fault")


@pytest.mark.parametrize("setting", ["1", "0"])
def test_store_records_fault(tmp_path, io_fault, setting):
    """A checksummed O_DIRECT store of 3 MiB (one pwrite straight from the caller's page-
    aligned buffer, then the CRC pass, then the records) whose fsetxattr fails (ENOSPC)
    fails as a record error (operation "setxattr", errno kept), nothing published, no
    temp, and the next store on the thread works, with the same bytes and records on the
    ring's engine and the plain one: no store asks the filesystem for fallocate or goes
    through the ring (one op counted per load piece only)."""
    from test_block_io import preload
    if setting == "1":
        _need_liburing()
    d = tmp_path / "blocks"
    f = d / "faulty"
    f.mkdir(parents=True)
    log = tmp_path / "faults.log"
    e = {k: v for k, v in os.environ.items() if not k.startswith("KVTIER_")}
    e.update(KVTIER_IO_BACKEND="c", KVTIER_IO_URING=setting, LD_PRELOAD=preload(io_fault), KVT_FAULT_DIR=str(f),
             KVT_FAULT_ERRNO=f"fsetxattr:{errno.ENOSPC}:-1,fallocate:{errno.EOPNOTSUPP}:-1", KVT_FAULT_LOG=str(log))
    r = subprocess.run([sys.executable, "-c", RECORDS_SCRIPT, str(d), str(f)], capture_output=True, text=True,
                       env=e, cwd=str(ROOT), timeout=300)
    assert r.returncode == 0, r.stdout + r.stderr
    res = json.loads([ln for ln in r.stdout.splitlines() if ln.startswith("RESULT ")][-1][len("RESULT "):])
    if res.get("no_direct"):
        pytest.skip(f"{d} does not accept O_DIRECT")
    eng = res["engine"]
    if setting == "1" and eng["engine"] != "io_uring":
        unavailable(f"the kernel refuses io_uring here ({os.strerror(eng['setup_errno'])})")
    hits = log.read_text().splitlines() if log.exists() else []
    assert res["first"] == [errno.ENOSPC, "setxattr", False]
    assert len(hits) >= 1 and all(h.startswith("fsetxattr\t") for h in hits), hits
    assert res["second"] is True and res["temps"] == []
    assert eng["uring_ops"] == 0 and eng["plain_blocks"] == 0


FORK_SCRIPT = r"""
import json, mmap, os, sys
import numpy as np
from kvtier import io, _C
d, n = sys.argv[1], int(sys.argv[2])
bs = 1 << 20  # > 256 KiB: several pieces, through the ring
src = mmap.mmap(-1, bs)
v = np.frombuffer(src, dtype=np.uint8)
v[:] = np.random.default_rng(3).integers(0, 256, bs, dtype=np.uint8)
paths = [os.path.join(d, f"b{i}.bin") for i in range(n)]
io.batch_store_block(paths, v, [0] * n, bs, use_o_direct=True, checksum=True)

def rings():
    fds = os.listdir("/proc/self/fd")
    out = 0
    for f in fds:
        try:
            out += os.readlink(f"/proc/self/fd/{f}") == "anon_inode:[io_uring]"
        except OSError:
            pass
    return out

def load_all():
    dst = mmap.mmap(-1, n * bs)
    out = np.frombuffer(dst, dtype=np.uint8)
    io.batch_load_block(paths, out, [i * bs for i in range(n)], bs, use_o_direct=True, checksum=True)
    return all(np.array_equal(out[i * bs:(i + 1) * bs], v) for i in range(n))

res = {"parent_ok": load_all(), "parent_rings": rings(), "ops": _C.io_engine_status()["uring_ops"]}
r, w = os.pipe()
pid = os.fork()
if pid == 0:
    os.close(r)
    before = rings()
    ops0 = _C.io_engine_status()["uring_ops"]
    ok = load_all()
    child = {"ok": ok, "rings_before": before, "rings_after": rings(),
             "ops": _C.io_engine_status()["uring_ops"] - ops0}
    os.write(w, json.dumps(child).encode())
    os._exit(0)
os.close(w)
res["child"] = json.loads(os.read(r, 4096))
os.waitpid(pid, 0)
res["parent_ok_after"] = load_all()
res["engine"] = _C.io_engine_status()["engine"]
print("RESULT " + json.dumps(res))
"""


def test_forked_child_makes_its_own_ring_without_a_getpid_per_block(tmp_path):
    """The ring is the calling thread's and a forked child's thread gets a new one: the
    child's loads go through a ring of its own (one more io_uring descriptor than it
    inherited, ring ops counted) and verify, and the parent's ring still works after.
    Fork is detected by a generation a pthread_atfork handler bumps, not by a getpid()
    per block (one syscall per block; glibc does not cache the pid): strace counts the
    getpid calls of 32 ring loads and stores, far fewer than the blocks."""
    _need_liburing()
    d = tmp_path / "blocks"
    d.mkdir()
    e = {k: v for k, v in os.environ.items() if not k.startswith("KVTIER_")}
    e.update(KVTIER_IO_BACKEND="c", KVTIER_IO_URING="1")
    n = 32
    r = subprocess.run([sys.executable, "-c", FORK_SCRIPT, str(d), str(n)], capture_output=True, text=True,
                       env=e, cwd=str(ROOT), timeout=300)
    assert r.returncode == 0, r.stdout + r.stderr
    res = json.loads([ln for ln in r.stdout.splitlines() if ln.startswith("RESULT ")][-1][len("RESULT "):])
    if res["engine"] != "io_uring":
        unavailable("the kernel refuses io_uring here")
    assert res["parent_ok"] and res["parent_ok_after"] and res["parent_rings"] == 1
    c = res["child"]
    assert c["ok"] and c["rings_before"] == 1 and c["rings_after"] == 2, c  # a ring of its own
    assert c["ops"] >= n * 3  # its loads went through it (>= 3 pieces per 1 MiB block)
    strace = shutil.which("strace")
    if strace is None:
        unavailable("no strace to count getpid calls")
    d2 = tmp_path / "blocks2"
    d2.mkdir()
    out = tmp_path / "strace.txt"
    r = subprocess.run([strace, "-f", "-qq", "-c", "-U", "name,calls", "-e", "trace=getpid", "-o", str(out),
                        sys.executable, "-c", FORK_SCRIPT, str(d2), str(n)], capture_output=True, text=True,
                       env=e, cwd=str(ROOT), timeout=300)
    if r.returncode != 0 and "PTRACE" in r.stderr.upper():
        unavailable(f"strace cannot trace here: {r.stderr.strip()[:200]}")
    assert r.returncode == 0, r.stdout + r.stderr
    calls = 0
    for ln in out.read_text().splitlines():
        f = ln.split()
        if f and f[0] == "getpid":
            calls = int(f[1])
    # 32 stores and 3 x 32 loads on the ring (128 blocks): one getpid per block before
    assert calls < n, out.read_text()


DIRECT_SCRIPT = r"""
import json, mmap, os, sys
import numpy as np
from kvtier import io, _C
d = sys.argv[1]
if not io.probe_o_direct(d):
    print("RESULT " + json.dumps({"no_direct": True}))
    sys.exit(0)
bs = 3 << 20
src = np.frombuffer(mmap.mmap(-1, bs), dtype=np.uint8)
src[:] = np.random.default_rng(5).integers(0, 256, bs, dtype=np.uint8)
p = os.path.join(d, "b.bin")
io.batch_store_block([p], src, [0], bs, use_o_direct=True, checksum=True)
out = {"bad": [], "ops": {}}
for landing in ("direct", "bounce"):
    for ck in (False, True):
        dst = np.frombuffer(mmap.mmap(-1, bs), dtype=np.uint8)
        before = _C.io_engine_status()
        io.batch_load_block([p], dst, [0], bs, use_o_direct=True, checksum=ck, job_state=bytearray(8),
                            landing=landing)
        after = _C.io_engine_status()
        if not np.array_equal(dst, src):
            out["bad"].append([landing, ck])
        out["ops"][f"{landing}-{int(ck)}"] = [after["uring_ops"] - before["uring_ops"],
                                              after["plain_blocks"] - before["plain_blocks"]]
out["engine"] = _C.io_engine_status()["engine"]
print("RESULT " + json.dumps(out))
"""


def test_direct_landing_is_one_read_not_ring_pieces(tmp_path):
    """The direct landing reads an O_DIRECT block into the row in one read (then one CRC pass),
    not in the bounce's io_uring pieces: each piece was one more device request, kick, interrupt
    and wake-up, which made it cost 1.5-1.7x the plain pread floor's CPU (docs/vs_vllm.md, "The
    direct landing at the floor's CPU"). The bounce, on the same engine, still uses the ring."""
    _need_liburing()
    d = tmp_path / "blocks"
    d.mkdir()
    e = {k: v for k, v in os.environ.items() if not k.startswith("KVTIER_")}
    e.update(KVTIER_IO_BACKEND="c", KVTIER_IO_URING="1")
    r = subprocess.run([sys.executable, "-c", DIRECT_SCRIPT, str(d)], capture_output=True, text=True, env=e,
                       cwd=str(ROOT), timeout=300)
    assert r.returncode == 0, r.stdout + r.stderr
    res = json.loads([ln for ln in r.stdout.splitlines() if ln.startswith("RESULT ")][-1][len("RESULT "):])
    if res.get("no_direct"):
        pytest.skip(f"{d} does not accept O_DIRECT")
    if res["engine"] != "io_uring":
        unavailable("the kernel refuses io_uring here")
    assert res["bad"] == []
    ops = res["ops"]
    assert ops["direct-0"] == [0, 0] and ops["direct-1"] == [0, 0], ops  # no ring op, not a plain engine block
    assert ops["bounce-0"][0] >= 4 and ops["bounce-1"][0] >= 4, ops  # 3 MiB: halving pieces on the ring
