"""Without the C core (kvtier._C not importable, as on a machine where it was not built):
checksummed block I/O, the tier and `kvtier info` work on the pure-Python fallback.

The C core is made unimportable in a subprocess by ``sys.modules['kvtier._C'] = None``
before ``import kvtier``: the import then fails with ImportError, and kvtier/__init__.py
sets ``kvtier._C = None`` exactly as on such a machine."""
import os
import re
import subprocess
import sys
import textwrap

import kvtier

NO_C = "import sys\nsys.modules['kvtier._C'] = None\nimport warnings\nwarnings.simplefilter('ignore')\n"


def run_no_c(code, *args):
    r = subprocess.run([sys.executable, "-c", NO_C + textwrap.dedent(code), *args],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, (r.returncode, r.stdout, r.stderr[-3000:])
    return r.stdout


def test_checksummed_store_and_load_without_the_c_core(tmp_path):
    out = run_no_c("""
        import errno, os
        import numpy as np
        import kvtier, kvtier.io as kio
        assert kvtier._C is None and kio.backend == "python", (kvtier._C, kio.backend)
        root = sys.argv[1]
        bs = 8192
        src = np.random.default_rng(3).integers(0, 256, (2, bs), dtype=np.uint8)
        paths = [os.path.join(root, "a"), os.path.join(root, "b")]
        kio.batch_store_block(paths, memoryview(src).cast("B"), [0, bs], bs, checksum=True)
        dst = np.zeros_like(src)
        n = kio.batch_load_block(paths, memoryview(dst).cast("B"), [0, bs], bs, checksum=True)
        print(n, dst.tobytes() == src.tobytes())
        for p in paths:
            print(os.getxattr(p, "user.vllm.kv_crc32c").hex(), "%08x" % kvtier.crc32c(open(p, "rb").read()))
        with open(paths[1], "r+b") as f:  # flip one byte of the second block
            f.seek(100); b = f.read(1); f.seek(100); f.write(bytes([b[0] ^ 0xFF]))
        try:
            kio.batch_load_block(paths, memoryview(dst).cast("B"), [0, bs], bs, checksum=True)
            print("loaded")
        except OSError as e:
            print("refused", errno.errorcode[e.errno], e.num_succeeded)
    """, str(tmp_path))
    lines = out.splitlines()
    assert lines[0] == "0 True"  # no re-read needed, bytes equal
    # the fallback's CRC is the C core's (checked here in the parent, where _C is built)
    for line in lines[1:3]:
        xattr, crc_py = line.split()
        assert xattr == crc_py and len(xattr) == 8
    assert lines[3] == "refused EBADMSG 1"
    # the fallback's CRC there is CRC32C: the C core's value here for block "a" (unchanged)
    assert int(lines[1].split()[0], 16) == kvtier.crc32c((tmp_path / "a").read_bytes())


def test_checksummed_tier_without_the_c_core(tmp_path):
    out = run_no_c("""
        import os
        import numpy as np
        import kvtier
        from kvtier.manager import FileSystemTierManager, TransferJob
        assert kvtier._C is None
        buf = np.random.default_rng(5).integers(0, 256, (4, 16384), dtype=np.uint8)
        orig = buf.copy()
        m = FileSystemTierManager(buf, sys.argv[1], "test/model", checksum_blocks=True,
                                  n_read_threads=1, n_write_threads=1)
        keys = [(i.to_bytes(8, "big") + b"\\xab" * 8, 0) for i in range(4)]
        m.submit_store(TransferJob(1, keys, [0, 1, 2, 3]))
        assert m.drain_jobs(timeout=30)
        r, = m.get_finished_jobs()
        print("store", r.success, r.error)
        p = m.file_mapper.get_file_name(keys[2])
        print(os.getxattr(p, "user.vllm.kv_crc32c").hex(), "%08x" % kvtier.crc32c(orig[2]))
        buf[:] = 0
        m.submit_load(TransferJob(2, keys, [3, 2, 1, 0]))
        assert m.drain_jobs(timeout=30)
        r, = m.get_finished_jobs()
        print("load", r.success, r.error, r.checksum_failed, buf[3].tobytes() == orig[0].tobytes(),
              buf[0].tobytes() == orig[3].tobytes())
        m.shutdown()
    """, str(tmp_path))
    store, crc, load = out.splitlines()
    assert store == "store True None"
    a, b = crc.split()
    assert a == b and len(a) == 8
    assert load == "load True None False True True"


def test_info_without_the_c_core_says_so_and_why():
    out = run_no_c("""
        sys.argv = ["kvtier", "info"]
        from kvtier.cli import main
        main(["info"])
    """)
    assert "C core:         NOT importable, using the pure-Python fallback (import of kvtier._C halted; None in sys.modules)" in out
    isal = [line for line in out.splitlines() if line.startswith("ISA-L:")]
    assert isal == ["ISA-L:          unknown: the C core is not importable "
                    "(import of kvtier._C halted; None in sys.modules)"], out
    assert "libisal not found" not in out
    assert "I/O engine:     not available: the C core is not importable" in out


def test_the_fallbacks_block_io_tests_pass_without_the_c_core():
    """The fallback is an independent implementation: its block-I/O and deadline tests (the
    ``python`` half of the io_backend-parametrised tests) pass with kvtier._C unimportable
    (tests/conftest.py, KVTIER_TEST_NO_C=1), so nothing of the C core is borrowed."""
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = dict(os.environ, KVTIER_TEST_NO_C="1", PYTHONWARNINGS="ignore")
    env.pop("KVTIER_IO_BACKEND", None)
    r = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:randomly", "-p", "no:cacheprovider",
                        "-k", "python and not c] and not test_c_identity", "tests/test_block_io.py", "tests/test_late_io.py",
                        "tests/test_policy.py"],
                       capture_output=True, text=True, timeout=900, cwd=root, env=env)
    tail = r.stdout[-3000:]
    assert r.returncode == 0, tail + r.stderr[-2000:]
    passed = int(re.search(r"(\d+) passed", tail).group(1))
    assert passed >= 100, tail  # the python half ran, not skipped
