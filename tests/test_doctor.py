"""`kvtier doctor ROOT [--peer OTHER] [--json]` on real filesystems: its verdict per probe,
its exit status, and that it leaves nothing behind. The two-client cases run on GlusterFS
and MooseFS (tests/dfs.py)."""
from __future__ import annotations

import errno
import json
import os
import subprocess
import sys

import pytest

from fusefault.mount import mount_fusefault
from ci import unavailable
from kvtier._tier.mountinfo import mount_of
from mounts import mount_loop, mount_tmpfs

PROBES = ["filesystem", "writable", "user_xattr", "o_direct", "rename_excl", "space", "fsync"]
PEER_PROBES = ["peer_names", "peer_rename", "peer_data", "peer_xattr"]


def doctor(root, *args):
    """Run `kvtier doctor --json` in a new process; returns (exit status, report, stderr)."""
    p = subprocess.run([sys.executable, "-m", "kvtier", "doctor", "--json", root, *args],
                       stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, timeout=300)
    return p.returncode, (json.loads(p.stdout) if p.stdout.strip() else None), p.stderr


def statuses(d):
    return {c["name"]: c["status"] for c in d["checks"]}


def check(d, name):
    (c,) = [c for c in d["checks"] if c["name"] == name]
    return c


def test_text_report_and_help(tmp_path):
    p = subprocess.run([sys.executable, "-m", "kvtier", "doctor", str(tmp_path)], stdout=subprocess.PIPE,
                       stderr=subprocess.PIPE, text=True, timeout=120)
    assert p.returncode in (0, 1), p.stderr
    assert "user_xattr" in p.stdout and "kvtier here:" in p.stdout and f"(exit {p.returncode})" in p.stdout
    assert os.listdir(tmp_path) == []
    h = subprocess.run([sys.executable, "-m", "kvtier", "doctor", "--help"], stdout=subprocess.PIPE, text=True)
    assert "--peer" in h.stdout and "``" not in h.stdout


@pytest.mark.parametrize("fs", ["ext4", "xfs", "tmpfs"])
def test_local_filesystems_pass(fs):
    ctx = mount_tmpfs() if fs == "tmpfs" else mount_loop(fs, size_mb=1300)  # > 1 GiB: no space warning
    with ctx as root:
        os.mkdir(os.path.join(root, "cache"))
        code, d, err = doctor(root)
        assert code == 0, (err, d and [c for c in d["checks"] if c["status"] != "pass"])
        assert [c["name"] for c in d["checks"]] == PROBES
        assert set(statuses(d).values()) == {"pass"}
        assert d["kind"] == fs and d["filesystem"]["fstype"] == fs and d["filesystem"]["mount_point"] == root
        assert d["kvtier"] == {"io": "O_DIRECT", "checksums": True, "runs": True, "verify": d["kvtier"]["verify"]}
        assert d["recommended"]["source"] == "tested"
        od = check(d, "o_direct")["data"]
        assert od["aligned"] == "ok"
        if fs in ("ext4", "xfs"):  # block filesystems report their DIO alignment and refuse unaligned writes
            assert od["statx_dio_align"] and min(od["statx_dio_align"]) >= 512
            assert od["unaligned"] == "refused"
        assert sorted(os.listdir(root)) == ["cache"] + (["lost+found"] if fs == "ext4" else [])


@pytest.mark.parametrize("fs", ["ext4", "xfs"])
def test_a_discard_mount_passes_with_the_advice_for_a_bounded_cache(fs):
    """ext4/XFS mounted `discard` trim at every unlink (an eviction cost ~2x the CPU,
    docs/capacity.md): the filesystem check passes (an unbounded cache never unlinks in
    bulk), says so in its detail and data, and the recommended options say what to do;
    the same filesystem without `discard` carries no such note."""
    with mount_loop(fs, size_mb=1300, options="discard") as root:
        code, d, err = doctor(root)
        assert code == 0, (err, d and [c for c in d["checks"] if c["status"] != "pass"])
        f = check(d, "filesystem")
        assert f["status"] == "pass" and f["fix"] == "" and f["data"]["discard"] is True
        assert "discard" in f["data"]["super_options"].split(",") + f["data"]["options"].split(",")
        assert "; mounted discard: an evicted block costs ~2x the CPU" in f["detail"]
        assert "mount without `discard` and trim periodically (fstrim" in d["recommended"]["options"]
        assert os.listdir(root) in (["lost+found"], [])
    with mount_loop(fs, size_mb=1300) as root:
        f = check(doctor(root)[1], "filesystem")
        assert f["status"] == "pass" and "discard" not in f["data"] and "mounted discard" not in f["detail"]


def test_ramfs_fails_no_xattrs(ramfs_dir):
    code, d, _ = doctor(ramfs_dir)
    assert code == 2 and d["status"] == "fail"
    s = statuses(d)
    assert s["user_xattr"] == "fail" and "ENOTSUP" in check(d, "user_xattr")["detail"]
    assert check(d, "user_xattr")["fix"]
    assert s["space"] == "warn"  # ramfs reports no size
    assert check(d, "o_direct")["data"]["aligned"] == "refused"
    assert d["kvtier"]["runs"] is False and d["kvtier"]["checksums"] is False and d["kvtier"]["io"] == "buffered"
    assert os.listdir(ramfs_dir) == []


def test_read_only_mount_fails():
    with mount_tmpfs(options=["ro"]) as root:
        code, d, _ = doctor(root)
        assert code == 2
        s = statuses(d)
        assert s["filesystem"] == "fail" and s["writable"] == "fail"
        assert "EROFS" in check(d, "writable")["detail"]
        assert check(d, "writable")["fix"] == "ROOT's filesystem is mounted read-only: mount it read-write"


def test_a_full_filesystem_is_not_a_permission_problem():
    """No free inode left (ENOSPC on the probe's mkdir): the fix says free space or
    inodes, not "give write access"."""
    with mount_tmpfs(size="1m", options=["nr_inodes=16"]) as root:
        n = 0
        with pytest.raises(OSError) as ei:
            while True:
                open(os.path.join(root, f"f{n}"), "wb").close()
                n += 1
        assert ei.value.errno == errno.ENOSPC and 0 < n < 16
        code, d, _ = doctor(root)
        assert code == 2
        w = check(d, "writable")
        assert w["status"] == "fail" and "ENOSPC" in w["detail"]
        assert w["fix"].startswith("free space or inodes on ROOT's filesystem (df -h ROOT; df -i ROOT)")
        assert "write access" not in w["fix"]
        assert sorted(os.listdir(root)) == sorted(f"f{i}" for i in range(n))  # left nothing behind


def test_writable_fix_by_errno():
    from kvtier.cli.doctor import _writable_fix

    assert "free space or inodes" in _writable_fix(errno.EDQUOT)
    assert "write access" in _writable_fix(errno.EACCES) and "write access" in _writable_fix(errno.EPERM)
    assert "write access" not in _writable_fix(errno.EIO) and "client's log" in _writable_fix(errno.EIO)


def test_sizes_print_in_a_unit_that_never_rounds_to_zero():
    """A 4 MiB filesystem's space is printed in MiB (it printed "0.0 GiB free of 0.0 GiB")."""
    from kvtier.cli._text import human_bytes
    from kvtier.cli.doctor import check_space

    assert [human_bytes(n) for n in (0, 1, 1023, 1024, 1536, 4 << 20, 5 << 30, 3 << 40)] == \
        ["0 B", "1 B", "1023 B", "1.0 KiB", "1.5 KiB", "4.0 MiB", "5.0 GiB", "3.0 TiB"]
    with mount_tmpfs(size="4m") as root:
        with open(os.path.join(root, "f"), "wb") as f:
            f.write(b"\0" * (1 << 20))
        c = check_space(root)
        assert c.status == "warn" and c.data["total_bytes"] == 4 << 20
        assert c.detail.startswith("3.0 MiB free of 4.0 MiB, "), c.detail


def test_full_filesystem_fails_naming_enospc():
    with mount_tmpfs(size="8m") as root:
        with open(os.path.join(root, "fill"), "wb") as f:
            with pytest.raises(OSError) as ei:
                while True:
                    f.write(b"\0" * (1 << 20))
                    f.flush()
        assert ei.value.errno == errno.ENOSPC
        code, d, err = doctor(root)
        assert code == 2 and d is not None, err
        assert "Traceback" not in err
        assert check(d, "space")["status"] == "fail"
        fails = [c for c in d["checks"] if c["status"] == "fail" and c["name"] != "space"]
        assert fails and all("ENOSPC" in c["detail"] and root in c["detail"] for c in fails), \
            [(c["name"], c["detail"]) for c in fails]
        # kvtier's own startup probes do not fail for want of space (a tier restarts on its full
        # disk: the O_DIRECT probe's ENOSPC keeps O_DIRECT), so no kvtier_probe check; the
        # doctor's own checks fail naming ENOSPC
        assert [c["name"] for c in d["checks"] if c["name"] == "kvtier_probe"] == []
        assert d["kvtier"]["io"] == "O_DIRECT"
        # a write refused for want of space is no O_DIRECT refusal: o_direct fails, naming ENOSPC
        assert check(d, "o_direct")["status"] == "fail"
        assert check(d, "o_direct")["data"]["errno"] == errno.ENOSPC
        assert d["kvtier"]["runs"] is False
        assert all(c["fix"].startswith("free space or inodes on ROOT's filesystem") for c in fails), \
            [(c["name"], c["fix"]) for c in fails]  # not "fix the filesystem error above"
        assert sorted(os.listdir(root)) == ["fill"]


def test_a_1_mib_filesystem_warns_that_the_fsync_probe_did_not_fit_and_still_runs_kvtier():
    """On a 1 MiB tmpfs the 1 MiB fsync probe file cannot be written: a warning naming ENOSPC
    with the space fix, not a capability failure; its probe files are written one at a time
    (they were five at once, filling the filesystem so that kvtier's own probe failed after
    it): kvtier's probe passes (issue #24 item 15)."""
    with mount_tmpfs(size="1m") as root:
        code, d, err = doctor(root)
        assert "Traceback" not in err
        f = check(d, "fsync")
        assert f["status"] == "warn" and f["detail"].startswith("not measured: no room for its 1 MiB probe file (ENOSPC")
        assert f["data"]["errno"] == errno.ENOSPC and f["fix"].startswith("free space or inodes")
        assert not [c["name"] for c in d["checks"] if c["status"] == "fail"]
        assert d["kvtier"]["io"] == "O_DIRECT" and d["kvtier"]["checksums"] is True and d["kvtier"]["runs"] is True
        assert code == 1 and d["status"] == "warn"
        assert os.listdir(root) == []


def test_dev_shm_warns_that_it_is_the_ram_of_vllms_cpu_tier():
    """/dev/shm is where vLLM's CPU tier maps its blocks from: a cache there competes with it
    for RAM; doctor says so (a warning with the fix), unlike another tmpfs (issue #24 item 15)."""
    m = mount_of("/dev/shm")
    if m is None or m.kind != "tmpfs" or m.mount_point != "/dev/shm":
        unavailable("/dev/shm mounted as its own tmpfs")
    code, d, err = doctor("/dev/shm")
    f = check(d, "filesystem")
    assert f["status"] == "warn" and f["detail"].endswith("; /dev/shm: RAM shared with vLLM's CPU tier")
    assert "SharedOffloadRegion" in f["fix"] and f["fix"].startswith("use a tmpfs of its own with a size")
    with mount_tmpfs() as root:
        assert check(doctor(root)[1], "filesystem")["status"] == "pass"


def test_fusefault_passthrough_and_faults(tmp_path):
    with mount_fusefault(tmp_path) as ff:
        code, d, err = doctor(ff.mnt)
        assert d is not None, err
        assert d["kind"] == "fuse" and d["filesystem"]["fstype"].startswith("fuse")
        s = statuses(d)
        assert s["user_xattr"] == "pass" and s["rename_excl"] == "pass" and s["writable"] == "pass"
        assert check(d, "rename_excl")["data"]["torn"] == 0
        assert check(d, "o_direct")["data"]["aligned"] in ("ok", "refused")
        assert code == (1 if "warn" in s.values() else 0)
        # setxattr refused by the filesystem: no checksums possible
        ff.add("setxattr", "*", arg=errno.EOPNOTSUPP)
        code, d, _ = doctor(ff.mnt)
        assert code == 2 and statuses(d)["user_xattr"] == "fail" and d["kvtier"]["checksums"] is False
        assert ff.hits("setxattr") >= 1
        ff.clear()
        # a read error the probe did not expect: reported as a failure of that probe, named
        ff.add("eio", "*/dio-aligned")
        code, d, _ = doctor(ff.mnt)
        c = check(d, "o_direct")
        assert code == 2 and c["status"] == "fail" and c["data"]["errno"] == errno.EIO and "dio-aligned" in c["detail"]
        ff.clear()
        assert [n for n in os.listdir(ff.backing) if n != ".fusefault"] == []


def test_peer_same_directory_passes(tmpfs_dir):
    code, d, err = doctor(tmpfs_dir, "--peer", tmpfs_dir)
    assert code == 0, err
    assert [c["name"] for c in d["checks"]] == PROBES + PEER_PROBES
    assert {n: statuses(d)[n] for n in PEER_PROBES} == {n: "pass" for n in PEER_PROBES}
    for n in ("peer_names", "peer_data", "peer_xattr"):  # seconds until the peer saw the change
        assert all(v is not None and v < 1.0 for v in check(d, n)["data"].values())
    assert check(d, "peer_rename")["data"]["torn"] == 0
    assert os.listdir(tmpfs_dir) == []


def test_peer_that_is_another_directory_is_unusable(tmp_path):
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    code, d, err = doctor(str(tmp_path / "a"), "--peer", str(tmp_path / "b"), "--wait", "0.3")
    assert code == 2 and d is None and "not a mount of the same directory" in err
    assert os.listdir(tmp_path / "a") == [] and os.listdir(tmp_path / "b") == []


def test_bad_arguments(tmp_path):
    code, d, err = doctor(str(tmp_path / "missing"))
    assert code == 2 and f"{tmp_path / 'missing'}: No such file or directory" in err
    code, d, err = doctor(str(tmp_path), "--wait", "0")
    assert code == 2 and "--wait" in err


# ---------------------------------------------------------------- two clients of one volume

@pytest.mark.dfs
def test_dfs_recommended_mounts_pass(dfs, dfs_dirs):
    a, b = dfs_dirs
    code, d, err = doctor(a, "--peer", b)
    assert d is not None, err
    assert d["kind"] == dfs.kind
    assert check(d, "filesystem")["data"]["client_options_from"] == (
        "command line" if dfs.kind == "glusterfs" else ".params"), check(d, "filesystem")
    bad = {c["name"]: c["detail"] for c in d["checks"] if c["status"] != "pass"}
    ren = check(d, "rename_excl")["data"]
    assert ren["torn"] == 0 and ren["reads"] > 0
    if dfs.kind == "glusterfs" and ren["enoent"]:  # distribute volume: the name is missing mid-rename
        assert bad.keys() == {"rename_excl"} and code == 1, bad
    else:
        assert code == 0 and bad == {}, bad
    assert check(d, "peer_data")["data"]["first_read_stale"] is False
    assert check(d, "peer_xattr")["data"]["first_read_stale"] is False
    assert d["kvtier"]["checksums"] is True and d["kvtier"]["io"] == "O_DIRECT"
    assert d["recommended"]["source"] == "tested"
    od = check(d, "o_direct")["data"]
    assert od["aligned"] == "ok" and od["unaligned"] in ("ok", "lost", "refused")
    assert os.listdir(a) == []


@pytest.fixture(scope="session")
def default_mount(dfs):
    """A third client of the volume, mounted with the client's defaults."""
    return dfs.mount("c", defaults=True)


@pytest.mark.dfs
def test_dfs_default_mount_options_warn(dfs, dfs_dirs, default_mount):
    a, _ = dfs_dirs
    c = os.path.join(default_mount, os.path.basename(a))
    # the client's own options, read from its command line
    code, d, _ = doctor(c)
    f = check(d, "filesystem")
    assert code == 1 and f["status"] == "warn"
    assert ("fopen-keep-cache=false" if dfs.kind == "glusterfs" else "mfsxattrcacheto=0") in f["fix"]
    # and the stale cache itself, measured: changes through node A, read through the default client
    code, d, _ = doctor(a, "--peer", c, "--wait", "3")
    s = statuses(d)
    assert code == 1
    if dfs.kind == "glusterfs":  # page cache kept across opens (fresh once its attributes time out)
        assert s["peer_data"] == "warn" and s["peer_xattr"] == "pass"
        assert "stale" in d["kvtier"]["verify"]
    else:  # xattrs cached 30 s: still stale after the 3 s wait
        assert s["peer_xattr"] == "warn" and s["peer_data"] == "pass"
        assert check(d, "peer_xattr")["data"]["xattr_s"] is None
    assert os.listdir(a) == []
