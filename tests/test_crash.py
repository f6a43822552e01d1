"""Crash consistency: a process storing blocks is SIGKILLed at random points.

A child (forked by a clean, single-threaded fork server) stores checksummed
blocks in a loop (kvtier.io over the C core or the fallback, or the tier
manager) and is SIGKILLed after a random delay,
at least 100 times in all. After each kill: every published ``.bin`` loads
with checksum verification and holds exactly the bytes stored for its key (no
torn or half-written block is ever visible under its final name), and every
other file left is a store temp (``<hash>.bin_<hex>.tmp``). The temps left by
the kills are then removed by the stale-temp sweep, which touches nothing else.

Plus the sweep's own contract (kvtier/_tier/sweep.py, FileSystemTierManager
``sweep_stale_temps_after``): only this tier's temps older than the threshold.
"""
from __future__ import annotations

import errno
import os
import random
import re
import shutil
import signal
import time

import numpy as np
import pytest

from kvtier import io as kio
from kvtier._tier.sweep import TEMP_NAME_RE, sweep_stale_temps

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


# A fork server: a fresh single-threaded Python (no pytest threads, no locks
# held by other threads at fork time) that forks one storing child per request,
# reports its pid, and reaps it after the test kills it.
FORK_SERVER = """
import os, sys
sys.path.insert(0, sys.argv[1])
import test_crash as tc
for line in sys.stdin:
    mode, d, start = line.split()
    pid = os.fork()
    if pid == 0:
        tc._child_loop(mode, d, int(start))
    print(pid, flush=True)
    print(os.waitpid(pid, 0)[1], flush=True)
"""


def test_sigkill_during_stores_never_publishes_a_torn_block(tmp_path):
    import subprocess
    import sys

    rng = random.Random(42)
    published = temps_seen = 0
    t_end = time.monotonic() + 60
    kills = 0
    env = {**os.environ, "OPENBLAS_NUM_THREADS": "1", "OMP_NUM_THREADS": "1"}
    server = subprocess.Popen([sys.executable, "-c", FORK_SERVER, os.path.dirname(os.path.abspath(__file__))],
                              stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env)
    try:
        while kills < KILLS:
            assert time.monotonic() < t_end, f"only {kills} kills in 60 s"
            mode = MODES[kills % len(MODES)]
            d = str(tmp_path / f"k{kills}")
            os.makedirs(d)
            delay = rng.uniform(0.0, 0.04 if mode != "manager" else 0.08)
            server.stdin.write(f"{mode} {d} {kills * 100000}\n")
            server.stdin.flush()
            pid = int(server.stdout.readline())
            time.sleep(delay)
            os.kill(pid, signal.SIGKILL)
            status = int(server.stdout.readline())
            assert os.WIFSIGNALED(status) and os.WTERMSIG(status) == signal.SIGKILL, \
                f"child ({mode}) ended by itself (status {status}) before the kill"
            kills += 1
            published_now, temps_now = _check_after_kill(mode, d, kills)
            published += published_now
            temps_seen += temps_now
    finally:
        server.stdin.close()
        server.wait(timeout=30)
    # the kills really landed inside stores, and plenty of blocks were published (verified
    # above). Half a block per run: a quiet host publishes 2-4, an ASan build on a busy one ~1.
    assert temps_seen >= 5, f"only {temps_seen} temps left in {KILLS} kills: kills never hit a store"
    assert published >= KILLS // 2, f"only {published} blocks published in {KILLS} runs"


def _check_after_kill(mode, d, kills):

    """After a kill: only complete, verified blocks and temps; the sweep
    removes exactly the temps. Returns (blocks published, temps left)."""
    root = d
    if mode == "manager":
        ranks = [e for e in os.listdir(d) if e.endswith("_r0")]
        root = os.path.join(d, ranks[0]) if ranks else d
    bins, temps, other = _scan(root)
    if mode == "manager":
        other = [p for p in other if os.path.basename(p) not in ("config.json", "kvtier.json")]
    assert other == [], f"unexpected files after a kill: {other}"
    _verify(bins, backend="c" if kills % 2 else "python")

    # the sweep removes exactly the temps, and the blocks still verify
    res = sweep_stale_temps(d, older_than=0.0, now=time.time() + 1)
    assert sorted(res.removed) == sorted(temps) and res.errors == []
    bins2, temps2, _ = _scan(root)
    assert sorted(bins2) == sorted(bins) and temps2 == []
    shutil.rmtree(d)
    return len(bins), len(temps)


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
    with pytest.raises(exc, match="^sweep_stale_temps_after must be"):
        FileSystemTierManager(np.zeros((1, 4096), dtype=np.uint8), str(root), "m",
                              sweep_stale_temps_after=bad)
    assert not root.exists()
    with pytest.raises(exc, match="^older_than must be"):
        sweep_stale_temps(str(tmp_path), bad)


@pytest.mark.parametrize("short", [0, 0.5, 59.9])
def test_sweep_after_below_a_minute_is_refused(tmp_path, short):
    """A tier started with sweep_stale_temps_after=0 would delete the temps other live
    processes are writing: the key needs >= 60 s (the function itself takes any age)."""
    from kvtier.manager import FileSystemTierManager

    root = tmp_path / "never"
    with pytest.raises(ValueError, match=r"^sweep_stale_temps_after must be .*>= 60 .*use minutes"):
        FileSystemTierManager(np.zeros((1, 4096), dtype=np.uint8), str(root), "m",
                              sweep_stale_temps_after=short)
    assert not root.exists()
    with FileSystemTierManager(np.zeros((1, 4096), dtype=np.uint8), str(root), "m", n_read_threads=1,
                               n_write_threads=1, sweep_stale_temps_after=60) as m:
        assert m.last_sweep is not None and m.last_sweep.removed == []


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


# ---------------------------------------------------------------- optional durability

def _store_two(io, d, durable):
    bs = 64 * 1024
    view = np.random.default_rng(8).integers(0, 256, 2 * bs, dtype=np.uint8)
    paths = [os.path.join(d, "aa", f"{i:02x}_g0", f"{i:032x}.bin") for i in range(2)]
    io.batch_store_block(paths, view, [0, bs], bs, checksum=True, durable=durable)
    out = np.zeros_like(view)
    io.batch_load_block(paths, out, [0, bs], bs, checksum=True)
    assert np.array_equal(out, view)
    return paths


def test_durable_fallback_syncs_temp_before_rename_and_dir_after(tmp_path, monkeypatch):
    """The fallback calls os.fdatasync on the open temp (before the rename)
    and os.fsync on the destination's directory (after it), once per block;
    without ``durable`` neither is called."""
    events = []
    real_fdatasync, real_fsync, real_rename = os.fdatasync, os.fsync, os.rename

    def spy_fdatasync(fd):
        events.append(("fdatasync", os.readlink(f"/proc/self/fd/{fd}")))
        return real_fdatasync(fd)

    def spy_fsync(fd):
        events.append(("fsync", os.readlink(f"/proc/self/fd/{fd}")))
        return real_fsync(fd)

    def spy_rename(a, b, *args, **kw):
        events.append(("rename", os.fsdecode(b)))
        return real_rename(a, b, *args, **kw)

    monkeypatch.setattr(os, "fdatasync", spy_fdatasync)
    monkeypatch.setattr(os, "fsync", spy_fsync)
    monkeypatch.setattr(os, "rename", spy_rename)
    io = kio.for_backend("python")
    _store_two(io, str(tmp_path / "off"), durable=False)
    assert [e for e in events if e[0] != "rename"] == []
    events.clear()
    paths = _store_two(io, str(tmp_path / "on"), durable=True)
    assert len(events) == 3 * len(paths), events
    for i, p in enumerate(paths):
        (k1, temp), (k2, renamed), (k3, synced_dir) = events[3 * i: 3 * i + 3]
        assert k1 == "fdatasync" and re.fullmatch(re.escape(p) + r"_[0-9a-f]+\.tmp", temp), events
        assert (k2, renamed) == ("rename", p)
        assert (k3, synced_dir) == ("fsync", os.path.dirname(p))


def test_durable_c_core_syscalls_under_strace(tmp_path):
    """The C core: with durable=True, for each block fdatasync(temp fd) comes
    before the rename and fsync(directory fd) after it (strace -f -y shows
    the paths of the fds); with durable=False there is no fdatasync/fsync."""
    import shutil as _sh
    import subprocess
    import sys
    import textwrap

    if _sh.which("strace") is None:
        pytest.skip("strace not installed (scripts/bootstrap --test installs it)")
    pytest.importorskip("kvtier._C")
    script = textwrap.dedent("""
        import os, sys
        import numpy as np
        from kvtier import io
        d, durable = sys.argv[1], sys.argv[2] == "1"
        bs = 64 * 1024
        v = np.arange(2 * bs, dtype=np.uint8)
        paths = [os.path.join(d, "x", f"{i}.bin") for i in range(2)]
        io.for_backend("c").batch_store_block(paths, v, [0, bs], bs, checksum=True, durable=durable)
    """)
    out = {}
    for durable in (0, 1):
        d = str(tmp_path / f"d{durable}")
        log = str(tmp_path / f"strace{durable}.log")
        r = subprocess.run(["strace", "-f", "-y", "-qq", "-o", log, "-e", "trace=fdatasync,fsync,rename,renameat,renameat2",
                            sys.executable, "-c", script, d, str(durable)], capture_output=True, text=True, timeout=120)
        if r.returncode != 0 and "PTRACE" in r.stderr.upper():
            pytest.skip(f"strace cannot trace here: {r.stderr.strip()[-200:]}")
        assert r.returncode == 0, r.stderr
        with open(log) as f:
            out[durable] = [l.split(None, 1)[1] if l[0].isdigit() else l for l in f.read().splitlines()]
    assert not [l for l in out[0] if l.startswith(("fdatasync", "fsync"))], out[0]
    calls = [l for l in out[1] if l.startswith(("fdatasync", "fsync", "rename"))]
    d = str(tmp_path / "d1")
    for i in range(2):
        dest = os.path.join(d, "x", f"{i}.bin")
        k = next(j for j, l in enumerate(calls) if l.startswith("rename") and f'"{dest}"' in l)
        assert re.match(r"fdatasync\(\d+<" + re.escape(dest) + r"_[0-9a-f]+\.tmp>\) = 0", calls[k - 1]), calls
        assert re.match(r"fsync\(\d+<" + re.escape(os.path.join(d, "x")) + r">\) = 0", calls[k + 1]), calls


@pytest.mark.parametrize("backend", ["c", "python"])
def test_durable_round_trip_and_manager_option(tmp_path, backend):
    from kvtier.manager import FileSystemTierManager, TransferJob

    _store_two(kio.for_backend(backend), str(tmp_path / "io"), durable=True)
    buf = np.random.default_rng(4).integers(0, 256, (3, 8192), dtype=np.uint8)
    keys = [(bytes([i]) * 16, 0) for i in range(3)]
    with FileSystemTierManager(buf, str(tmp_path / "m"), "dur/model", n_read_threads=1, n_write_threads=1,
                               checksum_blocks=True, durable=True) as m:
        assert m.durable is True
        m.submit_store(TransferJob(1, keys, [0, 1, 2]))
        assert m.drain_jobs(timeout=30)
        (r,) = m.get_finished_jobs()
        assert r.success and len(r.successful_keys) == 3
        assert m.lookup(keys) == [True] * 3
    with pytest.raises(TypeError):
        FileSystemTierManager(buf, str(tmp_path / "m2"), "dur/model", durable="yes")
