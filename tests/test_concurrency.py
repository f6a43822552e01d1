"""Concurrency: two processes, several threads each, storing and loading the
same keys at the same time (C core and fallback mixed, so the two
implementations also race each other).

Each round has its own set of keys; every thread of both processes stores all
of them and loads them back in its own random order, so up to 8 writers race
for each destination (the existence check, the exclusive temp create and the
rename) while readers load it. Expected: no store fails; a load either fails
with ENOENT (not stored yet) or returns exactly the stored bytes (never a
partial file, never EBADMSG/EIO); afterwards every file is complete, carries
the right CRC32C record and loads with verification, and no temp is left.
"""
from __future__ import annotations

import glob
import os
import random
import threading
import time
import traceback

import numpy as np

import kvtier
from kvtier import io as kio

BS = 1024 * 1024 + 4096  # more than one piece of the I/O engine
NKEYS = 16
ROUNDS = 5
THREADS = 4
XATTR = "user.vllm.kv_crc32c"
BASE = np.random.default_rng(99).integers(0, 256, BS, dtype=np.uint8)


def content(r: int, k: int) -> np.ndarray:
    b = BASE.copy()
    b[:16] = np.frombuffer(r.to_bytes(8, "little") + k.to_bytes(8, "little"), dtype=np.uint8)
    b[BS // 2] = (r * 31 + k) & 0xFF
    return b


def path_of(d: str, r: int, k: int) -> str:
    h = (r.to_bytes(8, "big") + k.to_bytes(8, "big")).hex()
    return os.path.join(d, h[:3], f"{h[3:5]}_g0", f"{h}.bin")


def worker(d: str, tid: int, seed: int, errors: list) -> None:
    rng = random.Random(seed)
    io = kio.for_backend("c" if tid % 2 == 0 else "python")
    out = np.empty(BS, dtype=np.uint8)
    try:
        for r in range(ROUNDS):
            order = list(range(NKEYS))
            rng.shuffle(order)
            for k in order:
                p = path_of(d, r, k)
                if rng.random() < 0.5:  # try a load before storing: races a peer's rename
                    try:
                        out[:] = 0
                        io.batch_load_block([p], out, [0], BS, checksum=True)
                        if not np.array_equal(out, content(r, k)):
                            errors.append(f"{io.backend} t{tid}: wrong bytes loaded from {p}")
                    except FileNotFoundError:
                        pass
                io.batch_store_block([p], content(r, k), [0], BS, checksum=True)
                out[:] = 0
                io.batch_load_block([p], out, [0], BS, checksum=True)
                if not np.array_equal(out, content(r, k)):
                    errors.append(f"{io.backend} t{tid}: wrong bytes after store from {p}")
    except Exception:  # any OSError (EBADMSG, EIO, EEXIST ...) is a failure
        errors.append(f"{io.backend} t{tid}: " + traceback.format_exc())


def run_threads(d: str, seed: int, start_fd: int) -> list:
    errors: list = []
    os.read(start_fd, 1)  # both processes start together
    ts = [threading.Thread(target=worker, args=(d, t, seed * 100 + t, errors)) for t in range(THREADS)]
    for t in ts:
        t.start()
    for t in ts:
        t.join()
    return errors


CHILD = """
import os, sys
sys.path.insert(0, sys.argv[1])
import test_concurrency as t
errs = t.run_threads(sys.argv[2], seed=2, start_fd=int(sys.argv[3]))
print("\\n".join(errs))
sys.exit(3 if errs else 0)
"""


def test_two_processes_many_threads_same_keys(tmp_path):
    import subprocess
    import sys

    d = str(tmp_path / "cache")
    os.makedirs(d)
    start_r, start_w = os.pipe()
    try:
        # the second process is a fresh Python (not a fork of this one)
        child = subprocess.Popen([sys.executable, "-c", CHILD, os.path.dirname(os.path.abspath(__file__)), d,
                                  str(start_r)], pass_fds=(start_r,), stdout=subprocess.PIPE,
                                 stderr=subprocess.STDOUT, text=True)
        time.sleep(0.5)  # let it import; then both start at once
        os.write(start_w, b"gg")  # one byte for each process
        errors = run_threads(d, seed=1, start_fd=start_r)
        child_out, _ = child.communicate(timeout=300)
    finally:
        os.close(start_r)
        os.close(start_w)
    assert errors == [], "\n".join(errors)
    assert child.returncode == 0, child_out

    # every key of every round was published exactly once, complete and verified
    bins = glob.glob(os.path.join(d, "**", "*.bin"), recursive=True)
    assert len(bins) == ROUNDS * NKEYS
    out = np.empty(BS, dtype=np.uint8)
    for r in range(ROUNDS):
        for k in range(NKEYS):
            p = path_of(d, r, k)
            want = content(r, k)
            assert os.path.getsize(p) == BS
            assert os.getxattr(p, XATTR) == kvtier.crc32c(want).to_bytes(4, "big")
            out[:] = 0
            kio.for_backend("c").batch_load_block([p], out, [0], BS, checksum=True)
            assert np.array_equal(out, want)
    assert glob.glob(os.path.join(d, "**", "*.tmp"), recursive=True) == []


def test_manager_threads_store_and_load_same_keys(tmp_path):
    """The tier manager with several read and write threads, jobs storing and
    loading overlapping keys at once: every load that succeeds returns the
    stored bytes, and the tier ends with every block verified, no temps."""
    from kvtier.manager import FileSystemTierManager, TransferJob

    bs = 128 * 1024
    rows = 8
    src = np.random.default_rng(5).integers(0, 256, (rows, bs), dtype=np.uint8)
    keys = [(bytes([k]) * 16, 0) for k in range(rows)]
    with FileSystemTierManager(src, str(tmp_path / "c"), "conc/model", n_read_threads=4, n_write_threads=4,
                               checksum_blocks=True) as m:
        for j in range(12):  # 12 overlapping store jobs of all keys, shuffled
            order = random.Random(j).sample(range(rows), rows)
            m.submit_store(TransferJob(("s", j), [keys[i] for i in order], order))
        assert m.drain_jobs(timeout=60)
        res = m.get_finished_jobs()
        assert len(res) == 12 and all(r.success for r in res), [r.error for r in res if not r.success]
        dst = np.zeros_like(src)
        with FileSystemTierManager(dst, str(tmp_path / "c"), "conc/model", n_read_threads=4,
                                   n_write_threads=4, checksum_blocks=True) as m2:
            for j in range(12):
                order = random.Random(100 + j).sample(range(rows), rows)
                m2.submit_load(TransferJob(("l", j), [keys[i] for i in order], order))
                m.submit_store(TransferJob(("s2", j), keys, list(range(rows))))  # racing re-stores (skipped)
            assert m2.drain_jobs(timeout=60) and m.drain_jobs(timeout=60)
            loads = m2.get_finished_jobs()
            assert len(loads) == 12 and all(r.success and not r.checksum_failed for r in loads)
            assert all(r.success for r in m.get_finished_jobs())
            assert np.array_equal(dst, src)
    assert glob.glob(os.path.join(str(tmp_path / "c"), "**", "*.tmp"), recursive=True) == []
    assert len(glob.glob(os.path.join(str(tmp_path / "c"), "**", "*.bin"), recursive=True)) == rows
