"""Count what a round end costs the training thread, and what the round's job enqueues elsewhere.

:class:`RoundEndProbe` wraps a live ``ACCOPipeline``: every ``end_round`` call runs under a
``TorchDispatchMode`` that counts the ATen operations the calling (training) thread dispatches inside it (a dispatch
mode is thread-local, so the executor's worker thread is not counted there), and every launched job runs under
another mode on the worker thread, counting the operations of the round job itself. The host time is the
pipeline's own ``stats.round_end_host_s`` (the training thread inside ``end_round``, its waits for jobs excluded).

On the CPU a dispatched operation is a kernel run; on CUDA it is (at least) one kernel launch: the training
thread's count is the launches it makes between two of its own kernels at a round end.
"""

from __future__ import annotations

import threading
from collections import Counter
from dataclasses import dataclass, field
from typing import Callable, List

from torch.utils._python_dispatch import TorchDispatchMode


class _OpCount(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.ops: Counter = Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops[str(func.overloadpacket)] += 1
        return func(*args, **(kwargs or {}))


@dataclass
class RoundEndCounts:
    """Per round end: the operations the training thread dispatched inside ``end_round`` and the operations of the
    job it launched (counted on the thread that ran it), and that thread's identity."""

    training_ops: List[Counter] = field(default_factory=list)
    job_ops: List[Counter] = field(default_factory=list)
    job_threads: List[int] = field(default_factory=list)

    @property
    def max_training_ops(self) -> int:
        return max((sum(c.values()) for c in self.training_ops), default=0)

    @property
    def min_job_ops(self) -> int:
        return min((sum(c.values()) for c in self.job_ops), default=0)


class RoundEndProbe:
    """Install on ``pipeline`` (its ``end_round`` and its executor's ``launch``); :meth:`remove` restores both."""

    def __init__(self, pipeline) -> None:
        self.pipeline = pipeline
        self.counts = RoundEndCounts()
        self.training_thread = threading.get_ident()
        self._end_round = pipeline.end_round
        self._launch = pipeline.executor.launch
        pipeline.end_round = self._counted_end_round
        pipeline.executor.launch = self._counted_launch

    def _counted_end_round(self, plan=None) -> None:
        with _OpCount() as mode:
            self._end_round(plan)
        self.counts.training_ops.append(mode.ops)

    def _counted_launch(self, name: str, job: Callable):
        def counted_job():
            with _OpCount() as mode:
                try:
                    return job()
                finally:
                    self.counts.job_ops.append(mode.ops)
                    self.counts.job_threads.append(threading.get_ident())

        return self._launch(name, counted_job)

    def remove(self) -> None:
        del self.pipeline.end_round
        del self.pipeline.executor.launch
