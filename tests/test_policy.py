"""The error policy table of docs/design.md ("Error policy"), walked row by row.

Each row id (P1, P2 ...) has one check below that produces the row's errno or observation
(the LD_PRELOAD shim tests/c/io_fault.c, KVT_FAULT_ERRNO, in a child process; or the file
state itself) against each backend (C core and fallback, the same test body) and asserts
the row's outcome: loaded or not, errno, ``operation``, ``condemned``, the policy counters
of the call, and whether the file is still on disk. A row without a check or a check
without a row fails :func:`test_every_row_has_a_check`.
"""
from __future__ import annotations

import errno
import hashlib
import json
import mmap
import os
import re
import shutil
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import numpy as np
import pytest

import kvtier
from kvtier import io as kio
from kvtier._blockio import policy, records
from test_block_io import build_preload, preload

ROOT = Path(__file__).resolve().parent.parent
DESIGN = ROOT / "docs" / "design.md"
BS = 3 * 4096
EAGAIN, ESTALE, EIO, EINTR = errno.EAGAIN, errno.ESTALE, errno.EIO, errno.EINTR


def table_rows():
    """{id: (operation, observation, outcome, file)} of the design.md error table."""
    text = DESIGN.read_text()
    sec = text[text.index("## Error policy"):]
    sec = sec[:sec.index("\n## ", 5)]
    rows = {}
    for line in sec.splitlines():
        m = re.match(r"\| (P\d+) \|(.*)\|\s*$", line)
        if m:
            rows[m.group(1)] = tuple(c.strip() for c in m.group(2).split("|"))
    return rows


@pytest.fixture(scope="module")
def io_fault(tmp_path_factory):
    return build_preload(tmp_path_factory, "io_fault")


def data_of(seed, n=BS):
    return np.random.default_rng(seed).integers(0, 256, n, dtype=np.uint8).tobytes()


def block_path(d, key="abcdef0123456789"):
    return str(Path(d) / "m_0123456789ab_r0" / key[:3] / f"{key[3:5]}_g0" / f"{key}.bin")


def put(io_backend, path, data, checksum=True, **kw):
    """Store `data` from a page-aligned buffer (as vLLM's primary): O_DIRECT stays on."""
    buf = np.frombuffer(mmap.mmap(-1, len(data)), np.uint8) if data else np.zeros(0, np.uint8)
    buf[:] = np.frombuffer(data, np.uint8)
    io_backend.batch_store_block([path], buf, [0], len(data), checksum=checksum, **kw)


def temps(d):
    return [p for p in Path(d).rglob("*.tmp")]


def result_of(fn):
    counts = {}
    try:
        r = fn(counts)
        return {"ok": True, "ret": r, "counts": counts}
    except OSError as e:
        return {"ok": False, "errno": e.errno, "op": e.operation, "condemned": e.condemned,
                "cf": e.checksum_failed, "msg": e.strerror, "counts": counts}


def get(io_backend, path, n=BS, checksum=True, **kw):
    """Load in this process: result dict with "sha" of the bytes loaded."""
    out = np.zeros(n, np.uint8)
    r = result_of(lambda c: io_backend.batch_load_block([path], out, [0], n, checksum=checksum, counts=c, **kw))
    r["sha"] = hashlib.sha256(out.tobytes()).hexdigest()
    return r


_CHILD = textwrap.dedent("""
    import hashlib, json, sys, time
    import numpy as np
    from kvtier import io
    spec = json.loads(sys.argv[1])
    assert io.backend == spec["backend"]
    raw = np.zeros(spec["n"] + 8192, np.uint8)  # page aligned, as vLLM's primary: stores stay O_DIRECT
    start = (-raw.ctypes.data) % 4096 + spec["skew"]  # (unless skewed)
    out = raw[start:start + spec["n"]]
    counts = {}
    t0 = time.monotonic()
    try:
        if spec["what"] == "load":
            io.batch_load_block([spec["path"]], out, [0], spec["n"], counts=counts, **spec["kw"])
        else:
            out[:] = np.frombuffer(bytes.fromhex(spec["data"]), np.uint8)
            io.batch_store_block([spec["path"]], out, [0], spec["n"], counts=counts, **spec["kw"])
        r = {"ok": True}
    except OSError as e:
        r = {"ok": False, "errno": e.errno, "op": e.operation, "condemned": e.condemned, "cf": e.checksum_failed,
             "msg": e.strerror}
    r.update(counts=counts, sha=hashlib.sha256(out.tobytes()).hexdigest(), secs=time.monotonic() - t0)
    print(json.dumps(r))
""")


def child(io_backend, shim, d, what, path, faults, data=None, n=BS, log=None, skew=0, **kw):
    """Run one load or store of `path` in a child under the shim with
    KVT_FAULT_ERRNO=faults (affecting files under d), its buffer `skew` bytes past a
    page. Returns the result dict."""
    kw.setdefault("checksum", True)
    spec = {"backend": io_backend.backend, "what": what, "path": path, "n": n, "kw": kw, "skew": skew,
            "data": data.hex() if data is not None else None}
    env = dict(os.environ, LD_PRELOAD=preload(shim), KVT_FAULT_DIR=str(d), KVT_FAULT_ERRNO=faults,
               KVTIER_IO_BACKEND=io_backend.backend)
    if log:
        env["KVT_FAULT_LOG"] = str(log)
    r = subprocess.run([sys.executable, "-c", _CHILD, json.dumps(spec)], env=env, cwd=str(ROOT),
                       capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    return json.loads(r.stdout)


def sha(b):
    return hashlib.sha256(b).hexdigest()


def only(counts, **want):
    """counts has exactly the nonzero entries `want`."""
    assert {k: v for k, v in counts.items() if v} == want, counts


# ---------------------------------------------------------------- the rows


def check_P1(io_backend, shim, d):
    """EINTR anywhere is retried in place: store and load go through."""
    p, data = block_path(d), data_of(1)
    r = child(io_backend, shim, d, "store", p, "open:4:1,pwrite:4:1,fsetxattr:4:1,rename:4:1", data=data)
    assert r["ok"], r
    r = child(io_backend, shim, d, "load", p, "open:4:1,fstat:4:1,pread:4:1,fgetxattr:4:1")
    assert r["ok"] and r["sha"] == sha(data), r
    # the calls each backend retries itself (CPython retries open/pread/fstat/pwrite: PEP 475)
    assert r["counts"].get("retry_eintr", 0) >= (2 if io_backend.backend == "c" else 1), r
    # inside the engine's reads and writes (the plain path: buffered) each retry is counted
    # by the C core; the fallback's os.pwrite / os.preadv retry EINTR inside CPython (PEP 475),
    # where no Python code sees it
    q = block_path(d, "eeeeee0123456789")
    r = child(io_backend, shim, d, "store", q, "pwrite:4:2", data=data, use_o_direct=False)
    assert r["ok"], r
    only(r["counts"], **({"retry_eintr": 2} if io_backend.backend == "c" else {}))
    for checksum in (True, False):
        r = child(io_backend, shim, d, "load", q, "pread:4:3", use_o_direct=False, checksum=checksum)
        assert r["ok"] and r["sha"] == sha(data), r
        only(r["counts"], **({"retry_eintr": 3} if io_backend.backend == "c" else {}))
    if io_backend.backend == "c":  # (CPython's own retries of the fallback's reads have no bound)
        r = child(io_backend, shim, d, "load", q, "pread:4:-1", use_o_direct=False)
        assert (r["ok"], r["errno"], r["op"], r["condemned"]) == (False, errno.EINTR, "read", None), r
        assert r["counts"]["retry_eintr"] == policy.RETRY_EINTR_MAX, r
        assert Path(q).read_bytes() == data  # kept


def check_P2(io_backend, shim, d):
    p, data = block_path(d), data_of(2)
    put(io_backend, p, data)
    r = child(io_backend, shim, d, "load", p, f"pread:{EAGAIN}:1")
    assert r["ok"] and r["sha"] == sha(data), r
    only(r["counts"], retry_eagain=1)
    r = child(io_backend, shim, d, "load", p, f"fgetxattr:{ESTALE}:2")
    assert r["ok"] and r["sha"] == sha(data), r
    only(r["counts"], retry_estale=2)
    r = child(io_backend, shim, d, "load", p, f"open:{EAGAIN}:-1")
    assert (r["ok"], r["errno"], r["op"], r["condemned"]) == (False, EAGAIN, "open", None), r
    only(r["counts"], retry_eagain=policy.RETRY_TRANSIENT)
    assert r["secs"] >= (1 + 2 + 4) / 1000  # the backoff
    assert Path(p).read_bytes() == data


def check_P3(io_backend, shim, d):
    p, data = block_path(d), data_of(3)
    r = child(io_backend, shim, d, "store", p, f"pwrite:{EAGAIN}:1", data=data)
    assert r["ok"], r
    only(r["counts"], retry_eagain=1)
    assert Path(p).read_bytes() == data and temps(d) == []
    q = block_path(d, "bbbbbb0123456789")
    r = child(io_backend, shim, d, "store", q, f"rename:{ESTALE}:-1", data=data)
    assert (r["ok"], r["errno"], r["op"]) == (False, ESTALE, "rename"), r
    only(r["counts"], retry_estale=policy.RETRY_TRANSIENT)
    assert not os.path.exists(q) and temps(d) == []


def check_P4(io_backend, shim, d):
    p, data = block_path(d), data_of(4)
    put(io_backend, p, data)
    for faults, code, op in ((f"pread:{EIO}:1", EIO, "read"), (f"fgetxattr:{errno.EOPNOTSUPP}:1",
                                                                errno.EOPNOTSUPP, "getxattr"),
                             (f"open:{errno.EACCES}:1", errno.EACCES, "open")):
        r = child(io_backend, shim, d, "load", p, faults)
        assert (r["ok"], r["errno"], r["op"], r["condemned"], r["cf"]) == (False, code, op, None, False), r
        only(r["counts"])  # not retried
        assert Path(p).read_bytes() == data
    r = get(io_backend, block_path(d, "missing00000000"))
    assert (r["ok"], r["errno"], r["op"]) == (False, errno.ENOENT, "open")


def check_P5(io_backend, shim, d):
    p, data = block_path(d), data_of(5)
    put(io_backend, p, data)
    r = child(io_backend, shim, d, "load", p, f"close:{EIO}:1")
    assert r["ok"] and r["sha"] == sha(data), r


def check_P6(io_backend, shim, d):
    p, data = block_path(d), data_of(6)
    put(io_backend, p, data)
    r = child(io_backend, shim, d, "load", p, "pread:0:1")  # one early end of file: transient
    assert r["ok"] and r["sha"] == sha(data), r
    only(r["counts"], reread_short=1)
    assert Path(p).read_bytes() == data
    r = child(io_backend, shim, d, "load", p, "pread:0:2")  # again after the reopen: still no proof
    assert r["ok"] and r["sha"] == sha(data), r
    only(r["counts"], reread_short=2)
    r = child(io_backend, shim, d, "load", p, "pread:0:-1")  # on every open: a miss, never condemned
    assert (r["ok"], r["errno"], r["op"], r["condemned"], r["cf"]) == (False, EIO, "verify", None, False), r
    only(r["counts"], reread_short=2)
    assert Path(p).read_bytes() == data  # fstat says the block size: the size is not wrong


def check_P7(io_backend, shim, d):
    for checksum in (True, False):
        p, data = block_path(d), data_of(7)
        put(io_backend, p, data, checksum=checksum)
        os.truncate(p, BS // 2)
        r = get(io_backend, p, checksum=checksum)
        assert (r["ok"], r["errno"], r["op"], r["condemned"]) == (False, EIO, "verify", "size"), r
        only(r["counts"], restat_size=1, condemned_size=1)
        assert not os.path.exists(p)


def check_P8(io_backend, shim, d):
    p, data = block_path(d), data_of(8)
    put(io_backend, p, data)
    r = get(io_backend, p, n=BS // 3)  # the caller's layout has another block size
    assert (r["ok"], r["errno"], r["condemned"]) == (False, EIO, None), r
    assert r["msg"] == (f"block size mismatch (kept): the file has {BS} bytes, the block size asked for is "
                        f"{BS // 3}; its own CRC record verifies all its bytes (a block of another block size)")
    only(r["counts"], restat_size=1)
    assert Path(p).read_bytes() == data


def check_P9(io_backend, shim, d):
    p, data = block_path(d), data_of(9)
    put(io_backend, p, data)
    with open(p, "ab") as f:  # grown: not its record's bytes any more
        f.write(b"x")
    for faults in (f"fgetxattr:{EIO}:-1", f"pread:{EIO}:1", f"fgetxattr:{EINTR}:-1"):
        r = child(io_backend, shim, d, "load", p, faults)
        assert (r["ok"], r["errno"], r["condemned"]) == (False, EIO, None), (faults, r)
        # the message names both sizes (the path is the OSError's filename); the C core's
        # first read fails before it ever looks at the size: a plain read error there
        unsure = (f"block size mismatch (kept): the file has {BS + 1} bytes, the block size asked for is {BS}; "
                  "not confirmed (its size changed between opens, or its record could not be read)")
        plain_read_error = faults.startswith("pread") and io_backend.backend == "c"
        assert r["msg"] == (os.strerror(EIO) if plain_read_error else unsure), (faults, r)
        assert os.path.getsize(p) == BS + 1, faults  # a transient error never removes
    r = get(io_backend, p)  # without the fault: proven not its record's bytes
    assert (r["ok"], r["errno"], r["condemned"]) == (False, EIO, "size"), r
    assert not os.path.exists(p)


def check_P10(io_backend, shim, d):
    p, data = block_path(d), data_of(10)
    put(io_backend, p, data)
    with open(p, "r+b") as f:
        f.seek(100)
        b = f.read(1)
        f.seek(100)
        f.write(bytes([b[0] ^ 1]))
    r = get(io_backend, p)
    assert (r["ok"], r["errno"], r["op"], r["condemned"], r["cf"]) == (False, errno.EBADMSG, "verify", "checksum",
                                                                      True), r
    only(r["counts"], reread_checksum=1, condemned_checksum=1)
    assert not os.path.exists(p)


def check_P11(io_backend, shim, d):
    a, b, data = block_path(d), block_path(d, "fedcba9876543210"), data_of(11)
    put(io_backend, a, data)
    os.makedirs(os.path.dirname(b))
    shutil.copy2(a, b)  # bytes and both xattrs, under another key's name
    assert os.getxattr(b, "user.vllm.kv_crc32c") == os.getxattr(a, "user.vllm.kv_crc32c")
    r = get(io_backend, b)
    assert (r["ok"], r["errno"], r["condemned"], r["cf"]) == (False, errno.EBADMSG, "identity", True), r
    only(r["counts"], reread_identity=1, condemned_identity=1)
    assert not os.path.exists(b)
    r = get(io_backend, a)
    assert r["ok"] and r["sha"] == sha(data), r
    only(r["counts"])
    # ERANGE once from a record's getxattr (a FUSE filesystem's): asked again with the
    # largest buffer (CPython's os.getxattr does), the record is read: nothing counted
    r = child(io_backend, shim, d, "load", a, f"fgetxattr:{errno.ERANGE}:1")
    assert r["ok"] and r["sha"] == sha(data), r
    only(r["counts"])
    # a record really longer than any (not 12 bytes), one bit of its identity flipped, or
    # its CRC bytes flipped: the record itself is damaged, not another block's (issue #24):
    # the block is judged by user.vllm.kv_crc32c, which verifies it
    rec = os.getxattr(a, records.ID_XATTR_NAME)
    for bad in (b"x" * 100, rec[:8], bytes([rec[0] ^ 4]) + rec[1:], rec[:11] + bytes([rec[11] ^ 1])):
        os.setxattr(a, records.ID_XATTR_NAME, bad)
        r = get(io_backend, a)
        assert r["ok"] and r["sha"] == sha(data), r
        only(r["counts"])
    os.setxattr(a, records.ID_XATTR_NAME, b"x" * 100)
    os.removexattr(a, "user.vllm.kv_crc32c")  # no record left that verifies it: as P12
    r = get(io_backend, a)
    assert r["ok"] and r["sha"] == sha(data), r
    only(r["counts"], unverified=1)
    assert Path(a).read_bytes() == data
    # its CRC bytes flipped and no user.vllm.kv_crc32c to tell the record from the data: P10
    os.setxattr(a, records.ID_XATTR_NAME, rec[:11] + bytes([rec[11] ^ 1]))
    r = get(io_backend, a)
    assert (r["ok"], r["errno"], r["condemned"]) == (False, errno.EBADMSG, "checksum"), r
    only(r["counts"], reread_checksum=1, condemned_checksum=1)
    assert not os.path.exists(a)


def check_P12(io_backend, shim, d):
    p, data = block_path(d), data_of(12)
    put(io_backend, p, data, checksum=False)
    r = get(io_backend, p)
    assert r["ok"] and r["sha"] == sha(data), r
    only(r["counts"], unverified=1)
    # counted once per block loaded: a first short read reopens it (two opens, one load) ...
    r = child(io_backend, shim, d, "load", p, "pread:0:1")
    assert r["ok"] and r["sha"] == sha(data), r
    only(r["counts"], unverified=1, reread_short=1)
    # ... and a file of another size (two opens, condemned: not loaded) is not counted
    with open(p, "ab") as f:
        f.write(b"x")
    r = get(io_backend, p)
    assert (r["ok"], r["errno"], r["condemned"]) == (False, EIO, "size"), r
    only(r["counts"], restat_size=1, condemned_size=1)
    assert not os.path.exists(p)


def check_P13(io_backend, shim, d):
    p, data = block_path(d), data_of(13)
    put(io_backend, p, data, checksum=False)
    r = get(io_backend, p, checksum="strict")
    assert (r["ok"], r["errno"], r["op"], r["condemned"], r["cf"]) == (False, errno.ENODATA, "getxattr", None,
                                                                      False), r
    only(r["counts"], unverified_miss=1)
    assert Path(p).read_bytes() == data
    with open(p, "ab") as f:  # a wrong size says so first, as with checksum on (P7)
        f.write(b"x")
    r = get(io_backend, p, checksum="strict")
    assert (r["ok"], r["errno"], r["condemned"]) == (False, EIO, "size"), r
    only(r["counts"], restat_size=1, condemned_size=1)
    assert not os.path.exists(p)
    q = block_path(d, "9999990123456789")
    put(io_backend, q, data)
    r = get(io_backend, q, checksum="strict")  # with its record: loads
    assert r["ok"] and r["sha"] == sha(data), r


def check_P14(io_backend, shim, d):
    target = Path(d) / "elsewhere.bin"
    target.write_bytes(data_of(14))
    for key, make, code in (("1110000000000000", lambda p: os.symlink(target, p), errno.ELOOP),
                            ("2220000000000000", os.mkdir, errno.EISDIR),
                            ("3330000000000000", os.mkfifo, errno.EINVAL)):
        p = block_path(d, key)
        os.makedirs(os.path.dirname(p))
        make(p)
        for kw in ({}, {"checksum": "strict"}, {"job_state": kio.JobState()}):
            r = get(io_backend, p, **kw)
            assert (r["ok"], r["errno"], r["condemned"]) == (False, code, None), (key, kw, r)
            only(r["counts"])  # not loaded: not "unverified"
        assert os.path.lexists(p)
    assert target.read_bytes() == data_of(14)


def check_P15(io_backend, shim, d):
    p, data = block_path(d), data_of(15)
    put(io_backend, p, data)
    log = Path(d) / "log"
    # EINTR once on each fsync: logged, so the log shows which files were synced
    r = child(io_backend, shim, d, "store", p, "fsync:4:1", data=data_of(99), durable=True, log=log)
    assert r["ok"], r
    only(r["counts"], durable_existing=1, existing=1, **({"retry_eintr": 2} if io_backend.backend == "c" else {}))
    synced = {line.split("\t")[2] for line in log.read_text().splitlines() if line.startswith("fsync")}
    assert synced == {p, os.path.dirname(p)}, synced
    assert Path(p).read_bytes() == data  # not rewritten
    r = child(io_backend, shim, d, "store", p, f"fsync:{EIO}:1", data=data_of(99), durable=True)
    assert (r["ok"], r["errno"], r["op"]) == (False, EIO, "sync"), r
    assert Path(p).read_bytes() == data
    # gone between the lstat and the open that syncs it (ENOENT: a peer's condemnation):
    # the caller's bytes are stored as a new block (faults only under the block's path: its
    # open, and its temp's, which is made again, P21)
    r = child(io_backend, shim, p, "store", p, f"open:{errno.ENOENT}:1", data=data_of(98), durable=True)
    assert r["ok"], r
    only(r["counts"])
    assert Path(p).read_bytes() == data_of(98) and temps(d) == []
    assert get(io_backend, p)["ok"]


def check_P16(io_backend, shim, d):
    p = block_path(d)
    os.makedirs(p)
    r = result_of(lambda c: put(io_backend, p, data_of(16), counts=c))
    assert (r["ok"], r["errno"], r["op"]) == (False, errno.EISDIR, "rename"), r
    assert os.path.isdir(p) and temps(d) == []


def check_P17(io_backend, shim, d):
    target = Path(d) / "elsewhere.bin"
    target.write_bytes(b"T" * 10)
    for key, make in (("1110000000000000", lambda p: os.symlink(target, p)), ("2220000000000000", os.mkfifo),
                      ("3330000000000000", lambda p: Path(p).write_bytes(b"short"))):
        p, data = block_path(d, key), data_of(17)
        os.makedirs(os.path.dirname(p))
        make(p)
        r = result_of(lambda c: put(io_backend, p, data, counts=c))
        assert r["ok"], (key, r)
        only(r["counts"], replaced=1)
        assert not os.path.islink(p) and Path(p).read_bytes() == data
        assert get(io_backend, p)["ok"]
    assert target.read_bytes() == b"T" * 10 and temps(d) == []
    # a block of the size without CRC record, stored again with checksums (on or strict):
    # replaced by the verified copy (strict would miss it for ever); with one, or
    # without checksums: left as it is
    for i, mode in enumerate((True, "strict")):
        p, old, data = block_path(d, f"{i}" * 16), data_of(170 + i), data_of(172 + i)
        put(io_backend, p, old, checksum=False)
        assert get(io_backend, p, checksum="strict")["errno"] == errno.ENODATA
        r = result_of(lambda c: put(io_backend, p, data, checksum=mode, counts=c))
        assert r["ok"], r
        only(r["counts"], replaced=1)
        r = get(io_backend, p, checksum="strict")
        assert r["ok"] and r["sha"] == sha(data), r
        only(r["counts"])
        r = result_of(lambda c: put(io_backend, p, old, checksum=mode, counts=c))
        only(r["counts"], existing=1)
        assert Path(p).read_bytes() == data and temps(d) == []
    p = block_path(d, "4" * 16)
    put(io_backend, p, data_of(174), checksum=False)
    r = result_of(lambda c: put(io_backend, p, data_of(175), checksum=False, counts=c))
    only(r["counts"], existing=1)
    assert Path(p).read_bytes() == data_of(174)


def check_P18(io_backend, shim, d):
    data = data_of(18)
    for i, (faults, code, op, kw) in enumerate(((f"fsetxattr:{errno.ENOSPC}:1", errno.ENOSPC, "setxattr", {}),
                                                (f"pwrite:{EIO}:1", EIO, "write", {}),
                                                (f"fdatasync:{EIO}:1", EIO, "sync", {"durable": True}),
                                                (f"close:{errno.EDQUOT}:1", errno.EDQUOT, "close", {}),
                                                (f"rename:{errno.EACCES}:1", errno.EACCES, "rename", {}))):
        p = block_path(d, f"{i}" * 16)
        r = child(io_backend, shim, d, "store", p, faults, data=data, **kw)
        assert (r["ok"], r["errno"], r["op"]) == (False, code, op), (faults, r)
        assert not os.path.exists(p) and temps(d) == [], faults


def check_P19(io_backend, shim, d):
    p, data = block_path(d), data_of(19)
    r = child(io_backend, shim, d, "store", p, f"fsync:{EIO}:-1", data=data, durable=True)
    assert (r["ok"], r["errno"], r["op"]) == (False, EIO, "sync"), r
    assert Path(p).read_bytes() == data and temps(d) == []  # published, kept


def check_P20(io_backend, shim, d):
    good = block_path(d)
    put(io_backend, good, data_of(20))
    odd = []
    for key, make in (("1110000000000000", lambda p: os.symlink(good, p)), ("2220000000000000", os.mkdir),
                      ("3330000000000000", os.mkfifo), ("4440000000000000", lambda p: Path(p).write_bytes(b"x"))):
        p = block_path(d, key)
        os.makedirs(os.path.dirname(p))
        make(p)
        odd.append(p)
    assert io_backend.batch_lookup([good] + odd, BS) == [True, False, False, False, False]


def check_P21(io_backend, shim, d):
    """The temp's open answers ENOENT three times after its parents were made (a shared
    filesystem's name cache): retried, stored; answering it for good fails the store after
    the retries, nothing left behind."""
    data = data_of(21)
    p = block_path(d)
    r = child(io_backend, shim, d, "store", p, f"open:{errno.ENOENT}:4", data=data)
    assert r["ok"], r
    assert Path(p).read_bytes() == data and temps(d) == []
    q = block_path(d, "fedcba9876543210")
    t0 = time.monotonic()
    r = child(io_backend, shim, d, "store", q, f"open:{errno.ENOENT}:1000", data=data)
    assert (r["ok"], r["errno"], r["op"]) == (False, errno.ENOENT, "open"), r
    assert time.monotonic() - t0 >= 1.0  # 2 + 4 + ... + 512 ms of pauses
    assert not os.path.exists(q) and temps(d) == []


def check_P22(io_backend, shim, d):
    """scrub judges the CRC records as a load does, and reports a directory at a block path."""
    from kvtier.cli import scrub

    p, data = block_path(d), data_of(22)
    put(io_backend, p, data)
    os.setxattr(p, "user.vllm.kv_crc32c", b"\x01\x02\x03")  # malformed; the identity record is good
    r = get(io_backend, p)
    assert r["ok"] and r["sha"] == sha(data), r
    q = block_path(d, "fedcba9876543210")
    os.makedirs(q)
    res = scrub.scrub(d, remove=True, progress=False)
    by = {f["path"]: f for f in res["findings"]}
    assert (by[p]["status"], by[p]["removed"]) == ("ok", False), by
    assert (by[q]["status"], by[q]["removed"]) == ("error", False), by
    assert Path(p).read_bytes() == data and os.path.isdir(q)


CHECKS = {name[len("check_"):]: fn for name, fn in globals().items() if name.startswith("check_P")}


def test_every_row_has_a_check():
    rows = table_rows()
    assert sorted(rows) == sorted(CHECKS), "docs/design.md error table and tests/test_policy.py differ"
    # the retry counts and backoffs the table states are the code's
    for rid in ("P2", "P3"):
        outcome = rows[rid][2]
        assert f"{policy.RETRY_TRANSIENT} times" in outcome and "after 1, 2, 4 ms" in outcome, outcome
    assert f"up to {policy.RETRY_EINTR_MAX} times in a row" in rows["P1"][2]
    assert policy.BACKOFF_US == 1000


def test_buffered_unaligned_is_counted_once_per_block_stored(io_backend, io_fault, tmp_path):
    """A store from a buffer 16 bytes past a page (O_DIRECT asked for, written buffered) is
    counted buffered_unaligned once when it is stored, whatever retries it took (EAGAIN at
    the temp's open or its write: P3), and not at all when it fails; the same on both
    backends."""
    d = tmp_path / "tier"
    d.mkdir()
    data = data_of(31)
    for i, (faults, ok, want) in enumerate([
            ("open:11:2", True, {"retry_eagain": 2, "buffered_unaligned": 1}),
            ("pwrite:11:2", True, {"retry_eagain": 2, "buffered_unaligned": 1}),
            ("open:28:-1", False, {}),
            ("pwrite:5:-1", False, {})]):
        p = block_path(d, f"{i}" * 16)
        r = child(io_backend, io_fault, d, "store", p, faults, data=data, skew=16, use_o_direct=True)
        assert r["ok"] is ok and os.path.exists(p) is ok, (faults, r)
        only(r["counts"], **want)
        if ok:
            assert Path(p).read_bytes() == data and get(io_backend, p)["ok"]
    assert temps(d) == []


@pytest.mark.parametrize("row", sorted(CHECKS, key=lambda r: int(r[1:])))
def test_policy_row(io_backend, io_fault, tmp_path, row):
    d = tmp_path / "tier"
    d.mkdir()
    CHECKS[row](io_backend, io_fault, str(d))


def test_policy_vocabulary_is_the_same_in_both_backends(io_backend):
    info = io_backend.policy_info()
    assert tuple(info["counts"]) == policy.COUNT_NAMES
    assert tuple(info["operations"]) == policy.OPERATIONS
    assert tuple(info["causes"]) == policy.CAUSES
    assert (info["retry_eintr_max"], info["retry_transient"], info["backoff_us"], info["id_xattr"]) == (
        policy.RETRY_EINTR_MAX, policy.RETRY_TRANSIENT, policy.BACKOFF_US, records.ID_XATTR_NAME)


def test_identity_record_is_the_same_in_both_backends(tmp_path):
    from kvtier import io as kio

    try:
        c, py = kio.for_backend("c"), kio.for_backend("python")
    except ImportError as e:
        pytest.skip(str(e))
    for i, rel in enumerate(("m_0123456789ab_r0/abc/de_g0/abcdef.bin", "x.bin", "a/b.bin")):
        p1, p2 = str(tmp_path / "c" / rel), str(tmp_path / "py" / rel)
        put(c, p1, data_of(i, 4096))
        put(py, p2, data_of(i, 4096))
        crc = kvtier.crc32c(data_of(i, 4096))
        for p in (p1, p2):  # identity (8 bytes) + the CRC32C of user.vllm.kv_crc32c (4 bytes)
            rec = os.getxattr(p, records.ID_XATTR_NAME)
            assert rec == records.block_identity(p, 4096) + crc.to_bytes(4, "big") == records.identity_record(p, 4096, crc)
            assert os.getxattr(p, "user.vllm.kv_crc32c") == rec[8:]
        if i == 0:  # the last four components are the same: so is the record
            assert os.getxattr(p1, records.ID_XATTR_NAME) == os.getxattr(p2, records.ID_XATTR_NAME)
    # bound to the last four components: the same block under another root verifies
    assert records.block_identity("/r1/m_1_r0/abc/de_g0/k.bin", 8) == records.block_identity("/r2/m_1_r0/abc/de_g0/k.bin", 8)
    assert records.block_identity("/r/m_1_r0/abc/de_g0/k.bin", 8) != records.block_identity("/r/m_2_r0/abc/de_g0/k.bin", 8)
    assert records.block_identity("/r/m_1_r0/abc/de_g0/k.bin", 8) != records.block_identity("/r/m_1_r0/abc/de_g0/k.bin", 16)


def test_condemned_error_says_why(io_backend, tmp_path):
    """A condemned block's OSError says the cause in its message (str(), as JobResult.error
    and the log show it), errno, filename and attributes unchanged; both backends alike."""
    def load_err(p, n=BS):
        out = np.zeros(n, np.uint8)
        with pytest.raises(OSError) as ei:
            io_backend.batch_load_block([p], out, [0], n, checksum=True)
        assert not os.path.exists(p)  # condemned: removed
        return ei.value

    p, data = block_path(tmp_path), data_of(40)
    put(io_backend, p, data)
    os.truncate(p, 1000)
    e = load_err(p)
    assert (e.errno, e.filename, e.operation, e.condemned) == (EIO, p, "verify", "size")
    assert e.strerror == f"block condemned (size): 1000 bytes, expected {BS}"
    assert str(e) == f"[Errno {EIO}] block condemned (size): 1000 bytes, expected {BS}: {p!r}"

    put(io_backend, p, data)
    with open(p, "r+b") as f:
        f.seek(100)
        f.write(bytes([data[100] ^ 1]))
    e = load_err(p)
    assert (e.errno, e.filename, e.operation, e.condemned, e.checksum_failed) == (
        errno.EBADMSG, p, "verify", "checksum", True)
    assert e.strerror == "block condemned (checksum): CRC32C mismatch (or malformed record) on two reads"

    other = block_path(tmp_path, "fedcba9876543210")
    put(io_backend, other, data)
    shutil.copy2(other, p)  # another block's bytes and records under this name
    e = load_err(p)
    assert (e.errno, e.filename, e.condemned, e.checksum_failed) == (errno.EBADMSG, p, "identity", True)
    assert e.strerror == "block condemned (identity): identity record of another block or layout on two reads"

    e2 = None
    try:  # an error that condemns nothing keeps the plain strerror
        io_backend.batch_load_block([p], np.zeros(BS, np.uint8), [0], BS, checksum=True)
    except OSError as e2_:
        e2 = e2_
    assert e2 is not None and (e2.errno, e2.strerror, e2.condemned) == (
        errno.ENOENT, os.strerror(errno.ENOENT), None)


def test_identity_of_a_clean_absolute_path_is_unchanged():
    """Lexical normalisation keeps the identity of a clean absolute path (FileMapper's):
    blocks stored before it still load. Expected values from the formula before it:
    FNV-1a 64 of "kvtier.id.v1\\0", the bytes after the path's fourth-last "/" (the whole
    path if it has fewer), "\\0", the size in decimal."""
    assert records.block_identity("/tmp/kv/m_0123456789abcdef_r0/abc/de_g0/abcdef0123.bin",
                                 65536).hex() == "62a1bb24f74a16a8"
    assert records.block_identity("/a/b/c", 4096) == records.block_identity("/a//b/./c", 4096)
    assert records.block_identity("/a/b/c/d", 4096) == records.block_identity("/x/../a/b/c/d", 4096)
    assert records.block_identity("/a/b/c/d", 4096) != records.block_identity("/a/b/c/e", 4096)
