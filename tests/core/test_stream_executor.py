"""``core.comm.StreamExecutor`` on a stand-in for ``torch.cuda`` (this machine has no GPU; tests/gpu run the real
one): the training thread only records the launch event and queues the job; the worker thread makes the side stream
wait for that event, enqueues the job with the side stream current, and records the done event after it; ``wait``
makes the compute stream wait for the done event; ``done`` queries it; a job that raised surfaces in ``wait``."""

from __future__ import annotations

import threading

import pytest
import torch

from acco_ds.core import comm


class FakeEvent:
    def __init__(self, log):
        self.log, self.stream, self.complete = log, None, False

    def record(self, stream):
        self.stream = stream
        self.log.append(("record", stream.name, threading.get_ident()))

    def query(self):
        return self.complete

    def synchronize(self):
        self.log.append(("synchronize", self.stream.name, threading.get_ident()))


class FakeStream:
    def __init__(self, name, log):
        self.name, self.log = name, log

    def wait_event(self, event):
        self.log.append(("wait", self.name, event.stream.name, threading.get_ident()))


class FakeCuda:
    """What StreamExecutor uses of torch.cuda: streams, events, a thread-local current stream and device."""

    def __init__(self):
        self.log = []
        self.compute = FakeStream("compute", self.log)
        self._tls = threading.local()

    def current_stream(self, device=None):
        return getattr(self._tls, "stream", self.compute)

    def Stream(self, device=None, priority=0):  # noqa: N802 (torch's name)
        return FakeStream("side", self.log)

    def Event(self):  # noqa: N802
        return FakeEvent(self.log)

    def stream(self, s):
        fake = self

        class _Ctx:
            def __enter__(self):
                self.prev = fake.current_stream()
                fake._tls.stream = s

            def __exit__(self, *exc):
                fake._tls.stream = self.prev

        return _Ctx()

    def device(self, d):
        class _Ctx:
            def __enter__(self):
                return None

            def __exit__(self, *exc):
                return False

        return _Ctx()


@pytest.fixture
def cuda(monkeypatch):
    fake = FakeCuda()
    for name in ("current_stream", "Stream", "Event", "stream", "device"):
        monkeypatch.setattr(torch.cuda, name, getattr(fake, name))
    return fake


def test_the_worker_thread_enqueues_the_job_after_the_launch_event(cuda):
    ex = comm.StreamExecutor(group=None, timeout_s=10.0, device=torch.device("cuda", 0))
    me = threading.get_ident()
    seen = {}

    def job():
        seen["thread"] = threading.get_ident()
        seen["stream"] = torch.cuda.current_stream().name
        cuda.log.append(("job",))
        return "result"

    try:
        ticket = ex.launch("round 0", job)
        assert ticket.ready is not None and ticket.ready.stream.name == "compute"
        assert cuda.log[0] == ("record", "compute", me)  # the training thread's whole share
        assert ex.wait(ticket) == "result"
        assert seen == {"thread": ex._thread.ident, "stream": "side"}
        side = cuda.log[1:]
        assert side[0] == ("wait", "side", "compute", ex._thread.ident)  # ordered after the launch's kernels
        assert side[1] == ("job",)
        assert side[2] == ("record", "side", ex._thread.ident)  # done, after the job
        assert cuda.log[-1] == (
            "wait",
            "compute",
            "side",
            me,
        )  # wait(): the compute stream waits, not the host
        assert not ex.done(ticket)
        ticket.cuda_done.complete = True
        assert ex.done(ticket)
    finally:
        ex.close()


def test_jobs_run_in_order_and_a_failed_one_surfaces_in_wait(cuda):
    ex = comm.StreamExecutor(group=None, timeout_s=10.0, device=torch.device("cuda", 0))
    order = []

    def failing():
        order.append(1)
        raise RuntimeError("enqueue failed")

    try:
        t1 = ex.launch("round 1", failing)
        t2 = ex.launch("round 2", lambda: order.append(2))
        with pytest.raises(RuntimeError, match="round 1"):
            ex.wait(t1)
        ex.wait(t2)
        assert order == [1, 2]
    finally:
        ex.close()


def test_an_offloaded_step_waits_on_the_worker_thread_for_the_side_streams_copies(cuda):
    """Optimizer offload (``core.host_step.StreamCopies``): the host step's wait for its inputs is an event recorded
    on the side stream and synchronized by the worker thread, before the step reads the staging buffers; the
    training thread never synchronizes."""
    from acco_ds.core.host_step import HostStep, OffloadSpec, StreamCopies

    dev = torch.device("cuda", 0)
    ex = comm.StreamExecutor(group=None, timeout_s=10.0, device=dev)
    host = HostStep(1, dev, OffloadSpec(pin_memory=False), copies=StreamCopies(dev))
    grad, out = torch.arange(6.0), torch.zeros(6)  # CPU tensors stand in for the job's device buffers
    state = (torch.zeros(6), torch.zeros(6), torch.zeros(6))
    seen = {}

    def step(master, exp_avg, exp_avg_sq, *, out, grad):
        cuda.log.append(("step",))
        seen["grad"] = grad.clone()
        out.copy_(grad * 2)

    me = threading.get_ident()
    try:
        ticket = ex.launch("round 0", lambda: host.run(0, step, state, {"grad": grad}, out))
        ex.wait(ticket)
    finally:
        ex.close()
    worker = ex._thread.ident
    side = [e for e in cuda.log if e[-1] == worker or e == ("step",)]
    assert side == [
        ("wait", "side", "compute", worker),
        ("record", "side", worker),  # after the copies to the host, on the side stream
        ("synchronize", "side", worker),  # the worker thread's wait, not the training thread's
        ("step",),
        ("record", "side", worker),  # the job's done event, after the copy back
    ]
    assert not any(e[0] == "synchronize" and e[-1] == me for e in cuda.log)
    assert torch.equal(seen["grad"], grad) and torch.equal(out, grad * 2)


def test_the_cuda_module_is_the_executors_argument(monkeypatch):
    """``StreamExecutor(cuda=...)`` takes its streams and events from that module alone (the CPU test mode passes
    ``core.emulated_stream.EmulatedCuda``): ``torch.cuda`` is not touched."""

    def untouchable(*args, **kwargs):
        raise AssertionError("torch.cuda used although the executor was given its own cuda module")

    for name in ("current_stream", "Stream", "Event", "stream", "device"):
        monkeypatch.setattr(torch.cuda, name, untouchable)
    fake = FakeCuda()
    ex = comm.StreamExecutor(group=None, timeout_s=10.0, device=torch.device("cuda", 0), cuda=fake)
    try:
        ticket = ex.launch("round 0", lambda: "result")
        assert ex.wait(ticket) == "result"
    finally:
        ex.close()
    assert [e[0] for e in fake.log] == ["record", "wait", "record", "wait"]
