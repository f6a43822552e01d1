"""benchmarks/vs_vllm.py: its verified floor (vfloor) stores blocks kvtier loads and
verifies what kvtier stores, and a quick run prints the vfloor column and ratios."""
from __future__ import annotations

import errno
import importlib.util
import os
import re
import shutil
import subprocess
import sys

import pytest

from ci import unavailable
import kvtier
from kvtier._blockio import records

HERE = os.path.dirname(os.path.abspath(__file__))
SCRIPT = os.path.join(HERE, os.pardir, "benchmarks", "vs_vllm.py")
KiB = 1024


@pytest.fixture(scope="module")
def vs():
    spec = importlib.util.spec_from_file_location("vs_vllm_under_test", SCRIPT)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


@pytest.fixture(scope="module")
def vfloor(vs, tmp_path_factory):
    """(the vfloor CLoop, its pool): 4 MiB of random bytes."""
    if shutil.which("gcc") is None:
        unavailable("no gcc to build the vfloor loop")
    pool = vs.Pool(4 * 1024 * KiB)
    try:
        vf = vs.CLoop("vfloor", vs.VFLOOR_C, str(tmp_path_factory.mktemp("vfloor-so")), pool, libs=vs.VFLOOR_LIBS,
                      piece=vs.VFLOOR_PIECE)
    except subprocess.CalledProcessError as e:
        unavailable(f"vfloor did not build with ISA-L (libisal-dev): {e.stderr.decode(errors='replace')[-300:]}")
    return vf, pool


def block_dir(root) -> str:
    """A FileMapper-shaped directory: the identity hashes the last four components."""
    d = os.path.join(str(root), "m_0123456789ab_r0", "abc", "de_g0")
    os.makedirs(d, exist_ok=True)
    return d


@pytest.mark.parametrize("direct", [False, True], ids=["buffered", "o_direct"])
def test_vfloor_store_records_and_kvtier_loads_it(vfloor, io_backend, tmp_path, direct):
    vf, pool = vfloor
    bs = 3 * 256 * KiB  # three buffered pieces: the CRC is chained across them
    path = os.path.join(block_dir(tmp_path), "abcdef0123.bin")
    vf.store([path], pool.mv, [bs], bs, direct)
    src = bytes(pool.mv[bs:2 * bs])
    crc = kvtier.crc32c(src)
    assert os.getxattr(path, "user.vllm.kv_crc32c") == crc.to_bytes(4, "big")
    assert os.getxattr(path, records.ID_XATTR_NAME) == records.identity_record(path, bs, crc)
    assert os.listdir(os.path.dirname(path)) == ["abcdef0123.bin"]  # the temp renamed away
    got = bytearray(bs)
    io_backend.batch_load_block([path], memoryview(got), [0], bs, False, "strict")
    assert got == src


def test_vfloor_crc_check_value(vfloor, tmp_path):
    """The record of b"123456789" carries the CRC-32C check value (design.md)."""
    vf, pool = vfloor
    pool.a[:9] = list(b"123456789")
    path = os.path.join(block_dir(tmp_path), "0123.bin")
    vf.store([path], pool.mv, [0], 9, False)
    assert os.getxattr(path, "user.vllm.kv_crc32c") == bytes.fromhex("e3069283")
    assert os.getxattr(path, records.ID_XATTR_NAME)[8:] == bytes.fromhex("e3069283")
    assert open(path, "rb").read() == b"123456789"


def test_vfloor_loads_and_verifies_kvtier_blocks(vfloor, io_backend, tmp_path):
    vf, pool = vfloor
    bs = 64 * KiB
    d = block_dir(tmp_path)
    good, bad, plain = (os.path.join(d, f"{n}.bin") for n in ("aa01", "aa02", "aa03"))
    io_backend.batch_store_block([good, bad], pool.mv, [0, bs], bs, False, True)
    io_backend.batch_store_block([plain], pool.mv, [0], bs, False, False)
    pool.a[2 * bs:3 * bs] = 0
    vf.load([good], pool.mv, [2 * bs], bs, False)
    assert pool.mv[2 * bs:3 * bs] == pool.mv[0:bs]
    with open(bad, "r+b") as f:  # one flipped bit
        f.seek(1000)
        b = f.read(1)
        f.seek(1000)
        f.write(bytes([b[0] ^ 0x10]))
    with pytest.raises(OSError) as ei:
        vf.load([bad], pool.mv, [2 * bs], bs, False)
    assert ei.value.errno == errno.EBADMSG and ei.value.filename == bad
    with pytest.raises(OSError) as ei:  # no records: not a verified block
        vf.load([plain], pool.mv, [2 * bs], bs, False)
    assert ei.value.errno == errno.ENODATA
    moved = os.path.join(d, "aa04.bin")  # the right bytes under another name: the identity differs
    os.rename(good, moved)
    with pytest.raises(OSError) as ei:
        vf.load([moved], pool.mv, [2 * bs], bs, False)
    assert ei.value.errno == errno.EBADMSG


def test_build_vfloor_self_check(vs, vfloor, tmp_path):
    _, pool = vfloor
    so_dir, disk = tmp_path / "so", tmp_path / "disk"
    so_dir.mkdir()
    disk.mkdir()
    vf, note = vs.build_vfloor(str(so_dir), str(disk), pool)
    assert vf is not None and "self-check passed" in note, note
    assert os.listdir(disk) == []  # the check's files removed


@pytest.mark.vllm
def test_vs_vllm_quick_run_has_vfloor(tmp_path):
    """A quick run of the direct and 4 KiB cells prints the vfloor column with numbers
    and, per target, kvtier / vLLM, vfloor / vLLM and kvtier / vfloor."""
    if importlib.util.find_spec("vllm") is None or importlib.util.find_spec("torch") is None:
        unavailable("vLLM 0.33 and torch (CPU) are needed for the peer column")
    r = subprocess.run([sys.executable, SCRIPT, "--quick", "--only", "direct,small", "--small-blocks", "200",
                        "--pool-mib", "32", "--dir", str(tmp_path)], capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-2000:]
    out = r.stdout
    assert "verified floor: vfloor: " in out and "self-check passed" in out, out[:2000]
    head = next(line for line in out.splitlines() if line.startswith("| cell "))
    assert re.search(r"\| +floor wall \|.*\| +vfloor wall \|", head), head
    rows = [line for line in out.splitlines() if re.match(r"\| (load|store) ", line)]
    assert len(rows) == 4 + 2  # 256 KiB and 4 MiB load/store, the 4 KiB batch load/store
    cols = head.split("|")
    at = next(i for i, c in enumerate(cols) if c.strip() == "vfloor wall")
    for line in rows:
        wall = float(line.split("|")[at].split("[")[0])
        assert wall > 0, line
    num = r"\d+\.\d\d"
    assert re.search(rf"- O_DIRECT 256 KiB-16 MiB wall <= 1\.00x: worst {num}x", out), out
    assert len(re.findall(rf"^  \| (load|store) \S+ \S+ +\| +{num} \| +{num} \| +{num} \| (met|NOT met)", out,
                          re.M)) == 4, out
    for op in ("load", "store"):
        assert re.search(rf"- 4 KiB batch {op} <= 1\.10x: {num}x: .*; vfloor/vLLM {num}, on/vfloor {num}$", out,
                         re.M), out
    assert os.listdir(tmp_path) == []


def test_build_vfloor_skips_with_a_reason(vs, vfloor, tmp_path, monkeypatch):
    """A vfloor that does not build, or that builds but writes another identity than
    kvtier's (here: a wrong CRC in its identity record), is left out with the reason, not timed."""
    _, pool = vfloor
    for n, (old, new, why) in enumerate((
            ("#include <isa-l/crc.h>", "#include <isa-l/no_such_header.h>", "no_such_header.h"),
            ("be32(id + 8, c);", "be32(id + 8, c ^ 1);", "self-check failed"))):
        so_dir, disk = tmp_path / f"so{n}", tmp_path / f"disk{n}"
        so_dir.mkdir()
        disk.mkdir()
        monkeypatch.setattr(vs, "VFLOOR_C", vs.VFLOOR_C.replace(old, new))
        vf, note = vs.build_vfloor(str(so_dir), str(disk), pool)
        monkeypatch.undo()
        assert vf is None and why in note, note
        assert os.listdir(disk) == []  # a failed check's files removed too
