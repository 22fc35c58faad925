"""The communication executor: runs one round's communication job beside the compute.

One interface, two implementations:

- ``ThreadExecutor`` (CPU, gloo): the job runs on a daemon worker thread and issues its
  collectives on a dedicated process group, so they never interleave with DeepSpeed's own
  collectives on the default group (gloo's reduce-scatter blocks its caller for tens of ms).
  ``done`` polls the future; ``wait`` blocks the compute thread until the job has finished
  (or raises after ``timeout_s`` naming the job).
- ``StreamExecutor`` (CUDA, NCCL): the job is *enqueued* from the host on a side CUDA stream,
  after the side stream waited on an event recorded on the compute stream at launch (the job
  reads the gradient buffer the compute stream wrote and overwrites the parameter buffer the
  compute stream read). A ``done`` event is recorded on the side stream after the job.
  ``wait`` makes the compute stream wait on that event: the host never blocks. ``done`` queries
  the event. Jobs must not read device values on the host (no ``.item()``): scales and skip
  flags stay on the device.

Jobs are plain callables; their return value is handed back by ``wait``.
"""

from __future__ import annotations

import queue
import threading
import time
from typing import Any, Callable

import torch
import torch.distributed as dist


class CommTimeoutError(RuntimeError):
    """The communication of a round did not finish within comm_timeout_s (a peer is lost or stalled)."""


class Ticket:
    """A launched job. ``name`` says which round/job it is, for error messages."""

    def __init__(self, name: str):
        self.name = name
        self.launched_at = time.monotonic()
        self.result: Any = None
        self.error: BaseException | None = None
        self.finished = threading.Event()
        self.cuda_done = None  # torch.cuda.Event on the StreamExecutor


class ThreadExecutor:
    """Runs jobs in order on one daemon thread (CPU tensors, gloo)."""

    def __init__(self, group, timeout_s: float):
        self.group = group
        self.timeout_s = timeout_s
        self._queue: queue.Queue = queue.Queue()
        self._thread = threading.Thread(target=self._loop, name="acco-comm", daemon=True)
        self._thread.start()

    def _loop(self) -> None:
        while True:
            item = self._queue.get()
            if item is None:
                return
            ticket, job = item
            try:
                ticket.result = job()
            except BaseException as err:  # handed to the compute thread by wait()
                ticket.error = err
            finally:
                ticket.finished.set()

    def launch(self, name: str, job: Callable[[], Any]) -> Ticket:
        ticket = Ticket(name)
        self._queue.put((ticket, job))
        return ticket

    def done(self, ticket: Ticket) -> bool:
        return ticket.finished.is_set()

    def wait(self, ticket: Ticket) -> Any:
        if not ticket.finished.wait(self.timeout_s):
            raise CommTimeoutError(
                f"acco_ds: the communication job '{ticket.name}' did not finish within comm_timeout_s="
                f"{self.timeout_s:g} s: a peer rank is lost or stalled in the collective. "
                "Raise optimizer.params.comm_timeout_s if your link is that slow."
            )
        if ticket.error is not None:
            raise RuntimeError(
                f"acco_ds: the communication job '{ticket.name}' failed: {ticket.error}"
            ) from (ticket.error)
        return ticket.result

    def close(self) -> None:
        self._queue.put(None)


class StreamExecutor:
    """Enqueues jobs on a side CUDA stream, ordered against the compute stream by events."""

    def __init__(self, group, timeout_s: float, device: torch.device):
        self.group = group
        self.timeout_s = timeout_s
        self.device = device
        self.stream = torch.cuda.Stream(device=device)

    def launch(self, name: str, job: Callable[[], Any]) -> Ticket:
        ticket = Ticket(name)
        ready = torch.cuda.Event()
        ready.record(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(self.stream):
            self.stream.wait_event(ready)
            ticket.result = job()
            ticket.cuda_done = torch.cuda.Event()
            ticket.cuda_done.record(self.stream)
        ticket.finished.set()
        return ticket

    def done(self, ticket: Ticket) -> bool:
        return ticket.cuda_done.query()

    def wait(self, ticket: Ticket) -> Any:
        torch.cuda.current_stream(self.device).wait_event(ticket.cuda_done)
        return ticket.result

    def close(self) -> None:
        pass


def make_executor(device: torch.device, timeout_s: float, group=None):
    """A dedicated process group over all ranks of ``group`` (default: WORLD) and the executor for
    ``device``. Collective: every rank calls it at the same point."""
    import datetime

    ranks = None if group is None else dist.get_process_group_ranks(group)
    backend = "nccl" if device.type == "cuda" else "gloo"
    comm_group = dist.new_group(ranks=ranks, backend=backend, timeout=datetime.timedelta(seconds=timeout_s))
    if device.type == "cuda":
        return StreamExecutor(comm_group, timeout_s, device)
    return ThreadExecutor(comm_group, timeout_s)
