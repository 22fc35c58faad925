"""The communication executor: runs one round's communication job beside the compute.

One interface, two implementations, one thread each:

- ``ThreadExecutor`` (CPU, gloo): the job runs on a daemon worker thread and issues its
  collectives on a dedicated process group, so they never interleave with DeepSpeed's own
  collectives on the default group (gloo's reduce-scatter blocks its caller for tens of ms).
  ``done`` polls the future; ``wait`` blocks the compute thread until the job has finished
  (or raises after ``timeout_s`` naming the job).
- ``StreamExecutor`` (CUDA, NCCL): the same worker thread ENQUEUES the job's kernels on a side CUDA
  stream of the highest priority, after the side stream waited on an event the training thread
  recorded on the compute stream at launch (the job reads the gradient buffer the compute stream
  wrote and overwrites the parameter buffer the compute stream read). A ``done`` event is recorded
  on the side stream after the job. The training thread's share of a launch is that one event and a
  queue put, so it goes back to enqueueing the next micro-batch at once instead of spending the
  round job's launches (reduce-scatter, norm, AdamW, all-gather per group) between two of its
  kernels. ``wait`` makes the compute stream wait on the ``done`` event; the host waits only while
  the worker thread has not finished enqueueing the job (it had a round of compute for it).
  ``done`` queries the event. Jobs must not read device values on the host (no ``.item()``):
  scales and skip flags stay on the device. The class takes the ``torch.cuda``-like module it runs on:
  with ``ACCO_DS_EMULATED_STREAM_EXECUTOR=1`` CPU ranks run it on ``core.emulated_stream.EmulatedCuda``
  (a CPU test mode: events on the side stream complete late, stream waits block the calling thread;
  that module's docstring says which CUDA-only parts it covers and which it does not).

Jobs are plain callables; their return value is handed back by ``wait``.

Failures: the communication group is created with ``timeout=comm_timeout_s``; a job that raised
or did not finish in time surfaces in ``wait`` as PeerLostError (the heartbeats of
``core.liveness`` name the lost rank) or CommTimeoutError, never as a hang. ``check_reducible``
probes at set-up that the backend reduces the communication dtype.
"""

from __future__ import annotations

import atexit
import contextlib
import queue
import sys
import threading
import time
import weakref
from typing import Any, Callable

import torch
import torch.distributed as dist

from acco_ds.core import emulated_stream


def reduce_scatter_single(
    output: torch.Tensor, input: torch.Tensor, op=dist.ReduceOp.SUM, group=None
) -> None:
    """``torch.distributed.reduce_scatter_single`` (torch >= 2.10; before, ``reduce_scatter_tensor``, which the newer
    torch still runs with a FutureWarning), looked up at call time, where a byte counter may have wrapped it."""
    fn = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
    fn(output, input, op=op, group=group)


def all_gather_single(output: torch.Tensor, input: torch.Tensor, group=None) -> None:
    """``torch.distributed.all_gather_single`` (torch >= 2.10; before, ``all_gather_into_tensor``), looked up at call
    time."""
    fn = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    fn(output, input, group=group)


SIDE_STREAM_PRIORITY = -100
"""Priority of the CUDA side stream (lower is higher; torch clamps it to the device's highest)."""
WAIT_OVER_POLL_S = 0.001
"""Seconds between ``StreamExecutor.wait_over``'s polls of a job's side-stream event."""


class CommTimeoutError(RuntimeError):
    """The communication of a round did not finish within comm_timeout_s (a peer is lost or stalled).
    The message names the job and, when the heartbeats tell, the lost peer (``core.liveness``)."""


class PeerLostError(RuntimeError):
    """A collective of a round failed and the heartbeats name a lost peer rank (``lost_ranks``)."""

    def __init__(self, message: str, lost_ranks):
        super().__init__(message)
        self.lost_ranks = list(lost_ranks)


class Ticket:
    """A launched job. ``name`` says which round/job it is, for error messages."""

    def __init__(self, name: str):
        self.name = name
        self.launched_at = time.monotonic()
        self.result: Any = None
        self.error: BaseException | None = None
        self.finished = threading.Event()
        self.ready = None  # torch.cuda.Event recorded on the compute stream at launch (StreamExecutor)
        self.cuda_done = None  # torch.cuda.Event recorded on the side stream after the job (StreamExecutor)


_OPEN_EXECUTORS: weakref.WeakSet[ThreadExecutor] = weakref.WeakSet()
WORKER_THREAD = "acco-comm"  # the name of the round jobs' thread (ThreadExecutor)
_SAW_COMM_FAILURE = False  # a round's communication failed or timed out in this process


@atexit.register  # registered before _close_open_executors, so it runs after it (atexit is LIFO)
def _destroy_gloo_groups() -> None:
    """Destroy the process groups at a clean exit of a gloo job, as torch asks jobs to do. A gloo worker
    thread drops its last reference to a finished collective's tensors by itself, and one that does so while
    the interpreter finalises needs the GIL it can no longer get: the process aborts ("terminate called
    without an active exception", SIGABRT) after training fine; measured with torch 2.13 in 6 of 30 two-rank
    runs that exit right after an async all-gather, 0 of 30 with the groups destroyed first, which joins
    those threads. Skipped after a failed round or an uncaught exception (a collective may still be stuck
    on a lost peer: joining it would hold the exit up to the group's timeout) and for other backends."""
    if _SAW_COMM_FAILURE or getattr(sys, "last_value", None) is not None:
        return
    if not (dist.is_available() and dist.is_initialized()):
        return
    with contextlib.suppress(Exception):
        if dist.get_backend() == "gloo":
            dist.destroy_process_group()


def release_groups(groups, busy: bool = False) -> bool:
    """Destroy the gloo groups among ``groups`` (None and non-gloo entries are skipped) that this process created
    with :func:`new_subgroup` and nothing runs on any more: each one's gloo device has an event-loop thread of its
    own that wakes every 10 ms and its sockets, which an engine closed and replaced by another (a process that
    builds several engines) would otherwise keep until the process exits. Local, not collective: a rank's last
    collective on a group is complete once its own thread returned from it, and the bytes it sent stay
    deliverable to a peer still finishing that collective. Skipped when ``busy`` (a thread may still be inside
    a collective on one of them), after a failed round in this process (a collective may be stuck on a lost
    peer) and without an initialized default group. NCCL groups are left to the process's end: their
    communicators may still run a job's kernels on the device. Returns whether it released them; the caller then
    drops its references (a group's gloo device and loop thread live as long as one does)."""
    if busy or _SAW_COMM_FAILURE or not (dist.is_available() and dist.is_initialized()):
        return False
    for group in groups:
        if group is None or group == dist.GroupMember.NON_GROUP_MEMBER:
            continue
        with contextlib.suppress(ValueError, RuntimeError):  # already destroyed (e.g. by the atexit hook)
            if dist.get_backend(group) == "gloo":
                dist.destroy_process_group(group)
    return True


@atexit.register
def _close_open_executors() -> None:
    """Close (drain and join) the worker threads of engines never closed (e.g. under the HF Trainer)
    before the interpreter finalises: a daemon thread still inside a gloo call then would abort the
    process (see ``core.liveness._stop_running_monitors``)."""
    for executor in list(_OPEN_EXECUTORS):
        executor.close()


def _note_comm_failure() -> None:
    global _SAW_COMM_FAILURE
    _SAW_COMM_FAILURE = True


class ThreadExecutor:
    """Runs jobs in order on one daemon thread (CPU tensors, gloo; the base of ``StreamExecutor``).

    Failure contract: ``wait`` returns within ``timeout_s`` (plus the heartbeat read below) or raises.
    A job that raised (gloo reports a dead peer at once: "Connection closed by peer") or did not
    finish in time is turned into PeerLostError / CommTimeoutError naming the job and, from
    ``monitor.report()``, the lost peer rank. The collectives themselves run on ``group``, created
    with ``timeout_s``, so a frozen peer cannot block the worker thread longer than that either."""

    def __init__(self, group, timeout_s: float, monitor=None):
        self.group = group
        self.timeout_s = timeout_s
        self.monitor = monitor
        self._queue: queue.Queue = queue.Queue()
        self._thread = threading.Thread(target=self._loop, name=WORKER_THREAD, daemon=True)
        self._thread.start()
        _OPEN_EXECUTORS.add(self)

    def _loop(self) -> None:
        while True:
            item = self._queue.get()
            if item is None:
                return
            ticket, job = item
            try:
                ticket.result = self._run(ticket, job)
            except BaseException as err:  # handed to the compute thread by wait()
                ticket.error = err
            finally:
                ticket.finished.set()
            # the job's arguments (buffers, a fused round end's rows) must not outlive it until the next job
            item = ticket = job = None

    def _run(self, ticket: Ticket, job: Callable[[], Any]) -> Any:
        """Run ``job`` on the worker thread (the CPU form: its work is done when it returns)."""
        return job()

    def _before_launch(self, ticket: Ticket) -> None:
        """On the launching (training) thread, before the job is queued: nothing on the CPU."""

    def launch(self, name: str, job: Callable[[], Any]) -> Ticket:
        ticket = Ticket(name)
        self._before_launch(ticket)
        self._queue.put((ticket, job))
        return ticket

    def done(self, ticket: Ticket) -> bool:
        return ticket.finished.is_set()

    def wait_over(self, ticket: Ticket, timeout_s: float) -> bool:
        """Block the calling thread (any but the training thread's stream: nothing is ordered on a stream) until
        ``ticket``'s job is over, its error included (CPU: it ran), or ``timeout_s``; whether it is over. For a
        thread that should leave the link to the job (``core.peer_copies``); the job's result stays ``wait``'s."""
        return ticket.finished.wait(timeout_s)

    def _wait_host(self, ticket: Ticket) -> None:
        """Until the worker thread is through with ``ticket`` (CPU: the job ran; CUDA: it is enqueued), or raise."""
        if not ticket.finished.wait(self.timeout_s):
            _note_comm_failure()
            report = peer_report(self.monitor)
            raise CommTimeoutError(
                f"acco_ds: the communication job '{ticket.name}' did not finish within comm_timeout_s="
                f"{self.timeout_s:g} s; {report.describe()}. If no peer is lost and your link is that slow, "
                "raise optimizer.params.comm_timeout_s."
            )
        if ticket.error is not None:
            _note_comm_failure()
            raise self.failure(f"the communication job '{ticket.name}'", ticket.error) from ticket.error

    def wait(self, ticket: Ticket) -> Any:
        self._wait_host(ticket)
        return ticket.result

    def failure(self, what: str, err: BaseException) -> BaseException:
        """The exception to raise for ``err`` from a collective of ``what``: PeerLostError naming the
        lost rank when the heartbeats find one, else a RuntimeError naming ``what``."""
        return collective_failure(self.monitor, what, err)

    def close(self) -> None:
        """Let the jobs already launched finish, end the worker thread and join it (at most
        ``timeout_s``: the group's timeout bounds a collective), then stop the heartbeats. Idempotent."""
        if self._thread.is_alive():
            self._queue.put(None)
            if self._thread is not threading.current_thread():
                self._thread.join(timeout=self.timeout_s)
        _OPEN_EXECUTORS.discard(self)
        if self.monitor is not None:
            self.monitor.stop()

    def running(self) -> bool:
        """Whether the worker thread is still alive (after ``close``: a job outlived the join's timeout)."""
        return self._thread.is_alive()


class StreamExecutor(ThreadExecutor):
    """The worker thread enqueues each job on a side CUDA stream, ordered against the compute stream by events
    (module docstring). NCCL collectives do not fail on the host: a lost peer ends in NCCL's watchdog after the
    group's timeout, comm_timeout_s; a job that raised while being enqueued surfaces in ``wait``.

    ``cuda``: the ``torch.cuda``-like module the streams and events come from (default ``torch.cuda``; CPU ranks in
    the emulated test mode: ``core.emulated_stream.EmulatedCuda``). Threads and streams: ``launch`` runs on the
    training thread and records ``ticket.ready`` on its current stream (the compute stream); ``_run`` runs on the
    worker thread with the side stream current there, which waits on ``ready`` before the job and records
    ``ticket.cuda_done`` after it; ``wait`` (training thread) makes the compute stream wait on ``cuda_done``, so the
    compute side touches the job's buffers only after it; ``done`` never blocks. A ticket without ``cuda_done``
    (a job restored as finished, on a CPU rank) needs no stream wait."""

    def __init__(self, group, timeout_s: float, device: torch.device, monitor=None, cuda=None):
        self.device = device
        self.cuda = torch.cuda if cuda is None else cuda
        # torch maps a priority beyond the device's range to its highest: the round's NCCL kernels then
        # start as soon as their inputs are ready instead of queueing behind the compute stream's kernels
        self.stream = self.cuda.Stream(device=device, priority=SIDE_STREAM_PRIORITY)
        super().__init__(group, timeout_s, monitor)

    def _before_launch(self, ticket: Ticket) -> None:
        ticket.ready = self.cuda.Event()
        ticket.ready.record(self.cuda.current_stream(self.device))

    def _run(self, ticket: Ticket, job: Callable[[], Any]) -> Any:
        # the current device and stream are the thread's own: set both here, for every job
        with self.cuda.device(self.device), self.cuda.stream(self.stream):
            self.stream.wait_event(ticket.ready)
            result = job()
            done = self.cuda.Event()
            done.record(self.stream)
            ticket.cuda_done = done
        return result

    def done(self, ticket: Ticket) -> bool:
        if not ticket.finished.is_set():
            return False
        return ticket.cuda_done is None or ticket.cuda_done.query()

    def wait_over(self, ticket: Ticket, timeout_s: float) -> bool:
        """As ``ThreadExecutor.wait_over``, the job's side-stream work included: the calling thread polls
        ``cuda_done`` (no stream waits on it)."""
        deadline = time.monotonic() + timeout_s
        if not ticket.finished.wait(timeout_s):
            return False
        while not self.done(ticket):
            if time.monotonic() >= deadline:
                return False
            time.sleep(WAIT_OVER_POLL_S)
        return True

    def wait(self, ticket: Ticket) -> Any:
        self._wait_host(ticket)
        if ticket.cuda_done is not None:
            self.cuda.current_stream(self.device).wait_event(ticket.cuda_done)
        return ticket.result


def peer_report(monitor):
    """``monitor.report()``, or a report saying why there is none."""
    from acco_ds.core.liveness import PeerReport

    if monitor is None:
        return PeerReport(unavailable="no heartbeat monitor")
    return monitor.report()


def collective_failure(monitor, what: str, err: BaseException) -> BaseException:
    """Turn the error of a failed collective into PeerLostError naming the lost rank (from the
    heartbeats), or a RuntimeError naming ``what`` when no peer is lost (or it is not a comm error)."""
    _note_comm_failure()
    if isinstance(err, (CommTimeoutError, PeerLostError)):
        return err
    if isinstance(err, (RuntimeError, OSError)):
        report = peer_report(monitor)
        lost = report.lost or ([0] if report.store_lost else [])
        if lost:
            return PeerLostError(
                f"acco_ds: {what} failed: {report.describe()}. The collective reported: {err}", lost
            )
    return RuntimeError(f"acco_ds: {what} failed: {type(err).__name__}: {err}")


def new_subgroup(group, backend: str, timeout_s: float):
    """A new process group over the ranks of ``group`` (default: WORLD) with ``timeout_s``. Collective
    over WORLD: every rank calls it at the same point. When ``group`` is one of several disjoint groups
    (the data-parallel groups under tensor parallelism), every rank must create every one of them, in
    the same order: the ranks learn all the groups' members from each other first."""
    import datetime

    timeout = datetime.timedelta(seconds=timeout_s)
    if group is None or dist.get_world_size(group) == dist.get_world_size():
        ranks = None if group is None else dist.get_process_group_ranks(group)
        return dist.new_group(ranks=ranks, backend=backend, timeout=timeout)
    everyone = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, sorted(dist.get_process_group_ranks(group)))
    lists = sorted({tuple(r) for r in everyone})
    members = [r for lst in lists for r in lst]
    if sorted(members) != list(range(dist.get_world_size())):
        raise ValueError(f"acco_ds: the groups {lists} do not partition the {dist.get_world_size()} ranks")
    mine, _ = dist.new_subgroups_by_enumeration([list(r) for r in lists], timeout=timeout, backend=backend)
    return mine


def make_executor(device: torch.device, timeout_s: float, group=None):
    """A dedicated process group over all ranks of ``group`` (default: WORLD) and the executor for
    ``device``: ``StreamExecutor`` on CUDA; on CPU ``ThreadExecutor``, or with
    ``ACCO_DS_EMULATED_STREAM_EXECUTOR=1`` ``StreamExecutor`` on ``core.emulated_stream.EmulatedCuda`` (its delay
    from ``ACCO_DS_EMULATED_STREAM_DELAY_S``). Collective: every rank calls it at the same point."""
    emulated = None  # read before anything starts: a bad delay raises with no thread running
    if device.type == "cpu" and emulated_stream.enabled():
        emulated = emulated_stream.EmulatedCuda.from_env()
    comm_group = new_subgroup(group, "nccl" if device.type == "cuda" else "gloo", timeout_s)
    from acco_ds.core.liveness import PeerMonitor, heartbeat_interval

    monitor = PeerMonitor(
        dist.get_process_group_ranks(comm_group),
        dist.get_rank(),
        heartbeat_interval(timeout_s),
        prefix=f"acco_ds/liveness/{comm_group.group_name}",
    )
    monitor.start()
    if device.type == "cuda":
        return StreamExecutor(comm_group, timeout_s, device, monitor)
    if emulated is not None:
        return StreamExecutor(comm_group, timeout_s, device, monitor, cuda=emulated)
    return ThreadExecutor(comm_group, timeout_s, monitor)


def make_control_group(group, timeout_s: float):
    """A gloo group over the ranks of ``group`` (default: WORLD) for the pipeline's few collectives
    issued from the compute side (end-of-run agreement on the round count and pending counts): the
    communication group is busy with the job in flight then, and DeepSpeed's default group has its own
    (30 min) timeout. CPU tensors only. Collective."""
    return new_subgroup(group, "gloo", timeout_s)


def check_reducible(group, dtype: torch.dtype, device: torch.device, option: str) -> None:
    """Probe that ``group``'s backend sums ``dtype`` tensors with reduce-scatter and all-gathers them
    (one element per rank); raise ACCOConfigError naming ``option`` (the comm_dtype setting) otherwise.
    Collective: every rank calls it at the same point, before any training."""
    from acco_ds.config import ACCOConfigError

    world = dist.get_world_size(group)
    backend = dist.get_backend(group)
    try:
        # element j is (j + 1) / world on every rank: rank j's reduced element is j + 1
        full = ((torch.arange(world, dtype=torch.float64) + 1) / world).to(device=device, dtype=dtype)
        out = torch.zeros(1, dtype=dtype, device=device)
        reduce_scatter_single(out, full, op=dist.ReduceOp.SUM, group=group)
        gathered = torch.zeros(world, dtype=dtype, device=device)
        all_gather_single(gathered, out, group=group)
        want = torch.arange(world, dtype=torch.float64) + 1
        ok = bool(((gathered.double().cpu() - want).abs() <= 0.02 * want).all())
        why = "" if ok else f"the probe summed to {gathered.tolist()} instead of {want.tolist()}"
    except (RuntimeError, TypeError, ValueError) as err:
        ok, why = False, f"{type(err).__name__}: {err}"
    if not ok:
        raise ACCOConfigError(
            f"optimizer.params.comm_dtype={option!r} resolves to {dtype}, which the {backend} backend cannot "
            f"reduce-scatter/all-gather here ({why}). Allowed: a comm_dtype the backend reduces: 'fp32' works on "
            "every backend; 'bf16' works on NCCL and on gloo with recent torch."
        )
