"""Two nodes on one real distributed filesystem (GlusterFS, MooseFS): tests/dfs.py starts
the servers in a network namespace and two FUSE clients (node A, node B); each test runs a
tier per node, node B's in another process (tests/dfs_node.py), and checks every byte.

Clients mount with the options docs/shared-filesystems.md recommends (GlusterFS
``--fopen-keep-cache=false``, MooseFS ``mfsxattrcacheto=0``)."""
from __future__ import annotations

import errno
import json
import os
import subprocess
import sys
import time

import numpy as np
import pytest

import dfs as _dfs
import dfs_node
from corrupt import flip_bit

import kvtier

pytestmark = pytest.mark.dfs

HERE = os.path.dirname(os.path.abspath(__file__))
BS = 256 * 1024  # bytes per block
N = 24


def node(op, root, *args, backend=None, wait=True, **kw):
    """Run tests/dfs_node.py ``op`` on ``root`` in a new process; returns its JSON result
    (or the Popen with ``wait=False``)."""
    argv = [sys.executable, os.path.join(HERE, "dfs_node.py"), op, root,
            "--blocks", str(kw.pop("blocks", N)), "--block-bytes", str(kw.pop("bs", BS)), *args]
    for k, v in kw.items():
        argv += [f"--{k.replace('_', '-')}", str(v)]
    env = dict(os.environ)
    if backend:
        env["KVTIER_IO_BACKEND"] = backend
    p = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    if not wait:
        return p
    return finish(p)


def finish(p, timeout=120):
    out, err = p.communicate(timeout=timeout)
    assert p.returncode == 0, f"{p.args}: exit {p.returncode}\n{err[-3000:]}"
    return json.loads(out)


def store_here(root, seed=0, n=N, o_direct=True):
    """Store blocks 0..n-1 of ``seed`` through a tier in this process; returns (tier paths, src)."""
    from kvtier.manager import TransferJob

    src = dfs_node.blocks(seed, n, BS)
    t = dfs_node.tier(src.copy(), root, True, o_direct)
    try:
        t.submit_store(TransferJob("s", [dfs_node.key(seed, i) for i in range(n)], list(range(n))))
        assert t.drain_jobs(timeout=120)
        (r,) = t.get_finished_jobs()
        assert r.success, r.error
        return [t.file_mapper.get_file_name(dfs_node.key(seed, i)) for i in range(n)], src
    finally:
        t.shutdown()


def via(path, a, b):
    """The same file through the other mount."""
    assert path.startswith(a + "/")
    return b + path[len(a):]


def files_under(root):
    out = {"bin": [], "tmp": [], "other": []}
    for d, _, fs in os.walk(root):
        for f in fs:
            kind = "bin" if f.endswith(".bin") else "tmp" if f.endswith(".tmp") else "other"
            out[kind].append(os.path.join(d, f))
    return out


def eventually(cond, timeout=10.0):
    """Poll ``cond`` until true or ``timeout`` s (a client's name cache lags ~1 s)."""
    deadline = time.monotonic() + timeout
    while not cond():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.05)
    return True


@pytest.mark.parametrize("backend", ["c", "python"])
def test_store_on_a_load_on_b_every_byte(dfs, dfs_dirs, backend):
    a, b = dfs_dirs
    paths, src = store_here(a)
    for i, p in enumerate(paths):  # the CRC32C xattr node A set is what node B reads
        pb = via(p, a, b)
        assert os.path.getsize(pb) == BS
        assert os.getxattr(pb, "user.vllm.kv_crc32c") == kvtier.crc32c(src[i].tobytes()).to_bytes(4, "big")
    r = node("load", b, backend=backend)
    assert r["loaded"] == list(range(N)) and r["missed"] == [], r
    assert r["mismatched_bytes"] == 0 and r["checksum_failed"] == 0 and r["errors"] == [], r
    assert not files_under(a)["tmp"]


@pytest.mark.parametrize("o_direct", [False, True], ids=["buffered", "o_direct"])
def test_byte_flipped_through_b_is_caught_through_a(dfs, dfs_dirs, o_direct):
    a, b = dfs_dirs
    paths, src = store_here(a, o_direct=o_direct)
    r = node("load", a, o_direct=int(o_direct))  # node A has read them: its page cache is warm
    assert r["loaded"] == list(range(N)) and r["mismatched_bytes"] == 0
    bad = {3, 17}
    for i in bad:
        flip_bit(via(paths[i], a, b), BS // 2 + i)
    r = node("load", a, o_direct=int(o_direct))
    assert r["missed"] == sorted(bad), r
    assert r["checksum_failed"] == len(bad) and r["errors"] == ["EBADMSG"]
    assert r["loaded"] == sorted(set(range(N)) - bad) and r["mismatched_bytes"] == 0
    for i in range(N):  # condemned files are gone through both nodes, the others kept intact
        if i in bad:
            assert not os.path.exists(paths[i])
            assert eventually(lambda: not os.path.exists(via(paths[i], a, b)))
        else:
            with open(via(paths[i], a, b), "rb") as f:
                assert f.read() == src[i].tobytes()


def test_both_nodes_store_the_same_keys_at_once(dfs, dfs_dirs, tmp_path):
    a, b = dfs_dirs
    go = str(tmp_path / "go")
    pa = node("store", a, wait=False, go=go)
    pb = node("store", b, wait=False, go=go)
    time.sleep(1.0)  # both processes up, tiers open, waiting
    open(go, "w").close()
    ra, rb = finish(pa), finish(pb)
    # Every key stored by at least one node. A store may fail, never leaving a temp: on
    # GlusterFS a node's mkdir of a directory the other node just made gives EEXIST, and
    # its open in it ENOENT for about a second (name cache); that block is the other's.
    assert set(ra["loaded"]) | set(rb["loaded"]) == set(range(N)), (ra, rb)
    assert set(ra["errors"]) | set(rb["errors"]) <= {"ENOENT"}, (ra, rb)
    src = dfs_node.blocks(0, N, BS)
    for root in (a, b):
        f = files_under(root)
        assert f["tmp"] == [], f["tmp"]
        assert len(f["bin"]) == N
    names = sorted(os.path.basename(p) for p in files_under(b)["bin"])
    want = sorted(dfs_node.key(0, i)[0].hex() + ".bin" for i in range(N))
    assert names == want
    by_name = {dfs_node.key(0, i)[0].hex() + ".bin": i for i in range(N)}
    for p in files_under(b)["bin"]:
        i = by_name[os.path.basename(p)]
        with open(p, "rb") as fh:
            assert fh.read() == src[i].tobytes()
        assert os.getxattr(p, "user.vllm.kv_crc32c") == kvtier.crc32c(src[i].tobytes()).to_bytes(4, "big")
    r = node("load", a)
    assert r["loaded"] == list(range(N)) and r["mismatched_bytes"] == 0


def test_scrub_remove_on_b_while_a_loads(dfs, dfs_dirs, tmp_path):
    a, b = dfs_dirs
    paths, src = store_here(a)
    bad = [1, 8, 9, 20]
    for i in bad:
        flip_bit(via(paths[i], a, b), 7 * i)
    good = [i for i in range(N) if i not in bad]
    stop = str(tmp_path / "stop")
    loader = node("load", a, wait=False, until=stop, only=",".join(map(str, good)))
    time.sleep(1.0)
    sc = subprocess.run([sys.executable, "-m", "kvtier", "scrub", "--remove", "--json", "--no-progress", b],
                        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, timeout=120)
    open(stop, "w").close()
    r = finish(loader)
    assert sc.returncode == 1, sc.stderr
    d = json.loads(sc.stdout)
    assert d["counts"]["corrupt"] == len(bad) and d["counts"]["ok"] == len(good), d["counts"]
    assert sorted(d["removed"]) == sorted(via(paths[i], a, b) for i in bad)
    assert r["passes"] >= 1 and r["loaded"] == good and r["mismatched_bytes"] == 0 and r["errors"] == []
    for i in range(N):
        if i in bad:
            assert eventually(lambda: not os.path.exists(paths[i]))
        else:
            with open(paths[i], "rb") as fh:
                assert fh.read() == src[i].tobytes()


def test_two_client_bench(dfs, dfs_dirs):
    a, b = dfs_dirs
    p = subprocess.run([sys.executable, "-m", "kvtier", "bench", "--root", a, "--node-b", b, "--preset", "tiny",
                        "--blocks", "24", "--repeat", "1", "--vllm", "off", "--json"],
                       stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, timeout=300)
    assert p.returncode == 0, p.stderr[-3000:]
    d = json.loads(p.stdout)
    assert [(r["engine"], r["op"]) for r in d["rows"]] == [
        ("kvtier checksum off", "store"), ("kvtier checksum off", "load"),
        ("kvtier checksum on", "store"), ("kvtier checksum on", "load")]
    for r in d["rows"]:
        assert r["failed_blocks"] == 0 and r["mismatched_bytes"] == 0, (r, p.stderr[-3000:])
        assert 0 < r["gbps_a"] and 0 < r["gbps_b"] and r["gbps_total"] > 0
    assert d["fstype"] == dfs.fstype and d["ok"] is True
    assert os.listdir(a) == []  # the bench directory is removed


def _parse_up_line(out):
    import ast
    import re

    m = re.search(r"mounts (\[.*?\]), storage PIDs (\[.*?\]), namespaces (\S+) (\S+), PIDs (\[.*?\])", out)
    assert m, out
    return ast.literal_eval(m[1]), ast.literal_eval(m[2]), m[3], m[4], ast.literal_eval(m[5])


def _assert_nothing_left(mounts, ns_s, ns_c, pids):
    work = os.path.dirname(mounts[0])
    for pid in pids:  # gone, a zombie of a reaper that is not ours, or the PID reused by another program
        try:
            with open(f"/proc/{pid}/stat") as f:
                state = f.read().rsplit(")", 1)[1].split()[0]
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                cmd = f.read().decode(errors="replace")
        except OSError:
            continue
        assert state == "Z" or work not in cmd, f"{pid} still running: {cmd}"
    assert not os.path.exists(f"/run/netns/{ns_s}") and not os.path.exists(f"/run/netns/{ns_c}")
    with open("/proc/self/mountinfo") as f:
        mi = f.read()
    for mnt in mounts:
        assert mnt not in mi and not os.path.exists(os.path.dirname(mnt))


@pytest.mark.parametrize("kind", ["glusterfs", "moosefs"])
def test_cluster_teardown_leaves_nothing(kind):
    """tests/dfs.py stops every daemon it started and deletes its namespaces, mounts and files
    (run in a process of its own: the session's clusters stay up meanwhile)."""
    why = _dfs.missing(kind)
    if why:
        from ci import unavailable

        unavailable(why)
    p = subprocess.run([sys.executable, os.path.join(HERE, "dfs.py"), kind, "0"], stdout=subprocess.PIPE,
                       stderr=subprocess.PIPE, text=True, timeout=300)
    assert p.returncode == 0, p.stderr[-3000:]
    mounts, storage, ns_s, ns_c, pids = _parse_up_line(p.stdout)
    assert len(mounts) == 2 and len(storage) == 2 and set(storage) <= set(pids)
    _assert_nothing_left(mounts, ns_s, ns_c, pids)


def test_a_killed_run_is_swept_by_the_next():
    """SIGKILL the process that started a cluster: no teardown ran; sweep_leftovers (called
    by every cluster start) stops what that run's record names and deletes the rest."""
    why = _dfs.missing("glusterfs")
    if why:
        from ci import unavailable

        unavailable(why)
    p = subprocess.Popen([sys.executable, os.path.join(HERE, "dfs.py"), "glusterfs", "120"], stdout=subprocess.PIPE,
                         stderr=subprocess.PIPE, text=True)
    try:
        line = p.stdout.readline()  # printed once the cluster is up
        mounts, storage, ns_s, ns_c, pids = _parse_up_line(line)
    finally:
        p.kill()
        p.wait(30)
    assert all(os.path.exists(f"/proc/{pid}") for pid in pids) and os.path.exists(f"/run/netns/{ns_s}")
    swept = _dfs.sweep_leftovers()
    assert os.path.dirname(mounts[0]) in swept
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline and any(os.path.exists(f"/proc/{pid}/cmdline") and
                                              open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()[0] != "Z"
                                              for pid in pids):
        time.sleep(0.1)
    _assert_nothing_left(mounts, ns_s, ns_c, pids)


def test_storage_server_stopped_mid_load(dfs, dfs_dirs):
    """SIGSTOP one brick / chunkserver: loads of the blocks it holds are misses at the
    deadline (io_timeout_s), never a hang or a wrong byte; on GlusterFS the blocks on the
    other brick load through the same tier while it is still stopped (once the client
    declares it gone); no timed-out row is written late; after SIGCONT every block loads
    intact."""
    import itertools
    import signal

    from kvtier.manager import TransferJob

    a, _ = dfs_dirs
    if dfs.kind == "moosefs":  # one copy per chunk, so a stopped chunkserver holds the only one
        dfs.client_tool("mfssetgoal", "-r", "1", a)
    n = 16
    paths, src = store_here(a, n=n)
    where = [dfs.storage_of(p) for p in paths]
    assert all(len(w) == 1 for w in where), where
    stalled = [i for i in range(n) if where[i] == [0]]
    served = [i for i in range(n) if where[i] == [1]]
    assert stalled and served, where  # 16 random keys over 2 servers: both hold some
    pid = dfs.storage_pids[0]
    buf = np.zeros_like(src)
    deadline = 3.0
    # threads: 2 x 16, so the stalled jobs (< 16) stay under the stuck-thread cap (twice that)
    t = dfs_node.tier(buf, a, True, True, threads=16, io_timeout_s=deadline)

    ids = itertools.count()

    def load(rows):
        """One job per block; returns {block: JobResult}."""
        block_of = {}
        for i in rows:
            block_of[j := next(ids)] = i
            t.submit_load(TransferJob(j, [dfs_node.key(0, i)], [i]))
        assert t.drain_jobs(timeout=60)
        return {block_of[r.job_id]: r for r in t.get_finished_jobs()}

    try:
        os.kill(pid, signal.SIGSTOP)
        try:
            t0 = time.monotonic()
            res = load(range(n))
            took = time.monotonic() - t0
            for i in stalled:
                assert not res[i].success and res[i].error.errno == errno.ETIMEDOUT, (i, res[i])
            for i in served:  # may wait too (GlusterFS: a directory lookup asks every brick;
                if res[i].success:  # a client busy with the stalled requests); never a wrong byte
                    assert np.array_equal(buf[i], src[i]), i
                else:
                    assert res[i].error.errno == errno.ETIMEDOUT, (i, res[i])
            assert took < deadline + 10, took
            before = buf[stalled].copy()  # reported failed: nothing may write these rows from now on
            # still stopped: the tier keeps serving the blocks on the other brick. GlusterFS: once
            # a directory's entry times out (1 s) its lookup asks every brick and waits for the
            # stopped one until the client declares it gone (network.ping-timeout); one block per
            # try, so a try that still waits leaves one stuck thread, not a pool's worth
            t0 = time.monotonic()
            limit = _dfs.GLUSTER_PING_TIMEOUT + 3 * deadline + 10
            ok = set()
            while time.monotonic() - t0 < limit and len(ok) < len(served):
                i = [j for j in served if j not in ok][0]
                buf[i] = 0
                r = load([i])[i]
                if r.success:
                    assert np.array_equal(buf[i], src[i]), i
                    ok.add(i)
                else:
                    assert r.error.errno in (errno.ETIMEDOUT, errno.EAGAIN), r
                    time.sleep(0.5)
            if dfs.kind == "glusterfs":
                assert ok == set(served), f"blocks on the running brick not served within {limit} s"
            # MooseFS: its client may hold every read while one chunkserver is silent (seen on a
            # loaded machine); the deadline then keeps each a miss (checked above)
        finally:
            os.kill(pid, signal.SIGCONT)
        time.sleep(1.0)  # the stalled reads complete now: their rows must stay untouched
        assert np.array_equal(buf[stalled], before), "a timed-out load wrote into the buffer late"
        ok = set()
        for attempt in range(30):  # the client reconnects: bounded
            res = load([i for i in range(n) if i not in ok])
            ok |= {i for i, r in res.items() if r.success}
            if len(ok) == n:
                break
            time.sleep(0.5)
        assert ok == set(range(n)) and np.array_equal(buf, src)
    finally:
        os.kill(pid, signal.SIGCONT)
        t.shutdown()
