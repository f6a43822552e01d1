"""kvtier._tier.deadline: calls with a deadline on threads that may be abandoned."""
from __future__ import annotations

import errno
import threading
import time

import pytest

from kvtier._tier.deadline import DEFAULT_IO_TIMEOUT_S, OffThread, check_timeout


def test_check_timeout():
    assert check_timeout(0) == 0.0 and check_timeout(2) == 2.0 and check_timeout(0.25) == 0.25
    assert DEFAULT_IO_TIMEOUT_S > 0
    for bad in (True, "1", None):
        with pytest.raises(TypeError, match="io_timeout_s"):
            check_timeout(bad)
    assert check_timeout(threading.TIMEOUT_MAX) == threading.TIMEOUT_MAX
    for bad in (-1, float("nan"), float("inf"), 1e10, 1e300, 2**64):
        with pytest.raises(ValueError, match="io_timeout_s must be >= 0 and at most 9223372036 s"):
            check_timeout(bad)


@pytest.mark.timeout(30)
def test_offthread_result_error_timeout_and_fail_fast():
    ot = OffThread("t", max_stuck=2)
    assert ot.call(lambda a, b: a + b, 2, 3, timeout=5, what="x", path="/p") == 5
    with pytest.raises(KeyError):
        ot.call({}.__getitem__, "k", timeout=5, what="x", path="/p")
    gate = threading.Event()
    t0 = time.monotonic()
    with pytest.raises(TimeoutError) as ei:
        ot.call(gate.wait, timeout=0.2, what="probe of /root", path="/root")
    assert 0.2 <= time.monotonic() - t0 < 2
    assert ei.value.errno == errno.ETIMEDOUT and ei.value.filename == "/root"
    assert "probe of /root" in str(ei.value)
    assert ot.stuck == 1
    assert ot.call(lambda: 7, timeout=5, what="x", path="/p") == 7  # another thread serves
    with pytest.raises(TimeoutError):
        ot.call(gate.wait, timeout=0.1, what="x", path="/p")
    assert ot.stuck == 2
    ran = []
    t0 = time.monotonic()
    with pytest.raises(TimeoutError, match="still stuck"):  # the cap: fail fast, nothing started
        ot.call(ran.append, 1, timeout=5, what="x", path="/p")
    assert ran == [] and time.monotonic() - t0 < 1
    gate.set()  # the filesystem answers: the stuck threads end
    end = time.monotonic() + 5
    while ot.stuck and time.monotonic() < end:
        time.sleep(0.01)
    assert ot.stuck == 0
    assert ot.call(lambda: 8, timeout=5, what="x", path="/p") == 8
    ot.close()


def test_offthread_without_deadline_runs_on_the_caller():
    ot = OffThread("t", max_stuck=1)
    assert ot.call(threading.get_ident, timeout=0, what="x", path="/p") == threading.get_ident()
    assert ot.call(threading.get_ident, timeout=1, what="x", path="/p") != threading.get_ident()


@pytest.mark.timeout(30)
def test_offthread_cap_holds_for_concurrent_callers():
    """6 callers at once on a call that hangs, cap 1: one thread gets stuck, not 6; the
    others fail (ETIMEDOUT) without starting; once it returns, calls run again."""
    ot = OffThread("t", max_stuck=1)
    gate = threading.Event()
    started = []
    errs = []

    def hang():
        started.append(1)
        gate.wait(20)

    def caller():
        try:
            ot.call(hang, timeout=0.3, what="x", path="/p")
        except OSError as e:
            errs.append(e)

    ts = [threading.Thread(target=caller) for _ in range(6)]
    for t in ts:
        t.start()
    for t in ts:
        t.join(10)
    assert len(started) == 1 and ot.stuck == 1
    assert len(errs) == 6 and all(e.errno == errno.ETIMEDOUT for e in errs)
    assert sum(getattr(e, "started", True) for e in errs) == 1  # one asked the filesystem
    gate.set()
    end = time.monotonic() + 5
    while ot.stuck and time.monotonic() < end:
        time.sleep(0.01)
    assert ot.stuck == 0 and ot.call(lambda: 9, timeout=5, what="x", path="/p") == 9
    ot.close()
