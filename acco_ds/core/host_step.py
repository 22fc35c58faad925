"""The optimizer step in host memory (``zero_optimization.offload_optimizer``, docs/OFFLOAD.md).

With offload, this rank's fp32 master shard and both moments live in host memory (``GroupBuffers(state_device=
"cpu")``) and never on the GPU. A round's job (``round_job.run_round_job``) reduces the gradients on the device as
without offload (reduce-scatter, g~, norm, clipping coefficient), then:

1. for every group, right after the norm, :meth:`HostStep.stage` enqueues the copies of the step's device inputs
   into that group's host staging buffers: the reduced gradient shard (or the quantized chunks and the kept g~ of a
   compressed round), the AdamW scalars' row, the scale and the skip flag (``to_host``), and marks them;
2. then per group, in order, :meth:`HostStep.step` waits on the HOST for that group's copies alone (the executor's
   worker thread waits, at most ``timeout_s``; the compute stream never does), runs the same step function the
   device would have run (``ops.adamw``, ``ops.adamw_difference``, ``ops.quantized_sum_step``) on host tensors: the
   project's C++ kernels, OpenMP over ``ops.adamw.host_threads()`` threads (the ``host_threads`` option; ``step``;
   the CPU and CUDA kernels share one math, so the bits are those of the step on the device), and copies the new parameter shard (and a
   compressed all-gather's quantized difference) back into the job's device buffers (``to_device``); the caller
   then issues that group's all-gather. Group i+1's inputs are on the host before group i's all-gather is issued,
   so its step runs on the worker thread while group i's all-gather runs (on CUDA on the side stream; on gloo ranks
   the job leaves the uncompressed all-gather's point-to-point transfers in flight, ``round_job``).

Copies and their order:

- CUDA (:class:`StreamCopies`): every copy is enqueued on the current stream, the job's side stream, with
  ``non_blocking``; the host polls an event recorded after a group's copies to the host. The copies back need no
  host wait: the all-gather the caller enqueues next on the same stream runs after them. With ``pin_memory`` the
  staging buffers are page-locked (:class:`HostMemory`), so the copies are asynchronous; without it they are
  synchronous on the worker thread, still off the compute stream.
- CPU ranks (:class:`ThreadCopies`, only with ``OffloadSpec.staged``: the state is host memory already, so a CPU
  rank normally steps in place): a copy thread stands in for the copy engine and runs the copies in order; the host
  waits on a group's last copy before its step reads the staging buffers, and on the copy back before an
  all-gather reads it. ``ACCO_DS_HOST_COPY_DELAY_S`` delays each copy (tests: a step that does not wait reads stale
  staging buffers; a delay past ``timeout_s`` makes the wait raise).

Buffer ownership: the staging buffers belong to this object, one set per group, allocated when the pipeline builds
it (``round_job.host_staging`` lists what its jobs use, with exact sizes), reused every round; a job allocates no
host memory. Reuse is safe without more waits: the jobs run one after another on one worker thread and one stream,
so a round's copies to the host are enqueued after the previous round's copies back, and the host writes a group's
buffers (its step) only after waiting for that group's copies of this round; the groups' buffers are disjoint, so
staging group i+1 while group i steps is safe too.
"""

from __future__ import annotations

import contextlib
import os
import queue
import threading
import time
from dataclasses import dataclass
from functools import partial
from typing import Any, Callable, Dict, Iterable, List, Sequence, Tuple

import torch

STAGING_ENV = "ACCO_DS_HOST_STEP_STAGING"
"""``1``: CPU ranks with offload run the staged path (copies to and from host staging buffers, a copy thread) instead
of stepping their state in place; the tests use it to run on CPU the path a GPU rank runs."""

COPY_DELAY_ENV = "ACCO_DS_HOST_COPY_DELAY_S"
"""Seconds the CPU copy thread sleeps before each copy (tests); 0 by default."""


@dataclass(frozen=True)
class OffloadSpec:
    """``zero_optimization.offload_optimizer`` as ACCO runs it: ``pin_memory`` pins the staging buffers (the only
    host memory a round copies to or from); ``staged`` runs :class:`HostStep` (always on GPU ranks; on CPU ranks with
    ``ACCO_DS_HOST_STEP_STAGING=1``), else the state, in host memory already, is stepped in place."""

    pin_memory: bool = False
    staged: bool = True

    @classmethod
    def for_device(cls, device: torch.device, pin_memory: bool) -> OffloadSpec:
        staged = device.type != "cpu" or os.environ.get(STAGING_ENV, "0") == "1"
        return cls(pin_memory=bool(pin_memory), staged=staged)


INPUTS_PHASE = "waiting for the step's inputs to reach the host"
BACK_PHASE = "waiting for the new parameters to be copied back to the device"
"""The two waits of a host step, as its timeout's message names them (:meth:`HostStep.step`)."""

STAGING_ALIGN = 64
"""Bytes each staging buffer's start is aligned to inside its block of host memory (the kernels' vector loads)."""

PAGE = 4096
"""The unit ``cudaHostRegister`` page-locks: a pinned block registers whole pages of its own allocation only."""


class StreamCopies:
    """CUDA copies on the current stream (module docstring). Called on the executor's worker thread, with the job's
    side stream current."""

    def __init__(self, device: torch.device):
        self.device = device

    def copy(self, dst: torch.Tensor, src: torch.Tensor) -> None:
        dst.copy_(src, non_blocking=True)

    def mark(self):
        """An event recorded on the current stream after the copies enqueued so far."""
        event = torch.cuda.Event()
        event.record(torch.cuda.current_stream(self.device))
        return event

    def wait_host(self, marker, timeout_s: float | None) -> bool:
        """Block this thread until ``marker``'s copies completed: True, or False once ``timeout_s`` passed first
        (None: no deadline, the event is synchronized). Polls the event, sleeping up to 0.5 ms between queries."""
        if timeout_s is None:
            marker.synchronize()
            return True
        deadline = time.monotonic() + timeout_s
        pause = 1e-5
        while not marker.query():
            left = deadline - time.monotonic()
            if left <= 0:
                return False
            time.sleep(min(pause, left))
            pause = min(2 * pause, 5e-4)
        return True

    def wait_device(self, timeout_s: float | None) -> bool:
        """Nothing to wait for: the device work enqueued next on the stream runs after the copies."""
        return True

    def close(self) -> None:
        pass


class ThreadCopies:
    """CPU ranks' stand-in for the copy engine: one daemon thread runs the copies in order (module docstring).
    ``copy`` and the waits are called by one thread (the executor's worker thread)."""

    def __init__(self, delay_s: float | None = None):
        self.delay_s = float(os.environ.get(COPY_DELAY_ENV, "0") or 0) if delay_s is None else float(delay_s)
        self._queue: queue.Queue = queue.Queue()
        self._last: threading.Event | None = None
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._loop, name="acco_ds host copies", daemon=True)
        self._thread.start()

    def _loop(self) -> None:
        while True:
            item = self._queue.get()
            if item is None:
                return
            dst, src, done = item
            try:
                if self.delay_s:
                    time.sleep(self.delay_s)
                dst.copy_(src)
            except BaseException as err:  # surfaced by the next wait
                self._error = err
            finally:
                done.set()

    def copy(self, dst: torch.Tensor, src: torch.Tensor) -> None:
        self._last = threading.Event()
        self._queue.put((dst, src, self._last))

    def mark(self) -> threading.Event | None:
        """The event the copy thread sets after the last copy queued so far (None: none was)."""
        return self._last

    def wait_host(self, marker, timeout_s: float | None) -> bool:
        """Until the copy thread ran ``marker``'s copies (and every one before): True, or False once ``timeout_s``
        passed first (None: no deadline). Raises RuntimeError when one of those copies failed."""
        if marker is not None and not marker.wait(timeout_s):
            return False
        if self._error is not None:
            err, self._error = self._error, None
            raise RuntimeError("acco_ds: a host-step staging copy failed") from err
        return True

    def wait_device(self, timeout_s: float | None) -> bool:
        """Until the copy thread ran every copy queued so far (the copies to the device among them), as
        :meth:`wait_host`."""
        return self.wait_host(self._last, timeout_s)

    def close(self) -> None:
        self._queue.put(None)


class HostMemory:
    """``nbytes`` of host memory, exactly (``data``: uint8), for staging buffers. ``pin`` (CUDA): page-locked by
    registering it with the CUDA driver (``cudaHostRegister``, through ``torch.cuda.cudart()``), not allocated by the
    caching host allocator (``pin_memory=True``), which rounds every request up to a power of two (up to twice the
    bytes) and keeps it cached. The registered span is the whole pages inside an allocation two pages longer than
    ``nbytes``, so it shares no page with other memory (a page registered twice is an error); ``allocated`` counts
    those two pages. :meth:`release` unregisters it; the owner calls it once no copy reads or writes it."""

    def __init__(self, nbytes: int, pin: bool):
        self.registered: int | None = None
        if not pin:
            self._raw = self.data = torch.empty(nbytes, dtype=torch.uint8)
            self.allocated = nbytes
            return
        raw = torch.empty(nbytes + 2 * PAGE, dtype=torch.uint8)
        start = -raw.data_ptr() % PAGE
        span = max(1, -(-nbytes // PAGE)) * PAGE
        err = int(torch.cuda.cudart().cudaHostRegister(raw.data_ptr() + start, span, 0))
        if err != 0:
            raise RuntimeError(
                f"acco_ds: page-locking {nbytes} bytes of host staging buffers (cudaHostRegister) failed with CUDA "
                f"error {err}; set zero_optimization.offload_optimizer.pin_memory=false to stage in pageable memory"
            )
        self.registered = raw.data_ptr() + start
        self._raw, self.data = raw, raw[start : start + nbytes]
        self.allocated = raw.numel()

    def release(self) -> None:
        if self.registered is not None:
            torch.cuda.cudart().cudaHostUnregister(self.registered)
            self.registered = None

    def __del__(self):
        with contextlib.suppress(Exception):
            self.release()


def allocate_staging(nbytes: int, pin: bool) -> HostMemory:
    """The one place host staging memory is allocated (tests spy on it: a job allocates none)."""
    return HostMemory(nbytes, pin)


StagingKey = Tuple[str, tuple, torch.dtype]
"""A staging buffer: the step's keyword it stands in for (or ``"out"``), its shape and dtype."""


@dataclass
class Staged:
    """One group's inputs on their way to the host (:meth:`HostStep.stage`): ``tensors`` the staging buffers under
    the step's keyword names (None where the job passed None), ``out_host`` the buffer the step writes, ``out`` the
    job's device shard it is copied back to, ``ready`` the copies' marker."""

    group: int
    tensors: Dict[str, torch.Tensor | None]
    out_host: torch.Tensor
    out: torch.Tensor
    ready: Any


StepFunction = Callable[..., Any]


class HostStep:
    """Runs each group's AdamW step on its host-resident state with staged copies (module docstring).

    ``device``: the device of the job's buffers. One instance per pipeline; :meth:`stage`, :meth:`step` and
    :meth:`run` are called on the communication side only (the executor's worker thread, with the job's stream
    current on CUDA). ``staging``: per group, the buffers to allocate now (:data:`StagingKey`; the pipeline passes
    ``round_job.host_staging``, every buffer its jobs use), in one block of host memory (:class:`HostMemory`: exact
    sizes, pinned where ``spec.pin_memory`` on CUDA); a tensor a job hands over without one gets its own block at
    that point. ``accounts``: per group, an object whose ``host_staging_bytes`` is kept at that group's staging
    bytes (the pipeline's ``GroupBuffers``: ``held_bytes()`` counts them). ``timeout_s`` (the pipeline's
    comm_timeout_s) bounds each wait for copies: past it the step raises a RuntimeError naming ``rank``, the group
    and the wait; None waits without a deadline."""

    def __init__(
        self,
        group_count: int,
        device: torch.device,
        spec: OffloadSpec,
        copies=None,
        *,
        staging: Sequence[Iterable[StagingKey]] | None = None,
        accounts: Sequence[Any] | None = None,
        timeout_s: float | None = None,
        rank: int = 0,
    ):
        self.device = device
        self.spec = spec
        self.pin = bool(spec.pin_memory and device.type == "cuda")
        self.timeout_s = timeout_s
        self.rank = rank
        self.accounts = accounts
        if copies is None:
            copies = StreamCopies(device) if device.type == "cuda" else ThreadCopies()
        self.copies = copies
        self._staging: List[Dict[StagingKey, torch.Tensor]] = [{} for _ in range(group_count)]
        self._memory: List[HostMemory] = []
        wanted = [(g, key) for g, keys in enumerate(staging or ()) for key in sorted(set(keys), key=_order)]
        if wanted:
            self._carve(wanted)
        for g in range(group_count):
            self._account(g)

    def _carve(self, wanted: Sequence[Tuple[int, StagingKey]]) -> None:
        """One block of host memory for ``wanted`` (group, key) buffers, each start aligned to STAGING_ALIGN."""
        offsets, end = [], 0
        for _, (_, shape, dtype) in wanted:
            offsets.append(end)
            end += -(-_nbytes(shape, dtype) // STAGING_ALIGN) * STAGING_ALIGN
        memory = allocate_staging(end, self.pin)
        self._memory.append(memory)
        for (g, key), off in zip(wanted, offsets):
            _, shape, dtype = key
            n = _nbytes(shape, dtype)
            self._staging[g][key] = memory.data[off : off + n].view(dtype).view(shape)

    def _account(self, group: int) -> None:
        if self.accounts is not None:
            self.accounts[group].host_staging_bytes = self.staging_bytes(group)

    def _buffer(self, group: int, name: str, like: torch.Tensor) -> torch.Tensor:
        key = (name, tuple(like.shape), like.dtype)
        buf = self._staging[group].get(key)
        if buf is None:  # not reserved at set-up: a block of its own
            self._carve([(group, key)])
            self._account(group)
            buf = self._staging[group][key]
        return buf

    def staging_bytes(self, group: int | None = None) -> int:
        """Bytes of the host staging buffers held now: of ``group``, or of all groups (exact sizes; the blocks
        add their alignment, and on CUDA two pages each: ``allocated_bytes``)."""
        sets = self._staging if group is None else [self._staging[group]]
        return sum(t.numel() * t.element_size() for s in sets for t in s.values())

    def allocated_bytes(self) -> int:
        """Bytes of host memory the staging blocks took (the buffers, their alignment, the pinned blocks' pages)."""
        return sum(m.allocated for m in self._memory)

    def staging_keys(self, group: int) -> List[StagingKey]:
        """The staging buffers of ``group``, in the order they were allocated."""
        return list(self._staging[group])

    def stage(self, group: int, tensors: Dict[str, torch.Tensor | None], out: torch.Tensor) -> Staged:
        """Enqueue the copies of ``tensors`` (device tensors of the job, or None) into ``group``'s staging buffers
        and mark them; returns without waiting. ``out`` (this rank's shard of the parameter target, on the device):
        the step writes a staging buffer copied back into it by :meth:`step`; where a tensor of ``tensors`` holds
        the same memory (``base`` may be the target itself), that tensor's buffer, with ``out``'s old values."""
        copies = self.copies
        staged: Dict[str, torch.Tensor | None] = {}
        out_host = None
        for name, t in tensors.items():
            if t is None:
                staged[name] = None
                continue
            host = self._buffer(group, name, t)
            copies.copy(host, t)
            staged[name] = host
            if _same_memory(t, out):
                out_host = host
        if out_host is None:
            out_host = self._buffer(group, "out", out)
        return Staged(group, staged, out_host, out, copies.mark())

    def step(self, staged: Staged, fn: StepFunction, state: Sequence[torch.Tensor], clock=None, **keywords):
        """Wait for ``staged``'s copies to the host (this thread only; bounded by ``timeout_s``), run ``fn(*state,
        out=..., **staged tensors, **keywords)`` on the host (``state``: master, exp_avg, exp_avg_sq, in host
        memory), enqueue the copy of the new parameters back into ``staged.out``. Returned tensors (a compressed
        all-gather's ``(q, scales)``) come back as new device tensors. Returns when the copies back are enqueued
        (CUDA: the work enqueued next on the stream runs after them) or done (CPU)."""
        copies, group = self.copies, staged.group
        self._wait(partial(copies.wait_host, staged.ready), group, INPUTS_PHASE)
        if clock is not None:
            clock.mark("to_host")
        result = fn(*state, out=staged.out_host, **staged.tensors, **keywords)
        if clock is not None:
            clock.mark("step")
        copies.copy(staged.out, staged.out_host)
        if result is not None:
            result = tuple(self._back(r) for r in result)
        self._wait(copies.wait_device, group, BACK_PHASE)
        return result

    def run(
        self,
        group: int,
        fn: StepFunction,
        state: Sequence[torch.Tensor],
        tensors: Dict[str, torch.Tensor | None],
        out: torch.Tensor,
        clock=None,
        **keywords,
    ):
        """:meth:`stage` then :meth:`step`: one group's step on its own."""
        return self.step(self.stage(group, tensors, out), fn, state, clock, **keywords)

    def _wait(self, wait: Callable[[float | None], bool], group: int, phase: str) -> None:
        """``wait(timeout_s)``; raise naming this rank, ``group`` and ``phase`` where it timed out."""
        if not wait(self.timeout_s):
            raise RuntimeError(
                f"acco_ds: rank {self.rank}, parameter group {group}: the offloaded optimizer step timed out "
                f"{phase}: the copies did not finish within comm_timeout_s={self.timeout_s:g} s (a stalled copy "
                "engine or host; raise optimizer.params.comm_timeout_s if the host is that slow)"
            )

    def _back(self, host: torch.Tensor) -> torch.Tensor:
        dev = torch.empty(host.shape, dtype=host.dtype, device=self.device)
        self.copies.copy(dev, host)
        return dev

    def close(self) -> None:
        """End the copy thread (CPU) and unpin the staging blocks; call it once no job runs."""
        self.copies.close()
        if any(m.registered is not None for m in self._memory):
            torch.cuda.synchronize(self.device)  # the last job's copies back may still read the blocks
        for memory in self._memory:
            memory.release()


def _nbytes(shape: tuple, dtype: torch.dtype) -> int:
    n = 1
    for d in shape:
        n *= int(d)
    return n * dtype.itemsize


def _order(key: StagingKey):
    """Staging keys by name (a stable layout across runs)."""
    return (key[0], key[1], str(key[2]))


def _same_memory(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.device == b.device and a.data_ptr() == b.data_ptr() and a.numel() == b.numel()
