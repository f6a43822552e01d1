"""`kvtier info` tells the truth about what is built and active."""
import json
import os
import platform
import shutil
import subprocess
import sys

import pytest

import kvtier


def run_info(*args, env=None, rc=0):
    """`kvtier info ARGS` with env added; asserts its exit status is rc (2 when a
    KVTIER_* setting is refused)."""
    e = dict(os.environ)
    e.update(env or {})
    r = subprocess.run([sys.executable, "-m", "kvtier", "info", *args], capture_output=True, text=True, env=e)
    assert r.returncode == rc, (r.returncode, r.stdout, r.stderr[-2000:])
    return r


def test_info_json_matches_core():
    d = json.loads(run_info("--json").stdout)
    assert d["version"] == kvtier.__version__
    assert d["c_core"] is True
    assert d["crc32c_backend"] == kvtier.crc32c_backend
    names = [b["name"] for b in d["crc32c_backends"]]
    assert names == [n for (n, _ok, _f) in kvtier._C.backends()] + ["numpy"]
    avail = {b["name"] for b in d["crc32c_backends"] if b["available"]}
    assert avail == set(kvtier.crc32c_backends())
    assert d["isal_version"] == kvtier._C.isal_version()


@pytest.mark.skipif(shutil.which("pkg-config") is None, reason="pkg-config not installed")
def test_info_isal_version_is_the_one_built_against():
    r = subprocess.run(["pkg-config", "--modversion", "libisal"], capture_output=True, text=True)
    if r.returncode != 0 or os.environ.get("KVTIER_NO_ISAL") == "1":  # scripts/test-no-isal sets it
        assert kvtier._C.isal_version() is None
        assert "isal" not in kvtier.crc32c_backends()
    else:
        assert kvtier._C.isal_version() == r.stdout.strip()
        assert "isal" in kvtier.crc32c_backends()


@pytest.mark.skipif(os.path.isdir("/sys/bus/dsa/devices"), reason="this host has a DSA bus")
def test_info_says_no_dsa_device_and_claims_no_offload():
    out = run_info().stdout
    dsa_line = [l for l in out.splitlines() if l.startswith("DSA:")]
    assert dsa_line == ["DSA:            no DSA devices found (/sys/bus/dsa/devices absent)"]
    assert "enabled: dsa " not in out
    d = json.loads(run_info("--json").stdout)
    assert d["dsa_counters"] == {}
    assert {b["name"]: b["available"] for b in d["crc32c_backends"]}.get("dsa") is False


def test_info_names_the_model_as_model_never_dsa():
    out = run_info(env={"KVTIER_CRC32C_BACKEND": "dsa-model"}).stdout
    assert "CRC32C active:  dsa-model" in out
    assert "enabled: dsa-model (software model, not hardware" in out
    assert "enabled: dsa (" not in out


def test_without_c_core_import_warns_and_everything_uses_the_fallback(tmp_path):
    """A tree whose C core is missing still imports, says so once, and computes right."""
    import shutil as sh

    pkg = tmp_path / "kvtier"
    sh.copytree(os.path.dirname(kvtier.__file__), pkg, ignore=sh.ignore_patterns("_C*.so", "__pycache__"))
    code = (
        "import sys, warnings\n"
        "sys.meta_path = [f for f in sys.meta_path if 'ditable' not in repr(f)]\n"  # hide the editable install
        f"sys.path.insert(0, {str(tmp_path)!r})\n"
        "with warnings.catch_warnings(record=True) as w:\n"
        "    warnings.simplefilter('always')\n"
        "    import kvtier, kvtier.io\n"
        "msgs = [str(x.message) for x in w if issubclass(x.category, RuntimeWarning)]\n"
        "print(kvtier.__file__, kvtier._C, kvtier.crc32c_backend, kvtier.io.backend, hex(kvtier.crc32c(b'123456789')))\n"
        "print(len(msgs), msgs[0])\n"
    )
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    line1, line2 = r.stdout.splitlines()
    assert line1 == f"{pkg / '__init__.py'} None numpy python 0xe3069283"
    assert line2.startswith("1 kvtier: the C core (kvtier._C) is not importable (No module named 'kvtier._C')")


def test_info_names_the_block_io_backend_and_a_bad_choice():
    assert "Block I/O:      c (kvtier._C)" in run_info().stdout
    assert json.loads(run_info("--json", env={"KVTIER_IO_BACKEND": "python"}).stdout)["io_backend"] == \
        "python (pure-Python fallback)"
    r = run_info(env={"KVTIER_IO_BACKEND": "bogus"}, rc=2)
    assert "Block I/O:      error: KVTIER_IO_BACKEND='bogus' is not valid; valid values: c, python" in r.stdout
    assert r.stderr == "kvtier info: KVTIER_IO_BACKEND='bogus' is not valid; valid values: c, python\n"


def test_info_reports_the_io_engine():
    """The I/O engine line and JSON follow the build (liburing) and
    KVTIER_IO_URING: io_uring when built with liburing and the kernel gives a
    ring, plain with KVTIER_IO_URING=0, an error for a bad value."""
    from kvtier import _C

    built = _C.io_engine_status()["liburing"]
    d = json.loads(run_info("--json", env={"KVTIER_IO_URING": ""}).stdout)
    assert d["io_engine"]["liburing"] is built and d["io_engine"]["setting"] == "unset"
    assert d["io_engine"]["uring_ops"] == 0 and d["io_engine"]["plain_blocks"] == 0
    text = run_info(env={"KVTIER_IO_URING": ""}).stdout
    if not built:
        assert d["io_engine"]["engine"] == "plain"
        assert "I/O engine:     plain pread/pwrite (built without liburing" in text
    elif d["io_engine"]["engine"] == "io_uring":
        assert "I/O engine:     io_uring (liburing): bounce-landing O_DIRECT loads in pieces, the next read in flight while one is " \
               "moved; stores: one pwrite straight from the caller's buffer, never the ring; 0 io_uring ops, 0 plain " \
               "O_DIRECT blocks\n" in text
    else:  # the kernel refused a ring here
        assert d["io_engine"]["setup_errno"] > 0
        assert "I/O engine:     plain pread/pwrite (the kernel refused io_uring: " in text
    try:  # the load slots' pages: the kernel's THP mode, as read here
        with open("/sys/kernel/mm/transparent_hugepage/enabled") as f:
            thp = f.read().split("[")[1].split("]")[0]
    except (OSError, IndexError):
        thp = None
    assert d["io_engine"]["thp"] == thp
    pages = "transparent huge pages" if thp in ("always", "madvise") else "4 KiB pages"
    assert (f"O_DIRECT slots (loads): 2 x 2 MiB per I/O thread on {pages} "
            f"(THP {thp or 'not in this kernel'}") in text
    off = json.loads(run_info("--json", env={"KVTIER_IO_URING": "0"}).stdout)["io_engine"]
    assert (off["engine"], off["setting"]) == ("plain", "0")
    if built:
        assert "I/O engine:     plain pread/pwrite (KVTIER_IO_URING=0)" in run_info(env={"KVTIER_IO_URING": "off"}).stdout
    py = run_info(env={"KVTIER_IO_BACKEND": "python"}).stdout
    line = next(ln for ln in py.splitlines() if ln.startswith("I/O engine:"))
    assert line.endswith("[not used: the block I/O backend is the pure-Python fallback]")
    bad = run_info(env={"KVTIER_IO_URING": "maybe"}, rc=2).stdout
    assert "I/O engine:     error: KVTIER_IO_URING='maybe' is not valid; valid values: 1, true" in bad
    bad_json = json.loads(run_info("--json", env={"KVTIER_IO_URING": "2"}, rc=2).stdout)
    assert bad_json["io_engine"] is None and bad_json["io_engine_error"].startswith("KVTIER_IO_URING='2'")


def _cpu_flags() -> set:
    with open("/proc/cpuinfo") as f:
        for line in f:
            if line.startswith("flags"):
                return set(line.split(":", 1)[1].split())
    return set()


def test_info_reports_the_crc_copy():
    """The CRC copy line and JSON: the kernel follows the CPU flags in
    /proc/cpuinfo (independent of the C core's own CPUID probe), on by default
    where a fused kernel exists, off with KVTIER_CRC_COPY=0 or a forced CRC32C
    backend, an error for a bad value."""
    flags = _cpu_flags()
    if platform.machine() != "x86_64":
        kernel = "generic"
    elif {"avx512f", "vpclmulqdq", "pclmulqdq", "sse4_2"} <= flags:
        kernel = "avx512-vpclmulqdq"
    elif {"pclmulqdq", "sse4_2"} <= flags:
        kernel = "pclmulqdq"
    else:
        kernel = "generic"
    base = {k: v for k, v in os.environ.items() if not k.startswith("KVTIER_")}
    d = json.loads(subprocess.run([sys.executable, "-m", "kvtier", "info", "--json"], capture_output=True, text=True,
                                  env=base, check=True).stdout)
    assert d["crc_copy"] == {"kernel": kernel, "enabled": kernel != "generic", "blocks": 0, "bytes": 0}
    text = subprocess.run([sys.executable, "-m", "kvtier", "info"], capture_output=True, text=True, env=base,
                          check=True).stdout
    if kernel != "generic":
        assert f"CRC copy:       on ({kernel}); C-core checksummed loads: private memory, then one pass " \
               "of copy (non-temporal stores) + CRC32C: 0 blocks, 0 bytes\n" in text
    else:
        assert "CRC copy:       off (no fused kernel for this CPU" in text
    off = run_info(env={"KVTIER_CRC_COPY": "0"}).stdout
    assert f"CRC copy:       off (KVTIER_CRC_COPY); kernel {kernel}\n" in off
    assert json.loads(run_info("--json", env={"KVTIER_CRC_COPY": "No"}).stdout)["crc_copy"]["enabled"] is False
    forced = run_info(env={"KVTIER_CRC32C_BACKEND": "table", "KVTIER_CRC_COPY": ""}).stdout
    if kernel != "generic":
        assert "CRC copy:       off (the CRC32C backend is forced to table); kernel " + kernel in forced
    bad = run_info(env={"KVTIER_CRC_COPY": "maybe"}, rc=2).stdout
    assert "CRC copy:       error: KVTIER_CRC_COPY='maybe' is not valid; valid values: 1, true" in bad
    assert "[not used" not in bad
    bad_json = json.loads(run_info("--json", env={"KVTIER_CRC_COPY": "2"}, rc=2).stdout)
    assert bad_json["crc_copy"] is None
    assert bad_json["crc_copy_error"].startswith(
        "KVTIER_CRC_COPY='2' is not valid")


def test_info_says_a_refused_load_landing_and_exits_2(tmp_path):
    """KVTIER_LOAD_LANDING with a word no tier takes: ``kvtier info`` says it is invalid where
    the landing is described and on stderr, naming the variable and the valid words, and exits
    2 (bad arguments), with ROOT and --json too; never a traceback. (Was: ``info`` printed the
    junk as a setting with exit 0, ``info ROOT`` died with a traceback, exit 1.) A valid word
    in any case is no error."""
    msg = "KVTIER_LOAD_LANDING must be one of auto, direct, bounce, not 'junk'"
    for args in ((), (str(tmp_path),)):
        r = run_info(*args, env={"KVTIER_LOAD_LANDING": "junk"}, rc=2)
        assert r.stderr == f"kvtier info: {msg}\n", r.stderr
        assert f"Load landing:   error: {msg} (every tier of this process refuses it); tier key load_landing" in r.stdout
        assert "KVTIER_LOAD_LANDING=junk" not in r.stdout
        d = json.loads(run_info(*args, "--json", env={"KVTIER_LOAD_LANDING": "junk"}, rc=2).stdout)
        assert d["setting_errors"] == [msg] and d["load_landing_error"] == msg
    assert f"  load landing: error: {msg}" in r.stdout.splitlines()
    assert d["root"]["load_landing"] == {"auto": None, "why": None, "error": msg}
    ok = run_info(str(tmp_path), env={"KVTIER_LOAD_LANDING": "Bounce"})
    assert ok.stderr == "" and "  load landing: auto -> bounce (KVTIER_LOAD_LANDING=bounce)" in ok.stdout.splitlines()
    assert json.loads(run_info("--json").stdout)["setting_errors"] == []
    assert os.listdir(tmp_path) == []


# ---------------------------------------------------------------- kvtier info ROOT: can a block be stored there


def _read_only_statvfs(monkeypatch, root):
    """os.statvfs of ``root`` as on a read-only mount (ST_RDONLY set), other paths as they are."""
    real = os.statvfs

    def statvfs(p):
        st = real(p)
        if os.path.abspath(os.fspath(p)) != root:
            return st
        t = list(st)
        t[8] |= os.ST_RDONLY  # f_flag
        return os.statvfs_result(t)

    monkeypatch.setattr(os, "statvfs", statvfs)


def _info_root_here(capsys, root):
    """``kvtier info ROOT --json`` and ``kvtier info ROOT`` in this process (the monkeypatches
    hold): (exit status, the JSON's root section, the text)."""
    from kvtier.cli import main

    rc_json = main(["info", root, "--json"])
    d = json.loads(capsys.readouterr().out)["root"]
    rc_text = main(["info", root])
    text = capsys.readouterr().out
    assert rc_json == rc_text
    return rc_json, d, text


def _assert_flagged(rc, d, text, why):
    assert rc == 0  # said, not an error: info reports
    assert d["writable"] is False and why in d["not_writable"], d
    line = next(ln for ln in text.splitlines() if ln.startswith("  writable:     "))
    assert line.startswith("  writable:     NO: ") and why in line and "no block can be stored here" in line, line


@pytest.mark.parametrize("how", ["read_only_mount", "no_write_access"])
def test_info_root_says_when_no_block_can_be_stored_there(tmp_path, monkeypatch, capsys, how):
    """A root on a read-only mount (statvfs ST_RDONLY) or one this process may not write
    (access W_OK refused: root ignores modes, so both are monkeypatched here) is flagged in
    the text and the JSON (was: nothing said, the tier's startup failed later with EROFS);
    a writable root says yes."""
    root = str(tmp_path)
    rc, d, text = _info_root_here(capsys, root)
    assert rc == 0 and d["writable"] is True and d["not_writable"] is None and d["filesystem"]["read_only"] is False
    assert "  writable:     yes" in text.splitlines()
    if how == "read_only_mount":
        _read_only_statvfs(monkeypatch, root)
        why = "is mounted read-only (statvfs ST_RDONLY)"
    else:
        real_access = os.access
        monkeypatch.setattr(os, "access", lambda p, mode, **kw: False if (os.fspath(p) == root and mode & os.W_OK)
                            else real_access(p, mode, **kw))
        why = f"this process (uid {os.geteuid()}) may not write to it (access W_OK refused)"
    rc, d, text = _info_root_here(capsys, root)
    _assert_flagged(rc, d, text, why)
    assert d["filesystem"]["read_only"] is (how == "read_only_mount")
    assert os.listdir(tmp_path) == []


def test_info_root_on_a_real_read_only_bind_mount(tmp_path, monkeypatch, capsys):
    """A read-only bind mount for real where mount(8) may (root with CAP_SYS_ADMIN, as CI):
    ``kvtier info`` flags it and a tier there fails with EROFS, as it says. Where mounting is
    refused, the same check through a monkeypatched statvfs (never a skip: CI=true fails skips)."""
    src, mnt = tmp_path / "src", tmp_path / "mnt"
    src.mkdir()
    mnt.mkdir()
    mounted = (shutil.which("mount") is not None and os.geteuid() == 0
               and subprocess.run(["mount", "--bind", str(src), str(mnt)], capture_output=True).returncode == 0)
    try:
        if mounted and subprocess.run(["mount", "-o", "remount,bind,ro", str(mnt)],
                                      capture_output=True).returncode != 0:
            subprocess.run(["umount", str(mnt)], capture_output=True)
            mounted = False
        if not mounted:
            _read_only_statvfs(monkeypatch, str(mnt))
        rc, d, text = _info_root_here(capsys, str(mnt))
        _assert_flagged(rc, d, text, "is mounted read-only (statvfs ST_RDONLY)")
        assert d["filesystem"]["read_only"] is True
        if mounted:
            import errno

            import numpy as np
            from kvtier.manager import FileSystemTierManager

            assert os.statvfs(str(mnt)).f_flag & os.ST_RDONLY and not os.access(str(mnt), os.W_OK)
            with pytest.raises(OSError) as ei:
                FileSystemTierManager(np.zeros((2, 4096), np.uint8), str(mnt), "m", use_o_direct=False)
            assert ei.value.errno == errno.EROFS and str(mnt) in str(ei.value)
    finally:
        if mounted:
            subprocess.run(["umount", str(mnt)], capture_output=True)
    assert os.listdir(src) == []


@pytest.mark.mount
def test_info_root_says_when_the_filesystem_has_no_user_xattrs(ramfs_dir, tmp_path, capsys):
    """``kvtier info ROOT`` on a ramfs (no user xattrs) says so, in the text and the JSON, by
    one getxattr on ROOT (nothing created), and that a checksummed tier cannot start there,
    which is true: the default tier refuses to start. (Was: ``writable: yes`` and the landing,
    nothing about xattrs.) A root with user xattrs says yes."""
    rc, d, text = _info_root_here(capsys, ramfs_dir)
    why = f"the filesystem (ramfs at {ramfs_dir}) has no user xattrs (getxattr: Operation not supported)"
    assert rc == 0 and d["user_xattrs"] is False and d["user_xattrs_why"] == why and d["writable"] is True
    assert (f"  user xattrs:  NO: {why}: a checksummed tier (checksum_blocks=True, the default) cannot start "
            "here, only checksum_blocks=False (blocks unverified)") in text.splitlines()
    assert os.listdir(ramfs_dir) == []
    import numpy as np
    from kvtier.manager import FileSystemTierManager

    with pytest.raises(ValueError, match="ramfs"):
        FileSystemTierManager(np.zeros((2, 4096), np.uint8), ramfs_dir, "m", use_o_direct=False)
    rc, d, text = _info_root_here(capsys, str(tmp_path))
    assert rc == 0 and d["user_xattrs"] is True and d["user_xattrs_why"] is None
    assert "  user xattrs:  yes" in text.splitlines()


@pytest.mark.parametrize("var, value, says", [
    ("KVTIER_CRC32C_BACKEND", "foo", "KVTIER_CRC32C_BACKEND=foo: CRC32C backend 'foo' is unknown; available backends: "),
    ("KVTIER_DSA", "maybe", "KVTIER_DSA='maybe' is not valid; valid values: model, off"),
])
def test_a_setting_refused_at_import_is_one_line_and_exit_2(var, value, says):
    """A KVTIER_* setting refused while kvtier imports (the C core's CRC backend, the DSA
    switch) is said by the kvtier command as every refused setting (one line, exit 2), by
    `python -m kvtier` and by the installed console script, not as a traceback; a program
    importing kvtier still gets the ValueError."""
    e = dict(os.environ, **{var: value})
    script = shutil.which("kvtier")
    cmds = [[sys.executable, "-m", "kvtier", "info"]] + ([[script, "info"]] if script else [])
    for cmd in cmds:
        r = subprocess.run(cmd, capture_output=True, text=True, env=e)
        assert r.returncode == 2 and r.stdout == "", (cmd, r.returncode, r.stdout, r.stderr)
        assert r.stderr.startswith(f"kvtier: {says}") and r.stderr.count("\n") == 1, (cmd, r.stderr)
    r = subprocess.run([sys.executable, "-c", "import kvtier"], capture_output=True, text=True, env=e)
    assert r.returncode == 1 and "Traceback" in r.stderr and f"ValueError: {says}" in r.stderr, r.stderr
