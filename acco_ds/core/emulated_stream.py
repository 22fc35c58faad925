"""What ``core.comm.StreamExecutor`` uses of ``torch.cuda``, emulated for CPU ranks: a CPU test mode of the CUDA
executor.

``ACCO_DS_EMULATED_STREAM_EXECUTOR=1`` makes ``core.comm.make_executor`` give a CPU rank the ``StreamExecutor`` a
GPU rank gets, on an :class:`EmulatedCuda` instead of ``torch.cuda``: the same worker thread, launch event, side
stream, done event, ``done`` and ``wait``, so the executor's hand-offs and every caller's branch on a ticket's
events (``Ticket.ready`` / ``Ticket.cuda_done``) run in whole training runs on CPU.

The emulation, and what it stands for:

- Streams (:class:`EmulatedStream`): the compute stream is each thread's default current stream; ``Stream()``
  makes a side stream; ``stream(s)`` sets the current stream of the calling thread only (thread-local, as in
  CUDA). CPU ops run synchronously on the thread that issues them: the work "enqueued" on a stream is done when
  the call returns.
- Device asynchrony: an event recorded on a side stream completes only ``delay_s`` seconds after it was recorded
  (``ACCO_DS_EMULATED_STREAM_DELAY_S``, default :data:`DEFAULT_DELAY_S`), and never before an event recorded
  earlier on that stream. So ``StreamExecutor.done`` stays False for a while after the worker thread finished
  enqueueing a job, as on a GPU where the host is ahead of the device. And however late it is looked at, a
  side-stream event (``delay_s`` > 0) is found not yet complete at its first look (``query``, ``synchronize`` or a
  stream's ``wait_event``): a loaded host that reaches a wait after ``delay_s`` still meets the device behind it, so
  every run exercises the asynchrony. Events recorded on the compute stream complete when recorded (the compute
  stream's work is the training thread's, done by then).
- Waits: ``stream.wait_event(e)`` blocks the CALLING thread until ``e`` completes (a CPU stream waiting is its
  host thread waiting: the ops issued after it, synchronous, cannot run early). So ``StreamExecutor.wait`` blocks
  the training thread until the job's done event completes, and the compute side can never touch the job's
  buffers before it. ``Event.synchronize()`` blocks until complete; ``query()`` (of an event or a stream) does
  not block. An event never recorded is complete, as in CUDA.
- ``device(d)`` is a context that changes nothing (one device).

What it covers: ``StreamExecutor`` itself (``_before_launch``, ``_run``, ``done``, ``wait``), the pipeline's
``sync_in_flight`` (``ticket.cuda_done.synchronize()``), and every caller of ``executor.done`` / ``executor.wait``
(adaptive round ends, the fused round end's residual wait on a job that failed, the accessors, the module
``state_dict`` hook, the committed view) seeing a job finished on the host but not yet on the "device"; and with
the memory state's copies in the inputs form, a commit's captured step inputs (``core.commit_inputs``, pinned
non-blocking copies on CUDA) written into their slot only where the job's host read ends its stream work
(``CommitInputs.synchronized``). The pipeline's ``defer_host_reads`` (the other CUDA default on this path) is a
separate switch (the pipeline's attribute, which the CPU tests set).

What it does not cover: the branches on ``device.type == "cuda"`` inside the job and beside the executor stay on
their CPU forms, because the CPU rank's device is still the CPU: the round job's host summary (CUDA: a pinned
buffer written asynchronously with a ``summary_ready`` event; CPU: a synchronous copy, no event), its pinned AdamW
table, the offloaded step's ``StreamCopies`` (CPU: ``ThreadCopies``), the fused round end's residual release event
and pinned leftover blocks, ``record_stream`` in the compressed exchanges, the phase clock's CUDA timing events
(CPU: the worker thread's clock) and a restored job's done event (``snapshot``: none on CPU). Nor does it delay a
job's DATA: a job's buffers are written when its CPU ops return on the worker thread, only the events that say so
come late; so a compute-side read that skipped its stream wait would still find the job's results here (such a bug
shows on CPU as a wrong ``done``/``wait`` outcome or a crash, not as wrong bits).

Threads: an :class:`EmulatedCuda` and its streams and events may be used from any thread; the current stream is
per thread. ``incomplete_looks`` counts the looks (``query``, ``wait_event``, ``synchronize``) that found their
event not yet complete, so a test can see the asynchrony was exercised.
"""

from __future__ import annotations

import contextlib
import os
import threading
import time
from typing import Iterator

EXECUTOR_ENV = "ACCO_DS_EMULATED_STREAM_EXECUTOR"
"""``1``: CPU ranks run ``StreamExecutor`` on :class:`EmulatedCuda` instead of ``ThreadExecutor`` (a CPU test
mode; ``core.comm.make_executor``)."""

DELAY_ENV = "ACCO_DS_EMULATED_STREAM_DELAY_S"
"""Seconds after which an event recorded on an emulated side stream completes (default :data:`DEFAULT_DELAY_S`)."""

DEFAULT_DELAY_S = 0.005


def enabled() -> bool:
    """Whether ``ACCO_DS_EMULATED_STREAM_EXECUTOR=1`` asks for the emulated stream executor on CPU ranks."""
    return os.environ.get(EXECUTOR_ENV, "0") == "1"


def delay_from_env() -> float:
    """``ACCO_DS_EMULATED_STREAM_DELAY_S`` (>= 0), else :data:`DEFAULT_DELAY_S`."""
    raw = os.environ.get(DELAY_ENV)
    if raw is None or raw == "":
        return DEFAULT_DELAY_S
    delay = float(raw)
    if not delay >= 0.0:
        raise ValueError(f"acco_ds: {DELAY_ENV}={raw!r}: allowed a number of seconds >= 0")
    return delay


class EmulatedStream:
    """A stream whose recorded events complete ``delay_s`` after their record, in record order."""

    def __init__(self, cuda: EmulatedCuda, name: str, delay_s: float):
        self.cuda = cuda
        self.name = name
        self.delay_s = delay_s
        self._lock = threading.Lock()
        self._tail = 0.0  # time.monotonic() at which the last event recorded on this stream completes

    def _record_time(self) -> float:
        """When an event recorded now completes: ``delay_s`` from now, not before the previous one."""
        with self._lock:
            self._tail = max(self._tail, time.monotonic() + self.delay_s)
            return self._tail

    def wait_event(self, event: EmulatedEvent) -> None:
        """The stream waits for ``event``: on CPU, the calling thread blocks until it completes."""
        event.synchronize()

    def query(self) -> bool:
        with self._lock:
            return time.monotonic() >= self._tail

    def __repr__(self) -> str:
        return f"EmulatedStream({self.name!r}, delay_s={self.delay_s:g})"


class EmulatedEvent:
    """``torch.cuda.Event`` on an emulated stream: complete once the time its record set has passed."""

    def __init__(self, cuda: EmulatedCuda):
        self.cuda = cuda
        self.stream: EmulatedStream | None = None
        self._completes_at: float | None = None  # None: never recorded (complete)
        self._looked_at = True  # False from a side-stream record until its first look

    def record(self, stream: EmulatedStream | None = None) -> None:
        stream = self.cuda.current_stream() if stream is None else stream
        self.stream = stream
        with self.cuda._count_lock:
            self._completes_at = stream._record_time()
            self._looked_at = stream.delay_s <= 0.0

    def _complete_at_this_look(self) -> bool:
        """Whether the event is complete now; a look that finds it not yet complete is counted."""
        with self.cuda._count_lock:
            if self._completes_at is None:
                return True
            first, self._looked_at = not self._looked_at, True
            if not first and time.monotonic() >= self._completes_at:
                return True
            self.cuda.incomplete_looks += 1
            return False

    def query(self) -> bool:
        return self._complete_at_this_look()

    def synchronize(self) -> None:
        if not self._complete_at_this_look():
            self.cuda._sleep_until(self._completes_at)


class EmulatedCuda:
    """The part of ``torch.cuda`` ``StreamExecutor`` uses (``Stream``, ``Event``, ``current_stream``, ``stream``,
    ``device``), for CPU ranks. ``delay_s``: how late an event recorded on a side stream completes."""

    def __init__(self, delay_s: float = DEFAULT_DELAY_S):
        if not delay_s >= 0.0:
            raise ValueError(f"EmulatedCuda: delay_s must be >= 0, got {delay_s!r}")
        self.delay_s = float(delay_s)
        self.compute = EmulatedStream(self, "compute", 0.0)
        self._tls = threading.local()
        self._count_lock = threading.Lock()  # guards incomplete_looks and every event's first-look state
        self.incomplete_looks = 0

    @classmethod
    def from_env(cls) -> EmulatedCuda:
        return cls(delay_from_env())

    def current_stream(self, device=None) -> EmulatedStream:
        return getattr(self._tls, "stream", self.compute)

    def Stream(self, device=None, priority: int = 0) -> EmulatedStream:  # noqa: N802 (torch.cuda's name)
        return EmulatedStream(self, "side", self.delay_s)

    def Event(self, enable_timing: bool = False, blocking: bool = False, interprocess: bool = False):  # noqa: N802
        if enable_timing or interprocess:
            raise NotImplementedError("EmulatedCuda: events with timing or across processes are not emulated")
        return EmulatedEvent(self)

    @contextlib.contextmanager
    def stream(self, s: EmulatedStream) -> Iterator[None]:
        """Make ``s`` the calling thread's current stream for the block."""
        prev = getattr(self._tls, "stream", None)
        self._tls.stream = s
        try:
            yield
        finally:
            if prev is None:
                del self._tls.stream
            else:
                self._tls.stream = prev

    @contextlib.contextmanager
    def device(self, d) -> Iterator[None]:
        yield

    @staticmethod
    def _sleep_until(deadline: float) -> None:
        now = time.monotonic()
        while now < deadline:
            time.sleep(deadline - now)
            now = time.monotonic()
