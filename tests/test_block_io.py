"""Block I/O (kvtier.io over kvtier._C and kvtier.fallback): protocol, on-disk
bytes, error table of design.md, O_DIRECT fallbacks, argument checks, GIL.

Every test taking ``io_backend`` runs once against the C core and once against
the pure-Python fallback and calls that implementation (conftest.py).
"""
from __future__ import annotations

import errno
import glob
import mmap
import os
import pathlib
import shutil
import subprocess
import sys
import textwrap
import threading
import time

import numpy as np
import pytest

import kvtier
from kvtier import io as kio
from kvtier._blockio import records
from corrupt import flip_bit
from mounts import mount_tmpfs

XATTR = "user.vllm.kv_crc32c"
ID_XATTR = "user.kvtier.id"
ROOT = pathlib.Path(__file__).resolve().parent.parent


# ---------------------------------------------------------------- helpers


def rand_blocks(n, block_size, seed=0):
    """A view of n blocks of random bytes (numpy uint8, contiguous)."""
    return np.random.default_rng(seed).integers(0, 256, n * block_size, dtype=np.uint8)


def offsets_of(n, block_size):
    return [i * block_size for i in range(n)]


def block_paths(d, n, name="blk"):
    # nested, not yet existing parents: the store creates them
    return [os.path.join(str(d), "m_0123456789ab_r0", f"{i:03x}", f"{i:02x}_g0", f"{name}{i}.bin") for i in range(n)]


def expected_record(data) -> bytes:
    return kvtier.crc32c(data).to_bytes(4, "big")


def temps_under(d):
    return glob.glob(os.path.join(str(d), "**", "*.tmp"), recursive=True)



def aligned_buffer(nbytes):
    """Page-aligned writable buffer (anonymous mmap) of nbytes."""
    m = mmap.mmap(-1, nbytes)
    return m


def store_one(io_backend, path, data: bytes, checksum=True, use_o_direct=True):
    buf = np.frombuffer(bytearray(data), dtype=np.uint8)
    io_backend.batch_store_block([path], buf, [0], len(data), use_o_direct=use_o_direct, checksum=checksum)


def preload(shim: str) -> str:
    """LD_PRELOAD for a child with our shim: after what is already preloaded (under
    scripts/sanitize the ASan/UBSan runtimes, which must come first)."""
    have = os.environ.get("LD_PRELOAD", "")
    return f"{have}:{shim}" if have else shim


def load_expect_error(io_backend, paths, block_size, checksum=True, use_o_direct=True):
    out = np.zeros(len(paths) * block_size, dtype=np.uint8)
    with pytest.raises(OSError) as ei:
        io_backend.batch_load_block(paths, out, offsets_of(len(paths), block_size), block_size,
                                    use_o_direct=use_o_direct, checksum=checksum)
    return ei.value, out


# ---------------------------------------------------------------- round trip


@pytest.mark.parametrize("checksum", [False, True])
def test_round_trip_blocks_of_several_chunks_buffered(io_backend, tmp_path, checksum):
    """Buffered blocks larger than the engine's 256 KiB chunk, not a multiple of it: written
    in one call without checksum, chunk by chunk with the CRC of each chunk before its
    write with it; the bytes and the records are the block's either way."""
    bs = 4 * 256 * 1024 + 4097
    view = rand_blocks(2, bs, seed=53)
    paths = block_paths(tmp_path, 2)
    io_backend.batch_store_block(paths, view, [bs, 0], bs, use_o_direct=False, checksum=checksum)
    for p, off in zip(paths, (bs, 0)):
        want = view[off: off + bs].tobytes()
        assert open(p, "rb").read() == want
        assert (XATTR in os.listxattr(p)) == checksum
        if checksum:
            assert os.getxattr(p, XATTR) == expected_record(want)
    out = np.zeros_like(view)
    assert io_backend.batch_load_block(paths, out, [0, bs], bs, use_o_direct=False, checksum=checksum) == 0
    assert np.array_equal(out[:bs], view[bs:]) and np.array_equal(out[bs:], view[:bs])


@pytest.mark.parametrize("checksum", [False, True])
@pytest.mark.parametrize("n", [0, 1, 2, 5])
def test_round_trip_batch_sizes(io_backend, tmp_path, n, checksum):
    bs = 64 * 1024 + 512  # not a power of two: the last chunk is partial
    view = rand_blocks(n, bs, seed=n)
    paths = block_paths(tmp_path, n)
    io_backend.batch_store_block(paths, view, offsets_of(n, bs), bs, checksum=checksum)
    for i, p in enumerate(paths):
        with open(p, "rb") as f:
            assert f.read() == view[i * bs:(i + 1) * bs].tobytes()
        if checksum:
            assert os.getxattr(p, XATTR) == expected_record(view[i * bs:(i + 1) * bs])
        else:
            assert XATTR not in os.listxattr(p)
    assert temps_under(tmp_path) == []
    out = np.zeros_like(view)
    before = io_backend.checksum_stats()
    assert io_backend.batch_load_block(paths, out, offsets_of(n, bs), bs, checksum=checksum) == 0  # none re-read
    assert np.array_equal(out, view)
    assert io_backend.checksum_stats() == before
    assert io_backend.batch_lookup(paths) == [True] * n


def test_record_is_big_endian_crc32c(io_backend, tmp_path):
    # RFC 3720 B.4 check value: CRC32C("123456789") = 0xE3069283
    p = str(tmp_path / "check.bin")
    store_one(io_backend, p, b"123456789")
    assert os.getxattr(p, XATTR) == bytes.fromhex("e3069283")
    out = bytearray(9)
    io_backend.batch_load_block([p], out, [0], 9, checksum=True)
    assert out == b"123456789"


def test_blocks_at_arbitrary_offsets(io_backend, tmp_path):
    bs = 4096
    view = rand_blocks(4, bs, seed=7)
    offs = [3 * bs, 0, 2 * bs + 17, 5]  # unordered, overlapping, unaligned
    paths = block_paths(tmp_path, 4)
    io_backend.batch_store_block(paths, view, offs, bs, checksum=True)
    for p, o in zip(paths, offs):
        assert pathlib.Path(p).read_bytes() == view[o:o + bs].tobytes()
    out = np.zeros(6 * bs, dtype=np.uint8)
    io_backend.batch_load_block(paths, out, [0, bs, 2 * bs, 3 * bs], bs, checksum=True)
    for i, o in enumerate(offs):
        assert np.array_equal(out[i * bs:(i + 1) * bs], view[o:o + bs])
    assert not out[4 * bs:].any()


def test_store_skips_existing_destination(io_backend, tmp_path):
    """An existing block of the size is not rewritten; with checksums, only one with a CRC
    record (one without is replaced by the verified copy: design.md P17)."""
    p = str(tmp_path / "a.bin")
    pathlib.Path(p).write_bytes(b"old!" * 256)
    store_one(io_backend, p, b"new!" * 256, checksum=False)
    assert pathlib.Path(p).read_bytes() == b"old!" * 256
    assert XATTR not in os.listxattr(p)
    store_one(io_backend, p, b"new!" * 256)
    assert pathlib.Path(p).read_bytes() == b"new!" * 256 and XATTR in os.listxattr(p)
    store_one(io_backend, p, b"old!" * 256)
    assert pathlib.Path(p).read_bytes() == b"new!" * 256
    assert temps_under(tmp_path) == []


def test_pathlike_and_bytes_paths(io_backend, tmp_path):
    bs = 1000
    view = rand_blocks(2, bs, seed=3)
    paths = [tmp_path / "p" / "a.bin", os.fsencode(str(tmp_path / "p" / "b.bin"))]
    io_backend.batch_store_block(paths, view, [0, bs], bs, checksum=True)
    out = np.zeros_like(view)
    io_backend.batch_load_block(paths, out, [0, bs], bs, checksum=True)
    assert np.array_equal(out, view)
    assert io_backend.batch_lookup(paths + [tmp_path / "nope"]) == [True, True, False]


def test_lookup(io_backend, tmp_path):
    """A hit is a regular file (of the block size when given): a symlink (which
    a load refuses with ELOOP), a directory or a FIFO at a block path is a miss."""
    (tmp_path / "f").write_bytes(b"x")
    os.symlink(tmp_path / "f", tmp_path / "link")
    os.symlink(tmp_path / "missing", tmp_path / "dangling")
    (tmp_path / "dir").mkdir()
    os.mkfifo(tmp_path / "fifo")
    paths = [str(tmp_path / n) for n in ("f", "link", "dangling", "none", "dir", "fifo")]
    want = [True, False, False, False, False, False]
    assert io_backend.batch_lookup(paths) == want
    assert io_backend.impl.batch_lookup(paths) == want
    assert io_backend.batch_lookup(paths, 1) == want
    assert io_backend.batch_lookup(paths, 2) == [False] * 6
    assert io_backend.batch_lookup([]) == []
    with pytest.raises(ValueError):
        io_backend.impl.batch_lookup(paths, -1)
    with pytest.raises(TypeError):
        io_backend.impl.batch_lookup(paths, 1.0)


# ---------------------------------------------------------------- cross compatibility


def test_cross_backend_compatible(tmp_path):
    try:
        c, py = kio.for_backend("c"), kio.for_backend("python")
    except ImportError as e:
        pytest.skip(str(e))
    bs = 300 * 1024
    view = rand_blocks(3, bs, seed=11)
    offs = offsets_of(3, bs)
    pc, pp = block_paths(tmp_path / "c", 3), block_paths(tmp_path / "py", 3)
    c.batch_store_block(pc, view, offs, bs, checksum=True)
    py.batch_store_block(pp, view, offs, bs, checksum=True)
    for a, b in zip(pc, pp):
        assert os.getxattr(a, XATTR) == os.getxattr(b, XATTR)  # identical record bytes
        assert pathlib.Path(a).read_bytes() == pathlib.Path(b).read_bytes()
    out = np.zeros_like(view)
    py.batch_load_block(pc, out, offs, bs, checksum=True)  # C wrote, Python reads
    assert np.array_equal(out, view)
    out[:] = 0
    c.batch_load_block(pp, out, offs, bs, checksum=True)  # Python wrote, C reads
    assert np.array_equal(out, view)
    flip_bit(pp[1], 5)  # and both reject the same corruption
    err, _ = load_expect_error(c, pp, bs)
    assert (err.errno, err.checksum_failed, err.num_succeeded) == (errno.EBADMSG, True, 1)


# ---------------------------------------------------------------- xattr before rename


def build_preload(tmp_path_factory, name: str) -> str:
    """tests/c/<name>.c built as an LD_PRELOAD shim (-Wall -Werror); skips
    without a C compiler. Returns the .so path."""
    cc = shutil.which("cc") or shutil.which("gcc")
    if cc is None:
        pytest.skip(f"no C compiler for the LD_PRELOAD shim tests/c/{name}.c")
    out = tmp_path_factory.mktemp(name) / f"{name}.so"
    subprocess.run([cc, "-shared", "-fPIC", "-O1", "-Wall", "-Werror", "-o", str(out),
                    str(ROOT / "tests/c" / f"{name}.c"), "-ldl"], check=True)
    return str(out)


@pytest.fixture(scope="module")
def rename_spy(tmp_path_factory):
    """tests/c/rename_spy.c built as an LD_PRELOAD shim (see its header)."""
    return build_preload(tmp_path_factory, "rename_spy")


@pytest.mark.parametrize("checksum", [True, False])
def test_xattr_set_before_rename(io_backend, tmp_path, rename_spy, checksum):
    """An LD_PRELOAD shim intercepts rename(2) of the temp (C core and Python
    both go through libc) and reads the temp's xattr at that instant."""
    log = tmp_path / "spy.log"
    d = tmp_path / "store"
    script = textwrap.dedent(f"""
        import numpy as np
        from kvtier import io
        assert io.backend == {io_backend.backend!r}, io.backend
        v = np.frombuffer(bytes(range(256)) * 4096, dtype=np.uint8)  # 1 MiB
        paths = [{str(d)!r} + f"/x/{{i}}.bin" for i in range(2)]
        io.batch_store_block(paths, v, [0, 512 * 1024], 512 * 1024, checksum={checksum})
    """)
    env = dict(os.environ, LD_PRELOAD=preload(rename_spy), KVT_RENAME_SPY_LOG=str(log), KVTIER_IO_BACKEND=io_backend.backend)
    subprocess.run([sys.executable, "-c", script], check=True, env=env, cwd=str(ROOT))
    lines = [ln.split("\t") for ln in log.read_text().splitlines()]
    assert len(lines) == 2
    block = (bytes(range(256)) * 4096)[: 512 * 1024]
    for i, (old, new, rec, dest_existed) in enumerate(lines):
        assert new == f"{d}/x/{i}.bin"
        assert old.startswith(new + "_") and old.endswith(".tmp")
        assert len(old) == len(new) + 1 + 16 + 4  # <dest>_<16 hex>.tmp
        assert dest_existed == "0"
        if checksum:
            assert rec == expected_record(block).hex()  # the record was on the temp before the rename
        else:
            assert rec == f"-{errno.ENODATA}"


def test_store_temp_tags_differ_per_call_and_per_process():
    """The temp tag of a store call (kvtier.io._store_tag): 16 hex digits, a
    new one every call, and a forked child draws its own base (not the
    parent's next tags)."""
    from kvtier import io
    tags = [io._store_tag() for _ in range(1000)]
    assert len(set(tags)) == 1000 and all(len(t) == 16 and int(t, 16) >= 0 for t in tags)
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:  # pragma: no cover - the child
        os.write(w, " ".join(io._store_tag() for _ in range(3)).encode())
        os._exit(0)
    os.close(w)
    child = os.read(r, 100).decode().split()
    os.close(r)
    os.waitpid(pid, 0)
    ours = [io._store_tag() for _ in range(3)]
    assert len(child) == 3 and not set(child) & set(ours + tags)
    # the child's tags do not continue the parent's sequence
    assert abs(int(child[0], 16) - int(ours[0], 16)) > 10_000


# ---------------------------------------------------------------- checksum failures


@pytest.mark.parametrize("where", ["start", "middle", "end"])
def test_corruption_detected_and_removed(io_backend, tmp_path, where):
    bs = 1024 * 1024 + 4096
    n = 4
    view = rand_blocks(n, bs, seed=5)
    paths = block_paths(tmp_path, n)
    io_backend.batch_store_block(paths, view, offsets_of(n, bs), bs, checksum=True)
    pos = {"start": 0, "middle": bs // 2 + 3, "end": bs - 1}[where]
    flip_bit(paths[2], pos)
    before = io_backend.checksum_stats()
    err, out = load_expect_error(io_backend, paths, bs)
    after = io_backend.checksum_stats()
    # persistent: the first mismatch is re-read once, the second condemns
    assert after["checksum_retries"] - before["checksum_retries"] == 1
    assert after["checksum_condemned"] - before["checksum_condemned"] == 1
    assert err.errno == errno.EBADMSG
    assert err.checksum_failed is True
    assert err.num_succeeded == 2
    assert err.num_retried == 1  # this call's own count (per tier), not the process-wide one
    assert os.fsdecode(err.filename) == paths[2]
    assert not os.path.exists(paths[2])  # removed
    assert all(os.path.exists(p) for p in paths[:2] + paths[3:])  # the rest kept
    assert np.array_equal(out[: 2 * bs], view[: 2 * bs])  # blocks before it loaded
    assert not out[3 * bs:].any()  # the batch stopped: block 3 not read
    # without checksums the same-size corruption is invisible (the reason for this feature)
    paths2 = block_paths(tmp_path / "nock", 1)
    io_backend.batch_store_block(paths2, view, [0], bs, checksum=False)
    flip_bit(paths2[0], pos)
    out2 = np.zeros(bs, dtype=np.uint8)
    io_backend.batch_load_block(paths2, out2, [0], bs, checksum=False)
    assert not np.array_equal(out2, view[:bs])


@pytest.mark.parametrize("bs", [8192, 3 * 1024 * 1024 + 4096])
@pytest.mark.parametrize("use_o_direct", [True, False], ids=["direct", "buffered"])
@pytest.mark.parametrize("with_job", [False, True], ids=["plain", "job_state"])
def test_what_a_failed_verified_load_leaves_in_its_row(io_backend, tmp_path, with_job, use_o_direct, bs):
    """What a miss leaves in its row, the same bytes from both backends in every mode (with
    and without a job state, O_DIRECT and buffered, a row 16 bytes past a page and one
    aligned): a block condemned on its data (CRC mismatch on two reads) leaves the bytes
    its re-read got, the file's (the C core's copy + CRC writes the row before the CRC is
    known; the fallback under a job state copies its private buffer in too, in a commit
    section); a block refused on its records (identity of another block, a malformed CRC
    record) is refused before its data is read: the row is untouched. The blocks before
    it are loaded, the neighbours of the rows untouched. (The fallback under a job state
    left the row untouched on a CRC mismatch: backends disagreed.)"""
    if use_o_direct and not kio.probe_o_direct(str(tmp_path)):
        pytest.skip(f"{tmp_path} does not accept O_DIRECT")
    cases = ["crc_data", "crc_vllm_record", "identity", "malformed_record"]
    view = rand_blocks(2, bs, seed=31)
    for case in cases:
        for skew in (0, 16):
            d = tmp_path / f"{case}{skew}"
            paths = block_paths(d, 2)
            io_backend.batch_store_block(paths, view, [0, bs], bs, checksum=True)
            p = paths[1]
            if case == "crc_data":  # the identity record's CRC no longer matches the data
                flip_bit(p, bs // 2 + 5)
            elif case == "crc_vllm_record":  # a block vLLM stored: its record wrong
                os.removexattr(p, ID_XATTR)
                os.setxattr(p, XATTR, bytes(4))
            elif case == "identity":  # another block's identity (its CRC right)
                os.setxattr(p, ID_XATTR, b"\x01" * 8 + os.getxattr(p, ID_XATTR)[8:])
            else:
                os.removexattr(p, ID_XATTR)
                os.setxattr(p, XATTR, b"\x01\x02\x03")
            on_disk = np.fromfile(p, np.uint8)
            raw = aligned_buffer(2 * bs + 2 * 4096)
            buf = np.frombuffer(raw, np.uint8)
            buf[:] = 0xA5
            offs = [4096 + skew, 4096 + skew + bs]
            job = kio.JobState() if with_job else None
            with pytest.raises(OSError) as ei:
                io_backend.batch_load_block(paths, buf, offs, bs, use_o_direct=use_o_direct, checksum=True,
                                            job_state=job)
            e = ei.value
            assert (e.errno, e.num_succeeded, e.checksum_failed) == (errno.EBADMSG, 1, True), case
            assert e.condemned == ("identity" if case == "identity" else "checksum")
            assert not os.path.exists(p)
            assert np.array_equal(buf[offs[0]:offs[0] + bs], view[:bs])  # the block before it: loaded
            row = buf[offs[1]:offs[1] + bs]
            if case.startswith("crc"):
                assert np.array_equal(row, on_disk), (case, skew)  # the file's bytes, as re-read
                assert np.array_equal(row, view[bs:]) == (case == "crc_vllm_record")  # (the record was wrong)
            else:
                assert (row == 0xA5).all(), (case, skew)  # refused on its records: untouched
            assert (buf[:offs[0]] == 0xA5).all() and (buf[offs[1] + bs:] == 0xA5).all()
            if with_job:
                assert job.blocks_done == 1  # the condemned block is not counted


@pytest.mark.parametrize("record", [b"", b"\x01\x02\x03", b"\x00" * 5, b"\x11" * 8, b"\x22" * 40, "swapped", "wrong"])
def test_malformed_or_wrong_record_is_mismatch(io_backend, tmp_path, record):
    """A block with only vLLM's record (no identity record: stored by vLLM with
    checksums): any record but its 4-byte big-endian CRC32C is a checksum failure."""
    bs = 8192
    view = rand_blocks(1, bs, seed=9)
    p = block_paths(tmp_path, 1)
    io_backend.batch_store_block(p, view, [0], bs, checksum=True)
    os.removexattr(p[0], ID_XATTR)
    good = os.getxattr(p[0], XATTR)
    if record == "swapped":
        record = good[::-1]  # little-endian presentation of the right value
        assert record != good
    elif record == "wrong":
        record = ((int.from_bytes(good, "big") + 1) & 0xFFFFFFFF).to_bytes(4, "big")
    os.setxattr(p[0], XATTR, record)
    err, _ = load_expect_error(io_backend, p, bs)
    assert (err.errno, err.checksum_failed, err.num_succeeded, err.condemned) == (errno.EBADMSG, True, 0, "checksum")
    assert not os.path.exists(p[0])


@pytest.mark.parametrize("crc_part", [b"", b"\x01\x02\x03", b"\x00" * 5, b"\x22" * 40, "swapped", "wrong"])
def test_malformed_or_wrong_identity_record_is_judged_by_the_crc_record(io_backend, tmp_path, crc_part):
    """The identity record a store sets is the identity (8 bytes) then the CRC32C (4): a
    load checks that CRC. This identity followed by a wrong CRC, by nothing (8 bytes) or by
    a part of another length: the identity record is damaged, which is no proof against the
    bytes (issue #24, design.md P10/P11): user.vllm.kv_crc32c verifies them and the block
    loads (strict mode too); without that record a wrong CRC is a checksum failure
    (removed) and a record of another length counts as none (loaded unverified, a miss in
    strict mode)."""
    bs = 8192
    view = rand_blocks(1, bs, seed=19)
    p = block_paths(tmp_path, 1)
    io_backend.batch_store_block(p, view, [0], bs, checksum=True)
    rec = os.getxattr(p[0], ID_XATTR)
    ident, good = rec[:8], rec[8:]
    assert (ident, good) == (records.block_identity(p[0], bs), expected_record(view))
    if crc_part == "swapped":
        crc_part = good[::-1]
    elif crc_part == "wrong":
        crc_part = ((int.from_bytes(good, "big") + 1) & 0xFFFFFFFF).to_bytes(4, "big")
    os.setxattr(p[0], ID_XATTR, ident + crc_part)
    for mode in (True, "strict"):
        out = np.zeros(bs, dtype=np.uint8)
        counts = {}
        assert io_backend.batch_load_block(p, out, [0], bs, checksum=mode, counts=counts) == 0
        assert np.array_equal(out, view) and counts == {}, counts
    os.removexattr(p[0], XATTR)
    if len(crc_part) != 4:
        out = np.zeros(bs, dtype=np.uint8)
        counts = {}
        io_backend.batch_load_block(p, out, [0], bs, checksum=True, counts=counts)
        assert np.array_equal(out, view) and counts == {"unverified": 1}, counts
        with pytest.raises(OSError) as ei:
            io_backend.batch_load_block(p, out, [0], bs, checksum="strict")
        assert (ei.value.errno, ei.value.condemned) == (errno.ENODATA, None)
        assert os.path.exists(p[0])
        return
    err, _ = load_expect_error(io_backend, p, bs)
    assert (err.errno, err.checksum_failed, err.num_succeeded, err.condemned) == (errno.EBADMSG, True, 0, "checksum")
    assert not os.path.exists(p[0])


def test_identity_binds_the_lexically_normalised_path(io_backend, tmp_path, monkeypatch):
    """The identity record binds the last four components of the path normalised
    lexically (a relative path against the working directory): a block stored under one
    spelling loads under every other spelling of the same path, verified, kept, nothing
    re-read or condemned; stored under a messy spelling, it loads under the clean one."""
    bs = 8192
    d = tmp_path / "m_0123_r0" / "abc" / "de_g0"
    d.mkdir(parents=True)
    clean = str(d / "x.bin")
    t = str(tmp_path)
    spellings = [
        (t, "m_0123_r0/abc/de_g0/x.bin"), (t, "./m_0123_r0/abc/de_g0/x.bin"),
        (t, "m_0123_r0//abc/./de_g0/x.bin"), (t, "m_0123_r0/abc/../abc/de_g0//x.bin"),
        (str(d), "x.bin"), (str(d), "./x.bin"), (str(d), "../de_g0/x.bin"),
        (str(d / ".." / ".."), "../m_0123_r0/./abc/de_g0/x.bin"),
        (t, t + "//m_0123_r0/abc/./de_g0/x.bin"), (t, t + "/m_0123_r0/abc/de_g0/../de_g0/x.bin"),
    ]
    for i, (cwd, spelling) in enumerate(spellings):
        view = rand_blocks(1, bs, seed=40 + i)
        monkeypatch.chdir(cwd)
        stored, loaded = (clean, spelling) if i % 2 == 0 else (spelling, clean)
        io_backend.batch_store_block([stored], view, [0], bs, checksum=True)
        assert os.getxattr(clean, ID_XATTR)[:8] == records.block_identity(clean, bs)
        out = np.zeros(bs, dtype=np.uint8)
        counts = {}
        assert io_backend.batch_load_block([loaded], out, [0], bs, checksum="strict", counts=counts) == 0, spelling
        assert np.array_equal(out, view) and counts == {} and os.path.exists(clean), spelling
        os.unlink(clean)


def test_identity_refuses_another_block_name_under_any_spelling(io_backend, tmp_path, monkeypatch):
    """A block renamed to another key (its identity record moves with it) is still an
    identity mismatch when loaded through a relative, "./" spelling: EBADMSG, condemned."""
    bs = 8192
    view = rand_blocks(1, bs, seed=51)
    monkeypatch.chdir(tmp_path)
    io_backend.batch_store_block(["./x.bin"], view, [0], bs, checksum=True)
    os.rename("x.bin", "y.bin")
    err, _ = load_expect_error(io_backend, ["./y.bin"], bs)
    assert (err.errno, err.checksum_failed, err.num_succeeded, err.condemned) == (errno.EBADMSG, True, 0, "identity")
    assert not os.path.exists(tmp_path / "y.bin")


def test_c_identity_equals_python_identity_on_messy_spellings(tmp_path, monkeypatch):
    """The identity the C core's store sets equals records.block_identity for messy
    spellings of one file and that of its clean absolute path (the fallback stores
    records.block_identity itself)."""
    c = kio.for_backend("c")
    bs = 4096
    d = tmp_path / "p" / "q" / "r" / "s"
    d.mkdir(parents=True)
    clean = str(d / "z.bin")
    monkeypatch.chdir(d)
    view = rand_blocks(1, bs, seed=52)
    for sp in ["z.bin", "./z.bin", ".//z.bin", "../s/z.bin", "../../r/s/z.bin", "../../../../p/q/r/s/z.bin",
               str(tmp_path) + "//p/q/r/s/./z.bin", str(tmp_path) + "/p/q/r/s/../s/z.bin",
               str(tmp_path) + "/p/../p/q/r/s/z.bin"]:
        c.batch_store_block([sp], view, [0], bs, checksum=True)
        assert os.getxattr(clean, ID_XATTR)[:8] == records.block_identity(sp, bs) == records.block_identity(clean, bs), sp
        os.unlink(clean)


def test_load_checks_the_crc_of_the_identity_record(io_backend, tmp_path):
    """A block kvtier stored is verified by the CRC its identity record carries: one
    xattr per load. user.vllm.kv_crc32c (vLLM's reader's) is read only when the bytes do
    not match that CRC (P10): a block whose vLLM record was removed or is wrong still loads
    verified, in strict mode too; a flipped byte fails either way (it matches neither)."""
    bs = 3 * 4096
    view = rand_blocks(4, bs, seed=29)
    p = block_paths(tmp_path, 4)
    io_backend.batch_store_block(p, view, offsets_of(4, bs), bs, checksum=True)
    os.removexattr(p[0], XATTR)
    os.setxattr(p[1], XATTR, b"\0\0\0\0")
    with open(p[3], "r+b") as f:
        f.seek(7)
        f.write(bytes([view[3 * bs + 7] ^ 0x40]))
    out = np.zeros_like(view)
    counts = {}
    assert io_backend.batch_load_block(p[:3], out, offsets_of(3, bs), bs, checksum="strict", counts=counts) == 0
    assert np.array_equal(out[: 3 * bs], view[: 3 * bs]) and counts == {}
    err, _ = load_expect_error(io_backend, p[3:], bs)
    assert (err.errno, err.condemned) == (errno.EBADMSG, "checksum") and not os.path.exists(p[3])


@pytest.mark.parametrize("left", ["both", "id_only", "vllm_only", "neither"])
def test_what_a_load_verifies_by_the_records_a_block_has(io_backend, tmp_path, left):
    """The README's account of the two CRC records, each set of them (a block kvtier stored
    has both): either record verifies the block, in strict mode too (``user.kvtier.id``
    alone: its xattr ``user.vllm.kv_crc32c`` removed, the identity record carries the same
    CRC); a flipped byte is then EBADMSG, condemned. Only with neither is nothing verified:
    checksum True loads it counted ``unverified`` (the flipped byte too), "strict" is
    ENODATA, a miss counted ``unverified_miss``, the file kept."""
    bs = 8192
    view = rand_blocks(1, bs, seed=61)
    p = block_paths(tmp_path, 1)
    io_backend.batch_store_block(p, view, [0], bs, checksum=True)
    drop = {"both": [], "id_only": [XATTR], "vllm_only": [ID_XATTR], "neither": [XATTR, ID_XATTR]}[left]
    for name in drop:
        os.removexattr(p[0], name)
    assert sorted(n for n in os.listxattr(p[0]) if n.startswith("user.")) == sorted({XATTR, ID_XATTR} - set(drop))
    verified = left != "neither"
    for mode in (True, "strict"):
        out = np.zeros(bs, dtype=np.uint8)
        counts = {}
        if verified or mode is True:
            assert io_backend.batch_load_block(p, out, [0], bs, checksum=mode, counts=counts) == 0
            assert np.array_equal(out, view) and counts == ({} if verified else {"unverified": 1}), (mode, counts)
        else:
            with pytest.raises(OSError) as ei:
                io_backend.batch_load_block(p, out, [0], bs, checksum=mode, counts=counts)
            e = ei.value
            assert (e.errno, e.num_succeeded, e.checksum_failed, e.condemned) == (errno.ENODATA, 0, False, None)
            assert counts == {"unverified_miss": 1}, counts
        assert os.path.exists(p[0])
    flip_bit(p[0], bs // 2)
    on_disk = np.fromfile(p[0], np.uint8)
    out = np.zeros(bs, dtype=np.uint8)
    counts = {}
    if verified:
        with pytest.raises(OSError) as ei:
            io_backend.batch_load_block(p, out, [0], bs, checksum=True, counts=counts)
        e = ei.value
        assert (e.errno, e.checksum_failed, e.condemned) == (errno.EBADMSG, True, "checksum")
        assert not os.path.exists(p[0])
    else:
        assert io_backend.batch_load_block(p, out, [0], bs, checksum=True, counts=counts) == 0
        assert np.array_equal(out, on_disk) and not np.array_equal(out, view) and counts == {"unverified": 1}
        assert os.path.exists(p[0])


def test_legacy_block_without_record_loads(io_backend, tmp_path):
    bs = 100 * 1024
    view = rand_blocks(2, bs, seed=2)
    paths = block_paths(tmp_path, 2)
    io_backend.batch_store_block(paths, view, [0, bs], bs, checksum=False)
    assert all(XATTR not in os.listxattr(p) for p in paths)
    out = np.zeros_like(view)
    io_backend.batch_load_block(paths, out, [0, bs], bs, checksum=True)
    assert np.array_equal(out, view)
    assert all(os.path.exists(p) for p in paths)


@pytest.mark.parametrize("checksum", [False, True])
@pytest.mark.parametrize("shape", ["truncated", "empty", "longer"])
def test_wrong_size_is_eio_and_removed(io_backend, tmp_path, shape, checksum):
    bs = 64 * 1024
    view = rand_blocks(2, bs, seed=4)
    paths = block_paths(tmp_path, 2)
    io_backend.batch_store_block(paths, view, [0, bs], bs, checksum=True)
    if shape == "longer":
        with open(paths[1], "ab") as f:
            f.write(b"\0")
    else:
        os.truncate(paths[1], {"truncated": bs - 1, "empty": 0}[shape])
    err, out = load_expect_error(io_backend, paths, bs, checksum=checksum)
    assert (err.errno, err.checksum_failed, err.num_succeeded) == (errno.EIO, False, 1)
    assert os.fsdecode(err.filename) == paths[1]
    assert not os.path.exists(paths[1])
    assert os.path.exists(paths[0])
    assert np.array_equal(out[:bs], view[:bs])


@pytest.mark.parametrize("asked", [2048, 16384, 300 * 1024])
def test_intact_block_loaded_with_another_block_size_is_eio_but_kept(io_backend, tmp_path, asked):
    """A caller asking for the wrong block size gets EIO, but a block whose own record
    verifies all its bytes is not destroyed for it (a layout mismatch, not corruption),
    with checksums on or off (issue #24, design.md P8)."""
    bs = 4096 if asked != 300 * 1024 else 257 * 1024  # also a block larger than one I/O chunk
    view = rand_blocks(1, bs, seed=8)
    path = block_paths(tmp_path, 1)[0]
    io_backend.batch_store_block([path], view, [0], bs, checksum=True)
    err, _ = load_expect_error(io_backend, [path], asked, checksum=True)
    assert (err.errno, err.checksum_failed, err.num_succeeded) == (errno.EIO, False, 0)
    # the reason, with both sizes and the path (was a bare "Input/output error")
    assert str(err) == (f"[Errno {errno.EIO}] block size mismatch (kept): the file has {bs} bytes, the block "
                        f"size asked for is {asked}; its own CRC record verifies all its bytes (a block of "
                        f"another block size): {path!r}")
    assert os.path.exists(path)
    out = np.zeros(bs, dtype=np.uint8)
    io_backend.batch_load_block([path], out, [0], bs, checksum=True)  # the right size still loads
    assert np.array_equal(out, view[:bs])
    # without checksums too: its records are asked all the same (issue #24: a checksum-off
    # tier of another block size removed the other geometry's intact blocks)
    err, _ = load_expect_error(io_backend, [path], asked, checksum=False)
    assert (err.errno, err.condemned) == (errno.EIO, None) and "its own CRC record verifies" in str(err)
    assert os.path.exists(path)
    # its records removed, nothing proves the bytes intact: EIO, removed (P7)
    for name in (XATTR, ID_XATTR):
        os.removexattr(path, name)
    err, _ = load_expect_error(io_backend, [path], asked, checksum=False)
    assert (err.errno, err.condemned) == (errno.EIO, "size")
    assert not os.path.exists(path)


def test_missing_file_enoent_kept_going_nowhere(io_backend, tmp_path):
    bs = 4096
    view = rand_blocks(3, bs, seed=1)
    paths = block_paths(tmp_path, 3)
    io_backend.batch_store_block([paths[0], paths[2]], view, [0, 2 * bs], bs, checksum=True)
    err, out = load_expect_error(io_backend, paths, bs)
    assert isinstance(err, FileNotFoundError)
    assert (err.errno, err.checksum_failed, err.num_succeeded) == (errno.ENOENT, False, 1)
    assert os.fsdecode(err.filename) == paths[1]
    assert os.path.exists(paths[0]) and os.path.exists(paths[2])
    assert np.array_equal(out[:bs], view[:bs]) and not out[bs:].any()


@pytest.mark.parametrize("case", ["good", "missing", "symlink", "directory", "dir_itself", "dotdot", "linked_dir"])
def test_batch_of_many_blocks_in_one_directory(io_backend, tmp_path, case):
    """A batch of >= 16 blocks: the C core opens the directory they share once and each
    block relative to it (csrc/block/block.c batch_dir). Same bytes and the same errors as whole
    paths: a missing block ENOENT, a symlink at a block path ELOOP, a directory EISDIR,
    a path naming the shared directory itself, '..' inside the rest, a symlinked
    shared directory (followed, as a whole path's open follows it)."""
    bs, n, bad = 4096, 40, 23
    view = rand_blocks(n, bs, seed=5)
    real = tmp_path / "real"  # above the four components the identity record binds
    paths = [str(real / "m_0123456789ab_r0" / f"{i % 4:03x}" / "00_g0" / f"blk{i}.bin") for i in range(n)]
    io_backend.batch_store_block(paths, view, offsets_of(n, bs), bs, checksum=True)
    want = None  # (errno, num_succeeded) or None: loads
    if case == "missing":
        os.unlink(paths[bad])
        want = (errno.ENOENT, bad)
    elif case == "symlink":
        os.unlink(paths[bad])
        os.symlink(paths[0], paths[bad])
        want = (errno.ELOOP, bad)
    elif case == "directory":
        os.unlink(paths[bad])
        os.mkdir(paths[bad])
        want = (errno.EISDIR, bad)
    elif case == "dir_itself":
        paths[bad] = str(real / "m_0123456789ab_r0" / f"{bad % 4:03x}")
        want = (errno.EISDIR, bad)
        # with a trailing '/' (the name of the directory opened for the batch, then an empty one)
        # it is refused before any I/O, as every block path ending in a separator
        with pytest.raises(ValueError, match=r"^paths\[23\]: a block path may not end in '/'"):
            io_backend.batch_load_block(paths[:bad] + [paths[bad] + "/"] + paths[bad + 1:], np.zeros(n * bs, np.uint8),
                                        offsets_of(n, bs), bs)
    elif case == "dotdot":
        os.mkdir(real / "x")
        paths = [p.replace(str(real), str(real / "x" / "..")) for p in paths]
    elif case == "linked_dir":
        os.symlink(real, tmp_path / "link")
        paths = [p.replace(str(real), str(tmp_path / "link")) for p in paths]
    out = np.zeros(n * bs, dtype=np.uint8)
    for checksum in (True, False):
        out[:] = 0
        if want is None:
            io_backend.batch_load_block(paths, out, offsets_of(n, bs), bs, checksum=checksum)
            assert np.array_equal(out, view)
            continue
        with pytest.raises(OSError) as ei:
            io_backend.batch_load_block(paths, out, offsets_of(n, bs), bs, checksum=checksum)
        err = ei.value
        assert (err.errno, err.num_succeeded, err.checksum_failed) == (*want, False)
        assert os.fsdecode(err.filename) == paths[bad]
        assert np.array_equal(out[:bad * bs], view[:bad * bs]) and not out[(bad + 1) * bs:].any()
    if want is not None and case != "missing":
        assert os.path.lexists(paths[bad])  # kept


def test_symlink_loop_eloop_kept(io_backend, tmp_path):
    a, b = str(tmp_path / "a.bin"), str(tmp_path / "b.bin")
    os.symlink(b, a)
    os.symlink(a, b)
    err, _ = load_expect_error(io_backend, [a], 4096)
    assert (err.errno, err.checksum_failed, err.num_succeeded) == (errno.ELOOP, False, 0)
    assert os.path.islink(a) and os.path.islink(b)


@pytest.mark.mount
def test_getxattr_error_other_than_enodata_keeps_file(io_backend, ramfs_dir):
    # ramfs has no user xattrs: fgetxattr says EOPNOTSUPP, which is not the block's fault
    bs = 16 * 1024
    view = rand_blocks(2, bs, seed=6)
    paths = block_paths(ramfs_dir, 2)
    io_backend.batch_store_block(paths, view, [0, bs], bs, checksum=False)
    err, _ = load_expect_error(io_backend, paths, bs, checksum=True)
    assert (err.errno, err.checksum_failed, err.num_succeeded) == (errno.EOPNOTSUPP, False, 0)
    assert all(os.path.exists(p) for p in paths)
    out = np.zeros_like(view)
    io_backend.batch_load_block(paths, out, [0, bs], bs, checksum=False)
    assert np.array_equal(out, view)


@pytest.mark.mount
def test_store_setxattr_failure_leaves_nothing(io_backend, ramfs_dir):
    bs = 16 * 1024
    view = rand_blocks(1, bs)
    paths = block_paths(ramfs_dir, 1)
    with pytest.raises(OSError) as ei:
        io_backend.batch_store_block(paths, view, [0], bs, checksum=True)
    e = ei.value
    assert (e.errno, e.checksum_failed, e.num_succeeded) == (errno.EOPNOTSUPP, False, 0)
    assert os.fsdecode(e.filename) == paths[0]
    assert not os.path.exists(paths[0])
    assert temps_under(ramfs_dir) == []


def test_store_failure_index_and_earlier_blocks_kept(io_backend, tmp_path):
    bs = 4096
    view = rand_blocks(3, bs)
    (tmp_path / "file").write_bytes(b"")
    paths = [str(tmp_path / "ok0.bin"), str(tmp_path / "file" / "sub" / "x.bin"), str(tmp_path / "ok2.bin")]
    with pytest.raises(NotADirectoryError) as ei:
        io_backend.batch_store_block(paths, view, offsets_of(3, bs), bs, checksum=True)
    e = ei.value
    assert (e.errno, e.num_succeeded, e.checksum_failed) == (errno.ENOTDIR, 1, False)
    assert os.fsdecode(e.filename) == paths[1]
    assert os.path.exists(paths[0]) and not os.path.exists(paths[2])
    assert temps_under(tmp_path) == []


# ---------------------------------------------------------------- O_DIRECT


@pytest.mark.mount
@pytest.mark.parametrize("fs", ["tmpfs", "ramfs"])
def test_o_direct_refusing_or_odd_fs_round_trips(io_backend, fs, request):
    d = request.getfixturevalue(f"{fs}_dir")
    bs = 256 * 1024
    buf = aligned_buffer(4 * bs)  # page-aligned: O_DIRECT is attempted
    buf[:] = rand_blocks(4, bs, seed=8).tobytes()
    paths = block_paths(d, 4)
    checksum = fs == "tmpfs"  # ramfs has no xattrs
    io_backend.batch_store_block(paths, buf, offsets_of(4, bs), bs, use_o_direct=True, checksum=checksum)
    out = aligned_buffer(4 * bs)
    io_backend.batch_load_block(paths, out, offsets_of(4, bs), bs, use_o_direct=True, checksum=checksum)
    assert out[:] == buf[:]
    assert kio.probe_o_direct(d) is (fs == "tmpfs")  # Linux >= 6.6 tmpfs accepts O_DIRECT; ramfs never


def _misaligned_round_trip(io_backend, d):
    for bs, skew in [(256 * 1024, 1), (256 * 1024, 512), (1000, 0), (4096 * 3 + 7, 4096)]:
        base = aligned_buffer(2 * bs + 8192)
        src = np.frombuffer(base, dtype=np.uint8)
        src[:] = np.random.default_rng(bs + skew).integers(0, 256, src.size, dtype=np.uint8)
        paths = block_paths(os.path.join(d, f"{bs}_{skew}"), 2)
        offs = [skew, skew + bs]
        io_backend.batch_store_block(paths, base, offs, bs, use_o_direct=True, checksum=True)
        out_base = aligned_buffer(2 * bs + 8192)
        io_backend.batch_load_block(paths, out_base, [skew + 3, skew + 3 + bs], bs, use_o_direct=True, checksum=True)
        out = np.frombuffer(out_base, dtype=np.uint8)
        assert np.array_equal(out[skew + 3:skew + 3 + 2 * bs], src[skew:skew + 2 * bs]), (bs, skew)
        del src, out
        base.close()
        out_base.close()


def test_misaligned_o_direct_round_trips_tmp(io_backend, tmp_path):
    _misaligned_round_trip(io_backend, str(tmp_path))  # /tmp: the host's disk (ext4 here)


@pytest.mark.mount
def test_misaligned_o_direct_round_trips_ext4(io_backend, ext4_dir):
    assert kio.probe_o_direct(ext4_dir)
    _misaligned_round_trip(io_backend, ext4_dir)


def _resident_pages(path):
    """Pages of `path` in the page cache (mincore(2) over a read-only mapping)."""
    import ctypes

    libc = ctypes.CDLL(None, use_errno=True)
    size = os.path.getsize(path)
    with open(path, "rb") as f:
        m = mmap.mmap(f.fileno(), size, prot=mmap.PROT_READ)
    # a read-only mmap cannot back a ctypes object: take its address through numpy
    addr = np.frombuffer(m, dtype=np.uint8).__array_interface__["data"][0]
    npages = (size + mmap.PAGESIZE - 1) // mmap.PAGESIZE
    vec = (ctypes.c_ubyte * npages)()
    rc = libc.mincore(ctypes.c_void_p(addr), ctypes.c_size_t(size), vec)
    assert rc == 0, os.strerror(ctypes.get_errno())
    return sum(v & 1 for v in vec)


@pytest.mark.mount
def test_o_direct_is_really_used_when_aligned(io_backend, ext4_dir):
    """O_DIRECT bypasses the page cache: an aligned store, checksummed or not, leaves
    none of the file's pages cached; a misaligned one (written straight from the
    caller's buffer: buffered), checksummed or not, leaves them all."""
    bs = 1024 * 1024
    buf = aligned_buffer(bs + 4096)
    buf[:] = os.urandom(bs + 4096)
    cached = {}
    for name, off, checksum in (("direct", 0, False), ("direct_crc", 0, True), ("odd", 1, False),
                                ("odd_crc", 1, True)):
        p = os.path.join(ext4_dir, f"{name}.bin")
        io_backend.batch_store_block([p], buf, [off], bs, use_o_direct=True, checksum=checksum)
        cached[name] = _resident_pages(p)  # before the read below caches them
        assert pathlib.Path(p).read_bytes() == bytes(buf[off:off + bs])
    pages = bs // mmap.PAGESIZE
    assert cached == {"direct": 0, "direct_crc": 0, "odd": pages, "odd_crc": pages}


# ---------------------------------------------------------------- ENOSPC, probes


@pytest.mark.mount
def test_enospc_leaves_no_temp_and_no_destination(io_backend):
    with mount_tmpfs(size="1m") as d:
        small, big = 64 * 1024, 2 * 1024 * 1024
        view = rand_blocks(1, big, seed=12)
        ok, full = os.path.join(d, "a", "ok.bin"), os.path.join(d, "a", "full.bin")
        io_backend.batch_store_block([ok], view, [0], small, checksum=True)
        with pytest.raises(OSError) as ei:
            io_backend.batch_store_block([full], view, [0], big, checksum=True)
        e = ei.value
        assert (e.errno, e.num_succeeded, e.checksum_failed) == (errno.ENOSPC, 0, False)
        assert os.fsdecode(e.filename) == full
        assert not os.path.exists(full)
        assert temps_under(d) == []
        assert sorted(os.listdir(os.path.join(d, "a"))) == ["ok.bin"]
        out = np.zeros(small, dtype=np.uint8)
        io_backend.batch_load_block([ok], out, [0], small, checksum=True)
        assert np.array_equal(out, view[:small])


@pytest.mark.mount
def test_probe_xattr(ramfs_dir, tmpfs_dir, ext4_dir, tmp_path):
    assert kio.probe_xattr(ramfs_dir) is False
    assert kio.probe_xattr(tmpfs_dir) is True
    assert kio.probe_xattr(ext4_dir) is True
    assert kio.probe_xattr(tmp_path) is True
    for d in (ramfs_dir, tmpfs_dir, ext4_dir, str(tmp_path)):
        assert not [n for n in os.listdir(d) if n.startswith(".kvtier_probe")]
    with pytest.raises(FileNotFoundError):
        kio.probe_xattr(tmp_path / "missing")
    with pytest.raises(FileNotFoundError):
        kio.probe_o_direct(tmp_path / "missing")


@pytest.mark.mount
def test_probe_o_direct(ramfs_dir, ext4_dir):
    assert kio.probe_o_direct(ramfs_dir) is False
    assert kio.probe_o_direct(ext4_dir) is True


# ---------------------------------------------------------------- bad arguments


def test_store_counts_blocks_already_there_as_existing(io_backend, tmp_path):
    """A block already on disk is skipped (not rewritten) and counted in counts["existing"]."""
    bs = 4096
    view = rand_blocks(3, bs)
    paths = block_paths(tmp_path, 3)
    first = {}
    io_backend.batch_store_block(paths[:2], view, offsets_of(2, bs), bs, counts=first)
    assert first.get("existing", 0) == 0
    mtimes = [os.stat(p).st_mtime_ns for p in paths[:2]]
    again = {}
    other = rand_blocks(3, bs, seed=1)
    io_backend.batch_store_block(paths, other, offsets_of(3, bs), bs, counts=again)
    assert again["existing"] == 2
    assert [os.stat(p).st_mtime_ns for p in paths[:2]] == mtimes
    assert open(paths[0], "rb").read() == view[:bs].tobytes()  # not rewritten
    assert open(paths[2], "rb").read() == other[2 * bs:].tobytes()


@pytest.mark.parametrize("name", ["use_o_direct", "durable"])
@pytest.mark.parametrize("value", ["no", 0, 1, None])
def test_flags_must_be_bool(io_backend, tmp_path, name, value):
    """durable="no" would be True through bool(): refused, naming the argument, nothing stored."""
    bs = 4096
    view = rand_blocks(1, bs)
    paths = block_paths(tmp_path, 1)
    got = {"no": "'no' (str)", 0: "0 (int)", 1: "1 (int)", None: "None"}[value]
    with pytest.raises(TypeError) as ei:
        io_backend.batch_store_block(paths, view, [0], bs, **{name: value})
    assert str(ei.value) == f"{name} must be a bool, got {got}"
    assert not os.path.exists(paths[0])
    if name == "use_o_direct":
        with pytest.raises(TypeError, match=r"^use_o_direct must be a bool"):
            io_backend.batch_load_block(paths, view, [0], bs, use_o_direct=value)
    io_backend.batch_store_block(paths, view, [0], bs, **{name: False})
    assert os.path.getsize(paths[0]) == bs


def test_bad_arguments_io_layer(io_backend, tmp_path):
    bs = 4096
    view = rand_blocks(2, bs)
    paths = block_paths(tmp_path, 2)
    store, load = io_backend.batch_store_block, io_backend.batch_load_block
    with pytest.raises(TypeError):
        store("not-a-list", view, [0], bs)
    with pytest.raises(TypeError):
        store([1, 2], view, [0, bs], bs)
    with pytest.raises(TypeError):
        store(paths, object(), [0, bs], bs)  # not a buffer
    with pytest.raises(TypeError):
        store(paths, view, [0, 1.5], bs)
    with pytest.raises(TypeError):
        store(paths, view, [0, bs], "4096")
    with pytest.raises(ValueError):
        store(paths, view, [0], bs)  # unequal lengths
    with pytest.raises(ValueError):
        store(paths, view, [0, bs + 1], bs)  # past the end
    with pytest.raises(ValueError):
        store(paths, view, [-1, 0], bs)
    with pytest.raises(ValueError):
        store(paths, view, [0, 0], 0)
    with pytest.raises(BufferError):
        load(paths, view.tobytes(), [0, bs], bs)  # read-only view for a load
    with pytest.raises(BufferError):
        load(paths, np.zeros((2, 2 * bs), dtype=np.uint8)[:, ::2], [0, bs], bs)  # not contiguous
    # messages name the argument
    for args, msg in (((paths, None, [0, bs], bs), r"^view must be a buffer .*not NoneType$"),
                      ((paths, view, [0, "4096"], bs), r"^offsets\[1\] must be int, not str$"),
                      ((paths, view, [0.0, bs], bs), r"^offsets\[0\] must be int, not float$"),
                      ((paths, view, [0, bs], 4096.0), r"^block_size must be int, not float$")):
        with pytest.raises(TypeError, match=msg):
            store(*args)
    # a NUL byte or an empty path: ValueError naming the caller's argument, both backends alike
    for bad, msg in ((str(tmp_path / "a\0b"), r"^paths\[1\]: embedded null byte$"),
                     (os.fsencode(tmp_path / "a\0b"), r"^paths\[1\]: embedded null byte$"),
                     ("", r"^paths\[1\]: empty path$")):
        for call in (lambda: store([paths[0], bad], view, [0, bs], bs, checksum=True),
                     lambda: load([paths[0], bad], np.zeros(2 * bs, np.uint8), [0, bs], bs),
                     lambda: io_backend.batch_lookup([paths[0], bad])):
            with pytest.raises(ValueError, match=msg):
                call()
    assert not os.listdir(tmp_path)  # nothing written by any of them
    io_backend.batch_store_block(paths, view.tobytes(), [0, bs], bs)  # read-only view is fine for a store
    multi = np.zeros((2, bs // 4), dtype=np.float32)  # any C-contiguous dtype/shape, counted in bytes
    io_backend.batch_load_block(paths, multi, [0, bs], bs)
    assert multi.tobytes() == view.tobytes()


# ---------------------------------------------------------------- torch CPU tensors


def test_torch_bf16_tensor_round_trip(io_backend, tmp_path):
    """A bf16 CPU tensor (rows = blocks) is stored from and loaded into as its
    bytes: same bytes back, record = CRC32C of the tensor block's bytes."""
    torch = pytest.importorskip("torch")
    n, elems = 4, 8192  # 16 KiB blocks of bf16
    bs = elems * 2
    src = torch.randn(n, elems, dtype=torch.bfloat16, generator=torch.Generator().manual_seed(3))
    src_bytes = src.view(torch.uint8).numpy().tobytes()
    paths = block_paths(tmp_path, n)
    io_backend.batch_store_block(paths, src, offsets_of(n, bs), bs, checksum=True)
    for i, p in enumerate(paths):
        assert os.getxattr(p, XATTR) == kvtier.crc32c(src[i]).to_bytes(4, "big")
        with open(p, "rb") as f:
            assert f.read() == src_bytes[i * bs:(i + 1) * bs]
    dst = torch.zeros(n, elems, dtype=torch.bfloat16)
    # load in reverse order through a 1-D view as well: offsets are in bytes of the tensor
    assert io_backend.batch_load_block(paths[::-1], dst, offsets_of(n, bs)[::-1], bs, checksum=True) == 0
    assert dst.view(torch.uint8).numpy().tobytes() == src_bytes
    assert torch.equal(dst, src)
    flat = torch.zeros(n * elems, dtype=torch.bfloat16)
    io_backend.batch_load_block(paths, flat, offsets_of(n, bs), bs, checksum=True)
    assert torch.equal(flat.view(n, elems), src)
    assert kvtier.crc32c(flat) == kvtier.crc32c(src_bytes)


def test_torch_non_contiguous_tensor_is_buffer_error(io_backend, tmp_path):
    torch = pytest.importorskip("torch")
    t = torch.zeros(64, 128, dtype=torch.bfloat16)
    paths = block_paths(tmp_path, 2)
    for bad in (t.t(), t[:, ::2]):
        assert not bad.is_contiguous()
        with pytest.raises(BufferError):
            io_backend.batch_store_block(paths, bad, [0, 4096], 4096, checksum=True)
        with pytest.raises(BufferError):
            io_backend.batch_load_block(paths, bad, [0, 4096], 4096, checksum=True)
    assert not os.listdir(tmp_path)  # nothing written


def test_bad_arguments_raw_layer(io_backend, tmp_path):
    impl = io_backend.impl
    p = [str(tmp_path / "a.bin")]
    t = [str(tmp_path / "a.bin_0.tmp")]
    buf = [bytearray(16)]
    with pytest.raises(TypeError):
        impl.batch_store_block("x", p, buf)
    with pytest.raises(TypeError):
        impl.batch_store_block(t, p, [object()])
    with pytest.raises(TypeError):
        impl.batch_store_block([3], p, buf)
    with pytest.raises(ValueError):
        impl.batch_store_block(t, p + p, buf)
    with pytest.raises(ValueError):
        impl.batch_store_block([str(tmp_path / "a\0b")], p, buf)
    with pytest.raises(TypeError):
        impl.batch_load_block(p, buf, True, False, "extra")
    with pytest.raises(TypeError):
        impl.batch_load_block(p, buf, bogus=True)
    with pytest.raises(ValueError):
        impl.batch_load_block(p, buf + buf)
    with pytest.raises(BufferError):
        impl.batch_load_block(p, [b"read-only bytes!"])
    with pytest.raises(BufferError):
        impl.batch_load_block(p, [memoryview(bytearray(32))[::2]])
    with pytest.raises(TypeError):
        impl.batch_lookup("x")
    assert not os.listdir(tmp_path)
    impl.batch_store_block(t, p, [b"0123456789abcdef"], False, True)  # positional flags (vLLM call shape)
    out = bytearray(16)
    impl.batch_load_block(p, [out], use_o_direct=False, checksum=True)
    assert out == b"0123456789abcdef"


@pytest.mark.parametrize("tail", ["/", "/.", "/.."])
def test_a_block_path_naming_a_directory_is_refused_before_any_io(io_backend, tmp_path, tail):
    """A block path ending in a separator, '.' or '..' names a directory: ValueError before
    any I/O, for stores, loads and lookups, at kvtier.io and at the raw layer, the same
    message from both backends. (A store of ``.../blk.bin/`` made the directory ``blk.bin``
    as the temp's parent, then failed at the rename with ENOTDIR, leaving it at the key:
    every later store of ``blk.bin`` was EISDIR.)"""
    bs = 4096
    view = rand_blocks(1, bs, seed=43)
    good = block_paths(tmp_path, 1)[0]
    bad = good + tail
    # str, bytes, and os.PathLike (pathlib keeps a '..' but drops a trailing '/' or '.')
    for b in [bad, os.fsencode(bad)] + ([pathlib.Path(bad)] if tail == "/.." else []):
        msg = rf"^paths\[1\]: a block path may not end in '{tail[1:] or '/'}' \(it would name a directory\)$"
        for call in (lambda: io_backend.batch_store_block([good, b], np.tile(view, 2), [0, bs], bs, True, True),
                     lambda: io_backend.batch_load_block([good, b], np.zeros(2 * bs, np.uint8), [0, bs], bs),
                     lambda: io_backend.batch_lookup([good, b])):
            with pytest.raises(ValueError, match=msg):
                call()
    impl = io_backend.impl
    raw = rf"dest_paths\[0\]: a block path may not end in '{tail[1:] or '/'}'"
    with pytest.raises(ValueError, match=raw):
        impl.batch_store_block([good + "_t.tmp"], [bad], [view.tobytes()], False, True)
    with pytest.raises(ValueError, match=raw.replace("dest_paths", "source_paths")):
        impl.batch_load_block([bad], [bytearray(bs)])
    with pytest.raises(ValueError, match=raw.replace("dest_paths", "paths")):
        impl.batch_lookup([bad])
    assert os.listdir(tmp_path) == []  # no directory made at (or above) the key
    # the name stays usable: a store of the file itself, then a load
    io_backend.batch_store_block([good], view, [0], bs, True, True)
    out = np.zeros(bs, np.uint8)
    io_backend.batch_load_block([good], out, [0], bs, True, True)
    assert out.tobytes() == view.tobytes() and io_backend.batch_lookup([good]) == [True]
    # a name that merely ends in a dot is a file name
    io_backend.batch_store_block([good + "."], view, [0], bs, True, True)
    assert os.path.isfile(good + ".")


@pytest.mark.parametrize("bad, exc, msg", [
    ({"buffered_unaligned": None}, TypeError, r"counts\['buffered_unaligned'\] must be int, not NoneType$"),
    ({"unverified": 1.0}, TypeError, r"counts\['unverified'\] must be int, not float$"),
    ({"unverified": True}, TypeError, r"counts\['unverified'\] must be int, not bool$"),
    ({"unverified": np.int64(1)}, TypeError, r"counts\['unverified'\] must be int, not int64$"),
    ({"unverified": -1}, ValueError, r"counts\['unverified'\] = -1: a counter is an int in 0\.\.2\*\*64-1$"),
    ({"unverified": 2**64}, ValueError, r"counts\['unverified'\] = 18446744073709551616: a counter is an int"),
    ([], TypeError, r"counts must be a dict or None, not list$"),
])
def test_counts_checked_before_any_io(io_backend, tmp_path, bad, exc, msg):
    """``counts=`` is checked before any I/O, by both backends alike, at kvtier.io and at the
    raw layer: a dict of policy counters, each value an int (not bool) in 0..2**64-1. (A bad
    value raised TypeError only after the I/O: a store had published its block, a load of a
    corrupt block had condemned it and raised TypeError instead of EBADMSG; the fallback
    took a float.)"""
    bs = 4096
    view = rand_blocks(2, bs, seed=44)
    paths = block_paths(tmp_path, 2)
    counts = bad.copy()
    with pytest.raises(exc, match=msg):
        io_backend.batch_store_block(paths, view, [0, bs], bs, True, True, counts=counts)
    assert counts == bad and not os.path.exists(os.path.dirname(paths[0]))  # nothing published, nothing made
    with pytest.raises(exc, match=msg):
        io_backend.impl.batch_store_block([p + "_t.tmp" for p in paths], paths, view, False, True,
                                          offsets=[0, bs], block_size=bs, counts=counts)
    assert not os.path.exists(os.path.dirname(paths[0]))
    io_backend.batch_store_block(paths, view, [0, bs], bs, True, True)
    flip_bit(paths[1], 5)
    out = np.zeros(2 * bs, np.uint8)
    with pytest.raises(exc, match=msg):
        io_backend.batch_load_block(paths, out, [0, bs], bs, True, True, counts=counts)
    with pytest.raises(exc, match=msg):
        io_backend.impl.batch_load_block(paths, out, True, True, offsets=[0, bs], block_size=bs, counts=counts)
    assert os.path.exists(paths[1]) and not out.any()  # not read, not condemned
    good = {"unverified": 2}
    with pytest.raises(OSError) as ei:
        io_backend.batch_load_block(paths, out, [0, bs], bs, True, True, counts=good)
    assert ei.value.errno == errno.EBADMSG and ei.value.checksum_failed is True and ei.value.num_succeeded == 1
    assert good == {"unverified": 2, "reread_checksum": 1, "condemned_checksum": 1}
    assert not os.path.exists(paths[1])


def test_c_signatures():
    import inspect

    C = pytest.importorskip("kvtier._C")
    assert str(inspect.signature(C.batch_store_block)) == \
        ("(tmp_paths, dest_paths, buffers, /, use_o_direct=True, checksum=False, durable=False, *, job_state=None, "
         "counts=None, offsets=None, block_size=None)")
    assert str(inspect.signature(C.batch_load_block)) == \
        ("(source_paths, buffers, /, use_o_direct=True, checksum=False, *, job_state=None, counts=None, "
         "offsets=None, block_size=None, landing='bounce')")
    assert str(inspect.signature(C.batch_lookup)) == "(paths, block_size=0, /)"


def test_offsets_form_of_the_raw_calls(io_backend, tmp_path):
    """impl.batch_*_block(paths, buffer, ..., offsets=, block_size=): one buffer and the
    offsets of its blocks (what kvtier.io passes: no per-block memoryview), the same bytes
    and records as the list form, the same errors in both backends."""
    impl = io_backend.impl
    bs, n = 4096 + 8, 5
    view = rand_blocks(n + 1, bs, seed=41)
    offs = [bs * (n - i) for i in range(n)]  # out of order, the first block of the view unused
    p = [os.path.join(str(tmp_path), f"r\u00e9{i}.bin") for i in range(n)]  # a non-ASCII name too
    tmps = [x + "_t.tmp" for x in p]
    impl.batch_store_block(tmps, p, view, False, True, offsets=offs, block_size=bs)
    for i, x in enumerate(p):
        want = view[offs[i]: offs[i] + bs].tobytes()
        assert open(x, "rb").read() == want and os.getxattr(x, XATTR) == expected_record(want)
        assert os.getxattr(x, ID_XATTR) == records.identity_record(x, bs, kvtier.crc32c(want))
    out = np.zeros((n + 1) * bs, np.uint8)
    assert impl.batch_load_block(p, out, False, True, offsets=offs[::-1], block_size=bs) == 0
    for i in range(n):
        assert out[offs[n - 1 - i]: offs[n - 1 - i] + bs].tobytes() == open(p[i], "rb").read()
    assert not out[:bs].any()
    bad = [({"offsets": offs, "block_size": True}, TypeError, "block_size must be int"),
           ({"offsets": offs}, TypeError, "block_size must be int"),
           ({"offsets": offs, "block_size": 0}, ValueError, "block_size must be > 0"),
           ({"offsets": 5, "block_size": bs}, TypeError, "offsets must be a list"),
           ({"offsets": offs[:2], "block_size": bs}, ValueError, "equal lengths"),
           ({"offsets": offs[:4] + [1.0], "block_size": bs}, TypeError, r"offsets\[4\] must be int, not float"),
           ({"offsets": offs[:4] + [n * bs + 1], "block_size": bs}, ValueError, r"offsets\[4\] = .* outside"),
           ({"offsets": [-1] + offs[1:], "block_size": bs}, ValueError, r"offsets\[0\] = -1"),
           ({"offsets": [2**70] + offs[1:], "block_size": bs}, ValueError, r"offsets\[0\]")]
    for kw, exc, msg in bad:
        with pytest.raises(exc, match=msg):
            impl.batch_load_block(p, out, False, True, **kw)
    with pytest.raises(BufferError, match="writable"):
        impl.batch_load_block(p, bytes(out), False, True, offsets=offs, block_size=bs)
    with pytest.raises(ValueError, match="embedded null"):
        impl.batch_load_block(p[:1] + ["a\0b"] + p[2:], out, False, True, offsets=offs, block_size=bs)
    assert not out[:bs].any()  # nothing was loaded by a refused call


# ---------------------------------------------------------------- GIL


@pytest.mark.timeout(60)
def test_fifo_or_directory_at_a_block_path_fails_fast_and_is_kept(io_backend, tmp_path):
    """A FIFO at a block path must not block the batch (open would wait for a
    writer forever) and is not ours to remove; a directory likewise."""
    bs = 4096
    view = rand_blocks(1, bs)
    good = block_paths(tmp_path, 1)[0]
    io_backend.batch_store_block([good], view, [0], bs, checksum=True)
    fifo, d = str(tmp_path / "fifo.bin"), str(tmp_path / "dir.bin")
    os.mkfifo(fifo)
    os.mkdir(d)
    t0 = time.monotonic()
    err, out = load_expect_error(io_backend, [good, fifo], bs)
    assert time.monotonic() - t0 < 10
    assert (err.errno, err.num_succeeded, err.checksum_failed) == (errno.EINVAL, 1, False)
    assert os.fsdecode(err.filename) == fifo
    assert np.array_equal(out[:bs], view[:bs])  # the block before it loaded
    err, _ = load_expect_error(io_backend, [d], bs)
    assert (err.errno, err.num_succeeded) == (errno.EISDIR, 0)
    assert stat_mode_is(fifo, "S_ISFIFO") and os.path.isdir(d)  # both kept


def stat_mode_is(path, fn):
    import stat

    return getattr(stat, fn)(os.lstat(path).st_mode)


def test_symlink_at_a_block_path_is_eloop_and_neither_link_nor_target_is_touched(io_backend, tmp_path):
    """Loads never follow a symlink at the block path: nothing outside the cache is read
    as a block (a link to /etc/passwd would otherwise load as a legacy block)."""
    target = tmp_path / "outside"
    target.write_bytes(b"secret" * 1000)  # the right size: a followed load would accept it (no xattr)
    link = str(tmp_path / "blk.bin")
    os.symlink(target, link)
    err, out = load_expect_error(io_backend, [link], len(b"secret" * 1000))
    assert (err.errno, err.checksum_failed) == (errno.ELOOP, False)
    assert not out.any()  # nothing was read
    assert os.path.islink(link) and target.read_bytes() == b"secret" * 1000


@pytest.mark.timeout(120)
def test_other_thread_runs_during_large_batch(io_backend, tmp_path):
    """A second thread keeps leaving timestamps strictly inside one
    batch_load_block call (the middle half of it), so the GIL is free while
    the batch reads and checksums; a held GIL leaves none there (the control
    test_gil_probe_detects_a_held_gil in tests/test_crc32c.py uses the same
    probe, _mid_call_progress)."""
    from test_crc32c import _mid_call_progress

    bs, n = 4 * 1024 * 1024, 24
    view = rand_blocks(n, bs, seed=13)
    paths = block_paths(tmp_path, n)
    io_backend.batch_store_block(paths, view, offsets_of(n, bs), bs, use_o_direct=False, checksum=True)
    out = np.zeros_like(view)
    offs = offsets_of(n, bs)
    results = []
    for _ in range(3):  # a loaded host may deschedule the spinner for a whole call
        out[:] = 0
        d, mid, total = _mid_call_progress(
            lambda: io_backend.batch_load_block(paths, out, offs, bs, use_o_direct=False, checksum=True))
        assert np.array_equal(out, view)
        results.append((round(d * 1e3, 1), mid, total))
        if d > 0.004 and mid >= 10:  # >= 40 switch intervals (1e-4 s) long
            return
    pytest.fail(f"other thread stalled inside batch_load_block: (ms, stamps mid-call, total) {results}")


# ---------------------------------------------------------------- backend choice


def test_backend_env_var():
    code = "from kvtier import io; print(io.backend)"
    env = dict(os.environ)
    for forced in ("python", "c"):
        env["KVTIER_IO_BACKEND"] = forced
        r = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, cwd=str(ROOT))
        if forced == "c" and r.returncode != 0 and "not importable" in r.stderr:
            continue
        assert r.returncode == 0, r.stderr
        assert r.stdout.strip() == forced
    env["KVTIER_IO_BACKEND"] = "rust"
    r = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, cwd=str(ROOT))
    assert r.returncode != 0
    assert "ValueError" in r.stderr and "KVTIER_IO_BACKEND" in r.stderr and "c, python" in r.stderr
    with pytest.raises(ValueError, match="valid: c, python"):
        kio.for_backend("rust")


# ---------------------------------------------------------------- several threads at once


@pytest.mark.timeout(120)
def test_concurrent_checksummed_io_is_exact(io_backend, tmp_path):
    """Several threads at once, each with its own engine slots and pieces (sizes
    that split into uneven pieces): every record is the exact CRC32C of its
    block, every load gives the bytes back, and a flipped bit is still caught."""
    sizes = [512 * 1024, 512 * 1024 + 1, 1024 * 1024 + 4097, 3 * 1024 * 1024 - 3]
    errors = []

    def worker(t):
        try:
            rng = np.random.default_rng(t)
            for it in range(12):
                bs = sizes[(t + it) % len(sizes)]
                view = rng.integers(0, 256, 2 * bs, dtype=np.uint8)
                paths = [str(tmp_path / f"t{t}_{it}_{k}.bin") for k in range(2)]
                io_backend.batch_store_block(paths, view, [0, bs], bs, checksum=True)
                for k, p in enumerate(paths):
                    assert os.getxattr(p, XATTR) == expected_record(view[k * bs:(k + 1) * bs])
                out = np.zeros_like(view)
                io_backend.batch_load_block(paths, out, [0, bs], bs, checksum=True)
                assert np.array_equal(out, view)
                if it % 3 == 0:  # and mismatches are still caught under contention
                    flip_bit(paths[1], bs - 1 - it)
                    with pytest.raises(OSError) as ei:
                        io_backend.batch_load_block(paths, out, [0, bs], bs, checksum=True)
                    assert (ei.value.errno, ei.value.checksum_failed, ei.value.num_succeeded) == (errno.EBADMSG, True, 1)
        except BaseException as e:  # reported by the main thread
            errors.append(e)

    threads = [threading.Thread(target=worker, args=(t,)) for t in range(4)]
    for th in threads:
        th.start()
    for th in threads:
        th.join(100)
    assert not errors, errors[0]


@pytest.mark.timeout(60)
def test_load_after_fork(io_backend, tmp_path):
    """A forked child loads with its own per-thread private memory and
    io_uring ring (the parent's ring is not the child's to use)."""
    bs = 2 * 1024 * 1024
    view = rand_blocks(1, bs, seed=21)
    io_backend.batch_store_block([str(tmp_path / "parent.bin")], view, [0], bs, checksum=True)
    pid = os.fork()
    if pid == 0:  # child: store + verify, exit status tells the parent
        code = 1
        try:
            p = str(tmp_path / "child.bin")
            io_backend.batch_store_block([p], view, [0], bs, checksum=True)
            out = np.zeros_like(view)
            io_backend.batch_load_block([p, str(tmp_path / "parent.bin")], np.zeros(2 * bs, np.uint8),
                                        [0, bs], bs, checksum=True)
            io_backend.batch_load_block([p], out, [0], bs, checksum=True)
            code = 0 if np.array_equal(out, view) else 2
        finally:
            os._exit(code)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0
    assert os.getxattr(str(tmp_path / "child.bin"), XATTR) == expected_record(view)


def test_type_stub_covers_the_c_module():
    """kvtier/_C.pyi declares every public name of kvtier._C, with the
    positional-only parameters of the block I/O calls."""
    import ast

    C = pytest.importorskip("kvtier._C")
    tree = ast.parse((ROOT / "kvtier" / "_C.pyi").read_text())
    declared = {n.name for n in tree.body if isinstance(n, ast.FunctionDef)}
    declared |= {n.target.id for n in tree.body if isinstance(n, ast.AnnAssign)}
    public = {n for n in dir(C) if not n.startswith("__")}
    assert public - declared == set()
    fn = {n.name: n for n in tree.body if isinstance(n, ast.FunctionDef)}
    assert [a.arg for a in fn["batch_store_block"].args.posonlyargs] == ["tmp_paths", "dest_paths", "buffers"]
    assert [a.arg for a in fn["batch_load_block"].args.posonlyargs] == ["source_paths", "buffers"]


def test_condemned_block_republished_meanwhile_is_kept(tmp_path, monkeypatch):
    """A block condemned by one reader is removed only if the name still points to the
    file it read: a good copy a peer renamed over it meanwhile stays (fallback; the C core
    runs the same fstat/stat inode check, csrc/block/block.c unlink_if_same)."""
    from kvtier import fallback

    bs = 8192
    view = rand_blocks(2, bs, seed=9)
    path = block_paths(tmp_path, 1)[0]
    # the peer's copy: the same last four path components, so the same identity record
    good = str(tmp_path / "peer" / os.path.relpath(path, tmp_path))
    fallback.batch_store_block([path + "_a.tmp"], [path], [view[:bs]], checksum=True)
    fallback.batch_store_block([good + "_b.tmp"], [good], [view[:bs]], checksum=True)
    flip_bit(path, 17)
    real = fallback._read_verify
    calls = []

    def read_verify_then_republish(fd, *args):
        r = real(fd, *args)
        calls.append(r)
        if len(calls) == 2:  # the condemning re-read: a peer republishes a good copy now
            os.replace(good, path)
        return r

    monkeypatch.setattr(fallback, "_read_verify", read_verify_then_republish)
    out = np.zeros(bs, dtype=np.uint8)
    with pytest.raises(OSError) as ei:
        fallback.batch_load_block([path], [out], checksum=True)
    assert ei.value.errno == errno.EBADMSG and ei.value.checksum_failed is True
    assert [c[0] for c in calls] == ["checksum", "checksum"]  # mismatch twice: condemned
    assert os.path.exists(path)  # ... but the republished good block was not removed
    monkeypatch.setattr(fallback, "_read_verify", real)
    fallback.batch_load_block([path], [out], checksum=True)
    assert np.array_equal(out, view[:bs])


# ---------------------------------------------------------------- injected faults (LD_PRELOAD)


@pytest.fixture(scope="module")
def io_fault(tmp_path_factory):
    """tests/c/io_fault.c built as an LD_PRELOAD shim (see its header)."""
    return build_preload(tmp_path_factory, "io_fault")


FAULT_BS, FAULT_N = 768 * 1024, 2  # 3 I/O chunks per block, page multiple (O_DIRECT-able)

_FAULT_SCRIPT = """
import mmap, sys
import numpy as np
from kvtier import io
d, odirect, durable, out_path = sys.argv[1], sys.argv[2] == "1", sys.argv[3] == "1", sys.argv[4]
assert io.backend == sys.argv[5], io.backend
bs, n = {bs}, {n}
src = mmap.mmap(-1, n * bs)  # page-aligned: O_DIRECT usable
v = np.frombuffer(src, dtype=np.uint8)
v[:] = np.random.default_rng(5).integers(0, 256, n * bs, dtype=np.uint8)
paths = [f"{{d}}/m/{{i:02x}}/blk{{i}}.bin" for i in range(n)]
offs = [i * bs for i in range(n)]
io.batch_store_block(paths, v, offs, bs, use_o_direct=odirect, checksum=True, durable=durable)
dst = mmap.mmap(-1, n * bs)
o = np.frombuffer(dst, dtype=np.uint8)
assert io.batch_load_block(paths, o, offs, bs, use_o_direct=odirect, checksum=True) == 0
with open(out_path, "wb") as f:
    f.write(o.tobytes())
""".format(bs=FAULT_BS, n=FAULT_N)


def _run_under_faults(io_backend, io_fault, tmp_path, odirect=True, durable=False, **faults):
    """Store + load FAULT_N blocks in a subprocess under the shim; assert the
    round trip (bytes loaded, bytes and xattr on disk, no temp left) and
    return the shim's log as (func, kind, path) tuples."""
    d = tmp_path / "faulty"
    d.mkdir()
    if odirect and not kio.probe_o_direct(str(d)):
        pytest.skip(f"{d} does not accept O_DIRECT")
    log, loaded = tmp_path / "fault.log", tmp_path / "loaded.bin"
    # KVTIER_IO_URING=0: the shim wraps libc's pread/pwrite, which io_uring bypasses
    # (the io_uring path's own tests: tests/test_io_engine.py)
    env = dict(os.environ, LD_PRELOAD=preload(io_fault), KVT_FAULT_DIR=str(d), KVT_FAULT_LOG=str(log),
               KVTIER_IO_BACKEND=io_backend.backend, KVTIER_IO_URING="0", **faults)
    r = subprocess.run([sys.executable, "-c", _FAULT_SCRIPT, str(d), str(int(odirect)), str(int(durable)),
                        str(loaded), io_backend.backend], env=env, cwd=str(ROOT), capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    want = np.random.default_rng(5).integers(0, 256, FAULT_N * FAULT_BS, dtype=np.uint8).tobytes()
    assert loaded.read_bytes() == want
    for i in range(FAULT_N):
        p = d / "m" / f"{i:02x}" / f"blk{i}.bin"
        block = want[i * FAULT_BS:(i + 1) * FAULT_BS]
        assert p.read_bytes() == block
        assert os.getxattr(p, XATTR) == expected_record(block)
    assert temps_under(d) == []
    return [tuple(ln.split("\t")) for ln in log.read_text().splitlines()] if log.exists() else []


def test_o_direct_refused_at_first_io_falls_back_to_buffered(io_backend, io_fault, tmp_path):
    """fcntl(F_SETFL, O_DIRECT) succeeds but every pread/pwrite on the O_DIRECT
    fd fails with EINVAL: store and load drop O_DIRECT and finish buffered."""
    log = _run_under_faults(io_backend, io_fault, tmp_path, KVT_FAULT_DIO_EINVAL="1")
    kinds = {(f, k) for f, k, _ in log}
    assert kinds == {("pwrite", "DIO_EINVAL"), ("pread", "DIO_EINVAL")}  # O_DIRECT was tried, both ways
    # once per file: after the EINVAL the fd stays buffered
    assert sum(1 for f, _, p in log if f == "pwrite") == FAULT_N
    assert sum(1 for f, _, p in log if f == "pread") == FAULT_N


_MISALIGNED_SCRIPT = """
import mmap, sys
import numpy as np
from kvtier import io
d, shift, checksum = sys.argv[1], int(sys.argv[2]), sys.argv[3] == "1"
assert io.backend == sys.argv[4], io.backend
bs = {bs}
src = mmap.mmap(-1, bs + 4096)
v = np.frombuffer(src, dtype=np.uint8)[shift:shift + bs]  # shift bytes past a page, as np.zeros often is
v[:] = np.random.default_rng(6).integers(0, 256, bs, dtype=np.uint8)
p = f"{{d}}/m/00/blk.bin"
io.batch_store_block([p], v, [0], bs, use_o_direct=True, checksum=checksum)
dst = mmap.mmap(-1, bs + 4096)
o = np.frombuffer(dst, dtype=np.uint8)[shift:shift + bs]
io.batch_load_block([p], o, [0], bs, use_o_direct=True, checksum=checksum)
assert o.tobytes() == v.tobytes()
""".format(bs=FAULT_BS)


@pytest.mark.parametrize("checksum", [True, False])
def test_o_direct_whatever_the_callers_alignment(io_backend, io_fault, tmp_path, checksum):
    """A caller's buffer 16 bytes past a page (np.zeros, a torch tensor) keeps O_DIRECT where
    the bytes move through the engine's own page-aligned memory: every load (the private
    slots; the fallback's bounce buffer). A store writes straight from the caller's buffer,
    checksummed or not, so it is O_DIRECT only when that is aligned (buffered here). Seen by
    the shim refusing O_DIRECT I/O (logged, then finished buffered)."""
    d = tmp_path / "faulty"
    d.mkdir()
    if not kio.probe_o_direct(str(d)):
        pytest.skip(f"{d} does not accept O_DIRECT")
    log = tmp_path / "fault.log"
    env = dict(os.environ, LD_PRELOAD=preload(io_fault), KVT_FAULT_DIR=str(d), KVT_FAULT_LOG=str(log),
               KVTIER_IO_BACKEND=io_backend.backend, KVTIER_IO_URING="0", KVT_FAULT_DIO_EINVAL="1")
    r = subprocess.run([sys.executable, "-c", _MISALIGNED_SCRIPT, str(d), "16", str(int(checksum)),
                        io_backend.backend], env=env, cwd=str(ROOT), capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    lines = [tuple(ln.split("\t")) for ln in log.read_text().splitlines()] if log.exists() else []
    kinds = sorted({(f, k) for f, k, _ in lines})
    assert kinds == [("pread", "DIO_EINVAL")], lines


def test_unaligned_store_is_counted_buffered(io_backend, tmp_path):
    """A store from a buffer 16 bytes past a page, checksummed or not, is written buffered
    although O_DIRECT was asked for (every store writes straight from the caller's buffer):
    counted per block as buffered_unaligned (the tier's counter and metric of that name),
    so the silent fallback is visible. An aligned buffer or use_o_direct=False is not
    counted; the bytes and the checksummed blocks' records round-trip either way."""
    if not kio.probe_o_direct(str(tmp_path)):
        pytest.skip(f"{tmp_path} does not accept O_DIRECT")
    bs, n = 4096, 3
    raw = np.random.default_rng(5).integers(0, 256, (n + 2) * bs, dtype=np.uint8)
    start = (-raw.ctypes.data) % bs
    aligned, off16 = raw[start:start + n * bs], raw[start + 16:start + 16 + n * bs]
    offs = [i * bs for i in range(n)]
    seen = {}
    for name, buf, checksum, direct in [("off16", off16, False, True), ("aligned", aligned, False, True),
                                        ("off16_crc", off16, True, True), ("aligned_crc", aligned, True, True),
                                        ("off16_nodirect", off16, False, False)]:
        paths = [str(tmp_path / f"{name}{i}.bin") for i in range(n)]
        counts = {}
        io_backend.batch_store_block(paths, buf, offs, bs, use_o_direct=direct, checksum=checksum, counts=counts)
        seen[name] = counts.get("buffered_unaligned", 0)
        out = np.zeros(n * bs, np.uint8)
        io_backend.batch_load_block(paths, out, offs, bs, checksum=checksum)
        assert np.array_equal(out, buf)
        if checksum:
            assert [os.getxattr(p, "user.vllm.kv_crc32c") for p in paths] == [
                kvtier.crc32c(buf[o:o + bs]).to_bytes(4, "big") for o in offs]
    assert seen == {"off16": n, "aligned": 0, "off16_crc": n, "aligned_crc": 0, "off16_nodirect": 0}


def test_buffer_aligned_to_512_not_4096_takes_the_c_cores_mode(io_backend, tmp_path):
    """The O_DIRECT rule is the C core's on both backends: a block length and (for a store
    without checksum, written straight from the caller's buffer) an address that are
    multiples of 4096, not the filesystem's reported minimum (statx STATX_DIOALIGN, 512
    here on ext4). A store from a buffer 512 bytes past a page is buffered and counted
    buffered_unaligned on both (the fallback used O_DIRECT and counted nothing): all its
    pages in the page cache after it; from a page-aligned one, O_DIRECT, none. The
    bytes stored and loaded (O_DIRECT, into the same 512-aligned rows) agree."""
    if not kio.probe_o_direct(str(tmp_path)):
        pytest.skip(f"{tmp_path} does not accept O_DIRECT")
    bs, n = 64 * 1024, 3
    raw = aligned_buffer((n + 1) * bs)
    buf = np.frombuffer(raw, np.uint8)
    buf[:] = np.random.default_rng(12).integers(0, 256, buf.size, dtype=np.uint8)
    offs512 = [512 + i * bs for i in range(n)]
    offs0 = [i * bs for i in range(n)]
    assert buf.ctypes.data % 4096 == 0 and (buf.ctypes.data + 512) % 4096 == 512
    seen, cached = {}, {}
    for name, offs in (("off512", offs512), ("aligned", offs0)):
        paths = [str(tmp_path / f"{name}{i}.bin") for i in range(n)]
        counts = {}
        io_backend.batch_store_block(paths, buf, offs, bs, use_o_direct=True, checksum=False, counts=counts)
        seen[name] = counts.get("buffered_unaligned", 0)
        cached[name] = [_resident_pages(p) for p in paths]
        for i, p in enumerate(paths):
            assert pathlib.Path(p).read_bytes() == buf[offs[i]:offs[i] + bs].tobytes()
        out_raw = aligned_buffer((n + 1) * bs)
        out = np.frombuffer(out_raw, np.uint8)
        for p in paths:  # drop the cached pages: the load's own mode shows in what it leaves
            fd = os.open(p, os.O_RDONLY)
            os.fsync(fd)  # dirty pages are not dropped
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            os.close(fd)
        io_backend.batch_load_block(paths, out, offs512, bs, use_o_direct=True, checksum=False)
        assert all(np.array_equal(out[o:o + bs], buf[offs[i]:offs[i] + bs]) for i, o in enumerate(offs512))
        assert [_resident_pages(p) for p in paths] == [0] * n  # loaded O_DIRECT (through aligned memory)
    assert seen == {"off512": n, "aligned": 0}
    assert cached == {"off512": [bs // 4096] * n, "aligned": [0] * n}


def test_job_state_counts_the_blocks_stored_and_loaded(io_backend, tmp_path):
    """Under a job state a store counts each block stored (published or found there), as a
    load counts each block loaded: the count is the index of the block in flight, which a
    deadline error names (tests/test_deadlines.py)."""
    bs, n = 8192, 3
    view = rand_blocks(n, bs, seed=41)
    paths = block_paths(tmp_path, n)
    io_backend.batch_store_block(paths[:1], view, [0], bs, checksum=True)
    for checksum in (True, False):
        js = kio.JobState()
        io_backend.batch_store_block(paths, view, offsets_of(n, bs), bs, checksum=checksum, job_state=js)
        assert (js.state, js.blocks_done) == (kio.LIVE, n)
    out = np.zeros_like(view)
    js = kio.JobState()
    io_backend.batch_load_block(paths, out, offsets_of(n, bs), bs, checksum=True, job_state=js)
    assert (js.state, js.blocks_done) == (kio.LIVE, n) and np.array_equal(out, view)
    os.unlink(paths[1])
    js = kio.JobState()
    with pytest.raises(FileNotFoundError) as ei:  # a load stops at block 1: counted 1
        io_backend.batch_load_block(paths, out, offsets_of(n, bs), bs, checksum=True, job_state=js)
    assert ei.value.num_succeeded == js.blocks_done == 1
    js = kio.JobState()
    os.makedirs(paths[1])  # a directory at block 1's path: the store fails there
    with pytest.raises(IsADirectoryError) as ei:
        io_backend.batch_store_block(paths, view, offsets_of(n, bs), bs, checksum=True, job_state=js)
    assert ei.value.num_succeeded == js.blocks_done == 1


EINTR_FUNCS = ["open", "pwrite", "pread", "fsetxattr", "fgetxattr", "rename", "fsync", "close"]


def test_eintr_once_everywhere_is_retried(io_backend, io_fault, tmp_path):
    """The first call per file of each of open, pwrite, pread, fsetxattr,
    fgetxattr, rename, fsync fails with EINTR (and close reports EINTR after
    closing): a durable store + load still round-trips (the C core retries;
    the fallback relies on PEP 475 for open/pwrite/preadv/fsync and retries
    the xattr calls and rename itself; close's EINTR counts as closed)."""
    log = _run_under_faults(io_backend, io_fault, tmp_path, durable=True, KVT_FAULT_EINTR=",".join(EINTR_FUNCS))
    hit = {f for f, k, _ in log if k == "EINTR"}
    assert hit == set(EINTR_FUNCS)
    opened = {p for f, _, p in log if f == "open"}
    assert any(p.endswith(".tmp") for p in opened)  # the temp create
    assert any(p.endswith("blk0.bin") for p in opened)  # the load's open
    assert sum(1 for f, _, p in log if f == "rename") == FAULT_N


_MANY_SCRIPT = """
import sys
import numpy as np
from kvtier import io
d, n, bs, step = sys.argv[1], int(sys.argv[2]), 4096, sys.argv[4]
assert io.backend == sys.argv[3], io.backend
v = np.random.default_rng(6).integers(0, 256, n * bs, dtype=np.uint8)
paths = [f"{d}/m/{i % 3:02x}/blk{i}.bin" for i in range(n)]
offs = [i * bs for i in range(n)]
o = np.zeros(n * bs, dtype=np.uint8)
if step == "round_trip":
    io.batch_store_block(paths, v, offs, bs, use_o_direct=False, checksum=True)
    assert io.batch_load_block(paths, o, offs, bs, use_o_direct=False, checksum=True) == 0
    assert np.array_equal(o, v)
else:
    try:
        io.batch_load_block(paths, o, offs, bs, use_o_direct=False, checksum=True)
    except PermissionError as e:
        print(e.num_succeeded, e.filename)
        assert np.array_equal(o[:e.num_succeeded * bs], v[:e.num_succeeded * bs])
"""


def test_open_faults_in_a_batch_under_one_directory(io_backend, io_fault, tmp_path):
    """40 blocks (the C core opens them relative to the directory they share): the first
    open of each block fails with EINTR and is retried (the round trip); then every open
    of one block failing with EACCES stops the batch there, named by its whole path."""
    d = tmp_path / "faulty"
    d.mkdir()
    log = tmp_path / "fault.log"

    def run(step, **faults):
        env = dict(os.environ, LD_PRELOAD=preload(io_fault), KVT_FAULT_LOG=str(log),
                   KVTIER_IO_BACKEND=io_backend.backend, **faults)
        r = subprocess.run([sys.executable, "-c", _MANY_SCRIPT, str(d), "40", io_backend.backend, step], env=env,
                           cwd=str(ROOT), capture_output=True, text=True)
        assert r.returncode == 0, r.stderr
        return r.stdout.split()

    # the blocks' directories, not the shared one (d/m), start with d/m/0
    run("round_trip", KVT_FAULT_DIR=str(d / "m" / "0"), KVT_FAULT_EINTR="open")
    eintr = {p for f, k, p in (ln.split("\t") for ln in log.read_text().splitlines()) if (f, k) == ("open", "EINTR")}
    assert {f"{d}/m/{i % 3:02x}/blk{i}.bin" for i in range(40)} <= eintr
    bad = f"{d}/m/01/blk7.bin"
    assert run("load", KVT_FAULT_DIR=bad, KVT_FAULT_ERRNO=f"open:{errno.EACCES}:-1") == ["7", bad]


def test_parents_not_shown_yet_are_retried(io_backend, io_fault, tmp_path):
    """Every mkdir of a store's parents fails once with ENOENT (a shared filesystem's name
    cache not showing a directory another node just made: GlusterFS, two nodes storing
    into new directories at once): the store pauses and makes them again (P21), and every
    block round-trips."""
    log = _run_under_faults(io_backend, io_fault, tmp_path, KVT_FAULT_ERRNO=f"mkdir:{errno.ENOENT}:1")
    failed = {p for f, _, p in log if f == "mkdir"}
    assert {str(tmp_path / "faulty" / "m" / f"{i:02x}") for i in range(FAULT_N)} <= failed


@pytest.mark.parametrize("limit", [12345, 5 * 4096])
def test_short_transfers_round_trip(io_backend, io_fault, tmp_path, limit):
    """pread/pwrite move at most `limit` bytes per call (an unaligned limit
    also breaks O_DIRECT, which then falls back to buffered)."""
    log = _run_under_faults(io_backend, io_fault, tmp_path, KVT_FAULT_SHORT=str(limit))
    shorts = {f for f, k, _ in log if k == "SHORT"}
    assert shorts == {"pwrite", "pread"}
    # every chunk of KVT_IO_CHUNK = 256 KiB took several calls
    assert sum(1 for f, _, _ in log if f == "pwrite") >= FAULT_N * FAULT_BS // limit - FAULT_N * 3


def test_fallback_short_and_o_direct_einval_monkeypatched(tmp_path, monkeypatch):
    """The same conditions injected into the Python fallback by replacing
    os.pwrite / os.preadv (what it calls): EINVAL while the fd has O_DIRECT,
    then at most 1000 bytes per call."""
    import fcntl

    from kvtier import fallback

    if not kio.probe_o_direct(str(tmp_path)):
        pytest.skip("tmp_path does not accept O_DIRECT")
    real_pwrite, real_preadv = os.pwrite, os.preadv
    seen = {"dio_pwrite": 0, "dio_pread": 0, "pwrite": 0, "pread": 0}

    def pwrite(fd, data, off):
        if fcntl.fcntl(fd, fcntl.F_GETFL) & os.O_DIRECT:
            seen["dio_pwrite"] += 1
            raise OSError(errno.EINVAL, "O_DIRECT refused")
        seen["pwrite"] += 1
        return real_pwrite(fd, memoryview(data)[:1000], off)

    def preadv(fd, bufs, off):
        if fcntl.fcntl(fd, fcntl.F_GETFL) & os.O_DIRECT:
            seen["dio_pread"] += 1
            raise OSError(errno.EINVAL, "O_DIRECT refused")
        seen["pread"] += 1
        return real_preadv(fd, [memoryview(bufs[0])[:1000]], off)

    monkeypatch.setattr(os, "pwrite", pwrite)
    monkeypatch.setattr(os, "preadv", preadv)
    bs = 3 * 4096
    src = aligned_buffer(2 * bs)
    src[:] = bytes(rand_blocks(2, bs, seed=21))
    paths = block_paths(tmp_path, 2)
    fallback.batch_store_block([p + "_x.tmp" for p in paths], paths, [memoryview(src)[:bs], memoryview(src)[bs:]],
                               use_o_direct=True, checksum=True)
    dst = aligned_buffer(2 * bs)
    assert fallback.batch_load_block(paths, [memoryview(dst)[:bs], memoryview(dst)[bs:]],
                                     use_o_direct=True, checksum=True) == 0
    monkeypatch.undo()
    assert dst[:] == src[:]
    for i, p in enumerate(paths):
        assert pathlib.Path(p).read_bytes() == src[i * bs:(i + 1) * bs]
        assert os.getxattr(p, XATTR) == expected_record(src[i * bs:(i + 1) * bs])
    assert temps_under(tmp_path) == []
    assert (seen["dio_pwrite"], seen["dio_pread"]) == (2, 2)  # O_DIRECT tried once per file
    assert seen["pwrite"] == seen["pread"] == 2 * -(-bs // 1000)  # 1000 bytes per call


def test_durable_dir_fsync_failure_keeps_a_peers_block(io_backend, io_fault, tmp_path):
    """Durable store: the directory fsync after our rename fails (EIO). A peer
    renamed its own block onto the destination in between (its check for the
    destination ran before our rename): the store raises EIO and the peer's
    block stays. Without the peer, our block stays too: a failed durable store
    never removes a published block, which another durable job may have
    synced and reported stored (issue 13, finding 4)."""
    d = tmp_path / "faulty"
    d.mkdir()
    dest = d / "blk.bin"
    peer = d / "peer.bin"
    peer.write_bytes(b"P" * 4096)
    script = textwrap.dedent(f"""
        import errno
        from kvtier import io
        try:
            io.batch_store_block([{str(dest)!r}], bytearray(b"O" * 4096), [0], 4096, checksum=True, durable=True)
        except OSError as e:
            assert (e.errno, e.filename, e.num_succeeded, e.operation) == (errno.EIO, {str(dest)!r}, 0, "sync"), e
        else:
            raise SystemExit("store succeeded")
    """)
    base = dict(os.environ, LD_PRELOAD=preload(io_fault), KVT_FAULT_DIR=str(d), KVT_FAULT_DIRSYNC_EIO="1",
                KVT_FAULT_LOG=str(tmp_path / "log"), KVTIER_IO_BACKEND=io_backend.backend)
    r = subprocess.run([sys.executable, "-c", script], cwd=str(ROOT), capture_output=True, text=True,
                       env=dict(base, KVT_FAULT_PEER_SRC=str(peer), KVT_FAULT_PEER_DST=str(dest)))
    assert r.returncode == 0, r.stderr
    assert "PEER_PUBLISHED" in (tmp_path / "log").read_text()
    assert dest.read_bytes() == b"P" * 4096  # the peer's block survived our failed store
    assert not peer.exists() and temps_under(d) == []
    dest.unlink()
    r = subprocess.run([sys.executable, "-c", script], cwd=str(ROOT), capture_output=True, text=True, env=base)
    assert r.returncode == 0, r.stderr
    assert dest.read_bytes() == b"O" * 4096 and temps_under(d) == []  # our published block stays


def test_batch_error_under_allocation_failures():
    """raise_batch_error (csrc/py/blockio.c) under an allocation failure at each point
    of a failing batch_load_block: the result is the full OSError or a
    MemoryError, never a SystemError (NULL without an exception) or a crash.
    Failure points past the argument parsing (which a succeeding load also
    has) land in raise_batch_error itself."""
    pytest.importorskip("kvtier._C")
    pytest.importorskip("_testcapi")
    script = textwrap.dedent("""
        import os, sys, tempfile, _testcapi
        import kvtier._C as C
        d = tempfile.mkdtemp()
        good = os.path.join(d, "g.bin")
        C.batch_store_block([good + ".tmp"], [good], [bytes(4096)])
        def probe(paths):
            bufs = [bytearray(4096) for _ in paths]
            out = []
            for k in range(200):
                e = None
                _testcapi.set_nomemory(k, k + 1)
                try:
                    C.batch_load_block(paths, bufs)
                    _testcapi.remove_mem_hooks()
                except BaseException as exc:
                    _testcapi.remove_mem_hooks()
                    e = exc
                out.append(e)
            return out
        ok = probe([good, good])
        bad = probe([good, good, os.path.join(d, "missing.bin")])
        n_ok = sum(isinstance(e, MemoryError) for e in ok)
        n_bad = sum(isinstance(e, MemoryError) for e in bad)
        for e in bad:
            if isinstance(e, MemoryError):
                continue
            assert type(e) is FileNotFoundError, repr(e)
            assert (e.errno, e.filename, e.num_succeeded, e.checksum_failed, e.num_retried) == (
                2, os.path.join(d, "missing.bin"), 2, False, 0), repr(e)
        assert isinstance(bad[-1], FileNotFoundError)
        print(n_ok, n_bad)
    """)
    r = subprocess.run([sys.executable, "-c", script], cwd=str(ROOT), capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    n_ok, n_bad = map(int, r.stdout.split())
    assert n_bad > n_ok, (n_ok, n_bad)  # some failures hit the error construction


@pytest.mark.parametrize("name_len", [240, 254])
def test_a_name_whose_temp_does_not_fit_name_max_says_so(io_backend, tmp_path, name_len):
    """A block name of 235-255 bytes fits NAME_MAX but its temp (+ '_<16 hex>.tmp') does not:
    ENAMETOOLONG names the temp suffix and the longest name that works, nothing is left
    behind; a name that does not fit itself keeps the plain message (issue #24 item 15)."""
    data = np.arange(4096, dtype=np.uint8)
    dest = str(tmp_path / ("b" * (name_len - 4) + ".bin"))
    with pytest.raises(OSError) as ei:
        io_backend.batch_store_block([dest], data, [0], 4096, use_o_direct=False, checksum=True)
    e = ei.value
    assert e.errno == errno.ENAMETOOLONG and e.filename == dest and e.num_succeeded == 0
    assert e.strerror == (f"File name too long: the block's name ({name_len} bytes) fits NAME_MAX (255), but its "
                          f"temp name (the name + '_<16 hex>.tmp', {name_len + 21} bytes) does not; keep block "
                          "names at most 234 bytes")
    assert os.listdir(tmp_path) == []
    ok = str(tmp_path / ("c" * 230 + ".bin"))  # 234 bytes: its temp is 255
    io_backend.batch_store_block([ok], data, [0], 4096, use_o_direct=False, checksum=True)
    assert os.listdir(tmp_path) == [os.path.basename(ok)]
    with pytest.raises(OSError) as ei:
        io_backend.batch_store_block([str(tmp_path / ("d" * 256))], data, [0], 4096, use_o_direct=False)
    assert ei.value.errno == errno.ENAMETOOLONG and ei.value.strerror == "File name too long"


def test_a_destination_lstat_eio_stores_anew_on_both_backends(io_backend, io_fault, tmp_path):
    """The first lstat of every store's destination fails with EIO (a sick client's look-up):
    the store writes the block anew, as the C core always did, and every block round-trips;
    the fallback failed the store (issue #24 item 15)."""
    log = _run_under_faults(io_backend, io_fault, tmp_path, KVT_FAULT_ERRNO=f"lstat:{errno.EIO}:1")
    failed = {p for f, _, p in log if f == "lstat"}
    assert {str(tmp_path / "faulty" / "m" / f"{i:02x}" / f"blk{i}.bin") for i in range(FAULT_N)} <= failed
