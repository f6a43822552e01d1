"""`kvtier scrub` size judgement per KV-cache group, re-read on a CRC32C mismatch, and
inode-checked removal, on real block files written by kvtier.io (checksum on)."""
import contextlib
import io
import json
import os

import numpy as np
import pytest

import kvtier
import kvtier.io as kio
from kvtier._blockio import records
from kvtier.cli import scrub as sc
from kvtier.cli import main
from corrupt import flip_bit as flip

XATTR = "user.vllm.kv_crc32c"


def block_path(root, h, group):
    hx = h.hex()
    return os.path.join(root, "m_0123456789ab_r0", hx[:3], f"{hx[3:5]}_g{group}", f"{hx}.bin")


def store(paths, block_bytes, seed, checksum=True):
    """Store len(paths) random blocks of block_bytes through kvtier.io; returns their bytes."""
    data = np.random.default_rng(seed).integers(0, 256, len(paths) * block_bytes, dtype=np.uint8)
    for p in paths:
        os.makedirs(os.path.dirname(p), exist_ok=True)
    kio.batch_store_block(paths, data, [i * block_bytes for i in range(len(paths))], block_bytes,
                          use_o_direct=False, checksum=checksum)
    out = [data[i * block_bytes:(i + 1) * block_bytes].tobytes() for i in range(len(paths))]
    for p, b in zip(paths, out):
        with open(p, "rb") as f:
            assert f.read() == b
        if checksum:
            assert os.getxattr(p, XATTR) == kvtier.crc32c(b).to_bytes(4, "big")
    return out


def run(root, *extra):
    """(exit status, JSON report) of `kvtier scrub ROOT --json`."""
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        rc = main(["scrub", str(root), "--json", "--no-progress", *extra])
    return rc, json.loads(out.getvalue())



def hybrid(root):
    """Three 8 KiB blocks in group 0, one 4 KiB block in group 1, no kvtier.json."""
    g0 = [block_path(root, bytes([i]) * 16, 0) for i in range(1, 4)]
    g1 = [block_path(root, b"\x09" * 16, 1)]
    store(g0, 8192, 1)
    store(g1, 4096, 2)
    return g0, g1


def test_hybrid_groups_guess_size_per_group_and_remove_keeps_good_blocks(tmp_path):
    g0, g1 = hybrid(str(tmp_path))
    for extra in ((), ("--remove",)):
        rc, d = run(tmp_path, *extra)
        assert rc == 0
        assert d["counts"] == {"ok": 4, "corrupt": 0, "no_checksum": 0, "wrong_size": 0, "error": 0, "stray_temp": 0, "gone": 0}
        assert d["expected_block_bytes"] == {
            "m_0123456789ab_r0/g0": {"bytes": 8192, "source": "guess"},
            "m_0123456789ab_r0/g1": {"bytes": 4096, "source": "guess"},
        }
        assert d["findings"] == [] and d["removed"] == [] and d["clean"] is True
        assert all(os.path.getsize(p) == 8192 for p in g0) and os.path.getsize(g1[0]) == 4096


def test_guessed_size_never_condemns_a_block_whose_crc_matches(tmp_path):
    root = str(tmp_path)
    big = [block_path(root, bytes([i]) * 16, 0) for i in range(1, 4)]
    odd = block_path(root, b"\x0a" * 16, 0)
    legacy = block_path(root, b"\x0b" * 16, 0)
    store(big, 8192, 1)
    store([odd], 4096, 2)
    store([legacy], 2048, 3, checksum=False)
    rc, d = run(tmp_path, "--remove")
    assert rc == 0 and d["clean"] is True and d["removed"] == []
    assert d["counts"]["ok"] == 4 and d["counts"]["no_checksum"] == 1 and d["counts"]["wrong_size"] == 0
    by = {f["path"]: f for f in d["findings"]}
    assert set(by) == {odd, legacy}
    assert (by[odd]["status"], by[odd]["size"], by[odd]["expected_size"], by[odd]["size_source"]) == (
        "ok", 4096, 8192, "guess")
    assert "CRC32C matches: kept" in by[odd]["detail"]
    assert by[legacy]["status"] == "no_checksum" and "most common size" in by[legacy]["detail"]
    assert os.path.getsize(odd) == 4096 and os.path.getsize(legacy) == 2048

    # the same odd block with a bad CRC32C is condemned (by its CRC32C) and removed
    flip(odd, 100)
    rc, d = run(tmp_path, "--remove")
    assert rc == 1 and d["removed"] == [odd] and not os.path.exists(odd)
    (f,) = [f for f in d["findings"] if f["path"] == odd]
    assert f["status"] == "corrupt" and f["removed"] is True and f["retried"] is True
    assert all(os.path.exists(p) for p in big + [legacy])


def test_known_size_judges_every_group(tmp_path):
    root = str(tmp_path)
    g0, g1 = hybrid(root)
    base = os.path.join(root, "m_0123456789ab")  # the rank directory's base (FileMapper.base_path)
    os.makedirs(base)
    with open(os.path.join(base, "kvtier.json"), "w") as f:
        json.dump({"block_bytes": 8192}, f)
    rc, d = run(tmp_path)
    assert rc == 1
    assert d["expected_block_bytes"]["m_0123456789ab_r0/g1"] == {"bytes": 8192, "source": "kvtier.json"}
    assert [(f["path"], f["status"]) for f in d["findings"]] == [(g1[0], "wrong_size")]
    # its CRC32C matches: reported, but --remove keeps it (a size rule is not corruption)
    rc, d = run(tmp_path, "--remove")
    assert rc == 1 and d["removed"] == [] and all(os.path.exists(p) for p in g0 + g1)
    assert "CRC32C matches: kept" in d["findings"][0]["detail"]
    # the same block corrupted, or stripped of its record, is removed
    flip(g1[0], 5)
    rc, d = run(tmp_path, "--remove")
    assert rc == 1 and d["removed"] == g1 and not os.path.exists(g1[0])
    assert all(os.path.exists(p) for p in g0)


def test_known_size_removes_an_unverifiable_block_of_the_wrong_size(tmp_path):
    root = str(tmp_path)
    g0, g1 = hybrid(root)
    os.removexattr(g1[0], "user.vllm.kv_crc32c")
    os.removexattr(g1[0], "user.kvtier.id")  # no CRC recorded at all (its 12 bytes carry one)
    rc, d = run(tmp_path, "--block-size", "8192", "--remove")
    assert rc == 1 and d["removed"] == g1 and not os.path.exists(g1[0])
    assert all(os.path.exists(p) for p in g0)


@pytest.fixture
def fadvise_calls(monkeypatch):
    """Records os.posix_fadvise calls and runs an optional hook after the real call."""
    real = os.posix_fadvise
    calls, hooks = [], []

    def fake(fd, offset, length, advice):
        calls.append((os.readlink(f"/proc/self/fd/{fd}"), offset, length, advice))
        real(fd, offset, length, advice)
        for h in hooks:
            h()

    monkeypatch.setattr(os, "posix_fadvise", fake)
    return calls, hooks


def test_first_mismatch_reread_ok_is_counted_retried(tmp_path, fadvise_calls):
    calls, hooks = fadvise_calls
    g0, _ = hybrid(str(tmp_path))
    good = open(g0[1], "rb").read()
    flip(g0[1], 5000)

    def repair():  # the device copy is good; only the first read saw bad bytes
        with open(g0[1], "r+b") as f:
            f.write(good)

    hooks.append(repair)
    rc, d = run(tmp_path, "--remove")
    assert rc == 0 and d["retried"] == 1 and d["removed"] == []
    assert calls == [(g0[1], 0, 8192, os.POSIX_FADV_DONTNEED)]
    (f,) = d["findings"]
    assert (f["path"], f["status"], f["retried"], f["removed"]) == (g0[1], "ok", True, False)
    assert "re-read after POSIX_FADV_DONTNEED matched" in f["detail"]
    assert open(g0[1], "rb").read() == good


def test_second_mismatch_condemns(tmp_path, fadvise_calls):
    calls, _ = fadvise_calls
    g0, g1 = hybrid(str(tmp_path))
    flip(g1[0], 4095)
    rc, d = run(tmp_path)
    assert rc == 1 and d["retried"] == 0 and os.path.exists(g1[0])
    assert calls == [(g1[0], 0, 4096, os.POSIX_FADV_DONTNEED)]
    assert [(f["path"], f["status"], f["retried"]) for f in d["findings"]] == [(g1[0], "corrupt", True)]
    rc, d = run(tmp_path, "--remove")
    assert rc == 1 and d["removed"] == g1 and not os.path.exists(g1[0])
    assert all(os.path.exists(p) for p in g0)


def test_remove_keeps_a_block_republished_during_scrub(tmp_path, fadvise_calls):
    _, hooks = fadvise_calls
    g0, _ = hybrid(str(tmp_path))
    p = g0[0]
    good = open(p, "rb").read()
    crc = os.getxattr(p, XATTR)
    flip(p, 0)

    def republish():  # a peer stores the block again: temp + rename over the name
        tmp = p + "_00ff.tmp"
        with open(tmp, "wb") as f:
            f.write(good)
        os.setxattr(tmp, XATTR, crc)
        os.rename(tmp, p)

    hooks.append(republish)
    rc, d = run(tmp_path, "--remove")
    assert rc == 1 and d["removed"] == []
    (f,) = d["findings"]
    assert (f["path"], f["status"], f["removed"]) == (p, "corrupt", False)
    assert "republished during scrub" in f["detail"]
    assert open(p, "rb").read() == good
    hooks.clear()
    rc, d = run(tmp_path, "--remove")
    assert rc == 0 and d["counts"]["ok"] == 4 and d["removed"] == []


def test_unlink_if_same(tmp_path):
    a, b = tmp_path / "a.bin", tmp_path / "b.bin"
    a.write_bytes(b"old")
    b.write_bytes(b"new")
    fd = os.open(a, os.O_RDONLY)
    try:
        os.rename(b, a)
        assert "another file" in sc._unlink_if_same(str(a), fd)
        assert a.read_bytes() == b"new"
    finally:
        os.close(fd)
    fd = os.open(a, os.O_RDONLY)
    try:
        assert sc._unlink_if_same(str(a), fd) == ""
        assert not a.exists()
    finally:
        os.close(fd)


def test_text_report_names_sources_and_retried(tmp_path, capsys):
    hybrid(str(tmp_path))
    assert main(["scrub", str(tmp_path), "--no-progress"]) == 0
    out = capsys.readouterr().out
    assert "m_0123456789ab_r0/g1: expected block size 4096 (guess: most common size; judged by CRC32C only)" in out
    assert "ok 4  corrupt 0  no_checksum 0  wrong_size 0  error 0  stray_temp 0  gone 0  retried 0" in out


def test_scrub_checks_both_crc_records(tmp_path):
    """A store records the CRC32C twice: user.vllm.kv_crc32c (the upstream vLLM PR's name) and in the
    12-byte identity record (kvtier's load, which reads only that one). Scrub judges a block
    as a load does (design.md P22): by the identity record's CRC when it has one of this
    block, else by user.vllm.kv_crc32c. Without vLLM's record the block is ok; a vLLM record
    that is malformed or disagrees is noted (a reader checking it would reject the block;
    vLLM 0.33 checks none: the note says so) but the
    block is ok and never removed (a load serves it, verified); bytes that match vLLM's
    record but not the identity record's CRC are ok too, noted: the identity record alone
    is damaged (issue #24: a load serves them, verified by vLLM's record); --adopt
    records both."""
    root = str(tmp_path)
    paths = [block_path(root, bytes([i]) * 16, 0) for i in range(1, 6)]
    data = store(paths, 8192, 7)
    crc = kvtier.crc32c(data[0])
    assert os.getxattr(paths[0], "user.kvtier.id") == records.identity_record(paths[0], 8192, crc)
    os.removexattr(paths[0], XATTR)
    bad = ((kvtier.crc32c(data[1]) ^ 1) & 0xFFFFFFFF).to_bytes(4, "big")
    os.setxattr(paths[1], XATTR, bad)
    os.removexattr(paths[2], XATTR)
    os.removexattr(paths[2], "user.kvtier.id")
    os.setxattr(paths[3], XATTR, b"\x01\x02\x03")  # malformed
    crc4 = kvtier.crc32c(data[4])
    os.setxattr(paths[4], "user.kvtier.id", records.identity_record(paths[4], 8192, crc4 ^ 1))
    for p, i in zip(paths, range(5)):  # what a load says: each loads its bytes
        out = np.zeros(8192, np.uint8)
        kio.batch_load_block([p], out, [0], 8192, use_o_direct=False, checksum=True)
        assert out.tobytes() == data[i], p
    rc, d = run(tmp_path)
    by = {f["path"]: f for f in d["findings"]}
    assert rc == 0 and sorted(by) == [paths[1], paths[2], paths[3], paths[4]] and d["counts"]["ok"] == 4
    assert [by[p]["status"] for p in paths[1:]] == ["ok", "no_checksum", "ok", "ok"]
    assert f"user.vllm.kv_crc32c 0x{int.from_bytes(bad, 'big'):08x} differs" in by[paths[1]]["detail"]
    assert ("a reader checking user.vllm.kv_crc32c (the open upstream vLLM checksum PR's; vLLM 0.33 checks no "
            "CRC) would reject it; kept") in by[paths[1]]["detail"]
    assert "vLLM's own reader" not in by[paths[1]]["detail"]
    assert "user.vllm.kv_crc32c is 3 bytes, not 4" in by[paths[3]]["detail"]
    assert "identity record user.kvtier.id is damaged (12 bytes, its CRC differs" in by[paths[4]]["detail"]
    rc, d = run(tmp_path, "--adopt", "--remove")
    assert d["adopted"] == [paths[2]] and d["removed"] == []
    assert all(os.path.exists(p) for p in paths)
    crc2 = kvtier.crc32c(data[2])
    assert os.getxattr(paths[2], XATTR) == crc2.to_bytes(4, "big")
    assert os.getxattr(paths[2], "user.kvtier.id") == records.identity_record(paths[2], 8192, crc2)
    rc, d = run(tmp_path, "--strict")
    assert rc == 0 and d["counts"]["ok"] == 5 and sorted(f["path"] for f in d["findings"]) == [paths[1], paths[3],
                                                                                               paths[4]]


def test_scrub_reports_a_directory_at_a_block_path(tmp_path):
    """A directory named like a block (every load and store of that key fails EISDIR) is
    reported as an error, never removed (not even with --remove), and not walked into."""
    root = str(tmp_path)
    good = block_path(root, b"\x01" * 16, 0)
    store([good], 8192, 3)
    d_bin = block_path(root, b"\x02" * 16, 0)
    os.makedirs(os.path.join(d_bin, "inner"))
    open(os.path.join(d_bin, "inner", "x.bin"), "wb").close()
    for extra in ((), ("--remove",)):
        rc, d = run(tmp_path, *extra)
        assert d["blocks"] == 2 and d["counts"]["ok"] == 1 and d["counts"]["error"] == 1, d
        (f,) = d["findings"]
        assert f["path"] == d_bin and f["status"] == "error" and "a directory at a block path" in f["detail"]
        assert not f["removed"] and os.path.isdir(os.path.join(d_bin, "inner"))


@pytest.mark.parametrize("progress", [[], ["--no-progress"]])
def test_scrub_of_a_directory_without_a_cache_says_so_and_fails(tmp_path, capsys, progress):
    """An empty or mistyped (but existing) directory is not a clean cache: exit 2, a message
    naming the path on stderr, nothing on stdout. A tier's root with its config.json but no
    block yet is a cache: 0 blocks, exit 0."""
    empty = tmp_path / "empty"
    (empty / "unrelated").mkdir(parents=True)
    (empty / "notes.txt").write_text("x")
    assert main(["scrub", str(empty), *progress]) == 2
    out, err = capsys.readouterr()
    assert out == ""
    assert "no kvtier or vLLM cache found" in err and str(empty) in err
    assert "%" not in err  # no progress-bar fragment before the error
    assert main(["scrub", str(empty), "--strict", "--json", *progress]) == 2
    capsys.readouterr()

    root = tmp_path / "root"
    (root / "m_0123456789ab").mkdir(parents=True)
    (root / "m_0123456789ab" / "config.json").write_text("{}")
    assert main(["scrub", str(root), "--json", *progress]) == 0
    assert json.loads(capsys.readouterr().out)["blocks"] == 0


def test_scrub_counts_a_block_removed_during_the_scrub_as_gone(tmp_path, monkeypatch, capsys):
    """A live bounded root: a block evicted (or condemned by a load) between scrub's listing
    and its verify, a symlink at a block path removed likewise, and a shard directory removed
    between its listing and its walk (the evictor removes emptied ones) are not errors: the
    files are counted ``gone`` (listed, with why), the directory skipped, and the report is
    clean, exit 0. (Was: ``error`` with "open: No such file or directory" while the summary
    said clean, and an unreadable directory that made it unclean.) A file that cannot be
    read for another reason is still an error."""
    root = str(tmp_path)
    paths = [block_path(root, bytes([i]) * 16, 0) for i in range(1, 4)]
    store(paths, 8192, 11)
    link = os.path.join(os.path.dirname(paths[0]), "05" * 16 + ".bin")
    os.symlink(paths[0], link)
    shard = os.path.dirname(block_path(root, b"\x07" * 16, 0))
    store([block_path(root, b"\x07" * 16, 0)], 8192, 12)
    real_verify, real_walk = sc._verify, os.walk

    def verify(path, *a, **kw):  # evicted after the listing, before its verify
        if path in (paths[1], link):
            os.unlink(path)
        return real_verify(path, *a, **kw)

    def walk(top, *a, **kw):
        for t in real_walk(top, *a, **kw):
            yield t
            if os.path.isdir(shard) and os.path.dirname(shard) == t[0]:
                import shutil

                shutil.rmtree(shard)  # listed in its parent, removed before the walk reaches it

    monkeypatch.setattr(sc, "_verify", verify)
    monkeypatch.setattr(os, "walk", walk)
    rc, d = run(tmp_path)
    assert rc == 0 and d["clean"] is True, d
    assert d["counts"] == {"ok": 2, "corrupt": 0, "no_checksum": 0, "wrong_size": 0, "error": 0, "stray_temp": 0,
                           "gone": 2}
    by = {f["path"]: f for f in d["findings"]}
    assert sorted(by) == sorted([paths[1], link])
    assert by[paths[1]]["status"] == "gone" and by[paths[1]]["detail"].startswith(
        "gone while the scrub ran (ENOENT at open: evicted by a bounded root's evictor, condemned by a load")
    assert by[link]["status"] == "gone" and "ENOENT at lstat" in by[link]["detail"]
    monkeypatch.setattr(os, "walk", real_walk)
    store([block_path(root, b"\x07" * 16, 0)], 8192, 12)
    main(["scrub", root, "--no-progress"])
    text = capsys.readouterr().out
    assert "  ok 3  corrupt 0  no_checksum 0  wrong_size 0  error 0  stray_temp 0  gone 0  retried 0" in text
    monkeypatch.setattr(os, "open", lambda *a, **kw: (_ for _ in ()).throw(PermissionError(13, "Permission denied")))
    rc, d = run(tmp_path)
    assert rc == 0 and d["counts"]["error"] == 3 and d["counts"]["gone"] == 0  # EACCES: still an error


def test_scrub_words_a_damaged_identity_record_truly(tmp_path):
    """The note on a damaged ``user.kvtier.id`` says what it is: a 0-byte record is "0 bytes,
    not 12" (was "longer than any record"), a 12-byte one with a few identity bits flipped
    says so; a block whose only record is such a damaged identity record is ``no_checksum``
    saying there is no user.vllm.kv_crc32c and no usable identity record, and that a load
    takes it unverified (was "no xattr: unverified", and "judged by user.vllm.kv_crc32c",
    which it does not have), which is what a load does."""
    root = str(tmp_path)
    paths = [block_path(root, bytes([i]) * 16, 0) for i in range(1, 5)]
    data = store(paths, 8192, 13)
    os.setxattr(paths[0], "user.kvtier.id", b"")  # vLLM's record intact: ok, noted
    own = records.identity_record(paths[1], 8192, kvtier.crc32c(data[1]))
    os.setxattr(paths[1], "user.kvtier.id", bytes([own[0] ^ 0x01]) + own[1:])  # one identity bit
    for p, rec in ((paths[2], b""), (paths[3], b"\x01\x02\x03\x04\x05")):  # the only record: damaged
        os.removexattr(p, XATTR)
        os.setxattr(p, "user.kvtier.id", rec)
    rc, d = run(tmp_path)
    by = {f["path"]: f for f in d["findings"]}
    assert rc == 0 and [by[p]["status"] for p in paths] == ["ok", "ok", "no_checksum", "no_checksum"]
    assert by[paths[0]]["detail"].startswith("identity record user.kvtier.id is damaged (0 bytes, not 12): no proof")
    assert by[paths[0]]["detail"].endswith("judged by user.vllm.kv_crc32c, as a load judges it")
    assert by[paths[1]]["detail"].startswith(
        "identity record user.kvtier.id is damaged (12 bytes, its identity within 4 bits of this block's)")
    for p, n in ((paths[2], 0), (paths[3], 5)):
        det = by[p]["detail"]
        assert det == ("no user.vllm.kv_crc32c and no usable identity record: unverified; identity record "
                       f"user.kvtier.id is damaged ({n} bytes, not 12): no proof against the bytes (a well-formed "
                       "record of another block would differ in about 32 bits of its identity); with no "
                       "user.vllm.kv_crc32c either, nothing verifies the bytes: a load takes it unverified "
                       "(a miss with checksum_blocks='strict')"), det
    assert all("longer than any record" not in f["detail"] for f in d["findings"])
    for p, i in ((paths[2], 2), (paths[3], 3)):  # what the note says a load does
        out, counts = np.zeros(8192, np.uint8), {}
        kio.batch_load_block([p], out, [0], 8192, use_o_direct=False, checksum=True, counts=counts)
        assert out.tobytes() == data[i] and counts == {"unverified": 1}
        with pytest.raises(OSError) as ei:
            kio.batch_load_block([p], out, [0], 8192, use_o_direct=False, checksum="strict")
        assert ei.value.errno == __import__("errno").ENODATA
