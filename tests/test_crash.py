"""Crash consistency: a process storing blocks is SIGKILLed at random points.

A forked child stores checksummed blocks in a loop (kvtier.io over the C core
or the fallback, or the tier manager) and is SIGKILLed after a random delay,
at least 100 times in all. After each kill: every published ``.bin`` loads
with checksum verification and holds exactly the bytes stored for its key (no
torn or half-written block is ever visible under its final name), and every
other file left is a store temp (``<hash>.bin_<hex>.tmp``). The temps left by
the kills are then removed by the stale-temp sweep, which touches nothing else.

Plus the sweep's own contract (kvtier/sweep.py, FileSystemTierManager
``sweep_stale_temps_after``): only this tier's temps older than the threshold.
"""
from __future__ import annotations

import errno
import os
import random
import shutil
import signal
import time

import numpy as np
import pytest

from kvtier import io as kio
from kvtier.sweep import TEMP_NAME_RE, sweep_stale_temps

BS = 512 * 1024 + 4096  # >= the C core's CRC helper-thread size, odd number of chunks
KILLS = 120
MODES = ["c", "python", "manager"]
BASE = np.random.default_rng(1234).integers(0, 256, BS, dtype=np.uint8)


def content(i: int) -> np.ndarray:
    """The bytes stored for key i: BASE stamped with i at both ends."""
    b = BASE.copy()
    stamp = np.frombuffer(int(i).to_bytes(8, "little"), dtype=np.uint8)
    b[:8] = stamp
    b[-8:] = stamp
    return b


def key_hash(i: int) -> bytes:
    return i.to_bytes(16, "big")


def _child_loop(mode: str, d: str, start: int) -> None:
    """Runs in the forked child until killed. Never returns."""
    try:
        i = start
        if mode == "manager":
            from kvtier.manager import FileSystemTierManager, TransferJob

            rows = 4
            buf = np.zeros((rows, BS), dtype=np.uint8)
            m = FileSystemTierManager(buf, d, "crash/model", n_read_threads=1, n_write_threads=2,
                                      checksum_blocks=True)
            j = 0
            while True:
                keys = []
                for r in range(rows):
                    buf[r] = content(i)
                    keys.append((key_hash(i), 0))
                    i += 1
                m.submit_store(TransferJob(j, keys, list(range(rows))))
                m.drain_jobs()
                m.get_finished_jobs()
                j += 1
        io = kio.for_backend(mode)
        while True:
            h = key_hash(i).hex()
            path = os.path.join(d, h[:3], f"{h[3:5]}_g0", f"{h}.bin")
            io.batch_store_block([path], content(i), [0], BS, checksum=True)
            i += 1
    finally:
        os._exit(0)


def _scan(d: str):
    """(published .bin paths, temp paths, other files) under d."""
    bins, temps, other = [], [], []
    for dirpath, _dirs, files in os.walk(d):
        for f in files:
            p = os.path.join(dirpath, f)
            if f.endswith(".bin"):
                bins.append(p)
            elif TEMP_NAME_RE.match(f):
                temps.append(p)
            else:
                other.append(p)
    return bins, temps, other


def _verify(bins, backend="c"):
    io = kio.for_backend(backend)
    out = np.empty(BS, dtype=np.uint8)
    for p in bins:
        assert os.path.getsize(p) == BS, f"torn block {p}: {os.path.getsize(p)} bytes"
        out[:] = 0
        io.batch_load_block([p], out, [0], BS, checksum=True)  # raises on any mismatch
        i = int(os.path.basename(p)[:-4], 16)
        assert np.array_equal(out, content(i)), f"{p} does not hold the bytes of key {i}"


def test_sigkill_during_stores_never_publishes_a_torn_block(tmp_path):
    rng = random.Random(42)
    published = temps_seen = 0
    t_end = time.monotonic() + 60
    kills = 0
    while kills < KILLS:
        assert time.monotonic() < t_end, f"only {kills} kills in 60 s"
        mode = MODES[kills % len(MODES)]
        d = str(tmp_path / f"k{kills}")
        os.makedirs(d)
        delay = rng.uniform(0.0, 0.04 if mode != "manager" else 0.08)
        pid = os.fork()
        if pid == 0:  # pragma: no cover - child
            _child_loop(mode, d, start=kills * 100000)
        time.sleep(delay)
        os.kill(pid, signal.SIGKILL)
        _, status = os.waitpid(pid, 0)
        assert os.WIFSIGNALED(status) and os.WTERMSIG(status) == signal.SIGKILL, \
            f"child ({mode}) ended by itself (status {status}) before the kill"
        kills += 1

        root = d
        if mode == "manager":
            ranks = [e for e in os.listdir(d) if e.endswith("_r0")]
            root = os.path.join(d, ranks[0]) if ranks else d
        bins, temps, other = _scan(root)
        if mode == "manager":
            other = [p for p in other if os.path.basename(p) not in ("config.json", "kvtier.json")]
        assert other == [], f"unexpected files after a kill: {other}"
        _verify(bins, backend="c" if kills % 2 else "python")
        published += len(bins)
        temps_seen += len(temps)

        # the sweep removes exactly the temps, and the blocks still verify
        res = sweep_stale_temps(d, older_than=0.0, now=time.time() + 1)
        assert sorted(res.removed) == sorted(temps) and res.errors == []
        bins2, temps2, _ = _scan(root)
        assert sorted(bins2) == sorted(bins) and temps2 == []
        shutil.rmtree(d)
    # the kills really landed inside stores, and plenty of blocks were published
    assert temps_seen >= 5, f"only {temps_seen} temps left in {KILLS} kills: kills never hit a store"
    assert published >= KILLS, f"only {published} blocks published in {KILLS} runs"


# ---------------------------------------------------------------- stale-temp sweep

OLD = 3600.0  # seconds before "now" for the old files


def _touch(path, data=b"x", age=0.0):
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "wb") as f:
        f.write(data)
    if age:
        t = time.time() - age
        os.utime(path, (t, t), follow_symlinks=False)
    return path


def _layout(rank_dir, other_rank_dir, outside):
    h = "0123456789abcdef0123456789abcdef"
    sub = os.path.join(rank_dir, h[:3], f"{h[3:5]}_g0")
    f = {
        "block": _touch(os.path.join(sub, f"{h}.bin"), age=OLD),
        "stale1": _touch(os.path.join(sub, f"{h}.bin_00112233aabbccdd.tmp"), age=OLD),
        "stale2": _touch(os.path.join(rank_dir, "fff", "ff_g1", "ffff.bin_0a.tmp"), age=OLD),
        "recent": _touch(os.path.join(sub, f"{h}.bin_99887766aabbccdd.tmp"), age=1.0),
        "not_ours_name": _touch(os.path.join(sub, "notes.tmp"), age=OLD),
        "bin_tmp_no_tag": _touch(os.path.join(sub, f"{h}.bin.tmp"), age=OLD),
        "upper_noise": _touch(os.path.join(sub, f"{h}.bin_zz.tmp"), age=OLD),
        "stale_probe": _touch(os.path.join(rank_dir, ".kvtier_probe_a1b2c3d4"), age=OLD),
        "probe_like_dir_file": _touch(os.path.join(rank_dir, ".kvtier_probe_x.y"), age=OLD),
        "other_rank": _touch(os.path.join(other_rank_dir, "abc", "de_g0", "abcdef.bin_0123.tmp"), age=OLD),
        "outside_target": _touch(os.path.join(outside, "victim.bin_0123.tmp"), age=OLD),
    }
    link = os.path.join(sub, "dead.bin_4567.tmp")
    os.symlink(f["outside_target"], link)
    t = time.time() - OLD
    os.utime(link, (t, t), follow_symlinks=False)
    f["symlink"] = link
    linked_dir = os.path.join(rank_dir, "linkdir")
    os.symlink(outside, linked_dir)  # a symlinked directory is not walked into
    return f


def test_sweep_removes_only_stale_temps_of_this_tier(tmp_path):
    from kvtier.manager import FileSystemTierManager

    buf = np.zeros((2, 4096), dtype=np.uint8)
    root = tmp_path / "cache"
    # find this tier's rank dir name from a first (unswept) manager
    with FileSystemTierManager(buf, str(root), "sweep/model", n_read_threads=1, n_write_threads=1) as m0:
        rank_dir = m0.file_mapper.rank_path
        assert m0.last_sweep is None  # default: off
    other_rank_dir = rank_dir[: -len("_r0")] + "_r1"
    outside = str(tmp_path / "outside")
    f = _layout(rank_dir, other_rank_dir, outside)

    # default (off): a new manager removes nothing
    with FileSystemTierManager(buf, str(root), "sweep/model", n_read_threads=1, n_write_threads=1):
        pass
    assert all(os.path.lexists(p) for p in f.values())

    with FileSystemTierManager(buf, str(root), "sweep/model", n_read_threads=1, n_write_threads=1,
                               sweep_stale_temps_after=60.0) as m:
        res = m.last_sweep
    assert sorted(res.removed) == sorted([f["stale1"], f["stale2"], f["stale_probe"]])
    assert res.kept_recent == 1 and res.errors == []
    gone = {"stale1", "stale2", "stale_probe"}
    for name, p in f.items():
        assert os.path.lexists(p) == (name not in gone), name
    assert os.path.exists(f["outside_target"])  # the symlink was not followed


def test_sweep_threshold_and_missing_dir(tmp_path):
    d = str(tmp_path / "t")
    p = _touch(os.path.join(d, "aa.bin_01.tmp"), age=100.0)
    assert sweep_stale_temps(d, 200.0).removed == []
    assert sweep_stale_temps(d, 200.0).kept_recent == 1
    assert sweep_stale_temps(d, 50).removed == [p]
    assert not os.path.exists(p)
    assert sweep_stale_temps(str(tmp_path / "missing"), 1.0).removed == []


@pytest.mark.parametrize("bad,exc", [(-1.0, ValueError), (float("nan"), ValueError), (float("inf"), ValueError),
                                     ("60", TypeError), (True, TypeError)])
def test_sweep_bad_threshold_raises_before_any_io(tmp_path, bad, exc):
    from kvtier.manager import FileSystemTierManager

    root = tmp_path / "never"
    with pytest.raises(exc):
        FileSystemTierManager(np.zeros((1, 4096), dtype=np.uint8), str(root), "m",
                              sweep_stale_temps_after=bad)
    assert not root.exists()
    with pytest.raises(exc):
        sweep_stale_temps(str(tmp_path), bad)


def test_sweep_records_unremovable_temps(tmp_path):
    """A temp that cannot be removed (immutable: EPERM even for root) is
    recorded in ``errors`` and the sweep goes on to the next one."""
    import shutil as _sh
    import subprocess

    d = str(tmp_path / "imm")
    stuck = _touch(os.path.join(d, "a", "aa.bin_01.tmp"), age=100.0)
    other = _touch(os.path.join(d, "b", "bb.bin_02.tmp"), age=100.0)
    if _sh.which("chattr") is None:
        pytest.skip("chattr (e2fsprogs) not installed")
    r = subprocess.run(["chattr", "+i", stuck], capture_output=True, text=True)
    if r.returncode != 0:
        pytest.skip(f"cannot make a file immutable here: {r.stderr.strip()}")
    try:
        res = sweep_stale_temps(d, 1.0)
        assert res.removed == [other]
        assert [(p, e.errno) for p, e in res.errors] == [(stuck, errno.EPERM)]
        assert os.path.exists(stuck)
    finally:
        subprocess.run(["chattr", "-i", stuck], capture_output=True)
