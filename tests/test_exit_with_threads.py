"""A process that ends while acco_ds's threads are inside a C++ call still exits with status 0.

At finalisation CPython ends a daemon thread that takes the GIL back with pthread_exit; inside
pybind11's noexcept GIL guard (a store or gloo call returning) that is ``std::terminate``: SIGABRT,
"terminate called without an active exception", in a job that trained fine (seen in CI on the
resume phase of tests/test_reliability_checkpoint.py). acco_ds joins its heartbeat and worker threads
at exit (``core.liveness`` / ``core.comm`` atexit hooks). Here the heartbeat thread is held inside a
blocking store call (``TCPStore.wait`` on a key never set) when the main thread returns, and the
call returns while the interpreter finalises (an object's ``__del__`` keeps finalisation busy). Without
the hooks this exits with SIGABRT (rc -6) and "terminate called without an active exception".
"""

from __future__ import annotations

import subprocess
import sys
import textwrap
import time

from tests.launch import REPO, free_port

SCRIPT = textwrap.dedent(
    """
    import sys, time
    from datetime import timedelta
    import torch.distributed as dist
    from acco_ds.core.liveness import PeerMonitor

    class SlowStore:
        '''A TCPStore whose multi_get first blocks ~2 s in C++ (GIL released).'''
        def __init__(self, store):
            self.store = store
        def clone(self):
            return SlowStore(self.store.clone())
        def set_timeout(self, t):
            self.store.set_timeout(t)
        def add(self, key, n):
            return self.store.add(key, n)
        def multi_get(self, keys):
            try:
                self.store.wait(["never-set"], timedelta(seconds=2))
            except Exception:
                pass
            print("SLOW_CALL_RETURNED", flush=True)
            return self.store.multi_get(keys)

    store = dist.TCPStore("127.0.0.1", int(sys.argv[1]), 1, is_master=True, timeout=timedelta(seconds=30))
    monitor = PeerMonitor([0], 0, 0.2, prefix="t", store=SlowStore(store))
    monitor.start()

    class SlowTeardown:
        # in a module of its own, cleared (unlike __main__, which the thread keeps alive) while the
        # interpreter finalises: it keeps finalisation busy until the store call has returned
        def __del__(self, sleep=time.sleep):
            sleep(3)

    import types
    slowmod = types.ModuleType("slowmod")
    slowmod.teardown = SlowTeardown()
    sys.modules["slowmod"] = slowmod
    del slowmod
    time.sleep(0.5)  # the heartbeat thread is inside store.wait now
    print("MAIN_RETURNS", flush=True)
    """
)


def test_exit_while_the_heartbeat_thread_is_in_a_store_call():
    t0 = time.monotonic()
    proc = subprocess.run(
        [sys.executable, "-c", SCRIPT, str(free_port())], cwd=REPO, capture_output=True, text=True, timeout=60
    )
    took = time.monotonic() - t0
    out = proc.stdout + proc.stderr
    assert "MAIN_RETURNS" in out
    assert proc.returncode == 0, f"rc={proc.returncode}\n{out[-2000:]}"
    assert "terminate called" not in out
    assert "SLOW_CALL_RETURNED" in out  # the exit waited for the thread to leave the call
    assert took < 30, f"the exit took {took:.1f} s"


def test_thread_executor_close_drains_and_joins():
    from acco_ds.core.comm import _OPEN_EXECUTORS, ThreadExecutor

    ex = ThreadExecutor(group=None, timeout_s=10.0)
    assert ex in _OPEN_EXECUTORS
    done = []
    ex.launch("slow", lambda: (time.sleep(0.3), done.append(1)))
    ex.launch("second", lambda: done.append(2))
    ex.close()
    assert done == [1, 2] and not ex._thread.is_alive() and ex not in _OPEN_EXECUTORS
    ex.close()  # idempotent
