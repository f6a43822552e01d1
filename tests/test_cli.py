"""`kvtier bench` and `kvtier scrub` end to end on real files."""
import json
import os
import subprocess
import sys

import numpy as np
import pytest

import kvtier.io as kio
from kvtier.cli import bench
from kvtier.cli import main
from kvtier.cli._text import human_bytes
from kvtier.manager import FileSystemTierManager, TransferJob
from corrupt import flip_bit as flip

TINY_BLOCK = 2 * 2 * 2 * 64 * 2 * 16  # K,V x layers x KV heads x head_dim x fp16 bytes x tokens


def test_preset_geometry():
    assert bench.PRESETS["tiny"].block_bytes(16) == TINY_BLOCK == 16384
    assert bench.PRESETS["llama-3.1-8b"].block_bytes(16) == 2 * 1024 * 1024
    assert bench.PRESETS["qwen3-8b"].block_bytes(16) == 36 * 8 * 128 * 2 * 2 * 16 == 2359296


def test_bench_tiny_end_to_end_subprocess(tmp_path):
    png = tmp_path / "b.png"
    r = subprocess.run(
        [sys.executable, "-m", "kvtier", "bench", "--vllm", "off", "--min-pass-s", "0", "--preset", "tiny", "--blocks", "8", "--jobs", "1,2",
         "--repeat", "1", "--root", str(tmp_path), "--json", "--no-progress", "--plot", str(png)],
        capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    d = json.loads(r.stdout)
    assert d["ok"] and d["block_bytes"] == TINY_BLOCK and d["mismatched_bytes"] == 0
    # 2 job counts x checksum off/on x 8 blocks, every byte compared
    assert d["verified_bytes"] == 2 * 2 * 8 * TINY_BLOCK
    assert [(x["op"], x["jobs"], x["checksum"]) for x in d["rows"]] == [
        ("store", 2, False), ("store", 2, True), ("load", 1, False), ("load", 1, True),
        ("load", 2, False), ("load", 2, True)]
    for x in d["rows"]:
        assert x["failed_jobs"] == 0 and x["gbps"] > 0 and x["p99_ms"] >= x["p50_ms"] > 0
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert os.listdir(tmp_path) == ["b.png"]  # the temp cache was removed


def test_bench_table_text(tmp_path, capsys):
    assert main(["bench", "--vllm", "off", "--min-pass-s", "0", "--preset", "tiny", "--blocks", "4", "--jobs", "1", "--repeat", "1",
                 "--root", str(tmp_path), "--no-progress", "--checksum", "on"]) == 0
    out = capsys.readouterr().out
    assert "16.00 KiB per block" in out
    assert "verified 65,536 bytes loaded, 0 mismatched, 0 failed jobs: OK" in out


def test_bench_detects_mismatch(tmp_path, monkeypatch, capsys):
    real = kio.batch_load_block

    def flipping(paths, view, offsets, block_size, **kw):
        real(paths, view, offsets, block_size, **kw)
        mv = memoryview(view).cast("B")
        mv[offsets[0]] ^= 0xFF  # one wrong byte per job

    monkeypatch.setattr(kio, "batch_load_block", flipping)
    rc = main(["bench", "--vllm", "off", "--min-pass-s", "0", "--preset", "tiny", "--blocks", "4", "--jobs", "2", "--repeat", "1",
               "--root", str(tmp_path), "--no-progress", "--json"])
    assert rc == 1
    d = json.loads(capsys.readouterr().out)
    assert not d["ok"] and d["mismatched_bytes"] == 2 * 2  # 2 jobs x checksum off/on


def test_bench_bad_args(tmp_path, capsys):
    assert main(["bench", "--vllm", "off", "--min-pass-s", "0", "--blocks", "0", "--root", str(tmp_path), "--no-progress"]) == 2
    assert main(["bench", "--vllm", "off", "--min-pass-s", "0", "--jobs", "a,b", "--no-progress"]) == 2
    with pytest.raises(SystemExit):
        main(["bench", "--vllm", "off", "--min-pass-s", "0", "--preset", "nope"])


# ---------------------------------------------------------------- scrub
def make_cache(root):
    """6 checksummed blocks + 1 legacy block (no xattr); returns (paths, legacy path)."""
    buf = np.random.default_rng(1).integers(0, 256, (8, 8192), dtype=np.uint8)
    keys = [(bytes([i]) * 16, 0) for i in range(7)]
    with FileSystemTierManager(buf, root, "m/x", checksum_blocks=True, n_read_threads=1, n_write_threads=1) as m:
        m.submit_store(TransferJob(1, keys[:6], list(range(6))))
        m.drain_jobs()
        assert m.get_finished_jobs()[0].success
        paths = [m.file_mapper.get_file_name(k) for k in keys]
    with FileSystemTierManager(buf, root, "m/x", checksum_blocks=False, n_read_threads=1, n_write_threads=1) as m:
        m.submit_store(TransferJob(2, keys[6:], [6]))
        m.drain_jobs()
        assert m.get_finished_jobs()[0].success
    return paths



def test_scrub_clean_cache(tmp_path, capsys):
    paths = make_cache(str(tmp_path))
    assert main(["scrub", str(tmp_path), "--json", "--no-progress"]) == 0
    d = json.loads(capsys.readouterr().out)
    assert d["blocks"] == 7 and d["bytes"] == 7 * 8192
    assert d["counts"] == {"ok": 6, "corrupt": 0, "no_checksum": 1, "wrong_size": 0, "error": 0, "stray_temp": 0, "gone": 0}
    assert [f["path"] for f in d["findings"]] == [paths[6]]
    assert d["retried"] == 0
    assert list(d["expected_block_bytes"].values()) == [{"bytes": 8192, "source": "kvtier.json"}]
    assert [k.rsplit("/", 1)[1] for k in d["expected_block_bytes"]] == ["g0"]


def test_scrub_finds_corruption_and_remove_deletes_only_bad(tmp_path, capsys):
    paths = make_cache(str(tmp_path))
    flip(paths[2], 4000)
    os.truncate(paths[4], 8191)
    stray = paths[0] + "_0123456789abcdef.tmp"
    open(stray, "wb").close()
    assert main(["scrub", str(tmp_path), "--json", "--no-progress"]) == 1
    d = json.loads(capsys.readouterr().out)
    assert d["counts"] == {"ok": 4, "corrupt": 1, "no_checksum": 1, "wrong_size": 1, "error": 0, "stray_temp": 1, "gone": 0}
    by = {f["path"]: f for f in d["findings"]}
    assert by[paths[2]]["status"] == "corrupt" and "recorded" in by[paths[2]]["detail"]
    assert by[paths[4]]["status"] == "wrong_size" and by[paths[4]]["expected_size"] == 8192
    assert by[stray]["status"] == "stray_temp"
    assert all(os.path.exists(p) for p in paths)  # nothing removed without --remove

    assert main(["scrub", str(tmp_path), "--remove", "--no-progress"]) == 1
    out = capsys.readouterr().out
    assert "[removed]" in out
    assert [os.path.exists(p) for p in paths] == [True, True, False, True, False, True, True]
    assert os.path.exists(stray)  # stray temps are only reported
    assert main(["scrub", str(tmp_path), "--json", "--no-progress"]) == 0
    d = json.loads(capsys.readouterr().out)
    assert d["counts"]["ok"] == 4 and d["counts"]["corrupt"] == 0


def test_scrub_malformed_xattr_is_corrupt(tmp_path, capsys):
    """A malformed user.vllm.kv_crc32c is corrupt where a load reads it (no 12-byte identity
    record), a note where the load checks the identity record's CRC (design.md P22)."""
    paths = make_cache(str(tmp_path))
    os.setxattr(paths[1], "user.vllm.kv_crc32c", b"\x00\x01\x02")
    os.removexattr(paths[1], "user.kvtier.id")
    os.setxattr(paths[2], "user.vllm.kv_crc32c", b"\x00\x01\x02")
    assert main(["scrub", str(tmp_path), "--json", "--no-progress"]) == 1
    d = json.loads(capsys.readouterr().out)
    by = {f["path"]: f for f in d["findings"]}
    assert (by[paths[1]]["status"], by[paths[2]]["status"]) == ("corrupt", "ok")
    assert [f["path"] for f in d["findings"] if f["status"] == "corrupt"] == [paths[1]]
    assert "user.vllm.kv_crc32c is 3 bytes, not 4" in by[paths[2]]["detail"]


def test_scrub_size_without_block_info(tmp_path, capsys):
    paths = make_cache(str(tmp_path))
    info = [os.path.join(dp, f) for dp, _, fs in os.walk(tmp_path) for f in fs if f == "kvtier.json"]
    assert len(info) == 1
    os.unlink(info[0])
    os.truncate(paths[3], 100)
    # the most common size (8192) is only a guess: the truncated block is condemned by its
    # CRC32C (corrupt), not by its size
    assert main(["scrub", str(tmp_path), "--json", "--no-progress"]) == 1
    d = json.loads(capsys.readouterr().out)
    assert list(d["expected_block_bytes"].values()) == [{"bytes": 8192, "source": "guess"}]
    bad = [f for f in d["findings"] if f["status"] in ("corrupt", "wrong_size")]
    assert [(f["path"], f["status"], f["size"], f["retried"]) for f in bad] == [(paths[3], "corrupt", 100, True)]
    assert "most common size in this group is 8192" in bad[0]["detail"]
    # an explicit --block-size is a known size: it wins over the guess, and judges sizes
    assert main(["scrub", str(tmp_path), "--json", "--no-progress", "--block-size", "100"]) == 1
    d = json.loads(capsys.readouterr().out)
    assert d["counts"]["wrong_size"] == 6 and d["counts"]["ok"] == 0 and d["counts"]["corrupt"] == 1
    assert list(d["expected_block_bytes"].values()) == [{"bytes": 100, "source": "--block-size"}]
    assert all(os.path.exists(p) for p in paths)


def test_scrub_symlink_is_error_and_kept(tmp_path, capsys):
    paths = make_cache(str(tmp_path))
    os.unlink(paths[5])
    os.symlink(paths[5], paths[5])
    assert main(["scrub", str(tmp_path), "--json", "--no-progress", "--remove"]) == 0
    d = json.loads(capsys.readouterr().out)
    assert d["counts"]["error"] == 1 and os.path.islink(paths[5])


# every subcommand's way of taking a directory: (argv before it, option or None, argv after it)
DIR_ARGS = {
    "info": ([], None, []),
    "scrub": (["--no-progress"], None, []),
    "doctor": (["--wait", "0.3"], None, []),
    "evict": (["--max-bytes", "1G"], None, []),
    "bench": (["--vllm", "off", "--preset", "tiny", "--blocks", "4", "--no-progress"], "--root", []),
    "bench --node-b": (["--vllm", "off", "--preset", "tiny", "--blocks", "4", "--no-progress", "--root", "{ok}"],
                       "--node-b", []),
    "doctor --peer": (["--wait", "0.3", "{ok}"], "--peer", []),
}


def test_dir_args_lists_every_subcommand_that_takes_a_root():
    """A new subcommand with a ROOT (or a --root) is checked below, not forgotten."""
    from kvtier.cli import build_parser

    sub = next(a for a in build_parser()._actions if a.dest == "command")
    takes = {name for name, p in sub.choices.items()
             if any(a.dest == "root" for a in p._actions)}
    assert takes == {"info", "scrub", "doctor", "evict", "bench"}
    assert takes <= set(DIR_ARGS)


@pytest.mark.parametrize("kind", ["missing", "file", "below_a_file"])
@pytest.mark.parametrize("cmd", sorted(DIR_ARGS))
def test_every_subcommand_says_the_same_of_a_root_that_is_no_directory(tmp_path, cmd, kind):
    """A ROOT that does not exist, is a regular file, or lies below one: exit 2 (bad
    arguments, as ``kvtier --help`` says) from every subcommand, one line on stderr naming
    the path and the errno text, nothing on stdout, nothing made. Before: info and evict
    exit 1, scrub and doctor 2, doctor said "not a directory" of a missing path, bench
    named no errno."""
    ok = tmp_path / "ok"
    ok.mkdir()
    f = tmp_path / "f"
    f.write_bytes(b"not a directory")
    root, why = {"missing": (tmp_path / "missing", "No such file or directory"),
                 "file": (f, "Not a directory"), "below_a_file": (f / "sub", "Not a directory")}[kind]
    name = cmd.split()[0]
    before, opt, after = DIR_ARGS[cmd]
    argv = [name] + [a.replace("{ok}", str(ok)) for a in before] + ([opt] if opt else []) + [str(root)] + after
    r = subprocess.run([sys.executable, "-m", "kvtier", *argv], capture_output=True, text=True, timeout=120)
    assert r.returncode == 2, (argv, r.returncode, r.stderr)
    assert r.stderr == f"kvtier {name}: {opt + ' ' if opt else ''}{root}: {why}\n", (argv, r.stderr)
    assert r.stdout == ""
    assert sorted(p.name for p in tmp_path.iterdir()) == ["f", "ok"] and os.listdir(ok) == []
    assert f.read_bytes() == b"not a directory"


@pytest.mark.parametrize("cmd", sorted(DIR_ARGS))
def test_every_subcommand_shows_an_empty_root_as_quotes(tmp_path, monkeypatch, capsys, cmd):
    """``kvtier scrub ""`` (an unset $VAR): exit 2 and ``'': No such file or directory`` on
    stderr (before: ``: No such file or directory``, no path to see), nothing made in the
    working directory (an empty path is not taken as ".")."""
    ok = tmp_path / "ok"
    ok.mkdir()
    monkeypatch.chdir(ok)
    name = cmd.split()[0]
    before, opt, after = DIR_ARGS[cmd]
    argv = [name] + [a.replace("{ok}", str(ok)) for a in before] + ([opt] if opt else []) + [""] + after
    assert main(argv) == 2, argv
    out, err = capsys.readouterr()
    assert err == f"kvtier {name}: {opt + ' ' if opt else ''}'': No such file or directory\n", (argv, err)
    assert out == "" and os.listdir(ok) == []


def test_info_of_a_root_it_cannot_read_is_exit_2_with_the_errno_and_path(tmp_path):
    """``kvtier info ROOT`` on a directory this process may not list (EACCES): exit 2 with
    the errno and the path on stderr, nothing on stdout, as ``kvtier scrub`` and ``kvtier
    evict`` say of it (was 1). Root runs the CLI without capabilities (setpriv)."""
    root = tmp_path / "root"
    root.mkdir()
    nocaps = ["setpriv", "--bounding-set=-all", "--inh-caps=-all"] if os.geteuid() == 0 else []
    cmd = nocaps + [sys.executable, "-m", "kvtier", "info", str(root)]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0 and str(root) in r.stdout, (r.returncode, r.stderr)
    os.chmod(root, 0)
    try:
        for extra in ([], ["--json"]):
            r = subprocess.run(cmd + extra, capture_output=True, text=True, timeout=120)
            assert r.returncode == 2 and r.stdout == "", (extra, r.returncode, r.stdout, r.stderr)
            assert r.stderr.endswith(f"kvtier info: [Errno 13] Permission denied: '{root}'\n"), (extra, r.stderr)
    finally:
        os.chmod(root, 0o755)


def test_scrub_bad_root(tmp_path, capsys):
    assert main(["scrub", str(tmp_path / "missing")]) == 2
    assert "No such file" in capsys.readouterr().err


def test_tier_bench_script_smoke(tmp_path):
    script = os.path.join(os.path.dirname(__file__), os.pardir, "benchmarks", "tier_bench.py")
    r = subprocess.run([sys.executable, script, "--sizes", "4K,8K", "--jobs", "1,2", "--repeat", "1",
                        "--cap-mib", "1", "--threads", "2", "--root", str(tmp_path), "--json"],
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    d = json.loads(r.stdout)
    assert d["mismatched_bytes"] == 0
    assert [(x["block_bytes"], x["jobs"], x["blocks_per_job"]) for x in d["rows"]] == [
        (4096, 1, 16), (4096, 2, 16), (8192, 1, 16), (8192, 2, 16)]
    assert all(x["store_ms_off"] > 0 and x["load_ms_on"] > 0 for x in d["rows"])
    assert os.listdir(tmp_path) == []


@pytest.mark.parametrize("cmd", ["bench", "scrub"])
def test_subcommand_help_is_plain_text(cmd, capsys):
    """--help shows the module docstring without reST markup, and every
    option has a help text."""
    with pytest.raises(SystemExit) as ei:
        main([cmd, "--help"])
    assert ei.value.code == 0
    out = capsys.readouterr().out
    assert "``" not in out and ":class:" not in out and ":mod:" not in out and ":func:" not in out
    first = {"bench": "kvtier bench: store and load real-model-sized KV blocks through the tier manager.",
             "scrub": "kvtier scrub ROOT: verify every block file of a cache against its CRC32C and size."}[cmd]
    assert first in out
    if cmd == "bench":
        assert "kvtier.manager.FileSystemTierManager into a temp directory (or --root)" in out
        assert "--seed SEED           seed of the random block bytes and keys (default 0)" in out
    import argparse

    from kvtier.cli import build_parser

    sub = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction)).choices[cmd]
    missing = [a.dest for a in sub._actions if not a.help]
    assert missing == [], f"{cmd}: options without help text: {missing}"


def test_plain_text():
    from kvtier.cli._text import plain_text

    assert plain_text("see :class:`~kvtier.x.Y` and ``--root`` or :func:`f`") == "see kvtier.x.Y and --root or f"


def test_bench_refuses_more_blocks_than_ram(capsys):
    """2 x blocks x block bytes above MemAvailable: exit 2 with one line, before any allocation."""
    rc = main(["bench", "--vllm", "off", "--min-pass-s", "0", "--preset", "llama-3.1-70b", "--blocks", "1000000", "--no-progress"])
    assert rc == 2
    err = capsys.readouterr().err
    bs = bench.PRESETS["llama-3.1-70b"].block_bytes(bench.DEFAULT_TOKENS)
    assert err.startswith(f"kvtier bench: needs {human_bytes(2 * 1000000 * bs, 2)} of RAM (source and load "
                          f"buffers, 2 x 1000000 blocks of {human_bytes(bs, 2)}), "), err
    assert err.rstrip().endswith("available (MemAvailable); use --blocks")


def test_bench_table_with_one_checksum_mode_keeps_its_columns(tmp_path, capsys):
    rc = main(["bench", "--vllm", "off", "--min-pass-s", "0", "--preset", "tiny", "--blocks", "4", "--jobs", "1", "--repeat", "1", "--root", str(tmp_path),
               "--checksum", "on", "--no-progress"])
    assert rc == 0
    lines = capsys.readouterr().out.splitlines()
    hdr = next(line for line in lines if line.startswith("op"))
    for line in lines:
        if line.startswith(("store", "load")):
            assert len(line) == len(hdr) and [i for i, c in enumerate(line) if c == "|"] == \
                [i for i, c in enumerate(hdr) if c == "|"], (hdr, line)
            assert line.split("|")[1].split()[0] == "-"  # no off column


def test_bench_on_ramfs_is_not_refused_for_space(ramfs_dir, capsys):
    """ramfs reports no size (statvfs f_blocks 0): the free-space check must not read that as full."""
    assert os.statvfs(ramfs_dir).f_blocks == 0
    rc = main(["bench", "--vllm", "off", "--min-pass-s", "0", "--preset", "tiny", "--blocks", "4", "--jobs", "1", "--repeat", "1", "--root", ramfs_dir,
               "--checksum", "off", "--no-progress"])
    out = capsys.readouterr()
    assert rc == 0, out.err
    assert "0 mismatched, 0 failed jobs: OK" in out.out


def test_a_reader_leaving_the_pipe_ends_the_command_quietly(tmp_path):
    """`kvtier scrub ROOT | head` (the reader gone before the output is written): no
    BrokenPipeError traceback, exit status 141 (128 + SIGPIPE, as a shell reports ls)."""
    os.makedirs(tmp_path / "m")
    with open(tmp_path / "m" / "blk.bin", "wb") as f:
        f.write(b"x" * 4096)
    for args in (["scrub", str(tmp_path)], ["info"]):
        r_fd, w_fd = os.pipe()
        os.close(r_fd)  # the reader left before anything was written
        p = subprocess.run([sys.executable, "-m", "kvtier", *args], stdout=w_fd, stderr=subprocess.PIPE,
                           text=True, timeout=120)
        os.close(w_fd)
        assert p.returncode == 141, (args, p.returncode, p.stderr[-2000:])
        assert "Traceback" not in p.stderr and "BrokenPipeError" not in p.stderr, p.stderr[-2000:]


def test_evict_json_says_a_failure_on_stdout_with_its_exit_status(tmp_path):
    """``kvtier evict --json`` prints a JSON object on stdout whatever happens: on a failure
    ``{"root", "error", "exit_status"}`` with the message that stderr shows and the same exit
    status (1: another process holds the evictor lock; 2: a bound that is no size, or one
    that holds no block); a pass that ran has ``"error": null, "exit_status": 0``. (Was:
    nothing on stdout when it failed, so a JSON reader got no answer.)"""
    from kvtier._tier import capacity as cap

    root = tmp_path / "root"
    (root / "m_0123456789ab_r0").mkdir(parents=True)
    cmd = [sys.executable, "-m", "kvtier", "evict", str(root), "--json"]

    def run(*argv, rc):
        r = subprocess.run(cmd + list(argv), capture_output=True, text=True, timeout=120)
        assert r.returncode == rc, (argv, r.returncode, r.stdout, r.stderr)
        out = json.loads(r.stdout)
        assert "Traceback" not in r.stderr
        return out, r.stderr

    for argv, want in ((["--max-bytes", "12X"], "powers of 1024"),
                       (["--max-bytes", "1K"], "less than one block plus the root's own files")):
        out, err = run(*argv, rc=2)
        assert out == {"root": str(root), "error": out["error"], "exit_status": 2} and want in out["error"]
        assert err == f"kvtier evict: {out['error']}\n"
    lock = cap.EvictorLock(str(root))  # this process holds it: the command's process cannot take it
    os.makedirs(os.path.join(cap.state_dir(str(root)), cap.WRITERS_DIR), exist_ok=True)
    assert lock.try_acquire()
    try:
        out, err = run("--max-bytes", "1G", rc=1)
        assert out["exit_status"] == 1 and out["error"].startswith(
            f"another process holds the evictor lock of {root} (pid {os.getpid()} by F_GETLK")
        assert out["error"].endswith("it enforces its own bound; nothing done") and err == f"kvtier evict: {out['error']}\n"
    finally:
        lock.release()
    out, err = run("--max-bytes", "1G", rc=0)
    assert out["error"] is None and out["exit_status"] == 0 and out["evicted"] == 0 and err == ""
