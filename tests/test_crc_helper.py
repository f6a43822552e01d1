"""The CRC helper thread of checksummed buffered loads (csrc/fs_io.c "CRC hook").

C level: tests/c/test_crc_helper.c, linked directly with csrc/fs_io.c and the
sources of csrc/crc32c and csrc/dsa, built here with gcc and run as separate
processes (the environment is read once per process):
  * 4 threads loading blocks of piece-edge sizes (512 KiB - 1, 512 KiB, 1 MiB,
    3 MiB - 7, 4 MiB + 1, 16 MiB) in single-block and multi-block batches,
    bytes compared; bit flips at the first byte, around 64 KiB piece
    boundaries, in the middle and at the last byte give EBADMSG,
    checksum_failed and remove the file; the helper must have shared blocks
    and bytes; fork() while a thread loads;
  * the same with KVTIER_CRC_HELPER_POLL_US=0 (the helper sleeps whenever it
    waits, every piece wakes it through the condition variable) and with
    KVTIER_CRC_HELPER=0 (never used);
  * exact counters per load in a fresh single-threaded process (which blocks
    the helper takes, the wake-up policy), across several CRC32C backends;
  * under ThreadSanitizer: no data race.

Every process here runs with KVTIER_CRC_COPY=0: the fused copy path takes
checksummed buffered loads when it is on, and the helper only gets them
without it (tests/test_crc_copy.py tests that path and the hand-over).

Python level (kvtier.io over the C core, one subprocess per environment):
the KVTIER_CRC_HELPER / KVTIER_CRC_HELPER_POLL_US settings as reported by
kvtier._C.crc_helper_status(), counters against the loads made, corruption
detection with the helper on, and a helper that was running in the parent
at fork().
"""
from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
SRC = ROOT / "tests" / "c" / "test_crc_helper.c"
PIECE = 64 * 1024  # KVT_CRC_PIECE in csrc/fs_io.c
MIB = 1024 * 1024

pytestmark = pytest.mark.timeout(300)


# --------------------------------------------------------------------------
# Building and running the C program
# --------------------------------------------------------------------------

def _pkg_config_isal():
    pc = shutil.which("pkg-config")
    if pc is None:
        return [], []
    v = subprocess.run([pc, "--modversion", "libisal"], capture_output=True, text=True)
    if v.returncode != 0:
        return [], []
    cflags = subprocess.run([pc, "--cflags", "libisal"], capture_output=True, text=True).stdout.split()
    libs = subprocess.run([pc, "--libs", "libisal"], capture_output=True, text=True).stdout.split()
    return ["-DKVTIER_HAVE_ISAL=1", f'-DKVTIER_ISAL_VERSION="{v.stdout.strip()}"', *cflags], libs


def _sources():
    return ([str(ROOT / "csrc" / "fs_io.c")]
            + sorted(str(p) for p in (ROOT / "csrc" / "crc32c").glob("*.c"))
            + sorted(str(p) for p in (ROOT / "csrc" / "dsa").glob("*.c")))


def _compile(cc, out, flags, isal=True):
    cflags, libs = _pkg_config_isal() if isal else ([], [])
    cmd = [cc, "-std=gnu11", "-Wall", "-Wextra", "-Wno-unused-parameter", "-Werror", *flags,
           f"-I{ROOT}/csrc", f"-I{ROOT}/csrc/crc32c", f"-I{ROOT}/csrc/dsa", *cflags,
           "-o", str(out), str(SRC), *_sources(), *libs, "-lpthread"]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=240)


def _env():
    """The caller's environment without kvtier settings (the program sets its
    own) and without a sanitizer runtime preloaded by scripts/sanitize."""
    drop = ("KVTIER_", "LD_PRELOAD", "ASAN_OPTIONS", "UBSAN_OPTIONS", "TSAN_OPTIONS")
    return {k: v for k, v in os.environ.items() if not k.startswith(drop)}


def _run(cmd, tmp_path, timeout=120):
    r = subprocess.run([*cmd, "--dir", str(tmp_path)], capture_output=True, text=True, timeout=timeout, env=_env())
    return r


def _summary(r):
    m = re.search(r"^(\d+) passed, (\d+) failed$", r.stdout, re.M)
    assert m, f"no summary (exit {r.returncode}):\n{r.stdout}\n{r.stderr[-4000:]}"
    return int(m.group(1)), int(m.group(2))


def _helper_line(r):
    m = re.search(r"^helper: enabled (\d) running (\d) poll_ns (\d+) blocks (\d+) bytes (\d+) late (\d+)$",
                  r.stdout, re.M)
    assert m, r.stdout
    return dict(zip(("enabled", "running", "poll_ns", "blocks", "bytes", "late"), map(int, m.groups())))


def _expect_ok(r, min_checks):
    passed, failed = _summary(r)
    assert failed == 0 and r.returncode == 0, f"exit {r.returncode}\n{r.stdout}\n{r.stderr[-4000:]}"
    assert passed >= min_checks, r.stdout  # every phase ran
    return _helper_line(r)


@pytest.fixture(scope="module")
def prog(tmp_path_factory):
    """The program, -O2, with ISA-L when pkg-config finds it."""
    cc = shutil.which(os.environ.get("CC", "gcc")) or shutil.which("cc")
    if cc is None:
        pytest.skip("no C compiler")
    exe = tmp_path_factory.mktemp("crc_helper") / "test_crc_helper"
    r = _compile(cc, exe, ["-O2", "-g"])
    assert r.returncode == 0, r.stderr
    return str(exe)


def test_c_stress_helper_on(prog, tmp_path):
    """4 threads, first use at once, piece-edge sizes, corruption at piece
    edges; the helper shared blocks (and bytes, unless it backed off)."""
    r = _run([prog, "--iters", "4"], tmp_path)
    h = _expect_ok(r, 950)
    assert "corrupt: done" in r.stdout
    assert (h["enabled"], h["running"], h["poll_ns"]) == (1, 1, 1_000_000)
    assert h["blocks"] > 0 and (h["bytes"] > 0 or h["late"] > 0)  # late: it backed off (busy host)
    assert os.listdir(tmp_path) == []  # the program removed its directory


def test_c_stress_poll0_condvar(prog, tmp_path):
    """KVTIER_CRC_HELPER_POLL_US=0: the helper sleeps as soon as it waits, so
    every piece and every block goes through the wake-up path."""
    r = _run([prog, "--poll0", "--iters", "3"], tmp_path)
    h = _expect_ok(r, 850)
    assert (h["enabled"], h["running"], h["poll_ns"]) == (1, 1, 0)
    assert h["blocks"] > 0 and (h["bytes"] > 0 or h["late"] > 0)


def test_c_helper_off(prog, tmp_path):
    """KVTIER_CRC_HELPER=0: the same loads, all checksummed inline."""
    r = _run([prog, "--off", "--iters", "2"], tmp_path)
    h = _expect_ok(r, 750)
    assert h == {"enabled": 0, "running": 0, "poll_ns": 1_000_000, "blocks": 0, "bytes": 0, "late": 0}


@pytest.mark.parametrize("args", [[], ["--poll0"]], ids=["poll1ms", "poll0"])
def test_c_fork_while_loading(prog, tmp_path, args):
    """fork() while a thread loads through the helper: every child round-trips
    its loads and detects a flipped bit; its own helper thread starts (a
    cooldown inherited from a late parent may keep a child inline: the run is
    retried until some child shows the restart)."""
    for _ in range(3):
        r = _run([prog, "--fork", *args], tmp_path)
        _expect_ok(r, 40)  # the parent's checks; each child's are its exit status
        m = re.search(r"^fork: helper restarted in (\d+) of (\d+) children$", r.stdout, re.M)
        assert m, r.stdout
        if int(m.group(1)) > 0:
            return
    pytest.skip(f"no child got its helper out of cooldown (host too busy):\n{r.stdout}")


def _run_accounting(cmd, tmp_path, want=15):
    """Exact per-load counters need the helper out of cooldown (a late wait
    puts it there for >= 0.1 s): the program checks availability with a
    control load before each measurement and counts the inconclusive ones as
    skipped (every conclusive one is asserted). On a busy host retry until
    `want` of them were conclusive."""
    best = None
    for _ in range(3):
        r = _run(cmd, tmp_path)
        h = _expect_ok(r, 95)
        m = re.search(r"^exact: (\d+) checked, (\d+) skipped", r.stdout, re.M)
        assert m, r.stdout
        checked = int(m.group(1))
        if checked >= want:
            return r, h, checked
        best = r
    pytest.skip(f"fewer than {want} exact checks conclusive in 3 runs (the helper kept backing off: "
                f"a busy host):\n{best.stdout}")


@pytest.mark.parametrize("args", [[], ["--poll0"]], ids=["poll1ms", "poll0"])
def test_c_exact_accounting_and_wakeup_policy(prog, tmp_path, args):
    """Which loads the helper takes (>= 512 KiB, buffered, checksummed; not
    O_DIRECT, stores or unchecksummed loads), its bytes (whole 64 KiB pieces
    from the front, or the whole block), and when a sleeping helper is woken
    (>= 2 MiB left in the batch, or a stream within the poll window)."""
    r, h, checked = _run_accounting([prog, "--accounting", *args], tmp_path)
    assert "policy: done" in r.stdout
    assert h["enabled"] == 1 and h["running"] == 1
    assert h["poll_ns"] == (0 if args else 1_000_000)


def test_c_accounting_helper_off(prog, tmp_path):
    r = _run([prog, "--accounting", "--off"], tmp_path)
    h = _expect_ok(r, 40)
    assert h == {"enabled": 0, "running": 0, "poll_ns": 1_000_000, "blocks": 0, "bytes": 0, "late": 0}


@pytest.mark.parametrize("backend", ["sse42", "table"])
def test_c_stress_other_backends(prog, tmp_path, backend):
    """The helper's and the caller's pieces joined by kvt_crc32c_combine give
    the standard CRC32C whichever backend computes them."""
    r = _run([prog, "--backend", backend, "--iters", "1"], tmp_path)
    if r.returncode == 2 and "backend" in r.stderr:
        pytest.skip(r.stderr.strip())
    assert f"backend: {backend}" in r.stdout
    h = _expect_ok(r, 640)
    assert h["blocks"] > 0 and (h["bytes"] > 0 or h["late"] > 0)


# --------------------------------------------------------------------------
# ThreadSanitizer
# --------------------------------------------------------------------------

TSAN_BROKEN = ("unexpected memory mapping", "FATAL: ThreadSanitizer", "ThreadSanitizer failed to allocate",
               "failed to intercept")


@pytest.fixture(scope="module")
def tsan_prog(tmp_path_factory):
    """The program under ThreadSanitizer (clang, else gcc), without ISA-L so
    that every CRC load is instrumented (it runs with --backend sse42)."""
    d = tmp_path_factory.mktemp("crc_helper_tsan")
    errors = []
    for name in ("clang", "gcc"):
        cc = shutil.which(name)
        if cc is None:
            continue
        exe = d / f"test_crc_helper_tsan_{name}"
        r = _compile(cc, exe, ["-O1", "-g", "-fsanitize=thread", "-Wno-error=tsan", "-Wno-unknown-warning-option"],
                     isal=False)
        if r.returncode != 0:
            errors.append(f"{name}: {r.stderr[-500:]}")
            continue
        # Is the runtime usable here? Some kernels' ASLR layouts are not
        # (older TSan: "unexpected memory mapping"): then without ASLR.
        probe = subprocess.run([str(exe), "--bogus"], capture_output=True, text=True, timeout=60, env=_env())
        if probe.returncode == 2 and "usage:" in probe.stderr:
            return [str(exe)]
        setarch = shutil.which("setarch")
        if setarch and any(s in probe.stderr for s in TSAN_BROKEN):
            cmd = [setarch, os.uname().machine, "-R", str(exe)]
            probe = subprocess.run([*cmd, "--bogus"], capture_output=True, text=True, timeout=60, env=_env())
            if probe.returncode == 2 and "usage:" in probe.stderr:
                return cmd
        errors.append(f"{name}: TSan runtime not usable: {probe.stderr[-500:]}")
    pytest.skip("ThreadSanitizer unavailable: " + " | ".join(errors) if errors else "no clang or gcc")


def _run_tsan(cmd, tmp_path, args):
    r = _run([*cmd, "--backend", "sse42", *args], tmp_path, timeout=240)
    assert "WARNING: ThreadSanitizer" not in r.stderr, r.stderr[-12000:]
    _expect_ok(r, 600)
    return r


def test_tsan_no_data_race(tsan_prog, tmp_path):
    """Claims/done words, the poll-then-sleep wait, the cooldown, settle and
    combine under ThreadSanitizer: 4 loading threads and the helper, after a
    first load on the main thread."""
    _run_tsan(tsan_prog, tmp_path, ["--warm", "--iters", "2"])


def test_tsan_no_data_race_poll0(tsan_prog, tmp_path):
    """The condition-variable wake-ups (KVTIER_CRC_HELPER_POLL_US=0)."""
    _run_tsan(tsan_prog, tmp_path, ["--warm", "--poll0", "--iters", "1"])


def test_tsan_no_data_race_at_first_use(tsan_prog, tmp_path):
    """The first status calls, combine calls and loads of the process from
    several threads at once: the configuration is read, the combine table
    filled and the helper thread started on demand."""
    _run_tsan(tsan_prog, tmp_path, ["--iters", "1"])


# --------------------------------------------------------------------------
# Python level, through kvtier.io over the C core
# --------------------------------------------------------------------------

PRELUDE = textwrap.dedent("""
    import errno, json, os, sys
    import numpy as np
    import kvtier
    from kvtier import io as kio
    from kvtier import _C
    io = kio.for_backend("c")
    d = sys.argv[1]
    XATTR = "user.vllm.kv_crc32c"

    def data(n, bs, seed):
        return np.random.default_rng(seed).integers(0, 256, n * bs, dtype=np.uint8)

    def names(n, tag):
        return [os.path.join(d, f"{tag}{i}.bin") for i in range(n)]

    def offs(n, bs):
        return [i * bs for i in range(n)]

    sys.path.insert(0, os.path.join(os.getcwd(), "tests"))  # cwd: the repository root
    from corrupt import flip_bit as flip

    def result(**kw):
        print("RESULT " + json.dumps(kw), flush=True)
""")


def _py(tmp_path, body, env=None, timeout=120):
    """Run PRELUDE + body in a fresh interpreter (the C core reads its
    environment once per process) with the C block I/O backend; returns the
    dict passed to result()."""
    # keep a sanitizer runtime preloaded by scripts/sanitize: this interpreter
    # imports the same (sanitized) extension as the caller
    e = {k: v for k, v in os.environ.items() if not k.startswith("KVTIER_")}
    e["KVTIER_IO_BACKEND"] = "c"
    e["KVTIER_CRC_COPY"] = "0"  # else the fused copy path takes the loads (module docstring)
    e.update(env or {})
    code = PRELUDE + textwrap.dedent(body)
    r = subprocess.run([sys.executable, "-c", code, str(tmp_path)], capture_output=True, text=True,
                       timeout=timeout, env=e, cwd=str(ROOT))
    assert r.returncode == 0, r.stdout + r.stderr
    lines = [l for l in r.stdout.splitlines() if l.startswith("RESULT ")]
    assert lines, r.stdout + r.stderr
    return json.loads(lines[-1][len("RESULT "):])


@pytest.fixture(autouse=True)
def _need_c_core():
    pytest.importorskip("kvtier._C")


def test_default_enabled_follows_affinity(tmp_path):
    """KVTIER_CRC_HELPER unset (or empty): on exactly when the process may run
    on >= 2 CPUs (sched_getaffinity); with one CPU it is never used."""
    ncpu = len(os.sched_getaffinity(0))
    res = _py(tmp_path, """
        st = _C.crc_helper_status()
        result(st=st, ncpu=len(os.sched_getaffinity(0)))
    """)
    assert res["ncpu"] == ncpu
    assert res["st"] == {"enabled": ncpu >= 2, "running": False, "poll_us": 1000, "blocks": 0, "bytes": 0,
                         "late": 0}
    res = _py(tmp_path, """
        result(st=_C.crc_helper_status())
    """, env={"KVTIER_CRC_HELPER": ""})
    assert res["st"]["enabled"] is (ncpu >= 2)
    # pinned to one CPU before the first use: off, and loads stay inline
    res = _py(tmp_path, """
        os.sched_setaffinity(0, {min(os.sched_getaffinity(0))})
        bs = 4 * 1024 * 1024
        view = data(2, bs, 1)
        p = names(2, "one_cpu")
        io.batch_store_block(p, view, offs(2, bs), bs, checksum=True)
        out = np.zeros_like(view)
        for _ in range(3):
            io.batch_load_block(p, out, offs(2, bs), bs, use_o_direct=False, checksum=True)
        result(st=_C.crc_helper_status(), same=bool(np.array_equal(out, view)))
    """)
    assert res["same"]
    assert res["st"] == {"enabled": False, "running": False, "poll_us": 1000, "blocks": 0, "bytes": 0, "late": 0}


def test_helper_off_env(tmp_path):
    """KVTIER_CRC_HELPER=0: checksummed buffered 4 MiB loads round-trip and
    the helper neither starts nor counts anything."""
    res = _py(tmp_path, """
        bs = 4 * 1024 * 1024
        view = data(3, bs, 2)
        p = names(3, "off")
        io.batch_store_block(p, view, offs(3, bs), bs, checksum=True)
        same = []
        for i in range(4):
            out = np.zeros_like(view)
            io.batch_load_block(p, out, offs(3, bs), bs, use_o_direct=False, checksum=True)
            same.append(bool(np.array_equal(out, view)))
        result(st=_C.crc_helper_status(), same=same,
               rec=[os.getxattr(x, XATTR).hex() for x in p],
               want=[kvtier.crc32c(view[i * bs:(i + 1) * bs]).to_bytes(4, "big").hex() for i in range(3)])
    """, env={"KVTIER_CRC_HELPER": "0"})
    assert res["same"] == [True] * 4
    assert res["rec"] == res["want"]
    assert res["st"] == {"enabled": False, "running": False, "poll_us": 1000, "blocks": 0, "bytes": 0, "late": 0}


def test_helper_on_counts_only_buffered_checksummed_loads(tmp_path):
    """KVTIER_CRC_HELPER=1: a batch of 8 x 1 MiB checksummed buffered loads
    round-trips through the helper (blocks 1..8 per batch, bytes whole
    pieces, at most what was loaded); O_DIRECT loads, stores and
    unchecksummed loads leave the counters alone."""
    from kvtier import io as kio

    direct_ok = kio.probe_o_direct(str(tmp_path))
    res = _py(tmp_path, """
        import mmap
        n, bs = 8, 1024 * 1024
        view = data(n, bs, 3)
        p = names(n, "on")
        st0 = _C.crc_helper_status()
        io.batch_store_block(p, view, offs(n, bs), bs, use_o_direct=False, checksum=True)
        io.batch_store_block(names(n, "on_direct"), view, offs(n, bs), bs, use_o_direct=True, checksum=True)
        st_store = _C.crc_helper_status()
        # Until the helper has checksummed some bytes: on a busy host the new
        # thread may not run for a while (the caller then does all the CRC),
        # and after a late wait it is left alone for >= 0.1 s.
        import time
        batches = []
        deadline = time.monotonic() + 15
        while True:
            out = np.zeros_like(view)
            io.batch_load_block(p, out, offs(n, bs), bs, use_o_direct=False, checksum=True)
            st = _C.crc_helper_status()
            batches.append(dict(same=bool(np.array_equal(out, view)), blocks=st["blocks"], bytes=st["bytes"],
                                late=st["late"]))
            if (st["bytes"] > 0 and len(batches) >= 2) or time.monotonic() > deadline:
                break
            if st["late"] > (batches[-2]["late"] if len(batches) > 1 else 0):
                time.sleep(0.2)
        before = _C.crc_helper_status()
        out = np.zeros_like(view)
        io.batch_load_block(p, out, offs(n, bs), bs, use_o_direct=False, checksum=False)
        same_nock = bool(np.array_equal(out, view))
        after_nock = _C.crc_helper_status()
        same_direct = None
        if os.environ["T_DIRECT_OK"] == "1":
            m = mmap.mmap(-1, n * bs)  # page-aligned: O_DIRECT is usable
            aligned = np.frombuffer(m, dtype=np.uint8)
            for _ in range(2):
                io.batch_load_block(p, aligned, offs(n, bs), bs, use_o_direct=True, checksum=True)
            same_direct = bool(np.array_equal(aligned, view))
            del aligned
            m.close()
        after_direct = _C.crc_helper_status()
        result(st0=st0, st_store=st_store, batches=batches, before=before, after_nock=after_nock,
               after_direct=after_direct, same_nock=same_nock, same_direct=same_direct)
    """, env={"KVTIER_CRC_HELPER": "1", "T_DIRECT_OK": "1" if direct_ok else "0"})
    assert res["st0"]["enabled"] is True and res["st0"]["running"] is False
    assert (res["st_store"]["blocks"], res["st_store"]["bytes"], res["st_store"]["running"]) == (0, 0, False)
    b = res["batches"]
    assert all(x["same"] for x in b)
    # the first batch starts the helper: 8 MiB left >= 2 MiB, no cooldown yet
    assert 1 <= b[0]["blocks"] <= 8
    prev = 0
    for i, x in enumerate(b):
        assert prev < x["blocks"] or x["late"] > 0, b  # every batch starts with 8 MiB left: wakes it
        assert x["blocks"] <= 8 * (i + 1)
        prev = x["blocks"]
    last = b[-1]
    assert 0 < last["bytes"] <= len(b) * 8 * MIB, f"the helper checksummed nothing in {len(b)} batches: {b}"
    assert last["bytes"] % PIECE == 0  # 1 MiB blocks: whole 64 KiB pieces only
    assert res["same_nock"]
    assert (res["after_nock"]["blocks"], res["after_nock"]["bytes"]) == (res["before"]["blocks"],
                                                                      res["before"]["bytes"])
    if not direct_ok:
        pytest.skip(f"O_DIRECT not supported in {tmp_path}: O_DIRECT part not checked")
    assert res["same_direct"]
    assert (res["after_direct"]["blocks"], res["after_direct"]["bytes"]) == (res["before"]["blocks"],
                                                                          res["before"]["bytes"])


def test_corruption_detected_with_helper(tmp_path):
    """KVTIER_CRC_HELPER=1: one flipped bit at offset 0, 65535, 65536 (the
    first piece boundary), 2 MiB and the last byte of a 4 MiB block, loaded
    after a good 4 MiB block: EBADMSG, checksum_failed, re-read once, the
    corrupt file removed, the good block loaded."""
    res = _py(tmp_path, """
        bs = 4 * 1024 * 1024
        view = data(2, bs, 4)
        good = names(1, "good")[0]
        io.batch_store_block([good], view, [0], bs, checksum=True)
        cases = []
        st0 = _C.crc_helper_status()
        for pos in (0, 65535, 65536, 2 * 1024 * 1024, bs - 1):
            bad = os.path.join(d, f"bad_{pos}.bin")
            io.batch_store_block([bad], view, [bs], bs, checksum=True)
            flip(bad, pos)
            out = np.zeros_like(view)
            try:
                io.batch_load_block([good, bad], out, [0, bs], bs, use_o_direct=False, checksum=True)
                cases.append(dict(pos=pos, raised=False))
            except OSError as e:
                cases.append(dict(pos=pos, raised=True, errno=e.errno, checksum_failed=e.checksum_failed,
                                  num_succeeded=e.num_succeeded, num_retried=e.num_retried,
                                  filename=e.filename, exists=os.path.exists(bad),
                                  good_ok=bool(np.array_equal(out[:bs], view[:bs]))))
        result(cases=cases, st0=st0, st=_C.crc_helper_status())
    """, env={"KVTIER_CRC_HELPER": "1"})
    import errno

    assert [c["pos"] for c in res["cases"]] == [0, 65535, 65536, 2 * MIB, 4 * MIB - 1]
    for c in res["cases"]:
        assert c["raised"], c
        assert (c["errno"], c["checksum_failed"], c["num_succeeded"], c["num_retried"]) == (errno.EBADMSG, True, 1, 1), c
        assert c["filename"] == str(tmp_path / f"bad_{c['pos']}.bin")
        assert not c["exists"] and c["good_ok"], c
    # 5 batches of 2 x 4 MiB (+ 5 re-reads), 8 MiB left at each start: the
    # helper took part (a cooldown after a late wait could skip some)
    assert res["st"]["blocks"] > res["st0"]["blocks"]
    assert res["st"]["bytes"] <= 15 * 4 * MIB


@pytest.mark.parametrize("value,poll_us", [("250", 250), ("0", 0), ("10000000", 10_000_000), ("", 1000)])
def test_poll_us_parsing(tmp_path, value, poll_us):
    """KVTIER_CRC_HELPER_POLL_US: a decimal number of microseconds up to 10 s;
    empty keeps the default 1000 (KVT_CRC_HELPER_POLL_NS)."""
    res = _py(tmp_path, """
        st = _C.crc_helper_status()
        bs = 1024 * 1024
        view = data(4, bs, 5)
        p = names(4, "poll")
        io.batch_store_block(p, view, offs(4, bs), bs, checksum=True)
        out = np.zeros_like(view)
        io.batch_load_block(p, out, offs(4, bs), bs, use_o_direct=False, checksum=True)
        result(poll_us=st["poll_us"], after=_C.crc_helper_status()["poll_us"], same=bool(np.array_equal(out, view)))
    """, env={"KVTIER_CRC_HELPER": "1", "KVTIER_CRC_HELPER_POLL_US": value})
    assert res == {"poll_us": poll_us, "after": poll_us, "same": True}


def _c_only(env):
    """crc_helper_status() of a fresh interpreter that imports the C core but
    not kvtier.io (which validates the variables)."""
    e = {k: v for k, v in os.environ.items() if not k.startswith("KVTIER_")}
    e.update(env)
    r = subprocess.run([sys.executable, "-c", "import json, kvtier._C as C; print(json.dumps(C.crc_helper_status()))"],
                       capture_output=True, text=True, env=e, timeout=60)
    assert r.returncode == 0, r.stderr
    return json.loads(r.stdout)


@pytest.mark.parametrize("value", ["abc", "-5", "12abc", "10000001", " 5", "1e3"])
def test_poll_us_invalid(value):
    """kvtier.io refuses a value the C core would not use (ValueError naming
    the variable and the range); the C core alone keeps its default 1000 for
    the ones it cannot parse."""
    e = {k: v for k, v in os.environ.items() if not k.startswith("KVTIER_")}
    e["KVTIER_CRC_HELPER_POLL_US"] = value
    r = subprocess.run([sys.executable, "-c", "import kvtier.io"], capture_output=True, text=True, env=e, timeout=60)
    assert r.returncode == 1
    assert "ValueError: KVTIER_CRC_HELPER_POLL_US=" in r.stderr and "0..10000000" in r.stderr
    if value in ("abc", "-5", "12abc", "10000001", "1e3"):
        assert _c_only({"KVTIER_CRC_HELPER_POLL_US": value})["poll_us"] == 1000


@pytest.mark.parametrize("value,enabled", [
    ("1", True), ("true", True), ("YES", True), ("On", True),
    ("0", False), ("false", False), ("No", False), ("OFF", False),
])
def test_crc_helper_switch_words(value, enabled):
    """KVTIER_CRC_HELPER takes 1/true/yes/on and 0/false/no/off, any case."""
    assert _c_only({"KVTIER_CRC_HELPER": value})["enabled"] is enabled
    e = {k: v for k, v in os.environ.items() if not k.startswith("KVTIER_")}
    e["KVTIER_CRC_HELPER"] = value
    subprocess.run([sys.executable, "-c", "import kvtier.io"], check=True, env=e, timeout=60)


def test_crc_helper_switch_unknown_word():
    """Another value fails `import kvtier.io` with the valid ones listed; the C
    core alone treats it as unset (automatic)."""
    e = {k: v for k, v in os.environ.items() if not k.startswith("KVTIER_")}
    e["KVTIER_CRC_HELPER"] = "2"
    r = subprocess.run([sys.executable, "-c", "import kvtier.io"], capture_output=True, text=True, env=e, timeout=60)
    assert r.returncode == 1
    assert "KVTIER_CRC_HELPER='2' is not valid; valid values: 1, true, yes, on, 0, false, no, off" in r.stderr
    assert _c_only({"KVTIER_CRC_HELPER": "2"})["enabled"] is (len(os.sched_getaffinity(0)) >= 2)


@pytest.mark.timeout(120)
def test_fork_while_helper_running(tmp_path):
    """The parent's helper thread is running (started by a load) when it
    forks: the child has no thread (running False, counters inherited),
    starts its own on its first eligible load, round-trips and detects a
    flipped bit; the parent's helper keeps working. (test_block_io.py's
    test_crc_helper_after_fork forks before any load.)"""
    res = _py(tmp_path, """
        import time
        bs = 4 * 1024 * 1024
        view = data(2, bs, 6)
        p = names(2, "fork")
        io.batch_store_block(p, view, offs(2, bs), bs, checksum=True)
        out = np.zeros_like(view)
        io.batch_load_block(p, out, offs(2, bs), bs, use_o_direct=False, checksum=True)
        parent0 = _C.crc_helper_status()
        r, w = os.pipe()
        pid = os.fork()
        if pid == 0:
            os.close(r)
            rep = {}
            try:
                rep["at_fork"] = _C.crc_helper_status()
                deadline = time.monotonic() + 5  # an inherited cooldown keeps the first loads inline
                rounds, ok = 0, True
                while True:
                    o = np.zeros_like(view)
                    io.batch_load_block(p, o, offs(2, bs), bs, use_o_direct=False, checksum=True)
                    ok &= bool(np.array_equal(o, view))
                    rounds += 1
                    st = _C.crc_helper_status()
                    if (st["running"] and st["blocks"] > rep["at_fork"]["blocks"]) or time.monotonic() > deadline:
                        break
                rep.update(rounds=rounds, same=ok, after=st)
                bad = os.path.join(d, "child_bad.bin")
                io.batch_store_block([bad], view, [bs], bs, checksum=True)
                flip(bad, 3 * 65536)
                try:
                    io.batch_load_block([bad], o, [0], bs, use_o_direct=False, checksum=True)
                    rep["bad"] = None
                except OSError as e:
                    rep["bad"] = [e.errno, e.checksum_failed, os.path.exists(bad)]
            except BaseException as e:
                rep["error"] = repr(e)
            os.write(w, json.dumps(rep).encode())
            os._exit(0)
        os.close(w)
        chunks = []
        while True:
            c = os.read(r, 65536)
            if not c:
                break
            chunks.append(c)
        _, status = os.waitpid(pid, 0)
        child = json.loads(b"".join(chunks))
        out = np.zeros_like(view)
        io.batch_load_block(p, out, offs(2, bs), bs, use_o_direct=False, checksum=True)
        result(parent0=parent0, child=child, status=os.waitstatus_to_exitcode(status),
               parent_same=bool(np.array_equal(out, view)), parent1=_C.crc_helper_status())
    """, env={"KVTIER_CRC_HELPER": "1"})
    import errno

    assert res["status"] == 0
    child = res["child"]
    assert "error" not in child, child
    assert res["parent0"]["running"] is True and res["parent0"]["blocks"] >= 1
    assert child["at_fork"]["running"] is False  # no thread in the child
    assert child["at_fork"]["blocks"] == res["parent0"]["blocks"]  # counters inherited
    assert child["same"] is True
    assert child["after"]["running"] is True, child
    assert child["after"]["blocks"] > child["at_fork"]["blocks"], child
    assert child["bad"] == [errno.EBADMSG, True, False]
    assert res["parent_same"] and res["parent1"]["running"] is True
    assert res["parent1"]["blocks"] >= res["parent0"]["blocks"]
