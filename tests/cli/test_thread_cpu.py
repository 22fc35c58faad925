"""``cli.thread_cpu``: a thread's CPU time lands under its name, a thread that ended in between under ``ENDED``,
and a thread's time only from the first sample on."""

from __future__ import annotations

import threading
import time
from pathlib import Path

import pytest

from acco_ds.cli import thread_cpu

pytestmark = pytest.mark.skipif(
    not Path("/proc/self/task").is_dir(), reason="per-thread CPU needs Linux's /proc"
)

BURN_S = 0.3


def _burn(seconds: float) -> None:
    t0 = time.thread_time()
    while time.thread_time() - t0 < seconds:
        pass


def _gone_from_the_kernel(tid: int) -> None:
    deadline = time.monotonic() + 30
    while (Path("/proc/self/task") / str(tid)).exists():
        assert time.monotonic() < deadline, f"thread {tid} still in /proc/self/task 30 s after its join"
        time.sleep(0.01)


def test_each_threads_cpu_time_is_found_under_its_name():
    go, done, release = threading.Event(), threading.Event(), threading.Event()

    def busy():
        go.wait(30)
        _burn(BURN_S)
        done.set()
        release.wait(30)  # alive at the second sample

    def sleeper():
        go.wait(30)
        done.wait(30)

    threads = [
        threading.Thread(target=busy, name="burner", daemon=True),
        threading.Thread(target=sleeper, name="sleeper", daemon=True),
    ]
    for t in threads:
        t.start()
    before, p0 = thread_cpu.sample(), time.process_time()
    go.set()
    _burn(BURN_S)
    assert done.wait(30)
    threads[1].join(30)
    ended = threading.Thread(target=_burn, args=(BURN_S,), name="short-lived")
    ended.start()
    ended.join(30)
    _gone_from_the_kernel(ended.native_id)  # join() returns before the kernel has reaped the thread
    out = thread_cpu.by_name(before, thread_cpu.sample(), time.process_time() - p0)
    release.set()
    assert 0.9 * BURN_S <= out["burner"] < 2 * BURN_S
    me = threading.current_thread().name
    assert 0.9 * BURN_S <= out[me] < 2 * BURN_S  # counted from the first sample, not from the thread's start
    assert "sleeper" not in out  # it ended before the second sample: its (little) time is the ended threads'
    assert "short-lived" not in out
    assert out[thread_cpu.ENDED] >= 0.9 * BURN_S
    assert out[thread_cpu.ENDED] < 3 * BURN_S  # not the process's whole time


def test_nothing_without_a_second_sample():
    assert thread_cpu.by_name(thread_cpu.sample(), {}, 1.0) == {}
