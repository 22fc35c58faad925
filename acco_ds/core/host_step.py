"""The optimizer step in host memory (``zero_optimization.offload_optimizer``, docs/OFFLOAD.md).

With offload, this rank's fp32 master shard and both moments live in host memory (``GroupBuffers(state_device=
"cpu")``) and never on the GPU. A round's job (``round_job.run_round_job``) reduces the gradients on the device as
without offload (reduce-scatter, g~, norm, clipping coefficient), then, per group, :meth:`HostStep.run`:

1. copies the step's device inputs into host staging buffers: the reduced gradient shard (or the quantized chunks
   and the kept g~ of a compressed round), the AdamW scalars' row, the scale and the skip flag (``to_host``);
2. waits on the HOST for those copies alone (the executor's worker thread waits; the compute stream never does);
3. runs the same step function the device would have run (``ops.adamw``, ``ops.adamw_difference``,
   ``ops.quantized_sum_step``) on host tensors: the project's C++ kernels, OpenMP over ``torch.get_num_threads()``
   threads (``step``). The CPU and CUDA kernels share one math, so the bits are those of the step on the device;
4. copies the new parameter shard (and a compressed all-gather's quantized difference) back into the job's device
   buffers (``to_device``), before the caller's all-gather.

Copies and their order:

- CUDA (:class:`StreamCopies`): every copy is enqueued on the current stream, the job's side stream, with
  ``non_blocking``; the host waits on an event recorded after the copies to the host. The copies back need no host
  wait: the all-gather the caller enqueues next on the same stream runs after them. Staging buffers are pinned with
  ``pin_memory`` (else the copies are synchronous on the worker thread, still off the compute stream).
- CPU ranks (:class:`ThreadCopies`, only with ``OffloadSpec.staged``: the state is host memory already, so a CPU
  rank normally steps in place): a copy thread stands in for the copy engine and runs the copies in order; the host
  waits on the last one before a step reads the staging buffers and before an all-gather reads the copy back.
  ``ACCO_DS_HOST_COPY_DELAY_S`` delays each copy (tests: a step that does not wait reads stale staging buffers).

Buffer ownership: the staging buffers belong to this object, one set per group, reused every round. Reuse is safe
without more waits: the jobs run one after another on one worker thread and one stream, so a round's copies to the
host are enqueued after the previous round's copies back, and its host wait covers them.
"""

from __future__ import annotations

import os
import queue
import threading
import time
from dataclasses import dataclass
from typing import Any, Callable, Dict, Sequence

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


class StreamCopies:
    """CUDA copies on the current stream (module docstring)."""

    def __init__(self, device: torch.device):
        self.device = device

    def copy(self, dst: torch.Tensor, src: torch.Tensor) -> None:
        dst.copy_(src, non_blocking=True)

    def wait_host(self) -> None:
        event = torch.cuda.Event()
        event.record(torch.cuda.current_stream(self.device))
        event.synchronize()

    def wait_device(self) -> None:
        """Nothing: the device work enqueued next on the stream runs after the copies."""

    def close(self) -> None:
        pass


class ThreadCopies:
    """CPU ranks' stand-in for the copy engine: one daemon thread runs the copies in order (module docstring)."""

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

    def wait_host(self) -> None:
        if self._last is not None:
            self._last.wait()
        if self._error is not None:
            err, self._error = self._error, None
            raise RuntimeError("acco_ds: a host-step staging copy failed") from err

    def wait_device(self) -> None:
        self.wait_host()

    def close(self) -> None:
        self._queue.put(None)


StepFunction = Callable[..., Any]


class HostStep:
    """Runs a group's AdamW step on its host-resident state with staged copies (module docstring).

    ``device``: the device of the job's buffers. One instance per pipeline; :meth:`run` is called on the
    communication side only (the executor's worker thread)."""

    def __init__(self, group_count: int, device: torch.device, spec: OffloadSpec, copies=None):
        self.device = device
        self.spec = spec
        self.pin = bool(spec.pin_memory and device.type == "cuda")
        if copies is None:
            copies = StreamCopies(device) if device.type == "cuda" else ThreadCopies()
        self.copies = copies
        self._staging: list[Dict[tuple, torch.Tensor]] = [{} for _ in range(group_count)]

    def _buffer(self, group: int, name: str, like: torch.Tensor) -> torch.Tensor:
        key = (name, tuple(like.shape), like.dtype)
        buf = self._staging[group].get(key)
        if buf is None:
            buf = torch.empty(like.shape, dtype=like.dtype, pin_memory=self.pin)
            self._staging[group][key] = buf
        return buf

    def staging_bytes(self) -> int:
        """Bytes of host staging buffers held now (all groups)."""
        return sum(t.numel() * t.element_size() for s in self._staging for t in s.values())

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
        """``fn(*state, out=..., **tensors, **keywords)`` on the host: ``state`` (master, exp_avg, exp_avg_sq) is in
        host memory; every tensor of ``tensors`` (device tensors of the job, or None) is copied to a staging buffer
        first, ``out`` (this rank's shard of the parameter target, on the device) is written from the host's.
        ``out``'s old values are copied over only where ``tensors`` holds the same memory (``base`` may be the
        target itself). Returned tensors (a compressed all-gather's ``(q, scales)``) come back as new device
        tensors. Returns when the copies back are enqueued (CUDA) or done (CPU)."""
        copies = self.copies
        staged: Dict[str, Any] = {}
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
        copies.wait_host()
        if clock is not None:
            clock.mark("to_host")
        result = fn(*state, out=out_host, **staged, **keywords)
        if clock is not None:
            clock.mark("step")
        copies.copy(out, out_host)
        if result is not None:
            result = tuple(self._back(r) for r in result)
        copies.wait_device()
        return result

    def _back(self, host: torch.Tensor) -> torch.Tensor:
        dev = torch.empty(host.shape, dtype=host.dtype, device=self.device)
        self.copies.copy(dev, host)
        return dev

    def close(self) -> None:
        self.copies.close()


def _same_memory(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.device == b.device and a.data_ptr() == b.data_ptr() and a.numel() == b.numel()
