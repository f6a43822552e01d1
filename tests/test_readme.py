"""The README's quick start and example stay true."""
import logging
import re
from pathlib import Path

import pytest

from ci import unavailable

ROOT = Path(__file__).resolve().parent.parent
README = (ROOT / "README.md").read_text()


def quick_start():
    block = re.search(r"## Quick start\n\n```sh\n(.*?)```", README, re.S).group(1)
    return [l for l in block.splitlines() if l and not l.startswith("#")]


def test_quick_start_is_two_commands_and_ci_runs_the_test_one():
    cmds = quick_start()
    assert len(cmds) == 2
    install_and_run, test = cmds
    assert install_and_run.endswith("kvtier bench")
    assert test.endswith("python -m pytest")
    ci = (ROOT / ".ci" / "run").read_text().splitlines()
    assert test in ci


def test_quick_start_says_how_long_the_suite_and_all_of_ci_take():
    """The test command's comment gives the time of the suite (CI's main stage: 10 min on 2
    cores at 099978b) and of all of .ci/run's stages (24.5 min there); it once said "about
    15 minutes", neither."""
    block = re.search(r"## Quick start\n\n```sh\n(.*?)```", README, re.S).group(1)
    comment = block.split("# install test dependencies", 1)[1].split("\nscripts/bootstrap --test", 1)[0]
    comment = " ".join(line.lstrip("# ") for line in comment.splitlines())
    suite = re.search(r"the whole test suite \(about (\d+) minutes on 2 cores\b", comment)
    all_ci = re.search(r"all of CI, \.ci/run: .* about (\d+) minutes once installed\)", comment)
    assert suite and all_ci, comment
    assert 5 <= int(suite.group(1)) < int(all_ci.group(1)) <= 45, comment  # CI's budget: 45 min on 2 cores
    stages = [ln for ln in (ROOT / ".ci" / "run").read_text().splitlines() if "pytest" in ln or ln.startswith("scripts/")]
    assert any("scripts/sanitize" in ln for ln in stages) and any("scripts/test-no-isal" in ln for ln in stages)


@pytest.mark.parametrize("checksum", ["as written", "off"])
def test_python_example_runs(tmp_path, caplog, recwarn, checksum):
    """The example runs as written, and with checksums off too (what a user may try next),
    without a warning: its buffer is page aligned, so its stores keep O_DIRECT
    (with np.zeros the tier warned "the primary buffer starts 16 bytes past a page")."""
    code = re.search(r"```python\n(.*?)```", README, re.S).group(1)
    assert '"/mnt/nvme/kv"' in code and "checksum_blocks=True" in code
    code = code.replace('"/mnt/nvme/kv"', repr(str(tmp_path / "kv")))
    if checksum == "off":
        code = code.replace("checksum_blocks=True", "checksum_blocks=False")
    printed = []
    ns = {"print": lambda *a: printed.append(a)}
    caplog.set_level(logging.WARNING)
    exec(compile(code, "README.md", "exec"), ns)
    assert ns["buf"].ctypes.data % 4096 == 0
    assert [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING] == []
    assert [str(w.message) for w in recwarn if not issubclass(w.category, (DeprecationWarning, ResourceWarning))] == []
    (stored,), (loaded,) = printed[0][0], printed[1][0]
    assert stored.success and stored.transfer_bytes == 2 << 20
    assert loaded.success and loaded.checksum_failed is False
    assert loaded.successful_keys == stored.successful_keys
    bins = list((tmp_path / "kv").rglob("00112233445566778899aabbccddeeff.bin"))
    assert len(bins) == 1 and bins[0].stat().st_size == 2 << 20


def readme_kv_transfer_config() -> str:
    return re.search(r"--kv-transfer-config '(.*?)'", README, re.S).group(1)


def test_use_with_vllm_config_is_plain_json():
    """The README's --kv-transfer-config pastes anywhere JSON goes (a config file,
    ``KVTransferConfig(**json.loads(...))``): no vLLM-only ``8G``."""
    import json

    cfg = json.loads(readme_kv_transfer_config())
    assert cfg["kv_connector"] == "OffloadingConnector" and cfg["kv_role"] == "kv_both"
    extra = cfg["kv_connector_extra_config"]
    assert extra["spec_name"] == "TieringOffloadingSpec"
    assert extra["cpu_bytes_to_use"] == 8 * 2**30 and isinstance(extra["cpu_bytes_to_use"], int)
    assert extra["secondary_tiers"] == [{"type": "kvtier", "root_dir": "/mnt/nvme/kv"}]


@pytest.mark.vllm
def test_use_with_vllm_command_is_a_config_vllm_accepts():
    """The README's `vllm serve ... --kv-transfer-config '...'` JSON, read the way vLLM 0.33
    reads it (human-readable numbers such as 8G expanded first), gives an integer
    cpu_bytes_to_use (a quoted "8G" stays a string and fails int() in vLLM's CPU spec) and
    a kvtier secondary tier."""
    import json

    try:
        from vllm.engine.arg_utils import _expand_json_human_readable_numbers as expand
    except ImportError as e:
        unavailable(f"vLLM 0.33 is not installed: {e}")
    extra = json.loads(expand(readme_kv_transfer_config()))["kv_connector_extra_config"]
    assert extra["cpu_bytes_to_use"] == 8 * 2**30
    assert int(extra["cpu_bytes_to_use"]) == 8 * 2**30
    assert extra["secondary_tiers"] == [{"type": "kvtier", "root_dir": "/mnt/nvme/kv"}]


def _readme_prose() -> str:
    """The README's text with its line breaks as spaces (claims span lines)."""
    return " ".join(README.split())


@pytest.mark.parametrize("backend", ["c", "python"])
def test_what_strict_covers_is_what_the_readme_says(tmp_path, backend):
    """The README's claim is exact (it said that with "strict" kvtier never hands back a wrong
    byte "of any block"): the identity record alone binds a block to its name, so two blocks
    whose files are swapped are refused (EBADMSG, identity) while they carry it, and load
    each other's bytes, verified, in strict mode too, once it is removed (their only record
    user.vllm.kv_crc32c); strict refuses a block with no CRC record (ENODATA)."""
    import errno
    import os

    import numpy as np

    from kvtier import io as kio

    prose = _readme_prose()
    assert "of any block" not in prose
    assert "Only `user.kvtier.id` binds a block to its name (layout directory, rank, key) and size" in prose
    assert ("two such blocks whose files were swapped each load the other's bytes" in prose
            and "Strict mode refuses blocks with no CRC record; it does not cover these two" in prose)
    io = kio.for_backend(backend)
    bs = 8192
    data = np.random.default_rng(5).integers(0, 256, 2 * bs, dtype=np.uint8)
    paths = [str(tmp_path / "m_0123456789ab_r0" / "abc" / "de_g0" / f"{n}.bin") for n in ("a" * 32, "b" * 32)]

    def swap():
        os.rename(paths[0], paths[0] + ".x")
        os.rename(paths[1], paths[0])
        os.rename(paths[0] + ".x", paths[1])

    def strict_load(p):
        out = np.zeros(bs, np.uint8)
        io.batch_load_block([p], out, [0], bs, use_o_direct=False, checksum="strict")
        return out.tobytes()

    io.batch_store_block(paths, data, [0, bs], bs, use_o_direct=False, checksum=True)
    swap()  # records intact: each file's identity record names the other key
    with pytest.raises(OSError) as ei:
        strict_load(paths[0])
    assert ei.value.errno == errno.EBADMSG and ei.value.condemned == "identity" and not os.path.exists(paths[0])
    os.unlink(paths[1])
    io.batch_store_block(paths, data, [0, bs], bs, use_o_direct=False, checksum=True)
    for p in paths:
        os.removexattr(p, "user.kvtier.id")
    swap()  # only user.vllm.kv_crc32c: the bytes verify, under the other name (the uncovered case)
    assert strict_load(paths[0]) == data[bs:].tobytes() and strict_load(paths[1]) == data[:bs].tobytes()
    os.removexattr(paths[0], "user.vllm.kv_crc32c")  # no CRC record at all: strict refuses it
    with pytest.raises(OSError) as ei:
        strict_load(paths[0])
    assert ei.value.errno == errno.ENODATA and os.path.exists(paths[0])


def test_the_readme_exit_statuses_are_each_commands():
    """The README's exit statuses are true of every command (it said "1 a check failed" of
    every command, but ``kvtier doctor`` exits 2 for a failed check: its --help says so), and
    ``kvtier --help`` says the same."""
    import subprocess
    import sys

    prose = _readme_prose()
    assert "Exit status of every command:" not in prose
    assert ("Exit status of every command but `kvtier doctor`: 0 done (clean), 1 a check failed or found "
            "something (each command's `--help` says what), 2 bad arguments; `kvtier doctor`: 0 every check "
            "passed, 1 a warning, 2 a failed check (kvtier cannot run on that mount) or bad arguments.") in prose
    doctor = " ".join(subprocess.run([sys.executable, "-m", "kvtier", "doctor", "--help"], capture_output=True,
                                     text=True, check=True).stdout.split())
    assert "Exit status: 0 every check passed; 1 a warning; 2 kvtier cannot run there (a failed check," in doctor
    top = " ".join(subprocess.run([sys.executable, "-m", "kvtier", "--help"], capture_output=True, text=True,
                                  check=True).stdout.split())
    assert ("Exit status of every command but doctor: 0 done (clean); 1 a check failed or found something (each "
            "command's --help says what); 2 bad arguments. doctor: 0 every check passed, 1 a warning, 2 a failed "
            "check (kvtier cannot run there) or bad arguments.") in top
