"""The C core's job state word (csrc/block/job_state.h): job_state_cas and the
commit sections of batch_load_block / batch_store_block(job_state=...).

The Python fallback's side of the same contract is kvtier.fallback's (tested
with it); these tests call kvtier._C directly."""
import errno
import os
import threading
import time

import numpy as np
import pytest

_C = pytest.importorskip("kvtier._C")

LIVE, COMMITTING, EXPIRED, DONE = 0, 1, 2, 3


def _word(buf) -> int:
    return int(np.frombuffer(buf, dtype=np.uint32, count=1)[0])


def _phase_and_blocks(buf):
    """(phase, blocks counted) of a job state word: blocks << 2 | phase."""
    w = _word(buf)
    return w & 3, w >> 2


def test_constants_and_cas():
    assert (_C.JOB_LIVE, _C.JOB_COMMITTING, _C.JOB_EXPIRED, _C.JOB_DONE) == (LIVE, COMMITTING, EXPIRED, DONE)
    buf = bytearray(8)
    assert _C.job_state_cas(buf, LIVE, COMMITTING) is True
    assert _word(buf) == COMMITTING
    assert _C.job_state_cas(buf, LIVE, EXPIRED) is False  # held COMMITTING
    assert _word(buf) == COMMITTING
    assert _C.job_state_cas(buf, COMMITTING, LIVE) is True
    arr = np.zeros(2, dtype=np.int32)
    assert _C.job_state_cas(arr, LIVE, DONE) is True
    assert arr[0] == DONE and arr[1] == 0  # only the first word


def test_cas_bad_arguments():
    with pytest.raises(BufferError, match="buf must be a writable buffer"):
        _C.job_state_cas(b"\0" * 8, 0, 1)  # read-only
    with pytest.raises(TypeError, match="buf must be a writable buffer"):
        _C.job_state_cas(8, 0, 1)
    with pytest.raises(ValueError, match=">= 4 bytes"):
        _C.job_state_cas(bytearray(2), 0, 1)
    with pytest.raises(ValueError, match="4-byte aligned"):
        _C.job_state_cas(memoryview(bytearray(16))[1:9], 0, 1)
    with pytest.raises(ValueError, match="new must be in"):
        _C.job_state_cas(bytearray(8), 0, 2**32)
    with pytest.raises(ValueError, match="old must be in"):
        _C.job_state_cas(bytearray(8), -1, 0)
    with pytest.raises(TypeError):
        _C.job_state_cas(bytearray(8), 0)
    with pytest.raises(BufferError, match="job_state must be a writable buffer"):
        _C.batch_load_block([], [], job_state=b"\0" * 8)


def _store(d, n, bs, seed=1):
    rng = np.random.default_rng(seed)
    data = rng.integers(0, 256, size=(n, bs), dtype=np.uint8)
    paths = [os.path.join(d, f"b{i}.bin") for i in range(n)]
    _C.batch_store_block([p + ".tmp" for p in paths], paths, list(data), True, True, job_state=bytearray(8))
    return paths, data


@pytest.mark.parametrize("use_o_direct", [True, False])
@pytest.mark.parametrize("checksum", [True, False])
@pytest.mark.parametrize("bs", [4096, 12345, 3 << 20])
def test_round_trip_under_job_state(tmp_path, use_o_direct, checksum, bs):
    paths, data = _store(str(tmp_path), 3, bs)
    js = bytearray(8)
    out = np.zeros_like(data)
    assert _C.batch_load_block(paths, list(out), use_o_direct, checksum, job_state=js) == 0
    assert np.array_equal(out, data)
    assert _phase_and_blocks(js) == (LIVE, 3)  # every commit section gave it back; 3 blocks counted


def test_expired_before_start(tmp_path):
    paths, data = _store(str(tmp_path), 2, 8192)
    js = bytearray(8)
    assert _C.job_state_cas(js, LIVE, EXPIRED)
    out = np.zeros_like(data)
    with pytest.raises(OSError) as ei:
        _C.batch_load_block(paths, list(out), True, True, job_state=js)
    assert ei.value.errno == errno.ETIMEDOUT and ei.value.num_succeeded == 0 and ei.value.filename == paths[0]
    assert not out.any()
    assert all(os.path.exists(p) for p in paths)  # a deadline never removes a block
    dest = os.path.join(str(tmp_path), "new.bin")
    with pytest.raises(OSError) as ei:
        _C.batch_store_block([dest + ".tmp"], [dest], [data[0]], True, True, job_state=js)
    assert ei.value.errno == errno.ETIMEDOUT and ei.value.num_succeeded == 0
    assert sorted(os.listdir(tmp_path)) == ["b0.bin", "b1.bin"]  # no temp, no block


def _expire_at(js, blocks, view, snap):
    """Expire the job as soon as it counted ``blocks`` loaded blocks (CAS LIVE ->
    EXPIRED keeping the count, spinning while COMMITTING, as
    kvtier.io.JobState.expire does; polling the word, not a clock, so a loaded
    machine that wakes this thread late does not miss the batch), then
    snapshot the view and the count."""
    while True:
        w = _word(js)
        if w >> 2 >= blocks and w & 3 == LIVE and _C.job_state_cas(js, w, (w & ~3) | EXPIRED):
            break  # COMMITTING: a piece is being copied; it gives the word back when done
    snap.append(view.copy())
    snap.append(w >> 2)


def _expire_after(js, delay_s, view, snap):
    """Expire the job after ``delay_s`` seconds (a store counts no blocks)."""
    time.sleep(delay_s)
    _expire_at(js, 0, view, snap)


@pytest.mark.parametrize("use_o_direct", [True, False])
def test_no_byte_after_expiry(tmp_path, use_o_direct):
    """A load expired mid-batch stops at a commit point: the view is exactly
    what it was when expire() returned, the blocks counted in the word when it
    expired are num_succeeded and whole, the ones after the failing block
    untouched."""
    n, bs = 48, 1 << 20
    paths, data = _store(str(tmp_path), n, bs)
    for at in (1, 4, 12, 24, 1, 4, 12, 24):
        js = bytearray(8)
        out = np.zeros_like(data)
        snap = []
        t = threading.Thread(target=_expire_at, args=(js, at, out, snap))
        t.start()
        try:
            _C.batch_load_block(paths, list(out), use_o_direct, True, job_state=js)
            t.join()
            continue  # the rest loaded before the expiring thread ran: try again
        except OSError as e:
            t.join()
            assert e.errno == errno.ETIMEDOUT, e
            k = e.num_succeeded
            assert k >= at
            assert np.array_equal(out, snap[0])  # nothing written after expire() returned
            assert snap[1] == k  # the count read at expiry is the call's own partial keep
            assert np.array_equal(out[:k], data[:k])
            assert not out[k + 1:].any()
            assert _phase_and_blocks(js) == (EXPIRED, k)
            return
    pytest.fail("48 x 1 MiB loaded to the end 8 times before the expiring thread ran: cannot observe an expiry")


def test_store_expired_mid_batch(tmp_path):
    """A store expired between blocks publishes nothing more and leaves no temp."""
    d = str(tmp_path)
    n, bs = 64, 256 << 10
    rng = np.random.default_rng(3)
    data = rng.integers(0, 256, size=(n, bs), dtype=np.uint8)
    paths = [os.path.join(d, f"s{i}.bin") for i in range(n)]
    js = bytearray(8)
    snap = []
    t = threading.Thread(target=_expire_after, args=(js, 0.005, data, snap))
    t.start()
    try:
        _C.batch_store_block([p + ".tmp" for p in paths], paths, list(data), True, True, durable=True, job_state=js)
        t.join()
        pytest.fail("64 durable stores finished within 5 ms: cannot observe an expiry")
    except OSError as e:
        t.join()
        assert e.errno == errno.ETIMEDOUT
        k = e.num_succeeded
        names = sorted(os.listdir(d))
        assert names == sorted(f"s{i}.bin" for i in range(k))  # published: exactly the first k, no temps
        for i in range(k):
            with open(paths[i], "rb") as f:
                assert f.read() == data[i].tobytes()
