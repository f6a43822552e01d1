"""`kvtier bench`: misses are not wrong bytes; --plot is checked before the run."""
import json
import os

import pytest

from ci import unavailable
from kvtier.cli import bench
from kvtier.cli import main
from kvtier.cli._text import human_bytes
from mounts import mount_tmpfs

TINY_BLOCK = 16 * 1024


def test_bench_on_a_full_disk_counts_misses_as_failed_jobs_not_mismatches(capsys, monkeypatch):
    # the disk fills up during the run (another writer, or a filesystem that reports more
    # room than it has): statvfs says 1 GiB free, so the up-front check passes, but the
    # tmpfs holds 1 MiB and the last stores hit ENOSPC mid-run
    import os

    real_statvfs = os.statvfs

    def roomy(path):
        st = real_statvfs(path)
        return os.statvfs_result((st.f_bsize, st.f_frsize, st.f_blocks, st.f_bfree, (1 << 30) // st.f_frsize,
                                  st.f_files, st.f_ffree, st.f_favail, st.f_flag, st.f_namemax))

    monkeypatch.setattr(os, "statvfs", roomy)
    with mount_tmpfs(size="1m") as root:
        rc = main(["bench", "--vllm", "off", "--min-pass-s", "0", "--preset", "tiny", "--blocks", "64", "--jobs", "4", "--repeat", "1",
                   "--root", str(root), "--no-progress", "--json", "--checksum", "on"])
    d = json.loads(capsys.readouterr().out)
    assert rc == 1 and d["ok"] is False
    # the table shows no GB/s for a pass with failed jobs (checksum on only: off is "-" too)
    table = bench.format_table(d).splitlines()
    import kvtier.io as kio  # the header names the I/O engine, as `kvtier info` does
    eng = kio._c_module().io_engine_status()["engine"] if kio.backend == "c" else "python"
    assert d["io_engine"] == eng and f"(engine {eng})" in table[1]
    failed = [r for r in d["rows"] if r["failed_jobs"]]
    assert failed
    for r in failed:
        line = next(x for x in table if x.startswith(f"{r['op']:<6}{r['jobs']:>5} |"))
        assert line.split("|")[1].split() == ["-", "-", "-"], line
    assert d["failed_jobs"] > 0  # the stores hit ENOSPC; the loads of those blocks miss
    assert d["mismatched_bytes"] == 0  # ... and no loaded byte was wrong
    # only the blocks the tier reported loaded were compared
    assert 0 < d["verified_bytes"] < 64 * TINY_BLOCK
    assert d["verified_bytes"] % TINY_BLOCK == 0


def test_bench_refuses_a_root_without_room_before_storing(capsys):
    """Less free space than the blocks need: rc 2 and one ENOSPC line naming the root,
    before any store (nothing left behind), not a table of failed jobs."""
    import os

    with mount_tmpfs(size="256k") as root:
        rc = main(["bench", "--vllm", "off", "--min-pass-s", "0", "--preset", "tiny", "--blocks", "64", "--root", str(root), "--no-progress"])
        left = os.listdir(root)
    out, err = capsys.readouterr()
    assert rc == 2 and out == "" and left == []
    # 2 modes x (64 blocks x (4 pages + 1 for metadata) + 64 KiB for the config files)
    need = human_bytes(2 * (64 * 5 * 4096 + 64 * 1024), 2)
    assert err.startswith(f"kvtier bench: [Errno 28] needs {need} free (2 x 64 blocks of 16.00 KiB, each rounded up to "
                          "4.0 KiB filesystem blocks, plus one for its xattr and 64 KiB per copy for config files and "
                          "directories)"), err
    assert err.rstrip().endswith(f"use --blocks or another --root: {str(root)!r}")


def test_bench_plot_into_a_missing_directory_fails_before_running(tmp_path, capsys):
    rc = main(["bench", "--vllm", "off", "--min-pass-s", "0", "--preset", "tiny", "--blocks", "4", "--root", str(tmp_path), "--no-progress",
               "--plot", str(tmp_path / "nope" / "x.png")])
    err = capsys.readouterr().err
    assert rc == 2 and "does not exist or is not writable" in err
    assert list(tmp_path.iterdir()) == []  # nothing was run


@pytest.mark.parametrize("kind", ["missing", "file"])
def test_bench_root_that_is_not_a_directory_is_named_as_such(tmp_path, capsys, kind):
    """--root MISSING (or a file) says so and exits 2, creating nothing; before, the error named
    a random temp path under it (issue #24 item 13)."""
    root = tmp_path / "nope"
    if kind == "file":
        root.write_bytes(b"x")
    rc = main(["bench", "--vllm", "off", "--min-pass-s", "0", "--preset", "tiny", "--blocks", "4", "--root", str(root),
               "--no-progress"])
    err = capsys.readouterr().err
    what = "No such file or directory" if kind == "missing" else "Not a directory"
    assert rc == 2 and err.strip() == f"kvtier bench: --root {root}: {what}"
    assert sorted(p.name for p in tmp_path.iterdir()) == ([] if kind == "missing" else ["nope"])


def test_bench_prints_the_table_then_writes_the_plot(tmp_path, capsys):
    png = tmp_path / "b.png"
    rc = main(["bench", "--vllm", "off", "--min-pass-s", "0", "--preset", "tiny", "--blocks", "4", "--jobs", "1", "--repeat", "1",
               "--root", str(tmp_path), "--no-progress", "--plot", str(png)])
    out, err = capsys.readouterr()
    assert rc == 0 and "0 mismatched, 0 failed jobs: OK" in out
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert f"plot written to {png}" in err


def test_bench_plot_name_without_a_known_image_type_fails_before_running(tmp_path, capsys):
    for bad in (tmp_path / "x.xyz", tmp_path / "noext", tmp_path):
        rc = main(["bench", "--vllm", "off", "--min-pass-s", "0", "--preset", "tiny", "--blocks", "4", "--root", str(tmp_path), "--no-progress",
                   "--plot", str(bad)])
        assert rc == 2 and ".png" in capsys.readouterr().err
    assert list(tmp_path.iterdir()) == []  # nothing was run or written


def test_bench_modes_load_the_same_files_over_long_passes(tmp_path, monkeypatch):
    """Checksum off and on load the very same files (the spy sees the same paths, the
    checksummed store's), each load pass runs its jobs again until --min-pass-s, and the
    GB/s spread over the repeats brackets the median."""
    import kvtier.io as kio

    real, seen = kio.batch_load_block, {False: set(), True: set()}

    def spy(paths, view, offsets, block_size, **kw):
        seen[bool(kw.get("checksum"))].update(map(str, paths))
        return real(paths, view, offsets, block_size, **kw)

    monkeypatch.setattr(kio, "batch_load_block", spy)
    d = bench.run_bench("tiny", blocks=8, jobs=(2,), root=str(tmp_path), repeat=2, progress=False,
                        vllm="off", min_pass_s=0.2)
    assert d["ok"] and seen[False] and seen[False] == seen[True] and len(seen[True]) == 8
    loads = [r for r in d["rows"] if r["op"] == "load"]
    assert [r["mode"] for r in loads] == ["off", "on"]
    for r in loads:
        assert r["wall_s"] >= 0.2 and r["rounds"] >= 2
        assert r["gbps_min"] <= r["gbps"] <= r["gbps_max"]
        assert abs(r["gbps"] - r["bytes"] * r["rounds"] / r["wall_s"] / 1e9) < 0.5 * r["gbps"]
    table = bench.format_table(d)
    assert "median [min-max] of 2 passes of >= 0.2 s" in table and "every mode loading the same files" in table


@pytest.mark.vllm
def test_bench_vllm_column(tmp_path, monkeypatch):
    """With vLLM installed the table gets vLLM's own fs tier I/O (fs_io_C) for the same
    jobs: stores and loads succeed, its loads are verified byte for byte like ours."""
    from kvtier.cli.peer import load_vllm_io

    vio, note = load_vllm_io()
    if vio is None:
        unavailable(f"vLLM's fs tier io: {note}")
    # every store pass, kvtier's and vLLM's, starts from the same directory state (an empty
    # root) and leaves the same tree (kvtier.file_mapper's layout): the same directory work timed
    stores = []

    def tree(root):
        return sorted(os.path.relpath(os.path.join(d, x), root) for d, ds, fs in os.walk(root) for x in ds + fs)

    def spy(real, op_arg, root_of):
        def f(*a, **kw):
            root = root_of(*a)
            before = tree(root) if a[op_arg] == "store" else None
            out = real(*a, **kw)
            if before is not None:
                stores.append((before, tree(root)))
            return out
        return f

    rank_root = lambda mgr, *a: mgr.file_mapper.rank_path  # noqa: E731
    peer_root = lambda vio, pool, op, keys, paths, *a: os.path.dirname(os.path.dirname(os.path.dirname(paths[0])))  # noqa: E731
    monkeypatch.setattr(bench, "_pass", spy(bench._pass, 1, rank_root))
    monkeypatch.setattr(bench, "_peer_pass", spy(bench._peer_pass, 2, peer_root))
    d = bench.run_bench("tiny", blocks=8, jobs=(2,), root=str(tmp_path), repeat=1, progress=False,
                        vllm="on", min_pass_s=0)
    assert d["ok"] and d["vllm"].startswith("vLLM 0.33")
    assert len(stores) == 3 and all(before == [] for before, _ in stores)
    after = [t for _, t in stores]
    assert after[0] == after[1] == after[2] and len([x for x in after[0] if x.endswith(".bin")]) == 8, after
    assert [(r["op"], r["mode"]) for r in d["rows"]] == [
        ("store", "off"), ("store", "on"), ("store", "vllm"), ("load", "off"), ("load", "on"), ("load", "vllm")]
    assert all(r["failed_jobs"] == 0 and r["gbps"] > 0 for r in d["rows"])
    assert d["verified_bytes"] == 3 * 8 * TINY_BLOCK  # 3 modes' loads compared with the source
    head = bench.format_table(d).splitlines()
    assert any("GB/s vLLM" in x and "on/vLLM" in x for x in head)


def test_two_client_mode_same_directory(tmp_path):
    """`kvtier bench --root D --node-b D`: two processes on one directory (the local
    stand-in for two mounts; tests/test_dfs.py runs it across two clients)."""
    import subprocess
    import sys

    p = subprocess.run([sys.executable, "-m", "kvtier", "bench", "--root", str(tmp_path), "--node-b",
                        str(tmp_path), "--preset", "tiny", "--blocks", "8", "--repeat", "2", "--checksum", "on",
                        "--vllm", "off", "--json"], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                       timeout=300)
    assert p.returncode == 0, p.stderr[-3000:]
    d = json.loads(p.stdout)
    assert [(r["engine"], r["op"]) for r in d["rows"]] == [("kvtier checksum on", "store"), ("kvtier checksum on", "load")]
    assert all(r["failed_blocks"] == 0 and r["mismatched_bytes"] == 0 and r["gbps_total"] > 0 for r in d["rows"])
    assert d["repeat"] == 2 and d["blocks"] == 8 and os.listdir(tmp_path) == []


@pytest.mark.vllm
def test_two_client_mode_vllm_column(tmp_path):
    """--vllm on: vLLM 0.33's fs tier I/O (fs_io_C) runs the same two-client passes first."""
    import subprocess
    import sys

    from kvtier.cli.peer import load_vllm_io

    vio, note = load_vllm_io()
    if vio is None:
        unavailable(note)
    p = subprocess.run([sys.executable, "-m", "kvtier", "bench", "--root", str(tmp_path), "--node-b",
                        str(tmp_path), "--preset", "tiny", "--blocks", "8", "--repeat", "1", "--checksum", "off",
                        "--vllm", "on", "--json"], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                       timeout=600)
    assert p.returncode == 0, p.stderr[-3000:]
    d = json.loads(p.stdout)
    assert [(r["engine"], r["op"]) for r in d["rows"]] == [
        ("vLLM fs_io_C (no checksum)", "store"), ("vLLM fs_io_C (no checksum)", "load"),
        ("kvtier checksum off", "store"), ("kvtier checksum off", "load")]
    assert all(r["failed_blocks"] == 0 and r["mismatched_bytes"] == 0 for r in d["rows"])
    assert d["vllm_note"].startswith("vLLM column: vLLM 0.33")


def test_two_client_mode_refuses_another_directory(tmp_path):
    from kvtier.cli.bench_nodes import run_two_clients

    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    with pytest.raises(ValueError, match="not the same directory"):
        run_two_clients(str(tmp_path / "a"), str(tmp_path / "b"), visible_timeout=0.2)
    assert os.listdir(tmp_path / "a") == [] and os.listdir(tmp_path / "b") == []
    with pytest.raises(ValueError, match="blocks must be a positive int"):
        run_two_clients(str(tmp_path / "a"), str(tmp_path / "a"), blocks=0)


def test_two_client_mode_needs_root(capsys):
    from kvtier.cli import main

    assert main(["bench", "--node-b", "/tmp"]) == 2
    assert "--node-b needs --root" in capsys.readouterr().err


def test_bench_reports_cpu_per_gib_moved_not_per_pass(tmp_path):
    """Load passes run several rounds, store passes one: the CPU the table and the rows
    report is the pass's process CPU over the GiB it moved (bytes x rounds), so modes whose
    passes ran different numbers of rounds compare per unit of work; the header says what
    a pass is and the unit."""
    d = bench.run_bench("tiny", blocks=8, jobs=(1, 2), root=str(tmp_path), repeat=1, progress=False,
                        vllm="off", min_pass_s=0.2)
    assert d["ok"]
    rows = {(r["op"], r["jobs"], r["mode"]): r for r in d["rows"]}
    assert sorted(rows) == [("load", 1, "off"), ("load", 1, "on"), ("load", 2, "off"), ("load", 2, "on"),
                            ("store", 2, "off"), ("store", 2, "on")]
    for (op, _, _), r in rows.items():
        assert r["rounds"] == 1 if op == "store" else r["rounds"] >= 2, r
        moved_gib = r["bytes"] * r["rounds"] / 2**30
        assert r["cpu_s"] > 0 and r["cpu_s_per_gib"] == pytest.approx(r["cpu_s"] / moved_gib, rel=1e-9), r
    table = bench.format_table(d).splitlines()
    assert any("a store pass: 1 round; a load pass: rounds until >= 0.2 s" in x and "per GiB moved" in x
               for x in table), table
    hdr = next(x for x in table if x.startswith("op "))
    assert "CPU s/GiB off" in hdr
    for (op, jobs, _), r in rows.items():
        line = next(x for x in table if x.split()[:2] == [op, str(jobs)])
        cpu = line.split("|")[4].split()  # off, on, on/off
        off, on = rows[(op, jobs, "off")], rows[(op, jobs, "on")]
        assert cpu == [f"{off['cpu_s_per_gib']:.3f}", f"{on['cpu_s_per_gib']:.3f}",
                       f"{on['cpu_s_per_gib'] / off['cpu_s_per_gib']:.2f}"], (line, off, on)
